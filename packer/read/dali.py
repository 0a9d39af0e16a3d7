"""NVIDIA DALI fed by packer: packer reads, DALI decodes and augments (``packer.dali``).

``pipeline(ds, batch_size)`` builds a DALI pipeline whose external source (``PackerSource``) hands DALI
each batch's stored payloads in packer's block order (``BlockShuffleSampler``: a new order per epoch,
rank sharding) read through the dataset's batch pipeline (read-ahead, headers checked: ``output="payloads"``);
DALI decodes encoded payloads (``fn.decoders.image``: "cpu", or "mixed" = nvJPEG on a GPU) and augments. Raw
payloads go to the augmentations as HWC arrays, skipping the decoder. ``loader(...)`` wraps it in DALI's PyTorch
iterator.

NVIDIA DALI is an optional dependency (``pip install -e '.[dali]'`` in packer's checkout), imported only here and
only when a pipeline is built. See docs/dali.md.
"""

from __future__ import annotations

import copyreg
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from packer.errors import MissingPackageError, OptionError, PackerError, install_hint
from packer.read.dataset import PackedDataset, open_dataset
from packer.read.sampler import DEFAULT_OPEN_BLOCKS, DEFAULT_RUN, BlockShuffleSampler

if TYPE_CHECKING:
    from nvidia.dali.pipeline import Pipeline

Device = Literal["cpu", "gpu"]
Augment = Literal["train", "eval", "none"]
LastBatch = Literal["partial", "drop", "fill"]
StartMethod = Literal["fork", "spawn"]

INSTALL_HINT = install_hint("dali")
MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)  # ImageNet statistics, as torchvision's Normalize is used
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
TRAIN_AREA = (0.08, 1.0)  # torchvision RandomResizedCrop's defaults
TRAIN_RATIO = (3 / 4, 4 / 3)
EVAL_RATIO = 256 / 224  # eval: shorter side to size * 256/224, then the center size x size crop
OUTPUTS = ("images", "labels", "indices")


def import_dali() -> Any:
    """``nvidia.dali``, or a one-line PackerError naming the extra that installs it."""
    try:
        import nvidia.dali as dali
        import nvidia.dali.fn  # noqa: F401  (submodules the pipeline uses)
        import nvidia.dali.plugin.pytorch  # noqa: F401
        import nvidia.dali.types  # noqa: F401
    except ImportError as exc:
        raise MissingPackageError(f"packer.dali needs NVIDIA DALI, which does not import here ({exc}): "
                                  f"{INSTALL_HINT}") from None
    return dali


class PackerSource:
    """DALI external source (``batch=True, batch_info=True``): batch ``k`` of DALI's epoch ``e``.

    Returns (payloads, labels, indices) for the samples ``k * batch_size ...`` of this rank's block
    order of epoch ``first_epoch + e`` and raises StopIteration after the last batch. A pure function
    of (epoch, batch number), so DALI's parallel workers (fork or spawn: it pickles) can each compute
    any batch. ``last_batch``: "partial" (a short last batch: every sample once per epoch), "drop"
    (no short batch) or "fill" (the short batch padded with the epoch's first samples), as DALI's
    ``LastBatchPolicy`` names them.
    """

    def __init__(self, ds: PackedDataset, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 first_epoch: int = 0, last_batch: LastBatch = "partial", num_replicas: int | None = None,
                 rank: int | None = None, open_blocks: int = DEFAULT_OPEN_BLOCKS, run: int = DEFAULT_RUN) -> None:
        if batch_size < 1:
            raise OptionError(f"batch_size must be positive, got {batch_size}")
        if last_batch not in ("partial", "drop", "fill"):
            raise OptionError(f"unknown last_batch {last_batch!r} (choose partial, drop or fill)")
        self.ds = ds
        self.batch_size = batch_size
        self.first_epoch = first_epoch
        self.last_batch = last_batch
        self.raw = ds.source.payload != "encoded"  # pixels: stored raw, or a "ram-decoded" cache
        self.sampler = BlockShuffleSampler(ds, batch_size=batch_size, shuffle=shuffle, seed=seed,
                                           num_replicas=num_replicas, rank=rank, open_blocks=open_blocks, run=run)
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, order): the last epoch asked, per process

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        n = len(self.sampler)
        return n // self.batch_size if self.last_batch == "drop" else -(-n // self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        """This rank's sample order in (absolute) ``epoch``."""
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, self.sampler.order(epoch))
        return self._order[1]

    def batch_indices(self, epoch: int, k: int) -> np.ndarray | None:
        """Sample indices of batch ``k`` of ``epoch``; None after the last batch."""
        if not 0 <= k < len(self):
            return None
        order = self.order(epoch)
        idx = order[k * self.batch_size : (k + 1) * self.batch_size]
        if self.last_batch == "fill" and len(idx) < self.batch_size:
            idx = np.concatenate([idx, np.resize(order, self.batch_size - len(idx))])
        return idx

    def __call__(self, info: Any) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        idx = self.batch_indices(self.first_epoch + int(info.epoch_idx), int(info.iteration))
        if idx is None:
            raise StopIteration
        arrays = self.ds.pipeline.load(idx, output="payloads", chunks=1)
        pos = self.ds.positions(idx)  # where the samples (ImageFolder indices) are stored: the index's arrays
        return arrays, self.ds.index.labels[pos].astype(np.int64), idx

    def array(self, pos: int, payload: Any) -> np.ndarray:
        """The payload stored at ``pos`` as DALI takes it: the HWC pixels (raw), else the encoded bytes, whose
        header is checked against the index first (no decoder allocates for a damaged header)."""
        return self.ds.pipeline.decoding.external(pos, payload, self.ds.source.payload)


def as_dataset(ds_or_path: PackedDataset | str | os.PathLike) -> PackedDataset:
    """An open packer dataset (a RAM-cached one too) from a dataset or its path."""
    ds = ds_or_path if isinstance(ds_or_path, PackedDataset) else open_dataset(ds_or_path)
    if not isinstance(ds, PackedDataset):
        raise OptionError(f"packer.dali reads a PackedDataset or its path, not {type(ds).__name__}")
    if not ds.has_images:
        raise OptionError(f"{ds.root}: its samples have no image for DALI to decode (read them with open_dataset)")
    return ds


def pipeline(
    ds_or_path: PackedDataset | str | os.PathLike,
    batch_size: int,
    *,
    device: Device = "cpu",
    augment: Augment = "train",
    size: int = 224,
    seed: int = 0,
    shuffle: bool = True,
    first_epoch: int = 0,
    last_batch: LastBatch = "partial",
    num_threads: int = 2,
    py_workers: int = 0,
    py_start_method: StartMethod = "fork",
    num_replicas: int | None = None,
    rank: int | None = None,
    device_id: int | None = None,
    prefetch: int = 2,
) -> Pipeline:
    """A built DALI pipeline over a packer dataset of any format, with outputs ("images", "labels", "indices").

    ``augment``: "train" (random resized crop, area (0.08, 1), ratio (3/4, 4/3), to ``size`` x ``size``;
    horizontal flip with p = 0.5; normalize: float CHW), "eval" (shorter side to ``size`` * 256/224,
    center crop, normalize) or "none" (the decoded images, HWC uint8 at their own sizes). ``device``
    "gpu" decodes with nvJPEG (``mixed``) on GPU ``device_id`` (default 0); "cpu" runs DALI without a
    GPU. ``py_workers`` > 0 runs the source in that many processes (DALI's parallel external source,
    started by ``py_start_method``); 0 runs it in the calling thread. ``shuffle``, ``seed``,
    ``num_replicas``/``rank`` as for ``BlockShuffleSampler``: DALI counts epochs itself (each reset
    starts the next), from ``first_epoch``.
    """
    if device not in ("cpu", "gpu"):
        raise OptionError(f"unknown device {device!r} (choose cpu or gpu)")
    if augment not in ("train", "eval", "none"):
        raise OptionError(f"unknown augment {augment!r} (choose train, eval or none)")
    if py_start_method not in ("fork", "spawn"):
        raise OptionError(f"unknown py_start_method {py_start_method!r} (choose fork or spawn)")
    if py_workers > 0 and py_start_method == "fork" and StopIteration in copyreg.dispatch_table:
        raise PackerError("this process pickles exceptions its own way (a copyreg reducer for StopIteration, "
                          "e.g. tblib's, which Dask installs), which DALI refuses from its fork workers at "
                          "each epoch's end: use py_start_method='spawn' or py_workers=0")
    dali = import_dali()
    ds = as_dataset(ds_or_path)
    source = PackerSource(ds, batch_size, shuffle=shuffle, seed=seed, first_epoch=first_epoch,
                          last_batch=last_batch, num_replicas=num_replicas, rank=rank)
    pipe = dali.pipeline.Pipeline(
        batch_size=batch_size, num_threads=num_threads, seed=seed, prefetch_queue_depth=prefetch,
        device_id=(device_id or 0) if device == "gpu" else None,
        py_num_workers=max(py_workers, 1), py_start_method=py_start_method,
    )
    parallel = {"parallel": True, "prefetch_queue_depth": prefetch} if py_workers > 0 else {}
    with pipe:
        images, labels, indices = dali.fn.external_source(
            source=source, num_outputs=3, batch=True, batch_info=True, **parallel,
            layout=["HWC" if source.raw else "", "", ""],
            dtype=[dali.types.UINT8, dali.types.INT64, dali.types.INT64],
        )
        images = augment_graph(dali, images, source.raw, device, augment, size)
        if device == "gpu":
            labels = labels.gpu()
        pipe.set_outputs(images, labels, indices)
    pipe.build()
    return pipe


def augment_graph(dali: Any, images: Any, raw: bool, device: Device, augment: Augment, size: int) -> Any:
    """Decode (encoded payloads) and augment: the DALI operators between the source and the outputs (also
    used on DALI's own file reader by examples/measure_dali.py, so both decode and augment alike)."""
    fn, types = dali.fn, dali.types
    decoder = "mixed" if device == "gpu" else "cpu"
    if raw and device == "gpu":
        images = images.gpu()
    if augment == "train":
        if raw:
            images = fn.random_resized_crop(images, size=(size, size), random_area=TRAIN_AREA,
                                            random_aspect_ratio=TRAIN_RATIO)
        else:  # DALI's fused decode + crop: only the crop's part of a JPEG is decoded
            images = fn.decoders.image_random_crop(images, device=decoder, output_type=types.RGB,
                                                   adjust_orientation=False, random_area=TRAIN_AREA,
                                                   random_aspect_ratio=TRAIN_RATIO)
            images = fn.resize(images, size=(size, size))
        mirror = fn.random.coin_flip(probability=0.5)
        return fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", mean=MEAN, std=STD,
                                        mirror=mirror)
    if not raw:  # EXIF orientation is not applied, as by packer's decoders and ImageFolder's loader
        images = fn.decoders.image(images, device=decoder, output_type=types.RGB, adjust_orientation=False)
    if augment == "none":
        return images
    images = fn.resize(images, resize_shorter=round(size * EVAL_RATIO))
    return fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", crop=(size, size),
                                    mean=MEAN, std=STD)


class DaliLoader:
    """``(images, labels)`` torch tensors per batch from a packer DALI pipeline, one epoch per ``iter()``.

    Wraps DALI's ``DALIGenericIterator``, which resets the pipeline after each epoch, so the next
    epoch gets the next block order. Needs one output size per batch: ``augment`` "train" or "eval".
    """

    def __init__(self, pipe: Pipeline) -> None:
        dali = import_dali()
        self.pipe = pipe
        self._it = dali.plugin.pytorch.DALIGenericIterator(pipe, list(OUTPUTS), auto_reset=True)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for out in self._it:
            yield out[0]["images"], out[0]["labels"]


def loader(ds_or_path: PackedDataset | str | os.PathLike, batch_size: int, **kwargs: Any) -> DaliLoader:
    """A PyTorch iterator of ``(images, labels)`` over ``pipeline(ds_or_path, batch_size, **kwargs)``."""
    if kwargs.get("augment", "train") == "none":
        raise OptionError("loader() stacks each batch into one tensor: use augment='train' or 'eval' "
                          "(pipeline(..., augment='none') gives the decoded images at their own sizes)")
    return DaliLoader(pipeline(ds_or_path, batch_size, **kwargs))
