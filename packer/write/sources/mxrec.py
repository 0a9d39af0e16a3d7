"""MXNet RecordIO as a source: ``packer convert data.rec --to lmdb`` (layout: ``packer.formats.recordio``).

The records are those ``data.idx`` (beside the ``.rec``) lists, else those a walk of the record
magics finds. Keys: ``<rec name>/<idx key>``, or ``<rec name>/<IRHeader id>`` without an index. The
scan reads each record's header only (the IRHeader's label); workers read and check whole records.
Labels: a single float label (flag 0) becomes its integer when integral (``2.0`` -> 2; ``2.5`` is
an error); a label vector (flag k > 0) of one value is that value, a longer one is an error for its
record (packer keeps one class label per sample). All labels -1 (packer's own flat output): no
classes; else ``classes`` from ``--classes-file`` or ``0..max``. A damaged ``.idx`` is refused as a
whole; a damaged record is an error naming its key and byte offset.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from packer.errors import PackerError
from packer.formats.recordio import decode_record, peek_header, record_spans, unpack_header
from packer.perprocess import PerProcess
from packer.write.sources.base import Facts, Payload, RecordError, SourceReader
from packer.write.sources.labels import integer_classes, label_problem, named_classes
from packer.write.sources.records import ClassMapper, ScanResult, Source, SourceError


class RecReader(SourceReader):
    """Reads one record's image bytes; locator (start, end) of the record in the ``.rec``."""

    def __init__(self, rec: Path) -> None:
        self.rec = rec
        self._fd: PerProcess[tuple[int, int]] = PerProcess()

    def _open(self) -> tuple[int, int]:
        fd = os.open(self.rec, os.O_RDONLY)
        return fd, os.fstat(fd).st_mtime_ns

    def read(self, rel: str, loc: Any) -> tuple[Payload, Facts | None]:
        start, end = loc
        try:
            fd, mtime = self._fd.get(self._open)
            buf = os.pread(fd, end - start, start)
        except OSError as exc:
            raise RecordError(f"cannot read {self.rec.name}: {exc.strerror or exc}") from None
        if len(buf) != end - start:
            raise RecordError(f"truncated: the record at byte {start} ends at {end}, the file at {start + len(buf)}")
        try:
            image = unpack_header(decode_record(buf, f"record at byte {start}"), f"record at byte {start}")[3]
        except PackerError as exc:
            raise RecordError(str(exc)) from None
        if not len(image):
            raise RecordError("empty image (0 bytes after the header)")
        return bytes(image), [end - start, mtime]

    def facts(self, rel: str, loc: Any) -> Facts | None:
        try:
            st = os.stat(self.rec)
        except OSError:
            return None
        return [loc[1] - loc[0], st.st_mtime_ns] if loc[1] <= st.st_size else None

    def location(self, rel: str, loc: Any) -> str:
        return f"{self.rec.name}: record at byte {loc[0]}"

    def missing(self) -> str | None:
        return None if self.rec.is_file() else f"cannot see {self.rec}"

    def close(self) -> None:
        self._fd.close(lambda h: os.close(h[0]))


def integer_label(label: float | tuple[float, ...], named: int | None) -> int | str:
    """The class index a record's IRHeader label stands for, or why it stands for none (``labels.label_problem``;
    ``named``: how many classes are named, None for "0".."max"); -1 stands for itself (packer's flat output)."""
    if isinstance(label, tuple):
        if len(label) != 1:
            return (f"a label vector of {len(label)} values: packer keeps one class label per sample "
                    "(convert with one label per record)")
        label = label[0]
    if not math.isfinite(label) or label != int(label):
        return f"label {label} is not an integer class index"
    value = int(label)
    return value if value == -1 else label_problem(value, named) or value


class RecordIOSource(Source):
    """One ``.rec`` file (and its ``.idx`` when there is one)."""

    type = "recordio"

    @classmethod
    def claims(cls, path: Path) -> bool:
        return path.suffix == ".rec" and path.is_file()

    def scan(self, map_classes: ClassMapper | None = None, *, skip_hidden: bool = False,
             allow_empty: bool = False) -> ScanResult:
        rec = self.path
        idx = rec.with_suffix(".idx")
        try:
            fd = os.open(rec, os.O_RDONLY)
        except OSError as exc:
            raise PackerError(f"{rec}: cannot open ({exc.strerror or exc})") from None
        errors: list[SourceError] = []
        keys, labels, locs, where, numbers = [], [], [], [], []  # numbers: each record's place in the file, 0 first
        count = 0
        named = named_classes(self.options.classes_file, self.storage_options)
        try:
            names, starts, ends, problem = record_spans(rec, fd, idx if idx.is_file() else None)
            if problem:
                errors.append(SourceError(f"{rec.name}/", f"{problem}: the rest of the file is not read", rec.name,
                                          record=False))
            for count, (name, start, end) in enumerate(zip(names, starts.tolist(), ends.tolist()), start=1):
                at = f"{rec.name}: record at byte {start}"
                try:
                    label, id_, _ = peek_header(fd, start, end, at)
                except PackerError as exc:
                    errors.append(SourceError(f"{rec.name}/{name}", str(exc), at, count - 1))
                    continue
                key = f"{rec.name}/{name if idx.is_file() else id_}"
                value = integer_label(label, None if named is None else len(named))
                if isinstance(value, str):
                    errors.append(SourceError(key, value, at, count - 1))
                    continue
                numbers.append(count - 1)
                keys.append(key)
                labels.append(value)
                locs.append((start, end))
                where.append(at)
        finally:
            os.close(fd)
        return self._records(keys, np.asarray(labels, dtype=np.int64), locs, where, errors, named,
                             np.asarray(numbers, dtype=np.int64), count)

    def _records(self, keys: list[str], labels: np.ndarray, locs: list, where: list[str],
                 errors: list[SourceError], named: list[str] | None, numbers: np.ndarray, total: int) -> ScanResult:
        """The scan's records: duplicate keys become errors, and -1 labels unless every label is -1. ``numbers``:
        each record's place in the file; ``total``: the records the file holds."""
        seen: set[str] = set()
        unique = []
        for i, key in enumerate(keys):
            if key in seen:
                errors.append(SourceError(key, "key seen earlier in this file", where[i], int(numbers[i])))
            else:
                seen.add(key)
                unique.append(i)
        labels, numbers = labels[unique], numbers[unique]
        keys, locs, where = [keys[i] for i in unique], [locs[i] for i in unique], [where[i] for i in unique]
        if len(labels) and np.all(labels == -1) and named is None:
            classes, keep = [], list(range(len(keys)))  # a flat folder's records, as packer writes them
        else:
            keep = [i for i, v in enumerate(labels.tolist()) if v != -1]
            unlabelled = label_problem(-1, None) or ""  # -1 among other labels: no class index
            errors += [SourceError(keys[i], unlabelled, where[i], int(numbers[i]))
                       for i in np.flatnonzero(labels == -1).tolist()]
            classes = integer_classes(labels[keep].tolist(), named)
        if not keep and not errors:
            raise PackerError(f"{self.path}: no records")
        return ScanResult(root=self.path.parent, classes=classes, rel_paths=[keys[i] for i in keep],
                          labels=labels[keep], errors=errors, reader=RecReader(self.path),
                          locs=[locs[i] for i in keep], numbers=numbers[keep], source_records=total)
