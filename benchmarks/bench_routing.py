"""The measured MQA/MHA crossover: one MLA layer's time on each path per query length.

For B requests of q new tokens over C cached tokens, MLAAttention runs once forced onto
the absorbed MQA path (decode_threshold = q) and once onto the MHA path with chunked
context (decode_threshold = 1, no router), bf16, Triton kernels. The measured crossover
(largest q where MQA is faster) is printed next to PathCostModel's prediction.

    python -m benchmarks.bench_routing --out routing.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pagedmla import BatchSpec, LatentKVCache, MLAAttention, MLADims, MLAMetadataBuilder
from pagedmla.routing import PathCostModel


def measure(dims: MLADims, batch: int, q: int, context: int, device: str, backend: str,
            dtype: torch.dtype, block: int = 64) -> dict[str, float]:
    """Milliseconds of one MLAAttention forward on each path for B requests of q tokens
    over `context` cached rows (random latents)."""
    seq = context + q
    per_req = -(-seq // block)
    cache = LatentKVCache(1 + batch * per_req, block, dims.kv_lora_rank,
                          dims.qk_rope_head_dim, dtype=dtype, device=device)
    cache.data.normal_()
    table = (1 + torch.arange(batch * per_req, dtype=torch.int32)).view(batch, per_req)
    pos = torch.arange(context, seq)
    slots = (table[:, pos // block].long() * block + pos % block).reshape(-1)
    spec = BatchSpec([q] * batch, [seq] * batch, table, slots)
    T = batch * q
    make = dict(device=device, dtype=dtype)
    inputs = (torch.randn(T, dims.num_heads, dims.qk_head_dim, **make),
              torch.randn(T, dims.kv_lora_rank, **make),
              torch.randn(T, dims.qk_rope_head_dim, **make))
    w = torch.randn(dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim),
                    dims.kv_lora_rank, **make) * dims.kv_lora_rank**-0.5
    attn = MLAAttention(dims, dims.qk_head_dim**-0.5, w, backend=backend)
    times = {}
    # A one-token request is a decode on either builder: time it once.
    for path, threshold in (("mqa", q), ("mha", 1))[: 1 if q == 1 else 2]:
        builder = MLAMetadataBuilder(dims, block_size=block, device=device,
                                     decode_threshold=threshold)
        meta = builder.build(spec)
        times[path] = time_ms(lambda meta=meta: attn(*inputs, cache, meta), device)
    return times


def time_ms(fn, device: str, repeats: int = 10) -> float:
    """Median milliseconds of fn() after one warm-up (CUDA events on a GPU)."""
    fn()
    if device == "cpu":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[len(times) // 2]
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--contexts", default="4096,32768")
    parser.add_argument("--query-lens", default="1,8,16,32,64,128,256")
    parser.add_argument("--heads", default="16,128")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--out", default="routing.json")
    args = parser.parse_args()
    model = PathCostModel()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    query_lens = [int(q) for q in args.query_lens.split(",")]
    rows, summary = [], []
    for heads in map(int, args.heads.split(",")):
        dims = MLADims(heads, 512, 128, 64, 128)
        for context in map(int, args.contexts.split(",")):
            measured = 0
            for q in query_lens:
                times = measure(dims, args.batch, q, context, args.device, args.backend, dtype)
                if "mha" not in times or times["mqa"] < times["mha"]:
                    measured = q
                rows.append(dict(heads=heads, context=context, q=q, **times,
                                 model_prefers_mqa=model.prefers_mqa(dims, q, context)))
                print(rows[-1], flush=True)
            summary.append(dict(heads=heads, context=context, measured_crossover=measured,
                                predicted_crossover=model.crossover(dims, context,
                                                                    limit=max(query_lens))))
    with open(args.out, "w") as f:
        json.dump({"device": args.device, "batch": args.batch, "rows": rows,
                   "summary": summary}, f, indent=1)
    print("\n| heads | context | measured crossover q (largest q with MQA faster, of the "
          "sampled q) | predicted |\n|---|---|---|---|")
    for s in summary:
        print(f"| {s['heads']} | {s['context']} | {s['measured_crossover']} | "
              f"{s['predicted_crossover']} |")


if __name__ == "__main__":
    main()
