"""How the command line's process ends (``packer.cli.run``/``end_process``): where obstore's runtime ran in it, a
Ctrl-C (or an error) that cancelled requests in flight ends with packer's one line on stderr, never a tokio
thread's panic ("The Python interpreter is not initialized") after it; ``atexit`` handlers still run.

The panic is a race between obstore's threads finishing the cancelled requests and the interpreter's
finalization: the same script ending by ``sys.exit`` printed it in 2 of 12 runs here, by ``end_process`` in none
of 12 (docs/remote.md, "Known limits"), so each check below runs several times."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.imagesets import make_imagefolder
from support.storage_servers import Emulated

import packer
from packer.storage.emulate import Fault

REPO = Path(__file__).resolve().parents[1]
RUNS = 3


@pytest.fixture
def slow(tmp_path):
    """The emulated store sending every GET's body at 4 KB/s: requests stay in flight until cancelled."""
    (tmp_path / "root").mkdir()
    srv = Emulated(tmp_path / "root")
    srv.faults.add(Fault("slow", rate=4000), times=-1)
    yield srv
    srv.stop()


def _env(tmp: Path | None = None) -> dict[str, str]:
    """The children's environment; ``tmp``: their temp folder (``TMPDIR``), this test's own."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    return env if tmp is None else {**env, "TMPDIR": str(tmp)}


def _interrupt_once_fetching(srv: Emulated, cmd: list[str], tmp: Path | None = None) -> subprocess.CompletedProcess:
    """``cmd`` started, SIGINT once the server has begun its slow GETs; its result. The requests of an earlier
    run's process may still reach the server after it ended: counted only once every connection has closed."""
    srv.server.stats.closed()
    begun = len(srv.faults.applied)
    proc = subprocess.Popen(cmd, env=_env(tmp), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while len(srv.faults.applied) <= begun and proc.poll() is None:
        time.sleep(0.01)  # polling for the requests to start, not timing anything
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_ctrl_c_while_converting_a_url_dataset_prints_packers_one_line_only(slow, tmp_path):
    imgs = make_imagefolder(tmp_path / "imgs", classes=2, per_class=6, size=(48, 48))
    packer.convert(imgs, tmp_path / "root" / "ds.lmdb", workers=0, shard_bytes=8000, progress=False)
    tmp = tmp_path / "tmp"  # the runs' own temp folder: another test process's local copies come and go in /tmp
    tmp.mkdir()
    for n in range(RUNS):
        out = tmp_path / f"out{n}.hdf5"
        res = _interrupt_once_fetching(slow, [
            sys.executable, "-m", "packer", "convert", "s3://bucket/ds.lmdb", "--to", "hdf5", "-o", str(out),
            "--storage-option", f"endpoint={slow.server.endpoint}", "--storage-option", "skip_signature=true",
            "--storage-option", "region=us-east-1"], tmp)
        assert (res.returncode, res.stderr) == (130, "packer: interrupted\n")
        assert not out.exists() and not out.with_name(out.name + ".partial").exists()
    assert list(tmp.iterdir()) == []  # the local copies removed


SCRIPT = """
import atexit, sys
from support.storage_servers import s3_store
from packer.cli import end_process
from packer.storage.fetch import Fetcher, Range

atexit.register(print, "atexit ran", flush=True)
store = s3_store(sys.argv[1], "s3://bucket/ds")
try:
    with Fetcher(store, max_in_flight=4) as fetcher:
        futures = fetcher.fetch([Range("shard.bin", i * 200_000, i * 200_000 + 100_000) for i in range(8)])
        futures[0].result()
except KeyboardInterrupt:
    store.close()
    print("interrupted", file=sys.stderr, flush=True)
    end_process(130)
"""


def test_end_process_after_cancelled_requests_prints_no_panic_and_runs_atexit(slow):
    slow.write("ds/shard.bin", os.urandom(2 << 20))
    for _ in range(2 * RUNS):
        res = _interrupt_once_fetching(slow, [sys.executable, "-c", SCRIPT, slow.server.endpoint])
        assert (res.returncode, res.stderr, res.stdout) == (130, "interrupted\n", "atexit ran\n")


def test_run_exits_with_mains_code(tmp_path):
    res = subprocess.run([sys.executable, "-m", "packer", "info", str(tmp_path / "none")], env=_env(),
                         capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.startswith("packer: error: ") and len(res.stderr.splitlines()) == 1


def _closed_reader() -> int:
    """The write end of a pipe whose reader has already gone (``packer ... | head -1`` once head has its line)."""
    r, w = os.pipe()
    os.close(r)
    return w


@pytest.mark.parametrize("json_out", [False, True])
def test_a_reader_of_stdout_that_went_away_is_no_traceback(json_out, tmp_path):
    imgs = make_imagefolder(tmp_path / "imgs", classes=2, per_class=1, size=(8, 8))
    packer.convert(imgs, tmp_path / "ds.lmdb", workers=0, progress=False)
    w = _closed_reader()
    try:
        res = subprocess.run([sys.executable, "-m", "packer", "info", str(tmp_path / "ds.lmdb"),
                              *(["--json"] if json_out else [])],
                             env=_env(), stdout=w, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(w)
    assert (res.returncode, res.stderr) == (1, "")  # cut short: 1, as Python's docs advise, and no traceback


def test_a_reader_of_stdout_that_went_away_is_no_traceback_where_obstore_ran(slow, tmp_path):
    imgs = make_imagefolder(tmp_path / "imgs", classes=2, per_class=1, size=(8, 8))
    packer.convert(imgs, tmp_path / "root" / "ds.lmdb", workers=0, progress=False)
    slow.faults.clear()
    w = _closed_reader()
    try:
        res = subprocess.run([sys.executable, "-m", "packer", "info", "s3://bucket/ds.lmdb", "--json",
                              "--storage-option", f"endpoint={slow.server.endpoint}", "--storage-option",
                              "skip_signature=true", "--storage-option", "region=us-east-1"],
                             env=_env(), stdout=w, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(w)
    assert (res.returncode, res.stderr) == (1, "")
