"""Copies out of a mapped shard truncated in place (``base.pread_ranges``): a PackerError, never a SIGBUS, whether
copied from the map under ``safecopy``'s guard or read with ``pread``; a SIGBUS anywhere else still kills."""

from __future__ import annotations

import faulthandler
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
from support.memlimit import limited_call

from packer import PackerError
from packer.formats import safecopy
from packer.formats.base import pread_ranges

SIZE = 64 << 10


def _mapped_file(path: Path) -> tuple[int, np.ndarray, bytes]:
    data = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    return fd, np.frombuffer(mmap.mmap(fd, 0, access=mmap.ACCESS_READ), dtype=np.uint8), data


def _copies_then_truncated(path: Path, guarded: bool) -> list[str]:
    """Copies of ranges (one starting in the part that stays, one wholly past it) before and after the file is cut to
    a quarter, from the map (``guarded``) or by pread; the outcomes."""
    fd, arr, data = _mapped_file(path)
    mapped = (arr, 0) if guarded else None
    starts, ends = [100, SIZE // 2, SIZE - 10], [9000, SIZE // 2 + 5000, SIZE]
    outcomes = []
    got = pread_ranges(fd, starts, ends, None, path, SIZE, mapped=mapped)
    outcomes.append("same" if [g.tobytes() for g in got] == [data[a:b] for a, b in zip(starts, ends)] else "differ")
    os.truncate(path, SIZE // 4)
    for start, end in ((100, 9000), (SIZE // 2, SIZE // 2 + 5000)):
        try:
            pread_ranges(fd, [start], [end], np.zeros(end - start, np.uint8), path, SIZE, mapped=mapped)
            outcomes.append("ok")
        except PackerError as exc:
            outcomes.append(str(exc))
    return outcomes


@pytest.mark.parametrize("guarded", [True, False], ids=["safecopy", "pread"])
def test_copies_of_a_truncated_file_are_a_packer_error_never_sigbus(tmp_path, guarded):
    if guarded and not safecopy.available():
        pytest.skip("packer.formats._safecopy is not built (python setup.py build_ext --inplace)")
    kind, outcomes = limited_call(_copies_then_truncated, tmp_path / "shard", guarded)
    assert kind == "ok", (kind, outcomes)  # "died": the child was killed (SIGBUS)
    assert outcomes[0] == "same"
    assert outcomes[1] == "ok"  # bytes 100..9000 are still in the file: read as they are
    assert "changed size since it was opened" in outcomes[2] and "reopen the dataset" in outcomes[2]


def _touch_past_the_end(path: Path, faulthandler_first: bool) -> int:
    """After a guarded copy installed the handler (and ``faulthandler`` took SIGBUS over, or not): the guarded copy
    of a truncated range, then an unguarded read of it."""
    faulthandler.disable()  # pytest's, inherited: its traceback of the expected fault would only be noise
    fd, arr, _data = _mapped_file(path)
    safecopy.copy([np.zeros(10, np.uint8).data], [arr[:10].data])
    if faulthandler_first:  # replaces the handler: the next guarded copy installs it again
        faulthandler.enable(file=open(os.devnull, "w"))  # noqa: SIM115 - the child ends here
    os.truncate(path, 0)
    assert safecopy.copy([np.zeros(10, np.uint8).data], [arr[:10].data]) == 0
    return int(arr[5])  # not guarded: SIGBUS, as without packer


@pytest.mark.parametrize("faulthandler_first", [False, True], ids=["alone", "after-faulthandler"])
def test_a_sigbus_outside_a_guarded_copy_still_kills(tmp_path, faulthandler_first):
    if not safecopy.available():
        pytest.skip("packer.formats._safecopy is not built (python setup.py build_ext --inplace)")
    kind, why = limited_call(_touch_past_the_end, tmp_path / "shard", faulthandler_first)
    assert (kind, why) == ("died", "exit code -7")
