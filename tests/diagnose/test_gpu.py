"""nvidia-smi's utilisation and memory, asked once and sampled beside a run, and what doctor and the profilers say
with them: against a stand-in nvidia-smi (a real executable first on PATH, tests/support/gpus.py), since this
machine has no GPU."""

from __future__ import annotations

import time

import pytest
from support._tiny import make_lmdb
from support.gpus import H100, fake_nvidia_smi

import packer
from packer.diagnose.doctor import diagnose, render
from packer.diagnose.doctor_rules import judge
from packer.diagnose.gpu import GpuSampler, query
from packer.diagnose.profile import LoopProfiler
from packer.diagnose.sweep import RandomCrop, sweep

NO_DRIVER = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
TWO = [{**H100, "utilization.gpu": [90, 100], "memory.used": [1000, 3000]},
       {**H100, "index": 1, "utilization.gpu": "[N/A]", "memory.used": 12}]


@pytest.fixture
def smi(tmp_path, monkeypatch):
    """Put a stand-in nvidia-smi for the given GPUs (or failure) first on PATH."""

    def install(gpus=None, fail=None, rounds=None):
        monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path / "bin", gpus, fail, rounds))

    return install


def test_query_lists_each_gpu_and_says_why_when_it_cannot(smi, tmp_path, monkeypatch):
    smi(TWO)
    q = query()
    assert q.error is None and [g.index for g in q.gpus] == [0, 1]
    assert q.gpus[0].name == "NVIDIA H100 80GB HBM3" and q.gpus[0].memory_total_mib == 81559
    assert q.gpus[0].utilization_pct == 90 and q.gpus[1].utilization_pct is None  # [N/A]: not reported
    smi(fail=NO_DRIVER)
    q = query()
    assert q.gpus == [] and q.error == f"nvidia-smi failed (exit 9): {NO_DRIVER}"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert "not on PATH" in (query().error or "")


def wait_for(samples: list, count: int) -> None:
    deadline = time.monotonic() + 60  # a bound against a hang, not a timing: the lines come within a second
    while len(samples) < count and time.monotonic() < deadline:
        time.sleep(0.02)


def wait_for_usage(sampler: GpuSampler) -> None:
    deadline = time.monotonic() + 60  # a bound against a hang, not a timing
    while not sampler.usage(since_mark=True) and time.monotonic() < deadline:
        time.sleep(0.02)


def test_sampler_gets_each_line_as_it_is_printed(smi):
    """The stand-in prints 3 rounds, then waits to be stopped; like a C program, into a pipe it would have kept
    them in its buffer, and lost them when stopped."""
    smi(TWO, rounds=3)
    with GpuSampler(interval_ms=50) as sampler:
        wait_for(sampler.samples, 6)
        assert len(sampler.samples) == 6  # before it was stopped
    assert len(sampler.samples) == 6 and sampler.error is None


def test_sampler_sums_up_per_gpu_and_after_the_mark(smi):
    smi(TWO)
    with GpuSampler(interval_ms=50) as sampler:
        wait_for(sampler.samples, 6)
        sampler.mark()
        before = len(sampler.samples)
        wait_for(sampler.samples, before + 4)
    first, second = sampler.usage()
    assert sampler.error is None and first.index == 0 and second.index == 1
    assert first.utilization_min == 90 and first.utilization_max == 100 and 90 < first.utilization_mean < 100
    assert first.memory_used_max_mib == 3000 and second.utilization_mean is None and second.memory_used_max_mib == 12
    steady = sampler.usage(since_mark=True)
    assert 0 < steady[0].samples < first.samples
    assert "GPU 0 (H) busy" in first.line(81559, "H") and "3,000 of 81,559 MiB used" in first.line(81559)
    assert "utilisation not reported" in second.line()


def test_sampler_says_why_it_has_no_samples(smi, tmp_path, monkeypatch):
    smi(fail=NO_DRIVER)
    with GpuSampler(interval_ms=50) as sampler:
        proc = sampler._proc
        assert proc is not None
        deadline = time.monotonic() + 60  # a bound against a hang, not a timing: until it has failed by itself
        while proc.poll() is None and time.monotonic() < deadline:  # (a sleep stopped it first under load)
            time.sleep(0.02)
    assert proc.returncode == 9 and sampler.samples == []
    assert sampler.error == f"nvidia-smi gave no samples: {NO_DRIVER}"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with GpuSampler() as sampler:
        pass
    assert sampler.usage() == [] and "not on PATH" in (sampler.error or "")


def test_doctor_reads_utilisation_and_memory_and_says_what_they_mean(smi):
    smi([{**H100, "utilization.gpu": [80, 100]}])
    r = diagnose(None, seconds=0.3, progress=False)
    s = r["gpu"]["smi"]
    assert s["error"] is None and s["gpus"][0]["name"] == H100["name"] and s["sampled_s"] == 0.3
    (u,) = s["usage"]
    assert u["samples"] >= 1 and 80 <= u["utilization_mean"] <= 100 and u["memory_used_max_mib"] == 40960
    text = render(r)
    assert "nvidia-smi: GPU 0 (NVIDIA H100 80GB HBM3) busy" in text and "40,960 of 81,559 MiB used" in text
    found = "\n".join(f["text"] for f in r["verdict"])
    if not r["gpu"]["available"]:  # torch here is a CPU build
        assert "nvidia-smi lists 1 GPU(s) (NVIDIA H100 80GB HBM3) but torch" in found
    assert "another job is on the GPU: GPU 0 (NVIDIA H100 80GB HBM3)" in found and "40,960 of 81,559 MiB" in found


def test_doctor_without_nvidia_smi_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    r = diagnose(None, seconds=0.1, progress=False)
    assert r["gpu"]["smi"]["gpus"] == [] and "not on PATH" in r["gpu"]["smi"]["error"]
    assert "nvidia-smi: nvidia-smi is not on PATH" in render(r)
    found = "\n".join(f["text"] for f in r["verdict"])
    assert "another job" not in found and "nvidia-smi lists" not in found


def _gpu_report(util: float, used: float, available: bool = True) -> dict:
    smi = {"gpus": [{"index": 0, "name": "NVIDIA H100", "utilization_pct": util, "memory_used_mib": used,
                     "memory_total_mib": 81559.0}], "error": None, "sampled_s": 1.0,
           "usage": [{"index": 0, "samples": 5, "utilization_mean": util, "utilization_min": util,
                      "utilization_median": util, "utilization_max": util, "memory_used_max_mib": used}]}
    return {"machine": {"cores_usable": 16, "cores": 16, "load_average": [0.1], "memory": {},
                        "shm": None, "open_files_limit": {"soft": 65536, "hard": 65536}},
            "gpu": {"available": available, "torch": "2.x", "cuda_build": "12.4" if available else None,
                    "devices": ["NVIDIA H100"] if available else [], "h2d_pinned_GBps": 24.0,
                    "h2d_pageable_GBps": 9.0, "smi": smi},
            "decode": {"libturbojpeg": True, "libturbojpeg_error": None, "per_core": {}}}


def test_gpu_rules_on_an_idle_and_a_shared_gpu():
    idle = "\n".join(f["text"] for f in judge(_gpu_report(0.0, 1.0)))
    assert "GPU present (NVIDIA H100, CUDA 12.4)" in idle and "GPU 0 0% busy, 1 of 81,559 MiB used" in idle
    assert "another job" not in idle and "nvidia-smi lists" not in idle
    shared = "\n".join(f["text"] for f in judge(_gpu_report(0.0, 30000.0)))
    assert "another job is on the GPU: GPU 0 (NVIDIA H100) 0% busy, 30,000 of 81,559 MiB used" in shared
    cpu_torch = "\n".join(f["text"] for f in judge(_gpu_report(0.0, 1.0, available=False)))
    assert "nvidia-smi lists 1 GPU(s) (NVIDIA H100) but torch 2.x cannot use them: it is a CPU-only build" in cpu_torch


@pytest.fixture(scope="module")
def lmdb_path(tmp_path_factory):
    return make_lmdb(tmp_path_factory.mktemp("gpu_profile"), count=16)


def test_profile_samples_the_gpu_over_the_steady_batches(smi, lmdb_path, monkeypatch):
    from packer.diagnose import profile as profile_mod

    made: list[GpuSampler] = []

    class Seen(GpuSampler):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(profile_mod, "GpuSampler", Seen)
    smi([{**H100, "utilization.gpu": 40}])
    prof = LoopProfiler(range(8), warmup=2, gpu=True, progress=False)
    for i in prof:
        if i == 7:  # the last of 6 steady steps lasts until nvidia-smi has printed during them (not a fixed time)
            wait_for_usage(made[0])
    (u,) = prof.gpu_usage
    assert prof.gpu_error is None and u.utilization_mean == 40 and u.samples >= 1
    report = prof.report()
    assert "during the steady batches: GPU 0 busy 40% on average" in report
    assert "GPU 0 was busy 40% of the time" in report and "the loader is not the limit" in report
    assert prof.to_dict()["gpu"]["usage"][0]["utilization_mean"] == 40
    assert prof.verdict().figures["gpu_utilization_mean"] == 40
    quiet = LoopProfiler(range(3), progress=False)  # no CUDA in use here: not sampled unless asked
    list(quiet)
    assert quiet.gpu_usage == [] and quiet.gpu_error is None and "GPU" not in quiet.report()


def test_profile_sweep_notes_what_nvidia_smi_saw(smi, lmdb_path):
    smi([{**H100, "utilization.gpu": 0, "memory.used": 500}])
    ds = packer.open_dataset(lmdb_path, image="tensor", transform=RandomCrop(16))
    res = sweep(ds, workers=(0,), batch_sizes=(4,), step_ms=100, batches=3, progress=False, gpu=True)
    assert any(n.startswith("nvidia-smi during the sweep") and "GPU 0 busy 0% on average" in n
               and "up to 500 MiB used" in n for n in res.notes), res.notes
