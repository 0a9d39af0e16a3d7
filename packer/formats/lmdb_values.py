"""An LMDB shard's values read straight from one read-only map of its file, where its ``.spans.npy`` says they lie.

py-lmdb copies every value out of its map into a new ``bytes`` (and walks a cursor per run of
neighbours); with the spans written at conversion (``lmdb.value_spans``) a value is a slice of a
memoryview, a batch of fixed-size values one gather. Nothing here trusts the spans file: ``load_spans``
checks its shape and bounds, ``check_against_btree`` that no two values overlap and that a spread of
samples (first, last, between) lies exactly where LMDB's own B-tree puts them; the payload sizes are
checked against the index on every read (``read.store.ShardStore.check_reads``) and the file's size
against the manifest before each (the reader's ``check_size``: a map never reads past a truncated end).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from pathlib import Path

import lmdb
import numpy as np

from packer.errors import PackerError
from packer.layout.trust import load_npy

SAMPLES_CHECKED = 8  # samples per shard whose spans are compared with the B-tree on open (a leaf page read each)
GATHER_BYTES = 1 << 20  # read_into gathers about this much at a time (its temporary stays in the CPU cache)


def key(pos: int) -> bytes:
    return b"%010d" % pos


def load_spans(path: Path, num_samples: int, file_size: int, psize: int) -> np.ndarray | None:
    """[N, 3] int64 (leaf page, value start, value end) from ``path``, each inside the file; None: none written
    (a file of shape (0, 3): conversion ran where /proc could not locate the values)."""
    spans = load_npy(path, "<i8", ndim=2, max_items=3 * num_samples)
    if spans.shape == (0, 3):
        return None
    if (spans.shape != (num_samples, 3) or np.any(spans < 0) or np.any(spans[:, 1] > spans[:, 2])
            or np.any(spans[:, 2] > file_size) or np.any(spans[:, 0] % psize) or np.any(spans[:, 0] >= file_size)):
        raise PackerError(f"{path}: spans do not describe the samples of {path.name.removesuffix('.spans.npy')}.lmdb")
    return spans


def check_against_btree(env: lmdb.Environment, spans: np.ndarray, path: Path, spans_path: Path) -> None:
    """Refuse spans that disagree with the shard: values that overlap, or a spread of samples whose leaf page
    and value are not where LMDB's B-tree puts them in the file (``_leaf_node``: leaf pages only, never a value:
    py-lmdb reads a whole value to hand it out, 8 values of 100 KB were 190 device reads, 1.2 s, on a cold
    open under the emulated hard disk)."""
    where = f"{spans_path}: spans disagree with the LMDB B-tree of {path.name}"
    order = np.argsort(spans[:, 1], kind="stable")
    if np.any(spans[order[1:], 1] < spans[order[:-1], 2]):
        raise PackerError(f"{where} (two values overlap)")
    psize, size = int(env.stat()["psize"]), os.stat(path).st_size
    with env.begin(buffers=True) as txn, txn.cursor() as cur:
        for pos in np.unique(np.linspace(0, len(spans) - 1, min(SAMPLES_CHECKED, len(spans))).astype(int)).tolist():
            if not cur.set_key(key(pos)):
                raise PackerError(f"{where} (sample {pos} is missing)")
            page, at, nbytes = _leaf_node(cur.key(), psize, size, f"{where} (sample {pos}")
            start, end = int(spans[pos, 1]), int(spans[pos, 2])
            if nbytes != end - start:
                raise PackerError(f"{where} (sample {pos}: {end - start} bytes, LMDB holds {nbytes})")
            if (page, at) != (int(spans[pos, 0]), start):
                raise PackerError(f"{where} (sample {pos} lies at byte {at}, not {start})")


def spans_from_btree(env: lmdb.Environment, path: Path, count: int) -> np.ndarray:
    """[count, 3] int64 (leaf page, value start, value end) of every sample, from one walk of the B-tree's leaf
    pages (values are never touched): how the writer makes the spans file, and how a reader serves a shard
    written without one. A value that would lie outside the file is refused in one line."""
    psize, size = int(env.stat()["psize"]), os.stat(path).st_size
    out = np.zeros((count, 3), dtype=np.int64)
    with env.begin(buffers=True) as txn, txn.cursor() as cur:
        found = cur.first()
        for pos in range(count):
            if not found or bytes(cur.key()) != key(pos):
                raise PackerError(f"{path}: damaged LMDB shard: sample {pos} is missing")
            page, start, nbytes = _leaf_node(cur.key(), psize, size, f"{path}: damaged LMDB shard (sample {pos}")
            if start + nbytes > size:
                raise PackerError(f"{path}: damaged LMDB shard (sample {pos}'s value runs past the end of the file)")
            out[pos] = (page, start, start + nbytes)
            found = cur.next()
    return out


NODE_HEADER = struct.Struct("<HHHH")  # LMDB's MDB_node: data size (low, high 16 bits), flags, key size
BIGDATA = 0x01  # F_BIGDATA: the value lies in overflow pages, the node holds their first page number
PAGE_HEADER = 16  # an overflow page's header (page number, padding, flags, overflow count)


def _leaf_node(key_buffer, psize: int, file_size: int, where: str) -> tuple[int, int, int]:
    """(leaf page offset, value offset, value size) in the file of the leaf node holding ``key_buffer`` (py-lmdb's
    zero-copy key, inside its map of the file), decoded as LMDB lays a node out.

    The page's own header gives its number, hence its place in the file (leaf pages lie inside the file: the
    reader checked LMDB's last page against the file's size), and only bytes of that page are read: the node's
    header before the key, an overflow page number after it."""
    address = _address(key_buffer)
    in_page = address % psize
    page = int.from_bytes(ctypes.string_at(address - in_page, 8), "little") * psize
    lo, hi, flags, ksize = NODE_HEADER.unpack(ctypes.string_at(address - NODE_HEADER.size, NODE_HEADER.size))
    nbytes = lo | hi << 16
    inline = 8 if flags & BIGDATA else nbytes  # bytes after the key, in this page
    if not 0 <= page <= file_size - psize or ksize != len(key_buffer) or in_page + ksize + inline > psize:
        raise PackerError(f"{where}'s leaf node is not LMDB's)")
    if flags & BIGDATA:
        return page, int.from_bytes(ctypes.string_at(address + ksize, 8), "little") * psize + PAGE_HEADER, nbytes
    return page, page + in_page + ksize, nbytes


def _address(buf) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


class MappedValues:
    """A shard's values as zero-copy read-only views of this process's read-only map of the file.

    A view keeps the map alive: a payload held after the dataset closed still reads the bytes it was
    given (``close`` only forgets the map; it goes with its last view), as memmap's payloads do.
    """

    def __init__(self, fd: int, path: Path, spans: np.ndarray, random: bool) -> None:
        try:
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise PackerError(f"{path}: cannot map ({exc})") from exc
        if len(mm) < int(spans[:, 2].max(initial=0)):
            raise PackerError(f"{path}: shorter than its spans say (truncated?)")
        if random:
            mm.madvise(mmap.MADV_RANDOM)  # no read-ahead: uniform random reads would only evict pages
        self.view = memoryview(mm)
        self.array = np.frombuffer(mm, dtype=np.uint8)
        self.spans = spans
        self.path = path

    def read(self, pos: int) -> memoryview:
        return self.view[int(self.spans[pos, 1]) : int(self.spans[pos, 2])]

    def read_many(self, positions: list[int]) -> list[memoryview]:
        view = self.view
        return [view[a:b] for a, b in self.spans[positions, 1:].tolist()]

    def read_into(self, positions: list[int], out: np.ndarray) -> None:
        """Copy the values at ``positions`` (each ``out[0].nbytes`` long, any order) into ``out[0:len]``: a gather
        from a view whose rows start at every byte of the file, a cache-sized piece at a time."""
        n = len(positions)
        size = int(np.prod(out.shape[1:]))
        starts = self.spans[positions, 1]
        if np.any(self.spans[positions, 2] - starts != size):
            raise PackerError(f"{self.path}: {np.sum(self.spans[positions, 2] - starts != size)} of the samples "
                              f"asked are not {size} bytes long (damaged dataset)")
        if not n or not size:
            return
        rows = np.lib.stride_tricks.as_strided(self.array, shape=(len(self.array) - size + 1, size),
                                               strides=(1, 1), writeable=False)
        flat = out[:n].reshape(n, size)
        step = max(1, GATHER_BYTES // size)
        for k in range(0, n, step):
            flat[k : k + step] = rows[starts[k : k + step]]
