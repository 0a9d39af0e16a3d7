"""A locality-preserving shuffle (the idea of FFCV's quasi-random order) for every packed dataset.

Samples are cut into blocks of contiguous storage (``block_bytes``, never across a shard); each epoch the blocks are
put in a new random order and split into equal parts, one per rank (padded or cut as ``DistributedSampler`` does);
inside a rank, windows of about ``open_blocks`` blocks are shuffled in runs of ``run`` neighbours, a window holding a
whole number of batches. Reads stay large and near each other; the order is a pure function of (seed, epoch, rank,
number of ranks) and the blocks, drawn from PCG64's stable stream, and is yielded as the dataset's public indices.
docs/sampling.md has the rules, the tuning and what the locality costs in shuffle quality.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from torch.utils.data import BatchSampler, DistributedSampler, Sampler

from packer._random import raw_draws, stable_permutation
from packer.errors import OptionError
from packer.layout.index import shard_starts
from packer.read.dataset import PackedDataset
from packer.read.hints import hinted_order
from packer.read.indexing import IndexMap
from packer.read.ranks import check_rank, replicas_and_rank, warn_if_accelerate
from packer.read.resume import EpochPosition, resume_position

DEFAULT_BLOCK_BYTES = 16_000_000  # long enough that a seek is a small part of a block's read (docs/sampling.md)
DEFAULT_OPEN_BLOCKS = 8  # window of 128 MB per rank: mixing across blocks at no IO cost
DEFAULT_RUN = 16  # neighbours read together: ~1.8 MB reads of ImageNet JPEGs; see docs/sampling.md


# ------------------------------------------------------------------ blocks


def block_boundaries(nbytes: np.ndarray, block_bytes: int, cuts: Sequence[int] | np.ndarray = ()) -> np.ndarray:
    """Start of each block of contiguous samples holding about ``block_bytes``, plus the end.

    A block closes once it holds ``block_bytes`` or more (a sample larger than that is a
    block of its own), and always at each of ``cuts`` (shard starts: a block never spans
    two files).
    """
    if block_bytes <= 0:
        raise OptionError(f"block size must be positive, got {block_bytes}")
    nbytes = np.asarray(nbytes, dtype=np.int64)
    n = len(nbytes)
    bounds = [0]
    for stop in sorted({int(c) for c in cuts if 0 < int(c) < n} | {n}):
        start = bounds[-1]
        csum = np.cumsum(nbytes[start:stop])  # bytes from this shard's first sample
        done = 0  # bytes before the open block
        while bounds[-1] < stop:
            j = int(np.searchsorted(csum, done + block_bytes, side="left"))  # first sample reaching the size
            end = min(stop, start + j + 1)
            bounds.append(end)
            done = int(csum[end - start - 1])
    return np.asarray(bounds, dtype=np.int64)


def check_boundaries(blocks: Sequence[int] | np.ndarray, n: int) -> np.ndarray:
    """Explicit block boundaries: increasing, from 0 to ``n`` (len = number of blocks + 1)."""
    b = np.asarray(blocks, dtype=np.int64)
    if b.ndim != 1 or len(b) < 2 or b[0] != 0 or b[-1] != n or np.any(np.diff(b) <= 0):
        raise OptionError(
            f"blocks must be strictly increasing sample indices from 0 to the dataset length {n} "
            f"(block i is samples blocks[i]..blocks[i+1]-1); got {len(b)} values"
            + (f" from {b[0]} to {b[-1]}" if b.ndim == 1 and len(b) else "")
        )
    return b


def dataset_boundaries(dataset: Any, block_bytes: int | None = None,
                       blocks: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
    """Block boundaries for ``dataset``: explicit ``blocks``, the dataset's own (``block_boundaries()``,
    e.g. one mosaic per block), or ``block_bytes`` of payload from its metadata, cut at shard starts."""
    n = len(dataset)
    if blocks is not None:
        return check_boundaries(blocks, n)
    if not isinstance(dataset, PackedDataset):
        raise OptionError(f"{type(dataset).__name__} is not a packer dataset, so it has no per-sample sizes: "
                          "pass blocks= explicitly")
    bounds = dataset.block_boundaries() if block_bytes is None else None
    if bounds is not None:
        return check_boundaries(bounds, n)
    cuts = shard_starts([s.num_samples for s in dataset.manifest.shards])[1:-1]
    return block_boundaries(dataset.index.nbytes, DEFAULT_BLOCK_BYTES if block_bytes is None else block_bytes, cuts)


# ------------------------------------------------------------------ the order


def rank_order(
    bounds: np.ndarray,
    epoch: int,
    seed: int = 0,
    *,
    num_replicas: int = 1,
    rank: int = 0,
    open_blocks: int = DEFAULT_OPEN_BLOCKS,
    run: int = DEFAULT_RUN,
    batch_size: int | None = None,
    shuffle: bool = True,
    drop_last: bool = False,
) -> np.ndarray:
    """The storage positions rank ``rank`` of ``num_replicas`` reads in ``epoch`` (see the module doc)."""
    n = int(bounds[-1])
    sizes = np.diff(bounds)
    nb = len(sizes)
    if not shuffle or n == 0:
        seq, unit = np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    else:
        perm = stable_permutation(nb, seed, epoch, 0)
        psizes = sizes[perm]
        offset = np.arange(n) - np.repeat(np.concatenate(([0], np.cumsum(psizes)[:-1])), psizes)  # inside block
        seq = np.repeat(bounds[:-1][perm], psizes) + offset  # the blocks end to end, in permuted order
        # runs of `run` neighbours, cut at a random phase per block and epoch: the units shuffled below
        phase = np.repeat((raw_draws(seed, epoch, 2, n=nb) % np.uint64(run)).astype(np.int64), psizes)
        unit = np.cumsum((offset == 0) | ((offset + phase) % run == 0)) - 1
    if drop_last:
        per_rank = n // num_replicas
        seq, unit = seq[: per_rank * num_replicas], unit[: per_rank * num_replicas]
    else:
        per_rank = math.ceil(n / num_replicas)
        pad = per_rank * num_replicas - n  # repeats samples from the start, like DistributedSampler
        seq = np.resize(seq, per_rank * num_replicas)
        unit = np.concatenate([unit, np.resize(unit, pad) + (int(unit[-1]) + 1 if n else 0)])
    mine = seq[rank * per_rank : (rank + 1) * per_rank]
    if not shuffle or per_rank == 0:
        return mine.astype(np.int64)
    mine_unit = unit[rank * per_rank : (rank + 1) * per_rank]
    window = window_samples(n, nb, open_blocks, batch_size)
    keys = raw_draws(seed, epoch, 1, rank, num_replicas, n=int(unit[-1]) + 1)[mine_unit]
    order = np.lexsort((np.arange(per_rank), keys, np.arange(per_rank) // window))
    return mine[order].astype(np.int64)


def window_samples(n: int, num_blocks: int, open_blocks: int, batch_size: int | None) -> int:
    """Samples per window: about ``open_blocks`` blocks' worth, a whole number of batches when ``batch_size``
    is given. ``rank_order`` shuffles inside consecutive windows of its order, so windows stay contiguous."""
    window = max(1, round(open_blocks * n / max(num_blocks, 1)))
    if batch_size:
        window = max(batch_size, round(window / batch_size) * batch_size)
    return window


class BlockShuffleSampler(DistributedSampler):
    """Quasi-random order that reads few blocks at a time; rank-aware like ``DistributedSampler``.

    ``DataLoader(ds, sampler=s, batch_size=s.batch_size)``. Each pass is a new order, as ``shuffle=True``
    reshuffles: a pass that starts after the previous one ran to its end, with no ``set_epoch`` between, takes the
    next epoch by itself (a plain loop, ``ThreadLoader``, ``StatefulDataLoader`` without Lightning);
    ``s.set_epoch(epoch)`` before a pass chooses its epoch (Lightning and ``DistributedSampler`` loops do). A pass
    left before its end (an iterator DataLoader makes and drops, a ``break``) starts again from its beginning; every
    rank runs its passes to the end alike, so ranks stay in step. A ``DistributedSampler``, so Lightning and Fabric
    keep it; every rank yields ``len(s)`` of the dataset's (ImageFolder's) indices; ``state_dict()`` saves the
    position inside an epoch (torchdata's ``StatefulDataLoader``).

    Args:
        dataset: a packer dataset (``open_dataset``): its sample sizes make the blocks; others need ``blocks``.
        block_bytes: payload bytes per block (default 16 MB); blocks never cross a shard; ignored with ``blocks``.
        blocks: explicit block boundaries: strictly increasing storage positions from 0 to ``len(dataset)``.
        open_blocks: blocks shuffled together in a window (default 8): more mixes better, touches more at once.
        run: neighbours read together (default 16; 1 shuffles single samples): the size of each read.
        batch_size: the DataLoader's batch size, so that windows hold whole batches and no batch straddles two.
        num_replicas: ranks sharing the epoch (default: the ``torch.distributed`` world size when used, else 1).
        rank: this process's rank (default: the process group's when the sampler is used, else 0).
        shuffle: False yields the storage order (split over ranks), as ``DistributedSampler(shuffle=False)``.
        seed: the seed of every epoch's order (the same on every rank).
        drop_last: leave out up to ``num_replicas - 1`` samples instead of padding ranks to equal counts.
        warn: warn when most blocks hold a single label (a class-sorted dataset: batches would hold few classes).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        block_bytes: int | None = None,
        blocks: Sequence[int] | None = None,
        open_blocks: int = DEFAULT_OPEN_BLOCKS,
        run: int = DEFAULT_RUN,
        batch_size: int | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        warn: bool = True,
    ) -> None:
        # DistributedSampler.__init__ is not called: it would fix the ranks now, from a process
        # group that Lightning and accelerate initialise only later.
        if num_replicas is not None and rank is not None:
            check_rank(rank, num_replicas)  # else checked when used
        if open_blocks < 1:
            raise OptionError(f"open_blocks must be at least 1, got {open_blocks}")
        if run < 1:
            raise OptionError(f"run must be at least 1, got {run}")
        if batch_size is not None and batch_size < 1:
            raise OptionError(f"batch_size must be positive, got {batch_size}")
        self.dataset = dataset
        self.bounds = dataset_boundaries(dataset, block_bytes, blocks)
        self.index_map = dataset.index_map if isinstance(dataset, PackedDataset) else IndexMap(None)
        self.num_samples_total = int(self.bounds[-1])
        self.open_blocks = open_blocks
        self.run = run
        self.batch_size = batch_size
        self._replicas = (num_replicas, rank)  # None: from the process group when used
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.position = EpochPosition()
        self._ran_out = False  # the last pass handed out its last index: the next one takes the next epoch
        self._epoch_set = False  # set_epoch or load_state_dict since the last pass started: it chooses
        labels = dataset.index.labels if isinstance(dataset, PackedDataset) else None
        if warn and shuffle and labels is not None:
            warn_if_sorted(labels, self.bounds)

    @property
    def num_replicas(self) -> int:  # resolved when used, not when built
        """Number of ranks: as given, else the process group's world size (1 without one)."""
        return replicas_and_rank(*self._replicas)[0]

    @property
    def rank(self) -> int:
        """This process's rank: as given, else the process group's (0 without one)."""
        return replicas_and_rank(*self._replicas)[1]

    @property
    def num_samples(self) -> int:
        """Samples per rank and epoch (``DistributedSampler``'s attribute)."""
        return len(self)

    @property
    def total_size(self) -> int:
        """Samples per epoch over all ranks, padding included (``DistributedSampler``'s attribute)."""
        return len(self) * self.num_replicas

    @property
    def num_blocks(self) -> int:
        return len(self.bounds) - 1

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration use the order of ``epoch`` (call before each epoch, on every rank).

        The epoch a loaded state is in keeps its saved position; another epoch starts at its beginning. Without
        it, each pass after the first takes the next epoch by itself.
        """
        if int(epoch) != self.epoch:
            self.position = EpochPosition()
        self.epoch = int(epoch)
        self._epoch_set = True

    def order(self, epoch: int | None = None) -> np.ndarray:
        """This rank's sample indices (the dataset's: ImageFolder's) for ``epoch`` (default: the current one)."""
        return self.index_map.public_many(self.stored_order(epoch))

    def stored_order(self, epoch: int | None = None) -> np.ndarray:
        """``order`` as storage positions: where its locality shows (``diagnose.shuffle_quality.shuffle_stats``)."""
        return rank_order(
            self.bounds, self.epoch if epoch is None else epoch, self.seed,
            num_replicas=self.num_replicas, rank=self.rank, open_blocks=self.open_blocks, run=self.run,
            batch_size=self.batch_size, shuffle=self.shuffle, drop_last=self.drop_last,
        )

    def __iter__(self) -> Iterator[int]:
        """This rank's indices, each carrying its block's range (packer.read.hints): the worker reading a
        batch may widen its reads to whole device requests inside those blocks, while this order is iterated.
        The pass starts, and takes its epoch, when its first index is asked for (see the class doc)."""
        if self._replicas == (None, None):
            warn_if_accelerate(self.num_replicas)
        return self._pass()

    def _pass(self) -> Iterator[int]:
        if self._ran_out and not self._epoch_set:  # nobody chose this pass's epoch: the next one, as shuffle=True
            self.epoch += 1
            self.position = EpochPosition()
        self._ran_out = self._epoch_set = False
        stored = self.stored_order()
        indices = self.position.iterate(hinted_order(self.index_map.public_many(stored).tolist(), stored,
                                                     self.bounds))
        yield from (self.dataset.follow(stored, indices, self.position.yielded)
                    if isinstance(self.dataset, PackedDataset) else indices)
        self._ran_out = True

    def __len__(self) -> int:
        n, r = self.num_samples_total, self.num_replicas
        return n // r if self.drop_last else math.ceil(n / r)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(samples={self.num_samples_total}, blocks={self.num_blocks}, "
                f"open_blocks={self.open_blocks}, run={self.run}, batch_size={self.batch_size}, "
                f"num_replicas={self.num_replicas}, rank={self.rank}, shuffle={self.shuffle}, seed={self.seed}, "
                f"drop_last={self.drop_last}, epoch={self.epoch})")

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: the epoch and how many of its samples were handed out (plain ints).

        The same on every rank at a step (ranks hand out equal counts), so one rank's saved state
        resumes them all, as Lightning does with rank 0's checkpoint.
        """
        return {"epoch": self.epoch, "yielded": self.position.yielded, "order": self._order_key()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume: the next pass continues ``state``'s epoch after its last handed-out sample; a state saved at
        the end of an epoch makes the next pass the following epoch (unless ``set_epoch`` chooses), as it would
        have been without the interruption."""
        self.epoch, yielded = resume_position(state, self._order_key(), len(self))
        self.position = EpochPosition(resume_at=yielded)
        finished = yielded == len(self)
        self._ran_out, self._epoch_set = finished, not finished

    def _order_key(self) -> dict[str, Any]:
        """What the order depends on besides the epoch and the rank: a saved position is only valid for it."""
        return {"samples": self.num_samples_total, "blocks": self.num_blocks, "seed": self.seed,
                "num_replicas": self.num_replicas, "open_blocks": self.open_blocks, "run": self.run,
                "batch_size": self.batch_size, "shuffle": self.shuffle, "drop_last": self.drop_last}


class BlockBatchSampler(BatchSampler):
    """Batches of a ``BlockShuffleSampler``: ``DataLoader(ds, batch_sampler=BlockBatchSampler(ds, 256))``. Lightning
    rebuilds a batch_sampler under DDP: there, pass ``sampler=BlockShuffleSampler(ds, batch_size=B), batch_size=B``.

    Args:
        dataset: a packer dataset (``open_dataset``), as for ``BlockShuffleSampler``.
        batch_size: samples per batch (also the block sampler's ``batch_size``: windows of whole batches).
        drop_last_batch: drop a short last batch of each rank (ranks hold equal sample counts, so equal batches).
        **kwargs: ``BlockShuffleSampler``'s other arguments (``block_bytes``, ``open_blocks``, ``run``, ``seed``, ...).
    """

    def __init__(self, dataset: Any, batch_size: int, drop_last_batch: bool = False, **kwargs: Any) -> None:
        if isinstance(dataset, Sampler):
            raise OptionError(
                f"BlockBatchSampler got a {type(dataset).__name__} where a dataset belongs: Lightning rebuilds a "
                "batch_sampler around its DistributedSampler under DDP, which would undo the block order. Use "
                "DataLoader(ds, sampler=BlockShuffleSampler(ds, batch_size=B), batch_size=B), which Lightning keeps")
        self.block_sampler = BlockShuffleSampler(dataset, batch_size=batch_size, **kwargs)
        super().__init__(self.block_sampler, batch_size, drop_last_batch)

    def set_epoch(self, epoch: int) -> None:
        self.block_sampler.set_epoch(epoch)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(batch_size={self.batch_size}, drop_last_batch={self.drop_last}, "
                f"sampler={self.block_sampler!r})")

    def state_dict(self) -> dict[str, Any]:
        """The block sampler's position (a whole number of batches into the epoch)."""
        return self.block_sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the batch after the last one handed out when ``state`` was saved."""
        self.block_sampler.load_state_dict(state)


def block_order(ds: Any, epoch: int, seed: int = 0, block_bytes: int | None = None, *,
                open_blocks: int = DEFAULT_OPEN_BLOCKS, run: int = DEFAULT_RUN,
                batch_size: int | None = None) -> np.ndarray:
    """The whole epoch's block-shuffled order for one process (no ranks), as sample indices: for benchmarks."""
    s = BlockShuffleSampler(ds, block_bytes=block_bytes, open_blocks=open_blocks, run=run, batch_size=batch_size,
                            num_replicas=1, rank=0, seed=seed, warn=False)
    return s.order(epoch)


def warn_if_sorted(labels: np.ndarray, bounds: np.ndarray) -> None:
    """Warn when most blocks hold a single label: block shuffling would then batch few classes together."""
    labels = np.asarray(labels)
    if len(bounds) < 3 or len(np.unique(labels)) < 2:
        return
    changes = np.concatenate(([0], np.cumsum(labels[1:] != labels[:-1])))  # label changes up to each sample
    pure = float(np.mean(changes[bounds[1:] - 1] == changes[bounds[:-1]]))
    if pure > 0.5:
        warnings.warn(
            f"{pure:.0%} of the blocks hold a single label: the dataset is stored in class order, so "
            "block shuffling puts few classes in each batch. Convert with --order shuffled, or use a "
            "uniform shuffle.", stacklevel=3,
        )
