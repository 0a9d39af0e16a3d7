"""Where another thread is now, from its stack: a test waits for a thread to be blocked where it means (a consumer
in its ``get``, a close behind a lock) instead of sleeping a while and hoping it got there."""

from __future__ import annotations

import sys
import threading


def running(thread: threading.Thread, *functions) -> bool:
    """Whether ``thread`` is inside each of ``functions`` now (a call of each on its stack)."""
    codes = set()
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        codes.add(frame.f_code)
        frame = frame.f_back
    return all(f.__code__ in codes for f in functions)
