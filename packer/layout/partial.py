"""What an unfinished conversion leaves on disk, as both sides read it: ``<out>.partial/journal/``.

The writer (packer.write.journal) records a plan, one entry per finished shard, and before the
renames into place a swap record; readers (``open_dataset`` on a missing name, ``packer info``)
use this module to say what an interrupted run left and how to go on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from packer.errors import DatasetError, PackerError, arg

PARTIAL_SUFFIX = ".partial"  # an unfinished output, <out>.partial, renamed to <out> once complete
JOURNAL_DIR = "journal"
PLAN_NAME = "plan.json"
SWAP_NAME = "swap.json"
# an unfinished upload to object storage keeps its lock, plan and journal under <url>/.packer-partial/ until its
# manifest is in place (packer.write.remote_output)
REMOTE_PARTIAL = ".packer-partial"
REMOTE_LOCK = f"{REMOTE_PARTIAL}/lock.json"
REMOTE_PLAN = f"{REMOTE_PARTIAL}/{PLAN_NAME}"
OLD_TAG = ".packer-old-"  # <out>.packer-old-<pid>-<random>: the folder an --overwrite moves the old output into
_MAX_SWAP_BYTES = 1 << 16


def made_by_packer(partial: Path) -> bool:
    """Whether ``partial`` is a folder a conversion made: a real folder holding its journaled plan."""
    journal = partial / JOURNAL_DIR
    return (not partial.is_symlink() and partial.is_dir() and not journal.is_symlink()
            and (journal / PLAN_NAME).is_file() and not (journal / PLAN_NAME).is_symlink())


def read_swap(partial: Path, out: Path) -> tuple[bool, str | None]:
    """(whether ``partial`` holds a journaled swap into ``out``, the trash folder's name it records).

    The name is trusted only in the shape packer gives it (``<out>.packer-old-...``, no slash),
    so a damaged or crafted record can never point a deletion anywhere else.
    """
    path = partial / JOURNAL_DIR / SWAP_NAME
    if not made_by_packer(partial) or not path.is_file():
        return False, None
    try:
        if path.stat().st_size > _MAX_SWAP_BYTES:
            raise ValueError("implausibly large")
        trash = json.loads(path.read_text(encoding="utf-8"))["trash"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DatasetError(f"{path}: damaged swap record ({exc}); move {partial} away and convert again") from exc
    if trash is not None and not (isinstance(trash, str) and trash.startswith(out.name + OLD_TAG)
                                  and "/" not in trash and "\0" not in trash):
        raise DatasetError(f"{path}: damaged swap record (trash {trash!r:.80}); move {partial} away and convert again")
    return True, trash


def unfinished_note(out: Path) -> str:
    """What an interrupted conversion left beside the missing dataset ``out``, and what to do (or "")."""
    partial = out.with_name(out.name + PARTIAL_SUFFIX)
    try:
        swapping, trash = read_swap(partial, out)
    except PackerError as exc:
        return f" ({exc.template})"
    if swapping:
        old = ""
        if trash and os.path.lexists(out.with_name(trash) / out.name):
            old = f", the old one in {out.with_name(trash)}"
        return (f" (a 'packer convert' is moving its result into place, or was interrupted doing so: the new, "
                f"complete dataset is in {partial}{old}; unless a conversion is still running, run the same "
                f"convert command with {arg('resume', True)} to finish)")
    if made_by_packer(partial):
        return f" (an unfinished conversion is in {partial}: run the same convert command with {arg('resume', True)})"
    return ""
