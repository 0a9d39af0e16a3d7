"""argparse types that check ranges: a nonsense value is a usage error (exit 2) before any work starts.

Shared by the CLI and by the options formats declare (``packer.formats.base.Option``), whose flags
the CLI generates.
"""

from __future__ import annotations

import argparse
import math
import re

from packer.units import parse_bytes


def csv_of(kind):
    """argparse type: a comma-separated list of at least one ``kind``."""
    def parse(text: str):
        try:
            values = tuple(kind(v.strip()) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"expected at least one value, got {text!r}")
        return values
    return parse


def int_in(low: int, high: int | None = None):
    """argparse type: an integer from ``low`` to ``high`` (None: no upper bound)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(
                f"{value} is out of range: expected {low} to {high}" if high is not None
                else f"{value} is out of range: expected {low} or more")
        return value
    return parse


def float_in(low: float, high: float, above: bool = False, below: bool = False):
    """argparse type: a finite number from ``low`` (``above``: more than ``low``) to ``high`` (``below``: less)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < low or (above and value == low) or value > high or (
                below and value == high):
            raise argparse.ArgumentTypeError(f"{text} is out of range: expected {'more than' if above else 'from'} "
                                             f"{low:g} to {'less than ' if below else ''}{high:g}")
        return value
    return parse


def size_arg(text: str) -> int:
    """argparse type: a size in bytes (512MB, 1GiB, ...) of at least one byte."""
    try:
        value = parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MB, 1GB, 2GiB)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range: expected at least 1 byte")
    return value


def hw_arg(max_side: int):
    """argparse type: ``HxW`` with both sides from 1 to ``max_side``."""
    def parse(text: str) -> tuple[int, int]:
        m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
        if not m:
            raise argparse.ArgumentTypeError(f"expected HxW, e.g. 375x500, got {text!r}")
        h, w = int(m.group(1)), int(m.group(2))
        if not (1 <= h <= max_side and 1 <= w <= max_side):
            raise argparse.ArgumentTypeError(f"{text!r} is out of range: sides from 1 to {max_side}")
        return h, w
    return parse
