"""The conversion journal: what an interrupted conversion had finished, so ``--resume`` can go on.

Inside ``<out>.partial/journal/``:

| file              | written                        | holds                                          |
|-------------------|--------------------------------|------------------------------------------------|
| plan.json         | before the first shard         | options, source, a digest of the scanned file  |
|                   |                                | list, the shard plan (source position ranges)  |
| shard-00000.json  | after that shard is on disk    | its files (sizes, sha256), per-sample metadata |
|                   | (fsynced)                      | (with each source's size and mtime as read)    |
|                   |                                | and the source files it could not pack         |
| swap.json         | after the manifest, before the | the name of the folder the old output (if any) |
|                   | renames into place             | is moved into: --resume finishes the swap      |

The folder is made under a temporary name and renamed to ``<out>.partial`` only once its plan
is written, so a ``.partial`` without a plan was not made by packer and is never deleted. The
journal stays until the dataset is in place, then is removed.

Only JSON: a journal, like a manifest, can never execute code when read. A shard counts as
done only once its entry exists, and its files are checked against it before being reused;
so are its sources: a source whose size or mtime changed since it was read is packed again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from packer.errors import DatasetError
from packer.layout.fsutil import fsync_file, write_atomic
from packer.layout.manifest import FileInfo, Shard, dumps_lossless, sha256_file
from packer.layout.partial import JOURNAL_DIR, PLAN_NAME, SWAP_NAME, made_by_packer
from packer.write.sources.base import SourceReader
from packer.write.sources.records import ScanResult, SourceError

log = logging.getLogger(__name__)  # under "packer": the command line prints it, a library user routes it


@dataclass
class ShardResult:
    """One finished shard: its files and the metadata of the samples it holds, in order."""

    shard_id: int
    shard: Shard
    rel_paths: list[str] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    heights: list[int] = field(default_factory=list)
    widths: list[int] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)
    stats: list[list[int] | None] = field(default_factory=list)  # [size, mtime_ns] of each source as read
    errors: list[SourceError] = field(default_factory=list)
    rewritten: int = 0  # samples stored rewritten (--jpeg-restarts), not as their source's bytes
    # per sample: the file, offset and CRC-32 of its payload ("file", "offset", "crc32": packer.layout.ranges),
    # kept by an output in a bucket while the shard's files were local; None elsewhere (read at the end instead)
    ranges: dict[str, list[int]] | None = None

    def to_json(self) -> str:
        data = asdict(self)
        if data["ranges"] is None:
            del data["ranges"]  # a local output's entry stays as it was
        return dumps_lossless(data)

    @classmethod
    def from_json(cls, text: str, where: str) -> ShardResult:
        try:
            data = json.loads(text)
            shard = data["shard"]
            result = cls(
                shard_id=int(data["shard_id"]),
                shard=Shard(
                    num_samples=int(shard["num_samples"]),
                    files=[FileInfo(str(f["name"]), int(f["num_bytes"]), str(f["sha256"])) for f in shard["files"]],
                    facts=dict(shard.get("facts", {})),
                ),
                rel_paths=[str(p) for p in data["rel_paths"]],
                labels=[int(v) for v in data["labels"]],
                heights=[int(v) for v in data["heights"]],
                widths=[int(v) for v in data["widths"]],
                nbytes=[int(v) for v in data["nbytes"]],
                stats=[None if v is None else [int(v[0]), int(v[1])] for v in data["stats"]],
                errors=[SourceError.from_json(e) for e in data["errors"]],
                rewritten=int(data.get("rewritten", 0)),
                ranges=_ranges(data.get("ranges")),
            )
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise DatasetError(f"{where}: damaged journal entry ({exc})") from exc
        n = result.shard.num_samples
        if not all(len(v) == n for v in (result.rel_paths, result.labels, result.heights, result.widths, result.nbytes,
                                         result.stats, *(result.ranges or {}).values())):
            raise DatasetError(f"{where}: damaged journal entry (lengths disagree)")
        return result


RANGE_LIMITS = {"file": 1 << 31, "offset": 1 << 63, "crc32": 1 << 32}  # what each fits (packer.layout.ranges)


def _ranges(data: Any) -> dict[str, list[int]] | None:
    """A journal entry's payload ranges: three lists of ints in their dtypes' bounds (ValueError where not)."""
    if data is None:
        return None
    got = {key: [int(v) for v in data[key]] for key in RANGE_LIMITS}
    if any(not 0 <= v < RANGE_LIMITS[key] for key, values in got.items() for v in values):
        raise ValueError("a payload range out of bounds")
    return got


def scan_digest(scan: ScanResult) -> str:
    """Identifies the scanned file list and labels: a resume must see the same source."""
    h = hashlib.sha256()
    h.update(json.dumps(scan.classes).encode())
    for rel, label in zip(scan.rel_paths, scan.labels.tolist()):
        h.update(f"{label}\0{rel}\n".encode("utf-8", "surrogateescape"))  # a name's non-UTF-8 bytes as they are
    return h.hexdigest()


def write_plan(partial: Path, plan: dict[str, Any]) -> None:
    (partial / JOURNAL_DIR).mkdir(exist_ok=True)
    write_atomic(partial / JOURNAL_DIR / PLAN_NAME, dumps_lossless(plan, indent=1))


def read_plan(partial: Path) -> dict[str, Any] | None:
    """The journaled plan of ``partial``, or None where packer did not make it (see ``made_by_packer``)."""
    path = partial / JOURNAL_DIR / PLAN_NAME
    if not made_by_packer(partial):
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{path}: damaged conversion plan ({exc}); remove {partial} and convert again") from exc


def shard_entry(partial: Path, shard_id: int) -> Path:
    return partial / JOURNAL_DIR / f"shard-{shard_id:05d}.json"


def record_shard(partial: Path, result: ShardResult, names: list[str]) -> ShardResult:
    """Flush the shard's files and checksum them (at once: both take a while), then journal the shard as done.

    ``result.shard.files`` may already hold files the writer checksummed as it wrote them: those are not read back.
    """
    known = {f.name: f for f in result.shard.files}
    with ThreadPoolExecutor(max_workers=1) as hasher:
        sums = {n: hasher.submit(sha256_file, partial / n) for n in names if n not in known}
        for name in names:
            fsync_file(partial / name)
        result.shard.files = [known[n] if n in known else FileInfo(n, (partial / n).stat().st_size, sums[n].result())
                              for n in names]
    write_atomic(shard_entry(partial, result.shard_id), result.to_json())
    return result


def write_swap(partial: Path, trash: str | None) -> None:
    """Journal the swap about to happen: the old output (if any) goes into folder ``trash`` beside it."""
    write_atomic(partial / JOURNAL_DIR / SWAP_NAME, json.dumps({"trash": trash}))


def load_done_shards(partial: Path, num_shards: int, scan: ScanResult) -> dict[int, ShardResult]:
    """Journaled shards whose files are intact and whose records (of ``scan``) are unchanged; anything
    else in ``partial`` is removed."""
    done: dict[int, ShardResult] = {}
    changed: list[str] = []
    reader, locs = scan.source_reader(), (scan.locator_of() if scan.locs is not None else {})
    for shard_id in range(num_shards):
        entry = shard_entry(partial, shard_id)
        if not entry.is_file():
            continue
        result = ShardResult.from_json(entry.read_text(encoding="utf-8"), str(entry))
        stale = changed_sources(reader, locs, result)
        changed += stale
        if not stale and intact_files(partial, result):
            done[shard_id] = result
        else:
            entry.unlink()
    if changed:
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        log.info("%d source file(s) changed since the interrupted run (%s): packing their shards again", len(changed),
                 shown)
    remove_unkept(partial, done)
    return done


def intact_files(partial: Path, result: ShardResult) -> bool:
    """Whether the journaled shard's files are all there with their recorded sizes and checksums."""
    return all(
        (partial / f.name).is_file()
        and (partial / f.name).stat().st_size == f.num_bytes
        and sha256_file(partial / f.name) == f.sha256
        for f in result.shard.files
    )


def remove_unkept(partial: Path, done: dict[int, ShardResult]) -> None:
    """Remove every file of ``partial`` outside the journal that no ``done`` shard lists (and emptied folders)."""
    keep = {f.name for r in done.values() for f in r.shard.files}
    for dirpath, _dirnames, filenames in os.walk(partial, topdown=False):
        rel_dir = Path(dirpath).relative_to(partial)
        if rel_dir.parts[:1] == (JOURNAL_DIR,):
            continue
        for name in filenames:
            if (rel_dir / name).as_posix() not in keep:
                os.remove(os.path.join(dirpath, name))
        if rel_dir != Path(".") and not os.listdir(dirpath):
            os.rmdir(dirpath)


def changed_sources(reader: SourceReader, locs: dict[str, Any], result: ShardResult) -> list[str]:
    """The shard's packed records whose facts (a file's size and mtime in ns) now differ from when they were
    read, or that are gone."""
    return [rel for rel, seen in zip(result.rel_paths, result.stats)
            if seen is None or reader.facts(rel, locs.get(rel)) != seen]
