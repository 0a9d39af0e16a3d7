"""The loop profiler, per-stage instrumentation across workers, the verdict and the worker sweep."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from support._tiny import make_lmdb
from support.spawned import Fetch, batches_of, probe_for
from torch.utils.data import DataLoader

import packer
from packer.diagnose.instrument import StageTotals, clock_of, instrument
from packer.diagnose.plots import plot_sweep
from packer.diagnose.profile import LoopStats, batch_len, profile, verdict
from packer.diagnose.sweep import RandomCrop, SweepPoint, sweep, word_sweep
from packer.errors import PackerError
from packer.tools.sample import photo_like


@pytest.fixture(scope="module")
def lmdb_path(tmp_path_factory):
    return make_lmdb(tmp_path_factory.mktemp("profile"), count=24)


def tensor_ds(path):
    return packer.open_dataset(path, image="tensor", transform=RandomCrop(16))


def test_wait_plus_step_adds_up_and_samples_are_counted(lmdb_path):
    ds = tensor_ds(lmdb_path)
    loader = DataLoader(ds, batch_size=5, num_workers=0)
    prof = profile(loader, progress=False)
    for _x, _y in prof:
        time.sleep(0.002)
    st = prof.stats
    assert st.iterations == math.ceil(24 / 5) and sum(st.samples) == 24 and st.samples[-1] == 4
    assert sum(st.wait) + sum(st.step) + sum(st.h2d) == pytest.approx(st.total_s, rel=1e-6)
    assert all(s >= 0.002 for s in st.step)
    f_all, f_steady = st.figures(steady=False), st.figures(steady=True)
    assert f_all["samples"] == 24 and f_steady["samples"] == 24 - 5 and f_steady["iterations"] == st.iterations - 1
    assert 0 <= f_all["wait_fraction"] <= 1


def test_break_counts_only_complete_steps(lmdb_path):
    prof = profile(DataLoader(tensor_ds(lmdb_path), batch_size=2), progress=False)
    for i, _b in enumerate(prof):
        if i == 3:
            break
    assert prof.stats.iterations == 3 and sum(prof.stats.samples) == 6
    assert sum(prof.stats.wait) + sum(prof.stats.step) == pytest.approx(prof.stats.total_s, rel=1e-6)


def test_device_copy_is_timed_as_its_own_stage(lmdb_path):
    prof = profile(DataLoader(tensor_ds(lmdb_path), batch_size=6), device="cpu", progress=False)
    for x, _y in prof:
        assert x.device.type == "cpu"
    assert len(prof.stats.h2d) == 4 and all(h >= 0 for h in prof.stats.h2d)
    parts = sum(prof.stats.wait) + sum(prof.stats.step) + sum(prof.stats.h2d)
    assert parts == pytest.approx(prof.stats.total_s, rel=1e-6)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_stages_are_summed_across_workers(request, start_method):
    if start_method == "spawn":  # read by the session's spawned workers (_spawned_stages): the clock's rows only
        ds, batches = request.getfixturevalue("spawned").context, request.getfixturevalue("spawned").values()
        clock = clock_of(ds)
        assert clock is not None and len(batches) == 6
        totals = clock.totals()
    else:
        ds = instrument(tensor_ds(request.getfixturevalue("lmdb_path")))
        loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=ds.collate(),
                            multiprocessing_context=start_method)
        prof = profile(loader, progress=False)
        for _ in prof:
            pass
        totals = prof.stage_totals()
        assert totals is not None and totals.batches == prof.stats.iterations
        assert "per sample" in prof.summary()
    assert totals.samples == 24 and totals.batches == 6
    assert totals.processes == 2  # both workers wrote their rows; the main process did no loading
    assert set(totals.seconds) == {"read", "decode", "transform", "collate"}
    assert all(v > 0 for v in totals.per_sample_ms().values())
    assert isinstance(ds, packer.PackedDataset) and ds.classes == tensor_ds(ds.root).classes  # the dataset itself


@probe_for(test_stages_are_summed_across_workers)
def _spawned_stages(tmp_path_factory):
    """Batches of 4 of an instrumented dataset, collated by its timed collate, in the spawned workers: they write
    their rows of the clock the parent reads. Context: the dataset."""
    ds = instrument(tensor_ds(make_lmdb(tmp_path_factory.mktemp("profile"), count=24)))
    return Fetch(ds, batches_of(len(ds), 4), ds.collate()), ds


def test_uninstrumented_dataset_is_one_stage():
    ds = instrument([(torch.zeros(2), 0)] * 10)
    for _ in DataLoader(ds, batch_size=5, collate_fn=ds.collate()):
        pass
    t = clock_of(ds).totals()
    assert set(t.seconds) == {"getitem", "collate"} and t.samples == 10 and t.batches == 2 and t.processes == 1


def _stats(wait_ms, step_ms, n=10, batch=8):
    return LoopStats(wait=[wait_ms / 1000] * n, step=[step_ms / 1000] * n, h2d=[0.0] * n, samples=[batch] * n,
                     total_s=n * (wait_ms + step_ms) / 1000)


def test_verdict_compute_bound():
    v = verdict(_stats(wait_ms=2, step_ms=40))
    assert v.bound == "compute" and v.limit is None and "compute-bound" in str(v) and "2.0 ms" in str(v)


def test_an_input_bound_loader_gets_advice_it_can_follow(lmdb_path):
    """Without packer.instrument, an input-bound verdict says how to see the stages, for a ThreadLoader as for a
    DataLoader (a ThreadLoader has no collate_fn to time)."""
    ds = packer.open_dataset(lmdb_path, image="tensor")
    for loader, advice in ((packer.ThreadLoader(ds, batch_size=4), "instrument(dataset) to see which stage"),
                           (DataLoader(ds, batch_size=4, collate_fn=packer.collate),
                            "instrument(dataset) (and collate_fn=ds.collate())")):
        wrapped = profile(packer.BackgroundLoader(loader), progress=False)
        list(wrapped)
        wrapped.stats = _stats(wait_ms=30, step_ms=10)
        assert advice in str(wrapped.verdict())


def test_instrument_times_a_threadloader(lmdb_path):
    """packer.instrument attaches a clock to the dataset's pipeline: a ThreadLoader's decode threads are timed per
    stage (read, decode, transform), every sample counted once, and the verdict names the stage."""
    ds = instrument(packer.open_dataset(lmdb_path, image="tensor", transform=RandomCrop(16)))
    prof = profile(packer.ThreadLoader(ds, batch_size=4, num_threads=2), progress=False)
    for _ in prof:
        pass
    totals = prof.stage_totals()
    assert totals is not None and totals.samples == 24 and totals.processes == 1
    assert {"read", "decode", "transform"} <= set(totals.seconds) and "getitem" not in totals.seconds
    prof.stats = _stats(wait_ms=30, step_ms=10)
    assert "per sample (ms): read" in str(prof.verdict())


def test_verdict_input_bound_names_the_stage_and_workers():
    stages = StageTotals(seconds={"read": 0.1, "decode": 0.8, "transform": 0.05, "collate": 0.05},
                         samples=100, batches=12, processes=1)
    v = verdict(_stats(wait_ms=30, step_ms=40), stages, workers=1, cores=2)
    assert v.bound == "input" and v.limit == "decode"
    text = str(v)
    assert "decode 8.00" in text and "decoding is the limit" in text and "num_workers=1" in text
    # 10 ms per sample, 8 per batch, 40 ms step -> 2 busy workers
    assert v.figures["workers_needed"] == 2


def test_verdict_names_the_datasets_own_way_to_decode_less(lmdb_path, tmp_path, jpegregion):
    """Decode-bound: a packed dataset without a fused crop is told of it, one with a RandomResizedCrop but without
    --jpeg-restarts of that option; one converted with it, or a plain torch dataset, gets the general advice only."""
    stages = StageTotals(seconds={"read": 0.1, "decode": 0.8, "transform": 0.05, "collate": 0.05},
                         samples=100, batches=12, processes=1)
    crop = packer.RandomResizedCropDecode(16, seed=0)
    rewritten = packer.convert(packer.open_dataset(lmdb_path).root, tmp_path / "rst.lmdb", to="lmdb",
                               jpeg_restarts=True, progress=False, workers=0).output
    pngs = tmp_path / "pngs" / "a"
    pngs.mkdir(parents=True)
    for k in range(3):
        photo_like(np.random.default_rng(k), 20, 30).save(pngs / f"{k}.png")
    png_ds = packer.convert(pngs.parent, tmp_path / "png.lmdb", to="lmdb", progress=False, workers=0).output
    said = {}
    for name, ds in {"plain": packer.open_dataset(lmdb_path), "crop": packer.open_dataset(lmdb_path, crop=crop),
                     "center": packer.open_dataset(lmdb_path, crop=packer.CenterCropDecode(16, resize=20)),
                     "whole": packer.open_dataset(lmdb_path, crop=packer.RandomResizedCropDecode(16, region=False)),
                     "rewritten": packer.open_dataset(rewritten, crop=crop),
                     "pil": packer.open_dataset(lmdb_path, crop=crop, decoder="pil"),
                     "png": packer.open_dataset(png_ds, crop=crop), "png, no crop": packer.open_dataset(png_ds),
                     "torch": list(range(4))}.items():
        said[name] = str(verdict(_stats(wait_ms=30, step_ms=40), stages, workers=1, cores=2, dataset=ds))
    assert "crop=packer.RandomResizedCropDecode(224)" in said["plain"]
    assert "converted without --jpeg-restarts" in said["crop"] and "converted without --jpeg-restarts" in said["center"]
    assert "region=True" in said["whole"]
    assert all("for this dataset" not in said[k] for k in ("rewritten", "pil", "png", "png, no crop", "torch"))
    fed = str(verdict(_stats(wait_ms=2, step_ms=40), stages, dataset=packer.open_dataset(lmdb_path, crop=crop)))
    assert "for this dataset" not in fed


def test_batch_len():
    assert batch_len([torch.zeros(7, 3), torch.zeros(7)]) == 7
    assert batch_len({"x": torch.zeros(5, 1)}) == 5
    assert batch_len([(1, 2), (3, 4), (5, 6)]) == 3


def test_sweep_measures_each_setting_and_its_verdict_follows_the_measurement(lmdb_path):
    # Real DataLoaders; whether a setting is fed depends on the machine's load (CI runs tests in parallel), so this
    # checks the measurement and that the verdict is the rule applied to it; the rule itself is tested below.
    res = sweep(tensor_ds(lmdb_path), workers=(0, 1, 2), batch_sizes=(4,), step_ms=50, batches=6, progress=False)
    assert [p.workers for p in res.points] == [0, 1, 2]
    for p in res.points:
        assert p.iterations == 6 and p.fed == (p.wait_ms < 0.10 * p.measured_step_ms)
        assert p.measured_step_ms >= 50 and p.samples_per_s > 0
        assert {"read", "decode", "transform", "collate"} <= set(p.per_sample_ms)
    fed = [p.workers for p in res.points if p.fed]
    assert res.feasible == bool(fed)
    if fed:
        assert res.chosen is not None and res.chosen.workers == min(fed) and res.chosen.wait_over_step < 0.10
        assert f"num_workers={res.chosen.workers}" in res.report()
    else:
        assert res.chosen is None and "NOT FEASIBLE" in res.report()
    assert res.predicted_workers is not None
    d = res.to_dict()
    assert d["points"][0]["workers"] == 0 and d["points"][0]["fed"] == res.points[0].fed


def _point(workers: int, wait_ms: float, step_ms: float = 50.0, batch_size: int = 4) -> SweepPoint:
    return SweepPoint(workers=workers, batch_size=batch_size, pin_memory=False, step_ms=step_ms, iterations=6,
                      warmup=2, wait_ms=wait_ms, measured_step_ms=step_ms, h2d_ms=0.0,
                      wait_over_step=wait_ms / step_ms, samples_per_s=1000 * batch_size / (step_ms + wait_ms),
                      first_batch_s=0.1, per_sample_ms={"read": 0.5, "decode": 3.0, "transform": 0.2, "collate": 0.1})


def test_the_verdict_picks_the_smallest_worker_count_whose_wait_is_under_a_tenth_of_the_step():
    res = word_sweep("ds", [_point(0, 30.0), _point(1, 6.0), _point(2, 4.0), _point(4, 0.5)], 50, cores=4)
    assert [p.fed for p in res.points] == [False, False, True, True]  # 6 ms of 50 is 12 %: not fed
    assert res.feasible and res.chosen is not None and res.chosen.workers == 2
    assert "num_workers=2" in res.report() and res.to_dict()["chosen"]["fed"]
    starved = word_sweep("ds", [_point(0, 30.0), _point(1, 20.0)], 50, cores=4)
    assert not starved.feasible and starved.chosen is None and "NOT FEASIBLE" in starved.report()
    assert "num_workers=1" in starved.report()  # the best tested setting, named


def test_sweep_says_plainly_when_no_setting_is_fed(lmdb_path):
    res = sweep(tensor_ds(lmdb_path), workers=(0, 1), batch_sizes=(8,), step_ms=0.01, batches=4, progress=False)
    assert not res.feasible and res.chosen is None
    assert "NOT FEASIBLE" in res.report()


def test_sweep_rejects_bad_arguments(lmdb_path):
    with pytest.raises(PackerError):
        sweep(tensor_ds(lmdb_path), workers=(-1,), progress=False)
    with pytest.raises(PackerError):
        sweep(tensor_ds(lmdb_path), batches=1, progress=False)


def test_plot_or_clear_message(lmdb_path, tmp_path):
    res = sweep(tensor_ds(lmdb_path), workers=(0, 1), batch_sizes=(8,), step_ms=5, batches=3, progress=False)
    out = tmp_path / "sweep.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(PackerError, match="matplotlib"):
            plot_sweep(res, out)
        return
    plot_sweep(res, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_cli_json_and_exit_code(lmdb_path, capsys):
    import json

    from packer.cli import main

    rc = main(["profile", str(lmdb_path), "--workers", "0,1", "--batch-size", "4", "--step-ms", "30",
               "--batches", "3", "--crop", "16", "--json", "-", "-q"])
    d = json.loads(capsys.readouterr().out)
    assert rc == (0 if d["feasible"] else 1)
    assert [p["workers"] for p in d["points"]] == [0, 1] and d["points"][0]["batch_size"] == 4
    rc = main(["profile", str(lmdb_path), "--workers", "0", "--batch-size", "4", "--step-ms", "0.01",
               "--batches", "2", "--crop", "0", "-q"])
    out = capsys.readouterr().out
    assert rc == 1 and "NOT FEASIBLE" in out  # list-collated samples (no crop) work too


def test_profile_cli_rejects_bad_lists(lmdb_path, capsys):
    from packer.cli import main

    with pytest.raises(SystemExit) as e:
        main(["profile", str(lmdb_path), "--workers", "two"])
    assert e.value.code == 2
    assert main(["profile", str(lmdb_path), "--pin-memory", "maybe", "-q"]) == 2
    assert "pin-memory" in capsys.readouterr().err


@pytest.mark.parametrize("cache", ["ram", "ram-decoded"])
def test_instrumented_cached_dataset_in_workers_gives_what_the_dataset_gives(imagefolder, tmp_path, cache):
    """Mixed sizes, image="tensor", no transform, a worker: the batch-slot path, through the cache's own
    reading (it used to reach the uncached dataset through blanket forwarding and crash)."""
    out = packer.convert(imagefolder, tmp_path / "m.lmdb", workers=0, progress=False).output
    plain = packer.open_dataset(out, image="tensor")
    ds = packer.open_dataset(out, image="tensor", cache=cache, cache_options={"progress": False})
    inst = instrument(ds)
    loader = DataLoader(inst, batch_size=4, num_workers=1, collate_fn=list)
    got = [item for batch in loader for item in batch]
    assert len(got) == len(plain)
    for i, (img, label) in enumerate(got):
        ref, ref_label = plain[i]
        assert label == ref_label and torch.equal(img, ref)
    totals = clock_of(inst).totals()
    assert totals.samples == len(plain) and "read" in totals.seconds and "getitem" not in totals.seconds
    ds.close()


def test_instrumented_cached_dataset_reads_nothing_ahead_from_disk(imagefolder, tmp_path):
    """The profile of a RAM-cached dataset times the cache: once it is filled, no disk read-ahead is planned."""
    import subprocess
    import sys

    out = packer.convert(imagefolder, tmp_path / "r.lmdb", workers=0, progress=False).output
    code = (
        "import sys, packer\n"
        "from packer.diagnose.sweep import RandomCrop\n"
        "ds = packer.open_dataset(sys.argv[1], image='tensor', transform=RandomCrop(8), cache='ram',\n"
        "                         cache_options={'progress': False})\n"
        "from packer.read import readahead\n"
        "planned = []\n"
        "start = readahead.start\n"
        "readahead.start = lambda requests, **kw: (planned.append(len(requests)), start(requests, **kw))[1]\n"
        "inst = packer.instrument(ds)\n"
        "for k in range(0, len(inst), 4):\n"
        "    inst.__getitems__(list(range(k, min(k + 4, len(inst)))))\n"
        "ds.close()\n"
        "print(f'READ-AHEAD {planned}' if planned else 'NONE')\n"
    )
    res = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=120)
    assert res.stdout.strip().splitlines()[-1] == "NONE", res.stdout + res.stderr


def test_profile_cli_runs_the_fused_train_crop(lmdb_path, capsys):
    import json

    from packer.cli import main

    rc = main(["profile", str(lmdb_path), "--workers", "0", "--batch-size", "4", "--step-ms", "1",
               "--batches", "2", "--crop", "16", "--train-crop", "--json", "-", "-q"])
    d = json.loads(capsys.readouterr().out)
    assert rc in (0, 1) and d["points"][0]["samples_per_s"] > 0
    assert d["points"][0]["per_sample_ms"]["decode"] > 0  # the crop is part of decoding, no transform stage


def test_profile_of_a_url_runs_its_dataloaders_through_the_node_cache(lmdb_path, tmp_path, monkeypatch, capsys):
    import json

    from support.storage_servers import served_as_a_user

    from packer.cli import main

    server = served_as_a_user(lmdb_path, tmp_path / "root", monkeypatch, "ds.lmdb")
    try:
        rc = main(["profile", "s3://bucket/ds.lmdb", "--cache-dir", str(tmp_path / "cache"), "--workers", "0,1",
                   "--batch-size", "4", "--step-ms", "1", "--batches", "2", "--crop", "16", "--json", "-", "-q"])
        served = server.server.stats.settled()
    finally:
        server.stop()
    d = json.loads(capsys.readouterr().out)
    assert rc in (0, 1) and [p["workers"] for p in d["points"]] == [0, 1]
    assert all(p["samples_per_s"] > 0 for p in d["points"])
    assert served["body_bytes"] > 0 and served["gets"] > 0  # read from the store, not a local path named s3:
