"""The shared RAM cache: one copy in /dev/shm shared by fork and spawn workers, refusal, clean-up."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from support._tiny import Probe, first, make_lmdb, mapped_files
from support.spawned import Fetch, probe_for
from torch.utils.data import DataLoader

import packer
from packer.errors import PackerError
from packer.read import cache as cache_mod
from packer.read.cache import sweep_stale
from packer.read.dataset import CachedDataset


def shm_files() -> set[str]:
    """This process's caches in /dev/shm (their names start with the creator's pid: others' are not ours to count)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"{cache_mod.PREFIX}{os.getpid()}-")}


@pytest.fixture(scope="module")
def lmdb_path(tmp_path_factory):
    return make_lmdb(tmp_path_factory.mktemp("cache"), count=40)


@pytest.mark.parametrize("mode", ["ram", "ram-decoded"])
def test_cached_samples_equal_uncached(lmdb_path, mode):
    plain = packer.open_dataset(lmdb_path, image="numpy")
    cached = packer.open_dataset(lmdb_path, image="numpy", cache=mode,
                                 cache_options={"progress": False, "workers": 2})
    try:
        assert isinstance(cached, CachedDataset) and cached.path.exists()
        assert len(cached) == len(plain) and cached.classes == plain.classes and cached.targets == plain.targets
        for i in range(len(plain)):
            a, b = cached[i], plain[i]
            assert b[1] == a[1] and np.array_equal(a[0], b[0])
        if mode == "ram":
            assert cached.read_payload(3) == plain.read_payload(3)
    finally:
        cached.close()
    assert not cached.path.exists()


def _shared_cache(lmdb_path, mode: str) -> tuple[CachedDataset, int]:
    """A cache mapped in this process too, and the inode of its one shm file."""
    cached = CachedDataset(packer.open_dataset(lmdb_path, image="numpy"), mode, progress=False, workers=1)
    cached[0]  # map it in the parent too
    ino = os.stat(cached.path).st_ino
    assert mapped_files(cached.path.name) == [(str(cached.path), ino)]
    return cached, ino


@pytest.mark.parametrize("mode, start_method", [("ram", "fork"), ("ram-decoded", "fork"), ("ram-decoded", "spawn")])
def test_workers_share_one_copy(request, mode, start_method):  # spawn workers take seconds to start: one case
    if start_method == "spawn":  # read by the session's spawned workers (_spawned_cache)
        lmdb_path, cached, ino = request.getfixturevalue("spawned").context
        items = request.getfixturevalue("spawned").values()
    else:
        lmdb_path = request.getfixturevalue("lmdb_path")
        cached, ino = _shared_cache(lmdb_path, mode)
        items = DataLoader(Probe(cached, cached.path.name), batch_size=1, num_workers=2,
                           multiprocessing_context=start_method, collate_fn=first)
    plain = packer.open_dataset(lmdb_path, image="numpy")
    try:
        pids, seen = set(), []
        for i, pid, maps, img, label in items:
            pids.add(pid)
            seen.append(i)
            assert maps == [(str(cached.path), ino)]  # the worker maps the very same shm file
            ref_img, ref_label = plain[i]
            assert label == ref_label and np.array_equal(img, ref_img)
        assert sorted(seen) == list(range(len(plain)))
        assert len(pids) == 2 and os.getpid() not in pids
        assert cached.path.exists()  # workers ending never delete the creator's cache
    finally:
        cached.close()
    assert not cached.path.exists()


@probe_for(test_workers_share_one_copy)
def _spawned_cache(tmp_path_factory):
    """Each sample, with the pid and the cache files mapped by the spawned worker that read it, from a
    ram-decoded cache the parent maps. Context: (lmdb path, the cache, its inode)."""
    lmdb_path = make_lmdb(tmp_path_factory.mktemp("cache"), count=40)
    cached, ino = _shared_cache(lmdb_path, "ram-decoded")
    return Fetch(Probe(cached, cached.path.name), [[i] for i in range(len(cached))], first), (lmdb_path, cached, ino)


def test_refuses_when_memory_is_short(lmdb_path, monkeypatch):
    before = shm_files()
    monkeypatch.setattr(cache_mod, "memory_available", lambda: 1000)
    with pytest.raises(PackerError) as err:
        CachedDataset(packer.open_dataset(lmdb_path), "ram-decoded", progress=False)
    msg = str(err.value)
    assert "refused" in msg and "1.0 KB of RAM is available" in msg and "needs" in msg
    assert shm_files() == before


def test_removed_on_garbage_collection(lmdb_path):
    cached = CachedDataset(packer.open_dataset(lmdb_path), "ram", progress=False)
    path = cached.path
    assert path.exists()
    del cached
    gc.collect()
    assert not path.exists()


CHILD = textwrap.dedent("""
    import sys, time
    from packer.read.dataset import CachedDataset
    import packer
    ds = CachedDataset(packer.open_dataset(sys.argv[1]), "ram", progress=False)
    ds[0]
    print(ds.path, flush=True)
    time.sleep(600)
""")


def _wait_gone(path, seconds=20.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not os.path.exists(path):
            return True
        time.sleep(0.05)
    return False


def test_removed_after_the_creator_is_killed(lmdb_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(lmdb_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        path = child.stdout.readline().strip()
        assert path and os.path.exists(path)
        other = CachedDataset.attach(packer.open_dataset(lmdb_path), path)  # another "rank" maps it
        assert other[5][1] == packer.open_dataset(lmdb_path)[5][1]
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert _wait_gone(path), f"{path} left behind after SIGKILL"  # the janitor removed it
        assert other[5][1] == packer.open_dataset(lmdb_path)[5][1]  # an existing mapping keeps working
        other.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_stale_files_are_swept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{cache_mod.PREFIX}{dead.pid}-12345-deadbeef.bin"
    stale.write_bytes(b"x")
    mine = tmp_path / cache_mod._cache_name()
    mine.write_bytes(b"x")
    assert sweep_stale(tmp_path) == [stale]
    assert not stale.exists() and mine.exists()


def test_unknown_mode_and_non_packer_dataset(lmdb_path):
    with pytest.raises(PackerError, match="unknown cache"):
        packer.open_dataset(lmdb_path, cache="disk")
    with pytest.raises(PackerError, match="packer datasets"):
        CachedDataset(list(range(3)), "ram", progress=False)


def test_refuses_when_shm_is_too_small(lmdb_path, monkeypatch):
    from packer import sysinfo

    monkeypatch.setattr(sysinfo, "disk_space", lambda path: (64_000, 64_000_000))
    with pytest.raises(PackerError) as err:
        CachedDataset(packer.open_dataset(lmdb_path), "ram-decoded", progress=False)
    assert "/dev/shm has 64.0 KB free of 64.0 MB" in str(err.value) and "--shm-size" in str(err.value)


ORPHAN_CHILD = textwrap.dedent("""
    import os, sys, time
    from packer.read.dataset import CachedDataset
    import packer
    ds = CachedDataset(packer.open_dataset(sys.argv[1]), "ram", progress=False, shm_dir=sys.argv[2])
    pid = os.fork()  # like a fork DataLoader worker: holds every descriptor the creator has
    if pid == 0:
        ds[0]
        time.sleep(600)
        os._exit(0)
    print(ds.path, pid, flush=True)
    time.sleep(600)
""")


def test_removed_after_the_creator_is_killed_while_a_forked_worker_lives(lmdb_path, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p)}
    child = subprocess.Popen([sys.executable, "-c", ORPHAN_CHILD, str(lmdb_path), str(tmp_path)],
                             stdout=subprocess.PIPE, text=True, env=env)
    orphan = None
    try:
        path, orphan_s = child.stdout.readline().split()
        orphan = int(orphan_s)
        assert os.path.exists(path) and os.path.dirname(path) == str(tmp_path)
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert _wait_gone(path, seconds=10), f"{path} left behind while an orphaned worker lives"
        os.kill(orphan, 0)  # the orphan still runs: the file went with its creator, not with the last worker
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if orphan is not None:
            try:
                os.kill(orphan, signal.SIGKILL)
            except ProcessLookupError:
                pass
