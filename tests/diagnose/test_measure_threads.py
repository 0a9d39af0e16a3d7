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
        assert r["steady_images_per_s"] > 0 and r["steady_of_decode_limit"] > 0, r
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


def test_steady_rate_leaves_out_what_comes_before_the_first_batch(monkeypatch):
    """Issue 19's steady state: images after the first batch over the time after it (a loader's start and first
    batch left out); one batch in all: the whole epoch's rate. On a clock the test sets."""
    import types

    spec = importlib.util.spec_from_file_location("mt", SCRIPT)
    mt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mt)
    clock = iter([0.0, 0.2, 0.35])  # start; first batch handed out; end
    monkeypatch.setattr(mt, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    rate, _cpu, steady = mt.timed(lambda: iter([4, 4, 4, 4]))
    assert (round(rate, 6), round(steady, 6)) == (round(16 / 0.35, 6), 80.0)
    clock = iter([0.0, 0.2, 0.25])
    rate, _cpu, steady = mt.timed(lambda: iter([10]))
    assert rate == steady == 10 / 0.25
