"""Decode steps replayed from CUDA graphs give what eager steps give.

CPU parts check the pieces graphs rely on (the size ladder, input staging; the
sync-free expert kernel is tested in test_model_ops); the engine comparison needs a GPU
and is skipped without one.
"""

from __future__ import annotations

import pytest
import torch

from pagedmla import LLM, SamplingParams
from pagedmla.engine.cuda_graph import GraphInputs, capture_sizes, graph_widths
from pagedmla.metadata import BatchSpec
from pagedmla.models.tiny import write_tiny_checkpoint
from tests.engine_helpers import assert_same_completions


def test_capture_sizes_cover_every_batch() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256
    assert all(any(s >= b for s in sizes) for b in range(1, 257))


def test_graph_widths_of_dense_and_sparse_models() -> None:
    """Dense decode graphs take the whole table; a sparse model's start at the width
    that holds top-k positions and grow 4x, the whole table last."""
    assert graph_widths(2560, 64, None) == [2560]
    assert graph_widths(2560, 64, 2048) == [32, 128, 512, 2048, 2560]
    assert graph_widths(2048, 64, 2048) == [32, 128, 512, 2048]
    assert graph_widths(40, 4, 12) == [3, 12, 40]
    assert graph_widths(3, 4, 12) == [3]
    assert graph_widths(2, 4, 12) == [2]


def _decode_spec(table: list[list[int]], slots: list[int], seq_lens: list[int]) -> BatchSpec:
    return BatchSpec([1] * len(slots), seq_lens, torch.tensor(table, dtype=torch.int32),
                     torch.tensor(slots, dtype=torch.int64))


def test_graph_inputs_stage_pads_and_checks() -> None:
    """Staged rows hold the step, padding rows nothing, and nothing of an earlier step."""
    inputs = GraphInputs(max_rows=8, max_blocks=5, num_slots=64, num_blocks=16,
                         device=torch.device("cpu"))
    index = inputs.stage(4, torch.tensor([11, 12, 13]), torch.tensor([5, 6, 7]),
                         _decode_spec([[1, 2], [3, 4], [5, 6]], [21, 29, 38], [6, 7, 8]), [0, 2])
    assert index.tolist() == [0, 2]
    assert inputs.token_ids[:4].tolist() == [11, 12, 13, 0]
    assert inputs.positions[:4].tolist() == [5, 6, 7, 0]
    assert inputs.slot_mapping[:4].tolist() == [21, 29, 38, -1]
    assert inputs.seq_lens[:4].tolist() == [6, 7, 8, 0]
    assert inputs.block_table[:4].tolist() == [[1, 2, 0, 0, 0], [3, 4, 0, 0, 0],
                                               [5, 6, 0, 0, 0], [0] * 5]
    assert inputs.query_start_loc.tolist() == list(range(9))
    index = inputs.stage(2, torch.tensor([9]), torch.tensor([2]),
                         _decode_spec([[7]], [28], [3]), [0])
    assert index.tolist() == [0]
    assert inputs.token_ids[:2].tolist() == [9, 0]
    assert inputs.slot_mapping[:2].tolist() == [28, -1]
    assert inputs.seq_lens[:2].tolist() == [3, 0]
    assert inputs.block_table[:2].tolist() == [[7, 0, 0, 0, 0], [0] * 5]
    one = (torch.tensor([1]), torch.tensor([1]))
    with pytest.raises(ValueError, match="slot"):
        inputs.stage(1, *one, _decode_spec([[1]], [64], [2]), [0])
    with pytest.raises(ValueError, match="blocks"):
        inputs.stage(1, *one, _decode_spec([[16]], [5], [2]), [0])
    with pytest.raises(ValueError, match="columns"):
        inputs.stage(1, *one, _decode_spec([[1] * 6], [5], [2]), [0])


def _count_calls(owner: object | None, name: str) -> list[int]:
    """A counter of owner.name's calls that return something other than None or False
    (stays [0] without the owner): wraps the method on that instance."""
    count = [0]
    if owner is not None:
        method = getattr(owner, name)

        def counted(*args):
            result = method(*args)
            count[0] += result is not None and result is not False
            return result

        setattr(owner, name, counted)
    return count


def _count_piece_steps(llm: LLM) -> list[int]:
    """A counter of the steps that run as piecewise graphs."""
    return _count_calls(llm.runner.pieces, "run")


def _count_decode_row_steps(llm: LLM) -> list[int]:
    """A counter of the steps whose decode rows replay `DecodeRowGraphs`."""
    pieces = llm.runner.pieces
    return _count_calls(pieces and pieces.decode_rows, "stage")


def _count_prompt_steps(llm: LLM) -> list[int]:
    """A counter of the steps that replay one graph of the whole step (prompts taken
    by `PromptRows`)."""
    pieces = llm.runner.pieces
    return _count_calls(pieces and pieces.prompt_rows, "stage")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_graphs_match_eager() -> None:
    """Greedy tokens identical and logprobs within 1e-3 (float32 model, Triton kernels);
    batches of 1..12 decodes replay padded graphs of 1, 2, 4, 8 and 16 rows. Graphs with
    async scheduling too: rows leave from the front (max_tokens 13 + i), so the ahead
    steps gather their token ids from the device, and one sequence stops on a token.
    A budget of 48 tokens a step cuts the longer prompts into chunks that share steps
    with decodes, whose rows then replay `DecodeRowGraphs`; the first step's prompts,
    without context, replay graphs of the whole step."""
    prompts = [[(7 * i + j) % 250 + 3 for j in range(5 + 9 * i)] for i in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=13 + i, logprobs=1, ignore_eos=True)
              for i in range(12)]
    runs = []
    for eager, ahead in ((True, False), (False, False), (False, True)):
        llm = LLM("tiny", dtype=torch.float32, device="cuda", block_size=16,
                  max_num_seqs=16, max_num_batched_tokens=48, enforce_eager=eager,
                  num_kv_blocks=512, async_scheduling=ahead)
        if not runs:  # stop sequence 5 on its 7th token, in every run
            first = llm.generate(prompts, params, use_tqdm=False)[5].outputs[0].token_ids
            params[5] = SamplingParams(temperature=0.0, max_tokens=18, logprobs=1,
                                       ignore_eos=True, stop_token_ids=[first[6]])
        pieces = _count_piece_steps(llm)
        decode_rows = _count_decode_row_steps(llm)
        prompt_rows = _count_prompt_steps(llm)
        runs.append(llm.generate(prompts, params, use_tqdm=False))
        assert (llm.runner.graphs is None) == eager
        assert (pieces[0] > 0) != eager  # the prompts' steps replayed piecewise graphs
        assert (decode_rows[0] > 0) != eager  # and decode rows among them theirs
        assert (prompt_rows[0] > 0) != eager  # and prompts theirs
    assert runs[0][5].outputs[0].finish_reason == "stop"
    for eager_out, *graph_outs in zip(*runs, strict=True):
        a = eager_out.outputs[0]
        for b in (out.outputs[0] for out in graph_outs):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            for step_a, step_b in zip(a.logprobs, b.logprobs, strict=True):
                for token, value in step_a.items():
                    assert abs(value - step_b[token]) < 1e-3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_weights_graphs_match_eager(tmp_path) -> None:
    """A block-fp8 checkpoint keeps its weights in fp8 on the GPU, and decode steps that
    run the fp8 GEMMs and fp8 experts replay in CUDA graphs: greedy tokens identical to
    eager and logprobs within 1e-3 (float32 activations, quantized to e4m3 in both)."""
    model = str(write_tiny_checkpoint(tmp_path, fp8=True))
    prompts = [[(5 * i + j) % 250 + 3 for j in range(4 + 7 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=1, ignore_eos=True)
    runs = []
    for eager in (True, False):
        llm = LLM(model, dtype=torch.float32, device="cuda", block_size=16, max_num_seqs=8,
                  enforce_eager=eager, num_kv_blocks=256)
        assert llm.model.state_dict()["layers.1.mlp.w13"].dtype == torch.float8_e4m3fn
        assert (llm.runner.graphs is None) == eager
        runs.append(llm.generate(prompts, params, use_tqdm=False))
        llm.close()
    assert_same_completions(*runs)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize(("dcp", "checkpoint"), [(1, False), (2, False), (1, True)])
def test_parallel_graphs_match_eager(dcp: int, checkpoint: bool, tmp_path) -> None:
    """Tensor parallel 2 (NCCL, a spawned worker), alone and with decode context
    parallel 2: every rank captures the decode graphs with the collectives inside and
    stages its own slots and cache lengths. Greedy tokens identical to eager steps of
    the same parallel layout and logprobs within 1e-3; close() reaps the worker. With
    `checkpoint`, the tiny model is a block-fp8 checkpoint each rank reads its slices
    of (the built-in one is loaded whole, then sharded)."""
    model = str(write_tiny_checkpoint(tmp_path, fp8=True)) if checkpoint else "tiny"
    prompts = [[(5 * i + j) % 250 + 3 for j in range(4 + 11 * i)] for i in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=9 + 2 * i, logprobs=1,
                             ignore_eos=True) for i in range(6)]
    runs = []
    for eager in (True, False):
        with LLM(model, dtype=torch.float32, device="cuda", block_size=16,
                 max_num_seqs=8, enforce_eager=eager, num_kv_blocks=256,
                 tensor_parallel_size=2, decode_context_parallel_size=dcp) as llm:
            assert (llm.runner.graphs is None) == eager
            pieces = _count_piece_steps(llm)
            runs.append(llm.generate(prompts, params, use_tqdm=False))
            assert (pieces[0] > 0) != eager
            workers = list(llm.parallel.workers.procs)
        assert not any(proc.is_alive() for proc in workers)
    assert_same_completions(*runs)
