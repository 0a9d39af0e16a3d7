"""Copies out of a memory-mapped shard that a file truncated meanwhile turns into an error, not a SIGBUS.

Touching a page of a shared map past the end of a file truncated in place faults with SIGBUS, which kills the
process whichever thread touched it; Python can't catch it. The compiled ``packer.formats._safecopy`` (built by
setup.py, optional, libc only) copies under a SIGBUS handler that jumps back out of the copy and says which copy
faulted; a SIGBUS anywhere else goes where it went before. Without it ``available()`` is False and
``base.pread_ranges`` reads with ``pread`` instead (which never faults: the kernel's per-page work makes it
slower than a copy from a warm map, docs/results.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from packer.compiled import safe_copy

_EXT = safe_copy()
_safecopy = _EXT.module


def available() -> bool:
    """Whether the compiled copy loaded."""
    return _EXT.available


def notice_missing() -> None:
    """Say once per process that payloads are read with ``pread``, and how to build the guarded copy."""
    _EXT.notice()


def copy(dsts: Sequence[memoryview], srcs: Sequence[memoryview]) -> int:
    """Copy each ``srcs[k]`` into ``dsts[k]`` (of the same length; the GIL released); the index of the first whose
    source faulted (a page past the end of a truncated file, an I/O error), or -1. The handler is installed on
    first use, and again wherever another library replaced it since (one ``sigaction`` per call)."""
    if _safecopy is None:
        raise RuntimeError(f"{_EXT.name} is not built ({_EXT.missing})")
    if not _safecopy.is_installed():
        _safecopy.install()
    return _safecopy.copy(dsts, srcs)
