"""Timing on one GPU, and the card's measured ceilings.

* `bench`: median of `triton.testing.do_bench`, which wipes a 256 MB buffer (several
  times the 60 MB L2 of an H100 / H200) before every call; host work beyond the wipe
  counts.
* `bench_covered`: the same wipe, with the host's launch work kept off the clock.
* `graphed`: a function captured in a CUDA graph, whose replay times the GPU work alone.
* `host_us`: the host's time per call.
* `SmClock`: the SM clock while a measurement runs (the card lowers it at its power cap).
* `ceilings`: HBM read and copy bandwidth and the bf16 matmul rate, measured with these
  timers in the same process as the kernels they judge.
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl
import triton.testing

DEV = "cuda"  # every benchmark runs on the current CUDA device


def bench(fn: Callable[[], object], rep_ms: int = 100) -> float:
    """Median time of fn in microseconds (L2 wiped before every call)."""
    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e3


# GPU cycles per microsecond that `bench_covered`'s head start assumes (the H200's top
# SM clock is 1980 MHz; at a lower clock the head start only lasts longer).
_SPIN_CYCLES_PER_US = 2000


def bench_covered(fn: Callable[[], object], rep_ms: int = 100, max_calls: int = 200,
                  clean_l2: bool = False) -> float:
    """Median GPU time of fn in microseconds, the L2 wiped before every call as `bench`
    does, with the host's work for the calls kept off the clock.

    The wipe writes 256 MB, as `bench`'s does, so L2 holds only dirty lines, whose
    write-back then shares HBM with the timed call (~9-10 µs of a decode of 600 MB on an
    H200). clean_l2: the wipe reads the 256 MB instead, so the call starts with a cold L2
    that holds no dirty lines: closer to what a decode layer meets in a model, after
    projections that write little.

    `bench` starts each call's clock when the wipe before it ends; a call whose Python
    and launch work outlast the wipe (~60 µs) is timed from then, idle GPU included.
    Here a spin kernel that outlasts the host's work for all the timed calls is queued
    first, so every call is already queued when the GPU reaches it (fn must not wait for
    the device, or the head start is lost). For eager calls whose host work is part of
    what is measured, use `bench`."""
    wipe = torch.zeros(256 << 20, dtype=torch.int8, device=DEV)
    flush = stream_read(wipe) if clean_l2 else wipe.zero_

    def timed() -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        flush()
        start.record()
        fn()
        end.record()
        return start, end

    for _ in range(3):  # warm-up (and compilation)
        timed()
    start, end = timed()
    torch.cuda.synchronize()
    calls = min(max_calls, max(10, int(rep_ms / max(start.elapsed_time(end), 1e-3))))
    host = host_us(timed, calls=5)
    torch.cuda._sleep(int(calls * host * 1.5 * _SPIN_CYCLES_PER_US))
    events = [timed() for _ in range(calls)]
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3


def host_us(fn: Callable[[], object], calls: int = 40) -> float:
    """Median host time of one call of fn in microseconds (its Python and launch work)."""
    times = []
    for _ in range(calls):
        begin = time.perf_counter()
        fn()
        times.append((time.perf_counter() - begin) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """fn captured in a CUDA graph: replaying it times the GPU work alone, as the engine's
    decode steps run it, without Python's launch overhead (tens of microseconds per
    call, as long as the whole kernel on small shapes)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


class SmClock:
    """The GPU's SM clock as `nvidia-smi` samples it every 50 ms while a `with` block runs;
    `mhz` afterwards: the median sample (None where nvidia-smi is missing or gave none).

    Why it is recorded: under sustained decode an H200 reaches its 700 W power cap and
    lowers the SM clock (reason "SW power cap"), from ~1950 down to ~1400 MHz. A kernel
    bound by its chains of dependent instructions (the fp8 decode) slows with the clock,
    one bound by HBM (bf16 decode) does not, so their ratio moves between runs."""

    def __init__(self) -> None:
        # nvidia-smi numbers GPUs its own way (CUDA_VISIBLE_DEVICES does not apply to
        # it): name the current one by its UUID.
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        self._gpu = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        self._proc: subprocess.Popen | None = None
        self.mhz: float | None = None

    def __enter__(self) -> SmClock:
        with contextlib.suppress(OSError):  # no nvidia-smi: mhz stays None
            self._proc = subprocess.Popen(
                ["nvidia-smi", "-i", self._gpu, "--query-gpu=clocks.sm",
                 "--format=csv,noheader,nounits", "-lms", "50"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self.mhz = median_sample(self._proc.communicate()[0])


def median_sample(text: str) -> float | None:
    """The median of the numbers in `text`, one per line (nvidia-smi's csv without header
    or units); lines that are not numbers ("[N/A]") are skipped; None without any."""
    values = []
    for line in text.splitlines():
        try:
            values.append(float(line))
        except ValueError:
            continue
    return statistics.median(values) if values else None


# --- ceilings ---------------------------------------------------------------------------------


@triton.jit
def _stream_read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Sum of one contiguous run of BLOCK * ITERS elements (the last one masked)."""
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


def stream_read(x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A plain streaming read of the contiguous tensor x: returns a function computing
    per-program partial sums of x (float32), one per run of 8192 elements. On an H200 it
    reads 4 GiB at 4.6 TB/s, where torch.sum reaches 4.2 (and 151 MiB at 3.3 against
    torch.sum's 2.5, timed after the 256 MB wipe), so the ceilings use the faster of
    the two."""
    block, iters = 4096, 2  # the fastest of a sweep over reads of 75 MiB to 4 GiB
    n = x.numel()
    out = torch.empty(triton.cdiv(n, block * iters), dtype=torch.float32, device=x.device)

    def run() -> torch.Tensor:
        _stream_read_kernel[(out.numel(),)](x, out, n, BLOCK=block, ITERS=iters, num_warps=8)
        return out
    return run


def read_times(x: torch.Tensor) -> tuple[float, float]:
    """Microseconds of a read of x by torch.sum and by `stream_read`, graph replays."""
    return (bench(graphed(lambda: x.sum(dtype=torch.float32))),
            bench(graphed(stream_read(x))))


def ceilings() -> dict[str, float]:
    """The card's rates, measured: HBM read (the faster of torch.sum and `stream_read`
    over 4 GiB), read + write (a 4 GiB copy) and bf16 matmul (8192^3, random data)."""
    src = torch.empty(1 << 31, dtype=torch.bfloat16, device=DEV).normal_()  # 4 GiB
    dst = torch.empty_like(src)
    sum_us, stream_us = read_times(src)
    copy_us = bench(lambda: dst.copy_(src))
    src = dst = None
    torch.cuda.empty_cache()
    n = 8192
    a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    mm_us = bench(lambda: a @ b)
    return {
        "hbm_read_tbps": (1 << 31) * 2 / min(sum_us, stream_us) / 1e6,
        "hbm_read_torch_sum_tbps": (1 << 31) * 2 / sum_us / 1e6,
        "hbm_copy_tbps": (1 << 31) * 2 * 2 / copy_us / 1e6,  # bytes read + written
        "bf16_matmul_tflops": 2 * n**3 / mm_us / 1e6,
    }
