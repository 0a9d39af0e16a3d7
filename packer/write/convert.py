"""The conversion driver: options -> scan -> plan -> build the shards -> index, errors.json, manifest -> swap.

Worker processes (``write.pool``) or Dask tasks (``write.cluster``) read, validate and (for raw
payloads) decode the source files; shards are written in dataset order, so the output depends
only on the source and the options, never on ``workers``. Everything goes into ``<out>.partial``
and is renamed to ``<out>`` after the manifest is written, so an interrupted run never leaves an
output that looks complete. Every source file is either packed or listed in ``errors.json``.

Nothing the run did not make is deleted (``write.output``); a ``.partial`` is reused or removed
only when its journal shows packer made it (``write.plan``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from packer._version import __version__
from packer.errors import PackerError, ResumableError
from packer.formats import get_format
from packer.layout.fields import parse_specs
from packer.layout.manifest import IMAGELESS, Manifest, holds_dataset, read_manifest
from packer.layout.partial import PARTIAL_SUFFIX, made_by_packer, read_swap
from packer.layout.report import ERRORS_NAME
from packer.write.cluster import DaskCluster, class_mapper
from packer.write.finish import in_storage_order, number_errors, seal, stored_index
from packer.write.fresh import source_digest, stale_reason
from packer.write.journal import ShardResult, SourceError, load_done_shards
from packer.write.options import ConvertOptions, make_options
from packer.write.output import check_destination, output_path, swap_into_place
from packer.write.plan import apply_order, load_or_make_plan
from packer.write.pool import LocalPool, PoolSettings
from packer.write.scan import IMG_EXTENSIONS, ScanResult
from packer.write.shards import BuildJob, ShardBuilder, ShardWriteError
from packer.write.sources.base import SourceOptions
from packer.write.sources.registry import scan_source
from packer.write.sources.select import PARTS


@dataclass
class ConvertResult:
    output: Path
    num_samples: int
    errors: list[SourceError]
    seconds: float
    bytes_read: int
    ignored: dict[str, int] = field(default_factory=dict)  # reason -> count (packer.write.scan)
    not_images: dict[str, int] = field(default_factory=dict)  # the "not an image" files by suffix
    reused: bool = False  # if_changed found the output up to date: nothing was converted
    rewritten: int | None = None  # --jpeg-restarts: samples stored rewritten (None: not asked, or not converted here)

    @property
    def files_per_second(self) -> float:
        return (self.num_samples + len(self.errors)) / max(self.seconds, 1e-9)


def convert(
    src: str | os.PathLike,
    output: str | os.PathLike | None = None,
    *,
    to: str = "lmdb",
    on_error: Literal["skip", "raise"] = "skip",
    workers: int | None = None,
    overwrite: bool = False,
    resume: bool = False,
    if_changed: bool = False,
    progress: bool = True,
    client: Any = None,
    pool: PoolSettings | None = None,
    source_type: str | None = None,
    root: str | os.PathLike | None = None,
    path_column: str | None = None,
    label_column: str | None = None,
    classes_file: str | os.PathLike | None = None,
    classes: Sequence[str] | None = None,
    label_key: str | None = None,
    image_column: str | None = None,
    **options: Any,
) -> ConvertResult:
    """Pack the records of source ``src`` into a dataset of format ``to``; see ``packer convert --help``.

    ``src`` is a folder of images, a list file, an archive or a packer dataset, chosen by what it is
    or by ``source_type`` (write/sources/registry.py); ``root``, ``path_column``, ``label_column`` and
    ``classes_file`` read list files (``label_key``: WebDataset's json label field; ``image_column``:
    a Hugging Face dataset's image column); ``classes`` keeps those classes only (renumbered in sorted order).
    ``options`` are the fields of ``ConvertOptions`` (``payload``, ``validate``, ``shard_bytes``,
    ``resize``, ``order``, ``tile``, ...): everything that decides the output's bytes, recorded in
    the manifest. ``payload`` defaults to ``encoded`` where the format stores it, else ``raw``
    (bmp, mosaic). With a Dask ``client`` the class folders are scanned and the shards written by
    the cluster's workers (packer.write.cluster; source and output on storage they share); the
    bytes are the same. ``pool`` tunes the local process pool (``write.pool.PoolSettings``; the
    defaults suit every run). ``overwrite`` replaces an existing packer dataset (nothing else);
    ``resume`` goes on with an interrupted run's ``<out>.partial``. ``if_changed``: an existing output
    converted with the same options from the same source files (sizes, mtimes) is reused, not converted
    again (``write.fresh``); a stale one is replaced only with ``overwrite``.
    """
    source = source_options(source_type, root, path_column, label_column, classes_file, classes, label_key,
                            image_column)
    return _convert(src, output_path(src, output, to), source, to, on_error, workers, overwrite, resume, progress,
                    client, pool, options, if_changed)


def convert_split(src: str | os.PathLike, output: str | os.PathLike | None = None, *, split: float, to: str = "lmdb",
                  **kwargs: Any) -> tuple[ConvertResult, ConvertResult]:
    """``convert`` into ``<output>-train`` and ``<output>-val``: per class, a seeded ``split`` fraction
    (``seed``, as for the order) goes to train, the rest to val (write/sources/select.py)."""
    out = output_path(src, output, to)
    names = ("source_type", "root", "path_column", "label_column", "classes_file", "classes", "label_key",
             "image_column")
    given = {k: kwargs.pop(k, None) for k in names}
    base = source_options(**given)
    common = ("on_error", "workers", "overwrite", "resume", "progress", "client", "pool", "if_changed")
    defaults: dict[str, Any] = {"on_error": "skip", "workers": None, "overwrite": False, "resume": False,
                                "progress": True, "client": None, "pool": None, "if_changed": False}
    run = {k: kwargs.pop(k, defaults[k]) for k in common}
    seed = int(kwargs.get("seed", 0))
    parts = []
    for part in PARTS:
        source = replace(base, split=float(split), split_seed=seed, part=part)
        parts.append(_convert(src, out.with_name(f"{out.name}-{part}"), source, to, options=dict(kwargs), **run))
    return parts[0], parts[1]


def source_options(source_type: str | None = None, root: str | os.PathLike | None = None,
                   path_column: str | None = None, label_column: str | None = None,
                   classes_file: str | os.PathLike | None = None,
                   classes: Sequence[str] | None = None, label_key: str | None = None,
                   image_column: str | None = None) -> SourceOptions:
    """SourceOptions from ``convert``'s keywords (paths made absolute: the manifest records them)."""
    if isinstance(classes, str):
        classes = [c for c in classes.split(",") if c]
    return SourceOptions(
        type=source_type, root=None if root is None else os.path.abspath(root), path_column=path_column,
        label_column=label_column, classes_file=None if classes_file is None else os.path.abspath(classes_file),
        classes=None if classes is None else tuple(str(c) for c in classes), label_key=label_key,
        image_column=image_column,
    )


def _convert(src: str | os.PathLike, out: Path, source: SourceOptions, to: str, on_error: str, workers: int | None,
             overwrite: bool, resume: bool, progress: bool, client: Any, pool: PoolSettings | None,
             options: dict[str, Any], if_changed: bool = False) -> ConvertResult:
    opts = make_options(to, **options)
    opts.check()
    if on_error not in ("skip", "raise"):
        raise PackerError(f"unknown error policy {on_error!r} (choose skip or raise)")
    fmt = get_format(to)
    if opts.shard_bytes is None:
        opts.shard_bytes = fmt.default_shard_bytes
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
        raise PackerError(f"workers {workers!r}: expected a count >= 0 (0: in this process; None: all cores)")
    workers = os.cpu_count() or 1 if workers is None else workers
    check_destination(src, out, overwrite or if_changed)  # if_changed: an existing dataset is looked at first

    started = time.perf_counter()
    hidden, empty = opts.skip_hidden, opts.allow_empty
    scanned = scan_source(src, source, None if client is None else class_mapper(client, hidden),
                          skip_hidden=hidden, allow_empty=empty)
    match_payload(scanned, opts, options.get("payload"))
    check_sequential(scanned, opts, client)
    # before any file is read: a change meanwhile makes the output stale. Folders only: other sources record
    # no fingerprint, so --if-changed always converts them again (never reuses a stale output)
    digest = source_digest(scanned) if scanned.source_type == "folder" else ""
    if if_changed and holds_dataset(out):
        why = stale_reason(out, opts, digest)
        if why is None:
            return _reused(scanned, out, started)
        if not overwrite:
            raise PackerError(f"{out}: out of date ({why}); add --overwrite to replace it")
    scan = apply_order(scanned, opts.order, opts.seed)
    partial = out.with_name(out.name + PARTIAL_SUFFIX)
    plan = load_or_make_plan(scan, out, partial, opts, resume)
    try:
        if read_swap(partial, out)[0]:  # a finished conversion whose move into place was interrupted
            return complete_swap(scan, partial, out, started)
        ranges = [(int(a), int(b)) for a, b in plan["shards"]]
        job = BuildJob(scan, partial, ranges, load_done_shards(partial, len(ranges), scan), opts, on_error,
                       progress, float(plan.get("mean_bytes", 0.0)))
        backend: ShardBuilder = LocalPool(workers, pool or PoolSettings()) if client is None else DaskCluster(client)
        shards = _build_shards(backend, job, out)
        return finish(scanned, partial, out, shards, opts, started, digest, source)
    except OSError as exc:  # the journal, meta/*.npy, errors.json, the manifest or the renames
        raise _failed_midway(f"{exc.filename or out}: {exc.strerror or exc}", partial) from exc
    except KeyboardInterrupt:
        raise KeyboardInterrupt(_interrupted(partial)) from None


def match_payload(scan: ScanResult, options: ConvertOptions, given: str | None) -> None:
    """A source of samples without an image (a packed dataset of payload none) converts to payload none, which
    no source of images does (it would drop them)."""
    if scan.source_reader().holds_images:
        if options.payload == IMAGELESS:
            raise PackerError(f"{scan.root}: holds images; --payload none would leave them out")
        return
    if given not in (None, IMAGELESS):
        raise PackerError(f"{scan.root}: its samples have no image, so --payload {given} has nothing to store: "
                          "leave --payload out")
    options.payload = IMAGELESS
    options.check()


def check_sequential(scan: ScanResult, options: ConvertOptions, client: Any) -> None:
    """A source read only in order (a compressed tar) can't be shuffled or spread over a cluster; pixels are
    never re-encoded."""
    if scan.source_reader().gives_pixels and options.payload != "raw":
        raise PackerError(f"{scan.root}: holds decoded pixels (raw payloads), which packer never re-encodes: "
                          "convert it with --payload raw (or convert the original images)")
    if not scan.source_reader().sequential:
        return
    if options.order != "source":
        raise PackerError(f"{scan.root}: a compressed archive can only be read in its stored order: add --order "
                          "source (or decompress it to a .tar, which is read in place in any order)")
    if client is not None:
        raise PackerError(f"{scan.root}: a compressed archive can only be read in order, by one process: convert "
                          "it without --scheduler (or decompress it to a .tar)")


def _build_shards(backend: ShardBuilder, job: BuildJob, out: Path) -> list[ShardResult]:
    """Every planned shard, the journaled ones reused: built by ``backend`` (a process pool, or a Dask cluster)."""
    try:
        results = backend.build_shards(job)
    except ShardWriteError as exc:
        raise _failed_midway(f"{out}: {exc}", job.partial) from exc
    except PackerError:  # a bad source file under --on-error raise: nothing worth resuming
        shutil.rmtree(job.partial, ignore_errors=True)
        raise
    return [results[i] for i in range(len(job.ranges))]


def finish(scan: ScanResult, partial: Path, out: Path, shards: list[ShardResult], options: ConvertOptions,
           started: float, digest: str = "", source: SourceOptions = SourceOptions()) -> ConvertResult:
    """Index, fields, error report and manifest (last), then the renames that make the dataset exist (``seal``).

    ``scan`` in the source's order (as scanned, before ``--order``): the index records where each of
    its samples is stored, so that ``ds[i]`` is the source's sample i whatever the storage order.
    """
    failed = number_errors([e for r in shards for e in r.errors], scan.rel_paths, scan.numbering())
    errors: list[SourceError] = locate_errors(scan, failed) + scan.errors
    shards = drop_empty_shards(partial, shards)
    index = stored_index(shards, scan.rel_paths, scan.numbering())
    manifest = Manifest(
        format=options.format,
        payload=options.payload,
        num_samples=len(index),
        classes=list(scan.classes),
        shards=[r.shard for r in shards],
        options=options.record(),
        source=os.path.abspath(scan.root),  # samples are ImageFolder's paths: os.path.join(source, rel)
        extensions=list(IMG_EXTENSIONS),
        source_digest=digest,
        source_type=scan.source_type,
        source_options=source.record(),
        source_records=scan.num_source_records,
        created_by=f"packer {__version__}",
        created_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    seal(partial, out, index, errors, scan.ignored, manifest, parse_specs(scan.field_specs),
         in_storage_order(index, scan.rel_paths, scan.fields), offered=len(scan), earlier=scan.earlier)
    return ConvertResult(out, len(index), errors, time.perf_counter() - started, int(index.nbytes.sum()),
                         dict(scan.ignored), dict(scan.not_images),
                         rewritten=sum(r.rewritten for r in shards) if options.jpeg_restarts else None)


def drop_empty_shards(partial: Path, shards: list[ShardResult]) -> list[ShardResult]:
    """The shards holding samples; the files of those whose every record failed are deleted. An empty shard
    would be a shard of no files for some formats (bmp) and of files no reader needs for the others: the
    manifest lists no shard without samples, so every format opens, iterates and verifies the same way."""
    for r in shards:
        if r.shard.num_samples > 0:
            continue
        for f in r.shard.files:  # then the folders they leave empty (n5's shard-*.n5/...), up to partial
            path = partial / f.name
            path.unlink(missing_ok=True)
            for folder in path.parents:
                if folder == partial or any(folder.iterdir()):
                    break
                folder.rmdir()
    return [r for r in shards if r.shard.num_samples > 0]


def locate_errors(scan: ScanResult, errors: list[SourceError]) -> list[SourceError]:
    """The errors of records that could not be packed, with where each record is in the source (line, member)."""
    if not errors or scan.locs is None:
        return errors
    reader, locs = scan.source_reader(), scan.locator_of()
    for e in errors:
        if not e.location and e.path in locs:
            e.location = reader.location(e.path, locs[e.path])
    return errors


def complete_swap(scan: ScanResult, partial: Path, out: Path, started: float) -> ConvertResult:
    """Finish the move into place that a killed run journaled: its output is complete, nothing is converted."""
    num_samples = read_manifest(partial).num_samples
    errors = _recorded_errors(partial)
    print(f"packer: {partial} holds a finished conversion; moving it into place", file=sys.stderr)
    swap_into_place(partial, out)
    return ConvertResult(out, num_samples, errors, time.perf_counter() - started, 0, dict(scan.ignored),
                         dict(scan.not_images))


def _reused(scan: ScanResult, out: Path, started: float) -> ConvertResult:
    """The result for an output ``if_changed`` found up to date: its own counts, nothing converted."""
    return ConvertResult(out, read_manifest(out).num_samples, _recorded_errors(out), time.perf_counter() - started,
                         0, dict(scan.ignored), dict(scan.not_images), reused=True)


def _recorded_errors(directory: Path) -> list[SourceError]:
    """The errors a finished conversion's ``errors.json`` lists."""
    path = directory / ERRORS_NAME
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        return [SourceError(str(e["path"]), str(e["reason"]), str(e.get("location", "")),
                            e["index"] if isinstance(e.get("index"), int) else None) for e in report["errors"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PackerError(f"{path}: damaged error report ({exc}); move {directory} away and convert again") from exc


def _failed_midway(message: str, partial: Path) -> PackerError:
    """The error for a failure after the output was started: resumable while ``partial`` holds the work."""
    if not made_by_packer(partial):
        return PackerError(message)
    return ResumableError(f"{message}; the work done so far is kept in {partial}: free space (or fix the "
                          f"problem), then run the same command with --resume")


def _interrupted(partial: Path) -> str:
    """What a Ctrl-C leaves: the message the CLI prints (once) as ``packer: ...``."""
    if not made_by_packer(partial):
        return "interrupted"
    return (f"interrupted; the work done so far is kept in {partial}: run the same command with --resume "
            f"to go on, or remove it")
