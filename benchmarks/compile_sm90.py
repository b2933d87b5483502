"""Compile the decode kernels for sm_90a on a machine without a GPU, and report what ptxas
says of each: shared memory, registers, spilled bytes.

The Triton interpreter runs the Triton kernels on the CPU but not the Gluon ones, and
neither it nor a CPU test sees what the compiler makes of a kernel: a Gluon kernel that
does not build for Hopper, or one whose warp partitions spill registers (loads of
spilled values inside a tile loop slow a kernel down). This builds every path
`decode.mla_decode` can take on an H100/H200 (the 16-row bf16 and fp8 kernels, one split
per program and persistent runs; the 64-row kernel with 16-bit and fp8 caches; the
Triton kernel; the plan and the combine), both prefill kernels, the sparse kernel
(`sparse_decode`, 16 and 128 heads, bf16 and fp8_ds_mla caches), the lightning
indexer's logits kernel (decode and prefill; its top-k is torch's) and every other
Triton kernel of `ops/triton`, each through the entry point the backend calls: the
latent cache write and gather (bf16, fp8, fp8_ds_mla), the indexer key write (fp8,
bf16), the activation quantization, the block-fp8 GEMM (DeepSeek-V3's q_a, kv_a, q_b
and o_proj at 16 and 4096 rows), the bf16 and fp8 routed experts (16 and 4096
tokens), merge_attn_states, merge_partials, the attention output's fp8 epilogues
(`output_quant`: V up-projection, merge, one pass, and o_proj on the codes), RMSNorm
and the rotary embedding; all from
CPU tensors, with a stand-in for the CUDA driver that reports an sm_90a target and turns every
launch into a compile-only warm-up; the device's facts are faked through
`selection.device_platform`. Run it with the Triton the GPU machine has: other versions
compile other code, and the Gluon kernels build with one release only
(`_utils.GLUON_TRITON`); a path that does not build is reported as such. --ptx adds a
hash of each kernel's PTX without its name and line information, which stays the same
where a change of the code leaves the compiled kernel as it was.

    PYTHONPATH=src python3 benchmarks/compile_sm90.py [--ptx]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.backends.nvidia.driver import ty_to_cpp
from triton.runtime import driver
from triton.runtime.jit import JITFunction

COMPILED: list[tuple[str, Any]] = []  # (kernel name, compiled kernel), in launch order


class _Sm90Driver:
    """The parts of Triton's CUDA driver that compiling asks for: an sm_90a target on
    device 0, stream 0."""

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty_to_cpp(ty)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def _compile_only(self: JITFunction, grid: Any) -> Callable[..., Any]:
    """`kernel[grid]` as a warm-up: compile for the current target, launch nothing."""

    def warmup(*args: Any, **kwargs: Any) -> Any:
        kernel = self.run(*args, grid=grid, warmup=True, **kwargs)
        COMPILED.append((self.fn.__name__, kernel))
        return kernel

    return warmup


def ptxas_report(kernel: Any) -> tuple[int, int]:
    """(registers, spilled bytes) of a compiled kernel, from `ptxas -v` on its PTX (the
    ptxas this Triton compiles sm_90a with)."""
    ptxas = get_ptxas(90).path
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(kernel.asm["ptx"])
        ptx.flush()
        log = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return int(registers.group(1)) if registers else -1, int(spills.group(1)) if spills else 0


def _platform(gluon: bool) -> Callable[[torch.device], Any]:
    """`_utils.device_platform` for CPU tensors as on a Hopper GPU with the Triton the
    Gluon kernels are written for (gluon), or as on a GPU that runs only the Triton
    kernels."""
    from pagedmla.ops.triton._utils import Platform

    return lambda device: Platform(cudnn=False, hopper=gluon, gluon=gluon)


def compile_decode(batch: int, heads: int, context: int, fp8: bool = False,
                   page: int = 64, gluon: bool = True) -> None:
    """Build `mla_decode`'s kernels for a batch of `batch` requests of `context`
    positions each, N = heads, DeepSeek widths; gluon=False takes the Triton kernel."""
    from pagedmla.cache import FP8_DTYPE
    from pagedmla.ops.triton import decode, selection

    selection.device_platform = _platform(gluon)
    L, R = 512, 64
    blocks = batch * (context // page + 2)
    data = torch.zeros(blocks, page, L + R, dtype=torch.bfloat16)
    q = torch.zeros(batch, heads, L + R, dtype=torch.bfloat16)
    table = torch.arange(blocks, dtype=torch.int32).view(batch, -1)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    decode.mla_decode(q, data.to(FP8_DTYPE) if fp8 else data, torch.ones(()), table, seq_lens,
                      starts, 1, context, L, (L + R) ** -0.5)


def compile_invariant_decode(tokens: int, heads: int, fp8: bool, L: int = 512,
                             R: int = 64) -> None:
    """Build the batch-invariant decode kernel for `tokens` rows of requests at 4096
    positions, N = heads, widths L and R (DeepSeek's by default), a bf16 or fp8 cache."""
    from pagedmla.cache import FP8_DTYPE
    from pagedmla.ops.triton import invariant_decode

    page, context = 64, 4096
    blocks = tokens * context // page
    data = torch.zeros(blocks, page, L + R, dtype=torch.bfloat16)
    q = torch.zeros(tokens, heads, L + R, dtype=torch.bfloat16)
    table = torch.arange(blocks, dtype=torch.int32).view(tokens, -1)
    seq_lens = torch.full((tokens,), context, dtype=torch.int32)
    starts = torch.arange(tokens + 1, dtype=torch.int32)
    invariant_decode.invariant_decode(q, data.to(FP8_DTYPE) if fp8 else data, torch.ones(()),
                                      table, seq_lens, starts, 1, context, L,
                                      (L + R) ** -0.5)


def compile_sparse(tokens: int, heads: int, ds_mla: bool) -> None:
    """Build `sparse_decode.sparse_attention`'s kernel for `tokens` decode tokens of
    requests at 4096 positions, top-k 2048, N = heads, DeepSeek widths, a bf16 or
    fp8_ds_mla cache."""
    from pagedmla.cache import DS_MLA_BYTES, DS_MLA_DTYPE
    from pagedmla.ops.triton import sparse_decode

    L, R, page, context = 512, 64, 64, 4096
    blocks = tokens * (context // page)
    data = (torch.zeros(blocks, page, DS_MLA_BYTES, dtype=DS_MLA_DTYPE) if ds_mla
            else torch.zeros(blocks, page, L + R, dtype=torch.bfloat16))
    q = torch.zeros(tokens, heads, L + R, dtype=torch.bfloat16)
    table = torch.arange(blocks, dtype=torch.int32).view(tokens, -1)
    seq_lens = torch.full((tokens,), context, dtype=torch.int32)
    starts = torch.arange(tokens + 1, dtype=torch.int32)
    indices = torch.zeros(tokens, 2048, dtype=torch.int32)
    sparse_decode.sparse_attention(q, data, torch.ones(()), table, seq_lens, starts, indices,
                                   L, (L + R) ** -0.5)


def compile_prefill(tokens: int, heads: int, qk_dim: int, v_dim: int, gluon: bool = True
                    ) -> None:
    """Build `prefill.varlen_attention`'s kernel for one causal sequence of `tokens`
    tokens, N = heads; gluon=False takes the Triton kernel."""
    from pagedmla.ops.triton import prefill, selection

    selection.device_platform = _platform(gluon)
    q = torch.zeros(tokens, heads, qk_dim, dtype=torch.bfloat16)
    v = torch.zeros(tokens, heads, v_dim, dtype=torch.bfloat16)
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    prefill.varlen_attention(q, q.clone(), v, cu, cu, tokens, tokens, qk_dim ** -0.5, True)


def compile_indexer(tokens: int, requests: int, context: int, fp8: bool = True) -> None:
    """Build the lightning indexer's logits kernel (`ops.triton.indexer`) for `requests`
    requests of tokens / requests query tokens over `context` positions each,
    DeepSeek-V3.2's 64 heads of 128, page 64."""
    from pagedmla.ops.reference_indexer import allocate_indexer_cache
    from pagedmla.ops.triton import indexer

    page, heads, dim = 64, 64, 128
    pages = context // page
    data = allocate_indexer_cache(requests * pages, page, dim, torch.bfloat16, fp8)
    table = torch.arange(requests * pages, dtype=torch.int32).view(requests, pages)
    seq_lens = torch.full((requests,), context, dtype=torch.int32)
    starts = torch.arange(0, tokens + 1, tokens // requests, dtype=torch.int32)
    indexer.indexer_logits(torch.zeros(tokens, heads, dim, dtype=torch.bfloat16),
                           torch.zeros(tokens, heads), data.zero_(), table, seq_lens, starts)


def _latent_cache(blocks: int, page: int, kind: str) -> torch.Tensor:
    """A zero latent cache [blocks, page, 576] of `kind`: "bf16", "fp8" (e4m3, one
    scale) or "fp8_ds_mla" (uint8 entries of 656 bytes)."""
    from pagedmla.cache import DS_MLA_BYTES, DS_MLA_DTYPE, FP8_DTYPE

    if kind == "fp8_ds_mla":
        return torch.zeros(blocks, page, DS_MLA_BYTES, dtype=DS_MLA_DTYPE)
    return torch.zeros(blocks, page, 576, dtype=FP8_DTYPE if kind == "fp8" else torch.bfloat16)


def compile_cache_write(tokens: int, kind: str) -> None:
    """Build `cache_ops.write_cache` for kv_c [tokens, 512] and k_pe [tokens, 64] (bf16,
    contiguous, as the model passes them) into a `kind` cache of pages of 64."""
    from pagedmla.ops.triton import cache_ops

    data = _latent_cache(tokens // 64 + 1, 64, kind)
    cache_ops.write_cache(data, torch.zeros(tokens, 512, dtype=torch.bfloat16),
                          torch.zeros(tokens, 64, dtype=torch.bfloat16),
                          torch.arange(tokens, dtype=torch.int64), torch.ones(()))


def compile_gather(rows: int, requests: int, kind: str) -> None:
    """Build `cache_ops.gather_cache` for a chunk of `rows` context rows, rows / requests
    from each of `requests` requests, out [rows, 576] bf16, a `kind` cache of pages of 64."""
    from pagedmla.ops.triton import cache_ops

    pages = rows // requests // 64 + 1
    data = _latent_cache(requests * pages, 64, kind)
    table = torch.arange(requests * pages, dtype=torch.int32).view(requests, pages)
    cu = torch.arange(0, rows + 1, rows // requests, dtype=torch.int32)
    to_seq = torch.arange(rows, dtype=torch.int32) // (rows // requests)
    cache_ops.gather_cache(data, torch.ones(()), table, torch.zeros(requests, dtype=torch.int32),
                           cu, to_seq, torch.zeros(rows, 576, dtype=torch.bfloat16))


def compile_index_write(tokens: int, fp8: bool) -> None:
    """Build `index_cache.write_indexer_cache` for keys k [tokens, 128] bf16 into an
    indexer key cache of pages of 64: fp8 (codes and scales) or bf16 rows."""
    from pagedmla.ops.reference_indexer import allocate_indexer_cache
    from pagedmla.ops.triton import index_cache

    data = allocate_indexer_cache(tokens // 64 + 1, 64, 128, torch.bfloat16, fp8).zero_()
    index_cache.write_indexer_cache(data, torch.zeros(tokens, 128, dtype=torch.bfloat16),
                                    torch.arange(tokens, dtype=torch.int64))


def compile_quantize(rows: int, width: int) -> None:
    """Build `fp8_quant.quantize_activations` for x [rows, width] bf16, groups of 128."""
    from pagedmla.ops.triton import fp8_quant

    fp8_quant.quantize_activations(torch.zeros(rows, width, dtype=torch.bfloat16), 128)


def compile_fp8_linear(rows: int, n: int, k: int) -> None:
    """Build `fp8_gemm.fp8_linear` (its pick_config; the split-K sum where it splits) for
    x [rows, k] bf16 and W [n, k] e4m3 in 128 x 128 scale blocks."""
    from pagedmla.ops.block_fp8 import FP8_WEIGHT_DTYPE, scale_grid
    from pagedmla.ops.triton import fp8_gemm

    weight = torch.zeros(n, k, dtype=FP8_WEIGHT_DTYPE)
    fp8_gemm.fp8_linear(torch.zeros(rows, k, dtype=torch.bfloat16), weight,
                        torch.zeros(scale_grid(weight.shape, (128, 128))), (128, 128))


def compile_moe(tokens: int, fp8: bool, experts: int = 16) -> None:
    """Build `moe.fused_experts` for x [tokens, 7168] bf16, top-8 routing, `experts`
    experts of intermediate 2048 (w13 [E, 4096, 7168], w2 [E, 7168, 2048]; bf16, or e4m3
    with 128 x 128 scale blocks), the tiles DeepSeek-V3's 256 experts get (pick_config)."""
    from pagedmla.ops.block_fp8 import FP8_WEIGHT_DTYPE
    from pagedmla.ops.triton import moe

    H, inter, top_k, E = 7168, 2048, 8, experts
    dtype = FP8_WEIGHT_DTYPE if fp8 else torch.bfloat16
    w13 = torch.zeros(E, 2 * inter, H, dtype=dtype)
    w2 = torch.zeros(E, H, inter, dtype=dtype)
    ids = (torch.arange(tokens * top_k) % E).view(tokens, top_k)
    config = (moe.pick_config(tokens * top_k, 256, group=128) if fp8
              else moe.pick_config(tokens * top_k, 256))
    scales = ((torch.zeros(E, 2, inter // 128, H // 128), torch.zeros(E, H // 128, inter // 128),
               (128, 128)) if fp8 else (None, None, None))
    moe.fused_experts(torch.zeros(tokens, H, dtype=torch.bfloat16), w13, w2,
                      torch.zeros(tokens, top_k), ids, *scales, config=config)


def compile_merge(tokens: int, heads: int, width: int, write_lse: bool) -> None:
    """Build `merge.merge_attn_states` for partials [tokens, heads, width] bf16 with lse
    [heads, tokens] float32, the merged lse stored or not."""
    from pagedmla.ops.triton import merge

    part = torch.zeros(tokens, heads, width, dtype=torch.bfloat16)
    lse = torch.zeros(heads, tokens)
    merge.merge_attn_states(part, lse, part.clone(), lse.clone(), torch.zeros_like(part),
                            torch.zeros_like(lse) if write_lse else None)


def compile_output_quant(tokens: int, heads: int, group: int | None) -> None:
    """Build the attention output's fp8 epilogues (`output_quant`) for N = `heads`, V
    128, L 512, bf16: the decode's V up-projection, the merge and the one-pass
    quantization, per group of `group` (power-of-two scales) or per tensor (None); and
    o_proj's GEMM on the codes (7168 <- heads * 128)."""
    from pagedmla.ops.block_fp8 import FP8_WEIGHT_DTYPE
    from pagedmla.ops.output_quant import OutputQuant, QuantizedOutput
    from pagedmla.ops.triton import fp8_gemm, merge, output_quant, v_up_proj

    quant = OutputQuant(group=group) if group else OutputQuant(scale=torch.ones(1))
    out = QuantizedOutput.empty(tokens, heads * 128, quant, torch.device("cpu"))
    v_up_proj.v_up_proj_quant(torch.zeros(tokens, heads, 512, dtype=torch.bfloat16),
                        torch.zeros(heads, 512, 128, dtype=torch.bfloat16), out)
    part = torch.zeros(tokens, heads, 128, dtype=torch.bfloat16)
    lse = torch.zeros(heads, tokens)
    merge.merge_attn_states_quant(part, lse, part.clone(), lse.clone(), out)
    output_quant.quantize_output(part.view(tokens, -1), out)
    weight = torch.zeros(7168, heads * 128, dtype=FP8_WEIGHT_DTYPE)
    fp8_gemm.fp8_linear_quantized(out, weight, torch.zeros(56, heads), (128, 128),
                                  torch.bfloat16)


def compile_merge_partials(ranks: int, tokens: int, heads: int) -> None:
    """Build `combine.merge_partials` as decode context parallelism calls it: `ranks`
    partials out [ranks, tokens, heads, 512] and lse, views of one float32 [ranks,
    tokens, heads, 513] tensor, merged to bf16."""
    from pagedmla.ops.triton import combine

    received = torch.zeros(ranks, tokens, heads, 513)
    combine.merge_partials(received[..., :512], received[..., 512], torch.bfloat16)


def compile_norm(tokens: int, width: int, residual: bool) -> None:
    """Build `norm.rms_norm` (or `add_rms_norm` with a residual) for x [tokens, width]
    bf16 and a bf16 weight."""
    from pagedmla.ops.triton import norm

    x, weight = torch.zeros(tokens, width, dtype=torch.bfloat16), torch.zeros(width,
                                                                              dtype=torch.bfloat16)
    if residual:
        norm.add_rms_norm(x, x.clone(), weight, 1e-6)
    else:
        norm.rms_norm(x, weight, 1e-6)


def compile_rope(tokens: int, heads: int, interleaved: bool) -> None:
    """Build `rope.rotary` for q [tokens, heads, 128 + 64] bf16 and k_pe [tokens, 64],
    a strided view of the kv_a output [tokens, 576], cos / sin [tokens, 32] float32."""
    from pagedmla.ops.triton import rope

    latent = torch.zeros(tokens, 576, dtype=torch.bfloat16)
    cos = torch.zeros(tokens, 32)
    rope.rotary(torch.zeros(tokens, heads, 192, dtype=torch.bfloat16), latent[:, 512:], cos,
                cos.clone(), interleaved)


def ptx_hash(name: str, ptx: str) -> str:
    """A hash of the kernel `name`'s PTX without its name, comments, line information
    and debug sections: what a rename or a move of the source leaves unchanged."""
    lines, debug = [], False
    for line in ptx.splitlines():
        text = line.strip()
        debug = debug or (text.startswith(".section") and ".debug" in text)
        if debug:
            debug = text != "}"
            continue
        if text and not text.startswith((".loc", ".file", "//")):
            lines.append(line.replace(name, "KERNEL"))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def failure_reason(error: BaseException) -> str:
    """A failed build's cause in one line: the innermost error (the compiler's own, not
    its trace); for a Triton CompilationError, its message and the function and line
    (of that function's source, its `def` line 1) it points at."""
    while error.__cause__ is not None:
        error = error.__cause__
    message, src = getattr(error, "error_message", None), getattr(error, "src", None)
    if message and src and hasattr(error.node, "lineno"):
        function = re.search(r"def (\w+)", src)
        where = f"{function.group(1) if function else '?'} line {error.node.lineno}: "
        text = where + message.strip().splitlines()[-1]
    else:
        text = str(error).strip().splitlines()[0]
    return f"{type(error).__name__}: {text[:160]}".replace("|", "/")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ptx", action="store_true",
                        help="add a hash of each kernel's PTX (name and lines stripped)")
    options = parser.parse_args(argv)
    driver.set_active(_Sm90Driver())
    JITFunction.__getitem__ = _compile_only
    from pagedmla.ops.triton import (
        cache_ops,
        combine,
        decode,
        decode_triton,
        fp8_gemm,
        fp8_quant,
        index_cache,
        indexer,
        invariant_decode,
        merge,
        moe,
        norm,
        output_quant,
        prefill,
        prefill_hopper,
        rope,
        sparse_decode,
        v_up_proj,
    )

    # CPU tensors stand in for CUDA ones, on an H200 (132 multiprocessors, 50 MB of L2).
    for module in (cache_ops, combine, decode, fp8_gemm, fp8_quant, index_cache, indexer,
                   invariant_decode, merge, moe, norm, output_quant, prefill, rope,
                   sparse_decode, v_up_proj):
        module.check_device = lambda *tensors: None
        if hasattr(module, "multiprocessor_count"):
            module.multiprocessor_count = lambda device: 132
    prefill_hopper.l2_cache_bytes = lambda device: 50 * 2**20
    decode_triton.INTERPRETED = False
    cases = [  # (label, batch, heads, context, fp8, page, gluon)
        ("bf16 16 rows, one wave", 64, 16, 8192, False, 64, True),
        ("bf16 16 rows, persistent runs", 200, 16, 4096, False, 64, True),
        ("bf16 16 rows, pages of 16", 64, 16, 8192, False, 16, True),
        ("fp8 16 rows", 64, 16, 8192, True, 64, True),
        ("fp8 2 x 16 rows", 8, 32, 4096, True, 64, True),
        ("bf16 64 rows", 1, 128, 65536, False, 64, True),
        ("fp8 64 rows", 4, 128, 4096, True, 64, True),
        ("fp8 64 rows, 200 requests (combine loops)", 200, 128, 4096, True, 64, True),
        ("Triton kernel, persistent runs", 200, 16, 4096, False, 64, False),
    ]
    ptx_column = (" PTX hash |", "---|") if options.ptx else ("", "")
    print("| path | kernel | shared bytes | registers | spilled bytes |" + ptx_column[0])
    print("|---|---|---:|---:|---:|" + ptx_column[1])
    builds = [(label, compile_decode, args) for label, *args in cases]
    builds += [("prefill 192 / 128", compile_prefill, (4096, 16, 192, 128, True)),
               ("prefill 192 / 128, Triton kernel", compile_prefill, (4096, 16, 192, 128, False)),
               ("indexer decode, fp8", compile_indexer, (64, 64, 4096)),
               ("indexer decode 2 tokens, fp8", compile_indexer, (128, 64, 4096)),
               ("indexer prefill, fp8", compile_indexer, (4096, 1, 4096)),
               ("indexer prefill, bf16", compile_indexer, (4096, 1, 4096, False))]
    builds += [(f"batch-invariant decode {'fp8' if fp8 else 'bf16'}, {heads} heads",
                compile_invariant_decode, (64, heads, fp8)) for heads in (16, 128)
               for fp8 in (False, True)]
    builds += [("batch-invariant decode bf16, L 32, R 8 (the tests' widths)",
                compile_invariant_decode, (64, 4, False, 32, 8))]
    builds += [(f"sparse {'fp8_ds_mla' if ds else 'bf16'}, {heads} heads", compile_sparse,
                (64, heads, ds)) for heads in (16, 128) for ds in (True, False)]
    kinds = ("bf16", "fp8", "fp8_ds_mla")
    builds += [(f"cache write {kind}, {n} tokens", compile_cache_write, (n, kind))
               for kind in kinds for n in (64, 4096)]
    builds += [(f"cache gather {kind}, 4096 rows", compile_gather, (4096, 4, kind))
               for kind in kinds]
    builds += [(f"indexer key write {'fp8' if fp8 else 'bf16'}, 4096 tokens",
                compile_index_write, (4096, fp8)) for fp8 in (True, False)]
    builds += [("fp8 quantize 16 x 7168", compile_quantize, (16, 7168))]
    builds += [(f"fp8 linear {name} {k}->{n}, M={m}", compile_fp8_linear, (m, n, k))
               for m in (16, 4096)
               for name, n, k in (("q_a", 1536, 7168), ("kv_a", 576, 7168),
                                  ("q_b", 24576, 1536), ("o_proj", 7168, 16384))]
    builds += [(f"MoE {'fp8' if fp8 else 'bf16'} experts, {t} tokens", compile_moe, (t, fp8))
               for fp8 in (False, True) for t in (16, 4096)]
    builds += [("merge 128 heads x 128, lse", compile_merge, (4096, 128, 128, True)),
               ("merge 128 heads x 128, no lse", compile_merge, (4096, 128, 128, False)),
               ("merge_partials 4 ranks, 64 tokens", compile_merge_partials, (4, 64, 16)),
               ("fp8 output, groups of 128, 64 tokens", compile_output_quant, (64, 128, 128)),
               ("fp8 output, groups of 128, 4096 tokens", compile_output_quant,
                (4096, 16, 128)),
               ("fp8 output, per tensor, 64 tokens", compile_output_quant, (64, 128, None)),
               ("rms_norm 1536", compile_norm, (64, 1536, False)),
               ("rms_norm 512", compile_norm, (64, 512, False)),
               ("add_rms_norm 7168", compile_norm, (64, 7168, True)),
               ("rotary interleaved, 128 heads", compile_rope, (64, 128, True)),
               ("rotary halves, 128 heads", compile_rope, (64, 128, False))]
    for label, build, args in builds:
        done = len(COMPILED)
        try:
            build(*args)
        except Exception as error:  # a kernel that does not build with this Triton
            print(f"| {label} | does not build: {failure_reason(error)} | | | |", flush=True)
        for name, kernel in COMPILED[done:]:
            registers, spills = ptxas_report(kernel)
            ptx = f" {ptx_hash(name, kernel.asm['ptx'])} |" if options.ptx else ""
            print(f"| {label} | {name} | {kernel.metadata.shared} | {registers} | {spills} |"
                  + ptx, flush=True)


if __name__ == "__main__":
    main()
