"""What a sample is made of when a dataset has fields: ``open_dataset(p, fields=...)``.

``None`` (the default): ``(image, label)`` as ImageFolder. A sequence of names (``("image", "label",
"boxes")``): a tuple in that order. ``"all"``: a dict of the image, the label and every field.
A dataset without images (a Writer's samples of fields alone, payload ``none``): by default ``(fields, label)``,
``fields`` a dict of every field (what ``transform`` is given, as DatasetFolder's ``(sample, target)``); names
and ``"all"`` as above without ``"image"``.
Field values come from ``layout.fields.FieldStore`` (int, float, str, parsed JSON, bytes, numpy arrays);
ragged arrays differ in shape from sample to sample, so batch them with ``packer.collate`` (a list).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from packer.errors import OptionError
from packer.layout.fields import FieldStore

FieldsArg = Sequence[str] | Literal["all"] | None


class FieldSelection:
    """The names a sample holds and how it is shaped (tuple, or dict for ``"all"``)."""

    def __init__(self, fields: FieldsArg, store: FieldStore, where: object, images: bool = True,
                 transform: object = None, crop: object = None) -> None:
        """``images``: whether the dataset's samples have one; without, ``crop`` and (with ``fields``) ``transform``
        have nothing to apply to and are refused."""
        if not images and (crop is not None or (transform is not None and fields is not None)):
            raise OptionError(f"{where}: its samples have no image: {'crop=' if crop is not None else 'transform='}"
                              " has nothing to apply to (transform= is given the fields dict with fields=None)")
        self.as_dict = fields == "all"
        self.images = images
        own = ("image", "label", *store.specs) if images else ("label", *store.specs)
        if fields is None:
            self.names: tuple[str, ...] | None = None
        elif isinstance(fields, str) and fields != "all":
            raise OptionError(f"fields={fields!r}: expected 'all' or a sequence of names such as ('image', 'label')")
        else:
            names = own if fields == "all" else tuple(fields)
            for name in names:
                if name not in own:
                    why = " (its samples have no image)" if name == "image" and not images else ""
                    raise OptionError(f"{where}: no field {name!r}{why} (this dataset has {', '.join(own)})")
            self.names = names

    def inputs(self, store: FieldStore, pos: int, where: str) -> dict[str, Any] | None:
        """What stands in the image's place in a sample without one: every field, by name (None with ``fields=``,
        which names what the sample holds)."""
        if self.names is not None:
            return None
        return {name: store.value(name, pos, where) for name in store.specs}

    def sample(self, store: FieldStore, pos: int, image: Any, target: Any, where: str) -> Any:
        """The sample at storage position ``pos`` as this selection shapes it."""
        if self.names is None:
            return image, target
        values = [image if n == "image" else target if n == "label" else store.value(n, pos, where)
                  for n in self.names]
        return dict(zip(self.names, values)) if self.as_dict else tuple(values)
