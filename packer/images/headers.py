"""Image size from the header bytes alone: JPEG (packer.images.decode.jpeg_size) and PNG parsed directly, others
through Pillow.

``--validate header`` runs this once per file, so it must cost far less than reading the
file: walking JPEG markers to the frame header takes microseconds, ``Image.open`` about ten
times more. A header that can't be parsed is a ``DecodeError``.
"""

from __future__ import annotations

import struct

from packer.images.decode import DecodeError, check_pixels, jpeg_markers, jpeg_size, read_header
from packer.images.magic import is_jpeg, sniff


def png_size(data: bytes | memoryview) -> tuple[int, int]:
    if len(data) < 24 or bytes(data[12:16]) != b"IHDR":
        raise DecodeError("PNG header has no IHDR chunk (truncated or corrupt)")
    width, height = struct.unpack_from(">II", data, 16)
    if height == 0 or width == 0:
        raise DecodeError(f"PNG header gives an empty image ({width}x{height})")
    return height, width


def check_size(data: bytes | memoryview, height: int, width: int) -> None:
    """Refuse encoded bytes whose header gives another size than (height, width) ((0, 0): not known) or
    one above the pixel limit: checked before any decoder allocates for a damaged header."""
    hh, ww = image_size(data)
    if (height or width) and (hh, ww) != (height, width):
        raise DecodeError(f"image header says {hh}x{ww}, the index says {height}x{width} (damaged)")
    check_pixels(hh, ww)


def image_size(data: bytes | memoryview) -> tuple[int, int]:
    """(height, width) of encoded image bytes, reading only the header."""
    kind = sniff(data)
    if kind == "jpeg":
        return jpeg_size(data)
    if kind == "png":
        return png_size(data)
    return read_header(data)


def jpeg_segments(data: bytes | memoryview) -> list[tuple[int, bytes]]:
    """(marker, payload) of each segment of a JPEG's header, up to its first scan (``decode.jpeg_markers``). A header
    that runs past the data or is not made of markers is a DecodeError."""
    if not is_jpeg(data):
        raise DecodeError("not a JPEG (no SOI marker)")
    out = []
    for pos, marker, length in jpeg_markers(data):
        if pos + 2 + length > len(data):
            raise DecodeError(f"damaged JPEG header at byte {pos}")
        out.append((marker, bytes(data[pos + 4:pos + 2 + length])))
        if marker == 0xDA:
            return out
    raise DecodeError("JPEG header ends before its scan")
