# ruff: noqa: E501  (a diagnostic tool: long shell and C lines kept whole)
"""Narrow down DeepGEMM's first-call SIGSEGV (m_grouped_fp8_gemm_nt_contiguous, H200, CUDA 13.0) in one run.

Run on the GPU machine, after DeepGEMM's in-place build (built by patches/deepgemm/build.sh):
    PYTHONPATH=$PWD/.deps/DeepGEMM CUDA_HOME=/usr/local/cuda python patches/deepgemm/diagnose.py [--steps a,b] [--budget 480]

The parent never touches CUDA. It reports the toolchain, the install layout and what the extension links to, then
runs each step in a child python that has: faulthandler, a native backtrace on SIGSEGV/SIGBUS/SIGABRT (a tiny C
helper built here with cc; frames in deep_gemm/_C*.so are put through addr2line), C stdout unbuffered (DeepGEMM's
DG_JIT_DEBUG output is printf/std::cout, block-buffered when stdout is a file or pipe, so a crash used to lose it),
DG_JIT_DEBUG=1 and DG_JIT_PRINT_COMPILER_COMMAND=1. Steps go from no-CUDA to the failing call, so the first step
that dies, and the last DeepGEMM debug line it printed, say where the crash is. Logs: $OUT/dg_diag or --out.
"""

import argparse
import glob
import importlib.util
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

STEP_ORDER = [
    "selftest",
    "import",
    "exception",
    "device_runtime",
    "cublaslt",
    "driver",
    "layout_jit",
    "layout_jit_nvrtc",
    "bf16_gemm",
    "fp8_gemm",
    "grouped_small",
    "grouped_user",
]
DEFAULT_STEPS = list(STEP_ORDER)

# What each step proves when it is the first to fail
MEANING = {
    "selftest": "nothing: a deliberate NULL read, it must die with SIGSEGV and print [native] frames",
    "import": "the build or its shared-library resolution (ldd section above)",
    "exception": "C++ exceptions do not unwind: every DG_HOST_ASSERT (nvcc failure, bad cache dir...) becomes a crash",
    "device_runtime": "DeviceRuntime() (device_runtime.hpp:29-49, 72-81): cublasLtCreate / 32 MiB workspace / "
    "cudaGetDeviceProperties",
    "cublaslt": "cuBLASLt as linked into _C (no JIT)",
    "driver": "libcuda itself: the same driver calls as jit/handle.hpp (dlsym'd by name) without DeepGEMM",
    "layout_jit": "the JIT chain on its smallest kernel (transpose_fp32); the last DG line tells the stage",
    "layout_jit_nvrtc": "same kernel through NVRTC (no popen of nvcc): if this passes, the NVCC/popen side is at fault",
    "bf16_gemm": "SM90 BF16 GEMM: TMA descriptors + a real GEMM kernel, no scaling factors",
    "fp8_gemm": "dense SM90 FP8 1D2D GEMM (SF transform + 1D2D kernel)",
    "grouped_small": "m-grouped contiguous FP8 at 256x256x512 (smaller than the failing call)",
    "grouped_user": "the failing call itself (2304 x 4096 x 7168, 4 groups, -1 padding rows)",
}

# DeepGEMM debug lines in the order the JIT path prints them (compiler.hpp, kernel_runtime.hpp, system.hpp, ...)
MILESTONES = [
    ("GemmDesc(", "heuristics chose a config (get_best_config)"),
    ("Making TMA desc", "cuTensorMapEncodeTiled called"),
    ("Making 3D TMA desc", "cuTensorMapEncodeTiled called"),
    ("Generated kernel code", "code generated + include hash done (include_parser)"),
    ("Create directory", "cache dir created (make_dirs)"),
    ("Running NVCC command", "nvcc --version parsed, nvcc compile started"),
    ("Compiling JIT runtime with NVRTC", "NVRTC compile started"),
    ("NVRTC log", "NVRTC compile finished (log)"),
    ("NVCC compilation failed", "nvcc FAILED (exception follows)"),
    ("Loading CUBIN", "cubin written; cuLibraryLoadFromFile next"),
    ("Load time", "kernel loaded (cuLibraryEnumerateKernels/cuKernelGetFunction ok)"),
    ("Launch kernel with", "cuFuncSetAttribute ok; cuLaunchKernelEx next"),
    ("STEP-OK", "step finished"),
]

SEGV_HELPER_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>
#include <unistd.h>

static struct sigaction prev[65];
static void put(const char *s) { ssize_t r = write(2, s, strlen(s)); (void) r; }

static void on_fatal(int sig, siginfo_t *si, void *ctx) {
    char line[768];
    void *pc = 0;
#if defined(__x86_64__)
    pc = (void *) ((ucontext_t *) ctx)->uc_mcontext.gregs[REG_RIP];
#elif defined(__aarch64__)
    pc = (void *) ((ucontext_t *) ctx)->uc_mcontext.pc;
#endif
    fflush(stdout);
    snprintf(line, sizeof line, "\n[native] signal %d code %d fault-addr %p pc %p\n", sig, si->si_code, si->si_addr, pc);
    put(line);
    void *frames[64];
    int n = backtrace(frames, 64);
    for (int i = -1; i < n; ++ i) {
        void *a = i < 0 ? pc : frames[i];
        Dl_info info;
        if (dladdr(a, &info) && info.dli_fname)
            snprintf(line, sizeof line, "[native] #%d %p %s+0x%lx (%s)\n", i, a, info.dli_fname,
                     (unsigned long) ((char *) a - (char *) info.dli_fbase), info.dli_sname ? info.dli_sname : "?");
        else
            snprintf(line, sizeof line, "[native] #%d %p ?\n", i, a);
        put(line);
    }
    struct sigaction *p = &prev[sig];
    if ((p->sa_flags & SA_SIGINFO) && p->sa_sigaction)
        p->sa_sigaction(sig, si, ctx);                /* faulthandler: Python traceback */
    else if (p->sa_handler != SIG_DFL && p->sa_handler != SIG_IGN)
        p->sa_handler(sig);
    signal(sig, SIG_DFL);
    raise(sig);
}

int dg_diag_install(void) {
    static char alt[1 << 16];
    stack_t old;
    if (sigaltstack(NULL, &old) == 0 && (old.ss_flags & SS_DISABLE)) {
        stack_t ss = { .ss_sp = alt, .ss_size = sizeof alt, .ss_flags = 0 };
        sigaltstack(&ss, NULL);
    }
    void *warm[4];
    backtrace(warm, 4);                                /* load the unwinder now, not inside the handler */
    int sigs[] = { SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT };
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fatal;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    for (unsigned i = 0; i < sizeof sigs / sizeof sigs[0]; ++ i)
        if (sigaction(sigs[i], &sa, &prev[sigs[i]]) != 0)
            return -1;
    return 0;
}
"""

CHILD_PRELUDE = r"""
import ctypes, faulthandler, os, re, sys, traceback
faulthandler.enable(all_threads=True)
_libc = ctypes.CDLL(None)
try:  # C stdio unbuffered: DeepGEMM prints with printf/std::cout, lost in a crash when stdout is a file
    _libc.setvbuf(ctypes.c_void_p.in_dll(_libc, "stdout"), None, 2, 0)
except Exception as _e:
    print("setvbuf(stdout) failed:", _e, flush=True)
if os.environ.get("DG_DIAG_SEGV_HELPER"):
    try:
        ctypes.CDLL(os.environ["DG_DIAG_SEGV_HELPER"]).dg_diag_install()
    except OSError as _e:
        print("native backtrace helper not loaded:", _e, flush=True)

def say(*a):
    print(*a, flush=True)

def libs(tag):
    pat = re.compile(r"(libstdc\+\+|libgcc_s|libcudart|libcuda\.so|libnvrtc|libcublasLt|libcublas\.|libtorch_cuda|"
                     r"libc10_cuda|deep_gemm/_C|libpython)")
    seen = []
    for line in open("/proc/self/maps"):
        parts = line.split()
        if len(parts) >= 6 and pat.search(parts[5]) and parts[5] not in seen:
            seen.append(parts[5])
    say(f"[libs {tag}]")
    for p in seen:
        say("   ", p, "->", os.path.realpath(p))

def rel_err(x, y):
    x, y = x.double(), y.double()
    return ((x - y).norm() / y.norm().clamp_min(1e-30)).item()
"""

# one BF16 GEMM [256, 512] x [384, 512]^T through deep_gemm.{gemm}
BF16_GEMM = r"""
import torch, deep_gemm
a = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
b = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16)
d = torch.empty(256, 384, device="cuda", dtype=torch.bfloat16)
deep_gemm.{gemm}(a, b, d)
torch.cuda.synchronize()
say("{what} rel err", rel_err(d, a.float() @ b.float().T))
"""

STEPS = {
    "selftest": r"""
say("reading address 8 on purpose")
ctypes.string_at(8, 1)
""",
    "import": r"""
say("python", sys.version.split()[0], "dlopenflags", sys.getdlopenflags())
import torch
say("torch", torch.__version__, "cuda", torch.version.cuda, torch.__file__)
import deep_gemm
say("deep_gemm", deep_gemm.__version__, deep_gemm.__file__)
say("_C", deep_gemm._C.__file__)
say("mk alignment", deep_gemm.get_mk_alignment_for_contiguous_layout())
libs("after import")
""",
    "exception": r"""
import deep_gemm
try:
    deep_gemm._C.get_tma_aligned_size(128, 3)  # DG_HOST_ASSERT(16 % element_size == 0): a C++ throw, no CUDA
    say("no exception raised?!")
except RuntimeError as e:
    say("C++ exception became RuntimeError (good):", str(e)[:200])
""",
    "device_runtime": r"""
import torch, deep_gemm
torch.zeros(1, device="cuda")
say("device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
say("num_sms", deep_gemm.get_num_sms())  # first DeviceRuntime use: cublasLtCreate, workspace, device props
libs("after DeviceRuntime")
""",
    "cublaslt": BF16_GEMM.format(gemm="cublaslt_gemm_nt", what="cublaslt"),
    "driver": r"""
import subprocess, tempfile, torch
from ctypes import byref, c_int, c_uint, c_uint32, c_uint64, c_void_p, cast, Structure
work = tempfile.mkdtemp(prefix="dg_diag_drv_")
src = os.path.join(work, "k.cu")
open(src, "w").write('extern "C" __global__ void k(float* p, unsigned n) {'
                     ' unsigned i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) p[i] = (float) i; }\n')
nvcc = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
r = subprocess.run([nvcc, "-cubin", "--gpu-architecture=sm_90a", "-o", os.path.join(work, "k.cubin"), src],
                   capture_output=True, text=True)
say("nvcc rc", r.returncode, r.stdout[-300:], r.stderr[-300:])
x = torch.zeros(1024, device="cuda")  # primary context current on this thread, like DeepGEMM relies on
cu = ctypes.CDLL("libcuda.so.1")

def call(name, *args):
    rc = getattr(cu, name)(*args)
    say(f"{name} -> {rc}")
    assert rc == 0, name

lib, kern, fn, cnt = c_void_p(), c_void_p(), c_void_p(), c_uint()
call("cuLibraryLoadFromFile", byref(lib), os.path.join(work, "k.cubin").encode(), None, None, c_uint(0), None, None, c_uint(0))
call("cuLibraryGetKernelCount", byref(cnt), lib)
call("cuLibraryEnumerateKernels", byref(kern), c_uint(1), lib)
call("cuKernelGetFunction", byref(fn), kern)
call("cuFuncSetAttribute", fn, c_int(8), c_int(1024))  # MAX_DYNAMIC_SHARED_SIZE_BYTES

class Attr(Structure):
    _fields_ = [("id", c_int), ("pad", c_int), ("value", c_uint64 * 8)]

class Config(Structure):
    _fields_ = [("gx", c_uint), ("gy", c_uint), ("gz", c_uint), ("bx", c_uint), ("by", c_uint), ("bz", c_uint),
                ("smem", c_uint), ("stream", c_void_p), ("attrs", c_void_p), ("num_attrs", c_uint)]

attr = Attr(); attr.id = 4  # CLUSTER_DIMENSION, {2, 1, 1}
dims = cast(byref(attr.value), ctypes.POINTER(c_uint))
dims[0], dims[1], dims[2] = 2, 1, 1
cfg = Config(8, 1, 1, 128, 1, 1, 1024, c_void_p(torch.cuda.current_stream().cuda_stream),
             cast(byref(attr), c_void_p), 1)
p, n = c_void_p(x.data_ptr()), c_uint(1024)
params = (c_void_p * 2)(cast(byref(p), c_void_p), cast(byref(n), c_void_p))
call("cuLaunchKernelEx", byref(cfg), fn, params, None)
torch.cuda.synchronize()
say("kernel result ok:", bool((x == torch.arange(1024, device="cuda", dtype=torch.float)).all()))
t = torch.zeros(256, 256, device="cuda", dtype=torch.bfloat16)
buf = (ctypes.c_uint8 * 256)()
tmap = c_void_p((ctypes.addressof(buf) + 127) & ~127)  # CUDA 13 CUtensorMap is alignas(128)
call("cuTensorMapEncodeTiled", tmap, c_int(9), c_uint32(2), c_void_p(t.data_ptr()), (c_uint64 * 2)(256, 256),
     (c_uint64 * 1)(512), (c_uint32 * 2)(64, 64), (c_uint32 * 2)(1, 1), c_int(0), c_int(3), c_int(3), c_int(0))
call("cuLibraryUnload", lib)
""",
    "layout_jit": r"""
import torch, deep_gemm
sf = torch.rand(256, 4, device="cuda")  # K-major FP32 SF: forces the transpose_fp32 JIT kernel
out = deep_gemm.get_mn_major_tma_aligned_tensor(sf)
torch.cuda.synchronize()
say("out", tuple(out.shape), out.stride(), "equal:", torch.equal(out, sf))
""",
    "bf16_gemm": BF16_GEMM.format(gemm="bf16_gemm_nt", what="bf16"),
    "fp8_gemm": r"""
import torch, deep_gemm
from deep_gemm.utils.math import per_token_cast_to_fp8, per_block_cast_to_fp8
x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
y = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16)
d = torch.empty(256, 384, device="cuda", dtype=torch.bfloat16)
deep_gemm.fp8_gemm_nt(per_token_cast_to_fp8(x, use_ue8m0=False), per_block_cast_to_fp8(y, use_ue8m0=False), d)
torch.cuda.synchronize()
say("fp8 dense rel err", rel_err(d, x.float() @ y.float().T))
""",
}

GROUPED = r"""
import torch, deep_gemm
from deep_gemm.utils.math import per_token_cast_to_fp8, per_block_cast_to_fp8, align
G, N, K, ms = {G}, {N}, {K}, {ms}
A = deep_gemm.get_mk_alignment_for_contiguous_layout()
M = sum(align(m, A) for m in ms)
x = torch.zeros(M, K, device="cuda", dtype=torch.bfloat16)
w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16)
idx = torch.full((M,), -1, device="cuda", dtype=torch.int32)
s = 0
for g, m in enumerate(ms):
    x[s:s + m] = torch.randn(m, K, device="cuda")
    idx[s:s + m] = g
    s += align(m, A)
a = per_token_cast_to_fp8(x, use_ue8m0=False)
q = [per_block_cast_to_fp8(w[g], use_ue8m0=False) for g in range(G)]
b = (torch.stack([t[0] for t in q]), torch.stack([t[1] for t in q]))
d = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
say("shapes a", tuple(a[0].shape), tuple(a[1].shape), a[1].stride(), "b", tuple(b[0].shape), tuple(b[1].shape))
deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, d, idx)
torch.cuda.synchronize()
say("group 0 rel err", rel_err(d[:ms[0]], x[:ms[0]].float() @ w[0].float().T))
"""
STEPS["layout_jit_nvrtc"] = STEPS["layout_jit"]
STEPS["grouped_small"] = GROUPED.format(G=2, N=256, K=512, ms=[100, 200])
STEPS["grouped_user"] = GROUPED.format(G=4, N=4096, K=7168, ms=[300, 517, 129, 1000])


def sh(cmd, timeout=60):
    try:
        r = subprocess.run(cmd, shell=isinstance(cmd, str), capture_output=True, text=True, timeout=timeout)
        return r.returncode, (r.stdout + r.stderr).strip()
    except Exception as e:  # noqa: BLE001 (a missing tool is a finding, not an error)
        return -1, f"{type(e).__name__}: {e}"


def section(title):
    print(f"\n===== {title}", flush=True)


def report_environment(dg_root, cuda_home):
    section("toolchain")
    print("python", sys.executable, sys.version.split()[0])
    print("CUDA_HOME", os.environ.get("CUDA_HOME"), "-> used", cuda_home)
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    rc, out = sh([nvcc, "--version"])
    print(f"{nvcc} --version (rc {rc}):\n" + textwrap.indent(out, "    "))
    m = re.search(r"release (\d+\.\d+)", out)
    print("DeepGEMM's parse (compiler.hpp:185):", m.group(1) if m else "NO MATCH -> DG_HOST_ASSERT")
    for tool in ("nvcc", "g++", "gcc", "cc", "c++", "addr2line"):
        print(f"which {tool}:", shutil.which(tool))
    print("g++ --version:", sh("g++ --version | head -1")[1])
    print("cuobjdump:", os.path.exists(os.path.join(cuda_home, "bin", "cuobjdump")))
    print("driver:", sh("nvidia-smi --query-gpu=name,driver_version --format=csv,noheader")[1])
    print(
        "RLIMIT_STACK",
        resource.getrlimit(resource.RLIMIT_STACK),
        "RLIMIT_CORE",
        resource.getrlimit(resource.RLIMIT_CORE),
    )
    for k in sorted(os.environ):
        if k.startswith(("DG_", "CUDA_", "LD_", "PYTHONPATH", "CC", "CXX", "NVCC")):
            print(f"env {k}={os.environ[k]}")

    section("install layout")
    print("deep_gemm root:", dg_root)
    inc = os.path.join(dg_root, "include")
    for name in ("deep_gemm", "cute", "cutlass"):
        p = os.path.join(inc, name)
        print(
            f"  include/{name}: exists={os.path.exists(p)} islink={os.path.islink(p)} "
            f"readlink={os.readlink(p) if os.path.islink(p) else '-'} realpath={os.path.realpath(p)}"
        )
    for rel in (
        "cute/tensor.hpp",
        "cutlass/cutlass.h",
        "deep_gemm/impls/smxx_layout.cuh",
        "deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh",
        "deep_gemm/impls/sm90_bf16_gemm.cuh",
    ):
        print(f"  {rel}: {os.path.exists(os.path.join(inc, rel))}")
    # The include walk DeepGEMM hashes before its first debug print (include_parser.hpp:181-238)
    pat, seen, problems = re.compile(r'#\s*include\s*[<"][^>"]+[>"]'), set(), []
    todo = ["deep_gemm/impls/smxx_layout.cuh", "deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh"]
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        try:
            code = open(os.path.join(inc, rel)).read()
        except OSError as e:
            problems.append(f"cannot open {rel}: {e}")
            continue
        for s in pat.findall(code):
            if not (s.startswith("#include <") and s.endswith(">") and s[10] != " " and s[-2] != " "):
                problems.append(f"non-standard include in {rel}: {s}")
            elif s[10:-1].startswith("deep_gemm"):
                todo.append(s[10:-1])
    print(f"  include-hash walk: {len(seen)} files, problems: {problems or 'none'}")
    sos = sorted(glob.glob(os.path.join(dg_root, "_C*.so")))
    print(
        "  extension files:", [(os.path.basename(s), os.path.getsize(s), time.ctime(os.path.getmtime(s))) for s in sos]
    )
    for so in sos:
        rc, out = sh(["ldd", so])
        keep = [
            l.strip()
            for l in out.splitlines()
            if re.search(r"stdc\+\+|gcc_s|cudart|nvrtc|cublas|torch_cuda|c10_cuda|not found", l)
        ]
        print(f"  ldd {os.path.basename(so)}:\n" + textwrap.indent("\n".join(keep), "      "))
        print(
            "  RPATH/RUNPATH:", [l.strip() for l in sh(["readelf", "-d", so])[1].splitlines() if "PATH" in l] or "none"
        )
        und = sh(["nm", "-D", "--undefined-only", so])[1]
        print(
            "  built with DG_JIT_USE_RUNTIME_API:",
            "cudaLibraryLoadFromFile" in und,
            "| cublasLtCreate undefined (resolved at import):",
            "cublasLtCreate" in und,
        )
        need = sorted(
            set(re.findall(r"GLIBCXX_[\d.]+", sh(["objdump", "-T", so])[1])),
            key=lambda v: [int(x) for x in v.split("_")[1].split(".")],
        )
        print("  highest GLIBCXX needed:", need[-1] if need else "?")


def build_helper(work):
    src, lib = os.path.join(work, "dg_segv.c"), os.path.join(work, "libdg_segv.so")
    open(src, "w").write(SEGV_HELPER_C)
    for cc in ("cc", "gcc", "/opt/gcc/bin/gcc", "g++"):
        if shutil.which(cc) or os.path.exists(cc):
            rc, out = sh([cc, "-O1", "-g", "-shared", "-fPIC", "-x", "c", src, "-o", lib])
            if rc == 0:
                return lib
            print(f"helper build with {cc} failed: {out[-300:]}")
    return None


def resolve_native(log):
    """addr2line the frames that are in DeepGEMM's extension."""
    out = []
    for m in re.finditer(r"\[native\] #(-?\d+) \S+ (\S+)\+0x([0-9a-f]+) \((.*)\)", log):
        idx, obj, off, sym = int(m.group(1)), m.group(2), int(m.group(3), 16), m.group(4)
        where = ""
        if "deep_gemm" in obj and shutil.which("addr2line"):
            rc, txt = sh(["addr2line", "-C", "-f", "-i", "-e", obj, hex(off if idx < 0 else off - 1)])
            where = " | ".join(txt.splitlines()[:6])
        out.append(f"  #{idx} {os.path.basename(obj)}+{hex(off)} {sym[:80]} {where}")
    return out


def last_milestone(log):
    best = None
    for line in log.splitlines():
        for key, meaning in MILESTONES:
            if line.startswith(key):
                best = (key, meaning, line[:160])
    return best


def run_step(name, args, env, out_dir, helper, cache_dir):
    body = (
        CHILD_PRELUDE
        + "\ntry:\n"
        + textwrap.indent(STEPS[name], "    ")
        + "\n    say('STEP-OK')\nexcept BaseException:\n    traceback.print_exc()\n    sys.stdout.flush()\n    os._exit(3)\n"
    )
    script = os.path.join(out_dir, f"step_{name}.py")
    open(script, "w").write(body)
    cenv = dict(env)
    cenv.update(DG_JIT_DEBUG="1", DG_JIT_PRINT_COMPILER_COMMAND="1", DG_JIT_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
    if helper:
        cenv["DG_DIAG_SEGV_HELPER"] = helper
    if name == "layout_jit_nvrtc":
        cenv.update(DG_JIT_USE_NVRTC="1", DG_JIT_CACHE_DIR=cache_dir + "_nvrtc")
    log_path = os.path.join(out_dir, f"step_{name}.log")
    t0 = time.time()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(
                [sys.executable, "-u", script],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=cenv,
                timeout=args.step_timeout,
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = open(log_path, errors="replace").read()
    if rc == "timeout":
        status = "TIMEOUT"
    elif rc == 0:
        status = "OK"
    elif rc == 3:
        status = "PYTHON EXCEPTION"
    elif rc < 0:
        status = f"KILLED by signal {-rc}" + (" (SIGSEGV)" if rc == -11 else " (SIGABRT)" if rc == -6 else "")
    else:
        status = f"exit {rc}"
    print(f"\n----- step {name}: {status} in {time.time() - t0:.0f} s  ({MEANING[name]})", flush=True)
    ms = last_milestone(text)
    if ms:
        print(f"  last DeepGEMM milestone: '{ms[0]}' = {ms[1]}\n      {ms[2]}")
    natives = resolve_native(text)
    if natives:
        print("  native frames (faulting pc first):\n" + "\n".join(natives[:24]))
    lines = [l for l in text.splitlines() if not l.startswith("[native] #")]
    # Skip the big generated-code dumps in the tail, keep everything else
    tail, skip = [], False
    for l in lines:
        if l.startswith("Generated kernel code"):
            skip = True
            tail.append(l + " (code omitted; full log in " + log_path + ")")
            continue
        if skip and (
            l.startswith(("Create directory", "Running", "Compiling", "Loading", "Launch", "Making", "GemmDesc"))
            or "Error" in l
            or "error" in l
            or l.startswith(("Traceback", "Fatal", "[native]", "STEP-OK"))
        ):
            skip = False
        if not skip:
            tail.append(l)
    print(textwrap.indent("\n".join(tail[-args.tail :]), "  | "))
    for root in (cache_dir, cache_dir + "_nvrtc"):
        if os.path.isdir(root):
            kernels = sorted(glob.glob(os.path.join(root, "cache", "kernel.*")))
            tmps = sorted(glob.glob(os.path.join(root, "tmp", "*")))
            print(
                f"  jit cache {os.path.basename(root)}: {[os.path.basename(k) + ':' + ','.join(sorted(os.listdir(k))) for k in kernels]}"
                f" leftover tmp: {[os.path.basename(t) + ':' + ','.join(sorted(os.listdir(t))) for t in tmps if os.path.isdir(t)]}"
            )
    return status


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", default=",".join(DEFAULT_STEPS), help="comma list from: " + ",".join(STEP_ORDER))
    p.add_argument("--budget", type=float, default=480, help="seconds for all steps (default 480)")
    p.add_argument("--step-timeout", type=float, default=240)
    p.add_argument("--tail", type=int, default=30, help="log lines shown per step")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", tempfile.gettempdir()), "dg_diag"))
    args = p.parse_args()
    t_start = time.time()
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="dg_diag_")
    cache_dir = os.path.join(work, "jit_cache")

    spec = importlib.util.find_spec("deep_gemm")
    if spec is None or not spec.origin:
        sys.exit("deep_gemm is not importable: set PYTHONPATH to the DeepGEMM tree")
    dg_root = os.path.dirname(os.path.abspath(spec.origin))
    cuda_home = (
        os.environ.get("CUDA_HOME")
        or os.environ.get("CUDA_PATH")
        or (os.path.dirname(os.path.dirname(shutil.which("nvcc"))) if shutil.which("nvcc") else "/usr/local/cuda")
    )
    report_environment(dg_root, cuda_home)

    helper = build_helper(work)
    print("\nnative backtrace helper:", helper or "UNAVAILABLE (faulthandler only)")
    section("steps (each in its own process)")
    results, env = {}, dict(os.environ)
    env.setdefault("CUDA_HOME", cuda_home)
    for name in [s for s in STEP_ORDER if s in args.steps.split(",")]:
        left = args.budget - (time.time() - t_start)
        if name == "layout_jit_nvrtc" and results.get("layout_jit") == "OK":
            results[name] = "skipped (layout_jit passed)"
            continue
        if left < 20:
            results[name] = f"skipped (budget: {left:.0f} s left)"
            continue
        args.step_timeout = min(args.step_timeout, left)
        results[name] = run_step(name, args, env, args.out, helper, cache_dir)
        if name == "import" and results[name] != "OK":
            break

    section("summary")
    first_bad = None
    for name in STEP_ORDER:
        if name in results:
            note = ""
            if name == "selftest":
                ok = "SIGSEGV" in results[name]
                note = "  (expected crash: handler works)" if ok else "  (crash handling NOT verified)"
            print(f"  {name:18s} {results[name]}{note}")
            if (
                name != "selftest"
                and first_bad is None
                and results[name] != "OK"
                and not results[name].startswith("skipped")
            ):
                first_bad = name
    if first_bad:
        print(f"\nfirst failing step: {first_bad} -> points at {MEANING[first_bad]}")
    else:
        print("\nno step failed: compare the failing program's environment (env section) with this one")
    print(f"logs: {args.out}  (step_*.log, step_*.py); total {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
