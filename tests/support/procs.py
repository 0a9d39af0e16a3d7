"""Which tests start a process, and a guard that proves the rest start none (``make test-fast``).

A test that starts a process (a subprocess, DataLoader workers, a multiprocessing pool, gloo ranks, an example
script) pays an interpreter start-up each time: that, not packer's code, is most of the suite's time. Such tests
are listed in ``tests/procs.txt`` and marked ``procs``; ``pytest --no-procs`` (``make test-fast``) leaves them out
and runs the others with every way of starting a process replaced by one that fails the test, naming it, so the
list cannot miss one. ``make test`` runs everything.
"""

from __future__ import annotations

import _posixsubprocess
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

LIST = Path(__file__).resolve().parents[1] / "procs.txt"


class ProcessStarted(RuntimeError):
    """Raised by the guard: a test left out of tests/procs.txt started a process."""


def listed() -> list[str]:
    """The node ids (or their prefixes: a file, a test without its parameters) of tests/procs.txt."""
    lines = (line.split("#", 1)[0].strip() for line in LIST.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line]


def matches(nodeid: str, entry: str) -> bool:
    """Whether ``entry`` names the test ``nodeid``: the same id, its file, or the test with any parameters."""
    return nodeid == entry or nodeid.startswith((entry + "::", entry + "["))


class Guard:
    """While installed, starting a process raises ProcessStarted naming ``current`` (the running test), and
    appends it to ``log`` when given (to list the tests that need the mark)."""

    # every way Python starts a process on Linux: subprocess through its own binding of _posixsubprocess.fork_exec
    # (or os.posix_spawn), multiprocessing's spawn/forkserver through _posixsubprocess.fork_exec, its fork and
    # os.spawn* through os.fork
    NAMES = (("os", "fork"), ("os", "forkpty"), ("os", "posix_spawn"), ("os", "posix_spawnp"), ("os", "system"),
             ("_posixsubprocess", "fork_exec"), ("subprocess", "_fork_exec"))

    def __init__(self, log: Path | None = None):
        self.current = "(no test)"
        self.log = log
        self._saved: list[tuple[object, str, Callable]] = []

    def install(self) -> None:
        modules = {"os": os, "_posixsubprocess": _posixsubprocess, "subprocess": subprocess}
        for module_name, name in self.NAMES:
            module = modules[module_name]
            original = getattr(module, name)
            self._saved.append((module, name, original))
            setattr(module, name, self._refuse(f"{module_name}.{name}", original))

    def uninstall(self) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()

    def _refuse(self, what: str, original: Callable) -> Callable:
        def refuse(*args, **kwargs):
            if _looking_up_a_library():
                return original(*args, **kwargs)
            if self.log is not None:
                with self.log.open("a", encoding="utf-8") as f:
                    f.write(self.current + "\n")
            raise ProcessStarted(f"{self.current} started a process ({what}) under --no-procs: list it in "
                                 f"tests/procs.txt, or make it start none")
        return refuse


def _looking_up_a_library() -> bool:
    """Whether ctypes.util.find_library is on the stack: it runs ldconfig once per library an import or first use
    looks up (libc, libturbojpeg), which is the interpreter's business, not the test's."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(os.path.join("ctypes", "util.py")):
            return True
        frame = frame.f_back
    return False
