"""Per-sample fields beside the image and label (boxes, captions, ...): their specs, encoding and checked loading.

A dataset's fields are declared in the manifest (``fields: {name: spec}``) and stored, whatever the
format, under ``meta/fields/``, in storage order like ``meta/labels.npy``; every file is listed with
its sha256 in the manifest's ``meta_files``. Never pickles: plain ``.npy`` files, checked on open.

| kind          | spec example     | files (meta/fields/)                 | dtype       | shape        |
|---------------|------------------|--------------------------------------|-------------|--------------|
| int           | ``int``          | NAME.npy                             | <i8         | [N]          |
| float         | ``float``        | NAME.npy                             | <f8         | [N]          |
| str           | ``str``          | NAME.offsets.npy, NAME.blob.npy      | <i8, u1     | [N+1], [B]   |
| json          | ``json``         | NAME.offsets.npy, NAME.blob.npy      | <i8, u1     | [N+1], [B]   |
| bytes         | ``bytes``        | NAME.offsets.npy, NAME.blob.npy      | <i8, u1     | [N+1], [B]   |
| fixed array   | ``uint8[3,4]``   | NAME.npy                             | the dtype   | [N, 3, 4]    |
| ragged array  | ``float32[:,4]`` | NAME.offsets.npy (rows), NAME.blob.npy | the dtype | [N+1], [R, 4] |

str is UTF-8; json is compact UTF-8 JSON text, parsed when read. Array dtypes are stored
little-endian. Names are ASCII identifiers (never ``image`` or ``label``), so file names can't collide.
A *cell* is one sample's value as stored (int, float, bytes, or an array of the declared dtype and
shape): conversions carry cells, so fields move between datasets byte for byte.
"""

from __future__ import annotations

import base64
import json
import re
import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from packer.errors import DatasetError, OptionError
from packer.layout.fsutil import naming
from packer.layout.index import listed_path
from packer.layout.manifest import Manifest
from packer.layout.trust import check_offsets, load_npy
from packer.perprocess import PicklesAs

FIELDS_DIR = "meta/fields"
RESERVED = frozenset({"image", "label"})  # the names of what every sample has: fields=("image", "label", ...)
SCALARS = {"int": "<i8", "float": "<f8"}
BLOBS = frozenset({"str", "json", "bytes"})
DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64")
MAX_DIMS, MAX_NAME = 8, 64
_DIM = re.compile(r"[0-9]+")  # ASCII digits only: str.isdigit also takes "²", which int() refuses
_ARRAY = re.compile(r"^([a-z0-9]+)\[([^\]]*)\]$")


@dataclass(frozen=True)
class FieldSpec:
    """A parsed spec: ``kind`` is int, float, str, json, bytes or array (``dtype``, trailing ``shape``, ``ragged``)."""

    kind: str
    dtype: str = ""  # numpy dtype string, little-endian (arrays and scalars)
    shape: tuple[int, ...] = ()  # arrays: the per-sample shape (ragged: after the first dimension)
    ragged: bool = False

    @property
    def text(self) -> str:
        if self.kind != "array":
            return self.kind
        dims = [":"] * self.ragged + [str(n) for n in self.shape]
        return f"{np.dtype(self.dtype).name}[{','.join(dims)}]"

    @property
    def variable(self) -> bool:
        """Stored as offsets + blob (str, json, bytes, ragged arrays), else as one array of N values."""
        return self.kind in BLOBS or self.ragged


def parse_spec(text: object, where: str = "field") -> FieldSpec:
    """``int``, ``float``, ``str``, ``json``, ``bytes``, ``DTYPE[d1,d2]`` (fixed) or ``DTYPE[:,d2]`` (ragged)."""
    if not isinstance(text, str):
        raise OptionError(f"{where}: field spec must be a string, found {type(text).__name__}")
    if text in SCALARS:
        return FieldSpec(text, SCALARS[text])
    if text in BLOBS:
        return FieldSpec(text, "u1")
    m = _ARRAY.match(text.replace(" ", ""))
    if m is None or m.group(1) not in DTYPES:
        raise OptionError(f"{where}: unknown field spec {text!r:.80} (int, float, str, json, bytes, or an array "
                          f"such as float32[:,4] (ragged) or uint8[3,4] (fixed) of {', '.join(DTYPES)})")
    dims = [d for d in m.group(2).split(",")] if m.group(2) else []
    ragged = bool(dims) and dims[0] == ":"
    rest = dims[1:] if ragged else dims
    if not dims or len(dims) > MAX_DIMS or not all(_DIM.fullmatch(d) and 0 < int(d) < (1 << 31) for d in rest):
        raise OptionError(f"{where}: field spec {text!r:.80}: dimensions must be 1 to {MAX_DIMS} positive numbers "
                          f"(0-9; the first may be ':'); a single number is int or float")
    shape = tuple(int(d) for d in rest)
    if int(np.prod(shape, dtype=object)) >= (1 << 31):
        raise OptionError(f"{where}: field spec {text!r:.80}: a sample's array is implausibly large")
    return FieldSpec("array", np.dtype(m.group(1)).newbyteorder("<").str, shape, ragged)


def check_name(name: object, where: str = "field") -> str:
    """A field name: an ASCII identifier of at most 64 characters, not ``image`` or ``label``."""
    if not isinstance(name, str) or not name.isidentifier() or not name.isascii() or len(name) > MAX_NAME:
        raise OptionError(f"{where}: field name {name!r:.80} is not an identifier (letters, digits, _)")
    if name in RESERVED:
        raise OptionError(f"{where}: {name!r} is not a field name (every sample has its {name})")
    return name


def as_field_name(text: str, taken: Collection[str] = ()) -> str:
    """A field name made from a column or member name (``bbox x`` -> ``bbox_x``, ``1st`` -> ``c_1st``), not in
    ``taken`` nor reserved."""
    name = re.sub(r"\W", "_", text.strip(), flags=re.ASCII)[:MAX_NAME - 4] or "column"
    name = f"c_{name}" if name[0].isdigit() else name
    while name in RESERVED or name in taken:
        name += "_"
    return name


def parse_specs(specs: Mapping[str, object] | None, where: str = "fields") -> dict[str, FieldSpec]:
    """Name -> FieldSpec, every name and spec checked."""
    if specs is None:
        return {}
    if not isinstance(specs, Mapping):
        raise OptionError(f"{where}: expected a mapping of field name -> spec")
    return {check_name(k, where): parse_spec(v, f"{where}: {k}") for k, v in specs.items()}


def encode_cell(spec: FieldSpec, value: Any, where: str) -> Any:
    """One sample's ``value`` as stored (a cell), or a PackerError naming ``where`` and why."""
    kind = spec.kind
    if kind == "int":
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise OptionError(f"{where}: expected an int, found {type(value).__name__}")
        if not -(1 << 63) <= int(value) < (1 << 63):
            raise OptionError(f"{where}: {value} does not fit in 64 bits")
        return int(value)
    if kind == "float":
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise OptionError(f"{where}: expected a float, found {type(value).__name__}")
        try:
            return np.float64(value)
        except OverflowError:
            raise OptionError(f"{where}: {value} is too large for a float") from None
    if kind == "str":
        if not isinstance(value, str):
            raise OptionError(f"{where}: expected a str, found {type(value).__name__}")
        try:
            return value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise OptionError(f"{where}: not valid text ({exc})") from None
    if kind == "json":
        try:
            return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
        except (TypeError, ValueError, UnicodeEncodeError, RecursionError) as exc:
            raise OptionError(f"{where}: not JSON ({exc})") from None
    if kind == "bytes":
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise OptionError(f"{where}: expected bytes, found {type(value).__name__}")
        return bytes(value)
    return _array_cell(spec, value, where)


def _array_cell(spec: FieldSpec, value: Any, where: str) -> np.ndarray:
    """An array of the declared dtype and shape: integers only where every value is kept, floats may round
    (float64 -> float32) but not overflow to inf, other casts only exact."""
    try:
        arr = np.asarray(value)
        if arr.dtype.hasobject:
            raise ValueError("holds Python objects")
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a lossy cast is refused below, with the field's name
            cast = arr.astype(spec.dtype)
    except (TypeError, ValueError, OverflowError) as exc:
        raise OptionError(f"{where}: not an array of {spec.text} ({exc})") from None
    if not _kept(arr, cast):
        raise OptionError(f"{where}: {arr.dtype} values do not fit {np.dtype(spec.dtype).name} "
                          f"({'they overflow' if cast.dtype.kind == 'f' else 'not every value is kept'})")
    if spec.ragged and cast.size == 0 and cast.ndim == 1:
        cast = cast.reshape((0, *spec.shape))  # np.array([]): no rows
    want = ("rows", *spec.shape) if spec.ragged else spec.shape
    got = cast.shape[1:] if spec.ragged else cast.shape
    if (spec.ragged and cast.ndim != len(spec.shape) + 1) or got != spec.shape:
        raise OptionError(f"{where}: shape {arr.shape}, expected ({', '.join(map(str, want))}) for {spec.text}")
    return np.ascontiguousarray(cast)


def _kept(arr: np.ndarray, cast: np.ndarray) -> bool:
    """Whether ``cast`` holds ``arr``'s values: exactly, or for float targets rounded but finite where they were."""
    if cast.dtype.kind == "f" and arr.dtype.kind in "biuf":
        with np.errstate(all="ignore"):
            return not bool(np.any(np.isfinite(arr) & ~np.isfinite(cast)))
    with np.errstate(all="ignore"):
        return bool(np.array_equal(cast, arr))


def encode_column(spec: FieldSpec, cells: Sequence[Any]) -> dict[str, np.ndarray]:
    """The arrays storing ``cells`` (in order): ``{"": values}`` or ``{"offsets": ..., "blob": ...}``."""
    n = len(cells)
    if spec.kind in SCALARS:
        return {"": np.asarray(list(cells), dtype=spec.dtype).reshape(n)}
    if not spec.variable:
        values = np.empty((n, *spec.shape), dtype=spec.dtype)
        for i, c in enumerate(cells):
            values[i] = c
        return {"": values}
    offsets = np.zeros(n + 1, dtype="<i8")
    if spec.kind in BLOBS:
        np.cumsum([len(c) for c in cells], out=offsets[1:])
        return {"offsets": offsets, "blob": np.frombuffer(b"".join(cells), dtype="u1").copy()}
    np.cumsum([len(c) for c in cells], out=offsets[1:])
    blob = np.concatenate(list(cells)) if n else np.empty((0, *spec.shape), dtype=spec.dtype)
    return {"offsets": offsets, "blob": np.ascontiguousarray(blob, dtype=spec.dtype)}


def file_name(name: str, part: str) -> str:
    """The file of a field's ``part`` ("" for the values, "offsets", "blob"), relative to the dataset."""
    return f"{FIELDS_DIR}/{name}.npy" if not part else f"{FIELDS_DIR}/{name}.{part}.npy"


def save_fields(directory: Path, specs: Mapping[str, FieldSpec], columns: Mapping[str, Sequence[Any]]) -> list[str]:
    """Write every field's column of cells under ``directory/meta/fields``; returns the names written."""
    names: list[str] = []
    if not specs:
        return names
    (directory / FIELDS_DIR).mkdir(parents=True, exist_ok=True)
    for name, spec in specs.items():
        for part, arr in encode_column(spec, columns[name]).items():
            rel = file_name(name, part)
            with naming(directory / rel):
                np.save(directory / rel, arr)
            names.append(rel)
    return names


class FieldStore(PicklesAs):
    """The fields of a dataset, loaded and checked: cells and values by storage position."""

    def __init__(self, specs: dict[str, FieldSpec], arrays: dict[str, dict[str, np.ndarray]]) -> None:
        self.specs, self._arrays = specs, arrays

    @property
    def texts(self) -> dict[str, str]:
        """Name -> spec as written in the manifest."""
        return {k: s.text for k, s in self.specs.items()}

    @classmethod
    def load(cls, directory: Path, specs: Mapping[str, object], num_samples: int,
             path_of: Any) -> FieldStore:
        """Load ``meta/fields`` for ``specs`` (the manifest's); ``path_of(rel)``: the checked path of a listed file.

        Every array's dtype and length is checked before it is read, offsets against their blob.
        """
        try:
            parsed = parse_specs(specs, f"{directory}: manifest fields")
        except OptionError as exc:  # a spec a Writer would refuse: the manifest is damaged, not an argument
            raise DatasetError(exc.template) from None
        arrays: dict[str, dict[str, np.ndarray]] = {}
        for name, spec in parsed.items():
            if not spec.variable:
                path = path_of(file_name(name, ""))
                arrays[name] = {"": load_npy(path, spec.dtype, ndim=1 + len(spec.shape), max_items=None)}
                values = arrays[name][""]
                if values.shape != (num_samples, *spec.shape):
                    raise DatasetError(f"{path}: shape {values.shape}, expected {(num_samples, *spec.shape)}")
                continue
            offsets_path, blob_path = path_of(file_name(name, "offsets")), path_of(file_name(name, "blob"))
            offsets = load_npy(offsets_path, "<i8", ndim=1, max_items=num_samples + 1)
            blob = load_npy(blob_path, spec.dtype, ndim=1 + len(spec.shape) if spec.ragged else 1)
            if blob.shape[1:] != (spec.shape if spec.ragged else ()):
                raise DatasetError(f"{blob_path}: shape {blob.shape}, expected rows of {spec.shape}")
            check_offsets(offsets, len(blob), str(offsets_path), count=num_samples)
            arrays[name] = {"offsets": offsets, "blob": blob}
        return cls(parsed, arrays)

    def spec(self, name: str) -> FieldSpec:
        spec = self.specs.get(name)
        if spec is None:
            known = ", ".join(self.specs) or "none"
            raise KeyError(f"no field {name!r} in this dataset (its fields: {known})")
        return spec

    def cell(self, name: str, pos: int) -> Any:
        """The stored value at storage position ``pos``: int, float64, bytes or an array (a view)."""
        spec, arrays = self.spec(name), self._arrays[name]
        if not spec.variable:
            v = arrays[""][pos]
            return int(v) if spec.kind == "int" else v
        off = arrays["offsets"]
        part = arrays["blob"][int(off[pos]):int(off[pos + 1])]
        return part.tobytes() if spec.kind in BLOBS else part

    def value(self, name: str, pos: int, where: str = "dataset") -> Any:
        """The value at ``pos`` as handed out: int, float, str, parsed JSON, bytes, or a numpy array (a copy)."""
        return cell_value(self.spec(name), self.cell(name, pos), f"{where}: field {name!r} of sample at {pos}")

    def cells(self, name: str) -> list[Any]:
        """Every cell of ``name``, in storage order (a conversion carries them)."""
        n = len(self._arrays[name]["offsets"]) - 1 if self.spec(name).variable else len(self._arrays[name][""])
        return [self.cell(name, i) for i in range(n)]


def cell_value(spec: FieldSpec, cell: Any, where: str) -> Any:
    """A stored ``cell`` as handed out: int, float, str, parsed JSON, bytes, or a numpy array (a copy); damaged
    text or JSON is a PackerError naming ``where``."""
    if spec.kind == "float":
        return float(cell)
    if spec.kind in ("str", "json"):
        try:
            text = cell.decode("utf-8")
            return text if spec.kind == "str" else json.loads(text)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise DatasetError(f"{where} is damaged ({type(exc).__name__}: {exc})") from None
    if spec.kind == "array":
        return np.array(cell)
    return cell


def same_cell(a: Any, b: Any) -> bool:
    """Whether two cells store the same bytes (floats bit for bit, arrays with their dtype and shape)."""
    if isinstance(a, (np.ndarray, np.floating)) or isinstance(b, (np.ndarray, np.floating)):
        x, y = np.asarray(a), np.asarray(b)
        return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
    return type(a) is type(b) and a == b


def json_value(value: Any) -> Any:
    """A field value as JSON holds it (``packer extract``'s sidecar, WebDataset's ``json``): arrays as nested
    lists, bytes as base64 text, the rest as it is."""
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    return value.tolist() if isinstance(value, np.ndarray) else value


def load_fields(directory: Path, manifest: Manifest) -> FieldStore:
    """The fields ``manifest`` declares, each file checked against its ``meta_files`` entry (size, sha256)."""
    listed = {f.name: f for f in manifest.meta_files}
    return FieldStore.load(directory, manifest.fields, manifest.num_samples,
                           lambda rel: listed_path(directory, rel, listed))
