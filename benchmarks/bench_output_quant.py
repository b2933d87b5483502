"""The attention output handed to o_proj in fp8: the pass it saves, at decode and
prefill sizes (`ops/output_quant.py`, DeepSeek-V3's o_proj: 7168 <- N * 128, 128 x 128
fp8 blocks, groups of 128 with power-of-two scales).

The attention kernels themselves are the same either way; what differs is how their
result reaches o_proj. For each case, in one process, both ways from the same partials:

* decode (T requests, one token each): `torch.bmm` with W_UV into bf16, then
  `fp8_linear` (which quantizes x inside its programs up to 64 rows, in a pass of its
  own above), against `v_up_proj_quant` (the bmm with the quantization as its
  epilogue) and `fp8_linear_quantized`;
* prefill without context: the copy of the attention kernel's output into the layer's
  buffer, then `fp8_linear`, against `quantize_output` in place of the copy and
  `fp8_linear_quantized`;
* prefill with context: `merge_attn_states` into bf16, then `fp8_linear`, against
  `merge_attn_states_quant` and `fp8_linear_quantized`.

Each way is timed as a CUDA graph replay (`harness.graphed`, L2 wiped before every
replay); "stage" is the same without o_proj. Both o_proj outputs are first checked
against x @ W in float32 (x the stage's bf16 output, W dequantized): the fused one's
relative L2 error within 1.5x the unfused one's (both round x to e4m3, with different
scales).

    python -m benchmarks.bench_output_quant --out output_quant.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import triton

from benchmarks.harness import DEV, bench, graphed
from pagedmla.ops.block_fp8 import dequantize_blocks
from pagedmla.ops.output_quant import OutputQuant, QuantizedOutput
from pagedmla.ops.triton import (
    fp8_linear,
    fp8_linear_quantized,
    merge_attn_states,
    merge_attn_states_quant,
    quantize_output,
    v_up_proj_quant,
)

H, L, V = 7168, 512, 128
BLOCK = (128, 128)
# (kind, tokens, heads): decode batches, prefill chunks; N 128 is tensor parallel 1,
# N 16 is one rank of 8.
CASES = [(kind, T, N) for N in (128, 16) for kind, T in (
    ("decode", 1), ("decode", 64), ("decode", 256),
    ("prefill", 4096), ("prefill", 16384),
    ("prefill + context", 4096), ("prefill + context", 16384),
)]


def _case(kind: str, T: int, N: int) -> dict[str, float | str | int]:
    gen = torch.Generator(DEV).manual_seed(T * N)

    def randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=DEV).to(dtype)

    weight = (randn(H, N * V, dtype=torch.float32) * 64).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(H // 128, N, generator=gen, device=DEV) / 64
    quant = OutputQuant(group=128)
    codes = QuantizedOutput.empty(T, N * V, quant, torch.device(DEV))
    plain = torch.empty(T, N, V, dtype=torch.bfloat16, device=DEV)
    if kind == "decode":
        latent, W_UV = randn(T, N, L), randn(N, L, V) / L**0.5

        def unfused_stage() -> None:
            torch.bmm(latent.transpose(0, 1), W_UV, out=plain.transpose(0, 1))

        def fused_stage() -> None:
            v_up_proj_quant(latent, W_UV, codes)
    elif kind == "prefill":
        new_out = randn(T, N, V)

        def unfused_stage() -> None:
            plain.copy_(new_out)

        def fused_stage() -> None:
            quantize_output(new_out.view(T, -1), codes)
    else:
        ctx, new = randn(T, N, V, dtype=torch.float32), randn(T, N, V)
        ctx_lse, new_lse = randn(N, T, dtype=torch.float32), randn(N, T, dtype=torch.float32)

        def unfused_stage() -> None:
            merge_attn_states(ctx, ctx_lse, new, new_lse, plain, None)

        def fused_stage() -> None:
            merge_attn_states_quant(ctx, ctx_lse, new, new_lse, codes)

    def unfused() -> torch.Tensor:
        unfused_stage()
        return fp8_linear(plain.view(T, -1), weight, scale_inv, BLOCK)

    def fused() -> torch.Tensor:
        fused_stage()
        return fp8_linear_quantized(codes, weight, scale_inv, BLOCK, torch.bfloat16)

    unfused_out = unfused().float()  # leaves the stage's bf16 output in `plain`
    exact = plain.view(T, -1).float() @ dequantize_blocks(weight, scale_inv, BLOCK).t()
    errors = [float((out - exact).norm() / exact.norm())
              for out in (unfused_out, fused().float())]
    # Both quantize x to e4m3 (~2% of a value, rms); power-of-two scales keep as many bits.
    assert errors[1] < 1.5 * errors[0] + 1e-3, f"{kind} T {T} N {N}: errors {errors}"
    times = {name: bench(graphed(fn)) for name, fn in (
        ("unfused_us", unfused), ("fused_us", fused),
        ("unfused_stage_us", unfused_stage), ("fused_stage_us", fused_stage))}
    return {"kind": kind, "T": T, "N": N, **times, "unfused_error": errors[0],
            "fused_error": errors[1],
            "saved_us": times["unfused_us"] - times["fused_us"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results as JSON here")
    options = parser.parse_args(argv)
    rows = [_case(*case) for case in CASES]
    print("| case | N | stage µs: bf16 / fp8 | with o_proj µs: bf16 / fp8 | saved |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kind']} {r['T']} | {r['N']} | {r['unfused_stage_us']:.1f} / "
              f"{r['fused_stage_us']:.1f} | {r['unfused_us']:.1f} / {r['fused_us']:.1f} | "
              f"{r['saved_us']:.1f} µs ({r['saved_us'] / r['unfused_us']:.0%}) |")
    if options.out:
        run = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"),
               "command": " ".join(sys.argv), "results": rows}
        with open(options.out, "w") as f:
            json.dump(run, f, indent=1)


if __name__ == "__main__":
    main()
