"""Map-style PyTorch datasets over packed datasets: a drop-in for torchvision's ImageFolder.

``open_dataset(path)`` returns ``(image, label)`` samples with ImageFolder's attributes (packer.read.surface), and
``ds[i]`` is ImageFolder's sample i whatever order the samples are stored in (packer.read.indexing). A dataset is
that surface plus one ``BatchPipeline`` (packer.read.pipeline) over a source: its shards (packer.read.store), or
one shared copy in RAM (``cache=``, packer.read.cache). Shard readers open their files lazily in each process, so
a dataset is safe to hand to ``DataLoader(num_workers>0)`` under fork and spawn alike.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, overload

import numpy as np
import torch
from torch.utils.data._utils.collate import default_collate

from packer import sysinfo
from packer.errors import DatasetError, OptionError, PackerError
from packer.formats import FORMATS, get_format
from packer.images.crop import CropDecode
from packer.layout.manifest import read_manifest
from packer.read.batch import BatchView, Layout, get_batch
from packer.read.cache import CACHE_MODES, RamCache
from packer.read.collate import mark_mixed_shapes
from packer.read.decoding import Decoding
from packer.read.fields import FieldsArg, FieldSelection
from packer.read.hints import aheads_of
from packer.read.indexing import IndexMap
from packer.read.pipeline import BatchPipeline
from packer.read.present import ImageKind, Presenter
from packer.read.readahead import Pending
from packer.read.slots import WorkerMemory
from packer.read.source import SampleSource
from packer.read.store import Access, LocalFiles, ShardFiles, ShardStore
from packer.read.surface import FolderSurface
from packer.storage.url import is_url, parse
from packer.units import human_bytes

FILE_SOURCES = ("", "folder", "list")  # source types whose records are files below the recorded source folder
CacheMode = Literal["ram", "ram-decoded"]
RemoteMode = Literal["auto", "ranged", "shard"]  # how a URL is read (packer.read.ranged, packer.read.remote)
REMOTE_MODES = ("auto", "ranged", "shard")


class PackedDataset(FolderSurface):
    """A packed dataset of any format, read as ``(image, label)`` pairs like ImageFolder: ``ds[i]`` is ImageFolder's
    sample ``i`` of the converted source, whatever order the samples are stored in; ``classes``, ``class_to_idx``,
    ``targets`` and ``samples`` are ImageFolder's too. Its arguments are ``open_dataset``'s keywords."""

    FORMAT: ClassVar[str | None] = None  # set by the per-format subclasses (LMDBDataset, ...): opens that format only

    def __init__(self, path: str | os.PathLike, transform: Callable | None = None,
                 target_transform: Callable | None = None, image: ImageKind = "pil", decoder: str = "auto",
                 access: Access = "auto", decode_size: int | None = None, source_root: str | os.PathLike | None = None,
                 crop: CropDecode | None = None, fields: FieldsArg = None, shard_files: ShardFiles | None = None
                 ) -> None:
        """Open the dataset at ``path`` (its arguments: see the class docstring); no shard file is opened yet."""
        at = LocalFiles.at(path, type(self).__name__) if shard_files is None else shard_files  # a URL refused
        self.root, self.store = at.root, ShardStore(at.root, access, at)  # absolute: os.chdir, workers, pickles
        self.manifest, self.index, self.access = self.store.manifest, self.store.index, self.store.access
        if self.FORMAT is not None and self.manifest.format != self.FORMAT:
            raise OptionError(f"{self.root}: holds format {self.manifest.format!r}, not {self.FORMAT!r} "
                              "(use packer.open_dataset to open any format)")
        self.index_map = IndexMap.of(self.index, self.manifest)
        self.field_store = self.store.fields
        selection = FieldSelection(fields, self.field_store, self.root, self.has_images, transform, crop)
        # samples are file paths where the source was files below a folder (a folder, a list file's --root);
        # the records of an archive, WebDataset, Hugging Face, RecordIO or packer source are named by key only
        files = self.manifest.source_type in FILE_SOURCES
        recorded = self.manifest.source if files and os.path.isabs(self.manifest.source) else None
        self._warned_relative = not files  # keys are not paths to warn about
        self.source_root = os.path.abspath(source_root) if source_root is not None else recorded
        self.presenter = Presenter(image, transform, target_transform, selection, self.field_store,
                                   self.index, str(self.root))
        decoding = Decoding(self.index, self.index_map, str(self.root), decoder, decode_size, crop)
        self.source: SampleSource = self.store
        self.pipeline = BatchPipeline(self.store, decoding, self.presenter, self.index_map)
        self.classes: list[str] = list(self.manifest.classes)
        self.class_to_idx: dict[str, int] = {c: i for i, c in enumerate(self.classes)}
        self.warn_if_subset(stacklevel=2)  # ds[i] is not ImageFolder(source)[i]: said once, when opened

    decoder = property(lambda self: self.pipeline.decoding.decoder, doc="The JPEG decoder (``open_dataset``'s).")
    decode_size = property(lambda self: self.pipeline.decoding.decode_size, doc="``open_dataset``'s decode_size.")
    crop = property(lambda self: self.pipeline.decoding.crop, doc="The fused decode + crop, or None.")

    def __repr__(self) -> str:
        m = self.manifest
        return (f"{type(self).__name__}({self.store.files.name!r}, format={m.format}, payload={m.payload}, "
                f"samples={len(self)}, classes={len(self.classes)}, image={self.image}, indexing={self.indexing})")

    # ------------------------------------------------------------ samples and batches: all through the pipeline

    def __getitem__(self, i: int) -> Any:
        return self.pipeline.one(i)

    def __getitems__(self, indices: Sequence[int]) -> list:
        """A DataLoader's batch: read ahead in file order, each chunk decoded as its bytes come in, into one shared
        block inside a worker where sizes differ (packer.read.slots)."""
        return mark_mixed_shapes(self.pipeline.load(indices, WorkerMemory()))  # default_collate names packer.collate

    def get_batch(self, indices: Sequence[int], layout: Layout = "NHWC", sort: bool = False,
                  out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``indices`` as one uint8 image tensor and an int64 label tensor (``packer.read.batch.get_batch``)."""
        return get_batch(self.pipeline, indices, layout, sort, out, self.fixed_shape)

    def batched(self, layout: Layout = "NHWC") -> BatchView:
        """A dataset whose items are whole batches, for ``DataLoader(sampler=BatchSampler(...), batch_size=None)``."""
        return BatchView(self, layout)

    def collate(self, fn: Callable = default_collate) -> Callable:
        """``fn`` as a DataLoader's ``collate_fn`` over this dataset: timed as the collate stage where
        ``packer.instrument`` attached a clock."""
        return fn if self.pipeline.clock is None else self.pipeline.clock.collate(fn)

    # ------------------------------------------------------------ reading, by public index

    def read_payload(self, i: int) -> Any:
        """The stored payload of sample ``i``: encoded bytes, or raw pixel bytes/array."""
        return self.payload_at(self.position(i))

    def read_payloads(self, indices: Sequence[int] | np.ndarray) -> list:
        """Payloads of many samples, returned in the order asked (read ahead in file order)."""
        return self.payloads_at(self.positions(indices), aheads_of(indices))

    def read_ahead(self, indices: Sequence[int]) -> Pending:
        """Start reading these samples' bytes in the background, in file order; returns at once. ``wait(k)`` on the
        result returns when the ``k``-th sample in file order (``sorted(ds.positions(indices))``) is in memory."""
        return self.source.start(self.positions(indices), aheads_of(indices), skip_cached=False)

    def pixels(self, i: int, payload: Any = None, strict: bool = False, out: np.ndarray | None = None) -> np.ndarray:
        """Sample ``i`` as HWC uint8 RGB (``payload``: its stored payload, read already). ``strict``: a decoder
        warning (e.g. a truncated JPEG, which Pillow pads with grey) is an error too, as in ``packer verify --deep``."""
        if not self.has_images:
            raise PackerError(f"{self.manifest.source or 'this dataset'}: its samples have no image (fields and "
                              "labels only: ds[i] is (fields, label))")
        return self.pixels_at(self.position(i), payload, strict, out)

    # ------------------------------------------------------------ reading, by storage position (tools, bench)

    def payload_at(self, pos: int) -> Any:
        """The stored payload at storage position ``pos``, checked against the index."""
        return self.source.payloads([pos])[0]

    def payloads_at(self, stored: Sequence[int] | np.ndarray, ahead: Sequence = (), pending: Pending | None = None,
                    into: Callable[[int], np.ndarray] | None = None,
                    places: Sequence[np.ndarray | None] | None = None) -> list:
        """Payloads at these storage positions, read ahead in file order (``pending``: started already), returned in
        the order asked (``into``/``places``: ``SampleSource.payloads``')."""
        idx = np.asarray(stored, dtype=np.int64)
        if not len(idx):
            return []
        return self.source.payloads(idx, self.source.start(idx, ahead) if pending is None else pending, into, places)

    def pixels_at(self, pos: int, payload: Any = None, strict: bool = False, out: np.ndarray | None = None
                  ) -> np.ndarray:
        """The sample stored at ``pos`` as HWC uint8 RGB (``strict``: see ``pixels``)."""
        payload = self.payload_at(pos) if payload is None else payload
        return self.pipeline.decoding.pixels(pos, payload, self.source.payload, strict, out)

    def locate(self, i: int) -> tuple[int, int]:
        """(shard number, position inside that shard) of sample ``i``."""
        return self.store.locate(self.position(i))

    @property
    def fixed_shape(self) -> tuple[int, int, int] | None:
        """(H, W, 3) when every shard stores one shape its reader copies in bulk, else None."""
        return self.store.fixed_shape

    def block_boundaries(self) -> np.ndarray | None:
        """Storage positions where the format's natural blocks start (mosaic: one per mosaic), then len(self);
        None for formats without any (the block sampler then makes blocks by bytes)."""
        return get_format(self.manifest.format).block_boundaries(self.manifest)

    def follow(self, stored: np.ndarray, indices: Iterator[int], start: int) -> Iterator[int]:
        """A sampler's pass (storage positions ``stored``, from ``start``): the source may fetch ahead along it
        (a URL's; not when the samples come from a RAM cache)."""
        return self.source.follow(stored, indices, start)

    def close(self) -> None:
        self.source.close()
        self.store.close()


class CachedDataset(PackedDataset):
    """A packed dataset read from one copy in shared memory that every DataLoader worker maps (packer.read.cache);
    ``open_dataset(p, cache=...)`` makes one. ``dataset``'s settings and ImageFolder surface are its own.

    Args:
        dataset: a packer dataset (``open_dataset``): its transforms, image kind and decoder stay in use.
        mode: ``"ram"`` caches the stored payloads (no more IO, still decoded per sample), ``"ram-decoded"``
            the decoded pixels (no decoding either, several times larger).
        workers: processes that decode while filling a ``"ram-decoded"`` cache (default: all cores).
        progress: a progress bar while filling: None (default) when stderr is a terminal, True, False.
        shm_dir: the shared-memory folder (a tmpfs; default ``/dev/shm``): it must hold the whole copy.
    """

    cache: RamCache  # the source it reads from

    def __init__(self, dataset: PackedDataset, mode: str = "ram", *, workers: int | None = None,
                 progress: bool | None = None, shm_dir: str | os.PathLike = sysinfo.SHM_DIR) -> None:
        if mode not in CACHE_MODES:
            raise OptionError(f"unknown cache {mode!r} (choose {' or '.join(CACHE_MODES)})")
        _read_from(self, dataset, lambda: RamCache(dataset.store, mode, dataset.pipeline.decoding, workers=workers,
                                                   progress=progress, shm_dir=shm_dir))

    @classmethod
    def attach(cls, dataset: PackedDataset, path: str | os.PathLike, timeout: float = 600.0) -> CachedDataset:
        """Map a cache another process (e.g. local rank 0) created for the same dataset; waits until it is filled."""
        self = cls.__new__(cls)
        _read_from(self, dataset, lambda: RamCache.attach(dataset.store, path, timeout))
        return self

    @property
    def path(self) -> Path:
        """The cache file (in ``shm_dir``)."""
        return self.cache.path

    def __repr__(self) -> str:
        return (f"{super().__repr__()[:-1]}, cache={self.cache.mode!r}, {human_bytes(self.cache.total_bytes)} "
                f"in {self.cache.path})")


def _read_from(cached: CachedDataset, dataset: PackedDataset, make: Callable[[], RamCache]) -> None:
    """``cached`` as ``dataset`` (its settings, surface and shard store shared), reading from the RAM cache ``make``
    returns."""
    if not isinstance(dataset, PackedDataset):
        raise OptionError(f"the RAM cache works on packer datasets (open_dataset), not {type(dataset).__name__}")
    vars(cached).update(vars(dataset))
    cached.source = cached.cache = make()
    cached.pipeline = BatchPipeline(cached.source, dataset.pipeline.decoding, dataset.presenter, dataset.index_map)


# help()'s explanation of every argument, kept outside the class body (the class stays small to read)
PackedDataset.__doc__ = f"""{PackedDataset.__doc__}

    Args:
        path: the dataset directory ``packer convert`` or ``packer.Writer`` made.
        transform: called on each image (as ``image`` gives it), as ImageFolder's ``transform``.
        target_transform: called on each label (an int), as ImageFolder's ``target_transform``.
        image: what an image is: ``"pil"`` (a PIL RGB image, ImageFolder's), ``"numpy"`` (an HWC uint8
            array) or ``"tensor"`` (a CHW uint8 tensor; batch mixed sizes with ``collate_fn=packer.collate``).
        decoder: the JPEG decoder: ``"auto"`` (libjpeg-turbo where it loads, else Pillow), ``"turbojpeg"``
            or ``"pil"``.
        access: ``"sequential"`` reads ahead in file order (sequential and block-shuffled passes),
            ``"random"`` does not (uniform shuffles over data larger than RAM); ``"auto"``: sequential
            unless the dataset's files exceed half the free memory.
        decode_size: decode JPEGs at the smallest DCT scale that keeps the short side >= this many pixels
            (lossy, faster; 224 does nothing on 500x375 photos); None: full size.
        source_root: where the converted folder is now (``samples`` join it with each relative path);
            None: the folder the manifest records.
        crop: a fused decode + crop + resize (``packer.RandomResizedCropDecode``, ``packer.CenterCropDecode``;
            docs/decoding.md): only the pixels the crop keeps are decoded.
        fields: what a sample holds (docs/fields.md): None for ``(image, label)``, a sequence of names for
            a tuple in that order (e.g. ``("image", "label", "boxes")``), ``"all"`` for a dict of every field.
        shard_files: where the shard files come from (``packer.read.store.ShardFiles``): None for the folder ``path``;
            ``open_dataset`` of a URL passes its remote shards (``packer.read.remote.RemoteShards``).

    Raises:
        InputNotFoundError: ``path`` is not a packed dataset (a ``FileNotFoundError``).
        DatasetError: the dataset fails its checks (damaged or replaced files).
        OptionError: an argument out of its choices (a ``ValueError``).
"""


# The built-in formats' dataset classes: PackedDataset that opens one format only (pickled by reference).
class BMPDataset(PackedDataset):
    """A packed dataset of format 'bmp' only (see PackedDataset)."""

    FORMAT = 'bmp'


class HDF5Dataset(PackedDataset):
    """A packed dataset of format 'hdf5' only (see PackedDataset)."""

    FORMAT = 'hdf5'


class LMDBDataset(PackedDataset):
    """A packed dataset of format 'lmdb' only (see PackedDataset)."""

    FORMAT = 'lmdb'


class MemmapDataset(PackedDataset):
    """A packed dataset of format 'memmap' only (see PackedDataset)."""

    FORMAT = 'memmap'


class MosaicDataset(PackedDataset):
    """A packed dataset of format 'mosaic' only (see PackedDataset)."""

    FORMAT = 'mosaic'


class N5Dataset(PackedDataset):
    """A packed dataset of format 'n5' only (see PackedDataset)."""

    FORMAT = 'n5'


class PthDataset(PackedDataset):
    """A packed dataset of format 'pth' only (see PackedDataset)."""

    FORMAT = 'pth'


class RecordIODataset(PackedDataset):
    """A packed dataset of format 'recordio' only (see PackedDataset)."""

    FORMAT = 'recordio'


class SafetensorsDataset(PackedDataset):
    """A packed dataset of format 'safetensors' only (see PackedDataset)."""

    FORMAT = 'safetensors'


# format name -> its dataset class; a format registered later (a plug-in) is opened as a PackedDataset
DATASET_CLASSES: dict[str, type[PackedDataset]] = {
    "bmp": BMPDataset, "hdf5": HDF5Dataset, "lmdb": LMDBDataset, "memmap": MemmapDataset, "mosaic": MosaicDataset,
    "n5": N5Dataset, "pth": PthDataset, "recordio": RecordIODataset, "safetensors": SafetensorsDataset}


@overload
def open_dataset(path: str | os.PathLike, cache: None = None, cache_options: Mapping[str, Any] | None = None, *,
                 transform: Callable | None = None, target_transform: Callable | None = None, image: ImageKind = "pil",
                 decoder: str = "auto", access: Access = "auto", decode_size: int | None = None,
                 source_root: str | os.PathLike | None = None, crop: CropDecode | None = None,
                 fields: FieldsArg = None, cache_dir: str | os.PathLike | None = None,
                 cache_limit: int | str | None = "20GB", storage_options: Mapping[str, Any] | None = None,
                 remote_mode: RemoteMode = "auto") -> PackedDataset: ...


@overload
def open_dataset(path: str | os.PathLike, cache: CacheMode, cache_options: Mapping[str, Any] | None = None, *,
                 transform: Callable | None = None, target_transform: Callable | None = None, image: ImageKind = "pil",
                 decoder: str = "auto", access: Access = "auto", decode_size: int | None = None,
                 source_root: str | os.PathLike | None = None, crop: CropDecode | None = None,
                 fields: FieldsArg = None, cache_dir: str | os.PathLike | None = None,
                 cache_limit: int | str | None = "20GB", storage_options: Mapping[str, Any] | None = None,
                 remote_mode: RemoteMode = "auto") -> CachedDataset: ...


def open_dataset(path: str | os.PathLike, cache: CacheMode | None = None,
                 cache_options: Mapping[str, Any] | None = None, *,
                 transform: Callable | None = None, target_transform: Callable | None = None, image: ImageKind = "pil",
                 decoder: str = "auto", access: Access = "auto", decode_size: int | None = None,
                 source_root: str | os.PathLike | None = None, crop: CropDecode | None = None,
                 fields: FieldsArg = None, cache_dir: str | os.PathLike | None = None,
                 cache_limit: int | str | None = "20GB", storage_options: Mapping[str, Any] | None = None,
                 remote_mode: RemoteMode = "auto") -> PackedDataset | CachedDataset:
    """Open a packed dataset of any format as a map-style PyTorch dataset (ImageFolder's samples and indices).

    ``with open_dataset(p) as ds:`` closes its shard files at the end.

    Args:
        path: the dataset directory (made by ``packer convert`` or ``packer.Writer``), or its URL (``s3://``,
            ``gs://``, ``az://``, ``http(s)://``, ``file://``): read through ``cache_dir`` as ``remote_mode`` says
            (docs/remote.md).
        cache: None reads the shard files; ``"ram"`` (the stored payloads) or ``"ram-decoded"`` (decoded
            pixels) returns a ``packer.CachedDataset``: one copy in shared memory for all DataLoader workers.
        cache_options: keyword arguments of ``packer.CachedDataset`` (``workers``, ``progress``, ``shm_dir``).
        transform: called on each image, as ImageFolder's ``transform``.
        target_transform: called on each label, as ImageFolder's ``target_transform``.
        image: ``"pil"`` (PIL images, ImageFolder's), ``"numpy"`` (HWC uint8 arrays) or ``"tensor"`` (CHW
            uint8 tensors).
        decoder: the JPEG decoder: ``"auto"`` (libjpeg-turbo where it loads, else Pillow), ``"turbojpeg"``, ``"pil"``.
        access: ``"sequential"`` (read ahead in file order), ``"random"`` (no read-ahead) or ``"auto"``
            (sequential unless the files exceed half the free memory).
        decode_size: decode JPEGs at the smallest DCT scale that keeps the short side >= this (lossy); None: full.
        source_root: where the converted folder is now, for ``samples``; None: the one the manifest records.
        crop: a fused decode + crop + resize (``packer.RandomResizedCropDecode``, ``packer.CenterCropDecode``).
        fields: what a sample holds: None for ``(image, label)``, names for a tuple, ``"all"`` for a dict
            (docs/fields.md).
        cache_dir: a URL's node-wide cache (default ``~/.cache/packer``); a node-local disk.
        cache_limit: the disk the cache may use ("20GB"; None: no bound of this job's).
        storage_options: a URL's credentials and client options (``endpoint``, ``region``, ...).
        remote_mode: how a URL is read: ``"ranged"`` (each batch's payloads by large ranged GETs of neighbouring
            samples, checked against the CRC-32 each sample's conversion recorded), ``"shard"`` (each shard
            fetched whole, checked against its sha256), ``"auto"`` (ranged where the conversion recorded
            payload ranges, else shard). docs/remote.md.

    Returns:
        The format's ``PackedDataset`` subclass (``LMDBDataset``, ...), or a ``CachedDataset`` with ``cache``.

    Raises:
        InputNotFoundError: ``path`` is not a packed dataset (a ``FileNotFoundError``).
        DatasetError: the dataset fails its checks.
        OptionError: an argument out of its choices (a ``ValueError``).
    """
    if cache == "ram-decoded" and crop is not None:
        raise OptionError("crop= with cache='ram-decoded' would keep one crop per sample for ever: use cache='ram'")
    if cache is not None and cache not in CACHE_MODES:
        raise OptionError(f"unknown cache {cache!r} (choose {' or '.join(CACHE_MODES)})")
    if remote_mode not in REMOTE_MODES:
        raise OptionError(f"unknown remote_mode {remote_mode!r} (choose {', '.join(REMOTE_MODES)})")
    files = _remote_files(path, cache_dir, cache_limit, storage_options)  # None: a path or a file:// URL
    try:
        path = parse(path).path if files is None else files.root
        fmt = read_manifest(path).format if files is None else files.open()[0].format
        if fmt not in FORMATS:
            where = path if files is None else files.name
            raise DatasetError(f"{where}: format {fmt!r} is unknown to this packer ({', '.join(FORMATS)})")
        ds = DATASET_CLASSES.get(fmt, PackedDataset)(
            path, transform=transform, target_transform=target_transform, image=image, decoder=decoder,
            access=access, decode_size=decode_size, source_root=source_root, crop=crop, fields=fields,
            shard_files=files)
        if files is not None:
            _read_ranged(ds, files, remote_mode)
    except BaseException:
        if files is not None:
            files.close()
        raise
    if cache is None:
        return ds
    try:
        return CachedDataset(ds, cache, **dict(cache_options or {}))
    except BaseException:
        ds.close()  # a URL's connection to the node's downloader too
        raise


def _read_ranged(ds: PackedDataset, files: ShardFiles, mode: RemoteMode) -> None:
    """``ds`` (a URL's, ``files``) reading in ranged mode where ``mode`` and its metadata say so (its pipeline's
    decoding and presenter kept); else in whole-shard mode, as opened."""
    from packer.read.ranged import ranged_source

    source = ranged_source(files, mode)
    if source is not None:
        ds.source = source
        ds.pipeline = BatchPipeline(source, ds.pipeline.decoding, ds.presenter, ds.index_map)


def _remote_files(path: str | os.PathLike, cache_dir: str | os.PathLike | None, cache_limit: int | str | None,
                  storage_options: Mapping[str, Any] | None) -> ShardFiles | None:
    """A URL's shard files (packer.read.remote), or None for a local path or ``file://`` URL."""
    if not is_url(path) or parse(path).is_local:
        return None
    from packer.read.remote import open_remote

    return open_remote(str(path), cache_dir, cache_limit, storage_options)
