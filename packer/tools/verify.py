"""Check a packed dataset: files and checksums, counts, and (optionally) against its source folder."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from packer.errors import DatasetError, IndexingWarning, PackerError
from packer.formats import get_format
from packer.images.decode import decode
from packer.images.headers import jpeg_segments
from packer.images.magic import sniff
from packer.layout.checksums import file_problem
from packer.layout.fields import same_cell
from packer.layout.index import Index
from packer.layout.manifest import MANIFEST_NAME, Manifest, read_manifest
from packer.layout.ranges import PayloadRanges
from packer.layout.remote import RemoteDataset, default_cache_dir, is_remote
from packer.layout.report import ERRORS_NAME
from packer.layout.trust import read_inside
from packer.progress import bar
from packer.read.dataset import open_dataset
from packer.read.indexing import STORED
from packer.storage.url import redact, refuse_urls
from packer.write.options import ConvertOptions, make_options, scan_rules
from packer.write.ranges import record_ranges
from packer.write.shards import prepare, stored_bytes
from packer.write.sources.base import InlineReader, RecordError, SourceOptions
from packer.write.sources.records import ScanResult, SourceError
from packer.write.sources.registry import scan_source


@dataclass
class Report:
    """What ``verify`` found: every problem in words (none: the dataset is sound) and how much of each was checked."""

    problems: list[str] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        """Plain JSON values (``packer verify --json``, docs/library.md)."""
        return {"checked": dict(self.checked), "num_problems": len(self.problems), "problems": list(self.problems)}


def verify_remote(url: str, cache_dir: str | os.PathLike | None = None, progress: bool | None = None,
                  storage_options: dict[str, Any] | None = None) -> Report:
    """``verify`` of a dataset in object storage: its manifest and meta/ checked as a local dataset's (at open),
    every object's size (a listing) and sha256 (each streamed through the node's downloader, nothing kept)."""
    report = Report()
    try:
        ds = RemoteDataset(url, cache_dir or default_cache_dir(), None, storage_options, strict=False)
    except DatasetError as exc:
        report.problems.append(str(exc))
        return report
    with ds:
        total = sum(f.num_bytes for f in ds.manifest.all_files())
        with bar(total=total, progress=progress, unit="B", unit_scale=True, desc="verify") as shown:
            report.problems.extend(ds.verify_files(shown.update))
        report.checked["files"] = len(ds.manifest.all_files())
        if not report.problems:
            report.checked["samples"] = ds.manifest.num_samples
    return report


def verify(path: str | os.PathLike, against: str | os.PathLike | None = None, progress: bool | None = None,
           deep: bool = False, source: SourceOptions | None = None, cache_dir: str | os.PathLike | None = None,
           storage_options: dict[str, Any] | None = None) -> Report:
    """Every check ``packer verify`` runs; problems are collected, not raised (a missing or empty
    ``against`` source is refused up front with a PackerError: nothing to compare with).

    ``against`` is read as ``source`` says, by default as the dataset's manifest records it was read
    (its source type, a list file's root and columns, ``--classes``, its part of ``--split``).
    ``deep``: also decode every sample (strictly, as conversion's full validation does) and
    check its shape against the stored heights and widths. A dataset at a URL: every object's sha256 first
    (``verify_remote``), then the samples read through ``cache_dir`` as ``open_dataset(url)`` reads them.
    """
    refuse_urls("packer verify --against", against)
    if is_remote(path):
        return _verify_remote_samples(str(path), against, progress, deep, source, cache_dir, storage_options)
    refuse_urls("packer verify", path)  # a scheme packer does not read
    root = Path(path)
    report = Report()
    try:
        manifest: Manifest | None = read_manifest(root)
    except PackerError as exc:
        manifest = None
        report.problems.append(str(exc))
    scan = _scan_against(against, manifest, source, root / MANIFEST_NAME)
    if manifest is None:
        return report
    for info in manifest.all_files():  # no symlink out of the dataset: verify reads nothing else either
        problem = file_problem(root, info)
        if problem is not None:
            report.problems.append(problem)
    report.checked["files"] = len(manifest.all_files())
    if scan is not None and scan.source_type == "packed":
        _check_packed_source(scan.root, report)
    if report.problems:
        return report
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", IndexingWarning)  # about indices a user maps; the report says it
            ds = open_dataset(root, image="numpy")
    except PackerError as exc:
        report.problems.append(str(exc))
        return report
    index = ds.store.index
    _check_samples(ds, report, deep, scan, progress)
    if deep:
        _check_ranges(root, manifest, index, ds.index_map.public, report)
    return report


def _check_ranges(root: Path, manifest: Manifest, index: Index, public: Callable[[int], int], report: Report) -> None:
    """Each payload the format's reader returns has the CRC-32 recorded for ranged reads by URL
    (packer/layout/ranges.py): a crafted shard whose value was replaced would read other bytes by URL."""
    try:
        recorded = PayloadRanges.load(root, manifest, index)
        found = None if recorded is None else record_ranges(root, manifest, index)
    except PackerError as exc:  # a shard its reader refuses: reported already by the deep check, once is enough
        if str(exc) not in report.problems:
            report.problems.append(str(exc))
        return
    if recorded is None:
        return
    if found is None:
        report.problems.append(f"{root}: payload ranges are recorded, but some payload is no plain byte range of its "
                               "shard now (modified after conversion?)")
        return
    bad = np.flatnonzero(found.crc32 != recorded.crc32)  # a value moved with its bytes (lmdb's pages) reads the same
    for pos in bad[:10].tolist():
        report.problems.append(f"{root}: sample {public(pos)}: its payload is not the one meta/ records for ranged "
                               "reads (a URL of this dataset would read other bytes)")
    if len(bad) > 10:
        report.problems.append(f"{root}: {len(bad) - 10} more samples whose payload is not the recorded one")
    report.checked["payload ranges"] = len(index)


def _verify_remote_samples(url: str, against: str | os.PathLike | None, progress: bool | None, deep: bool,
                           source: SourceOptions | None, cache_dir: str | os.PathLike | None,
                           storage_options: dict[str, Any] | None) -> Report:
    """``verify`` of a URL: every object's sha256 first, then the samples read as ``open_dataset(url)`` reads them
    (through the node's cache) for ``deep`` and ``against``: whole shards by the format's own reader, not the
    recorded payload ranges (a crafted shard whose value moved must be seen as the local reader sees it)."""
    report = verify_remote(url, cache_dir, progress, storage_options)
    if report.problems or (against is None and not deep):
        return report
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IndexingWarning)  # about indices a user maps; the report says it
        ds = open_dataset(url, image="numpy", cache_dir=cache_dir or default_cache_dir(),
                          storage_options=storage_options, remote_mode="shard")  # as the format's reader reads
    try:
        scan = _scan_against(against, ds.manifest, source, f"{redact(url)}/{MANIFEST_NAME}")
    except BaseException:
        ds.close()
        raise
    _check_samples(ds, report, deep, scan, progress)
    return report


def _scan_against(against: str | os.PathLike | None, manifest: Manifest | None, source: SourceOptions | None,
                  where: str | os.PathLike) -> ScanResult | None:
    """The source to compare with, read as the dataset's manifest records it was (a missing source is refused
    before any work)."""
    if against is None:
        return None
    hidden, empty = scan_rules(manifest.options) if manifest is not None else (False, False)  # as converted
    if source is None:
        source = recorded_options(manifest, where)
    return scan_source(against, source, skip_hidden=hidden, allow_empty=empty)


def _check_samples(ds, report: Report, deep: bool, scan: ScanResult | None, progress: bool | None) -> None:
    """The checks that read samples: every one decoded (``deep``) and compared with the source (``scan``)."""
    report.checked["samples"] = len(ds)
    try:
        if deep and not ds.has_images:
            report.checked["without an image (nothing to decode)"] = len(ds)
        elif deep:
            _check_deep(ds, report, progress)
        if scan is not None:
            _check_against(ds, scan, report, progress)
    finally:
        ds.close()


def _check_packed_source(src: Path, report: Report) -> None:
    """A packer dataset compared against is checked against its own manifest first: a copy of a damaged source
    must not pass (its samples would equal the damaged ones). The source's shards are hashed once: its reader
    finds their digests in this process's memory (layout.checksums)."""
    files = read_manifest(src).all_files()
    for info in files:
        problem = file_problem(src, info)
        if problem is not None:
            report.problems.append(f"the source is damaged: {problem}")
    report.checked["source dataset files"] = len(files)


def _check_deep(ds, report: Report, progress: bool | None) -> None:
    """Decode every sample (in storage order: a sequential pass); its shape must be the one the index records."""
    unknown = 0
    for i in bar(range(len(ds)), desc="decoding", progress=progress):
        try:
            arr = ds.pixels_at(i, strict=True)
        except PackerError as exc:
            report.problems.append(str(exc))
            continue
        h, w = int(ds.index.heights[i]), int(ds.index.widths[i])
        if h == 0 and w == 0:
            unknown += 1  # converted with --validate none: no shape was recorded
        elif arr.shape != (h, w, 3):
            report.problems.append(f"{ds.root}: sample {ds.index_map.public(i)} ({ds.index.rel_path(i)}) decodes to "
                                   f"{arr.shape[0]}x{arr.shape[1]}, the index says {h}x{w}")
    report.checked["decoded"] = len(ds)
    if unknown:
        report.checked["without a recorded shape"] = unknown


def _check_indexing(ds, scan: ScanResult, report: Report) -> None:
    """Sample i is the source's i-th packed image in ImageFolder's order, and ``ds.imagefolder_index(i)`` its
    index in the source (where the dataset records it)."""
    if ds.indexing == STORED:
        report.checked["indexing: stored order (an older dataset)"] = len(ds)
        return
    packed = set(ds.index.rel_paths())
    want = [rel for rel in scan.rel_paths if rel in packed]
    got = ds.relpaths
    if got != want:
        k = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        report.problems.append(f"{ds.root}: sample {k} is {got[k] if k < len(got) else 'missing'}, but ImageFolder's "
                               f"sample {k} of {scan.root} is {want[k] if k < len(want) else 'missing'}")
        return
    if not ds.index_map.known:
        report.checked["indexing: source indices not recorded (an older dataset)"] = len(ds)
        return
    number = dict(zip(scan.rel_paths, scan.numbering().tolist()))
    mapped = ds.imagefolder_index(np.arange(len(ds)))
    wrong = [k for k, (rel, j) in enumerate(zip(got, mapped)) if number[rel] != j]
    if wrong or ds.source_records != scan.num_source_records:
        k = wrong[0] if wrong else 0
        report.problems.append(f"{ds.root}: ds.imagefolder_index({k}) is {mapped[k]} of {ds.source_records}, but "
                               f"{got[k]} is ImageFolder's sample {number[got[k]]} of {scan.num_source_records} "
                               f"in {scan.root}")


def within(got: np.ndarray, want: np.ndarray, mean_bound: float = 0.0, max_bound: int = 0) -> bool:
    """Same shape, and the absolute pixel error within the bounds ((0, 0): identical)."""
    if got.shape != want.shape:
        return False
    if max_bound == 0:
        return bool(np.array_equal(got, want))
    err = np.abs(got.astype(np.int16) - want.astype(np.int16))
    return bool(err.max() <= max_bound and err.mean() <= mean_bound)


_MAX_ERRORS_BYTES = 256 << 20  # errors.json: about a million failed files' entries


def reported_errors(root: Path) -> set[str]:
    """The source paths ``errors.json`` lists, read as untrusted input (a regular file inside ``root``, size-capped)."""
    where = str(root / ERRORS_NAME)
    raw = read_inside(root, ERRORS_NAME, _MAX_ERRORS_BYTES, where)
    try:
        errors = json.loads(raw.decode("utf-8"))["errors"]
        paths = {e["path"] for e in errors}
    except (UnicodeDecodeError, ValueError, RecursionError, KeyError, TypeError) as exc:
        raise DatasetError(f"{where}: not a packer error report ({type(exc).__name__}: {exc})") from None
    if not all(isinstance(p, str) for p in paths):
        raise DatasetError(f"{where}: not a packer error report (a path is not a string)")
    return paths


def reference_options(manifest: Manifest, where: str = MANIFEST_NAME) -> ConvertOptions:
    """The conversion a manifest records, checked as ``convert`` checks it, decoding with Pillow (the reference)."""
    recorded = {k: v for k, v in manifest.options.items() if k != "format"}
    try:
        options = make_options(manifest.format, **{**recorded, "decoder": "pil"})
        options.check()
    except PackerError as exc:
        raise DatasetError(f"{where}: the recorded conversion options are not valid ({exc})") from None
    return options


def recorded_options(manifest: Manifest | None, where: str | os.PathLike) -> SourceOptions:
    """How the dataset read its source (its manifest's ``source_options``); nothing recorded, or no readable
    manifest: as ``against`` looks (the manifest's own problems are reported by ``verify``)."""
    if manifest is None:
        return SourceOptions()
    try:
        return SourceOptions.from_record(manifest.source_options, where)
    except PackerError:
        return SourceOptions()


def _check_against(ds, scan: ScanResult, report: Report, progress: bool | None) -> None:
    """Every source file is packed identically (bytes, or Pillow's pixels for raw) or listed as an error, and
    ``ds[i]`` is ImageFolder's sample i (among those packed) where the dataset records that indexing."""
    src = scan.root
    try:
        reported = reported_errors(ds.root)
        options = reference_options(ds.manifest, str(ds.root / MANIFEST_NAME))
    except PackerError as exc:
        report.problems.append(str(exc))
        return
    for rel in scan.unlisted:  # reported or not, what is in it can't be checked
        report.problems.append(f"{src / rel}: cannot list this source folder: its files can't be checked")
    for e in scan.errors:
        if e.path not in reported and e.path not in scan.unlisted:
            report.problems.append(f"{src / e.path}: {e.reason}, and not reported as an error")
    if list(ds.classes) != list(scan.classes):
        report.problems.append(f"classes differ: dataset {ds.classes[:5]}..., source {scan.classes[:5]}...")
    packed = {p: i for i, p in enumerate(ds.index.rel_paths())}  # storage positions
    raw = ds.manifest.payload == "raw"
    options = ConvertOptions.from_record({**ds.manifest.options, "decoder": "pil"}, ds.root)  # the reference decode
    # (0, 0) unless the format is lossy (jpeg mosaics)
    mean_bound, max_bound = get_format(ds.manifest.format).error_bound(ds.manifest.options)
    reader = scan.source_reader()
    wanted = [(rel, label, loc) for rel, label, loc in scan.records() if rel in packed or rel not in reported]
    got = reader.read_in_order((rel, loc) for rel, _, loc in wanted)  # in scan order: sequential readers stream
    for (rel, label, _), res in bar(zip(wanted, got), total=len(wanted), desc="verifying", progress=progress):
        i = packed.get(rel)
        if i is None:
            report.problems.append(f"{src / rel}: neither packed nor reported as an error")
            continue
        if int(ds.index.labels[i]) != label:
            report.problems.append(f"{src / rel}: label {int(ds.index.labels[i])}, the source says {label}")
        if isinstance(res, RecordError):
            report.problems.append(f"{src / rel}: cannot read source ({res})")
            continue
        try:  # a sample that fails to read is a problem found, like one that differs
            if raw:
                expected = prepare(InlineReader(), rel, label, options, (res[0], res[1], None))
                if isinstance(expected, SourceError) or not within(ds.pixels_at(i), np.asarray(expected.payload),
                                                                   mean_bound, max_bound):
                    report.problems.append(f"{src / rel}: stored pixels differ from the source's decode")
            elif isinstance(res[0], np.ndarray) or not _same_payload(bytes(ds.payload_at(i)), res[0], options):
                report.problems.append(f"{src / rel}: stored bytes differ from the source file")
        except PackerError as exc:
            report.problems.append(str(exc))
    extra = set(packed) - set(scan.rel_paths)
    for rel in sorted(extra)[:20]:
        report.problems.append(f"{rel}: packed but not in {src}")
    _check_indexing(ds, scan, report)
    _check_fields(ds, scan, packed, report)
    report.checked["source files"] = len(scan)


def _same_payload(stored: bytes, source: bytes, options: ConvertOptions) -> bool:
    """Stored encoded bytes are the source's or, under ``jpeg_restarts``, its rewrite: the bytes this build
    makes, else (another libjpeg's rewrite of a JPEG this build rewrites too) a JPEG with a restart marker per
    MCU, the source's metadata segments and the source's pixels."""
    if stored == source:
        return True
    if not options.jpeg_restarts or sniff(source) != "jpeg" or sniff(stored) != "jpeg":
        return False
    rewrite = stored_bytes(source, options)
    if rewrite == stored:
        return True
    if rewrite is source:  # a JPEG this build stores as it is (CMYK, damaged...): so would any, the bytes differ
        return False
    try:  # hostile bytes: any decoder's failure is a difference found, not a crash
        segments = jpeg_segments(stored)
        if (0xDD, b"\x00\x01") not in segments or _metadata(segments) != _metadata(jpeg_segments(source)):
            return False
        return np.array_equal(decode(stored, "pil"), decode(source, "pil"))
    except Exception:  # noqa: BLE001
        return False


def _metadata(segments: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    """The APPn and COM segments a rewrite keeps (its encoder writes JFIF and Adobe markers of its own)."""
    return [(m, p) for m, p in segments if (0xE0 <= m <= 0xEF or m == 0xFE)
            and not (m == 0xE0 and p.startswith(b"JFIF\0")) and not (m == 0xEE and p.startswith(b"Adobe"))]


def _check_fields(ds, scan: ScanResult, packed: dict[str, int], report: Report) -> None:
    """The per-sample fields the source gives are the dataset's, each packed sample's stored byte for byte."""
    if ds.field_specs != scan.field_specs:
        report.problems.append(f"fields differ: dataset {ds.field_specs}, the source gives {scan.field_specs}")
        return
    for name, cells in scan.fields.items():
        differ = [rel for rel, cell in zip(scan.rel_paths, cells)
                  if rel in packed and not same_cell(ds.field_store.cell(name, packed[rel]), cell)]
        if differ:
            report.problems.append(f"field {name!r} differs from the source's for {len(differ)} sample(s), "
                                   f"e.g. {scan.root / differ[0]}")
