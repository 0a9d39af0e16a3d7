"""Hugging Face datasets on disk, read through pyarrow alone (never the ``datasets`` package).

Two layouts: a ``save_to_disk`` folder (``state.json`` lists its ``.arrow`` files, Arrow IPC
streams; ``dataset_info.json`` its features) and Parquet files (one, or a folder's ``*.parquet``).
The features (``Image``, ``ClassLabel`` with its names) come from the ``huggingface`` entry of
the Arrow schema's metadata, which both layouts carry; ``dataset_info.json`` is the fallback.
An ``Image`` column is a struct of ``bytes`` (the encoded file) and ``path``. Rows are read a
record batch (Arrow, memory-mapped) or a row group (Parquet) at a time, so memory is bounded by
the largest batch, never the dataset. pyarrow is the optional extra ``hf`` (``pip install -e '.[hf]'``),
imported only when such a source is opened.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packer.errors import DatasetError, InputNotFoundError, MissingPackageError, OptionError, PackerError, install_hint
from packer.layout.trust import check_inner_name

HF_EXTRA = install_hint("hf")
_MAX_JSON = 64 << 20  # state.json / dataset_info.json: far more than any real one


def pyarrow_modules() -> tuple[Any, Any, Any]:
    """(pyarrow, pyarrow.ipc, pyarrow.parquet), or a PackerError naming the extra to install."""
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError as exc:
        raise MissingPackageError(f"reading a Hugging Face dataset needs pyarrow ({exc}): {HF_EXTRA}") from None
    return pyarrow, pyarrow.ipc, pyarrow.parquet


def _read_json(path: Path) -> Any:
    try:
        if path.stat().st_size > _MAX_JSON:
            raise DatasetError(f"{path}: {path.stat().st_size} bytes, too large for a dataset description")
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise DatasetError(f"{path}: not readable as JSON ({exc})") from None


@dataclass
class HFFiles:
    """The data files of a Hugging Face dataset on disk, in order, and how to read them."""

    root: Path  # the folder the files are in (names in records are relative to it)
    names: list[str]  # file names relative to root
    kind: str  # "arrow" (IPC stream, save_to_disk) or "parquet"
    features: dict = field(default_factory=dict)  # dataset_info.json's, when there is one


def find_files(src: str | os.PathLike) -> HFFiles:
    """The data files ``src`` names: a ``save_to_disk`` folder, a ``.parquet`` file or a folder of them."""
    src = Path(src)
    if src.is_file():
        if src.suffix not in (".parquet", ".arrow"):
            raise OptionError(f"{src}: not a .parquet or .arrow file")
        return HFFiles(src.parent, [src.name], src.suffix[1:])
    if not src.is_dir():
        raise InputNotFoundError(f"{src}: no such file or folder")
    if (src / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in src.iterdir() if (p / "state.json").is_file())
        raise OptionError(f"{src}: a DatasetDict; give one split's folder ({', '.join(splits) or 'none found'})")
    if (src / "state.json").is_file():
        state = _read_json(src / "state.json")
        try:
            names = [check_inner_name(f["filename"], str(src / "state.json")) for f in state["_data_files"]]
        except (KeyError, TypeError) as exc:
            raise DatasetError(f"{src / 'state.json'}: no list of data files ({exc})") from None
        info = _read_json(src / "dataset_info.json") if (src / "dataset_info.json").is_file() else {}
        features = info.get("features") if isinstance(info, dict) else None
        return HFFiles(src, names, "arrow", features if isinstance(features, dict) else {})
    names = sorted(p.name for p in src.iterdir() if p.suffix == ".parquet" and p.is_file())
    if not names:
        raise PackerError(f"{src}: neither a save_to_disk folder (state.json) nor a folder of .parquet files")
    return HFFiles(src, names, "parquet")


def schema_features(schema: Any, fallback: dict) -> dict:
    """The ``datasets`` features recorded in an Arrow schema's metadata (``huggingface`` entry), else ``fallback``."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if raw is None:
        return fallback
    try:
        features = json.loads(raw.decode("utf-8"))["info"]["features"]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError):
        return fallback
    return features if isinstance(features, dict) else fallback


def class_names(features: dict, column: str) -> list[str] | None:
    """The names of a ``ClassLabel`` feature, or None when ``column`` is no ClassLabel."""
    feature = features.get(column)
    if not isinstance(feature, dict) or feature.get("_type") != "ClassLabel":
        return None
    names = feature.get("names")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise DatasetError(f"ClassLabel column {column!r}: its names are not a list of strings")
    return names


class TableFile:
    """One data file, read a batch at a time: an Arrow IPC stream (memory-mapped) or a Parquet file."""

    def __init__(self, path: Path, kind: str) -> None:
        self.path, self.kind = path, kind
        pa, ipc, pq = pyarrow_modules()
        try:
            if kind == "parquet":
                self._pq = pq.ParquetFile(path)
                self.schema = self._pq.schema_arrow
                self.batch_rows = [self._pq.metadata.row_group(g).num_rows for g in range(self._pq.num_row_groups)]
            else:
                self._batches = _arrow_batches(pa, ipc, path)
                self.schema = self._batches[0].schema if self._batches else _arrow_schema(pa, ipc, path)
                self.batch_rows = [b.num_rows for b in self._batches]
        except (OSError, pa.ArrowException) as exc:
            raise DatasetError(f"{path}: not a readable {kind} file ({exc})") from None

    def batch(self, k: int, columns: list[str]) -> Any:
        """Batch (row group) ``k`` with ``columns`` as an Arrow table or record batch."""
        pa = pyarrow_modules()[0]
        try:
            if self.kind == "parquet":
                return self._pq.read_row_group(k, columns=columns)
            return self._batches[k].select(columns)
        except (OSError, pa.ArrowException) as exc:
            raise DatasetError(f"{self.path}: batch {k} is not readable ({exc})") from None

    def batches(self, columns: list[str]) -> Iterator[tuple[int, Any]]:
        """(first row, batch) for each batch, in order."""
        first = 0
        for k, n in enumerate(self.batch_rows):
            yield first, self.batch(k, columns)
            first += n


def _arrow_batches(pa: Any, ipc: Any, path: Path) -> list:
    """The record batches of an Arrow IPC stream (``save_to_disk``) or file, memory-mapped: no copy is made."""
    source = pa.memory_map(str(path))
    try:
        return list(ipc.open_stream(source))
    except pa.ArrowInvalid:
        source = pa.memory_map(str(path))
        reader = ipc.open_file(source)
        return [reader.get_batch(i) for i in range(reader.num_record_batches)]


def _arrow_schema(pa: Any, ipc: Any, path: Path) -> Any:
    try:
        return ipc.open_stream(pa.memory_map(str(path))).schema
    except pa.ArrowInvalid:
        return ipc.open_file(pa.memory_map(str(path))).schema
