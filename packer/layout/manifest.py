"""``manifest.json``: what a packed dataset is, written last and atomically.

A directory without a valid manifest is not a dataset. The manifest is plain JSON (never
pickle), checked on load for its kind and version, so an old or foreign directory gets a
clear error instead of a confusing read failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from packer.errors import DatasetError, InputNotFoundError, PackerError
from packer.layout.fsutil import write_atomic
from packer.layout.partial import unfinished_note
from packer.layout.trust import check_inner_name, inside, json_kind, read_inside
from packer.perprocess import PicklesAs

KIND = "packer-dataset"
VERSION = 1
MANIFEST_NAME = "manifest.json"
PAYLOADS = ("encoded", "raw", "none")  # encoded: the source file's bytes; raw: decoded HWC uint8 RGB; none: no image
IMAGELESS = "none"  # samples of fields and a label only (a Writer's tokens, embeddings, boxes): 0-byte payloads


@dataclass
class FileInfo:
    """One file of a shard, with what ``packer verify`` checks."""

    name: str  # relative to the dataset directory
    num_bytes: int
    sha256: str


@dataclass
class Shard:
    """A run of consecutive samples stored together."""

    num_samples: int
    files: list[FileInfo]
    facts: dict[str, Any] = field(default_factory=dict)  # format-specific, from Writer.close()


@dataclass
class Manifest(PicklesAs):
    """What a packed dataset is (``manifest.json``); a URL dataset's pickles as a reference to it (reloaded from the
    node's cache where unpickled: packer/layout/remote.py)."""

    format: str
    payload: str
    num_samples: int
    classes: list[str]
    shards: list[Shard]
    meta_files: list[FileInfo] = field(default_factory=list)  # meta/*.npy, checksummed like shards
    options: dict[str, Any] = field(default_factory=dict)
    num_errors: int = 0
    source: str = ""  # the converted folder, absolute (older datasets: as given, maybe relative)
    extensions: list[str] = field(default_factory=list)  # the file name endings the scan took; [] in older datasets
    source_digest: str = ""  # the scanned file list, sizes and mtimes (packer.write.fresh); "" before it was kept
    source_type: str = ""  # how the source was read (write/sources: folder, list, archive, packed, ...)
    source_options: dict[str, Any] = field(default_factory=dict)  # ... and with which options (verify --against)
    fields: dict[str, str] = field(default_factory=dict)  # per-sample fields: name -> spec (layout/fields.py)
    # records in the source's numbering (packed, refused, left out: meta/source_index.npy); None in older datasets
    source_records: int | None = None
    created_by: str = ""
    created_at: str = ""
    kind: str = KIND
    version: int = VERSION

    def to_dict(self) -> dict[str, Any]:
        """The manifest as JSON-able data (``dataclasses.asdict`` without its deep copies: a million file
        entries took it a minute)."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["shards"] = [{"num_samples": s.num_samples, "files": [vars(f).copy() for f in s.files],
                           "facts": dict(s.facts)} for s in self.shards]
        data["meta_files"] = [vars(f).copy() for f in self.meta_files]
        return data

    def to_json(self) -> str:
        return dumps_lossless(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, data: Any, where: str = "manifest") -> Manifest:
        """Build from parsed JSON, checking every field's type and range (the file may be crafted)."""
        if not isinstance(data, dict) or data.get("kind") != KIND:
            kind = data.get("kind") if isinstance(data, dict) else type(data).__name__
            raise DatasetError(f"{where}: not a packer manifest (kind is {kind!r})")
        if data.get("version") != VERSION:
            raise DatasetError(
                f"{where}: manifest version {data.get('version')!r}, but this packer reads version "
                f"{VERSION}; convert again or use a matching packer"
            )
        try:
            shards = [
                Shard(
                    num_samples=_count(s["num_samples"], "shard num_samples"),
                    files=[_file_info(f) for f in _typed(s["files"], list, "shard files")],
                    facts=dict(_typed(s.get("facts", {}), dict, "shard facts")),
                )
                for s in _typed(data["shards"], list, "shards")
            ]
            meta_files = [_file_info(f) for f in _typed(data.get("meta_files", []), list, "meta_files")]
            manifest = cls(
                format=_typed(data["format"], str, "format"),
                payload=_typed(data["payload"], str, "payload"),
                num_samples=_count(data["num_samples"], "num_samples"),
                classes=[_typed(c, str, "class name") for c in _typed(data["classes"], list, "classes")],
                shards=shards,
                meta_files=meta_files,
                options=_options(data.get("options", {})),
                num_errors=_count(data.get("num_errors", 0), "num_errors"),
                source=str(data.get("source", "")),
                extensions=[_typed(e, str, "extension")
                            for e in _typed(data.get("extensions", []), list, "extensions")],
                source_digest=str(data.get("source_digest", "")),
                source_type=str(data.get("source_type", "")),
                source_options=dict(_typed(data.get("source_options", {}), dict, "source_options")),
                fields={_typed(k, str, "field name"): _typed(v, str, "field spec")
                        for k, v in _typed(data.get("fields", {}), dict, "fields").items()},
                source_records=None if data.get("source_records") is None else
                _count(data["source_records"], "source_records"),
                created_by=str(data.get("created_by", "")),
                created_at=str(data.get("created_at", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise DatasetError(f"{where}: malformed manifest ({type(exc).__name__}: {exc})") from exc
        manifest.check(where)
        return manifest

    def check(self, where: str) -> None:
        """Internal consistency: counts add up, file names stay inside the dataset, each named once."""
        if self.payload not in PAYLOADS:
            raise DatasetError(f"{where}: unknown payload {self.payload!r} (expected one of {PAYLOADS})")
        if self.num_samples < 0 or any(s.num_samples < 0 for s in self.shards):
            raise DatasetError(f"{where}: negative sample count")
        total = sum(s.num_samples for s in self.shards)
        if total != self.num_samples:
            raise DatasetError(f"{where}: shards hold {total} samples but the manifest says {self.num_samples}")
        if self.source_records is not None and self.source_records < self.num_samples:
            raise DatasetError(f"{where}: source_records {self.source_records} is below num_samples {self.num_samples}")
        if any(not s.files for s in self.shards):
            raise DatasetError(f"{where}: a shard lists no files")
        if len(set(self.classes)) != len(self.classes):
            raise DatasetError(f"{where}: class names repeat")
        seen: set[str] = set()
        for f in self.all_files():
            check_inner_name(f.name, where)
            if os.path.normpath(f.name) in seen or f.name == MANIFEST_NAME:
                raise DatasetError(f"{where}: file {f.name!r} listed twice")
            seen.add(os.path.normpath(f.name))

    def all_files(self) -> list[FileInfo]:
        return [f for s in self.shards for f in s.files] + list(self.meta_files)

    def check_files(self, directory: Path) -> None:
        """Every listed file exists inside ``directory`` (no symlink leading out) with its recorded size.

        A cheap ``stat`` per file, no hashing: damage inside a file is ``packer verify``'s job.
        """
        problems = self.file_problems(directory, first=True)
        if problems:
            raise DatasetError(problems[0])

    def size_problems(self, sizes: Mapping[str, int], where: Callable[[str], str]) -> list[str]:
        """What ``file_problems`` finds, from sizes already known (a listing of the dataset's objects): a file
        missing or not of its recorded size; ``where(name)`` names the file in the message."""
        problems = []
        for f in self.all_files():
            size = sizes.get(f.name)
            if size is None:
                problems.append(f"{where(f.name)}: missing")
            elif size != f.num_bytes:
                problems.append(f"{where(f.name)}: {size} bytes, manifest says {f.num_bytes} (damaged or replaced)")
        return problems

    def file_problems(self, directory: Path, first: bool = False) -> list[str]:
        """What ``check_files`` finds, every problem (``first``: up to the first): a file missing, leading out of
        ``directory``, or not of its recorded size (a ``stat`` each, no hashing)."""
        problems = []
        for f in self.all_files():
            try:
                path = inside(directory, f.name, str(directory / MANIFEST_NAME))
                size = path.stat().st_size
            except PackerError as exc:
                problems.append(str(exc))
            except OSError as exc:
                problems.append(f"{directory / f.name}: {exc.strerror or exc}")
            else:
                if size != f.num_bytes:
                    problems.append(f"{path}: {size} bytes, manifest says {f.num_bytes} (damaged or replaced)")
            if first and problems:
                break
        return problems


_MAX_COUNT = 1 << 62


def dumps_lossless(data: Any, **kwargs: Any) -> str:
    """JSON text, readable (not ASCII-escaped), that can be written as UTF-8 whatever names it holds.

    A file name that is not valid UTF-8 reaches Python with its bytes as lone surrogates
    (surrogateescape); they become ``\\udcXX`` escapes, which JSON reads back unchanged.
    """
    return json.dumps(data, ensure_ascii=False, **kwargs).encode("utf-8", "backslashreplace").decode("utf-8")


def _typed(value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"{what} must be {kind.__name__}, found {type(value).__name__} {value!r:.60}")
    return value


def _count(value: Any, what: str) -> int:
    _typed(value, int, what)
    if not 0 <= value < _MAX_COUNT:
        raise ValueError(f"{what} {value} out of range")
    return value


# The conversion options a manifest records (ConvertOptions' fields but ``decoder``) and the types
# and ranges of their values: ``packer verify --against`` rebuilds the conversion from them, so a
# crafted value is refused when the manifest is read. Names not listed are kept and read by nothing.
OPTION_TYPES: dict[str, tuple[type, ...]] = {
    "format": (str,), "payload": (str,), "validate": (str,), "shard_bytes": (int, type(None)),
    "resize": (str, type(None)), "resize_mode": (str,), "upscale": (bool,), "compression": (str, type(None)),
    "order": (str,), "seed": (int,), "skip_hidden": (bool,), "allow_empty": (bool,), "jpeg_restarts": (bool,),
}  # a format's own options (mosaic's tile, quality, ...) are its to check: Format.check_options
_OPTION_RANGES: dict[str, tuple[int, int]] = {"shard_bytes": (1, _MAX_COUNT), "seed": (0, _MAX_COUNT)}


def _options(value: Any) -> dict[str, Any]:
    """The manifest's ``options``, each listed one of its type and in its range."""
    options = dict(_typed(value, dict, "options"))
    for name, v in options.items():
        kinds = OPTION_TYPES.get(name)
        if kinds is None:
            continue
        if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
            allowed = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise TypeError(f"option {name} must be {allowed}, found {type(v).__name__} {v!r:.60}")
        bounds = _OPTION_RANGES.get(name)
        if bounds is not None and v is not None and not bounds[0] <= v <= bounds[1]:
            lo, hi = bounds
            raise ValueError(f"option {name} {v} out of range ({lo} to {hi})")
    return options


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _file_info(f: Any) -> FileInfo:
    _typed(f, dict, "file entry")
    digest = _typed(f["sha256"], str, "sha256")
    if not _SHA256.fullmatch(digest):
        raise ValueError(f"sha256 {digest!r:.80} is not 64 hex digits")
    return FileInfo(_typed(f["name"], str, "file name"), _count(f["num_bytes"], "num_bytes"), digest)


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Write ``manifest.json`` atomically (tmp file, fsync, rename, folder fsync)."""
    write_atomic(directory / MANIFEST_NAME, manifest.to_json())


def dataset_directory(directory: str | os.PathLike) -> Path:
    """``directory``, refused when it is no dataset at all: missing, unreadable, not a directory, no manifest.

    A directory that passes may still be damaged: that is for ``read_manifest`` and the readers to find.
    """
    directory = Path(directory)
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        note = unfinished_note(Path(os.path.abspath(directory)))
        raise InputNotFoundError(f"{directory}: no such dataset{note}") from None
    except OSError as exc:
        raise PackerError(f"{directory}: cannot open ({exc.strerror or exc})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise InputNotFoundError(f"{directory}: not a packed dataset (a dataset is a directory)")
    if not os.access(directory, os.R_OK | os.X_OK):
        raise PackerError(f"{directory}: cannot open (permission denied)")
    if not os.path.lexists(directory / MANIFEST_NAME):
        raise InputNotFoundError(f"{directory}: not a packed dataset, {MANIFEST_NAME} is missing (an unfinished "
                                 "conversion?)")
    return directory


def read_manifest(directory: str | os.PathLike) -> Manifest:
    directory = dataset_directory(directory)
    return load_manifest(directory, str(directory / MANIFEST_NAME), lambda listed: count_files(directory, listed))


def load_manifest(directory: Path, where: str, present: Callable[[int], int], sha256: str | None = None) -> Manifest:
    """``directory/manifest.json`` (a regular file inside it, size-capped), parsed and checked as a dataset's:
    ``present(listed)`` counts the files the dataset holds, up to ``listed`` (``check_counts``). ``where`` names
    the manifest in messages: its path, or the URL it was fetched from (packer/layout/remote.py). ``sha256``: the
    digest its bytes must have (a URL dataset's copy in the node's cache, reloaded where it is unpickled)."""
    raw = read_inside(directory, MANIFEST_NAME, MAX_MANIFEST_BYTES)
    if sha256 is not None and hashlib.sha256(raw).hexdigest() != sha256:
        raise DatasetError(f"{where}: the node's copy ({directory / MANIFEST_NAME}) is no longer the manifest this "
                           "dataset was opened with (the cache folder was changed): open the dataset again")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise DatasetError(f"{where}: cannot read manifest ({type(exc).__name__}: {exc})") from exc
    check_counts(data, present, where)
    return Manifest.from_dict(data, where=where)


def check_counts(data: Any, present: Callable[[int], int], where: str) -> None:
    """Before any per-shard work: every shard lists a file, and the files listed are no more than the dataset
    holds (``present(listed)``: its files counted up to ``listed``). A crafted manifest claiming a million shards
    was otherwise parsed, checked and stat'ed entry by entry for minutes before a missing file refused it; here it
    costs one pass counting list lengths and a walk of the dataset's folder (or a listing of its objects) that
    stops once it has seen as many files as are listed."""
    shards = data.get("shards") if isinstance(data, dict) else None
    meta = data.get("meta_files") if isinstance(data, dict) else None
    if not isinstance(shards, list):
        return  # from_dict says what is wrong
    listed = len(meta) if isinstance(meta, list) else 0
    for s in shards:
        files = s.get("files") if isinstance(s, dict) else None
        if not isinstance(files, list):
            return  # from_dict says what is wrong with this shard before building anything after it
        if not files:
            raise PackerError(f"{where}: a shard lists no files")
        listed += len(files)
    held = present(listed)
    if held < listed:
        raise PackerError(f"{where}: lists {listed:,} files in {len(shards):,} shards, but the dataset folder "
                          f"holds {held:,} files (a damaged or crafted manifest)")


def count_files(directory: Path, enough: int) -> int:
    """The files below ``directory`` (anything but a folder), counted up to ``enough``. A link to a folder inside is
    followed once; one leading out is never opened (nothing outside is read): the count is then ``enough``, and
    the names below it are refused later, with that reason."""
    root = os.path.realpath(directory)
    count, folders, seen = 0, [root], set()
    while folders and count < enough:
        try:
            with os.scandir(folders.pop()) as entries:
                for entry in entries:
                    if not entry.is_dir():  # a file, a link to one, a broken link, a special file
                        count += 1
                        if count >= enough:
                            break
                        continue
                    path = os.path.realpath(entry.path) if entry.is_symlink() else entry.path
                    if path != root and not path.startswith(root + os.sep):
                        return enough
                    st = entry.stat()
                    if (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino))
                        folders.append(path)
        except OSError:
            continue  # an unreadable folder or entry: its files, if listed, are refused by name later
    return count


MAX_MANIFEST_BYTES = 256 << 20


def holds_dataset(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a packer manifest, i.e. is a dataset: never a source to scan.

    Only the manifest's ``kind`` is looked at, so a damaged dataset still counts; any other
    ``manifest.json`` (a photo collection's own) does not.
    """
    return json_kind(os.path.join(directory, MANIFEST_NAME), MAX_MANIFEST_BYTES) == KIND


def sha256_file(path: Path, block: int = 4 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def file_info(directory: Path, name: str) -> FileInfo:
    path = directory / name
    return FileInfo(name=name, num_bytes=path.stat().st_size, sha256=sha256_file(path))
