"""Payload ranges of a dataset written straight into a bucket (packer/write/remote_output.py keeps each shard's
ranges while its files are in the staging folder, in its journal entry; packer/write/ranges.py): the same meta/
files a local conversion writes, so the URL reads in ranged mode (packer/read/ranged.py), also after a killed and
resumed upload. Against the emulated store (packer/storage/emulate.py), counting at the server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.imagesets import make_imagefolder
from support.storage_servers import CREDENTIALS, Emulated, killed_upload, open_served

import packer
from packer.cli import main
from packer.layout.manifest import read_manifest
from packer.layout.partial import REMOTE_PARTIAL
from packer.layout.ranges import RANGE_FILES
from packer.read.ranged import RangedSource
from packer.write.convert import convert

URL = "s3://bucket/ds"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_imagefolder(tmp_path_factory.mktemp("remote-ranges") / "imgs", classes=3, per_class=8)


def _options(srv: Emulated) -> dict:
    return {**CREDENTIALS, "endpoint": srv.server.endpoint}


def _meta(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted((folder / "meta").rglob("*"))
            if p.is_file()}


def _meta_entries(folder: Path) -> list[dict]:
    return json.loads((folder / "manifest.json").read_text())["meta_files"]


def _same_meta(local: Path, bucket: Path) -> None:
    """The bucket's meta/ objects and the manifest's meta entries are the local conversion's, byte for byte."""
    assert _meta(bucket) == _meta(local)
    assert _meta_entries(bucket) == _meta_entries(local)


def _shard_bytes(ds) -> int:
    return max(sum(f.num_bytes for f in s.files) for s in ds.manifest.shards)


@pytest.mark.parametrize("fmt", ["lmdb", "memmap"])
def test_a_dataset_converted_into_a_bucket_records_the_local_ranges_and_reads_in_ranged_mode(fmt, source, fresh_store,
                                                                                               tmp_path):
    local = tmp_path / f"local.{fmt}"
    convert(source, local, to=fmt, shard_bytes=6_000, workers=0, progress=False)
    convert(source, f"{URL}.{fmt}", to=fmt, shard_bytes=6_000, workers=0, progress=False,
            storage_options=_options(fresh_store), staging_dir=tmp_path / "staging")
    bucket = tmp_path / "root" / f"ds.{fmt}"
    assert set(RANGE_FILES.values()) <= set(_meta(bucket))
    _same_meta(local, bucket)
    with open_served(fresh_store, tmp_path / "cache", f"{URL}.{fmt}", remote_mode="ranged") as ds:
        assert isinstance(ds.source, RangedSource) and len(ds.manifest.shards) > 2
        opened = fresh_store.server.stats.settled()
        assert bytes(ds.read_payload(5)) == Path(ds.samples[5][0]).read_bytes()
        one = fresh_store.server.stats.settled()
        # one ranged GET of the sample's group, not its shard's files
        assert one["gets"] - opened["gets"] == 1 and 0 < one["body_bytes"] - opened["body_bytes"] < _shard_bytes(ds)
        for i in range(len(ds)):
            assert bytes(ds.read_payload(i)) == Path(ds.samples[i][0]).read_bytes()


def test_formats_without_plain_ranges_record_none_in_a_bucket_either(source, fresh_store, tmp_path):
    for fmt, kw in [("bmp", {}), ("hdf5", {"payload": "raw", "compression": "gzip"})]:
        local = tmp_path / f"local.{fmt}"
        convert(source, local, to=fmt, shard_bytes=20_000, workers=0, progress=False, **kw)
        convert(source, f"{URL}.{fmt}", to=fmt, shard_bytes=20_000, workers=0, progress=False,
                storage_options=_options(fresh_store), staging_dir=tmp_path / "staging", **kw)
        bucket = tmp_path / "root" / f"ds.{fmt}"
        assert not set(RANGE_FILES.values()) & set(_meta(bucket))
        _same_meta(local, bucket)
        with open_served(fresh_store, tmp_path / "cache", f"{URL}.{fmt}") as ds:  # "auto": whole-shard mode
            assert not isinstance(ds.source, RangedSource)


def test_a_writer_into_a_bucket_records_the_ranges_a_local_writer_does(source, fresh_store, tmp_path):
    jpegs = sorted(source.rglob("*.jpg"))
    for out, kw in [(tmp_path / "local.lmdb", {}), (f"{URL}.lmdb",
                                                    {"storage_options": _options(fresh_store),
                                                     "staging_dir": tmp_path / "staging"})]:
        with packer.Writer(out, format="lmdb", fields={"caption": "str"}, shard_bytes=4_000, **kw) as w:
            for k, path in enumerate(jpegs):
                w.add(image=path.read_bytes(), label=k % 2, caption=f"photo {k}")
    _same_meta(tmp_path / "local.lmdb", tmp_path / "root" / "ds.lmdb")
    with open_served(fresh_store, tmp_path / "cache", f"{URL}.lmdb", remote_mode="ranged", fields="all") as ds:
        assert isinstance(ds.source, RangedSource) and len(ds.manifest.shards) > 2
        for k, path in enumerate(jpegs):
            assert bytes(ds.read_payload(k)) == path.read_bytes() and ds[k]["caption"] == f"photo {k}"


def test_packer_bench_reads_a_bucket_written_dataset_with_ranged_gets(source, fresh_store, tmp_path):
    convert(source, f"{URL}.lmdb", to="lmdb", shard_bytes=6_000, workers=0, progress=False,
            storage_options=_options(fresh_store), staging_dir=tmp_path / "staging")
    shards = sum(f.num_bytes for s in read_manifest(tmp_path / "root" / "ds.lmdb").shards for f in s.files)
    opts = [f"--storage-option={k}={v}" for k, v in _options(fresh_store).items()]
    assert main(["bench", f"{URL}.lmdb", *opts, "--remote-mode", "ranged", "--workers", "0", "--repeats", "1",
                 "--batch-size", "4", "-q", "--json", str(tmp_path / "b.json")]) == 0
    cold = next(r for r in json.loads((tmp_path / "b.json").read_text())["results"] if r["cache"] == "cold")
    assert cold["samples"] == 24
    # ranged GETs of the payloads' pages: less than the shard files, at least the payloads delivered
    assert cold["bytes"] <= cold["fetched_bytes"][0] < shards


def _env(endpoint: str) -> dict:
    return {**os.environ, "PYTHONPATH": os.getcwd(), "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}


@dataclass
class Killed:
    """An upload into the emulated store SIGKILLed after three shards: the server, its folder, the same conversion
    made locally, the journal in the bucket, the command and its environment."""

    srv: Emulated
    root: Path
    local: Path
    journal: Path
    cmd: list[str]
    env: dict

    def resume(self, staging: Path) -> subprocess.CompletedProcess:
        """The same conversion with --resume from another staging folder (another machine's)."""
        return subprocess.run([*self.cmd[:-1], str(staging), "--resume"], env=self.env, capture_output=True,
                              text=True)

    def reads_the_source_in_ranged_mode(self, cache: Path) -> None:
        self.srv.server.stats.closed()
        with open_served(self.srv, cache, f"{URL}.lmdb", remote_mode="ranged") as ds:
            assert isinstance(ds.source, RangedSource)
            for i in range(len(ds)):
                assert bytes(ds.read_payload(i)) == Path(ds.samples[i][0]).read_bytes()


@pytest.fixture
def killed(source, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    local = tmp_path / "local.lmdb"
    convert(source, local, to="lmdb", shard_bytes=2_500, workers=0, progress=False)
    srv = Emulated(root, bandwidth=40_000)
    journal = root / "ds.lmdb" / REMOTE_PARTIAL / "journal"
    cmd = [sys.executable, "-m", "packer", "convert", str(source), "--to", "lmdb", "-o", f"{URL}.lmdb", "-q",
           "--workers", "0", "--shard-size", "2500", "--staging-dir", str(tmp_path / "staging-1")]
    try:
        env = _env(srv.server.endpoint)
        killed_upload(cmd, env, journal, srv)
        yield Killed(srv, root, local, journal, cmd, env)
    finally:
        srv.stop()


def test_a_killed_then_resumed_upload_records_the_ranges_of_a_fresh_conversion(killed, tmp_path):
    entries = sorted(killed.journal.glob("shard-*.json"))
    assert entries and not (killed.root / "ds.lmdb" / "manifest.json").exists()
    for entry in entries:  # each journaled shard's ranges are in the bucket: its staged files are gone
        ranges = json.loads(entry.read_text())["ranges"]
        assert set(ranges) == set(RANGE_FILES) and len(ranges["offset"]) > 0
    done = killed.resume(tmp_path / "staging-2")
    assert done.returncode == 0, done.stderr
    _same_meta(killed.local, killed.root / "ds.lmdb")
    killed.reads_the_source_in_ranged_mode(tmp_path / "cache")


@pytest.mark.parametrize("craft", ["past_the_file", "no_such_file", "negative", "short"])
def test_a_resumed_upload_recomputes_journal_ranges_that_do_not_fit_their_shard(craft, killed, tmp_path):
    """A journal entry in the bucket whose ``ranges`` point outside its shard's files (edited, or from a damaged
    upload) must not become the dataset's meta/ ranges: the dataset would be finished and then refuse to open.
    Ranges that are no ranges (negative, a list short) are a damaged entry, refused in one line."""
    entry = sorted(killed.journal.glob("shard-*.json"))[0]
    data = json.loads(entry.read_text())
    if craft == "past_the_file":
        data["ranges"]["offset"][0] = sum(f["num_bytes"] for f in data["shard"]["files"]) + 10
    elif craft == "no_such_file":
        data["ranges"]["file"][0] = 7
    elif craft == "negative":
        data["ranges"]["offset"][0] = -1
    else:
        data["ranges"]["crc32"].pop()
    entry.write_text(json.dumps(data))
    done = killed.resume(tmp_path / "staging-2")
    if craft in ("negative", "short"):  # no range at all: refused in one line (the entry is damaged)
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1
        assert "damaged journal entry" in done.stderr and not (killed.root / "ds.lmdb" / "manifest.json").exists()
        return
    assert done.returncode == 0, done.stderr
    _same_meta(killed.local, killed.root / "ds.lmdb")
    killed.reads_the_source_in_ranged_mode(tmp_path / "cache")
