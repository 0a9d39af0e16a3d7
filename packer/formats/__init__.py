"""The format registry: format name -> its ``Format`` (packer.formats.base), one line per format.

Adding a format is one module here that ends with ``FORMAT = Format(...)`` plus one line in
``FORMATS`` (or ``register`` from outside, e.g. a test); docs/adding-a-format.md walks through one.
"""

from __future__ import annotations

from packer.errors import PackerError
from packer.formats import bmp, hdf5, lmdb, memmap, mosaic, n5, pth, recordio, safetensors
from packer.formats.base import Format

FORMATS: dict[str, Format] = {f.name: f for f in (lmdb.FORMAT, hdf5.FORMAT, memmap.FORMAT, bmp.FORMAT, mosaic.FORMAT,
                                                  recordio.FORMAT, n5.FORMAT, pth.FORMAT, safetensors.FORMAT)}


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise PackerError(f"unknown format {name!r} (choose from {', '.join(FORMATS)})") from None


def register(fmt: Format) -> None:
    """Add a format (e.g. a plug-in, or a test's throw-away one); its name must be new."""
    if fmt.name in FORMATS:
        raise PackerError(f"a format named {fmt.name!r} is registered already")
    FORMATS[fmt.name] = fmt
