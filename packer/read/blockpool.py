"""Batch memory a ThreadLoader decodes into, used again once nothing holds a batch made from it."""

from __future__ import annotations

import sys
import threading
import weakref

import numpy as np
import torch

from packer.read.staged import StagedDataset


class BlockPool:
    """Batch memory used again once nothing holds a batch made from it.

    Fresh memory costs a page fault per 4 KiB page on first touch (decoding 64 photos of 500x375 into
    a new block: ~25 % more CPU than into memory touched before; docs/results.md). A block is a numpy
    array that every tensor made from it keeps alive (``torch.from_numpy``): when only this pool still
    refers to it, no batch, view or copy-free conversion of one is left, and it is handed out again.
    One pool per dataset, for every ThreadLoader over it (``pool_of``): kept across epochs and loaders (a
    new pool per epoch: ~5 % more CPU on 1,500 photos, docs/results.md), so ``take`` may be called by two
    feeders at once: it holds a lock.
    """

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


_POOLS: weakref.WeakKeyDictionary[StagedDataset, dict[str, BlockPool]] = weakref.WeakKeyDictionary()
_POOLS_LOCK = threading.Lock()


def pool_of(ds: StagedDataset, keep: int, kind: str = "pixels") -> BlockPool:
    """The memory of ``ds``'s ThreadLoaders (kept while ``ds`` lives), remembering at least ``keep`` blocks:
    ``pixels``, the batches decoded into; ``payloads``, the stored bytes read for them (``payloads_at(into=)``)."""
    with _POOLS_LOCK:
        pools = _POOLS.setdefault(ds, {})
        pool = pools.get(kind)
        if pool is None:
            pool = pools[kind] = BlockPool(keep)
        pool.keep = max(pool.keep, keep)
        return pool
