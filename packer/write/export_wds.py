"""The WebDataset export (``to="wds"``): a sink, not a format, writing ``shard-%06d.tar`` files the
``webdataset`` package reads unchanged, then ``classes.txt``, errors.json and the export's index (written last;
the folder's layout: layout/wdsexport.py).

Each sample is ``<key>.<ext>`` (the encoded bytes as stored; decoded pixels as lossless PNG), ``<key>.cls`` (its
label; none for a source without labels), ``<key>.json`` (its fields, when it has any) and ``<key>.path.txt`` (its
key in the source). The key is the record's number in the source's numbering, zero-padded, never holding a dot, so
an export converts back with the same numbering, paths, labels and bytes (write/sources/webdataset.py). Not
resumable: a failure removes what the run wrote (``resume`` only finishes a journaled move into place). To a URL
(``RemoteOutput`` with the index as its marker) each tar is uploaded as it is closed and the index put last.
"""

from __future__ import annotations

import io
import json
import logging
import os
import tarfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from packer._version import __version__
from packer.errors import OptionError, OutputExistsError, PackerError, arg
from packer.formats import FORMATS
from packer.formats.base import PreparedSample
from packer.images.magic import sniff
from packer.layout.fields import FieldSpec, cell_value, json_value, parse_specs
from packer.layout.fsutil import write_atomic
from packer.layout.manifest import FileInfo, dumps_lossless, file_info
from packer.layout.wdsexport import (
    CLASSES_NAME,
    EXPORT_KIND,
    EXPORT_NAME,
    PATH_CODEC,
    PATH_EXTENSION,
    SHARD_PATTERN,
)
from packer.units import human_bytes
from packer.write.finish import write_error_report
from packer.write.lock import OutputLock
from packer.write.options import WDS, ConvertOptions, Declared, PoolSettings, RunOptions, declared, own_options
from packer.write.output import Output
from packer.write.plan import estimate_sample_bytes
from packer.write.pool import ordered_results
from packer.write.remote_output import RemoteOutput
from packer.write.shards import progress_bar
from packer.write.sink import Finished, Sink
from packer.write.sources.base import SourceOptions
from packer.write.sources.records import ScanResult, SourceError

DEFAULT_SHARD_BYTES = 256 << 20
# Without --shard-size: at least this many shards where there are as many samples, so that webdataset with
# DataLoader(num_workers=N <= 16) gives every worker a shard (it fails, "fewer shards than workers", otherwise)
DEFAULT_SHARDS = 16
_BLOCK, _RECORD = tarfile.BLOCKSIZE, tarfile.RECORDSIZE  # a member's header; what the whole tar is padded to
_SNIFFED = {"jpeg": "jpg", "png": "png", "bmp": "bmp", "gif": "gif", "webp": "webp"}  # sniff's name -> extension

log = logging.getLogger(__name__)  # under "packer": the command line prints it, a library user routes it


class ExportSink(Sink):
    """WebDataset tars of at most ``shard_bytes`` each, or by default ``DEFAULT_SHARDS`` (16) or more of at most
    256 MB (one sample per shard below 16 samples)."""

    name = WDS
    command = "packer convert --to wds"
    resumable = False

    def __init__(self) -> None:
        self.tar: TarSink | None = None

    def refuse(self, given: Sequence[tuple[Declared, Any]]) -> None:
        """What would change the stored bytes (and ``if_changed``, a cluster): refused unless left unset."""
        refused = sorted((d.keyword, d) for d, v in given if not d.wds and v is not None and v != d.default)
        if refused:
            raise OptionError(f"{refused[0][1].named()}: not an option of {arg('to', WDS)} (it stores the source's "
                              "encoded bytes as they are; decoded pixels as lossless PNG)")

    def options(self, given: dict[str, Any]) -> ConvertOptions:
        common = {d.keyword: d for d in declared(ConvertOptions)}
        unknown = sorted(set(given) - set(common) - {d.keyword for d in own_options(FORMATS)})
        if unknown:
            known = ", ".join(sorted(k for k, d in common.items() if d.wds))
            raise OptionError(f"unknown conversion option {unknown[0]!r} for {arg('to', WDS)} (known: {known})")
        opts = ConvertOptions(format=WDS, **{k: v for k, v in given.items() if k in common and common[k].wds})
        opts.check()
        return opts

    def accept(self, scan: ScanResult, options: ConvertOptions, payload: str | None) -> None:
        """Records with an image only; a source of pixels is read as such (written as PNG), any other as bytes."""
        reader = scan.source_reader()
        if not reader.holds_images:
            raise OptionError(f"{scan.root}: its samples have no image, and a WebDataset sample is exported with one; "
                              "convert it to another format instead")
        options.payload = "raw" if reader.gives_pixels else "encoded"

    def start(self, scan: ScanResult, output: Output, options: ConvertOptions, resume: bool) -> OutputLock:
        """A new folder; one left over is refused, naming it (or the live run writing it), unless it holds a finished
        export whose move into place was journaled and ``resume`` is given (the driver then finishes that)."""
        partial = output.folder
        if not output.left_over():
            return output.start({"kind": EXPORT_KIND, "source": scan.source_name(), "options": options.record()})
        if output.made_by_packer():
            output.check_free()
        if isinstance(output, RemoteOutput):  # an unfinished upload, resume given: nothing is journaled to go on from
            raise OutputExistsError(output.not_resumable("a WebDataset export is not resumed"))
        swapping = output.swapping()
        if swapping and resume and (partial / EXPORT_NAME).is_file():
            return output.take()
        if swapping:
            raise OutputExistsError(f"{partial}: holds a finished export that was being moved into place; run the same "
                                    f"command with {arg('resume', True)} to finish that")
        raise OutputExistsError(f"{partial}: exists (left over from an interrupted run, or not packer's); a WebDataset "
                                f"export is not resumed and packer leaves that folder alone: remove it (rm -r "
                                f"'{partial}') or choose another {arg('output')}")

    def recorded_samples(self, folder: Path) -> int:
        return int(json.loads((folder / EXPORT_NAME).read_text(encoding="utf-8"))["num_samples"])

    def write(self, scan: ScanResult, output: Output, options: ConvertOptions, run: RunOptions) -> list[SourceError]:
        """Every record of ``scan`` (dataset order) through the pool into tars; the records not exported."""
        limit = DEFAULT_SHARD_BYTES if options.shard_bytes is None else int(options.shard_bytes)
        per_shard = max(1, len(scan) // DEFAULT_SHARDS) if options.shard_bytes is None else None
        tar = self.tar = TarSink(output.folder, limit, per_shard, lambda name: output.files_done([name]))
        numbers, specs = scan.numbering(), parse_specs(scan.field_specs)
        digits = max(6, len(str(max(scan.num_source_records - 1, 0))))
        prepared = ordered_results(scan.source_reader(), scan.records(), options, run.worker_count(),
                                   estimate_sample_bytes(scan, options), run.pool or PoolSettings())
        errors: list[SourceError] = []
        bar = progress_bar(len(scan), run.progress)
        try:
            for i, res in enumerate(prepared):  # one result per record, in order
                bar.update(1)
                if isinstance(res, SourceError):
                    if run.on_error == "raise":
                        raise PackerError(f"{scan.root / res.path}: {res.reason}")
                    errors.append(res)
                    continue
                tar.add(sample_members(f"{int(numbers[i]):0{digits}d}", res, sample_fields(scan, i, specs)))
            tar.close()
        finally:
            bar.close()
            prepared.close()
        few_shards(tar, options.shard_bytes)
        return errors

    def finish(self, scan: ScanResult, output: Output, errors: list[SourceError], options: ConvertOptions,
               source: SourceOptions) -> Finished:
        """classes.txt, errors.json, then the index (last), and the move into place."""
        assert self.tar is not None, "finish() before write()"
        partial, tar = output.folder, self.tar
        if scan.classes:
            write_atomic(partial / CLASSES_NAME, "".join(f"{c}\n" for c in scan.classes))
        num_samples = sum(tar.counts)
        write_error_report(partial, errors, scan.ignored, num_samples, scan.earlier)
        shards = [{**asdict(info), "num_samples": n} for info, n in zip(tar.infos, tar.counts, strict=True)]
        index = {"kind": EXPORT_KIND, "version": 1, "num_samples": num_samples, "num_errors": len(errors),
                 "source_records": scan.num_source_records,
                 "num_classes": len(scan.classes), "shards": shards, "source": scan.source_name(),
                 "source_type": scan.source_type, "options": options.record(), "created_by": f"packer {__version__}",
                 "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        output.seal(lambda folder: write_atomic(folder / EXPORT_NAME, dumps_lossless(index, indent=1)))
        return Finished(num_samples, sum(int(s["num_bytes"]) for s in shards))


def sample_fields(scan: ScanResult, i: int, specs: Mapping[str, FieldSpec]) -> dict[str, Any]:
    """Record ``i``'s per-sample fields as JSON holds them (``packer extract``'s sidecar form), its ``<key>.json``
    member (empty: none written); ``specs``: the scan's field specs, parsed."""
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
    return _SNIFFED.get(sniff(data), "bin")


def few_shards(sink: TarSink, shard_bytes: int | None) -> None:
    """A notice when a ``--shard-size`` left fewer shards than ``DEFAULT_SHARDS`` though there are as many samples:
    webdataset with more DataLoader workers than shards fails; the fix is a smaller size (or the default)."""
    total = sum(sink.counts)
    if shard_bytes is None or len(sink.names) >= min(DEFAULT_SHARDS, total):
        return
    size = max(1, sum(info.num_bytes for info in sink.infos) // DEFAULT_SHARDS)
    log.warning("%d shard(s): webdataset with DataLoader(num_workers=N) fails for N above that (\"fewer shards "
                "than workers\"); a shard size of %s (or the default) gives %d", len(sink.names),
                human_bytes(size).replace(" ", ""), DEFAULT_SHARDS)


class TarSink:
    """Writes samples into ``shard-%06d.tar`` files of at most ``limit`` bytes each, padding included (a sample
    larger than that gets a shard of its own), and at most ``per_shard`` samples (None: no bound). Members are plain
    files with fixed metadata: same bytes every run. Each closed tar is measured and checksummed (``infos``), then
    handed to ``closed`` (an output in a bucket uploads it and deletes it here)."""

    def __init__(self, folder: Path, limit: int, per_shard: int | None = None,
                 closed: Callable[[str], None] | None = None) -> None:
        self.folder, self.limit, self.per_shard, self.closed = folder, limit, per_shard, closed
        self.names: list[str] = []
        self.counts: list[int] = []
        self.infos: list[FileInfo] = []  # the closed tars' sizes and sha256
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
        self.infos.append(file_info(self.folder, self.names[-1]))
        if self.closed is not None:
            self.closed(self.names[-1])


def closed_size(used: int) -> int:
    """The size of a tar whose members take ``used`` bytes, once closed (two zero blocks, padded to a record)."""
    return -(-(used + 2 * _BLOCK) // _RECORD) * _RECORD
