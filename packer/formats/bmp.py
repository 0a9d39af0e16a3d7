"""BMP: every image decoded once and stored as an uncompressed 24-bit BMP, in a tree mirroring the source.

| file                          | holds                                                          |
|-------------------------------|----------------------------------------------------------------|
| images/<source path>.bmp      | one ordinary bottom-up 24-bit BMP per sample (any viewer opens |
|                               | it); e.g. ``cat/001.jpg`` -> ``images/cat/001.jpg.bmp``         |

The whole source name is kept and ``.bmp`` appended, so ``a.jpg`` and ``a.png`` in one folder
can never clash, whatever shard each lands in, and the source name stays readable. A name
component that can't be a portable file name here (longer than 251 bytes once ``.bmp`` is
added, a backslash, bytes that are not UTF-8) is shortened to an ASCII prefix plus a hash of
the whole source path: still deterministic and unique. A shard is a run of about 1 GB of
these files (the unit a resumed conversion keeps); the manifest lists every file with its
sha256, in sample order, and the reader finds sample ``pos`` of a shard as its ``pos``-th file.

Trades disk (~3 bytes per pixel) for decode time: reading is a file read plus one numpy copy
(``packer.images.bmp``), no codec. The manifest grows by about 150 bytes per image.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from packer.errors import DatasetError, OptionError, PackerError, arg
from packer.formats.base import Format, PreparedSample, ShardReader, ShardWriter
from packer.images import bmp as bmpfile
from packer.layout.manifest import Shard

TREE = "images"
_NAME_MAX = 255


def _portable(component: str, rel: str, suffix: str = "") -> str:
    try:
        ok = len((component + suffix).encode("utf-8")) <= _NAME_MAX and "\\" not in component
    except UnicodeEncodeError:  # undecodable bytes in the source name (surrogate escapes)
        ok = False
    if ok and component not in ("", ".", ".."):
        return component + suffix
    prefix = "".join(ch if ch.isascii() and (ch.isalnum() or ch in "._-") else "_" for ch in component)[:64]
    digest = hashlib.sha256(rel.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return f"{prefix}~{digest}{suffix}"


def bmp_name(rel_path: str) -> str:
    """The file name (relative to the dataset directory) that holds the sample packed from ``rel_path``."""
    parts = rel_path.split("/")
    dirs = [_portable(p, rel_path) for p in parts[:-1]]
    return "/".join([TREE, *dirs, _portable(parts[-1], rel_path, ".bmp")])


class Writer(ShardWriter):
    def __init__(self, directory: Path, shard_id: int, num_samples: int, payload: str, options: dict) -> None:
        if payload != "raw":
            raise OptionError(f"the bmp format stores decoded pixels: use {arg('payload', 'raw')}")
        self.directory = Path(directory)
        self._names: list[str] = []
        self._made: set[Path] = set()

    def add(self, sample: PreparedSample) -> None:
        if not isinstance(sample.payload, np.ndarray):
            raise PackerError(f"{sample.rel_path}: the bmp format needs decoded pixels")
        name = bmp_name(sample.rel_path)
        path = self.directory / name
        if path.parent not in self._made:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._made.add(path.parent)
        try:
            fh = open(path, "xb")  # "x": two samples must never share a file
        except FileExistsError:
            raise PackerError(f"{path}: two source files map to this name (a case-insensitive output "
                              f"filesystem?); convert onto a case-sensitive one") from None
        with fh:
            fh.write(bmpfile.encode(sample.payload))
        self._names.append(name)

    def close(self) -> tuple[list[str], dict]:
        return list(self._names), {"layout": f"{TREE}/<source path>.bmp"}

    def abort(self) -> None:
        for name in self._names:
            try:
                os.remove(self.directory / name)
            except OSError:
                pass


class Reader(ShardReader):
    """Reads one shard's BMP files; nothing is kept open, so fork and spawn workers need nothing special."""

    def __init__(self, directory: Path, shard: Shard, payload: str, access: str = "sequential") -> None:
        self.directory = Path(directory)
        self.names = [f.name for f in shard.files]
        if len(self.names) != shard.num_samples:
            raise DatasetError(f"{directory}: a bmp shard lists {len(self.names)} files for {shard.num_samples} "
                               "samples")

    def __len__(self) -> int:
        return len(self.names)

    def read(self, pos: int) -> np.ndarray:
        """HWC uint8 RGB pixels of sample ``pos``, from our own header parser (no Pillow)."""
        return bmpfile.read(self.directory / self.names[pos])

    def read_many(self, positions: list[int]) -> list[np.ndarray]:
        return [self.read(p) for p in positions]

    def will_need(self, positions: list[int]) -> None:
        """Ask the kernel to start reading these samples' files, all at once (deep queue, overlapped IO)."""
        if not hasattr(os, "posix_fadvise"):
            return
        for pos in positions:
            try:
                fd = os.open(self.directory / self.names[pos], os.O_RDONLY)
            except OSError:
                continue  # read() will report it
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)


FORMAT = Format(
    name="bmp", dataset_class="BMPDataset", payloads=frozenset({"raw"}), Writer=Writer, Reader=Reader,
    default_shard_bytes=1 << 30,  # a shard is a run of files of the tree: the unit a resumed conversion keeps
)
