"""Where each sample's payload lies in its shard's files, and its checksum: what ranged reads of a URL need.

Layout (``meta/``, beside the index; listed in the manifest's ``meta_files`` with their sha256, so they are
checked like the rest of meta/; storage order; written by ``packer.write.ranges`` at conversion):

| file                      | dtype | shape | holds                                                         |
|---------------------------|-------|-------|---------------------------------------------------------------|
| payload_file.npy          | <i4   | [N]   | which of its shard's files holds the payload (manifest order) |
| payload_offset.npy        | <i8   | [N]   | the payload's first byte in that file (it is ``nbytes`` long) |
| payload_crc32.npy         | <u4   | [N]   | zlib's CRC-32 of the payload's bytes                          |

Written only where every sample's payload is one contiguous byte range of a shard file, the very bytes its
format's reader returns (checked at conversion: lmdb, memmap, recordio, hdf5 unchunked, ...); datasets without
them (other formats, older datasets) are read by URL in whole-shard mode (docs/remote.md).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from packer.errors import DatasetError
from packer.layout.fsutil import naming
from packer.layout.index import META_DIR, Index, listed_path
from packer.layout.manifest import Manifest
from packer.layout.trust import load_npy

RANGE_FILES = {"file": f"{META_DIR}/payload_file.npy", "offset": f"{META_DIR}/payload_offset.npy",
               "crc32": f"{META_DIR}/payload_crc32.npy"}
DTYPES = {"file": "<i4", "offset": "<i8", "crc32": "<u4"}
ALGORITHM = "crc32"  # the checksum's name in the storage layer's pieces (packer.storage.cache.check)


def crc32_hex(data: bytes | memoryview) -> str:
    """The CRC-32 of ``data`` as 8 hex digits (what ``packer.storage.cache.check`` compares for ``crc32``)."""
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


@dataclass
class PayloadRanges:
    """Per stored sample: the file of its shard (index into the shard's ``files``), the offset and CRC-32 of its
    payload (its length is the index's ``nbytes``)."""

    file: np.ndarray
    offset: np.ndarray
    crc32: np.ndarray

    def save(self, directory: Path) -> list[str]:
        """Write the arrays under ``directory/meta``; the names written (relative)."""
        (directory / META_DIR).mkdir(exist_ok=True)
        for key, name in RANGE_FILES.items():
            with naming(directory / name):
                np.save(directory / name, np.ascontiguousarray(getattr(self, key), dtype=DTYPES[key]))
        return list(RANGE_FILES.values())

    @classmethod
    def load(cls, directory: Path, manifest: Manifest, index: Index) -> PayloadRanges | None:
        """The ranges recorded in ``directory`` (each file checked against the manifest's size and sha256, every
        range inside its file), or None where the manifest lists none (another format, an older dataset)."""
        listed = {f.name: f for f in manifest.meta_files}
        if not all(name in listed for name in RANGE_FILES.values()):
            return None
        n = manifest.num_samples
        arrays = {key: load_npy(listed_path(directory, name, listed), DTYPES[key], ndim=1, max_items=n)
                  for key, name in RANGE_FILES.items()}
        got = cls(**arrays)
        got.check(manifest, index, directory / META_DIR)
        return got

    def check(self, manifest: Manifest, index: Index, where: Path) -> None:
        """Lengths match the manifest; every payload lies inside a file of its own shard (a crafted file could
        point anywhere)."""
        n = manifest.num_samples
        for key in RANGE_FILES:
            if len(getattr(self, key)) != n:
                raise DatasetError(f"{where}/payload_{key}.npy: {len(getattr(self, key))} entries, manifest says {n}")
        counts = [s.num_samples for s in manifest.shards]
        files = np.repeat(np.array([len(s.files) for s in manifest.shards], dtype=np.int64), counts)
        if len(files) != n:
            raise DatasetError(f"{where}: the shards hold {len(files)} samples, manifest says {n}")
        if n and (int(self.file.min()) < 0 or bool(np.any(self.file >= files))):
            raise DatasetError(f"{where}/payload_file.npy: a file number outside its shard's files (damaged)")
        first = np.concatenate([[0], np.cumsum([len(s.files) for s in manifest.shards])[:-1]]).astype(np.int64)
        sizes = np.array([f.num_bytes for s in manifest.shards for f in s.files], dtype=np.int64)
        size = sizes[np.repeat(first, counts) + self.file] if n else np.zeros(0, dtype=np.int64)
        if n and (int(self.offset.min()) < 0 or bool(np.any(self.offset + index.nbytes > size))):
            raise DatasetError(f"{where}/payload_offset.npy: a payload past the end of its file (damaged)")
