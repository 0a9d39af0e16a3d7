"""A conversion on a real 2-process Dask LocalCluster into a bucket (the emulated store): each task uploads its own
shard from its worker, the driver puts the manifest last; the same dataset as a local conversion; a task failing
or a worker killed mid-upload; resume on the cluster; the credentials never in what Dask shows."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import pytest
from support.dask_cluster import cluster_client  # noqa: F401  # the fixture `client`: the module's cluster
from support.storage_servers import CREDENTIALS, Emulated, killed_upload, wait_until

distributed = pytest.importorskip("distributed", reason="needs the packer[dask] extra (make install adds it)")
psutil = pytest.importorskip("psutil")

import test_cluster  # noqa: E402
from test_cluster import REPO, SHARD, _cli, same_dataset  # noqa: E402

from packer import PackerError, convert, open_dataset  # noqa: E402
from packer.layout.manifest import read_manifest  # noqa: E402
from packer.layout.partial import REMOTE_LOCK, REMOTE_PARTIAL  # noqa: E402
from packer.storage.emulate import Fault  # noqa: E402
from packer.write.remote_output import RemoteOutput  # noqa: E402

URL = "s3://bucket/ds.lmdb"
source, reference = test_cluster.source, test_cluster.reference  # fixtures: the source and its local conversion
SECRET = "SeCrEt-never-shown-0123456789"


class Writers:
    """The emulated store's ``on_write``: each write request (method, key) with the process that sent it, found by
    its connection among this test's own processes (the driver, the workers), as "driver", "worker" or "other";
    ``kill``: the key whose first PUT by a worker kills that worker (SIGKILL) before it is answered."""

    def __init__(self, client, kill: str | None = None) -> None:
        self.roles = {os.getpid(): "driver", **{pid: "worker" for pid in client.run(os.getpid).values()}}
        self.kill, self.killed = kill, 0
        self.log: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()

    def __call__(self, method: str, key: str, peer: tuple[str, int]) -> None:
        pid = self.sender(peer)
        role = self.roles.get(pid, "other") if pid is not None else "other"
        with self.lock:
            self.log.append((method, key, role))
            if method == "PUT" and key == self.kill and role == "worker" and pid is not None and not self.killed:
                self.killed = pid
                os.kill(pid, signal.SIGKILL)  # mid-upload: the request is sent, never answered

    def sender(self, peer: tuple[str, int]) -> int | None:
        for pid in self.roles:
            try:
                conns = psutil.Process(pid).net_connections(kind="tcp")
            except psutil.NoSuchProcess:
                continue
            if any(c.laddr and (c.laddr.ip, c.laddr.port) == tuple(peer[:2]) for c in conns):
                return pid
        return None

    def puts(self) -> list[tuple[str, str]]:
        """(key below the dataset's prefix, role) of every PUT, in order."""
        with self.lock:
            return [(key.split("/", 1)[1], role) for method, key, role in self.log if method == "PUT"]


def _executing(dask_worker) -> int:
    return dask_worker.state.executing_count  # cancelled tasks whose thread still runs included


def tasks_ended(client) -> None:
    """Every task has ended on the workers: a task the driver cancelled is released by the scheduler at once (no
    longer in ``processing()``) while its thread still runs and may still put its shard and journal entry."""
    wait_until(lambda: not any(client.run(_executing).values()), "every task's thread ended on the workers")


def _options(srv: Emulated) -> dict:
    return {**CREDENTIALS, "aws_secret_access_key": SECRET, "endpoint": srv.server.endpoint}


def _convert(source: Path, srv: Emulated, client, tmp_path: Path, **kw):
    return convert(source, URL, client=client, shard_bytes=SHARD, progress=False, storage_options=_options(srv),
                   staging_dir=tmp_path / "staging", **kw)


def _shard_files(dataset: Path) -> set[str]:
    return {f.name for s in read_manifest(dataset).shards for f in s.files}


def _manifest_last(puts: list[tuple[str, str]]) -> None:
    """The manifest is put once, by the driver, after every other object of the dataset."""
    keys = [key for key, _ in puts if not key.startswith(REMOTE_PARTIAL + "/")]
    assert keys[-1] == "manifest.json" and keys.count("manifest.json") == 1
    assert dict(puts)["manifest.json"] == "driver"


def _same_samples(srv: Emulated, reference: Path, cache: Path) -> None:
    want = open_dataset(reference)
    with open_dataset(URL, cache_dir=cache, storage_options=_options(srv)) as ds:
        assert (ds.classes, ds.targets) == (want.classes, want.targets) and len(ds) == len(want)
        for i in range(len(ds)):
            assert bytes(ds.read_payload(i)) == bytes(want.read_payload(i))


def test_each_worker_uploads_its_shards_and_the_driver_the_manifest_last(client, source, reference, tmp_path):
    (tmp_path / "root").mkdir()
    writers = Writers(client)
    srv = Emulated(tmp_path / "root", on_write=writers)
    try:
        res = _convert(source, srv, client, tmp_path)
        _same_samples(srv, reference, tmp_path / "cache")
    finally:
        srv.stop()
    dataset = tmp_path / "root" / "ds.lmdb"
    same_dataset(dataset, reference)  # every object's bytes, errors.json and meta/ included; the manifest bar time
    assert res.output == URL and len(res.errors) >= 4 and not (dataset / REMOTE_PARTIAL).exists()
    puts = writers.puts()
    shards = _shard_files(dataset)
    assert len(shards) >= 5 and shards <= {key for key, _ in puts}
    assert {role for key, role in puts if key in shards or key.startswith(f"{REMOTE_PARTIAL}/journal/")} == {"worker"}
    _manifest_last(puts)
    assert not [p for p in (tmp_path / "staging").rglob("*") if p.is_file()]  # the driver staged nothing left


def test_a_failed_upload_leaves_no_manifest_and_resume_on_the_cluster_puts_only_the_rest(client, source, reference,
                                                                                         tmp_path):
    (tmp_path / "root").mkdir()
    writers = Writers(client)
    srv = Emulated(tmp_path / "root", on_write=writers)
    dataset = tmp_path / "root" / "ds.lmdb"
    victim = sorted(_shard_files(reference))[3]
    try:
        srv.faults.add(Fault("status", status=403, code="AccessDenied"), key=f"ds.lmdb/{victim}", method="PUT",
                       times=-1)
        with pytest.raises(PackerError, match="resume=True") as failed:
            _convert(source, srv, client, tmp_path, order="source")
        assert victim in str(failed.value) and SECRET not in str(failed.value)
        tasks_ended(client)
        assert not (dataset / "manifest.json").exists() and (dataset / REMOTE_LOCK).is_file()
        journal = dataset / REMOTE_PARTIAL / "journal"
        kept = [read for e in journal.glob("shard-*.json") if (read := e.read_text())]
        srv.faults.clear()
        writers.log.clear()
        _convert(source, srv, client, tmp_path, order="source", resume=True)
    finally:
        srv.stop()
    done = {name for text in kept for name in _names(text)}
    again = {key for key, _ in writers.puts()} & _shard_files(dataset)
    assert victim in again and again == _shard_files(dataset) - done  # only what was missing
    local = tmp_path / "local.lmdb"
    convert(source, local, workers=0, shard_bytes=SHARD, progress=False, order="source")
    same_dataset(dataset, local)
    _manifest_last(writers.puts())


def test_a_store_error_in_a_tasks_lock_check_keeps_the_work_for_resume(client, source, reference, tmp_path):
    """A task checks the lock in the bucket before it puts its shard: a store failing that read (a 500 after the
    client's retries) is a failed upload, as a failed PUT is: the shards put so far are kept and resume finishes
    (before: taken for a bad source, the run deleted everything it had put)."""
    (tmp_path / "root").mkdir()
    dataset = tmp_path / "root" / "ds.lmdb"
    lock = f"ds.lmdb/{REMOTE_LOCK}"

    armed: list[str] = []

    def fail_lock_reads_after_a_shard(method: str, key: str, peer: tuple[str, int]) -> None:
        if method == "PUT" and key.startswith(f"ds.lmdb/{REMOTE_PARTIAL}/journal/") and not armed:
            armed.append(key)
            srv.faults.add(Fault("status", status=500, code="InternalError"), key=lock, method="GET", times=-1)

    srv = Emulated(tmp_path / "root", on_write=fail_lock_reads_after_a_shard)
    try:
        with pytest.raises(PackerError, match="resume=True") as failed:
            _convert(source, srv, client, tmp_path, order="source")
        assert SECRET not in str(failed.value)
        tasks_ended(client)
        assert not (dataset / "manifest.json").exists() and list((dataset / REMOTE_PARTIAL / "journal").glob("*"))
        srv.faults.clear()
        _convert(source, srv, client, tmp_path, order="source", resume=True)
    finally:
        srv.stop()
    local = tmp_path / "local.lmdb"
    convert(source, local, workers=0, shard_bytes=SHARD, progress=False, order="source")
    same_dataset(dataset, local)


def _names(entry: str) -> list[str]:
    import json

    return [f["name"] for f in json.loads(entry)["shard"]["files"]]


def test_a_worker_killed_mid_upload_is_replaced_and_no_manifest_comes_before_the_shards(client, source, reference,
                                                                                        tmp_path):
    (tmp_path / "root").mkdir()
    victim = sorted(_shard_files(reference))[2]
    writers = Writers(client, kill=f"ds.lmdb/{victim}")
    srv = Emulated(tmp_path / "root", on_write=writers)
    try:
        _convert(source, srv, client, tmp_path)
    finally:
        client.wait_for_workers(2, timeout=120)
        srv.stop()
    assert writers.killed, "no worker was killed: the test did not test anything"
    puts = writers.puts()
    assert [key for key, _ in puts].count(victim) >= 2  # the killed attempt, then the task run again
    _manifest_last(puts)
    same_dataset(tmp_path / "root" / "ds.lmdb", reference)


def test_the_shard_folder_of_a_worker_killed_mid_upload_is_removed_by_a_later_task(source, reference, tmp_path):
    """A task writes its shard in a temporary folder of its worker: SIGKILLed mid-upload, its own cleanup dies with
    it, so a later task on that machine removes the folder (before: left there for good, a shard each time). The
    workers' temporary folder is this test's (TMPDIR of a cluster of its own)."""
    scratch = tmp_path / "workers-tmp"
    scratch.mkdir()
    (tmp_path / "root").mkdir()
    victim = sorted(_shard_files(reference))[2]
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None,
                                  env={"TMPDIR": str(scratch)}) as cluster, distributed.Client(cluster) as client:
        writers = Writers(client, kill=f"ds.lmdb/{victim}")
        srv = Emulated(tmp_path / "root", on_write=writers)
        try:
            _convert(source, srv, client, tmp_path)
            assert writers.killed, "no worker was killed: the test did not test anything"
            wait_until(lambda: not psutil.pid_exists(writers.killed), "the killed worker reaped")
            client.wait_for_workers(2, timeout=120)
            _convert(source, srv, client, tmp_path, overwrite=True)  # later tasks, on this machine
        finally:
            srv.stop()
    assert not list(scratch.glob("packer-shard-*"))
    same_dataset(tmp_path / "root" / "ds.lmdb", reference)


class _Shown(distributed.diagnostics.plugin.WorkerPlugin):
    """What a worker holds of each task it runs: its key, its call and its arguments' reprs (what Dask's dashboard
    and its "Compute Failed ... args:" log lines show; the scheduler holds them serialized)."""

    name = "packer-test-shown"

    def __init__(self) -> None:
        self.shown: list[str] = []

    def setup(self, worker) -> None:
        self.worker = worker

    def transition(self, key, start, finish, **kwargs) -> None:
        if finish == "executing":
            task = self.worker.state.tasks.get(key)
            spec = task.run_spec if task is not None else None
            self.shown.append(f"{key} {spec!r} " + ", ".join(repr(a) for a in getattr(spec, "args", ())))


def _shown_on(dask_worker) -> list[str]:
    return dask_worker.plugins[_Shown.name].shown


def test_the_credentials_never_show_in_what_dask_sees(client, source, tmp_path):
    (tmp_path / "root").mkdir()
    srv = Emulated(tmp_path / "root")
    client.register_plugin(_Shown())
    try:
        with distributed.get_task_stream(client) as stream:
            _convert(source, srv, client, tmp_path)
        shown = "\n".join(line for lines in client.run(_shown_on).values() for line in lines)
        output = RemoteOutput(URL, _options(srv))
        uploader = repr(output.shard_uploader(0))
    finally:
        client.unregister_worker_plugin(_Shown.name)
        srv.stop()
    assert "ShardUploader('s3://bucket/ds.lmdb')" in shown and "packer-shard-" in shown  # the tasks were seen
    logs = [client.get_scheduler_logs(), client.get_worker_logs()]
    for text in (shown, uploader, str(stream.data), str(logs)):
        assert SECRET not in text
    stored = [p.read_bytes() for p in (tmp_path / "root").rglob("*") if p.is_file()]
    assert stored and not [b for b in stored if SECRET.encode() in b]


def test_cli_converts_into_a_bucket_on_a_scheduler(client, source, reference, tmp_path):
    (tmp_path / "root").mkdir()
    srv = Emulated(tmp_path / "root")
    try:
        opts = [a for k, v in _options(srv).items() for a in ("--storage-option", f"{k}={v}")]
        res = _cli("convert", str(source), "-o", URL, "--shard-size", str(SHARD), "--scheduler",
                   client.scheduler.address, "--staging-dir", str(tmp_path / "staging"), *opts, "-q")
    finally:
        srv.stop()
    assert res.returncode == 1, res.stderr  # 1: some source files were bad (listed in errors.json)
    assert "not packed, see errors.json" in res.stderr and SECRET not in res.stderr + res.stdout
    same_dataset(tmp_path / "root" / "ds.lmdb", reference)


def test_a_bad_source_under_on_error_raise_leaves_nothing_in_the_bucket(client, source, tmp_path):
    (tmp_path / "root").mkdir()
    srv = Emulated(tmp_path / "root")
    try:
        with pytest.raises(PackerError, match=r"weird/(empty|truncated|random|broken_link|unreadable)\.jpg"):
            _convert(source, srv, client, tmp_path, on_error="raise", order="source")  # the bad class last
        tasks_ended(client)
        puts = srv.server.stats.settled()["puts"]
    finally:
        srv.stop()
    assert puts > 3  # the lock, the plan and shards were put: the shards uploaded by tasks are deleted as well
    assert not [p for p in (tmp_path / "root").rglob("*") if p.is_file()]


def test_overwrite_on_the_cluster_replaces_a_dataset_as_a_local_run_does(client, source, reference, tmp_path):
    (tmp_path / "root").mkdir()
    srv = Emulated(tmp_path / "root")
    try:
        convert(source, URL, workers=0, to="memmap", progress=False, storage_options=_options(srv))  # another one
        with pytest.raises(PackerError, match="already exists"):
            _convert(source, srv, client, tmp_path)
        _convert(source, srv, client, tmp_path, overwrite=True)
    finally:
        srv.stop()
    same_dataset(tmp_path / "root" / "ds.lmdb", reference)  # and nothing of the memmap dataset left


def test_a_driver_killed_mid_run_leaves_no_manifest_and_resume_on_the_cluster_finishes(client, source, reference,
                                                                                       tmp_path):
    (tmp_path / "root").mkdir()
    srv = Emulated(tmp_path / "root", bandwidth=100_000)  # a slow link: the driver is killed with shards to go
    dataset = tmp_path / "root" / "ds.lmdb"
    opts = [a for k, v in _options(srv).items() for a in ("--storage-option", f"{k}={v}")]
    cmd = [sys.executable, "-m", "packer", "convert", str(source), "-o", URL, "--shard-size", str(SHARD),
           "--scheduler", client.scheduler.address, "--staging-dir", str(tmp_path / "staging"), *opts, "-q"]
    try:
        killed_upload(cmd, {**os.environ, "PYTHONPATH": str(REPO)}, dataset / REMOTE_PARTIAL / "journal", srv)
        tasks_ended(client)
        assert not (dataset / "manifest.json").exists() and (dataset / REMOTE_LOCK).is_file()
        _convert(source, srv, client, tmp_path, resume=True)
    finally:
        srv.stop()
    same_dataset(dataset, reference)
    assert not (dataset / REMOTE_PARTIAL).exists()
