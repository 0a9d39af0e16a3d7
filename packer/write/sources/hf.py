"""Hugging Face datasets as a source: a ``save_to_disk`` folder or Parquet files (see ``hfarrow``).

One record per row: the image is the ``--image-column`` (default ``image``) struct's ``bytes``,
kept as they are (the encoded file); a row with only a ``path`` is read from ``--root`` when given,
else an error. The label is the ``--label-column`` (default ``label``; without that column and
without the option: -1, like a flat folder), an integer or ``ClassLabel`` column; ``classes`` are
the ClassLabel's names, else ``--classes-file``, else ``0..max``. Other scalar columns (numbers, booleans,
text) become per-sample fields (``scalar_fields``). A record's key is
``<file>/<row>`` (row within the file) plus the image path's extension when it has one; errors
name file and row. Rows are read a batch at a time (a Parquet row group, an Arrow record batch),
in each worker the batch last used stays cached, so memory is bounded by the largest batch.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from packer.errors import DatasetError, OptionError, PackerError, arg
from packer.layout.fields import as_field_name, encode_cell, parse_spec
from packer.perprocess import PerProcess
from packer.write.scan import is_image_name
from packer.write.sources.base import Facts, FileReader, Payload, RecordError, SourceReader
from packer.write.sources.hfarrow import HFFiles, TableFile, class_names, find_files, pyarrow_modules, schema_features
from packer.write.sources.labels import inside_root, integer_classes, label_problem, named_classes
from packer.write.sources.records import ClassMapper, ScanResult, Source, SourceError


@dataclass
class _Cache:
    files: dict[int, TableFile] = field(default_factory=dict)
    batch: tuple[int, int] | None = None  # (file, batch) held in column
    column: Any = None  # the image column's bytes child of that batch


class RowReader(SourceReader):
    """Reads a row's image bytes; locator (file, batch, row in batch, size), or ``path`` for a row read from --root."""

    def __init__(self, files: HFFiles, image_column: str, root: Path | None) -> None:
        self.files, self.image_column = files, image_column
        self.paths = FileReader(root) if root is not None else None
        self._cache: PerProcess[_Cache] = PerProcess(_Cache)

    def _bytes_column(self, f: int, k: int) -> Any:
        cache = self._cache.get()
        if cache.batch != (f, k):
            if f not in cache.files:
                cache.files[f] = TableFile(self.files.root / self.files.names[f], self.files.kind)
            try:
                batch = cache.files[f].batch(k, [self.image_column])
            except PackerError as exc:
                raise RecordError(str(exc)) from None
            cache.batch, cache.column = (f, k), image_bytes_child(whole(batch.column(0)))
        return cache.column

    def read(self, rel: str, loc: Any) -> tuple[Payload, Facts | None]:
        if isinstance(loc, str):  # a path-only row, read below --root
            if self.paths is None:
                raise RecordError("a path-only row, and no --root to read it from")
            return self.paths.read(loc, None)
        f, k, row, size = loc
        data = self._bytes_column(f, k)[row].as_py()
        if not data or len(data) != size:
            raise RecordError(f"row changed since the scan ({size} bytes then, {len(data or b'')} now)")
        return data, [size, self._mtime(f)]

    def _mtime(self, f: int) -> int:
        return os.stat(self.files.root / self.files.names[f]).st_mtime_ns

    def facts(self, rel: str, loc: Any) -> Facts | None:
        if isinstance(loc, str):
            return None if self.paths is None else self.paths.facts(loc, None)
        try:
            return [loc[3], self._mtime(loc[0])]
        except OSError:
            return None

    def size(self, rel: str, loc: Any) -> int | None:
        return None if isinstance(loc, str) else loc[3]

    def location(self, rel: str, loc: Any) -> str:
        return "" if isinstance(loc, str) else f"{self.files.names[loc[0]]}: row {rel.rsplit('/', 1)[1].split('.')[0]}"

    def missing(self) -> str | None:
        gone = [n for n in self.files.names if not (self.files.root / n).is_file()]
        return f"cannot see {self.files.root / gone[0]}" if gone else None

    def close(self) -> None:
        self._cache.close()


def whole(column: Any) -> Any:
    """One array of a column (a Parquet row group's columns come chunked)."""
    pa = pyarrow_modules()[0]
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def image_bytes_child(column: Any) -> Any:
    """The encoded-bytes array of an image column: a struct's ``bytes`` field, or a binary column itself."""
    pa = pyarrow_modules()[0]
    if pa.types.is_struct(column.type):
        return column.field("bytes")
    return column


def _check_columns(schema: Any, where: Path, image: str, label: str | None) -> None:
    pa = pyarrow_modules()[0]
    names = list(schema.names)
    for col in [image] + ([label] if label else []):
        if col not in names:
            raise OptionError(f"{where}: no column {col!r} (columns: {', '.join(names)}); "
                              f"name the right one with {arg('image_column')} / {arg('label_column')}")
    itype = schema.field(image).type
    binary = (pa.types.is_binary(itype) or pa.types.is_large_binary(itype))
    if not binary and not (pa.types.is_struct(itype) and itype.get_field_index("bytes") >= 0):
        raise OptionError(f"{where}: column {image!r} is {itype}, not an Image (bytes, path) or binary column")
    if label and not pa.types.is_integer(schema.field(label).type):
        raise OptionError(f"{where}: column {label!r} is {schema.field(label).type}, not an integer or ClassLabel")


class HFSource(Source):
    """A Hugging Face dataset on disk; its rows in file order, then row order."""

    type = "hf"

    @classmethod
    def claims(cls, path: Path) -> bool:
        if path.is_file():
            return path.suffix in (".parquet", ".arrow")
        if not path.is_dir():
            return False
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return True
        return any(p.suffix == ".parquet" for p in path.iterdir())

    def scan(self, map_classes: ClassMapper | None = None, *, skip_hidden: bool = False,
             allow_empty: bool = False) -> ScanResult:
        files = find_files(self.path)
        image_col = self.options.image_column or "image"
        root = Path(self.options.root) if self.options.root else None
        rows = _Rows()
        from_file = named_classes(self.options.classes_file, self.storage_options)
        names: list[str] | None = from_file
        for f, name in enumerate(files.names):
            table = TableFile(files.root / name, files.kind)
            label_col = self.options.label_column or ("label" if "label" in table.schema.names else None)
            _check_columns(table.schema, files.root / name, image_col, label_col)
            if f and label_col != rows.label_col:
                raise DatasetError(f"{files.root / name}: no column {rows.label_col!r}, unlike {files.names[0]}")
            rows.label_col = label_col
            if label_col:
                label_names = class_names(schema_features(table.schema, files.features), label_col)
                names = label_names if label_names is not None else from_file
            if not f:
                rows.scalars = scalar_columns(table.schema, (image_col, label_col))
            elif missing := sorted(set(rows.scalars) - set(table.schema.names)):
                raise DatasetError(f"{files.root / name}: no column {missing[0]!r}, unlike {files.names[0]}")
            columns = [image_col] + ([label_col] if label_col else []) + rows.scalars
            for k, (first, batch) in enumerate(table.batches(columns)):
                rows.add_batch(f, name, k, first, batch, root, None if names is None else len(names))
        labels = np.asarray(rows.labels, dtype=np.int64)
        classes = [] if rows.label_col is None else integer_classes(rows.labels, names)
        if not len(labels) and not rows.errors:
            raise PackerError(f"{self.path}: no rows")
        specs, cells = scalar_fields({c: rows.values.get(c, []) for c in rows.scalars})
        return ScanResult(root=files.root, classes=classes, rel_paths=rows.keys, labels=labels, ignored=Counter(),
                          errors=rows.errors, reader=RowReader(files, image_col, root), locs=rows.locs,
                          field_specs=specs, fields=cells, numbers=np.asarray(rows.numbers, dtype=np.int64),
                          source_records=rows.count)


class _Rows:
    """The rows found so far: keys, labels, locators, numbers (rows of every file in order, 0 first), and the
    errors with file, row and number."""

    def __init__(self) -> None:
        self.count = 0  # rows met so far, refused ones included
        self.numbers: list[int] = []
        self.keys: list[str] = []
        self.labels: list[int] = []
        self.locs: list[Any] = []
        self.where: list[str] = []
        self.errors: list[SourceError] = []
        self.label_col: str | None = None
        self.scalars: list[str] = []  # the other scalar columns: per-sample fields
        self.values: dict[str, list[Any]] = {}  # per scalar column, its value in each kept row

    def add_batch(self, f: int, name: str, k: int, first: int, batch: Any, root: Path | None,
                  named: int | None) -> None:
        """Add the rows of one batch; ``named``: how many classes are named (``labels.label_problem``)."""
        column = whole(batch.column(0))
        data = image_bytes_child(column)
        lengths = _lengths(data)
        pa = pyarrow_modules()[0]
        has_path = pa.types.is_struct(column.type) and column.type.get_field_index("path") >= 0
        paths = column.field("path").to_pylist() if has_path else [None] * len(column)
        labels = batch.column(1).to_pylist() if self.label_col else [-1] * len(column)
        skip = 2 if self.label_col else 1
        scalars = {c: batch.column(skip + j).to_pylist() for j, c in enumerate(self.scalars)}
        for r in range(len(column)):
            row, path = first + r, paths[r]
            suffix = PurePosixPath(path).suffix.lower() if isinstance(path, str) and is_image_name(path) else ""
            key, where = f"{name}/{row}{suffix}", f"{name}: row {row}"
            number = self.count
            self.count += 1
            if labels[r] is None:
                self.errors.append(SourceError(key, f"no label (null in column {self.label_col!r})", where, number))
                continue
            if self.label_col and (why := label_problem(labels[r], named)) is not None:
                self.errors.append(SourceError(key, why, where, number))
                continue
            if lengths[r] > 0:
                loc: Any = (f, k, r, lengths[r])
            elif path and root is not None:
                try:
                    loc = inside_root(path, where)
                except PackerError as exc:
                    self.errors.append(SourceError(key, str(exc), where, number))
                    continue
            else:
                why = f"only a path ({path!r}): give --root to read it from there" if path else "no image"
                self.errors.append(SourceError(key, why, where, number))
                continue
            for c, values in scalars.items():
                self.values.setdefault(c, []).append(values[r])
            self.keys.append(key)
            self.numbers.append(number)
            self.labels.append(int(labels[r]))
            self.locs.append(loc)
            self.where.append(where)


def _lengths(data: Any) -> list[int]:
    """Each row's byte count (0 for a null)."""
    import pyarrow.compute as pc

    return [n or 0 for n in pc.call_function("binary_length", [data]).to_pylist()]


def scalar_columns(schema: Any, taken: tuple[str | None, ...]) -> list[str]:
    """The columns besides the image and the label holding numbers, booleans or text: they become fields."""
    pa = pyarrow_modules()[0]
    kinds = (pa.types.is_integer, pa.types.is_floating, pa.types.is_boolean, pa.types.is_string,
             pa.types.is_large_string)
    return [n for n in schema.names if n not in taken and any(k(schema.field(n).type) for k in kinds)]


def scalar_fields(columns: dict[str, list[Any]]) -> tuple[dict[str, str], dict[str, list]]:
    """Scalar columns as fields: int, float, str; a column with nulls or booleans (or ints beyond 64 bits) as
    json, so nothing is changed."""
    specs: dict[str, str] = {}
    cells: dict[str, list] = {}
    for column, values in columns.items():
        name = as_field_name(column, specs)
        present = [v for v in values if v is not None]
        if len(present) < len(values) or any(isinstance(v, bool) for v in present) or \
                any(isinstance(v, int) and not -(1 << 63) <= v < (1 << 63) for v in present):
            kind = "json"
        else:
            kind = "str" if any(isinstance(v, str) for v in present) else \
                "float" if any(isinstance(v, float) for v in present) else "int"
        spec = parse_spec(kind)
        specs[name], cells[name] = kind, [encode_cell(spec, v, f"column {column!r}") for v in values]
    return specs, cells
