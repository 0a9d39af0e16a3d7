"""The shared driver's promises on the recordio, n5, pth and safetensors formats: a conversion killed
half-way resumes to the same bytes as an uninterrupted one (tests/write/test_resume.py does lmdb),
the same input gives the same bytes whatever the worker count, and extract gives back the sources."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from support.cli import run_cli
from support.imagesets import make_imagefolder
from support.interrupt import kill_after_shards

from packer import convert
from packer.tools.extract import extract
from packer.tools.verify import verify

REPO = Path(__file__).resolve().parents[2]
FORMATS = ["recordio", "n5", "pth", "safetensors"]


def tree(root: Path) -> dict[str, bytes]:
    """Every file below root but the manifest (it holds a creation time)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "manifest.json"}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_imagefolder(tmp_path_factory.mktemp("res") / "src", classes=3, per_class=300, size=(48, 64))


@pytest.mark.parametrize("fmt", FORMATS)
def test_resume_after_sigkill_is_byte_identical(source, tmp_path, fmt):
    reference = tmp_path / "ref"
    convert(source, reference, to=fmt, workers=0, shard_bytes=40_000, progress=False)
    out = tmp_path / "out"
    args = ["convert", str(source), "--to", fmt, "-o", str(out), "--workers", "1", "--shard-size", "40000", "-q"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    assert kill_after_shards([sys.executable, "-m", "packer", *args], env, tmp_path / "out.partial" / "journal",
                             shards=2) >= 2
    res = run_cli(*args, "--resume")  # in this interpreter: the kill is the child's business
    assert res.returncode == 0, res.stderr
    assert tree(out) == tree(reference)
    assert verify(out, against=source).ok


@pytest.mark.parametrize("fmt", FORMATS)
def test_same_bytes_whatever_the_worker_count_and_extract_returns_the_sources(imagefolder, tmp_path, fmt):
    convert(imagefolder, tmp_path / "a", to=fmt, workers=0, shard_bytes=6_000, progress=False)
    convert(imagefolder, tmp_path / "b", to=fmt, workers=2, shard_bytes=6_000, progress=False)
    assert tree(tmp_path / "a") == tree(tmp_path / "b")
    result = extract(tmp_path / "a", tmp_path / "x")
    files = sorted(p.relative_to(imagefolder) for p in imagefolder.rglob("*.jpg"))
    assert result.num_files == len(files)
    assert all((tmp_path / "x" / f).read_bytes() == (imagefolder / f).read_bytes() for f in files)
