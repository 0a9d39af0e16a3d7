"""An LMDB shard's values read straight from one read-only map of its file, where its ``.spans.npy`` says they lie.

py-lmdb copies every value out of its map into a new ``bytes`` (and walks a cursor per run of
neighbours); with the spans written at conversion (``writer.value_spans``) a value is a slice of a
memoryview, a batch of fixed-size values one gather. Nothing here trusts the spans file: ``load_spans``
checks its shape and bounds, ``check_against_btree`` that no two values overlap and that every sample of
the first, middle and last leaf pages lies exactly where LMDB's own B-tree puts it; the payload sizes are
checked against the index on every read (``read.store.ShardStore.check_reads``) and the file's size
against the manifest before each (the reader's ``check_size``: a map never reads past a truncated end).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from packer.errors import DatasetError
from packer.formats.filemap import map_readonly
from packer.formats.lmdb.pages import Tree
from packer.layout.trust import load_npy

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
        raise DatasetError(f"{path}: spans do not describe the samples of {path.name.removesuffix('.spans.npy')}.lmdb")
    return spans


def check_against_btree(tree: Tree, spans: np.ndarray, path: Path, spans_path: Path) -> None:
    """Refuse spans that disagree with the shard: values that overlap, or any sample of the first, middle and
    last leaf pages whose leaf page or value is not where LMDB's B-tree puts it in the file (``pages``:
    the root, branch and leaf pages only, never a value)."""
    where = f"{spans_path}: spans disagree with the LMDB B-tree of {path.name}"
    order = np.argsort(spans[:, 1], kind="stable")
    if np.any(spans[order[1:], 1] < spans[order[:-1], 2]):
        raise DatasetError(f"{where} (two values overlap)")
    for target in sorted({0, len(spans) // 2, len(spans) - 1} if len(spans) else ()):
        pgno = tree.leaf_of(key(target))
        nodes = tree.leaf(pgno)
        first = _position(nodes[0].key, len(spans))
        if first is None or not first <= target < first + len(nodes):
            raise DatasetError(f"{where} (sample {target} is missing)")
        for pos, node in enumerate(nodes, start=first):
            if pos >= len(spans) or node.key != key(pos):
                raise DatasetError(f"{where} (sample {pos} is missing)")
            start, end = int(spans[pos, 1]), int(spans[pos, 2])
            if node.nbytes != end - start:
                raise DatasetError(f"{where} (sample {pos}: {end - start} bytes, LMDB holds {node.nbytes})")
            if (pgno * tree.psize, node.start) != (int(spans[pos, 0]), start):
                raise DatasetError(f"{where} (sample {pos} lies at byte {node.start}, not {start})")


def _position(k: bytes, count: int) -> int | None:
    """The sample position a key names (``key``'s ten digits), or None."""
    return int(k) if len(k) == 10 and k.isdigit() and int(k) < count else None


def spans_from_btree(tree: Tree, count: int) -> np.ndarray:
    """[count, 3] int64 (leaf page, value start, value end) of every sample, from one walk of the B-tree's leaf
    pages (values are never touched): how the writer makes the spans file, and how a reader serves a shard
    written without one. A value that would lie outside the file is refused in one line."""
    out = np.zeros((count, 3), dtype=np.int64)
    pos = 0
    for pgno, nodes in tree.leaves():
        for node in nodes:
            if pos >= count or node.key != key(pos):
                raise DatasetError(f"{tree.path}: damaged LMDB shard: sample {min(pos, count)} is missing")
            out[pos] = (pgno * tree.psize, node.start, node.start + node.nbytes)
            pos += 1
    if pos != count:
        raise DatasetError(f"{tree.path}: damaged LMDB shard: sample {pos} is missing")
    return out


class MappedValues:
    """A shard's values as zero-copy read-only views of this process's read-only map of the file.

    A view keeps the map alive: a payload held after the dataset closed still reads the bytes it was
    given (``close`` only forgets the map; it goes with its last view), as memmap's payloads do.
    """

    def __init__(self, fd: int, path: Path, spans: np.ndarray, random: bool) -> None:
        mm = map_readonly(path, fd, "random" if random else "sequential")
        if len(mm) < int(spans[:, 2].max(initial=0)):
            raise DatasetError(f"{path}: shorter than its spans say (truncated?)")
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
            raise DatasetError(f"{self.path}: {np.sum(self.spans[positions, 2] - starts != size)} of the samples "
                               f"asked are not {size} bytes long (damaged dataset)")
        if not n or not size:
            return
        rows = np.lib.stride_tricks.as_strided(self.array, shape=(len(self.array) - size + 1, size),
                                               strides=(1, 1), writeable=False)
        flat = out[:n].reshape(n, size)
        step = max(1, GATHER_BYTES // size)
        for k in range(0, n, step):
            flat[k : k + step] = rows[starts[k : k + step]]
