"""Image decoding: libjpeg-turbo (PyTurboJPEG) for JPEG, Pillow for everything else.

Every decoder returns HWC ``uint8`` RGB, matching ``Image.open(f).convert("RGB")`` (what
torchvision's ImageFolder loader returns; EXIF orientation is *not* applied, as there).
The image format is sniffed from the bytes' magic, never from the file name.

``min_size=S`` asks for decode-time downscaling: a JPEG is decoded at the smallest DCT scale
(1/2, 1/4, 1/8) whose short side is still >= S; both backends pick the same scale and give
the same size (libjpeg-turbo ``scaling_factor`` / Pillow ``draft``). Other formats have no
cheap scaled decode and come back at full size.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import struct
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np
from PIL import Image

from packer.compiled import jpeg_region
from packer.errors import DatasetError, MissingPackageError, OptionError
from packer.images.magic import is_jpeg
from packer.perprocess import PerProcess

log = logging.getLogger(__name__)  # under "packer": the command line prints it, a library user routes it

_native = jpeg_region().module  # the compiled region decoder (images.jpegregion): here whole JPEGs into a buffer

Backend = Literal["auto", "turbojpeg", "pil"]
BACKENDS = ("auto", "turbojpeg", "pil")

class DecodeError(DatasetError):
    """The bytes are not a complete, decodable image (damaged data: a DatasetError)."""


# ------------------------------------------------------------------ the pixel limit

def pixel_limit() -> int | None:
    """The most pixels an image may have: twice Pillow's ``Image.MAX_IMAGE_PIXELS`` (read now), where
    Pillow raises its DecompressionBombError; None when that is None (no limit)."""
    limit = Image.MAX_IMAGE_PIXELS
    return None if limit is None else 2 * int(limit)


def check_pixels(height: int, width: int, what: str = "image header says") -> None:
    """Refuse an image of this size (from its header or metadata) above :func:`pixel_limit`, before any
    pixel is allocated: every decode path calls this, so a 1 KB file can't claim gigabytes."""
    limit = pixel_limit()
    if limit is not None and int(height) * int(width) > limit:
        raise DecodeError(
            f"{what} {int(height)}x{int(width)} ({int(height) * int(width)} pixels), above the pixel "
            f"limit of {limit} (2 x PIL.Image.MAX_IMAGE_PIXELS, Pillow's decompression-bomb rule; raise that "
            "to read larger images)")


# ------------------------------------------------------------------ decode-time downscaling

SCALE_DENOMINATORS = (8, 4, 2)  # the DCT scales libjpeg-turbo and Pillow's draft() both offer


def scale_denominator(height: int, width: int, min_size: int | None) -> int:
    """The largest d in 8, 4, 2 (else 1) whose 1/d-scaled image keeps its short side >= min_size.

    Scaled sides are ceil(side / d), as libjpeg computes them.
    """
    if not min_size:
        return 1
    short = min(height, width)
    for d in SCALE_DENOMINATORS:
        if short >= d and -(-short // d) >= min_size:
            return d
    return 1


def scaled_shape(height: int, width: int, min_size: int | None) -> tuple[int, int]:
    """(height, width) that ``decode(..., min_size=min_size)`` returns for a JPEG of this size."""
    d = scale_denominator(height, width, min_size)
    return -(-height // d), -(-width // d)


def check_min_size(min_size: int | None) -> int | None:
    """Validate a user's decode size: None (full size) or a positive int."""
    if min_size is None:
        return None
    if isinstance(min_size, bool) or not isinstance(min_size, (int, np.integer)) or min_size < 1:
        raise OptionError(f"decode size must be a positive number of pixels or None, not {min_size!r}")
    return int(min_size)


# ------------------------------------------------------------------ JPEG header (packer.images.headers for others)

# Start-of-frame markers (baseline, extended, progressive, lossless, arithmetic); not DHT/JPG/DAC.
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_STANDALONE = {0x01, *range(0xD0, 0xD8)}  # TEM, RSTn: no length field


def jpeg_markers(data: bytes | memoryview) -> Iterator[tuple[int, int, int]]:
    """(offset, marker, length) of each segment of a JPEG's header, in order, through its first SOS; fill bytes
    and standalone markers (TEM, RSTn) skipped, the walk ending at EOI or where the data does (callers say what
    they missed). A byte where a marker belongs, or a length below 2, is a DecodeError naming the offset. The one
    header walker: sizes (``jpeg_size``), metadata (``headers.jpeg_segments``), tiles (``jpegtiles.scan_start``)."""
    n, pos = len(data), 2
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
        if marker == 0xD9:  # EOI
            return
        (length,) = struct.unpack_from(">H", data, pos + 2)
        if length < 2:
            raise DecodeError(f"corrupt JPEG header (segment length {length} at byte {pos})")
        yield pos, marker, length
        if marker == 0xDA:
            return
        pos += 2 + length


def jpeg_size(data: bytes | memoryview) -> tuple[int, int]:
    """(height, width) from a JPEG's SOF segment."""
    return jpeg_frame(data)[:2]


def jpeg_frame(data: bytes | memoryview) -> tuple[int, int, int]:
    """(height, width, number of components) from a JPEG's SOF segment (4: CMYK or YCCK; 0: the data ends first)."""
    for pos, marker, length in jpeg_markers(data):
        if marker == 0xDA:
            break  # a scan before any frame header
        if marker in _SOF:
            if pos + 9 > len(data):
                break  # the frame header cut short
            if length < 8:  # precision, height, width, components: a size read past it would be another segment's
                raise DecodeError(f"corrupt JPEG header (frame header of {length} bytes at byte {pos})")
            height, width = struct.unpack_from(">HH", data, pos + 5)
            components = data[pos + 9] if pos + 10 <= len(data) else 0  # 0: cut short before it
            if height == 0 or width == 0:
                raise DecodeError(f"JPEG header gives an empty image ({width}x{height})")
            return height, width, components
    raise DecodeError("JPEG header has no frame header (truncated or not a JPEG)")


# ------------------------------------------------------------------ libjpeg-turbo handle

_notice_shown = False
_TJPF_RGB = 0  # turbojpeg.TJPF_RGB, set when the handle loads


def _load_turbojpeg():
    """Load libturbojpeg through PyTurboJPEG (raises ImportError/OSError/RuntimeError if missing)."""
    import turbojpeg

    global _TJPF_RGB
    _TJPF_RGB = turbojpeg.TJPF_RGB
    return turbojpeg.TurboJPEG()


def _turbo_state() -> tuple[Any, str | None]:
    """(the TurboJPEG handle or None, why it is missing or None)."""
    try:
        return _load_turbojpeg(), None
    except (ImportError, OSError, RuntimeError) as exc:
        return None, str(exc).splitlines()[0] if str(exc) else type(exc).__name__


# One TurboJPEG handle per process, loaded on first use (so fork and spawn workers each load their own).
_TURBO: PerProcess[tuple[Any, str | None]] = PerProcess(_turbo_state)


def turbojpeg_handle():
    """The process's TurboJPEG object, or None when libturbojpeg is missing."""
    return _TURBO.get()[0]


def turbojpeg_available() -> bool:
    return turbojpeg_handle() is not None


def turbojpeg_missing_reason() -> str | None:
    return _TURBO.get()[1]


def _notice_fallback() -> None:
    """Say once per process that JPEGs go through Pillow, and how to get libjpeg-turbo."""
    global _notice_shown
    if not _notice_shown:
        _notice_shown = True
        log.warning(
            "libjpeg-turbo not found (%s); decoding JPEG with Pillow, about 1.15-1.3x slower (docs/decoding.md). "
            "Install it: apt-get install libturbojpeg0 | conda install libjpeg-turbo | brew install jpeg-turbo",
            turbojpeg_missing_reason(),
        )


# ------------------------------------------------------------------ backends

def decode_pil(data: bytes | memoryview, min_size: int | None = None) -> np.ndarray:
    """Decode with Pillow exactly as ImageFolder's loader does: ``convert("RGB")``.

    With ``min_size``, JPEGs are decoded at the DCT scale of :func:`scale_denominator` via ``draft``.
    """
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            check_pixels(height, width)  # Image.open reads the header only: nothing allocated yet
            if min_size and img.format == "JPEG":
                d = scale_denominator(height, width, min_size)
                if d > 1:
                    # draft() picks the largest scale s in 8,4,2,1 with s <= min(W // w, H // h):
                    # asking for (W // d, H // d) makes that exactly d.
                    img.draft("RGB", (width // d, height // d))
            img.load()
            rgb = img if img.mode == "RGB" else img.convert("RGB")
            return np.asarray(rgb)
    except Image.UnidentifiedImageError:
        raise DecodeError(f"not an image format Pillow reads (starts with {bytes(data[:8])!r})") from None
    except Image.DecompressionBombError as exc:  # Pillow's own check of the same limit, inside Image.open
        raise DecodeError(f"above the pixel limit of {pixel_limit()} ({exc})") from exc
    except (OSError, ValueError, SyntaxError) as exc:
        raise DecodeError(f"cannot decode image: {exc}") from exc


# TurboJPEG colorspaces it decodes like Pillow; CMYK (3) and YCCK (4) go to Pillow.
TURBO_SAFE_COLORSPACES = (0, 1, 2)  # RGB, YCbCr, GRAY


def decode_turbojpeg(data: bytes | memoryview, strict: bool = True, min_size: int | None = None,
                     out: np.ndarray | None = None) -> np.ndarray | None:
    """Decode a JPEG with libjpeg-turbo; None when it can't (no library, CMYK/YCCK): use Pillow then.

    ``strict`` turns libjpeg's warnings (e.g. truncated data) into a DecodeError. ``out``: see
    :func:`decode` (libjpeg-turbo writes into it directly when its shape fits).
    """
    tj = turbojpeg_handle()
    if tj is None:
        return None
    try:
        with warnings.catch_warnings() if strict else contextlib.nullcontext():
            if strict:
                warnings.simplefilter("error")
            width, height, _sub, colorspace = tj.decode_header(data)
            check_pixels(height, width)
            if colorspace not in TURBO_SAFE_COLORSPACES:
                return None
            d = scale_denominator(height, width, min_size) if min_size else 1
            shape = (-(-height // d), -(-width // d), 3)
            fits = writable_as(out, shape)
            # PyTurboJPEG's own array is np.empty: for some corrupt data, not strict, it came back unwritten
            dst = out if fits else np.zeros(shape, np.uint8)
            return tj.decode(data, pixel_format=_TJPF_RGB, scaling_factor=(1, d) if d > 1 else None, dst=dst)
    except (OSError, UserWarning) as exc:
        raise DecodeError(f"cannot decode JPEG: {exc}") from exc


def decode_into(data: bytes | memoryview, backend: Backend | str, strict: bool, out: np.ndarray) -> np.ndarray | None:
    """A whole JPEG decoded at full size by the compiled extension straight into ``out``: one call without the
    GIL, no header read through ctypes first, no handle set up per image (docs/results.md). Returns ``out``;
    None where it can't and another path decodes: the ``pil`` backend, not a JPEG, no libjpeg-turbo (the
    extension or PyTurboJPEG's library missing: ``decode`` says so), CMYK/YCCK, or ``out`` not a writable
    C-contiguous uint8 array (within the pixel limit) of the header's (height, width, 3): the header's size is
    checked against ``out`` before any pixel is decoded. Same library and settings as PyTurboJPEG's decode
    (read to the end marker: an error there is one): the same pixels and errors."""
    fits = (out.dtype == np.uint8 and out.ndim == 3 and out.shape[2] == 3 and out.flags.c_contiguous
            and max(out.shape[:2]) <= 0xFFFF)  # JPEG's own limit on a side: a larger out is no JPEG's shape
    limit = pixel_limit()
    if (backend == "pil" or _native is None or not (fits and out.flags.writeable)
            or (limit is not None and out.shape[0] * out.shape[1] > limit)
            or not is_jpeg(data) or turbojpeg_handle() is None):
        return None  # (a header above the limit or unlike out: the other path refuses it with its own words)
    try:
        # out's size is within the limit and the header must equal it (else 0: the other path says what is wrong)
        done = _native.decode_region(data, 1, 0, 0, out, strict, 0, True)
    except ValueError as exc:
        raise DecodeError(f"cannot decode JPEG: {exc}") from None
    return out if done else None


def decode_many(datas: Sequence[bytes | memoryview], outs: Sequence[np.ndarray], backend: Backend | str,
                strict: bool) -> bytes | None:
    """Whole JPEGs decoded at full size by the compiled extension, ``datas[k]`` into ``outs[k]``, in one call without
    the GIL (a ThreadLoader's decode thread: less CPU than ``decode_into`` for each, docs/results.md).
    Per item one byte, 1: done, the same pixels and settings as ``decode_into``; else not done (not a JPEG, CMYK,
    an ``out`` not of the header's size, an error): decode it with ``decode`` then, which says what is wrong.
    None where the extension does not decode here (``decode_into``'s reasons)."""
    if backend == "pil" or _native is None or turbojpeg_handle() is None:
        return None
    return _native.decode_many(datas, outs, strict, pixel_limit() or 0)


def _header_shaped(data: bytes | memoryview) -> np.ndarray | None:
    """An empty (height, width, 3) array as the JPEG header says, for the extension to decode into; None where
    the header can't be read here or is above the pixel limit (the other path then says what is wrong).
    PyTurboJPEG's own array is no better: it handed back uninitialised memory for some corrupt data when not
    strict, where libjpeg (through the extension) and Pillow refuse it."""
    try:
        height, width = jpeg_size(data)
    except DecodeError:
        return None
    limit = pixel_limit()
    return None if limit is not None and height * width > limit else np.empty((height, width, 3), np.uint8)


def decode(
    data: bytes | memoryview, backend: Backend | str = "auto", strict: bool = True, min_size: int | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Decode image bytes to HWC uint8 RGB with the chosen backend.

    ``auto``: libjpeg-turbo for JPEG when it loads, Pillow otherwise. ``turbojpeg``: the same,
    but a missing library is an error. ``pil``: Pillow only. ``min_size``: see the module docs.
    ``out``: a uint8 array to put the pixels in (e.g. a slot of a shared batch); returned when the
    image has its shape, else the pixels come back in a new array.
    """
    if backend not in BACKENDS:
        raise OptionError(f"unknown decoder {backend!r} (choose from {', '.join(BACKENDS)})")
    if backend != "pil" and is_jpeg(data):
        if min_size is None and _native is not None and turbojpeg_handle() is not None:  # the compiled extension:
            # into out, else into an array of its own (without libturbojpeg, Pillow and its notice, as before)
            if out is not None and decode_into(data, backend, strict, out) is not None:
                return out
            target = _header_shaped(data)
            if target is not None and decode_into(data, backend, strict, target) is not None:
                return copy_into(target, out)
        pixels = decode_turbojpeg(data, strict=strict, min_size=min_size, out=out)
        if pixels is not None:
            return copy_into(pixels, out)
        if turbojpeg_handle() is None:
            if backend == "turbojpeg":
                raise MissingPackageError("decoder 'turbojpeg' asked for, but libturbojpeg is missing "
                                          f"({turbojpeg_missing_reason()})")
            _notice_fallback()
    return copy_into(decode_pil(data, min_size=min_size), out)


def pil_loader(path: str | os.PathLike) -> Image.Image:
    """torchvision ImageFolder's ``default_loader`` (its PIL path): the file at ``path`` as an RGB PIL image."""
    with open(path, "rb") as f:
        img = Image.open(f)
        return img.convert("RGB")


def writable_as(out: np.ndarray | None, shape: tuple[int, ...]) -> bool:
    """Whether pixels of ``shape`` can be written straight into ``out``: a writable C-contiguous uint8 array of
    that shape (a decoder writes through a read-only one: a read-only map is a crash)."""
    return (out is not None and out.shape == shape and out.dtype == np.uint8 and out.flags.c_contiguous
            and out.flags.writeable)


def copy_into(pixels: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """``out`` holding ``pixels`` when the shapes agree and it is writable (no copy if it already does: the same
    memory, raw pixels read straight into their slot), else ``pixels``."""
    if out is None or pixels is out or pixels.shape != out.shape or not out.flags.writeable:
        return pixels
    if pixels.__array_interface__ != out.__array_interface__ or pixels.dtype != out.dtype:
        np.copyto(out, pixels)
    return out


def read_header(data: bytes | memoryview) -> tuple[int, int]:
    """(height, width) from the image header, without decoding the pixels."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
    except Image.UnidentifiedImageError:
        raise DecodeError(f"not an image format Pillow reads (starts with {bytes(data[:8])!r})") from None
    except Image.DecompressionBombError as exc:
        raise DecodeError(f"above the pixel limit of {pixel_limit()} ({exc})") from exc
    except (OSError, ValueError, SyntaxError) as exc:
        raise DecodeError(f"not a readable image: {exc}") from exc
    return height, width
