"""examples/measure_whole_decode.py, measure_residency_check.py and measure_intraop.py run end to end on small
datasets and print a figure per round and path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from support.imagesets import make_imagefolder

from packer import convert

ROOT = Path(__file__).resolve().parents[2]


def run(script: str, *args: str) -> list[str]:
    out = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_measure_whole_decode_smoke(tmp_path, turbojpeg, jpegregion):
    src = make_imagefolder(tmp_path / "imgs", classes=2, per_class=40, size=(48, 64))
    packed = convert(src, tmp_path / "p.memmap", to="memmap", workers=0, progress=False).output
    lines = run("measure_whole_decode.py", str(src), str(packed), "--rounds", "1")
    assert any("extension" in line and " us" in line for line in lines if "PyTurboJPEG decode(dst=)" in line)
    assert [line.split(":")[1].strip() for line in lines if "ThreadLoader" in line] == [
        "ThreadLoader, extension, chunks in one call", "ThreadLoader, extension, one call per image",
        "ThreadLoader, PyTurboJPEG"]
    assert any(line.startswith("decode limit: ") for line in lines)


def test_measure_residency_check_smoke(tmp_path):
    src = make_imagefolder(tmp_path / "imgs", classes=2, per_class=20, size=(48, 64))
    packed = convert(src, tmp_path / "p.lmdb", to="lmdb", workers=0, progress=False).output
    lines = run("measure_residency_check.py", str(packed), "--rounds", "1")
    assert len(lines) == 1 and "values only (holding)" in lines[0] and "whole file" in lines[0], lines


def test_measure_intraop_smoke(tmp_path):
    src = make_imagefolder(tmp_path / "imgs", classes=2, per_class=40, size=(240, 260))
    packed = convert(src, tmp_path / "p.lmdb", to="lmdb", workers=0, progress=False).output
    lines = run("measure_intraop.py", str(packed), "--rounds", "1")
    assert [line.split(":")[1].strip() for line in lines] == ["serial", "team"], lines
    assert all("img/s" in line and "decode threads" in line for line in lines)
