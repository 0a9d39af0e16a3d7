"""The emulated object store (packer/storage/emulate.py): boto3, an independent S3 client, reads it as S3 (HEAD,
ranged GET, conditional GET, ListObjectsV2 pages); latency and bandwidth are checked by the server's own
accounting and the link's schedule, never by the wall clock."""

from __future__ import annotations

import threading

import pytest
from support.storage_servers import Emulated

from packer.storage.emulate import CHUNK, Link

DATA = bytes(range(256)) * 2000


@pytest.fixture
def s3(tmp_path):
    import boto3

    root = tmp_path / "root"
    (root / "train" / "cat").mkdir(parents=True)
    (root / "train" / "dog").mkdir(parents=True)
    (root / "train" / "cat" / "1.jpg").write_bytes(DATA)
    (root / "train" / "cat" / "2.jpg").write_bytes(b"two")
    (root / "train" / "dog" / "3.jpg").write_bytes(b"three")
    (tmp_path / "secret.txt").write_text("outside the served folder")
    srv = Emulated(root, page_size=2, latency=0.001, bandwidth=50e6)
    client = boto3.client("s3", endpoint_url=srv.server.endpoint, region_name="us-east-1",
                          aws_access_key_id="x", aws_secret_access_key="y")
    yield srv, client
    srv.stop()


def test_boto3_reads_it_as_s3(s3):
    srv, client = s3
    head = client.head_object(Bucket="bucket", Key="train/cat/1.jpg")
    assert head["ContentLength"] == len(DATA) and head["ETag"]
    part = client.get_object(Bucket="bucket", Key="train/cat/1.jpg", Range="bytes=1000-1999")
    assert part["Body"].read() == DATA[1000:2000] and part["ContentRange"] == f"bytes 1000-1999/{len(DATA)}"
    assert client.get_object(Bucket="bucket", Key="train/cat/1.jpg", Range="bytes=-10")["Body"].read() == DATA[-10:]
    same = client.get_object(Bucket="bucket", Key="train/cat/1.jpg", IfMatch=head["ETag"])
    assert same["Body"].read() == DATA
    from botocore.exceptions import ClientError

    with pytest.raises(ClientError, match="412|PreconditionFailed"):
        client.get_object(Bucket="bucket", Key="train/cat/1.jpg", IfMatch='"another"')
    with pytest.raises(ClientError, match="InvalidRange|416"):
        client.get_object(Bucket="bucket", Key="train/cat/2.jpg", Range="bytes=10-20")
    for outside in ("../secret.txt", "train/../../secret.txt", "%2e%2e/secret.txt"):
        with pytest.raises(ClientError, match="NoSuchKey|404"):
            client.get_object(Bucket="bucket", Key=outside)


def test_listing_is_paginated_with_prefixes_and_delimiters(s3):
    srv, client = s3
    pages = list(client.get_paginator("list_objects_v2").paginate(Bucket="bucket", Prefix="train/"))
    keys = [o["Key"] for p in pages for o in p.get("Contents", [])]
    assert keys == ["train/cat/1.jpg", "train/cat/2.jpg", "train/dog/3.jpg"] and len(pages) == 2
    top = client.list_objects_v2(Bucket="bucket", Prefix="train/", Delimiter="/")
    assert [p["Prefix"] for p in top["CommonPrefixes"]] == ["train/cat/", "train/dog/"]
    assert srv.server.stats.lists == 3


def test_every_request_is_delayed_and_every_body_byte_paced(s3):
    srv, client = s3
    for i in range(5):
        part = client.get_object(Bucket="bucket", Key="train/cat/1.jpg", Range=f"bytes={i * 100}-{i * 100 + 99}")
        part["Body"].read()
    client.head_object(Bucket="bucket", Key="train/cat/2.jpg")
    client.get_object(Bucket="bucket", Key="train/cat/1.jpg")["Body"].read()
    st = srv.server.stats.settled()
    assert st["requests"] == st["latency_delays"] == 7 and st["latency_seconds"] == pytest.approx(7 * 0.001)
    assert st["body_bytes"] == st["paced_bytes"] == 5 * 100 + len(DATA)
    assert st["paced_seconds"] == pytest.approx(st["paced_bytes"] / 50e6)


def test_the_link_gives_each_chunk_its_own_slot_whatever_the_concurrency():
    """Chunks reserved from 8 threads at once are scheduled one after another at the link's rate."""
    link = Link(bandwidth=100e6)
    starts: list[float] = []
    lock = threading.Lock()

    def book() -> None:
        for _ in range(20):
            at = link.reserve(CHUNK)
            with lock:
                starts.append(at)

    threads = [threading.Thread(target=book) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    starts.sort()
    slot = CHUNK / 100e6
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(starts) == 160 and min(gaps) >= slot * (1 - 1e-9)
    assert starts[-1] - starts[0] >= 159 * slot * (1 - 1e-9)  # 160 chunks take the link 160 slots
    assert Link(None).reserve(CHUNK) == 0.0  # unlimited: nothing is booked


def test_closed_waits_for_requests_a_dead_client_had_fully_sent(tmp_path):
    """A client that sends a PUT and vanishes at once: ``closed()`` returns only once the server has stored it (the
    race a killed writer leaves: its last requests sit in the server's socket buffer, unanswered)."""
    import socket
    from urllib.parse import urlsplit

    root = tmp_path / "root"
    root.mkdir()
    srv = Emulated(root, latency=0.3)  # the server sleeps before answering: the client is gone by then
    try:
        where = urlsplit(srv.server.endpoint)
        body = b"x" * 1000
        with socket.create_connection((where.hostname, where.port)) as sock:
            sock.sendall(b"PUT /bucket/late.bin HTTP/1.1\r\nHost: h\r\nContent-Length: 1000\r\n\r\n" + body)
        counts = srv.server.stats.closed()
        assert (root / "late.bin").read_bytes() == body
        assert counts["open_connections"] == 0 and counts["active"] == 0 and counts["puts"] == 1
    finally:
        srv.stop()


def test_a_page_of_a_listing_stats_its_own_entries_not_the_whole_prefix(tmp_path, monkeypatch):
    import os

    import boto3

    folder = tmp_path / "root" / "many"
    folder.mkdir(parents=True)
    for i in range(60):
        (folder / f"{i:03d}.jpg").write_bytes(b"x" * (i + 1))
    srv = Emulated(tmp_path / "root", page_size=5)
    try:
        client = boto3.client("s3", endpoint_url=srv.server.endpoint, region_name="us-east-1",
                              aws_access_key_id="x", aws_secret_access_key="y")
        stats, real_stat = [], os.stat
        monkeypatch.setattr(os, "stat", lambda path, *a, **kw: stats.append(path) or real_stat(path, *a, **kw))
        page = client.list_objects_v2(Bucket="bucket", Prefix="many/", StartAfter="many/010.jpg")
        monkeypatch.undo()
        want = [(f"many/{i:03d}.jpg", i + 1) for i in range(11, 16)]
        assert [(o["Key"], o["Size"]) for o in page["Contents"]] == want
        assert len([p for p in stats if str(p).endswith(".jpg")]) == 5  # a 100,000-key prefix: 100 pages, not 100x
    finally:
        srv.stop()


def test_pages_list_every_key_once_in_s3_order_whatever_the_folders(tmp_path):
    import boto3

    root = tmp_path / "root"
    names = ["p/a.txt", "p/a/b", "p/a/c/d", "p/a0", "p/a-b/x", "p/b", "p/é/1", "p/z", "q/other"]
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(name.encode())
    srv = Emulated(root, page_size=2)
    try:
        client = boto3.client("s3", endpoint_url=srv.server.endpoint, region_name="us-east-1",
                              aws_access_key_id="x", aws_secret_access_key="y")
        for prefix in ["p/", "p/a", "p", ""]:
            pages = list(client.get_paginator("list_objects_v2").paginate(Bucket="bucket", Prefix=prefix))
            keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
            assert keys == sorted(n for n in names if n.startswith(prefix)), prefix
    finally:
        srv.stop()
