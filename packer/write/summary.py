"""The converter's terminal summary: how many of the files found were packed, and what was left out and why.

One count per source record everywhere: a record is a file, list row, archive member or sample, packed or
not; an errors.json entry that is no record (``SourceError.record``: a folder not read, a link loop, the
unread rest of an archive) is named apart, never counted as a file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from packer.write.scan import HIDDEN, HIDDEN_FOLDER, NOT_IMAGE, NOT_SCANNED, OUTSIDE_CLASSES
from packer.write.sources.records import SourceError

_FILE_REASONS = (NOT_IMAGE, OUTSIDE_CLASSES, HIDDEN)  # ``ignored`` reasons that count files (the others: folders)


def records_not_packed(errors: Sequence[SourceError]) -> int:
    """How many of ``errors`` stand for a record (the others: folders, link loops, the rest of an archive)."""
    return sum(e.record for e in errors)


def files_found(num_packed: int, ignored: Mapping[str, int], errors: Sequence[SourceError]) -> int:
    """Every file the scan saw: packed, failed (errors.json) or ignored (folders not counted)."""
    return num_packed + records_not_packed(errors) + sum(ignored.get(r, 0) for r in _FILE_REASONS)


def not_packed_line(num_packed: int, errors: Sequence[SourceError]) -> str:
    """The error report's headline: "2 of 5 files not packed" (of the records: packed and not), and the
    entries that are no record ("1 folder or part of the source not read")."""
    failed = records_not_packed(errors)
    parts = [f"{failed} of {num_packed + failed} files not packed"] if failed else []
    if len(errors) > failed:
        parts.append(_not_read(len(errors) - failed))
    return " and ".join(parts)


def _not_read(n: int) -> str:
    return f"{_plural(n, 'folder or part of the source', 'folders or parts of the source')} not read"


def conversion_summary(num_packed: int, ignored: Mapping[str, int], errors: Sequence[SourceError]) -> str:
    """``packed 3 of 6 files``: of every file found, not only of the images."""
    return f"packed {num_packed} of {files_found(num_packed, ignored, errors)} files"


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


def _suffixes(not_images: Mapping[str, int], shown: int = 3) -> str:
    """".txt x2, .json x1": the commonest suffixes of the files that are not images."""
    ranked = sorted(not_images.items(), key=lambda kv: (-kv[1], kv[0]))
    text = ", ".join(f"{s or 'no extension'} x{n}" for s, n in ranked[:shown])
    return text + (", ..." if len(ranked) > shown else "")


def describe_left_out(ignored: Mapping[str, int], not_images: Mapping[str, int], errors: Sequence[SourceError]) -> str:
    """What was not packed and why, in one line ("" when nothing): the counts the scan and the conversion kept."""
    parts = []
    if ignored.get(NOT_IMAGE):
        parts.append(f"{_plural(ignored[NOT_IMAGE], 'not an image', 'not images')} ({_suffixes(not_images)})")
    failed = records_not_packed(errors)
    if failed:
        parts.append(f"{failed} not packed (see errors.json)")
    if len(errors) > failed:
        parts.append(f"{_not_read(len(errors) - failed)} (see errors.json)")
    if ignored.get(OUTSIDE_CLASSES):
        parts.append(f"{ignored[OUTSIDE_CLASSES]} outside class folders")
    hidden = [_plural(ignored[r], w) for r, w in ((HIDDEN, "hidden file"), (HIDDEN_FOLDER, "hidden folder"))
              if ignored.get(r)]
    if hidden:
        parts.append(" and ".join(hidden) + " (--skip-hidden)")
    known = (NOT_IMAGE, OUTSIDE_CLASSES, HIDDEN, HIDDEN_FOLDER)
    parts += [f"{n} {r}" for r, n in ignored.items() if r not in known and not r.startswith(NOT_SCANNED)]
    text = ", ".join(parts)
    skipped = [r.removeprefix(NOT_SCANNED + ": ") for r in ignored if r.startswith(NOT_SCANNED)]
    if skipped:
        text += ("; " if text else "") + f"{NOT_SCANNED}: {', '.join(skipped)}"
    return text
