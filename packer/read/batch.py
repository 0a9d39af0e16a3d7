"""Whole batches: one shared-memory block per worker batch of mixed sizes (``batch_slots``), uint8
batch tensors read in bulk where the format allows (``get_batch``), and datasets whose items are batches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from packer.errors import DatasetError, OptionError, arg
from packer.images.crop import spread
from packer.images.decode import DecodeError, decode_many, jpeg_frame, pixel_limit
from packer.layout.trust import reading
from packer.read.hints import aheads_of

if TYPE_CHECKING:
    from packer.images.crop import Window
    from packer.read.dataset import PackedDataset

BATCH_BLOCK_MAX = 1 << 30  # largest shared block batch_slots maps for one batch (larger: image by image)


def batch_slots(ds: PackedDataset, indices: Sequence[int], max_bytes: int = BATCH_BLOCK_MAX,
                in_worker: bool | None = None) -> list[torch.Tensor] | None:
    """Per sample, an HWC uint8 tensor of its size, all in one block of shared memory, where
    samples of different sizes leave a DataLoader worker as plain tensors (``image="tensor"``,
    no transform), so that no collate function can stack them.

    Samples are decoded straight into their slots, so a batch crosses to the main process as
    one block, as ``default_collate``'s stacked batches do, instead of one copy into shared
    memory per image (2 workers on 2 cores: ~25 % more images/s; ``packer bench --levels
    loader``). Keeping one image keeps its batch's block alive. None elsewhere (main process,
    transforms, ``decode_size``, batches of one shape) and where the index lacks a size
    (``--validate none``).
    """
    if in_worker is None:
        in_worker = get_worker_info() is not None
    if not in_worker:
        return None
    shapes = _slot_shapes(ds, indices, max_bytes)
    if shapes is None:
        return None
    if ds.crop is not None:  # fused crops: every output has crop.size, decoded straight into one block
        return list(_new_batch((len(indices), *ds.crop.size, 3), shared=True).unbind(0))
    if len(set(shapes)) <= 1:
        # One shape: a collate function stacks them into shared memory itself; a block here would be
        # one more copy (default_collate over 224x224 mosaic tiles: ~20 % fewer tiles/s with it).
        return None
    return _views(_new_batch((sum(h * w * 3 for h, w in shapes),), shared=True), shapes)


def decode_block(ds: PackedDataset, indices: Sequence[int], alloc: Callable[[int], torch.Tensor] | None = None,
                 max_bytes: int = BATCH_BLOCK_MAX) -> tuple[torch.Tensor | None, list[torch.Tensor]] | None:
    """A batch to decode into in this process (``packer.ThreadLoader``): ``(stacked, slots)``.

    One shape (fused crops, fixed-size datasets): ``stacked`` is an (N, H, W, 3) tensor and ``slots``
    its rows, so the decoded batch needs no stacking copy. Several shapes: ``stacked`` is None and
    ``slots`` are views of one flat block. None where ``batch_slots`` would not decode into slots.
    ``alloc(nbytes)``: the flat uint8 memory (default a new tensor).
    """
    shapes = _slot_shapes(ds, indices, max_bytes)
    if shapes is None:
        return None
    total = sum(h * w * 3 for h, w in shapes)
    block = torch.empty(total, dtype=torch.uint8) if alloc is None else alloc(total)
    if len(set(shapes)) <= 1:
        h, w = shapes[0] if shapes else (0, 0)
        stacked = block.view(len(shapes), h, w, 3)
        return stacked, list(stacked.unbind(0))
    return None, _views(block, shapes)


def samples_in_slots(ds: PackedDataset, idx: Sequence[int], payloads: Sequence, slots: Sequence[torch.Tensor],
                     windows: Sequence[Window] | None = None) -> list | None:
    """JPEGs decoded into their slots by one call of the compiled extension, whole (``decode_many``) or as fused
    crops through ``windows`` (``CropDecode.from_bytes_many``), as ``present_at`` would hand them out: ``(image,
    label)`` with ``image="tensor"``, no transform, ``decode_size`` or fields (storage positions). A sample it
    leaves is None: one whose header is not a 3- or 1-component JPEG's of the index's size is not even tried (the
    one-by-one path's header check says what is wrong), nor is one the extension leaves (CMYK, damage). None: no
    bulk path for this dataset (a fused crop without ``windows`` among them)."""
    if (ds.manifest.payload != "encoded" or ds.image != "tensor" or ds.transform is not None
            or ds.target_transform is not None or ds.decode_size or ds.selection.names is not None):
        return None
    pos = np.asarray(idx, dtype=np.int64)
    heights, widths = ds.index.heights[pos].tolist(), ds.index.widths[pos].tolist()
    checked = [_plain_jpeg(data, h, w) for data, h, w in zip(payloads, heights, widths, strict=True)]
    views = [slot.numpy() for slot in slots]
    if ds.crop is None:
        ready = [k for k, ok in enumerate(checked) if ok]
        status = decode_many([payloads[k] for k in ready], [views[k] for k in ready], ds.decoder, strict=False)
        done = None if status is None else spread(status, ready, len(pos))
    elif windows is None or ds.decoder == "pil":
        return None
    else:
        done = ds.crop.from_bytes_many(payloads, windows, heights, widths, views, checked, strict=False)
    if done is None:
        return None
    labels = ds.index.labels[pos].tolist()
    return [(slot.permute(2, 0, 1), label) if ok == 1 else None
            for slot, label, ok in zip(slots, labels, done, strict=True)]


def crop_windows(ds: PackedDataset, idx: Sequence[int]) -> list[Window] | None:
    """The fused crop's window of each sample at these storage positions, drawn in this order from the index's
    sizes: a batch's crops in its order, as a DataLoader's per-sample draws are, whichever sample's bytes come in
    first. None: no crop, or sizes the index lacks (each sample then draws from its header's size as decoded)."""
    if ds.crop is None or not len(idx):
        return None
    pos = np.asarray(idx, dtype=np.int64)
    heights, widths = ds.index.heights[pos], ds.index.widths[pos]
    if heights.min() < 1 or widths.min() < 1:
        return None
    return ds.crop.windows(heights.tolist(), widths.tolist(), ds.index_map.public_many(pos).tolist())


def _plain_jpeg(data, height: int, width: int) -> bool:
    """Whether ``data`` is a JPEG whose frame header says ``height`` x ``width`` (> 0) in 3 or 1 components."""
    if height < 1 or width < 1 or bytes(data[:3]) != b"\xff\xd8\xff":
        return False
    try:
        return jpeg_frame(data) in ((height, width, 3), (height, width, 1))
    except DecodeError:
        return False


def _slot_shapes(ds: PackedDataset, indices: Sequence[int], max_bytes: int) -> list[tuple[int, int]] | None:
    """(h, w) of each sample's slot (storage positions); None where slots don't apply: other image kinds,
    transforms, ``decode_size``, sizes the index lacks or that the per-sample path would refuse, too large."""
    if ds.image != "tensor" or ds.transform is not None or ds.decode_size:
        return None
    if ds.crop is not None:
        return [tuple(ds.crop.size)] * len(indices)  # type: ignore[list-item]
    idx = np.asarray(indices, dtype=np.int64)
    h, w = ds.index.heights[idx].astype(np.int64), ds.index.widths[idx].astype(np.int64)
    if not len(h) or np.any(h <= 0) or np.any(w <= 0):
        return None
    # Sizes come from metadata: allocate only what the per-sample path would accept (it names the problem)
    if ds.manifest.payload == "encoded":
        limit = pixel_limit()
        if limit is not None and np.any(h * w > limit):
            return None
    elif np.any(ds.index.nbytes[idx] != h * w * 3):
        return None
    if int((h * w * 3).sum()) > max_bytes:
        return None  # nothing checked the sizes yet: don't map more than this on their word
    return list(zip(h.tolist(), w.tolist()))


def _views(block: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """HWC views of consecutive pieces of the flat, contiguous ``block``, one per shape (one call each: half the
    time of a slice then a view, per batch of 64 in a ThreadLoader's feeder)."""
    if not block.is_contiguous() or sum(h * w * 3 for h, w in shapes) > block.numel():
        raise ValueError(f"a block of {block.numel()} bytes is not contiguous or too small for these shapes")
    out, start, view = [], block.storage_offset(), block.as_strided
    for h, w in shapes:
        out.append(view((h, w, 3), (w * 3, 3, 1), start))
        start += h * w * 3
    return out


def get_batch(
    ds: PackedDataset, indices: Sequence[int], layout: Literal["NHWC", "NCHW"] = "NHWC", sort: bool = False,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples ``indices`` as one uint8 image tensor and an int64 label tensor; no transforms.

    Fixed-shape raw datasets (``--payload raw --resize HxW`` in hdf5, memmap or lmdb) are read
    straight into the batch, in the order asked where one shard holds them all, else shard by shard
    in storage order and then put in order (memmap, lmdb: one memory copy in all for one shard).
    ``sort=True`` returns the samples in storage order (labels follow), which saves the copy
    that puts them back in the order asked. Other datasets decode each sample; all must
    share one shape. ``layout="NCHW"`` is a zero-copy channels-last view of the NHWC batch.
    ``out`` (e.g. a pinned NHWC uint8 tensor) receives the images instead of a new tensor.
    """
    if layout not in ("NHWC", "NCHW"):
        raise OptionError(f"unknown batch layout {layout!r} (choose NHWC or NCHW)")
    if not ds.has_images:
        raise OptionError(f"{ds.root}: its samples have no image, so there is no image batch (read ds[i])")
    idx = ds.positions(indices)  # storage positions: reads, sizes and labels below are all by them
    order = np.argsort(idx, kind="stable")
    in_order = bool(np.all(order == np.arange(len(idx))))
    if sort:
        idx, in_order = idx[order], True
    shape = ds.store.fixed_shape
    if shape is None:
        pixels = [ds.pixels_at(int(i), p) for i, p in zip(idx, ds.payloads_at(idx, aheads_of(indices)), strict=True)]
        shapes = {p.shape for p in pixels}
        if len(shapes) > 1:
            raise OptionError(
                f"{ds.root}: get_batch needs images of one shape, this batch has {len(shapes)} "
                f"(e.g. {sorted(shapes)[:2]}); convert with {arg('payload', 'raw')} {arg('resize', 'HxW')}")
        shape = pixels[0].shape if pixels else (0, 0, 3)
    elif np.any(ds.index.heights[idx] != shape[0]) or np.any(ds.index.widths[idx] != shape[1]):
        raise DatasetError(f"{ds.root}: shards say every image is {shape[0]}x{shape[1]}, the index disagrees "
                           "(damaged dataset)")
    images = out if out is not None else _new_batch((len(idx), *shape))
    if tuple(images.shape) != (len(idx), *shape) or images.dtype != torch.uint8 or not images.is_contiguous():
        raise OptionError(f"out: expected a contiguous uint8 tensor {(len(idx), *shape)}, got "
                          f"{images.dtype} {tuple(images.shape)}")
    arr = images.numpy()
    if ds.store.fixed_shape is None:
        for k, p in enumerate(pixels):
            arr[k] = p
    else:
        shard_of = np.searchsorted(ds.store.starts, idx, side="right") - 1
        if len(idx) and not in_order and shard_of.min() == shard_of.max():
            in_order, order = True, np.arange(len(idx))  # one shard: read in the order asked, straight into the batch
        ordered = idx if in_order else idx[order]
        buf = arr if in_order else np.empty_like(arr)
        shard_of = shard_of if in_order else shard_of[order]
        bounds = np.searchsorted(shard_of, np.arange(len(ds.store.readers) + 1))
        for shard, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            if hi > lo:
                positions = (ordered[lo:hi] - ds.store.starts[shard]).tolist()
                with reading(ds.store.where(shard)):
                    ds.store.readers[shard].read_into(positions, buf[lo:hi])
                ds.store.check_same_files(shard)
        if not in_order:
            arr[order] = buf
    labels = torch.from_numpy(ds.index.labels[idx].astype(np.int64))
    return (images.permute(0, 3, 1, 2) if layout == "NCHW" else images), labels


def _new_batch(shape: tuple[int, ...], shared: bool | None = None) -> torch.Tensor:
    """An uint8 tensor; inside a DataLoader worker (``shared`` None: as ``get_worker_info`` says) it lives in
    shared memory, as ``default_collate`` makes its batches, so handing it to the main process copies nothing."""
    if not (get_worker_info() is not None if shared is None else shared):
        return torch.empty(shape, dtype=torch.uint8)
    elem = torch.empty(0, dtype=torch.uint8)
    storage = elem._typed_storage()._new_shared(int(np.prod(shape)), device=elem.device)
    return elem.new(storage).resize_(*shape)


class BatchView(Dataset):
    """Items are batches: ``view[[i, j, ...]] -> (uint8 images, int64 labels)`` via ``get_batch(sort=True)``.

    Use with a ``BatchSampler`` as the loader's sampler and ``batch_size=None``::

        loader = DataLoader(ds.batched(), batch_size=None, num_workers=4, pin_memory=True,
                            sampler=BatchSampler(RandomSampler(ds), batch_size=256, drop_last=False))

    Each worker then reads a whole batch in one call (one memory copy for memmap); samples in a
    batch come in storage order, which training does not notice.
    """

    def __init__(self, dataset: PackedDataset, layout: Literal["NHWC", "NCHW"] = "NHWC") -> None:
        self.dataset = dataset
        self.layout: Literal["NHWC", "NCHW"] = layout

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dataset.get_batch(indices, layout=self.layout, sort=True)
