"""The end of every write (``convert`` and ``Writer``): meta files, errors.json, the manifest (last), fsync, swap.

Until the manifest is written the output is only ``<out>.partial``; the swap into place is journaled
(write.output), so a kill between the renames is finished by a resumed run.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from packer.errors import DatasetError
from packer.layout.fields import FieldSpec, save_fields
from packer.layout.fsutil import write_plain
from packer.layout.index import Index
from packer.layout.manifest import Manifest, dumps_lossless, file_info, write_manifest
from packer.layout.report import ERRORS_NAME, MAX_ERRORS_BYTES
from packer.layout.trust import read_inside
from packer.write.journal import ShardResult
from packer.write.output import Output
from packer.write.ranges import record_ranges
from packer.write.sources.records import SourceError
from packer.write.summary import not_packed_line

log = logging.getLogger(__name__)  # under "packer": the command line prints it, a library user routes it


def stored_index(shards: list[ShardResult], source_order: list[str] | None,
                 source_numbers: np.ndarray | None = None) -> Index:
    """The index of the samples the shards hold, in storage order; ``source_order``: every record's key in
    the source's order (for ``position``), ``source_numbers`` their numbers in the source (``source_index``)."""
    def cat(name: str) -> list:
        return [v for r in shards for v in getattr(r, name)]

    return Index.build(cat("rel_paths"), cat("labels"), cat("heights"), cat("widths"), cat("nbytes"),
                       source_order=source_order, source_numbers=source_numbers)


def number_errors(errors: list[SourceError], keys: list[str], numbers: np.ndarray) -> list[SourceError]:
    """``errors`` of records that failed when read (``keys``: the records, ``numbers``: their numbers in the
    source), each given its record's number: errors.json then says which source index was not packed."""
    number_of = dict(zip(keys, numbers.tolist()))
    for e in errors:
        if e.index is None:
            e.index = number_of.get(e.path)
    return errors


def in_storage_order(index: Index, keys: list[str], columns: Mapping[str, Sequence[Any]]) -> dict[str, list[Any]]:
    """Per-record ``columns`` (in the order of ``keys``) reordered to the samples ``index`` stores."""
    if not columns:
        return {}
    rank = {key: k for k, key in enumerate(keys)}
    order = [rank[p] for p in index.rel_paths()]
    return {name: [values[k] for k in order] for name, values in columns.items()}


def seal(output: Output, index: Index, errors: list[SourceError], ignored: Mapping[str, int], manifest: Manifest,
         specs: Mapping[str, FieldSpec] | None = None, columns: Mapping[str, Sequence[Any]] | None = None,
         earlier: Sequence[Mapping[str, Any]] = ()) -> None:
    """Write ``index``, the field ``columns`` (storage order) and the payloads' ranges (packer.write.ranges) under
    meta/, errors.json (``earlier``: the numbered entries a re-packed dataset carries), then ``manifest`` (its
    meta_files, num_samples, num_errors and fields filled in here; ``source_records`` given by the caller) last;
    fsync, and swap into place."""
    partial = output.folder
    specs = dict(specs or {})
    names = index.save(partial) + save_fields(partial, specs, columns or {})
    # where payloads are plain byte ranges: ranged reads by URL (a bucket's shards: the ranges kept as uploaded)
    ranges = record_ranges(partial, manifest, index, output.recorded_ranges)
    names += [] if ranges is None else ranges.save(partial)
    manifest.meta_files = [file_info(partial, n) for n in names]
    manifest.num_samples, manifest.num_errors = len(index), len(errors)
    manifest.fields = {k: s.text for k, s in specs.items()}
    write_error_report(partial, errors, ignored, len(index), earlier)
    output.seal(lambda folder: write_manifest(folder, manifest))


def write_error_report(partial: Path, errors: list[SourceError], ignored: Mapping[str, int], packed: int,
                       earlier: Sequence[Mapping[str, Any]] = ()) -> None:
    """``errors.json`` (every record not packed, with reason, location and source index; what the scan ignored;
    ``earlier``: a re-packed dataset's own numbered entries, layout/report.py) and the first ten on stderr;
    ``packed``: the records that were (``summary.not_packed_line`` counts them)."""
    # a plain write: fsync_tree flushes it with the index (one journal commit), and --resume rewrites whatever
    # an interrupted finish left, so it needs no atomic write of its own
    write_plain(partial / ERRORS_NAME, dumps_lossless(
        {"num_errors": len(errors), "ignored": dict(ignored),
         "errors": [e.to_json() for e in sorted(errors, key=lambda e: e.path)],
         **({"earlier": [dict(e) for e in earlier]} if earlier else {})},
        indent=1,
    ))
    if errors:  # one record: the first ten below the count
        shown = [f"  {e.path}: {e.reason}" for e in errors[:10]]
        more = [f"  ... and {len(errors) - 10} more"] if len(errors) > 10 else []
        head = f"{not_packed_line(packed, errors)}, see {ERRORS_NAME}:"
        log.warning("%s", "\n".join([head, *shown, *more]))


def recorded_errors(directory: Path, shown: str | None = None) -> list[SourceError]:
    """The errors a finished conversion's ``errors.json`` in ``directory`` lists (at most ``MAX_ERRORS_BYTES`` read);
    ``shown``: the dataset's name in messages where ``directory`` holds a copy (a URL's, fetched)."""
    name = shown or str(directory)
    try:
        raw = read_inside(directory, ERRORS_NAME, MAX_ERRORS_BYTES, f"{name}/{ERRORS_NAME}")
        report = json.loads(raw.decode("utf-8"))
        return [SourceError.from_json(e) for e in report["errors"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise DatasetError(f"{name}/{ERRORS_NAME}: damaged error report ({exc}); move {name} away and convert "
                           "again") from exc
