"""Read hints that travel with the sample indices: the order being iterated says which block a sample is read from.

A sampler that reads block by block (``BlockShuffleSampler``) yields ``Hinted`` indices: ints to
everyone else, each carrying the range of storage positions its block will be read from in this
iteration. A DataLoader hands them, inside the batch, to whichever worker reads the batch (fork or
spawn, under DDP each rank its own), and that worker's reads may then be widened to whole device
requests inside the block (packer.read.readahead), since the rest of the block is read in this
iteration anyway; a uniform shuffle yields plain ints, and its batches read their own bytes only.
Nothing is switched on in the dataset: no state outlives the iteration that made the hints.

Blocks are not read whole in the background: such reads, queued between a batch's own, delayed the
bytes decoded next (docs/results.md, "Reads in the order decoding needs them").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np


class Ahead(NamedTuple):
    """Storage positions [first, stop) an iteration reads whole (a block, or a rank's share of it)."""

    first: int
    stop: int


class Hinted(int):
    """A sample index (the dataset's public one) with the ``Ahead`` range of its block.
    Arithmetic, hashing and comparison are plain ``int``'s."""

    aheads: tuple[Ahead, ...]

    def __new__(cls, value: int, aheads: tuple[Ahead, ...]) -> Hinted:
        self = super().__new__(cls, value)
        self.aheads = aheads
        return self

    def __reduce__(self) -> tuple:  # to a worker: the class, the int and the ranges; no per-index dict
        return (Hinted, (int(self), self.aheads))


def block_ranges(stored: np.ndarray, bounds: np.ndarray) -> tuple[np.ndarray, list[Ahead]]:
    """For an order of storage positions: each one's block (by ``bounds``), and per block the hull of the
    positions this order reads from it (a rank's share of a block split between ranks, not the whole block)."""
    stored = np.asarray(stored, dtype=np.int64)
    block = np.searchsorted(bounds, stored, side="right") - 1
    nb = len(bounds) - 1
    first = np.full(nb, np.iinfo(np.int64).max, dtype=np.int64)
    last = np.full(nb, -1, dtype=np.int64)
    np.minimum.at(first, block, stored)
    np.maximum.at(last, block, stored)
    return block, [Ahead(int(a), int(b) + 1) for a, b in zip(first.tolist(), last.tolist())]


def aheads_of(indices: Iterable[int]) -> list[Ahead]:
    """The distinct ``Ahead`` ranges a batch's indices carry, in order of first appearance ([] for plain ints)."""
    return list(dict.fromkeys(a for i in indices if isinstance(i, Hinted) for a in i.aheads))


class HintedOrder(Sequence[int]):
    """An iteration's order of public indices, made ``Hinted`` with their block when taken (an epoch of
    ImageNet would be a million objects at once); one tuple per block, pickled once per batch."""

    def __init__(self, public: Sequence[int], block: np.ndarray, aheads: Sequence[Ahead]) -> None:
        self.public, self.block = public, block
        self.made = [(a,) for a in aheads]

    def __len__(self) -> int:
        return len(self.public)

    def __getitem__(self, k):  # type: ignore[override]  # int positions only: the order is walked, never sliced
        return Hinted(self.public[k], self.made[int(self.block[k])])


def hinted_order(public: Sequence[int], stored: np.ndarray, bounds: np.ndarray) -> HintedOrder:
    """One iteration of an order by blocks: ``public`` indices (as yielded) of the storage positions ``stored``,
    hinted with the blocks of ``bounds``."""
    block, aheads = block_ranges(stored, bounds)
    return HintedOrder(public, block, aheads)
