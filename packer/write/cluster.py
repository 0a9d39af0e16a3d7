"""Distributed conversion on a Dask cluster: one task per shard, the same bytes as a local run.

The driver scans (class folders spread over the cluster) and plans as ``convert`` does; each
task reads its shard's sources from shared storage, writes the shard into a private staging
folder ``<out>.partial/.staging/<shard>-<uuid>/``, moves the finished files into place and
journals the shard (``packer.write.journal``). A worker lost mid-shard leaves at most a staging
folder, never a half shard under the real names; Dask runs the task again elsewhere and the
next ``load_done_shards`` (or the end of the run) clears the leftovers. The driver checks each
returned shard against the plan and finishes (index, errors.json, manifest) like a local run.

An output in a bucket (``Output.shard_uploader``): each task writes its shard in a temporary folder of its
worker and uploads it from there (``ShardPutter``, ``remote_output.ShardUploader``: its objects, then its entry), so
workers need share no disk with the driver and no shard passes through it; the task returns only the shard's
record, and the driver puts the manifest last, as a local run does. A task re-run puts the same bytes again.

Dask is an optional extra (``pip install -e '.[dask]'`` in packer's checkout), imported only here and only when used.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packer._version import __version__
from packer.errors import MissingPackageError, OptionError, PackerError, arg, install_hint
from packer.formats import get_format
from packer.storage.node import pid_space, temp_suffix, temp_writer
from packer.sysinfo import pid_alive
from packer.write.journal import ShardResult, record_shard
from packer.write.options import ConvertOptions
from packer.write.output import ShardPutter
from packer.write.scan import scan_folder, walk_class
from packer.write.shards import BuildJob, ShardWriteError, prepare, progress_bar, write_shard
from packer.write.sources.base import FileReader, SourceReader
from packer.write.sources.records import ClassMapper, ScanResult, Walk

log = logging.getLogger(__name__)  # under "packer": the command line prints it, a library user routes it

STAGING_DIR = ".staging"
SHARD_FOLDER = "packer-shard-"  # a task's temporary folder on its worker (an output in a bucket): shard_folder
_RETRIES = 2  # re-runs after an exception in a task (a lost worker is re-run by the scheduler anyway)
_CLASSES_PER_TASK_TARGET = 8  # scan tasks per worker thread: balance without a task per tiny class


def _require_dask():
    try:
        import distributed
    except ImportError as exc:
        raise MissingPackageError(
            f"a Dask cluster ({arg('scheduler')}) needs Dask distributed, which is not installed: "
            f"{install_hint('dask')} (or pip install 'dask[distributed]')"
        ) from exc
    return distributed


@contextlib.contextmanager
def open_client(scheduler: str) -> Iterator[Any]:
    """A Dask client for ``tcp://HOST:PORT`` (a running scheduler) or ``local:N`` (a LocalCluster here).

    ``local:N`` starts N worker processes with one thread each and closes them on exit.
    """
    distributed = _require_dask()
    if scheduler.startswith("local:"):
        try:
            n = int(scheduler.split(":", 1)[1])
        except ValueError:
            n = 0
        if n <= 0:
            raise OptionError(f"{arg('scheduler', scheduler)}: local:N needs a positive number of workers, "
                              "e.g. local:4")
        import logging

        # dashboard_address=None would still bind the scheduler's HTTP server to *:8787 (and clash
        # with any other cluster on the machine): a free port on localhost instead. Dask's own logs stay quiet
        # (a worker's heartbeat cut by the cluster's close logs a traceback at ERROR): a task's failure comes
        # back through its future, and packer reports it.
        cluster = distributed.LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                                           dashboard_address="127.0.0.1:0", silence_logs=logging.CRITICAL)
        try:
            with distributed.Client(cluster) as client:
                yield client
        finally:
            cluster.close()
        return
    try:
        client = distributed.Client(scheduler, timeout="30s")
    except (OSError, TimeoutError) as exc:
        raise PackerError(
            f"{arg('scheduler', scheduler)}: cannot reach the Dask scheduler ({exc}); start one with "
            f"'dask scheduler' and workers with 'dask worker {scheduler}', or use local:N"
        ) from exc
    with client:
        yield client


def _worker_threads(client: Any) -> int:
    """Worker threads of the cluster; with none yet, say so and wait for the first worker to join."""
    if not client.nthreads():
        log.warning("no Dask workers at %s yet; waiting for one to join (dask worker %s --nthreads 1)",
                    client.scheduler.address, client.scheduler.address)
        client.wait_for_workers(1)
    return max(1, sum(client.nthreads().values()))


# ---------------------------------------------------------------- scan


def scan_on_cluster(client: Any, root: str | os.PathLike, *, skip_hidden: bool = False,
                    allow_empty: bool = False) -> ScanResult:
    """``scan_folder(root, ...)`` with the class folders walked by the cluster's workers; the same result."""
    return scan_folder(root, map_classes=class_mapper(client, skip_hidden), skip_hidden=skip_hidden,
                       allow_empty=allow_empty)


def class_mapper(client: Any, skip_hidden: bool = False) -> ClassMapper:
    """A ``scan_folder`` class mapper that walks the class folders on the cluster (``skip_hidden`` as the scan's).

    Each task walks a run of consecutive class folders and returns their sorted paths; they are
    merged in class order. A flat folder (no class folders) is walked here.
    """
    _require_dask()
    _worker_threads(client)

    def map_classes(folders: list[tuple[str, str]]):
        per_task = max(1, len(folders) // (_worker_threads(client) * _CLASSES_PER_TASK_TARGET))
        groups = [[(os.path.abspath(p), rel) for p, rel in folders[i : i + per_task]]
                  for i in range(0, len(folders), per_task)]
        token = uuid.uuid4().hex
        futures = [client.submit(_walk_classes, g, skip_hidden, key=f"packer-scan-{i:06d}-{token}", retries=_RETRIES)
                   for i, g in enumerate(groups)]
        try:
            for future in futures:  # in class order; later groups keep walking meanwhile
                yield from future.result()
                future.release()
        finally:
            client.cancel(futures)

    return map_classes


def _walk_classes(folders: list[tuple[str, str]], skip_hidden: bool) -> list[Walk]:
    """Dask task: walk_class for a run of class folders."""
    return [walk_class(path, rel, skip_hidden) for path, rel in folders]


# ---------------------------------------------------------------- shards


def convert_shard(root: str, partial: str, shard_id: int, items: list[tuple[str, int, Any]], options: dict,
                  on_error: str, version: str, reader: SourceReader | None = None,
                  uploader: ShardPutter | None = None) -> dict:
    """Dask task: prepare, write, move into place and journal one shard; with ``uploader`` (an output in a bucket),
    write it in a temporary folder of this worker and upload it instead (``partial`` is then not used).

    ``items``: (key, label, locator) records read by ``reader`` (default: files below ``root``).
    Returns ``{"result": ShardResult JSON, "uploaded": keys put}``, or ``{"error": message, "kind":
    "write"|"input"}`` for a problem that running again would not fix (so Dask does not retry it).
    """
    host = socket.gethostname()
    if version != __version__:
        return {"kind": "input", "error": f"worker {host} runs packer {__version__}, the driver {version}: "
                "install the same packer on every worker"}
    part, src = Path(partial), Path(root)
    reader = FileReader(src) if reader is None else reader
    unseen = f"cannot see the output folder {part}" if uploader is None and not part.is_dir() else reader.missing()
    if unseen is not None:
        shared = "the source" + (" and the output" if uploader is None else "")
        return {"kind": "input", "error": f"worker {host} {unseen}: {shared} must be on storage shared by the driver "
                "and every worker, under the same path"}
    opts = ConvertOptions.from_record(options)
    fmt = get_format(opts.format)
    keys: list[str] = []
    staging = part / STAGING_DIR / f"{shard_id:05d}-{uuid.uuid4().hex}"
    try:
        if uploader is None:
            with contextlib.suppress(FileExistsError):
                staging.parent.mkdir()  # not parents=True: never re-create a removed output folder
            staging.mkdir()
        else:
            staging = shard_folder(shard_id)
        records = reader.admitted(items) if reader.admitted_where_read else items
        samples = (prepare(reader, rel, label, opts, loc) for rel, label, loc in records)
        try:
            result, names = write_shard(staging, shard_id, len(items), samples, fmt, opts, on_error, src)
            if uploader is not None:
                result, keys = uploader.put(staging, result, names)
        except ShardWriteError as exc:
            return {"kind": "write", "error": exc.template}
        except PackerError as exc:  # a bad source under --on-error raise
            return {"kind": "input", "error": exc.template}
        if uploader is None:
            _move_into_place(staging, part, names)
            record_shard(part, result, names)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if uploader is not None:
            uploader.close()  # this task's client: a worker runs many tasks
    return {"result": result.to_json(), "uploaded": keys}


def shard_folder(shard_id: int) -> Path:
    """A temporary folder on this worker's disk for shard ``shard_id`` (an output in a bucket), named after its pid
    (``temp_suffix``); those of this user whose worker is gone (SIGKILLed mid-shard: its task's cleanup died with
    it, and Dask runs the task again elsewhere) are removed first, as nothing else would."""
    tmp = Path(tempfile.gettempdir())
    with os.scandir(tmp) as entries:
        left = [e.name for e in entries if e.name.startswith(SHARD_FOLDER) and ".tmp-" in e.name]
    for name in left:
        space, pid = temp_writer(name)
        try:
            mine = (tmp / name).lstat().st_uid == os.getuid()
        except OSError:
            continue
        if mine and pid is not None and space == pid_space() and not pid_alive(pid):
            shutil.rmtree(tmp / name, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{SHARD_FOLDER}{shard_id:05d}{temp_suffix()}-"))


def _move_into_place(staging: Path, partial: Path, names: list[str]) -> None:
    """Rename a closed shard's files from staging to their real names (subfolders included).

    Each rename is atomic, and the file under a real name is always complete: a second attempt
    at the same shard renames identical bytes over the first's.
    """
    for name in names:
        folder = partial  # created level by level: never re-create a removed output folder
        for part in Path(name).parent.parts:
            folder = folder / part
            with contextlib.suppress(FileExistsError):
                folder.mkdir()
        os.replace(staging / name, partial / name)


@dataclass
class DaskCluster:
    """Builds shards on the Dask cluster of ``client``: one task per shard."""

    client: Any

    def build_shards(self, job: BuildJob) -> dict[int, ShardResult]:
        """Write every shard not yet done on the cluster; returns all shards' results, checked against the plan."""
        client = self.client
        distributed = _require_dask()
        scan, partial, ranges, output = job.scan, job.partial, job.ranges, job.output
        root = os.path.abspath(scan.root)
        reader = scan.source_reader()
        opts = {**job.options.record(), "decoder": job.options.decoder}
        todo = job.todo()
        token = uuid.uuid4().hex
        threads = _worker_threads(client)
        in_flight = 2 * threads  # a bounded queue: the scheduler never holds every path list
        if len(ranges) < threads:
            log.warning("%d shard(s) for %d Dask worker threads: a task writes one shard, so most workers will "
                        "idle; choose a smaller shard size (--shard-size, shard_bytes=)", len(ranges), threads)

        def submit(sid: int):
            a, b = ranges[sid]
            records = scan.records(a, b)  # a packed source: its shards checked here, once (objects: by the task)
            records = records if reader.admitted_where_read else list(reader.admitted(records))
            future = client.submit(convert_shard, root, str(partial), sid, records, opts, job.on_error, __version__,
                                   reader, output.shard_uploader(sid), key=f"packer-shard-{sid:05d}-{token}",
                                   retries=_RETRIES)
            live[future.key] = (sid, future)
            return future

        results = dict(job.done)
        live: dict[str, tuple[int, Any]] = {}  # submitted and not yet collected: key -> (shard, future)
        queue = iter(todo)
        pending = distributed.as_completed([submit(sid) for sid in itertools.islice(queue, in_flight)])
        bar = progress_bar(len(scan), job.progress)
        bar.update(job.done_samples())
        try:
            for future in pending:
                sid, _ = live.pop(future.key)
                try:
                    reply = future.result()
                except Exception as exc:  # KilledWorker (lost too often), or the task's own bug after its retries
                    raise ShardWriteError(f"shard {sid} failed on the cluster ({type(exc).__name__}: {exc})") from exc
                future.release()
                if "error" in reply:
                    raise (ShardWriteError if reply["kind"] == "write" else PackerError)(reply["error"])
                result = ShardResult.from_json(reply["result"], f"shard {sid} from the cluster")
                uploaded = [str(k) for k in reply["uploaded"]]  # a shard put in a bucket: its journal entry at least
                check_result(result, sid, scan, ranges[sid], None if uploaded else partial)
                results[sid] = output.shard_put(result, uploaded)
                bar.update(ranges[sid][1] - ranges[sid][0])
                for nxt in queue:
                    pending.add(submit(nxt))
                    break
        except BaseException as exc:
            # convert() removes the output folder after a bad source under --on-error raise: let the
            # shards already running end first, so none writes into a folder being removed
            bad_source = isinstance(exc, PackerError) and not isinstance(exc, ShardWriteError)
            stopped = [f for _, f in live.values()]
            _stop(client, stopped, wait_running=bad_source)
            for future in stopped:  # a shard put meanwhile is this run's: discard() deletes it with the rest
                if future.status == "finished" and "uploaded" in (reply := future.result()):
                    output.shard_put(ShardResult.from_json(reply["result"], "a shard"), reply["uploaded"])
            raise
        finally:
            bar.close()
        shutil.rmtree(partial / STAGING_DIR, ignore_errors=True)
        return results


def _stop(client: Any, futures: list, wait_running: bool) -> None:
    """Cancel the shards not yet started; with ``wait_running``, wait for those running to end."""
    live = [f for f in futures if not f.done()]
    running = {str(k) for keys in client.processing().values() for k in keys} if wait_running else set()
    client.cancel([f for f in live if str(f.key) not in running])
    if running:
        _require_dask().wait([f for f in live if str(f.key) in running])


def check_result(result: ShardResult, sid: int, scan: ScanResult, span: tuple[int, int], partial: Path | None) -> None:
    """A shard written elsewhere must hold exactly its planned samples, in order, and its journaled files in
    ``partial`` (None: uploaded to a bucket, where the end of the run checks their sizes before the manifest)."""
    a, b = span
    failed = {e.path for e in result.errors}
    expected = [p for p in scan.rel_paths[a:b] if p not in failed]
    where = f"shard {sid} from the cluster"
    if result.shard_id != sid or result.rel_paths != expected or len(failed) + len(expected) != b - a:
        raise PackerError(f"{where}: holds other samples than planned (a worker with a different packer or source?)")
    if result.labels != scan.labels[a:b][[p not in failed for p in scan.rel_paths[a:b]]].tolist():
        raise PackerError(f"{where}: labels differ from the plan")
    if partial is None:
        return
    for f in result.shard.files:
        path = partial / f.name
        size = path.stat().st_size if path.is_file() else None
        if size != f.num_bytes:
            raise PackerError(f"{where}: {path} is {'missing' if size is None else f'{size} bytes'}, "
                              f"the worker journaled {f.num_bytes} (is {partial} on storage shared by all workers?)")
