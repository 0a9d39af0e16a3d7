"""Shard files opened, checked against the manifest and mapped read-only: the one home of that sequence.

A mapped file truncated in place (``rsync --inplace``, ``cp`` over an open dataset) kills its reader with SIGBUS at
the first page past the new end, so a reader keeps the file open and ``check_size`` sees it unchanged before each
read. ``map_array`` maps through libc and holds no descriptor: a format of many files (n5's block files) whose
samples a user keeps would otherwise hold one per file and run into the open-file limit.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from packer.errors import DatasetError
from packer.libc import LIBC, MAP_FAILED, last_error


def check_size(fd: int, expected: int, path: object) -> None:
    """The open shard file ``fd`` still has the size the manifest records (else a DatasetError saying so).

    Truncated in place, a mapped file kills its reader at the first page past the new end, and HDF5 reads zeros
    there; one ``fstat`` before each read turns that into an error.
    """
    size = os.fstat(fd).st_size
    if size != expected:
        raise DatasetError(f"{path}: shard changed size since it was opened ({expected} bytes in the manifest, "
                           f"{size} now: rewritten in place?); reopen the dataset")


def open_checked(path: str | os.PathLike[str], expected: int | None = None, what: str = "") -> int:
    """``path`` opened read-only (close-on-exec), of the manifest's ``expected`` size where given; a DatasetError
    naming the file otherwise (``what``: the kind of file, for the message)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise DatasetError(f"{path}: cannot open{' ' + what if what else ''} ({exc.strerror or exc})") from exc
    if expected is not None:
        with closed_on_error(fd):
            check_size(fd, expected, path)
    return fd


@contextmanager
def closed_on_error(fd: int) -> Iterator[int]:
    """Keep ``fd`` open past the block; close it if the block raises (a half-made handle holds nothing)."""
    try:
        yield fd
    except BaseException:
        os.close(fd)
        raise


def map_readonly(path: object, fd: int, access: str) -> mmap.mmap:
    """The open file ``fd`` (at ``path``) mapped read-only by Python's ``mmap`` (which keeps a duplicate of the
    descriptor while it lives); ``access="random"`` turns the kernel's read-ahead off for it."""
    try:
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
        raise DatasetError(f"{path}: cannot map ({exc})") from exc
    if access == "random" and hasattr(mmap, "MADV_RANDOM"):
        mm.madvise(mmap.MADV_RANDOM)  # no read-ahead: uniform random reads would only evict pages
    return mm


def map_bytes(path: object, fd: int, size: int, access: str) -> np.ndarray:
    """The open file ``fd`` of ``size`` bytes (checked by the caller) as a flat read-only uint8 array of its map;
    an empty array for an empty file, which can't be mapped."""
    return np.frombuffer(map_readonly(path, fd, access), dtype=np.uint8) if size else np.zeros(0, np.uint8)


class _Mapping:
    """Owns one mapping; numpy arrays made from it keep it alive through their ``base`` and it unmaps when freed."""

    def __init__(self, addr: int, size: int) -> None:
        self._addr, self._size = addr, size
        self.__array_interface__ = {"data": (addr, True), "shape": (size,), "typestr": "|u1", "version": 3}

    def __del__(self) -> None:
        if LIBC is not None:
            LIBC.munmap(self._addr, self._size)


def map_array(path: object, fd: int, access: str) -> np.ndarray:
    """The open file ``fd`` (at ``path``, not empty) as a read-only uint8 array of its current size that holds no
    descriptor: the caller may close ``fd`` at once, and the map goes with its last view. ``access="random"``: no
    read-ahead. Where libc's ``mmap`` is not reachable, a Python map (which keeps a descriptor)."""
    if LIBC is None:
        return np.frombuffer(map_readonly(path, fd, access), dtype=np.uint8)
    size = os.fstat(fd).st_size
    if size == 0:
        raise DatasetError(f"{path}: cannot map (an empty file)")
    addr = LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == MAP_FAILED:
        raise DatasetError(f"{path}: cannot map ({last_error()})")
    owner = _Mapping(addr, size)
    if access == "random" and hasattr(mmap, "MADV_RANDOM"):
        LIBC.madvise(addr, size, mmap.MADV_RANDOM)  # no read-ahead: uniform random reads would only evict pages
    return np.asarray(owner)
