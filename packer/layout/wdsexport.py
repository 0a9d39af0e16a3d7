"""The on-disk contract of a WebDataset export (``packer convert SRC --to wds``), shared by its writer
(``write.export_wds``), the WebDataset source (which reads its class names back) and the destination check
(``--overwrite`` replaces only what packer made).

| file                 | what                                                                      |
|----------------------|---------------------------------------------------------------------------|
| shard-%06d.tar       | WebDataset shards: ``<key>.<ext>`` image, ``<key>.cls`` label, ``<key>.json`` fields |
| classes.txt          | class names, line i naming label i (absent when the source has none)      |
| errors.json          | the records not exported, as ``convert`` reports them                     |
| packer-wds.json      | written last: kind, shards with sample counts, sizes and sha256           |

A folder without ``packer-wds.json`` (an interrupted export is still ``<out>.partial``) is no export.
"""

from __future__ import annotations

import os
from pathlib import Path

from packer.layout.trust import json_kind

EXPORT_NAME = "packer-wds.json"
EXPORT_KIND = "packer-webdataset-export"
CLASSES_NAME = "classes.txt"
SHARD_PATTERN = "shard-%06d.tar"
_MAX_EXPORT_BYTES = 64 << 20


def holds_wds_export(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a finished WebDataset export made by packer (only the ``kind`` is looked at)."""
    return json_kind(os.path.join(directory, EXPORT_NAME), _MAX_EXPORT_BYTES) == EXPORT_KIND


def export_classes_file(directory: Path) -> str | None:
    """The ``classes.txt`` of a packer export in ``directory`` (None: not an export, or no classes)."""
    path = directory / CLASSES_NAME
    return str(path) if holds_wds_export(directory) and path.is_file() and not path.is_symlink() else None
