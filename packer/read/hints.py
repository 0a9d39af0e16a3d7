"""Read-ahead hints that travel with the sample indices: the order being iterated says what comes next.

A sampler that reads block by block (``BlockShuffleSampler``) yields ``Hinted`` indices: ints to
everyone else, each carrying the range of storage positions its block will be read from in this
iteration. A DataLoader hands them, inside the batch, to whichever worker reads the batch (fork or
spawn, under DDP each rank its own), so a worker reads whole blocks ahead exactly while such an
order is iterated; a uniform shuffle yields plain ints, and its batches read their own bytes only.
Nothing is switched on in the dataset: no state outlives the iteration that made the hints.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np


class Ahead(NamedTuple):
    """Storage positions [first, stop) an iteration will read soon; ``tag`` tells iterations apart."""

    first: int
    stop: int
    tag: int


class Hinted(int):
    """A sample index (the dataset's public one) with the ``Ahead`` ranges to read soon: its own block's, then
    (late in a window) the next window's blocks. Arithmetic, hashing and comparison are plain ``int``'s."""

    aheads: tuple[Ahead, ...]

    def __new__(cls, value: int, aheads: tuple[Ahead, ...]) -> Hinted:
        self = super().__new__(cls, value)
        self.aheads = aheads
        return self

    def __reduce__(self) -> tuple:  # to a worker: the class, the int and the ranges; no per-index dict
        return (Hinted, (int(self), self.aheads))


def block_ranges(stored: np.ndarray, bounds: np.ndarray, tag: int) -> tuple[np.ndarray, list[Ahead]]:
    """For an order of storage positions: each one's block (by ``bounds``), and per block the hull of the
    positions this order reads from it (a rank's share of a block split between ranks, not the whole block)."""
    stored = np.asarray(stored, dtype=np.int64)
    block = np.searchsorted(bounds, stored, side="right") - 1
    nb = len(bounds) - 1
    first = np.full(nb, np.iinfo(np.int64).max, dtype=np.int64)
    last = np.full(nb, -1, dtype=np.int64)
    np.minimum.at(first, block, stored)
    np.maximum.at(last, block, stored)
    return block, [Ahead(int(a), int(b) + 1, tag) for a, b in zip(first.tolist(), last.tolist())]


def aheads_of(indices: Iterable[int]) -> list[Ahead]:
    """The distinct ``Ahead`` ranges a batch's indices carry, in order of first appearance ([] for plain ints)."""
    return list(dict.fromkeys(a for i in indices if isinstance(i, Hinted) for a in i.aheads))


class HintedOrder(Sequence[int]):
    """An iteration's order of public indices, made ``Hinted`` when taken (an epoch of ImageNet would be a
    million objects at once). Each carries its block; in the second half of a window (``window`` samples: the
    sampler's, see ``sampler.window_samples``) also the next window's blocks, so the worker holding such a
    batch starts reading them while the current window is decoded (in the order they are first needed)."""

    def __init__(self, public: Sequence[int], block: np.ndarray, aheads: Sequence[Ahead], window: int) -> None:
        self.public, self.block, self.aheads, self.window = public, block, aheads, max(int(window), 1)
        self._made: dict[tuple[int, int], tuple[Ahead, ...]] = {}  # one tuple per (block, window): pickled once

    def __len__(self) -> int:
        return len(self.public)

    def __getitem__(self, k):  # type: ignore[override]  # int positions only: the order is walked, never sliced
        b, w = int(self.block[k]), k // self.window
        late = k - w * self.window >= self.window // 2
        key = (b, w if late else -1)
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = (self.aheads[b], *(self._next_window(w) if late else ()))
        return Hinted(self.public[k], made)

    def _next_window(self, w: int) -> tuple[Ahead, ...]:
        seg = self.block[(w + 1) * self.window : (w + 2) * self.window]
        blocks, first = np.unique(seg, return_index=True)
        return tuple(self.aheads[int(b)] for b in blocks[np.argsort(first)])


def hinted_order(public: Sequence[int], stored: np.ndarray, bounds: np.ndarray, window: int) -> HintedOrder:
    """One iteration of an order by blocks: ``public`` indices (as yielded) of the storage positions ``stored``,
    hinted with the blocks of ``bounds`` and ``window``; the tag is new, so a later iteration reads ahead again."""
    block, aheads = block_ranges(stored, bounds, tag=time.monotonic_ns())
    return HintedOrder(public, block, aheads, window)
