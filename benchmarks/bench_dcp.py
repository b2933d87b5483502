"""Decode context parallelism on two GPUs (NCCL): parity, decode throughput, max context.

    python -m benchmarks.bench_dcp --out bench_dcp.json                   # 2 GPUs
    python -m benchmarks.bench_dcp --device cpu --tiny --out /tmp/dcp.json  # CPU smoke test

1. Decode, tp 2 with dcp 1 and dcp 2, on a DeepSeek-V2-Lite-shaped model (hidden 2048,
   27 layers, 16 heads, L 512, R 64, P 128, V 128, 64 experts top-6, 2 shared) whose
   random weights are drawn on each GPU (no checkpoint). Both ranks run the engine's
   per-step work (metadata build, model forward, all-gathered logits) on B requests
   whose caches already hold C tokens of random latents; a step's time is the median
   over --steps steps after warm-up, throughput is B / step time. Max context: the
   cache blocks that fit in --gpu-memory-utilization of the GPU after the model and the
   workspace (the rule of LLM._auto_num_blocks), times the tokens a block stands for
   (block_size * dcp): with dcp 2 each rank keeps half of every sequence's latents.
2. Parity: LLM("tiny", float32) with tp 2 + dcp 2 against one process, a mixed batch
   with chunked prefill and a shared prefix: greedy tokens identical, logprobs within
   1e-4. Run last, in this process (rank 0), once the decode ranks have exited.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing as mp
import queue
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from pagedmla import BatchSpec, LatentKVCache
from pagedmla.distributed.dcp_layout import DCPLayout
from pagedmla.distributed.dcp_metadata import DCPMetadataBuilder
from pagedmla.distributed.state import ParallelState
from pagedmla.distributed.tensor_parallel import parallelize
from pagedmla.engine.memory import cache_block_bytes, workspace_bytes
from pagedmla.metadata import MLAMetadataBuilder
from pagedmla.models.config import DeepseekConfig
from pagedmla.models.deepseek import DeepseekForCausalLM
from pagedmla.models.tiny import tiny_config

TP = 2
V2_LITE = dict(
    architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400,
    hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
    num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
    q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1,
    topk_method="greedy", scoring_func="softmax", n_group=1, topk_group=1,
    norm_topk_prob=False, routed_scaling_factor=1.0, rms_norm_eps=1e-6,
    max_position_embeddings=163840, rope_theta=10000.0, tie_word_embeddings=False,
    rope_scaling=dict(type="yarn", rope_type="yarn", factor=40.0,
                      original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                      mscale=0.707, mscale_all_dim=0.707),
)


def random_model(config: dict, dtype: torch.dtype, device: torch.device) -> DeepseekForCausalLM:
    """The model with N(0, 1/fan_in) weights drawn where they live (embedding N(0, 1))."""
    model = DeepseekForCausalLM(DeepseekConfig.from_dict(config), dtype=dtype, device=device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 1.0 if "embed_tokens" in name else param.shape[-1] ** -0.5)
    model.process_weights_after_loading()
    return model


def fitting_blocks(model: torch.nn.Module, builder: MLAMetadataBuilder, block_size: int,
                   dtype: torch.dtype, utilization: float, device: torch.device) -> int:
    """Cache blocks per rank that fit after the model and the workspace (LLM's rule)."""
    if device.type != "cuda":
        return 4096
    d = model.dims
    per_block = cache_block_bytes(d, block_size, dtype, model.config.num_hidden_layers)
    free, total = torch.cuda.mem_get_info(device)
    workspace = workspace_bytes(d, builder.workspace_rows, dtype)
    return int((free - (1.0 - utilization) * total - workspace) // per_block)


def decode_step_times(model, state, layout, args, dtype, batch: int, context: int) -> list[float]:
    """Seconds per decode step of `batch` requests whose caches hold `context` tokens."""
    device = state.device
    d = model.dims
    if layout is None:
        builder = MLAMetadataBuilder(d, block_size=args.block_size, device=device)
        tokens_per_block = args.block_size
    else:
        builder = DCPMetadataBuilder(d, layout, state, device=device)
        tokens_per_block = layout.virtual_block_size
    per_request = math.ceil((context + args.steps + args.warmup) / tokens_per_block)
    caches = [LatentKVCache(1 + batch * per_request, args.block_size, d.kv_lora_rank,
                            d.qk_rope_head_dim, dtype=dtype, device=device)
              for _ in range(model.config.num_hidden_layers)]
    for cache in caches:
        cache.data.normal_()
    table = (1 + torch.arange(batch * per_request, dtype=torch.int32)).view(batch, per_request)
    ids = torch.randint(0, model.config.vocab_size, (batch,), device=device)
    times = []
    for step in range(args.warmup + args.steps):
        seq = context + step + 1
        block, offset = table[:, (seq - 1) // tokens_per_block], (seq - 1) % tokens_per_block
        spec = BatchSpec([1] * batch, [seq] * batch, table,
                         block.to(torch.int64) * tokens_per_block + offset)
        positions = torch.full((batch,), seq - 1, dtype=torch.int64, device=device)
        _sync(device)
        state.barrier()
        start = time.perf_counter()
        with torch.inference_mode():
            hidden = model(ids, positions, caches, builder.build(spec))
            ids = model.compute_logits(hidden).argmax(dim=-1)
        _sync(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    del caches
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return times


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_rank(rank: int, port: int, args: argparse.Namespace, results) -> None:
    """One of the TP ranks: build the sharded model once, then measure dcp 1 and dcp 2."""
    device = torch.device(args.device if args.device == "cpu" else f"cuda:{rank}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    config = tiny_config() if args.tiny else V2_LITE
    torch.manual_seed(0)  # identical (replicated) weights on both ranks before sharding
    states = {dcp: ParallelState.connect(TP, dcp, device) for dcp in (1, 2)}
    model = parallelize(random_model(config, dtype, device), states[1])
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rows = []
    for dcp, state in states.items():
        layout = None if dcp == 1 else DCPLayout(dcp, state.dcp_rank, 1, args.block_size)
        builder = (MLAMetadataBuilder(model.dims, block_size=args.block_size, device=device)
                   if layout is None else DCPMetadataBuilder(model.dims, layout, state,
                                                            device=device))
        blocks = state.min_over_ranks(fitting_blocks(
            model, builder, args.block_size, dtype, args.gpu_memory_utilization, device))
        tokens_per_block = args.block_size * dcp
        for batch in args.batch_sizes:
            for context in args.contexts:
                needed = batch * math.ceil((context + args.steps + args.warmup)
                                           / tokens_per_block) + 1
                row = dict(dcp=dcp, batch=batch, context=context,
                           max_context_tokens=blocks * tokens_per_block)
                if needed > blocks:
                    row["fits"] = False
                else:
                    times = decode_step_times(model, state, layout, args, dtype, batch, context)
                    step = statistics.median(times)
                    row.update(fits=True, step_ms=step * 1e3, tokens_per_s=batch / step)
                rows.append(row)
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def run_decode(args: argparse.Namespace) -> list[dict]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=decode_rank, args=(r, port, args, results)) for r in range(TP)]
    for proc in procs:
        proc.start()
    while True:
        try:
            rows = results.get(timeout=5)
            break
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                for proc in procs:
                    proc.kill()
                raise RuntimeError(f"a decode rank failed (exit codes {failed})") from None
    for proc in procs:
        proc.join()
    return rows


def run_parity(args: argparse.Namespace) -> dict:
    from pagedmla import LLM, SamplingParams

    gen = torch.Generator().manual_seed(0)
    lens = (1, 3, 17, 40, 2, 64, 9, 130)
    prompts = [torch.randint(0, 259, (n,), generator=gen).tolist() for n in lens]
    prefix = torch.randint(0, 259, (48,), generator=gen).tolist()
    shared = [prefix + torch.randint(0, 259, (n,), generator=gen).tolist() for n in (1, 9, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1, ignore_eos=True)
    options = dict(dtype=torch.float32, device=args.device, block_size=16, num_kv_blocks=256,
                   max_num_batched_tokens=32, workspace_rows=64)
    outputs = {}
    for name, parallel in (("single", {}), ("tp2_dcp2", dict(
            tensor_parallel_size=2, decode_context_parallel_size=2))):
        with LLM("tiny", **options, **parallel) as llm:
            outputs[name] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)
                             + llm.generate(shared, params, use_tqdm=False)]
    same, worst = True, 0.0
    for ref, got in zip(outputs["single"], outputs["tp2_dcp2"], strict=True):
        same &= ref.token_ids == got.token_ids
        for token, want, have in zip(got.token_ids, ref.logprobs, got.logprobs):
            worst = max(worst, abs(have[token] - want.get(token, math.inf)))
    return dict(tokens_identical=same, max_logprob_diff=worst,
                passed=bool(same and worst <= 1e-4))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="tiny model and sizes (smoke test)")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-sizes", default=None, help="comma list (default 1,32,128)")
    parser.add_argument("--contexts", default=None, help="comma list (default 4096,32768)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--skip-parity", action="store_true")
    parser.add_argument("--out", default="bench_dcp.json")
    args = parser.parse_args()
    default_batches, default_contexts = ("2,4", "40,200") if args.tiny else ("1,32,128",
                                                                             "4096,32768")
    args.batch_sizes = [int(x) for x in (args.batch_sizes or default_batches).split(",")]
    args.contexts = [int(x) for x in (args.contexts or default_contexts).split(",")]
    if args.tiny:
        args.block_size, args.steps, args.warmup = min(args.block_size, 16), 3, 1
    if args.device == "cuda" and torch.cuda.device_count() < TP:
        raise SystemExit(f"needs {TP} GPUs, found {torch.cuda.device_count()}")

    rows = run_decode(args)
    print("| dcp | batch | context | step ms | tokens/s | max context tokens |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        timing = (f"{row['step_ms']:.2f} | {row['tokens_per_s']:.1f}" if row["fits"]
                  else "does not fit | -")
        print(f"| {row['dcp']} | {row['batch']} | {row['context']} | {timing} | "
              f"{row['max_context_tokens']} |")
    parity = None if args.skip_parity else run_parity(args)
    if parity is not None:
        print(f"parity tp2+dcp2 vs 1 process: {'PASS' if parity['passed'] else 'FAIL'} "
              f"(tokens identical {parity['tokens_identical']}, max logprob diff "
              f"{parity['max_logprob_diff']:.2e})")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    report = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        torch=torch.__version__, commit=commit.stdout.strip(), command=" ".join(sys.argv),
        model="tiny" if args.tiny else "DeepSeek-V2-Lite shape, random weights",
        tensor_parallel_size=TP, block_size=args.block_size, decode=rows, parity=parity,
    )
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    return 0 if parity is None or parity["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
