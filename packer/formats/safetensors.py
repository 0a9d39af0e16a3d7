"""safetensors: one ``.safetensors`` file per shard, the arrays of packer.formats.tensorfile, that
``safetensors.numpy.load_file`` / ``safetensors.torch.load_file`` / ``safe_open`` (and the Rust,
JS and C++ readers) open without packer and without executing anything.

| bytes          | holds                                                                      |
|----------------|----------------------------------------------------------------------------|
| 8              | header length H, little-endian uint64                                      |
| H              | JSON: ``{"__metadata__": {...}, name: {"dtype", "shape", "data_offsets":    |
|                | [begin, end]}, ...}`` (offsets relative to the data), padded with spaces to |
|                | a multiple of 8 so the data start 8-byte aligned                            |
| rest           | the arrays back to back, little-endian, no gaps: labels, offsets, shapes   |
|                | (I64), then images (U8); the order the safetensors package writes          |

Written here, not through the ``safetensors`` package, so that the images stream from the shard's scratch file;
read without it: the header (at most 100 MB, as the reference reader allows) and every entry are checked before the
file is mapped and samples handed out as views of the map.
"""

from __future__ import annotations

import json
import struct
from math import prod
from pathlib import Path

import numpy as np

from packer.errors import DatasetError
from packer.formats.base import Format
from packer.formats.filemap import map_readonly
from packer.formats.tensorfile import ArrayShardReader, ArrayShardWriter, file_size

_MAX_HEADER = 100_000_000  # the reference implementation's limit
DTYPES = {"U8": np.dtype("u1"), "I64": np.dtype("<i8")}
_NAMES = {v: k for k, v in DTYPES.items()}


def header_bytes(arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> tuple[bytes, list[str]]:
    """The length prefix and padded JSON header for ``arrays``, and the order their bytes follow in."""
    order = sorted(arrays, key=lambda k: (-arrays[k].dtype.itemsize, k))  # by alignment, then name
    header: dict = {"__metadata__": dict(sorted(metadata.items()))}
    at = 0
    for name in order:
        arr = arrays[name]
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape), "data_offsets": [at, at + arr.nbytes]}
        at += arr.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text, order


def parse_header(path: Path) -> tuple[dict[str, tuple[np.dtype, tuple[int, ...], int]], dict, int]:
    """(name -> (dtype, shape, start in the file), metadata, data start) of a safetensors file, checked whole."""
    size = file_size(path)
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
            (length,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
            if not 0 < length <= min(_MAX_HEADER, size - 8):
                raise DatasetError(f"{path}: safetensors header of {length} bytes in a file of {size}")
            header = json.loads(fh.read(length))
    except (OSError, ValueError, RecursionError) as exc:
        raise DatasetError(f"{path}: not a safetensors file ({type(exc).__name__}: {exc})") from exc
    if not isinstance(header, dict):
        raise DatasetError(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise DatasetError(f"{path}: __metadata__ must map names to strings")
    data_start = 8 + length
    entries, ranges = {}, []
    for name, entry in header.items():
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(entry["shape"])
            begin, end = entry["data_offsets"]
            if not all(type(v) is int and v >= 0 for v in (*shape, begin, end)) or len(entry) != 3:
                raise ValueError("fields")
        except (KeyError, TypeError, ValueError):
            raise DatasetError(f"{path}: safetensors entry {name!r:.60} is not a U8/I64 tensor description") from None
        if end - begin != prod(shape) * dtype.itemsize:
            raise DatasetError(f"{path}: {name!r:.60} covers {end - begin} bytes, its shape {shape} needs "
                               f"{prod(shape) * dtype.itemsize}")
        entries[name] = (dtype, shape, data_start + begin)
        ranges.append((begin, end))
    ranges.sort()
    at = 0
    for begin, end in ranges:
        if begin != at:
            raise DatasetError(f"{path}: safetensors byte ranges overlap or leave gaps")
        at = end
    if data_start + at != size:
        raise DatasetError(f"{path}: the tensors cover {at} bytes, the file holds {size - data_start} after the header")
    return entries, metadata, data_start


class Writer(ArrayShardWriter):
    suffix = ".safetensors"

    def write_file(self, path: Path, arrays: dict[str, np.ndarray]) -> None:
        layout = "fixed" if self.shape is not None else "blob"
        prefix, order = header_bytes(arrays, {"format": "packer", "payload": self.payload, "layout": layout})
        with open(path, "wb") as fh:
            fh.write(prefix)
            for name in order:
                if arrays[name].nbytes:
                    fh.write(np.ascontiguousarray(arrays[name]).data.cast("B"))


class Reader(ArrayShardReader):
    def load_file(self, fd: int) -> tuple[dict[str, np.ndarray], int | None]:
        entries, _metadata, data_start = parse_header(self.path)
        mm = None
        if self.num_bytes > data_start:
            mm = map_readonly(self.path, fd, self.access)
            if len(mm) != data_start + sum(prod(s) * d.itemsize for d, s, _ in entries.values()):
                raise DatasetError(f"{self.path}: changed size while being opened")
        arrays = {name: np.ndarray(shape, dtype, buffer=mm, offset=start) if prod(shape) else np.zeros(shape, dtype)
                  for name, (dtype, shape, start) in entries.items()}
        return arrays, entries["images"][2] if "images" in entries else None


FORMAT = Format(
    name="safetensors", dataset_class="SafetensorsDataset", payloads=frozenset({"encoded", "raw", "none"}),
    Writer=Writer, Reader=Reader, default_shard_bytes=256 << 20,
)
