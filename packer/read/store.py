"""A dataset's shards, opened as one consistent version, and reads checked whatever the format: the local source.

``ShardStore`` holds the manifest, the per-sample index and the identity of every shard file, all
read from one version of the dataset (a conversion with ``--overwrite`` may swap a new one in at
any time), one ``Format.Reader`` per shard (opening nothing until used in a process), and checks
each read: the payload has the size the index records, and the files are the ones opened. As a
``SampleSource`` it reads a batch ahead in file order (packer.read.readahead), skipping what the page
cache holds, and reads payloads shard by shard with one ``read_many`` each.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, cast

import numpy as np

from packer import sysinfo
from packer.errors import DatasetError, OptionError, PackerError
from packer.formats import check_recorded_options, get_format
from packer.formats.base import Destinations, Format, ShardReader
from packer.layout.fields import FieldStore, load_fields
from packer.layout.index import Index, shard_starts
from packer.layout.manifest import MANIFEST_NAME, Manifest, Shard, read_manifest
from packer.layout.trust import reading
from packer.perprocess import PerProcess
from packer.read import readahead
from packer.read.hints import Ahead
from packer.read.source import SampleSource
from packer.storage.url import refuse_url

Access = Literal["auto", "sequential", "random"]


def resolve_access(access: Access, fits: bool) -> str:
    """``auto``: sequential-friendly (read-ahead on) unless the dataset is larger than half the free RAM (``fits``:
    ``fits_in_memory``).

    Read-ahead makes sequential and block-shuffled passes many times faster; it only hurts
    uniform random access over data that can't stay in the page cache.
    """
    if access not in ("auto", "sequential", "random"):
        raise OptionError(f"unknown access pattern {access!r} (choose auto, sequential or random)")
    if access != "auto":
        return access
    return "sequential" if fits else "random"


def fits_in_memory(manifest: Manifest) -> bool:
    """The dataset's files take at most half the memory available now (unknown: True), so pages read ahead stay
    cached until the pass needs them."""
    size = sum(f.num_bytes for s in manifest.shards for f in s.files)
    available = sysinfo.memory_available()
    return available is None or size <= available // 2


FileIds = list[list[tuple[int, int]]]


class ShardFiles(Protocol):
    """Where a store's shard files come from: the dataset's folder (``LocalFiles``), or a node's cache that a
    remote dataset's shards are fetched into (``packer.read.remote.RemoteShards``)."""

    root: Path  # the local folder holding the manifest and meta/ (a remote dataset's: the node's copy)
    name: str  # the dataset as messages name it: its path, or its URL redacted

    def open(self) -> tuple[Manifest, Index, FieldStore, FileIds | None]:
        """Manifest, index, fields and each shard file's identity (None: the files are checked when fetched)."""
        ...

    def reader(self, fmt: Format, k: int, shard: Shard, payload: str, access: str) -> ShardReader:
        """The reader of shard ``k`` (opening nothing yet)."""
        ...

    def where(self, name: str) -> str:
        """File ``name`` of the dataset as messages name it."""
        ...

    def follow(self, stored: np.ndarray, indices: Iterator[int], start: int) -> Iterator[int]:
        """``indices``, the pass over storage positions ``stored`` from ``start``, as handed out."""
        ...

    def close(self) -> None: ...


class LocalFiles:
    """The shard files of the dataset folder ``root``, read in place."""

    def __init__(self, root: Path) -> None:
        self.root, self.name = root, str(root)

    @classmethod
    def at(cls, path: str | os.PathLike, by: str) -> LocalFiles:
        """The folder ``path`` made absolute (a later ``os.chdir``, a worker, an unpickling elsewhere); a URL is
        refused in one line naming ``by``, never taken as a path."""
        refuse_url(path, f"{by} (use open_dataset for a URL)")
        return cls(Path(path).absolute())

    def open(self) -> tuple[Manifest, Index, FieldStore, FileIds | None]:
        return _open_consistent(self.root)

    def reader(self, fmt: Format, k: int, shard: Shard, payload: str, access: str) -> ShardReader:
        return fmt.Reader(self.root, shard, payload, access=access)

    def where(self, name: str) -> str:
        return str(self.root / name)

    def follow(self, stored: np.ndarray, indices: Iterator[int], start: int) -> Iterator[int]:
        return indices

    def close(self) -> None:
        pass


HULLS_KEPT = 4096  # ranges whose byte hulls a store remembers (an epoch's blocks, and ranks' shares of them)


class ShardStore(SampleSource):
    """The shards of the dataset at ``root`` (an absolute path), opened consistently; reads checked. ``files``:
    where the shard files come from (default: ``root`` itself)."""

    def __init__(self, root: Path, access: Access = "auto", files: ShardFiles | None = None) -> None:
        self.root = root
        self.files = LocalFiles(root) if files is None else files
        self.manifest, self.index, self.fields, self._file_ids = self.files.open()
        self.payload = self.manifest.payload
        fmt = get_format(self.manifest.format)
        check_recorded_options(fmt.name, self.manifest.options, root / MANIFEST_NAME)
        self.fits_in_memory = fits_in_memory(self.manifest)  # read-ahead may read a block's edge request whole
        self.access = resolve_access(access, self.fits_in_memory)
        self._shards()
        self._checked: PerProcess[set[int]] = PerProcess(set)  # shards whose files this process checked
        self.hulls: dict[tuple[int, int], list[tuple[str, int, int]]] = {}  # byte_hulls, per range asked

    def _shards(self) -> None:
        """A reader (opening nothing yet), a first position and a name per shard, from the manifest."""
        fmt = get_format(self.manifest.format)
        with reading(f"{self.root}: opening shards"):
            self.readers = [self.files.reader(fmt, k, s, self.manifest.payload, self.access)
                            for k, s in enumerate(self.manifest.shards)]
        self.starts = shard_starts([s.num_samples for s in self.manifest.shards])
        self._names = [self.files.where(s.files[0].name) for s in self.manifest.shards]  # where(): once, not per read

    def __getstate__(self) -> dict:
        """All but what ``_shards`` makes again where unpickled (a URL dataset's manifest pickles as a reference:
        a spawned worker's pickle does not grow with the shards) and the remembered hulls."""
        state = dict(self.__dict__)
        for name in ("readers", "starts", "_names"):
            del state[name]
        state["hulls"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state)
        self._shards()

    def start(self, positions: np.ndarray, ahead: Sequence[Ahead] = (), skip_cached: bool = True
              ) -> readahead.Pending:
        """Read these positions' bytes ahead in file order (``SampleSource.start``); ``skip_cached``: not the samples
        whose bytes are all in the page cache (reading them ahead would only copy; a page the decoder never touches,
        an EXIF thumbnail's, once evicted would else have the whole batch read again). The ``ahead`` ranges bound
        how far a read may be widened to whole device requests."""
        ordered = np.sort(np.asarray(positions, dtype=np.int64), kind="stable")
        shard_of = np.searchsorted(self.starts, ordered, side="right") - 1
        requests: list = []
        for shard in np.unique(shard_of):
            reader = self.readers[shard]
            where = (ordered[shard_of == shard] - self.starts[shard]).tolist()
            with reading(self.where(shard)):
                cached = reader.cached(where).tolist() if skip_cached else [False] * len(where)
                todo = [p for p, c in zip(where, cached, strict=True) if not c]
                if todo:
                    reader.will_need(todo)  # formats of one file per sample: the kernel reads them all at once
                    spans = iter(reader.file_spans(todo))  # the others: byte ranges for the read-ahead thread
                    requests.extend(() if c else next(spans) for c in cached)
                else:
                    requests.extend([()] * len(where))  # nothing to read for any of them
        # whole device requests at block edges where the data fits in memory (the neighbour's part stays cached)
        return readahead.start(requests, within=self._hulls(ahead), whole_cells=self.fits_in_memory)

    def payloads(self, positions: Sequence[int] | np.ndarray, pending: readahead.Pending | None = None,
                 into: Callable[[int], np.ndarray] | None = None,
                 places: Sequence[np.ndarray | None] | None = None) -> list:
        """``SampleSource.payloads``: each shard's samples read with one ``read_many`` (or ``read_copies``) call in
        file order, once ``pending`` has brought in its last one, and checked against the index together."""
        idx = np.asarray(positions, dtype=np.int64)
        if len(idx) == 1 and into is None and places is None:
            if pending is not None:
                pending.wait(0)
            return [self.read(int(idx[0]))]
        if not len(idx):
            return []
        order = np.argsort(idx, kind="stable")
        ordered = idx[order]
        got: list = []  # in file order
        shard_of = np.searchsorted(self.starts, ordered, side="right") - 1
        bounds = np.flatnonzero(np.diff(shard_of)) + 1
        memory = self._copies_memory(ordered, order, into, places)
        for lo, hi in zip([0, *bounds.tolist()], [*bounds.tolist(), len(ordered)]):
            if pending is not None:
                pending.wait_all(range(lo, hi))
            got.extend(self.read_checked(int(shard_of[lo]), ordered[lo:hi], memory and memory(lo, hi)))
        if len(got) < 2:
            return got
        place = np.empty(len(order), dtype=np.int64)
        place[order] = np.arange(len(order))  # where each asked sample lies in file order
        return list(operator.itemgetter(*place.tolist())(got))  # one C-level gather, not a Python loop

    def _copies_memory(self, ordered: np.ndarray, order: np.ndarray, into: Callable[[int], np.ndarray] | None,
                       places: Sequence[np.ndarray | None] | None) -> Callable[[int, int], Destinations] | None:
        """Where ``payloads`` reads the copies of the payloads ``ordered[lo:hi]`` (positions in file order, ``order``
        their places in the order asked); None: no copies, views. Raw pixels go straight into their ``places``
        where each has the payload's size: one copy, as a view copied into its slot was; else consecutive parts of
        one block from ``into``."""
        sizes = self.index.nbytes[ordered]
        if places is not None and self.payload == "raw":
            dests = [places[k] for k in order.tolist()]
            if all(d is not None and d.nbytes == n for d, n in zip(dests, sizes.tolist(), strict=True)):
                return lambda lo, hi: cast(list, dests[lo:hi])
        if into is None:
            return None
        ends = np.cumsum(sizes)
        block = into(int(ends[-1]))
        return lambda lo, hi: block[int(ends[lo] - sizes[lo]) : int(ends[hi - 1])]

    def _hulls(self, ahead: Sequence[Ahead]) -> list[tuple[str, int, int]]:
        """Each hinted range's byte hull in every file its samples lie in (``byte_hulls``; a range across shards,
        or out of range, is left out)."""
        out = []
        for hint in ahead:
            try:
                first, stop = operator.index(hint.first), operator.index(hint.stop)
            except (TypeError, AttributeError):
                raise PackerError(f"{self.root}: a read hint must hold integer positions, got {hint!r}") from None
            if not 0 <= first < stop <= self.manifest.num_samples:
                continue
            out.extend(self.byte_hulls(first, stop))
        return out

    def byte_hulls(self, first: int, stop: int) -> list[tuple[str, int, int]]:
        """Per file, the first byte to the last of the ranges storage positions [first, stop) are read from (one
        file for most formats, each block file the range covers for n5); [] for a range across shards. Worked
        out once per range: a block sampler hints the same blocks batch after batch."""
        got = self.hulls.get((first, stop))
        if got is None:
            if len(self.hulls) >= HULLS_KEPT:
                self.hulls.clear()
            got = self.hulls[first, stop] = self._byte_hulls(first, stop)
        return got

    def _byte_hulls(self, first: int, stop: int) -> list[tuple[str, int, int]]:
        shard, a = self.locate(first)
        if self.locate(stop - 1)[0] != shard:
            return []
        hull: dict[str, tuple[int, int]] = {}
        for ranges in self.readers[shard].file_spans(list(range(a, a + stop - first))):
            for path, lo, hi in ranges:
                was = hull.get(path)
                hull[path] = (lo, hi) if was is None else (min(was[0], lo), max(was[1], hi))
        return [(path, lo, hi) for path, (lo, hi) in hull.items()]

    def locate(self, i: int) -> tuple[int, int]:
        """(shard number, position inside that shard) of sample ``i``."""
        shard = int(np.searchsorted(self.starts, i, side="right")) - 1
        return shard, i - int(self.starts[shard])

    def read(self, i: int) -> Any:
        """Sample ``i``'s payload (a checked index), checked against the index and the files opened."""
        shard, pos = self.locate(i)
        with reading(self.where(shard, i)):
            buf = self.readers[shard].read(pos)
        self.check_read(shard, i, buf)
        return buf

    def read_checked(self, shard: int, stored: np.ndarray, into: Destinations = None) -> list:
        """The payloads at dataset positions ``stored`` (ascending, all in ``shard``), checked together
        (``check_reads``): views from the reader's ``read_many``, or with ``into`` (memory for their bytes:
        ``ShardReader.read_copies``) copies, never read through a map."""
        positions = (stored - self.starts[shard]).tolist()
        with reading(self.where(shard)):
            reader = self.readers[shard]
            bufs = reader.read_many(positions) if into is None else reader.read_copies(positions, into)
        self.check_reads(shard, stored, bufs)
        return bufs

    def where(self, shard: int, i: int | None = None) -> str:
        return self._names[shard] if i is None else f"{self._names[shard]}: sample {i}"

    def check_read(self, shard: int, i: int, buf) -> None:
        """Checks every read passes, whatever the format: the payload has the size the index
        records, and the shard's files are still those this dataset was opened on."""
        self.check_same_files(shard)
        size = buf.nbytes if isinstance(buf, (np.ndarray, memoryview)) else len(buf)
        if size != int(self.index.nbytes[i]):
            raise DatasetError(f"{self.where(shard, i)}: {size} bytes read, the index says "
                               f"{int(self.index.nbytes[i])} (damaged dataset)")

    def check_reads(self, shard: int, positions: np.ndarray, bufs: list) -> None:
        """``check_read`` of many payloads of one shard (dataset positions ``positions``), at once."""
        if len(bufs) != len(positions):
            raise DatasetError(f"{self.where(shard)}: {len(bufs)} samples read, {len(positions)} asked")
        self.check_same_files(shard)
        sizes = _sizes(bufs)
        bad = np.flatnonzero(sizes != self.index.nbytes[positions])
        if len(bad):
            i = int(positions[bad[0]])
            raise DatasetError(f"{self.where(shard, i)}: {int(sizes[bad[0]])} bytes read, the index says "
                               f"{int(self.index.nbytes[i])} (damaged dataset)")

    def check_same_files(self, shard: int) -> None:
        """Once per process and shard, after its reader opened: the files are those this dataset was opened on."""
        checked = self._checked.get()
        if shard not in checked and self._file_ids is not None:
            for f, recorded in zip(self.manifest.shards[shard].files, self._file_ids[shard]):
                if _file_id(self.root / f.name) != recorded:
                    raise DatasetError(f"{self.root / f.name}: replaced since this dataset was opened "
                                       "(a new conversion?); open the dataset again")
            checked.add(shard)

    def follow(self, stored: np.ndarray, indices: Iterator[int], start: int) -> Iterator[int]:
        """The shard files may fetch ahead along a sampler's pass (a URL's, whole-shard mode)."""
        return self.files.follow(stored, indices, start)

    @property
    def fixed_shape(self) -> tuple[int, int, int] | None:
        """(H, W, 3) when every shard stores one shape its reader can copy in bulk, else None."""
        shapes = {r.fixed_shape for r in self.readers}
        return shapes.pop() if len(shapes) == 1 and None not in shapes else None

    def close(self) -> None:
        for r in self.readers:
            r.close()
        self.files.close()


def _sizes(bufs: list) -> np.ndarray:
    """Bytes of each payload: views and arrays say ``nbytes`` (one C-level pass where all are), others (``bytes``)
    their length."""
    if set(map(type, bufs)) <= _VIEWS:
        return np.fromiter(map(_NBYTES, bufs), dtype=np.int64, count=len(bufs))
    return np.fromiter((b.nbytes if isinstance(b, (np.ndarray, memoryview)) else len(b) for b in bufs),
                       dtype=np.int64, count=len(bufs))


_NBYTES = operator.attrgetter("nbytes")
_VIEWS = {np.ndarray, memoryview}


def _open_consistent(root: Path) -> tuple[Manifest, Index, FieldStore, FileIds]:
    """Manifest, index, fields and the identity of every shard file, all from one version of the dataset.

    ``convert --overwrite`` swaps a whole new directory in: if the directory changed while
    these were read, read them again. The file identities let readers, which open lazily,
    refuse files that were replaced after this point instead of reading them with this index.
    """
    for _ in range(5):
        before = _dir_id(root)
        try:
            manifest = read_manifest(root)
            manifest.check_files(root)
            index = Index.load(root, manifest.num_samples, files=manifest.meta_files,
                               num_classes=len(manifest.classes), source_records=manifest.source_records)
            fields = load_fields(root, manifest)
            file_ids = [[_file_id(root / f.name) for f in s.files] for s in manifest.shards]
        except PackerError:
            if _dir_id(root, missing_ok=True) not in (before, None):
                continue  # swapped while being read: files vanished or changed under us, read the new one
            raise
        if _dir_id(root) == before:
            return manifest, index, fields, file_ids
    raise PackerError(f"{root}: replaced again and again while being opened; try again later")


def _dir_id(path: Path, missing_ok: bool = False) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError as exc:
        if missing_ok:
            return None
        raise DatasetError(f"{path}: {exc.strerror or exc}") from None
    return st.st_dev, st.st_ino, st.st_mtime_ns


def _file_id(path: Path) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError as exc:
        raise DatasetError(f"{path}: {exc.strerror or exc}") from None
    return st.st_dev, st.st_ino
