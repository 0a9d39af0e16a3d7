"""Mosaic shards: images resized to one tile size and laid out row by row on a grid; each mosaic is one image file.

| file                              | holds                                                    |
|-----------------------------------|----------------------------------------------------------|
| mosaic-<shard>-<n>.bmp/.png/.jpg  | one mosaic: up to rows x cols tiles of tile_h x tile_w,  |
|                                   | sample k of the mosaic at row k // cols, column k % cols  |
| mosaic-<shard>-<n>.jpg.rst.npy    | jpeg only: <i8 [n, 2] byte ranges of its restart intervals |

Shard facts (manifest): ``tile`` [h, w], ``grid`` [rows, cols], ``codec``, ``quality`` and
``samples_per_mosaic`` (one count per mosaic; the shard's files list the mosaics in order, then
for jpeg their indexes): every mosaic is full except the last of a
shard, which is cut after its last used row (unused cells of that row are black). One mosaic
is one block of neighbouring samples for the block sampler (``block_boundaries``).

Codecs: ``bmp`` (default; lossless, uncompressed, one tile is read from a memory map without
touching the rest), ``png`` (lossless, smaller, but the whole mosaic is decoded for any tile:
kept in a small per-process cache, so read it in block order), ``jpeg`` (explicit, lossy, the
smallest; 4:4:4 with tiles on MCU boundaries and a restart marker per tile band, so one tile is
cut out by copying its bytes and decoded alone, identical to decoding the whole mosaic: see
``packer.images.jpegtiles``; each jpeg mosaic has its interval index beside it, ``<mosaic>.rst.npy``).
The default grid makes one mosaic about 16 MB decoded. ``geometry`` holds the tile and grid arithmetic and the
options, ``writer`` and ``reader`` the two directions.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from packer.argtypes import int_in
from packer.errors import OptionError, arg
from packer.formats.base import Format, Option
from packer.formats.mosaic import geometry
from packer.formats.mosaic.geometry import CODECS, block_boundaries, error_bound
from packer.formats.mosaic.reader import Reader
from packer.formats.mosaic.writer import Writer
from packer.images.resize import ResizeSpec
from packer.layout.manifest import Manifest

__all__ = ["FORMAT", "Reader", "Writer"]


class MosaicFormat(Format):
    """Mosaic's hooks: its layout options are checked up front, shards hold whole mosaics, jpeg is lossy."""

    def check_options(self, options: Mapping) -> None:
        tile, resize = options.get("tile"), options.get("resize")
        geometry.geometry(options)  # --tile and --grid, named as given
        tile_spec, resize_spec = ResizeSpec.parse(tile, option="tile"), ResizeSpec.parse(resize)
        if tile_spec is not None and resize_spec is not None and tile_spec.fixed_shape != resize_spec.fixed_shape:
            raise OptionError(f"{arg('tile', tile)} already sets the size; drop {arg('resize', resize)}")

    def implied_resize(self, options: Mapping) -> str | None:
        return options.get("tile")

    def shard_multiple(self, options: Mapping) -> int:
        """Tiles per mosaic: shards of whole mosaics, so only a shard's last one is partly filled."""
        return geometry.geometry(options).cells

    def error_bound(self, options: Mapping) -> tuple[float, int]:
        return error_bound(options)

    def block_boundaries(self, manifest: Manifest) -> np.ndarray:
        return block_boundaries(manifest)


FORMAT = MosaicFormat(
    name="mosaic", dataset_class="MosaicDataset", payloads=frozenset({"raw"}), Writer=Writer, Reader=Reader,
    default_shard_bytes=1 << 30,  # resume granularity of a long conversion; shards hold whole mosaics
    options=(
        Option("tile", "mosaic: the size every image is resized to (stretched, or letterboxed with "
               "--resize-mode fit); required for --to mosaic", metavar="HxW"),
        Option("grid", "mosaic: tiles per mosaic, rows x columns (default: about 16 MB decoded per mosaic, "
               "e.g. 11x10 for 224x224 tiles)", metavar="RxC"),
        Option("codec", "mosaic file codec: bmp (default; lossless, a tile is read without decoding the rest), "
               "png (lossless, smaller, whole mosaics decoded), jpeg (lossy, smallest; tiles multiples of 16 px)",
               choices=CODECS),
        Option("quality", "mosaic jpeg quality 1-100 (default 95)", type=int_in(1, 100)),
    ),
)
