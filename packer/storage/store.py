"""``ObjectStore``: one root (a dataset's folder in a bucket, an http(s) prefix or a local folder) and the few
operations packer needs on the objects below it: head, ranged get, get, list, put (multipart for large files),
delete. Keys are relative names ("meta/labels.npy").

Built on obstore (chosen by measuring: docs/remote.md). Credentials come from the usual places (environment
variables, instance roles, ``storage_options=``: obstore's config keys such as ``aws_access_key_id``,
``endpoint``, ``region``, ``skip_signature``) and never appear in ``repr`` or a message. One client per process
(``PerProcess``; fork- and spawn-safe, see packer/storage/client.py). A blocking call interrupted by Ctrl-C cancels
its request. Failures are ``packer.storage.faults`` errors naming the redacted URL.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from packer.perprocess import PerProcess
from packer.storage.client import Client, Lanes, ObjectInfo, StoreSpec, open_client
from packer.storage.faults import RetryPolicy
from packer.storage.url import Location, parse

__all__ = ["Lanes", "ObjectInfo", "ObjectStore", "RetryPolicy", "wait"]


def wait(future: concurrent.futures.Future) -> Any:
    """``future.result()``, cancelling the request when the wait is interrupted (Ctrl-C)."""
    try:
        return future.result()
    except BaseException:
        future.cancel()
        raise


class ObjectStore:
    """The objects below ``root``. ``storage_options``: the library's configuration (credentials, endpoint,
    region...); ``policy``: timeouts and retries."""

    def __init__(self, root: str | os.PathLike | Location, storage_options: Mapping[str, Any] | None = None,
                 policy: RetryPolicy | None = None) -> None:
        self.root = root if isinstance(root, Location) else parse(root)
        self.spec = StoreSpec(self.root.url, dict(storage_options or {}), policy or RetryPolicy())
        self._client: PerProcess[Client] = PerProcess(self._open)

    def _open(self) -> Client:
        return open_client(self.spec)

    @property
    def client(self) -> Client:
        return self._client.get()

    def location(self, key: str) -> Location:
        return self.root.join(key) if key else self.root

    def head(self, key: str) -> ObjectInfo:
        """Size and ETag/generation; ``ObjectNotFound`` (a FileNotFoundError) for a missing object."""
        return wait(self.client.submit("head", key))

    def submit_get(self, key: str, start: int | None = None, end: int | None = None,
                   etag: str | None = None) -> concurrent.futures.Future:
        """Start a GET of ``[start, end)`` (the whole object when None); the future gives ``(data, ObjectInfo)``,
        ``data`` bytes-like (a memoryview of the client's buffer: copy what you keep). With ``etag`` the read is
        conditional (If-Match) and the returned ETag checked: ``ObjectChanged`` if the object was replaced, never
        bytes of another version."""
        return self.client.submit("get", key, start=start, end=end, etag=etag)

    def submit_gets(self, objects: list[tuple[str, str | None]],
                    lanes: Lanes | None = None) -> concurrent.futures.Future:
        """Start a GET of each whole ``(key, etag)`` object (If-Match where an ETag is given, as ``submit_get``): all
        at once, or within ``lanes`` shared with other calls; one future of their results in order, each ``(data,
        ObjectInfo)`` or the ``StorageError`` it gave. One hand-over to the client's loop for them all: many small
        objects cost less CPU than one future each."""
        return self.client.submit_many("get", [(key, {"etag": etag}) for key, etag in objects], lanes)

    def get_range(self, key: str, start: int, end: int, etag: str | None = None) -> bytes:
        if not 0 <= start < end:
            raise ValueError(f"range [{start}, {end}) of {self.location(key)}: 0 <= start < end expected")
        return bytes(wait(self.submit_get(key, start, end, etag))[0])

    def get(self, key: str, etag: str | None = None) -> bytes:
        return bytes(wait(self.submit_get(key, etag=etag))[0])

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (all pages), keys relative to the root."""
        return wait(self.client.submit("list", "", prefix=prefix))

    def list_tree(self, prefix: str = "") -> list[ObjectInfo]:
        """``list(prefix)`` where ``prefix`` is a folder ("" or ending in "/"), its subfolders listed at once: one
        listing of its own level, then one per subfolder, all in flight together (a listing's pages come one after
        another, each naming the next; an ImageFolder prefix lists one class per request instead of one page
        after another for all). In key order."""
        top = wait(self.client.submit("folder", "", prefix=prefix))
        folders = [info.key for info in top if info.key.endswith("/")]
        futures = [self.client.submit("list", "", prefix=folder) for folder in folders]
        try:
            below = [info for future in futures for info in wait(future)]
        finally:
            for future in futures:
                future.cancel()
        return sorted([info for info in top if not info.key.endswith("/")] + below, key=lambda info: info.key)

    def put(self, key: str, data: bytes | memoryview | os.PathLike, chunk_size: int = 8 << 20,
            create: bool = False) -> ObjectInfo:
        """Write one object, all or nothing; a file larger than ``chunk_size`` goes up as a multipart upload.
        ``create``: only if no object has that key (a conditional put, If-None-Match: *), else ``ObjectExists``."""
        kw = {"chunk_size": chunk_size, "create": create}
        if isinstance(data, (bytes, memoryview)):
            return wait(self.client.submit("put", key, data=bytes(data), **kw))
        return wait(self.client.submit("put", key, path=str(Path(data).absolute()), **kw))

    def delete(self, key: str) -> None:
        wait(self.client.submit("delete", key))

    def close(self) -> None:
        """Stop this process's client (its loop thread or helper process); the store reopens on next use."""
        self._client.close(lambda c: c.close())

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ObjectStore({str(self.root)!r})"
