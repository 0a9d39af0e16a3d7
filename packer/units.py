"""Byte sizes: parse what users type ('512MB', '2GiB') and print sizes people read."""

from __future__ import annotations

import argparse
import re


def parse_bytes(text: str) -> int:
    """'1GB', '512MB', '64k', '1000' -> bytes (decimal units; KiB/MiB/GiB are binary)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgGtT]?)(i?)[bB]?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MB, 1GB, 2GiB)")
    num, unit, binary = float(m.group(1)), m.group(2).lower(), m.group(3)
    base = 1024 if binary else 1000
    return int(num * base ** "_kmgt".index(unit or "_"))


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
