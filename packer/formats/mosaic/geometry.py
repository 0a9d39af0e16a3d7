"""Mosaic geometry and options: the tile and grid of a mosaic (``--tile``, ``--grid``, ``--codec``,
``--quality``), its blocks for the block sampler, and the encoding of one mosaic image. ``writer`` and ``reader``
build on these.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from PIL import Image

from packer.errors import OptionError, PackerError, arg
from packer.images import bmp as bmpfile
from packer.images.decode import check_pixels
from packer.layout.manifest import Manifest, Shard

DEFAULT_QUALITY = 95  # --codec jpeg

CODECS = ("bmp", "png", "jpeg")
DEFAULT_CODEC = "bmp"
EXTENSIONS = {"bmp": "bmp", "png": "png", "jpeg": "jpg"}
TARGET_MOSAIC_BYTES = 16 << 20  # decoded size the default grid aims at (8-32 MB)
JPEG_MCU = 16  # tiles must be multiples of this for lossless crops, whatever the subsampling
JPEG_MAX_SIDE = 65500
INDEX_SUFFIX = ".rst.npy"  # beside each jpeg mosaic: its restart intervals, int64 [n, 2] (packer.images.jpegtiles)
_PNG_LEVEL = 1  # photos barely compress further at higher levels, which encode slower (docs/results.md)


@dataclass(frozen=True)
class Geometry:
    tile_h: int
    tile_w: int
    rows: int
    cols: int
    codec: str
    quality: int

    @property
    def cells(self) -> int:
        return self.rows * self.cols

    def origin(self, cell: int) -> tuple[int, int]:
        """(top, left) pixel of cell ``cell`` in its mosaic."""
        r, c = divmod(cell, self.cols)
        return r * self.tile_h, c * self.tile_w

    def shape(self, count: int) -> tuple[int, int, int]:
        """Decoded shape of a mosaic holding ``count`` tiles (cut after its last used row)."""
        return math.ceil(count / self.cols) * self.tile_h, self.cols * self.tile_w, 3


def parse_hw(text: str, what: str, form: str = "HxW", example: str = "224x224") -> tuple[int, int]:
    """'224x224' -> (224, 224); ``what``: the option given (its keyword: tile), ``form``/``example``: its shape in
    messages."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", str(text))
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise OptionError(f"{arg(what, text)}: expected {form} of positive integers, e.g. {example}")
    return int(m.group(1)), int(m.group(2))


def default_grid(tile_h: int, tile_w: int) -> tuple[int, int]:
    """Rows and columns making a roughly square mosaic of about TARGET_MOSAIC_BYTES decoded."""
    cells = max(1, round(TARGET_MOSAIC_BYTES / (tile_h * tile_w * 3)))
    cols = max(1, round(math.sqrt(cells * tile_h / tile_w)))
    return max(1, round(cells / cols)), cols


def geometry(options: Mapping) -> Geometry:
    """The mosaic layout asked for by convert options (``tile``, ``grid``, ``codec``, ``quality``), checked."""
    tile = options.get("tile") or options.get("resize")  # a fixed --resize HxW is the tile size too
    if not tile or (not options.get("tile") and "x" not in str(tile).lower()):
        raise OptionError(f"{arg('to', 'mosaic')} needs {arg('tile', 'HxW')}, the size every image is resized to "
                          f"(e.g. {arg('tile', '224x224')})")
    th, tw = parse_hw(tile, "tile" if options.get("tile") else "resize")
    rows, cols = parse_hw(options["grid"], "grid", "RxC", "11x10") if options.get("grid") else default_grid(th, tw)
    codec = options.get("codec") or DEFAULT_CODEC
    if codec not in CODECS:
        raise OptionError(f"unknown mosaic codec {codec!r} (choose from {', '.join(CODECS)})")
    if options.get("quality") is not None and codec != "jpeg":
        raise OptionError(f"{arg('quality')} is for {arg('codec', 'jpeg')} only ({codec} is lossless)")
    quality = jpeg_quality(options)
    if codec == "jpeg":
        if th % JPEG_MCU or tw % JPEG_MCU:
            def near(v: int) -> str:
                lo = max(JPEG_MCU, v // JPEG_MCU * JPEG_MCU)
                return f"{lo}" if lo == v else f"{lo} or {lo + JPEG_MCU}"
            raise OptionError(
                f"{arg('tile', f'{th}x{tw}')}: with {arg('codec', 'jpeg')} tiles must be multiples of {JPEG_MCU} px "
                f"so each tile can be cut out losslessly (height {near(th)}, width {near(tw)}), or use a lossless codec"
            )
        if rows * th > JPEG_MAX_SIDE or cols * tw > JPEG_MAX_SIDE:
            raise OptionError(f"{arg('grid', f'{rows}x{cols}')} of {th}x{tw} tiles exceeds JPEG's {JPEG_MAX_SIDE} px "
                              "limit")
    if codec == "png":  # read by decoding whole mosaics: one must stay within the pixel limit
        try:
            check_pixels(rows * th, cols * tw,
                         what=f"{arg('grid', f'{rows}x{cols}')} of {th}x{tw} tiles makes png mosaics of")
        except PackerError as exc:
            raise OptionError(f"{exc.template}; use a smaller {arg('grid')} or {arg('codec', 'bmp')}") from None
    return Geometry(th, tw, rows, cols, codec, quality)


def jpeg_quality(options: Mapping) -> int:
    """``quality`` of the options, an int 1..100 (95 when not given; 0 is refused, not taken as unset)."""
    quality = options.get("quality")
    if quality is None:
        return DEFAULT_QUALITY
    if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100:
        raise OptionError(f"{arg('quality', quality)}: expected an integer from 1 to 100")
    return quality


def error_bound(options: Mapping) -> tuple[float, int]:
    """(mean, max) absolute pixel error a reader may show against the resize pipeline's output; (0, 0): exact.

    For jpeg, empirical and generous: it grows with libjpeg's quantisation-table scale s (0.1 at quality 95, 0.2 at
    90, 1 at 50), above the worst errors measured on photo, noise and edge tiles (docs/bmp-mosaic.md;
    tests/formats/test_bmp_mosaic.py checks the bound).
    """
    if (options.get("codec") or DEFAULT_CODEC) != "jpeg":
        return 0.0, 0
    q = jpeg_quality(options)
    s = (100 - q) / 50 if q >= 50 else 50 / max(q, 1)
    return 1.0 + 32.0 * s, min(255, int(8 + 240 * s))


def blocks(shard: Shard) -> list[tuple[int, int]]:
    """(start, stop) positions inside ``shard`` of each of its mosaics, in order."""
    counts = [int(c) for c in shard.facts.get("samples_per_mosaic", [])]
    edges = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).tolist()
    return list(zip(edges[:-1], edges[1:], strict=True))


def dataset_blocks(manifest: Manifest) -> list[tuple[int, int]]:
    """(start, stop) dataset indices of every mosaic, in order."""
    out, base = [], 0
    for shard in manifest.shards:
        out += [(base + a, base + b) for a, b in blocks(shard)]
        base += shard.num_samples
    return out


def block_boundaries(manifest: Manifest) -> np.ndarray:
    """Where each mosaic starts, then the sample count: the block sampler's ``blocks`` (one mosaic each).

    ``MosaicDataset.block_boundaries()`` returns this (through ``FORMAT``), so the block sampler uses it.
    """
    starts = [a for a, _b in dataset_blocks(manifest)]
    return np.asarray(starts + [manifest.num_samples], dtype=np.int64)


def encode(canvas: np.ndarray, geom: Geometry) -> bytes:
    if geom.codec == "bmp":
        return bmpfile.encode(canvas)
    buf = io.BytesIO()
    if geom.codec == "png":
        Image.fromarray(canvas).save(buf, "PNG", compress_level=_PNG_LEVEL)
    else:
        # 4:4:4, baseline, a restart marker after each tile-wide band of 8 rows (see packer.images.jpegtiles)
        Image.fromarray(canvas).save(buf, "JPEG", quality=geom.quality, subsampling=0,
                                     restart_marker_blocks=geom.tile_w // 8)
    return buf.getvalue()


def expected_intervals(geom: Geometry, count: int) -> int:
    """Restart intervals in a jpeg mosaic of ``count`` tiles: one per tile column per 8-pixel band."""
    return geom.shape(count)[0] // 8 * geom.cols
