"""Bad input is rejected with a ValueError/TypeError that names what is wrong."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from pagedmla import BatchSpec, LatentKVCache, MLAAttention, MLADims, MLAMetadataBuilder
from pagedmla.distributed.dcp_layout import DCPLayout
from pagedmla.distributed.dcp_metadata import DCPMetadataBuilder
from pagedmla.ops import REFERENCE, registry
from pagedmla.testing import PagedBatch, make_paged_batch

DIMS = MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
               v_head_dim=12)
Q_LENS = [1, 1, 5]
SEQ_LENS = [20, 7, 40]


@pytest.fixture
def batch() -> PagedBatch:
    return make_paged_batch(DIMS, Q_LENS, SEQ_LENS, 16, seed=42)


def build(batch: PagedBatch, dims: MLADims = DIMS, **kwargs):
    return MLAMetadataBuilder(dims, block_size=batch.block_size, **kwargs).build(batch.spec)


def layer(batch: PagedBatch, dims: MLADims = DIMS) -> MLAAttention:
    return MLAAttention(dims, kv_b_proj=batch.kv_b_proj, backend="reference")


def test_valid_batch_runs(batch: PagedBatch) -> None:
    # The baseline every other test perturbs one thing of.
    out = layer(batch)(batch.q, batch.kv_c, batch.k_pe, batch.cache, build(batch))
    assert out.shape == (7, DIMS.num_heads * DIMS.v_head_dim)


# --- forward inputs ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("which", "shape", "pattern"),
    [
        ("q", (7, 5, 24), r"\bq\b.*shape"),  # one head too many
        ("q", (7, 4, 23), r"\bq\b.*shape"),  # P + R off by one
        ("q", (6, 4, 24), r"\bq\b.*shape"),  # one token short
        ("q", (7, 96), r"\bq\b.*shape"),  # flattened heads
        ("kv_c", (7, 33), "kv_c_normed.*shape"),
        ("kv_c", (8, 32), "kv_c_normed.*shape"),
        ("k_pe", (7, 9), "k_pe.*shape"),
        ("k_pe", (7, 1, 8), "k_pe.*shape"),
    ],
)
def test_wrong_input_shapes(batch: PagedBatch, which: str, shape, pattern: str) -> None:
    args = {"q": batch.q, "kv_c": batch.kv_c, "k_pe": batch.k_pe}
    args[which] = torch.zeros(shape)
    with pytest.raises(ValueError, match=pattern):
        layer(batch)(args["q"], args["kv_c"], args["k_pe"], batch.cache, build(batch))


def test_wrong_input_dtypes(batch: PagedBatch) -> None:
    attn, meta = layer(batch), build(batch)
    with pytest.raises(TypeError, match="kv_c_normed"):
        attn(batch.q, batch.kv_c.bfloat16(), batch.k_pe, batch.cache, meta)
    with pytest.raises(TypeError, match="k_pe"):
        attn(batch.q, batch.kv_c, batch.k_pe.double(), batch.cache, meta)
    with pytest.raises(TypeError, match=r"\bq\b"):
        attn(batch.q.double(), batch.kv_c.double(), batch.k_pe.double(), batch.cache, meta)
    with pytest.raises(TypeError, match=r"\bq\b"):
        attn(batch.q.to(torch.int32), batch.kv_c, batch.k_pe, batch.cache, meta)
    with pytest.raises(TypeError, match="cache"):  # bf16 inputs against a float32 cache
        attn(batch.q.bfloat16(), batch.kv_c.bfloat16(), batch.k_pe.bfloat16(), batch.cache,
             meta)
    with pytest.raises(TypeError, match=r"\bq\b"):
        attn(batch.q.numpy(), batch.kv_c, batch.k_pe, batch.cache, meta)


def test_wrong_input_devices(batch: PagedBatch) -> None:
    # The "meta" device stands in for a second device on a CPU-only machine.
    attn, meta = layer(batch), build(batch)
    with pytest.raises(ValueError, match="k_pe"):
        attn(batch.q, batch.kv_c, batch.k_pe.to("meta"), batch.cache, meta)
    with pytest.raises(ValueError, match="kv_c_normed"):
        attn(batch.q, batch.kv_c.to("meta"), batch.k_pe, batch.cache, meta)
    with pytest.raises(ValueError, match="cache"):
        attn(batch.q.to("meta"), batch.kv_c.to("meta"), batch.k_pe.to("meta"), batch.cache, meta)


def test_wrong_argument_types(batch: PagedBatch) -> None:
    attn, meta = layer(batch), build(batch)
    with pytest.raises(TypeError, match="cache"):
        attn(batch.q, batch.kv_c, batch.k_pe, batch.cache.data, meta)
    with pytest.raises(TypeError, match="meta"):
        attn(batch.q, batch.kv_c, batch.k_pe, batch.cache, batch.spec)
    with pytest.raises(TypeError, match="dims"):
        MLAAttention({"num_heads": 4}, kv_b_proj=batch.kv_b_proj)
    with pytest.raises(TypeError, match="dims"):
        MLAMetadataBuilder(None)


# --- dimension mismatches ------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [
        (4 * (16 + 12) + 1, 32),  # P + V off
        (8 * (16 + 12), 32),  # twice the heads
        (4 * (16 + 12), 31),  # L off
        (32, 4 * (16 + 12)),  # transposed
    ],
)
def test_kv_b_proj_shape(shape) -> None:
    with pytest.raises(ValueError, match="kv_b_proj"):
        MLAAttention(DIMS, kv_b_proj=torch.zeros(shape))


def test_kv_b_proj_dtype() -> None:
    with pytest.raises(TypeError, match="kv_b_proj"):
        MLAAttention(DIMS, kv_b_proj=torch.zeros(4 * 28, 32, dtype=torch.int64))


@pytest.mark.parametrize("scale", [0.0, -0.125, float("nan"), float("inf")])
def test_softmax_scale_must_be_finite_and_positive(scale: float) -> None:
    with pytest.raises(ValueError, match="softmax_scale"):
        MLAAttention(DIMS, softmax_scale=scale)


def test_head_count_mismatch_between_layer_and_inputs(batch: PagedBatch) -> None:
    # A layer for 8 heads given q with 4 heads.
    dims8 = MLADims(8, 32, 16, 8, 12)
    attn = MLAAttention(dims8, kv_b_proj=torch.randn(8 * 28, 32))
    with pytest.raises(ValueError, match=r"\bq\b.*shape"):
        attn(batch.q, batch.kv_c, batch.k_pe, batch.cache, build(batch, dims8))


@pytest.mark.parametrize(("L", "R"), [(16, 8), (32, 4), (32, 0)])
def test_cache_width_mismatch(batch: PagedBatch, L: int, R: int) -> None:
    cache = LatentKVCache(batch.cache.num_blocks, 16, L, R, dtype=torch.float32)
    with pytest.raises(ValueError, match="cache"):
        layer(batch)(batch.q, batch.kv_c, batch.k_pe, cache, build(batch))


def test_cache_block_size_mismatch(batch: PagedBatch) -> None:
    cache = LatentKVCache(4 * batch.cache.num_blocks, 4, 32, 8, dtype=torch.float32)
    meta = MLAMetadataBuilder(DIMS, block_size=16).build(batch.spec)
    with pytest.raises(ValueError, match="block_size"):
        layer(batch)(batch.q, batch.kv_c, batch.k_pe, cache, meta)


def test_metadata_built_for_other_dims(batch: PagedBatch) -> None:
    other = MLADims(4, 64, 16, 8, 12)
    with pytest.raises(ValueError, match="meta"):
        layer(batch)(batch.q, batch.kv_c, batch.k_pe, batch.cache, build(batch, other))


# --- batch description ----------------------------------------------------------------------


def _spec(batch: PagedBatch, **changes) -> BatchSpec:
    fields = {
        "query_lens": list(batch.spec.query_lens),
        "seq_lens": list(batch.spec.seq_lens),
        "block_table": batch.spec.block_table.clone(),
        "slot_mapping": batch.spec.slot_mapping.clone(),
    }
    fields.update(changes)
    return BatchSpec(**fields)


def test_query_len_longer_than_seq_len(batch: PagedBatch) -> None:
    spec = _spec(batch, seq_lens=[20, 7, 4])
    with pytest.raises(ValueError, match="query_len"):
        MLAMetadataBuilder(DIMS, block_size=16).build(spec)


def test_query_len_zero(batch: PagedBatch) -> None:
    spec = _spec(batch, query_lens=[1, 0, 5], slot_mapping=batch.spec.slot_mapping[1:])
    with pytest.raises(ValueError, match="query_len"):
        MLAMetadataBuilder(DIMS, block_size=16).build(spec)


def test_block_table_too_short(batch: PagedBatch) -> None:
    # seq_len 40 needs 3 pages of 16; give 2 columns.
    spec = _spec(batch, block_table=batch.spec.block_table[:, :2].clone())
    with pytest.raises(ValueError, match="block_table"):
        MLAMetadataBuilder(DIMS, block_size=16).build(spec)


def test_block_table_rows_per_request(batch: PagedBatch) -> None:
    spec = _spec(batch, block_table=batch.spec.block_table[:2].clone())
    with pytest.raises(ValueError, match="block_table"):
        MLAMetadataBuilder(DIMS, block_size=16).build(spec)


def test_block_id_outside_the_cache(batch: PagedBatch) -> None:
    table = batch.spec.block_table.clone()
    table[2, 1] = batch.cache.num_blocks
    with pytest.raises(ValueError, match="block"):
        layer(batch)(batch.q, batch.kv_c, batch.k_pe, batch.cache,
                     build_spec(_spec(batch, block_table=table)))


def test_block_table_and_slot_dtypes(batch: PagedBatch) -> None:
    with pytest.raises(TypeError, match="block_table"):
        build_spec(_spec(batch, block_table=batch.spec.block_table.long()))
    with pytest.raises(TypeError, match="slot_mapping"):
        build_spec(_spec(batch, slot_mapping=batch.spec.slot_mapping.int()))


def build_spec(spec: BatchSpec, **kwargs):
    return MLAMetadataBuilder(DIMS, block_size=16, **kwargs).build(spec)


def test_slot_beyond_the_cache(batch: PagedBatch) -> None:
    slots = batch.spec.slot_mapping.clone()
    slots[4] = batch.cache.num_blocks * batch.cache.block_size  # one past the last slot
    with pytest.raises(ValueError, match=r"slot_mapping\[4\]"):
        build_spec(_spec(batch, slot_mapping=slots))
    # Built unchecked (the engine's path), the layer still refuses to write there.
    meta = MLAMetadataBuilder(DIMS, block_size=16).build(_spec(batch, slot_mapping=slots),
                                                         validate=False)
    with pytest.raises(ValueError, match="slot"):
        layer(batch)(batch.q, batch.kv_c, batch.k_pe, batch.cache, meta)
    assert batch.cache_mismatches(written=False) == 0, "a rejected step must not write"


def _slot(batch: PagedBatch, request: int, position: int) -> int:
    """The slot of a request's position, from the batch's own list of its blocks."""
    return batch.blocks[request][position // 16] * 16 + position % 16


def _spare_block(batch: PagedBatch) -> int:
    used = {block for blocks in batch.blocks for block in blocks}
    return next(b for b in range(1, batch.cache.num_blocks) if b not in used)


# Tokens: 0 is request 0 at position 19, 1 is request 1 at 6, 2..6 are request 2 at 35..39.
@pytest.mark.parametrize(
    ("token", "wrong_slot"),
    [
        pytest.param(0, lambda batch: _slot(batch, 2, 19), id="another request's block"),
        pytest.param(1, lambda batch: _spare_block(batch) * 16 + 6, id="a free block"),
        pytest.param(0, lambda batch: 3, id="the null block"),
        pytest.param(5, lambda batch: _slot(batch, 2, 0), id="its own position 0"),
        pytest.param(6, lambda batch: _slot(batch, 2, 40), id="its own block, past seq_len"),
    ],
)
def test_slot_outside_its_position(batch: PagedBatch, token: int, wrong_slot) -> None:
    slots = batch.spec.slot_mapping.clone()
    right = int(slots[token])
    slots[token] = wrong_slot(batch)
    with pytest.raises(ValueError, match=rf"slot_mapping\[{token}\] must be {right} or -1"):
        build_spec(_spec(batch, slot_mapping=slots))


def test_slots_minus_one_may_repeat(batch: PagedBatch) -> None:
    slots = batch.spec.slot_mapping.clone()
    slots[[1, 2, 5]] = -1
    meta = build_spec(_spec(batch, slot_mapping=slots))
    assert meta.slot_mapping.tolist() == slots.tolist()


def test_slot_written_twice() -> None:
    # Two decodes at position 4 whose tables both list block 3: each slot is its own
    # request's, but both write slot 52.
    table = torch.tensor([[3], [3]], dtype=torch.int32)
    spec = BatchSpec([1, 1], [5, 5], table, torch.tensor([52, 52]))
    with pytest.raises(ValueError, match=r"slot 52 for tokens \[0, 1\]"):
        build_spec(spec)
    # One request whose table lists block 3 twice: positions 0 and 16 both go to slot 48.
    table = torch.tensor([[3, 3]], dtype=torch.int32)
    spec = BatchSpec([17], [17], table, torch.tensor([*range(48, 64), 48]))
    with pytest.raises(ValueError, match=r"slot 48 for tokens \[0, 16\]"):
        build_spec(spec)


def test_decode_context_parallel_builder_checks_the_engine_slots() -> None:
    # Under DCP the spec's slots are virtual (blocks of block_size * D tokens, the same on
    # every rank), so every rank refuses the same spec.
    batch = make_paged_batch(DIMS, [1, 1, 3], [5, 9, 20], block_size=8, seed=3)
    slots = batch.spec.slot_mapping.clone()
    slots[1] += 1  # request 1's position 8 written at position 9's slot
    for rank in range(2):
        builder = DCPMetadataBuilder(DIMS, DCPLayout(2, rank, 1, 4),
                                     SimpleNamespace(dcp_size=2, dcp_rank=rank))
        builder.build(batch.spec)
        with pytest.raises(ValueError, match=r"slot_mapping\[1\]"):
            builder.build(_spec(batch, slot_mapping=slots))
        builder.build(_spec(batch, slot_mapping=slots), validate=False)


def test_slot_below_minus_one(batch: PagedBatch) -> None:
    slots = batch.spec.slot_mapping.clone()
    slots[3] = -2
    with pytest.raises(ValueError, match="slot_mapping"):
        build_spec(_spec(batch, slot_mapping=slots))


@pytest.mark.parametrize("length", [6, 8, 0])
def test_slot_mapping_length(batch: PagedBatch, length: int) -> None:
    slots = torch.arange(length, dtype=torch.int64) + 16
    with pytest.raises(ValueError, match="slot_mapping"):
        build_spec(_spec(batch, slot_mapping=slots))


def test_prefill_before_decode() -> None:
    spec = make_paged_batch(DIMS, [5, 1, 1], [40, 20, 7], 16).spec
    with pytest.raises(ValueError, match="decode"):
        build_spec(spec)
    # With a threshold of 2, a 2-token request after a prefill is out of order too.
    spec = make_paged_batch(DIMS, [1, 4, 2], [20, 7, 40], 16).spec
    with pytest.raises(ValueError, match="decode"):
        build_spec(spec, decode_threshold=2)


def test_empty_batch(batch: PagedBatch) -> None:
    spec = BatchSpec([], [], torch.zeros(0, 1, dtype=torch.int32),
                     torch.zeros(0, dtype=torch.int64))
    with pytest.raises(ValueError, match="request"):
        build_spec(spec)


def test_seq_lens_length(batch: PagedBatch) -> None:
    with pytest.raises(ValueError, match="seq_lens"):
        build_spec(_spec(batch, seq_lens=[20, 7]))


# --- builder, cache and dims construction ------------------------------------------------------


@pytest.mark.parametrize(("block_size", "rows"), [(16, 15), (64, 32), (16, 0)])
def test_workspace_smaller_than_block(block_size: int, rows: int) -> None:
    with pytest.raises(ValueError, match="workspace_rows"):
        MLAMetadataBuilder(DIMS, block_size=block_size, workspace_rows=rows)


def test_bad_builder_arguments() -> None:
    with pytest.raises(ValueError, match="block_size"):
        MLAMetadataBuilder(DIMS, block_size=0)
    with pytest.raises(ValueError, match="decode_threshold"):
        MLAMetadataBuilder(DIMS, decode_threshold=0)
    with pytest.raises(TypeError, match="workspace_rows"):
        MLAMetadataBuilder(DIMS, workspace_rows=64.0)


@pytest.mark.parametrize("name", ["fp16x", "int8", "fp8_e5m2", "FP8 ", "", torch.int8,
                                  torch.float8_e5m2])
def test_unknown_cache_dtype(name) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LatentKVCache(4, 16, 32, 8, kv_cache_dtype=name, dtype=torch.float32)


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3", torch.float8_e4m3fn])
def test_fp8_cache_names(name) -> None:
    cache = LatentKVCache(5, 16, 32, 8, kv_cache_dtype=name, dtype=torch.bfloat16, scale=0.37)
    assert cache.is_fp8 and cache.data.dtype == torch.float8_e4m3fn
    assert cache.data.shape == (5, 16, 40) and cache.num_blocks == 5 and cache.block_size == 16
    assert cache.scale.dtype == torch.float32 and cache.scale.dim() == 0
    assert torch.equal(cache.data.float(), torch.zeros(5, 16, 40))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_auto_cache_uses_model_dtype(dtype) -> None:
    cache = LatentKVCache(3, 4, 32, 0, dtype=dtype)
    assert not cache.is_fp8 and cache.data.dtype == dtype and cache.data.shape == (3, 4, 32)
    assert not cache.data.any()


def test_bad_cache_arguments() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        LatentKVCache(0, 16, 32, 8)
    with pytest.raises(ValueError, match="block_size"):
        LatentKVCache(4, 0, 32, 8)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        LatentKVCache(4, 16, 0, 8)
    with pytest.raises(ValueError, match="rope_dim"):
        LatentKVCache(4, 16, 32, -1)
    with pytest.raises(ValueError, match="scale"):
        LatentKVCache(4, 16, 32, 8, kv_cache_dtype="fp8", scale=0.0)
    with pytest.raises(ValueError, match="scale"):
        LatentKVCache(4, 16, 32, 8, kv_cache_dtype="fp8", scale=float("nan"))
    with pytest.raises(TypeError, match="dtype"):
        LatentKVCache(4, 16, 32, 8, dtype=torch.int32)


@pytest.mark.parametrize(
    "value", [0.0, 0, -0.5, float("nan"), float("inf"), torch.tensor(0.0), torch.tensor([-1.0])]
)
def test_cache_scale_set_to_a_bad_value(value) -> None:
    cache = LatentKVCache(4, 16, 32, 8, kv_cache_dtype="fp8", scale=0.5)
    held = cache.scale
    with pytest.raises(ValueError, match="scale"):
        cache.scale = value
    assert cache.scale is held and cache.scale.item() == 0.5


@pytest.mark.parametrize("value", ["0.5", True, None, torch.ones(2), torch.tensor(True)])
def test_cache_scale_of_a_bad_type(value) -> None:
    cache = LatentKVCache(4, 16, 32, 8, kv_cache_dtype="fp8", scale=0.5)
    with pytest.raises(TypeError, match="scale"):
        cache.scale = value
    with pytest.raises(TypeError, match="scale"):
        LatentKVCache(4, 16, 32, 8, kv_cache_dtype="fp8", scale=value)


def test_cache_scale_set_in_place() -> None:
    # The kernels (and captured CUDA graphs) read the tensor: assignment writes into it.
    cache = LatentKVCache(4, 2, 4, 0, kv_cache_dtype="fp8", dtype=torch.float32, scale=0.5)
    held = cache.scale
    cache.scale = torch.tensor(0.25, dtype=torch.float64)
    assert cache.scale is held and cache.scale.dtype == torch.float32
    REFERENCE.write_cache(cache.data, torch.ones(1, 4), torch.ones(1, 0),
                          torch.tensor([3]), cache.scale)
    assert cache.data.view(-1, 4)[3].float().tolist() == [4.0] * 4
    plain = LatentKVCache(4, 2, 4, 0, dtype=torch.float32)
    plain.scale = 4.0  # a cache in the model dtype has no scale: it stays 1
    assert plain.scale.item() == 1.0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cache_scale_assigned_after_a_graph_capture() -> None:
    # A graph captured over an fp8 cache holds the scale tensor's address: a scale
    # assigned afterwards (a host number, or a device tensor read once) reaches replays.
    cache = LatentKVCache(4, 16, 32, 8, kv_cache_dtype="fp8", dtype=torch.bfloat16,
                          device="cuda", scale=1.0)
    ops = registry.get_backend("auto", "cuda")
    kv_c = torch.ones(1, 32, dtype=torch.bfloat16, device="cuda")
    k_pe = torch.ones(1, 8, dtype=torch.bfloat16, device="cuda")
    slots = torch.tensor([5], device="cuda")
    ops.write_cache(cache.data, kv_c, k_pe, slots, cache.scale)  # compiles outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.write_cache(cache.data, kv_c, k_pe, slots, cache.scale)
    for scale in (0.5, torch.tensor(0.25, device="cuda")):
        cache.scale = scale
        graph.replay()
        want = 1 / float(scale)
        assert cache.data.view(-1, 40)[5].float().eq(want).all(), f"scale {scale}"
    with pytest.raises(ValueError, match="scale"):
        cache.scale = torch.tensor(0.0, device="cuda")
    assert cache.scale.item() == 0.25


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match="backend"):
        MLAAttention(DIMS, backend="no-such-backend")


def test_backend_registration_replaces_a_resolved_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Backends are resolved once per (name, device type); registering a name again
    must not leave callers with the old one."""
    monkeypatch.setattr(registry, "_LOADERS", dict(registry._LOADERS))
    first = replace(REFERENCE, name="first")
    second = replace(REFERENCE, name="second")
    registry.register_backend("swapped", lambda: first)
    assert registry.get_backend("swapped", "cpu") is first
    registry.register_backend("swapped", lambda: second)
    assert registry.get_backend("swapped", torch.device("cpu")) is second
    registry._RESOLVED.clear()  # forget "swapped" before the registry is restored


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_heads", 0),
        ("num_heads", -4),
        ("kv_lora_rank", 0),
        ("kv_lora_rank", -512),
        ("qk_nope_head_dim", 0),
        ("qk_rope_head_dim", -1),
        ("v_head_dim", 0),
        ("q_lora_rank", 0),
    ],
)
def test_dims_reject_non_positive(field: str, value: int) -> None:
    args = {"num_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
            "v_head_dim": 12, field: value}
    with pytest.raises(ValueError, match=field):
        MLADims(**args)


@pytest.mark.parametrize("value", [4.0, "4", None, True])
def test_dims_reject_non_integers(value) -> None:
    with pytest.raises(TypeError, match="num_heads"):
        MLADims(value, 32, 16, 8, 12)


def test_dims_derived_widths() -> None:
    d = MLADims(num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                v_head_dim=128)
    assert (d.qk_head_dim, d.cache_width, d.q_lora_rank) == (192, 576, None)
    assert MLADims(1, 48, 24, 0, 16).qk_head_dim == 24  # NoPE


# --- from_hf_config ------------------------------------------------------------------------------

V2_LITE = {
    "model_type": "deepseek_v2", "num_attention_heads": 16, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
}
V3 = {
    "model_type": "deepseek_v3", "num_attention_heads": 128, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0},
}
V4 = {
    "model_type": "deepseek_v4", "num_attention_heads": 64, "head_dim": 512,
    "qk_rope_head_dim": 64, "q_lora_rank": 1024, "compress_ratios": [0, 4, 128],
}


def test_from_hf_config_v2_lite() -> None:
    assert MLADims.from_hf_config(V2_LITE) == MLADims(16, 512, 128, 64, 128, q_lora_rank=None)


def test_from_hf_config_v2_without_q_lora_rank() -> None:
    cfg = {k: v for k, v in V2_LITE.items() if k != "q_lora_rank"}
    assert MLADims.from_hf_config(cfg).q_lora_rank is None


def test_from_hf_config_v3_and_head_override() -> None:
    assert MLADims.from_hf_config(V3) == MLADims(128, 512, 128, 64, 128, q_lora_rank=1536)
    # Heads per tensor-parallel rank.
    assert MLADims.from_hf_config(V3, num_heads=16).num_heads == 16


def test_from_hf_config_v4_style() -> None:
    # head_dim is the latent, the value and the query/key width; the last R are rotated.
    dims = MLADims.from_hf_config(V4)
    assert dims == MLADims(64, 512, 448, 64, 512, q_lora_rank=1024)
    assert dims.qk_head_dim == 512 and dims.cache_width == 576


def test_from_hf_config_v4_style_object() -> None:
    dims = MLADims.from_hf_config(SimpleNamespace(**V4))
    assert dims == MLADims(64, 512, 448, 64, 512, q_lora_rank=1024)


def test_from_hf_config_transformers_object() -> None:
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(num_attention_heads=8, kv_lora_rank=64, q_lora_rank=96,
                           qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24)
    assert MLADims.from_hf_config(cfg) == MLADims(8, 64, 32, 16, 24, q_lora_rank=96)
    full = MLADims.from_hf_config(DeepseekV3Config())
    assert full == MLADims(128, 512, 128, 64, 128, q_lora_rank=1536)


def test_from_hf_config_missing_field() -> None:
    cfg = {k: v for k, v in V2_LITE.items() if k != "kv_lora_rank"}
    with pytest.raises(ValueError, match="kv_lora_rank"):
        MLADims.from_hf_config(cfg)
