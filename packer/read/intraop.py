"""torch's ops on the calling thread alone, for packer's decode threads.

torch runs an op such as the fused crop's resize on an OpenMP team whose size is a per-thread setting,
taken from ``torch.set_num_threads`` (default: all cores) the first time a thread uses it. Two decode
threads on 2 cores then start a team each per resize, whose threads wait at the op's barrier while the
other decoder holds the core, costing a ThreadLoader with a fused crop images/s (measured in docs/results.md,
"torch's ops on the decode thread alone"). DataLoader workers avoid it by calling ``torch.set_num_threads(1)``, which
would change the setting of the whole process here; ``serial_ops`` changes only the calling thread's.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from packer.sysinfo import proc_text

_RUNTIMES = ("libgomp", "libomp", "libiomp5")  # the OpenMP runtimes torch builds link
_lock = threading.Lock()
_setter: list[Callable[[int], None] | None] = []  # resolved once: [the runtime's omp_set_num_threads or None]


def _loaded_runtime() -> str | None:
    """Path of the OpenMP runtime loaded in this process (torch's own copy), None where none is."""
    for line in (proc_text("self/maps") or "").splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, dev, inode, then the path of a mapped file
        if len(fields) == 6 and fields[5].startswith("/") and Path(fields[5]).name.split(".so")[0] in _RUNTIMES:
            return fields[5]
    return None


def _omp_set_num_threads() -> Callable[[int], None] | None:
    with _lock:
        if not _setter:
            fn = None
            path = _loaded_runtime() if torch.backends.openmp.is_available() else None
            if path is not None:
                try:
                    fn = ctypes.CDLL(path).omp_set_num_threads  # the loaded copy: dlopen returns its handle
                    fn.argtypes, fn.restype = [ctypes.c_int], None
                except (OSError, AttributeError):
                    fn = None
            _setter.append(fn)
        return _setter[0]


def serial_ops() -> bool:
    """Make torch's ops called from this thread run on it alone; the rest of the process keeps its setting.
    False where torch's parallel backend is not an OpenMP runtime found here (nothing changed)."""
    setter = _omp_set_num_threads()
    if setter is None:
        return False
    torch.get_num_threads()  # torch sets this thread's team size on its first use: ours must come after
    setter(1)
    return torch.get_num_threads() == 1
