"""The local backend: a process pool prepares the samples, this process writes the shards in order.

Worker processes read, validate and (for raw payloads) decode the source files in chunks; the
results come back in source order, so the output depends only on the source and the options,
never on ``workers``. A bounded number of chunks is in flight, so memory stays flat. Forked
workers hand payloads back through a shared ring (one copy each way, no pickling); workers
started another way (spawn, forkserver) can't inherit it and pickle them.
"""

from __future__ import annotations

import itertools
import mmap
import multiprocessing
import os
import threading
import time
from collections import deque
from collections.abc import Generator, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from packer.formats import get_format
from packer.formats.base import PreparedSample
from packer.write.journal import ShardResult
from packer.write.options import ConvertOptions, PoolSettings
from packer.write.shards import BuildJob, prepare, progress_bar, write_shard
from packer.write.sources.base import InlineReader, RecordError, SourceReader
from packer.write.sources.records import SourceError


@dataclass
class LocalPool:
    """Builds shards with ``workers`` processes preparing samples (0: all in this process)."""

    workers: int
    settings: PoolSettings = field(default_factory=PoolSettings)

    def build_shards(self, job: BuildJob) -> dict[int, ShardResult]:
        """Write every shard not yet done: the pool prepares samples, this process writes them in order."""
        todo = [(sid, *job.ranges[sid]) for sid in job.todo()]
        scan = job.scan
        items = [item for _, a, b in todo for item in scan.records(a, b)]
        fmt = get_format(job.options.format)
        results = dict(job.done)
        bar = progress_bar(len(scan), job.progress)
        bar.update(job.done_samples())
        written = [0]

        def on_each(res) -> None:
            bar.update(1)
            if isinstance(res, PreparedSample):
                written[0] += res.nbytes
            if bar.n % 64 == 0:
                bar.set_postfix_str(f"{written[0] / 1e6 / max(bar.format_dict['elapsed'], 1e-9):.0f} MB/s")

        prepared = ordered_results(scan.source_reader(), items, job.options, self.workers, job.mean_bytes,
                                   self.settings)
        journaler = ThreadPoolExecutor(max_workers=1)  # checksums + journal of a shard while the next is written
        pending: dict[int, Future] = {}
        try:
            for sid, a, b in todo:
                result, names = write_shard(job.partial, sid, b - a, itertools.islice(prepared, b - a), fmt,
                                            job.options, job.on_error, scan.root, on_each if job.progress else None)
                pending[sid] = journaler.submit(job.output.shard_done, result, names)
                wait_for_room(pending.values(), job.output.max_pending)
            prepared.close()  # the pool winds down while the last shard is checksummed
            for sid, future in pending.items():
                results[sid] = future.result()
        finally:
            bar.close()
            prepared.close()
            journaler.shutdown(wait=True, cancel_futures=True)
        return results


def wait_for_room(pending: Iterable[Future], limit: int | None) -> None:
    """Wait (oldest first) until at most ``limit`` of the ``pending`` journal (and upload) tasks are unfinished, so
    that the shards waiting for them stay few on the local disk; a task's error is raised here, at once."""
    if limit is None:
        return
    unfinished = [f for f in pending if not f.done()]
    for future in unfinished[:max(0, len(unfinished) - limit)]:
        future.result()
    for future in pending:
        if future.done() and future.exception() is not None:
            future.result()


def ordered_results(
    reader: SourceReader, items: list[tuple[str, int, Any]], options: ConvertOptions, workers: int,
    mean_bytes: float = 0.0, settings: PoolSettings = PoolSettings(),
) -> Generator[PreparedSample | SourceError, None, None]:
    """Prepared samples in source order; a bounded number of chunks in flight keeps memory flat.

    ``items``: (key, label, locator) records. A sequential reader (a compressed tar) is read here, in
    order, and its payloads travel to the workers with their chunk (``InlineReader``).
    """
    chunk_len = settings.chunk
    ahead = max(2, min(settings.ahead, int(settings.ahead_bytes // max(1.0, workers * chunk_len * mean_bytes))))
    if reader.sequential:
        items_iter: Iterable[tuple[str, int, Any]] = _read_inline(reader, items)
        reader = InlineReader()
    else:
        items_iter = reader.admitted(items)
    chunks = _chunks(items_iter, chunk_len)
    if workers <= 0:
        for chunk in chunks:
            yield from prepare_chunk(reader, chunk, options)[0]
        return
    ctx = multiprocessing.get_context(settings.start_method)
    # Forked workers inherit a shared ring: payloads cross by one copy each way instead of pickles
    # through a pipe. Other start methods can't inherit it and fall back to pickling.
    slots = workers * ahead  # one per chunk in flight: a slot is free again once its chunk is popped
    slot_bytes = int(min(2 * chunk_len * max(mean_bytes, 1 << 16), settings.ring_bytes // slots)) & ~4095
    ring = mmap.mmap(-1, slots * slot_bytes) if ctx.get_start_method() == "fork" and slot_bytes else None
    try:
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker,
                                 initargs=(ring,)) as pool:
            pending: deque[Future] = deque()
            try:
                for n, chunk in enumerate(chunks):
                    slot = None if ring is None else ((n % slots) * slot_bytes, slot_bytes)
                    pending.append(pool.submit(prepare_chunk, reader, chunk, options, slot))
                    if len(pending) >= slots:
                        yield from _received(ring, pending.popleft())
                while pending:
                    yield from _received(ring, pending.popleft())
            finally:
                for f in pending:
                    f.cancel()
    finally:
        if ring is not None:
            ring.close()


def _chunks(items: Iterable[tuple[str, int, Any]], size: int) -> Iterator[list[tuple[str, int, Any]]]:
    it = iter(items)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def _read_inline(reader: SourceReader, items: list[tuple[str, int, Any]]) -> Iterator[tuple[str, int, Any]]:
    """The records with what ``reader`` read in order as their locators (for ``InlineReader``)."""
    got = reader.read_in_order((rel, loc) for rel, _, loc in items)
    for (rel, label, _), res in zip(items, got):
        yield rel, label, ((None, None, str(res)) if isinstance(res, RecordError) else (res[0], res[1], None))


def _received(ring: mmap.mmap | None, future: Future) -> list:
    results, where = future.result()
    return results if ring is None else _from_ring(ring, results, where)


# ---------------------------------------------------------------- worker side


def prepare_chunk(reader: SourceReader, items: list[tuple[str, int, Any]], options: ConvertOptions,
                  slot: tuple[int, int] | None = None) -> tuple[list, list]:
    """Prepare ``items``; with a ring ``slot`` (offset, size) payloads travel through the shared ring.

    Returns the results and, per result, where its payload lies in the ring: ``(offset, nbytes,
    shape)``, or None where it travels pickled (errors; payloads that do not fit the slot).
    """
    results = [prepare(reader, rel, label, options, loc) for rel, label, loc in items]
    where: list = [None] * len(results)
    if slot is None or _RING is None:
        return results, where
    offset, end = slot[0], slot[0] + slot[1]
    for i, res in enumerate(results):
        if isinstance(res, PreparedSample) and offset + res.nbytes <= end:
            payload, nbytes = res.payload, res.nbytes
            _RING[offset : offset + nbytes] = payload if isinstance(payload, bytes) else payload.data
            where[i] = (offset, nbytes, None if isinstance(payload, bytes) else payload.shape)
            res.payload = b""
            offset += nbytes
    return results, where


# The shared ring of a fork-started pool, inherited by its workers (set by their initializer).
_RING: mmap.mmap | None = None


def _init_worker(ring: mmap.mmap | None) -> None:
    global _RING
    _RING = ring
    # A killed parent (SIGKILL) can't stop its pool: a worker waiting for work would wait forever.
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _from_ring(ring: mmap.mmap, results: list, where: list) -> list:
    """Copy the payloads out of the ring (the slot is reused as soon as this returns)."""
    for res, loc in zip(results, where):
        if loc is not None:
            offset, nbytes, shape = loc
            data = ring[offset : offset + nbytes]  # a copy, as bytes
            res.payload = data if shape is None else np.frombuffer(data, np.uint8).reshape(shape).copy()
    return results
