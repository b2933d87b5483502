"""Sharded loading: each tensor parallel rank reads only its slices of a checkpoint.

Tiny checkpoints (16-bit, and block-fp8 whose shapes are not multiples of 128, so that
edge blocks are partial and the ranks' slices cut through blocks) are loaded on 2 and 4
gloo ranks. Expectations are independent of the loader: the bytes each rank may read
follow from which checkpoint tensors MLA keeps whole on every rank (the latent path,
norms, routers) and which it splits; the weights a rank holds are counted from its
materialised tensors; tokens are those of one process.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pagedmla import LLM, SamplingParams
from pagedmla.distributed.state import ParallelState
from pagedmla.distributed.tensor_parallel import shard_for
from pagedmla.engine.memory import GIB, check_fits
from pagedmla.models.checkpoint import Checkpoint
from pagedmla.models.loader import load_planned, plan_model
from pagedmla.models.shards import Piece, Shard
from pagedmla.models.tiny import tiny_config, write_tiny_checkpoint
from pagedmla.ops.block_fp8 import dequantize_blocks
from tests.dist_helpers import run_ranks
from tests.test_loader import quantize_by_hand

# Checkpoint tensors every rank reads whole: MLA's latent path, the norms, the routers.
REPLICATED = re.compile(r"q_a_proj|kv_a_proj_with_mqa|layernorm|model\.norm|mlp\.gate\.")
HIDDEN = tiny_config()["hidden_size"]
OPTIONS = dict(dtype=torch.float32, device="cpu", block_size=8, num_kv_blocks=48,
               max_num_batched_tokens=32, workspace_rows=16)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1, ignore_eos=True)
PROMPTS = [[5, 17, 200, 3, 9, 41, 77, 12, 130, 8], [66, 2], list(range(30, 70))]
LOGPROB_TOL = 1e-4
ELEMENT_BYTES = {"F32": 4, "BF16": 2, "F8_E4M3": 1}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sharded")
    return {
        "bf16": write_tiny_checkpoint(root / "bf16", dtype=torch.bfloat16),
        "fp8": write_tiny_checkpoint(root / "fp8", fp8=True),
    }


def _checkpoint_bytes(directory: Path) -> tuple[int, int, int]:
    """(all tensors' bytes, the replicated ones', the fp8 scales') of a checkpoint."""
    total = replicated = scales = 0
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names = f.keys()  # a safe_open handle is not iterable
            for name in names:
                t = f.get_slice(name)
                size = math.prod(t.get_shape()) * ELEMENT_BYTES[t.get_dtype()]
                total += size
                replicated += size if REPLICATED.search(name) else 0
                scales += size if name.endswith("_scale_inv") else 0
    return total, replicated, scales


class _CreatedShapes(TorchDispatchMode):
    """Records the shape of every tensor an op allocates (not on the meta device). Ops
    whose result aliases an input (views, in-place ops) allocate nothing: safetensors
    maps a shard's file and views a whole tensor of it, unread, before it cuts the slice
    asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if all(r.alias_info is None for r in func._schema.returns):
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor) and not leaf.is_meta:
                    self.shapes.add(tuple(leaf.shape))
        return out


def _held_bytes(module: torch.nn.Module) -> int:
    """The bytes of the distinct storages of a module's parameters and buffers."""
    storages = {}
    for t in (*module.parameters(), *module.buffers()):
        if t.numel():
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _load_rank(model: str, tp: int) -> dict:
    """Load `model` as this gloo rank: bytes planned and held, the shapes of the tensors
    allocated while loading."""
    state = ParallelState.connect(tp, 1, torch.device("cpu"))
    plan = plan_model(model, torch.float32, "auto", shard_for(state))
    with _CreatedShapes() as spy:
        module = load_planned(plan)
    return dict(planned=plan.weight_bytes, held=_held_bytes(module), shapes=spy.shapes,
                largest=max(t.numel() for t in module.state_dict().values()))


def _whole_shapes(tp: int) -> dict[str, tuple[int, ...]]:
    """Shapes of whole tensors that a rank must not allocate (none of its own tensors or
    checkpoint slices has them in the tiny model at this tp)."""
    c = tiny_config()
    heads, hidden, vocab = c["num_attention_heads"], c["hidden_size"], c["vocab_size"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    experts, inter = c["n_routed_experts"], c["moe_intermediate_size"]
    shapes = {
        "q_b_proj": (heads * qk, c["q_lora_rank"]),
        "kv_b_proj": (heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]),
        "dense gate_proj": (c["intermediate_size"], hidden),
        "experts w13": (experts, 2 * inter, hidden),
        "experts w2": (experts, hidden, inter),
        "embed_tokens / lm_head": (vocab, hidden),
    }
    if tp == 4:  # at tp 2 a rank's dense gate_proj is [128, 128] too
        shapes["o_proj"] = (hidden, heads * c["v_head_dim"])
    return shapes


@pytest.mark.parametrize(("kind", "tp"), [("bf16", 2), ("fp8", 4)])
def test_a_rank_allocates_no_whole_tensor(checkpoints, kind: str, tp: int) -> None:
    """Nor any tensor larger than its largest own one; and it holds the bytes planned."""
    for rank, got in enumerate(run_ranks(_load_rank, tp, str(checkpoints[kind]), tp)):
        whole = {name for name, shape in _whole_shapes(tp).items() if shape in got["shapes"]}
        assert not whole, f"rank {rank} allocated whole tensors: {whole}"
        assert max(math.prod(s) for s in got["shapes"]) <= got["largest"]
        assert got["held"] == got["planned"], rank


@pytest.mark.parametrize("model", ["tiny", "checkpoint"])
def test_planned_bytes_are_the_bytes_held(checkpoints, model: str) -> None:
    """The plan's weight bytes are what the loaded model holds (W_UK and W_UV included),
    and for the tiny model, loaded whole then sharded, what each of 2 ranks holds."""
    name = "tiny" if model == "tiny" else str(checkpoints["fp8"])
    plan = plan_model(name)
    assert _held_bytes(load_planned(plan)) == plan.weight_bytes
    if model == "tiny":  # checkpoints on ranks: test_a_rank_allocates_no_whole_tensor
        for got in run_ranks(_load_rank, 2, name, 2):
            assert got["held"] == got["planned"] < plan.weight_bytes


@pytest.fixture(scope="module")
def single(checkpoints):
    """One-process outputs and memory report, by checkpoint kind."""
    results = {}

    def outputs(kind: str):
        if kind not in results:
            llm = LLM(str(checkpoints[kind]), **OPTIONS)
            results[kind] = llm.generate(PROMPTS, GREEDY, use_tqdm=False), llm.memory
        return results[kind]

    return outputs


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_reads_its_share_and_gives_the_tokens_of_one_process(
    checkpoints, single, kind: str, tp: int
) -> None:
    expected, whole = single(kind)
    with LLM(str(checkpoints[kind]), tensor_parallel_size=tp, **OPTIONS) as llm:
        got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        reports = llm.memory_per_rank
    for ref, out in zip(expected, got, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for token, want, have in zip(out.outputs[0].token_ids, ref.outputs[0].logprobs,
                                     out.outputs[0].logprobs, strict=True):
            assert abs(have[token] - want[token]) <= LOGPROB_TOL
    assert [r.rank for r in reports] == list(range(tp))
    assert all(r.weight_bytes < whole.weight_bytes for r in reports)
    assert all(r.kv_cache_bytes == whole.kv_cache_bytes for r in reports)  # latents replicated
    total, replicated, scales = _checkpoint_bytes(checkpoints[kind])
    assert whole.checkpoint_bytes_read == total
    # A rank's vocabulary shard may have one row more than vocab / tp (embedding, head).
    allowance = scales + 2 * HIDDEN * (2 if kind == "bf16" else 4)
    share = replicated + (total - replicated) / tp
    for r in reports:
        assert r.checkpoint_bytes_read <= share + allowance, (r, share)
    # Split tensors are read once in all, whole ones by every rank; fp8 scale blocks
    # that two ranks' slices share are read by both.
    read = sum(r.checkpoint_bytes_read for r in reports)
    assert total + (tp - 1) * replicated <= read <= total + (tp - 1) * (replicated + scales)
    if kind == "bf16":
        assert read == total + (tp - 1) * replicated


def test_memory_report_of_one_process(checkpoints, single) -> None:
    _, report = single("fp8")
    llm = LLM(str(checkpoints["fp8"]), **OPTIONS)
    assert llm.memory.weight_bytes == report.weight_bytes == _held_bytes(llm.model)
    assert llm.memory.kv_cache_bytes == sum(c.data.numel() * c.data.element_size()
                                            for c in llm.caches)
    assert llm.memory.kv_cache_tokens == (OPTIONS["num_kv_blocks"] - 1) * OPTIONS["block_size"]
    assert llm.memory.load_seconds > 0 and llm.memory_per_rank == [llm.memory]
    assert re.fullmatch(r"rank 0: weights \d+\.\d{3} GiB, KV cache \d+\.\d{3} GiB "
                        r"\(376 tokens; float32, 320 bytes per token and layer\), weights "
                        r"loaded in \d+\.\d s \(0\.001 GiB of checkpoint read\)",
                        str(llm.memory))


def test_what_does_not_fit_says_how_much_is_missing() -> None:
    args = dict(device=torch.device("cuda", 0), free=10 * GIB, total=16 * GIB,
                utilization=0.9, workspace=GIB // 2, cache=GIB // 4, cache_blocks=2)
    check_fits(weights=7 * GIB, **args)  # 7.75 GiB of the 10 - 1.6 GiB it may use
    with pytest.raises(ValueError, match=r"weights 8\.00 GiB \+ the workspace 0\.50 GiB \+ "
                                         r"a KV cache of 2 blocks 0\.25 GiB need 8\.75 GiB; "
                                         r".* leaves 8\.40 GiB: 0\.35 GiB missing"):
        check_fits(weights=8 * GIB, **args)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_cache_that_cannot_fit_is_refused_before_loading() -> None:
    """A tiny-model block (bf16) is 3 layers x 64 tokens x 160 bytes: total / 4096
    blocks are 7.5 times the device's memory."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    with pytest.raises(ValueError, match=r"GiB missing"):
        LLM("tiny", device="cuda", block_size=64, num_kv_blocks=total // 4096)
    assert torch.cuda.mem_get_info()[0] >= free - 16 * 2**20  # nothing was allocated


@pytest.mark.parametrize("block", [(128, 128), (64, 48)])
def test_an_fp8_slice_is_the_slice_of_the_dequantized_weight(tmp_path, block) -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(300, 200, generator=gen)
    q, scale = quantize_by_hand(w, block)
    save_file({"x.weight": q, "x.weight_scale_inv": scale}, str(tmp_path / "model.safetensors"))
    whole = dequantize_blocks(q, scale, block)
    checkpoint = Checkpoint(tmp_path, block)
    with checkpoint.opened():
        for rows, cols in [(slice(0, 300), slice(0, 200)), (slice(100, 290), slice(50, 51)),
                           (slice(127, 129), slice(47, 200)), (slice(299, 300), slice(0, 97))]:
            before = checkpoint.bytes_read
            got = checkpoint.read("x.weight", (rows, cols), torch.float32)
            assert torch.equal(got, whole[rows, cols])
            blocks = (math.ceil(rows.stop / block[0]) - rows.start // block[0]) * (
                math.ceil(cols.stop / block[1]) - cols.start // block[1])
            assert checkpoint.bytes_read - before == got.numel() + 4 * blocks


def test_a_piece_lands_where_its_shard_is() -> None:
    gate = Piece("experts.3.up", (4, 6), lead=(3,), offset=(4, 0))  # w13 [E, 8, 6], up half
    assert gate.placement(Shard(0, 0, 2)) is None  # another rank's experts
    assert gate.placement(Shard(0, 2, 4)) == ((slice(0, 4), slice(0, 6)),
                                               (1, slice(4, 8), slice(0, 6)))
    rows = Piece("w", (10, 6))
    assert rows.placement(Shard(0, 8, 13)) == ((slice(8, 10), slice(0, 6)),
                                               (slice(0, 2), slice(0, 6)))  # padded past 10
    assert rows.placement(Shard(1, 2, 4)) == ((slice(0, 10), slice(2, 4)),
                                              (slice(0, 10), slice(0, 2)))
    full = torch.arange(12.0).view(3, 4)
    assert torch.equal(Shard(0, 2, 4).take(full), torch.cat([full[2:], torch.zeros(1, 4)]))
