"""The prose of docs/PERFORMANCE.md: what each table measures, and what limits each target.

`performance_report.py` puts the tables between these paragraphs. Nothing here is a
measured number of a result file; those come from docs/results/ only.
"""

INTRO = """# Performance

Current numbers of the Triton backend's kernels and of the engine on NVIDIA H200 GPUs,
against the card's ceilings and the strongest baselines measured in the same run. This
file is rendered by `python -m benchmarks.performance_report` from the result files in
[results/](results/): edit `benchmarks/performance_report.py` or
`benchmarks/performance_text.py`, not this file. Each table names its card, the date and
commit measured, and the command that runs its benchmark. Which kernel runs on which
GPU: [kernels.md](kernels.md); how the code is built: [design.md](design.md)."""

METHOD = """- **Counted first.** FLOPs and the fewest bytes each kernel must move are counted
  before it is timed: decode reads every cache row once, plus q and the output, and does
  2·N·q_len·Σctx·(L + R) FLOPs for the scores and 2·N·q_len·Σctx·L for the values.
- **Timed on the device.** Medians of CUDA-event timings after warm-up
  (`triton.testing.do_bench`, which writes 256 MB, several L2s, before every call). A
  decode row replays a CUDA graph of one `mla_decode` (stage 1 and the combine) planned
  before the capture, as every layer but a forward's first finds it (`with_plan_us`:
  planned inside the replay). Prefill rows time GPU work only (a spin kernel queued
  ahead keeps the host's launches off the clock; "host µs per call" is that work).
- **Clean L2.** The wipe leaves dirty lines whose write-back shares HBM with the timed
  call; `pct_ceiling_clean_l2` wipes by reading instead. Verdicts use the standard wipe.
- **Ceilings and baselines in the same run.** HBM read: the faster of `torch.sum` and a
  plain Triton read of 4 GiB; device copy; bf16 matmul 8192³ (`same_size_read_us`: a
  plain read of a decode's bytes, fixed costs included). Decode baselines: plain PyTorch
  (`torch_decode`: gather, `bmm`, float32 softmax, `bmm`) and our Triton kernel with 4
  splits per request, as common Triton MLA kernels split; "vs strongest baseline" is the
  faster one's time over ours. Prefill: PyTorch SDPA on cuDNN. Merge: `torch.compile` of
  the reference. Routed experts: the reference op and a dense form.
- **Spread.** Rows of unchanged code move by up to 3-5% between runs (the 64-row kernel
  at 128 × 8k by up to 15%), so a change is judged by an A/B in one run on one card. The
  fp8 16-row kernel follows the SM clock, which the power cap lowers (`sm_mhz` per row).

**Checking a change for speed.** On one card, while the machine stays up:
`python -m benchmarks.bench_kernels --out old.json` on the base tree, `--out new.json` on
the change, then `python -m benchmarks.compare_results old.json new.json`: it exits 1
where a row moved by more than 3%, has no partner, or ran another kernel config."""

TARGETS_INTRO = """Each verdict is computed from the rows of the tables below that fall
in the target's scope; "met on k of n" lists every such row. The last column names what
bounds the kernel where a target is missed."""

DECODE = """`mla_decode`, the absorbed MQA over the paged latent cache: L 512, R 64, bf16
queries, 64-token pages unless noted. On Hopper, stage 1 is a warp-specialized Gluon
kernel (which one for a cache dtype and N·q_len: [kernels.md](kernels.md)); "Triton
kernel µs" times the portable Triton kernel on the same call in the same run, the one
other GPUs run. N·q_len ≤ 16 is memory-bound: "% of ceiling" is of the HBM read rate;
above it, of the bf16 matmul rate. "fp8 speed-up" is the bf16 cache's time over the fp8
cache's; "vs strongest baseline" the faster baseline's time over ours. The raw results
also hold each row's time with the split plan made inside the replay (`with_plan_us`),
after a clean L2 (`pct_ceiling_clean_l2`), against a plain read of as many bytes
(`same_size_read_us`), and each baseline's own time."""

PLOTS = """Plots of this run: [decode bandwidth](results/decode_bandwidth.png),
[decode TFLOP/s](results/decode_tflops.png), [prefill TFLOP/s](results/prefill_tflops.png)."""

SPLIT_PLAN = """Batches past one wave of programs, where the cut into splits matters most:
an H200's 132 SMs run one program each, and at N = 128 a split takes two programs (two
head groups of 64 rows). Each batch is captured twice in one process and the two replays
(stage 1 and the combine, after the L2 wipe) are timed alternately three times, medians
kept: under the plan the code makes and under the same plan without its even and
persistent layouts, one split per program; the speed-up is the latter's time over the
former's. TFLOP/s = 2·N·Σctx·(2L + R) / time. Each batch's times, splits and layout are
in the raw results."""

PREFILL = """Varlen attention with LSE, qk 192 / v 128 (DeepSeek's widths), bf16. "Gluon
kernel" is `varlen_attention` as dispatched on Hopper; "backend op" is
`prefill_attention`, which hands batches of equal-length sequences to cuDNN and
everything else to our kernel; "Triton kernel µs" times the portable kernel in the same
run. Ragged batches have no single-call SDPA baseline."""

MERGE = """`merge_attn_states` folds two partials [T, N, D] with their LSE into one:
both partials and LSEs read once, the output and its LSE written once."""

ENGINE = """`LLM` steps driven as `LLM.generate` drives them, on random weights with
DeepSeek-V2-Lite's attention (16 heads, L 512, R 64, P 128, V 128), hidden 2048, vocabulary
32000, bf16, dense MLPs (MoE: V2-Lite's 64 routed experts, top 6, 2 shared). Timed: the
decode-only steps after the batch's prompts; "step ms" between two steps' completions,
"host ms" the host's busy part of it, "GPU idle" the share in which the device waits for
the host (CUDA events). "vs eager": eager steps of the same run; no other engine measured."""

MIXED = """Continuous arrivals: each step holds the batch's decodes and one new prompt.
With CUDA graphs such a step replays one graph of the whole step
(`engine/prompt_rows.py`). "planned ahead" is the share of these steps that the
scheduler planned while the step before them ran."""

PARALLEL = """The same model and batch on two H200s over NCCL: tensor parallelism over
both ranks, and decode context parallelism over the same two (each rank holds half of
every sequence's latents). Every rank captures the decode graphs with the collectives
inside them."""

DCP = """DeepSeek-V2-Lite's shape (27 layers, 64 routed experts top 6, 2 shared), random
weights, bf16, TP 2, 64-token pages, eager steps. Decode context parallelism doubles the
context the cache holds. At the measured commit the eager routed experts synchronised
with the host every layer and dominate these steps: the table shows capacity, not the
speed of graphed steps (above)."""

EXPERTS = """`fused_experts`: routed SwiGLU experts as two grouped GEMMs over tokens sorted
by expert on the device (no host synchronisation), replayed from a CUDA graph.
"grouped": the reference op (one matmul per expert that got tokens, the counts read on
the host), eager; "dense": every expert on every token weighted by its routing weight,
graphed. Bytes: the weights of the experts the routing touches, plus x and the output;
random routing."""

FP8_GEMM = """`ops.triton.fp8_linear`: y = x W^T with W in fp8 e4m3, one float32 scale per
128 × 128 block, and x in bf16, quantized per token and 128-channel group inside (in the
GEMM's programs for few rows, a pass of its own for many), at DeepSeek-V3's linears at
tensor parallel 1. Baselines in the same run: bf16 `torch.matmul` on the dequantized
weight, and `torch._scaled_mm` on e4m3 x and W with per-tensor scales (x quantized
beforehand, not timed; it takes only M that are multiples of 16, else "n/a"). Each is
timed as a CUDA graph that calls it on one weight copy after another, enough copies to
exceed the L2 cache three times, so that every call reads its weight from HBM. "% HBM
read": the fp8 weight's bytes per second over the HBM read rate of the same run;
TFLOP/s = 2·M·N·K / time. Bold: a row that misses its target (see the targets)."""

FP8_EXPERTS = """`fused_experts` with block-fp8 experts (128 × 128 blocks: bf16 weights
quantized) against the same experts in bf16, both replayed from CUDA graphs, at
DeepSeek-V3's widths (top 8, H 7168, I 2048) with random routing: all 256 experts on
one GPU, and the 32 a rank holds at tensor parallel 8 (routing over 256, so about 1/8 of
the token-expert pairs are local). Bytes: the weights (and fp8 scales) of the experts
the routing touches, plus x and the output; FLOPs count the local pairs."""

V3_LAYERS = """A random-weight checkpoint of DeepSeek-V3's shapes (hidden 7168, 128 heads,
q_lora 1536, L 512, R 64, 256 routed experts of 2048, top 8, one shared, every layer MoE,
vocabulary 129280), in block fp8 as shipped and in bf16, served by `LLM` with CUDA graphs
on one GPU with all its layers and with one: a layer's figures are the difference over the
layers between them (embedding, LM head and sampling drop out). "load s": planning and
reading the weights (`LLM.memory`); decode steps run over `--prompt-len` prompts."""

MEMORY_PLAN = """DeepSeek-V3/R1 whole (61 layers; the multi-token prediction layer is not
loaded) at tensor parallel 8 on one node, **computed on the CPU, not measured**
(`benchmarks/memory_plan.py`): each rank's model is built on the meta device and sharded
as the engine shards it (W_UK and W_UV included, as `LLM.memory` counts them); the KV
tokens are whole 64-token blocks in gpu_memory_utilization of the card (H200 143,771 MiB,
H100 81,559 MiB) less the weights and the prefill workspace. The CUDA context,
activations and graph pools are not counted, so a run holds somewhat fewer. Without DCP
every rank holds every token's latent (one per token, not split by heads); with DCP 8
the node holds eight times as many. "does not fit": the GiB missing for the weights, the
workspace and the smallest cache."""

SPARSE = """`sparse_attention` (`ops/triton/sparse_decode.py`, a portable Triton kernel): each query
token attends the top-k 2048 positions its indexer picked (64-token pages in random
order), L 512, R 64, N 128 (one GPU) or 16 (over 8 ranks), an fp8_ds_mla (656-byte rows)
or bf16 cache; FLOPs 2·N·topk·(2L + R) per token. Decode: B requests of q_len tokens at
32k positions; "% of gather": the faster plain gather of the same rows (a Triton read,
`torch.index_select`) over the kernel's time. Prefill: S tokens after C positions;
"ratio": TFLOP/s over those of the dense prefill op on the same S tokens, causal over
themselves (qk 192, v 128). Indexer (64 heads of 128, fp8 keys): the parts time the last
chunk of query rows, "total" `indexer_topk` over all chunks; targets: DeepGEMM's logits
kernel with `torch.topk` on an H200, as another engine measured it."""

ROUTING = """Which path a request of q new tokens over C cached ones should take: the
absorbed MQA path, or the MHA path with chunked context. One `MLAAttention` forward per
path from Python, bf16, Triton backend, median of 10 CUDA-event timings; at small q the
MQA time is the layer's launch from Python, not its kernels. The engine routes extends
by the cost model (`route_by_cost=True`); fresh prompts always take MHA."""

CPU = """On the CPU the reference backend runs everything, and the tests run the Triton
kernels in Triton's interpreter: both are for correctness and CI, not measured here.
`pagedmla generate --device cpu` and `pagedmla check` print their own times."""

STARTUP = """From an empty compile cache, then from the one it filled (~70 MB); `bench_engine`'s 8
layers of V2-Lite attention, bf16. Phases: design.md, Start-up. Each workload runs twice on
fresh random prompts, first right after `LLM(...)`; variants: built or loaded from disk."""

MODES = """The engine of the table above (8 layers, batch 128, context ~1k) in the default
mode and in two others, one process: `compile=True` (the step under torch.compile,
attention opaque; decode steps replay CUDA graphs captured around it, steps with a prompt
run it whole, without piecewise graphs) and `batch_invariant=True` (forwards of 64
tokens, every token a decode row, `invariant_decode`). Steps with the prompt: the
decodes and one 256-token prompt. `LLM(...)` without the warm-up, so with the compile's
own time for `compile=True`."""

OUTPUT_QUANT = """How the attention output reaches DeepSeek-V3's block-fp8 o_proj (7168 <- N ·
128): in bf16, which `fp8_linear` quantizes (inside its programs up to 64 rows, in a
pass of its own above), or as fp8 codes with power-of-two scales per 128 channels
written by the kernel that finishes the output (`ops/output_quant.py`), which
`fp8_linear_quantized` reads as they are. Stage: the decode's V up-projection, the copy
of a prompt's attention output (fp8: the one-pass quantization in its place), or the
merge with the context; each way a CUDA graph replay after an L2 wipe, o_proj included
or not."""

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
