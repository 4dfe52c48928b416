"""Shared comparison helpers: bitwise equality that names the first mismatching coordinate, the
ValueError that must name what is wrong, and each test's fixed seed."""

import os
import zlib

import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def case_seed() -> int:
    """This test's seed: fixed (a CRC of the test's id, parameters included, so every run draws the same
    inputs) and printed (pytest shows it with a failure)."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    seed = zlib.crc32(test.encode()) & ((1 << 30) - 1)
    print(f"seed {seed} ({test})")
    return seed


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_BITS[t.element_size()])


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "tensor") -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, e = as_bits(actual).cpu(), as_bits(expected).cpu()
    diff = a != e
    if bool(diff.any()):
        idx = tuple(int(i) for i in diff.nonzero()[0])
        n = int(diff.sum())
        raise AssertionError(
            f"{what}: {n} of {a.numel()} elements differ; first at {idx}: "
            f"got {actual.cpu()[idx]!r} (bits {int(a[idx]):#x}), expected {expected.cpu()[idx]!r} "
            f"(bits {int(e[idx]):#x})"
        )


def expect_value_error(fn, *words) -> str:
    """Call fn; it must raise a ValueError whose message holds every one of words. Returns the message."""
    try:
        fn()
    except ValueError as e:
        msg = str(e)
        assert all(w in msg for w in words), f"ValueError {msg!r} does not mention {words}"
        return msg
    raise AssertionError(f"expected ValueError mentioning {words}")


def random_splits(experts: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh random int64 (lengths, offsets) of experts segments: lengths in [0, max_len) with one
    forced empty, laid out back to back in a random expert order (offsets not increasing)."""
    lens = torch.randint(0, max_len, (experts,))
    lens[int(torch.randint(0, experts, ()))] = 0
    order = torch.randperm(experts)
    offs = torch.empty(experts, dtype=torch.int64)
    offs[order] = torch.cumsum(lens[order], 0) - lens[order]
    return lens, offs
