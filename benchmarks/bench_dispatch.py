"""Dispatch/combine benchmark per payload format (bf16, fp8, mxfp4, nvfp4) at DeepSeek-V3 shapes.

    python benchmarks/bench_dispatch.py [options]       # same as: python -m moe_fp4 bench dispatch
    torchrun --nproc-per-node=2 benchmarks/bench_dispatch.py --out benchmarks/results/dispatch.md

See moe_fp4/ep/bench.py for the columns and options.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the checkout, when not installed

from moe_fp4.ep.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
