"""``packer.collate``: DataLoader's default collate, except that images of different sizes become a list.

``default_collate`` stacks every tensor of a batch, so a plain ``DataLoader`` over photos of
different sizes (``image="tensor"`` or ``"numpy"`` without a resizing transform) fails with
"stack expects each tensor to be equal size", and PIL images fail outright. ``collate`` stacks
what has one shape, exactly as ``default_collate`` does (into shared memory inside a worker),
and hands out a list where shapes differ or the items are PIL images. Inside a worker, the
list's tensors are put in one shared block (as ``packer.read.batch.batch_slots`` decodes them),
so a batch crosses to the main process as one block rather than one per image.

Which modes stack: tensors and arrays of one shape (fixed-size datasets, or a transform that
crops or resizes to one size), numbers and labels. Lists: PIL images, tensors or arrays of
several shapes, strings and bytes as ``default_collate`` already does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import get_worker_info
from torch.utils.data._utils.collate import collate as _collate
from torch.utils.data._utils.collate import default_collate_fn_map

__all__ = ["collate"]


def _one_block(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors as views of one shared-memory block (one block per batch, not one per image)."""
    first = tensors[0].untyped_storage().data_ptr()
    if all(t.untyped_storage().data_ptr() == first for t in tensors) and tensors[0].is_shared():
        return list(tensors)  # already one shared block (batch_slots decoded them there)
    dtype = tensors[0].dtype
    if any(t.dtype != dtype for t in tensors):
        return list(tensors)
    block = torch.empty(sum(t.numel() for t in tensors), dtype=dtype).share_memory_()
    out, start = [], 0
    for t in tensors:
        view = block[start:start + t.numel()].view(t.shape)
        view.copy_(t)
        out.append(view)
        start += t.numel()
    return out


def _tensors(batch: Sequence[torch.Tensor], *, collate_fn_map: dict | None = None) -> Any:
    shape = batch[0].shape
    if all(t.shape == shape for t in batch):
        return default_collate_fn_map[torch.Tensor](batch, collate_fn_map=collate_fn_map)
    if get_worker_info() is not None and all(t.device.type == "cpu" for t in batch):
        return _one_block(batch)
    return list(batch)


def _arrays(batch: Sequence[np.ndarray], *, collate_fn_map: dict | None = None) -> Any:
    shape = batch[0].shape
    if all(a.shape == shape for a in batch):
        return default_collate_fn_map[np.ndarray](batch, collate_fn_map=collate_fn_map)
    # as default_collate does for arrays of one shape: tensors (read-only views copied, torch needs writable memory)
    return _tensors([torch.from_numpy(a if a.flags.writeable else a.copy()) for a in batch])


def _images(batch: Sequence[Image.Image], *, collate_fn_map: dict | None = None) -> list[Image.Image]:
    return list(batch)


COLLATE_FN_MAP: dict[type | tuple[type, ...], Callable] = {
    **default_collate_fn_map,
    torch.Tensor: _tensors,
    np.ndarray: _arrays,
    Image.Image: _images,
}


def collate(batch: Sequence[Any]) -> Any:
    """``default_collate``, with a list where images differ in shape or are PIL images (module doc).

    ``DataLoader(ds, batch_size=64, collate_fn=packer.collate)``: samples ``(image, label)`` give
    ``(images, labels)`` with ``labels`` an int64 tensor and ``images`` a stacked tensor or a list.
    Tuples, lists and dicts of fields collate field by field, as ``default_collate`` does.
    """
    return _collate(batch, collate_fn_map=COLLATE_FN_MAP)
