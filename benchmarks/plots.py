"""PNG plots of a `bench_kernels` report (needs matplotlib, imported only when drawing)."""

from __future__ import annotations

from pathlib import Path


def write_plots(report: dict, directory: str) -> list[str]:
    """PNG plots of a report: decode bandwidth against the HBM ceiling, and TFLOP/s of
    decode and prefill against the bf16 matmul ceiling, into `directory` (made if
    missing). Returns their paths."""
    import matplotlib

    Path(directory).mkdir(parents=True, exist_ok=True)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ceil = report["ceilings"]
    rows = report["results"]
    decode = [r for r in rows if r["kernel"] == "mla_decode"]
    label = [f"{r['cache']} B={r['B']} N={r['N']}\nctx={r.get('lengths', r['context'])} "
             f"q={r['q_len']} "
             f"p={r.get('page', 64)}" for r in decode]
    paths = []
    for metric, ceiling, name, unit in (
        ("tbps", ceil["hbm_read_tbps"], "decode_bandwidth.png", "TB/s"),
        ("tflops", ceil["bf16_matmul_tflops"], "decode_tflops.png", "TFLOP/s"),
    ):
        fig, ax = plt.subplots(figsize=(12, 4.5))
        ax.bar(range(len(decode)), [r[metric] for r in decode],
               color=["tab:blue" if r["cache"] == "bf16" else "tab:orange" for r in decode])
        ax.axhline(ceiling, color="black", linestyle="--", label=f"measured ceiling {ceiling:.0f}"
                   if unit == "TFLOP/s" else f"measured HBM read {ceiling:.2f} {unit}")
        ax.set_xticks(range(len(decode)), label, rotation=60, fontsize=7)
        ax.set_ylabel(unit)
        ax.set_title(f"mla_decode on {report['gpu']} (blue bf16 cache, orange fp8)")
        ax.legend()
        fig.tight_layout()
        paths.append(f"{directory}/{name}")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    prefill = [r for r in rows if r["kernel"] == "varlen_attention" and r.get("baseline_us")]
    if prefill:
        fig, ax = plt.subplots(figsize=(8, 4))
        x = range(len(prefill))
        ax.bar([i - 0.27 for i in x], [r["tflops"] for r in prefill], width=0.27,
               label=f"our kernel ({prefill[0].get('stage', 'triton')})")
        ax.bar(list(x), [r["flops"] / r["triton_kernel_us"] / 1e6 for r in prefill],
               width=0.27, label="our Triton kernel")
        ax.bar([i + 0.27 for i in x], [r["flops"] / r["baseline_us"] / 1e6 for r in prefill],
               width=0.27, label="PyTorch SDPA (cuDNN)")
        ax.axhline(ceil["bf16_matmul_tflops"], color="black", linestyle="--",
                   label="bf16 matmul ceiling")
        ax.set_xticks(list(x), [f"N={r['N']}\n{r['shape']}" for r in prefill], fontsize=7)
        ax.set_ylabel("TFLOP/s")
        ax.set_title("prefill attention, qk 192 / v 128")
        ax.legend()
        fig.tight_layout()
        paths.append(f"{directory}/prefill_tflops.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
