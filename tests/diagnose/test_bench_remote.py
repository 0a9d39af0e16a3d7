"""packer bench and packer doctor on a URL (packer/diagnose/bench_remote.py, link.py, doctor_remote.py): real passes
over a tiny packed dataset served by moto's S3, by the emulated store over S3 and plain HTTP, and through
``--emulate s3`` (the store in its own process). Only counts are checked, never timings: GETs per pass, bytes fetched
against the shards' bytes, cache hits, the cold cache's clean-up, the emulated link's settings."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support.imagesets import make_imagefolder
from support.storage_servers import CREDENTIALS, Emulated, moto_server, s3_store, upload

from packer.cli import main
from packer.diagnose.bench import BenchOptions
from packer.diagnose.bench_remote import RemoteOptions, Target, run_remote_bench
from packer.layout.manifest import read_manifest
from packer.write.convert import convert

SECRET = "not-a-real-secret-7f3a"


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A packed LMDB dataset of 12 JPEGs in several shards, and its shard files' names and bytes."""
    base = tmp_path_factory.mktemp("bench-remote")
    src = make_imagefolder(base / "imgs", classes=2, per_class=6)
    ds = base / "root" / "ds.lmdb"
    convert(src, ds, to="lmdb", shard_bytes=6_000, workers=0, progress=False, order="shuffled")
    files = [f for s in read_manifest(ds).shards for f in s.files]
    assert len(read_manifest(ds).shards) > 1
    return ds, {f.name: f.num_bytes for f in files}


def _bench(argv: list[str], out, mode: str = "shard") -> dict:
    """``packer bench`` with small settings; whole-shard mode unless ``mode`` (the counts below are per shard)."""
    assert main(["bench", *argv, "--workers", "0", "--repeats", "1", "--batch-size", "4", "-q", "--json",
                 str(out), "--remote-mode", mode]) == 0
    return json.loads(out.read_text())


def _row(report: dict, cache: str) -> dict:
    return next(r for r in report["results"] if r["cache"] == cache)


def _check_cold(row: dict, files: dict[str, int], samples: int) -> None:
    """A cold pass over every sample fetches each shard file once, whole, and hits nothing."""
    assert row["samples"] == samples and row["level"] == "loader"
    assert row["gets"] == [len(files)]
    assert row["fetched_bytes"] == [sum(files.values())]
    assert row["cache_hits"] == [0]
    assert row["requests_per_sample"]["median"] == pytest.approx(len(files) / samples)
    assert row["fetched_per_delivered_byte"]["median"] == pytest.approx(sum(files.values()) / row["bytes"])
    assert row["seconds_to_first_batch"][0] is not None and row["seconds_to_first_batch"][0] <= row["seconds"][0]


def test_emulate_s3_serves_the_local_dataset_by_url_and_counts(packed, tmp_path, monkeypatch):
    ds, files = packed
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the cold caches are made
    (tmp_path / "tmp").mkdir()
    report = _bench([str(ds), "--emulate", "s3", "--latency", "0.001", "--bandwidth", "1GB"], tmp_path / "b.json")
    assert report["remote"] is True
    emu = report["emulation"]
    assert (emu["preset"], emu["latency_s"], emu["bandwidth_bytes_per_s"]) == ("s3", 0.001, 1e9)
    cold, warm = _row(report, "cold"), _row(report, "warm")
    samples = report["datasets"][0]["samples"]
    assert samples == 12 and report["datasets"][0]["object_bytes"] == sum(files.values())
    _check_cold(cold, files, samples)
    assert cold["order"] == "block"  # a URL's default: the order that fetches whole shards ahead
    # the warm pass reads the cache the cold one filled: nothing fetched, every shard file a hit
    assert warm["gets"] == [0] and warm["fetched_bytes"] == [0] and warm["cache_hits"] == [len(files)]
    link = report["links"]["s3://packer/ds.lmdb"]
    assert link["object"] == max(files, key=files.__getitem__) and link["first_byte_s"] >= 0.001
    assert cold["ceiling"]["bound"] in ("link", "decode") and warm["ceiling"]["bound"] == "decode"  # no link used
    assert not list((tmp_path / "tmp").iterdir())  # the cold cache went with its repeat


def test_a_url_is_benched_as_training_reads_it_in_ranged_mode_by_default(packed, tmp_path):
    """The default ``--remote-mode auto`` reads a dataset that records ranges as ``open_dataset(URL)`` does: ranged
    GETs of the payloads (not whole shard files); the warm pass fetches nothing."""
    ds, files = packed
    report = _bench([str(ds), "--emulate", "s3", "--latency", "0.001", "--bandwidth", "1GB"], tmp_path / "b.json",
                    mode="auto")
    cold, warm = _row(report, "cold"), _row(report, "warm")
    assert report["options"]["remote_mode"] == "auto" and cold["samples"] == 12
    # ranged GETs of the payloads' pages: less than the shard files whole-shard mode fetches (exactly their bytes)
    assert 0 < cold["fetched_bytes"][0] < sum(files.values()) and cold["bytes"] <= cold["fetched_bytes"][0]
    assert warm["gets"] == [0] and warm["fetched_bytes"] == [0]


def test_emulated_link_serves_what_the_downloader_counts(packed, tmp_path):
    """The emulated store's own counters (in its own process) agree with the node downloader's: a bench pass
    costs the server what opening the dataset costs plus exactly the shards' bytes."""
    from packer.diagnose.link import EmulatedLink
    from packer.read.dataset import open_dataset

    ds, files = packed
    o = BenchOptions(levels=("loader",), orders=("sequential",), caches=("cold",), workers=(0,), batch_size=4,
                     repeats=1)
    with EmulatedLink(ds.parent, 0.0, None) as link:
        target = Target(link.url(ds.name), link.storage_options)
        start = link.stats()
        open_dataset(target.url, cache_dir=tmp_path / "c", storage_options=target.storage_options).close()
        opened = link.stats()
        report = run_remote_bench([target], o, RemoteOptions(measure_link=False, remote_mode="shard"))
        end = link.stats()
    row = report["results"][0]
    assert row["order"] == "sequential" and report["links"] == {}
    _check_cold(row, files, 12)
    open_bytes = opened["body_bytes"] - start["body_bytes"]
    assert end["body_bytes"] - opened["body_bytes"] == open_bytes + sum(files.values())
    assert end["gets"] - opened["gets"] == opened["gets"] - start["gets"] + len(files)


def test_url_on_moto_with_a_given_cache_keeps_it(packed, tmp_path):
    """``packer bench s3://...`` with --storage-option and --cache-dir: the given cache stays, so a second run
    fetches nothing; the secret is never written to the report."""
    ds, files = packed
    with moto_server() as endpoint:
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key=SECRET).create_bucket(Bucket="bucket")
        with s3_store(endpoint, "s3://bucket/ds.lmdb") as store:
            upload(store, ds)
        opts = ["--storage-option", f"endpoint={endpoint}", "--storage-option", "aws_access_key_id=testing",
                "--storage-option", f"aws_secret_access_key={SECRET}", "--storage-option", "region=us-east-1",
                "--cache-dir", str(tmp_path / "cache"), "--cold"]
        first = _bench(["s3://bucket/ds.lmdb", *opts], tmp_path / "a.json")
        again = _bench(["s3://bucket/ds.lmdb", *opts], tmp_path / "b.json")
    row = _row(first, "given")
    _check_cold(row, files, 12)
    assert SECRET not in (tmp_path / "a.json").read_text()
    assert first["options"]["storage_option_keys"] == ["aws_access_key_id", "aws_secret_access_key", "endpoint",
                                                       "region"]
    assert (tmp_path / "cache").is_dir()
    warm = _row(again, "given")
    assert warm["gets"] == [0] and warm["cache_hits"] == [len(files)]


def test_http_url_on_the_emulated_store(packed, tmp_path):
    """http(s):// cannot list: the link is measured on the manifest's largest shard file, by HEAD."""
    ds, files = packed
    shutil.copytree(ds, tmp_path / "root" / "ds.lmdb")
    server = Emulated(tmp_path / "root")
    try:
        url = f"{server.server.endpoint}/bucket/ds.lmdb"
        report = _bench([url, "--cold"], tmp_path / "b.json")
    finally:
        server.stop()
    _check_cold(_row(report, "cold"), files, 12)
    link = next(iter(report["links"].values()))
    assert link["object"] == max(files, key=files.__getitem__) and link["bandwidth_bytes_per_s"] > 0


def test_doctor_url_reports_the_link_and_the_bound(packed, tmp_path):
    from packer.diagnose.doctor import diagnose, render

    ds, _files = packed
    shutil.copytree(ds, tmp_path / "root" / "ds.lmdb")
    server = Emulated(tmp_path / "root", latency=0.02)
    try:
        report = diagnose("s3://bucket/ds.lmdb", seconds=0.1, progress=False,
                          storage_options={**CREDENTIALS, "endpoint": server.server.endpoint})
    finally:
        server.stop()
    link = report["link"]
    assert len(link["first_byte_s_each"]) == 5 and min(link["first_byte_s_each"]) >= 0.02  # the server's delay
    assert report["data"]["samples"] == 12
    bound = [f for f in report["verdict"] if f["figures"].get("bound")]
    assert len(bound) == 1 and bound[0]["figures"]["bound"] in ("link", "decode")
    assert "link " in render(report) and "storage not measured" not in render(report)


@pytest.mark.parametrize("argv, words", [
    (["s3://bucket/ds.lmdb", "LOCAL"], "either URLs or local paths"),
    (["s3://bucket/ds.lmdb", "--emulate", "hdd"], "throttle a local disk"),
    (["s3://bucket/ds.lmdb", "--read-iops", "100"], "throttle a local disk"),
    (["NOTDS", "--emulate", "s3"], "not a packed dataset"),
    (["s3://bucket/ds.lmdb", "--plot", "b.png"], "--plot charts a local bench"),
    (["LOCAL", "--storage-option", "region=x"], "for a dataset at a URL"),
    (["LOCAL", "--cache-dir", "c"], "for a dataset at a URL"),
])
def test_refusals_are_one_line(argv, words, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "NOTDS").mkdir()
    (tmp_path / "LOCAL").mkdir()
    assert main(["bench", *argv, "-q"]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_remote_peers_example_runs(tmp_path):
    """examples/bench_remote_peers.py end to end on 16 photos with the peers that are always installed (LitData
    and MosaicML Streaming are not test requirements): every image delivered once, the store's GETs counted."""
    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "peers.json"
    run = subprocess.run([sys.executable, str(repo / "examples" / "bench_remote_peers.py"), "--count", "16",
                          "--workers", "0", "--batch", "8", "--shard-size", "300KB", "--latency", "0",
                          "--peers", "packer,objects", "--start-methods", "fork", "--json", str(out)],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(repo)}, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    packer_row, objects = report["results"]["fork"]["packer"], report["results"]["fork"]["objects"]
    assert packer_row["images"] == objects["images"] == 16
    assert objects["store"]["gets"] == 16 and objects["fetched_per_image_byte"] == 1.0  # one GET per image
    assert packer_row["fetched_per_image_byte"] >= 1.0 and packer_row["store"]["gets"] > 0
    assert "| one object per image" in run.stdout
