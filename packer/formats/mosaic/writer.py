"""Mosaic shards written: tiles laid out row by row on a canvas, one mosaic image file written when it is full
(the last one cut after its last used row), with its restart-interval index beside a jpeg mosaic."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from packer.errors import OptionError, PackerError, arg
from packer.formats.base import (
    PreparedSample,
    ShardWriter,
)
from packer.formats.mosaic.geometry import (
    EXTENSIONS,
    INDEX_SUFFIX,
    encode,
    expected_intervals,
    geometry,
)
from packer.images import jpegtiles


class Writer(ShardWriter):
    """Fills one mosaic at a time; writes it when full, and the last one, cut after its last row, on close."""

    def __init__(self, directory: Path, shard_id: int, num_samples: int, payload: str, options: dict) -> None:
        if payload != "raw":
            raise OptionError(f"the mosaic format stores decoded pixels: use {arg('payload', 'raw')}")
        self.directory = Path(directory)
        self.shard_id = shard_id
        self.geom = geometry(options)
        self._canvas: np.ndarray | None = None
        self._filled = 0
        self._counts: list[int] = []
        self._names: list[str] = []
        self._sidecars: list[str] = []  # jpeg: the restart-interval index of each mosaic

    def add(self, sample: PreparedSample) -> None:
        g = self.geom
        px = sample.payload
        if not isinstance(px, np.ndarray) or px.shape != (g.tile_h, g.tile_w, 3):
            shape = getattr(px, "shape", None)
            raise PackerError(f"{sample.rel_path}: a mosaic tile must be {g.tile_h}x{g.tile_w}x3, got {shape}")
        if self._canvas is None:
            self._canvas = np.zeros((g.rows * g.tile_h, g.cols * g.tile_w, 3), dtype=np.uint8)
        top, left = g.origin(self._filled)
        self._canvas[top : top + g.tile_h, left : left + g.tile_w] = px
        self._filled += 1
        if self._filled == g.cells:
            self._flush()

    def _flush(self) -> None:
        assert self._canvas is not None
        name = f"mosaic-{self.shard_id:05d}-{len(self._names):06d}.{EXTENSIONS[self.geom.codec]}"
        used = self.geom.shape(self._filled)[0]
        data = encode(np.ascontiguousarray(self._canvas[:used]), self.geom)
        with open(self.directory / name, "xb") as fh:
            fh.write(data)
        self._names.append(name)
        if self.geom.codec == "jpeg":
            index = jpegtiles.restart_index(data, name)
            if len(index) != expected_intervals(self.geom, self._filled):
                import PIL

                raise PackerError(f"{name}: the JPEG encoder wrote {len(index)} restart intervals, expected "
                                  f"{expected_intervals(self.geom, self._filled)}: jpeg mosaics need Pillow >= 10.2 "
                                  f"(restart markers), this is {PIL.__version__}")
            np.save(self.directory / (name + INDEX_SUFFIX), index, allow_pickle=False)
            self._sidecars.append(name + INDEX_SUFFIX)
        self._counts.append(self._filled)
        self._canvas[:] = 0
        self._filled = 0

    def close(self) -> tuple[list[str], dict]:
        if self._filled:
            self._flush()
        g = self.geom
        return self._names + self._sidecars, {"tile": [g.tile_h, g.tile_w], "grid": [g.rows, g.cols], "codec": g.codec,
                                   "quality": g.quality, "samples_per_mosaic": list(self._counts)}

    def abort(self) -> None:
        for name in self._names + self._sidecars:
            try:
                os.remove(self.directory / name)
            except OSError:
                pass
