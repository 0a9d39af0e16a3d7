"""ObjectStore against real servers on localhost (moto's S3 server, the emulated store as S3 and as plain HTTP),
one test per fault kind injected at the server, and the per-process client under fork and spawn."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle

import pytest
from support.storage_servers import FAST_POLICY, Emulated, s3_store, user_environment

from packer.cli import end_process
from packer.errors import PackerError
from packer.storage.client import HelperClient, Lanes, LoopClient
from packer.storage.emulate import Fault
from packer.storage.faults import AccessDenied, ObjectChanged, ObjectNotFound, RetryPolicy, StorageError
from packer.storage.store import ObjectStore

DATA = bytes(range(256)) * 4096  # 1 MiB, every range distinguishable


def test_put_get_head_list_delete_on_moto(moto_endpoint, bucket):
    store = s3_store(moto_endpoint, f"s3://{bucket}/ds.lmdb")
    info = store.put("shard-00000.mdb", DATA)
    assert info.size == len(DATA) and info.etag
    store.put("meta/labels.npy", b"labels")
    head = store.head("shard-00000.mdb")
    assert (head.key, head.size, head.etag) == ("shard-00000.mdb", len(DATA), info.etag)
    assert store.get_range("shard-00000.mdb", 1000, 5000, etag=head.etag) == DATA[1000:5000]
    assert store.get_range("shard-00000.mdb", len(DATA) - 10, len(DATA) + 100) == DATA[-10:]  # clipped at the end
    assert store.get("meta/labels.npy") == b"labels"
    assert [i.key for i in store.list()] == ["meta/labels.npy", "shard-00000.mdb"]
    assert [i.key for i in store.list("meta/")] == ["meta/labels.npy"]
    store.delete("meta/labels.npy")
    with pytest.raises(ObjectNotFound) as err:
        store.head("meta/labels.npy")
    assert isinstance(err.value, FileNotFoundError) and isinstance(err.value, PackerError)
    assert f"s3://{bucket}/ds.lmdb/meta/labels.npy" in str(err.value)
    store.close()


def test_a_large_file_goes_up_in_parts_and_comes_back_whole(moto_endpoint, bucket, tmp_path):
    import boto3

    big = os.urandom(11 << 20)
    (tmp_path / "big.bin").write_bytes(big)
    store = s3_store(moto_endpoint, f"s3://{bucket}/x")
    store.put("big.bin", tmp_path / "big.bin", chunk_size=5 << 20)
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1", aws_access_key_id="testing",
                      aws_secret_access_key="testing")
    etag = s3.head_object(Bucket=bucket, Key="x/big.bin")["ETag"]
    assert etag.strip('"').endswith("-3"), etag  # S3's multipart ETag: 3 parts
    assert store.get("big.bin") == big
    store.close()


def test_listing_follows_every_page(tmp_path):
    root = tmp_path / "root"
    for i in range(7):
        (root / "p" / f"{i:02d}").mkdir(parents=True)
        (root / "p" / f"{i:02d}" / "x.jpg").write_bytes(b"x" * i)
    server = Emulated(root, page_size=2)
    try:
        store = server.store("p")
        infos = store.list()
        assert [i.key for i in infos] == [f"{i:02d}/x.jpg" for i in range(7)]
        assert [i.size for i in infos] == list(range(7))
        assert server.server.stats.lists == 4  # 7 keys, 2 a page
        store.close()
    finally:
        server.stop()


def test_http_range_reads(emulated):
    emulated.write("web/a.bin", DATA)
    store = emulated.http("web")
    assert store.get_range("a.bin", 10, 20) == DATA[10:20]
    assert store.head("a.bin").size == len(DATA)
    with pytest.raises(ObjectNotFound):
        store.get("missing.bin")
    store.close()


def test_local_paths_and_file_urls(tmp_path):
    (tmp_path / "a.bin").write_bytes(DATA)
    for root in (str(tmp_path), f"file://{tmp_path}"):
        with ObjectStore(root) as store:
            assert store.get_range("a.bin", 5, 9) == DATA[5:9]
            assert store.head("a.bin").etag


# ---- faults, injected at the server; each retried then given up on with one clear error ----

def _store(emulated, key="f/obj.bin"):
    emulated.write(key, DATA)
    return emulated.store("f"), key.split("/", 1)[1]


@pytest.mark.parametrize("status,code", [(500, "InternalError"), (503, "SlowDown")])
def test_5xx_and_throttling_are_retried_then_one_error(emulated, status, code):
    store, key = _store(emulated)
    emulated.faults.add(Fault("status", status, code), times=2)
    assert store.get_range(key, 0, 100) == DATA[:100]
    assert len(emulated.faults.applied) == 2
    emulated.faults.add(Fault("status", status, code), times=-1)
    with pytest.raises(StorageError) as err:
        store.get_range(key, 0, 100)
    msg = str(err.value)
    assert "s3://bucket/f/obj.bin" in msg and str(status) in msg and "\n" not in msg
    assert len(emulated.faults.applied) == 2 + FAST_POLICY.retries + 1  # every try reached the server
    store.close()


def test_a_connection_cut_mid_body_is_retried_then_one_error(emulated):
    store, key = _store(emulated)
    emulated.faults.add(Fault("cut", after=1000), times=1)
    assert store.get_range(key, 0, 500_000) == DATA[:500_000]
    emulated.faults.add(Fault("cut", after=1000), times=-1)
    with pytest.raises(StorageError, match="s3://bucket/f/obj.bin: the connection was cut mid-body"):
        store.get_range(key, 0, 500_000)
    assert len(emulated.faults.applied) >= 1 + FAST_POLICY.retries + 1
    store.close()


def test_a_truncated_body_is_never_returned(emulated):
    """A complete HTTP response whose body is shorter than the range asked: the length check catches it."""
    store, key = _store(emulated)
    emulated.faults.add(Fault("short", after=100), times=1)
    assert store.get_range(key, 1000, 9000) == DATA[1000:9000]
    emulated.faults.add(Fault("short", after=100), times=-1)
    with pytest.raises(StorageError, match=r"s3://bucket/f/obj.bin: 7900 bytes received of the 8000 asked for"):
        store.get_range(key, 1000, 9000)
    store.close()


def test_a_slow_body_times_out_into_one_error(emulated):
    emulated.write("f/slow.bin", DATA)
    policy = RetryPolicy(retries=1, backoff=0.01, max_backoff=0.01, retry_timeout=10, timeout=0.5, connect_timeout=1)
    store = emulated.store("f", policy)
    emulated.faults.add(Fault("slow", rate=2000), times=-1)
    with pytest.raises(StorageError) as err:
        store.get_range("slow.bin", 0, 100_000)  # 50 s at 2 KB/s; the timeout is 0.5 s a try
    assert "s3://bucket/f/slow.bin: timed out" in str(err.value)
    assert len(emulated.faults.applied) == 2  # the first try and one retry
    store.close()


def test_a_reset_connection_is_retried(emulated):
    store, key = _store(emulated)
    emulated.faults.add(Fault("reset"), times=2)
    assert store.get_range(key, 0, 10) == DATA[:10]
    assert len(emulated.faults.applied) == 2
    store.close()


def test_an_object_replaced_between_two_reads_is_detected_never_mixed(emulated):
    store, key = _store(emulated)
    etag = store.head(key).etag
    assert store.get_range(key, 0, 10, etag=etag) == DATA[:10]
    emulated.write("f/obj.bin", DATA[::-1])
    with pytest.raises(ObjectChanged, match="s3://bucket/f/obj.bin: the object changed since it was opened"):
        store.get_range(key, 10, 20, etag=etag)
    store.close()


def test_403_is_clear_and_not_retried(emulated):
    store, key = _store(emulated)
    emulated.faults.add(Fault("status", 403, "AccessDenied"), times=-1, method="*")
    with pytest.raises(AccessDenied, match="s3://bucket/f/obj.bin: access denied") as err:
        store.head(key)
    assert isinstance(err.value, PermissionError) and len(emulated.faults.applied) == 1
    store.close()


def test_404_is_a_file_not_found(emulated):
    store, _ = _store(emulated)
    with pytest.raises(FileNotFoundError, match="s3://bucket/f/nothing.bin: no such object"):
        store.get_range("nothing.bin", 0, 10)
    store.close()


def test_credentials_never_appear_in_repr_or_errors(emulated):
    secret = "SECRETKEY-DO-NOT-PRINT"
    store = ObjectStore("s3://bucket/f", {"aws_access_key_id": "id", "aws_secret_access_key": secret,
                                          "endpoint": emulated.server.endpoint, "region": "us-east-1"}, FAST_POLICY)
    emulated.faults.add(Fault("status", 403, "AccessDenied"), times=-1, method="*")
    with pytest.raises(AccessDenied) as err:
        store.head("x")
    for shown in (repr(store), repr(store.spec), str(err.value), repr(err.value)):
        assert secret not in shown
    store.close()


def test_credentials_and_endpoint_from_the_environment(emulated, monkeypatch):
    emulated.write("env/a.bin", DATA)
    user_environment(monkeypatch, emulated.server.endpoint)
    with ObjectStore("s3://bucket/env", policy=FAST_POLICY) as store:
        assert store.get_range("a.bin", 0, 10) == DATA[:10]


# ---- one client per process: fork and spawn ----

def _child_reads(store: ObjectStore, key: str, queue, method: str) -> None:
    try:
        queue.put((store.get_range(key, 100, 200), type(store.client).__name__))
    except BaseException as exc:
        queue.put((repr(exc), ""))
    finally:
        store.close()
    if method == "spawn":  # a spawned child ends by the interpreter's finalization, where obstore's runtime may
        queue.close()  # abort it (docs/remote.md, "Known limits": 1 run in 3 under load here): ended as a program
        queue.join_thread()  # using ObjectStore should end (a forked one ends by os._exit already)
        end_process(0)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_store_used_before_fork_or_pickled_to_spawn_reads_in_the_child(emulated, method):
    """obstore hangs in a forked child once the parent has made a request: the child gets a helper process."""
    store, key = _store(emulated)
    assert store.get_range(key, 0, 10) == DATA[:10]  # the parent's client is running
    ctx = mp.get_context(method)
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_reads, args=(store, key, queue, method))
    proc.start()
    got, client = queue.get(timeout=60)
    proc.join(60)
    assert got == DATA[100:200] and proc.exitcode == 0
    assert client == ("HelperClient" if method == "fork" else "LoopClient")
    assert pickle.loads(pickle.dumps(store)).get_range(key, 0, 5) == DATA[:5]
    store.close()


def test_a_store_dropped_without_close_stops_its_thread(tmp_path):
    """A client's loop thread holds its event loop, not the client: a store dropped unclosed (a pickled copy, a
    tool's) stops its thread and closes its loop instead of keeping them, and their descriptors, until exit."""
    import gc

    (tmp_path / "a.bin").write_bytes(DATA)
    store = ObjectStore(tmp_path)
    assert store.get_range("a.bin", 0, 4) == DATA[:4]
    client = store.client
    assert isinstance(client, LoopClient)
    thread, loop = client._thread, client._loop
    del store, client
    gc.collect()
    thread.join(10)
    assert not thread.is_alive() and loop.is_closed()


def _drop_helper_in_child(store: ObjectStore, key: str, queue) -> None:
    import gc

    try:
        assert store.get_range(key, 0, 4) == DATA[:4]
        client = store.client
        assert isinstance(client, HelperClient)
        kind, proc, reader = type(client).__name__, client._proc, client._reader
        store._client.close()  # forgotten, not closed: as a store nobody holds any more
        del client
        gc.collect()
        reader.join(30)
        queue.put((kind, proc.wait(30), reader.is_alive()))
    except BaseException as exc:
        queue.put((repr(exc), None, None))


def test_a_forked_childs_store_dropped_without_close_ends_its_helper(emulated):
    """The helper process and its reader thread end with a client nobody holds (they hold the pipe, not it)."""
    store, key = _store(emulated)
    assert store.get_range(key, 0, 10) == DATA[:10]  # obstore ran here: a forked child gets a helper
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_drop_helper_in_child, args=(store, key, queue))
    proc.start()
    got = queue.get(timeout=60)
    proc.join(60)
    assert got == ("HelperClient", 0, False)
    store.close()


@pytest.mark.parametrize("kind", [LoopClient, HelperClient])
def test_gets_started_together_give_each_result_or_error_in_order(emulated, kind):
    """``submit_gets``: one future for many GETs (small objects); each its bytes, or the error it alone gave."""
    emulated.write("many/a.bin", b"a" * 10)
    emulated.write("many/b.bin", b"b" * 20)
    store = emulated.store("many")
    etag_a, etag_b = store.head("a.bin").etag, store.head("b.bin").etag
    client = kind(store.spec)
    store._client.get = lambda: client  # this test's client kind in this process  # type: ignore[method-assign]
    try:
        got = store.submit_gets([("a.bin", etag_a), ("gone.bin", None), ("b.bin", "\"another\""), ("b.bin", etag_b),
                                 ("a.bin", None)]).result(60)
        assert [bytes(r[0]) if isinstance(r, tuple) else type(r) for r in got] == [
            b"a" * 10, ObjectNotFound, ObjectChanged, b"b" * 20, b"a" * 10]
        assert got[0][1].etag == etag_a and "s3://bucket/many/gone.bin" in str(got[1])
        assert store.submit_gets([]).result(60) == []
    finally:
        client.close()
        store.close()


@pytest.mark.parametrize("kind", [LoopClient, HelperClient])
def test_gets_within_lanes_keep_that_many_out_across_calls(tmp_path, kind):
    """``Lanes``: GETs of several ``submit_gets`` calls share one bound, kept by the client's loop (the helper's
    for a ``HelperClient``): the server never has more than 3 waiting for their first byte at once and reaches 3
    (``max_waiting``; ``max_active`` may count one more whose last bytes are leaving after the client has them: it
    read 4 in a CI run), each result its own."""
    (tmp_path / "root").mkdir()
    server = Emulated(tmp_path / "root", latency=0.2)
    for i in range(12):
        server.write(f"lanes/{i:02d}.bin", bytes([i]) * (i + 1))
    store = server.store("lanes")
    client = kind(store.spec)
    store._client.get = lambda: client  # this test's client kind in this process  # type: ignore[method-assign]
    try:
        lanes = Lanes.new(3)
        futures = [store.submit_gets([(f"{i:02d}.bin", None), (f"{i + 1:02d}.bin", None)], lanes)
                   for i in range(0, 12, 2)]
        got = [bytes(data) for future in futures for data, _ in future.result(60)]
        assert got == [bytes([i]) * (i + 1) for i in range(12)]
        stats = server.server.stats.settled()
        assert stats["gets"] == 12 and stats["max_waiting"] == 3
    finally:
        client.close()
        store.close()
        server.stop()


def test_a_tree_is_listed_one_request_per_folder_at_once_as_one_listing_would(tmp_path):
    """``list_tree``: the same objects, in the same order, as ``list``; its folders' listings are in flight together
    (an ImageFolder prefix of 10 classes: 10 at once, not every page one after another)."""
    root = tmp_path / "root"
    names = ["t/top.jpg", "t/a/1.jpg", "t/a/sub/2 é.jpg", "t/a0/3.jpg", "t/b/4.jpg", "t/c/5.jpg", "t/c/6.jpg",
             "t/c/7.jpg", "t/d/8.jpg", "other/9.jpg"]
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(name.encode())
    srv = Emulated(root, page_size=2, latency=0.2)
    try:
        with srv.store("t") as store:
            whole = store.list()
            assert [i.key for i in whole] == sorted(n[2:] for n in names if n.startswith("t/"))
            before = srv.server.stats.settled()
            assert store.list_tree() == whole
            stats = srv.server.stats.settled()
            # the five folders at once: each held 200 ms before its first byte, so each on a connection of its own
            # (the client's idle ones, then new ones; a listing page after page keeps reusing one)
            assert stats["connections"] >= 5 > before["connections"]
            # t/'s level (6 entries: 3 pages of 2), then a/, a0/, b/, c/ (3 objects: 2 pages), d/
            assert stats["lists"] - before["lists"] == 3 + 1 + 1 + 1 + 2 + 1
    finally:
        srv.stop()


def test_weak_etags_read_and_still_detect_a_replaced_object(tmp_path):
    """A server sending weak ETags (W/"...": nginx or a CDN that compresses) compares If-Match strongly, so a GET
    carrying one was always refused (412: "the object changed") and a dataset there could not be read; the
    version is then checked by the ETag of the body received."""
    from support.imagesets import make_imagefolder

    import packer

    (tmp_path / "root").mkdir()
    srv = Emulated(tmp_path / "root", weak_etags=True)
    try:
        srv.write("web/a.bin", DATA)
        store = srv.http("web")
        etag = store.head("a.bin").etag
        assert etag is not None and etag.startswith('W/"')
        assert store.get_range("a.bin", 10, 20, etag=etag) == DATA[10:20]
        srv.write("web/a.bin", DATA[::-1])
        with pytest.raises(ObjectChanged, match="the object changed since it was opened"):
            store.get_range("a.bin", 10, 20, etag=etag)
        store.close()
        imgs = make_imagefolder(tmp_path / "imgs", classes=2, per_class=3)
        packer.convert(imgs, tmp_path / "root" / "ds.lmdb", workers=0, progress=False)
        local = packer.open_dataset(tmp_path / "root" / "ds.lmdb")
        with packer.open_dataset(f"{srv.server.endpoint}/bucket/ds.lmdb", cache_dir=tmp_path / "cache") as ds:
            assert [bytes(ds.read_payload(i)) for i in range(len(ds))] == [bytes(local.read_payload(i))
                                                                            for i in range(len(local))]
    finally:
        srv.stop()


def test_close_ends_a_request_another_thread_waits_on(emulated):
    """A store closed while another thread waits on its request (a shared store: a Dask task's uploader in a
    threaded worker, a tool's) ends that wait with CancelledError instead of leaving it waiting forever: the loop
    stopped before the cancelled request could hand its cancellation to the waiting thread's future."""
    import concurrent.futures
    import threading

    from support.storage_servers import wait_until

    store, key = _store(emulated)
    emulated.faults.add(Fault("slow", rate=4000), times=-1)  # the 100 KB body would take 25 s
    outcome: list[BaseException | bytes] = []

    def read() -> None:
        try:
            outcome.append(store.get_range(key, 0, 100_000))
        except BaseException as exc:  # noqa: BLE001  # what the waiting thread got is the point
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    wait_until(lambda: emulated.server.stats.snapshot()["active"] >= 1, "the request under way at the server")
    store.close()
    reader.join(30)
    assert not reader.is_alive(), "the waiting thread was left waiting"
    assert len(outcome) == 1 and isinstance(outcome[0], concurrent.futures.CancelledError)
