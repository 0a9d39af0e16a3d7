"""A conversion that cannot write (read-only destination, a disk that fills at any step) or is
interrupted (Ctrl-C at any step) ends with one line naming the path and the reason, never a
traceback; what it finished is kept, and ``--resume`` completes it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.imagesets import make_imagefolder
from support.interrupt import run_cli_at
from support.mounts import read_only_mount, small_tmpfs

from packer import FORMATS, convert, open_dataset
from packer.tools.verify import verify

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def packer_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packer", *map(str, args)], env=ENV, capture_output=True, text=True)


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_imagefolder(tmp_path_factory.mktemp("fail") / "src", classes=2, per_class=6, size=(16, 16))


@pytest.mark.parametrize("sub", ["o.lmdb", "deeper/o.lmdb"])
def test_read_only_destination_is_refused_in_one_line(source, tmp_path, sub):
    (tmp_path / "dest").mkdir()
    with read_only_mount(tmp_path / "dest", tmp_path / "ro") as ro:
        res = packer_cli("convert", source, "-o", ro / sub, "--workers", "0", "-q")
        line = one_line(res.stderr)
        assert res.returncode == 2 and line.startswith(f"packer: error: {ro}/") and "Read-only file system" in line
    assert os.listdir(tmp_path / "dest") == []


# (the file being written when the disk fills, the exit code): the plan is written before the
# conversion starts (nothing to resume: refused, 2); later, the work is kept for --resume (1)
def opened_name(step: str) -> str:
    """The file name opened when ``step`` is written: JSON goes through a temporary file, except errors.json
    (written plainly before the flush of the whole folder)."""
    return os.path.basename(step) + (".tmp" if step.endswith(".json") and step != "errors.json" else "")


STEPS = [("journal/plan.json", 2), ("journal/shard-00000.json", 1), ("meta/labels.npy", 1),
         ("errors.json", 1), ("manifest.json", 1), ("journal/swap.json", 1)]


@pytest.mark.parametrize("step,code", STEPS, ids=[s for s, _ in STEPS])
def test_disk_full_at_each_step_is_one_line_then_resumes(source, tmp_path, step, code):
    with small_tmpfs(tmp_path / "fs", "4m") as fs:
        out, filler = fs / "o.lmdb", tmp_path / "fs" / "filler"
        # one shard: once the disk is full, nothing else is being written that could fail first
        cmd = ["convert", source, "-o", out, "--workers", "0", "-q"]
        target = opened_name(step)
        res = run_cli_at(cmd, ENV, "open", target, f"fill:{filler}")
        line = one_line(res.stderr)
        assert res.returncode == code, res.stderr
        assert line.startswith(f"packer: error: {out}") and step in line and "No space left on device" in line
        assert not out.exists()
        filler.unlink()
        if code == 2:  # refused before anything was kept: nothing left behind
            assert os.listdir(fs) == []
            assert packer_cli(*cmd).returncode == 0
        else:
            assert "--resume" in line
            done = packer_cli(*cmd, "--resume")
            assert done.returncode == 0, done.stderr
        assert verify(out, against=source).ok and sorted(os.listdir(fs)) == ["o.lmdb"]


def test_disk_full_while_shards_are_written_and_journaled_is_one_line(source, tmp_path):
    # several shards: the journal of shard 0 (a thread) and the creation of the next shard (LMDB's
    # own DiskError, no OSError) race to meet the full disk first; either way one line, exit 1
    with small_tmpfs(tmp_path / "fs", "4m") as fs:
        out = fs / "o.lmdb"
        cmd = ["convert", source, "-o", out, "--workers", "0", "--shard-size", "2000", "-q"]
        res = run_cli_at(cmd, ENV, "open", "shard-00000.json.tmp", f"fill:{tmp_path / 'fs' / 'filler'}")
        line = one_line(res.stderr)
        assert res.returncode == 1 and line.startswith(f"packer: error: {out}") and "--resume" in line
        assert "No space left on device" in line or "disk is full" in line
        (fs / "filler").unlink()
        assert packer_cli(*cmd, "--resume").returncode == 0 and verify(out, against=source).ok


@pytest.mark.parametrize("step", ["journal/shard-00001.json", "meta/labels.npy", "errors.json", "manifest.json"])
def test_ctrl_c_says_interrupted_once_with_the_way_on(source, tmp_path, step):
    out = tmp_path / "o.lmdb"
    cmd = ["convert", source, "-o", out, "--workers", "0", "--shard-size", "2000", "-q"]
    target = opened_name(step)
    res = run_cli_at(cmd, ENV, "open", target, "int")
    line = one_line(res.stderr)
    assert res.returncode == 130 and line.startswith("packer: interrupted") and "--resume" in line
    assert not out.exists()
    done = packer_cli(*cmd, "--resume")
    assert done.returncode == 0, done.stderr
    assert verify(out, against=source).ok and len(open_dataset(out)) == 12


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("bad", ["class_1", "class_0+class_1"])
def test_a_shard_whose_every_record_fails_is_left_out(tmp_path, fmt, bad):
    src = make_imagefolder(tmp_path / "imgs", classes=3, per_class=2, size=(16, 16))
    for name in bad.split("+"):
        for p in (src / name).glob("*.jpg"):
            p.write_bytes(b"not an image")
    options = {"tile": "16x16"} if fmt == "mosaic" else {}
    res = convert(src, tmp_path / f"o.{fmt}", to=fmt, order="source", shard_bytes=1, workers=0, progress=False,
                  **options)  # one record per planned shard: the bad ones' shards hold nothing
    ds = open_dataset(res.output)
    assert len(ds) == 6 - 2 * len(bad.split("+")) == len(ds.manifest.shards) and len(res.errors) == 6 - len(ds)
    assert [ds[i][1] for i in range(len(ds))] == ds.targets
    report = verify(res.output, deep=True)
    assert report.ok, report.problems
    listed = {f.name for f in ds.manifest.all_files()} | {"manifest.json", "errors.json"}
    on_disk = {p.relative_to(res.output).as_posix() for p in res.output.rglob("*") if p.is_file()}
    assert on_disk == listed  # no file of a dropped shard is left behind
