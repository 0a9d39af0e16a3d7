"""Crafted mosaic shards: headers are checked against the manifest's geometry before anything is
decoded, and tile indexes go through the checked ``.npy`` loader, so nothing is allocated beyond
what the packed mosaic justifies. Risky reads run in a forked child with a small address-space
allowance (tests/support/memlimit.py): a regression fails instead of taking the test runner's memory.
"""

from __future__ import annotations

import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from support.fuzzing import _npy_bytes, _rewrite_checksums
from support.memlimit import limited_call

from packer import convert, open_dataset
from packer.formats import mosaic
from packer.formats.mosaic import geometry as mosaic_geometry
from packer.layout.manifest import read_manifest

SIDE = 12000  # a 12000x12000 mosaic: 432 MB once decoded
ALLOWANCE = 300 << 20


@pytest.fixture(scope="module")
def bases(imagefolder, tmp_path_factory):
    root = tmp_path_factory.mktemp("mosaic-trust")
    for codec in ("png", "jpeg"):
        convert(imagefolder, root / codec, to="mosaic", tile="16x16", grid="2x4", codec=codec, workers=1,
                progress=False)
    return root


@pytest.fixture
def copy(bases, tmp_path):
    def make(codec: str) -> Path:
        shutil.copytree(bases / codec, tmp_path / codec)
        return tmp_path / codec
    return make


def patch_png_size(path: Path, height: int, width: int) -> None:
    data = bytearray(path.read_bytes())
    struct.pack_into(">II", data, 16, width, height)
    struct.pack_into(">I", data, 29, zlib.crc32(bytes(data[12:29])))
    path.write_bytes(bytes(data))


def patch_jpeg_size(path: Path, height: int, width: int) -> None:
    data = bytearray(path.read_bytes())
    sof = next(i for i in range(2, len(data) - 9) if data[i] == 0xFF and data[i + 1] == 0xC0)
    struct.pack_into(">HH", data, sof + 5, height, width)
    path.write_bytes(bytes(data))


def _read_tiles(path: Path, tile_read: str | None) -> int:
    """Every tile of the dataset's first shard (``tile_read`` None: through open_dataset)."""
    if tile_read is None:
        ds = open_dataset(path, image="numpy")
        return sum(ds[i][0].size for i in range(len(ds)))
    shard = read_manifest(path).shards[0]
    reader = mosaic.Reader(path, shard, "raw", tile_read=tile_read)
    return sum(reader.read(i).size for i in range(shard.num_samples))


@pytest.mark.parametrize(("codec", "tile_read"), [("png", None), ("jpeg", "full"), ("jpeg", "crop"),
                                                  ("jpeg", "segments")])
def test_mosaic_header_disagreeing_with_the_geometry_is_refused_before_decoding(copy, codec, tile_read, turbojpeg):
    ds = copy(codec)
    first = ds / read_manifest(ds).shards[0].files[0].name
    (patch_png_size if codec == "png" else patch_jpeg_size)(first, SIDE, SIDE)
    _rewrite_checksums(ds)
    kind, message = limited_call(_read_tiles, ds, tile_read, limit=ALLOWANCE)
    assert kind == "DatasetError" and f"image header says {SIDE}x{SIDE}, the manifest says 32x64" in message, \
        (kind, message)
    assert first.name in message


def test_tile_index_with_a_huge_header_is_refused(copy):
    ds = copy("jpeg")
    index = ds / read_manifest(ds).shards[0].files[-1].name
    assert index.name.endswith(mosaic_geometry.INDEX_SUFFIX)
    body = np.load(index).tobytes()
    index.write_bytes(_npy_bytes("{'descr': '<i8', 'fortran_order': False, 'shape': (1099511627776, 2), }") + body)
    _rewrite_checksums(ds)
    kind, message = limited_call(_read_tiles, ds, None, limit=ALLOWANCE)
    assert kind == "DatasetError" and index.name in message and "header promises" in message, (kind, message)

