"""A file mapped read-only as a numpy array that holds no file descriptor (``mmap(2)`` through ctypes).

Python's ``mmap.mmap`` keeps a duplicate of the descriptor for as long as the map lives, and the map
lives as long as any view of it. A format of many files (n5's block files) whose samples a user keeps
(``image="numpy"`` raw samples are such views) would then hold one descriptor per file and run into
the open-file limit. Here the map is unmapped when its last view goes, and nothing else is held.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

import numpy as np

from packer.errors import DatasetError
from packer.formats.base import map_readonly


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()
_FAILED = ctypes.c_void_p(-1).value  # MAP_FAILED


class _Mapping:
    """Owns one mapping; numpy arrays made from it keep it alive through their ``base`` and it unmaps when freed."""

    def __init__(self, libc: ctypes.CDLL, addr: int, size: int) -> None:
        self._libc, self._addr, self._size = libc, addr, size
        self.__array_interface__ = {"data": (addr, True), "shape": (size,), "typestr": "|u1", "version": 3}

    def __del__(self) -> None:
        self._libc.munmap(self._addr, self._size)


def map_array(path: object, fd: int, access: str) -> np.ndarray:
    """The open file ``fd`` (at ``path``, not empty) as a read-only uint8 array of its current size; the caller may
    close ``fd`` at once. ``access="random"``: no read-ahead. Where libc's ``mmap`` is not reachable, a Python map
    (which keeps a descriptor)."""
    libc = _LIBC
    if libc is None:
        return np.frombuffer(map_readonly(path, fd, access), dtype=np.uint8)
    size = os.fstat(fd).st_size
    if size == 0:
        raise DatasetError(f"{path}: cannot map (an empty file)")
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _FAILED:
        err = ctypes.get_errno()
        raise DatasetError(f"{path}: cannot map ({os.strerror(err)})")
    owner = _Mapping(libc, addr, size)
    if access == "random" and hasattr(mmap, "MADV_RANDOM"):
        libc.madvise(addr, size, mmap.MADV_RANDOM)  # no read-ahead: uniform random reads would only evict pages
    return np.asarray(owner)
