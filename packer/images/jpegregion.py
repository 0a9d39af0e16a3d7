"""JPEG region decode: only the rows and columns a crop needs, at a DCT scale, into a given buffer; and the
lossless rewrite (a restart marker per MCU) that lets a region decode skip the entropy-coded data around it.

The work is done by the optional compiled extension ``packer.images._jpegregion`` (libjpeg's
``jpeg_crop_scanline`` + ``jpeg_skip_scanlines``; built by setup.py where libjpeg's headers are). Without it
:func:`region_decode_available` is False and callers decode the whole image instead (one notice per process).
Pixels are identical to the same rows and columns of a whole decode at that scale (docs/decoding.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from packer.compiled import jpeg_region
from packer.images.decode import DecodeError, check_pixels, pixel_limit, writable_as

_EXT = jpeg_region()
_jpegregion = _EXT.module


def region_decode_available() -> bool:
    """Whether the compiled region decoder loaded."""
    return _EXT.available


def region_decode_missing_reason() -> str | None:
    return _EXT.missing


def notice_missing() -> None:
    """Say once per process that crops decode the whole JPEG, and how to build the region decoder."""
    _EXT.notice()


def decode_region(data: bytes | memoryview, d: int, top: int, left: int, height: int, width: int,
                  image_size: tuple[int, int], strict: bool = True, out: np.ndarray | None = None) -> np.ndarray | None:
    """Rows ``top:top+height``, columns ``left:left+width`` of a JPEG (``image_size`` = (height, width) per its
    header) decoded at 1/``d``, as HWC uint8 RGB, into ``out`` when it has that shape. None for a CMYK/YCCK JPEG
    (decode it whole), or when the extension is missing. ``strict``: libjpeg's warnings (truncated or corrupt
    data within the rows read) are a DecodeError; rows below the region are never read."""
    if _jpegregion is None:
        return None
    check_pixels(*image_size)
    shape = (height, width, 3)
    target = out if out is not None and writable_as(out, shape) else np.empty(shape, np.uint8)
    try:
        done = _jpegregion.decode_region(data, d, top, left, target, strict, pixel_limit() or 0)
    except ValueError as exc:
        raise DecodeError(f"cannot decode JPEG: {exc}") from None
    return target if done else None


def decode_regions(datas: Sequence[bytes | memoryview], regions: np.ndarray, outs: Sequence[np.ndarray],
                   strict: bool = False) -> bytes | None:
    """``decode_region`` for many JPEGs in one call without the GIL (a decode thread's chunk of fused crops).
    ``regions``: int64 (n, 5) of (d, top, left, image height, image width) per item, the header having to say that
    size. Per item one byte, 1: done, the pixels ``decode_region`` gives; else not done (not a JPEG, CMYK, a
    header of another size, an error): ``decode_region`` it then, which says what is wrong. None: not built."""
    if _jpegregion is None:
        return None
    return _jpegregion.decode_many(datas, outs, strict, pixel_limit() or 0, regions)


def restart_transcode(data: bytes | memoryview) -> bytes | None:
    """The JPEG ``data`` rewritten losslessly with a restart marker after every MCU: the same DCT coefficients,
    quantization and sampling (so the same pixels, any decoder), Huffman tables optimized, APPn/COM markers kept.
    ``decode_region`` then decodes only the crop's MCUs (docs/decoding.md). None where the bytes stay as they
    are: not an 8-bit YCbCr or grayscale JPEG, damaged data, above the pixel limit, or the extension not built."""
    if _jpegregion is None:
        return None
    return _jpegregion.restart_transcode(data, pixel_limit() or 0)
