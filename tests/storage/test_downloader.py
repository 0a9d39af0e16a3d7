"""The node's downloader process (packer/storage/downloader.py, its client downloader_client.py) with real
processes, real signals and the emulated store counting what it served: one download per range per node, entries
checked before they exist, the limit kept by the reader's policy, Ctrl-C, a crashed downloader started again once,
and nothing left running."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import CancelledError
from pathlib import Path

import pytest
from support.storage_servers import gone, one_object, s3_spec, together, wait_until

from packer.errors import PackerError
from packer.storage.cache import ChecksumMismatch, RangeCache
from packer.storage.downloader_client import DownloaderClient, wait_all
from packer.storage.emulate import Fault
from packer.storage.protocol import DownloaderGone, range_name

DATA = os.urandom(4 << 20)
REPO = Path(__file__).resolve().parents[2]
BLOCK = 1 << 18


@pytest.fixture
def server(tmp_path):
    with one_object(tmp_path / "root", DATA, latency=0.01) as srv:
        yield srv


def _spec(server):
    return s3_spec(server.server.endpoint, "s3://bucket/ds")


def _client(tmp_path, limit: int | str = "64MB") -> DownloaderClient:
    return DownloaderClient(tmp_path / "cache", limit, linger=0.2)


def _blocks(n: int = 16) -> list[tuple[int, int, list]]:
    return [(i * BLOCK, (i + 1) * BLOCK, []) for i in range(n)]


def _read_in_child(endpoint, cache_dir, digest, start, out):
    from support.storage_servers import s3_spec

    client = DownloaderClient(cache_dir, "64MB", linger=0.2)
    start.wait()
    spec = s3_spec(endpoint, "s3://bucket/ds")
    etag = client.head(spec, "shard.bin").etag
    paths = wait_all(client.fetch(spec, "shard.bin", etag, _blocks()))
    ok = hashlib.sha256(b"".join(p.read_bytes() for p in paths)).hexdigest() == digest  # DATA is the parent's
    out.put((ok, client.server_pid, "obstore" in sys.modules))
    client.close()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_three_processes_asking_for_the_same_ranges_download_them_once(server, tmp_path, method):
    ctx = mp.get_context(method)
    digest = hashlib.sha256(DATA).hexdigest()
    results = together(ctx, _read_in_child, (server.server.endpoint, tmp_path / "cache", digest))
    assert all(ok for ok, _, _ in results)
    assert len({pid for _, pid, _ in results}) == 1  # one downloader for the node's cache
    assert server.server.stats.settled()["body_bytes"] == 16 * BLOCK  # each byte served once for three readers
    if method == "spawn":
        assert not any(loaded for _, _, loaded in results)  # obstore never loaded in a client
    wait_until(lambda: gone(results[0][1]), "the downloader exits after its last client")


def test_a_client_is_used_only_by_the_process_that_made_it(server, tmp_path):
    client = _client(tmp_path)
    client.head(_spec(server), "shard.bin")
    pid = os.fork()
    if pid == 0:  # a forked child must make its own connection: the parent's stays the parent's
        try:
            client.head(_spec(server), "shard.bin")
            code = 1
        except PackerError as exc:
            code = 0 if "belongs to the process that made it" in str(exc) else 2
        client.forget()
        own = _client(tmp_path)
        code = code or (0 if own.head(_spec(server), "shard.bin").size == len(DATA) else 3)
        own.close()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert client.head(_spec(server), "shard.bin").size == len(DATA)  # the parent's connection still works
    client.close()


def test_every_piece_and_every_object_is_checked_before_its_entry_exists(server, tmp_path):
    spec = _spec(server)
    with _client(tmp_path) as client:
        etag = client.head(spec, "shard.bin").etag
        good = ("sha256", hashlib.sha256(DATA[100:200]).hexdigest())
        bad = ("sha256", "0" * 64)
        f_good, f_bad = client.fetch(spec, "shard.bin", etag, [(0, 1000, [(100, 200, *good)]),
                                                               (1000, 2000, [(1100, 1200, *bad)])])
        assert f_good.result(30).read_bytes() == DATA[:1000]
        with pytest.raises(ChecksumMismatch, match="s3://bucket/ds/shard.bin bytes 1100-1200"):
            f_bad.result(30)
        assert not client.path(range_name(spec, "shard.bin", etag, 1000, 2000)).exists()
        dest = "files/x/v/shard.bin"
        with pytest.raises(ChecksumMismatch, match="s3://bucket/ds/shard.bin: sha256"):
            client.fetch_file(spec, "shard.bin", etag, len(DATA), "1" * 64, dest).result(30)
        assert not (client.root / "files/x/v").exists() or os.listdir(client.root / "files/x/v") == []
        path, digest = client.fetch_file(spec, "shard.bin", etag, len(DATA), hashlib.sha256(DATA).hexdigest(),
                                         dest).result(30)
        assert path.read_bytes() == DATA and digest == hashlib.sha256(DATA).hexdigest()
        assert client.stats()["usage"] == 1000 + len(DATA)  # the bad range's and object's room given back
        with pytest.raises(PackerError, match="relative path below files/"):
            client.fetch_file(spec, "shard.bin", etag, len(DATA), None, "../../etc/x")


def test_the_limit_is_kept_and_what_the_reader_needs_again_is_evicted_last(server, tmp_path):
    spec = _spec(server)
    with _client(tmp_path, limit=1 << 20) as client:  # 1 MiB: four blocks of 256 KiB
        etag = client.head(spec, "shard.bin").etag
        names = [range_name(spec, "shard.bin", etag, s, e) for s, e, _ in _blocks()]
        wait_all(client.fetch(spec, "shard.bin", etag, _blocks(4)))
        client.need(names[:2], 1)  # blocks 0 and 1 are read again soon; 2 and 3 not this pass
        client.need(names[2:4], None)
        wait_all(client.fetch(spec, "shard.bin", etag, _blocks(6)[4:]))
        stats = client.stats()
        assert stats["usage"] <= 1 << 20 and stats["evicted"] == 2
        kept = [client.path(n).exists() for n in names[:6]]
        assert kept == [True, True, False, False, True, True]


def test_with_a_cache_as_large_as_the_data_a_second_pass_fetches_nothing(server, tmp_path):
    spec = _spec(server)
    with _client(tmp_path) as client:
        etag = client.head(spec, "shard.bin").etag
        first = wait_all(client.fetch(spec, "shard.bin", etag, _blocks()))
        served = server.server.stats.settled()
        second = wait_all(client.fetch(spec, "shard.bin", etag, _blocks()))
        assert first == second and server.server.stats.settled()["gets"] == served["gets"]
        assert client.stats()["hits"] == 16


def test_a_socket_path_too_long_for_an_address_still_works(server, tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    with DownloaderClient(deep, "1MB", linger=0.2) as client:
        assert len(str(client.socket_path)) > 108
        assert client.head(_spec(server), "shard.bin").size == len(DATA)


def test_the_downloader_exits_when_its_last_client_has_gone(server, tmp_path):
    before = set(threading.enumerate())  # threads another test left for the collector are not this one's
    a, b = _client(tmp_path), _client(tmp_path)
    assert a.server_pid == b.server_pid
    a.close()
    wait_until(lambda: b.stats()["clients"] == 1, "the downloader notices a client gone")  # its EOF, read apart
    b.close()
    wait_until(lambda: gone(a.server_pid), "the downloader exits")
    assert not a.socket_path.exists()
    assert [t.name for t in set(threading.enumerate()) - before if t.name.startswith("packer-downloader")] == []


def test_a_client_dropped_without_close_hangs_up(server, tmp_path):
    """Its reader thread holds it weakly: a client nobody holds (a dataset never closed) is collected, hangs up, its
    thread ends, and the downloader exits with its last client instead of living as long as the process."""
    import gc

    client = _client(tmp_path)
    client.head(_spec(server), "shard.bin")
    pid, reader = client.server_pid, client._reader
    del client
    gc.collect()
    reader.join(30)
    assert not reader.is_alive()
    wait_until(lambda: gone(pid), "the downloader exits after its last client")


def test_a_downloader_that_dies_is_started_again_once_then_one_error(server, tmp_path):
    spec = _spec(server)
    client = _client(tmp_path)
    etag = client.head(spec, "shard.bin").etag
    server.faults.add(Fault("slow", rate=40_000), times=1)  # the first part's GET would take two minutes
    fut = client.fetch_file(spec, "shard.bin", etag, len(DATA), hashlib.sha256(DATA).hexdigest(), "files/d/v/s.bin")
    first = client.server_pid
    wait_until(lambda: server.faults.applied, "the GET reached the server")
    wait_until(lambda: list((client.root / "files/d/v").glob("s.bin.tmp-*")), "the temporary file is there")
    os.kill(first, signal.SIGKILL)
    path, _ = fut.result(60)  # asked again of a new downloader
    assert path.read_bytes() == DATA and client.server_pid != first
    temps = list((client.root / "files/d/v").glob("s.bin.tmp-*"))
    assert len(temps) == 1  # the dead downloader's part-written object never got the entry's name
    os.utime(temps[0], (time.time() - 120, time.time() - 120))  # its writer is dead and it is a minute old
    RangeCache(tmp_path / "cache", "64MB").usage(rescan=True)
    assert not temps[0].exists()
    server.faults.add(Fault("slow", rate=4000), times=-1)
    fut = client.fetch(spec, "shard.bin", etag, [(300_000, 500_000, [])])[0]
    wait_until(lambda: len(server.faults.applied) >= 2, "the second GET reached the server")
    os.kill(client.server_pid, signal.SIGKILL)
    with pytest.raises(DownloaderGone, match="ended twice"):
        fut.result(60)
    client.close()


CTRL_C = """
import sys, threading
from support.storage_servers import s3_spec
from packer.storage.downloader_client import DownloaderClient
client = DownloaderClient(sys.argv[2], "64MB", linger=0.2)
spec = s3_spec(sys.argv[1], "s3://bucket/ds")
etag = client.head(spec, "shard.bin").etag
try:
    futures = client.fetch(spec, "shard.bin", etag, [(i * 200_000, i * 200_000 + 100_000, []) for i in range(8)])
    print("started", flush=True)
    futures[0].result()
except KeyboardInterrupt:
    client.close()
    print("interrupted; threads left:", [t.name for t in threading.enumerate() if t.name.startswith("packer")],
          flush=True)
"""


def test_ctrl_c_in_a_client_ends_its_requests_and_leaves_nothing_running(server, tmp_path):
    server.faults.add(Fault("slow", rate=4000), times=-1)  # the reads would take minutes
    watcher = _client(tmp_path)  # keeps the downloader up to ask it what happened
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    proc = subprocess.Popen([sys.executable, "-c", CTRL_C, server.server.endpoint, str(tmp_path / "cache")],
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "started"
    wait_until(lambda: watcher.stats()["in_flight"] == 8, "the eight reads are under way")
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert out.strip() == "interrupted; threads left: []" and proc.returncode == 0
    wait_until(lambda: watcher.stats()["in_flight"] == 0, "the downloader dropped the interrupted client's reads")
    wait_until(lambda: server.server.stats.snapshot()["active"] == 0, "the GETs under way were cancelled")
    pid = watcher.server_pid
    watcher.close()
    wait_until(lambda: gone(pid), "the downloader exits with its last client")


def test_cancelling_a_future_cancels_the_read(server, tmp_path):
    spec = _spec(server)
    server.faults.add(Fault("slow", rate=4000), times=-1)
    with _client(tmp_path) as client:
        etag = client.head(spec, "shard.bin").etag
        fut = client.fetch(spec, "shard.bin", etag, [(0, 100_000, [])])[0]
        wait_until(lambda: client.stats()["in_flight"] == 1, "the read is under way")
        assert fut.cancel()
        with pytest.raises(CancelledError):
            fut.result()
        wait_until(lambda: client.stats()["in_flight"] == 0 and client.stats()["cancelled"] == 1, "cancelled")


def test_a_client_that_stops_reading_stalls_nobody_else(server, tmp_path):
    from packer.storage.protocol import frame, try_connect

    with _client(tmp_path) as client:
        stalled = try_connect(client.socket_path)
        assert stalled is not None
        stalled.sendall(frame({"op": "hello", "version": 1, "pid": os.getpid(), "limit": None}))
        stalled.sendall(b"".join(frame({"op": "stats", "id": i}) for i in range(20_000)))  # answers never read
        wait_until(lambda: client.stats()["clients"] == 2, "both clients are connected")
        assert client.submit_head(_spec(server), "shard.bin").result(30).size == len(DATA)  # not stalled
        stalled.close()


def test_a_store_that_cannot_open_fails_each_request_once_and_blocks_no_other(server, tmp_path):
    from packer.storage.client import StoreSpec

    refused = StoreSpec(f"http://user:pw@{server.server.endpoint[7:]}/bucket/ds", {}, _spec(server).policy)
    with _client(tmp_path) as client:
        futures = client.fetch(refused, "shard.bin", None, _blocks(3))
        futures.append(client.fetch_file(refused, "shard.bin", None, 10, None, "files/r/v/s.bin"))
        for fut in futures:
            with pytest.raises(PackerError, match="credentialed http"):
                fut.result(30)
        assert client.stats()["in_flight"] == 0  # nothing left waiting in the downloader
        spec = _spec(server)
        etag = client.head(spec, "shard.bin").etag
        assert wait_all(client.fetch(spec, "shard.bin", etag, _blocks(3)))[2].read_bytes() == DATA[2 * BLOCK:3 * BLOCK]


def test_a_request_the_downloader_cannot_take_fails_all_its_ranges(server, tmp_path):
    with _client(tmp_path) as client:  # a store id it was never told of: the request fails whole, every range
        futures = client._submit("fetch", 3, sid=99, key="shard.bin", etag=None, ranges=[[0, 10, []]] * 3,
                                 priority=0)
        for fut in futures:
            with pytest.raises(PackerError, match="KeyError"):
                fut.result(30)


def test_a_cache_directory_that_cannot_be_made_is_one_clear_error(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(PackerError, match=r"/file/cache: cannot keep a cache there \(Not a directory\)"):
        DownloaderClient(tmp_path / "file" / "cache", "1MB")


def test_nodes_sharing_a_cache_folder_get_a_downloader_each(server, tmp_path, monkeypatch):
    """A Unix socket cannot be reached from another machine: each node (by the kernel's boot id) has its own
    socket in a shared folder, so a second node starts its own downloader instead of fighting over one socket."""
    from packer.storage import node

    here = _client(tmp_path)
    monkeypatch.setitem(node._IDS, "node", "another machine's boot id")
    there = _client(tmp_path)
    try:
        assert there.socket_path != here.socket_path and there.server_pid != here.server_pid
        spec = _spec(server)
        etag = here.head(spec, "shard.bin").etag
        assert [p.read_bytes() for p in wait_all(there.fetch(spec, "shard.bin", etag, _blocks(2)))] == \
            [DATA[:BLOCK], DATA[BLOCK:2 * BLOCK]]
        assert here.stats()["clients"] == 1 and there.stats()["clients"] == 1
    finally:
        here.close()
        there.close()
