"""GPU benchmarks of pagedmla.

Run each from the repository root as a module, e.g. `python -m benchmarks.bench_kernels`
(its docstring says what it measures and how). Shared modules:

* `harness`: timing (CUDA events after an L2 wipe, CUDA-graph replay, host time), the SM
  clock, and the card's measured ceilings (HBM read and copy, bf16 matmul);
* `workloads`: the kernel benchmarks' inputs and their fewest bytes and FLOPs;
* `baselines`: the PyTorch baselines the kernels are timed against;
* `kernel_choice`: which kernel the library picks for a call, as the benchmarks read it;
* `compare_results`: two `bench_kernels` results compared row by row.

The library never imports this package.
"""
