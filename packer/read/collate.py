"""``packer.collate``: DataLoader's default collate, except that images of different sizes become a list.

What has one shape is stacked exactly as ``default_collate`` does (into shared memory inside a worker); PIL images and
tensors or arrays of several shapes come as a list (inside a worker, in one shared block: packer.read.slots).
A batch of several shapes that ``__getitems__`` hands out in a worker is marked (``MixedShapes``, a tuple;
``MixedShapesDict``, a dict) so that torch's ``default_collate`` meets it through its documented extension point
(``default_collate_fn_map``) and raises a PackerError naming ``collate_fn=packer.collate`` instead of "Trying to
resize storage that is not resizable" (docs/guarantees.md).
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

from packer.errors import PackerError

__all__ = ["MixedShapes", "MixedShapesDict", "collate", "mark_mixed_shapes"]


def _one_block(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors as views of one shared-memory block (one block per batch, not one per image)."""
    first = tensors[0].untyped_storage().data_ptr()
    if all(t.untyped_storage().data_ptr() == first for t in tensors) and tensors[0].is_shared():
        return list(tensors)  # already one shared block (decoded there: packer.read.slots)
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


class MixedShapes(tuple):
    """A sample of a batch whose tensors differ in shape from sample to sample (module doc); a tuple otherwise."""

    __slots__ = ()

    def __reduce__(self) -> tuple:
        return tuple, (tuple(self),)  # crosses to another process as the plain tuple it stands for


class MixedShapesDict(dict):
    """``MixedShapes`` for samples that are dicts (``fields="all"``)."""

    def __reduce__(self) -> tuple:
        return dict, (dict(self),)


def _shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, (torch.Tensor, np.ndarray)) else None


def mark_mixed_shapes(samples: list) -> list:
    """``samples`` as they are, or, inside a DataLoader worker when some element holds tensors or arrays of several
    shapes across them (photos of several sizes), each marked so that torch's default collate names the fix
    instead of failing obscurely."""
    if len(samples) < 2 or get_worker_info() is None:
        return samples
    first = samples[0]
    if isinstance(first, tuple) and all(isinstance(s, tuple) and len(s) == len(first) for s in samples):
        columns = range(len(first))
        mixed = any(len({_shape(s[k]) for s in samples}) > 1 and _shape(first[k]) is not None for k in columns)
        return [MixedShapes(s) for s in samples] if mixed else samples
    if isinstance(first, dict) and all(isinstance(s, dict) and s.keys() == first.keys() for s in samples):
        mixed = any(len({_shape(s[k]) for s in samples}) > 1 and _shape(first[k]) is not None for k in first)
        return [MixedShapesDict(s) for s in samples] if mixed else samples
    return samples


def _refuse_mixed(batch: Sequence[Any], *, collate_fn_map: dict | None = None) -> Any:
    """torch's default collate of marked samples: a PackerError naming the shapes and the fix."""
    first = batch[0]
    keys = list(first) if isinstance(first, dict) else list(range(len(first)))
    for k in keys:
        shapes = sorted({shape for s in batch if (shape := _shape(s[k])) is not None})
        if len(shapes) > 1:
            where = f"field {k!r}" if isinstance(first, dict) else ("the images" if k == 0 else f"element {k}")
            shown = ", ".join("x".join(map(str, sh)) for sh in shapes[:3]) + (" ..." if len(shapes) > 3 else "")
            raise PackerError(f"torch's default collate cannot stack {where} of this batch: {len(shapes)} "
                              f"different shapes ({shown}); pass DataLoader(..., collate_fn=packer.collate) for a "
                              "list where shapes differ, or a transform that resizes or crops to one size")
    return _collate([tuple(s) if isinstance(s, tuple) else dict(s) for s in batch], collate_fn_map=collate_fn_map)


def collate(batch: Sequence[Any]) -> Any:
    """``default_collate``, with a list where images differ in shape or are PIL images (module doc).

    ``DataLoader(ds, batch_size=64, collate_fn=packer.collate)``: samples ``(image, label)`` give
    ``(images, labels)`` with ``labels`` an int64 tensor and ``images`` a stacked tensor or a list.
    Tuples, lists and dicts of fields collate field by field, as ``default_collate`` does.
    """
    return _collate(batch, collate_fn_map=COLLATE_FN_MAP)


# torch's documented extension point of default_collate (after COLLATE_FN_MAP is made: packer.collate stacks them)
default_collate_fn_map[MixedShapes] = _refuse_mixed
default_collate_fn_map[MixedShapesDict] = _refuse_mixed
