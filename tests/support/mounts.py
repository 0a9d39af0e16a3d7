"""Filesystems with limits, for tests that need them: read-only bind mounts and small tmpfs mounts.

Both need root (tests run as root; root's bypass of file modes is why a mount is needed) and
skip the test cleanly where mounting is not allowed. Mounts are private to the test's folder.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def _unmount(target: Path) -> None:
    """Unmount, lazily if something still holds a file open: never leave a mount behind."""
    if subprocess.run(["umount", str(target)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


@contextmanager
def read_only_mount(source: Path, target: Path) -> Iterator[Path]:
    """A read-only bind mount of ``source`` at ``target`` (root and mount rights needed, else skip)."""
    target.mkdir()
    try:
        subprocess.run(["mount", "--bind", str(source), str(target)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot bind-mount here ({exc}); the read-only copy test still runs")
    try:
        r = subprocess.run(["mount", "-o", "remount,ro,bind", str(target)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot remount read-only: {r.stderr.decode().strip()}")
        yield target
    finally:
        _unmount(target)


@contextmanager
def small_tmpfs(target: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (e.g. "300k") at the new folder ``target``: a disk that fills up (else skip)."""
    target.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(target)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root and tmpfs to make a small filesystem")
    try:
        yield target
    finally:
        _unmount(target)
