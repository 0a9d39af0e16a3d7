"""examples/bench_peers.py runs end to end on 50 small photos with whichever peers import here (DALI CPU is in
the test requirements; FFCV and LitData usually are not): every tool gives a figure for every setting."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from support.imagesets import make_imagefolder

from packer.images.jpegregion import region_decode_available

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "bench_peers.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_peers", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_peers"] = module
    spec.loader.exec_module(module)
    return module


def test_bench_peers_smoke(tmp_path):
    peers = _load()
    folder = make_imagefolder(tmp_path / "imgs", classes=2, per_class=25, size=(90, 120))
    report = peers.run(folder, tmp_path / "work", epochs=1, workers=2, batch=16, peers=("dali",), log=lambda s: None,
                       warmup=False)
    json.dumps(report)
    rows = report["rows"]
    assert {"loose folder + Pillow", "packer memmap", "packer lmdb"} <= set(rows)
    if region_decode_available():
        assert "packer lmdb --jpeg-restarts, ThreadLoader" in rows
    if importlib.util.find_spec("nvidia.dali") is not None:
        assert "NVIDIA DALI CPU" in rows
    else:
        assert "NVIDIA DALI CPU" in report["skipped"]
    for label, row in rows.items():
        want = 2 if label in ("LitData", "packer memmap, whole decode then crop") else 4
        assert len(row) == want, (label, row)
        for key, r in row.items():
            assert "error" not in r, (label, key, r)
            assert r["samples"] == 50 and r["images_per_s"] > 0, (label, key, r)
    table = peers.markdown(report)
    assert "| packer memmap |" in table and "train224, training order" in table
