"""What every format shares: the sample handed to writers and the lazy per-process handle."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

import numpy as np

H = TypeVar("H")


@dataclass
class PreparedSample:
    """One source image, read and validated, ready to store."""

    index: int  # position in the dataset
    rel_path: str  # relative to the converted folder
    label: int
    payload: bytes | np.ndarray  # encoded bytes, or HWC uint8 RGB for raw
    height: int
    width: int

    @property
    def nbytes(self) -> int:
        return len(self.payload) if isinstance(self.payload, bytes) else int(self.payload.nbytes)


class LazyHandle(Generic[H]):
    """A file handle opened on first use in each process; pickles without it.

    DataLoader workers get the dataset by fork (the parent's handle must not be reused) or by
    pickling (spawn: handles can't travel). Both end here with a fresh open in the worker.
    """

    def __init__(self) -> None:
        self._handle: H | None = None
        self._pid: int | None = None

    def get(self, opener: Callable[[], H]) -> H:
        if self._handle is None or self._pid != os.getpid():
            self._handle, self._pid = opener(), os.getpid()
        return self._handle

    def close(self, closer: Callable[[H], Any] | None = None) -> None:
        if self._handle is not None and self._pid == os.getpid() and closer is not None:
            closer(self._handle)
        self._handle, self._pid = None, None

    def __getstate__(self) -> dict:
        return {"_handle": None, "_pid": None}


def contiguous_runs(positions: list[int]) -> list[tuple[int, int]]:
    """Split positions into (start, stop) runs of consecutive values, in the order given."""
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and p == runs[-1][1]:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs
