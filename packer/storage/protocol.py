"""How the node's downloader (packer/storage/downloader.py) and its clients (packer/storage/downloader_client.py)
talk: the names both derive (cache paths, entry names, the socket's), the wire format and the error kinds.

One JSON object per message, each prefixed by its length as 4 bytes big-endian, over a Unix socket in the cache
directory; ``id`` is chosen by the client, answers may come in any order; bytes never cross the socket (an answer
names the cache file that holds them):

========================================================  ======================================================
client -> downloader                                       answer(s)
========================================================  ======================================================
hello {version, pid, limit}                                hello {version, pid}
store {sid, url, options, policy}                          (none: names a store for later requests)
head {id, sid, key}                                        {id, result: ObjectInfo} | {id, error, message}
list {id, sid, prefix}                                     {id, result: [ObjectInfo]} | error
fetch {id, sid, key, etag, ranges: [[start, end,           one per range: {id, i, entry} (its cache file) |
  [[start, end, algorithm, hexdigest], ...]]], priority}     {id, i, error, message}
fetch_file {id, sid, key, etag, size, sha256, dest,        {id, result: {entry, size, sha256}} | error; ``dest``
  priority}                                                  "files/...": an entry; "datasets/...": metadata, not
                                                             counted, never evicted; null: hashed only, nothing
                                                             kept (``verify``)
cancel {id, i: [...] | null}                               (none: the downloader forgets those requests; a GET no
                                                             client waits for any more is cancelled)
need {names, order}                                        (none: feeds the eviction policy, ``NextUse``)
stats {id}                                                 {id, result: counters, the downloader's CPU seconds}
========================================================  ======================================================

Every GET carries If-Match with the ETag given (``ObjectChanged`` when the object was replaced); each piece of a
range is checked against its checksum and a whole object against its sha256 before its entry gets its name.
Lower ``priority`` goes first (the blocks the reader needs next, then its read-ahead). The downloader uses the
smallest ``cache_limit`` its connected clients asked for (a client may leave it to the others). Which downloader a
process talks to depends on the cache directory and on its storage environment (``AWS_*``, ``GOOGLE_*``,
``AZURE_*``, proxies), which the downloader inherits from the process that started it: processes with other
credentials get their own.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from packer.errors import MissingPackageError, PackerError
from packer.storage.cache import ChecksumMismatch, RangeCache
from packer.storage.client import StoreSpec
from packer.storage.faults import AccessDenied, ObjectChanged, ObjectNotFound, ShortRead, StorageError
from packer.storage.url import redact_text
from packer.sysinfo import proc_path
from packer.units import parse_bytes

PROTOCOL = 1
UNBOUNDED = 1 << 62  # the limit of a cache no client has bounded
_HEADER = struct.Struct(">I")
_MAX_MESSAGE = 256 << 20  # a listing of a million objects
ERRORS: dict[str, type[PackerError]] = {c.__name__: c for c in (
    StorageError, ObjectNotFound, AccessDenied, ObjectChanged, ShortRead, ChecksumMismatch, MissingPackageError,
    PackerError)}


class DownloaderGone(StorageError):
    """The node's downloader process ended and could not be started again."""


# ---- names shared by clients and the downloader ----

def cache_root(cache_dir: str | os.PathLike) -> Path:
    """The folder packer keeps below ``cache_dir`` (``RangeCache``'s)."""
    return Path(cache_dir).absolute() / "packer-cache-v1"


def environment_key(environ: dict[str, str] | None = None) -> str:
    """Which downloader a process may share: one per storage environment (credentials, endpoints, proxies), so a
    process never reads with another's credentials. A digest: the values never appear in a file name."""
    env = os.environ if environ is None else environ
    items = sorted((k, v) for k, v in env.items() if k.upper().startswith(("AWS_", "GOOGLE_", "AZURE_"))
                   or k.lower() in ("http_proxy", "https_proxy", "no_proxy", "all_proxy"))
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def store_identity(spec: StoreSpec) -> str:
    """What names a store's objects in cache entries: its root URL and endpoint (two servers may have buckets of
    the same name), never its credentials in clear."""
    endpoint = spec.options.get("endpoint") or spec.options.get("aws_endpoint") or ""
    if not endpoint and spec.url.startswith("s3://"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT", "")
    return f"{spec.url}#{endpoint}" if endpoint else spec.url


def range_name(spec: StoreSpec, key: str, etag: str | None, start: int, end: int) -> str:
    """The cache entry of ``[start, end)`` of object ``key`` at version ``etag`` (what ``need`` takes)."""
    return RangeCache.name(f"{store_identity(spec)}/{key}", etag, start, end)


def entry_path(root: Path, name: str) -> Path:
    return root / name if "/" in name else root / "entries" / name[:2] / name


def checked_dest(dest: str) -> str:
    """A whole object's place: a relative path below ``files/`` (an entry, counted and evicted) or ``datasets/``
    (metadata the layers above keep: neither), never outside the cache."""
    parts = dest.split("/")
    if (len(parts) < 2 or parts[0] not in ("files", "datasets") or any(p in ("", ".", "..") for p in parts)
            or "\0" in dest or "\\" in dest or ".tmp-" in dest):
        raise PackerError(f"{dest!r}: a whole object's place in the cache must be a relative path below files/ "
                          "or datasets/")
    return dest


# ---- framing ----

def frame(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return _HEADER.pack(len(body)) + body


class Frames:
    """Messages out of a stream's bytes."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self.buf += data
        out = []
        while len(self.buf) >= 4:
            (n,) = _HEADER.unpack_from(self.buf)
            if n > _MAX_MESSAGE:
                raise PackerError(f"a downloader message of {n} bytes (at most {_MAX_MESSAGE})")
            if len(self.buf) < 4 + n:
                break
            out.append(json.loads(bytes(self.buf[4:4 + n])))
            del self.buf[:4 + n]
        return out


@contextlib.contextmanager
def short_path(path: Path) -> Iterator[str]:
    """``path`` as a Unix socket address: a path too long for one (108 bytes) is reached through its folder's
    descriptor (``/proc/self/fd/N/name``)."""
    text = str(path)
    if len(text.encode()) < 100:
        yield text
        return
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield proc_path(f"self/fd/{fd}/{path.name}")
    finally:
        os.close(fd)


def try_connect(path: Path) -> socket.socket | None:
    """A stream socket connected to the Unix socket at ``path``; None when nothing listens there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with short_path(path) as address:
            sock.connect(address)
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    except BaseException:
        sock.close()
        raise
    return sock



def error_answer(rid: int, exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, concurrent.futures.CancelledError):
        kind, message = "StorageError", "cancelled: the downloader is stopping"
    elif isinstance(exc, PackerError):
        kind = next((c.__name__ for c in type(exc).__mro__ if c.__name__ in ERRORS), "PackerError")
        message = str(exc)
    else:  # a bug or an OS error (disk full): one line
        kind, message = "StorageError", f"the downloader failed: {type(exc).__name__}: {exc}"
    return {"id": rid, "error": kind, "message": redact_text(message)}



def limit_bytes(cache_limit: int | str | None) -> int | None:
    """``cache_limit`` in bytes ("20GB" or an int); None stays None (no say in the limit)."""
    if cache_limit is None:
        return None
    limit = parse_bytes(cache_limit) if isinstance(cache_limit, str) else int(cache_limit)
    if limit <= 0:
        raise PackerError(f"cache_limit {cache_limit!r}: a positive size expected (e.g. 20GB)")
    return limit
