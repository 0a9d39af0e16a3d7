"""``packer.ThreadLoader``: DataLoader's surface, each batch decoded by threads of this process.

libjpeg-turbo and Pillow release the GIL while they decode, so N threads of one process decode N images at once,
with no worker processes to start and no batch pickled or copied between processes. A feeder thread draws each
batch's indices from the sampler, starts its reads ``READ_AHEAD_BATCHES`` batches ahead and plans it
(packer.read.pipeline); the decode threads run its chunks, each in the order its bytes arrive (a cold batch's
first chunk decodes while the rest is read). Batches come out in the sampler's order; images handed out as
decoded go straight into the batch's memory (packer.read.slots): one (N, 3, H, W) tensor when they share a size.
"""

from __future__ import annotations

import copy
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, RandomSampler, Sampler, SequentialSampler
from torch.utils.data._utils.collate import default_convert

from packer import sysinfo
from packer.errors import OptionError, PackerError
from packer.read.collate import collate as packer_collate
from packer.read.dataset import PackedDataset
from packer.read.hints import aheads_of
from packer.read.intraop import serial_ops
from packer.read.loaders import Prefetcher, close_at_exit, map_tensors
from packer.read.pipeline import BatchPipeline, BatchPlan, Reads
from packer.read.resume import Stateful
from packer.read.slots import Pooled, pool_of

if TYPE_CHECKING:
    from packer.images.crop import CropDecode

CHUNKS_PER_THREAD = 2  # a batch is cut into threads x this many chunks: enough to balance, few to hand over
# Batches whose reads are queued beyond the one being decoded: enough to keep a slow device busy while a
# batch waits for its turn (emulated hard disk, block order: docs/results.md), few enough to stay in the page cache.
READ_AHEAD_BATCHES = 4


class _Batch:
    """One batch on its way: its plan and a future per chunk (each the chunk's samples, in the plan's order)."""

    def __init__(self, plan: BatchPlan, futures: list[Future], fast: bool) -> None:
        self.plan = plan
        self.futures = futures
        self.fast = fast  # decoded into slots of our own block, (image, label) pairs, no collate_fn: that block

    def result(self, collate_fn: Callable[[Any], Any], pin: bool, unbatched: bool) -> Any:
        """The batch as handed out (``unbatched``: its one sample, as DataLoader's ``batch_size=None`` gives it)."""
        items: list = [None] * len(self.plan.positions)
        for f, places in zip(self.futures, self.plan.chunks, strict=True):
            for k, item in zip(places, f.result(), strict=True):
                items[k] = item
        if unbatched:
            batch = collate_fn(items[0])
        elif self.fast and not self.plan.missed:  # images in (pinned, where asked) batch memory; targets collated
            stacked = self.plan.stacked
            images = stacked.permute(0, 3, 1, 2) if stacked is not None else [img for img, _ in items]
            return [images, _pinned(packer_collate(tuple(target for _, target in items)), pin)]
        else:
            batch = collate_fn(items)
        return _pinned(batch, pin)


class _Failed:
    """A batch that could not be started (its indices, reads or batch memory): raised in its turn."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def result(self, collate_fn: Callable[[Any], Any], pin: bool, unbatched: bool) -> Any:
        raise self.exc


def _pinned(batch: Any, pin: bool) -> Any:
    return map_tensors(batch, lambda t: t if t.is_pinned() else t.pin_memory()) if pin else batch


def _drawn(batches: Iterable[Sequence[int]], stateful: Stateful | None) -> Iterator[tuple[Sequence[int], Any]]:
    """Each batch's indices with the sampler's state right after drawing it (None without a stateful sampler)."""
    for indices in batches:
        yield indices, None if stateful is None else copy.deepcopy(stateful.state_dict())


def _reads_queued(pipeline: BatchPipeline, drawn: Iterator[tuple[Sequence[int], Any]]
                  ) -> Iterator[tuple[Reads | Exception, Any]]:
    """(its reads, state) per batch, each batch's reads started ``READ_AHEAD_BATCHES`` batches before the batch is
    yielded, so the device reads, in order, the bytes decoded next. As a DataLoader's: a batch whose indices or reads
    fail is its error in place of the reads, and the next batches go on; a sampler that fails is raised in its turn,
    after the batches before it, and ends the epoch."""
    queued: deque = deque()
    try:
        while True:
            try:
                indices, state = next(drawn)
            except StopIteration:
                break
            except Exception as exc:  # noqa: BLE001 - raised in its turn, below
                queued.append(exc)
                break
            try:
                queued.append((pipeline.start(pipeline.positions(list(indices)), aheads_of(indices)), state))
            except Exception as exc:  # noqa: BLE001 - this batch's error, handed out in its turn
                queued.append((exc, state))
            if len(queued) > READ_AHEAD_BATCHES:
                yield queued.popleft()
        while queued:
            entry = queued.popleft()
            if isinstance(entry, Exception):
                raise entry
            yield entry
    finally:  # stopped early: the reads nobody will use no longer hold up the next iteration's
        for entry in queued:
            if isinstance(entry, tuple) and isinstance(entry[0], Reads):
                entry[0].pending.cancel()


def _start_batch(pipeline: BatchPipeline, reads: Reads, pool: ThreadPoolExecutor, alloc: Callable[[int], torch.Tensor],
                 into: Callable[[int], np.ndarray], threads: int, stacking: bool) -> _Batch:
    """Plan one batch (slots from ``alloc``, crops drawn in its order) and queue its chunks on the decode threads,
    in the order its bytes arrive. ``stacking``: no collate_fn (a batch in slots of one block is handed out as that
    block). Payloads are copies read into memory from ``into``, never views of a mapped shard: a shard truncated in
    place while threads decode is a PackerError, never a SIGBUS in a thread (which would kill the process)."""
    plan = pipeline.plan(reads, threads * CHUNKS_PER_THREAD, Pooled(alloc), copies=into)
    futures = [pool.submit(pipeline.run, plan, k) for k in range(len(plan.chunks))]
    return _Batch(plan, futures, fast=plan.slots is not None and stacking and pipeline.presenter.pairs)


class _Epoch:
    """One iteration of a ThreadLoader, with a DataLoader iterator's behaviour: the shuffle's seed is drawn when it
    is made; a batch that fails is raised in its turn and the next call goes on with the next batch (a sampler
    that fails ends it); stopped early (``close`` from any thread, or dropped), its threads are joined and the fused
    crops drawn for batches never handed out are given back, so the next epoch's crops are a worker-less
    DataLoader's."""

    def __init__(self, loader: ThreadLoader) -> None:
        self.done = True  # until made: nothing to close
        self.feed: Prefetcher | None = None
        self.pool: ThreadPoolExecutor | None = None
        self.lock = threading.Lock()  # starting and closing: a close racing the first next() stops what it starts
        self.loader = loader
        self.stateful = loader._stateful_or_none()
        if self.stateful is not None:
            loader._state = copy.deepcopy(self.stateful.state_dict())  # where this iteration starts (a loaded state)
        # DataLoader draws a seed for its workers first: drawn here too, a shuffle's order is DataLoader's
        torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
        self.crop = loader.dataset.pipeline.decoding.crop
        self.marks: list[object] = []  # the crop stream's position before each batch's windows were drawn
        self.handed = 0
        self.threads: set[int] = set()  # the decode threads' idents
        self.done = False
        close_at_exit(self)

    def __iter__(self) -> _Epoch:
        return self

    def __next__(self) -> Any:
        with self.lock:
            if self.done:
                raise StopIteration
            if self.feed is None:  # the first batch: the sampler starts in the feeder thread, as late as DataLoader's
                self.pool = ThreadPoolExecutor(self.loader.num_threads, thread_name_prefix="packer-decode",
                                               initializer=_decode_thread, initargs=(self.threads,))
                self.feed = Prefetcher(_feed(self.loader, self.pool, self.stateful, self.crop, self.marks),
                                       self.loader.prefetch_batches, name="packer-ThreadLoader")
            feed = self.feed
        try:
            (job, state), _ = feed.get()
        except BaseException:  # the end, or the sampler failed
            self.close()
            raise
        loader = self.loader
        try:
            batch = job.result(loader.collate_fn or (default_convert if loader.unbatched else packer_collate),
                               loader.pin_memory, loader.unbatched)
        except BaseException as exc:
            if self.done and isinstance(exc, CancelledError):  # closed from another thread: not handed out
                del self, loader
                raise StopIteration from None
            self.handed += 1  # a batch that fails counts as taken, as a DataLoader's: its state moves on
            loader._state = state
            # The traceback keeps this frame: without the epoch in it, an epoch the caller let go of (the error
            # left the for loop) is closed and its threads joined now, not when the error is forgotten.
            del self, loader
            raise
        self.handed += 1
        loader._state = state
        return batch

    def close(self) -> None:
        """Stop, from any thread: the feeder and decode threads joined, the crops drawn for batches not handed out
        given back. In one of its own threads (a reference cycle collected there), a thread of its own does it."""
        with self.lock:
            if self.done:
                return
            self.done = True
        here = threading.get_ident()
        if self.feed is not None and (here == self.feed.thread.ident or here in self.threads):
            threading.Thread(target=self._stop, name="packer-close", daemon=True).start()
        else:
            self._stop()

    def _stop(self) -> None:
        try:
            if self.feed is not None:
                self.feed.close()  # joins the feeder: no new chunks, no new draws
            if self.pool is not None:
                self.pool.shutdown(wait=True, cancel_futures=True)
        finally:
            feeding = self.feed is not None and self.feed.thread.is_alive()  # it did not stop in time: no rewind
            if self.crop is not None and not feeding and len(self.marks) > self.handed:
                mark = self.marks[self.handed]
                if mark is not None:
                    self.crop.rewind(mark)

    def __del__(self) -> None:
        self.close()


def _decode_thread(idents: set[int]) -> None:
    """A decode thread's start: known to its epoch (which must not join it from it), torch ops on it alone (the
    fused crop's resize: no OpenMP team per op)."""
    idents.add(threading.get_ident())
    serial_ops()


def _feed(loader: ThreadLoader, pool: ThreadPoolExecutor, stateful: Stateful | None, crop: CropDecode | None,
          marks: list[object]) -> Iterator[tuple[_Batch | _Failed, Any]]:
    """Feeder thread body: per batch, its plan and decode chunks queued (or its error); with the sampler's state
    right after the batch was drawn (reads are queued further ahead than that)."""
    pipeline = loader.dataset.pipeline
    alloc = (lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True)) if loader.pin_memory else loader._blocks.take
    for reads, state in _reads_queued(pipeline, _drawn(loader._batches, stateful)):
        marks.append(None if crop is None else crop.position())
        if isinstance(reads, Exception):
            yield _Failed(reads), state
            continue
        try:
            job: _Batch | _Failed = _start_batch(pipeline, reads, pool, alloc, loader._payloads.take_array,
                                                 loader.num_threads,
                                                 stacking=loader.collate_fn is None and not loader.unbatched)
        except Exception as exc:  # noqa: BLE001 - this batch's error, handed out in its turn
            job = _Failed(exc)
        yield job, state


class ThreadLoader:
    """Batches of ``dataset`` decoded by ``num_threads`` threads in this process, in the sampler's order.

    Arguments as DataLoader's (``batch_size``, None included, ``shuffle``, ``sampler``, ``batch_sampler``,
    ``drop_last``, ``collate_fn``, ``pin_memory``, ``generator``); ``num_threads`` replaces
    ``num_workers`` (default: the cores this process may use) and ``prefetch_batches`` says how many
    batches are read and decoded ahead of the one handed out. Batches equal those of
    ``DataLoader(dataset, ..., collate_fn=packer.collate)``, except that a stacked image batch is a
    channels-last view (``images.permute(0, 3, 1, 2)`` of an NHWC block; ``.contiguous()`` makes it
    NCHW); its iterator behaves as a DataLoader's (``_Epoch``). Call ``set_epoch`` on the sampler as with a
    DataLoader (a ``BlockShuffleSampler`` takes the next epoch by itself without it). ``state_dict()`` works over
    a sampler or batch sampler that has one (``BlockShuffleSampler``, ``BlockBatchSampler``): the position after
    the last batch handed out, not after those read ahead. The batch memory (up to ``prefetch_batches + 3``
    batches) stays with the dataset for its next epoch and its other ThreadLoaders.

    Args:
        dataset: a packer dataset (``open_dataset``, or a ``CachedDataset``).
        batch_size: samples per batch (default 1); None hands out single samples, unbatched, as DataLoader.
        shuffle: a new uniform shuffle each epoch (``RandomSampler`` with ``generator``).
        sampler: the order of samples (e.g. ``BlockShuffleSampler``); excludes ``shuffle``.
        batch_sampler: the batches' indices (e.g. ``BlockBatchSampler``); excludes ``batch_size``,
            ``shuffle``, ``sampler`` and ``drop_last``.
        num_threads: decoding threads, in place of DataLoader's ``num_workers`` (default: the cores this
            process may use).
        collate_fn: merges a batch's samples (default: images of one shape stacked, as ``packer.collate``).
        pin_memory: batches in pinned memory, for fast copies to CUDA (ignored, with a warning, without CUDA).
        drop_last: drop a short last batch.
        prefetch_batches: batches read and decoded ahead of the one handed out (default 2).
        generator: the random generator of ``shuffle``.
    """

    def __init__(
        self, dataset: PackedDataset, batch_size: int | None = 1, shuffle: bool = False,
        sampler: Sampler | Iterable[int] | None = None, batch_sampler: Iterable[Sequence[int]] | None = None,
        num_threads: int | None = None, collate_fn: Callable[[list], Any] | None = None, pin_memory: bool = False,
        drop_last: bool = False, prefetch_batches: int = 2, generator: torch.Generator | None = None,
    ) -> None:
        if not isinstance(dataset, PackedDataset):
            raise OptionError(f"ThreadLoader reads packer datasets (open_dataset), not a {type(dataset).__name__}")
        if num_threads is not None and num_threads < 1:
            raise OptionError(f"num_threads must be at least 1, got {num_threads}")
        if prefetch_batches < 1:
            raise OptionError(f"prefetch_batches must be at least 1, got {prefetch_batches}")
        if batch_sampler is not None and (batch_size != 1 or shuffle or sampler is not None or drop_last):
            raise OptionError("batch_sampler is mutually exclusive with batch_size, shuffle, sampler and drop_last")
        if shuffle and sampler is not None:
            raise OptionError("sampler is mutually exclusive with shuffle")
        if batch_size is None and drop_last:
            raise OptionError("batch_size=None (one sample at a time, no batches) is mutually exclusive with drop_last")
        if batch_sampler is None and batch_size is not None and batch_size < 1:
            raise OptionError(f"batch_size must be at least 1, got {batch_size}")
        self.dataset = dataset
        self.unbatched = batch_sampler is None and batch_size is None  # DataLoader's batch_size=None: samples
        if batch_sampler is None and sampler is None:
            sampler = RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
        self.sampler = sampler
        # DataLoader's attributes: batch_size and drop_last None and False with a batch_sampler; batch_sampler
        # None without batches. What is iterated, one list of indices at a time, is _batches.
        self.batch_size = None if batch_sampler is not None else batch_size
        self.drop_last = drop_last
        self._batches = batch_sampler if batch_sampler is not None else BatchSampler(
            sampler, batch_size or 1, drop_last)  # type: ignore[arg-type]
        self.batch_sampler = None if self.unbatched else self._batches
        self.num_threads = num_threads or sysinfo.usable_cores()
        self.collate_fn = collate_fn
        self.pin_memory = pin_memory and torch.cuda.is_available()
        if pin_memory and not self.pin_memory:
            warnings.warn("ThreadLoader: pin_memory=True, but no CUDA device here: not pinning", stacklevel=2)
        self.prefetch_batches = prefetch_batches
        self.generator = generator
        self._live: weakref.WeakSet = weakref.WeakSet()
        # batch memory: those in flight, the one handed out, one the caller keeps; kept across epochs and loaders
        self._blocks = pool_of(dataset, prefetch_batches + 3)
        # the stored bytes read for those batches (a block per batch, or per chunk of a batch still being read)
        self._payloads = pool_of(dataset, (prefetch_batches + 3) * self.num_threads * CHUNKS_PER_THREAD, "payloads")
        self._state: dict[str, Any] | None = None  # the sampler's state after the last batch handed out

    def __len__(self) -> int:
        return len(self._batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator:
        if any(not epoch.done for epoch in self._live):
            warnings.warn("ThreadLoader: a new iteration while another is still running: their feeder threads draw "
                          "from the sampler and the fused crops at once, so neither order nor crops are reproducible "
                          "(a DataLoader's are); finish the other or close() it first", RuntimeWarning, stacklevel=2)
        epoch = _Epoch(self)
        self._live.add(epoch)
        return epoch

    def close(self) -> None:
        """Stop every iteration still running (their threads are joined)."""
        for gen in list(self._live):
            gen.close()

    def _stateful_or_none(self) -> Stateful | None:
        for obj in (self._batches, self.sampler):
            if isinstance(obj, Stateful):
                return obj
        return None

    def state_dict(self) -> dict[str, Any]:
        """The sampler's position after the last batch this loader handed out."""
        stateful = self._stateful()
        return {"sampler": copy.deepcopy(stateful.state_dict() if self._state is None else self._state)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the next iteration after the last batch handed out when ``state_dict`` was saved."""
        if not isinstance(state_dict, dict) or "sampler" not in state_dict:
            raise OptionError("not a ThreadLoader state: expected a dict with the key 'sampler'")
        self._stateful().load_state_dict(state_dict["sampler"])
        self._state = copy.deepcopy(state_dict["sampler"])

    def _stateful(self) -> Stateful:
        stateful = self._stateful_or_none()
        if stateful is None:
            raise PackerError(f"ThreadLoader over a {type(self.sampler or self._batches).__name__} cannot save "
                              "its position: use a sampler with state_dict(), e.g. packer.BlockShuffleSampler")
        return stateful

    def __enter__(self) -> ThreadLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
