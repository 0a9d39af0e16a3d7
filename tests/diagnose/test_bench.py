"""packer bench, measure and throttle: real passes on a tiny set, real eviction, real kernel throttle where possible.

No timing thresholds: only structure, counts, bytes, eviction and clean-up are checked.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from packer.cli import main
from packer.diagnose import measure, system, throttle
from packer.diagnose.bench import BenchOptions, make_order, run_bench
from packer.diagnose.reports import bench_table, ceiling_summary
from packer.errors import PackerError

REPO = Path(__file__).resolve().parents[2]


def _make_folder(root: Path, per_class: int = 5) -> Path:
    rng = np.random.default_rng(1)
    for c in ("cat", "dog"):
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            h, w = 40 + 4 * i, 56 - 2 * i
            base = np.linspace(0, 255, w, dtype=np.float32)[None, :, None] * np.ones((h, 1, 3), np.float32)
            img = np.clip(base + rng.normal(0, 30, (h, w, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(img).save(root / c / f"{i:03d}.jpg", quality=90)
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from packer.write.convert import convert

    base = tmp_path_factory.mktemp("bench")
    folder = _make_folder(base / "imgs")
    convert(folder, base / "imgs.lmdb", to="lmdb", workers=1, progress=False)
    return folder, base / "imgs.lmdb"


def _can_evict(path: Path) -> bool:
    st = system.describe_storage(path)
    return st["fstype"] not in ("tmpfs", "ramfs", None) and measure.resident_pages(path) is not None


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.jpg"))


def _check_report(report: dict, folder: Path, n: int) -> None:
    json.dumps(report)  # every figure is JSON-able
    for key in ("machine", "storage", "options", "datasets", "ceilings", "results"):
        assert key in report
    assert report["machine"]["cores_usable"] >= 1 and report["machine"]["versions"]["packer"]
    assert report["ceilings"]["memory_copy"]["value"] > 0
    assert all(v["value"] > 0 for v in report["ceilings"]["sequential_read"].values())
    for r in report["results"]:
        assert r["samples"] == n, r
        assert len(r["seconds"]) == report["options"]["repeats"]
        s = r["samples_per_s"]
        assert s["min"] <= s["median"] <= s["max"]
        assert r["fraction_of_ceiling"] == pytest.approx(s["median"] / r["ceiling"]["samples_per_s"])
        if r["level"] == "read":
            assert r["bytes"] == _folder_bytes(folder)  # encoded payloads: the source files' bytes exactly
        if r["kind"] == "folder":
            assert r["speedup_vs_folder"] == pytest.approx(1.0)
        else:
            assert r["speedup_vs_folder"] > 0
        if r["cache"] == "cold" and _can_evict(folder):
            assert r["eviction"] == "verified", r
            assert all(f == 0 for f in r["resident_before"])


def test_read_and_decode_levels_json_consistent(data):
    folder, packed = data
    opts = BenchOptions(levels=("read", "decode"), repeats=2, ceiling_bytes=4 << 20, ceiling_seconds=0.2, batch_size=4,
                        block_bytes=40_000)
    report = run_bench([folder, packed], opts)
    _check_report(report, folder, 10)
    combos = {(r["kind"], r["level"], r["order"], r["cache"]) for r in report["results"]}
    assert len(combos) == 2 * 2 * 3 * 2  # kinds x levels x orders x caches
    assert {d["samples"] for d in report["datasets"]} == {10}
    assert "imgs.lmdb" in bench_table(report)


def test_stderr_ends_with_the_ceilings_the_table_uses(data):
    """The CPU ceilings are measured before and after the passes and the higher kept: the last ceiling line on
    stderr gives the values the table's header gives, not the first measurement's."""
    folder, packed = data
    said: list[str] = []
    report = run_bench([folder, packed], BenchOptions(levels=("read",), orders=("sequential",), caches=("warm",),
                                                      repeats=1, ceiling_bytes=4 << 20, ceiling_seconds=0.2),
                       log=said.append)
    header = next(line for line in bench_table(report).splitlines() if line.startswith("  ceilings"))
    final = [line for line in said if line.startswith("ceiling")][-1]
    assert final.split(": ", 1)[1] == header.split(": ", 1)[1] == ceiling_summary(report["ceilings"])
    assert header.startswith("  ceilings (the higher of before and after the passes): ")
    assert [f"memory copy {v:,.0f} MB/s" in final for v in report["ceilings"]["memory_copy"]["runs"]].count(True) >= 1


def test_the_ceilings_are_sized_to_the_data_benched(data):
    """A bench of 10 photos (a few hundred KB) reads a 32 MiB scratch file for its cold-read ceiling, not 256 MiB,
    and times its decoders on 3 passes over its photos, not for 1 s each; the JSON records the sizes used."""
    folder, packed = data
    report = run_bench([folder, packed], BenchOptions(levels=("read",), orders=("sequential",), caches=("warm",),
                                                      repeats=1))
    assert (report["options"]["ceiling_bytes"], report["options"]["ceiling_seconds"]) == (32 << 20, 0.0)
    assert [r["detail"].split(" file ")[0] for r in report["ceilings"]["sequential_read"].values()] == ["34 MB"]
    assert report["ceilings"]["decode"]
    for rate in report["ceilings"]["decode"].values():  # measured before and after the passes: each 3 passes
        assert [t["items"] for t in rate["timings"]] == [10, 10, 10], rate


def test_the_ceilings_grow_with_the_data_up_to_their_caps_and_given_sizes_are_kept(data):
    from dataclasses import replace

    from packer.diagnose.bench import ceiling_sizes
    from packer.diagnose.bench_sources import open_source

    folder, packed = data
    src = [open_source(folder, None), open_source(packed, None)]
    assert ceiling_sizes(src, BenchOptions()) == (32 << 20, 0.0)
    mid = replace(src[1], disk_bytes=100 << 20, nbytes=np.ones(49, np.int64))  # one image more than the samples
    assert ceiling_sizes([src[0], mid], BenchOptions()) == (100 << 20, 1.0)
    big = replace(src[1], disk_bytes=1 << 40)
    assert ceiling_sizes([src[0], big], BenchOptions()) == (256 << 20, 0.0)
    assert ceiling_sizes([src[0], big], BenchOptions(ceiling_bytes=4 << 20, ceiling_seconds=0.2)) == (4 << 20, 0.2)


def test_in_process_passes_record_their_threads_time_on_and_waiting_for_a_cpu(data):
    """Read and decode passes record the passing thread's time on a CPU and waiting for one (the scheduler's
    count), from which the summary tells a busy CPU from a slow disk; loader levels run elsewhere and record none."""
    folder, packed = data
    if measure.thread_cpu() is None:
        pytest.skip("no /proc/thread-self/schedstat here")
    report = run_bench([folder, packed], BenchOptions(levels=("decode", "loader"), orders=("sequential",),
                                                      caches=("warm",), workers=(0,), repeats=2,
                                                      ceiling_bytes=4 << 20, ceiling_seconds=0.2))
    for r in report["results"]:
        if r["level"] == "decode":
            assert len(r["thread_cpu_seconds"]) == 2
            for c, s in zip(r["thread_cpu_seconds"], r["seconds"], strict=True):  # the scheduler counts in ticks
                assert c["on_cpu"] >= 0 and c["waiting_for_cpu"] >= 0 and c["on_cpu"] + c["waiting_for_cpu"] < s + 0.05
        else:
            assert "thread_cpu_seconds" not in r


def test_thread_cpu_counts_this_threads_work():
    before = measure.thread_cpu()
    if before is None:
        pytest.skip("no /proc/thread-self/schedstat here")
    start = time.thread_time()
    while time.thread_time() - start < 0.05:  # 50 ms of this thread's own CPU time, however busy the machine is
        sum(range(1000))
    after = measure.thread_cpu()
    assert after is not None and after[0] - before[0] >= 0.04 and after[1] >= before[1]


def test_loader_level_with_workers(data):
    folder, packed = data
    opts = BenchOptions(levels=("loader",), orders=("block",), caches=("cold",), workers=(0, 2), repeats=1,
                        ceiling_bytes=4 << 20, ceiling_seconds=0.2, batch_size=3)
    report = run_bench([folder, packed], opts)
    _check_report(report, folder, 10)
    assert sorted((r["kind"], r["workers"]) for r in report["results"]) == [
        ("folder", 0), ("folder", 2), ("lmdb", 0), ("lmdb", 2)]
    assert all(r["ceiling"]["samples_per_s"] > 0 for r in report["results"])


def test_a_loader_setting_starts_workers_only_for_its_timed_passes(data, monkeypatch):
    """The warm-up of a head of the order runs in this process: every timed pass starts its workers afresh anyway
    (the README's cold bench of 2 datasets x 3 orders started 24 pairs of workers for 18 timed passes)."""
    from packer.diagnose import bench

    started = []
    real = bench.DataLoader

    def spy(*args, **kwargs):
        started.append(kwargs["num_workers"])
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "DataLoader", spy)
    folder, packed = data
    opts = BenchOptions(levels=("loader",), orders=("block",), caches=("cold", "warm"), workers=(2,), repeats=2,
                        ceiling_bytes=4 << 20, ceiling_seconds=0.2, batch_size=3)
    rows = run_bench([folder, packed], opts)["results"]
    assert len(rows) == 4 and all(r["samples"] == 10 and len(r["seconds"]) == 2 for r in rows)
    assert started.count(2) == 4 * 2  # workers started once per timed pass
    assert started.count(0) == 4  # the warm-ups (cold: a head; warm after its cold: one batch), in this process
    opts = BenchOptions(levels=("loader",), orders=("block",), caches=("warm",), workers=(2,), repeats=1,
                        ceiling_bytes=4 << 20, ceiling_seconds=0.2, batch_size=3)
    started.clear()
    run_bench([packed], opts)
    assert started == [2, 2]  # a warm setting's warm-up is a whole pass (it fills the page cache): with workers


@pytest.mark.parametrize("level", ["thread", "thread-train"])
def test_thread_levels_run_the_packed_dataset_through_a_thread_loader(data, monkeypatch, level):
    from packer.read import threaded

    made = []
    real = threaded.ThreadLoader.__init__

    def spy(self, dataset, *args, **kwargs):
        made.append((kwargs["num_threads"], dataset.crop is not None))
        real(self, dataset, *args, **kwargs)

    monkeypatch.setattr(threaded.ThreadLoader, "__init__", spy)
    folder, packed = data
    opts = BenchOptions(levels=(level,), orders=("block",), caches=("warm",), workers=(2,), repeats=1,
                        ceiling_bytes=4 << 20, ceiling_seconds=0.2, batch_size=3)
    rows = run_bench([folder, packed], opts)["results"]
    assert sorted((r["kind"], r["level"]) for r in rows) == [("folder", level), ("lmdb", level)]
    # the packed rows only; the fused crop for thread-train
    assert all(r["samples"] == 10 for r in rows) and made and set(made) == {(2, level == "thread-train")}


@pytest.mark.parametrize("level", ["read", "decode", "thread", "thread-train"])
def test_a_packed_dataset_is_opened_once_per_setting_not_in_each_timed_pass(data, monkeypatch, level):
    # Timed passes reuse the dataset the warm-up opened (a cold pass closes its files only): a cold open in
    # each pass had cost ~8 small reads under --emulate hdd (7-9 % of a pass) and its result was thrown away.
    # A warm setting right after its cold one has no warm-up: it takes that setting's dataset (else its first
    # timed pass opened one, the manifest and index evicted by the cold setting's last pass).
    from packer.diagnose import bench_sources

    opened = []
    real = bench_sources.Source.open

    def counting(self, *args, **kwargs):
        opened.append(self.kind)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(bench_sources.Source, "open", counting)
    folder, packed = data
    for caches, opens in ((("cold", "warm"), 1), (("warm",), 1), (("cold",), 1)):
        opened.clear()
        opts = BenchOptions(levels=(level,), orders=("block", "sequential"), caches=caches, workers=(2,), repeats=3,
                            ceiling_bytes=4 << 20, ceiling_seconds=0.2, batch_size=3)
        rows = run_bench([packed], opts)["results"]
        assert len(rows) == 2 * len(caches) and all(len(r["seconds"]) == 3 and r["samples"] == 10 for r in rows)
        assert opened == ["lmdb"] * opens * 2, (caches, opened)  # per order: one open, in the first warm-up


def test_train_level_gives_crop_batches_for_folder_and_packed(data):
    folder, packed = data
    opts = BenchOptions(levels=("train",), orders=("shuffle",), caches=("warm",), workers=(2,), repeats=1,
                        ceiling_bytes=4 << 20, ceiling_seconds=0.2, batch_size=3)
    report = run_bench([folder, packed], opts)
    rows = report["results"]
    assert sorted((r["kind"], r["level"], r["workers"]) for r in rows) == [("folder", "train", 2), ("lmdb", "train", 2)]
    assert all(r["samples"] == 10 and r["samples_per_s"]["median"] > 0 for r in rows)
    assert rows[1]["speedup_vs_folder"] is not None


def test_limit_counts_only_the_first_samples(data):
    folder, packed = data
    report = run_bench([folder, packed], BenchOptions(levels=("read",), orders=("shuffle",), caches=("warm",),
                                                      repeats=1, limit=4, ceiling_bytes=4 << 20, ceiling_seconds=0.2))
    first4 = sorted(folder.rglob("*.jpg"))[:4]
    from packer import open_dataset

    ds = open_dataset(packed)
    packed4 = int(ds.index.nbytes[:4].sum())  # the first 4 in the dataset's own (shuffled) order
    for r in report["results"]:
        assert r["samples"] == 4
        assert r["bytes"] == (sum(p.stat().st_size for p in first4) if r["kind"] == "folder" else packed4)


def test_eviction_verified_on_a_file_just_read(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(os.urandom(1 << 20))
    if not _can_evict(path):
        pytest.skip("mincore/fadvise eviction not possible on this filesystem")
    measure.read_file(path)
    before = measure.residency([path])
    assert before.verified and before.fraction > 0.9
    after = measure.evict([path])
    assert after.verified and after.fraction == 0
    measure.read_file(path)
    assert measure.residency([path]).fraction > 0.9


def test_mapped_pages_stay_and_are_reported(tmp_path):
    import mmap

    path = tmp_path / "mapped.bin"
    path.write_bytes(os.urandom(1 << 20))
    if not _can_evict(path):
        pytest.skip("mincore/fadvise eviction not possible on this filesystem")
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as mm:
        sum(mm[i] for i in range(0, len(mm), 4096))  # fault every page in through the mapping
        res = measure.evict([path])
        assert res.verified and res.fraction > 0.5  # mapped pages can't be dropped: the check must say so


def test_orders_are_permutations_in_batches():
    nbytes = np.full(1000, 100_000)
    blk = make_order("block", nbytes, 0, block_bytes=1_000_000, open_blocks=2, batch_size=64, run=4)
    assert sorted(blk.indices.tolist()) == list(range(1000)) and blk.indices.tolist() != list(range(1000))
    assert np.concatenate(blk.chunks).tolist() == blk.indices.tolist()
    assert [len(c) for c in blk.chunks] == [64] * 15 + [40]
    # locality: a batch touches few blocks of 10 samples (windows of 2 blocks, batch-aligned)
    assert np.mean([len({i // 10 for i in c}) for c in blk.chunks]) < 16
    shuf = make_order("shuffle", nbytes, 0, batch_size=64)
    assert sorted(shuf.indices.tolist()) == list(range(1000))
    assert make_order("sequential", nbytes, 0).indices.tolist() == list(range(1000))
    with pytest.raises(PackerError):
        make_order("zigzag", nbytes, 0)


def test_cli_writes_json_and_plot(data, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    folder, packed = data
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    rc = main(["bench", str(folder), str(packed), "--levels", "read", "--orders", "sequential,block", "--repeats", "1",
               "--limit", "6", "--ceiling-size", "4MB", "--json", str(out), "--plot", str(png), "-q"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert len(report["results"]) == 2 * 2 * 2 and all(r["samples"] == 6 for r in report["results"])
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "x folder" in capsys.readouterr().out


def test_cli_plot_without_matplotlib_refuses_before_measuring(data, monkeypatch, capsys):
    folder, _ = data
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["bench", str(folder), "--plot", "x.png", "-q"]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


def test_bad_options_are_usage_errors(data, capsys):
    folder, _ = data
    assert main(["bench", str(folder), "--levels", "fly", "-q"]) == 2
    assert "unknown or no level" in capsys.readouterr().err
    assert main(["bench", str(folder / "nope"), "-q"]) == 2


# ------------------------------------------------------------------ emulation refused where impossible


def test_refuses_without_controller(tmp_path):
    with pytest.raises(throttle.ThrottleUnavailable, match="no block-IO cgroup controller"):
        throttle.find_controller(tmp_path / "v1", [tmp_path / "v2"])


def test_refuses_when_not_root(monkeypatch, tmp_path):
    fake = tmp_path / "blkio"
    fake.mkdir()
    (fake / "blkio.throttle.read_iops_device").write_text("")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(throttle.ThrottleUnavailable, match="needs root"):
        throttle.find_controller(fake, [])


def test_refuses_off_linux(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(throttle.ThrottleUnavailable, match="needs Linux"):
        throttle.find_controller()


def test_refuses_without_block_device():
    if not Path("/dev/shm").is_dir() or system.describe_storage("/dev/shm")["fstype"] != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    with pytest.raises(throttle.ThrottleUnavailable, match="not on a block device"):
        throttle.devices_of(["/dev/shm"])


def test_cli_emulation_refused_exits_2(data, monkeypatch, tmp_path, capsys):
    folder, _ = data
    monkeypatch.setattr(throttle, "V1_ROOT", tmp_path / "none")
    monkeypatch.setattr(throttle, "V2_ROOTS", (tmp_path / "none2",))
    assert main(["bench", str(folder), "--emulate", "hdd", "--levels", "read", "-q"]) == 2
    assert "no block-IO cgroup controller" in capsys.readouterr().err


def test_presets_documented():
    """Each preset has a row in docs/bench.md's table with the IOPS and MB/s the code uses."""
    table = (REPO / "docs" / "bench.md").read_text(encoding="utf-8")
    for name, p in throttle.PRESETS.items():
        assert p.read_iops > 0 and p.read_bps > 0 and p.source
        row = re.search(rf"^\| `{name}` +\| (\d+) +\| (\d+) +\|", table, re.M)
        assert row and (int(row[1]), int(row[2]) * 1_000_000) == (p.read_iops, p.read_bps), name
    assert throttle.resolve_limits("hdd", None, 99)[:2] == (150, 99)
    with pytest.raises(PackerError):
        throttle.resolve_limits("floppy", None, None)


# ------------------------------------------------------------------ the real kernel throttle (root + cgroups)


def _throttle_possible(path) -> bool:
    try:
        throttle.find_controller()
        throttle.devices_of([path])
        return True
    except throttle.ThrottleUnavailable:
        return False


needs_throttle = pytest.mark.skipif(not _throttle_possible(Path(__file__).parent),
                                    reason="kernel block-IO throttle unavailable")


def _own_cgroup_line() -> str:
    return Path("/proc/self/cgroup").read_text()


def _still_throttled(proc: subprocess.Popen) -> bool:
    """Whether ``proc`` (a live run started by ``_start_child``) still sits in its own cgroup."""
    cg = throttle.find_controller().root / f"{throttle.CGROUP_PREFIX}{proc.pid}"
    return proc.poll() is None and str(proc.pid) in (cg / "cgroup.procs").read_text().split()


@pytest.fixture
def other_run(tmp_path):
    """Another packer benchmark throttling its reads meanwhile (e.g. another user's): these tests only
    check and remove the cgroups they created, and the other run keeps its own."""
    proc = _start_child(tmp_path)
    yield proc
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)


@needs_throttle
def test_throttle_applies_and_is_removed(tmp_path, other_run):
    ctl = throttle.find_controller()
    blob = tmp_path / "blob.bin"
    blob.write_bytes(os.urandom(2 << 20))
    with throttle.throttled([tmp_path], read_iops=5000, read_bps=500_000_000) as thr:
        assert thr.cgroup.is_dir() and str(os.getpid()) in (thr.cgroup / "cgroup.procs").read_text().split()
        limits = (thr.cgroup / ("blkio.throttle.read_iops_device" if ctl.version == 1 else "io.max")).read_text()
        assert any(f"{a}:{b}" in limits for a, b, _ in thr.devices)
        measure.evict([blob])
        before = thr.read_counters()
        measure.read_file(blob)
        after = thr.read_counters()
        assert after[0] > before[0] and after[1] - before[1] >= (1 << 20)  # the reads went through our cgroup
    assert not thr.cgroup.exists() and not thr.active
    assert throttle.CGROUP_PREFIX not in _own_cgroup_line()
    assert _still_throttled(other_run)


@needs_throttle
def test_throttle_removed_after_exception_and_ctrl_c(tmp_path):
    for exc in (RuntimeError, KeyboardInterrupt):
        with pytest.raises(exc):
            with throttle.throttled([tmp_path], read_iops=1000) as thr:
                if exc is KeyboardInterrupt:
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(1)
                raise exc("boom")
        assert not thr.cgroup.exists()
        assert throttle.CGROUP_PREFIX not in _own_cgroup_line()


_CHILD = textwrap.dedent("""
    import sys, time
    from packer.diagnose.throttle import throttled
    with throttled([sys.argv[1]], read_iops=1000):
        print("ready", flush=True)
        time.sleep(60)
""")


def _start_child(path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "ready"
    return proc


@needs_throttle
def test_sigterm_cleans_up_and_sigkill_leftover_is_removed_next_time(tmp_path, other_run):
    ctl = throttle.find_controller()
    proc = _start_child(tmp_path)
    cg = ctl.root / f"{throttle.CGROUP_PREFIX}{proc.pid}"
    assert cg.is_dir()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert not cg.exists()

    proc = _start_child(tmp_path)
    cg = ctl.root / f"{throttle.CGROUP_PREFIX}{proc.pid}"
    proc.kill()
    proc.wait(timeout=30)
    assert cg.is_dir()  # SIGKILL: nothing could clean up
    with throttle.throttled([tmp_path], read_iops=1000) as thr:
        assert str(cg) in thr.stale_removed
        assert f"{throttle.CGROUP_PREFIX}{other_run.pid}" not in " ".join(thr.stale_removed)  # alive: not stale
    assert not cg.exists() and not thr.cgroup.exists()
    assert _still_throttled(other_run)


@needs_throttle
def test_bench_under_emulation_records_device_reads_and_cleans_up(data, other_run):
    folder, packed = data
    ctl = throttle.find_controller()
    report = run_bench([folder, packed], BenchOptions(levels=("read",), orders=("block",), caches=("cold",), repeats=1,
                                                      ceiling_bytes=4 << 20, ceiling_seconds=0.2, read_iops=20000,
                                                      read_bps=1_000_000_000))
    assert report["emulation"]["read_iops"] == 20000
    for r in report["results"]:
        assert r["device_reads"][0]["bytes"] > 0  # cold reads reached the throttled device
    assert not (ctl.root / f"{throttle.CGROUP_PREFIX}{os.getpid()}").exists()
    assert throttle.CGROUP_PREFIX not in _own_cgroup_line()
    assert _still_throttled(other_run)


@needs_throttle
def test_a_cgroup_with_live_processes_is_not_stale_even_when_its_owner_pid_is_unknown(tmp_path):
    ctl = throttle.find_controller()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    cg = ctl.root / f"{throttle.CGROUP_PREFIX}{dead.pid}"  # owner gone, or in a pid namespace this process can't see
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        cg.mkdir()
        (cg / "cgroup.procs").write_text(str(sleeper.pid))
        with throttle.throttled([tmp_path], read_iops=1000) as thr:
            assert str(cg) not in thr.stale_removed
        assert str(sleeper.pid) in (cg / "cgroup.procs").read_text().split()
    finally:
        sleeper.kill()
        sleeper.wait()
        throttle.remove_cgroup(ctl, cg, ctl.root)
    assert not cg.exists()
