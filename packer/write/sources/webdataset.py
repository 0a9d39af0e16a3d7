"""WebDataset shards as a source: ``packer convert 'shards-{000000..000099}.tar' --to lmdb`` (a brace pattern, one
``.tar``, or a folder of ``.tar`` files), samples grouped by key as WebDataset groups them (``wdstar``).

A sample's one image member is its record, its ``cls`` member (or ``--label-key``'s field of its ``json``) the
label, its other members per-sample fields; a record's locator is the image's offset and size in the shard, read
with one ``pread``, so memory stays flat whatever the shard's size. The shards of a packer export (``--to wds``,
layout/wdsexport.py) convert back to what was exported: keys, numbers, paths and classes. docs/sources.md has
every rule.
"""

from __future__ import annotations

import itertools
import json
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from packer.errors import PackerError
from packer.layout.fields import as_field_name
from packer.layout.wdsexport import IMAGE_EXTENSIONS as EXPORT_IMAGES
from packer.layout.wdsexport import PATH_CODEC, PATH_EXTENSION, export_classes_file, export_records, holds_wds_export
from packer.perprocess import PerProcess
from packer.write.sources.archive_gz import GzTarReader
from packer.write.sources.base import Facts, Payload, RecordError, SourceReader, read_one_in_order
from packer.write.sources.labels import inside_root, integer_classes, label_problem, named_classes, parse_label
from packer.write.sources.records import ClassMapper, ScanResult, Source, SourceError
from packer.write.sources.wdstar import (
    IMAGE_EXTENSIONS,
    MAX_LABEL_MEMBER,
    TarSample,
    image_member,
    is_compressed,
    list_shard,
    shard_paths,
)


class ShardReader(SourceReader):
    """Reads image members in place: locator (shard number, offset, size); one open file per shard and process."""

    def __init__(self, shards: list[Path]) -> None:
        self.shards = shards
        self._fds: PerProcess[dict[int, tuple[int, int]]] = PerProcess(dict)

    def _fd(self, shard: int) -> tuple[int, int]:
        fds = self._fds.get()
        if shard not in fds:
            try:
                fd = os.open(self.shards[shard], os.O_RDONLY)
            except OSError as exc:
                raise RecordError(f"cannot open {self.shards[shard].name}: {exc.strerror or exc}") from None
            fds[shard] = (fd, os.fstat(fd).st_mtime_ns)
        return fds[shard]

    def read(self, rel: str, loc: Any) -> tuple[Payload, Facts | None]:
        shard, offset, size = loc
        fd, mtime = self._fd(shard)
        try:
            data = os.pread(fd, size, offset)
        except OSError as exc:
            raise RecordError(f"cannot read: {exc.strerror or exc}") from None
        if len(data) != size:
            raise RecordError(f"truncated: {len(data)} of {size} bytes at byte {offset} of {self.shards[shard].name}")
        if not data:
            raise RecordError("empty image member (0 bytes)")
        return data, [size, mtime]

    def facts(self, rel: str, loc: Any) -> Facts | None:
        try:
            st = os.stat(self.shards[loc[0]])
        except OSError:
            return None
        return [loc[2], st.st_mtime_ns] if loc[1] + loc[2] <= st.st_size else None

    def size(self, rel: str, loc: Any) -> int | None:
        return loc[2]

    def location(self, rel: str, loc: Any) -> str:
        return f"{self.shards[loc[0]].name}: member at byte {loc[1]}"

    def missing(self) -> str | None:
        gone = [p for p in self.shards if not p.is_file()]
        return f"cannot see the shard {gone[0]}" if gone else None

    def close(self) -> None:
        self._fds.close(lambda fds: [os.close(fd) for fd, _ in fds.values()])


def sample_label(sample: TarSample, label_key: str | None, named: int | None) -> int | None:
    """The sample's label from ``cls`` (or ``json[label_key]``); None when it has none; RecordError when it names
    no class (``labels.label_problem``; ``named``: how many classes are named, None for "0".."max")."""
    ext = "cls" if label_key is None else "json"
    if ext not in sample.members:
        return None
    name, raw = sample.members[ext].name, sample.small.get(ext)
    if raw is None:
        raise RecordError(f"{name}: more than {MAX_LABEL_MEMBER} bytes, too large to hold a label")
    if label_key is None:
        value = parse_label(raw, named)
        if isinstance(value, str):
            raise RecordError(f"{name}: {value}")
        return value
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RecordError(f"{name}: not JSON ({exc})") from None
    if not isinstance(value, dict) or label_key not in value:
        raise RecordError(f"{name}: no field {label_key!r} (--label-key)")
    label = value[label_key]
    if isinstance(label, bool) or not isinstance(label, int):
        raise RecordError(f"{name}: field {label_key!r} is {str(label)[:40]!r}, not an integer label")
    why = label_problem(label, named)
    if why is not None:
        raise RecordError(f"{name}: {why}")
    return label


class StreamedShardReader(ShardReader):
    """Shards some of which are ``.tar.gz``: read in scan order, each compressed shard streamed once
    (``archive_gz.GzTarReader``; the locator's offset is then the member's number in the stream)."""

    sequential = True

    def read(self, rel: str, loc: Any) -> tuple[Payload, Facts | None]:
        return read_one_in_order(self, rel, loc)

    def read_in_order(self, records: Iterable[tuple[str, Any]]) -> Iterator[tuple[Payload, Facts | None] | RecordError]:
        for shard, group in itertools.groupby(records, key=lambda r: r[1][0]):
            path = self.shards[shard]
            if not is_compressed(path):
                for rel, loc in group:
                    try:
                        yield ShardReader.read(self, rel, loc)
                    except RecordError as exc:
                        yield exc
                continue
            try:
                mtime = os.stat(path).st_mtime_ns
            except OSError as exc:
                for _ in group:
                    yield RecordError(f"cannot read {path.name}: {exc.strerror or exc}")
                continue
            yield from GzTarReader(path, mtime).read_in_order((rel, (n, size)) for rel, (_, n, size) in group)


class WebDatasetSource(Source):
    """WebDataset ``.tar`` shards (uncompressed), their samples in shard order, then tar order."""

    type = "webdataset"

    @classmethod
    def claims(cls, path: Path) -> bool:
        """A brace pattern, or a folder holding ``.tar`` files and nothing else (a single ``.tar`` is an archive)."""
        if "{" in str(path) and not path.exists():
            return True
        if not path.is_dir():
            return False
        if holds_wds_export(path):  # packer's own export: shards beside classes.txt, errors.json, its index
            return True
        names = [p for p in path.iterdir() if not p.name.startswith(".")]
        return bool(names) and all(p.name.endswith((".tar", ".tar.gz", ".tgz")) and p.is_file() for p in names)

    def sequential(self) -> bool:
        return any(is_compressed(p) for p in shard_paths(self.path))

    def scan(self, map_classes: ClassMapper | None = None, *, skip_hidden: bool = False,
             allow_empty: bool = False) -> ScanResult:
        shards = shard_paths(self.path)
        root = Path(os.path.commonpath([p.parent for p in shards]))
        named = named_classes(self.options.classes_file or export_classes_file(root), self.storage_options)
        export = holds_wds_export(root)  # packer's own export (or shards of it): keys and paths come back
        found = _Found(None if named is None else len(named), export)
        for n, shard in enumerate(shards):
            name = shard.relative_to(root).as_posix()
            if not shard.is_file():
                found.errors.append(SourceError(name + "/", "shard missing: its samples are neither packed nor "
                                                "counted", name, record=False))
                continue
            listing = list_shard(shard, EXPORT_IMAGES if export else IMAGE_EXTENSIONS)
            found.ignored.update(listing.ignored)
            for member, reason in listing.problems:
                found.errors.append(SourceError(f"{name}/{member}", reason, f"{name}: member {member or '-'}",
                                                record=bool(member)))  # "": the shard from there on
            for sample in listing.samples:
                found.add(n, name, sample, self.options.label_key)
        labelled = any(v is not None for v in found.labels)
        labels = np.asarray([-1 if v is None else v for v in found.labels], dtype=np.int64)
        classes, keep = [], list(range(len(labels)))
        if labelled:
            keep = [i for i in keep if found.labels[i] is not None]
            for i in sorted(set(range(len(labels))) - set(keep)):
                found.errors.append(SourceError(found.keys[i], "no label (other samples have one: a cls member, "
                                                "or a json member's --label-key field)", found.where[i],
                                                found.numbers[i]))
            classes = integer_classes(labels[keep].tolist(), named)
        if export:
            keep = sorted(keep, key=found.numbers.__getitem__)  # the source's order, whatever the shards' order
        if not keep and not found.errors:
            raise PackerError(f"{self.path}: no samples with an image in {len(shards)} shard(s)")
        reader = (StreamedShardReader if any(is_compressed(p) for p in shards) else ShardReader)(shards)
        specs, cells = member_fields([found.fields[i] for i in keep])
        total = export_records(root) if export else found.count
        numbers = np.asarray([found.numbers[i] for i in keep], dtype=np.int64)
        if total is None:  # an export from before packer recorded its numbering: its keys tell the most
            total = int(numbers.max()) + 1 if len(numbers) else 0
        return ScanResult(root=root, classes=classes, rel_paths=[found.keys[i] for i in keep], labels=labels[keep],
                          ignored=found.ignored, errors=found.errors, reader=reader, locs=[found.locs[i] for i in keep],
                          field_specs=specs, fields=cells, numbers=numbers, source_records=total)


class _Found:
    """The samples found so far (key, label or None, locator, location, number) and what was left out.

    ``named``: how many classes are named (labels.label_problem). ``export``: the shards of a packer export, whose
    samples carry their number (``<key>``) and source path (``<key>.path.txt``); else a sample's number is its
    place in shard order, then tar order.
    """

    def __init__(self, named: int | None, export: bool = False) -> None:
        self.named = named
        self.export = export
        self.keys: list[str] = []
        self.labels: list[int | None] = []
        self.locs: list[tuple[int, int, int]] = []
        self.where: list[str] = []
        self.numbers: list[int] = []
        self.errors: list[SourceError] = []
        self.ignored: Counter = Counter()
        self.fields: list[dict[str, bytes]] = []  # per sample, its other members' bytes by extension
        self.count = 0  # samples met so far (the numbering of shards that are not an export)
        self._taken: set[int] = set()  # an export's numbers met so far
        self._paths: set[str] = set()

    def add(self, n: int, shard: str, sample: TarSample, label_key: str | None) -> None:
        """Add ``sample`` of shard ``n``, or an error naming shard and key (and its number)."""
        where = f"{shard}: key {sample.key}"
        number: int | None = self.count
        self.count += 1
        if self.export:
            number = int(sample.key) if sample.key.isascii() and sample.key.isdigit() else None
            if number is None or number in self._taken:
                why = "a key met twice" if number is not None else "not a number"
                self.errors.append(SourceError(f"{shard}/{sample.key}", f"{why} in a packer export (its keys "
                                               "are the source's record numbers)", where))
                return
            self._taken.add(number)
        found = image_member(sample, EXPORT_IMAGES if self.export else IMAGE_EXTENSIONS)
        if sample.problem is not None or isinstance(found, str):
            self.errors.append(SourceError(f"{shard}/{sample.key}", sample.problem or str(found), where, number))
            return
        ext, member = found
        key = f"{shard}/{sample.key}.{ext}"
        try:
            label = sample_label(sample, label_key, self.named)
            if self.export:
                key = self._source_path(sample, key, where)
        except (RecordError, PackerError) as exc:
            self.errors.append(SourceError(key, str(exc), where, number))
            return
        fields: dict[str, bytes] = {}
        for other in sample.members:
            if other == ext or other == ("cls" if label_key is None else "json") or \
                    (self.export and other == PATH_EXTENSION):
                continue
            data = sample.small.get(other)
            if data is None:
                self.ignored[f"webdataset members not kept (over {MAX_LABEL_MEMBER >> 20} MB): .{other}"] += 1
            elif other.endswith("json") and not _is_json(data):
                self.errors.append(SourceError(f"{shard}/{sample.key}.{other}", "not valid JSON", where, number))
                return
            else:
                fields[other] = data
        self.fields.append(fields)
        self.keys.append(key)
        self.labels.append(label)
        self.locs.append((n, member.offset, member.size))
        self.where.append(where)
        self.numbers.append(number)

    def _source_path(self, sample: TarSample, key: str, where: str) -> str:
        """An export's sample's path in its source (``<key>.path.txt``), checked: relative, inside, not repeated;
        ``key`` (shard and member) for an export written before packer kept the path."""
        if PATH_EXTENSION not in sample.members:
            return key
        raw = sample.small.get(PATH_EXTENSION)
        if raw is None:
            raise RecordError(f"{PATH_EXTENSION}: too large")
        path = inside_root(raw.decode(*PATH_CODEC), where)
        if path in self._paths:
            raise RecordError(f"{PATH_EXTENSION}: {path!r} names another sample's source path too")
        self._paths.add(path)
        return path


def member_fields(members: list[dict[str, bytes]]) -> tuple[dict[str, str], dict[str, list]]:
    """The samples' other members as fields: (name -> spec, name -> cells). ``txt`` -> str (bytes where one is
    not UTF-8), ``json`` -> json (the member's text as it is), others -> bytes; a sample without the member gets
    an empty value (json: null)."""
    exts = sorted({ext for m in members for ext in m})
    specs: dict[str, str] = {}
    cells: dict[str, list] = {}
    for ext in exts:
        name = as_field_name(ext, specs)
        values = [m.get(ext) for m in members]
        kind = "json" if ext.endswith("json") else "str" if ext.endswith("txt") and all(
            v is None or _is_utf8(v) for v in values) else "bytes"
        specs[name] = kind
        cells[name] = [(b"null" if kind == "json" else b"") if v is None else v for v in values]
    return specs, cells


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _is_json(data: bytes) -> bool:
    try:
        json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False
    return True
