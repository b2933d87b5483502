"""Tensor / decode context parallel LLMs (gloo CPU processes) against one process.

Every configuration runs the built-in tiny model in float32 over the same prompts as
a single-process LLM with the same options: greedy tokens must be identical and each
sampled token's logprob within 1e-4 (observed ~2e-6: only the order of float32 sums
differs, in all-reduces and log-sum-exp merges). The options force the hard paths:
prompts of 1-3 tokens (shorter than the DCP group: empty shards), a 16-token step
budget (chunked prefill, mixed decode/prefill steps) and a 16-row workspace (each
context split in several chunks), then prompts sharing a 40-token prefix (prefix
caching). One LLM per configuration serves all of its checks.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace

import pytest
import torch

from pagedmla import LLM, SamplingParams
from pagedmla.cli import main
from pagedmla.distributed import runtime
from pagedmla.distributed.channel import Kind
from pagedmla.distributed.launch import Workers
from pagedmla.engine import llm as llm_module
from tests.dist_helpers import free_port
from tests.engine_helpers import ahead_steps

LOGPROB_TOL = 1e-4
OPTIONS = dict(dtype=torch.float32, device="cpu", block_size=8, num_kv_blocks=48,
               max_num_batched_tokens=16, workspace_rows=16)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    gen = torch.Generator().manual_seed(0)

    def draw(n: int) -> list[int]:
        return torch.randint(0, 259, (n,), generator=gen).tolist()

    mixed = [draw(n) for n in (1, 3, 17, 40, 2, 64, 9)]
    prefix = draw(40)
    shared = [prefix + draw(n) for n in (1, 7, 20)]
    return mixed, shared


def _generate(llm: LLM, prompt_sets: tuple[list[list[int]], ...]) -> list:
    return [llm.generate(prompts, GREEDY, use_tqdm=False) for prompts in prompt_sets]


def _same(reference: list, outputs: list) -> None:
    for ref_set, out_set in zip(reference, outputs, strict=True):
        for ref, out in zip(ref_set, out_set, strict=True):
            expected, got = ref.outputs[0], out.outputs[0]
            assert got.token_ids == expected.token_ids
            for token, want, have in zip(got.token_ids, expected.logprobs, got.logprobs,
                                         strict=True):
                assert abs(have[token] - want[token]) <= LOGPROB_TOL


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module")
def prompt_sets():
    return _prompts()


@pytest.fixture(scope="module")
def reference(prompt_sets):
    """Single-process outputs, both prompt sets through one LLM, by (kv-cache dtype, block
    size). An fp8 run is compared at the block size the parallel block manager sees:
    prefix caching then reuses the same tokens, which an fp8 cache returns quantized
    while recomputed ones are not."""
    results = {}

    def outputs(kv_cache_dtype: str, block_size: int) -> list:
        key = (kv_cache_dtype, block_size)
        if key not in results:
            options = {**OPTIONS, "block_size": block_size}
            llm = LLM("tiny", kv_cache_dtype=kv_cache_dtype, **options)
            results[key] = _generate(llm, prompt_sets)
        return results[key]

    return outputs


@pytest.mark.parametrize(
    ("tp", "dcp", "interleave", "kv_cache_dtype", "num_kv_blocks"),
    [(2, 1, 1, "auto", 48), (2, 2, 1, "auto", 48), (4, 2, 2, "auto", 48),
     (4, 4, 1, "auto", 5), (2, 2, 2, "fp8", 48)],
)
def test_parallel_matches_single_process(tp, dcp, interleave, kv_cache_dtype, num_kv_blocks,
                                         prompt_sets, reference) -> None:
    tight = num_kv_blocks < 16  # 4 usable blocks of 8 x 4 tokens: requests must wait
    with LLM("tiny", tensor_parallel_size=tp, decode_context_parallel_size=dcp,
             cp_kv_cache_interleave_size=interleave, kv_cache_dtype=kv_cache_dtype,
             **{**OPTIONS, "num_kv_blocks": num_kv_blocks}) as llm:
        pids = llm.parallel.workers.pids
        assert len(pids) == tp - 1
        mixed = llm.generate(prompt_sets[0], GREEDY, use_tqdm=False)
        assert llm.stats.steps > 10  # a small budget: prompts span several steps
        assert (llm.stats.preemptions > 0) == tight
        fed = sum(len(p) for p in prompt_sets[1])
        shared = llm.generate(prompt_sets[1], GREEDY, use_tqdm=False)
        if not tight:
            assert llm.stats.prefill_tokens < fed  # the shared prefix came from the cache
        # The block manager sees dcp times the tokens per block: the group's capacity.
        assert llm.block_manager.block_size == OPTIONS["block_size"] * dcp
    block_size = OPTIONS["block_size"] * (dcp if kv_cache_dtype == "fp8" else 1)
    _same(reference(kv_cache_dtype, block_size), [mixed, shared])
    assert all(_gone(pid) for pid in pids), "a worker outlived close()"


@pytest.mark.parametrize(("tp", "dcp", "pcp"), [(1, 1, 2), (1, 1, 4), (2, 2, 2)])
def test_prefill_context_parallel_matches_single_process(tp, dcp, pcp, prompt_sets,
                                                         reference) -> None:
    """P replicas split the steps with prompts (chunked, mixed with decodes, over cached
    prefixes) and run the decode steps alike: the single process's tokens."""
    with LLM("tiny", tensor_parallel_size=tp, decode_context_parallel_size=dcp,
             prefill_context_parallel_size=pcp, **OPTIONS) as llm:
        assert len(llm.parallel.workers.pids) == tp * pcp - 1
        outputs = _generate(llm, prompt_sets)
        assert llm.runner.pcp.steps_split > 3
        assert [report.rank for report in llm.memory_per_rank] == list(range(tp * pcp))
    _same(reference("auto", OPTIONS["block_size"]), outputs)


def test_dead_worker_is_a_clear_error_and_leaves_no_process() -> None:
    llm = LLM("tiny", tensor_parallel_size=2, **OPTIONS)
    pid = llm.parallel.workers.pids[0]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=rf"worker rank 1 \(pid {pid}\) was killed by signal"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert _gone(pid)
    with pytest.raises(RuntimeError, match="workers were stopped"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    llm.close()  # already stopped: a no-op


class _ExitingWorker:
    """A worker caught mid-exit: its sentinel has closed, but until joined it still reads
    as running (waitpid reports it a moment later, which on a loaded machine is often
    the case right after a SIGKILL)."""

    def __init__(self) -> None:
        self.sentinel, write = mp.Pipe(duplex=False)
        write.close()
        self.pid = 4242
        self.exitcode: int | None = None

    def join(self, timeout: float | None = None) -> None:
        self.exitcode = -signal.SIGKILL

    def is_alive(self) -> bool:
        return self.exitcode is None


def test_check_joins_a_worker_whose_sentinel_closed() -> None:
    # Read as running, such a worker would let the raw gloo error of the broken connection
    # through instead of naming the dead worker (the test above, on a loaded machine).
    workers = Workers.__new__(Workers)
    workers.procs, workers.pipes = [_ExitingWorker()], []
    with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid 4242\) was killed by signal 9"):
        workers.check()


def test_workers_exit_when_the_driver_dies(tmp_path) -> None:
    script = textwrap.dedent("""
        import os, signal, torch
        from pagedmla import LLM
        if __name__ == "__main__":
            llm = LLM("tiny", tensor_parallel_size=2, dtype=torch.float32, device="cpu",
                      num_kv_blocks=8)
            print(*llm.parallel.workers.pids, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    path = tmp_path / "driver.py"
    path.write_text(script)
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          timeout=120)
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 1, done.stderr
    deadline = time.monotonic() + 10
    while not all(_gone(p) or _is_zombie(p) for p in pids):
        assert time.monotonic() < deadline, "a worker outlived its driver"
        time.sleep(0.1)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] == "Z"
    except OSError:
        return True


def test_torchrun_every_rank_returns_the_outputs(tmp_path, prompt_sets, reference) -> None:
    script = textwrap.dedent(f"""
        import json, os, torch
        from pagedmla import LLM, SamplingParams
        llm = LLM("tiny", tensor_parallel_size=2, decode_context_parallel_size=2,
                  dtype=torch.float32, device="cpu", block_size=8, num_kv_blocks=48,
                  max_num_batched_tokens=16, workspace_rows=16)
        # (Every rank, as LLM() does on CUDA: the outputs after it are a fresh engine's.)
        llm.warm_up(show_progress=False)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        outs = llm.generate({prompt_sets[0]!r}, params, use_tqdm=False)
        print(json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
        llm.close()
        names = []
        for task in os.listdir("/proc/self/task"):
            try:
                names.append(open(f"/proc/self/task/{{task}}/comm").read().strip())
            except OSError:
                pass
        # One string, so one write: the two ranks share the pipe.
        print(f"gloo workers after close: {{names.count('pt_gloo_runloop')}}", flush=True)
    """)
    path = tmp_path / "spmd.py"
    path.write_text(script)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), str(path)],
        capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # Each rank prints its outputs once. Counted in the whole output, not line by line:
    # the ranks share the pipe and print writes a line's text and its newline apart, so
    # two lines can come out as "[[..]][[..]]\n\n".
    expected = str([o.outputs[0].token_ids for o in reference("auto", 8)[0]]).replace(" ", "")
    assert done.stdout.replace(" ", "").count(expected) == 2, done.stdout[-3000:]
    # close() leaves the group for good: its gloo worker threads (named pt_gloo_runloop
    # by PyTorch) are gone. A group kept alive past destroy_process_group makes ranks
    # abort at interpreter exit (see distributed/launch.py).
    assert done.stdout.count("gloo workers after close: 0") == 2, done.stdout[-2000:]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tensor_parallel_size=2, decode_context_parallel_size=3), "must divide"),
        (dict(tensor_parallel_size=3), "num_attention_heads \\(4\\) must be divisible"),
        (dict(tensor_parallel_size=2, decode_context_parallel_size=2,
              cp_kv_cache_interleave_size=3), "must divide block_size"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be an int >= 1"),
        (dict(prefill_context_parallel_size=0),
         "prefill_context_parallel_size must be an int >= 1"),
        (dict(prefill_context_parallel_size=2, batch_invariant=True),
         "batch_invariant=True needs prefill_context_parallel_size 1"),
    ],
)
def test_bad_sizes_fail_before_any_process_starts(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        LLM("tiny", **{**OPTIONS, **kwargs})


def test_cli_generate_with_parallel_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--device", "cpu", "--max-tokens", "3", "--block-size", "8",
                 "--num-kv-blocks", "16", "--tensor-parallel-size", "2",
                 "--decode-context-parallel-size", "2", "--cp-kv-cache-interleave-size", "2",
                 "--prefill-context-parallel-size", "2", "--prompt", "hello"]) == 0
    assert "completion:" in capsys.readouterr().out
    assert not torch.distributed.is_initialized()  # the LLM was dropped: workers stopped


@pytest.mark.parametrize("alive", [True, False])
def test_shutdown_order(monkeypatch: pytest.MonkeyPatch, alive: bool) -> None:
    """What close() does, in the order NCCL needs (the real thing runs on two GPUs in
    test_cuda_graph): the before-close callbacks (freeing captured graphs, which NCCL's
    teardown would otherwise wait for) first; with live workers the shutdown message,
    then leaving the group, whose teardown waits for every rank's, and only then
    reaping them; with a dead one, kill the rest first, then leave."""
    calls: list[tuple] = []

    class Proc:
        def is_alive(self) -> bool:
            return alive

    class Workers:
        def __init__(self) -> None:
            self.serving = True
            self.procs = [Proc()]

        def stop(self, graceful: bool = False) -> None:
            calls.append(("stop", graceful))

    class Channel:
        def send(self, kind: Kind) -> None:
            calls.append(("send", kind))

    monkeypatch.setattr(runtime.dist, "is_initialized", lambda: ("destroy",) not in calls)
    monkeypatch.setattr(runtime.dist, "destroy_process_group", lambda: calls.append(("destroy",)))
    runtime._shutdown(Workers(), Channel(), True, [lambda: calls.append(("graphs",))])
    if alive:
        assert calls == [("graphs",), ("send", Kind.SHUTDOWN), ("destroy",), ("stop", True)]
    else:
        assert calls == [("graphs",), ("stop", False), ("destroy",)]


@pytest.mark.parametrize(("tp", "dcp"), [(2, 1), (2, 2)])
def test_parallel_async_scheduling_matches_single_process(tp: int, dcp: int) -> None:
    """Ahead steps under TP / DCP: the step goes out before its token ids exist on the
    host, and the ranks receive them by a broadcast of rank 0's samples. Rows leave at
    different steps (max_tokens 3..9, one stop token), so later ahead steps gather a
    subset of the samples."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 259, (n,), generator=gen).tolist() for n in (3, 9, 17, 5)]
    params = [SamplingParams(temperature=0.0, max_tokens=3 + 2 * i, logprobs=1,
                             ignore_eos=True) for i in range(4)]
    options = {**OPTIONS, "max_num_batched_tokens": 64}
    single = LLM("tiny", async_scheduling=False, **options)
    stop = single.generate(prompts, params, use_tqdm=False)[3].outputs[0].token_ids[4]
    params[3] = replace(params[3], stop_token_ids=[stop])
    expected = single.generate(prompts, params, use_tqdm=False)
    with LLM("tiny", tensor_parallel_size=tp, decode_context_parallel_size=dcp,
             **options) as llm:
        assert llm.async_scheduling
        with ahead_steps(llm) as sizes:
            got = llm.generate(prompts, params, use_tqdm=False)
    assert sizes and min(sizes) < max(sizes)  # ahead steps ran, also after rows left
    assert expected[3].outputs[0].finish_reason == "stop"
    _same([expected], [got])


def test_a_failed_call_leaves_the_workers_consistent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C on the driver between steps (here in its sampler) aborts the call's requests;
    the workers hold no request state and serve the next call, which gives the
    single-process tokens. A failure while a step is being sent stops the workers, since
    the ranks may disagree on where they are; the driver is left idle all the same."""
    prompts, _ = _prompts()
    expected = LLM("tiny", **OPTIONS).generate(prompts, GREEDY, use_tqdm=False)
    with LLM("tiny", tensor_parallel_size=2, **OPTIONS) as llm:
        draw, calls = llm_module.draw, [0]

        def interrupted(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 4:
                raise KeyboardInterrupt
            return draw(*args, **kwargs)

        monkeypatch.setattr(llm_module, "draw", interrupted)
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[7] * 30, [8] * 50], GREEDY, use_tqdm=False)
        monkeypatch.undo()
        assert not llm.scheduler.has_unfinished()
        _same([expected], [llm.generate(prompts, GREEDY, use_tqdm=False)])
        monkeypatch.setattr(llm.parallel.channel, "send", _broken_send)
        with pytest.raises(ConnectionError):
            llm.generate(prompts, GREEDY, use_tqdm=False)
        manager = llm.block_manager
        assert not llm.scheduler.has_unfinished()
        assert manager.num_free_blocks == manager.num_usable_blocks
        assert not llm.parallel.is_open


def _broken_send(*args, **kwargs) -> None:
    raise ConnectionError("injected")


@pytest.mark.parametrize("sizes", [dict(tensor_parallel_size=2),
                                   dict(prefill_context_parallel_size=2)])
def test_online_engine_under_parallelism_matches_one_rank(sizes) -> None:
    """Requests added while others run, through an OnlineEngine over spawned TP 2 (or
    PCP 2) workers: the tokens of offline generate on one rank."""
    from pagedmla.engine.online import OnlineEngine

    prompts = [[3 + (7 * i + j) % 200 for j in range(5 + 6 * i)] for i in range(4)]
    want = [o.outputs[0].token_ids
            for o in LLM("tiny", **OPTIONS).generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM("tiny", **sizes, **OPTIONS)
    pids = list(llm.parallel.workers.pids)
    with OnlineEngine(llm) as engine:
        got = [[t for out in engine.stream(p, GREEDY) for t in out.token_ids]
               for p in prompts[:2]]
        outs: dict[int, list] = {2: [], 3: []}
        ids = [engine.add(prompts[i], GREEDY, outs[i].append) for i in (2, 3)]
        assert len(ids) == 2
        deadline = time.time() + 120
        while not all(o and o[-1].finish_reason for o in outs.values()):
            assert time.time() < deadline
            time.sleep(0.05)
    got += [[t for out in outs[i] for t in out.token_ids] for i in (2, 3)]
    assert got == want
    llm.close()
    assert all(_gone(pid) for pid in pids)
