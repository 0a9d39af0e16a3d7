"""``errors.json``: every source record a conversion did not pack, with its reason, beside the manifest.

| key        | holds                                                                                     |
|------------|-------------------------------------------------------------------------------------------|
| num_errors | how many entries ``errors`` holds                                                         |
| ignored    | what the scan left out by rule, reason -> count ("hidden", "not in --classes", ...)        |
| errors     | one entry per record or folder not packed: ``path``, ``reason``, ``location`` where the path |
|            | does not say it, ``index``: its number in the source's numbering where it has one          |
| earlier    | the entries of a re-packed dataset's own errors.json that have an ``index``: the records of |
|            | the original source it never held (a re-pack keeps the original numbering)                 |

Read back as untrusted input (a regular file inside the dataset, size-capped): ``ds.from_imagefolder`` names
the file and reason of a source index that was not packed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from packer.errors import PackerError
from packer.layout.trust import read_inside

ERRORS_NAME = "errors.json"
MAX_ERRORS_BYTES = 256 << 20  # about a million failed files' entries


def read_report(directory: Path) -> dict[str, Any]:
    """The parsed ``errors.json`` of the dataset in ``directory``; a PackerError naming it when it is missing,
    too large or not an error report."""
    where = str(directory / ERRORS_NAME)
    raw = read_inside(directory, ERRORS_NAME, MAX_ERRORS_BYTES, where)
    try:
        report = json.loads(raw.decode("utf-8"))
        entries = [*report["errors"], *report.get("earlier", [])]
        ok = all(isinstance(e, dict) and isinstance(e.get("path"), str) and isinstance(e.get("reason"), str)
                 for e in entries)
    except (UnicodeDecodeError, ValueError, RecursionError, KeyError, TypeError, AttributeError) as exc:
        raise PackerError(f"{where}: not a packer error report ({type(exc).__name__}: {exc})") from None
    if not ok:
        raise PackerError(f"{where}: not a packer error report (an entry without a path and a reason)")
    return report


def numbered_entries(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The entries of ``report`` (its own, then those kept from a re-packed dataset) that carry a source index."""
    return [e for e in [*report["errors"], *report.get("earlier", [])]
            if isinstance(e.get("index"), int) and not isinstance(e.get("index"), bool)]


def entry_of(directory: Path, number: int) -> dict[str, Any] | None:
    """The errors.json entry of the source record numbered ``number`` (None: it has none)."""
    return next((e for e in numbered_entries(read_report(directory)) if e["index"] == number), None)
