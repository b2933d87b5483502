"""Host-side cost of an engine decode step, without the model: scheduling, inputs,
bookkeeping for `--batch` running sequences (the part CUDA graphs cannot hide).

    python3 benchmarks/bench_host.py --batch 128
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedmla import LLM, SamplingParams
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
    for i in range(args.batch):
        prompt = torch.randint(3, 250, (args.prompt_len,), generator=gen).tolist()
        scheduler.add(Sequence(i, prompt, params))

    def step() -> int:
        """One step of bookkeeping; every sampled token is 5 (no model runs)."""
        batch = scheduler.schedule()
        _, _, spec = runner.prepare(batch)
        runner.sample_rows(batch)
        torch.tensor(spec.seq_lens, dtype=torch.int32)  # the graph runner's one extra copy
        scheduler.postprocess(batch, {s.seq_id: (5, {}) for s, need in
                                      zip(batch.seqs, batch.needs_sample, strict=True) if need})
        return len(batch.seqs)

    while scheduler.waiting or any(s.num_uncomputed > 1 for s in scheduler.running):
        step()  # the prompts' prefill, uncounted
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        size = step()
        times.append(time.perf_counter() - start)
    print(f"decode step bookkeeping at batch {size}: median "
          f"{statistics.median(times) * 1e3:.3f} ms over {args.steps} steps")


if __name__ == "__main__":
    main()
