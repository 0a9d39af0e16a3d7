"""One run writes an output at a time: a second conversion, a --resume beside it or a Writer is refused, naming
the running one's pid, and changes nothing; the running one then finishes a dataset that verifies. Real
processes: the first is stopped (SIGSTOP) at a point of its work while the others run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from support.cli import REPO, run_cli
from support.imagesets import jpeg_bytes, make_imagefolder
from support.interrupt import stopped_at

from packer import open_dataset
from packer.errors import PackerError
from packer.tools.verify import verify
from packer.write.lock import check_free
from packer.write.writer import Writer

ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _tree(root) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
            if p.is_file()}


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


@pytest.fixture
def src(tmp_path):
    return make_imagefolder(tmp_path / "src", classes=2, per_class=6)


def test_a_second_conversion_or_resume_is_refused_while_the_first_runs(src, tmp_path):
    out = tmp_path / "out.lmdb"
    cmd = ["convert", src, "-o", out, "--workers", "0", "--shard-size", "4KB", "-q"]
    first = stopped_at(cmd, ENV, "open", "shard-00001.json.tmp")  # one shard journaled, the second written
    try:
        partial = tmp_path / "out.lmdb.partial"
        before = _tree(tmp_path)
        for extra in ([], ["--resume"]):
            res = run_cli(*cmd, *extra)
            assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
            assert f"{out}: in use by pid {first.pid}, which is writing it in {partial}" in res.stderr
            assert "rm -r" not in res.stderr
        with pytest.raises(PackerError, match=f"in use by pid {first.pid}"):
            Writer(out, resume=True)
        assert _tree(tmp_path) == before  # the refusals changed nothing, not even the lock file
    finally:
        code, err = _finish(first)
    assert code == 0, err
    assert len(open_dataset(out)) == 12 and verify(out, against=src).ok


def test_two_conversions_started_together_one_is_refused(src, tmp_path):
    """The first stops just before renaming its new folder to ``.partial``; the second makes ``.partial`` and
    stops; the first, going on, finds it taken: refused, naming the second, its own new folder removed."""
    out = tmp_path / "out.lmdb"
    cmd = ["convert", src, "-o", out, "--workers", "0", "--shard-size", "4KB", "-q"]
    first = stopped_at(cmd, ENV, "os.rename-to", "out.lmdb.partial")
    second = stopped_at(cmd, ENV, "open", "shard-00000.json.tmp")
    try:
        code, err = _finish(first)
        assert code == 2 and f"in use by pid {second.pid}" in err, err
        assert not list(tmp_path.glob("out.lmdb.packer-new-*"))
    finally:
        code, err = _finish(second)
    assert code == 0, err
    assert verify(out, against=src).ok


_WRITER = r"""
import os, signal, sys
import numpy as np
from packer.write.writer import Writer

with Writer(sys.argv[1], shard_bytes=1 << 12) as w:
    for i in range(6):
        w.add(np.full((32, 32, 3), i, np.uint8), label=i % 2)
        if i == 2:
            os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_a_writer_holds_its_output_too(src, tmp_path):
    out = tmp_path / "w.lmdb"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(out)], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _, status = os.waitpid(proc.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), proc.communicate()
    try:
        assert (tmp_path / "w.lmdb.partial").is_dir()
        res = run_cli("convert", src, "-o", out, "--workers", "0", "--resume", "-q")
        assert res.returncode == 2 and f"in use by pid {proc.pid}" in res.stderr, res.stderr
        with pytest.raises(PackerError, match=f"in use by pid {proc.pid}"):
            with Writer(out, resume=True) as w:
                w.add(jpeg_bytes(np.random.default_rng(0), 16, 16))
    finally:
        code, err = _finish(proc)
    assert code == 0, err
    ds = open_dataset(out, image="numpy")
    assert len(ds) == 6 and [int(ds[i][0][0, 0, 0]) for i in range(6)] == list(range(6))


def test_a_killed_runs_partial_is_free_at_once(src, tmp_path):
    """The kernel drops the lock with its holder: --resume goes on from a SIGKILLed run's .partial."""
    out = tmp_path / "out.lmdb"
    cmd = ["convert", src, "-o", out, "--workers", "0", "--shard-size", "4KB", "-q"]
    first = stopped_at(cmd, ENV, "open", "shard-00001.json.tmp")
    first.kill()
    first.communicate()
    res = run_cli(*cmd, "--resume")
    assert res.returncode == 0, res.stderr
    assert verify(out, against=src).ok


_FORKS = r"""
import os, sys, time
from pathlib import Path
from packer.write.lock import OutputLock

lock = OutputLock.take(Path(sys.argv[1]), Path(sys.argv[2]))
child = os.fork()  # a pool worker, forked while the lock is held
if child == 0:  # says so once the fork hooks have run in it (it may be scheduled after the parent is killed)
    print(os.getpid(), flush=True)
    time.sleep(120)
    os._exit(0)
time.sleep(120)
"""


def test_a_worker_forked_by_a_killed_run_does_not_keep_its_lock(tmp_path):
    """A run SIGKILLed while a worker it forked lives on: the lock goes with the run (the child closed its copy
    at fork), so --resume can go on at once, as it could before the lock (test_resume_after_sigkill_...)."""
    partial, out = tmp_path / "o.lmdb.partial", tmp_path / "o.lmdb"
    (partial / "journal").mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-c", _FORKS, str(partial), str(out)], env=ENV, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    try:
        with pytest.raises(PackerError, match=f"in use by pid {proc.pid}"):
            check_free(partial, out)
        proc.kill()
        proc.wait()
        os.kill(child, 0)  # the forked child lives on
        check_free(partial, out)  # and the lock is free
    finally:
        proc.kill()
        os.kill(child, signal.SIGKILL)
