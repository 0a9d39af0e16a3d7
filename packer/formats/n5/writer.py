"""N5 shards written: images streamed into block files as they fill, the small arrays and every attributes file
at close (layout: ``packer.formats.n5``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from math import prod
from pathlib import Path

from packer.errors import OptionError, arg
from packer.formats.base import (
    BlobIndex,
    PreparedSample,
    ShardWriter,
    fixed_shape,
)
from packer.formats.n5.blocks import (
    ATTRIBUTES,
    BLOCK_BYTES,
    MAX_BLOCK_BYTES,
    N5_VERSION,
    Array,
    shard_dir,
    write_block,
    write_dataset,
    write_json,
)
from packer.units import parse_bytes


def block_bytes(options: Mapping) -> int | None:
    """``--n5-block`` in bytes (a number, or a size such as ``64KiB`` from the Python API), else None."""
    value = options.get("n5_block")
    if value is None:
        return None
    try:
        size = value if type(value) is int else parse_bytes(str(value))
    except ValueError as exc:  # argparse.ArgumentTypeError is a ValueError
        raise OptionError(f"{arg('n5_block', value)}: {exc}") from None
    if not 1 <= size <= MAX_BLOCK_BYTES:
        raise OptionError(f"{arg('n5_block', value)}: must be between 1 byte and {MAX_BLOCK_BYTES >> 20} MiB")
    return size


class Writer(ShardWriter):
    """Streams images into blocks as they fill; the small arrays and all attributes are written at close."""

    def __init__(self, directory: Path, shard_id: int, num_samples: int, payload: str, options: Mapping) -> None:
        super().__init__(directory, shard_id, num_samples, payload, options)
        self.shape = fixed_shape(payload, options)
        self.compression = options.get("compression") or "raw"
        self.name = shard_dir(shard_id)
        self.root = self.directory / self.name
        target = block_bytes(options) or BLOCK_BYTES
        if self.shape is not None:  # whole images per block
            self.rows = max(1, target // prod(self.shape))
            self.step = self.rows * prod(self.shape)
        else:
            self.rows = self.step = target
        self.index = BlobIndex(self.root, num_samples, payload, self.shape)
        self._pending = bytearray()
        self._blocks: list[str] = []
        (self.root / "images").mkdir(parents=True, exist_ok=True)  # OSError propagates: the driver reports it

    def _images(self, total: int) -> Array:
        if self.shape is not None:
            return Array((total // prod(self.shape), *self.shape), self.rows, "uint8", self.compression)
        return Array((total,), self.rows, "uint8", self.compression)

    def add(self, sample: PreparedSample) -> None:
        self.index.add(sample)
        data = sample.payload
        self._pending += data if isinstance(data, bytes) else data.data.cast("B")
        while len(self._pending) >= self.step:
            self._flush(self.step)

    def _flush(self, n: int) -> None:
        j = len(self._blocks)
        # The block's edge sizes come from the total so far: a full block is never an edge.
        arr = self._images(j * self.step + n)
        head, self._pending = self._pending[:n], self._pending[n:]
        self._blocks.append(write_block(self.root, "images", arr, j, head))

    def close(self) -> tuple[list[str], dict]:
        if self._pending:
            self._flush(len(self._pending))
        n = self.index.count
        images = self._images(int(self.index.offsets[n]))
        names = [ATTRIBUTES, *write_dataset(self.root, "images", images, None), *self._blocks]
        layout = "fixed" if self.shape is not None else "blob"
        if self.shape is None:
            names += write_dataset(self.root, "offsets", Array((n + 1,), n + 1, "int64"), self.index.offsets[: n + 1])
            if self.payload == "raw":
                names += write_dataset(self.root, "shapes", Array((n, 3), max(n, 1), "int64"), self.index.shapes[:n])
        names += write_dataset(self.root, "labels", Array((n,), max(n, 1), "int64"), self.index.labels[:n])
        write_json(self.root / ATTRIBUTES, {"n5": N5_VERSION, "packer": {
            "format": "n5", "payload": self.payload, "layout": layout, "num_samples": n,
            "description": _DESCRIBE[(self.payload, layout)]}})
        facts: dict = {"layout": layout, "rows": self.rows,
                       "compression": None if self.compression == "raw" else "gzip"}
        if self.shape is not None:
            facts["shape"] = list(self.shape)
        return [f"{self.name}/{x}" for x in names], facts

    def abort(self) -> None:
        for dirpath, _dirnames, filenames in os.walk(self.root, topdown=False):
            for f in filenames:
                os.unlink(os.path.join(dirpath, f))
            os.rmdir(dirpath)


_DESCRIBE = {
    ("encoded", "blob"): "original image files back to back; image i is images[offsets[i]:offsets[i+1]]",
    ("raw", "blob"): "decoded RGB pixels back to back; image i is images[offsets[i]:offsets[i+1]] "
    "reshaped to shapes[i] (height, width, 3)",
    ("raw", "fixed"): "decoded RGB pixels: images is (N, height, width, 3) uint8 in numpy order",
    ("none", "blob"): "no images (samples of fields and labels only): images is empty, offsets all 0",
}

