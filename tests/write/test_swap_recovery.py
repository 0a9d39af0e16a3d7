"""An ``--overwrite`` killed while moving the new dataset into place loses nothing: every way in
says what happened, and ``--resume`` finishes the move without converting again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.imagesets import make_imagefolder
from support.interrupt import run_cli_at

from packer import PackerError, convert, open_dataset
from packer.tools.verify import verify

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def packer_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packer", *map(str, args)], env=ENV, capture_output=True, text=True)


def files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def inodes(root: Path) -> dict[str, int]:
    return {p.name: p.stat().st_ino for p in root.iterdir() if p.is_file()}


@pytest.fixture
def old_and_new(tmp_path):
    """(old source, new source, a dataset of the old one): what --overwrite replaces, and with what."""
    old = make_imagefolder(tmp_path / "old", classes=2, per_class=3, seed=1, size=(16, 16))
    new = make_imagefolder(tmp_path / "new", classes=2, per_class=4, seed=2, size=(16, 16))
    out = tmp_path / "ds.lmdb"
    convert(old, out, workers=0, progress=False)
    return old, new, out


@pytest.mark.parametrize("signal", ["kill", "int"])
def test_stopped_between_the_renames_then_resumed(old_and_new, signal):
    old, new, out = old_and_new
    before = files(out)
    partial = out.with_name(out.name + ".partial")
    cmd = ["convert", new, "-o", out, "--overwrite", "--workers", "0", "-q"]
    run = run_cli_at(cmd, ENV, "os.rename", str(partial), signal)  # the second rename: .partial -> out
    assert run.returncode == (-9 if signal == "kill" else 130), run.stderr
    if signal == "int":  # a Ctrl-C says so once, with the way on
        assert run.stderr.count("interrupted") == 1 and "--resume" in run.stderr, run.stderr
    assert not out.exists() and (partial / "manifest.json").is_file()
    trash = [p for p in out.parent.iterdir() if p.name.startswith("ds.lmdb.packer-old-")]
    assert len(trash) == 1 and files(trash[0] / out.name) == before  # the old dataset, whole, in one place

    with pytest.raises(PackerError, match=rf"{out}: no such dataset .*interrupted.*{partial}.*resume=True"):
        open_dataset(out)
    info = packer_cli("info", out)
    assert info.returncode == 2 and str(partial) in info.stderr and str(trash[0]) in info.stderr, info.stderr
    refused = packer_cli(*cmd)  # without --resume: says what the state is, touches nothing
    assert refused.returncode == 2 and str(trash[0]) in refused.stderr and "--resume" in refused.stderr
    assert not out.exists() and files(trash[0] / out.name) == before

    kept = inodes(partial)
    done = packer_cli(*cmd, "--resume")
    assert done.returncode == 0, done.stderr
    assert inodes(out) == kept  # moved into place, not converted again
    assert verify(out, against=new).ok and len(open_dataset(out)) == 8
    assert sorted(p.name for p in out.parent.iterdir()) == ["ds.lmdb", "new", "old"]
    assert not (out / "journal").exists()


def test_stopped_before_the_old_dataset_moved_then_resumed(old_and_new):
    old, new, out = old_and_new
    before = files(out)
    partial = out.with_name(out.name + ".partial")
    cmd = ["convert", new, "-o", out, "--overwrite", "--workers", "0", "-q"]
    run = run_cli_at(cmd, ENV, "os.rename", str(out), "kill")  # the first rename: out -> its trash folder
    assert run.returncode == -9, run.stderr
    assert files(out) == before and (partial / "journal" / "swap.json").is_file()
    assert len(open_dataset(out)) == 6  # the old dataset still opens
    refused = packer_cli(*cmd)
    assert refused.returncode == 2 and "not replaced yet" in refused.stderr and "--resume" in refused.stderr

    kept = inodes(partial)
    done = packer_cli(*cmd, "--resume")
    assert done.returncode == 0, done.stderr
    assert inodes(out) == kept and verify(out, against=new).ok
    assert sorted(p.name for p in out.parent.iterdir()) == ["ds.lmdb", "new", "old"]


def test_a_swap_record_naming_another_folder_is_refused(old_and_new):
    old, new, out = old_and_new
    partial = out.with_name(out.name + ".partial")
    cmd = ["convert", new, "-o", out, "--overwrite", "--workers", "0", "-q"]
    assert run_cli_at(cmd, ENV, "os.rename", str(partial), "kill").returncode == -9
    (partial / "journal" / "swap.json").write_text(json.dumps({"trash": "old"}))  # the user's source folder
    before = files(old)
    with pytest.raises(PackerError, match="damaged swap record"):
        convert(new, out, overwrite=True, resume=True, workers=0, progress=False)
    assert files(old) == before and partial.is_dir()
