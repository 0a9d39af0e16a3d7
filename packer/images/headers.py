"""Image size from the header bytes alone: JPEG and PNG parsed directly, others through Pillow.

``--validate header`` runs this once per file, so it must cost far less than reading the
file: walking JPEG markers to the frame header takes microseconds, ``Image.open`` about ten
times more. A header that can't be parsed is a ``DecodeError``.
"""

from __future__ import annotations

import struct

from packer.images.decode import DecodeError, check_pixels, read_header, sniff

# Start-of-frame markers (baseline, extended, progressive, lossless, arithmetic); not DHT/JPG/DAC.
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_STANDALONE = {0x01, *range(0xD0, 0xD8)}  # TEM, RSTn: no length field


def jpeg_size(data: bytes | memoryview) -> tuple[int, int]:
    """(height, width) from a JPEG's SOF segment."""
    n = len(data)
    pos = 2
    while pos + 4 <= n:
        if data[pos] != 0xFF:
            raise DecodeError(f"corrupt JPEG header (no marker at byte {pos})")
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in _STANDALONE:
            pos += 2
            continue
        if marker in (0xD9, 0xDA):  # EOI or start of scan before any frame header
            break
        (length,) = struct.unpack_from(">H", data, pos + 2)
        if length < 2:
            raise DecodeError(f"corrupt JPEG header (segment length {length} at byte {pos})")
        if marker in _SOF:
            if pos + 9 > n:
                break
            height, width = struct.unpack_from(">HH", data, pos + 5)
            if height == 0 or width == 0:
                raise DecodeError(f"JPEG header gives an empty image ({width}x{height})")
            return height, width
        pos += 2 + length
    raise DecodeError("JPEG header has no frame header (truncated or not a JPEG)")


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
