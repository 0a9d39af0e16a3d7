"""A list file: ``path,label`` rows (CSV/TSV with a header, Kaggle style), ``path label`` lines (Caffe's
``convert_imageset`` list) or ``index<TAB>label<TAB>path`` lines (MXNet's ``.lst``, from ``im2rec.py --list``),
the images below ``--root`` (default: the list file's folder).

Labels are integers (kept as they are; ``classes`` from ``--classes-file`` or ``0..max``) or class
names (``classes`` = the sorted names, as ImageFolder numbers folders; with ``--classes-file``, line i
is class i). Records keep the file's order. A bad row never aborts: a path leaving ``--root``, a
duplicate, a bad label or a short row is an errors.json entry naming its line; a missing file is
found when read (its entry names the line too). Other columns become per-sample fields (docs/fields.md):
``int`` or ``float`` where every value parses so, else ``str``; names made identifiers (``bbox x`` -> ``bbox_x``).
"""

from __future__ import annotations

import csv
import posixpath
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from packer.errors import DatasetError, InputNotFoundError, OptionError, PackerError, arg
from packer.layout.fields import as_field_name
from packer.layout.trust import class_name_problem
from packer.storage.url import Location, UrlPath, is_url, redact
from packer.storage.url import parse as parse_url
from packer.write.sources.base import FileReader, SourceOptions, read_list_text
from packer.write.sources.labels import integer_classes, is_integer_text, named_classes, parse_label
from packer.write.sources.records import ClassMapper, ScanResult, Source, SourceError
from packer.write.sources.remote import objects_below, read_text_object, source_url

LIST_SUFFIXES = (".csv", ".tsv", ".txt", ".lst")


@dataclass
class _Rows:
    """What the list holds, before labels are resolved: per kept row its path, label text, line and number (the
    list's numbering: its data rows in order, 0 first, refused ones included); ``count``: rows numbered so far."""

    paths: list[str] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    numbers: list[int] = field(default_factory=list)
    extras: dict[str, list[str]] = field(default_factory=dict)
    errors: list[SourceError] = field(default_factory=list)
    count: int = 0

    def refuse(self, path: str, reason: str, location: str) -> None:
        """The row numbered last is not packed: an errors.json entry with its number."""
        self.errors.append(SourceError(path, reason, location, self.count - 1))


class ListSource(Source):
    """``labels.csv`` / ``.tsv`` (header: ``path,label[,more]``), ``list.txt`` / ``.lst`` (``path label`` lines) or
    MXNet's ``.lst`` (``index<TAB>label<TAB>path``). The list file may be at a URL (``location``), its paths then
    relative to its prefix; paths may be URLs (``s3://bucket/train/a.jpg``): the images are then objects."""

    type = "list"

    def __init__(self, path: Path, options: SourceOptions, location: Location | None = None,
                 storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__(path, options, storage_options)
        self.location = location

    @classmethod
    def claims(cls, path: Path) -> bool:
        return path.is_file() and path.suffix.lower() in LIST_SUFFIXES

    def scan(self, map_classes: ClassMapper | None = None, *, skip_hidden: bool = False,
             allow_empty: bool = False) -> ScanResult:
        path, opts, at = self.path, self.options, self.location
        text = read_text_object(at, self.storage_options) if at is not None else read_list_text(path)
        tabular = path.suffix.lower() in (".csv", ".tsv")
        if not tabular and (opts.path_column is not None or opts.label_column is not None):
            raise OptionError(f"{path}: {arg('path_column')}/{arg('label_column')} apply to .csv/.tsv lists with a "
                              "header")
        if tabular:
            rows = _csv_rows(path, text, self._columns())
        else:
            rows = _mxnet_rows(path, text) if is_mxnet_list(path, text) else _plain_rows(path, text)
        root = self._root(rows)
        if isinstance(root, Path) and not root.is_dir():
            raise InputNotFoundError(f"{root}: not a folder ({arg('root')} names the folder the list's paths are "
                                     "relative to)")
        _rebase(rows, root, path.name)
        classes, labels = _labels(path, rows, named_classes(opts.classes_file, self.storage_options))
        if not rows.paths:
            raise PackerError(f"{path}: no usable rows ({len(rows.errors)} refused"
                              + "".join(f"; {e.location}: {e.reason}" for e in rows.errors[:3]) + ")")
        specs, cells = columns_as_fields(rows.extras)
        scan = ScanResult(root=_as_path(root), classes=classes, rel_paths=rows.paths, labels=labels,
                          errors=rows.errors, ignored=Counter(), reader=FileReader(_as_path(root), path.name),
                          locs=list(rows.lines), field_specs=specs, fields=cells,
                          numbers=np.asarray(rows.numbers, dtype=np.int64), source_records=rows.count,
                          url=source_url(at) if at is not None else "")
        return (objects_below(root, scan, path.name, rows.lines, self.storage_options) if isinstance(root, Location)
                else scan)

    def _columns(self) -> tuple[str, str]:
        return self.options.path_column or "path", self.options.label_column or "label"

    def _root(self, rows: _Rows) -> Path | Location:
        """What the list's paths are relative to: ``--root``; else the list's folder or prefix; a local list naming
        only objects (URLs) and no ``--root``: the longest prefix (up to a ``/``) of the URLs it names."""
        given, at = self.options.root, self.location
        if given is not None:
            named = parse_url(given)
            return named.path if named.is_local else _folder(named)
        if at is not None:
            return _folder(Location(at.scheme, at.bucket, at.key.rpartition("/")[0], "", at.userinfo))
        urls = [p for p in rows.paths if is_url(p)]
        if not urls or len(urls) < len(rows.paths):  # relative paths: relative to the list's folder
            return self.path.parent
        common = posixpath.commonprefix(urls)
        try:
            return _folder(parse_url(common[:common.rfind("/") + 1]))
        except PackerError:
            raise PackerError(f"{self.path}: the URLs it names share no bucket (give {arg('root')}: the prefix "
                              "they are below)") from None


def _folder(location: Location) -> Location:
    """``location`` as a prefix (no trailing ``/``): objects below it are read by their keys relative to it."""
    return Location(location.scheme, location.bucket, location.key.rstrip("/"), "", location.userinfo)


def _below(url: str, root: Location) -> str | None:
    """``url``'s key relative to the prefix ``root`` (a clean relative name), or None when it is not below it."""
    try:
        at = parse_url(url)
    except PackerError:
        return None
    inside = at.key[len(root.key) + 1:] if root.key else at.key
    if (at.scheme, at.bucket, at.userinfo) != (root.scheme, root.bucket, root.userinfo) or (
            root.key and not at.key.startswith(root.key + "/")):
        return None
    clean = posixpath.normpath(inside) if inside else ""
    return clean if clean and clean == inside and not clean.startswith(("/", "../")) and clean != ".." else None


def _rebase(rows: _Rows, root: Path | Location, name: str) -> None:
    """Each URL row made relative to ``root`` (a prefix), or refused when outside it or when ``root`` is a local
    folder; a relative row stays as it is."""
    keep = []
    for i, rel in enumerate(rows.paths):
        inner = _below(rel, root) if is_url(rel) and isinstance(root, Location) else rel
        if inner is None or is_url(inner):
            reason = (f"a URL, not below {root}/" if isinstance(root, Location) else
                      f"a URL, while the paths are relative to the folder {root} (--root)")
            rows.errors.append(SourceError(redact(rel), reason, f"{name} line {rows.lines[i]}", rows.numbers[i]))
            continue
        rows.paths[i] = inner
        keep.append(i)
    _keep(rows, keep)
    seen: dict[str, int] = {}
    unique = []
    for i, rel in enumerate(rows.paths):
        if rel in seen:
            rows.errors.append(SourceError(rel, f"listed twice (first on line {seen[rel]}): this row is not packed",
                                           f"{name} line {rows.lines[i]}", rows.numbers[i]))
        else:
            seen[rel] = rows.lines[i]
            unique.append(i)
    _keep(rows, unique)


def _keep(rows: _Rows, keep: list[int]) -> None:
    """Only the rows at ``keep`` (in order), with their labels, lines, numbers and other columns."""
    rows.paths = [rows.paths[i] for i in keep]
    rows.labels = [rows.labels[i] for i in keep]
    rows.lines = [rows.lines[i] for i in keep]
    rows.numbers = [rows.numbers[i] for i in keep]
    rows.extras = {k: [v[i] for i in keep] for k, v in rows.extras.items()}


def _csv_rows(path: Path, text: str, columns: tuple[str, str]) -> _Rows:
    """Rows of a CSV (``,``) or TSV (tab) list with a header naming its columns."""
    path_col, label_col = columns
    reader = csv.reader(text.splitlines(), delimiter="\t" if path.suffix.lower() == ".tsv" else ",")
    try:
        header = next(reader, None)
        if header is None:
            raise PackerError(f"{path}: empty list file")
        header = [h.strip() for h in header]
        for col, flag in ((path_col, arg("path_column")), (label_col, arg("label_column"))):
            if col not in header:
                raise OptionError(f"{path}: no column {col!r} in the header ({', '.join(header)}); name the "
                                  f"right one with {flag}")
        ip, il = header.index(path_col), header.index(label_col)
        others = [(i, h) for i, h in enumerate(header) if i not in (ip, il)]
        rows, seen = _Rows(), {}
        for row in reader:
            line = reader.line_num
            if not row or all(not v.strip() for v in row):
                continue
            rows.count += 1
            if len(row) != len(header):
                rows.refuse(row[ip] if ip < len(row) else "", f"{len(row)} fields, the header has {len(header)}: "
                            "row not packed", f"{path.name} line {line}")
                continue
            _add_row(rows, seen, path.name, line, row[ip], row[il], {h: row[i] for i, h in others})
    except csv.Error as exc:
        raise DatasetError(f"{path}: line {reader.line_num}: not a valid CSV ({exc})") from None
    return rows


def _plain_rows(path: Path, text: str) -> _Rows:
    """Rows of a headerless ``relative/path.jpg 3`` list (Caffe's): the label after the last space."""
    rows, seen = _Rows(), {}
    for line, raw in enumerate(text.splitlines(), start=1):
        body = raw.strip()
        if not body or body.startswith("#"):
            continue
        rows.count += 1
        parts = body.rsplit(None, 1)
        if len(parts) != 2:
            rows.refuse(body, "no label (expected 'path label')", f"{path.name} line {line}")
            continue
        _add_row(rows, seen, path.name, line, parts[0], parts[1], {})
    return rows


def is_mxnet_list(path: Path, text: str) -> bool:
    """Whether a ``.lst`` holds MXNet's ``index<TAB>label<TAB>path`` lines (``im2rec.py --list``), judged by its
    first line: three or more tab-separated fields, the first an integer."""
    first = next((line for line in text.splitlines() if line.strip()), "")
    fields = first.rstrip("\r\n").split("\t")
    return path.suffix.lower() == ".lst" and len(fields) >= 3 and fields[0].strip().isdigit()


def _mxnet_rows(path: Path, text: str) -> _Rows:
    """Rows of MXNet's ``.lst``: ``index<TAB>label<TAB>path``, the label written as a float (``3.000000``);
    packer keeps one label per image, so a line with several is refused (its line in errors.json)."""
    rows, seen = _Rows(), {}
    for line, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        rows.count += 1
        fields = raw.split("\t")
        where = f"{path.name} line {line}"
        if len(fields) < 3 or not fields[0].strip().isdigit():
            rows.refuse(fields[-1].strip(), "not an MXNet list line ('index<TAB>label<TAB>path')", where)
        elif len(fields) > 3:
            rows.refuse(fields[-1].strip(), f"{len(fields) - 2} labels: packer keeps one label per image", where)
        else:
            _add_row(rows, seen, path.name, line, fields[2], _integral(fields[1].strip()), {})
    return rows


def _integral(text: str) -> str:
    """``3.000000`` as ``3`` (MXNet writes labels as floats); any other text unchanged (a bad label, reported)."""
    try:
        value = float(text)
    except ValueError:
        return text
    return str(int(value)) if value.is_integer() and value >= 0 else text


def _labels(path: Path, rows: _Rows, named: list[str] | None) -> tuple[list[str], np.ndarray]:
    """The classes and each kept row's label index (``named``: the classes ``--classes-file`` names, or None);
    rows with a bad label move to the errors.

    Mostly integers: each is checked by ``labels.parse_label`` (the others are bad labels, not class names);
    else the labels are class names.
    """
    numeric = sum(is_integer_text(t) for t in rows.labels) * 2 > len(rows.labels)
    if numeric:
        values = [parse_label(t, None if named is None else len(named)) for t in rows.labels]
        classes = integer_classes((v for v in values if isinstance(v, int)), named)
    else:  # a name that can't be a folder name is an error for its rows, as a bad label is
        classes = named if named is not None else sorted({t for t in rows.labels if not class_name_problem(t)})
        index = {c: i for i, c in enumerate(classes)}
        values = [index[t] if t in index else _name_problem(t, named is not None) for t in rows.labels]
    keep = [i for i, v in enumerate(values) if isinstance(v, int)]
    for i, v in enumerate(values):
        if isinstance(v, str):
            rows.errors.append(SourceError(rows.paths[i], v, f"{path.name} line {rows.lines[i]}", rows.numbers[i]))
    labels = np.asarray([values[i] for i in keep], dtype=np.int64)
    _keep(rows, keep)
    return classes, labels


def _name_problem(label: str, named: bool) -> str:
    """Why a label naming a class names none of ``classes``."""
    if not label:
        return "empty label"
    if named:
        return f"label {label!r}: not a class of --classes-file"
    return f"class name {label!r} {class_name_problem(label)}: a class name must be one plain folder name"


def _add_row(rows: _Rows, seen: dict[str, int], name: str, line: int, rel: str, label: str,
             extras: dict[str, str]) -> None:
    """Check one row's path and keep it, or record why not."""
    where = f"{name} line {line}"
    rel = rel.strip()
    clean = posixpath.normpath(rel) if rel and not is_url(rel) else rel  # a URL: made relative by _rebase
    if not rel:
        rows.refuse(rel, "empty path", where)
    elif "\x00" in rel or "\\" in rel or rel.startswith(("/", "~")) or clean == ".." or clean.startswith("../"):
        rows.refuse(rel, "path leaves --root (absolute, ~ or ..): refused", where)
    elif clean in seen:
        rows.refuse(clean, f"listed twice (first on line {seen[clean]}): this row is not packed", where)
    else:
        seen[clean] = line
        rows.paths.append(clean)
        rows.labels.append(label.strip())
        rows.lines.append(line)
        rows.numbers.append(rows.count - 1)
        for k, v in extras.items():
            rows.extras.setdefault(k, []).append(v)


def columns_as_fields(columns: dict[str, list[str]]) -> tuple[dict[str, str], dict[str, list]]:
    """A list's other columns as fields: (name -> spec, name -> cells), ``int``/``float`` where every value parses."""
    specs: dict[str, str] = {}
    cells: dict[str, list] = {}
    for column, values in columns.items():
        name = as_field_name(column, specs)
        for kind, parse in (("int", _int64), ("float", float)):
            try:
                cells[name] = [parse(v) for v in values]
            except ValueError:
                continue
            specs[name] = kind
            break
        else:
            specs[name], cells[name] = "str", [v.encode("utf-8") for v in values]
    return specs, cells


def _int64(text: str) -> int:
    value = int(text)
    if not -(1 << 63) <= value < (1 << 63):
        raise ValueError(f"{text} does not fit in 64 bits")
    return value


def _as_path(root: Path | Location) -> Path:
    """The records' root as ``ScanResult.root`` holds it: a folder, or a prefix shown as its URL."""
    return root if isinstance(root, Path) else UrlPath(str(root))
