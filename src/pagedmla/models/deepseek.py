"""The DeepSeek-V2/V3 decoder on top of MLAAttention, loading Hugging Face weight names;
with a lightning indexer per layer, the sparse-attention DeepSeek-V3.2 and GLM-5.

Tokens arrive flat ([T], all requests of a step, decodes first) with their positions
and the step's MLAMetadata; each layer keeps its latents in its own LatentKVCache (and a
sparse model's indexer keys beside them, `LatentKVCache.index_keys`).
Module names mirror the Hugging Face checkpoints without the leading "model.", except
that routed experts are stacked into `mlp.w13` / `mlp.w2`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from pagedmla.attention import MLAAttention
from pagedmla.attention.opaque import ForwardStep, compile_supported
from pagedmla.cache import LatentKVCache
from pagedmla.metadata import MLAMetadata
from pagedmla.models.config import DeepseekConfig
from pagedmla.models.indexer import Indexer
from pagedmla.models.linear import Linear
from pagedmla.models.moe import DenseMLP, MoE
from pagedmla.models.rope import RotaryEmbedding
from pagedmla.models.shards import Alternatives, Piece
from pagedmla.ops.block_fp8 import all_finite
from pagedmla.ops.registry import get_backend

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
# Our stacked expert tensors (and their fp8 scales): not checkpoint names.
_STACKED = (".mlp.w13", ".mlp.w2", ".mlp.w13_scale_inv", ".mlp.w2_scale_inv")
_W13_PARTS = ("gate_proj", "up_proj")  # w13 rows: gate first, then up


class RMSNorm(nn.Module):
    """x [..., D] -> weight * x / rms(x), the normalisation computed in float32; the
    backend's kernel (`rms_norm`, `add_rms_norm`) does the work."""

    def __init__(
        self, size: int, eps: float, dtype: torch.dtype, device: torch.device,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.eps = eps
        self.backend = backend
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return get_backend(self.backend, x.device).rms_norm(x, self.weight, self.eps)

    def fused_add(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), in one pass where the backend fuses it."""
        ops = get_backend(self.backend, x.device)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class DeepseekAttention(nn.Module):
    """The projections around one MLAAttention: `project` (hidden [T, H] -> its
    inputs) before it, o_proj ([T, N * V] -> [T, H]) after it; DecoderLayer runs the
    three, and PiecewiseGraphs runs them apart.

    q comes from q_proj, or from q_a_proj -> q_a_layernorm -> q_b_proj (q LoRA);
    kv_a_proj_with_mqa gives the latent [L] (normalised by kv_a_layernorm) and k_pe [R].
    kv_b_proj is held for loading; MLAAttention uses it after process_weights_after_loading.
    A sparse-attention model's layer `layer` has an `indexer` (models/indexer.py) unless
    it reuses an earlier layer's top-k (GLM-5's shared layers): `forward` then runs it
    and attends to each token's top-k positions only.
    With a block-fp8 checkpoint every projection but kv_b_proj keeps its fp8 weight:
    kv_b_proj is only ever used through its absorbed halves W_UK and W_UV, which the
    attention kernels take in the model dtype, so it is dequantized as it is loaded
    (it is small: 1/40 of a DeepSeek-V3 layer's weights).
    """

    def __init__(
        self, config: DeepseekConfig, dtype: torch.dtype, device: torch.device, backend: str,
        layer: int = 0,
    ) -> None:
        super().__init__()
        c, d = config, config.dims
        self.dims = d
        self.interleaved = c.rope_interleave
        N, H, L = d.num_heads, c.hidden_size, d.kv_lora_rank
        # DeepSeek's reference code (and transformers) build the two latent norms with the
        # RMSNorm default eps, not config.rms_norm_eps.
        eps = 1e-6
        block = c.weight_block_size

        def linear(inp: int, out: int) -> Linear:
            return Linear.empty(inp, out, dtype, device, block, backend)

        if d.q_lora_rank is None:
            self.q_proj = linear(H, N * d.qk_head_dim)
        else:
            self.q_a_proj = linear(H, d.q_lora_rank)
            self.q_a_layernorm = RMSNorm(d.q_lora_rank, eps, dtype, device, backend)
            self.q_b_proj = linear(d.q_lora_rank, N * d.qk_head_dim)
        self.kv_a_proj_with_mqa = linear(H, L + d.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(L, eps, dtype, device, backend)
        self.kv_b_proj = Linear.empty(L, N * (d.qk_nope_head_dim + d.v_head_dim), dtype, device)
        self.o_proj = linear(N * d.v_head_dim, H)
        self.attn = MLAAttention(d, c.softmax_scale, backend=backend)
        self.layer = layer
        self.indexer = None
        if c.indexer is not None and c.indexer.has_indexer(layer):
            self.indexer = Indexer(c.indexer, dtype, device, block, backend)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        step: ForwardStep,
        indices: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden [T, H] (normed) -> (attention output [T, N * V], the top-k positions
        [T, topk] it attended to, None where attention was dense). A layer without an
        indexer attends with the `indices` given (an earlier layer's). Traced by
        torch.compile, the indexer and attention are `attention/opaque.py`'s custom ops
        (whose indices are -1 throughout where attention is dense)."""
        q_latent, (q, kv_c, k_pe) = self._project(hidden, cos, sin)
        i = self.layer
        if torch.compiler.is_compiling():
            ops = torch.ops.pagedmla
            if self.indexer is not None:
                indices = ops.sparse_indices(hidden, q_latent, cos, sin, step, i,
                                             self.indexer.config.topk)
            return ops.mla_attention(q, kv_c, k_pe, step, i, indices,
                                     self.dims.v_head_dim), indices
        cache, meta = step.caches[i], step.meta
        if self.indexer is not None:
            indices = self.indexer(hidden, q_latent, cos, sin, cache.index_keys,
                                   meta.slot_mapping, meta.sparse)
        return self.attn(q, kv_c, k_pe, cache, meta, indices=indices), indices

    def project(
        self, hidden: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> MLAAttention's inputs: q [T, N, P + R] (rope applied),
        the normalised latent kv_c [T, L] and k_pe [T, R] (rope applied)."""
        return self._project(hidden, cos, sin)[1]

    def _project(
        self, hidden: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(the q latent [T, q_lora_rank] or None without q LoRA, `project`'s result)."""
        d = self.dims
        T, L = hidden.shape[0], d.kv_lora_rank
        q_latent = None
        if d.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(hidden))
            q = self.q_b_proj(q_latent)
        q = q.view(T, d.num_heads, d.qk_head_dim)
        latent = self.kv_a_proj_with_mqa(hidden)
        kv_c = self.kv_a_layernorm(latent[:, :L])
        if cos is None:
            k_pe = latent[:, L:].contiguous()
        else:  # q's rope dims in place (q is this layer's own projection)
            k_pe = self.attn.ops(q.device).rotary(q, latent[:, L:], cos, sin, self.interleaved)
        return q_latent, (q, kv_c, k_pe)


class DecoderLayer(nn.Module):
    """Pre-norm attention and feed-forward blocks, each with a residual: [T, H] -> [T, H]."""

    def __init__(
        self, config: DeepseekConfig, layer: int, dtype: torch.dtype, device: torch.device,
        backend: str,
    ) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps, dtype, device, backend)
        self.self_attn = DeepseekAttention(config, dtype, device, backend, layer)
        self.post_attention_layernorm = RMSNorm(H, eps, dtype, device, backend)
        if config.is_moe_layer(layer):
            self.mlp: nn.Module = MoE(config, dtype, device, backend)
        else:
            self.mlp = DenseMLP(H, config.intermediate_size, dtype, device,
                                config.weight_block_size, backend)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        step: ForwardStep,
        indices: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(hidden, residual) -> (mlp output, residual stream before it, the top-k
        positions attention used: `DeepseekAttention.forward`); the stream is hidden +
        residual, or hidden alone for the first layer (residual None). Each residual add
        is fused with the norm after it."""
        hidden, residual = self._input_norm(hidden, residual)
        out, indices = self.self_attn(hidden, cos, sin, step, indices)
        return (*self.after_attention(out, residual), indices)

    def _input_norm(
        self, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.input_layernorm(hidden), hidden
        return self.input_layernorm.fused_add(hidden, residual)

    def before_attention(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer up to attention: (q, kv_c, k_pe) as `DeepseekAttention.project`
        gives them, and the residual stream (dense attention only: the CUDA-graph
        pieces run attention apart)."""
        hidden, residual = self._input_norm(hidden, residual)
        return (*self.self_attn.project(hidden, cos, sin), residual)

    def after_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer from attention's output [T, N * V] on: (mlp output, residual)."""
        hidden = self.self_attn.o_proj(attn_out)
        hidden, residual = self.post_attention_layernorm.fused_add(hidden, residual)
        return self.mlp(hidden), residual


class DeepseekForCausalLM(nn.Module):
    """DeepSeek-V2/V3 causal LM over paged latent caches.

    Parameters are created uninitialised on `device` in `dtype` (router weights in
    float32); fill them with load_weights, then call process_weights_after_loading.
    """

    def __init__(
        self,
        config: DeepseekConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        backend: str = "auto",
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.dims = config.dims
        H, vocab = config.hidden_size, config.vocab_size
        self.embed_tokens = nn.utils.skip_init(nn.Embedding, vocab, H, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, dtype, device, backend)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(H, config.rms_norm_eps, dtype, device, backend)
        self.lm_head = None if config.tie_word_embeddings else Linear.empty(H, vocab, dtype, device)
        self.rotary = None
        if config.qk_rope_head_dim:
            self.rotary = RotaryEmbedding(
                config.qk_rope_head_dim, config.rope_theta, config.max_position_embeddings,
                config.rope_scaling,
            )
        self.requires_grad_(False)  # inference only: no autograd bookkeeping
        self._compiled: Callable[..., torch.Tensor] | None = None  # by enable_compile

    def enable_compile(self, backend: str = "inductor") -> None:
        """Run every later forward's layers under torch.compile(fullgraph=True) with
        dynamic token counts: attention and the indexer are opaque custom ops
        (`attention/opaque.py`), everything else is traced and fused (`ops/opaque.py`).
        The first forward of each token count class (1, and more than 1) compiles."""
        if not compile_supported():
            raise RuntimeError(f"compile=True needs torch >= 2.10 (custom ops taking "
                               f"Python objects), this is torch {torch.__version__}")
        # Dynamo keeps the graphs of `_run_layers` for every model of the process (two
        # each: one token, more); a process that builds several engines (a notebook, a
        # test run) would pass its default limit of 8 and fail (fullgraph).
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, 64)
        self._compiled = torch.compile(self._run_layers, fullgraph=True, dynamic=True,
                                       backend=backend)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list[LatentKVCache],
        meta: MLAMetadata,
    ) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64, one cache per layer -> hidden [T, H].

        The hidden states are final-normed: compute_logits applies only the LM head.
        """
        if len(caches) != len(self.layers):
            raise ValueError(f"caches has {len(caches)} entries, expected {len(self.layers)}")
        if self.config.indexer is not None:
            self._check_sparse(caches, meta)
        # Lazy state made outside any trace, which would otherwise guard on its absence.
        get_backend(self.norm.backend, positions.device)
        if self.rotary is not None:
            self.rotary.build(positions.device)
        step = ForwardStep([layer.self_attn for layer in self.layers], caches,
                           meta.for_forward())
        return (self._compiled or self._run_layers)(input_ids, positions, step)

    def _run_layers(
        self, input_ids: torch.Tensor, positions: torch.Tensor, step: ForwardStep
    ) -> torch.Tensor:
        """`forward` past its checks: every layer over step's caches and metadata."""
        hidden, cos, sin = self.embed(input_ids, positions)
        residual = indices = None
        for layer in self.layers:
            hidden, residual, indices = layer(hidden, residual, cos, sin, step, indices)
        return self.final_norm(hidden, residual)

    def _check_sparse(self, caches: list[LatentKVCache], meta: MLAMetadata) -> None:
        """ValueError unless a sparse-attention model's step has what its indexers need."""
        topk = self.config.indexer.topk
        if meta.sparse is None or meta.sparse.topk != topk:
            raise ValueError(f"a sparse-attention model needs metadata built with "
                             f"index_topk={topk}, got "
                             f"{None if meta.sparse is None else meta.sparse.topk}")
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            if layer.self_attn.indexer is not None and cache.index_keys is None:
                raise ValueError(f"caches[{i}] has no index_keys for layer {i}'s indexer")

    @property
    def decoder(self) -> DeepseekForCausalLM:
        """The layers' owner (this model; a tensor parallel wrapper returns its inner one)."""
        return self

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """input_ids [T], positions [T] -> (hidden [T, H], rope cos and sin [T, R / 2],
        None without rope dims)."""
        hidden = self.embed_tokens(input_ids)
        if self.rotary is None:
            return hidden, None, None
        cos, sin = self.rotary(positions)
        return hidden, cos, sin

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The last layer's (hidden, residual) -> the final-normed stream [T, H]."""
        return self.norm(hidden) if residual is None else self.norm.fused_add(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] (from forward) -> logits [B, vocab] float32."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return nn.functional.linear(hidden, head.weight).float()

    def checkpoint_sources(self) -> dict[str, Alternatives]:
        """For each state_dict key, the checkpoint tensors that fill it (`Alternatives`:
        the per-expert names first, transformers' fused expert tensor second; for a tied
        embedding, `lm_head.weight` second)."""
        c = self.config
        sources: dict[str, Alternatives] = {}
        for key, tensor in self.state_dict(keep_vars=True).items():
            shape = tuple(tensor.shape)
            if key.endswith(_STACKED):
                sources[key] = _expert_sources(key, shape, c.moe_intermediate_size)
                continue
            name = key if key == "lm_head.weight" else f"model.{key}"
            sources[key] = ((Piece(name, shape),),)
            if key == "embed_tokens.weight" and self.lm_head is None:
                sources[key] += ((Piece("lm_head.weight", shape),),)  # tied: either name
        return sources

    def expected_weight_names(self) -> set[str]:
        """Checkpoint names load_weights must see, with experts as per-expert tensors."""
        return {
            piece.name for first, *_ in self.checkpoint_sources().values() for piece in first
        }

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy (Hugging Face name, tensor) pairs into the parameters; returns names filled.

        The result uses expected_weight_names' spelling: a fused expert tensor
        (`mlp.experts.gate_up_proj` [E, 2I, H] / `mlp.experts.down_proj` [E, H, I], the
        in-memory transformers-5 layout) fills the names of all per-expert tensors it
        stands for. Skips `ignored_weight` names (`rotary_emb.inv_freq`, layers past
        num_hidden_layers such as DeepSeek-V3's MTP layer). ValueError for an unknown
        name, a shape mismatch, or a tensor with NaN or inf in the parameter's dtype
        (checked on the parameter's device, one reduction per tensor).
        """
        targets = self.state_dict(keep_vars=True)
        index = weight_index(self.checkpoint_sources())
        filled: set[str] = set()
        for name, tensor in weights:
            if ignored_weight(name, self.config.num_hidden_layers):
                continue
            if name not in index:
                raise ValueError(f"unknown weight {name!r}: the model has no tensor of that name")
            key, piece, covered = index[name]
            dest = targets[key][piece.region()]
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"weight {name!r} has shape {list(tensor.shape)}, expected {list(dest.shape)}"
                )
            dest.copy_(tensor)
            if not all_finite(dest):
                raise ValueError(f"weight {name!r} has NaN or inf values (as {dest.dtype})")
            filled |= covered
        return filled

    def derived_weights(self) -> list[torch.Tensor]:
        """The tensors process_weights_after_loading derives and keeps beside the loaded
        ones: each layer's W_UK and W_UV, but those that are views of kv_b_proj (W_UK,
        with one head) and take no memory of their own."""
        derived = (t for layer in self.layers
                   for t in (layer.self_attn.attn.W_UK, layer.self_attn.attn.W_UV))
        return [t for t in derived if t._base is None]

    def process_weights_after_loading(self) -> None:
        """Derive what MLAAttention precomputes (W_UK, W_UV) from the loaded kv_b_proj."""
        for layer in self.layers:
            layer.self_attn.attn.set_kv_b_proj(layer.self_attn.kv_b_proj.weight)


def _expert_sources(key: str, shape: tuple[int, ...], inter: int) -> Alternatives:
    """The checkpoint tensors of a stacked expert tensor (`key`, of `shape`): per-expert
    ones, and for the weights transformers' fused tensor second (fp8 scales come only
    per expert)."""
    mlp, _, stacked = key.rpartition(".")
    E = shape[0]
    experts = f"model.{mlp}.experts"
    if stacked == "w13":
        return (
            tuple(Piece(f"{experts}.{e}.{part}.weight", (inter, shape[2]), (e,), (k * inter, 0))
                  for e in range(E) for k, part in enumerate(_W13_PARTS)),
            (Piece(f"{experts}.gate_up_proj", shape),),
        )
    if stacked == "w2":
        return (
            tuple(Piece(f"{experts}.{e}.down_proj.weight", shape[1:], (e,)) for e in range(E)),
            (Piece(f"{experts}.down_proj", shape),),
        )
    if stacked == "w13_scale_inv":  # [E, 2, ...]: the gate's blocks, then the up's
        return (tuple(Piece(f"{experts}.{e}.{part}.weight_scale_inv", shape[2:], (e, k))
                      for e in range(E) for k, part in enumerate(_W13_PARTS)),)
    return (tuple(Piece(f"{experts}.{e}.down_proj.weight_scale_inv", shape[1:], (e,))
                  for e in range(E)),)


def ignored_weight(name: str, num_layers: int) -> bool:
    """Checkpoint tensors that next-token inference does not use: `rotary_emb.inv_freq`
    and layers past num_hidden_layers (DeepSeek-V3's multi-token-prediction layers)."""
    layer = _LAYER.match(name)
    past_last = layer is not None and int(layer[1]) >= num_layers
    return past_last or name.endswith("rotary_emb.inv_freq")


def weight_index(sources: dict[str, Alternatives]) -> dict[str, tuple[str, Piece, set[str]]]:
    """Checkpoint name -> (state_dict key, its piece, the expected names it fills): a
    piece of a later alternative stands for all of the first alternative's names."""
    index: dict[str, tuple[str, Piece, set[str]]] = {}
    for key, (first, *others) in sources.items():
        for piece in first:
            index[piece.name] = (key, piece, {piece.name})
        expected = {piece.name for piece in first}
        for alternative in others:
            for piece in alternative:
                index[piece.name] = (key, piece, expected)
    return index
