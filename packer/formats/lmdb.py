"""LMDB: one memory-mapped B-tree file per shard, keys in order, values = payloads.

| file                 | holds                                                              |
|----------------------|--------------------------------------------------------------------|
| shard-00000.lmdb     | LMDB environment (``subdir=False``, no lock file); key ``%010d`` of |
|                      | the sample's position in the shard (ASCII), value the payload:      |
|                      | encoded file bytes, or raw HWC uint8 RGB bytes (shape in ``meta/``) |

Written with ``append=True`` (keys arrive sorted: pages fill completely, no splits), committed
in batches, the map grown on ``MapFullError`` instead of reserving a huge map up front. The
same samples in the same order give the same file, byte for byte (LMDB's page allocation is
deterministic and ``meminit`` zeroes unused bytes).

Readers open with ``readonly=True, lock=False`` (safe on read-only and network filesystems:
nothing is written, not even a lock file). ``readahead`` decides whether the kernel reads
ahead around each page fault: on for sequential and block-shuffled passes (measured here a
cold sequential pass is ~17x faster with it), off for uniform random access on datasets
larger than RAM, where read-ahead only evicts useful pages.
"""

from __future__ import annotations

import os
from pathlib import Path

import lmdb
import numpy as np

from packer.errors import PackerError
from packer.formats.base import LazyHandle, PreparedSample, advise_willneed, contiguous_runs, mapping_base
from packer.manifest import Shard

NAME = "lmdb"
DATASET_CLASS = "LMDBDataset"
PAYLOADS = frozenset({"encoded", "raw"})
DEFAULT_SHARD_BYTES = 1 << 30
_BATCH_BYTES = 4 << 20  # commit about every 4 MB: measured ~30% faster than 16 MB here (dirty pages stay cache-hot)
_INITIAL_MAP = 64 << 20


def key(pos: int) -> bytes:
    return b"%010d" % pos


def shard_name(shard_id: int) -> str:
    return f"shard-{shard_id:05d}.lmdb"


class Writer:
    def __init__(self, directory: Path, shard_id: int, num_samples: int, payload: str, options: dict) -> None:
        self.name = shard_name(shard_id)
        self.path = directory / self.name
        self._map_size = _INITIAL_MAP
        self._env = self._open(self.path)
        self._batch: list[tuple[bytes, bytes]] = []
        self._batch_bytes = 0
        self._count = 0

    def _open(self, path: Path) -> lmdb.Environment:
        return lmdb.open(
            str(path), map_size=self._map_size, subdir=False, lock=False, sync=False,
            metasync=False, readahead=False, meminit=True, max_dbs=0,
        )

    def add(self, sample: PreparedSample) -> None:
        value = sample.payload if isinstance(sample.payload, bytes) else sample.payload.tobytes()
        self._batch.append((key(self._count), value))
        self._batch_bytes += len(value)
        self._count += 1
        if self._batch_bytes >= _BATCH_BYTES:
            self._commit()

    def _commit(self) -> None:
        while self._batch:
            try:
                with self._env.begin(write=True) as txn:
                    with txn.cursor() as cur:
                        for k, v in self._batch:
                            if not cur.put(k, v, append=True):
                                raise PackerError(f"{self.path}: LMDB refused key {k!r}")
                self._batch, self._batch_bytes = [], 0
            except lmdb.MapFullError:
                self._map_size *= 2  # the aborted transaction wrote nothing; grow and retry
                self._env.set_mapsize(self._map_size)

    def close(self) -> tuple[list[str], dict]:
        self._commit()
        self._env.close()
        return [self.name], {"map_size": self._map_size}

    def abort(self) -> None:
        self._env.close()
        if self.path.exists():
            os.remove(self.path)


# py-lmdb refuses to open one environment twice in a process, yet two datasets (or a dataset and
# `verify`) may read the same shard: readers of a process share one handle, counted.
_ENVS: dict[str, list] = {}


def _shared_env(path: Path, readahead: bool) -> tuple[lmdb.Environment, tuple]:
    """The process's environment for the file now at ``path`` (keyed by inode: a replaced file is a new one)."""
    for attempt in range(3):
        try:
            st = os.stat(path)
        except OSError as exc:
            raise PackerError(f"{path}: cannot open LMDB shard ({exc.strerror or exc})") from None
        ident = (str(path), st.st_dev, st.st_ino)
        entry = _ENVS.get(ident)
        if entry is not None and entry[2] != os.getpid():
            entry[0].close()  # inherited through fork: py-lmdb would refuse a second open of the same file
            entry = None
        if entry is None:
            try:
                env = lmdb.open(
                    str(path), subdir=False, readonly=True, lock=False, readahead=readahead,
                    meminit=False, max_readers=2048, max_dbs=0,
                )
            except lmdb.Error as exc:
                if "already open" in str(exc) and attempt < 2:
                    continue  # the file was replaced between stat and open by one this process has open
                raise PackerError(f"{path}: cannot open LMDB shard (replaced while opening? {exc})") from exc
            entry = _ENVS[ident] = [env, 0, os.getpid()]
        entry[1] += 1
        return entry[0], ident
    raise PackerError(f"{path}: replaced while being opened")


def _release_env(ident: tuple) -> None:
    entry = _ENVS.get(ident)
    if entry is not None and entry[2] == os.getpid():
        entry[1] -= 1
        if entry[1] <= 0:
            entry[0].close()
            del _ENVS[ident]


class Reader:
    """Reads one shard; opens the environment lazily in each process."""

    def __init__(self, directory: Path, shard: Shard, payload: str, access: str = "sequential") -> None:
        self.path = directory / shard.files[0].name
        self.num_samples = shard.num_samples
        self.readahead = access != "random"
        self._env: LazyHandle[lmdb.Environment] = LazyHandle()
        self._advice: LazyHandle[tuple[int, int] | None] = LazyHandle()  # (fd, mmap base) for prefetch

    def _open(self) -> lmdb.Environment:
        env, self._ident = _shared_env(self.path, self.readahead)
        try:
            stat, info = env.stat(), env.info()
            # LMDB maps the file and trusts its own page numbers: pages past the end of a truncated
            # file would fault (SIGBUS). Its pages must all lie inside the file.
            needed = (info["last_pgno"] + 1) * stat["psize"]
            size = os.stat(self.path).st_size
            problem = (None if stat["entries"] == self.num_samples
                       else f"holds {stat['entries']} samples, the manifest says {self.num_samples}")
            if needed > size:
                problem = f"truncated: LMDB records {needed} bytes of pages, the file holds {size}"
        except (lmdb.Error, OSError) as exc:
            problem = f"damaged LMDB shard ({exc})"
        if problem:
            _release_env(self._ident)
            raise PackerError(f"{self.path}: {problem}")
        return env

    def __len__(self) -> int:
        return self.num_samples

    def read(self, pos: int) -> bytes:
        try:
            with self._env.get(self._open).begin() as txn:
                value = txn.get(key(pos))
        except lmdb.Error as exc:
            raise PackerError(f"{self.path}: damaged LMDB shard, reading sample {pos} ({exc})") from exc
        if value is None:
            raise PackerError(f"{self.path}: sample {pos} is missing from the shard")
        return value

    def read_many(self, positions: list[int]) -> list[bytes]:
        """Runs of neighbouring positions are read with one cursor walk (sequential pages)."""
        try:
            return self._read_runs(positions)
        except lmdb.Error as exc:
            raise PackerError(f"{self.path}: damaged LMDB shard ({exc})") from exc

    def _read_runs(self, positions: list[int]) -> list[bytes]:
        out: list[bytes] = []
        with self._env.get(self._open).begin() as txn, txn.cursor() as cur:
            for start, stop in contiguous_runs(list(positions)):
                if not cur.set_key(key(start)):
                    raise PackerError(f"{self.path}: sample {start} is missing from the shard")
                for pos in range(start, stop):
                    k, v = cur.item()
                    if k != key(pos):
                        raise PackerError(f"{self.path}: sample {pos} is missing from the shard")
                    out.append(v)
                    cur.next()
        return out

    def prefetch(self, positions: list[int]) -> None:
        """Start reading the file spans of these samples in the background (see base.advise_willneed).

        LMDB stores a large value in consecutive overflow pages and, written in key order, runs
        of neighbouring samples in one span of the file; a value's file offset is its address
        in the read-only map minus the map's base.
        """
        env = self._env.get(self._open)
        advice = self._advice.get(self._open_advice)
        if advice is None:
            return
        fd, base = advice
        spans = []
        with env.begin(buffers=True) as txn:
            for start, stop in contiguous_runs(sorted(set(positions))):
                first, last = txn.get(key(start)), txn.get(key(stop - 1))
                if first is None or last is None:
                    continue  # read() will report it
                # Small values share leaf pages and are laid out downwards inside a page: take the hull.
                a = np.frombuffer(first, np.uint8).ctypes.data - base
                b = np.frombuffer(last, np.uint8).ctypes.data - base
                lo, hi = min(a, b), max(a + len(first), b + len(last))
                if 0 <= lo < hi:
                    spans.append((lo, hi))
        advise_willneed(fd, spans)

    def _open_advice(self) -> tuple[int, int] | None:
        self._env.get(self._open)
        base = mapping_base(str(self.path.resolve()))
        return None if base is None else (os.open(self.path, os.O_RDONLY), base)

    def close(self) -> None:
        self._advice.close(lambda advice: advice and os.close(advice[0]))
        self._env.close(lambda env: _release_env(self._ident))
