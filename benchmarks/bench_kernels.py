"""Conversion kernels against the copy bandwidth of the GPU (see moe_fp4/ops/bench.py).

    python benchmarks/bench_kernels.py [--tokens 4096 8192 32768] [--compile] [--markdown out.md]
"""

import sys

from moe_fp4.ops.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
