"""The examples/ scripts behind docs/results.md's figures run end to end on a tiny dataset (two of them had stopped
running after internal changes, unnoticed). Those with a test of their own, and those needing a GPU, NVIDIA DALI,
FFCV or the kernel throttle (root), are not repeated here. Output checks are structural: no timings.

Each runs as ``__main__`` in this interpreter (an interpreter start-up per script was most of this file's time),
with its own argv, working folder, environment and torch thread count put back after; those that need a process
of their own (a Dask cluster; a temp folder set by TMPDIR; packer functions replaced for the whole process) run as
a subprocess."""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from support.imagesets import make_imagefolder

from packer import convert

ROOT = Path(__file__).resolve().parents[2]

# script, its arguments ({d}: the work folder), a line its output must contain
CASES = [
    ("measure_overhead.py", "{d}/imgs.memmap --epochs 1", "train224  training"),
    ("measure_distributed.py", "{d}/imgs --dask-workers 1 --pool-workers 2 --shard-size 20KB --repeats 1",
     "outputs byte-identical: True"),
    ("lmdb_readahead.py", "{d}/imgs.lmdb --repeats 1", "uniform shuffle"),
    ("lmdb_read_paths.py", "{d}/imgs.lmdb --repeats 1 --batch-size 8", "ThreadLoader epochs"),
    ("shuffle_quality.py", "--dataset {d}/imgs.lmdb --batch 8 --block-mb 1 --epochs 1", "| block"),
    ("region_decode_speed.py", "{d}/imgs --count 10 --repeats 1", "region / whole"),
    ("train_example.py", "{d}/imgs.lmdb --epochs 1 --workers 2 --batch-size 8", "epoch 0: loss"),
    ("bmp_mosaic_speed.py", "{d}/imgs --limit 20 --repeats 1 --budget 0.2 --workdir {d}/w_bmp", "jpeg: grid"),
    ("format_sizes.py", "{d}/imgs --out {d}/w_fmt --workers 0", "mosaic-jpeg-q95-224x224.mosaic"),
    ("measure_convert.py", "{d}/imgs --to lmdb,memmap --workers 2 --repeats 1 --scratch {d}/scratch", "memmap"),
    ("measure_sources.py", "--workdir {d}/w_src --count 20 --workers 0 --repeats 1", "nested tar"),
    ("measure_bulk_crops.py", "warm {d}/imgs.memmap --rounds 2", "one by one"),
    ("measure_idle_cache.py", "{d}/imgs.lmdb --evict 0.05 --epochs 1 --batch-size 8", "read ahead"),
    ("measure_bulk_crops.py", "bench --one-by-one -- {d}/imgs.lmdb --levels thread-train --repeats 1 --warm",
     "thread-train"),
]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("examples")
    src = make_imagefolder(d / "imgs", classes=2, per_class=12, size=(64, 80))
    for fmt in ("lmdb", "memmap"):
        convert(src, d / f"imgs.{fmt}", to=fmt, workers=0, progress=False)
    return d


IDS = [script + ("" if args.startswith(("{", "-")) else "-" + args.split()[0]) for script, args, _ in CASES]


# scripts run in a subprocess of their own: a Dask cluster's processes and threads outlive a run in this interpreter;
# the other two replace packer functions for the rest of the process (ThreadLoader's feeder with a timed one, bulk
# crops switched off), which later tests would inherit
OWN_PROCESS = {"measure_distributed.py", "measure_overhead.py", "measure_bulk_crops.py"}


def run_in_process(script: Path, args: list[str], cwd: Path, monkeypatch, stderr: bool = False) -> str:
    """``python script args`` in this interpreter, as ``__main__``; returns what it printed (on stdout, and on
    stderr too, in order, with ``stderr``). A non-zero exit or an exception fails the test with its own traceback."""
    threads, environ = torch.get_num_threads(), dict(os.environ)
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    monkeypatch.setattr(sys, "path", [str(script.parent), *sys.path])  # as `python script` puts its folder first
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), \
                contextlib.redirect_stderr(printed) if stderr else contextlib.nullcontext():
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        assert e.code in (0, None), f"{script.name} exited {e.code}\n{printed.getvalue()[-3000:]}"
    finally:
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(environ)
    return printed.getvalue()


@pytest.mark.parametrize(("script", "args", "expect"), CASES, ids=IDS)
def test_example_runs(work, script, args, expect, monkeypatch):
    if script == "measure_distributed.py":
        pytest.importorskip("distributed")
    argv = args.format(d=work).split()
    if script not in OWN_PROCESS:
        printed = run_in_process(ROOT / "examples" / script, argv, work, monkeypatch)
        assert expect in printed, printed[-3000:]
        return
    out = subprocess.run([sys.executable, str(ROOT / "examples" / script), *argv],
                         capture_output=True, text=True, timeout=300, cwd=work,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert expect in out.stdout, out.stdout[-3000:]


def test_format_sizes_says_what_it_writes_first_and_leaves_no_temporary_folder(work, tmp_path, monkeypatch):
    """Without --out every variant goes into a temporary folder, deleted once measured; before writing, one line
    says how much and where (the 2,000 sample photos once filled 6.9 GB of a working folder without a word)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # found again from TMPDIR, as a new process would
    stdout = run_in_process(ROOT / "examples" / "format_sizes.py", [str(work / "imgs"), "--workers", "0"], tmp_path,
                            monkeypatch, stderr=True)
    lines = stdout.splitlines()
    said = next(n for n, line in enumerate(lines) if line.startswith("format_sizes: "))
    table = next(n for n, line in enumerate(lines) if line.startswith("| "))
    assert said < table, stdout  # said before the first conversion
    assert f"in the temporary folder {tmp}" in lines[said], lines[said]
    assert list(tmp.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["tmp"]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[table + 3:] if line.startswith("| ")]
    written = sum(int(r[3].replace(",", "")) for r in rows)  # bytes on disk of each variant, the source row left out
    number, unit = lines[said].split(" write about ")[1].split()[:2]
    estimated = float(number) * {"KB": 1e3, "MB": 1e6, "GB": 1e9}[unit]
    assert 0.5 < estimated / written < 1.5, (estimated, written)  # uncompressed pixels and file bytes, about
