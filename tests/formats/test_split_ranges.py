"""``formats.base.split_ranges``: byte ranges cut at block edges, many at once (HDF5 chunks, N5 blocks)."""

from __future__ import annotations

import numpy as np

from packer.formats.base import split_ranges


def brute(a: list[int], b: list[int], size: int) -> list[tuple[int, int, int, int]]:
    """The pieces one byte at a time: (block, start in it, end in it, which range), in order."""
    out: list[tuple[int, int, int, int]] = []
    for k, (lo, hi) in enumerate(zip(a, b, strict=True)):
        for byte in range(lo, hi):
            block, at = divmod(byte, size)
            if out and out[-1][3] == k and out[-1][0] == block:
                out[-1] = (block, out[-1][1], at + 1, k)
            else:
                out.append((block, at, at + 1, k))
    return out


def test_split_ranges_equals_cutting_byte_by_byte():
    rng = np.random.default_rng(0)
    for _ in range(300):
        size = int(rng.integers(1, 40))
        n = int(rng.integers(0, 8))
        a = rng.integers(0, 200, n)
        b = a + rng.integers(0, 90, n) * rng.integers(0, 2, n)  # some empty
        got = split_ranges(a, b, size)
        assert all(part.dtype == np.int64 for part in got)
        assert list(zip(*(part.tolist() for part in got))) == brute(a.tolist(), b.tolist(), size)
    assert [part.tolist() for part in split_ranges([], [], 8)] == [[], [], [], []]
