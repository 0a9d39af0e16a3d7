"""examples/gpu_feed.py, the one script a GPU machine runs, kept runnable here: its CPU parts end to end on a tiny
dataset (the GPU parts reported as skipped, with the reason), the JSON's shape, and its pieces that need a GPU
there run on the CPU here (the training step fed by every loader, the prefetcher's checks, the markdown of the
GPU parts). Structural checks only: no timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from support._tiny import make_lmdb
from torch import nn

from packer.errors import PackerError
from packer.read.dali import import_dali

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))
import check_cuda_prefetch  # noqa: E402
import gpu_feed  # noqa: E402
import gpu_feed_cores  # noqa: E402
import gpu_feed_train  # noqa: E402
import gpu_feed_verify  # noqa: E402
import resnet50  # noqa: E402

CUDA = torch.cuda.is_available()


def dali_imports() -> bool:
    try:
        import_dali()
    except PackerError:
        return False
    return True


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("gpu_feed")
    proc = subprocess.run([sys.executable, str(EXAMPLES / "gpu_feed.py"), "--out", str(out), "--budget-s", "30",
                           "--count", "40", "--size", "64x80", "--threads", "1,2", "--workdir", str(out / "work")],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "gpu_feed.json").read_text()), (out / "gpu_feed.md").read_text()


@pytest.mark.slow  # its module fixture runs examples/gpu_feed.py
def test_the_report_names_what_it_needs_and_has_every_part(run):
    r, _ = run
    assert set(r) >= {"command", "started", "budget_s", "machine", "requirements", "data", "parts", "elapsed_s"}
    assert set(r["requirements"]) == {"torch_cuda", "timm", "nvidia_dali", "ffcv", "turbojpeg", "jpegregion",
                                      "pillow", "h5py", "tqdm", "lmdb", "nvidia_smi"}
    assert all(isinstance(v["ok"], bool) and v["detail"] for v in r["requirements"].values())
    assert r["data"]["images"] == 40 and r["budget_s"] == 30 and r["data"]["format"] in ("lmdb", "memmap")
    assert list(r["parts"]) == list(gpu_feed.PARTS)
    assert all(p["status"] in ("ok", "skipped", "failed") for p in r["parts"].values())
    failed = {k: p.get("error") for k, p in r["parts"].items() if p["status"] == "failed"}
    assert not failed, failed


@pytest.mark.skipif(CUDA, reason="here the GPU parts would run")
def test_without_cuda_the_gpu_parts_say_why_they_did_not_run(run):
    r, md = run
    assert not r["requirements"]["torch_cuda"]["ok"]
    for part in ("feed", "prefetch"):
        assert r["parts"][part]["status"] == "skipped" and "needs a CUDA device" in r["parts"][part]["reason"]
    assert "skipped: training ResNet-50 on the GPU needs a CUDA device" in md
    if r["parts"]["dali_parity"]["status"] == "ok":
        assert "no CUDA device" in r["parts"]["dali_parity"]["gpu_skipped"]


def test_scaling_has_every_loader_at_every_count_against_bare_libjpeg_turbo(run):
    r, md = run
    s = r["parts"]["scaling"]
    assert s["status"] == "ok" and s["threads"] == [1, 2] and s["images"] == 40
    assert s["bare_one_thread"]["images_per_s"] > 0
    loaders = {"ThreadLoader", "DataLoader"} | ({"DALI CPU"} if dali_imports() else set())
    got = {(row["setting"], row["loader"], row["n"]) for row in s["rows"]}
    want = {(st, ld, n) for st in ("full", "train224") for ld in loaders for n in (1, 2)}
    assert want | {("full", "bare libjpeg-turbo", n) for n in (1, 2)} <= got
    for row in s["rows"]:
        assert "error" not in row, row
        assert row["images_per_s"] > 0 and row["of_n_bare"] > 0 and row["cpu_ms_per_image"] > 0
        assert row["of_linear"] == pytest.approx(1.0) if row["n"] == 1 else row["of_linear"] > 0
    if not r["requirements"]["ffcv"]["ok"]:
        assert "does not import" in s["skipped"]["FFCV"]
    assert "**full**: images/s" in md and "| 2 | " in md


def test_gil_part_bounds_one_process_and_runs_ranks(run):
    g = run[0]["parts"]["gil"]
    assert g["status"] == "ok"
    assert {(row["threads"], row["batch_size"]) for row in g["raw32"]} == {(1, 64), (1, 256), (2, 64), (2, 256)}
    assert all(row["cpu_us_per_sample"] > 0 and row["ceiling_samples_per_s"] > 0 for row in g["raw32"])
    (ranks,) = g["ranks"]  # 2 cores here: 2 processes x 1 thread
    assert "error" not in ranks, ranks
    assert ranks["ranks"] == 2 and ranks["threads_per_rank"] == 1 and ranks["images_per_s"] > 0
    for row in g["shortfalls"]:
        assert row["fraction"] < 0.9 and row["cpu_us_per_image"] > 0


@pytest.mark.skipif(not dali_imports(), reason="NVIDIA DALI does not import here")
def test_dali_parity_checks_every_sample_on_the_cpu_path(run):
    d = run[0]["parts"]["dali_parity"]
    cpu = d["parity"]["cpu"]
    assert d["status"] == "ok" and cpu["ok"] and cpu["seen"] == cpu["samples"] == 40 and not cpu["missing"]
    assert d["tolerance"]["mean_abs_diff"] == 4.0 and "test_image.py" in d["tolerance"]["source"]
    assert d["train_rate"]["cpu"]["images_per_s"] > 0


def test_doctor_part_keeps_the_gpu_facts_and_the_verdict(run):
    d = run[0]["parts"]["doctor"]
    assert d["status"] == "ok" and d["verdict"] and "smi" in d["gpu"]


@pytest.mark.skipif(not dali_imports(), reason="NVIDIA DALI does not import here")
def test_parity_finds_samples_over_the_tolerance(tmp_path, monkeypatch):
    path = make_lmdb(tmp_path, count=8)
    assert gpu_feed_verify.parity(path, "cpu", 1, batch=4)["ok"]
    monkeypatch.setitem(gpu_feed_verify.TOLERANCE, "mean_abs_diff", -1.0)  # every sample over it
    found = gpu_feed_verify.parity(path, "cpu", 1, batch=4)
    assert not found["ok"] and found["over_tolerance_count"] == 8


class Small(nn.Module):
    """A network small enough to train a few steps on the CPU in a test."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3, stride=8), nn.Linear(4, 10)

    def forward(self, x):
        return self.fc(self.conv(x).mean((2, 3)))


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    return make_lmdb(tmp_path_factory.mktemp("feed"), count=12, size=(60, 80))


def test_every_loader_feeds_the_step_its_normalised_channels_last_batches(photos):
    cpu = torch.device("cpu")
    makers = gpu_feed_train.sources(photos, batch=4, workers=1, device=cpu, epochs=2)
    assert len(makers) == 4
    for name, make in makers.items():
        if "dali" in name and not dali_imports():
            continue
        x, y = next(make())
        assert x.shape == (4, 3, 224, 224) and x.dtype == torch.float32, name
        assert x.is_contiguous(memory_format=torch.channels_last), name
        assert y.dtype == torch.int64 and 0 <= int(y.min()) and int(y.max()) < 2, name
        assert -3 < float(x.mean()) < 3, name  # normalised, not 0-255


def test_every_loader_goes_on_past_the_end_of_its_sampler(photos):
    cpu = torch.device("cpu")
    for name, make in gpu_feed_train.sources(photos, batch=4, workers=1, device=cpu, epochs=1).items():
        if "dali" in name and not dali_imports():
            continue
        it = make()
        for _ in range(7):  # 12 samples, 3 batches an epoch: past the end twice
            next(it)
        it.close()


def test_feed_times_the_ceiling_and_each_loader(photos):
    got = gpu_feed_train.feed(photos, seconds=2.0, workers=1, device=torch.device("cpu"), batch=4, model=Small(),
                              warmup=(1, 1), log=lambda _msg: None)
    assert got["ceiling"]["steps"] >= 2 and got["ceiling"]["steps_per_s"] > 0
    for name, row in got["loaders"].items():
        if "dali" in name and not dali_imports():
            assert "error" in row
            continue
        assert "error" not in row, (name, row)
        assert row["steps"] >= 2 and row["of_ceiling"] > 0 and row["warmup_steps"] == 1
    assert got["best"] in got["loaders"] and got["model"] == "Small"
    report = {"command": "c", "machine": {"cpu": "x", "cores": 2}, "parts": {"feed": {"status": "ok", **got}},
              "requirements": {"torch_cuda": {"ok": False, "detail": "d"}, "nvidia_smi": {"ok": False, "detail": "e"}}}
    md = gpu_feed.markdown(report)
    assert "| a batch kept on the GPU (the ceiling) |" in md and "not shown" not in md
    assert all(f"| {name} |" in md for name in got["loaders"])


def test_resnet50_has_torchvisions_layout_and_stands_in_for_timm():
    model = resnet50.ResNet50()
    assert sum(p.numel() for p in model.parameters()) == 25_557_032  # torchvision's resnet50()
    assert model(torch.zeros(1, 3, 64, 64)).shape == (1, 1000)
    made, source = gpu_feed_train.make_model(10)
    try:
        import timm  # noqa: F401
    except Exception:  # noqa: BLE001
        assert isinstance(made, resnet50.ResNet50) and source.startswith("examples/resnet50.py (timm: ")
    else:
        assert source.startswith("timm ")


def test_torch_random_resized_crop_resizes_the_window_it_draws():
    img = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (3, 60, 80), dtype=np.uint8))
    whole = gpu_feed_train.TorchRandomResizedCrop(32, scale=(1.0, 1.0), ratio=(80 / 60, 80 / 60))
    want = torch.nn.functional.interpolate(img[None], size=(32, 32), mode="bilinear", antialias=True,
                                           align_corners=False)[0]
    flips = 0
    for _ in range(20):  # the window is the whole image: the resize of it, flipped or not
        out = whole(img)
        assert out.dtype == torch.uint8 and out.shape == (3, 32, 32)
        flipped = torch.equal(out, want.flip(-1))
        assert flipped or torch.equal(out, want)
        flips += flipped
    assert 0 < flips < 20
    assert gpu_feed_train.TorchRandomResizedCrop(224)(img).shape == (3, 224, 224)


def test_the_prefetcher_checks_it_imports_run_and_render(photos):
    checked = check_cuda_prefetch.correctness(torch.device("cpu"))  # on the CPU: batches passed through
    assert [row["wrong_sums"] for row in checked] == [0, 0] and all(row["batches"] == 12 for row in checked)
    part = {"status": "ok", "correctness": checked, "ok": True, "step_alone_ms": 10.0,
            "ms_per_batch": [{"pin_memory": p, "loader": k, "ms": 12.0} for p in (False, True)
                             for k in ("plain .to(device)", "CUDAPrefetcher")],
            "copy_hidden": {"pin_memory=False": 0.0, "pin_memory=True": 0.0}}
    report = {"command": "c", "machine": {"cpu": "x", "cores": 2}, "parts": {"prefetch": part},
              "requirements": {"torch_cuda": {"ok": False, "detail": "d"}, "nvidia_smi": {"ok": False, "detail": "e"}}}
    md = gpu_feed.markdown(report)
    assert "correctness: OK" in md and "| - | step alone (no copy) | 10.00 |" in md and "not shown" not in md


def test_a_part_past_its_time_is_stopped_and_said_so(tmp_path):
    report: dict = {"command": "c", "machine": {"cpu": "x", "cores": 2}, "parts": {}, "requirements": {
        "torch_cuda": {"ok": False, "detail": "d"}, "nvidia_smi": {"ok": False, "detail": "e"}}}

    def stuck(seconds: float) -> dict:
        while True:
            try:
                time.sleep(0.05)
            except Exception:  # noqa: BLE001 - as the parts guard each row: must not keep it going
                pass

    gpu_feed.run_part("feed", stuck, 0.5, 1, report, tmp_path)
    part = json.loads((tmp_path / "gpu_feed.json").read_text())["parts"]["feed"]
    assert part["status"] == "failed" and part["error"].startswith("OverTime: stopped")
    gpu_feed.run_part("doctor", lambda s: {"verdict": ["fine"], "gpu": {}}, 0.5, 1, report, tmp_path)
    assert report["parts"]["doctor"]["status"] == "ok" and "## doctor" in (tmp_path / "gpu_feed.md").read_text()


def test_without_data_every_part_says_why(tmp_path):
    proc = subprocess.run([sys.executable, str(EXAMPLES / "gpu_feed.py"), "--out", str(tmp_path), "--count", "4",
                           "--size", "0x80", "--parts", "scaling,doctor"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 1, proc.stderr[-2000:]
    r = json.loads((tmp_path / "gpu_feed.json").read_text())
    assert "error" in r["data"] and set(r["parts"]) == {"scaling", "doctor"}
    assert all(p["status"] == "skipped" and p["reason"].startswith("no data: ") for p in r["parts"].values())
    assert "data: FAILED" in (tmp_path / "gpu_feed.md").read_text()


def test_scaling_without_bare_libjpeg_turbo_still_measures_the_loaders(photos, tmp_path):
    got = gpu_feed_cores.scaling(photos, tmp_path / "no-photos", tmp_path, [1, 2], 0.2, batch=4,
                                 loaders=("ThreadLoader",), bare=False, log=lambda _msg: None)
    assert "no bare libjpeg-turbo" in got["bare_one_thread"]["missing"]
    assert {(r["setting"], r["loader"], r["n"]) for r in got["rows"]} == {
        (s, "ThreadLoader", n) for s in ("full", "train224") for n in (1, 2)}
    assert all(r["images_per_s"] > 0 and "of_n_bare" not in r and r["of_linear"] > 0 for r in got["rows"])
    report = {"command": "c", "machine": {"cpu": "x", "cores": 2}, "parts": {"scaling": {"status": "ok", **got}},
              "requirements": {"torch_cuda": {"ok": False, "detail": "d"}, "nvidia_smi": {"ok": False, "detail": "e"}}}
    assert "no bare libjpeg-turbo" in gpu_feed.markdown(report) and "not shown" not in gpu_feed.markdown(report)
