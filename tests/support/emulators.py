"""Local emulators of the cloud object stores packer claims besides S3, started by the tests on a free port of
127.0.0.1: Azurite (Azure Blob; `make install` puts it in .tools/azurite with npm). Each is a real server speaking
the service's REST API, signatures checked; never a mocked client."""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from email.utils import formatdate
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
AZURITE = REPO / ".tools" / "azurite" / "node_modules" / ".bin" / "azurite-blob"
# Azurite's well-known development account and key (published by Microsoft: "Use the Azurite emulator")
AZURE_ACCOUNT = "devstoreaccount1"
AZURE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def emulator_or_skip(request: pytest.FixtureRequest, path: Path, how: str) -> None:
    """Skip when the emulator ``path`` is not installed; fail instead under --require-emulators (CI)."""
    if path.exists():
        return
    reason = f"{path.relative_to(REPO)} is not installed ({how})"
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
    """Start ``argv_for_port(port)`` on a free port (another when that one is taken meanwhile: "address in use")
    and yield the port once it accepts connections; the process is stopped at exit."""
    for _ in range(tries):
        port = _free_port()
        proc = subprocess.Popen(argv_for_port(port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for _ in range(1200):  # bounded: a failure names the server, never a timing
            if proc.poll() is not None or _answers(port):
                break
            time.sleep(0.05)
        if proc.poll() is None and _answers(port):
            break
        out = proc.communicate(timeout=30)[0].decode(errors="replace") if proc.poll() is not None else ""
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if "EADDRINUSE" not in out and "address already in use" not in out.lower():
            raise AssertionError(f"{name} did not start: {out[-2000:]}")
    else:
        raise AssertionError(f"{name}: every free port tried was taken")
    try:
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


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
