"""The kernels' division by an invariant divisor (csrc/kernels/sm90_divide.cuh), compiled for the host
with the system C++ compiler and checked against `/`: divisors 1 to 2^32 - 1, dividends at both ends
of the 32-bit range, at multiples of the divisor and either side of them, and drawn at random."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

HEADER_DIR = Path(__file__).resolve().parent.parent / "csrc" / "kernels"

DRIVER = r"""
#include "sm90_divide.cuh"
#include <cstdio>
#include <random>
int main(int argc, char** argv) {
  std::mt19937_64 rng(std::stoull(argv[1]));
  long long checks = 0, bad = 0;
  auto check = [&](uint32_t n, uint32_t d, moe_fp4::DivU32 v) {
    ++checks;
    if (moe_fp4::div_u32(n, v) != n / d && bad++ < 5) std::printf("bad %u / %u\n", n, d);
  };
  auto all = [&](uint32_t d) {
    const moe_fp4::DivU32 v = moe_fp4::make_div_u32(d);
    for (uint32_t n = 0; n < 4096; ++n) check(n, d, v);
    for (uint32_t k = 0; k < 4096; ++k) check(0xFFFFFFFFu - k, d, v);
    for (uint64_t q = 1; q < 2048 && q * d <= 0xFFFFFFFFull; ++q) {
      check(static_cast<uint32_t>(q * d), d, v);
      check(static_cast<uint32_t>(q * d - 1), d, v);
    }
    const uint64_t top = 0xFFFFFFFFull / d;  // the largest quotients
    for (uint64_t q = top > 64 ? top - 64 : 1; q <= top; ++q) {
      check(static_cast<uint32_t>(q * d), d, v);
      check(static_cast<uint32_t>(q * d - 1), d, v);
    }
    for (int i = 0; i < 2000; ++i) check(static_cast<uint32_t>(rng()) >> (rng() % 32), d, v);
  };
  for (uint32_t d = 1; d <= 300; ++d) all(d);
  for (int l = 1; l < 32; ++l) {  // powers of two and their neighbours
    all((1u << l) - 1u); all(1u << l); all((1u << l) + 1u);
  }
  all(0xFFFFFFFFu);
  for (int j = 0; j < 2000; ++j) {
    uint32_t d = static_cast<uint32_t>(rng()) >> (rng() % 32);
    all(d == 0u ? 1u : d);
  }
  std::printf("%lld checks, %lld wrong\n", checks, bad);
  return bad != 0;
}
"""


def test_div_u32_matches_division(tmp_path):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    src = tmp_path / "divide.cpp"
    src.write_text(DRIVER)
    exe = tmp_path / "divide"
    build = subprocess.run([cxx, "-std=c++17", "-O2", f"-I{HEADER_DIR}", str(src), "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    seed = int.from_bytes(os.urandom(4), "little")
    res = subprocess.run([str(exe), str(seed)], capture_output=True, text=True)
    assert res.returncode == 0, f"seed {seed}: {res.stdout}"
    checks, wrong = res.stdout.split(" checks, ")
    assert int(checks) > 10_000_000 and wrong.startswith("0 wrong"), res.stdout
