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

import json
import os
from pathlib import Path

from packer.layout.trust import open_regular

EXPORT_NAME = "packer-wds.json"
EXPORT_KIND = "packer-webdataset-export"
CLASSES_NAME = "classes.txt"
SHARD_PATTERN = "shard-%06d.tar"
_MAX_EXPORT_BYTES = 64 << 20


def holds_wds_export(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a finished WebDataset export made by packer (only the ``kind`` is looked at)."""
    try:
        fd, st = open_regular(os.path.join(directory, EXPORT_NAME))
    except OSError:
        return False
    try:
        if st.st_size > _MAX_EXPORT_BYTES:
            return False
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = json.loads(fh.read())
    except (OSError, ValueError, RecursionError):
        return False
    finally:
        os.close(fd)
    return isinstance(data, dict) and data.get("kind") == EXPORT_KIND


def export_classes_file(directory: Path) -> str | None:
    """The ``classes.txt`` of a packer export in ``directory`` (None: not an export, or no classes)."""
    path = directory / CLASSES_NAME
    return str(path) if holds_wds_export(directory) and path.is_file() and not path.is_symlink() else None
