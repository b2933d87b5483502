"""Engine decode steps on a GPU: time per step and the host's share of it.

Writes a random-weight DeepSeek checkpoint (V2-Lite attention: 16 heads, L 512, R 64,
P 128, V 128; dense MLPs so that MoE dispatch does not dominate), fills the engine
with `--batch` requests and times decode-only steps, driven as `LLM.generate` drives
them (`LLM.launch` / `LLM.complete`, `Scheduler.schedule_ahead` when async). Step
time: wall time between two steps' completions. Host time: the part of it the host
is busy (scheduling, inputs, metadata or graph staging, launches, sampling launch,
the token map and bookkeeping), i.e. all but the wait for the sampled tokens. Device
span: CUDA events around a step's enqueues, so the GPU time from reaching the step's
first work to its last; GPU idle = step - span, the host work that nothing overlaps.
Modes, in one process: eager, CUDA graphs, CUDA graphs with async scheduling, and that
with the step under torch.compile (`compiled_async`: `LLM(compile=True)`, whose steps
with prompts run the compiled step whole instead of piecewise graphs) or batch invariant
(`invariant_async`: `LLM(batch_invariant=True)`). With
`--tensor-parallel 2` the engine spawns a second rank (NCCL); `--dcp 2` adds decode
context parallelism over the same two ranks. `--sparse` puts DeepSeek-V3.2's attention
(q LoRA, a lightning indexer per layer, top-k 2048) in place of V2-Lite's: its decode
steps replay graphs per batch size and block-table width, its other steps run eagerly.

    python -m benchmarks.bench_engine --out engine.json
    python -m benchmarks.bench_engine --sparse --batch 64 --prompt-len 4096 \
        --modes eager,cuda_graphs_async --out engine_sparse.json

`--arrivals N` also times steps that add one N-token prompt each to the decodes
(continuous arrivals): mixed steps, planned ahead in the async mode as decode steps
are, eager in the eager mode. In the graph modes such a step replays one graph of the
whole step (`PiecewiseGraphs.capture_steps`: the decode rows' attention as
`DecodeRowGraphs` runs it, the new prompt's as `PromptRows` does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from pagedmla import LLM, SamplingParams
from pagedmla.engine.scheduler import ScheduledBatch
from pagedmla.engine.sequence import Sequence
from pagedmla.engine.step_loop import LaunchedStep
from pagedmla.models.tiny import tiny_config, write_tiny_checkpoint

BATCHED_TOKENS = 16384  # max_num_batched_tokens of the engines measured


def bench_config(layers: int, hidden: int, moe: bool = False, sparse: bool = False) -> dict:
    """V2-Lite's attention and depth options; dense MLPs, or with `moe` V2-Lite's
    experts after the first layer (64 routed, top 6, greedy softmax routing, 2 shared,
    1408 wide); with `sparse` DeepSeek-V3.2's attention in place of V2-Lite's (q LoRA
    1536, a lightning indexer per layer: 64 heads of 128, top-k 2048)."""
    config = tiny_config()
    config.update(
        vocab_size=32000, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, first_k_dense_replace=layers, num_attention_heads=16,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, max_position_embeddings=8192,
    )
    if sparse:
        config.update(model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"],
                      q_lora_rank=1536, index_n_heads=64, index_head_dim=128,
                      index_topk=2048, max_position_embeddings=16384)
    if moe:
        config.update(
            intermediate_size=10944, first_k_dense_replace=1, n_routed_experts=64,
            num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=1408,
            n_group=1, topk_group=1, topk_method="greedy", scoring_func="softmax",
            norm_topk_prob=False, routed_scaling_factor=1.0,
        )
    return config


def _prefill_steps(batch: int, prompt_len: int) -> int:
    """Steps that the batch's prompts take at BATCHED_TOKENS a step; meanwhile the
    requests whose prompts are in already decode."""
    return -(-batch * prompt_len // BATCHED_TOKENS)


def _add_requests(llm: LLM, gen: torch.Generator, first_id: int, count: int, length: int,
                  params: SamplingParams) -> None:
    """`count` requests of `length` random tokens, ids first_id.., straight to the
    scheduler (the benchmarks drive the steps themselves)."""
    for i in range(count):
        ids = torch.randint(0, llm.config.vocab_size, (length,), generator=gen).tolist()
        llm.scheduler.add(Sequence(first_id + i, ids, params))


def _drop_requests(llm: LLM) -> None:
    """Forget every request and free its blocks, so that the next measurement starts
    from an empty engine."""
    for seq in list(llm.scheduler.running):
        llm.block_manager.free(seq)
    llm.scheduler.running.clear()
    llm.scheduler.waiting.clear()


def _timed_launch(llm: LLM, events: dict) -> Callable[..., LaunchedStep]:
    """`llm.launch` with CUDA events recorded around the step's enqueues, kept in
    `events` under the launched step's id."""

    def launch(scheduled: ScheduledBatch, before: LaunchedStep | None = None) -> LaunchedStep:
        first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        first.record()
        launched = llm.launch(scheduled, {}, before)
        last.record()
        events[id(launched)] = (first, last)
        return launched

    return launch


def time_steps(llm: LLM, batch: int, prompt_len: int, steps: int) -> dict[str, float]:
    # Long enough that the first prompts' requests still run when the last prompt is in.
    max_tokens = steps + 8 + _prefill_steps(batch, prompt_len)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    _add_requests(llm, torch.Generator().manual_seed(0), 10_000, batch, prompt_len, params)
    events: dict[int, tuple[torch.cuda.Event, torch.cuda.Event]] = {}
    launch = _timed_launch(llm, events)
    total, host, device = [], [], []
    torch.cuda.synchronize()
    start = done = time.perf_counter()
    launched = None
    while (launched is not None or llm.scheduler.has_unfinished()) and len(total) < steps:
        if launched is None:
            launched = launch(llm.scheduler.schedule())
        ahead = llm.scheduler.schedule_ahead(launched.batch) if llm.async_scheduling else None
        following = None if ahead is None else launch(ahead, launched)
        waited = time.perf_counter()
        if launched.drawn is not None:
            launched.drawn.wait()  # the one blocking call: the sampled tokens' copy
        waited = time.perf_counter() - waited
        llm.complete(launched, start)
        previous, done = done, time.perf_counter()
        scheduled = launched.batch
        if all(n == 1 for n in scheduled.num_new_tokens) and len(scheduled.seqs) == batch:
            first, last = events[id(launched)]
            total.append(done - previous)
            host.append(done - previous - waited)
            device.append(first.elapsed_time(last) / 1e3)
        launched = following
    if launched is not None:
        llm.complete(launched, start)
    _drop_requests(llm)
    step = statistics.median(total)
    host_s = statistics.median(host)
    idle = statistics.median(t - d for t, d in zip(total, device, strict=True))
    return {"step_ms": step * 1e3, "host_ms": host_s * 1e3, "host_share": host_s / step,
            "device_span_ms": statistics.median(device) * 1e3, "idle_ms": idle * 1e3,
            "idle_share": idle / step, "decode_steps": len(total), "tokens_per_s": batch / step}


def time_mixed_steps(llm: LLM, batch: int, prompt_len: int, steps: int,
                     arrival_len: int) -> dict[str, float]:
    """Steps of `batch` decodes (and one more per step) plus one new `arrival_len`-token
    prompt each (continuous arrivals): in the graph modes one whole-step graph each (see
    the module docstring). Driven as `LLM.generate` drives them: with async scheduling each step is
    planned and enqueued while the one before runs (`Scheduler.schedule_ahead`), the
    prompt for it added just before (where a step is not planned ahead, its prompt
    waits for the next `schedule`). Step time: wall time between two steps'
    completions; device span as in `time_steps`. Medians after the first two steps
    (which may compile kernels for the new shapes)."""
    gen = torch.Generator().manual_seed(1)
    max_tokens = 2 * steps + 8 + _prefill_steps(batch, prompt_len)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    _add_requests(llm, gen, 20_000, batch, prompt_len, params)
    start = time.perf_counter()
    while llm.scheduler.waiting or any(
        seq.num_computed_tokens < seq.num_prompt_tokens for seq in llm.scheduler.running
    ):
        llm.step({}, start)
    events: dict[int, tuple[torch.cuda.Event, torch.cuda.Event]] = {}
    launch = _timed_launch(llm, events)
    arrivals = iter(range(30_000, 30_000 + steps + 3))

    def arrive() -> None:
        """The next step's prompt, unless one still waits (a step not planned ahead)."""
        if not llm.scheduler.waiting:
            _add_requests(llm, gen, next(arrivals), 1, arrival_len, params)

    times, spans, planned_ahead = [], [], []
    torch.cuda.synchronize()
    done = time.perf_counter()
    launched = None
    for _ in range(steps + 2):
        if launched is None:
            arrive()
            launched = launch(llm.scheduler.schedule())
        following = None
        if llm.async_scheduling:
            arrive()
            ahead = llm.scheduler.schedule_ahead(launched.batch)
            following = None if ahead is None else launch(ahead, launched)
        planned_ahead.append(launched.batch.ahead)
        prefilled = llm.stats.prefill_tokens
        llm.complete(launched, start)
        previous, done = done, time.perf_counter()
        if llm.stats.prefill_tokens - prefilled != arrival_len:
            raise RuntimeError("the new prompt was not prefilled in its step (max_num_seqs?)")
        first, last = events.pop(id(launched))
        times.append(done - previous)
        spans.append(first.elapsed_time(last) / 1e3)
        launched = following
    if launched is not None:
        llm.complete(launched, start)
    _drop_requests(llm)
    step = statistics.median(times[2:])
    return {"mixed_step_ms": step * 1e3,
            "mixed_span_ms": statistics.median(spans[2:]) * 1e3,
            "mixed_idle_ms": statistics.median(t - d for t, d in zip(times[2:], spans[2:]))
            * 1e3,
            "mixed_ahead_share": statistics.mean(planned_ahead[2:]),
            "arrival_len": arrival_len}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--moe", action="store_true", help="V2-Lite's routed experts")
    parser.add_argument("--sparse", action="store_true",
                        help="DeepSeek-V3.2's attention (lightning indexer, top-k 2048)")
    parser.add_argument("--modes", default="eager,cuda_graphs,cuda_graphs_async",
                        help="comma-separated, of those, compiled_async and invariant_async")
    parser.add_argument("--arrivals", type=int, default=0,
                        help="also time steps that add a prompt of this many tokens each")
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--dcp", type=int, default=1, help="decode context parallel size")
    parser.add_argument("--out", default="engine.json")
    args = parser.parse_args()
    config = bench_config(args.layers, args.hidden, args.moe, args.sparse)
    # Room for every request's prompt and tokens (so that no step preempts), 4096 at least.
    block_size = 64
    per_request = -(-(args.prompt_len + 2 * args.steps + 8
                      + _prefill_steps(args.batch, args.prompt_len)) // block_size)
    kv_blocks = max(4096, (args.batch + 2 * (args.steps + 3)) * per_request)
    results = {"gpu": torch.cuda.get_device_name(), "args": vars(args), "runs": {}}
    with tempfile.TemporaryDirectory() as directory:
        write_tiny_checkpoint(directory, config=config)
        modes = {"eager": (True, False, ""), "cuda_graphs": (False, False, ""),
                 "cuda_graphs_async": (False, True, ""),
                 "compiled_async": (False, True, "compile"),
                 "invariant_async": (False, True, "batch_invariant")}
        for mode in args.modes.split(","):
            eager, ahead, option = modes[mode]
            start = time.perf_counter()
            # No warm-up: the timed medians leave out the few steps that compile.
            llm = LLM(directory, dtype=torch.bfloat16, device="cuda", block_size=block_size,
                      max_num_seqs=args.batch + (args.steps + 3 if args.arrivals else 0),
                      max_num_batched_tokens=BATCHED_TOKENS,
                      enforce_eager=eager, num_kv_blocks=kv_blocks, async_scheduling=ahead,
                      tensor_parallel_size=args.tensor_parallel,
                      decode_context_parallel_size=args.dcp, warmup=False,
                      **({option: True} if option else {}))
            startup_s = time.perf_counter() - start
            results["runs"][mode] = time_steps(llm, args.batch, args.prompt_len, args.steps)
            results["runs"][mode]["startup_s"] = startup_s
            if args.arrivals:
                results["runs"][mode].update(time_mixed_steps(
                    llm, args.batch, args.prompt_len, args.steps, args.arrivals))
            llm.close()
            del llm
            torch.cuda.empty_cache()
            with open(args.out, "w") as f:  # after each mode: a cut-short run keeps its modes
                json.dump(results, f, indent=1)
    print(f"\nengine decode, batch {args.batch}, context ~{args.prompt_len}, "
          f"{args.layers} layers{' (MoE)' if args.moe else ''}"
          f"{' (sparse attention)' if args.sparse else ''}, "
          f"TP {args.tensor_parallel}, DCP {args.dcp}, {results['gpu']}")
    print("| mode | step ms | host ms | host share | device span ms | GPU idle ms | idle share "
          "| tok/s | start-up s |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, r in results["runs"].items():
        print(f"| {mode} | {r['step_ms']:.2f} | {r['host_ms']:.2f} | "
              f"{100 * r['host_share']:.1f}% | {r['device_span_ms']:.2f} | {r['idle_ms']:.2f} | "
              f"{100 * r['idle_share']:.1f}% | {r['tokens_per_s']:.0f} | "
              f"{r['startup_s']:.1f} |")
    if args.arrivals:
        print(f"\nsteps of {args.batch} decodes + one {args.arrivals}-token prompt:")
        print("| mode | step ms | device span ms | GPU idle ms | planned ahead |\n"
              "|---|---:|---:|---:|---:|")
        for mode, r in results["runs"].items():
            print(f"| {mode} | {r['mixed_step_ms']:.2f} | {r['mixed_span_ms']:.2f} | "
                  f"{r['mixed_idle_ms']:.2f} | {100 * r['mixed_ahead_share']:.0f}% |")


if __name__ == "__main__":
    main()
