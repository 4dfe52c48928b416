"""Command line: `python -m moe_fp4 <command>`.

  payload  bytes per token and per batch of each all-to-all payload format
  build    build (or rebuild) the native CUDA ops
  bench    run a benchmark: `bench dispatch`, `bench kernels`, `bench gemm`, `bench moe`
"""

from __future__ import annotations

import importlib
import sys

# command -> module whose main(argv) runs it
_COMMANDS = {
    "payload": "moe_fp4.formats.payload",
    "build": "moe_fp4.ops.build",
}
_BENCHES = {
    "dispatch": "moe_fp4.ep.bench",
    "kernels": "moe_fp4.ops.bench",
    "gemm": "moe_fp4.moe.bench",
    "moe": "moe_fp4.moe.bench_layer",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: python -m moe_fp4 {payload,build,bench {dispatch,kernels,gemm,moe}} [options]"
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\n" + usage)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        if not rest or rest[0] not in _BENCHES:
            print(f"bench: expected one of {sorted(_BENCHES)}\n{usage}", file=sys.stderr)
            return 2
        module, rest = _BENCHES[rest[0]], rest[1:]
    elif cmd in _COMMANDS:
        module = _COMMANDS[cmd]
    else:
        print(f"unknown command {cmd!r}\n{usage}", file=sys.stderr)
        return 2
    return int(importlib.import_module(module).main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
