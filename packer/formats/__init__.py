"""The format registry: format name -> its ``Format`` (packer.formats.base), one line per format.

Adding a format is one module here that ends with ``FORMAT = Format(...)`` plus one line in
``FORMATS`` (or ``register`` from outside, e.g. a test); docs/adding-a-format.md walks through one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from packer.errors import DatasetError, OptionError, PackerError, arg
from packer.formats import bmp, hdf5, lmdb, memmap, mosaic, n5, pth, recordio, safetensors
from packer.formats.base import Format
from packer.layout.manifest import OPTION_TYPES

FORMATS: dict[str, Format] = {f.name: f for f in (lmdb.FORMAT, hdf5.FORMAT, memmap.FORMAT, bmp.FORMAT, mosaic.FORMAT,
                                                  recordio.FORMAT, n5.FORMAT, pth.FORMAT, safetensors.FORMAT)}


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise OptionError(f"unknown format {name!r} (choose from {', '.join(FORMATS)})") from None


def register(fmt: Format) -> None:
    """Add a format (e.g. a plug-in, or a test's throw-away one); its name must be new."""
    if fmt.name in FORMATS:
        raise PackerError(f"a format named {fmt.name!r} is registered already")
    FORMATS[fmt.name] = fmt


def check_recorded_options(name: str, options: Mapping[str, Any], where: object) -> None:
    """Refuse a manifest's recorded options that format ``name`` never writes: another format's or an
    unknown one (non-empty), or its own in a state its ``check_options`` refuses. The common options
    are typed by the manifest itself (OPTION_TYPES)."""
    fmt = get_format(name)
    own = {o.name for o in fmt.options}
    others = {o.name: f.name for f in FORMATS.values() if f is not fmt for o in f.options}
    try:
        for key, value in options.items():
            if key in OPTION_TYPES or key in own or value is None:
                continue
            if key in others:
                raise OptionError(f"{arg(key)} is an option of {arg('to', others[key])} only")
            raise OptionError(f"unknown conversion option {key!r} for {arg('to', name)}")
        fmt.check_options(options)
    except PackerError as exc:  # named as the manifest records them (as convert's keywords): str(exc)
        raise DatasetError(f"{where}: the recorded conversion options are not valid ({exc})") from None
