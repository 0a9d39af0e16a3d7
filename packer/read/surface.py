"""The attributes other libraries read from an ImageFolder, in one place for every packer dataset.

torchvision's ``ImageFolder``/``DatasetFolder``/``VisionDataset`` (``targets``, ``samples``/``imgs``,
``find_classes``, ``loader``, ``extensions``, ``transforms``) and timm's ``ImageDataset``
(``filename``, ``filenames``), all in ImageFolder's sample order (packer.read.indexing), plus the
context manager. ``samples`` are ImageFolder's paths: ``os.path.join(source_root, relative path)``,
with the source folder recorded at conversion (``source_root=`` when the data moved); ``relpaths``
are the paths relative to it. ``root`` stays the packed dataset's directory (readers, workers and
messages rely on it); ImageFolder's ``root`` is ``source_root``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from functools import cached_property, partial
from typing import Any, Literal, overload

import numpy as np
from torch.utils.data import Dataset

from packer.errors import IndexingWarning, NotPackedError, PackerError
from packer.images.decode import pil_loader
from packer.layout.fields import FieldStore
from packer.layout.index import Index, normalize_index, normalize_indices
from packer.layout.manifest import IMAGELESS, Manifest
from packer.layout.report import ERRORS_NAME, entry_of
from packer.read.indexing import SUBSET, IndexMap, source_item, why_left_out
from packer.read.present import ImageKind, Presenter


class StandardTransform:
    """torchvision's ``StandardTransform``: ``transform`` on the input, ``target_transform`` on the target."""

    def __init__(self, transform: Callable | None = None, target_transform: Callable | None = None) -> None:
        self.transform = transform
        self.target_transform = target_transform

    def __call__(self, input: Any, target: Any) -> tuple[Any, Any]:
        if self.transform is not None:
            input = self.transform(input)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return input, target

    def __repr__(self) -> str:
        parts = [f"Transform: {self.transform!r}"] if self.transform is not None else []
        if self.target_transform is not None:
            parts.append(f"Target transform: {self.target_transform!r}")
        return "\n".join([type(self).__name__, *parts])


class FolderSurface(Dataset):
    """ImageFolder's and timm's read-only surface over ``manifest``, ``index``, ``index_map`` and ``source_root``, and
    ImageFolder's ``transform``/``target_transform`` (with ``image``, settings of how samples are handed out).

    Public indices are ImageFolder's (packer.read.indexing); ``position``/``positions`` map them to storage
    positions, which ``index``, the pipeline, read-ahead and blocks work in.
    """

    root: Any  # the packed dataset's directory (ImageFolder's root, the source folder, is source_root)
    manifest: Manifest
    index: Index  # per-sample metadata in storage order: labels, sizes, source paths
    index_map: IndexMap
    classes: list[str]
    class_to_idx: dict[str, int]
    field_store: FieldStore  # the per-sample fields, in storage order (layout/fields.py)
    source_root: str | None  # the converted folder (absolute), None where the dataset does not record it
    presenter: Presenter  # how samples are handed out (packer.read.present)
    loader = staticmethod(pil_loader)  # ImageFolder's default_loader: a path -> an RGB PIL image
    _warned_relative = False

    def __len__(self) -> int:
        return self.manifest.num_samples

    def close(self) -> None:
        """Release what the dataset holds open (shards, a cache); reading again reopens."""

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def transform(self) -> Callable | None:
        """Called on each image, as ImageFolder's ``transform`` (settable)."""
        return self.presenter.transform

    @transform.setter
    def transform(self, fn: Callable | None) -> None:
        self.presenter.transform = fn

    @property
    def target_transform(self) -> Callable | None:
        """Called on each label, as ImageFolder's ``target_transform`` (settable)."""
        return self.presenter.target_transform

    @target_transform.setter
    def target_transform(self, fn: Callable | None) -> None:
        self.presenter.target_transform = fn

    @property
    def image(self) -> ImageKind:
        """What an image is: ``"pil"``, ``"numpy"`` or ``"tensor"``."""
        return self.presenter.image

    @property
    def has_images(self) -> bool:
        """False for a dataset of samples without an image (a Writer's fields and labels alone, payload ``none``):
        nothing is read or decoded, and a sample is ``(fields, label)`` (packer.read.fields)."""
        return self.manifest.payload != IMAGELESS

    @property
    def indexing(self) -> str:
        """``"imagefolder"``: ``ds[i]`` is ImageFolder's sample i; ``"subset"``: some source records were not
        packed, ``ds[i]`` is ImageFolder's sample ``ds.imagefolder_index(i)``; ``"stored"``: the i-th stored sample
        (a dataset written before packer recorded the map). packer.read.indexing."""
        return self.index_map.kind

    def check_index(self, i: int) -> int:
        """``i`` as a position in ``range(len(self))`` (negative from the end), else IndexError."""
        return normalize_index(i, len(self))

    def position(self, i: int) -> int:
        """Where sample ``i`` (a public index, negative from the end) is stored; IndexError out of range."""
        return self.index_map.stored(self.check_index(i))

    def positions(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Where these samples (public indices) are stored."""
        return self.index_map.stored_many(normalize_indices(indices, len(self)))

    @property
    def targets(self) -> list[int]:
        """Each sample's class index, in ImageFolder's order."""
        return self.index_map.in_public_order(self.index.labels).tolist()

    @property
    def relpaths(self) -> list[str]:
        """Each sample's path relative to the converted folder (POSIX separators), in ImageFolder's order."""
        rel = self.index.rel_paths()
        if self.index_map.identity:
            return rel
        return [rel[p] for p in self.index_map.stored_many(np.arange(len(rel))).tolist()]

    @property
    def samples(self) -> list[tuple[str, int]]:
        """ImageFolder's ``(path, class index)`` pairs: ``os.path.join(source_root, relpath)``.

        A dataset that does not record its source folder gives relative paths, and warns once.
        """
        root = self._root_or_warn()
        rel = self.relpaths
        paths = rel if root is None else [os.path.join(root, r) for r in rel]
        return list(zip(paths, self.targets))

    imgs = samples

    @property
    def extensions(self) -> tuple[str, ...] | None:
        """The file name endings the conversion's scan took (ImageFolder's ``IMG_EXTENSIONS``); None where
        the dataset does not record them (written before packer did)."""
        return tuple(self.manifest.extensions) or None

    @property
    def transforms(self) -> StandardTransform | None:
        """VisionDataset's joint transform: ``transform`` and ``target_transform`` as one callable, or None."""
        if self.transform is None and self.target_transform is None:
            return None
        return StandardTransform(self.transform, self.target_transform)

    @property
    def field_specs(self) -> dict[str, str]:
        """The dataset's per-sample fields: name -> spec (``"str"``, ``"float32[:,4]"``, ...; docs/fields.md)."""
        return self.field_store.texts

    def field(self, name: str, index: int) -> Any:
        """Field ``name`` of sample ``index`` (ImageFolder's index), without reading or decoding the image."""
        return self.field_store.value(name, self.index_map.stored(self.check_index(index)), str(self.root))

    # ------------------------------------------------------------ the source's numbering (packer.read.indexing)

    @overload
    def imagefolder_index(self, index: int) -> int: ...
    @overload
    def imagefolder_index(self, index: Sequence[int] | np.ndarray) -> list[int]: ...

    def imagefolder_index(self, index: int | Sequence[int] | np.ndarray) -> int | list[int]:
        """The source's index of sample ``index`` (or of each): ``ds[i]`` is ``ImageFolder(source)[j]`` for
        ``j = ds.imagefolder_index(i)`` (a list file's row, an archive's member, ...). ``i`` itself when every
        source record was packed; a PackerError for an older dataset with files left out (it does not record them).
        """
        if isinstance(index, (Sequence, np.ndarray)):
            return self.index_map.source_many(normalize_indices(index, len(self))).tolist()
        return int(self.index_map.source_many(np.asarray([self.check_index(index)]))[0])

    @overload
    def from_imagefolder(self, index: int, missing: Literal["raise", "skip"] = "raise") -> int: ...
    @overload
    def from_imagefolder(self, index: Sequence[int] | np.ndarray,
                         missing: Literal["raise", "skip"] = "raise") -> list[int]: ...

    def from_imagefolder(self, index: int | Sequence[int] | np.ndarray,
                         missing: Literal["raise", "skip"] = "raise") -> int | list[int]:
        """The dataset index of the source's sample ``index`` (``ImageFolder(source)[index]``), or of each: what a
        saved ImageFolder split or ``Subset`` indices become here. A source sample that was not packed raises
        ``NotPackedError`` (a PackerError and LookupError) naming its file and errors.json reason; ``missing="skip"``
        leaves such samples out of a sequence instead. IndexError outside ``range(ds.source_records)``."""
        if missing not in ("raise", "skip"):
            raise PackerError(f"missing={missing!r}: choose 'raise' or 'skip'")
        if isinstance(index, (Sequence, np.ndarray)):
            single, numbers = False, normalize_indices(index, self.source_records)
        else:
            single, numbers = True, np.asarray([normalize_index(index, self.source_records)], dtype=np.int64)
        found = self.index_map.from_source_many(numbers)
        holes = np.flatnonzero(found < 0)
        if len(holes) and (single or missing == "raise"):
            raise NotPackedError(self._not_packed(int(numbers[holes[0]])))
        return int(found[0]) if single else found[found >= 0].tolist()

    @property
    def source_records(self) -> int:
        """How many records the source numbers (``ImageFolder(source)``'s length): the packed ones and those
        left out (damaged, ``--classes``, ``--split``); ``len(ds)`` when every one was packed."""
        return self.index_map.num_records()

    def _not_packed(self, number: int) -> str:
        """Why the source's record ``number`` is not in this dataset: its errors.json entry, or the selection."""
        where = f"{self.root}: {source_item(self.manifest.source_type, str(number))} was not packed"
        try:
            entry = entry_of(self.root, number)
        except PackerError as exc:
            return f"{where} ({exc})"
        if entry is not None:  # errors.json is untrusted text: shown on one line
            path, reason, loc = (str(entry.get(k, "")).replace("\n", "\\n") for k in ("path", "reason", "location"))
            return f"{where}: {path}{f', {loc}' if loc else ''}: {reason} (see {ERRORS_NAME})"
        chosen, picked = self.manifest.source_options, []  # as recorded (a crafted manifest: only shown)
        if isinstance(chosen.get("classes"), list):
            picked.append(f"--classes {','.join(map(str, chosen['classes']))}")
        if chosen.get("split") is not None:
            picked.append(f"--split {chosen['split']} ({chosen.get('part', 'train')} part)")
        why = f"left out by {' and '.join(picked)}" if picked else "not listed in errors.json"
        return f"{where}: {why}" + (" (or by the conversion of the dataset it was re-packed from)"
                                    if self.manifest.source_type == "packed" else "")

    def warn_if_subset(self, stacklevel: int = 2) -> None:
        """One ``IndexingWarning`` when ``ds[i]`` is not ``ImageFolder(source)[i]`` (some records not packed)."""
        if self.index_map.kind != SUBSET:
            return
        item = partial(source_item, self.manifest.source_type)
        why = why_left_out(self.manifest)
        if not self.index_map.known:
            text = (f"the samples are the packed ones in the source's order ({why}), so ds[i] is not {item('i')}; "
                    "their source indices are not recorded (converted by an older packer): convert again to map them")
        else:
            text = (f"{self.source_records - len(self):,} of the source's {self.source_records:,} records are not in "
                    f"this dataset ({why}), so ds[i] is {item('ds.imagefolder_index(i)')}, not {item('i')}; map "
                    "saved source indices with ds.from_imagefolder(j)")
        warnings.warn(f"{self.root}: {text}", IndexingWarning, stacklevel=stacklevel + 1)

    def find_classes(self, directory: str | os.PathLike | None = None) -> tuple[list[str], dict[str, int]]:
        """DatasetFolder's ``(classes, class_to_idx)``: the classes the source had at conversion (from the
        manifest; ``directory`` is accepted for the signature, nothing is scanned)."""
        classes = list(self.manifest.classes)
        return classes, {c: i for i, c in enumerate(classes)}

    @cached_property
    def _index_of_relpath(self) -> dict[str, int]:
        return {p: i for i, p in enumerate(self.relpaths)}

    def index_of(self, path: str | os.PathLike) -> int:
        """The index of the sample packed from ``path``: relative to the converted folder, or a ``samples`` path."""
        key = os.fspath(path)
        if os.path.isabs(key) and self.source_root is not None:
            rel = os.path.relpath(key, self.source_root)
            key = key if rel.startswith("..") else rel.replace(os.sep, "/")
        try:
            return self._index_of_relpath[key]
        except KeyError:
            raise KeyError(f"{os.fspath(path)!r} is not a sample of {self.root}") from None

    def filename(self, index: int, basename: bool = False, absolute: bool = False) -> str:
        """timm's ``ImageDataset.filename``: the sample's path relative to the source folder, its file
        name (``basename``) or its full path (``absolute``: as in ``samples``)."""
        return self._filename(self.relpaths[self.check_index(index)], basename, absolute)

    def filenames(self, basename: bool = False, absolute: bool = False) -> list[str]:
        """timm's ``ImageDataset.filenames``: ``filename`` of every sample, in order."""
        return [self._filename(r, basename, absolute) for r in self.relpaths]

    def _filename(self, rel: str, basename: bool, absolute: bool) -> str:
        if basename:
            return os.path.basename(rel)
        if absolute:
            root = self._root_or_warn()
            return rel if root is None else os.path.join(root, rel)
        return rel

    def _root_or_warn(self) -> str | None:
        if self.source_root is None and not self._warned_relative:
            self._warned_relative = True
            warnings.warn(f"{self.root}: samples are paths relative to the converted folder: the "
                          "dataset does not record that folder as an absolute path (converted by an older packer); "
                          "open it with source_root=FOLDER for ImageFolder's paths", stacklevel=3)
        return self.source_root
