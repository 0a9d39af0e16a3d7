"""The conversion driver and its public calls: ``convert`` (a dataset), ``convert_split`` (two) and ``export_wds``
(WebDataset shards), one driver for all: options -> scan -> order -> plan -> write -> finish, where the samples go
being a ``Sink`` (write/sink.py). Their keywords are the options declared in write/options.py.

Everything is written into ``<out>.partial`` and moved to ``<out>`` once complete, so an interrupted run never
leaves an output that looks complete; every source record is written or listed, with its reason, in errors.json;
nothing the run did not make is deleted (write/output.py).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from packer.errors import Interrupted, OptionError, PackerError, ResumableError, arg
from packer.formats import FORMATS, get_format
from packer.layout.manifest import MANIFEST_NAME
from packer.layout.partial import made_by_packer
from packer.layout.wdsexport import EXPORT_NAME
from packer.storage.url import is_url, parse, redact, refuse_urls
from packer.write.cluster import class_mapper
from packer.write.dataset_sink import DatasetSink
from packer.write.export_wds import ExportSink
from packer.write.finish import number_errors, recorded_errors
from packer.write.options import (
    WDS,
    ConvertOptions,
    Declared,
    RunOptions,
    declared,
    own_options,
    takes_options,
)
from packer.write.output import Output, output_path
from packer.write.plan import apply_order
from packer.write.remote_output import RemoteOutput
from packer.write.shards import ShardWriteError
from packer.write.sink import ConvertResult, Sink
from packer.write.sources.base import SourceOptions
from packer.write.sources.listfile import LIST_SUFFIXES
from packer.write.sources.records import ScanResult, SourceError
from packer.write.sources.registry import SOURCES, open_source, scan_opened
from packer.write.sources.remote import RemoteReader
from packer.write.sources.select import PARTS
from packer.write.sources.spool import SpooledSource

__all__ = ["ConvertResult", "convert", "convert_split", "drive", "export_wds", "keywords", "parse_keywords"]

log = logging.getLogger(__name__)  # under "packer": the command line prints it, a library user routes it
SPLIT = "split"  # the fraction of --split: convert_split's own keyword, not convert's


def targets() -> tuple[str, ...]:
    """What ``to`` names: a registered format (those registered later included), or the WebDataset export."""
    return (*sorted(FORMATS), WDS)


def keywords() -> list[Declared]:
    """Every declared keyword, in the order ``packer convert --help`` lists them: how SRC is read (with ``split``),
    what decides the output's bytes, how the run goes; the formats' own options come from ``own_options``."""
    source = [replace(d, choices=tuple(SOURCES)) if d.field == "type" else d for d in declared(SourceOptions)]
    return [*source, *declared(ConvertOptions), *declared(RunOptions)]


_CONVERT = [k for k in keywords() if k.keyword != SPLIT]
_EXPORT = [k for k in _CONVERT if k.wds]


def sink_for(to: str) -> Sink:
    """A new sink for ``to``: the WebDataset export, or the shards of a registered format."""
    return ExportSink() if to == WDS else DatasetSink(get_format(to))


@takes_options(_CONVERT, FORMATS)
def convert(src: str | os.PathLike, output: str | os.PathLike | None = None, *, to: str = "lmdb",
            **options: Any) -> ConvertResult:
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
            ``safetensors`` (``packer.FORMATS``; docs/formats-*.md), or ``wds`` for WebDataset shards
            (``export_wds``).
        **options: the conversion's options by keyword, each declared once in packer/write/options.py (how SRC is
            read, what decides the output's bytes, how the run goes) with the format's own; ``help(packer.convert)``
            lists them all with their types and defaults, ``packer convert --help`` as flags.

    Returns:
        A ``ConvertResult``: the output, the samples packed, every record left out with its reason, timings.

    Raises:
        InputNotFoundError: ``src`` does not exist (a ``FileNotFoundError``).
        OutputExistsError: ``output`` holds something packer won't replace (a ``FileExistsError``).
        OptionError: an option out of its range, or options that do not go together (a ``ValueError``).
        ResumableError: a failure part-way (a full disk); the work is kept for ``resume=True``.
    """
    sink = sink_for(to)
    check_locations(sink, src, output, url_output=True)
    run, source, given = parse_keywords(sink, options)
    return drive(src, make_output(src, output, sink, run), sink, run, source, given)


def make_output(src: str | os.PathLike, output: str | os.PathLike | None, sink: Sink, run: RunOptions) -> Output:
    """Where the conversion goes: a local folder, or a dataset or WebDataset export in object storage
    (``RemoteOutput``: shards uploaded as they are finished, by the Dask tasks that wrote them on a cluster, the
    manifest or the export's index last)."""
    if output is not None and is_url(output) and parse(output).is_local:  # file:///path: a local path
        output = parse(output).path
    if output is None or not is_url(output):
        return Output(output_path(src, output, sink.name))
    marker = MANIFEST_NAME if isinstance(sink, DatasetSink) else EXPORT_NAME  # an export (--to wds): its index
    return RemoteOutput(str(output), run.storage_options, run.staging_dir, overwrite=run.overwrite,
                        resume=run.resume, marker=marker)


@takes_options(_CONVERT, FORMATS)
def convert_split(src: str | os.PathLike, output: str | os.PathLike | None = None, *, split: float,
                  to: str = "lmdb", **options: Any) -> tuple[ConvertResult, ConvertResult]:
    """``convert`` into ``<output>-train`` and ``<output>-val``: per class, a seeded ``split`` fraction (``seed``,
    as for the order) goes to train, the rest to val (write/sources/select.py).

    Args:
        src: what to read, as for ``convert``.
        output: the name the two outputs are made from (``<output>-train``, ``<output>-val``: folders, or prefixes
            in object storage for a URL); None: ``<src>.<to>``.
        split: the fraction of each class that goes to train, between 0 and 1.
        to: the format, as for ``convert`` (``wds``: two WebDataset exports).
        **options: as for ``convert``.

    Returns:
        The two results, train's then val's.
    """
    sink = sink_for(to)
    check_locations(sink, src, output, url_output=True)
    run, source, given = parse_keywords(sink, options)
    seed = sink.options(dict(given)).seed
    results = []
    for part in PARTS:
        chosen = replace(source, split=float(split), split_seed=seed, part=part)
        part_sink = sink_for(to)
        named = part_name(src, output, sink.name, part)
        results.append(drive(src, make_output(src, named, part_sink, run), part_sink, run, chosen, dict(given)))
    return results[0], results[1]


def part_name(src: str | os.PathLike, output: str | os.PathLike | None, fmt: str, part: str) -> str | Path:
    """Where part ``part`` of a split goes: ``<output>-<part>``, a folder (``<src>.<fmt>-<part>`` by default) or,
    for an output in object storage, the URL's prefix with ``-<part>`` added."""
    if output is not None and is_url(output) and not parse(output).is_local:
        return f"{str(output).rstrip('/')}-{part}"
    if output is not None and is_url(output):  # file:///path: a local path
        output = parse(output).path
    out = output_path(src, output, fmt)
    return out.with_name(f"{out.name}-{part}")


@takes_options(_EXPORT)
def export_wds(src: str | os.PathLike, output: str | os.PathLike | None = None, **options: Any) -> ConvertResult:
    """Write the records of ``src`` as WebDataset shards into ``output`` (``convert(src, output, to="wds")``): of at
    most ``shard_bytes``, or by default 16 or more shards of at most 256 MB (one sample per shard below 16 samples).

    A sink, not a packer format: each sample keeps its source's encoded bytes (decoded pixels as lossless PNG),
    its label and fields; the shards are read back by ``webdataset`` or by ``convert`` (a WebDataset source).
    Options that would change the stored bytes (``payload``, ``resize``, ...) are refused unless left unset.

    Args:
        src: what to export: any source ``convert`` reads (a folder, a list file, an archive, a packer
            dataset, ...).
        output: the folder of shards to create; None: ``<src>.wds`` beside the source.

    Returns:
        A ``ConvertResult`` for the export (its ``output`` the folder of shards).
    """
    return convert(src, output, to=WDS, **options)


def check_locations(sink: Sink, src: str | os.PathLike, output: str | os.PathLike | None, *,
                    url_output: bool) -> None:
    """A source may be a URL (object storage: write/sources/remote.py); an output only where ``url_output``
    (``convert``'s ``make_output``), else it is refused; a URL source needs an output named (there is no folder
    beside it to put one in)."""
    if not url_output:
        refuse_urls(sink.command, output)
    if is_url(src) and not parse(src).is_local and output is None:
        raise OptionError(f"{redact(str(src))}: a source at a URL needs the output named ({arg('output')})")


def parse_keywords(sink: Sink, options: dict[str, Any]) -> tuple[RunOptions, SourceOptions, dict[str, Any]]:
    """``convert``'s keywords split into the run's options, the source's and the rest (the conversion's, checked
    by the sink); what the sink does not take is refused first."""
    known = {d.keyword: d for d in (*_CONVERT, *own_options(FORMATS))}
    sink.refuse([(known[k], v) for k, v in options.items() if k in known])
    run_fields = {d.keyword: d.field for d in declared(RunOptions)}
    source_keywords = {d.keyword for d in declared(SourceOptions)} - {SPLIT}
    run = RunOptions(**{run_fields[k]: v for k, v in options.items() if k in run_fields})
    source = SourceOptions.given(**{k: v for k, v in options.items() if k in source_keywords})
    rest = {k: v for k, v in options.items() if k not in run_fields and k not in source_keywords}
    return run, source, rest


def drive(src: str | os.PathLike, output: Output, sink: Sink, run: RunOptions, source: SourceOptions,
          given: dict[str, Any]) -> ConvertResult:
    """The one driver of every conversion: options, destination check, scan, order, then the sink's plan, write
    and finish in ``output`` under its lock. A failure part-way is kept for ``resume`` (a resumable sink) or
    removed, and said in one line. ``given``: the conversion's keywords (``parse_keywords``)."""
    out = output.shown
    opts = sink.options(dict(given))
    run = run.checked()
    output.check(src, sink.replaces(run))
    started = time.perf_counter()
    remote_output = isinstance(output, RemoteOutput)
    check_storage_options(src, remote_output, run, source, None)
    scanned = scan_records(src, source, opts, run)
    check_storage_options(src, remote_output, run, source, scanned)
    sink.accept(scanned, opts, given.get("payload"))
    check_sequential(scanned, opts, run.client)
    reused = sink.up_to_date(scanned, output, opts, run, started)
    if reused is not None:
        return reused
    ordered = apply_order(scanned, opts.order, opts.seed)
    with sink.start(ordered, output, opts, run.resume):  # held until the output is in place (or the run ends)
        try:
            if output.swapping():  # a finished output whose move into place was interrupted
                return _complete_swap(sink, scanned, output, started)
            failed = sink.write(ordered, output, opts, run)
            numbered = number_errors(failed, scanned.rel_paths, scanned.numbering())
            errors = locate_errors(scanned, numbered) + scanned.errors
            done = sink.finish(scanned, output, errors, opts, source)
        except ShardWriteError as exc:  # a full disk, an I/O error while a shard was written
            raise _failed_midway(sink, output, f"{out}: {exc}") from exc
        except PackerError:  # explained already (some kinds are OSErrors: an output that appeared meanwhile)
            if not sink.resumable:
                output.discard()
            raise
        except OSError as exc:  # the journal, meta/*.npy, errors.json, the manifest or the renames
            raise _failed_midway(sink, output, f"{exc.filename or out}: {exc.strerror or exc}") from exc
        except KeyboardInterrupt:
            raise Interrupted(_interrupted(sink, output)) from None
    return ConvertResult(output.result_name, done.num_samples, errors, time.perf_counter() - started,
                         done.num_bytes, dict(scanned.ignored), dict(scanned.not_images), rewritten=done.rewritten)


def scan_records(src: str | os.PathLike, source: SourceOptions, options: ConvertOptions, run: RunOptions) -> ScanResult:
    """The records of ``src`` as ``source`` reads and selects them, by the folder rules of ``options`` (objects at a
    URL with ``run.storage_options``); an order the source can't give is refused before the scan (which would
    inflate a compressed archive)."""
    client = run.client
    opened = open_source(src, source, run.storage_options)
    if client is not None and isinstance(opened, SpooledSource):
        raise OptionError(f"{redact(str(src))}: files at a URL read whole (archives, shards, Parquet) are not "
                          f"converted on a cluster yet (their local copy is on this machine only): convert them "
                          f"without {arg('client', cli='scheduler')}, on one machine")
    check_order(opened.sequential(), redact(str(src)) if is_url(src) else opened.path, options.order, client)
    mapper = None if client is None else class_mapper(client, options.skip_hidden)
    return scan_opened(opened, mapper, skip_hidden=options.skip_hidden, allow_empty=options.allow_empty)


def check_storage_options(src: str | os.PathLike, remote_output: bool, run: RunOptions, source: SourceOptions,
                          scanned: ScanResult | None) -> None:
    """``storage_options`` where nothing is read from or written to object storage: refused in one line, never
    ignored (as ``packer info`` and the other commands refuse ``--storage-option`` with a path). Asked before the
    scan (``scanned`` None) from the names alone; a local list file may name objects, so it is asked again after."""
    if not run.storage_options or remote_output:
        return
    named = [src, source.root, source.classes_file]
    if any(is_url(n) and not parse(n).is_local for n in named if n is not None):
        return
    if scanned is None and (source.type == "list" or Path(src).suffix.lower() in LIST_SUFFIXES):
        return  # its rows may be URLs: known once scanned
    if scanned is not None and isinstance(scanned.source_reader(), RemoteReader):
        return
    raise OptionError(f"{arg('storage_options', cli='storage-option')} is for a source or an output at a URL (s3://, "
                      "gs://, az://, http(s)://); nothing here is read from or written to object storage")


def check_sequential(scan: ScanResult, options: ConvertOptions, client: Any) -> None:
    """A source read only in order (a compressed tar) can't be shuffled or spread over a cluster; pixels are
    never re-encoded."""
    if scan.source_reader().gives_pixels and options.payload != "raw":
        raise OptionError(f"{scan.root}: holds decoded pixels (raw payloads), which packer never re-encodes: "
                          f"convert it with {arg('payload', 'raw')} (or convert the original images)")
    check_order(scan.source_reader().sequential, scan.root, options.order, client)


def check_order(sequential: bool, root: Path | str, order: str, client: Any) -> None:
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


def locate_errors(scan: ScanResult, errors: list[SourceError]) -> list[SourceError]:
    """The errors of records that could not be packed, with where each record is in the source (line, member)."""
    if not errors or scan.locs is None:
        return errors
    reader, locs = scan.source_reader(), scan.locator_of()
    for e in errors:
        if not e.location and e.path in locs:
            e.location = reader.location(e.path, locs[e.path])
    return errors


def _complete_swap(sink: Sink, scan: ScanResult, output: Output, started: float) -> ConvertResult:
    """Finish the move into place that a killed run journaled: its output is complete, nothing is converted."""
    num_samples = sink.recorded_samples(output.folder)
    errors = recorded_errors(output.folder)
    log.info("%s holds a finished conversion; moving it into place", output.folder)
    output.finish_swap()
    return ConvertResult(output.path, num_samples, errors, time.perf_counter() - started, 0, dict(scan.ignored),
                         dict(scan.not_images))


def _failed_midway(sink: Sink, output: Output, message: str) -> PackerError:
    """The error for a failure after the output was started: resumable while its folder holds the work (a
    resumable sink's); otherwise the folder is removed."""
    if not sink.resumable:
        output.discard()
        return PackerError(f"{message}; nothing was kept")
    if not made_by_packer(output.folder):
        return PackerError(message)
    return ResumableError(f"{message}; the work done so far is kept in {output.kept_in}: {output.remedy}, then run "
                          f"the same command with {arg('resume', True)}")


def _interrupted(sink: Sink, output: Output) -> str:
    """What a Ctrl-C leaves: the message the CLI prints (once) as ``packer: ...``."""
    if not sink.resumable:
        output.discard()
        return "interrupted; nothing was kept"
    if not made_by_packer(output.folder):
        return "interrupted"
    return (f"interrupted; the work done so far is kept in {output.kept_in}: run the same command with "
            f"{arg('resume', True)} to go on, or remove it")
