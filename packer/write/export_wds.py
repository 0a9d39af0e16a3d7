"""WebDataset export: ``packer convert SRC --to wds`` writes ``shard-%06d.tar`` files the ``webdataset`` package
reads unchanged (the folder's layout: layout/wdsexport.py).

Any source convert reads (folder, list file, archive, WebDataset, Hugging Face, packer dataset) is scanned,
read and validated by the same machinery (``write.sources``, ``write.pool.ordered_results``), so a record is
either exported or in errors.json. Each sample is ``<key>.<ext>``, the encoded bytes exactly as stored,
``<key>.cls`` (its label as decimal text; none for a source without labels), ``<key>.json`` (its fields,
when it has any) and ``<key>.path.txt`` (the record's key in the source: its relative path). A source of decoded
pixels (raw payloads) is written losslessly as PNG. The key is the record's number in the source's numbering,
zero-padded (ImageFolder's index of a folder, ``ds.imagefolder_index(i)`` of a packer dataset); it never contains
a dot (webdataset ends a key at the first dot of a member's base name). Converted back, an export gives the same
numbering, paths, labels, classes and bytes (write/sources/webdataset.py).
Not a format: nothing in packer opens the export for random access; webdataset streams it, and
``packer convert OUT --to lmdb`` reads it back as a WebDataset source. The export is not resumable: it
runs in ``<out>.partial`` and the index is written last, so an interrupted one never looks complete.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import tarfile
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import numpy as np
from PIL import Image

from packer._version import __version__
from packer.errors import OptionError, OutputExistsError, PackerError, arg
from packer.formats.base import PreparedSample
from packer.layout.fields import cell_value, json_value, parse_specs
from packer.layout.fsutil import fsync_tree, write_atomic
from packer.layout.manifest import dumps_lossless, file_info
from packer.layout.partial import PARTIAL_SUFFIX, made_by_packer, read_swap
from packer.layout.wdsexport import (
    CLASSES_NAME,
    EXPORT_KIND,
    EXPORT_NAME,
    PATH_CODEC,
    PATH_EXTENSION,
    SHARD_PATTERN,
)
from packer.storage.url import refuse_urls
from packer.units import human_bytes
from packer.write.convert import (
    ConvertResult,
    check_order,
    check_sequential,
    locate_errors,
    source_options,
)
from packer.write.finish import number_errors, write_error_report
from packer.write.lock import OutputLock, check_free
from packer.write.options import ConvertOptions, make_options
from packer.write.output import check_destination, output_path, swap_into_place
from packer.write.plan import apply_order, estimate_sample_bytes, make_partial
from packer.write.pool import PoolSettings, ordered_results
from packer.write.shards import progress_bar
from packer.write.sources.records import ScanResult, SourceError
from packer.write.sources.registry import open_source, scan_opened

DEFAULT_SHARD_BYTES = 256 << 20
# Without --shard-size: at least this many shards where there are as many samples, so that webdataset with
# DataLoader(num_workers=N <= 16) gives every worker a shard (it fails, "fewer shards than workers", otherwise)
DEFAULT_SHARDS = 16
_BLOCK, _RECORD = tarfile.BLOCKSIZE, tarfile.RECORDSIZE  # a member's header; what the whole tar is padded to
_SOURCE_KEYWORDS = ("source_type", "root", "path_column", "label_column", "classes_file", "classes", "label_key",
                    "image_column")
_MAGIC = ((b"\xff\xd8\xff", "jpg"), (b"\x89PNG\r\n\x1a\n", "png"), (b"BM", "bmp"), (b"GIF8", "gif"))

log = logging.getLogger(__name__)  # under "packer": the command line prints it, a library user routes it


def export_wds(src: str | os.PathLike, output: str | os.PathLike | None = None, *,
               on_error: Literal["skip", "raise"] = "skip", workers: int | None = None, overwrite: bool = False,
               resume: bool = False, progress: bool | None = None, pool: PoolSettings | None = None,
               validate: str = "full", shard_bytes: int | None = None, order: str = "shuffled", seed: int = 0,
               skip_hidden: bool = False, allow_empty: bool = False, decoder: str = "auto",
               **others: Any) -> ConvertResult:
    """Write the records of ``src`` as WebDataset shards into ``output``: of at most ``shard_bytes``, or by default
    ``DEFAULT_SHARDS`` (16) or more shards of at most 256 MB each (one sample per shard below 16 samples).

    A sink, not a packer format: each sample keeps its source's encoded bytes (decoded pixels as lossless PNG),
    its label and fields; the shards are read back by ``webdataset`` or by ``convert`` (a WebDataset source).

    Args:
        src: what to export: any source ``convert`` reads (a folder, a list file, an archive, a packer
            dataset, ...).
        output: the folder of shards to create; None: ``<src>.wds`` beside the source.
        on_error: ``"skip"`` lists a record that cannot be read in the export's errors.json and goes on;
            ``"raise"`` stops at the first (nothing is kept).
        workers: processes that read and validate the sources (None: all cores; 0: this process).
        overwrite: replace an existing export or packer dataset at ``output`` (anything else is refused).
        resume: finish the move into place that a killed run journaled (an export is not resumed part-way:
            anything else left in ``<output>.partial`` is refused, naming it).
        progress: a progress bar on stderr: None (default) when stderr is a terminal, True always, False never.
        pool: settings of the local process pool (``packer.write.pool.PoolSettings``).
        validate: ``"full"`` decodes every image (default), ``"header"`` reads headers only, ``"none"`` checks
            nothing, as for ``convert``.
        shard_bytes: at most this many bytes per ``.tar`` (default 256 MB).
        order: the order of samples in the shards: ``"shuffled"`` (seeded; default) or ``"source"``; keys are
            the source's sample numbers either way.
        seed: the seed of the shuffled order.
        skip_hidden: leave out names starting with ``.`` (ImageFolder keeps them).
        allow_empty: keep class folders without images as classes (ImageFolder's ``allow_empty``).
        decoder: the JPEG decoder that validates (``"auto"``, ``"turbojpeg"``, ``"pil"``).
        **others: ``convert``'s source keywords (``source_type``, ``root``, ``path_column``, ``label_column``,
            ``classes_file``, ``classes``, ``label_key``, ``image_column``); its other options (``payload``,
            ``resize``, ...) are refused unless unset: an export keeps the source's bytes.

    Returns:
        A ``ConvertResult`` for the export (its ``output`` the folder of shards).
    """
    refuse_urls("packer convert --to wds", src, output)
    given = {k: others.pop(k) for k in _SOURCE_KEYWORDS if k in others}
    unsupported = sorted(k for k, v in others.items() if v is not None and v is not False)
    if unsupported:
        raise OptionError(f"{arg(unsupported[0])}: not an option of {arg('to', 'wds')} (it stores the source's "
                          "encoded bytes as they are; decoded pixels as lossless PNG)")
    if on_error not in ("skip", "raise"):
        raise OptionError(f"unknown error policy {on_error!r} (choose skip or raise)")
    limit = DEFAULT_SHARD_BYTES if shard_bytes is None else int(shard_bytes)
    if limit <= 0:
        raise OptionError(f"{arg('shard_bytes', shard_bytes, cli='shard-size')}: must be positive")
    out = output_path(src, output, "wds")
    check_destination(src, out, overwrite)
    started = time.perf_counter()
    scanned = _scan_images(src, given, order, skip_hidden, allow_empty)
    # prepare() reads and validates each record exactly as convert does; "lmdb" only carries the common options
    opts = make_options("lmdb", payload="raw" if scanned.source_reader().gives_pixels else "encoded",
                        validate=validate, order=order, seed=seed, decoder=decoder)
    opts.check()
    check_sequential(scanned, opts, None)
    partial = out.with_name(out.name + PARTIAL_SUFFIX)
    if os.path.lexists(partial):
        return _leftover(scanned, partial, out, resume, started)
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = make_partial(out, partial, {"kind": EXPORT_KIND, "source": str(scanned.root), "options": opts.record()})
    with lock:  # held until the export is in place: a second run is refused, naming this one
        try:
            per_shard = max(1, len(scanned) // DEFAULT_SHARDS) if shard_bytes is None else None
            sink = TarSink(partial, limit, per_shard)
            errors = _write_samples(scanned, opts, sink, workers, pool or PoolSettings(), on_error, progress)
            few_shards(sink, shard_bytes)
            return _finish(scanned, partial, out, sink, errors, opts.record(), started)
        except (PackerError, OSError, KeyboardInterrupt) as exc:
            shutil.rmtree(partial, ignore_errors=True)  # ours (made above), not resumable: nothing half-done stays
            if isinstance(exc, OSError) and not isinstance(exc, PackerError):  # some kinds are OSErrors too
                raise PackerError(f"{exc.filename or out}: {exc.strerror or exc}; nothing was exported") from exc
            if isinstance(exc, KeyboardInterrupt):
                raise KeyboardInterrupt("interrupted; nothing was exported") from None
            raise


def _scan_images(src: str | os.PathLike, given: dict[str, Any], order: str, skip_hidden: bool,
                 allow_empty: bool) -> ScanResult:
    """The source's records, refused when they have no image (a WebDataset sample is exported with one)."""
    opened = open_source(src, source_options(**given))
    check_order(opened.sequential(), opened.path, order, None)  # before a scan that would inflate it all
    scanned = scan_opened(opened, skip_hidden=skip_hidden, allow_empty=allow_empty)
    if not scanned.source_reader().holds_images:
        raise OptionError(f"{scanned.root}: its samples have no image, and a WebDataset sample is exported with one; "
                          "convert it to another format instead")
    return scanned


def _write_samples(scanned: ScanResult, opts: ConvertOptions, sink: TarSink, workers: int | None, pool: PoolSettings,
                   on_error: str, progress: bool | None) -> list[SourceError]:
    """Every record of ``scanned`` in ``opts.order`` through the pool into ``sink``; the records not exported."""
    ordered = apply_order(scanned, opts.order, opts.seed)
    position = {rel: i for i, rel in enumerate(scanned.rel_paths)}
    numbers = scanned.numbering()
    digits = max(6, len(str(max(scanned.num_source_records - 1, 0))))
    workers = os.cpu_count() or 1 if workers is None else workers
    prepared = ordered_results(scanned.source_reader(), ordered.records(), opts, workers,
                               estimate_sample_bytes(scanned, opts), pool)
    errors: list[SourceError] = []
    bar = progress_bar(len(ordered), progress)
    try:
        for res in prepared:
            bar.update(1)
            if isinstance(res, SourceError):
                if on_error == "raise":
                    raise PackerError(f"{scanned.root / res.path}: {res.reason}")
                errors.append(res)
                continue
            i = position[res.rel_path]
            sink.add(sample_members(f"{int(numbers[i]):0{digits}d}", res, sample_fields(scanned, i)))
        sink.close()
    finally:
        bar.close()
        prepared.close()
    return locate_errors(ordered, number_errors(errors, scanned.rel_paths, numbers)) + scanned.errors


def sample_fields(scan: ScanResult, i: int) -> dict[str, Any]:
    """Record ``i``'s per-sample fields as JSON holds them (``packer extract``'s sidecar form), its ``<key>.json``
    member (empty: none written)."""
    specs = parse_specs(scan.field_specs)
    return {name: json_value(cell_value(specs[name], cells[i], name)) for name, cells in scan.fields.items()}


def sample_members(key: str, sample: PreparedSample, fields: Mapping[str, Any]) -> list[tuple[str, bytes]]:
    """The tar members of one sample: image (stored bytes, or pixels as PNG), ``cls`` when labelled, ``json``."""
    if isinstance(sample.payload, np.ndarray):
        buf = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(sample.payload, dtype=np.uint8), "RGB").save(buf, "PNG")
        members = [(f"{key}.png", buf.getvalue())]
    else:
        data = bytes(sample.payload)
        members = [(f"{key}.{image_extension(sample.rel_path, data)}", data)]
    if sample.label >= 0:
        members.append((f"{key}.cls", str(int(sample.label)).encode()))
    if fields:
        members.append((f"{key}.json", dumps_lossless(dict(fields)).encode()))
    members.append((f"{key}.{PATH_EXTENSION}", sample.rel_path.encode(*PATH_CODEC)))
    return members


def image_extension(rel: str, data: bytes) -> str:
    """The member extension of encoded bytes: the record's own suffix when it has an image one, else sniffed."""
    suffix = os.path.splitext(rel)[1].lower().lstrip(".")
    if suffix in ("jpg", "jpeg", "png", "ppm", "bmp", "pgm", "tif", "tiff", "webp"):
        return suffix
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return next((ext for magic, ext in _MAGIC if data.startswith(magic)), "bin")


def few_shards(sink: TarSink, shard_bytes: int | None) -> None:
    """A notice when a ``--shard-size`` left fewer shards than ``DEFAULT_SHARDS`` though there are as many samples:
    webdataset with more DataLoader workers than shards fails; the fix is a smaller size (or the default)."""
    total = sum(sink.counts)
    if shard_bytes is None or len(sink.names) >= min(DEFAULT_SHARDS, total):
        return
    size = max(1, sum((sink.folder / n).stat().st_size for n in sink.names) // DEFAULT_SHARDS)
    log.warning("%d shard(s): webdataset with DataLoader(num_workers=N) fails for N above that (\"fewer shards "
                "than workers\"); a shard size of %s (or the default) gives %d", len(sink.names),
                human_bytes(size).replace(" ", ""), DEFAULT_SHARDS)


class TarSink:
    """Writes samples into ``shard-%06d.tar`` files of at most ``limit`` bytes each, padding included (a sample
    larger than that gets a shard of its own), and at most ``per_shard`` samples (None: no bound). Members are plain
    files with fixed metadata: same bytes every run."""

    def __init__(self, folder: Path, limit: int, per_shard: int | None = None) -> None:
        self.folder, self.limit, self.per_shard = folder, limit, per_shard
        self.names: list[str] = []
        self.counts: list[int] = []
        self._tar: tarfile.TarFile | None = None
        self._used = 0  # bytes of headers and padded data in the open shard

    def add(self, members: list[tuple[str, bytes]]) -> None:
        size = sum(_BLOCK + -(-len(data) // _BLOCK) * _BLOCK for _, data in members)
        full = self.per_shard is not None and self.counts and self.counts[-1] >= self.per_shard
        if self._tar is not None and (closed_size(self._used + size) > self.limit or full):
            self._close_tar()
        if self._tar is None:
            self.names.append(SHARD_PATTERN % len(self.names))
            self.counts.append(0)
            self._tar = tarfile.open(self.folder / self.names[-1], "w", format=tarfile.USTAR_FORMAT)
            self._used = 0
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            self._tar.addfile(info, io.BytesIO(data))
        self._used += size
        self.counts[-1] += 1

    def close(self) -> None:
        if self._tar is not None:
            self._close_tar()

    def _close_tar(self) -> None:
        assert self._tar is not None
        self._tar.close()
        self._tar = None


def closed_size(used: int) -> int:
    """The size of a tar whose members take ``used`` bytes, once closed (two zero blocks, padded to a record)."""
    return -(-(used + 2 * _BLOCK) // _RECORD) * _RECORD


def _finish(scanned: ScanResult, partial: Path, out: Path, sink: TarSink, errors: list[SourceError],
            options: dict[str, Any], started: float) -> ConvertResult:
    """classes.txt, errors.json, then the index (last), fsync, and the move into place."""
    if scanned.classes:
        write_atomic(partial / CLASSES_NAME, "".join(f"{c}\n" for c in scanned.classes))
    write_error_report(partial, errors, scanned.ignored, sum(sink.counts), scanned.earlier)
    num_samples = sum(sink.counts)
    shards = [{**asdict(file_info(partial, name)), "num_samples": n} for name, n in zip(sink.names, sink.counts)]
    index = {"kind": EXPORT_KIND, "version": 1, "num_samples": num_samples, "num_errors": len(errors),
             "source_records": scanned.num_source_records,
             "num_classes": len(scanned.classes), "shards": shards, "source": os.path.abspath(scanned.root),
             "source_type": scanned.source_type, "options": options, "created_by": f"packer {__version__}",
             "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    fsync_tree(partial)
    write_atomic(partial / EXPORT_NAME, dumps_lossless(index, indent=1))
    swap_into_place(partial, out)
    return ConvertResult(out, num_samples, errors, time.perf_counter() - started,
                         sum(int(s["num_bytes"]) for s in shards), dict(scanned.ignored), dict(scanned.not_images))


def _leftover(scanned: ScanResult, partial: Path, out: Path, resume: bool, started: float) -> ConvertResult:
    """A ``<out>.partial`` already there: a finished export being moved into place (``resume`` finishes that),
    else refused, naming it (or the live run writing it)."""
    if made_by_packer(partial):
        check_free(partial, out)
    swapping = read_swap(partial, out)[0]
    if swapping and resume and (partial / EXPORT_NAME).is_file():
        with OutputLock.take(partial, out):
            swap_into_place(partial, out)
        return ConvertResult(out, int(_read_index(out)["num_samples"]), [], time.perf_counter() - started, 0,
                             dict(scanned.ignored), dict(scanned.not_images))
    if swapping:
        raise OutputExistsError(f"{partial}: holds a finished export that was being moved into place; run the same "
                                f"command with {arg('resume', True)} to finish that")
    raise OutputExistsError(f"{partial}: exists (left over from an interrupted run, or not packer's); a WebDataset "
                            f"export is not resumed and packer leaves that folder alone: remove it (rm -r '{partial}') "
                            f"or choose another {arg('output')}")


def _read_index(out: Path) -> dict[str, Any]:
    return json.loads((out / EXPORT_NAME).read_text(encoding="utf-8"))
