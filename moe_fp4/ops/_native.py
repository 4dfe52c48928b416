"""Building and loading the native extension (csrc/) with torch's cpp_extension and ninja."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import warnings
from pathlib import Path

import torch

EXTENSION_NAME = "moe_fp4_native"
_lock = threading.Lock()
_state: dict = {"module": None, "error": None, "tried": False}


def csrc_dir() -> Path:
    """The csrc/ folder of the source tree (MOE_FP4_CSRC overrides it)."""
    env = os.environ.get("MOE_FP4_CSRC")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "csrc"


def build_dir() -> Path:
    """Where the compiled extension is cached (MOE_FP4_BUILD_DIR overrides it)."""
    env = os.environ.get("MOE_FP4_BUILD_DIR")
    if env:
        return Path(env)
    tag = f"torch{torch.__version__}-cuda{torch.version.cuda}".replace("+", "_")
    return Path.home() / ".cache" / "moe_fp4" / tag


def sources() -> list[Path]:
    root = csrc_dir()
    return sorted((root / "torch").glob("*.cpp")) + sorted((root / "kernels").glob("*.cu"))


def _missing() -> str | None:
    """Why the extension cannot be built here, or None."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU-only build: install a CUDA build of torch"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        return "no CUDA toolkit found (nvcc): install it or set CUDA_HOME"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (torch.cuda.is_available() is False)"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f"the kernels are built for Hopper (sm_90a); this GPU is sm_{major}{minor}"
    if not (csrc_dir() / "kernels").is_dir():
        return f"the CUDA sources are not at {csrc_dir()} (use an editable install or set MOE_FP4_CSRC)"
    try:
        import ninja  # noqa: F401
    except ImportError:
        return "ninja is not installed (pip install ninja)"
    return None


@contextlib.contextmanager
def _arch_list(value: str):
    old = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = old


def build(verbose: bool = False):
    """Build (or load the cached build of) the native extension and return its module.

    Raises RuntimeError naming what is missing when there is no CUDA torch, toolkit or Hopper GPU.
    """
    with _lock:
        if _state["module"] is not None:
            return _state["module"]
        why = _missing()
        if why is not None:
            raise RuntimeError(f"moe_fp4 native ops cannot be built: {why}")
        from torch.utils.cpp_extension import load

        out = build_dir()
        out.mkdir(parents=True, exist_ok=True)
        verbose = verbose or os.environ.get("MOE_FP4_BUILD_VERBOSE", "0") == "1"
        # TORCH_CUDA_ARCH_LIST=9.0a makes torch pass -gencode=arch=compute_90a,code=sm_90a (and only it).
        with _arch_list("9.0a"):
            module = load(
                name=EXTENSION_NAME,
                sources=[str(s) for s in sources()],
                extra_include_paths=[str(csrc_dir() / "kernels")],
                extra_cflags=["-O3"],
                extra_cuda_cflags=["-O3", "-lineinfo"],
                # The process's shared libstdc++ (torch's), never a private static copy: a toolchain
                # whose -lstdc++ finds only the archive (a GCC under /opt with its own library dir)
                # linked one into the extension, and its uninitialised locale crashed the first error
                # message that formats a number, turning every argument check into a segfault.
                extra_ldflags=["-l:libstdc++.so.6"] if sys.platform.startswith("linux") else [],
                build_directory=str(out),
                verbose=verbose,
            )
        _state["module"] = module
        _state["error"] = None
        _state["tried"] = True
        return module


@functools.cache
def _mode() -> str:
    """MOE_FP4_NATIVE, read once per process (available() runs at every op call)."""
    return os.environ.get("MOE_FP4_NATIVE", "auto")


def available() -> bool:
    """Whether the native ops are usable here: builds the extension on first call (MOE_FP4_NATIVE=0
    turns them off; MOE_FP4_NATIVE=1 makes a failed build an error instead of a warning)."""
    mode = _mode()
    if mode == "0":
        return False
    if _state["module"] is not None:
        return True
    if _state["tried"]:
        return False
    if mode != "1" and (not torch.cuda.is_available() or torch.version.cuda is None):
        _state["tried"] = True
        return False
    try:
        build()
    except Exception as exc:  # the spec fallback takes over
        _state["tried"] = True
        _state["error"] = exc
        if mode == "1":
            raise
        warnings.warn(f"moe_fp4.ops: native ops unavailable, using the spec: {exc}", RuntimeWarning, stacklevel=3)
        return False
    return True


def module():
    """The loaded extension (building it if needed)."""
    return _state["module"] if _state["module"] is not None else build()
