"""`python -m moe_fp4 build`: build (or load from the cache) the native CUDA ops."""

from __future__ import annotations

import argparse
import time


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_fp4 build", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="print the compiler commands")
    args = parser.parse_args(argv)
    from moe_fp4.ops import _native

    start = time.perf_counter()
    try:
        module = _native.build(verbose=args.verbose)
    except RuntimeError as exc:
        print(f"build failed: {exc}")
        return 1
    print(f"built {module.__file__} in {time.perf_counter() - start:.1f} s (cache: {_native.build_dir()})")
    return 0
