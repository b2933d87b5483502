"""Engine decode steps on a GPU: time per step and the host's share of it.

Writes a random-weight DeepSeek checkpoint (V2-Lite attention: 16 heads, L 512, R 64,
P 128, V 128; dense MLPs so that MoE dispatch does not dominate), fills the engine
with `--batch` requests and times decode-only steps. Host time: scheduling, inputs,
metadata (eager) or graph input staging, kernel launches (eager), and after the sampled
tokens arrive, their map and the bookkeeping; i.e. everything but launching the sampler
and waiting for the device; step time: all of it to a device sync. Part of the host
time overlaps the device (a graph replay's launch runs while its first kernels do), so
the step is also split by CUDA events: the device span from the first enqueue to the
sampler's end, and the GPU idle time (step minus span: scheduling, input preparation
and bookkeeping that nothing overlaps). Eager and CUDA-graph engines run in the same
process.

    python3 benchmarks/bench_engine.py --out engine.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from pagedmla import LLM, SamplingParams
from pagedmla.engine.sampler import sample
from pagedmla.engine.sequence import Sequence
from pagedmla.models.tiny import tiny_config, write_tiny_checkpoint


def bench_config(layers: int, hidden: int) -> dict:
    config = tiny_config()
    config.update(
        vocab_size=32000, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, first_k_dense_replace=layers, num_attention_heads=16,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, max_position_embeddings=8192,
    )
    return config


def time_steps(llm: LLM, batch: int, prompt_len: int, steps: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    vocab = llm.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        llm.scheduler.add(Sequence(10_000 + i, ids, params))
    host, total, device = [], [], []
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    while llm.scheduler.has_unfinished() and len(total) < steps:
        torch.cuda.synchronize()
        start = time.perf_counter()
        scheduled = llm.scheduler.schedule()
        token_ids, positions, spec = llm.runner.prepare(scheduled)
        rows = llm.runner.sample_rows(scheduled)
        first.record()
        logits = llm.runner.execute(token_ids, positions, spec, rows)
        launched = time.perf_counter()  # execute only enqueues: its wall time is host work
        seqs = [s for s, need in zip(scheduled.seqs, scheduled.needs_sample, strict=True) if need]
        tokens, logprobs = sample(logits, [s.params for s in seqs], [None] * len(seqs))
        last.record()
        token_list = tokens.tolist()  # waits for the device: the one blocking call
        synced = time.perf_counter()
        sampled = {s.seq_id: (t, lp) for s, t, lp in zip(seqs, token_list, logprobs,
                                                          strict=True)}
        llm.scheduler.postprocess(scheduled, sampled)
        torch.cuda.synchronize()
        end = time.perf_counter()
        if all(n == 1 for n in scheduled.num_new_tokens) and len(scheduled.seqs) == batch:
            host.append((launched - start) + (end - synced))
            total.append(end - start)
            device.append(first.elapsed_time(last) / 1e3)
    for seq in list(llm.scheduler.running):
        llm.block_manager.free(seq)
    llm.scheduler.running.clear()
    llm.scheduler.waiting.clear()
    step = statistics.median(total)
    host_s = statistics.median(host)
    idle = statistics.median(t - d for t, d in zip(total, device, strict=True))
    return {"step_ms": step * 1e3, "host_ms": host_s * 1e3, "host_share": host_s / step,
            "device_span_ms": statistics.median(device) * 1e3, "idle_ms": idle * 1e3,
            "idle_share": idle / step, "decode_steps": len(total), "tokens_per_s": batch / step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="engine.json")
    args = parser.parse_args()
    config = bench_config(args.layers, args.hidden)
    results = {"gpu": torch.cuda.get_device_name(), "args": vars(args), "runs": {}}
    with tempfile.TemporaryDirectory() as directory:
        write_tiny_checkpoint(directory, config=config)
        for eager in (True, False):
            llm = LLM(directory, dtype=torch.bfloat16, device="cuda", block_size=64,
                      max_num_seqs=args.batch, max_num_batched_tokens=16384,
                      enforce_eager=eager, num_kv_blocks=4096)
            results["runs"]["eager" if eager else "cuda_graphs"] = time_steps(
                llm, args.batch, args.prompt_len, args.steps
            )
            del llm
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nengine decode, batch {args.batch}, context ~{args.prompt_len}, "
          f"{args.layers} layers, {results['gpu']}")
    print("| mode | step ms | host ms | host share | device span ms | GPU idle ms | idle share "
          "| tok/s |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode, r in results["runs"].items():
        print(f"| {mode} | {r['step_ms']:.2f} | {r['host_ms']:.2f} | "
              f"{100 * r['host_share']:.1f}% | {r['device_span_ms']:.2f} | {r['idle_ms']:.2f} | "
              f"{100 * r['idle_share']:.1f}% | {r['tokens_per_s']:.0f} |")


if __name__ == "__main__":
    main()
