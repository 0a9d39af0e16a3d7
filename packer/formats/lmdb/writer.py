"""LMDB shards written with py-lmdb: keys arrive sorted and are appended (``append=True``: pages fill
completely, no splits), committed in batches, the map grown on ``MapFullError`` instead of reserved up front; the
same samples in the same order give the same file, byte for byte (page allocation is deterministic and ``meminit``
zeroes unused bytes). Closing a shard writes its spans file (``values.spans_from_btree``)."""

from __future__ import annotations

import os
from pathlib import Path

import lmdb
import numpy as np

from packer.errors import PackerError
from packer.formats.base import PreparedSample, ShardWriter, check_addition, fixed_shape
from packer.formats.lmdb.pages import Tree, read_header
from packer.formats.lmdb.values import key, spans_from_btree

_BATCH_BYTES = 4 << 20  # commit about every 4 MB, not 16: dirty pages stay cache-hot (docs/results.md)
_INITIAL_MAP = 64 << 20


def shard_name(shard_id: int) -> str:
    return f"shard-{shard_id:05d}.lmdb"


class Writer(ShardWriter):
    def __init__(self, directory: Path, shard_id: int, num_samples: int, payload: str, options: dict) -> None:
        self.name = shard_name(shard_id)
        self.path = directory / self.name
        self.planned = num_samples
        self.shape = fixed_shape(payload, options)  # raw payloads of one shape: the manifest says so (read_into)
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
        check_addition(self.path, self._count, self.planned, sample, self.shape)
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
        np.save(self.path.with_name(spans_name(self.name)), value_spans(self.path, self._count), allow_pickle=False)
        facts: dict = {"map_size": self._map_size}
        if self.shape is not None:
            facts.update(layout="fixed", shape=list(self.shape))
        return [self.name, spans_name(self.name)], facts

    def abort(self) -> None:
        self._env.close()
        for path in (self.path, self.path.with_name(spans_name(self.name))):
            path.unlink(missing_ok=True)


def spans_name(shard_file: str) -> str:
    return shard_file.removesuffix(".lmdb") + ".spans.npy"


def value_spans(path: Path, count: int) -> np.ndarray:
    """[count, 3] int64: each sample's leaf page offset and value start/end in the file, found by one walk of
    the just-written file's leaf pages (``values.spans_from_btree``): readers map values with them."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        header = read_header(fd, path)
        return spans_from_btree(Tree(fd, path, header.psize, header.txnid), count)
    finally:
        os.close(fd)
