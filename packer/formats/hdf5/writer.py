"""HDF5 shards written with h5py, in format versions no newer than HDF5 1.10's (files checked readable by its
``h5ls``/``h5dump``): never variable-length datasets (one heap lookup per element, and no compression); blobs
chunked ``BLOB_CHUNK``; fixed-shape raw datasets one image per chunk; ``--compression lzf|gzip`` (raw payloads
only) runs in the writing process (gzip is in every HDF5 library, lzf is h5py's own filter).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import cast

import h5py
import numpy as np

from packer._version import __version__
from packer.formats.base import (
    BlobIndex,
    PreparedSample,
    ShardWriter,
    fixed_shape,
)

BLOB_CHUNK = 1 << 20  # a blob's chunk: the chunk index stays small (1,000 entries per GB)
BLOB_CHUNK_COMPRESSED = 256 << 10  # inflated whole: a random read inflates about one 256-px image more
_WRITE_BYTES = 16 << 20  # buffer this much before each write call
_LIBVER = ("earliest", "v110")  # readable by HDF5 >= 1.10 (h5py >= 2.8)
FILTERS = {None: [], "gzip": [h5py.h5z.FILTER_DEFLATE], "lzf": [h5py.h5z.FILTER_LZF]}  # per --compression

_DESCRIBE = {
    ("encoded", "blob"): "original image files, byte for byte, back to back; image i is "
    "images[offsets[i]:offsets[i+1]]",
    ("raw", "blob"): "decoded RGB pixels back to back; image i is "
    "images[offsets[i]:offsets[i+1]].reshape(shapes[i]) (height, width, 3)",
    ("raw", "fixed"): "decoded RGB pixels, one image per row: images[i] is (height, width, 3) uint8",
    ("none", "blob"): "no images (samples of fields and labels only): images is empty, offsets all 0",
}


def shard_name(shard_id: int) -> str:
    return f"shard-{shard_id:05d}.h5"


class Writer(ShardWriter):
    def __init__(self, directory: Path, shard_id: int, num_samples: int, payload: str, options: dict) -> None:
        self.name = shard_name(shard_id)
        self.path = directory / self.name
        self.payload = payload
        self.shape = fixed_shape(payload, options)
        self.compression = options.get("compression")
        self.index = BlobIndex(self.path, num_samples, payload, self.shape)
        self._pending: list[np.ndarray] = []  # fixed layout: images not yet written
        self._blob = bytearray()  # blob layout: bytes not yet written
        # No chunk cache: every chunk goes to disk when written, so a full disk fails the write that
        # filled it with an OSError; failing later inside h5py's close() leaves objects that crash
        # the interpreter when collected. (The driver reports the OSError and keeps finished shards.)
        self._file = h5py.File(self.path, "w", libver=_LIBVER, rdcc_nbytes=0)
        if self.shape is not None:
            self._images = self._file.create_dataset(
                "images", shape=(num_samples, *self.shape), maxshape=(None, *self.shape), dtype="u1",
                chunks=(1, *self.shape), compression=self.compression)
        else:
            chunk = BLOB_CHUNK_COMPRESSED if self.compression else BLOB_CHUNK
            self._images = self._file.create_dataset(
                "images", shape=(0,), maxshape=(None,), dtype="u1", chunks=(chunk,), compression=self.compression)

    def add(self, sample: PreparedSample) -> None:
        self.index.add(sample)
        data = sample.payload
        if self.shape is not None:
            self._pending.append(cast(np.ndarray, data))
            if len(self._pending) * sample.nbytes >= _WRITE_BYTES:
                self._flush()
        else:
            self._blob += data if isinstance(data, bytes) else data.data.cast("B")
            if len(self._blob) >= _WRITE_BYTES:
                self._flush()

    def _flush(self, final: bool = False) -> None:
        """Write what is buffered; blobs only in whole chunks until the end, so no chunk is written twice."""
        if self.shape is not None:
            if self._pending:
                stop = self.index.count
                self._images[stop - len(self._pending) : stop] = np.stack(self._pending)
                self._pending = []
            return
        chunk = cast(tuple, self._images.chunks)[0]  # the blob is always chunked
        n = len(self._blob) if final else len(self._blob) // chunk * chunk
        if n:
            start = int(self._images.shape[0])
            self._images.resize((start + n,))
            # Split off the head instead of viewing and then shrinking the buffer: a view that
            # lingers anywhere (h5py, a traceback) would make the shrink fail with BufferError.
            head, self._blob = self._blob[:n], self._blob[n:]
            self._images[start : start + n] = np.frombuffer(head, dtype=np.uint8)

    def _check_room(self) -> None:
        """Refuse before HDF5 writes its index and metadata at close if they might not fit (see __init__)."""
        chunks = self._images.id.get_num_chunks()
        need = 40 * self.index.count + 64 * chunks + (1 << 20)  # offsets, labels, shapes; chunk index, headers
        st = os.statvfs(self.path.parent)
        free = st.f_bavail * st.f_frsize
        if free < need:
            raise OSError(errno.ENOSPC, f"{free} bytes free, closing {self.name} needs about {need}")

    def close(self) -> tuple[list[str], dict]:
        self._flush(final=True)
        self._check_room()
        n, f = self.index.count, self._file
        layout = "fixed" if self.shape is not None else "blob"
        if self.shape is not None and n != self.index.planned:  # samples failed validation
            self._images.resize((n, *self.shape))
        self._images.attrs["description"] = _DESCRIBE[(self.payload, layout)]
        if self.shape is None:
            f.create_dataset("offsets", data=self.index.offsets[: n + 1]).attrs["description"] = (
                "int64 [N+1]: image i is images[offsets[i]:offsets[i+1]]")
        if self.payload == "raw" and self.shape is None:
            f.create_dataset("shapes", data=self.index.shapes[:n]).attrs["description"] = (
                "int64 [N,3]: (height, width, 3) of image i")
        f.create_dataset("labels", data=self.index.labels[:n]).attrs["description"] = (
            "int64 [N]: class index of image i (-1: no class); class names are in the packer "
            "dataset's manifest.json, source paths in its meta/")
        f.attrs.update({
            "packer_format": "hdf5",
            "packer_version": __version__,
            "payload": self.payload,
            "layout": layout,
            "num_samples": n,
            "description": f"{n} images packed by packer ({self.payload} payload, {layout} layout): "
            + _DESCRIBE[(self.payload, layout)],
        })
        f.close()
        facts: dict = {"layout": layout, "compression": self.compression}
        if self.shape is not None:
            facts["shape"] = list(self.shape)
        return [self.name], facts

    def abort(self) -> None:
        try:
            os.truncate(self.path, 0)  # frees the disk first, so HDF5 can write what close() flushes
        except OSError:
            pass
        try:
            self._file.close()
        except (OSError, RuntimeError):
            pass  # the file goes anyway
        self.path.unlink(missing_ok=True)
