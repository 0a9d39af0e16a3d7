"""Object-storage servers the storage tests start and stop themselves, on port 0 of localhost: moto's S3 server
(pure Python, as s3fs's own tests use) and packer's emulated store (S3 subset and plain HTTP Range, with fault
injection at the server). Never a mocked client object. The fixtures are in tests/storage/conftest.py."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from packer.storage.emulate import EmulatedStore, FaultPlan
from packer.storage.faults import RetryPolicy
from packer.storage.store import ObjectStore

CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region": "us-east-1"}
# quick retries and short timeouts so fault tests end fast; the counts are what the tests check
FAST_POLICY = RetryPolicy(retries=3, backoff=0.01, max_backoff=0.05, retry_timeout=20, timeout=2, connect_timeout=2)


@contextmanager
def moto_server() -> Iterator[str]:
    """moto's ThreadedMotoServer on 127.0.0.1, a free port; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer("127.0.0.1", 0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def make_bucket(endpoint: str, name: str) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                      aws_secret_access_key="testing")
    s3.create_bucket(Bucket=name)


def s3_store(endpoint: str, url: str, policy: RetryPolicy = FAST_POLICY) -> ObjectStore:
    """An ObjectStore for ``url`` (s3://bucket/prefix) served at ``endpoint``."""
    return ObjectStore(url, {**CREDENTIALS, "endpoint": endpoint}, policy)


class Emulated:
    """A running emulated store over ``root`` with a fault plan the test fills."""

    def __init__(self, root: Path, **kw) -> None:
        self.root = root
        self.faults = FaultPlan()
        self.server = EmulatedStore(root, "bucket", faults=self.faults, **kw).start()

    def store(self, prefix: str = "", policy: RetryPolicy = FAST_POLICY) -> ObjectStore:
        return s3_store(self.server.endpoint, f"s3://bucket/{prefix}", policy)

    def http(self, prefix: str = "", policy: RetryPolicy = FAST_POLICY) -> ObjectStore:
        return ObjectStore(f"{self.server.endpoint}/bucket/{prefix}", None, policy)

    def write(self, key: str, data: bytes) -> None:
        """Replace an object the way a writer would: a new file renamed over the old (a new ETag)."""
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def stop(self) -> None:
        self.server.stop()
