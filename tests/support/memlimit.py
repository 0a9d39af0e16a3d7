"""Run a risky call in a forked child whose address space may grow by a bounded amount only.

A regression that lets a crafted file allocate gigabytes then fails the test (MemoryError, or a
child that dies) instead of having the kernel's OOM killer take the test runner. The child
inherits everything already imported (fork), so the call starts at once.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import traceback
from collections.abc import Callable
from typing import Any

from support.fuzzing import _vm_size

GIB = 1 << 30


def _child(conn, fn: Callable, args: tuple, limit: int) -> None:
    try:
        vm = _vm_size()
        resource.setrlimit(resource.RLIMIT_AS, (vm + limit, resource.RLIM_INFINITY))
        result = ("ok", fn(*args))
    except BaseException as exc:  # everything is reported to the parent, which judges it
        result = (type(exc).__name__, f"{exc}\n{traceback.format_exc(limit=-3)}"[:4000])
    conn.send(result)
    conn.close()
    os._exit(0)


def limited_call(fn: Callable, *args, limit: int = 2 * GIB, timeout: float = 300.0) -> tuple[str, object]:
    """``fn(*args)`` in a forked child allowed ``limit`` more bytes of address space: ``("ok", the result)``
    (it must pickle), ``(exception class name, message)``, or ``("died", why)`` when the child died."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, fn, args, limit))
    proc.start()
    child.close()
    try:
        result = parent.recv() if parent.poll(timeout) else ("died", f"no answer after {timeout:.0f} s")
    except EOFError:
        proc.join()
        result = ("died", f"exit code {proc.exitcode}")
    if proc.is_alive():
        proc.kill()
    proc.join()
    return result


def _convert_report(src, out, options: dict) -> dict:
    import json

    from packer import convert

    res = convert(src, out, workers=0, progress=False, **options)
    return json.loads((res.output / "errors.json").read_text())


def limited_convert(src, out, limit: int = GIB, **options) -> tuple[str, Any]:
    """``packer.convert(src, out, workers=0, **options)`` in a child allowed ``limit`` more bytes of address
    space: ``("ok", its errors.json)``, or what ``limited_call`` says went wrong."""
    return limited_call(_convert_report, src, out, options, limit=limit)
