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
import logging
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from packer._version import __version__
from packer.errors import DatasetError, Interrupted, OptionError, OutputExistsError, PackerError, ResumableError, arg
from packer.formats import get_format
from packer.layout.fields import parse_specs
from packer.layout.manifest import IMAGELESS, Manifest, holds_dataset, read_manifest
from packer.layout.partial import PARTIAL_SUFFIX, made_by_packer, read_swap
from packer.layout.report import ERRORS_NAME
from packer.progress import progress_wanted
from packer.storage.url import refuse_urls
from packer.write.cluster import DaskCluster, class_mapper
from packer.write.finish import in_storage_order, number_errors, seal, stored_index
from packer.write.fresh import source_digest, stale_reason
from packer.write.journal import ShardResult, SourceError, load_done_shards
from packer.write.options import ConvertOptions, make_options
from packer.write.output import check_destination, check_replaceable, output_path, swap_into_place
from packer.write.plan import apply_order, load_or_make_plan
from packer.write.pool import LocalPool, PoolSettings
from packer.write.scan import IMG_EXTENSIONS
from packer.write.shards import BuildJob, ShardBuilder, ShardWriteError
from packer.write.sources.base import SourceOptions
from packer.write.sources.records import ScanResult
from packer.write.sources.registry import open_source, scan_opened
from packer.write.sources.select import PARTS

log = logging.getLogger(__name__)  # under "packer": the command line prints it, a library user routes it


@dataclass
class ConvertResult:
    """What a conversion did (``convert``, ``export_wds``): the output, what was packed, what was left out and why."""

    output: Path
    num_samples: int
    errors: list[SourceError]
    seconds: float
    bytes_read: int
    ignored: dict[str, int] = field(default_factory=dict)  # reason -> count (packer.write.scan)
    not_images: dict[str, int] = field(default_factory=dict)  # the "not an image" files by suffix
    reused: bool = False  # if_changed found the output up to date: nothing was converted
    nothing_to_resume: str = ""  # resume found this conversion finished already (how it knows): nothing was done
    rewritten: int | None = None  # --jpeg-restarts: samples stored rewritten (None: not asked, or not converted here)

    @property
    def files_per_second(self) -> float:
        return (self.num_samples + len(self.errors)) / max(self.seconds, 1e-9)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON values (``packer convert --json``'s entries, docs/library.md)."""
        return {"output": str(self.output), "num_samples": self.num_samples, "num_errors": len(self.errors),
                "errors": [e.to_json() for e in self.errors], "ignored": dict(self.ignored),
                "not_images": dict(self.not_images), "seconds": self.seconds, "bytes_read": self.bytes_read,
                "reused": self.reused, "nothing_to_resume": self.nothing_to_resume, "rewritten": self.rewritten}


def convert(
    src: str | os.PathLike, output: str | os.PathLike | None = None, *, to: str = "lmdb",
    on_error: Literal["skip", "raise"] = "skip", workers: int | None = None, overwrite: bool = False,
    resume: bool = False, if_changed: bool = False, progress: bool | None = None, client: Any = None,
    pool: PoolSettings | None = None, source_type: str | None = None, root: str | os.PathLike | None = None,
    path_column: str | None = None, label_column: str | None = None, classes_file: str | os.PathLike | None = None,
    classes: Sequence[str] | None = None, label_key: str | None = None, image_column: str | None = None,
    **options: Any,
) -> ConvertResult:
    """Pack the records of ``src`` into a new dataset of format ``to`` (what ``packer convert`` runs).

    Everything is written into ``<output>.partial`` and renamed into place at the end, so an interrupted run
    never leaves an output that looks complete; every source record is packed or listed, with its reason, in
    the output's ``errors.json``. The output depends only on the source and the options, never on ``workers``.

    Args:
        src: what to pack: a folder of images (ImageFolder's ``root/<class>/<image>``, or flat), a list file
            (``.csv``, ``.tsv``, ``.txt``, ``.lst``), an archive (``.tar``, ``.tar.gz``, ``.zip``), WebDataset
            shards, a Hugging Face dataset (a ``save_to_disk`` folder or Parquet), an MXNet ``.rec`` or a packer
            dataset, told apart by what it is (or by ``source_type``; docs/sources.md).
        output: the dataset directory to create; None: ``<src>.<to>`` beside the source.
        to: the format: ``lmdb``, ``hdf5``, ``memmap``, ``bmp``, ``mosaic``, ``recordio``, ``n5``, ``pth`` or
            ``safetensors`` (``packer.FORMATS``; docs/formats-*.md).
        on_error: ``"skip"`` lists a record that cannot be packed in errors.json and goes on; ``"raise"`` stops
            at the first (nothing is kept).
        workers: processes that read and validate the sources (None: all cores; 0: this process).
        overwrite: replace an existing packer dataset at ``output``, once the new one is complete (anything else
            there is refused).
        resume: go on with an interrupted run of the same source and options (its finished shards are checked
            and kept; the result is identical to an uninterrupted run).
        if_changed: reuse an existing output converted with the same options from the same source files (names,
            sizes, modification times) instead of converting again; a stale one is replaced only with
            ``overwrite``.
        progress: a progress bar on stderr: None (default) when stderr is a terminal, True always, False never.
        client: a ``dask.distributed.Client``: the cluster's workers scan the class folders and write the shards
            (source and output on storage they all share); the bytes are the same as a local run's.
        pool: settings of the local process pool (``packer.write.pool.PoolSettings``); the defaults suit every
            run.
        source_type: the kind of ``src`` when what it is does not say: ``folder``, ``list``, ``archive``,
            ``webdataset``, ``hf``, ``recordio`` or ``packed`` (docs/sources.md).
        root: a list file's folder: the paths it lists are relative to it.
        path_column: a ``.csv``/``.tsv`` list's column of paths (default ``path``).
        label_column: a list's or a Hugging Face dataset's column of labels (default ``label``).
        classes_file: class names, one per line, in label order, for a list of integer labels.
        classes: keep these classes only (names, or one comma-separated string), renumbered in sorted order.
        label_key: a WebDataset source's field of its ``.json`` member that holds the label.
        image_column: a Hugging Face dataset's image column (default ``image``).
        **options: what decides the output's bytes, recorded in the manifest: ``payload`` (``"encoded"``, the
            source files' bytes, the default where the format stores them; ``"raw"``, decoded RGB pixels),
            ``validate`` (``"full"`` decodes every image, the default; ``"header"``; ``"none"``), ``shard_bytes``
            (about this many bytes per shard; default the format's), ``resize`` (``"S"`` short side or ``"HxW"``,
            raw payloads only, lossy), ``resize_mode`` (``"stretch"`` or ``"fit"`` for HxW), ``upscale``,
            ``compression`` (raw payloads, a codec the format offers), ``order`` (``"shuffled"``, the default, or
            ``"source"``: ImageFolder's order on disk), ``seed`` (of the shuffled order), ``skip_hidden``,
            ``allow_empty`` (as ImageFolder's), ``jpeg_restarts`` (a lossless JPEG rewrite for faster crops),
            ``decoder``, and the format's own (mosaic: ``tile``, ``grid``, ``codec``, ``quality``; n5:
            ``n5_block``). ``packer convert --help`` explains each as its flag.

    Returns:
        A ``ConvertResult``: the output, the samples packed, every record left out with its reason, timings.

    Raises:
        InputNotFoundError: ``src`` does not exist (a ``FileNotFoundError``).
        OutputExistsError: ``output`` holds something packer won't replace (a ``FileExistsError``).
        OptionError: an option out of its range, or options that do not go together (a ``ValueError``).
        ResumableError: a failure part-way (a full disk); the work is kept for ``resume=True``.
    """
    refuse_urls("packer convert", src, output)
    source = source_options(source_type, root, path_column, label_column, classes_file, classes, label_key,
                            image_column)
    return _convert(src, output_path(src, output, to), source, to, on_error, workers, overwrite, resume, progress,
                    client, pool, options, if_changed)


def convert_split(src: str | os.PathLike, output: str | os.PathLike | None = None, *, split: float, to: str = "lmdb",
                  **kwargs: Any) -> tuple[ConvertResult, ConvertResult]:
    """``convert`` into ``<output>-train`` and ``<output>-val``: per class, a seeded ``split`` fraction
    (``seed``, as for the order) goes to train, the rest to val (write/sources/select.py)."""
    refuse_urls("packer convert", src, output)
    out = output_path(src, output, to)
    names = ("source_type", "root", "path_column", "label_column", "classes_file", "classes", "label_key",
             "image_column")
    given = {k: kwargs.pop(k, None) for k in names}
    base = source_options(**given)
    common = ("on_error", "workers", "overwrite", "resume", "progress", "client", "pool", "if_changed")
    defaults: dict[str, Any] = {"on_error": "skip", "workers": None, "overwrite": False, "resume": False,
                                "progress": None, "client": None, "pool": None, "if_changed": False}
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
             overwrite: bool, resume: bool, progress: bool | None, client: Any, pool: PoolSettings | None,
             options: dict[str, Any], if_changed: bool = False) -> ConvertResult:
    opts = make_options(to, **options)
    opts.check()
    progress = progress_wanted(progress)  # decided here, where the bar is drawn (not in the workers)
    if on_error not in ("skip", "raise"):
        raise OptionError(f"unknown error policy {on_error!r} (choose skip or raise)")
    fmt = get_format(to)
    if opts.shard_bytes is None:
        opts.shard_bytes = fmt.default_shard_bytes
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
        raise OptionError(f"workers {workers!r}: expected a count >= 0 (0: in this process; None: all cores)")
    workers = os.cpu_count() or 1 if workers is None else workers
    check_destination(src, out, overwrite or if_changed or resume)  # those look at an existing dataset first

    started = time.perf_counter()
    hidden, empty = opts.skip_hidden, opts.allow_empty
    opened = open_source(src, source)
    check_order(opened.sequential(), opened.path, opts.order, client)  # before a scan that would inflate it all
    scanned = scan_opened(opened, None if client is None else class_mapper(client, hidden),
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
            raise OutputExistsError(f"{out}: out of date ({why}); add {arg('overwrite', True)} to replace it")
    partial = out.with_name(out.name + PARTIAL_SUFFIX)
    if resume and not (overwrite or if_changed) and os.path.lexists(out):
        if holds_dataset(out) and not os.path.lexists(partial):  # finished: nothing was interrupted
            return _nothing_to_resume(scanned, out, opts, digest, started)
        check_replaceable(out, overwrite=False)  # refused, as without --resume
    scan = apply_order(scanned, opts.order, opts.seed)
    plan, lock = load_or_make_plan(scan, out, partial, opts, resume)
    with lock:  # held until the dataset is in place (or the run ends): a second run is refused, naming this one
        try:
            if read_swap(partial, out)[0]:  # a finished conversion whose move into place was interrupted
                return complete_swap(scan, partial, out, started)
            ranges = [(int(a), int(b)) for a, b in plan["shards"]]
            job = BuildJob(scan, partial, ranges, load_done_shards(partial, len(ranges), scan), opts, on_error,
                           progress, float(plan.get("mean_bytes", 0.0)))
            backend: ShardBuilder = (LocalPool(workers, pool or PoolSettings()) if client is None
                                     else DaskCluster(client))
            shards = _build_shards(backend, job, out)
            return finish(scanned, partial, out, shards, opts, started, digest, source)
        except PackerError:  # explained already (some kinds are OSErrors: an output that appeared meanwhile)
            raise
        except OSError as exc:  # the journal, meta/*.npy, errors.json, the manifest or the renames
            raise _failed_midway(f"{exc.filename or out}: {exc.strerror or exc}", partial) from exc
        except KeyboardInterrupt:
            raise Interrupted(_interrupted(partial)) from None


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
        raise OptionError(f"{scan.root}: holds decoded pixels (raw payloads), which packer never re-encodes: "
                          f"convert it with {arg('payload', 'raw')} (or convert the original images)")
    check_order(scan.source_reader().sequential, scan.root, options.order, client)


def check_order(sequential: bool, root: Path, order: str, client: Any) -> None:
    """Refuse an order (or a cluster) a source read only in its stored order can't give: asked of the source
    before its scan, which streams the whole archive, and of its reader after."""
    if not sequential:
        return
    if order != "source":
        raise OptionError(f"{root}: a compressed archive can only be read in its stored order: add "
                          f"{arg('order', 'source')} (or decompress it to a .tar, which is read in place in any order)")
    if client is not None:
        raise OptionError(f"{root}: a compressed archive can only be read in order, by one process: convert "
                          f"it without {arg('client', cli='scheduler')} (or decompress it to a .tar)")


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
         in_storage_order(index, scan.rel_paths, scan.fields), earlier=scan.earlier)
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
    log.info("%s holds a finished conversion; moving it into place", partial)
    swap_into_place(partial, out)
    return ConvertResult(out, num_samples, errors, time.perf_counter() - started, 0, dict(scan.ignored),
                         dict(scan.not_images))


def _reused(scan: ScanResult, out: Path, started: float) -> ConvertResult:
    """The result for an output ``if_changed`` found up to date: its own counts, nothing converted."""
    return ConvertResult(out, read_manifest(out).num_samples, _recorded_errors(out), time.perf_counter() - started,
                         0, dict(scan.ignored), dict(scan.not_images), reused=True)


def _nothing_to_resume(scan: ScanResult, out: Path, options: ConvertOptions, digest: str,
                       started: float) -> ConvertResult:
    """``resume`` where the conversion finished: nothing is done, and the result says so (``nothing_to_resume``);
    a dataset of other options or other source files is refused, naming the difference."""
    why = stale_reason(out, options, digest, sources_too=bool(digest))
    if why is not None:
        raise OutputExistsError(f"{out}: a complete dataset, so there is nothing to resume, and it is not this "
                                f"conversion's ({why}): add {arg('overwrite', True)} to convert again")
    result = _reused(scan, out, started)
    result.reused = False
    result.nothing_to_resume = "the same options" + (", the same source files, sizes and times" if digest else "")
    return result


def _recorded_errors(directory: Path) -> list[SourceError]:
    """The errors a finished conversion's ``errors.json`` lists."""
    path = directory / ERRORS_NAME
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        return [SourceError.from_json(e) for e in report["errors"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DatasetError(f"{path}: damaged error report ({exc}); move {directory} away and convert again") from exc


def _failed_midway(message: str, partial: Path) -> PackerError:
    """The error for a failure after the output was started: resumable while ``partial`` holds the work."""
    if not made_by_packer(partial):
        return PackerError(message)
    return ResumableError(f"{message}; the work done so far is kept in {partial}: free space (or fix the "
                          f"problem), then run the same command with {arg('resume', True)}")


def _interrupted(partial: Path) -> str:
    """What a Ctrl-C leaves: the message the CLI prints (once) as ``packer: ...``."""
    if not made_by_packer(partial):
        return "interrupted"
    return (f"interrupted; the work done so far is kept in {partial}: run the same command with "
            f"{arg('resume', True)} to go on, or remove it")
