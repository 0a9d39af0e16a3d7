"""``manifest.json``: what a packed dataset is, written last and atomically.

A directory without a valid manifest is not a dataset. The manifest is plain JSON (never
pickle), checked on load for its kind and version, so an old or foreign directory gets a
clear error instead of a confusing read failure.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from packer.errors import PackerError

KIND = "packer-dataset"
VERSION = 1
MANIFEST_NAME = "manifest.json"
PAYLOADS = ("encoded", "raw")  # encoded: the source file's bytes; raw: decoded HWC uint8 RGB


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
class Manifest:
    format: str
    payload: str
    num_samples: int
    classes: list[str]
    shards: list[Shard]
    meta_files: list[FileInfo] = field(default_factory=list)  # meta/*.npy, checksummed like shards
    options: dict[str, Any] = field(default_factory=dict)
    num_errors: int = 0
    source: str = ""
    created_by: str = ""
    created_at: str = ""
    kind: str = KIND
    version: int = VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, ensure_ascii=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "manifest") -> Manifest:
        if not isinstance(data, dict) or data.get("kind") != KIND:
            raise PackerError(f"{where}: not a packer manifest (kind is {data.get('kind')!r})")
        if data.get("version") != VERSION:
            raise PackerError(
                f"{where}: manifest version {data.get('version')!r}, but this packer reads version "
                f"{VERSION}; convert again or use a matching packer"
            )
        try:
            shards = [
                Shard(
                    num_samples=int(s["num_samples"]),
                    files=[FileInfo(str(f["name"]), int(f["num_bytes"]), str(f["sha256"])) for f in s["files"]],
                    facts=dict(s.get("facts", {})),
                )
                for s in data["shards"]
            ]
            meta_files = [FileInfo(str(f["name"]), int(f["num_bytes"]), str(f["sha256"]))
                          for f in data.get("meta_files", [])]
            manifest = cls(
                format=str(data["format"]),
                payload=str(data["payload"]),
                num_samples=int(data["num_samples"]),
                classes=[str(c) for c in data["classes"]],
                shards=shards,
                meta_files=meta_files,
                options=dict(data.get("options", {})),
                num_errors=int(data.get("num_errors", 0)),
                source=str(data.get("source", "")),
                created_by=str(data.get("created_by", "")),
                created_at=str(data.get("created_at", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PackerError(f"{where}: malformed manifest ({type(exc).__name__}: {exc})") from exc
        manifest.check(where)
        return manifest

    def check(self, where: str) -> None:
        """Internal consistency: counts add up, file names stay inside the dataset."""
        if self.payload not in PAYLOADS:
            raise PackerError(f"{where}: unknown payload {self.payload!r} (expected one of {PAYLOADS})")
        if self.num_samples < 0 or any(s.num_samples < 0 for s in self.shards):
            raise PackerError(f"{where}: negative sample count")
        total = sum(s.num_samples for s in self.shards)
        if total != self.num_samples:
            raise PackerError(f"{where}: shards hold {total} samples but the manifest says {self.num_samples}")
        for f in self.all_files():
            check_inner_name(f.name, where)

    def all_files(self) -> list[FileInfo]:
        return [f for s in self.shards for f in s.files] + list(self.meta_files)


def check_inner_name(name: str, where: str) -> None:
    """Refuse names that would leave the dataset directory (absolute, ``..``, empty)."""
    parts = Path(name).parts
    if not name or Path(name).is_absolute() or ".." in parts or "\\" in name:
        raise PackerError(f"{where}: file name {name!r} points outside the dataset directory")


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Write ``manifest.json`` atomically (tmp file, fsync, rename)."""
    path = directory / MANIFEST_NAME
    tmp = directory / (MANIFEST_NAME + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(manifest.to_json())
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_manifest(directory: str | os.PathLike) -> Manifest:
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    if not directory.exists():
        raise PackerError(f"{directory}: no such dataset")
    if not path.is_file():
        hint = " (an unfinished conversion?)" if directory.is_dir() else ""
        raise PackerError(f"{directory}: not a packed dataset, {MANIFEST_NAME} is missing{hint}")
    try:
        text = path.read_text(encoding="utf-8")
        if len(text) > 256 << 20:
            raise PackerError(f"{path}: manifest is implausibly large")
        data = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PackerError(f"{path}: cannot read manifest ({exc})") from exc
    return Manifest.from_dict(data, where=str(path))


def sha256_file(path: Path, block: int = 4 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def file_info(directory: Path, name: str) -> FileInfo:
    path = directory / name
    return FileInfo(name=name, num_bytes=path.stat().st_size, sha256=sha256_file(path))
