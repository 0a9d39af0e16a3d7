"""Batch memory: where a batch's images are decoded straight into (its slots), and the pool that reuses it.

Three kinds, one per way a batch leaves the pipeline: in a DataLoader worker, one block of shared memory for a
batch of mixed sizes, so it crosses to the main process as one block, as ``default_collate``'s stacked batches do
(``WORKER``); a ThreadLoader's block, the rows of one (N, H, W, 3) tensor where the samples share a size, taken from
a pool that hands a block out again once nothing holds a batch made from it (``Pooled``); the rows of the tensor
``get_batch`` returns (``Rows``). Keeping one image keeps its batch's block alive.
"""

from __future__ import annotations

import sys
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np
import torch
from torch.utils.data import get_worker_info

BATCH_BLOCK_MAX = 1 << 30  # largest block a batch's slots take (larger: each image its own array)

Shapes = list[tuple[int, int]]  # (h, w) of each sample's HWC uint8 slot
Slots = tuple[torch.Tensor | None, list[torch.Tensor]]  # (the stacked (N, H, W, 3) block or None, one slot each)


class SlotMemory(ABC):
    """Where a batch's slots are made, given each sample's shape."""

    @abstractmethod
    def slots(self, shapes: Shapes, cropped: bool) -> Slots | None:
        """The slots for these shapes (``cropped``: a fused crop's outputs), or None: each sample its own array."""


class WorkerMemory(SlotMemory):
    """Inside a DataLoader worker (``in_worker`` None: as ``get_worker_info`` says), one shared block for a batch of
    several shapes, or of fused crops; None elsewhere, and for one shape without a crop, which a collate function
    stacks into shared memory itself (a block here would be one more copy)."""

    def __init__(self, in_worker: bool | None = None) -> None:
        self.in_worker = in_worker

    def slots(self, shapes: Shapes, cropped: bool) -> Slots | None:
        if not (get_worker_info() is not None if self.in_worker is None else self.in_worker):
            return None
        if cropped:
            block = new_batch((len(shapes), *shapes[0], 3) if shapes else (0, 0, 0, 3), shared=True)
            return block, list(block.unbind(0))
        if len(set(shapes)) <= 1:
            return None
        return None, views(new_batch((sum(h * w * 3 for h, w in shapes),), shared=True), shapes)


class Pooled(SlotMemory):
    """A block from ``alloc(nbytes)`` (flat uint8, e.g. a ``BlockPool``'s): the rows of one (N, H, W, 3) tensor where
    every sample has one shape, else views of consecutive pieces."""

    def __init__(self, alloc: Callable[[int], torch.Tensor] | None = None) -> None:
        self.alloc = alloc

    def slots(self, shapes: Shapes, cropped: bool) -> Slots | None:
        total = sum(h * w * 3 for h, w in shapes)
        block = torch.empty(total, dtype=torch.uint8) if self.alloc is None else self.alloc(total)
        if len(set(shapes)) <= 1:
            h, w = shapes[0] if shapes else (0, 0)
            stacked = block.view(len(shapes), h, w, 3)
            return stacked, list(stacked.unbind(0))
        return None, views(block, shapes)


class Rows(SlotMemory):
    """The rows of ``out``, an (N, H, W, 3) uint8 tensor, where every shape is its rows' (else None)."""

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out

    def slots(self, shapes: Shapes, cropped: bool) -> Slots | None:
        if any((h, w, 3) != tuple(self.out.shape[1:]) for h, w in shapes) or len(shapes) != len(self.out):
            return None
        return self.out, list(self.out.unbind(0))


def views(block: torch.Tensor, shapes: Shapes) -> list[torch.Tensor]:
    """HWC views of consecutive pieces of the flat, contiguous ``block``, one per shape (one call each)."""
    if not block.is_contiguous() or sum(h * w * 3 for h, w in shapes) > block.numel():
        raise ValueError(f"a block of {block.numel()} bytes is not contiguous or too small for these shapes")
    out, start, view = [], block.storage_offset(), block.as_strided
    for h, w in shapes:
        out.append(view((h, w, 3), (w * 3, 3, 1), start))
        start += h * w * 3
    return out


def new_batch(shape: tuple[int, ...], shared: bool | None = None) -> torch.Tensor:
    """An uint8 tensor; inside a DataLoader worker (``shared`` None: as ``get_worker_info`` says) it lives in
    shared memory, as ``default_collate`` makes its batches, so handing it to the main process copies nothing."""
    if not (get_worker_info() is not None if shared is None else shared):
        return torch.empty(shape, dtype=torch.uint8)
    elem = torch.empty(0, dtype=torch.uint8)
    storage = elem._typed_storage()._new_shared(int(np.prod(shape)), device=elem.device)
    return elem.new(storage).resize_(*shape)


class BlockPool:
    """Batch memory used again once nothing holds a batch made from it (fresh memory costs a page fault per page on
    first touch). A block is a numpy array that every tensor made from it keeps alive (``torch.from_numpy``): when
    only this pool still refers to it, it is handed out again. ``take`` may be called by two feeders at once."""

    def __init__(self, keep: int) -> None:
        self.keep = keep  # blocks remembered; beyond them new blocks are left to the garbage collector
        self.blocks: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 tensor of ``nbytes``, in a free block where one is large enough."""
        with self._lock:  # a block found free is taken (referred to by the tensor) before another feeder looks
            return torch.from_numpy(self._take(nbytes))[:nbytes]

    def take_array(self, nbytes: int) -> np.ndarray:
        """``take`` as a numpy array (a view of the block: it is free again when no view of it is left)."""
        with self._lock:
            return self._take(nbytes)[:nbytes]

    def _take(self, nbytes: int) -> np.ndarray:
        for k in range(len(self.blocks)):
            # references: the list's, and getrefcount's argument
            if self.blocks[k].nbytes >= nbytes and sys.getrefcount(self.blocks[k]) == 2:
                return self.blocks[k]
        block = np.empty(max([nbytes, *(b.nbytes for b in self.blocks)]), dtype=np.uint8)
        free = [k for k in range(len(self.blocks)) if sys.getrefcount(self.blocks[k]) == 2]
        if len(self.blocks) < self.keep:
            self.blocks.append(block)
        elif free:
            self.blocks[free[0]] = block  # a free one too small: replaced by the larger one
        return block


_POOLS: weakref.WeakKeyDictionary[object, dict[str, BlockPool]] = weakref.WeakKeyDictionary()
_POOLS_LOCK = threading.Lock()


def pool_of(owner: object, keep: int, kind: str = "pixels") -> BlockPool:
    """The batch memory of ``owner``'s ThreadLoaders (a dataset; kept while it lives, across epochs and loaders),
    remembering at least ``keep`` blocks: ``pixels``, the batches decoded into; ``payloads``, the stored bytes read
    for them (copies, ``SampleSource.payloads(into=)``)."""
    with _POOLS_LOCK:
        pools = _POOLS.setdefault(owner, {})
        pool = pools.get(kind)
        if pool is None:
            pool = pools[kind] = BlockPool(keep)
        pool.keep = max(pool.keep, keep)
        return pool
