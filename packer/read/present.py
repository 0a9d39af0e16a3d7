"""How a decoded sample is handed out: the image kind (PIL, numpy, tensor), the transforms, the fields it holds."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image

from packer.errors import OptionError
from packer.layout.fields import FieldStore
from packer.layout.index import Index
from packer.read.fields import FieldSelection

ImageKind = Literal["pil", "numpy", "tensor"]


class Presenter:
    """A dataset's ``image``, ``transform``, ``target_transform`` and field selection over its labels and fields
    (storage order); ``ds.transform = ...`` sets them here."""

    def __init__(self, image: ImageKind, transform: Callable | None, target_transform: Callable | None,
                 selection: FieldSelection, fields: FieldStore, index: Index, root: str) -> None:
        if image not in ("pil", "numpy", "tensor"):
            raise OptionError(f"unknown image kind {image!r} (choose pil, numpy or tensor)")
        self.image: ImageKind = image
        self.transform, self.target_transform = transform, target_transform
        self.selection, self.fields, self.index, self.root = selection, fields, index, root

    @property
    def labels(self) -> np.ndarray:
        """The label of each sample (storage order): the index's, held through it (a URL dataset's index pickles
        as a reference, its arrays with it)."""
        return self.index.labels

    @property
    def pairs(self) -> bool:
        """Samples are ``(image, label)`` pairs (no ``fields=``)."""
        return self.selection.names is None

    @property
    def as_decoded(self) -> bool:
        """Images are handed out as decoded (CHW uint8 tensors, no transform): a batch slot's memory may be one."""
        return self.image == "tensor" and self.transform is None

    def one(self, pos: int, arr: np.ndarray | None, tensor: torch.Tensor | None = None) -> Any:
        """The sample stored at ``pos`` from its pixels ``arr`` (``tensor``: the same memory as a tensor already, its
        batch slot; ``arr`` None: a sample without an image, its fields dict in the image's place)."""
        if arr is None:
            img: Any = self.selection.inputs(self.fields, pos, self.root)
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
        target = int(self.labels[pos])
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return self.selection.sample(self.fields, pos, img, target, self.root)

    def many(self, positions: np.ndarray, arrs: Sequence[np.ndarray | None],
             tensors: Sequence[torch.Tensor | None]) -> list:
        """``one`` of each; plain pairs all in their slots in one pass."""
        if (tensors and tensors[0] is not None and self.image == "tensor" and self.transform is None
                and self.target_transform is None and self.selection.names is None
                and all(t is not None for t in tensors)):
            return [(t.permute(2, 0, 1), label)  # type: ignore[union-attr]
                    for t, label in zip(tensors, self.labels[positions].tolist(), strict=True)]
        return [self.one(p, a, t) for p, a, t in zip(positions.tolist(), arrs, tensors, strict=True)]
