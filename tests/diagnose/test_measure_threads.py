"""examples/measure_threads.py runs end to end on a small JPEG dataset: every loader row, with its fraction of the
bare per-core limit and of bare libjpeg-turbo on as many threads."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from support.imagesets import make_imagefolder

from packer import convert, sysinfo

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "measure_threads.py"


def test_measure_threads_smoke(tmp_path):
    src = make_imagefolder(tmp_path / "imgs", classes=2, per_class=10, size=(40, 56))
    packed = convert(src, tmp_path / "imgs.lmdb", to="lmdb", workers=0, progress=False).output
    out = subprocess.run([sys.executable, str(SCRIPT), str(packed), "--rounds", "1", "--batch-size", "4",
                          "--json", str(tmp_path / "t.json")],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "t.json").read_text())["datasets"][str(packed)]
    cores = sysinfo.usable_cores()
    assert {(r["loader"], r["order"]) for r in rows} == {
        ("bare libjpeg-turbo, 1 thread", "-"), (f"bare libjpeg-turbo, {cores} threads", "-"),
        *((kind, order) for kind in ("DataLoader", "ThreadLoader") for order in ("stored", "block"))}
    for r in rows:
        assert r["images_per_s"] > 0 and r["of_decode_limit"] > 0 and r["of_bare_threads"] > 0, r
    out = subprocess.run([sys.executable, str(SCRIPT), str(packed), "--rounds", "1", "--batch-size", "4",
                          "--loaders", "ThreadLoader", "--json", str(tmp_path / "t2.json")],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "t2.json").read_text())["datasets"][str(packed)]
    assert {r["loader"] for r in rows} == {"bare libjpeg-turbo, 1 thread", f"bare libjpeg-turbo, {cores} threads",
                                          "ThreadLoader"}


def test_bare_epochs_decode_every_image(tmp_path):
    spec = importlib.util.spec_from_file_location("mt", SCRIPT)
    mt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mt)
    src = make_imagefolder(tmp_path / "imgs", classes=1, per_class=7, size=(30, 44))
    payloads = [p.read_bytes() for p in sorted(src.rglob("*.jpg"))]
    assert sum(mt.bare_epoch(payloads, 3)) == 7
    assert sum(mt.bare_threads_epoch(payloads, 3, 2)) == 7


def test_bare_decoder_decodes_into_its_buffer_as_pillow_does(tmp_path):
    import io

    import numpy as np
    from PIL import Image

    spec = importlib.util.spec_from_file_location("mt", SCRIPT)
    mt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mt)
    src = make_imagefolder(tmp_path / "imgs", classes=1, per_class=4, size=(30, 44))
    dec = mt.BareDecoder()
    for path in sorted(src.rglob("*.jpg")):  # sizes differ: views of one buffer, grown where needed
        data = path.read_bytes()
        dec.decode(data)
        want = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        got = dec.buf[:want.size].reshape(want.shape)
        assert np.array_equal(got, want), path
