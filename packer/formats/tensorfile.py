"""What the pth and safetensors formats share: a shard as one file of a few named arrays (a dict of tensors).

| name     | dtype | shape     | holds                                                          |
|----------|-------|-----------|----------------------------------------------------------------|
| images   | uint8 | [N,H,W,3] | raw, one shape (``--resize HxW``): RGB pixels                   |
| images   | uint8 | [B]       | encoded: the files' bytes back to back (raw, mixed shapes: HWC  |
|          |       |           | pixels back to back)                                           |
| offsets  | int64 | [N+1]     | blob layouts: sample i is ``images[offsets[i]:offsets[i+1]]``    |
| shapes   | int64 | [N,3]     | raw, mixed shapes: (h, w, 3) of each sample                     |
| labels   | int64 | [N]       | class index (-1 for a flat folder); names in manifest.json      |

The writer streams payloads into a scratch file beside the shard (``<shard>.images.tmp``), then
writes the shard from a read-only map of it and removes it: memory stays flat whatever the shard
size, at the price of writing the images twice and needing their size again in free disk
space while a shard is closed. A format supplies only ``write_file`` (its file) and
``load_file`` (its checked, read-only arrays); readers here check names, dtypes and shapes
against the manifest and the offsets against the blob before any sample is sliced out.
"""

from __future__ import annotations

import os
from abc import abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

import numpy as np

from packer.errors import DatasetError
from packer.formats.base import (
    BlobIndex,
    PreparedSample,
    ShardWriter,
    check_offsets,
    fixed_shape,
    shard_layout,
)
from packer.formats.blob import Blob, BlobReader
from packer.formats.filemap import check_size, closed_on_error, open_checked
from packer.layout.manifest import Shard
from packer.perprocess import PerProcess

SCRATCH_SUFFIX = ".images.tmp"


def expected_arrays(payload: str, shape: tuple[int, int, int] | None, n: int) -> dict[str, tuple[str, tuple | None]]:
    """name -> (numpy dtype, shape; None for the blob, whose length the offsets give) of a shard's arrays."""
    if shape is not None:
        return {"images": ("u1", (n, *shape)), "labels": ("<i8", (n,))}
    out: dict[str, tuple[str, tuple | None]] = {"images": ("u1", None), "offsets": ("<i8", (n + 1,))}
    if payload == "raw":
        out["shapes"] = ("<i8", (n, 3))
    out["labels"] = ("<i8", (n,))
    return out


class ArrayShardWriter(ShardWriter):
    """Collects one shard's payloads and per-sample arrays; ``write_file`` turns them into the format's file."""

    suffix: ClassVar[str]

    def __init__(self, directory: Path, shard_id: int, num_samples: int, payload: str, options: Mapping) -> None:
        super().__init__(directory, shard_id, num_samples, payload, options)
        self.shape = fixed_shape(payload, options)
        self.name = f"shard-{shard_id:05d}{self.suffix}"
        self.path = self.directory / self.name
        self.scratch = self.directory / (self.name + SCRATCH_SUFFIX)
        self.index = BlobIndex(self.path, num_samples, payload, self.shape)
        self._fh = open(self.scratch, "wb")  # OSError (disk full) propagates: the driver reports it

    def add(self, sample: PreparedSample) -> None:
        self.index.add(sample)
        data = sample.payload
        self._fh.write(data if isinstance(data, bytes) else data.data)  # a C-contiguous uint8 array: no copy

    def close(self) -> tuple[list[str], dict]:
        self._fh.close()
        n = self.index.count
        total = int(self.index.offsets[n])
        # mode "c": a private map, writable for torch.from_numpy, never written back
        images = np.memmap(self.scratch, dtype=np.uint8, mode="c", shape=(total,)) if total else np.zeros(0, np.uint8)
        arrays = {"images": images.reshape((n, *self.shape)) if self.shape is not None else images}
        if self.shape is None:
            arrays["offsets"] = self.index.offsets[: n + 1]
            if self.payload == "raw":
                arrays["shapes"] = self.index.shapes[:n]
        arrays["labels"] = self.index.labels[:n]
        try:
            self.write_file(self.path, arrays)
        finally:
            del arrays, images  # drop the map before removing its file
            self.scratch.unlink(missing_ok=True)
        facts: dict = {"layout": "fixed", "shape": list(self.shape)} if self.shape is not None else {"layout": "blob"}
        return [self.name], facts

    @abstractmethod
    def write_file(self, path: Path, arrays: dict[str, np.ndarray]) -> None:
        """Write ``arrays`` (in the table's order) as the format's file at ``path``."""

    def abort(self) -> None:
        try:
            self._fh.close()
        except OSError:
            pass  # flushing fails again on a full disk: the files go anyway
        self.scratch.unlink(missing_ok=True)
        self.path.unlink(missing_ok=True)


class ArrayShardReader(BlobReader):
    """Reads one shard file through ``load_file``'s read-only arrays, loaded on first use in each process."""

    def __init__(self, directory: Path, shard: Shard, payload: str, access: str = "sequential") -> None:
        if len(shard.files) != 1:
            raise DatasetError(f"{directory}: a shard of this format is one file, the manifest lists "
                               f"{len(shard.files)}")
        self.path = Path(directory) / shard.files[0].name
        self.num_bytes = shard.files[0].num_bytes
        self.num_samples = shard.num_samples
        self.payload = payload
        self.access = access
        self.fixed_shape = shard_layout(shard.facts, self.path)
        self._h: PerProcess[Blob] = PerProcess()

    @abstractmethod
    def load_file(self, fd: int) -> tuple[dict[str, np.ndarray], int | None]:
        """The file's arrays, read-only, without reading their bytes (maps); and the images' offset in the file.
        ``fd``: the file, open and of the manifest's size (``filemap.open_checked``)."""

    def _open(self) -> Blob:
        with closed_on_error(open_checked(self.path, self.num_bytes)) as fd:
            return self._arrays(fd)

    def _blob(self) -> Blob:
        b = self._h.get(self._open)
        check_size(b.fd, self.num_bytes, self.path)
        return b

    def _arrays(self, fd: int) -> Blob:
        arrays, images_at = self.load_file(fd)
        want = expected_arrays(self.payload, self.fixed_shape, self.num_samples)
        if sorted(arrays) != sorted(want):
            raise DatasetError(f"{self.path}: holds arrays {sorted(arrays)!r:.200}, expected {list(want)}")
        for name, (dtype, shape) in want.items():
            arr = arrays[name]
            if arr.dtype != np.dtype(dtype) or (shape is not None and arr.shape != shape) or (
                    shape is None and arr.ndim != 1):
                raise DatasetError(f"{self.path}: {name} is {arr.dtype} {arr.shape}, expected {dtype} {shape or '[B]'}")
            arr.flags.writeable = False  # views handed out must never change what later reads see
        images, offsets, shapes = arrays["images"], arrays.get("offsets"), arrays.get("shapes")
        # in memory of our own, not views of the file's map: read_copies and file_spans look them up in threads
        # that a file truncated meanwhile must not kill
        offsets, shapes = (None if a is None else np.array(a) for a in (offsets, shapes))
        if offsets is not None:
            check_offsets(offsets, self.num_samples, len(images), f"{self.path}: offsets")
        if shapes is not None and (offsets is None or np.any(shapes < 0) or np.any(shapes[:, 2] != 3)
                                   or not np.array_equal(shapes.prod(axis=1), np.diff(offsets))):
            raise DatasetError(f"{self.path}: shapes do not match the offsets")
        return Blob(images, offsets, shapes, self.path, self.num_bytes, fd, images_at)

    def __len__(self) -> int:
        return self.num_samples

    def close(self) -> None:
        self._h.close(lambda b: os.close(b.fd))  # the maps go when the last view of them does
        super().close()


def file_size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError as exc:
        raise DatasetError(f"{path}: cannot stat ({exc.strerror or exc})") from exc
