"""Steps run as pieces around attention (PiecewiseGraphs) give what whole steps give.

On the CPU the pieces are called instead of replayed, which checks everything but the
capture itself: the static buffers crossing each attention, the padding of T up to a
bucket, the eager fallback above the largest bucket. On a GPU the engine captures them
(tests/test_cuda_graph.py compares graph engines, pieces included, with eager ones).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from pagedmla import LLM, SamplingParams
from pagedmla.engine.decode_rows import decode_row_sizes
from pagedmla.engine.piecewise import MAX_TOKENS, PiecewiseGraphs, token_buckets
from pagedmla.engine.prompt_rows import PromptRows
from pagedmla.metadata import BatchSpec

GREEDY = SamplingParams(temperature=0.0, max_tokens=7, logprobs=1, ignore_eos=True)
OPTIONS = dict(dtype=torch.float32, device="cpu", block_size=8, num_kv_blocks=64,
               max_num_batched_tokens=40)


def test_decode_row_sizes() -> None:
    assert decode_row_sizes(1) == [1]
    assert decode_row_sizes(2) == [1, 2]
    assert decode_row_sizes(5) == [1, 2, 4, 5]
    assert decode_row_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert decode_row_sizes(149) == [1, 2, 4, 8, 16, 32, 64, 128, 149]


def test_token_buckets() -> None:
    assert token_buckets(1) == [16]
    assert token_buckets(16) == [16]
    assert token_buckets(40) == [16, 32, 64]
    assert token_buckets(129) == [16, 32, 64, 128, 160]
    assert token_buckets(640) == [16, 32, 64, 128, 160, 192, 224, 256, 320, 384, 448, 512,
                                  640]
    buckets = token_buckets(1 << 20)
    assert buckets[-1] == MAX_TOKENS and len(buckets) == 20
    # Above 128 tokens a step is padded by at most a quarter.
    assert all(b <= 1.25 * a for a, b in itertools.pairwise(buckets[3:]))


def _assert_same_generations(expected: list, outputs: list) -> None:
    """Greedy tokens identical, and their logprobs within 1e-4."""
    for ref, out in zip(expected, outputs, strict=True):
        want, got = ref.outputs[0], out.outputs[0]
        assert got.token_ids == want.token_ids
        for token, a, b in zip(got.token_ids, want.logprobs, got.logprobs, strict=True):
            assert abs(a[token] - b[token]) <= 1e-4


def _record_whole_steps(pieces: PiecewiseGraphs) -> list[int]:
    """A list that records the decode rows' size of each whole step `pieces` runs."""
    sizes: list[int] = []
    body = pieces._step

    def recorded(rows, size, decode_meta):
        sizes.append(size)
        return body(rows, size, decode_meta)

    pieces._step = recorded
    return sizes


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 259, (24,), generator=gen).tolist()
    lengths = (1, 5, 13, 31, 70, 9)
    fresh = [torch.randint(0, 259, (n,), generator=gen).tolist() for n in lengths]
    # Shared prefixes: later prompts start from cached blocks (context, no recompute).
    return [*fresh, prefix + fresh[1], prefix + fresh[3]]


@pytest.mark.parametrize(
    ("buckets", "decode_sizes", "prompt_graphs"),
    [(token_buckets(40), None, False), ([16], None, False),
     (token_buckets(40), [1, 2, 4, 16], False), (token_buckets(40), [1, 2], False),
     (token_buckets(40), [1, 2, 4, 16], True), (token_buckets(40), [1, 2], True)],
)
def test_pieces_match_whole_steps(buckets: list[int], decode_sizes: list[int] | None,
                                  prompt_graphs: bool) -> None:
    """Greedy tokens identical and logprobs within 1e-4 (float32: padded GEMMs may sum in
    another order). The 40-token budget makes mixed and chunked steps of 1-40 tokens;
    with buckets [16] the larger ones fall back to whole eager steps. With decode_sizes
    the decode rows of mixed steps attend through `DecodeRowGraphs`' static buffers,
    padded up to a size (called, not replayed, on the CPU), and steps with more decode
    rows than the largest size keep the eager path. With prompt_graphs, steps whose
    other rows are prompts without context run as one graph of the whole step (its body
    called), their attention through `PromptRows`' buffers; chunks after a prompt's
    first, and prompts on a cached prefix, have context and stay eager."""
    prompts = _prompts()
    reference = LLM("tiny", **OPTIONS)
    expected = [reference.generate(prompts, GREEDY, use_tqdm=False) for _ in range(2)]

    llm = LLM("tiny", **OPTIONS)
    pieces = PiecewiseGraphs(llm.model, llm.caches, buckets)
    llm.runner.pieces = pieces
    # (decode requests, leading single-token ones, rows taken) of each step
    staged: list[tuple[int, int, int]] = []
    if decode_sizes is not None:
        pieces.capture_decode_rows(decode_sizes,
                                   -(-llm.max_model_len // OPTIONS["block_size"]),
                                   llm.max_model_len)
        stage = pieces.decode_rows.stage

        def counted_stage(meta):
            taken = stage(meta)
            lens = meta.decode.query_lens if meta.decode is not None else []
            lead = next((b for b, n in enumerate(lens) if n != 1), len(lens))
            staged.append((meta.num_decodes, lead, 0 if taken is None else taken[0]))
            if taken is not None:
                first, rest = taken
                assert rest.num_tokens == meta.num_tokens - first
                assert rest.num_decodes == meta.num_decodes - first
                assert rest.prefill is meta.prefill
            return taken

        pieces.decode_rows.stage = counted_stage
    prompt_steps: list[bool] = []  # per step with prompts: staged into PromptRows
    if prompt_graphs:
        pieces.capture_steps()
        stage_prompts = pieces.prompt_rows.stage

        def counted_prompts(meta, first, rows):
            taken = stage_prompts(meta, first, rows)
            if meta.prefill is not None:
                prompt_steps.append(taken)
            return taken

        pieces.prompt_rows.stage = counted_prompts
        step_sizes = _record_whole_steps(pieces)
    sizes: list[int] = []
    run = pieces.run

    def counted(token_ids, *args):
        sizes.append(token_ids.shape[0])
        return run(token_ids, *args)

    pieces.run = counted
    outputs, steps = [], 0
    for _ in range(2):
        outputs.append(llm.generate(prompts, GREEDY, use_tqdm=False))
        steps += llm.stats.steps
    assert sizes and all(n <= buckets[-1] for n in sizes)
    assert any(n not in buckets for n in sizes)  # padded steps ran
    # Every step ran in pieces (CPU: no whole-step graphs), but those above the buckets.
    assert (steps > len(sizes)) == (buckets[-1] < OPTIONS["max_num_batched_tokens"])
    if decode_sizes is not None:
        # Every step's leading single-token decodes were taken where the sizes hold them.
        assert all(k == (lead if lead <= decode_sizes[-1] else 0) for _, lead, k in staged)
        taken = [k for _, _, k in staged if k]
        assert taken
        # Some steps also had decode requests of several tokens (extends the router sent
        # to MQA), which stayed eager beside the graphed rows.
        assert any(0 < k < n for n, _, k in staged)
        # Padded rows ran (e.g. 8 decodes in 16 rows) / steps of more stayed eager.
        assert any(k not in decode_sizes for k in taken) == (decode_sizes[-1] == 16)
        assert any(lead > decode_sizes[-1] for _, lead, _ in staged) == (decode_sizes[-1] == 2)
    if prompt_graphs:
        assert any(prompt_steps) and not all(prompt_steps)
        assert len(step_sizes) == sum(prompt_steps)  # each such step ran whole
    for ref_set, out_set in zip(expected, outputs, strict=True):
        _assert_same_generations(ref_set, out_set)


def test_more_tokens_than_the_largest_bucket_is_an_error() -> None:
    llm = LLM("tiny", **OPTIONS)
    pieces = PiecewiseGraphs(llm.model, llm.caches, [16])
    with pytest.raises(ValueError, match="largest bucket"):
        pieces.run(torch.zeros(17, dtype=torch.int64), torch.zeros(17, dtype=torch.int64),
                   None, [0])


def _spec(query_lens: list[int], seq_lens: list[int], block_size: int) -> BatchSpec:
    """Request b owns blocks 1 + 8b .. (disjoint), its new tokens at its last positions."""
    table = torch.tensor([[1 + 8 * b + j for j in range(8)] for b in range(len(seq_lens))],
                         dtype=torch.int32)
    slots = [int(table[b, p // block_size]) * block_size + p % block_size
             for b, (q, s) in enumerate(zip(query_lens, seq_lens)) for p in range(s - q, s)]
    return BatchSpec(query_lens, seq_lens, table, torch.tensor(slots, dtype=torch.int64))


def test_decode_rows_stage_pads_and_leaves_the_rest_eager() -> None:
    # Five single-token decodes and a 3-token extend the router sends to MQA, then a
    # prompt: K = 5 rows staged in a size of 8, the padded rows' slots -1 and lengths 0
    # (also after a step that filled them), and the rest's metadata over rows 5.. .
    llm = LLM("tiny", **OPTIONS)
    pieces = PiecewiseGraphs(llm.model, llm.caches, token_buckets(40))
    block = OPTIONS["block_size"]
    pieces.capture_decode_rows([1, 8], max_blocks_per_seq=8, max_model_len=64)
    graphs = pieces.decode_rows
    full = llm.builder.build(_spec([1] * 7, [9, 20, 3, 30, 17, 5, 40], block))
    assert graphs.stage(full.for_forward())[0] == 7
    spec = _spec([1, 1, 1, 1, 1, 3, 12], [9, 20, 3, 30, 17, 25, 12], block)
    meta = llm.builder.build(spec).for_forward()
    assert meta.num_decodes == 6  # the extend takes the MQA path
    first, rest = graphs.stage(meta)
    assert first == 5 and graphs.rows == 8
    inputs = graphs.inputs
    assert inputs.slot_mapping[:5].tolist() == spec.slot_mapping[:5].tolist()
    assert inputs.slot_mapping[5:8].tolist() == [-1] * 3
    assert inputs.seq_lens[:8].tolist() == [9, 20, 3, 30, 17, 0, 0, 0]
    assert inputs.block_table[:5].tolist() == spec.block_table[:5].tolist()
    assert (rest.num_tokens, rest.num_decodes, rest.num_decode_tokens) == (15, 1, 3)
    assert rest.slot_mapping.tolist() == spec.slot_mapping[5:].tolist()
    assert rest.decode.query_start_loc.tolist() == [0, 3]
    assert rest.decode.seq_lens.tolist() == [25] and rest.decode.query_lens == [3]
    assert rest.prefill is meta.prefill
    # No leading single-token decode, or more than the largest size: nothing staged.
    assert graphs.stage(llm.builder.build(_spec([3, 12], [25, 12], block))) is None
    assert graphs.stage(llm.builder.build(_spec([1] * 9, [5] * 9, block))) is None


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_prompt_graphs_beside_graphed_decodes(kv_cache_dtype: str) -> None:
    # Two sequences at a time, generating 3-9 tokens each: each prompt after the first
    # two is admitted while the other request decodes, so its step has a graphed decode
    # row before the prompt's rows, which `PromptRows` attends (called) with the decode
    # row in its first sequence. Only the prompt's rows may reach the output and cache
    # (fp8: quantized as the eager step quantizes them).
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 259, (n,), generator=gen).tolist() for n in (3, 9, 14, 6, 11)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=1, ignore_eos=True)
              for n in (3, 9, 5, 8, 4)]
    options = dict(OPTIONS, max_num_seqs=2, kv_cache_dtype=kv_cache_dtype)
    expected = LLM("tiny", **options).generate(prompts, params, use_tqdm=False)
    llm = LLM("tiny", **options)
    pieces = PiecewiseGraphs(llm.model, llm.caches, token_buckets(40))
    llm.runner.pieces = pieces
    pieces.capture_decode_rows([1, 2], -(-llm.max_model_len // OPTIONS["block_size"]),
                               llm.max_model_len)
    pieces.capture_steps()
    stage = pieces.prompt_rows.stage
    firsts: list[int] = []  # rows before the prompts, in each step staged

    def counted(meta, first, rows):
        taken = stage(meta, first, rows)
        if taken:
            firsts.append(first)
        return taken

    pieces.prompt_rows.stage = counted
    step_sizes = _record_whole_steps(pieces)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert firsts == [0, 1, 1, 1]  # the first two together, then one beside a decode
    assert step_sizes == [0, 1, 1, 1]  # each ran as one whole step, with its decode row
    _assert_same_generations(expected, outputs)


def test_prompt_rows_stage_cuts_the_rows_into_sequences() -> None:
    # Two single-token decodes (taken by the decode-row graphs), then prompts of 5 and 3
    # tokens without context: rows 2..9 of a 16-row bucket. The sequences are rows 0-1,
    # the two prompts, six empty ones and the padding rows 10-15; slots are -1 outside the
    # prompts (also after a step that filled them) and only the prompts' rows are kept.
    llm = LLM("tiny", **OPTIONS)
    pieces = PiecewiseGraphs(llm.model, llm.caches, token_buckets(40))
    block = OPTIONS["block_size"]
    pieces.capture_decode_rows([1, 8], max_blocks_per_seq=8, max_model_len=64)
    pieces.capture_steps()
    graphs = pieces.prompt_rows
    assert graphs.stage(llm.builder.build(_spec([16], [16], block)), 0, 16)
    spec = _spec([1, 1, 5, 3], [9, 20, 5, 3], block)
    meta = llm.builder.build(spec).for_forward()
    first, rest = pieces.decode_rows.stage(meta)
    assert first == 2 and graphs.stage(rest, first, 16)
    assert graphs.cu_seqlens.tolist() == [0, 2, 7, 10, 10, 10, 10, 10, 10, 10, 16]
    slots = spec.slot_mapping.tolist()
    assert graphs.slot_mapping[:16].tolist() == [-1, -1, *slots[2:], *[-1] * 6]
    assert graphs.keep[:16, 0].tolist() == [False] * 2 + [True] * 8 + [False] * 6
    # Not staged: decodes left to the eager path, a prompt with context, more prompts
    # than the graphs hold.
    assert not graphs.stage(meta, 0, 16)
    assert not graphs.stage(llm.builder.build(_spec([4], [12], block)), 0, 16)
    one = PromptRows(pieces.decoder.layers, pieces.caches, [16, 32], max_prompts=1)
    assert not one.stage(rest, first, 16)
    assert one.stage(llm.builder.build(_spec([5], [5], block)), 0, 16)
