"""``convert(..., storage_options=)`` and ``packer convert --storage-option``: one set of settings reaching every
object the conversion reads (a prefix, a list file and the objects it names, WebDataset shards, a tar, Parquet,
Dask tasks) and the output in a bucket, with nothing in the environment (no ``AWS_*``, no ``~/.aws``); the secret
in none of stdout, stderr, errors.json or the manifest; refused where nothing is at a URL.

The emulated store (packer/storage/emulate.py) checks no signature, so what proves the settings arrived is the
endpoint: given only in them, a client without them would ask AWS itself (unreachable here) instead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from support.foreign import items, make_hf, make_wds
from support.imagesets import tiny_photos
from support.storage_servers import Emulated

import packer
from packer.errors import OptionError
from packer.storage.emulate import Fault
from packer.write.scan import scan_folder
from tests.write.sources.test_remote_source import _same_dataset

REPO = Path(__file__).resolve().parents[3]
SECRET = "sEcReT-do-not-print-7f3a"
STORAGE_ENV = ("AWS_", "GOOGLE_", "AZURE_")


@pytest.fixture
def served(tmp_path, monkeypatch):
    """The emulated store over ``tmp_path/root``, pages of 7 keys; this process's environment holds no store
    settings (the Dask workers it spawns inherit that) and ``HOME`` has no ``~/.aws``."""
    for name in list(os.environ):
        if name.startswith(STORAGE_ENV):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "root").mkdir()
    srv = Emulated(tmp_path / "root", page_size=7)
    yield srv
    srv.stop()


def options(srv: Emulated) -> dict[str, str]:
    return {"endpoint": srv.server.endpoint, "aws_access_key_id": "id", "aws_secret_access_key": SECRET,
            "region": "us-east-1"}


def flags(srv: Emulated) -> list[str]:
    return [a for k, v in options(srv).items() for a in ("--storage-option", f"{k}={v}")]


def child_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a ``packer`` child: nothing that configures a store, a ``HOME`` without ``~/.aws``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(STORAGE_ENV)}
    return {**env, "PYTHONPATH": str(REPO), "HOME": str(tmp_path / "home")}


def packer_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packer", *args], env=child_env(tmp_path), capture_output=True,
                          text=True, timeout=300)


def no_secret(*texts: str, folder: Path | None = None) -> None:
    """``SECRET`` in none of ``texts`` nor in any file below ``folder``."""
    for text in texts:
        assert SECRET not in text
    for path in (folder.rglob("*") if folder is not None else []):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


def test_every_source_kind_by_url_on_the_command_line_with_storage_options_only(served, tmp_path):
    root = tmp_path / "root"
    train = tiny_photos(root / "train", classes=2, per_class=4)
    (train / "c1" / "bad.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    scan = scan_folder(train)
    (train / "list.txt").write_text("".join(f"{rel} {label}\n" for rel, label in zip(scan.rel_paths,
                                                                                       scan.labels.tolist())))
    (root / "arch").mkdir()
    with tarfile.open(root / "arch" / "train.tar", "w") as tar:
        tar.add(train, arcname="train")
    make_wds(root / "shards", items(10), per_shard=4)
    _, parquet = make_hf(tmp_path / "hf", items(9), ["a", "b", "c"], rows_per_group=4)
    (root / "hf").mkdir()
    shutil.copy(parquet, root / "hf" / "data.parquet")
    local_root = tmp_path / "local"
    shutil.copytree(root, local_root)  # the same files, read from the disk
    kinds = {"prefix": ("train/", "train"), "list": ("train/list.txt", "train/list.txt"),
             "tar": ("arch/train.tar", "arch/train.tar"), "wds": ("shards/", "shards"),
             "parquet": ("hf/data.parquet", "hf/data.parquet")}
    for kind, (key, local_name) in kinds.items():
        out = tmp_path / f"{kind}.lmdb"
        res = packer_cli(tmp_path, "convert", f"s3://bucket/{key}", "-o", str(out), "--workers", "1",
                         *flags(served))
        assert res.returncode in (0, 1), (kind, res.stderr)
        local = packer.convert(local_root / local_name, tmp_path / f"{kind}-local.lmdb", workers=0, progress=False)
        _same_dataset(out, local.output)
        no_secret(res.stdout, res.stderr, folder=out)
        if kind in ("prefix", "list"):
            errors = json.loads((out / "errors.json").read_text())["errors"]
            assert [(e["path"], e["location"].split(" ")[0]) for e in errors] == [
                ("c1/bad.jpg", "s3://bucket/train/c1/bad.jpg")]


def test_a_lasting_failure_is_one_line_without_the_secret(served, tmp_path, capsys):
    from packer.cli import main

    tiny_photos(tmp_path / "root" / "train", classes=2, per_class=4)
    (tmp_path / "root" / "train" / "list.txt").write_text("c0/000.jpg 0\n")
    served.faults.add(Fault("status", 500, "InternalError"), key="train/list.txt", times=-1)  # a lasting failure
    assert main(["convert", "s3://bucket/train/list.txt", "-o", str(tmp_path / "failed.lmdb"), *flags(served)]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("packer: error: s3://bucket/train/list.txt: ") and "500" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "failed.lmdb").exists()
    no_secret(out, err)


def test_the_output_in_a_bucket_takes_storage_options_on_the_command_line(served, tmp_path):
    imgs = tiny_photos(tmp_path / "imgs", classes=2, per_class=4)
    res = packer_cli(tmp_path, "convert", str(imgs), "-o", "s3://bucket/out.lmdb", "--shard-size", "2KB",
                     *flags(served), "--json")
    assert res.returncode == 0, res.stderr
    no_secret(res.stdout, res.stderr, folder=tmp_path / "root")
    with packer.open_dataset("s3://bucket/out.lmdb", cache_dir=tmp_path / "cache", storage_options=options(served)
                             ) as ds, packer.open_dataset(packer.convert(imgs, tmp_path / "l.lmdb", workers=0,
                                                                         progress=False).output) as local:
        assert [bytes(ds.read_payload(i)) for i in range(len(ds))] == [
            bytes(local.read_payload(i)) for i in range(len(local))]
    no_secret(folder=tmp_path / "cache")


def test_a_local_list_naming_objects_and_a_url_root_take_storage_options(served, tmp_path):
    train = tiny_photos(tmp_path / "root" / "train", classes=2, per_class=4)
    scan = scan_folder(train)
    named = tmp_path / "lists"
    named.mkdir()
    rows = list(zip(scan.rel_paths, scan.labels.tolist()))
    (named / "urls.txt").write_text("".join(f"s3://bucket/train/{rel} {label}\n" for rel, label in rows))
    (named / "plain.txt").write_text("".join(f"{rel} {label}\n" for rel, label in rows))
    shutil.copy(named / "plain.txt", train / "plain.txt")
    local = packer.convert(train / "plain.txt", tmp_path / "local.lmdb", workers=0, progress=False, order="source")
    for name, kw in (("urls.txt", {}), ("plain.txt", {"root": "s3://bucket/train/"})):
        res = packer.convert(named / name, tmp_path / f"{name}.lmdb", workers=0, progress=False, order="source",
                             storage_options=options(served), **kw)
        _same_dataset(res.output, local.output)
        no_secret(folder=Path(res.output))


def test_dask_tasks_fetch_with_the_storage_options(served, tmp_path):
    distributed = pytest.importorskip("distributed", reason="needs the packer[dask] extra")
    from packer.write.cluster import open_client

    train = tiny_photos(tmp_path / "root" / "train", classes=3, per_class=4)
    local = packer.convert(train, tmp_path / "local.lmdb", workers=0, shard_bytes=2000, progress=False).output
    with open_client("local:2") as client:  # spawned workers: no AWS_* in their environment either
        assert isinstance(client, distributed.Client)
        before = served.server.stats.settled()["gets"]
        out = packer.convert("s3://bucket/train/", tmp_path / "dask.lmdb", client=client, shard_bytes=2000,
                             progress=False, storage_options=options(served)).output
        assert served.server.stats.settled()["gets"] - before == 12
    _same_dataset(out, local)
    no_secret(folder=Path(out))


def test_storage_options_with_nothing_at_a_url_are_refused_in_one_line(tmp_path, capsys):
    from packer.cli import main

    imgs = tiny_photos(tmp_path / "imgs", classes=2, per_class=4)
    (tmp_path / "list.txt").write_text("imgs/c0/000.jpg 0\n")
    for src in (imgs, tmp_path / "list.txt"):  # a list file: refused once its rows are known to be local
        with pytest.raises(OptionError, match=r"^storage_options is for a source or an output at a URL"):
            packer.convert(src, tmp_path / "x.lmdb", workers=0, progress=False, storage_options={"region": "x"})
        assert not (tmp_path / "x.lmdb").exists()
    assert main(["convert", str(imgs), "-o", str(tmp_path / "y.lmdb"), "--storage-option",
                 f"aws_secret_access_key={SECRET}", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("packer: error: --storage-option is for a source or an output at a URL")
    assert len(err.splitlines()) == 1 and SECRET not in err and not (tmp_path / "y.lmdb").exists()
    assert main(["convert", str(imgs), "-o", str(tmp_path / "z.lmdb"), "--storage-option", "novalue", "-q"]) == 2
    assert "--storage-option novalue: expected KEY=VALUE" in capsys.readouterr().err


def test_a_report_records_the_command_without_storage_option_values():
    from packer.cli.commands import shown_command

    argv = ["bench", "s3://bucket/ds.lmdb", "--storage-option", f"aws_secret_access_key={SECRET}",
            f"--storage-option=token={SECRET}", "--storage-opt", f"password={SECRET}", "--workers", "2"]
    assert shown_command(argv) == ("packer bench s3://bucket/ds.lmdb --storage-option aws_secret_access_key=... "
                                   "--storage-option=token=... --storage-opt password=... --workers 2")


def test_storage_options_the_store_refuses_are_one_line_without_the_secret(served, tmp_path, capsys):
    """An unknown key or a value obstore cannot parse: one line naming the URL and the key, never a traceback (it
    printed obstore's exception, a value it could not parse included)."""
    from packer.cli import main

    imgs = tiny_photos(tmp_path / "imgs", classes=2, per_class=4)
    for args in (["convert", str(imgs), "-o", "s3://bucket/out.lmdb", "-q"], ["info", "s3://bucket/out.lmdb"]):
        for bad in ("bogus_option=1", f"aws_skip_signature={SECRET}"):
            assert main([*args, *flags(served), "--storage-option", bad]) == 2
            out, err = capsys.readouterr()
            assert err.startswith("packer: error: s3://bucket/out.lmdb: the storage options were refused: ")
            assert len(err.splitlines()) == 1 and ("bogus_option" in err or "boolean" in err)
            no_secret(out, err)
    assert not (tmp_path / "root" / "out.lmdb").exists()


def test_a_storage_option_without_an_equals_sign_is_not_echoed(tmp_path, capsys):
    """``KEY:VALUE`` or a bare secret: the one-line refusal does not repeat the argument."""
    from packer.cli import main

    imgs = tiny_photos(tmp_path / "imgs", classes=2, per_class=4)
    for bad in (f"aws_secret_access_key:{SECRET}", SECRET):
        assert main(["convert", str(imgs), "-o", "s3://bucket/x.lmdb", "--storage-option", bad, "-q"]) == 2
        err = capsys.readouterr().err
        assert "expected KEY=VALUE" in err and len(err.splitlines()) == 1
        no_secret(err)
