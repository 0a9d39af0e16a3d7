"""WebDataset shards read in place: brace patterns, tar members grouped into samples by key.

WebDataset's rules (``webdataset.tariterators``), kept exactly: a member's key is its path up to
the first dot of its base name, its extension the rest, lowercased; consecutive members with the
same key form one sample; only regular files count, and top-level ``__name__`` members are
metadata, skipped. Shards are read with the standard library's ``tarfile`` (headers only: each
member's data offset and size are recorded, the bytes are ``pread`` later), never the webdataset
package. Where WebDataset raises or silently drops, packer reports: a repeated extension in one
sample, a key seen again later in the shard, a member that is a link or a device, a shard that
ends without tar's end-of-archive blocks (truncated or damaged).
"""

from __future__ import annotations

import os
import re
import tarfile
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from packer.errors import DatasetError, InputNotFoundError, OptionError, PackerError
from packer.write.sources.archive_common import declared_problem, forget_headers
from packer.write.sources.archive_gz import GzTar, rest_not_read

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")  # the image of a sample: exactly one of these
LABEL_EXTENSIONS = ("cls", "json")  # read while listing: a label is in one of them
MAX_LABEL_MEMBER = 1 << 20  # a non-image member larger than this holds no label and is kept as no field
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?$|^([A-Za-z])\.\.([A-Za-z])$")
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext
_META = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta
_MAX_EXPANSION = 1_000_000  # shard names one pattern may expand to


def _range(text: str) -> list[str] | None:
    """The items of ``a..b[..step]`` as braceexpand gives them (zero-padded when an end is), else None."""
    m = _RANGE.match(text)
    if m is None:
        return None
    if m.group(4):
        a, b = ord(m.group(4)), ord(m.group(5))
        return [chr(c) for c in (range(a, b + 1) if a <= b else range(a, b - 1, -1))]
    left, right, step_text = m.group(1), m.group(2), m.group(3)
    a, b = int(left), int(right)
    step = abs(int(step_text)) if step_text else 1
    if step == 0:
        raise OptionError(f"{{{text}}}: a range step of 0")
    if abs(b - a) // step + 1 > _MAX_EXPANSION:
        raise OptionError(f"{{{text}}}: more than {_MAX_EXPANSION} shard names")
    padded = any(s.lstrip("-").startswith("0") and s.lstrip("-") != "0" for s in (left, right))
    width = max(len(left), len(right)) if padded else 0
    values = range(a, b + 1, step) if a <= b else range(a, b - 1, -step)
    return [f"{v:0{width}d}" for v in values]


def _close(text: str, start: int) -> int:
    """The index of the ``}`` that closes the ``{`` at ``start``, or -1."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return -1


def _top_level_split(text: str) -> list[str]:
    parts, depth, last = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[last:i])
            last = i + 1
    return parts + [text[last:]]


def _expand(text: str, budget: list[int]) -> list[str]:
    start = text.find("{")
    if start < 0:
        return [text]
    end = _close(text, start)
    inner = text[start + 1 : end]
    parts = _top_level_split(inner)
    if len(parts) > 1:
        choices = [c for p in parts for c in _expand(p, budget)]
    else:
        choices = _range(inner) or ["{" + c + "}" for c in _expand(inner, budget)]
    rest = _expand(text[end + 1 :], budget)
    budget[0] -= len(choices) * len(rest)
    if budget[0] < 0:
        raise OptionError(f"{text}: more than {_MAX_EXPANSION} shard names")
    return [text[:start] + c + r for c in choices for r in rest]


def expand_braces(pattern: str) -> list[str]:
    """The names a WebDataset URL pattern stands for: ``{000..009}`` ranges and ``{a,b}`` lists, in order.

    Follows ``braceexpand`` (what WebDataset uses) for these forms, nesting included; braces
    holding neither stay as they are.
    """
    depth = 0
    for ch in pattern:
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth < 0:
            break
    if depth:
        raise OptionError(f"{pattern}: unbalanced braces")
    return _expand(pattern, [_MAX_EXPANSION])


def shard_paths(src: str | os.PathLike) -> list[Path]:
    """The shards ``src`` names: a brace pattern, one shard, or a folder's ``*.tar``/``*.tar.gz`` files (sorted)."""
    text = os.fspath(src)
    path = Path(text)
    if path.is_dir():
        shards = sorted(p for p in path.iterdir() if p.name.endswith((".tar", ".tar.gz", ".tgz"))
                        and not p.name.startswith("."))
        if not shards:
            raise PackerError(f"{path}: no .tar or .tar.gz shards in this folder")
        return shards
    names = expand_braces(text)
    if len(set(names)) != len(names):
        raise OptionError(f"{text}: the pattern names a shard twice")
    return [Path(n) for n in names]


def split_name(name: str) -> tuple[str, str] | None:
    """(key, extension) of a member name as WebDataset splits it (its own regex), the extension lowercased."""
    m = _KEY_EXT.match(name)
    return None if m is None else (m.group(1), m.group(2).lower())


@dataclass(frozen=True)
class Member:
    """One regular file of a tar: where its bytes lie."""

    name: str
    offset: int  # of the data, in the tar; in a compressed shard: the member's number in the stream
    size: int


@dataclass
class TarSample:
    """The members that share one key, in tar order, by lowercased extension."""

    key: str
    members: dict[str, Member] = field(default_factory=dict)
    problem: str | None = None  # why the sample can't be packed as it is (a repeated extension)
    small: dict[str, bytes | None] = field(default_factory=dict)  # non-image members' bytes (None: too large)


@dataclass
class ShardListing:
    """What one shard holds: its samples in tar order, and what was left out (with member names)."""

    samples: list[TarSample] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)  # (member or "", reason)
    ignored: Counter = field(default_factory=Counter)


def is_compressed(path: Path) -> bool:
    return path.name.endswith((".tar.gz", ".tgz"))


def _in_place(tf: tarfile.TarFile) -> Iterator[tuple[int, tarfile.TarInfo]]:
    """(number, header) of each member of an uncompressed shard, read in place (seeking past the data)."""
    number = 0
    while (info := tf.next()) is not None:
        forget_headers(tf)  # memory must not grow with the shard
        yield number, info
        number += 1


def _members(headers: Iterable[tuple[int, tarfile.TarInfo]], size: int | None,
             listing: ShardListing) -> Iterator[tuple[Member, tarfile.TarInfo]]:
    """The shard's regular files with data inside it (``size``: the shard's; None: a compressed stream, where
    a member is numbered instead); the rest goes to ``listing`` as ignored or a problem."""
    for number, info in headers:
        name = info.name
        if info.isdir():
            listing.ignored["tar folders"] += 1
        elif not info.isreg() or info.issparse():
            kind = "a link" if info.issym() or info.islnk() else "sparse" if info.issparse() else "not a regular file"
            listing.problems.append((name, f"tar member is {kind}: not read"))
        elif _META.match(name) or ("/" not in name and name.startswith("__") and name.endswith("__")):
            listing.ignored["webdataset metadata members"] += 1
        elif size is not None and info.offset_data + info.size > size:
            listing.problems.append((name, f"truncated: {info.size} bytes at byte {info.offset_data} run past "
                                           f"the shard's end ({size} bytes)"))
        else:
            yield Member(name, number if size is None else info.offset_data, info.size), info


def _bad_name(name: str) -> bool:
    parts = name.split("/")
    return name.startswith("/") or ".." in parts or "\x00" in name or "\\" in name


def list_shard(path: Path, images: tuple[str, ...] = IMAGE_EXTENSIONS) -> ShardListing:
    """The samples of a tar shard, grouped as WebDataset groups them: headers only (and the small members whose
    extension is not one of ``images``: labels, fields), read in place for a ``.tar``, streamed once for a
    ``.tar.gz`` (``GzTar``: a member inflating like a bomb ends the listing there, as a problem)."""
    listing = ShardListing()
    compressed = is_compressed(path)
    try:
        size = os.stat(path).st_size
        opened: GzTar | tarfile.TarFile = GzTar(path) if compressed else tarfile.open(path, "r:")
    except FileNotFoundError:
        raise InputNotFoundError(f"{path}: no such shard") from None
    except (OSError, EOFError, zlib.error, tarfile.TarError) as exc:
        raise DatasetError(f"{path}: not a readable tar{'.gz' if compressed else ''} file ({exc})") from None
    with opened:
        tf = opened.tf if isinstance(opened, GzTar) else opened
        try:
            if isinstance(opened, GzTar):
                _group(opened.members(), None, listing, lambda info, gz=opened: gz.data(info, keep=True), images)
            else:
                _group(_in_place(tf), size, listing, lambda info: _small(tf, info), images)
        except (OSError, EOFError, zlib.error, tarfile.TarError) as exc:
            listing.problems.append(("", f"damaged after byte {tf.offset}: {exc}; the rest of the shard is not read"))
            return listing
        if isinstance(opened, GzTar):
            if opened.stopped is not None:  # its sample is not packed, nor is anything after it
                name, why = opened.stopped
                if listing.samples and any(m.name == name for m in listing.samples[-1].members.values()):
                    listing.samples[-1].problem = f"{name}: {why}"
                else:
                    listing.problems.append((name, why))
                listing.problems.append(("", rest_not_read(name)))
            return listing
        end = tf.offset
    with open(path, "rb") as fh:
        tail = os.pread(fh.fileno(), 1024, end)
    if tail != bytes(1024):  # tar ends with two zero blocks; tarfile stops silently at a bad header
        listing.problems.append(("", f"truncated or damaged after byte {end} (no end-of-archive blocks): "
                                     "members after it, if any, are not read"))
    return listing


def _small(tf: tarfile.TarFile, info: tarfile.TarInfo) -> bytes:
    fh = tf.extractfile(info)
    return fh.read() if fh is not None else b""


def _group(headers: Iterable[tuple[int, tarfile.TarInfo]], size: int | None, listing: ShardListing,
           read: Callable[[tarfile.TarInfo], bytes | str], images: tuple[str, ...] = IMAGE_EXTENSIONS) -> None:
    """Group the members into ``listing.samples`` (consecutive members sharing a key); ``read``: a small member's
    bytes (a str: why it could not be read); ``images``: the extensions of image members (the others are small
    members: labels, fields). An image member declaring more bytes than any image within the pixel limit makes
    its sample a problem (``archive_common.declared_problem``)."""
    seen: set[str] = set()
    current: TarSample | None = None
    for m, info in _members(headers, size, listing):
        split = split_name(m.name)
        if split is None:
            listing.ignored["members without an extension"] += 1
            continue
        if _bad_name(m.name):
            listing.problems.append((m.name, "member name is absolute or holds '..'"))
            continue
        key, ext = split
        if current is None or key != current.key:
            current = TarSample(key)
            if key in seen:
                current.problem = "key seen earlier in this shard (its members are not together)"
            seen.add(key)
            listing.samples.append(current)
        if ext in current.members:
            current.problem = f"two members with extension .{ext}"
        current.members.setdefault(ext, m)
        if ext in images and (why := declared_problem(m.size)) is not None:
            current.problem = f"{m.name}: {why}"
        elif ext not in images and ext not in current.small:  # a label, or a per-sample field
            data = read(info) if m.size <= MAX_LABEL_MEMBER else None
            current.small[ext] = data if isinstance(data, bytes) else None


def image_member(sample: TarSample, extensions: tuple[str, ...] = IMAGE_EXTENSIONS) -> tuple[str, Member] | str:
    """(extension, member) of the sample's one image (a member with one of ``extensions``), or why there is not
    exactly one."""
    found = [(ext, sample.members[ext]) for ext in extensions if ext in sample.members]
    if not found:
        return f"no image member ({', '.join(extensions)}); has {', '.join(sample.members) or 'nothing'}"
    if len(found) > 1:
        return f"{len(found)} image members ({', '.join(e for e, _ in found)}): which one is the image is unclear"
    return found[0]
