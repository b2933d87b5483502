"""Triton kernel benchmarks (see pagedmla.kernel_bench): `python3 benchmarks/bench_kernels.py`."""

import sys

from pagedmla.kernel_bench import main

if __name__ == "__main__":
    sys.exit(main())
