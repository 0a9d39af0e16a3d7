"""The C library through ctypes, loaded once: the calls Python's ``mmap`` module lacks (a map that holds no file
descriptor, ``mincore``), declared here and nowhere else. ``LIBC`` is None where it can't be loaded; callers fall
back (a Python map) or answer "not known"."""

from __future__ import annotations

import ctypes
import ctypes.util
import os


def _load() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        return libc
    except (OSError, AttributeError):  # no C library by that name, or one without these calls
        return None


LIBC = _load()
MAP_FAILED = ctypes.c_void_p(-1).value  # what ``mmap`` returns on failure


def last_error() -> str:
    """The text of the ``errno`` the last failed call through ``LIBC`` on this thread left."""
    return os.strerror(ctypes.get_errno())
