"""Object-storage servers the storage tests start and stop themselves, on port 0 of localhost: moto's S3 server
(pure Python, as s3fs's own tests use) and packer's emulated store (S3 subset and plain HTTP Range, with fault
injection at the server). Never a mocked client object. The fixtures are in tests/storage/conftest.py."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from packer.storage.client import StoreSpec
from packer.storage.emulate import EmulatedStore, FaultPlan
from packer.storage.faults import RetryPolicy
from packer.storage.store import ObjectStore

CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region": "us-east-1"}
# quick retries and short timeouts so fault tests end fast; the counts are what the tests check
FAST_POLICY = RetryPolicy(retries=3, backoff=0.01, max_backoff=0.05, retry_timeout=20, timeout=2, connect_timeout=2)


@contextmanager
def moto_server() -> Iterator[str]:
    """moto's ThreadedMotoServer on 127.0.0.1, a free port; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer("127.0.0.1", 0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def make_bucket(endpoint: str, name: str) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                      aws_secret_access_key="testing")
    s3.create_bucket(Bucket=name)


def s3_store(endpoint: str, url: str, policy: RetryPolicy = FAST_POLICY) -> ObjectStore:
    """An ObjectStore for ``url`` (s3://bucket/prefix) served at ``endpoint``."""
    return ObjectStore(url, {**CREDENTIALS, "endpoint": endpoint}, policy)


class Emulated:
    """A running emulated store over ``root`` with a fault plan the test fills."""

    def __init__(self, root: Path, **kw) -> None:
        self.root = root
        self.faults = FaultPlan()
        self.server = EmulatedStore(root, "bucket", faults=self.faults, **kw).start()

    def store(self, prefix: str = "", policy: RetryPolicy = FAST_POLICY) -> ObjectStore:
        return s3_store(self.server.endpoint, f"s3://bucket/{prefix}", policy)

    def http(self, prefix: str = "", policy: RetryPolicy = FAST_POLICY) -> ObjectStore:
        return ObjectStore(f"{self.server.endpoint}/bucket/{prefix}", None, policy)

    def write(self, key: str, data: bytes) -> None:
        """Replace an object the way a writer would: a new file renamed over the old (a new ETag)."""
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def stop(self) -> None:
        self.server.stop()


@contextmanager
def one_object(root: Path, data: bytes, latency: float) -> Iterator[Emulated]:
    """An emulated store serving ``data`` as ``s3://bucket/ds/shard.bin`` with ``latency`` before each first byte."""
    root.mkdir()
    srv = Emulated(root, latency=latency)
    srv.write("ds/shard.bin", data)
    try:
        yield srv
    finally:
        srv.stop()


def together(ctx, target, args: tuple, n: int = 3) -> list:
    """``n`` processes of start method context ``ctx`` running ``target(*args, start, out)`` released at once (by
    ``start.wait()``: a barrier, passed once all ``n`` wait there; an event set after starting them released each as
    soon as it had imported, a second apart under load), each putting one result on ``out``: the results, the
    processes joined."""
    start, out = ctx.Barrier(n, timeout=120), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, start, out)) for _ in range(n)]
    for p in procs:
        p.start()
    results = [out.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(60)
    return results


def user_environment(monkeypatch, endpoint: str) -> None:
    """Credentials and endpoint in ``AWS_*``, as a user's shell holds them for a real bucket."""
    for name, value in {"AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "key", "AWS_REGION": "us-east-1",
                        "AWS_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(name, value)


def serve_copy(dataset: Path, root: Path, name: str | None = None) -> Emulated:
    """``dataset`` copied under ``root`` and served by a fresh emulated store (its counts the caller's) as
    s3://bucket/<name> (its own name by default); the caller stops the server."""
    shutil.copytree(dataset, root / (name or dataset.name))
    return Emulated(root)


def served_as_a_user(dataset: Path, root: Path, monkeypatch, name: str | None = None) -> Emulated:
    """``serve_copy``, the environment set as a user's would be."""
    server = serve_copy(dataset, root, name)
    user_environment(monkeypatch, server.server.endpoint)
    return server


def open_served(server: Emulated, cache_dir: Path, url: str, **kw):
    """``open_dataset(url)`` through ``server`` with test credentials, a 64 MB cache limit unless given."""
    from packer.read.dataset import open_dataset

    kw.setdefault("cache_limit", "64MB")
    return open_dataset(url, cache_dir=cache_dir, storage_options={**CREDENTIALS, "endpoint": server.server.endpoint},
                        **kw)


def s3_spec(endpoint: str, url: str, policy: RetryPolicy = FAST_POLICY) -> StoreSpec:
    """The StoreSpec a downloader client sends for ``url`` (s3://bucket/prefix) served at ``endpoint``."""
    return StoreSpec(url, {**CREDENTIALS, "endpoint": endpoint}, policy)


def upload(store: ObjectStore, folder: Path) -> list[str]:
    """Every file below ``folder`` put under the store's root by its relative name; the names."""
    names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    for name in names:
        store.put(name, folder / name)
    return names


def gone(pid: int) -> bool:
    """No process ``pid`` any more (a zombie counts as gone: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_until(check, what: str, tries: int = 600, pause: float = 0.05) -> None:
    """Poll ``check()`` until true (bounded: a failure names ``what``, never a timing)."""
    import time

    for _ in range(tries):
        if check():
            return
        time.sleep(pause)
    raise AssertionError(f"never happened: {what}")


def read_all(ds, how: str) -> None:
    """Every sample of ``ds`` read in the main process (``main``), by 2 forked DataLoader workers (``fork``) or 2
    ThreadLoader threads (``threads``): where a fault must surface the same."""
    import packer
    from packer.read.threaded import ThreadLoader

    if how == "main":
        ds.__getitems__(list(range(len(ds))))
    elif how == "fork":
        from torch.utils.data import DataLoader

        list(DataLoader(ds, batch_size=6, num_workers=2, collate_fn=packer.collate, multiprocessing_context="fork"))
    else:
        list(ThreadLoader(ds, batch_size=6, num_threads=2))


def killed_upload(cmd: list[str], env: dict, journal: Path, server: Emulated, shards: int = 3) -> None:
    """Run the conversion ``cmd`` into the emulated store, SIGKILL it once ``shards`` journal entries are in the
    bucket, then wait until the server has answered every request the killed writer had sent."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: journal.is_dir() and len(list(journal.glob("shard-*.json"))) >= shards
                   or proc.poll() is not None, f"{shards} shards uploaded")
        assert proc.poll() is None, "the conversion ended before it could be killed"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    server.server.stats.closed()
