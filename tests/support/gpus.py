"""A stand-in ``nvidia-smi`` for machines without a GPU: a real executable, put first on PATH, that answers
``--query-gpu=... --format=csv,noheader,nounits`` (and ``-lms N``, printing a line per GPU every N ms until
stopped) from a table of GPUs the test gives, the way the real one prints them. A list as a value gives one
value per round of samples, in turn. Like a C program, it buffers its output unless it writes to a terminal."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

H100 = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "utilization.gpu": 97, "memory.used": 40960,
        "memory.total": 81559}

SCRIPT = '''#!{python}
import sys, time
# C's stdio, whatever PYTHONUNBUFFERED says: lines to a terminal, 8 KiB blocks to a pipe or file
sys.stdout = open(1, "w", buffering=1 if sys.stdout.isatty() else 8192, closefd=False)
GPUS = {gpus}
FAIL = {fail}
ROUNDS = {rounds}
if FAIL:
    print(FAIL)  # the real one prints its failures to stdout and exits 9
    sys.exit(9)
args = sys.argv[1:]
fields = next(a.split("=", 1)[1] for a in args if a.startswith("--query-gpu=")).split(",")
loop_ms = int(args[args.index("-lms") + 1]) if "-lms" in args else None
def value(v, k):
    return v[k % len(v)] if isinstance(v, list) else v
k = 0
while True:  # no flush: into a pipe the lines wait in a buffer, as a C program's do
    for gpu in GPUS:
        print(", ".join(str(value(gpu.get(f, "[N/A]"), k)) for f in fields))
    if loop_ms is None:
        break
    k += 1
    if k == ROUNDS:
        time.sleep(3600)  # printed all it will: waits to be stopped
    time.sleep(loop_ms / 1000)
'''


def fake_nvidia_smi(folder: Path, gpus: list[dict] | None = None, fail: str | None = None,
                    rounds: int | None = None) -> str:
    """Write ``folder/nvidia-smi`` answering for ``gpus`` (default: one busy H100), or printing ``fail`` and
    exiting 9 as the real one does without a driver; with ``-lms``, ``rounds`` rounds of lines and then
    nothing until stopped (None: no end). Returns the PATH value to set (``folder`` first)."""
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / "nvidia-smi"
    exe.write_text(SCRIPT.format(python=sys.executable, gpus=json.dumps([H100] if gpus is None else gpus),
                                 fail=repr(fail), rounds=repr(rounds)))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"
