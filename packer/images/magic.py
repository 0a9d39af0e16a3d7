"""What encoded image bytes are, from their first bytes, never from a file name: the one table of magic numbers."""

from __future__ import annotations

JPEG = b"\xff\xd8\xff"  # start of image, then the first marker
PNG = b"\x89PNG\r\n\x1a\n"
MAGIC = (
    (JPEG, "jpeg"),
    (PNG, "png"),
    (b"BM", "bmp"),
    (b"GIF87a", "gif"),
    (b"GIF89a", "gif"),
    (b"II*\x00", "tiff"),
    (b"MM\x00*", "tiff"),
    (b"P5", "pgm"),
    (b"P6", "ppm"),
)


def sniff(data: bytes | memoryview) -> str:
    """Image format from the first bytes: ``jpeg``, ``png``, ``webp``, ... or ``unknown``."""
    head = bytes(data[:12])
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    for magic, name in MAGIC:
        if head.startswith(magic):
            return name
    return "unknown"


def is_jpeg(data: bytes | memoryview) -> bool:
    """Whether the bytes start as a JPEG does (cheaper than ``sniff`` on a hot path)."""
    return bytes(data[:3]) == JPEG
