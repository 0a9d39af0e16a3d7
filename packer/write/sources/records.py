"""What a source gives: the ``Source`` interface (does SRC look like it, scan it) and its record list.

A scan (``ScanResult``) holds per record a key (``rel_paths``: what ``ds.samples``, ``extract`` and errors.json
show), a label and a locator (``locs``: what the reader needs beside the key, e.g. a tar member's offset and
size), plus the classes, what was ignored and the errors found while scanning (``SourceError``). Its reader
(write/sources/base.py) travels with the records to pool workers and Dask tasks.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from packer.write.sources.base import FileReader, SourceOptions, SourceReader


@dataclass
class SourceError:
    """A source record that was not packed, or a part of the source that could not be read, and why: one entry
    of errors.json. Summaries count records only (``record``): a folder, a link loop that is no image file or the
    unread rest of an archive is listed, never counted as a file."""

    path: str  # relative to the source folder; a folder's ends with "/"
    reason: str
    location: str = ""  # where in the source when the path does not say it ("labels.csv line 12"); "": left out
    index: int | None = None  # the record's number in the source's numbering (ScanResult.numbers); None: it has none
    record: bool = True  # False: stands for no one record (a folder, a link loop, the rest of an archive)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "reason": self.reason, **({"location": self.location} if self.location else {}),
                **({"index": self.index} if self.index is not None else {}),
                **({} if self.record else {"record": False})}

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> SourceError:
        """An entry of errors.json or a journal; one written before ``record`` existed: a folder ("/") is none."""
        path = str(entry["path"])
        record = entry.get("record", not path.endswith("/"))
        index = entry.get("index")
        return cls(path, str(entry["reason"]), str(entry.get("location", "")),
                   index if isinstance(index, int) and not isinstance(index, bool) else None, record is not False)


@dataclass
class Walk:
    """What walking a folder tree found: image paths in ImageFolder order, and what was left out."""

    files: list[str] = field(default_factory=list)  # POSIX-style, relative to the scanned root
    ignored: Counter = field(default_factory=Counter)  # reason -> count
    errors: list[SourceError] = field(default_factory=list)
    unlisted: list[str] = field(default_factory=list)  # folders that could not be listed (in errors too)
    not_images: Counter = field(default_factory=Counter)  # of the files without an image name: suffix -> count

    def add(self, other: Walk) -> None:
        self.files.extend(other.files)
        self.ignored.update(other.ignored)
        self.not_images.update(other.not_images)
        self.errors.extend(other.errors)
        self.unlisted.extend(other.unlisted)


ClassMapper = Callable[[list[tuple[str, str]]], Iterable[Walk]]  # walks class folders elsewhere (a Dask cluster)


@dataclass
class ScanResult:
    """The records of one source (a folder's images in ImageFolder order; see write/sources/base.py)."""

    root: Path
    classes: list[str]
    rel_paths: list[str]  # POSIX-style, relative to root
    labels: np.ndarray  # int64, -1 for a flat folder
    ignored: Counter = field(default_factory=Counter)  # reason -> count
    errors: list[SourceError] = field(default_factory=list)  # folders and names the scan could not follow
    unlisted: list[str] = field(default_factory=list)  # folders that could not be listed: their files are unknown
    not_images: Counter = field(default_factory=Counter)  # files ignored as "not an image", by suffix (".txt")
    reader: SourceReader | None = None  # None: files below root (a folder)
    locs: list[Any] | None = None  # per record, what the reader needs beside its key (None: the key alone)
    field_specs: dict[str, str] = field(default_factory=dict)  # per-sample fields the records carry: name -> spec
    fields: dict[str, list[Any]] = field(default_factory=dict)  # name -> per record, its cell (layout/fields.py)
    source_type: str = "folder"
    # The source's numbering (ImageFolder's index for a folder, the row of a list file, ...): per record its
    # number (None: 0..len-1), and how many records it numbers, those refused or left out included (None: len)
    numbers: np.ndarray | None = None
    source_records: int | None = None
    earlier: list[dict[str, Any]] = field(default_factory=list)  # errors.json entries a packed source carries
    url: str = ""  # a source at a URL: its URL (redacted), recorded as the source instead of ``root``
    held: Any = None  # what must live while the records are read: a local copy of objects (write/sources/spool.py)

    def source_name(self) -> str:
        """Where the source is, as a manifest records it: its URL, or the absolute path of its folder or file."""
        return self.url or os.path.abspath(self.root)

    def __len__(self) -> int:
        return len(self.rel_paths)

    def numbering(self) -> np.ndarray:
        """Each record's number in the source's numbering (int64): what ``ds.imagefolder_index`` gives back."""
        return np.arange(len(self), dtype=np.int64) if self.numbers is None else self.numbers

    @property
    def num_source_records(self) -> int:
        """How many records the source's numbering counts (packed, refused and left out)."""
        return len(self) if self.source_records is None else self.source_records

    def source_reader(self) -> SourceReader:
        return self.reader if self.reader is not None else FileReader(self.root)

    def loc(self, i: int) -> Any:
        return None if self.locs is None else self.locs[i]

    def records(self, a: int = 0, b: int | None = None) -> list[tuple[str, int, Any]]:
        """(key, label, locator) of records a..b-1: what a worker is given."""
        b = len(self) if b is None else b
        locs = self.locs[a:b] if self.locs is not None else [None] * (b - a)
        return list(zip(self.rel_paths[a:b], self.labels[a:b].tolist(), locs))

    def take(self, positions: Any) -> ScanResult:
        """The records at ``positions`` (an order, or a subset), everything per record kept in step."""
        pick = [int(i) for i in positions]
        at = np.asarray(pick, dtype=np.int64)
        return replace(self, rel_paths=[self.rel_paths[i] for i in pick], labels=self.labels[at],
                       numbers=self.numbering()[at], source_records=self.num_source_records,
                       locs=None if self.locs is None else [self.locs[i] for i in pick],
                       fields={k: [v[i] for i in pick] for k, v in self.fields.items()})

    def locator_of(self) -> dict[str, Any]:
        """key -> locator (for resume checks and error locations after the shards are written)."""
        return dict(zip(self.rel_paths, self.locs if self.locs is not None else [None] * len(self)))

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.classes)}


class Source(ABC):
    """One kind of input. ``claims`` says whether SRC looks like it; ``scan`` lists its records."""

    type: ClassVar[str]  # the --source-type name, recorded in the manifest

    def __init__(self, path: Path, options: SourceOptions, storage_options: Mapping[str, Any] | None = None) -> None:
        """``storage_options``: the object store's settings for what the source reads at a URL (credentials,
        endpoint; never recorded: ``options`` are, in the manifest)."""
        self.path, self.options, self.storage_options = path, options, storage_options

    @classmethod
    @abstractmethod
    def claims(cls, path: Path) -> bool:
        """Whether SRC at ``path`` is this kind of source (checked in registry order, without --source-type)."""

    def sequential(self) -> bool:
        """Whether the records can only be read in stored order (a compressed tar), known before the scan (which
        would inflate the whole archive), so that an order the source can't give is refused first."""
        return False

    @abstractmethod
    def scan(self, map_classes: ClassMapper | None = None, *, skip_hidden: bool = False,
             allow_empty: bool = False) -> ScanResult:
        """Every record, in a deterministic order, with ``reader`` set; a PackerError when SRC is unreadable.

        ``map_classes``: walks class folders elsewhere (a Dask cluster); ``skip_hidden``/``allow_empty``: the
        folder rules (write.scan); only the folder source uses them.
        """
