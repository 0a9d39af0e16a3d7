"""An output in object storage (``convert -o s3://bucket/imgs.lmdb``, ``Writer("s3://...")``): the ``Output`` whose
shards are written in a local staging folder, uploaded as each is finished and deleted there once uploaded, with
the manifest uploaded last.

In the bucket, under the dataset's prefix, an unfinished upload keeps ``.packer-partial/``: ``lock.json`` (made
with a conditional put, so a second writer is refused), ``plan.json`` and one journal entry per uploaded shard
(put after the shard's objects), so ``--resume`` goes on from any machine and uploads only what is missing. The
order (docs/remote.md, "Writing to a bucket"): lock and plan; with ``--overwrite`` the old manifest is deleted
before any of its objects is replaced (no mixed dataset ever opens); shards; meta/ and errors.json; the old
dataset's objects the new one does not have; the manifest; then the journal, the plan and the lock.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from packer.errors import OptionError, OutputExistsError, PackerError, arg
from packer.layout.fsutil import write_atomic
from packer.layout.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, Shard, load_manifest
from packer.layout.partial import JOURNAL_DIR, REMOTE_LOCK, REMOTE_PARTIAL, REMOTE_PLAN
from packer.layout.ranges import DTYPES, RANGE_FILES, PayloadRanges
from packer.layout.report import ERRORS_NAME, MAX_ERRORS_BYTES
from packer.layout.wdsexport import CLASSES_NAME, EXPORT_NAME
from packer.storage.client import ObjectInfo
from packer.storage.faults import ObjectExists, ObjectNotFound, RetryPolicy, StorageError
from packer.storage.store import ObjectStore
from packer.storage.url import parse
from packer.sysinfo import pid_alive
from packer.write.journal import ShardResult, changed_sources, record_shard, shard_entry
from packer.write.lock import OutputLock
from packer.write.output import Output, ShardPutter
from packer.write.ranges import shard_ranges
from packer.write.shards import ShardWriteError
from packer.write.sources.records import ScanResult

log = logging.getLogger(__name__)  # under "packer": the command line prints it, a library user routes it
JOURNAL_PREFIX = f"{REMOTE_PARTIAL}/{JOURNAL_DIR}/"
WRITABLE = ("s3", "gs", "az")  # schemes whose stores list, put (multipart) and put create-only
PENDING_SHARDS = 2  # finished shards uploading (or waiting to) while the next is written
MARKERS = (MANIFEST_NAME, EXPORT_NAME)  # what makes a prefix packer's: a dataset's manifest, an export's index
UPLOADS_IN_FLIGHT = 8  # files of one shard (n5, bmp: many) put at once; a large file is a multipart upload itself


def staging_root(staging_dir: str | os.PathLike | None) -> Path:
    """Where outputs in object storage are staged: ``staging_dir``, or the system's temporary folder (per user)."""
    if staging_dir is not None:
        return Path(os.path.abspath(staging_dir))
    return Path(tempfile.gettempdir()) / f"packer-staging-{os.getuid()}"


@dataclass(frozen=True)
class ShardUploader(ShardPutter):
    """Puts a shard written in a local folder into an output in a bucket, the one way (``RemoteOutput.shard_done``):
    checksums and payload ranges, the lock checked, an earlier run's entry for the shard deleted (``stale``), the
    shard's objects, then its journal entry. Small and picklable, so that a Dask task on a machine sharing no disk
    with the driver uploads the shard it wrote as the driver would; its repr names the URL only (the store's
    credentials never show)."""

    store: ObjectStore
    token: str  # the run's, in its lock: an upload taken over by another writer puts nothing more
    format: str = ""  # the plan's format and payload: the payload ranges a shard's entry records
    payload: str = ""
    stale: tuple[str, ...] = ()  # an earlier run's journal objects for this shard, deleted before it is put

    def __repr__(self) -> str:
        return f"ShardUploader({str(self.store.root)!r})"

    def put(self, folder: Path, result: ShardResult, names: list[str]) -> tuple[ShardResult, list[str]]:
        """Checksum and journal the shard in ``folder`` with its payload ranges (read while its files are here: the
        meta/ ranges files a local conversion writes at the end), upload its files (none for a shard without
        samples), what is journaled beside its entry (a Writer's field spool, ``shard-NNNNN.fields/``), then its
        entry; its files in ``folder`` are deleted once uploaded. Returns the result and the keys put."""
        (folder / JOURNAL_DIR).mkdir(exist_ok=True)
        result = record_shard(folder, result, names)
        entry = shard_entry(folder, result.shard_id)
        if result.shard.num_samples > 0 and self._keep_ranges(folder, result):
            write_atomic(entry, result.to_json())
        self.check_lock()
        for key in self.stale:
            try:
                self.store.delete(key)
            except ObjectNotFound:
                pass
            except StorageError as exc:  # a failed upload (kept for resume), not a bad source
                raise ShardWriteError(f"deleting {key} failed ({exc})") from None
        keys = self.upload(folder, names) if result.shard.num_samples > 0 else []
        beside = entry.with_suffix(".fields")
        if beside.is_dir():
            spool = [p.relative_to(folder).as_posix() for p in sorted(beside.rglob("*")) if p.is_file()]
            keys += self.upload(folder, spool, prefix=REMOTE_PARTIAL + "/")
        keys.append(self.upload_one(JOURNAL_PREFIX + entry.name, entry))
        for name in names:
            _remove(folder, name)
        return result, keys

    def close(self) -> None:
        self.store.close()

    def _keep_ranges(self, folder: Path, result: ShardResult) -> bool:
        """Record in ``result`` (its journal entry: a ``resume`` keeps them) the payload ranges of the shard whose
        files are in ``folder`` (``write.ranges``); False where the format stores no plain ranges."""
        got = shard_ranges(folder, result.shard, self.format, self.payload, np.asarray(result.nbytes, dtype=np.int64))
        if got is None:
            return False
        result.ranges = {key: getattr(got, key).tolist() for key in RANGE_FILES}
        return True

    def check_lock(self) -> None:
        """Still this run's lock in the bucket: an ``overwrite`` or ``resume`` from another machine may have taken
        the upload over (the lock then names that writer), and this run must then put nothing more there."""
        try:
            holder = json.loads(self.store.get(REMOTE_LOCK))
        except (ObjectNotFound, ValueError) as exc:
            holder = {"error": str(exc)}
        except StorageError as exc:  # a failed upload (kept for resume), not a bad source
            raise ShardWriteError(f"reading {REMOTE_LOCK} failed ({exc})") from None
        if holder.get("token") != self.token:
            who = (f"pid {holder.get('pid')} on {holder.get('host')}" if "pid" in holder
                   else "its lock is gone")
            raise ShardWriteError(f"{self.store.root}: another conversion took this upload over meanwhile ({who}); "
                                  "this run puts nothing more there")

    def upload(self, folder: Path, names: list[str], prefix: str = "") -> list[str]:
        """Put the files ``names`` (relative to ``folder``) as ``<prefix><name>``, 8 at once; the keys put."""
        with ThreadPoolExecutor(max_workers=min(UPLOADS_IN_FLIGHT, max(1, len(names)))) as pool:
            futures = [pool.submit(self.upload_one, prefix + name, folder / name) for name in names]
            return [future.result() for future in futures]

    def upload_one(self, key: str, path: Path) -> str:
        try:
            self.store.put(key, path)
        except StorageError as exc:
            raise ShardWriteError(f"uploading {key} failed ({exc})") from None
        return key


class RemoteOutput(Output):
    """A dataset written to ``url``: ``folder`` is a local staging folder (keyed by the URL and endpoint) holding the
    run's journal and the shards not uploaded yet; the journal is mirrored under ``<url>/.packer-partial/``.

    ``overwrite``: replace a packer dataset or WebDataset export (or an unfinished upload) there; ``resume``: go on
    with an unfinished upload. Anything else at the prefix is refused, never deleted. ``marker``: the object that
    makes the output exist, put last (``manifest.json``; an export's ``packer-wds.json``)."""

    max_pending = PENDING_SHARDS  # uploading or waiting while the next is written: about three staged at once

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None,
                 staging_dir: str | os.PathLike | None = None, *, overwrite: bool = False, resume: bool = False,
                 policy: RetryPolicy | None = None, marker: str = MANIFEST_NAME) -> None:
        self.location = parse(url)
        if self.location.scheme not in WRITABLE:
            raise OptionError(f"{self.location}: packer writes datasets to {', '.join(s + '://' for s in WRITABLE)} "
                              "only (an http(s) server offers no listing or create-only put to write through): write "
                              "to a folder and publish it yourself")
        self.store = ObjectStore(self.location, storage_options, policy)
        endpoint = str((storage_options or {}).get("endpoint") or os.environ.get("AWS_ENDPOINT_URL", ""))
        key = hashlib.sha256(f"{self.location}\0{endpoint}".encode()).hexdigest()[:16]
        super().__init__(staging_root(staging_dir) / key / (self.location.name or "dataset"))
        self.overwrite, self.resume = overwrite, resume
        self.marker = marker  # the object put last, that makes the output exist: a manifest, an export's index
        self.found: dict[str, ObjectInfo] = {}  # the prefix's objects when checked (packer's, or nothing)
        self.uploaded: set[str] = set()  # keys this run put
        self._plan: dict[str, Any] | None = None
        self._token = secrets.token_hex(8)  # this run's, in its lock: a writer whose lock was taken over stops
        self.uploader = ShardUploader(self.store, self._token)  # meta/, errors.json, the manifest, an export's tars
        self._ranges: dict[tuple[tuple[str, str], ...], PayloadRanges] = {}  # uploaded shards' payload ranges
        self._finished: tempfile.TemporaryDirectory | None = None  # a finished dataset's manifest, fetched
        self._present: dict[str, int] | None = None  # the prefix's objects and sizes when a resume looked
        self._taken: set[str] = set()  # the journal's objects in the bucket when this run took the upload over

    # ---- names in messages and results

    @property
    def shown(self) -> str:
        return str(self.location)

    @property
    def result_name(self) -> str:
        return str(self.location)

    @property
    def kept_in(self) -> str:
        return f"{self.location} (an unfinished upload: its journal under {REMOTE_PARTIAL}/)"

    @property
    def remedy(self) -> str:
        return "fix the problem (the link, the credentials, the bucket's quota; or free local space for staging)"

    def where(self, key: str) -> str:
        return str(self.location.join(key))

    # ---- before anything is written

    def check(self, src: str | os.PathLike, replaces: bool) -> None:
        """What is at the prefix: nothing; a packer dataset or export (replaced only with ``overwrite``; left to the
        sink where ``replaces`` says it looks at one of its own kind first: ``resume``); an unfinished upload (gone
        on with by ``resume``, replaced by ``overwrite``); anything else is refused, even with ``overwrite``."""
        self.found = {o.key: o for o in self.store.list()}
        if not self.found:
            return
        packers, unfinished = [m for m in MARKERS if m in self.found], self.unfinished()
        if not (packers or unfinished):
            some = ", ".join(sorted(self.found)[:3]) + (" ..." if len(self.found) > 3 else "")
            raise OutputExistsError(f"{self.location}: holds {len(self.found)} object(s) ({some}) but no packer "
                                    f"{MANIFEST_NAME}: not a packer dataset; packer replaces only a dataset, even with "
                                    f"{arg('overwrite', True)}: choose another {arg('output')}, or remove them "
                                    "yourself")
        if unfinished:
            self.check_free()
            if not (self.resume or self.overwrite):
                raise OutputExistsError(self.left_over_reason())
        elif self.overwrite:
            self._check_only_the_datasets(packers)
        elif not (replaces and self.complete()):  # else: the sink says there is nothing to resume, or why not
            raise OutputExistsError(f"{self.location}: already exists (use {arg('overwrite', True)} to replace it)")

    def _check_only_the_datasets(self, markers: list[str]) -> None:
        """A dataset (or export) to replace holds only the objects its manifest (index) names, and errors.json:
        anything else under the prefix is not packer's, so the whole of it is refused rather than any of it
        deleted."""
        named: set[str] = set(markers)
        for marker in markers:
            try:
                named |= set(_named_objects(marker, json.loads(self._get_listed(marker))))
            except (ObjectNotFound, ValueError, KeyError, TypeError) as exc:
                raise OutputExistsError(f"{self.where(marker)}: unreadable ({exc}), so packer cannot tell its "
                                        "objects from others: remove the dataset yourself") from None
        other = sorted(k for k in self.found if k not in named | {ERRORS_NAME}
                       and not k.startswith(REMOTE_PARTIAL + "/"))
        if other:
            some = ", ".join(other[:3]) + (" ..." if len(other) > 3 else "")
            index = " and ".join(markers)
            raise OutputExistsError(f"{self.location}: holds {len(other)} object(s) its {index} does not "
                                    f"name ({some}); packer replaces only what it wrote, even with "
                                    f"{arg('overwrite', True)}: move them away, or choose another {arg('output')}")

    def complete(self) -> bool:
        """Whether the prefix held a finished output of this kind when checked (its ``marker``: a dataset's manifest,
        an export's index), and no unfinished upload."""
        return self.marker in self.found and not self.unfinished()

    def finished(self) -> tuple[Manifest, Path, list[str]]:
        """The dataset at the prefix (``complete``): its manifest and errors.json fetched into a local temporary
        folder (removed with this object), and its objects missing or of another size in the listing."""
        if self._finished is None:
            self._finished = tempfile.TemporaryDirectory(prefix="packer-finished-")
        folder = Path(self._finished.name)
        for name in (MANIFEST_NAME, ERRORS_NAME):
            if name in self.found:
                try:
                    (folder / name).write_bytes(self._get_listed(name))
                except StorageError as exc:
                    raise PackerError(f"{self.where(name)}: cannot be read ({exc})") from None
        manifest = load_manifest(folder, self.where(MANIFEST_NAME), lambda listed: len(self.found))
        return manifest, folder, manifest.size_problems({k: o.size for k, o in self.found.items()}, self.where)

    def _get_listed(self, key: str) -> bytes:
        """A small object found at the prefix (a manifest, an export's index, errors.json), refused before it is
        fetched when its listed size is beyond any such file's (someone's object there is not read into memory)."""
        limit = MAX_ERRORS_BYTES if key == ERRORS_NAME else MAX_MANIFEST_BYTES
        if self.found[key].size > limit:
            raise PackerError(f"{self.where(key)}: implausibly large ({self.found[key].size} bytes, at most {limit} "
                              "expected)")
        return self.store.get(key)

    def unfinished(self) -> bool:
        """Whether the prefix held an unfinished upload's lock or plan when checked."""
        return REMOTE_LOCK in self.found or REMOTE_PLAN in self.found

    def staged_bytes(self, needed: float, per_shard: float) -> float:
        return min(needed, (PENDING_SHARDS + 2) * per_shard)

    # ---- the plan and the lock (Output's interface, read by write.plan and the Writer)

    def left_over(self) -> bool:
        return self.resume and REMOTE_PLAN in self.found

    def made_by_packer(self) -> bool:
        return REMOTE_PLAN in self.found

    def plan(self) -> dict[str, Any] | None:
        if self._plan is None and REMOTE_PLAN in self.found:
            try:
                self._plan = json.loads(self.store.get(REMOTE_PLAN))
            except ObjectNotFound:
                return None
            except ValueError as exc:
                raise PackerError(f"{self.where(REMOTE_PLAN)}: damaged conversion plan ({exc}); convert again with "
                                  f"{arg('overwrite', True)}") from exc
        return self._plan

    def check_free(self) -> None:
        """A PackerError when the unfinished upload's writer runs on this machine still (its lock names it);
        a writer on another machine cannot be seen: ``resume`` and ``overwrite`` take its place."""
        super().check_free()
        if REMOTE_LOCK not in self.found:
            return
        try:
            holder = json.loads(self.store.get(REMOTE_LOCK))
            pid, host = int(holder["pid"]), str(holder["host"])
        except (ObjectNotFound, ValueError, KeyError, TypeError):
            return
        if host == socket.gethostname() and pid != os.getpid() and pid_alive(pid):
            raise PackerError(f"{self.location}: in use by a conversion running as pid {pid} on this machine "
                              f"(since {holder.get('since', '?')}); wait for it to finish")

    def left_over_reason(self) -> str:
        writer = ""
        try:
            holder = json.loads(self.store.get(REMOTE_LOCK))
            writer = f" (written by pid {holder['pid']} on {holder['host']} since {holder['since']})"
        except (StorageError, ValueError, KeyError, TypeError):
            pass
        return (f"{self.location}: an unfinished upload{writer}: an interrupted conversion, or one running now; go on "
                f"with it by running the same command with {arg('resume', True)}, or replace it with "
                f"{arg('overwrite', True)} (never while its writer still runs)")

    def start(self, plan: dict[str, Any]) -> OutputLock:
        """The staging folder with ``plan`` (locked), then in the bucket the lock (refused if another writer made
        one meanwhile), the plan, and with ``overwrite`` the old manifest deleted before any object is replaced."""
        self._restage()
        lock = super().start(plan)
        try:
            self._lock_bucket(take_over=self.unfinished() and (self.overwrite or self.resume))
            for key in self.found:  # an earlier upload's journal: not this plan's
                if key.startswith(JOURNAL_PREFIX):
                    self.store.delete(key)
            self.store.put(REMOTE_PLAN, json.dumps(plan, indent=1).encode())
            self.uploaded.add(REMOTE_PLAN)  # discard() removes it too: no plan is left naming no upload
            for marker in MARKERS:  # with overwrite: the old dataset (export) no longer opens from here on
                if self.overwrite and marker in self.found:
                    self.store.delete(marker)
        except BaseException:
            lock.release()
            raise
        self._plan = plan
        return lock

    def take(self) -> OutputLock:
        """Go on with the unfinished upload: a new staging folder holding its plan and journal, the lock taken."""
        plan = self.plan()
        assert plan is not None  # left_over() said so
        self._restage()
        lock = super().start(plan)
        try:
            self._lock_bucket(take_over=True)
            for key in self.found:  # entries, and what is journaled beside them (a Writer's field spools)
                if key.startswith(JOURNAL_PREFIX):
                    self._taken.add(key)
                    path = self.folder / JOURNAL_DIR / key[len(JOURNAL_PREFIX):]
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(self.store.get(key))
        except BaseException:
            lock.release()
            raise
        return lock

    def not_resumable(self, why: str, again: str = "convert again") -> str:
        return (f"{self.location}: {why}, so the unfinished upload can't be resumed; {again} with "
                f"{arg('overwrite', True)} (it replaces the unfinished upload)")

    def _restage(self) -> None:
        """An empty staging folder: what an earlier run left there is not needed (the bucket holds the journal)."""
        super().check_free()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _lock_bucket(self, take_over: bool) -> None:
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "token": self._token}
        try:
            self.store.put(REMOTE_LOCK, json.dumps(holder).encode(), create=not take_over)
        except ObjectExists:
            raise OutputExistsError(f"{self.location}: another conversion began writing here meanwhile; "
                                    f"{self.left_over_reason()}") from None
        self.uploaded.add(REMOTE_LOCK)

    def swapping(self) -> bool:
        return False  # nothing is renamed in a bucket: the manifest, put last, makes the dataset

    # ---- shards

    def done_shards(self, num_shards: int, scan: ScanResult) -> dict[int, ShardResult]:
        """The journaled shards whose objects are all in the bucket at their sizes and whose sources are unchanged;
        the others are written and uploaded again."""
        reader, locs = scan.source_reader(), (scan.locator_of() if scan.locs is not None else {})
        done: dict[int, ShardResult] = {}
        for shard_id in range(num_shards):
            entry = shard_entry(self.folder, shard_id)
            if not entry.is_file():
                continue
            result = ShardResult.from_json(entry.read_text(encoding="utf-8"), str(entry))
            if not changed_sources(reader, locs, result) and self.kept_shard(result):
                done[shard_id] = result
            else:
                entry.unlink()
        return done

    def kept_shard(self, result: ShardResult) -> bool:
        """Whether a journaled shard's objects are all in the bucket at their recorded sizes (one listing per run)
        and its recorded payload ranges lie inside them; its ranges are then kept for the end (``recorded_ranges``:
        its files are not here to read again)."""
        if self._present is None:
            self._present = {o.key: o.size for o in self.store.list()}
        uploaded = result.shard.num_samples == 0 or all(self._present.get(f.name) == f.num_bytes
                                                        for f in result.shard.files)
        if not (uploaded and _ranges_fit(result)):
            return False
        self._remember_ranges(result)
        return True

    def shard_done(self, result: ShardResult, names: list[str]) -> ShardResult:
        """Upload the shard written in the staging folder (``ShardUploader.put``: its objects, then its journal
        entry) and record it as this run's."""
        result, keys = self.shard_uploader(result.shard_id).put(self.folder, result, names)
        return self.shard_put(result, keys)

    def shard_uploader(self, shard_id: int) -> ShardUploader:
        """What puts shard ``shard_id`` here, in this process or in a Dask task elsewhere; an earlier run's journal
        objects for the shard (``take``) go with it, deleted before its own are put: an entry in the bucket always
        describes the objects there."""
        options = (self._plan or {}).get("options", {})
        stem = JOURNAL_PREFIX + shard_entry(Path(), shard_id).stem + "."
        stale = tuple(sorted(k for k in self._taken if k.startswith(stem)))
        self._taken.difference_update(stale)
        return replace(self.uploader, format=str(options.get("format")), payload=str(options.get("payload")),
                       stale=stale)

    def shard_put(self, result: ShardResult, keys: list[str]) -> ShardResult:
        """A shard ``shard_uploader`` put: its keys are this run's (``discard`` deletes them), its payload ranges
        kept for the end (``recorded_ranges``)."""
        self.uploaded.update(keys)
        self._remember_ranges(result)
        return result

    def _remember_ranges(self, result: ShardResult) -> None:
        if result.ranges is not None:
            self._ranges[_shard_key(result.shard)] = PayloadRanges(
                *(np.asarray(result.ranges[key], dtype=DTYPES[key]) for key in RANGE_FILES))

    def recorded_ranges(self, shard: Shard) -> PayloadRanges | None:
        return self._ranges.get(_shard_key(shard))

    # ---- the end

    def files_done(self, names: list[str]) -> None:
        """Upload finished files (an export's tars, as each is closed) and delete them in the staging folder."""
        self.uploader.check_lock()
        self.uploaded.update(self.uploader.upload(self.folder, names))
        for name in names:
            _remove(self.folder, name)

    def seal(self, write_last: Callable[[Path], None]) -> None:
        """Upload meta/ and errors.json (an export's classes.txt), delete the old output's objects the new one does
        not have, put the marker (the manifest, or an export's index: the last object), then remove the journal,
        the plan and the lock."""
        rest = [p.relative_to(self.folder).as_posix() for p in sorted(self.folder.rglob("*"))
                if p.is_file() and p.relative_to(self.folder).parts[0] != JOURNAL_DIR]
        self.uploaded.update(self.uploader.upload(self.folder, rest))
        write_last(self.folder)
        files = _named_objects(self.marker, json.loads((self.folder / self.marker).read_text(encoding="utf-8")))
        present = {o.key: o for o in self.store.list()}
        wrong = [n for n, size in files.items() if n not in present or size is not None and present[n].size != size]
        if wrong:
            raise ShardWriteError(f"{self.where(wrong[0])}: missing or of another size after the upload "
                                  f"({len(wrong)} object(s)); was the prefix written by someone else meanwhile?")
        keep = {*files, ERRORS_NAME, self.marker}
        for key in sorted(set(self.found) - keep):  # the old output's: the prefix held packer's objects only
            if not key.startswith(REMOTE_PARTIAL + "/"):
                self.store.delete(key)
        self.uploader.check_lock()
        self.uploaded.add(self.uploader.upload_one(self.marker, self.folder / self.marker))
        self._clear_partial(present)
        shutil.rmtree(self.folder, ignore_errors=True)

    def _clear_partial(self, present: Mapping[str, ObjectInfo]) -> None:
        """The journal, then the plan, then the lock: the upload is no longer unfinished."""
        keys = sorted(k for k in present if k.startswith(JOURNAL_PREFIX))
        for key in [*keys, REMOTE_PLAN, REMOTE_LOCK]:
            try:
                self.store.delete(key)
            except ObjectNotFound:
                pass

    def discard(self) -> None:
        """Nothing of the run is kept: the objects it put and, the prefix being packer's, the ones found there."""
        for key in sorted((set(self.found) | self.uploaded) - {REMOTE_LOCK}) + [REMOTE_LOCK]:
            try:
                self.store.delete(key)
            except ObjectNotFound:
                pass
        shutil.rmtree(self.folder, ignore_errors=True)

    def finish_swap(self) -> None:
        raise PackerError(f"{self.location}: nothing to move into place (an upload is finished by its manifest)")


def _named_objects(marker: str, data: Mapping[str, Any]) -> dict[str, int | None]:
    """The objects a manifest names (shard files, meta/) or an export's index does (its tars; ``classes.txt``, whose
    size it does not record: None), and their sizes."""
    if marker == EXPORT_NAME:
        files: dict[str, int | None] = {s["name"]: int(s["num_bytes"]) for s in data["shards"]}
        files[CLASSES_NAME] = None
        return files
    files = {f["name"]: int(f["num_bytes"]) for s in data["shards"] for f in s["files"]}
    files.update({f["name"]: int(f["num_bytes"]) for f in data.get("meta_files", [])})
    return files


def _ranges_fit(result: ShardResult) -> bool:
    """Whether a journal entry's payload ranges (if any) lie inside its shard's files: an entry whose ranges point
    elsewhere (edited or damaged in the bucket) is not taken, its shard is written again and its ranges read anew
    (kept, they would be the dataset's meta/ ranges, and the finished dataset would refuse to open)."""
    if result.ranges is None:
        return True
    sizes = [f.num_bytes for f in result.shard.files]
    return all(0 <= j < len(sizes) and 0 <= offset and offset + n <= sizes[j]
               for j, offset, n in zip(result.ranges["file"], result.ranges["offset"], result.nbytes, strict=True))


def _shard_key(shard: Shard) -> tuple[tuple[str, str], ...]:
    """A finished shard as its files name it (each file's name and sha256)."""
    return tuple((f.name, f.sha256) for f in shard.files)


def _remove(folder: Path, name: str) -> None:
    """Delete an uploaded file and the folders it leaves empty (n5's ``shard-*.n5/...``), up to ``folder``."""
    path = folder / name
    path.unlink(missing_ok=True)
    for parent in path.parents:
        if parent == folder or any(parent.iterdir()):
            break
        parent.rmdir()
