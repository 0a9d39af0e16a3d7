"""Lazy state that belongs to one process: the one place packer deals with fork and spawn for it.

DataLoader workers get a dataset by fork (a parent's open file, map, decoder handle or cache must not
be reused or mutated in the child) or by pickling (spawn: handles can't travel). ``PerProcess`` makes
its value on first use in each process, drops what a forked child inherited (``inherited`` releases it
there, e.g. closes an LMDB environment the child may not reopen otherwise), and pickles empty.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class PerProcess(Generic[T]):
    """A value made on first use in the current process (``make``, or the ``opener`` given to ``get``)."""

    def __init__(self, make: Callable[[], T] | None = None, inherited: Callable[[T], Any] | None = None) -> None:
        self._make, self._inherited = make, inherited
        self._value: T | None = None
        self._pid: int | None = None

    def get(self, opener: Callable[[], T] | None = None) -> T:
        if self._pid != os.getpid():
            if self._value is not None and self._inherited is not None:
                self._inherited(self._value)  # a forked child's copy of its parent's value
            make = opener or self._make
            if make is None:
                raise TypeError("PerProcess.get() needs an opener when made without one")
            self._value = make()
            self._pid = os.getpid()  # last: another thread never sees this pid before the value is set
        return self._value  # type: ignore[return-value]

    def peek(self) -> T | None:
        """The value if this process made it, else None (nothing is made)."""
        return self._value if self._pid == os.getpid() else None

    def close(self, closer: Callable[[T], Any] | None = None) -> None:
        """Forget the value; ``closer`` releases it first when this process made it."""
        if self._value is not None and self._pid == os.getpid() and closer is not None:
            closer(self._value)
        self._value, self._pid = None, None

    def __getstate__(self) -> dict:
        return {"_make": self._make, "_inherited": self._inherited, "_value": None, "_pid": None}


class PicklesAs:
    """A mixin for a large object that its owner can make again in the process that unpickles it (a URL dataset's
    index, reloaded from the node's cache): told ``pickle_as(reduced)``, it pickles as that ``__reduce__`` value
    (a callable and its arguments) instead of its bytes. A spawned DataLoader worker gets its dataset through a
    64 KiB pipe that the parent's ``Process.start`` blocks on until the child has imported and unpickled most of
    it: a dataset that pickles in megabytes starts its workers one after the other."""

    _pickled_as: tuple | None = None

    def pickle_as(self, reduced: tuple) -> None:
        self.__dict__["_pickled_as"] = reduced  # frozen dataclasses too; no field: eq and repr ignore it

    def __reduce_ex__(self, protocol: Any) -> Any:
        if self._pickled_as is not None:
            return self._pickled_as
        return super().__reduce_ex__(protocol)
