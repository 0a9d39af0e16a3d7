"""The lock on an output being written: an ``flock`` on ``<out>.partial/journal/lock``, held for the writing run's life.

Two runs writing one output (a second ``convert``, a ``--resume`` started beside the first, a ``Writer``)
would delete or overwrite each other's shards and journal entries; the second is refused before it
touches anything, naming the first's pid (the lock file holds it). The kernel drops the lock when its
holder ends, SIGKILL included, so the ``.partial`` of a killed run can be resumed at once. The lock is
taken in the fresh folder a ``.partial`` is made in, before it is renamed into place: no run ever sees
a ``.partial`` of a live run unlocked. A run that finds a ``.partial`` asks ``check_free`` first, which
writes nothing (a refusal changes nothing on disk), and takes the lock only once it goes on with it.
A forked child (a pool worker) closes its copies of the held locks at once (``os.register_at_fork``):
the lock is the run's, and goes with it even while workers it forked live on.
"""

from __future__ import annotations

import errno
import fcntl
import os
import weakref
from pathlib import Path
from types import TracebackType

from packer.errors import PackerError
from packer.layout.partial import JOURNAL_DIR

LOCK_NAME = "lock"  # in <partial>/journal/: "<pid>\n" of the run holding it


class OutputLock:
    """An exclusive ``flock`` on a ``.partial``'s lock file; ``release`` (or the end of the process) drops it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        _HELD.add(self)

    @classmethod
    def take(cls, partial: Path, out: Path) -> OutputLock:
        """Lock the ``.partial`` (packer's: its journal folder exists), or a PackerError naming the run holding it."""
        path = partial / JOURNAL_DIR / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            raise PackerError(f"{path}: cannot open the output's lock ({exc.strerror or exc})") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _holder(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise PackerError(f"{path}: cannot lock the output ({exc.strerror or exc})") from exc
            raise PackerError(in_use(out, partial, holder)) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass  # a full disk: the lock holds all the same, the message names no pid
        return cls(fd)

    def release(self) -> None:
        """Drop the lock (also for forked workers that inherited the descriptor) and close it; idempotent."""
        if self.fd < 0:
            return
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:  # a lock dropped without release ends with its object, as a file does
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


_HELD: weakref.WeakSet[OutputLock] = weakref.WeakSet()  # the locks this process holds (for a forked child)


def _close_in_child() -> None:
    """In a forked child: close the copies of the parent's locks, never unlocking them (LOCK_UN on a copy would
    release the parent's lock too); the lock then lasts as long as the parent holds it, not its children."""
    for lock in list(_HELD):
        if lock.fd >= 0:
            try:
                os.close(lock.fd)
            except OSError:
                pass
            lock.fd = -1


os.register_at_fork(after_in_child=_close_in_child)


def check_free(partial: Path, out: Path) -> None:
    """A PackerError naming the live run that holds ``partial``, else nothing; opens no file for writing, creates
    none (a ``.partial`` of a packer from before the lock has no lock file: free)."""
    path = partial / JOURNAL_DIR / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise PackerError(f"{path}: cannot open the output's lock ({exc.strerror or exc})") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # fails while a run holds it exclusively
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise PackerError(f"{path}: cannot lock the output ({exc.strerror or exc})") from exc
        raise PackerError(in_use(out, partial, _holder(fd))) from None
    finally:
        os.close(fd)


def _holder(fd: int) -> int | None:
    """The pid the lock file names, or None when it names none (yet)."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def in_use(out: Path, partial: Path, holder: int | None) -> str:
    """The refusal of a second run: whose run holds the output, and what to do."""
    who = f"pid {holder}" if holder is not None else "another process"
    return (f"{out}: in use by {who}, which is writing it in {partial}; wait for that run to finish (or stop it), "
            f"then run the command again")
