"""Fetcher (packer/storage/fetch.py) against the emulated store: coalescing, the bound on requests in flight,
the node-wide cache across processes, checksums, and cancellation by close() and Ctrl-C with no thread left."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import CancelledError
from pathlib import Path

import pytest
from support.storage_servers import one_object, together

from packer.storage.cache import ChecksumMismatch, RangeCache
from packer.storage.emulate import Fault
from packer.storage.fetch import Fetcher, Range

DATA = os.urandom(4 << 20)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def server(tmp_path):
    with one_object(tmp_path / "root", DATA, latency=0.02) as srv:
        yield srv


def _gets(server) -> int:
    return server.server.stats.settled()["gets"]


def test_adjacent_ranges_become_one_get_and_come_back_in_order(server):
    store = server.store("ds")
    blocks = [Range("shard.bin", i * 100_000, (i + 1) * 100_000) for i in range(10)]
    far = [Range("shard.bin", 3_000_000, 3_000_500), Range("shard.bin", 3_000_500, 3_001_000)]
    with Fetcher(store) as fetcher:
        futures = fetcher.fetch(far + blocks)
        got = [f.result(30) for f in futures]
    assert got == [DATA[r.start:r.end] for r in far + blocks]
    assert _gets(server) == 2 and fetcher.stats.requests == 2
    store.close()


def test_requests_are_capped_in_size_and_in_flight(server):
    store = server.store("ds")
    adjacent = [Range("shard.bin", i << 18, (i + 1) << 18) for i in range(10)]  # 10 x 256 KiB
    with Fetcher(store, max_request=1 << 20) as fetcher:
        assert [f.result(30) for f in fetcher.fetch(adjacent)] == [DATA[r.start:r.end] for r in adjacent]
    assert fetcher.stats.requests == 3  # 4 + 4 + 2 blocks of 256 KiB under 1 MiB
    spread = [Range("shard.bin", i * 200_000, i * 200_000 + 1000) for i in range(20)]  # not adjacent: 20 GETs
    with Fetcher(store, max_in_flight=4) as fetcher:
        assert [f.result(30) for f in fetcher.fetch(spread)] == [DATA[r.start:r.end] for r in spread]
    stats = server.server.stats.settled()
    assert stats["max_waiting"] == 4 and fetcher.stats.requests == 20  # the server's own count of concurrent GETs
    store.close()


def test_a_second_pass_through_the_cache_fetches_nothing(server, tmp_path):
    store = server.store("ds")
    cache = RangeCache(tmp_path / "cache", "64MB")
    blocks = [Range("shard.bin", i << 20, (i + 1) << 20, '"' + "x" + '"') for i in range(4)]
    etag = store.head("shard.bin").etag
    blocks = [Range(r.key, r.start, r.end, etag, ("sha256", hashlib.sha256(DATA[r.start:r.end]).hexdigest()))
              for r in blocks]
    with Fetcher(store, cache) as fetcher:
        assert [f.result(30) for f in fetcher.fetch(blocks)] == [DATA[r.start:r.end] for r in blocks]
    before = server.server.stats.settled()
    with Fetcher(store, cache) as fetcher:
        assert [f.result(30) for f in fetcher.fetch(blocks)] == [DATA[r.start:r.end] for r in blocks]
    after = server.server.stats.settled()
    assert after["body_bytes"] == before["body_bytes"] and fetcher.stats.hits == 4 and fetcher.stats.requests == 0
    store.close()


def test_a_range_with_the_wrong_checksum_fails_alone(server, tmp_path):
    store = server.store("ds")
    good = Range("shard.bin", 0, 1000, None, ("sha256", hashlib.sha256(DATA[:1000]).hexdigest()))
    bad = Range("shard.bin", 1000, 2000, None, ("sha256", "0" * 64))
    cache = RangeCache(tmp_path / "cache", "1MB")
    with Fetcher(store, cache) as fetcher:
        f_good, f_bad = fetcher.fetch([good, bad])
        assert f_good.result(30) == DATA[:1000]
        with pytest.raises(ChecksumMismatch, match="s3://bucket/ds/shard.bin bytes 1000-2000"):
            f_bad.result(30)
    assert cache.usage(rescan=True) == 1000  # only the good range was cached
    store.close()


def _fetch_all_in_child(endpoint, cache_dir, start, out):
    from support.storage_servers import s3_store

    store = s3_store(endpoint, "s3://bucket/ds")
    start.wait()
    ranges = [Range("shard.bin", i << 18, (i + 1) << 18, None) for i in range(16)]
    with Fetcher(store, RangeCache(cache_dir, "64MB"), max_in_flight=2) as fetcher:
        got = [f.result(60) for f in fetcher.fetch(ranges)]
    out.put((got == [DATA[r.start:r.end] for r in ranges], fetcher.stats.requests, fetcher.stats.waits))
    store.close()


def test_processes_sharing_a_cache_download_each_byte_once(server, tmp_path):
    ctx = mp.get_context("fork")  # DATA is the parent's
    results = together(ctx, _fetch_all_in_child, (server.server.endpoint, tmp_path / "c"))
    assert all(ok for ok, _, _ in results)
    assert server.server.stats.settled()["body_bytes"] == 16 << 18  # 4 MiB served once for three readers


def _storage_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(("packer-storage", "packer-fetch"))}


def test_close_cancels_what_is_in_flight_and_leaves_no_thread(server):
    before = _storage_threads()  # a client another test dropped unclosed stops when collected: not this one's
    store = server.store("ds")
    server.faults.add(Fault("slow", rate=4000), times=-1)  # each 100 KB range would take 25 s
    fetcher = Fetcher(store, max_in_flight=2)
    futures = fetcher.fetch([Range("shard.bin", i * 200_000, i * 200_000 + 100_000) for i in range(6)])
    fetcher.close()
    store.close()
    for f in futures:
        with pytest.raises(CancelledError):
            f.result(30)
    assert [t.name for t in _storage_threads() - before] == []


CTRL_C = """
import sys, threading
from support.storage_servers import s3_store
from packer.storage.fetch import Fetcher, Range
store = s3_store(sys.argv[1], "s3://bucket/ds")
try:
    with Fetcher(store, max_in_flight=4) as fetcher:
        futures = fetcher.fetch([Range("shard.bin", i * 200_000, i * 200_000 + 100_000) for i in range(8)])
        print("started", flush=True)
        futures[0].result()
except KeyboardInterrupt:
    store.close()
    print("interrupted; threads left:", [t.name for t in threading.enumerate() if t.name.startswith("packer")],
          flush=True)
"""


def test_ctrl_c_ends_the_wait_cancels_the_reads_and_leaves_no_thread(server):
    server.faults.add(Fault("slow", rate=4000), times=-1)  # the reads would take minutes
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    proc = subprocess.Popen([sys.executable, "-c", CTRL_C, server.server.endpoint], stdout=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "started"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert out.strip() == "interrupted; threads left: []" and proc.returncode == 0


def test_what_is_needed_next_goes_before_the_read_ahead_and_dropped_reads_are_never_sent(server):
    for name in ("a0", "a1", "a2", "a3", "next", "dropped"):
        server.write(f"ds/{name}", DATA[:1000])
    server.faults.add(Fault("slow", rate=1e9), times=-1)  # harmless: it only records the order of the GETs
    store = server.store("ds")
    with Fetcher(store, max_in_flight=1) as fetcher:
        ahead = fetcher.fetch([Range(f"a{i}", 0, 1000) for i in range(4)], priority=5)  # a0 starts at once
        dropped = fetcher.fetch([Range("dropped", 0, 1000)], priority=1)
        needed = fetcher.fetch([Range("next", 0, 1000)], priority=0)
        assert dropped[0].cancel()
        assert [f.result(30) for f in ahead + needed] == [DATA[:1000]] * 5
    assert [key for _, _, key in server.faults.applied] == ["ds/a0", "ds/next", "ds/a1", "ds/a2", "ds/a3"]
    store.close()
