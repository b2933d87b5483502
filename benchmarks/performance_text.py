"""The prose of docs/PERFORMANCE.md: what each table measures, and what limits each target.

`performance_report.py` puts the tables between these paragraphs. Nothing here is a
measured number of a result file; those come from docs/results/ only.
"""

INTRO = """\
# Performance

Current numbers of the Triton backend's kernels and of the engine on Hopper GPUs, against
each card's ceilings and the strongest baselines, rendered from [results/](results/) by
`python -m benchmarks.performance_report` (edit `benchmarks/performance_*.py`, not this
file). Kernels per GPU: [kernels.md](kernels.md); design: [design.md](design.md). CPU runs
(reference backend, Triton's interpreter) check correctness, not speed."""

METHOD = """\
- **Counted, then timed.** FLOPs and the fewest bytes moved are counted (decode: every cache
  row once, q, the output; 2·N·q_len·Σctx·(2L + R) FLOPs). Times: CUDA-event medians after
  warm-up (`triton.testing.do_bench`, which writes 256 MB before every call).
- **Decode** rows replay a CUDA graph of one `mla_decode` (stage 1 and the combine) planned
  before the capture, as all layers but a forward's first find it (`with_plan_us`: planned
  in the replay). **Prefill** rows time GPU work only: a spin kernel queued ahead keeps the
  host's launches ("host µs per call") off the clock. The wipe's dirty lines write back
  while timed; `pct_ceiling_clean_l2` wipes by reading; verdicts use the standard wipe.
- **Same-run ceilings and baselines** (ceilings: the table below; `same_size_read_us`: a
  plain read of a decode's bytes). Decode: PyTorch (`torch_decode`: gather, `bmm`, float32
  softmax, `bmm`) and our Triton kernel at 4 splits per request, as common Triton MLA
  kernels split; "vs strongest baseline": the faster one's time over ours. Prefill: SDPA on
  cuDNN; merge: `torch.compile` of the reference; experts: the reference op, a dense form.
- **Spread.** Unchanged code moves up to 3-5% between runs (the 64-row kernel at 128 × 8k up
  to 15%; the fp8 16-row kernel tracks the SM clock, lowered by the power cap: `sm_mhz`).
  A/B a change on one card: `python -m benchmarks.bench_kernels --out old.json` on the base
  tree, `--out new.json` on the change; `python -m benchmarks.compare_results old.json
  new.json` exits 1 where a row moved over 3%, lacks a partner or ran another config."""

TARGETS_INTRO = """\
Verdicts are computed from the rows of the tables below in each target's scope
("met on k of n" counts them); the last column names what bounds the kernel or engine."""

DECODE = """\
`mla_decode`, the absorbed MQA over the paged latent cache: L 512, R 64, bf16 queries,
64-token pages unless noted; stage 1 on Hopper a warp-specialized Gluon kernel
([kernels.md](kernels.md)), "Triton kernel µs" the portable one other GPUs run.
"% of ceiling": of HBM read where N·q_len ≤ 16 (memory-bound), else of bf16 matmul;
"fp8 speed-up": the bf16 cache's time over the fp8 one's. Each baseline's time: raw results."""

PLOTS = """\
Plots: [decode bandwidth](results/decode_bandwidth.png), [decode
TFLOP/s](results/decode_tflops.png), [prefill TFLOP/s](results/prefill_tflops.png)."""

SPLIT_PLAN = """\
Batches past one wave (132 SMs, a program each; at N = 128 a split is two programs, one per
64-row head group), each captured twice in one process: under the code's plan and without
its even and persistent layouts (one split per program); the replays (stage 1 and the
combine, after the L2 wipe) are timed alternately three times, medians kept. Speed-up: the
latter's time over the former's; TFLOP/s = 2·N·Σctx·(2L + R) / time."""

PREFILL = """\
Varlen attention with LSE, qk 192 / v 128, bf16. "Gluon kernel": `varlen_attention` as
dispatched on Hopper; "backend op": `prefill_attention`, which hands equal-length batches to
cuDNN and the rest to our kernel; "Triton kernel": the portable one; "vs cuDNN": cuDNN
SDPA's time over ours (ragged batches have no single-call SDPA)."""

MERGE = """\
`merge_attn_states` folds two partials [T, N, D] with their LSE into one: both partials and
LSEs read once, the output and its LSE written once."""

ENGINE = """\
`LLM.generate`'s steps; random weights, V2-Lite's attention (16 heads, L 512, R 64, P 128,
V 128), hidden 2048, vocabulary 32000, bf16, dense MLPs (MoE: 64 routed experts, top 6, 2
shared). Timed: decode steps after the prompts; "step ms" between step completions,
"host ms" its host-busy part, "GPU idle" the share the device waits for the host (CUDA
events); "vs eager": eager steps of the same run (no other engine measured)."""

PARALLEL = """\
Two H200s over NCCL, same model and batch: tensor parallel, and with decode context
parallelism (a rank holds half of each sequence's latents); collectives in the graphs."""

EXPERTS = """\
`fused_experts`: routed SwiGLU experts as two grouped GEMMs over tokens sorted by expert on
the device (no host sync), graphed; random routing. "grouped": the reference op (a matmul
per expert with tokens, counts read on the host), eager; "dense": every expert on every
token, weighted, graphed. Bytes: touched experts' weights, x, output."""

FP8_GEMM = """\
`ops.triton.fp8_linear`: y = x W^T, W fp8 e4m3 with a float32 scale per 128 × 128 block, x
bf16, quantized inside per token and 128-channel group; DeepSeek-V3's linears at TP 1.
Baselines: bf16 `torch.matmul` on the dequantized weight; `torch._scaled_mm` on e4m3 x and
W, per-tensor scales (x quantized untimed; M a multiple of 16, else "n/a"). Each is graphed
over weight copies filling 3x the L2, so every call reads its weight from HBM. "% HBM read":
weight bytes/s over the HBM read rate; TFLOP/s = 2·M·N·K / time; bold: target missed."""

FP8_EXPERTS = """\
`fused_experts` with block-fp8 experts (128 × 128 blocks, bf16 weights quantized) against
the same in bf16, both graphed, at V3's widths (top 8, H 7168, I 2048), random routing: all
256 experts on one GPU, and a rank's 32 at TP 8 (routing over 256, ~1/8 of pairs local).
Bytes: touched experts' weights and scales, x, output; FLOPs: local pairs."""

V3_LAYERS = """\
Random weights in DeepSeek-V3's shapes (hidden 7168, 128 heads, q_lora 1536, L 512, R 64,
256 routed experts of 2048, top 8, one shared, all layers MoE, vocabulary 129280), block fp8
and bf16, served by `LLM` with CUDA graphs on one GPU, all layers and one: a layer's figures
are the difference over the layers between (embedding, LM head, sampling drop out).
"load s": planning, reading weights (`LLM.memory`); decodes follow `--prompt-len` prompts."""

MEMORY_PLAN = """\
DeepSeek-V3/R1 (61 layers, no MTP layer), **computed on the CPU, not measured**
(`benchmarks/memory_plan.py`): each rank's model built on the meta device and sharded as the
engine shards it (W_UK, W_UV included, as `LLM.memory` counts); KV tokens: whole blocks in
gpu_memory_utilization of the card (H200 143,771 MiB, H100 81,559 MiB) less weights and
prefill workspace; CUDA context, activations and graph pools are not counted (a run holds
fewer). Without DCP each rank holds every token's latent (not split by heads); DCP 8 holds
8x per node. "does not fit": GiB missing for weights, workspace, smallest cache."""

SPARSE = """\
`sparse_attention` (`ops/triton/sparse_decode.py`, portable Triton): each query token
attends its indexer's top-k 2048 positions (64-token pages, random order); L 512, R 64,
N 128 (one GPU) or 16 (8 ranks), fp8_ds_mla (656-byte rows) or bf16 cache; 2·N·topk·(2L + R)
FLOPs per token. Decode: B requests of q_len tokens at 32k positions; "% of gather": a plain
gather of the same rows (faster of a Triton read, `torch.index_select`) over our time.
Prefill: S tokens after C positions; "ratio": TFLOP/s over the dense prefill op's on the S
tokens, causal (qk 192, v 128). Indexer (64 heads of 128, fp8 keys): parts time the last
chunk of query rows, "total" `indexer_topk` over all chunks; targets: DeepGEMM's logits
kernel and `torch.topk` on an H200, as measured by another engine."""

ROUTING = """\
Which path a request of q new tokens over C cached ones should take: absorbed MQA, or MHA
with chunked context. One `MLAAttention` forward per path from Python, bf16, Triton backend,
median of 10 CUDA-event timings (at small q MQA's time is the Python launch). The engine
routes extends by the cost model (`route_by_cost=True`); fresh prompts take MHA."""

STARTUP = """\
`bench_engine`'s 8 layers of V2-Lite attention, bf16, from an empty compile cache, then the
one it filled (~70 MB); phases: design.md, Start-up. Each workload runs twice on fresh
random prompts, first right after `LLM(...)`; "built": kernel variants built or loaded;
"fp8 scales": the fp8 cache's calibration (one prefill of 1024 random tokens)."""

MODES = """\
The engine of the table above (8 layers, batch 128, context ~1k) in the default mode and in
two others, one process: `compile=True` (the step under torch.compile, attention opaque;
decode steps replay CUDA graphs captured around it, steps with a prompt run it whole,
without piecewise graphs) and `batch_invariant=True` (forwards of 64 tokens, every token a
decode row, `invariant_decode`). Steps with the prompt: the decodes and one 256-token
prompt. `LLM(...)` without the warm-up, so with the compile's own time for `compile=True`."""

OUTPUT_QUANT = """\
The attention output into DeepSeek-V3's block-fp8 o_proj (7168 <- N · 128): bf16, which
`fp8_linear` quantizes (in its programs up to 64 rows, else in a pass of its own), or fp8
codes (power-of-two scales per 128 channels) from the kernel finishing the output
(`ops/output_quant.py`), read as is by `fp8_linear_quantized`. Stage: the decode's V
up-projection, a prompt's output copy (fp8: one-pass quantization) or the merge with the
context; a CUDA graph replay after an L2 wipe, with and without o_proj."""

# What bounds the kernel or the engine where a target is missed: one line each, the
# evidence being the kernels' profiles and same-run A/Bs.
LIMITS = {
    "first_call": "In these runs the split-KV planner and combine of decode rows run "
    "eagerly (steps past the largest piecewise graph, MQA extends) built a variant per "
    "request-count block and split count on first use (2-4, seconds each compiled, 0.1 s "
    "loaded). The engine now plans those rows for max_model_len, as its graphs do, and "
    "the warm-up walks their request counts: not yet measured.",
    "warm_start": "Measured on an H100: loading the weights (4.1 s) and capturing the "
    "graphs (3.7 s) dominate; the warm-up takes 1.3 s.",
    "memory_bound": "A one-wave grid pays ~22 µs of fixed cost (the write-back of the "
    "wipe's dirty lines, the slowest SMs, the combine, each program's prologue), which "
    "weighs on short grids; no plain read of as many bytes reaches 90% either "
    "(`same_size_read_us` in the raw results).",
    "compute_bound": "The tensor cores: the 64-row kernel's tiles run at ~93% of the "
    "matmul ceiling; past one wave each split adds a start and a float32 partial.",
    "one_long_request": "The tiles take ~30 µs at ~93% of the matmul ceiling; ~21 µs are "
    "fixed: the combine (~5.7), the float32 partials' store (~2.7), the first tile's "
    "arrival (~4.4) and a graph's floor after the wipe (~4.6).",
    "fp8": "The fp8 16-row kernel is bound by each consumer warpgroup's serial chain per "
    "tile, not by HBM: the ratio tends to 2 as slices grow, fixed costs set it on short "
    "grids and past one wave, and it follows the SM clock, which the power cap lowers.",
    "merge": "HBM bandwidth: both partials read once, the result written once.",
    "prefill_op": "Equal-length batches run on cuDNN itself; ragged batches and chunked "
    "context run the Gluon kernel.",
    "prefill_kernel": "The tensor cores, and at N = 128 reuse through L2: heads are "
    "launched in groups whose keys and values fit half the L2.",
    "gemm_read": "Not the HBM: each program quantizing its x tiles in every K step. On "
    "codes quantized beforehand the same GEMM runs o_proj (M 1 and 64) 2.4-3.2x faster "
    "(bench_output_quant on an H100: the attention output in fp8); `pick_config` still "
    "quantizes in the programs below 65 rows until bench_fp8_gemm --sweep confirms it "
    "for every shape.",
    "gemm_compute": "Pointer loads without the bulk-copy engine, and each 128-column K "
    "step scales its products by both block scales in float32 outside the tensor cores, "
    "which ends the asynchronous MMA chain every step (not yet profiled).",
    "engine": "Asynchronous scheduling plans and enqueues step n+1 while the device runs "
    "step n; the host's own work (Python per sequence) adds to a step only where it "
    "exceeds the device's time.",
    "sparse_tflops": "The portable Triton kernel (mma.sync, no wgmma): at 128 heads it "
    "holds all 255 registers a thread may use and spills with fp8_ds_mla, whose rows it "
    "dequantizes tile by tile; a Hopper wgmma kernel is needed.",
    "sparse_gather": "Each program's index load and the row gather it feeds form a "
    "dependent chain with one or two tiles in flight; fp8_ds_mla's 656-byte rows are "
    "dequantized inside the loop.",
    "indexer": "The parts around the logits kernel: the query preparation (Hadamard "
    "rotation, fp8 rounding) is about six PyTorch launches and the top-k is "
    "`torch.topk`, neither fused into the kernel.",
    "sparse_prefill": "One program per query token gathers that token's own top-k rows for "
    "its N heads only, so each gathered row feeds N·(2L + R) multiply-adds; dense prefill "
    "reuses each key tile across 64 or more query rows.",
}
