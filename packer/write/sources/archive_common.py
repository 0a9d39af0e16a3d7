"""What every archive source shares: member names made safe, the members found, the records in ImageFolder order."""

from __future__ import annotations

import posixpath
import tarfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from packer.errors import PackerError
from packer.images.decode import pixel_limit
from packer.write.scan import imagefolder_key, is_image_name
from packer.write.sources.base import SourceReader
from packer.write.sources.records import ScanResult, SourceError

TAR_SUFFIXES = (".tar",)
GZ_SUFFIXES = (".tar.gz", ".tgz")
ZIP_SUFFIXES = (".zip",)
MAX_RATIO = 200  # JPEG/PNG hardly compress: a member inflating more than this (beyond 1 MiB) is a bomb
_RATIO_FROM = 1 << 20  # members up to this size are never refused for their ratio
_HEADERS = 1 << 20  # room for an image file's headers and metadata beside its pixels


def member_limit() -> int | None:
    """The most bytes an image member may declare: an uncompressed RGBA image (4 bytes a pixel) at the pixel
    limit (``images.decode.pixel_limit``: 2 x PIL.Image.MAX_IMAGE_PIXELS) plus 1 MiB; None without a pixel limit."""
    limit = pixel_limit()
    return None if limit is None else 4 * limit + _HEADERS


def declared_problem(size: int) -> str | None:
    """Why a member declaring ``size`` bytes is not read (None: it may be): more than any image within the pixel
    limit takes. Judged from the header, before a byte is read or inflated."""
    limit = member_limit()
    if limit is None or size <= limit:
        return None
    return (f"declares {size:,} bytes, more than an image within the pixel limit can take ({limit:,}: 4 bytes a "
            "pixel of 2 x PIL.Image.MAX_IMAGE_PIXELS): not read")


def inflation_problem(inflated: int, compressed: int) -> str | None:
    """Why a member that gave ``inflated`` bytes from ``compressed`` is a decompression bomb (None: it is not)."""
    if inflated <= _RATIO_FROM or inflated <= MAX_RATIO * max(compressed, 1):
        return None
    return (f"inflates more than {MAX_RATIO}:1 ({inflated:,} bytes from {compressed:,} compressed so far, a "
            "decompression bomb?): not read")


def archive_kind(path: Path) -> str | None:
    """"tar", "tgz" or "zip" by the name's ending, else None."""
    name = path.name.lower()
    for kind, ends in (("tgz", GZ_SUFFIXES), ("tar", TAR_SUFFIXES), ("zip", ZIP_SUFFIXES)):
        if name.endswith(ends):
            return kind
    return None


def clean_member(name: str) -> tuple[str, str | None]:
    """A member's name as a relative POSIX path, and why it is refused (None: fine)."""
    rel = name[2:] if name.startswith("./") else name
    rel = rel.rstrip("/")
    if not rel or "\x00" in rel or "\\" in rel or rel.startswith("/"):
        return rel, "absolute or not a plain name: refused (never written anywhere, never read)"
    if ".." in rel.split("/"):
        return rel, "name with '..': refused (never written anywhere, never read)"
    return posixpath.normpath(rel), None


@dataclass
class Members:
    """What a scan of an archive found: candidate records (rel, locator), in the archive's order."""

    where: str  # the archive's name, for locations
    found: list[tuple[str, Any]] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)
    errors: list[SourceError] = field(default_factory=list)
    ignored: Counter = field(default_factory=Counter)

    def refuse(self, rel: str, reason: str, member: str | None = None, record: bool = True) -> None:
        """A member not packed (``record``: False for a part of the archive that holds records: a class tar, the
        rest of a damaged archive)."""
        self.errors.append(SourceError(rel, reason, f"{self.where}: member {member or rel}", record=record))

    def add(self, rel: str, loc: Any, member: str | None = None) -> None:
        """A regular file's member: kept when an image name, not hidden and not seen before."""
        if any(p.startswith(".") for p in rel.split("/")):
            self.ignored["hidden"] += 1
        elif not is_image_name(rel):
            self.ignored["not an image"] += 1
        elif rel in self.seen:
            self.refuse(rel, "appears twice in the archive: the second copy is not packed", member)
        else:
            self.seen.add(rel)
            self.found.append((rel, loc))


def records_of(path: Path, members: Members, reader: SourceReader, ordered: bool) -> ScanResult:
    """The ScanResult of an archive's members: classes from the top folders (or none: flat), ImageFolder order
    (``ordered``) or the archive's own."""
    found = members.found
    classes = sorted({rel.split("/", 1)[0] for rel, _ in found if "/" in rel})
    if classes:
        outside = [r for r, _ in found if "/" not in r]
        if outside:
            members.ignored["outside class folders"] += len(outside)
        found = [(r, loc) for r, loc in found if "/" in r]
        index = {c: i for i, c in enumerate(classes)}
        keyed = [((r.split("/", 1)[0], *imagefolder_key(r.split("/", 1)[1])), r, loc) for r, loc in found]
        labels_of = lambda r: index[r.split("/", 1)[0]]  # noqa: E731
    else:
        keyed = [(("", *imagefolder_key(r)), r, loc) for r, loc in found]
        labels_of = lambda r: -1  # noqa: E731
    if ordered:
        keyed.sort(key=lambda k: k[0])
    if not keyed:
        what = ", ".join(f"{n} {r}" for r, n in sorted(members.ignored.items())) or "nothing"
        errors = "".join(f"; {e.location}: {e.reason}" for e in members.errors[:3])
        raise PackerError(f"{path}: no images found in the archive (ignored: {what}{errors})")
    return ScanResult(root=path, classes=classes, rel_paths=[r for _, r, _ in keyed],
                      labels=np.asarray([labels_of(r) for _, r, _ in keyed], dtype=np.int64),
                      ignored=members.ignored, errors=members.errors, reader=reader,
                      locs=[loc for _, _, loc in keyed])


def forget_headers(tf: tarfile.TarFile) -> None:
    """Drop the headers a TarFile keeps of every member read so far: memory would grow with the archive."""
    tf.members = []  # pyright: ignore[reportAttributeAccessIssue]  # an attribute tarfile does not declare
