"""A packer dataset as a source: any format into any other (``packer convert imgs.lmdb --to hdf5``).

Records are the dataset's samples in its order (record i is ``ds[i]``, wherever it is stored), numbered as the
dataset numbers them in its own source (``ds.imagefolder_index``: a re-pack of a dataset with files left out keeps
the original numbering, and carries the numbered entries of its errors.json as ``earlier``);
keys are its relative paths (so ``ds.samples``, ``extract`` and ``verify`` speak of the original files);
labels, classes and per-sample fields as it stores them (fields as their stored
cells, so they stay byte-identical).
Encoded payloads move as the stored bytes, never re-encoded (``--payload raw`` decodes them);
raw payloads move as pixels and can only stay raw. Reads go through the format's own ``Reader``
(one per shard, opened per process), each checked against the size the index records.

A shard's files are checked against the source's manifest (sizes and sha256, as ``packer verify`` does) before
any of its samples is read: a damaged shard's samples become errors naming the shard and the reason, never a
clean copy of damaged bytes with fresh checksums. A conversion checks each shard once, in the driver, by a
thread hashing the shards a few ahead of the records handed to the workers (``admitted``: streamed, and the
hash leaves the shard in the page cache for the reads that follow); the verdict travels in each record's
locator. A reader given a record without one (``verify --against``, a single process) checks the shard itself,
once per process.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from packer.errors import PackerError
from packer.formats import check_recorded_options, get_format
from packer.formats.base import ShardReader
from packer.layout.checksums import file_problem
from packer.layout.fields import load_fields
from packer.layout.index import Index, shard_starts
from packer.layout.manifest import IMAGELESS, MANIFEST_NAME, Manifest, Shard, holds_dataset, read_manifest
from packer.layout.report import numbered_entries, read_report
from packer.layout.trust import reading
from packer.write.sources.base import Facts, Payload, RecordError, SourceReader
from packer.write.sources.records import ClassMapper, ScanResult, Source

CHECKERS = 2  # threads hashing a conversion's source shards (hashlib releases the GIL)
CHECKED_AHEAD = 2  # shards hashed ahead of the records handed out: their pages stay cached for the reads


class PackedSource(Source):
    """A folder holding a packer manifest."""

    type = "packed"

    @classmethod
    def claims(cls, path: Path) -> bool:
        return path.is_dir() and holds_dataset(path)

    def scan(self, map_classes: ClassMapper | None = None, *, skip_hidden: bool = False,
             allow_empty: bool = False) -> ScanResult:
        root = self.path
        manifest = read_manifest(root)
        manifest.check_files(root)
        check_recorded_options(manifest.format, manifest.options, root / MANIFEST_NAME)
        index = Index.load(root, manifest.num_samples, files=manifest.meta_files, num_classes=len(manifest.classes),
                           source_records=manifest.source_records)
        store = load_fields(root, manifest)  # carried as stored cells: the same bytes in the new dataset
        locs = list(zip(range(len(index)), index.nbytes.tolist(), index.heights.tolist(), index.widths.tolist()))
        stored = ScanResult(root=root, classes=list(manifest.classes), rel_paths=index.rel_paths(),
                            labels=np.asarray(index.labels, dtype=np.int64), reader=PackedReader(root, manifest),
                            locs=locs, field_specs=store.texts, fields={k: store.cells(k) for k in store.specs})
        if index.source_index is not None:  # the source's numbering, kept (else: record i is number i)
            stored.numbers, stored.source_records = index.source_index, manifest.source_records
            stored.earlier = _numbered_errors(root)
        return stored if index.position is None else stored.take(index.position)  # ds[i] is record i


def _numbered_errors(root: Path) -> list[dict[str, Any]]:
    """The entries of the dataset's errors.json with a source index: the records of its source it never held
    (none when the report is missing or damaged: the numbering still holds, only those reasons are lost)."""
    try:
        return numbered_entries(read_report(root))
    except PackerError:
        return []


class PackedReader(SourceReader):
    """Sample ``i`` (the locator ``(i, nbytes, height, width)``) through its shard's format Reader."""

    def __init__(self, root: Path, manifest: Manifest) -> None:
        self.root = root
        self.gives_pixels = manifest.payload == "raw"
        self.holds_images = manifest.payload != IMAGELESS
        fmt = get_format(manifest.format)
        self.readers: list[ShardReader] = [fmt.Reader(root, s, manifest.payload, access="sequential")
                                           for s in manifest.shards]
        self.starts = shard_starts([s.num_samples for s in manifest.shards])
        self.shards: list[Shard] = manifest.shards
        self.mtime_ns = os.stat(root / MANIFEST_NAME).st_mtime_ns
        self.damage: dict[int, str | None] = {}  # shard -> why its files fail their checks (None: they pass)

    def shard_damage(self, shard: int) -> str | None:
        """Why shard ``shard``'s files are not those the manifest records (None: they are), checked once."""
        if shard not in self.damage:
            problems = (file_problem(self.root, f) for f in self.shards[shard].files)
            problem = next((p for p in problems if p is not None), None)
            self.damage[shard] = None if problem is None else (
                f"{problem}: shard {shard} of the source dataset is damaged, its samples are not packed")
        return self.damage[shard]

    def shard_of(self, i: int) -> int:
        return int(np.searchsorted(self.starts, i, side="right")) - 1

    def admitted(self, records: Iterable[tuple[str, int, Any]]) -> Iterator[tuple[str, int, Any]]:
        """Each record once its shard is checked, with the verdict as a fifth locator entry ("" : the shard passed).
        Shards are hashed by ``CHECKERS`` threads in the order the records first need them, up to ``CHECKED_AHEAD``
        beyond the furthest one needed so far: the check streams with the conversion instead of a pass before it."""
        items = list(records)
        shards = (np.searchsorted(self.starts, [loc[0] for _, _, loc in items], side="right") - 1).tolist()
        need = list(dict.fromkeys(shards))  # shards in the order first needed
        rank = {shard: k for k, shard in enumerate(need)}
        checks: list[Future] = []  # need[k]'s check is checks[k]
        furthest = 0
        pool = ThreadPoolExecutor(CHECKERS, thread_name_prefix="packer-check-source")
        try:
            for (rel, label, loc), shard in zip(items, shards, strict=True):
                furthest = max(furthest, rank[shard])
                while len(checks) < min(len(need), furthest + 1 + CHECKED_AHEAD):
                    checks.append(pool.submit(self.shard_damage, need[len(checks)]))
                damage = checks[rank[shard]].result()
                yield rel, label, (*loc[:4], damage or "")
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def read(self, rel: str, loc: Any) -> tuple[Payload, Facts | None]:
        i, nbytes, h, w = loc[:4]
        shard = self.shard_of(i)
        # before its bytes reach this copy (or the format's reader): the verdict ``admitted`` gave, or checked here
        damage = (loc[4] or None) if len(loc) > 4 else self.shard_damage(shard)
        if damage is not None:
            raise RecordError(damage)
        try:
            with reading(f"{self.root}: sample {i}"):
                buf = self.readers[shard].read(i - int(self.starts[shard]))
                payload: Payload = np.array(buf) if isinstance(buf, np.ndarray) else bytes(buf)
        except PackerError as exc:
            raise RecordError(str(exc)) from None
        size = payload.nbytes if isinstance(payload, np.ndarray) else len(payload)
        if size != nbytes or (self.gives_pixels and size != h * w * 3):
            raise RecordError(f"{size} bytes read, the source's index says {nbytes} ({h}x{w}) (damaged dataset)")
        if self.gives_pixels:  # formats store pixels flat or shaped: the index says the shape
            payload = np.frombuffer(payload, np.uint8).reshape(h, w, 3) if isinstance(payload, bytes) \
                else payload.reshape(h, w, 3)
        return payload, [nbytes, self.mtime_ns]

    def facts(self, rel: str, loc: Any) -> Facts | None:
        try:
            return [loc[1], os.stat(self.root / MANIFEST_NAME).st_mtime_ns]
        except OSError:
            return None

    def size(self, rel: str, loc: Any) -> int | None:
        return None if self.gives_pixels else loc[1]

    def location(self, rel: str, loc: Any) -> str:
        return f"{self.root.name}: sample {loc[0]}"

    def missing(self) -> str | None:
        return None if self.root.is_dir() else f"cannot see the source dataset {self.root}"

    def close(self) -> None:
        for r in self.readers:
            r.close()
