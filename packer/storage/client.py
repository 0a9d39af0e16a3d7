"""The connection to object storage in one process: obstore's client driven by an event loop on one thread.

obstore (Rust ``object_store`` on a tokio runtime) is not fork-safe: once a process has made a request, a forked
child's requests hang, even on a client made in the child (docs/remote.md, measured). DataLoader workers are
forked. So ``open_client`` gives a process an in-process ``LoopClient`` unless an ancestor started the runtime
before forking it; such a child gets a ``HelperClient``: the same loop in a helper process started by exec
(``python -m packer.storage.client``, which dies with its parent's pipe), requests and bytes over a pipe.
``ObjectStore`` keeps one client per process in a ``PerProcess``. Every request has a timeout and retries
(``RetryPolicy``); ``submit`` returns a future that ``cancel()`` really cancels (the request is dropped).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import weakref
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from packer.errors import MissingPackageError, OptionError, PackerError, install_hint
from packer.storage.faults import (
    AccessDenied,
    ObjectChanged,
    ObjectExists,
    ObjectNotFound,
    RetryPolicy,
    ShortRead,
    StorageError,
    classify,
)
from packer.storage.profiles import profile_config
from packer.storage.url import Location

_CLIENT_KEYS = frozenset({"allow_http", "allow_invalid_certificates", "proxy_url", "user_agent", "default_headers"})
_ERRORS = {c.__name__: c for c in (StorageError, ObjectNotFound, AccessDenied, ObjectChanged, ShortRead,
                                   ObjectExists)}
_RUNTIME_PID: int | None = None  # the process that started obstore's runtime (its forked children must not use it)


def runtime_started() -> bool:
    """Whether obstore's runtime (its tokio threads) was started in this process: a process that ends while those
    threads still finish cancelled requests can print their panic, "The Python interpreter is not initialized"
    (``packer.cli.run`` ends the command line's process without the interpreter's finalization then)."""
    return _RUNTIME_PID == os.getpid()


@dataclass(frozen=True)
class ObjectInfo:
    """What HEAD or a listing says of an object: its key below the store's root, size and ETag/generation."""

    key: str
    size: int
    etag: str | None = None
    version: str | None = None


@dataclass(frozen=True)
class StoreSpec:
    """Everything needed to open a client in any process (picklable, JSON-able). ``options`` may hold
    credentials: its values never appear in ``repr``."""

    url: str  # the root URL (no credentials in it: parse() refuses them for s3/gs/az)
    options: dict[str, Any] = field(default_factory=dict)
    policy: RetryPolicy = field(default_factory=RetryPolicy)

    def __repr__(self) -> str:
        return f"StoreSpec({str(_location(self.url))!r}, options={sorted(self.options)}, {self.policy})"


@dataclass(frozen=True)
class Lanes:
    """A bound shared by the requests submitted with it: at most ``n`` out at once, the next (in the order
    submitted) started by the client's loop as soon as one lands, not when the caller next asks, so a caller busy
    with what landed leaves no request slot idle. ``key`` tells one bound from another (``Lanes.new``)."""

    key: int
    n: int

    @classmethod
    def new(cls, n: int) -> Lanes:
        return cls(next(_LANES), n)


_LANES = itertools.count()


def _location(url: str) -> Location:
    from packer.storage.url import parse

    return parse(url)


_AZ_EMULATOR = ("azure_storage_use_emulator", "azure_use_emulator", "use_emulator")
_AZ_ENDPOINT = ("azure_storage_endpoint", "azure_endpoint", "endpoint")
_AZ_ACCOUNT = ("azure_storage_account_name", "account_name")
_AZ_KEY = ("azure_storage_account_key", "azure_storage_access_key", "account_key", "access_key")
# Azurite's development account and its published key (Microsoft's "Use the Azurite emulator"; obstore's default)
_AZURITE_ACCOUNT = "devstoreaccount1"
_AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def _azure_emulator(config: dict[str, Any]) -> dict[str, Any]:
    """obstore's ``use_emulator`` ignores ``endpoint`` (it goes to ``$AZURITE_BLOB_STORAGE_URL`` or
    127.0.0.1:10000): with both given, the emulator at ``endpoint`` (its account's URL, path style) is meant, so the
    options are rewritten to that endpoint with the development account's name and key unless given."""
    flag = next((k for k in _AZ_EMULATOR if k in config), None)
    endpoint = next((str(config[k]) for k in _AZ_ENDPOINT if config.get(k)), "")
    if flag is None or str(config[flag]).lower() not in ("true", "1", "yes") or not endpoint:
        return config
    out = {k: v for k, v in config.items() if k not in _AZ_EMULATOR and k not in _AZ_ENDPOINT}
    account = next((str(config[k]) for k in _AZ_ACCOUNT if config.get(k)), _AZURITE_ACCOUNT)
    out.setdefault("account_name", account)
    if not any(config.get(k) for k in _AZ_KEY):
        out["account_key"] = _AZURITE_KEY
    base = endpoint.rstrip("/")
    out["endpoint"] = base if base.endswith(f"/{account}") else f"{base}/{account}"
    return out


def build_store(spec: StoreSpec) -> Any:
    """The obstore store for ``spec``'s root (its key the prefix of every request)."""
    try:
        from obstore.store import LocalStore, from_url
    except ImportError as exc:
        raise MissingPackageError(f"object storage needs obstore ({exc}): {install_hint('remote')}") from None

    loc = _location(spec.url)
    policy = spec.policy
    retry = {"max_retries": policy.retries, "retry_timeout": timedelta(seconds=policy.retry_timeout),
             "backoff": {"init_backoff": timedelta(seconds=policy.backoff),
                         "max_backoff": timedelta(seconds=policy.max_backoff), "base": 2}}
    if loc.is_local:
        return LocalStore(prefix=Path(loc.key))
    client: dict[str, Any] = {"timeout": timedelta(seconds=policy.timeout),
                              "connect_timeout": timedelta(seconds=policy.connect_timeout)}
    config: dict[str, Any] = {}
    for key, value in spec.options.items():
        (client if key in _CLIENT_KEYS else config)[key] = value
    if loc.scheme == "s3":  # a named AWS profile (~/.aws) adds what the options and environment do not give
        config = {**profile_config(config), **config}
    config.pop("profile", None)
    if loc.scheme == "az":
        config = _azure_emulator(config)
    endpoint = str(config.get("endpoint") or config.get("aws_endpoint") or
                   (os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT", "") if loc.scheme == "s3"
                    else ""))
    if loc.scheme == "http" or endpoint.startswith("http://"):  # an http endpoint given on purpose (a local server)
        client.setdefault("allow_http", True)
    root = f"{loc.scheme}://{loc.bucket}/{loc.key}".rstrip("/")
    if loc.scheme in ("http", "https"):
        if loc.query or loc.userinfo:
            raise PackerError(f"{loc}: signed or credentialed http(s) URLs are not supported by the store yet")
        return from_url(root, client_options=client, retry_config=retry)  # type: ignore[arg-type]
    try:
        return from_url(root, config=config or None, client_options=client, retry_config=retry)  # type: ignore[arg-type]
    except Exception as exc:  # obstore's configuration errors (an unknown key, a value it cannot parse)
        raise OptionError(f"{loc}: the storage options were refused: {_without_values(exc, spec.options)}") from None


def _without_values(exc: Exception, options: dict[str, Any]) -> str:
    """The first line of obstore's message about ``options``, each option's value left out (it may be a secret;
    values under 6 characters, "1" or "false", are no secret and would garble the message)."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    for value in sorted((str(v) for v in options.values() if len(str(v)) >= 6), key=len, reverse=True):
        text = text.replace(value, "...")
    return text


def etag_of(value: str | None) -> str | None:
    """An ETag as HTTP headers write it (quoted): Azure's listings give it bare (``0x8D...``) where its HEAD and GET
    quote it (``"0x8D..."``), so the one listed and the one read must be compared in one form."""
    if not value or value.startswith(('"', "W/")):
        return value
    return f'"{value}"'


def _info(key: str, meta: Any) -> ObjectInfo:
    return ObjectInfo(key, int(meta["size"]), etag_of(meta.get("e_tag")), meta.get("version"))


class LoopClient:
    """obstore's async API on one event-loop thread of this process."""

    def __init__(self, spec: StoreSpec) -> None:
        global _RUNTIME_PID
        self.spec = spec
        self._root = _location(spec.url)
        self._store = build_store(spec)
        _RUNTIME_PID = os.getpid()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="packer-storage-loop", daemon=True)
        self._thread.start()
        # a client dropped unclosed stops its thread too (the thread holds the loop, not the client)
        self._stop = weakref.finalize(self, _stop_loop, self._loop, self._thread, os.getpid())
        self._stop.atexit = False  # at exit the process's end releases it, as before
        self._lanes: weakref.WeakValueDictionary[int, asyncio.Semaphore] = weakref.WeakValueDictionary()

    def submit(self, op: str, key: str, lanes: Lanes | None = None, **kw: Any) -> concurrent.futures.Future:
        """Run ``op`` ("head", "get", "list", "put", "delete") on ``key`` in the loop (within ``lanes``); its
        future."""
        return asyncio.run_coroutine_threadsafe(self._within(lanes, op, key, kw), self._loop)

    def submit_many(self, op: str, calls: list[tuple[str, dict[str, Any]]],
                    lanes: Lanes | None = None) -> concurrent.futures.Future:
        """Run ``op`` on each ``(key, kw)`` of ``calls`` in the loop, all at once or within ``lanes``: one future of
        their results in order, each the value or the ``StorageError`` it raised (one hand-over between threads for
        them all, not one each: many small objects). Cancelling it cancels them all."""
        return asyncio.run_coroutine_threadsafe(self._many(op, calls, lanes), self._loop)

    async def _within(self, lanes: Lanes | None, op: str, key: str, kw: dict[str, Any]) -> Any:
        if lanes is None:
            return await self._with_retries(op, key, kw)
        gate = self._lanes.get(lanes.key)  # on the loop's thread only; gone once no request holds it
        if gate is None:
            gate = self._lanes[lanes.key] = asyncio.Semaphore(lanes.n)
        async with gate:
            return await self._with_retries(op, key, kw)

    async def _many(self, op: str, calls: list[tuple[str, dict[str, Any]]], lanes: Lanes | None) -> list[Any]:
        results = await asyncio.gather(*(self._within(lanes, op, key, kw) for key, kw in calls),
                                       return_exceptions=True)
        for result in results:  # a storage error is a result; anything else (a bug) is raised
            if isinstance(result, BaseException) and not isinstance(result, StorageError):
                raise result
        return results

    async def _with_retries(self, op: str, key: str, kw: dict[str, Any]) -> Any:
        attempt = 0
        while True:
            try:
                return await self._once(op, key, kw)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                retry, error = classify(exc, self._root.join(key).url if key else self._root.url)
                attempt += 1
                if not retry or attempt > self.spec.policy.retries:
                    raise error from None
                await asyncio.sleep(self.spec.policy.delay(attempt))

    async def _once(self, op: str, key: str, kw: dict[str, Any]) -> Any:
        import obstore as obs

        store = self._store
        if op == "head":
            return _info(key, await obs.head_async(store, key))
        if op == "get":
            start, end, etag = kw.get("start"), kw.get("end"), kw.get("etag")
            options: dict[str, Any] = {}
            if start is not None:
                options["range"] = (start, end)
            if etag and not etag.startswith("W/"):  # If-Match compares strongly: a weak ETag never matches (412)
                options["if_match"] = etag
            result = await obs.get_async(store, key, options=options)  # type: ignore[arg-type]
            data = memoryview(await result.bytes_async())  # obstore's buffer, not copied: the caller copies once
            info = _info(key, result.meta)
            if etag and info.etag and info.etag.removeprefix("W/") != etag.removeprefix("W/"):  # the body's version
                raise ObjectChanged(f"{self._root.join(key)}: the object changed since it was opened (ETag "
                                           f"{info.etag} instead of {etag}); open the dataset again")
            want = (min(end, info.size) - start) if start is not None and end is not None else info.size
            if len(data) != want:
                raise ShortRead(f"{self._root.join(key)}: {len(data)} bytes received of the {want} asked for "
                                f"(range {start}-{end}); the body was cut or truncated")
            return data, info
        if op == "list":
            out = []
            async for batch in obs.list(store, kw.get("prefix") or None, chunk_size=1000):
                out.extend(_info(m["path"], m) for m in batch)
            return out
        if op == "folder":  # one level: its objects, and its folders as keys ending in "/" (size 0)
            got = await obs.list_with_delimiter_async(store, kw.get("prefix") or None)
            return ([ObjectInfo(f"{p}/", 0) for p in got["common_prefixes"]] +
                    [_info(m["path"], m) for m in got["objects"]])
        if op == "put":  # multipart above chunk_size, parts uploaded concurrently; all or nothing is visible
            source = Path(kw["path"]) if "path" in kw else kw["data"]
            size = source.stat().st_size if isinstance(source, Path) else len(source)
            mode = "create" if kw.get("create") else "overwrite"  # create: If-None-Match *, ObjectExists if there
            res = await obs.put_async(store, key, source, chunk_size=kw.get("chunk_size", 8 << 20), mode=mode)
            return ObjectInfo(key, size, etag_of(res.get("e_tag")), res.get("version"))
        if op == "delete":
            return await obs.delete_async(store, key)
        raise ValueError(f"unknown storage operation {op!r}")

    def close(self) -> None:
        """Cancel what is in flight and stop the loop thread (joined: nothing is left running)."""
        self._stop()


DRAIN_S = 5.0  # a closing client waits this long at most for its cancelled requests to end


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread, pid: int) -> None:
    """Cancel the loop's tasks, stop it and join its thread; only in the process that made it (a forked child's
    copy is not running), and without the join when called on the loop's own thread (a callback dropped the client:
    the loop stops after it)."""
    if pid != os.getpid() or loop.is_closed():
        return

    async def drain() -> None:  # the cancelled requests end, and hand their end to the threads waiting on them
        tasks = asyncio.all_tasks(loop) - {asyncio.current_task()}
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=DRAIN_S)
        await asyncio.sleep(0)  # their done-callbacks (run_coroutine_threadsafe's hand-over) run before the stop
        loop.stop()

    loop.call_soon_threadsafe(lambda: loop.create_task(drain()))
    if threading.current_thread() is thread:
        return
    thread.join()
    loop.close()


# ---- the helper process: same client, over a pipe ----

def _send(stream, lock: threading.Lock, header: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    head = json.dumps({**header, "n": len(payload)}).encode()
    with lock:
        stream.write(struct.pack(">I", len(head)) + head)
        if payload:
            stream.write(payload)
        stream.flush()


def _receive(stream) -> tuple[dict[str, Any], bytes] | None:
    raw = stream.read(4)
    if len(raw) < 4:
        return None
    header = json.loads(stream.read(struct.unpack(">I", raw)[0]))
    payload = stream.read(header["n"]) if header["n"] else b""
    return header, payload


def _encode(op: str, result: Any) -> tuple[Any, bytes | memoryview]:
    if op == "get":
        return asdict(result[1]), result[0]
    if op in ("list", "folder"):
        return [asdict(i) for i in result], b""
    return (asdict(result) if isinstance(result, ObjectInfo) else None), b""


def _decode(op: str, result: Any, payload: bytes) -> Any:
    if op == "get":
        return payload, ObjectInfo(**result)
    if op in ("list", "folder"):
        return [ObjectInfo(**i) for i in result]
    return ObjectInfo(**result) if result is not None else None


def serve_helper() -> None:
    """The helper process: one spec, then requests until stdin closes (its parent went away)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what Ctrl-C stops
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    first = _receive(stdin)
    if first is None:
        return
    spec = StoreSpec(first[0]["url"], first[0]["options"], RetryPolicy(**first[0]["policy"]))
    client, lock = LoopClient(spec), threading.Lock()

    def reply(rid: int, op: str, fut: concurrent.futures.Future) -> None:
        with contextlib.suppress(BrokenPipeError, ValueError):
            try:
                result, payload = _encode(op, fut.result())
                _send(stdout, lock, {"id": rid, "ok": True, "result": result}, payload)
            except StorageError as exc:
                _send(stdout, lock, {"id": rid, "ok": False, "kind": type(exc).__name__, "message": str(exc)})
            except Exception as exc:  # a bug, reported as one line
                _send(stdout, lock, {"id": rid, "ok": False, "kind": "StorageError", "message": f"{exc!r}"})

    while (msg := _receive(stdin)) is not None:
        header, payload = msg
        kw = header["kw"] | ({"data": payload} if header["op"] == "put" else {})
        lanes = Lanes(*header["lanes"]) if header.get("lanes") else None
        fut = client.submit(header["op"], header["key"], lanes, **kw)
        fut.add_done_callback(lambda f, rid=header["id"], op=header["op"]: reply(rid, op, f))
    client.close()


class HelperClient:
    """``LoopClient``'s interface, served by a helper process (for forked children of a process using obstore)."""

    def __init__(self, spec: StoreSpec) -> None:
        self.spec = spec
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                            os.environ.get("PYTHONPATH", "")])}
        self._proc = subprocess.Popen([sys.executable, "-m", "packer.storage.client"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=env, start_new_session=True)
        self._lock, self._futures, self._next = threading.Lock(), {}, 0
        _send(self._proc.stdin, self._lock, {"url": spec.url, "options": spec.options, "policy": asdict(spec.policy)})
        # the reader and the finalizer hold the pipe and the process, not the client: one dropped unclosed ends them
        self._reader = threading.Thread(target=_read_replies, args=(weakref.ref(self), self._proc.stdout),
                                        name="packer-storage-helper", daemon=True)
        self._reader.start()
        self._end = weakref.finalize(self, _end_helper, self._proc, os.getpid())
        self._end.atexit = False  # at exit the process's end releases it, as before

    def submit(self, op: str, key: str, lanes: Lanes | None = None, **kw: Any) -> concurrent.futures.Future:
        """``LoopClient.submit``: ``lanes`` are kept by the helper's loop (a cancelled future does not withdraw a
        request already sent)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        data = kw.pop("data", b"")
        with self._lock:
            rid, self._next = self._next, self._next + 1
            self._futures[rid] = (op, fut)
        header = {"id": rid, "op": op, "key": key, "kw": kw, **({"lanes": [lanes.key, lanes.n]} if lanes else {})}
        try:
            _send(self._proc.stdin, self._lock, header, bytes(data))
        except (BrokenPipeError, ValueError):
            fut.set_exception(StorageError(f"the storage helper process ended (exit {self._proc.poll()})"))
        return fut

    def submit_many(self, op: str, calls: list[tuple[str, dict[str, Any]]],
                    lanes: Lanes | None = None) -> concurrent.futures.Future:
        """``LoopClient.submit_many``: each call a request to the helper, one future of their results."""
        futures = [self.submit(op, key, lanes, **kw) for key, kw in calls]
        return _combined(futures)

    def _reply(self, header: dict[str, Any], payload: bytes) -> None:
        with self._lock:
            op, fut = self._futures.pop(header["id"])
        if fut.set_running_or_notify_cancel():
            if header["ok"]:
                fut.set_result(_decode(op, header["result"], payload))
            else:
                fut.set_exception(_ERRORS.get(header["kind"], StorageError)(header["message"]))

    def _ended(self) -> None:
        """The helper's pipe closed: what is still waited for fails."""
        with self._lock:
            pending, self._futures = list(self._futures.values()), {}
        for _, fut in pending:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(StorageError(f"the storage helper process ended (exit {self._proc.poll()})"))

    def close(self) -> None:
        self._end()
        self._reader.join()


def _combined(futures: list[concurrent.futures.Future]) -> concurrent.futures.Future:
    """One future of ``futures``' results in order (a ``StorageError`` as a result); cancelling it cancels them."""
    out: concurrent.futures.Future = concurrent.futures.Future()
    left, lock = [len(futures)], threading.Lock()

    def landed(_: concurrent.futures.Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        if not out.set_running_or_notify_cancel():
            return
        results: list[Any] = []
        for fut in futures:
            exc = None if fut.cancelled() else fut.exception()
            if fut.cancelled() or (exc is not None and not isinstance(exc, StorageError)):
                out.set_exception(exc or concurrent.futures.CancelledError())
                return
            results.append(exc if exc is not None else fut.result())
        out.set_result(results)

    def cancelled(f: concurrent.futures.Future) -> None:
        if f.cancelled():
            for fut in futures:
                fut.cancel()

    out.add_done_callback(cancelled)
    for fut in futures:
        fut.add_done_callback(landed)
    if not futures:
        out.set_running_or_notify_cancel()
        out.set_result([])
    return out


def _read_replies(client_ref: weakref.ReferenceType[HelperClient], stdout: Any) -> None:
    """A helper client's reader thread: waits holding only the pipe, then the client while it hands a reply over."""
    while (msg := _receive(stdout)) is not None:
        client = client_ref()
        if client is None:
            return
        client._reply(*msg)
        del client
    client = client_ref()
    if client is not None:
        client._ended()


def _end_helper(proc: subprocess.Popen, pid: int) -> None:
    """Close the helper's stdin (it ends its requests and exits) and reap it; only in the process that started it."""
    if os.getpid() != pid:
        return
    with contextlib.suppress(OSError, ValueError):
        assert proc.stdin is not None
        proc.stdin.close()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


Client = LoopClient | HelperClient


def open_client(spec: StoreSpec) -> Client:
    """This process's client: in-process, unless obstore's runtime was started by the process this one was forked
    from (then a helper process)."""
    if _RUNTIME_PID is not None and _RUNTIME_PID != os.getpid():
        return HelperClient(spec)
    return LoopClient(spec)


if __name__ == "__main__":
    serve_helper()
