"""Map-style PyTorch datasets over packed datasets: a drop-in for torchvision's ImageFolder.

``open_dataset(path)`` returns ``(image, label)`` samples with ``classes``, ``class_to_idx``,
``targets``, ``samples`` and ``transform`` as ImageFolder has them (packer.read.surface), and
``ds[i]`` is ImageFolder's sample i whatever order the samples are stored in
(packer.read.indexing). Shard readers open their
files lazily in each process, so the dataset is safe to hand to ``DataLoader(num_workers>0)``
under fork and spawn alike. ``__getitems__`` lets a DataLoader read a batch in one call, with
runs of neighbouring samples read together.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal, cast, overload

import numpy as np
import torch
from PIL import Image

from packer.errors import DatasetError, OptionError, PackerError
from packer.formats import FORMATS, get_format
from packer.formats.base import Destinations, Format
from packer.images.crop import CropDecode, Window, check_crop
from packer.images.decode import BACKENDS, DecodeError, check_min_size, copy_into, decode
from packer.images.headers import check_size, image_size
from packer.layout.manifest import read_manifest
from packer.layout.trust import DATA_ERRORS, reading
from packer.read import batch, readahead
from packer.read.fields import FieldsArg, FieldSelection
from packer.read.hints import Ahead, aheads_of
from packer.read.indexing import IndexMap
from packer.read.store import Access, LocalFiles, ShardFiles, ShardStore
from packer.read.surface import FolderSurface
from packer.storage.url import is_url, parse

if TYPE_CHECKING:
    from packer.read.cache import CachedDataset

ImageKind = Literal["pil", "numpy", "tensor"]


FILE_SOURCES = ("", "folder", "list")  # source types whose records are files below the recorded source folder


class PackedDataset(FolderSurface):
    """A packed dataset of any format, read as ``(image, label)`` pairs like ImageFolder: ``ds[i]`` is ImageFolder's
    sample ``i`` of the converted source, whatever order the samples are stored in; ``classes``, ``class_to_idx``,
    ``targets`` and ``samples`` are ImageFolder's too. Its arguments are ``open_dataset``'s keywords."""

    FORMAT: str | None = None  # set by the per-format subclasses (LMDBDataset, ...)

    def __init__(
        self,
        path: str | os.PathLike,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        image: ImageKind = "pil",
        decoder: str = "auto",
        access: Access = "auto",
        decode_size: int | None = None,
        source_root: str | os.PathLike | None = None,
        crop: CropDecode | None = None,
        fields: FieldsArg = None,
        shard_files: ShardFiles | None = None,
    ) -> None:
        """Open the dataset at ``path`` (its arguments: see the class docstring); no shard file is opened yet."""
        at = LocalFiles.at(path, type(self).__name__) if shard_files is None else shard_files  # a URL refused
        self.root, self.store = at.root, ShardStore(at.root, access, at)  # absolute: os.chdir, workers, pickles
        self.manifest, self.index, self.access = self.store.manifest, self.store.index, self.store.access
        self.index_map = IndexMap.of(self.index, self.manifest)
        self.field_store = self.store.fields
        self.selection = FieldSelection(fields, self.field_store, self.root, self.has_images, transform, crop)
        # samples are file paths where the source was files below a folder (a folder, a list file's --root);
        # the records of an archive, WebDataset, Hugging Face, RecordIO or packer source are named by key only
        files = self.manifest.source_type in FILE_SOURCES
        recorded = self.manifest.source if files and os.path.isabs(self.manifest.source) else None
        self._warned_relative = not files  # keys are not paths to warn about
        self.source_root = os.path.abspath(source_root) if source_root is not None else recorded
        if self.FORMAT is not None and self.manifest.format != self.FORMAT:
            raise OptionError(
                f"{self.root}: holds format {self.manifest.format!r}, not {self.FORMAT!r} "
                f"(use packer.open_dataset to open any format)"
            )
        if image not in ("pil", "numpy", "tensor"):
            raise OptionError(f"unknown image kind {image!r} (choose pil, numpy or tensor)")
        if decoder not in BACKENDS:
            raise OptionError(f"unknown decoder {decoder!r} (choose from {', '.join(BACKENDS)})")
        self.transform = transform
        self.target_transform = target_transform
        self.image = image
        self.decoder = decoder
        self.decode_size = check_min_size(decode_size)
        self.crop = check_crop(crop, self.decode_size)
        self.classes: list[str] = list(self.manifest.classes)
        self.class_to_idx: dict[str, int] = {c: i for i, c in enumerate(self.classes)}
        self.warn_if_subset(stacklevel=2)  # ds[i] is not ImageFolder(source)[i]: said once, when opened

    def __len__(self) -> int:
        return self.manifest.num_samples

    def read_ahead(self, indices: Sequence[int]) -> readahead.Pending:
        """Start reading these samples' bytes in the background, in file order (packer.read.readahead).

        Returns at once; ``wait(k)`` on the result returns when the ``k``-th sample in file order
        (sorted by storage position, ``sorted(ds.positions(indices))``) is in memory. Formats of one
        file per sample (bmp) have the kernel read them all at once instead. Indices a block sampler
        yielded (packer.read.hints) may have their reads widened to whole device requests inside their blocks.
        """
        return self.start_reads(self.positions(indices), aheads_of(indices), skip_cached=False)

    def start_reads(self, idx: np.ndarray, ahead: Sequence[Ahead] = (), skip_cached: bool = True) -> readahead.Pending:
        """``read_ahead`` of storage positions (the staged-reading hook ``load_batch`` calls); ``skip_cached``:
        not the samples whose bytes are all in the page cache (reading them ahead would only copy; a page of a
        file the decoder never touches, an EXIF thumbnail's, once evicted would else have the whole batch read again).
        The ``ahead`` ranges (the blocks being read) bound how far a read may be widened to whole device requests."""
        ordered = idx[np.argsort(idx, kind="stable")]
        shard_of = np.searchsorted(self.store.starts, ordered, side="right") - 1
        requests: list = []
        for shard in np.unique(shard_of):
            reader = self.store.readers[shard]
            positions = (ordered[shard_of == shard] - self.store.starts[shard]).tolist()
            with reading(self.store.where(shard)):
                cached = reader.cached(positions).tolist() if skip_cached else [False] * len(positions)
                todo = [p for p, c in zip(positions, cached, strict=True) if not c]
                if todo:
                    reader.will_need(todo)  # formats of one file per sample: the kernel reads them all at once
                    spans = iter(reader.file_spans(todo))  # the others: byte ranges for the read-ahead thread
                    requests.extend(() if c else next(spans) for c in cached)
                else:
                    requests.extend([()] * len(positions))  # nothing to read for any of them
        # whole device requests at block edges where the data fits in memory (the neighbour's part stays cached)
        return readahead.start(requests, within=self._hulls(ahead), whole_cells=self.store.fits_in_memory)

    def block_boundaries(self) -> np.ndarray | None:
        """Storage positions where the format's natural blocks start (mosaic: one per mosaic), then len(self);
        None for formats without any (the block sampler then makes blocks by bytes)."""
        return get_format(self.manifest.format).block_boundaries(self.manifest)

    def _hulls(self, ahead: Sequence[Ahead]) -> list[tuple[str, int, int]]:
        """Each hinted range's byte hull in every file its samples lie in (``ShardStore.byte_hulls``; a range
        across shards, or out of range, is left out)."""
        out = []
        for hint in ahead:
            try:
                first, stop = operator.index(hint.first), operator.index(hint.stop)
            except (TypeError, AttributeError):
                raise PackerError(f"{self.root}: a read hint must hold integer positions, got {hint!r}") from None
            if not 0 <= first < stop <= len(self):
                continue
            out.extend(self.store.byte_hulls(first, stop))
        return out

    def __repr__(self) -> str:
        m = self.manifest
        return (f"{type(self).__name__}({self.store.files.name!r}, format={m.format}, payload={m.payload}, "
                f"samples={len(self)}, classes={len(self.classes)}, image={self.image}, indexing={self.indexing})")

    # ------------------------------------------------------------ reading

    def payload_at(self, pos: int):
        """The stored payload at storage position ``pos``: encoded bytes, or raw pixel bytes/array."""
        return self.store.read(pos)

    def payloads_at(self, stored: Sequence[int] | np.ndarray, ahead: Sequence[Ahead] = (),
                    pending: readahead.Pending | None = None, into: Callable[[int], np.ndarray] | None = None,
                    places: Sequence[np.ndarray | None] | None = None) -> list:
        """Payloads at these storage positions, read ahead in file order, returned in the order asked.

        Each shard's samples are read with one ``read_many`` call in file order, once the read-ahead
        has brought in its last one, and checked against the index together: the Python work per
        sample is one view or copy (warm reads at the loose folder's rate or above; docs/results.md).
        ``ahead``: as for ``start_reads``; ``pending``: its result for these positions, started earlier;
        ``into``/``places``: ``read_copies`` instead (see StagedDataset and ``_copies_memory``).
        """
        idx = np.asarray(stored, dtype=np.int64)
        if not len(idx):
            return []
        pending = self.start_reads(idx, ahead) if pending is None else pending
        order = np.argsort(idx, kind="stable")
        ordered = idx[order]
        got: list = []  # in file order
        shard_of = np.searchsorted(self.store.starts, ordered, side="right") - 1
        bounds = np.flatnonzero(np.diff(shard_of)) + 1
        memory = _copies_memory(self, ordered, order, into, places)
        for lo, hi in zip([0, *bounds.tolist()], [*bounds.tolist(), len(ordered)]):
            pending.wait(max(range(lo, hi), key=pending.need.__getitem__))  # the last to arrive
            got.extend(self.store.read_checked(int(shard_of[lo]), ordered[lo:hi], memory and memory(lo, hi)))
        if len(got) < 2:
            return got
        place = np.empty(len(order), dtype=np.int64)
        place[order] = np.arange(len(order))  # where each asked sample lies in file order
        return list(operator.itemgetter(*place.tolist())(got))  # one C-level gather, not a Python loop

    def pixels_at(self, i: int, payload=None, strict: bool = False, out: np.ndarray | None = None,
                  window: Window | None = None) -> np.ndarray:
        """The sample stored at ``i`` as HWC uint8 RGB, decoding encoded payloads (``strict``: see ``pixels``)."""
        buf = self.store.read(i) if payload is None else payload
        h, w = int(self.index.heights[i]), int(self.index.widths[i])
        if self.manifest.payload == "encoded":
            return self._decode(i, buf, strict, out, window)
        arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
        if arr.size != h * w * 3:
            raise DatasetError(f"{self.root}: sample {self.index_map.public(i)} holds {arr.size} bytes, "
                               f"expected {h}x{w}x3")
        if self.crop is not None:
            return self.crop.from_pixels(arr.reshape(h, w, 3), self.index_map.public(i), out, window)
        return copy_into(arr.reshape(h, w, 3), out)

    def _decode(self, i: int, buf, strict: bool = False, out: np.ndarray | None = None,
                window: Window | None = None) -> np.ndarray:
        """Decode the sample stored at ``i``; a codec failure on damaged bytes is a DecodeError naming the sample.

        The header is checked against the index first, so a damaged header can't make the
        decoder allocate an image far larger than the one that was packed; the decoder then
        refuses any image above the pixel limit (``packer.images.decode.check_pixels``), whatever the index says.
        """
        self.check_header(i, buf)
        with _sample_errors(self, i):
            if self.crop is not None:  # its random crop is drawn per (seed, epoch, ImageFolder index)
                hh, ww = image_size(buf)
                return self.crop.from_bytes(buf, self.index_map.public(i), hh, ww, self.decoder, strict, out, window)
            return decode(buf, self.decoder, strict=strict, min_size=self.decode_size, out=out)

    def check_header(self, i: int, buf) -> None:
        """Refuse sample ``i``'s encoded bytes when their header's size is not the index's or is above the
        pixel limit: checked before any decoder (packer's, or DALI's in ``packer.dali``) allocates."""
        with _sample_errors(self, i):
            check_size(buf, int(self.index.heights[i]), int(self.index.widths[i]))

    def present_at(self, i: int, arr: np.ndarray | None, tensor: torch.Tensor | None = None) -> Any:
        """The decoded pixels of the sample stored at ``i`` as handed out: image kind, transform, target transform.

        ``tensor``: ``arr``'s memory as a tensor already (its slot of ``batch_slots``); ``arr`` None: no image.
        """
        if arr is None:  # a sample without an image: its fields dict in the image's place (packer.read.fields)
            img: Any = self.selection.inputs(self.field_store, i, str(self.root))
        elif self.image == "pil":
            img = Image.fromarray(arr)
        elif self.image == "tensor" and tensor is not None:
            img = tensor.permute(2, 0, 1)
        elif self.image == "tensor":
            if not arr.flags.writeable:
                arr = arr.copy()  # torch needs writable memory; raw payloads are read-only views
            img = torch.from_numpy(arr).permute(2, 0, 1)
        else:
            img = arr
        target = int(self.index.labels[i])
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return self.selection.sample(self.field_store, i, img, target, str(self.root))

    def samples_in_slots(self, idx: Sequence[int], payloads: Sequence, slots: Sequence[torch.Tensor],
                         windows: Sequence[Window] | None = None) -> list | None:
        """JPEGs decoded into their slots by one call of the compiled extension (``read.batch.samples_in_slots``)."""
        return batch.samples_in_slots(self, idx, payloads, slots, windows)

    def crop_windows(self, idx: Sequence[int]) -> list[Window] | None:
        """Fused crops' windows drawn in this order, from the index's sizes (``read.batch.crop_windows``)."""
        return batch.crop_windows(self, idx)

    def crop_stream(self) -> CropDecode | None:
        return self.crop

    # ------------------------------------------------------------ whole batches (packer.read.batch)

    def batch_slots(self, indices: Sequence[int]) -> list[torch.Tensor] | None:
        """One shared block for a worker's batch of mixed sizes (storage positions; ``read.batch.batch_slots``)."""
        return batch.batch_slots(self, indices)

    def decode_block(self, indices: Sequence[int], alloc: Callable[[int], torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor | None, list[torch.Tensor]] | None:
        """A batch of slots to decode into in this process (storage positions; ``read.batch.decode_block``); None
        where samples are not ``(image, label)`` pairs (``fields=``): ThreadLoader's batch of slots assumes them."""
        if self.selection.names is not None or not self.has_images:
            return None
        return batch.decode_block(self, indices, alloc)

    def get_batch(
        self, indices: Sequence[int], layout: Literal["NHWC", "NCHW"] = "NHWC", sort: bool = False,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``indices`` as one uint8 image tensor and an int64 label tensor (``packer.read.batch.get_batch``)."""
        return batch.get_batch(self, indices, layout, sort, out)

    def batched(self, layout: Literal["NHWC", "NCHW"] = "NHWC") -> batch.BatchView:
        """A dataset whose items are whole batches, for ``DataLoader(sampler=BatchSampler(...), batch_size=None)``."""
        return batch.BatchView(self, layout)

    def locate(self, i: int) -> tuple[int, int]:
        """(shard number, position inside that shard) of sample ``i``."""
        return self.store.locate(self.position(i))

    @property
    def fixed_shape(self) -> tuple[int, int, int] | None:
        """(H, W, 3) when every shard stores one shape its reader copies in bulk (``get_batch``), else None."""
        return self.store.fixed_shape

    def follow(self, stored: np.ndarray, indices: Iterator[int], start: int) -> Iterator[int]:
        return self.store.files.follow(stored, indices, start)  # StagedDataset.follow: the shard files' read-ahead

    def close(self) -> None:
        self.store.close()



# help()'s explanation of every argument, kept outside the class body (tests/test_sizes.py bounds the class's lines,
# docstrings included, to keep its code small)
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


@contextmanager
def _sample_errors(ds: PackedDataset, i: int) -> Iterator[None]:
    """Any failure of a codec on the (damaged) bytes stored at ``i`` as a DecodeError naming the sample."""
    try:
        yield
    except DecodeError as exc:
        raise DecodeError(f"{ds.root}: sample {ds.index_map.public(i)} ({ds.index.rel_path(i)}): {exc}") from exc
    except DATA_ERRORS as exc:
        raise DecodeError(f"{ds.root}: sample {ds.index_map.public(i)} ({ds.index.rel_path(i)}): cannot decode "
                          f"({type(exc).__name__}: {exc})") from exc


def _format_dataset_class(fmt: Format) -> type[PackedDataset]:
    """The dataset class of one format (``LMDBDataset``, ...): PackedDataset that opens only that format."""
    cls = type(fmt.dataset_class, (PackedDataset,), {
        "FORMAT": fmt.name,
        "__doc__": f"A packed dataset of format {fmt.name!r} (see PackedDataset).",
        "__module__": __name__,
    })
    cls.__qualname__ = fmt.dataset_class
    return cls


# format name -> its dataset class; the built-in formats' now, a registered one's on first use (dataset_class)
DATASET_CLASSES: dict[str, type[PackedDataset]] = {name: _format_dataset_class(fmt) for name, fmt in FORMATS.items()}
globals().update({cls.__name__: cls for cls in DATASET_CLASSES.values()})  # pickled by reference: module globals


def dataset_class(name: str, where: object = "dataset") -> type[PackedDataset]:
    """The dataset class of format ``name``, made on first use for a format registered after import."""
    cls = DATASET_CLASSES.get(name)
    if cls is None:
        if name not in FORMATS:
            raise DatasetError(f"{where}: format {name!r} is unknown to this packer ({', '.join(FORMATS)})")
        cls = DATASET_CLASSES[name] = _format_dataset_class(FORMATS[name])
        globals()[cls.__name__] = cls
    return cls


def _copies_memory(ds: PackedDataset, ordered: np.ndarray, order: np.ndarray, into: Callable[[int], np.ndarray] | None,
                   places: Sequence[np.ndarray | None] | None) -> Callable[[int, int], Destinations] | None:
    """Where ``payloads_at`` reads the copies of the payloads ``ordered[lo:hi]`` (storage positions in file order,
    ``order`` their places in the order asked); None: no copies, views. Raw pixels go straight into their
    ``places`` (flat uint8 batch slots, one per sample asked) where each has the payload's size: one copy, as a
    view copied into its slot was; else consecutive parts of one block from ``into``."""
    sizes = ds.index.nbytes[ordered]
    if places is not None and ds.manifest.payload == "raw" and ds.crop is None:
        dests = [places[k] for k in order.tolist()]
        if all(d is not None and d.nbytes == n for d, n in zip(dests, sizes.tolist(), strict=True)):
            return lambda lo, hi: cast(list, dests[lo:hi])
    if into is None:
        return None
    ends = np.cumsum(sizes)
    block = into(int(ends[-1]))
    return lambda lo, hi: block[int(ends[lo] - sizes[lo]) : int(ends[hi - 1])]


CacheMode = Literal["ram", "ram-decoded"]


def _remote_files(path: str | os.PathLike, cache_dir: str | os.PathLike | None, cache_limit: int | str | None,
                  storage_options: Mapping[str, Any] | None) -> ShardFiles | None:
    """A URL's shard files (packer.read.remote), or None for a local path or ``file://`` URL."""
    if not is_url(path) or parse(path).is_local:
        return None
    from packer.read.remote import open_remote

    return open_remote(str(path), cache_dir, cache_limit, storage_options)


@overload
def open_dataset(path: str | os.PathLike, cache: None = None, cache_options: Mapping[str, Any] | None = None, *,
                 transform: Callable | None = None, target_transform: Callable | None = None, image: ImageKind = "pil",
                 decoder: str = "auto", access: Access = "auto", decode_size: int | None = None,
                 source_root: str | os.PathLike | None = None, crop: CropDecode | None = None,
                 fields: FieldsArg = None, cache_dir: str | os.PathLike | None = None,
                 cache_limit: int | str | None = "20GB",
                 storage_options: Mapping[str, Any] | None = None) -> PackedDataset: ...


@overload
def open_dataset(path: str | os.PathLike, cache: CacheMode, cache_options: Mapping[str, Any] | None = None, *,
                 transform: Callable | None = None, target_transform: Callable | None = None, image: ImageKind = "pil",
                 decoder: str = "auto", access: Access = "auto", decode_size: int | None = None,
                 source_root: str | os.PathLike | None = None, crop: CropDecode | None = None,
                 fields: FieldsArg = None, cache_dir: str | os.PathLike | None = None,
                 cache_limit: int | str | None = "20GB",
                 storage_options: Mapping[str, Any] | None = None) -> CachedDataset: ...


def open_dataset(path: str | os.PathLike, cache: CacheMode | None = None,
                 cache_options: Mapping[str, Any] | None = None, *,
                 transform: Callable | None = None, target_transform: Callable | None = None, image: ImageKind = "pil",
                 decoder: str = "auto", access: Access = "auto", decode_size: int | None = None,
                 source_root: str | os.PathLike | None = None, crop: CropDecode | None = None,
                 fields: FieldsArg = None, cache_dir: str | os.PathLike | None = None,
                 cache_limit: int | str | None = "20GB",
                 storage_options: Mapping[str, Any] | None = None) -> PackedDataset | CachedDataset:
    """Open a packed dataset of any format as a map-style PyTorch dataset (ImageFolder's samples and indices).

    ``with open_dataset(p) as ds:`` closes its shard files at the end.

    Args:
        path: the dataset directory (made by ``packer convert`` or ``packer.Writer``), or its URL (``s3://``,
            ``gs://``, ``az://``, ``http(s)://``, ``file://``): shards fetched whole into ``cache_dir`` as read
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

    Returns:
        The format's ``PackedDataset`` subclass (``LMDBDataset``, ...), or a ``CachedDataset`` with ``cache``.

    Raises:
        InputNotFoundError: ``path`` is not a packed dataset (a ``FileNotFoundError``).
        DatasetError: the dataset fails its checks.
        OptionError: an argument out of its choices (a ``ValueError``).
    """
    if cache == "ram-decoded" and crop is not None:
        raise OptionError("crop= with cache='ram-decoded' would keep one crop per sample for ever: use cache='ram'")
    files = _remote_files(path, cache_dir, cache_limit, storage_options)  # None: a path or a file:// URL
    path = parse(path).path if files is None else files.root
    fmt = read_manifest(path).format if files is None else files.open()[0].format
    try:
        cls = dataset_class(fmt, path if files is None else files.name)
        ds = cls(path, transform=transform, target_transform=target_transform, image=image, decoder=decoder,
                 access=access, decode_size=decode_size, source_root=source_root, crop=crop, fields=fields,
                 shard_files=files)
    except BaseException:
        if files is not None:
            files.close()
        raise
    if cache is None:
        return ds
    from packer.read.cache import CachedDataset

    return CachedDataset(ds, cache, **dict(cache_options or {}))
