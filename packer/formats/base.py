"""The format interface, in code: ``Format`` (what a format is), ``ShardWriter`` and ``ShardReader`` (what it
does), ``Option`` (a conversion option only it takes), and what every format shares.

A format is one module that ends with ``FORMAT = Format(...)`` (or an instance of a ``Format`` subclass
that overrides a hook) plus one line in ``packer.formats.FORMATS``; docs/adding-a-format.md walks
through one. Hooks have defaults, so nothing ever probes a format with ``getattr``/``hasattr``.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from packer.errors import DatasetError, PackerError
from packer.formats import safecopy
from packer.formats.filemap import check_size
from packer.images.resize import ResizeSpec
from packer.pagecache import SpanResidency

if TYPE_CHECKING:
    from packer.layout.manifest import Manifest, Shard

H = TypeVar("H")
Span = tuple[str, int, int]  # (file path, start byte, end byte)
Destinations = np.ndarray | Sequence[np.ndarray] | None  # read_copies' memory: flat, one array per sample, or new


@dataclass
class PreparedSample:
    """One source image, read and validated, ready to store."""

    index: int  # position in the dataset
    rel_path: str  # relative to the converted folder
    label: int
    payload: bytes | np.ndarray  # encoded bytes, or HWC uint8 RGB for raw
    height: int
    width: int
    source_stat: list[int] | None = None  # [size, mtime_ns] of the source file as read: a resume checks it
    rewritten: bool = False  # encoded bytes rewritten (--jpeg-restarts), not the source's own

    @property
    def nbytes(self) -> int:
        return len(self.payload) if isinstance(self.payload, bytes) else int(self.payload.nbytes)


class ShardWriter(ABC):
    """Writes one shard: ``add`` each prepared sample in order, then ``close`` (or ``abort`` on failure).

    Writers may receive fewer samples than ``num_samples`` (the rest failed validation).
    """

    def __init__(self, directory: Path, shard_id: int, num_samples: int, payload: str, options: Mapping) -> None:
        self.directory, self.shard_id, self.planned, self.payload = Path(directory), shard_id, num_samples, payload

    @abstractmethod
    def add(self, sample: PreparedSample) -> None: ...

    @abstractmethod
    def close(self) -> tuple[list[str], dict]:
        """Finish the shard: (its file names, relative to the directory; facts for the manifest)."""

    def abort(self) -> None:
        """Release what the writer holds after a failure (the caller removes the shard's files)."""

    def digests(self) -> dict[str, str]:
        """After ``close``: the sha256 of files it hashed as it wrote them (``layout.digest.StreamDigest``); the
        journal reads back the others. Default: none."""
        return {}


class ShardReader(ABC):
    """Reads one shard's payloads; opens nothing until its first read in the current process."""

    fixed_shape: tuple[int, int, int] | None = None  # (H, W, 3) when ``read_into`` can copy a batch in bulk
    _residency: SpanResidency | None = None  # made by the first ``cached`` (the default one)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "in_page_cache" in vars(cls):  # renamed after 0.1.0: an override under the old name would never be called
            raise TypeError(f"{cls.__qualname__}.in_page_cache is now cached(positions): a bool per position")

    @abstractmethod
    def __init__(self, directory: Path, shard: Shard, payload: str, access: str = "sequential") -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def read(self, pos: int) -> Any:
        """The payload at ``pos``: encoded bytes (or a buffer of them), or an HWC uint8 array."""

    def read_many(self, positions: Sequence[int]) -> list:
        """Payloads of ``positions``; formats override this where runs of neighbours read faster together."""
        return [self.read(p) for p in positions]

    def read_copies(self, positions: Sequence[int], buf: Destinations = None) -> list:
        """Payloads of ``positions`` as ``read_many`` gives them, but in memory of their own, read from the files
        (``pread``) and never through a map: a thread decoding them can't die of SIGBUS when a shard is truncated
        meanwhile, and a file cut short is a PackerError here (``packer.ThreadLoader`` reads this way). ``buf``,
        where the format stores payloads as plain bytes: flat uint8 memory of at least their total size (the
        index's) to read them into one after the other, or one flat array per position of exactly its payload's
        size (``sample_memory``); formats that decode or inflate make their own. The default suits formats whose
        reads never map a file (bmp, compressed HDF5); formats that map override it."""
        return self.read_many(positions)

    def read_into(self, positions: Sequence[int], out: np.ndarray) -> None:
        """Copy the payloads of ``positions`` (any order; runs of ascending neighbours copy fastest) into ``out``
        (only where ``fixed_shape`` is set)."""
        raise PackerError(f"{type(self).__name__} has no fixed shape to copy batches into")

    def file_spans(self, positions: Sequence[int]) -> list[list[Span]]:
        """Per position, the byte ranges reading it touches (the sample's own bytes last), for read-ahead.

        The default: none known (empty lists); read-ahead then leaves the reading to ``read``.
        """
        return [[] for _ in positions]

    def cached(self, positions: Sequence[int]) -> np.ndarray:
        """Per position, True when every byte reading it touches is in the page cache (read-ahead would only copy
        it again). The default asks the kernel about the ranges ``file_spans`` gives (False where it gives none);
        formats that know a cheaper question override it."""
        return self._span_residency().each(self.file_spans(positions))

    def _span_residency(self) -> SpanResidency:
        """This reader's page-cache questions about ranges of its files, made on first use."""
        if self._residency is None:
            self._residency = SpanResidency()
        return self._residency

    def will_need(self, positions: Sequence[int]) -> None:
        """Ask the kernel for these samples' files at once (formats of one file per sample); default nothing."""

    def close(self) -> None:
        """Drop this process's open files and maps (overrides call this too). Also called when the reader is
        garbage-collected, in forked children too: close only what this process opened (``PerProcess.close``)."""
        if self._residency is not None:
            self._residency.close()

    def __del__(self) -> None:
        """A reader dropped unclosed gives its descriptors back, as a file object does (maps go with their views)."""
        try:
            self.close()
        except Exception:  # half made, or at interpreter exit: nothing to give back  # noqa: BLE001
            pass


@dataclass(frozen=True)
class Option:
    """A conversion option only one format takes; ``packer convert --NAME`` is generated from it."""

    name: str
    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    type: Callable[[str], Any] | None = None  # None: the text as given (argparse's default)


@dataclass(frozen=True, eq=False)
class Format:
    """What a format is; subclasses override the hooks (defaults: nothing to check, exact, one unit)."""

    name: str  # on the command line and in the manifest
    dataset_class: str  # the name of its dataset class (packer.LMDBDataset, ...)
    payloads: frozenset[str]  # "encoded" bytes and/or "raw" pixels
    Writer: Callable[..., ShardWriter]  # the class, or a function making one (hdf5: h5py imported on first use)
    Reader: Callable[..., ShardReader]
    default_shard_bytes: int | None = None  # the shard size cap it prefers (None: one shard)
    compressions: frozenset[str] = frozenset()  # --compression codecs it offers for raw payloads
    options: tuple[Option, ...] = field(default=())  # its own conversion options

    def check_options(self, options: Mapping) -> None:
        """Refuse bad format options before any work starts; default: nothing to check."""

    def implied_resize(self, options: Mapping) -> str | None:
        """A resize the format's own options imply (mosaic: ``--tile HxW``); default None."""
        return None

    def shard_multiple(self, options: Mapping) -> int:
        """Plan shards in whole units of this many samples (mosaic: tiles per mosaic); default 1."""
        return 1

    def error_bound(self, options: Mapping) -> tuple[float, int]:
        """(mean, max) absolute pixel error a reader may show; (0, 0): exact (the default)."""
        return 0.0, 0

    def block_boundaries(self, manifest: Manifest) -> np.ndarray | None:
        """The format's natural blocks for the block sampler (starts, then N); default None (by bytes)."""
        return None


class BlobIndex:
    """What a shard writer records per sample as it adds them (blob layouts: hdf5, memmap, n5, pth): each
    payload's end offset, its (H, W, 3) for raw payloads, its label; ``add`` runs ``check_addition`` first."""

    def __init__(self, where: object, planned: int, payload: str, shape: tuple | None) -> None:
        self.where, self.planned, self.payload, self.shape = where, planned, payload, shape
        self.count = 0
        self.offsets = np.zeros(planned + 1, dtype="<i8")
        self.labels = np.zeros(planned, dtype="<i8")
        self.shapes = np.zeros((planned, 3), dtype="<i8")

    def add(self, sample: PreparedSample) -> None:
        check_addition(self.where, self.count, self.planned, sample, self.shape)
        if isinstance(sample.payload, np.ndarray):
            self.shapes[self.count] = sample.payload.shape
        self.labels[self.count] = sample.label
        self.count += 1
        self.offsets[self.count] = self.offsets[self.count - 1] + sample.nbytes


def check_addition(path, count: int, planned: int, sample: PreparedSample, shape: tuple | None) -> None:
    """A shard writer's checks before storing ``sample``: room in the plan, and the dataset's fixed shape if any."""
    if count >= planned:
        raise PackerError(f"{path}: more samples than the {planned} planned for this shard")
    got = sample.payload.shape if isinstance(sample.payload, np.ndarray) else None
    if shape is not None and got != shape:
        raise PackerError(f"{sample.rel_path}: shape {got} differs from the dataset's {shape}")


def pread_ranges(fd: int, starts: Sequence[int], ends: Sequence[int], buf: Destinations, path: object,
                 expected: int, owners: Sequence[int] | None = None, count: int | None = None,
                 mapped: tuple[np.ndarray, int] | None = None) -> list[np.ndarray]:
    """Bytes ``[starts[k], ends[k])`` of the open file ``fd`` (of ``expected`` bytes, per the manifest), one flat array
    per range, or per sample where ``owners`` (ascending) says whose piece each range is (``count`` samples: a
    sample's pieces joined, none: empty), in the memory ``buf`` gives (``sample_memory``). Copied from the
    reader's map (``mapped``: a flat uint8 array of the file from byte ``mapped[1]``) under the SIGBUS guard of
    ``safecopy`` where it is built, else read with ``pread`` (ranges that follow each other in the file by one
    call). A file cut short is ``check_size``'s PackerError, never a fault."""
    dests, views = sample_memory([b - a for a, b in zip(starts, ends, strict=True)], owners, count, buf, path)
    if mapped is not None and safecopy.available():
        arr, at = mapped
        if all(at <= a and b - at <= len(arr) for a, b in zip(starts, ends)):
            failed = safecopy.copy([v.data for v in views], [arr[a - at : b - at].data for a, b in zip(starts, ends)])
            if failed >= 0:
                check_size(fd, expected, path)
                raise PackerError(f"{path}: bytes {starts[failed]} to {ends[failed]} could not be read (an I/O error, "
                                  "or the file changed in place); reopen the dataset")
            return dests
    elif mapped is not None:
        safecopy.notice_missing()  # once per process: the pread below is the slower way
    k = 0
    while k < len(views):
        run = k + 1
        while run < len(views) and starts[run] == ends[run - 1] and run - k < _IOV_MAX:
            run += 1
        pread_exactly(fd, [v.data for v in views[k:run]], starts[k], path, expected)
        k = run
    return dests


_IOV_MAX = 1024  # buffers one preadv call takes (Linux's IOV_MAX)


def sample_memory(sizes: Sequence[int], owners: Sequence[int] | None, count: int | None, buf: Destinations,
                  path: object) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(per sample its flat uint8 memory, per piece its part of it) for pieces of ``sizes`` bytes, ``owners[k]``
    the sample of piece k (ascending; None: one piece each). The samples' memory: consecutive parts of ``buf``
    where it is a flat array large enough; ``buf``'s own arrays where it gives one per sample, each of exactly
    that sample's size (a batch slot: raw pixels read straight into it); else new memory."""
    if min(sizes, default=0) < 0:
        raise PackerError(f"{path}: a sample's bytes end before they start (damaged dataset)")
    owner = np.arange(len(sizes)) if owners is None else np.asarray(owners, dtype=np.int64)
    n = len(sizes) if count is None else count
    bounds = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
    first = bounds[np.searchsorted(owner, np.arange(n), side="left")]
    last = bounds[np.searchsorted(owner, np.arange(n), side="right")]
    if isinstance(buf, np.ndarray) or buf is None or len(buf) != n or any(
            d.dtype != np.uint8 or d.ndim != 1 or not d.flags.c_contiguous or d.nbytes != b - a
            for d, a, b in zip(buf, first.tolist(), last.tolist())):
        flat = buf if isinstance(buf, np.ndarray) and buf.nbytes >= bounds[-1] else np.empty(int(bounds[-1]), np.uint8)
        dests = [flat[a:b] for a, b in zip(first.tolist(), last.tolist())]
    else:
        dests = list(buf)
    at = (bounds[:-1] - first[owner]).tolist()  # each piece's place in its sample
    views = [dests[o][a : a + size] for o, a, size in zip(owner.tolist(), at, sizes)]
    return dests, views


def pread_exactly(fd: int, views: list[memoryview], offset: int, path: object, expected: int) -> None:
    """Fill ``views``, in order, with the bytes of ``fd`` from ``offset`` (see ``pread_ranges``)."""
    views = [v for v in views if len(v)]
    while views:
        n = os.preadv(fd, views, offset)
        if n == 0:  # the end of the file: cut short since it was checked
            check_size(fd, expected, path)
            raise PackerError(f"{path}: ends at byte {offset}, inside a sample (damaged dataset)")
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def contiguous_runs(positions: list[int]) -> list[tuple[int, int]]:
    """Split positions into (start, stop) runs of consecutive values, in the order given."""
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and p == runs[-1][1]:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs


def split_ranges(a: np.ndarray | Sequence[int], b: np.ndarray | Sequence[int], size: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Byte ranges [a[k], b[k]) cut where blocks of ``size`` bytes meet (HDF5 chunks, N5 blocks), all at once: per
    piece, its block, its start and end within that block, and its k (an empty range has none), in order."""
    a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    first = a // size
    counts = np.where(b > a, (b - 1) // size - first + 1, 0)
    owners = np.repeat(np.arange(len(a)), counts)
    blocks = first[owners] + np.arange(len(owners)) - np.repeat(np.cumsum(counts) - counts, counts)
    lo, hi = np.maximum(a[owners], blocks * size) - blocks * size, np.minimum(b[owners], (blocks + 1) * size)
    return blocks, lo, hi - blocks * size, owners


def joined(pieces: Sequence[np.ndarray]) -> np.ndarray:
    """A sample's pieces from several chunks or block files, joined into a copy read-only like every other sample."""
    out = np.concatenate(pieces)
    out.flags.writeable = False
    return out


def fixed_shape(payload: str, options: Mapping) -> tuple[int, int, int] | None:
    """(H, W, 3) every sample of a raw payload will have, known before writing; else None.

    Only ``--resize HxW`` promises one shape in advance (short-side resizing and untouched
    sources vary), so that is when formats choose a fixed-shape ``(N, H, W, 3)`` layout.
    """
    if payload != "raw":
        return None
    spec = ResizeSpec.parse(options.get("resize"), options.get("resize_mode", "stretch"),
                            bool(options.get("upscale", False)))
    return None if spec is None or spec.fixed_shape is None else (*spec.fixed_shape, 3)


def check_offsets(offsets: np.ndarray, num_samples: int, total: int, where: object) -> None:
    """Offsets ``[N+1]`` must start at 0, never decrease and end at the blob's size."""
    if offsets.ndim != 1 or len(offsets) != num_samples + 1:
        raise DatasetError(f"{where}: {len(offsets)} offsets for {num_samples} samples (expected N+1)")
    if offsets[0] != 0 or offsets[-1] != total or np.any(np.diff(offsets) < 0):
        raise DatasetError(f"{where}: offsets do not describe the {total} bytes of image data")


def sample_view(data: np.ndarray, offsets: np.ndarray | None, shapes: np.ndarray | None, pos: int
                ) -> np.ndarray | memoryview:
    """``sample_views`` of one position (no batch arrays made)."""
    if offsets is None:
        return data[pos]
    view = data[offsets[pos] : offsets[pos + 1]]
    return view.data if shapes is None else view.reshape(shapes[pos])


def sample_views(data: np.ndarray, offsets: np.ndarray | None, shapes: np.ndarray | None,
                 positions: Sequence[int]) -> list:
    """Zero-copy views of the samples at ``positions`` of a mapped array: rows of a fixed-shape ``data``, else
    memoryviews of bytes ``[offsets[p], offsets[p + 1])`` of a flat one, shaped (H, W, 3) by ``shapes`` (raw).
    Bounds are looked up for the whole batch at once, not per sample in Python (docs/results.md)."""
    if offsets is None:
        return list(map(data.__getitem__, positions))
    pos = np.asarray(positions, dtype=np.int64)
    bounds = zip(offsets[pos].tolist(), offsets[pos + 1].tolist())
    if shapes is None:
        whole = data.data  # one memoryview of the map: its slices are memoryviews, as ``data[a:b].data`` was
        return [whole[a:b] for a, b in bounds]
    return [data[a:b].reshape(shape) for (a, b), shape in zip(bounds, shapes[pos].tolist())]


def copy_runs(source, positions: list[int], out: np.ndarray) -> None:
    """Copy ``source[p]`` for ascending ``positions`` into ``out[0:len]``: one slice copy per run of neighbours.

    ``source`` is anything sliceable along its first axis (a numpy memmap, an h5py dataset);
    a slice per run beats per-sample reads and h5py's fancy indexing by far.
    """
    k = 0
    for start, stop in contiguous_runs(list(positions)):
        out[k : k + stop - start] = source[start:stop]
        k += stop - start


def shard_layout(facts: dict, where: object) -> tuple[int, int, int] | None:
    """The shard's (H, W, 3) from its manifest facts for the ``fixed`` layout, None for ``blob``."""
    layout = facts.get("layout")
    if layout == "blob":
        return None
    shape = facts.get("shape")
    if layout != "fixed" or not isinstance(shape, list) or len(shape) != 3 or shape[2] != 3 or not all(
            isinstance(v, int) and v > 0 for v in shape):
        raise DatasetError(f"{where}: manifest describes an unknown shard layout {layout!r} (shape {shape!r})")
    return (shape[0], shape[1], 3)
