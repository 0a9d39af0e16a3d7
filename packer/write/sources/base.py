"""How a source is read: ``SourceOptions`` (how SRC is read, recorded in the manifest) and the ``SourceReader``
that reads one record, by key and locator, in any process (``FileReader`` for files below a folder).

A reader is small and picklable: pool workers and Dask tasks get it with their records (write/sources/records.py),
and it opens its handles per process (``PerProcess``: fork and spawn safe).
"""

from __future__ import annotations

import errno
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from packer.argtypes import float_in
from packer.errors import DatasetError, PackerError, arg
from packer.layout.trust import open_regular
from packer.storage.url import is_url
from packer.write.options import declared, option

Payload = bytes | np.ndarray  # encoded bytes, or HWC uint8 pixels (a packed source of raw payloads)
Facts = list[int]  # two ints that change when a record's content may have: resume repacks a shard then


class RecordError(Exception):
    """One record can't be read; the message is the reason errors.json gives."""


class SourceReader(ABC):
    """Reads records of one source by (key, locator); picklable, opening nothing until used in a process."""

    sequential: ClassVar[bool] = False  # True: records can only be read in scan order (a compressed tar)
    gives_pixels: bool = False  # True: read() gives HWC pixels (a packed dataset of raw payloads): raw output only
    holds_images: bool = True  # False: records of fields alone (a packed dataset of payload none): none output only
    admitted_where_read: ClassVar[bool] = False  # True: a Dask task admits its own records (objects each worker
    # fetches from the store itself), not the driver

    @abstractmethod
    def read(self, rel: str, loc: Any) -> tuple[Payload, Facts | None]:
        """The record's payload and its facts as read; ``RecordError`` when it can't be read."""

    @abstractmethod
    def facts(self, rel: str, loc: Any) -> Facts | None:
        """The record's facts now (None: gone), compared by ``--resume`` with those recorded when read."""

    def admitted(self, records: Iterable[tuple[str, int, Any]]) -> Iterator[tuple[str, int, Any]]:
        """The (key, label, locator) records in the order given, each once it may be handed to a reader in another
        process (a pool worker, a Dask task); default: at once, as they are. A packed dataset yields each once its
        shard has been checked against its manifest here, the verdict in its locator: the workers then read
        without hashing the shard again each."""
        return iter(records)

    def read_in_order(self, records: Iterable[tuple[str, Any]]) -> Iterator[tuple[Payload, Facts | None] | RecordError]:
        """Each record of ``records`` (in scan order), or the RecordError it gave; sequential readers stream."""
        for rel, loc in records:
            try:
                yield self.read(rel, loc)
            except RecordError as exc:
                yield exc

    def size(self, rel: str, loc: Any) -> int | None:
        """The record's stored size in bytes where known without reading it (None: read it to know)."""
        return None

    def location(self, rel: str, loc: Any) -> str:
        """Where the record is, for errors.json ("labels.csv line 12", "x.tar: member a/b.jpg"); "": the key says."""
        return ""

    def missing(self) -> str | None:
        """Why this process can't see the source (a Dask worker without the shared storage), or None."""
        return None

    def close(self) -> None:
        """Drop this process's open handles."""



def read_one_in_order(reader: SourceReader, rel: str, loc: Any) -> tuple[Payload, Facts | None]:
    """``read`` for readers that only stream (``sequential``): the record through ``read_in_order``."""
    res = next(iter(reader.read_in_order([(rel, loc)])))
    if isinstance(res, RecordError):
        raise res
    return res

class FileReader(SourceReader):
    """Files below ``root`` (a folder, or a list file's ``--root``); ``listing``: the list file's name, if any."""

    def __init__(self, root: Path, listing: str = "") -> None:
        self.root, self.listing = root, listing

    def read(self, rel: str, loc: Any) -> tuple[Payload, Facts | None]:
        path = os.path.join(self.root, rel)  # not pathlib: this runs once per file, in the workers
        try:
            data, facts = read_source(path)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise RecordError(f"symbolic link loop ({exc.strerror})") from None
            if not os.path.exists(path) and os.path.islink(path):
                raise RecordError("broken symbolic link") from None
            raise RecordError(f"cannot read: {exc.strerror or exc}") from None
        return data, facts

    def facts(self, rel: str, loc: Any) -> Facts | None:
        try:
            st = os.stat(self.root / rel)
        except OSError:
            return None
        return [st.st_size, st.st_mtime_ns]

    def size(self, rel: str, loc: Any) -> int | None:
        try:
            return os.stat(self.root / rel).st_size
        except OSError:
            return None

    def location(self, rel: str, loc: Any) -> str:
        return f"{self.listing} line {loc}" if self.listing and loc is not None else ""

    def missing(self) -> str | None:
        return None if self.root.is_dir() else f"cannot see the source folder {self.root}"


def read_source(path: str | os.PathLike) -> tuple[bytes, list[int]]:
    """The whole file and its [size, mtime_ns] as read; OSError for a special file or one that changes meanwhile.

    Opened by ``open_regular`` (a FIFO would block forever); a change of size or mtime during the
    read means the bytes may mix two versions, so they are refused rather than packed.
    """
    fd, st = open_regular(path)
    try:
        data = _read_all(fd, st.st_size)
        after = os.fstat(fd)
    finally:
        os.close(fd)
    if len(data) != st.st_size and st.st_size != 0:
        raise OSError(errno.EAGAIN, f"changed while being read ({st.st_size} bytes, then {len(data)})")
    if (after.st_size, after.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
        raise OSError(errno.EAGAIN, "changed while being read (modified meanwhile)")
    return data, [st.st_size, st.st_mtime_ns]


def _read_all(fd: int, size: int) -> bytes:
    """Up to ``size + 1`` bytes of ``fd`` (one more than stat said shows a file that grew) in as few ``read``
    calls as the kernel allows; everything up to EOF where stat says 0 (files of /proc and the like)."""
    parts, got = [], 0
    want = size + 1 if size else 1 << 20
    while chunk := os.read(fd, want - got if size else want):
        parts.append(chunk)
        got += len(chunk)
        if size and got >= want:
            break
    return parts[0] if len(parts) == 1 else b"".join(parts)  # b"" for an empty file


MAX_LIST_BYTES = 4 << 30  # a list of ~50 million rows; beyond that it is not a list file


def read_list_text(path: Path) -> str:
    """A list file or a ``--classes-file`` as text (UTF-8, a BOM dropped); a PackerError naming it when it is
    too large, not text or unreadable."""
    try:
        size = path.stat().st_size
        if size > MAX_LIST_BYTES:
            raise DatasetError(f"{path}: {size} bytes is too large for a list file")
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: not UTF-8 text (byte {exc.start}): not a list file") from None
    except OSError as exc:
        raise PackerError(f"{path}: cannot read ({exc.strerror or exc})") from None


class InlineReader(SourceReader):
    """Records whose locator carries what a sequential reader read in the driver: ``(payload, facts, error)``."""

    def read(self, rel: str, loc: Any) -> tuple[Payload, Facts | None]:
        payload, facts, error = loc
        if error is not None:
            raise RecordError(error)
        return payload, facts

    def facts(self, rel: str, loc: Any) -> Facts | None:
        return loc[1]


@dataclass(frozen=True)
class SourceOptions:
    """How to read SRC, recorded in the manifest (``record``) so ``verify --against`` reads it the same way; each
    field given to ``convert`` as its keyword (write/options.py's ``option``)."""

    type: str | None = option(None, "read SRC as this kind of source (default: chosen by what SRC is; "
                              "docs/sources.md)", keyword="source_type")
    root: str | None = option(None, "list files: the folder the paths they list are relative to (default: the list "
                              "file's folder)", metavar="DIR", accepts="str | os.PathLike | None")
    path_column: str | None = option(None, "list files with a header: the column of image paths (default path)",
                                     metavar="NAME")
    label_column: str | None = option(None, "list files with a header, Hugging Face datasets: the column of labels, "
                                      "integers or class names (default label)", metavar="NAME")
    classes_file: str | None = option(None, "list files with integer labels: the class names, one a line, line i "
                                      "naming label i (default: the labels themselves, 0..max)", metavar="FILE",
                                      accepts="str | os.PathLike | None")
    classes: tuple[str, ...] | None = option(None, "keep only these classes (names, or one comma-separated string), "
                                             "renumbered as ImageFolder numbers a folder holding only them (sorted "
                                             "names)", metavar="A,B,C", accepts="Sequence[str] | str | None")
    split: float | None = option(None, f"write OUT-train and OUT-val: per class a seeded ({arg('seed')}) FRACTION of "
                                 "the records goes to train, the rest to val", metavar="FRACTION",
                                 parse=float_in(0.0, 1.0, above=True, below=True))
    split_seed: int = 0
    part: str | None = None  # "train" or "val": which part of --split this output holds
    label_key: str | None = option(None, "WebDataset shards: the label is this field of each sample's json member "
                                   "(default: its cls member)", metavar="FIELD")
    image_column: str | None = option(None, "Hugging Face datasets: the Image column (default image)", metavar="NAME")

    @classmethod
    def given(cls, **keywords: Any) -> SourceOptions:
        """The options from ``convert``'s keywords (their declared names; paths made absolute: the manifest records
        them; ``classes`` also as one comma-separated string)."""
        fields_of = {d.keyword: d.field for d in declared(cls)}
        values = {fields_of[k]: v for k, v in keywords.items()}
        for name in ("root", "classes_file"):  # a URL (an object-storage prefix) as it is
            if values.get(name) is not None and not is_url(values[name]):
                values[name] = os.path.abspath(values[name])
        classes = values.get("classes")
        if isinstance(classes, str):
            classes = [c for c in classes.split(",") if c]
        if classes is not None:
            values["classes"] = tuple(str(c) for c in classes)
        return cls(**values)

    def record(self) -> dict[str, Any]:
        """JSON-able, without unset entries (a folder conversion records {"type": "folder"})."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items() if v is not None
                and not (k == "split_seed" and self.split is None)}

    @classmethod
    def from_record(cls, record: dict[str, Any], where: object = "manifest") -> SourceOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(record) - known)
        if unknown:
            raise DatasetError(f"{where}: unknown source option(s) {', '.join(unknown)}")
        given = dict(record)
        if given.get("classes") is not None:
            given["classes"] = tuple(str(c) for c in given["classes"])
        return cls(**given)
