"""Whole batches as tensors: ``get_batch`` (one uint8 image tensor and an int64 label tensor) and ``BatchView`` (a
dataset whose items are batches), both through the batch pipeline with the batch's own rows as its slots."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

import numpy as np
import torch
from torch.utils.data import Dataset

from packer.errors import DatasetError, OptionError, arg
from packer.read.hints import aheads_of
from packer.read.pipeline import BatchPipeline
from packer.read.slots import Rows, new_batch

Layout = Literal["NHWC", "NCHW"]


def get_batch(pipeline: BatchPipeline, indices: Sequence[int], layout: Layout = "NHWC", sort: bool = False,
              out: torch.Tensor | None = None, fixed_shape: tuple[int, int, int] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples ``indices`` as one uint8 image tensor and an int64 label tensor; no transforms.

    Each image is decoded straight into its row of the batch, and raw pixels of the index's size are read straight
    into it (fixed-shape raw datasets, ``fixed_shape``: one copy). ``sort=True`` returns the samples in storage
    order (labels follow). All must share one shape. ``layout="NCHW"`` is a zero-copy channels-last view of the NHWC
    batch; ``out`` (e.g. a pinned NHWC uint8 tensor) receives the images instead of a new tensor.
    """
    root = pipeline.decoding.root
    if layout not in ("NHWC", "NCHW"):
        raise OptionError(f"unknown batch layout {layout!r} (choose NHWC or NCHW)")
    if not pipeline.images:
        raise OptionError(f"{root}: its samples have no image, so there is no image batch (read ds[i])")
    pos = pipeline.positions(indices)  # storage positions: reads, sizes and labels below are all by them
    if sort:
        pos = np.sort(pos, kind="stable")
    index = pipeline.source.index
    heights, widths = index.heights[pos], index.widths[pos]
    if fixed_shape is not None and (np.any(heights != fixed_shape[0]) or np.any(widths != fixed_shape[1])):
        raise DatasetError(f"{root}: shards say every image is {fixed_shape[0]}x{fixed_shape[1]}, the index "
                           "disagrees (damaged dataset)")
    shape = _one_shape(pipeline, heights, widths)
    images = out if out is not None or shape is None else new_batch((len(pos), *shape))
    if images is not None and shape is not None:
        _check_out(images, (len(pos), *shape))
    plan = pipeline.plan(pipeline.start(pos, aheads_of(indices)), memory=None if images is None else Rows(images),
                         output="pixels")
    pixels = pipeline.collect(plan)
    if images is None or plan.slots is None or plan.missed:  # decoded into arrays of their own: stacked here
        shapes = {p.shape for p in pixels}
        if len(shapes) > 1:
            raise _several_shapes(root, shapes)
        got = pixels[0].shape if pixels else (0, 0, 3)
        images = images if images is not None else new_batch((len(pos), *got))
        _check_out(images, (len(pos), *got))
        arr = images.numpy()
        for k, p in enumerate(pixels):
            arr[k] = p
    labels = torch.from_numpy(index.labels[pos].astype(np.int64))
    return (images.permute(0, 3, 1, 2) if layout == "NCHW" else images), labels


def _one_shape(pipeline: BatchPipeline, heights: np.ndarray, widths: np.ndarray) -> tuple[int, int, int] | None:
    """The (H, W, 3) every image of the batch decodes to, from the index (or the fused crop's size); None where it is
    not known before decoding (``decode_size``, sizes the index lacks, several)."""
    crop = pipeline.decoding.crop
    if crop is not None:
        return (int(crop.size[0]), int(crop.size[1]), 3)
    if pipeline.decoding.decode_size or not len(heights) or heights.min() < 1 or widths.min() < 1:
        return None
    shapes = {(int(h), int(w), 3) for h, w in zip(heights.tolist(), widths.tolist(), strict=True)}
    return shapes.pop() if len(shapes) == 1 else None  # several: decoded first, then refused (as a read error first)


def _several_shapes(root: str, shapes: set | list) -> OptionError:
    return OptionError(f"{root}: get_batch needs images of one shape, this batch has {len(shapes)} "
                       f"(e.g. {sorted(shapes)[:2]}); convert with {arg('payload', 'raw')} {arg('resize', 'HxW')}")


def _check_out(images: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(images.shape) != shape or images.dtype != torch.uint8 or not images.is_contiguous():
        raise OptionError(f"out: expected a contiguous uint8 tensor {shape}, got {images.dtype} {tuple(images.shape)}")


class Batches(Protocol):
    """A dataset that hands out whole batches (``PackedDataset``)."""

    def __len__(self) -> int: ...

    def get_batch(self, indices: Sequence[int], layout: Layout = "NHWC", sort: bool = False,
                  out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...


class BatchView(Dataset):
    """Items are batches: ``view[[i, j, ...]] -> (uint8 images, int64 labels)`` via ``get_batch(sort=True)``.

    Use with a ``BatchSampler`` as the loader's sampler and ``batch_size=None``::

        loader = DataLoader(ds.batched(), batch_size=None, num_workers=4, pin_memory=True,
                            sampler=BatchSampler(RandomSampler(ds), batch_size=256, drop_last=False))

    Each worker then reads a whole batch in one call; samples in a batch come in storage order, which training does
    not notice.
    """

    def __init__(self, dataset: Batches, layout: Layout = "NHWC") -> None:
        self.dataset = dataset
        self.layout: Layout = layout

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dataset.get_batch(indices, layout=self.layout, sort=True)
