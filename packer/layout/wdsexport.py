"""The on-disk contract of a WebDataset export (``packer convert SRC --to wds``), shared by its writer
(``write.export_wds``), the WebDataset source (which reads its class names back) and the destination check
(``--overwrite`` replaces only what packer made).

| file                 | what                                                                      |
|----------------------|---------------------------------------------------------------------------|
| shard-%06d.tar       | WebDataset shards: ``<key>.<ext>`` image, ``<key>.cls`` label, ``<key>.json`` fields, |
|                      | ``<key>.path.txt`` the record's key in the source (its relative path), UTF-8 (1)  |
| classes.txt          | class names, line i naming label i (absent when the source has none)      |
| errors.json          | the records not exported, as ``convert`` reports them                     |
| packer-wds.json      | written last: kind, shards with sample counts, sizes and sha256, ``source_records`` |

A folder without ``packer-wds.json`` (an interrupted export is still ``<out>.partial``) is no export.
``<key>`` is the record's number in the source's numbering (``ds.imagefolder_index(i)`` of a packer dataset,
ImageFolder's index of a folder), zero-padded; ``source_records`` how many records that numbering counts.
Converting an export back (write/sources/webdataset.py) restores both: records in key order, key = number,
the ``path.txt`` text as the record's path. (1) Names that are not UTF-8 are written with ``surrogateescape``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from packer.errors import PackerError
from packer.layout.trust import json_kind, read_inside

EXPORT_NAME = "packer-wds.json"
EXPORT_KIND = "packer-webdataset-export"
CLASSES_NAME = "classes.txt"
SHARD_PATTERN = "shard-%06d.tar"
PATH_EXTENSION = "path.txt"  # <key>.path.txt: the record's key in the source
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "ppm", "bmp", "pgm", "tif", "tiff", "webp", "gif", "bin")  # what it writes
PATH_CODEC = ("utf-8", "surrogateescape")
_MAX_EXPORT_BYTES = 64 << 20


def holds_wds_export(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a finished WebDataset export made by packer (only the ``kind`` is looked at)."""
    return json_kind(os.path.join(directory, EXPORT_NAME), _MAX_EXPORT_BYTES) == EXPORT_KIND


def export_records(directory: Path) -> int | None:
    """How many records the source numbering of the packer export in ``directory`` counts (None: not an export,
    or one written before packer recorded it)."""
    if not holds_wds_export(directory):
        return None
    try:
        data = json.loads(read_inside(directory, EXPORT_NAME, _MAX_EXPORT_BYTES))
    except (PackerError, ValueError, RecursionError):
        return None
    value = data.get("source_records") if isinstance(data, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62 else None


def export_classes_file(directory: Path) -> str | None:
    """The ``classes.txt`` of a packer export in ``directory`` (None: not an export, or no classes)."""
    path = directory / CLASSES_NAME
    return str(path) if holds_wds_export(directory) and path.is_file() and not path.is_symlink() else None
