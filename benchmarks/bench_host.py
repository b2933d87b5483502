"""Host-side cost of an engine decode step, without the model: scheduling, inputs,
CUDA-graph input staging and bookkeeping for `--batch` running sequences (the part
CUDA graphs cannot hide).

The step is the one `benchmarks.bench_engine` times as host work on the graph path: schedule,
prepare, sample_rows, staging of the graph inputs (here into CPU buffers), turning
the sampled token ids into the per-sequence map, and postprocess.

    python -m benchmarks.bench_host --batch 128
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedmla import LLM, SamplingParams
from pagedmla.engine.cuda_graph import GraphInputs
from pagedmla.engine.sequence import Sequence


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    llm = LLM("tiny", device="cpu", max_num_seqs=args.batch, block_size=64,
              num_kv_blocks=args.batch * (-(-(args.prompt_len + 2 * args.steps) // 64)) + 1)
    params = SamplingParams(temperature=0.0, max_tokens=4 * args.steps, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    scheduler, runner = llm.scheduler, llm.runner
    cache = llm.caches[0]
    # What DecodeGraphs would hold for this engine (LLM sizes its table the same way).
    inputs = GraphInputs(args.batch, -(-llm.max_model_len // cache.block_size),
                         cache.num_slots, cache.num_blocks, cache.device)
    for i in range(args.batch):
        prompt = torch.randint(3, 250, (args.prompt_len,), generator=gen).tolist()
        scheduler.add(Sequence(i, prompt, params))

    def step(stage: bool) -> int:
        """One step of bookkeeping; every sampled token is 5 (no model runs)."""
        batch = scheduler.schedule()
        token_ids, positions, spec = runner.prepare(batch)
        rows = runner.sample_rows(batch)
        if stage:
            inputs.stage(len(batch.seqs), token_ids, positions, spec, rows)
        sampled = [s for s, need in zip(batch.seqs, batch.needs_sample, strict=True) if need]
        tokens = [5] * len(sampled)  # stands for sample(...)'s token ids, .tolist()
        scheduler.postprocess(batch, {s.seq_id: (t, {}) for s, t in zip(sampled, tokens,
                                                                         strict=True)})
        return len(batch.seqs)

    while scheduler.waiting or any(s.num_uncomputed > 1 for s in scheduler.running):
        step(stage=False)  # the prompts' prefill, uncounted
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        size = step(stage=True)
        times.append(time.perf_counter() - start)
    print(f"decode step bookkeeping at batch {size}: median "
          f"{statistics.median(times) * 1e3:.3f} ms over {args.steps} steps")


if __name__ == "__main__":
    main()
