"""Uncompressed 24-bit BMP files, written and read with numpy alone (no Pillow on the read path).

| bytes       | field (little-endian)                                                        |
|-------------|------------------------------------------------------------------------------|
| 0..14       | BITMAPFILEHEADER: ``BM``, file size <u4, 2 reserved <u2, pixel offset <u4     |
| 14..54      | BITMAPINFOHEADER: size 40 <u4, width <i4, height <i4 (> 0: rows bottom-up,    |
|             | < 0: top-down), planes 1, bits 24, compression 0 (BI_RGB), image size <u4,    |
|             | pixels per metre x/y <i4, colours used/important 0                            |
| offset..    | rows of B,G,R bytes, each padded to a multiple of 4 bytes                     |

Written files are the classic bottom-up layout every viewer opens. The reader validates
every header field it relies on, so a damaged file gives a PackerError naming it instead of
garbage pixels or a huge allocation; it also accepts the larger V4/V5 info headers and
top-down files, which other tools write.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

from packer.errors import DatasetError, PackerError
from packer.images.decode import check_pixels

_FILE_HEADER = struct.Struct("<2sIHHI")  # 14 bytes
_INFO_HEADER = struct.Struct("<IiiHHIIiiII")  # 40 bytes (BITMAPINFOHEADER)
HEADER_BYTES = _FILE_HEADER.size + _INFO_HEADER.size  # 54
_INFO_SIZES = (40, 52, 56, 108, 124)  # BITMAPINFOHEADER, V2, V3, V4, V5: all start with the same 40 bytes
_PELS_PER_METRE = 2835  # 72 dpi
_BI_RGB = 0


def row_stride(width: int) -> int:
    """Bytes per stored row: 3 per pixel, padded to a multiple of 4."""
    return (width * 3 + 3) & ~3


@dataclass(frozen=True)
class BmpHeader:
    width: int
    height: int  # always positive
    top_down: bool
    offset: int  # where the pixel array starts
    stride: int


def encode(pixels: np.ndarray) -> bytes:
    """HWC uint8 RGB -> the bytes of a bottom-up 24-bit BMP file."""
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
        raise PackerError(f"BMP needs HWC uint8 RGB pixels, got {pixels.dtype} {pixels.shape}")
    h, w = pixels.shape[:2]
    stride = row_stride(w)
    size = HEADER_BYTES + stride * h
    if size >= 1 << 32 or h < 1 or w < 1:
        raise PackerError(f"an image of {h}x{w} pixels cannot be stored as a BMP file")
    rows = np.zeros((h, stride), dtype=np.uint8)
    rows[:, : w * 3] = pixels[::-1, :, ::-1].reshape(h, w * 3)  # bottom row first, BGR
    head = _FILE_HEADER.pack(b"BM", size, 0, 0, HEADER_BYTES) + _INFO_HEADER.pack(
        40, w, h, 1, 24, _BI_RGB, stride * h, _PELS_PER_METRE, _PELS_PER_METRE, 0, 0
    )
    return head + rows.tobytes()


def parse_header(head: bytes | memoryview, file_size: int, where: object) -> BmpHeader:
    """Validate the first bytes of a BMP file of ``file_size`` bytes; ``where`` names it in errors."""

    def bad(reason: str) -> PackerError:
        return DatasetError(f"{where}: damaged BMP file: {reason}")

    if len(head) < HEADER_BYTES or file_size < HEADER_BYTES:
        raise bad(f"{min(len(head), file_size)} bytes, too short for the 54-byte header")
    magic, size, _r1, _r2, offset = _FILE_HEADER.unpack_from(head, 0)
    info, width, height, planes, bits, compression, _image, _xp, _yp, _used, _imp = _INFO_HEADER.unpack_from(head, 14)
    if magic != b"BM":
        raise bad(f"magic is {magic!r}, expected b'BM'")
    if size != file_size:
        raise bad(f"header says {size} bytes, the file has {file_size}")
    if info not in _INFO_SIZES:
        raise bad(f"info header size {info} (expected one of {_INFO_SIZES})")
    if planes != 1 or bits != 24:
        raise bad(f"{bits} bits per pixel in {planes} planes; only 24-bit BMPs are read")
    if compression != _BI_RGB:
        raise bad(f"compression {compression}; only uncompressed (BI_RGB) BMPs are read")
    if width <= 0 or height == 0 or height == -(1 << 31):
        raise bad(f"size {width}x{height}")
    stride = row_stride(width)
    if offset < _FILE_HEADER.size + info or offset + stride * abs(height) > file_size:
        raise bad(f"pixel array at offset {offset} ({abs(height)} rows of {stride} bytes) does not fit in "
                  f"{file_size} bytes")
    return BmpHeader(width=width, height=abs(height), top_down=height < 0, offset=offset, stride=stride)


def _rows(buf, header: BmpHeader, first: int, count: int) -> np.ndarray:
    """Stored rows [first, first+count) as a (count, stride) view of ``buf`` (file order)."""
    return np.frombuffer(buf, dtype=np.uint8, count=count * header.stride,
                         offset=header.offset + first * header.stride).reshape(count, header.stride)


def region(buf, header: BmpHeader, top: int, left: int, height: int, width: int) -> np.ndarray:
    """Pixels [top:top+height, left:left+width] (image coordinates, top row 0) as a new HWC RGB array.

    ``buf`` is the whole file (bytes or an mmap): only the rows and columns asked for are touched.
    """
    if top < 0 or left < 0 or top + height > header.height or left + width > header.width:
        raise PackerError(f"region {height}x{width} at ({top}, {left}) is outside a {header.height}x{header.width} BMP")
    check_pixels(height, width)  # the one pixel limit of every decode path, before allocating
    first = top if header.top_down else header.height - top - height
    band = _rows(buf, header, first, height)[:, left * 3 : (left + width) * 3].reshape(height, width, 3)
    if not header.top_down:
        band = band[::-1]
    out = np.empty((height, width, 3), dtype=np.uint8)
    out[..., 0], out[..., 1], out[..., 2] = band[..., 2], band[..., 1], band[..., 0]  # BGR -> RGB
    return out


def decode(buf, header: BmpHeader) -> np.ndarray:
    """The whole image as a new HWC uint8 RGB array."""
    return region(buf, header, 0, 0, header.height, header.width)


def read(path: str | os.PathLike) -> np.ndarray:
    """Read and validate one BMP file; HWC uint8 RGB."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise PackerError(f"{path}: cannot read BMP file ({exc.strerror or exc})") from exc
    return decode(data, parse_header(data, len(data), path))
