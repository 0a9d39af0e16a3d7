"""pth: one ``torch.save`` file per shard, a dict of tensors that ``torch.load(path, weights_only=True)``
opens without executing code (the arrays of packer.formats.tensorfile, as tensors).

| file               | holds                                                                        |
|--------------------|------------------------------------------------------------------------------|
| shard-00000.pth    | PyTorch's zip archive (``<stem>/data.pkl``, ``<stem>/data/<k>``, ...):         |
|                    | ``{"images": uint8, "offsets": int64, "shapes": int64, "labels": int64}``      |
|                    | (which of them: tensorfile's table); tensor data stored uncompressed,        |
|                    | 64-byte aligned                                                               |

    shard = torch.load("shard-00000.pth", weights_only=True, mmap=True)
    jpeg_bytes = shard["images"][shard["offsets"][i]:shard["offsets"][i + 1]]

Shards are opened only with ``weights_only=True`` (the restricted unpickler: a pickle naming any other callable is
refused, never run) and only after the zip archive itself is checked (every record stored uncompressed inside the
file, ``data.pkl`` at most 1 MiB); ``mmap=True`` maps instead of reading (its costs: docs/formats-recordio-n5-pth.md).
256 MiB shards by default, since a plain ``torch.load`` reads a whole shard into memory. torch is imported only when
a shard is written or opened.
"""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import numpy as np

from packer.errors import DatasetError
from packer.formats.base import Format
from packer.formats.tensorfile import ArrayShardReader, ArrayShardWriter, file_size

_MAX_PICKLE = 1 << 20
_MAX_RECORDS = 64
_ZIP_LOCAL = b"PK\x03\x04"


def check_archive(path: Path) -> dict[str, tuple[int, int]]:
    """name -> (data start, size) of each record of a ``torch.save`` archive, checked before torch reads it.

    Every record must be stored (no compression to inflate), lie inside the file, and the one
    pickle must be small: whatever the directory claims, torch then allocates no more than the file.
    """
    size = file_size(path)
    out: dict[str, tuple[int, int]] = {}
    try:
        with open(path, "rb") as fh, zipfile.ZipFile(fh) as archive:
            infos = archive.infolist()
            if len(infos) > _MAX_RECORDS:
                raise DatasetError(f"{path}: {len(infos)} records in the archive (a packer shard has fewer than "
                                   f"{_MAX_RECORDS})")
            for info in infos:
                stored = info.compress_type == zipfile.ZIP_STORED and info.compress_size == info.file_size
                if not stored or info.flag_bits & 0x1:
                    raise DatasetError(f"{path}: record {info.filename!r:.80} is compressed or encrypted")
                fh.seek(info.header_offset)
                local = fh.read(30)
                if len(local) != 30 or local[:4] != _ZIP_LOCAL:
                    raise DatasetError(f"{path}: record {info.filename!r:.80} has no local header where the "
                                       "directory says")
                name_len, extra_len = struct.unpack_from("<HH", local, 26)
                start = info.header_offset + 30 + name_len + extra_len
                if start + info.file_size > size:
                    raise DatasetError(f"{path}: record {info.filename!r:.80} runs past the end of the file")
                out[info.filename] = (start, info.file_size)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError, struct.error) as exc:
        raise DatasetError(f"{path}: not a torch.save archive ({type(exc).__name__}: {exc})") from exc
    pickles = [name for name in out if name.endswith("/data.pkl")]
    if len(pickles) != 1 or out[pickles[0]][1] > _MAX_PICKLE:
        raise DatasetError(f"{path}: expected one data.pkl of at most {_MAX_PICKLE} bytes in the archive")
    return out


class Writer(ArrayShardWriter):
    suffix = ".pth"

    def write_file(self, path: Path, arrays: dict[str, np.ndarray]) -> None:
        import torch

        torch.save({k: torch.from_numpy(v) for k, v in arrays.items()}, path)


class Reader(ArrayShardReader):
    def load_file(self, fd: int) -> tuple[dict[str, np.ndarray], int | None]:
        import torch

        records = check_archive(self.path)
        try:
            obj = torch.load(self.path, weights_only=True, mmap=True, map_location="cpu")
        except Exception as exc:  # the restricted unpickler's refusals, torch's own checks: never a crash
            raise DatasetError(f"{self.path}: refused or damaged torch.save file ({type(exc).__name__}: "
                               f"{str(exc)[:300]})") from exc
        kinds = {torch.uint8: "u1", torch.int64: "<i8"}
        if type(obj) is not dict or not all(
                type(k) is str and isinstance(v, torch.Tensor) and v.dtype in kinds and v.device.type == "cpu"
                and v.layout == torch.strided and v.is_contiguous() for k, v in obj.items()):
            raise DatasetError(f"{self.path}: not a dict of contiguous uint8/int64 CPU tensors")
        arrays = {k: v.detach().numpy() for k, v in obj.items()}
        return arrays, _data_offset(obj, records, "images")


def _data_offset(tensors: dict, records: dict[str, tuple[int, int]], name: str) -> int | None:
    """Where tensor ``name``'s bytes start in the file (for read-ahead), or None where that can't be told.

    All tensors are views of one map of the file: the map's start is the one that puts every
    tensor's storage at the start of some data record.
    """
    starts = {start for rec, (start, _) in records.items() if "/data/" in rec}
    ptrs = [t.untyped_storage().data_ptr() for t in tensors.values() if t.untyped_storage().nbytes()]
    if name not in tensors or not ptrs:
        return None
    bases = {ptrs[0] - s for s in starts if all(p - (ptrs[0] - s) in starts for p in ptrs)}
    if len(bases) != 1:
        return None
    return tensors[name].data_ptr() - bases.pop()


FORMAT = Format(
    name="pth", dataset_class="PthDataset", payloads=frozenset({"encoded", "raw", "none"}),
    Writer=Writer, Reader=Reader,
    default_shard_bytes=256 << 20,
)
