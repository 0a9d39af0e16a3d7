"""The dataset sink: a conversion's samples as the shards of a format, journaled shard by shard so that
``--resume`` goes on from an interrupted run, then index, fields, errors.json and the manifest (written last).

Shards are planned before the first is written (write.plan), built by the local process pool or a Dask cluster
behind one ``build_shards(job)`` (write.pool, write.cluster), and written in dataset order, so the output depends
only on the source and the options, never on ``workers``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from packer._version import __version__
from packer.errors import OutputExistsError, PackerError, arg
from packer.formats.base import Format
from packer.layout.fields import parse_specs
from packer.layout.manifest import IMAGELESS, Manifest, read_manifest
from packer.write.cluster import DaskCluster
from packer.write.finish import in_storage_order, recorded_errors, seal, stored_index
from packer.write.fresh import source_digest, stale_reason
from packer.write.journal import ShardResult
from packer.write.lock import OutputLock
from packer.write.options import ConvertOptions, PoolSettings, RunOptions, make_options
from packer.write.output import Output, check_replaceable
from packer.write.plan import load_or_make_plan
from packer.write.pool import LocalPool
from packer.write.scan import IMG_EXTENSIONS
from packer.write.shards import BuildJob, ShardBuilder, ShardWriteError
from packer.write.sink import ConvertResult, Finished, Sink
from packer.write.sources.base import SourceOptions
from packer.write.sources.records import ScanResult, SourceError


class DatasetSink(Sink):
    """Shards of format ``fmt``, resumable; what ``packer convert --to <format>`` writes."""

    resumable = True

    def __init__(self, fmt: Format) -> None:
        self.fmt = fmt
        self.name = fmt.name
        self.digest = ""  # the source's fingerprint (folders only), recorded for --if-changed
        self.plan: dict[str, Any] = {}
        self.shards: list[ShardResult] = []

    def options(self, given: dict[str, Any]) -> ConvertOptions:
        opts = make_options(self.fmt.name, **given)
        opts.check()
        if opts.shard_bytes is None:
            opts.shard_bytes = self.fmt.default_shard_bytes
        return opts

    def replaces(self, run: RunOptions) -> bool:
        return run.overwrite or run.if_changed or run.resume  # those look at an existing dataset first

    def accept(self, scan: ScanResult, options: ConvertOptions, payload: str | None) -> None:
        """A source of samples without an image (a packed dataset of payload none) converts to payload none, which
        no source of images does (it would drop them). Takes the source's fingerprint (before any file is read)."""
        if scan.source_reader().holds_images:
            if options.payload == IMAGELESS:
                raise PackerError(f"{scan.root}: holds images; --payload none would leave them out")
        elif payload not in (None, IMAGELESS):
            raise PackerError(f"{scan.root}: its samples have no image, so --payload {payload} has nothing to store: "
                              "leave --payload out")
        else:
            options.payload = IMAGELESS
            options.check()
        # before any file is read: a change meanwhile makes the output stale. Folders only: other sources record
        # no fingerprint, so --if-changed always converts them again (never reuses a stale output)
        self.digest = source_digest(scan) if scan.source_type == "folder" else ""

    def up_to_date(self, scan: ScanResult, output: Output, options: ConvertOptions, run: RunOptions,
                   started: float) -> ConvertResult | None:
        """``if_changed`` with an output converted alike from the same files; ``resume`` of a finished conversion
        (a folder, or a dataset in a bucket)."""
        out = output.path
        if run.if_changed and output.complete():
            why = stale_reason(output, options, self.digest)
            if why is None:
                return _reused(scan, output, started)
            if not run.overwrite:
                raise OutputExistsError(f"{output.shown}: out of date ({why}); add {arg('overwrite', True)} to "
                                        "replace it")
        if run.resume and not (run.overwrite or run.if_changed):
            if output.complete() and not output.left_over():  # finished: nothing was interrupted
                return self._nothing_to_resume(scan, output, options, started)
            if os.path.lexists(out):
                check_replaceable(out, overwrite=False)  # refused, as without --resume
        return None

    def _nothing_to_resume(self, scan: ScanResult, output: Output, options: ConvertOptions,
                           started: float) -> ConvertResult:
        """``resume`` where the conversion finished: nothing is done, and the result says so (``nothing_to_resume``);
        a dataset of other options or other source files is refused, naming the difference."""
        why = stale_reason(output, options, self.digest, sources_too=bool(self.digest))
        if why is not None:
            raise OutputExistsError(f"{output.shown}: a complete dataset, so there is nothing to resume, and it is not "
                                    f"this conversion's ({why}): add {arg('overwrite', True)} to convert again")
        result = _reused(scan, output, started)
        result.reused = False
        result.nothing_to_resume = "the same options" + (", the same source files, sizes and times"
                                                         if self.digest else "")
        return result

    def start(self, scan: ScanResult, output: Output, options: ConvertOptions, resume: bool) -> OutputLock:
        self.plan, lock = load_or_make_plan(scan, output, options, resume)
        return lock

    def recorded_samples(self, folder: Path) -> int:
        return read_manifest(folder).num_samples

    def write(self, scan: ScanResult, output: Output, options: ConvertOptions, run: RunOptions) -> list[SourceError]:
        """Every planned shard, the journaled ones reused: built by the local pool, or by a Dask cluster
        (``run.client``)."""
        ranges = [(int(a), int(b)) for a, b in self.plan["shards"]]
        job = BuildJob(scan, output, ranges, output.done_shards(len(ranges), scan), options,
                       run.on_error, bool(run.progress), float(self.plan.get("mean_bytes", 0.0)))
        backend: ShardBuilder = (DaskCluster(run.client) if run.client is not None
                                 else LocalPool(run.worker_count(), run.pool or PoolSettings()))
        try:
            results = backend.build_shards(job)
        except ShardWriteError:
            raise  # a failure part-way: the driver keeps the work for --resume
        except PackerError:  # a bad source file under --on-error raise: nothing worth resuming
            output.discard()
            raise
        self.shards = [results[i] for i in range(len(ranges))]
        return [e for r in self.shards for e in r.errors]

    def finish(self, scan: ScanResult, output: Output, errors: list[SourceError], options: ConvertOptions,
               source: SourceOptions) -> Finished:
        """Index, fields, error report and manifest (last), then the renames that make the dataset exist (``seal``).

        ``scan`` in the source's order (as scanned, before ``--order``): the index records where each of
        its samples is stored, so that ``ds[i]`` is the source's sample i whatever the storage order.
        """
        shards = drop_empty_shards(output.folder, self.shards)
        index = stored_index(shards, scan.rel_paths, scan.numbering())
        manifest = Manifest(
            format=options.format,
            payload=options.payload,
            num_samples=len(index),
            classes=list(scan.classes),
            shards=[r.shard for r in shards],
            options=options.record(),
            source=scan.source_name(),  # samples are ImageFolder's paths: os.path.join(source, rel)
            extensions=list(IMG_EXTENSIONS),
            source_digest=self.digest,
            source_type=scan.source_type,
            source_options=source.record(),
            source_records=scan.num_source_records,
            created_by=f"packer {__version__}",
            created_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        )
        seal(output, index, errors, scan.ignored, manifest, parse_specs(scan.field_specs),
             in_storage_order(index, scan.rel_paths, scan.fields), earlier=scan.earlier)
        return Finished(len(index), int(index.nbytes.sum()),
                        sum(r.rewritten for r in shards) if options.jpeg_restarts else None)


def drop_empty_shards(partial: Path, shards: Sequence[ShardResult]) -> list[ShardResult]:
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


def _reused(scan: ScanResult, output: Output, started: float) -> ConvertResult:
    """The result for an output ``if_changed`` found up to date: its own counts, nothing converted."""
    manifest, folder, _ = output.finished()
    return ConvertResult(output.result_name, manifest.num_samples, recorded_errors(folder, output.shown),
                         time.perf_counter() - started, 0, dict(scan.ignored), dict(scan.not_images), reused=True)
