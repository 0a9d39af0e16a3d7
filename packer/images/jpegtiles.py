"""Cut one tile out of a JPEG mosaic by copying bytes: restart intervals as a tile index, no transcoding.

The mosaic is written baseline, 4:4:4 (8x8 MCUs), with a restart marker every ``tile_w / 8``
MCUs, so each restart interval is the entropy-coded data of one 8-pixel band of one tile.
Restart markers reset the DC predictors: an interval decodes without the bytes before it.
A tile is then a valid JPEG made of the mosaic's header (its SOF patched to the tile size)
and that tile's ``tile_h / 8`` intervals with renumbered RST markers: reading one tile costs
about one tile's bytes and one tile's decode, pixels identical to decoding the whole mosaic.
libjpeg-turbo's lossless crop (``TurboJPEG.crop``) gives the same pixels but entropy-decodes
the whole mosaic on every call.

The interval index, ``int64 [n, 2]`` (start, stop) byte ranges excluding markers, is found once
when the mosaic is written and stored beside it (``<mosaic>.rst.npy``).
"""

from __future__ import annotations

import struct

import numpy as np

from packer.errors import DatasetError
from packer.images.decode import DecodeError, jpeg_markers
from packer.images.magic import is_jpeg

_SOF_BASELINE = (0xC0, 0xC1)
_SOS, _EOI = 0xDA, 0xD9


def scan_start(data: bytes | memoryview, where: object) -> tuple[int, int]:
    """(offset of the SOF segment, offset where the entropy-coded scan starts) of a baseline JPEG."""
    if not is_jpeg(data):
        raise DatasetError(f"{where}: not a JPEG file")
    sof = -1
    try:
        for pos, marker, length in jpeg_markers(data):
            if marker in _SOF_BASELINE:
                if length < 8:
                    raise DatasetError(f"{where}: damaged JPEG frame header")
                sof = pos
            elif 0xC2 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
                raise DatasetError(f"{where}: not a baseline JPEG (SOF marker {marker:#x})")
            if marker == _SOS:
                if sof < 0:
                    raise DatasetError(f"{where}: JPEG scan without a frame header")
                if pos + 2 + length > len(data):
                    raise DatasetError(f"{where}: damaged JPEG header (scan header runs past the data)")
                return sof, pos + 2 + length
    except DecodeError as exc:
        raise DatasetError(f"{where}: {exc}") from None
    raise DatasetError(f"{where}: JPEG header ends before its scan")


def restart_index(data: bytes, where: object) -> np.ndarray:
    """``int64 [n, 2]`` byte ranges of the n restart intervals of a single-scan JPEG."""
    _sof, start = scan_start(data, where)
    buf = np.frombuffer(data, dtype=np.uint8)
    scan = buf[start:]
    marks = np.flatnonzero((scan[:-1] == 0xFF) & (scan[1:] >= 0xD0) & (scan[1:] <= 0xD7)) + start
    if len(data) < 2 or data[-2] != 0xFF or data[-1] != _EOI:
        raise DatasetError(f"{where}: JPEG does not end with EOI")
    starts = np.concatenate([[start], marks + 2])
    stops = np.concatenate([marks, [len(data) - 2]])
    return np.stack([starts, stops], axis=1).astype("<i8")


def tile_jpeg(data, index: np.ndarray, first: int, count: int, cols: int, tile_h: int, tile_w: int,
              where: object) -> bytes:
    """A JPEG of the ``count`` intervals ``first, first + cols, ...`` (one tile's bands, top to bottom)."""
    sof, start = scan_start(data, where)
    header = bytearray(data[:start])
    struct.pack_into(">HH", header, sof + 5, tile_h, tile_w)  # SOF: length, precision, height, width
    parts = [bytes(header)]
    for j in range(count):
        a, b = index[first + j * cols]
        parts.append(bytes(data[a:b]))
        parts.append(b"\xff" + bytes([0xD0 + j % 8]) if j + 1 < count else b"\xff\xd9")
    return b"".join(parts)
