"""Image decoding: libjpeg-turbo (PyTurboJPEG) for JPEG, Pillow for everything else.

Every decoder returns HWC ``uint8`` RGB, matching ``Image.open(f).convert("RGB")`` (what
torchvision's ImageFolder loader returns; EXIF orientation is *not* applied, as there).
The image format is sniffed from the bytes' magic, never from the file name.
"""

from __future__ import annotations

import io
import os
import sys
import warnings
from typing import Literal

import numpy as np
from PIL import Image

from packer.errors import PackerError

Backend = Literal["auto", "turbojpeg", "pil"]
BACKENDS = ("auto", "turbojpeg", "pil")

_MAGIC = (
    (b"\xff\xd8\xff", "jpeg"),
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"BM", "bmp"),
    (b"GIF87a", "gif"),
    (b"GIF89a", "gif"),
    (b"II*\x00", "tiff"),
    (b"MM\x00*", "tiff"),
    (b"P5", "pgm"),
    (b"P6", "ppm"),
)


class DecodeError(PackerError):
    """The bytes are not a complete, decodable image."""


def sniff(data: bytes | memoryview) -> str:
    """Image format from the first bytes: ``jpeg``, ``png``, ``webp``, ... or ``unknown``."""
    head = bytes(data[:12])
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    for magic, name in _MAGIC:
        if head.startswith(magic):
            return name
    return "unknown"


# One TurboJPEG handle per process, loaded on first use (so fork and spawn workers each load their own).
_turbo = None
_turbo_pid = None
_turbo_error: str | None = None
_notice_shown = False


def turbojpeg_handle():
    """The process's TurboJPEG object, or None when libturbojpeg is missing."""
    global _turbo, _turbo_pid, _turbo_error
    if _turbo_pid != os.getpid():
        _turbo_pid = os.getpid()
        try:
            from turbojpeg import TurboJPEG

            _turbo, _turbo_error = TurboJPEG(), None
        except (ImportError, OSError, RuntimeError) as exc:
            _turbo, _turbo_error = None, str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return _turbo


def turbojpeg_available() -> bool:
    return turbojpeg_handle() is not None


def turbojpeg_missing_reason() -> str | None:
    turbojpeg_handle()
    return _turbo_error


def _notice_fallback() -> None:
    global _notice_shown
    if not _notice_shown:
        _notice_shown = True
        print(
            f"packer: libjpeg-turbo not found ({_turbo_error}); decoding JPEG with Pillow, about 1.3x slower. "
            "Install it: apt-get install libturbojpeg0 | conda install libjpeg-turbo | brew install jpeg-turbo",
            file=sys.stderr,
        )


def decode_pil(data: bytes | memoryview) -> np.ndarray:
    """Decode with Pillow exactly as ImageFolder's loader does: ``convert("RGB")``."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            rgb = img if img.mode == "RGB" else img.convert("RGB")
            return np.asarray(rgb)
    except Image.UnidentifiedImageError:
        raise DecodeError(f"not an image format Pillow reads (starts with {bytes(data[:8])!r})") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise DecodeError(f"cannot decode image: {exc}") from exc


# TurboJPEG colorspaces it decodes like Pillow; CMYK (3) and YCCK (4) go to Pillow.
_TURBO_SAFE_COLORSPACES = (0, 1, 2)  # RGB, YCbCr, GRAY


def decode_turbojpeg(data: bytes | memoryview, strict: bool = True) -> np.ndarray | None:
    """Decode a JPEG with libjpeg-turbo; None when it can't (no library, CMYK): use Pillow then."""
    tj = turbojpeg_handle()
    if tj is None:
        return None
    from turbojpeg import TJPF_RGB

    try:
        with warnings.catch_warnings():
            if strict:
                warnings.simplefilter("error")
            _w, _h, _sub, colorspace = tj.decode_header(data)
            if colorspace not in _TURBO_SAFE_COLORSPACES:
                return None
            return tj.decode(data, pixel_format=TJPF_RGB)
    except (OSError, UserWarning) as exc:
        raise DecodeError(f"cannot decode JPEG: {exc}") from exc


def decode(data: bytes | memoryview, backend: Backend = "auto", strict: bool = True) -> np.ndarray:
    """Decode image bytes to HWC uint8 RGB with the chosen backend."""
    if backend not in BACKENDS:
        raise PackerError(f"unknown decoder {backend!r} (choose from {', '.join(BACKENDS)})")
    if backend != "pil" and sniff(data) == "jpeg":
        out = decode_turbojpeg(data, strict=strict)
        if out is not None:
            return out
        if turbojpeg_handle() is None:
            if backend == "turbojpeg":
                raise PackerError(f"decoder 'turbojpeg' asked for, but libturbojpeg is missing ({_turbo_error})")
            _notice_fallback()
    return decode_pil(data)


def read_header(data: bytes | memoryview) -> tuple[int, int]:
    """(height, width) from the image header, without decoding the pixels."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
    except Image.UnidentifiedImageError:
        raise DecodeError(f"not an image format Pillow reads (starts with {bytes(data[:8])!r})") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise DecodeError(f"not a readable image: {exc}") from exc
    return height, width
