"""examples/measure_batch_reads.py runs end to end on small lmdb and memmap datasets (encoded and fixed-shape raw):
a CPU figure per order and a bandwidth line per batch path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from support.imagesets import make_imagefolder

from packer import convert

ROOT = Path(__file__).resolve().parents[2]


def test_measure_batch_reads_smoke(tmp_path):
    src = make_imagefolder(tmp_path / "imgs", classes=2, per_class=12, size=(40, 56))
    paths = [convert(src, tmp_path / name, workers=0, progress=False, **options).output for name, options in [
        ("enc.lmdb", {"to": "lmdb"}), ("r.lmdb", {"to": "lmdb", "payload": "raw", "resize": "16x16"}),
        ("r.memmap", {"to": "memmap", "payload": "raw", "resize": "16x16"})]]
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "measure_batch_reads.py"), *map(str, paths),
                          "--folder", str(src), "--batch-size", "8", "--batch", "8", "--repeats", "1"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("folder (open + read)") for line in lines)
    for name in ("enc.lmdb", "r.lmdb", "r.memmap"):
        assert len([line for line in lines if line.startswith(name)]) >= 2, out.stdout
    for name in ("r.lmdb", "r.memmap"):
        assert any(line.startswith(name) and "get_batch out=" in line for line in lines), out.stdout
    for name in ("enc.lmdb", "r.lmdb", "r.memmap"):
        assert any(line.startswith(name) and "read_payloads out" in line for line in lines), out.stdout


def test_gather_copies_the_payloads_back_to_back(tmp_path):
    """The reused-buffer row copies exactly what the joined row joins (views and arrays alike)."""
    import importlib.util

    import numpy as np
    spec = importlib.util.spec_from_file_location("mbr", ROOT / "examples" / "measure_batch_reads.py")
    mbr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mbr)
    payloads = [memoryview(b"abc"), np.arange(6, dtype=np.uint8).reshape(1, 2, 3), memoryview(b"")]
    out = np.zeros(20, np.uint8)
    assert mbr.gather(payloads, out).tobytes() == b"".join(bytes(p) for p in payloads)
