"""The node-wide range cache (packer/storage/cache.py) with real processes: one download per range per node, no
partial entry after a crash, entries keyed by ETag, the limit kept by the eviction policy, checksums before use."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import resource
import signal
import time

import pytest
from support.fds import open_files_under
from support.storage_servers import together

from packer.errors import PackerError
from packer.storage.cache import ChecksumMismatch, KeepNeeded, RangeCache

URL = "s3://bucket/ds.lmdb/shard-00000.mdb"


def _counted_fetch(log: str, data: bytes, pause: float = 0.0):
    def fetch() -> bytes:
        with open(log, "a") as fh:
            fh.write(f"{os.getpid()}\n")
        time.sleep(pause)
        return data
    return fetch


def _get_in_child(cache_dir, log, start_event, out):
    cache = RangeCache(cache_dir, "1MB")
    start_event.wait()
    data = cache.get(URL, '"e1"', 0, 1000, _counted_fetch(log, b"x" * 1000, pause=0.5))
    out.put((len(data), cache.stats.misses, cache.stats.waits))


def test_two_processes_asking_at_once_download_once(tmp_path):
    log = str(tmp_path / "fetches.log")
    ctx = mp.get_context("spawn")
    results = together(ctx, _get_in_child, (tmp_path / "c", log))
    assert open(log).read().count("\n") == 1, "the same range was downloaded twice"
    assert sorted(r[1] for r in results) == [0, 0, 1] and all(r[0] == 1000 for r in results)
    assert sum(r[2] for r in results) >= 1  # someone found the download under way and waited for it


def test_threads_of_one_process_download_once(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    cache = RangeCache(tmp_path / "c", 10 << 20)
    log = str(tmp_path / "fetches.log")
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: cache.get(URL, '"e1"', 0, 100, _counted_fetch(log, b"y" * 100, 0.2)),
                            range(8)))
    assert got == [b"y" * 100] * 8 and open(log).read().count("\n") == 1


def _crash_mid_write(cache_dir):
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # the write of 4 MB dies at 1 MB
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    RangeCache(cache_dir, "100MB").get(URL, '"e1"', 0, 4 << 20, lambda: b"z" * (4 << 20))


def _hold_claim_forever(cache_dir, claimed):
    cache = RangeCache(cache_dir, "100MB")
    with cache.claim(RangeCache.name(URL, '"e1"', 0, 10)):
        claimed.set()
        time.sleep(600)


def test_a_crashed_downloader_leaves_nothing_that_looks_complete(tmp_path):
    ctx = mp.get_context("fork")
    proc = ctx.Process(target=_crash_mid_write, args=(tmp_path / "c",))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGXFSZ  # killed while writing the entry
    cache = RangeCache(tmp_path / "c", "100MB")
    name = cache.name(URL, '"e1"', 0, 4 << 20)
    temps = list(cache.path(name).parent.glob("*.tmp-*"))
    assert len(temps) == 1 and temps[0].stat().st_size == 1 << 20  # the partial write is there, as a temporary
    assert cache.read(name) is None and not cache.path(name).exists()
    assert cache.get(URL, '"e1"', 0, 4 << 20, lambda: b"z" * (4 << 20)) == b"z" * (4 << 20)
    os.utime(temps[0], (time.time() - 120, time.time() - 120))  # its writer is dead and it is a minute old
    cache.usage(rescan=True)
    assert not temps[0].exists()
    # a downloader killed while holding the claim: its lock goes with it, the next reader fetches
    claimed = ctx.Event()
    holder = ctx.Process(target=_hold_claim_forever, args=(tmp_path / "c", claimed))
    holder.start()
    assert claimed.wait(60)
    with cache.claim(cache.name(URL, '"e1"', 0, 10), block=False) as mine:
        assert not mine  # held by the other process
    holder.kill()
    holder.join(30)
    assert cache.get(URL, '"e1"', 0, 10, lambda: b"0123456789") == b"0123456789"


def test_a_replaced_object_never_serves_the_old_bytes(tmp_path):
    cache = RangeCache(tmp_path / "c", "1MB")
    assert cache.get(URL, '"v1"', 0, 4, lambda: b"old!") == b"old!"
    assert cache.get(URL, '"v2"', 0, 4, lambda: b"new!") == b"new!"
    assert cache.get(URL, '"v1"', 0, 4, lambda: pytest.fail("cached")) == b"old!"
    assert cache.stats.misses == 2 and cache.stats.hits == 1


def test_the_limit_holds_and_lru_goes_first(tmp_path):
    cache = RangeCache(tmp_path / "c", 10_000)
    for i in range(8):
        cache.get(URL, '"e"', i * 1000, (i + 1) * 1000, lambda: b"a" * 1000)
        time.sleep(0.01)  # distinct mtimes
    cache.get(URL, '"e"', 0, 1000, lambda: pytest.fail("cached"))  # range 0 used again: now the most recent
    for i in range(8, 12):
        cache.get(URL, '"e"', i * 1000, (i + 1) * 1000, lambda: b"a" * 1000)
    assert cache.usage(rescan=True) <= 10_000 and cache.usage() == cache.usage(rescan=True)
    present = [i for i in range(12) if cache.path(cache.name(URL, '"e"', i * 1000, (i + 1) * 1000)).exists()]
    # 12 KB into 10 KB: over the limit at the 11th, down to 90 %: the two least recently used (1, 2) go
    assert present == [0, *range(3, 12)] and cache.stats.evicted == 2


def test_keep_needed_evicts_what_the_epoch_will_not_read_again(tmp_path):
    names = [RangeCache.name(URL, '"e"', i * 1000, (i + 1) * 1000) for i in range(12)]
    policy = KeepNeeded(set(names[:4]))  # the epoch still reads ranges 0-3, written first (oldest)
    cache = RangeCache(tmp_path / "c", 10_000, policy)
    for i in range(12):
        cache.get(URL, '"e"', i * 1000, (i + 1) * 1000, lambda: b"b" * 1000)
    assert all(cache.path(n).exists() for n in names[:4])
    assert cache.usage(rescan=True) <= 10_000


def test_checksums_are_checked_before_use(tmp_path):
    cache = RangeCache(tmp_path / "c", "1MB")
    good = b"pixels" * 100
    digest = ("sha256", hashlib.sha256(good).hexdigest())
    with pytest.raises(ChecksumMismatch, match="s3://bucket/ds.lmdb/shard-00000.mdb bytes 0-600: sha256"):
        cache.get(URL, '"e"', 0, 600, lambda: good[:-1] + b"X", checksum=digest)
    name = cache.name(URL, '"e"', 0, 600)
    assert not cache.path(name).exists()  # wrong bytes are never cached
    assert cache.get(URL, '"e"', 0, 600, lambda: good, checksum=digest) == good
    raw = bytearray(cache.path(name).read_bytes())
    raw[10] ^= 1
    cache.path(name).write_bytes(bytes(raw))  # damaged on disk: found at the next hit, fetched again
    assert cache.get(URL, '"e"', 0, 600, lambda: good, checksum=digest) == good
    assert cache.stats.misses == 2


def test_limits_are_parsed_and_checked(tmp_path):
    assert RangeCache(tmp_path / "c", "20GB").limit == 20_000_000_000
    with pytest.raises(PackerError):
        RangeCache(tmp_path / "c", 0)
    with pytest.raises(PackerError, match="raise cache_limit"):
        RangeCache(tmp_path / "c", 10).get(URL, None, 0, 100, lambda: b"x" * 100)


def test_objects_being_fetched_keep_their_room_when_the_cache_is_counted_again(tmp_path):
    """A whole object being fetched (a temporary file as large as the object, as the downloader makes it) takes room
    that eviction must count: entries stored meanwhile never push the disk used past the limit."""
    cache = RangeCache(tmp_path / "c", 10_000)
    cache.make_room(5000)  # an object of 5000 bytes starts downloading ...
    (cache.root / "tmp").mkdir()
    with open(cache.root / "tmp" / f"{os.getpid()}-ab.tmp-{os.getpid()}-cd", "wb") as fh:
        fh.truncate(5000)  # ... into its temporary file, sized at the start (wholeobject.py)
    for i in range(12):  # ranges stored meanwhile: over the limit twice, so the entries are counted again
        cache.get(URL, '"e"', i * 1000, (i + 1) * 1000, lambda: b"c" * 1000)
    assert cache.usage(rescan=True) == cache.usage() <= 10_000
    assert cache.usage(rescan=True) == 5000 + 1000 * sum(
        cache.path(cache.name(URL, '"e"', i * 1000, (i + 1) * 1000)).exists() for i in range(12))


def test_a_cache_dropped_without_close_leaves_no_file_open(tmp_path):
    """Every RangeCache holds its lock and usage files open: dropped unclosed, it closes them (a test session or a
    tool making caches would otherwise run out of descriptors); ``with`` closes them at once."""
    import gc

    cache = RangeCache(tmp_path / "c", "1MB")
    cache.get(URL, '"e"', 0, 4, lambda: b"abcd")
    assert len(open_files_under(tmp_path)) == 2
    del cache
    gc.collect()
    assert open_files_under(tmp_path) == []
    with RangeCache(tmp_path / "c", "1MB") as cache:
        assert cache.get(URL, '"e"', 0, 4, lambda: pytest.fail("cached")) == b"abcd"
    assert open_files_under(tmp_path) == []


def test_a_temporary_file_of_another_node_or_container_is_kept_while_it_may_be_written(tmp_path):
    """A cache folder shared by machines (or containers): a pid of another pid space says nothing here, so its
    writer's temporary file is swept only when over an hour old; this space's dead writer's, after a minute."""
    from packer.storage.node import STALE_TEMP_SECONDS, pid_space

    cache = RangeCache(tmp_path / "c", "1MB")
    dead = mp.get_context("fork").Process(target=os.getpid)
    dead.start()
    dead.join()  # a pid no process of this space has now
    folder = cache.entries / "ab"
    folder.mkdir()
    other, ours, old = (folder / f"ab{i}.tmp-{space}-{dead.pid}-00" for i, space in
                        enumerate(("n000000000000", pid_space(), "n000000000000")))
    for path, age in ((other, 120), (ours, 120), (old, STALE_TEMP_SECONDS + 60)):
        path.write_bytes(b"x" * 100)
        os.utime(path, (time.time() - age, time.time() - age))
    assert cache.usage(rescan=True) == 100  # the other space's file, counted as a download under way
    assert other.exists() and not ours.exists() and not old.exists()
