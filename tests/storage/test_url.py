"""Locations (packer/storage/url.py): parsing, joining, redaction; and every entry point refusing a URL until its
scheme is supported end to end (one line naming the command, never a local folder named ``s3:``)."""

from __future__ import annotations

import os

import pytest
from support.imagesets import make_imagefolder
from support.storage_servers import CREDENTIALS

from packer.cli import main
from packer.errors import InputNotFoundError, PackerError
from packer.storage.url import Location, is_url, parse, redact, redact_text, refuse_url

SECRET = "SECRETVALUE123"
SIGNED = [
    f"https://bucket.s3.amazonaws.com/k.lmdb?X-Amz-Algorithm=AWS4&X-Amz-Credential={SECRET}&X-Amz-Signature={SECRET}",
    f"https://acct.blob.core.windows.net/c/x?sv=2022-11-02&se=2030&sp=r&sig={SECRET}",
    f"https://storage.googleapis.com/b/o?X-Goog-Signature={SECRET}&X-Goog-Date=1",
    f"https://user:{SECRET}@host:8080/a/b",
    f"https://{SECRET}@host/a",
    f"http://host/x?token={SECRET}&part=1",
]


def test_paths_and_urls_are_told_apart():
    assert is_url("s3://b/k") and is_url("gs://b") and is_url("weird+scheme://x")
    assert not is_url("s3:") and not is_url("s3:/b") and not is_url("rel/x") and not is_url("/abs")
    from pathlib import Path

    assert not is_url(Path("s3://b"))  # a Path collapses '//' and is a local path by construction


def test_parsing_gives_scheme_bucket_and_key():
    loc = parse("s3://bucket/a/b.lmdb")
    assert (loc.scheme, loc.bucket, loc.key, loc.name) == ("s3", "bucket", "a/b.lmdb", "b.lmdb")
    assert parse("gs://b").key == "" and parse("az://container/x").bucket == "container"
    http = parse("http://127.0.0.1:9000/b/k%20x?versionId=3")
    assert (http.bucket, http.key, http.query) == ("127.0.0.1:9000", "b/k x", "versionId=3")
    assert http.url == "http://127.0.0.1:9000/b/k%20x?versionId=3"
    local = parse("file:///tmp/ds")
    assert local.is_local and str(local.path) == "/tmp/ds"
    assert parse("rel/ds").path == parse(os.path.abspath("rel/ds")).path


@pytest.mark.parametrize("bad", ["ftp://host/x", "s3://", "file://otherhost/x", "s3://b/k?sig=1",
                                 "s3://user:pw@b/k", "https://h/x#frag"])
def test_bad_urls_are_one_clear_error(bad):
    with pytest.raises(PackerError) as err:
        parse(bad)
    assert "\n" not in str(err.value) and "pw" not in str(err.value)


def test_join_stays_inside():
    root = parse("s3://b/data/ds.lmdb")
    assert root.join("meta/labels.npy").url == "s3://b/data/ds.lmdb/meta/labels.npy"
    assert root.join("a", "b/c").key == "data/ds.lmdb/a/b/c"
    for bad in ("../x", "/etc/passwd", "a/../../x", "a\\b"):
        with pytest.raises(PackerError):
            root.join(bad)
    signed = parse(SIGNED[0])
    assert signed.join("x").query == ""  # a signature is for one object


@pytest.mark.parametrize("url", SIGNED)
def test_secrets_never_appear_in_str_repr_or_messages(url):
    loc = parse(url)
    for shown in (str(loc), repr(loc), redact(url), redact_text(f"GET {url}: 403 Forbidden"), f"{loc}", str([loc])):
        assert SECRET not in shown, shown
        assert "REDACTED" in shown
    assert SECRET in loc.url  # the client still gets the real URL
    with pytest.raises(PackerError) as err:
        refuse_url(url, "packer info")
    assert SECRET not in str(err.value)


def test_redaction_keeps_what_is_not_secret():
    assert redact("s3://b/k") == "s3://b/k"
    assert redact("http://h/x?part=1&X-Amz-Date=2") == "http://h/x?part=1&X-Amz-Date=2"
    assert redact_text("failed (https://h/x?sig=abc).") == "failed (https://h/x?sig=REDACTED)."
    assert Location("", "", "/tmp/x").url == "/tmp/x"


# ---- entry points: a URL is refused with one line, nothing is written locally ----

URL = "s3://bucket/x.lmdb"
MESSAGE = "object storage is not supported yet by {by}: " + URL


@pytest.fixture
def imgs(tmp_path):
    return make_imagefolder(tmp_path / "imgs", classes=2, per_class=2)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    assert not (tmp_path / "s3:").exists(), "a URL was taken as a local path"


@pytest.mark.parametrize("argv,by", [
    (["verify", "{ds}", "--against", URL], "packer verify --against"),
    (["extract", "{ds}", URL], "packer extract's destination (a local folder)"),
])
def test_every_command_refuses_a_url_in_one_line(argv, by, imgs, in_tmp, capsys):
    ds = in_tmp / "d.lmdb"
    if any("{ds}" in a for a in argv):
        assert main(["convert", str(imgs), "--to", "lmdb", "-o", str(ds), "-q", "--workers", "0"]) == 0
    capsys.readouterr()
    assert main([a.format(imgs=imgs, ds=ds) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "packer: error: " + MESSAGE.format(by=by)
    assert not (in_tmp / "outdir").exists()


def test_a_wds_export_to_a_url_is_written_there_not_refused(imgs, in_tmp, fresh_store, capsys):
    """``convert --to wds -o URL`` was refused like the entries above; it now exports into the bucket (the index
    last: tests/write/test_remote_output.py), and nothing is written locally."""
    options = [f"--storage-option={k}={v}" for k, v in
               {**CREDENTIALS, "endpoint": fresh_store.server.endpoint}.items()]
    argv = ["convert", str(imgs), "--to", "wds", "-o", "s3://bucket/x-wds", "--workers", "0", *options,
            "--staging-dir", str(in_tmp / "staging")]
    assert main(argv) == 0
    assert capsys.readouterr().out.startswith("packed 4 of 4 files into s3://bucket/x-wds in ")
    bucket = in_tmp / "root" / "x-wds"
    assert {p.name for p in bucket.iterdir()} == {"classes.txt", "errors.json", "packer-wds.json",
                                                  *(f"shard-{i:06d}.tar" for i in range(4))}
    assert not [p for p in (in_tmp / "staging").rglob("*") if p.is_file()]


def test_a_split_to_a_url_writes_both_parts_there_not_refused(imgs, in_tmp, fresh_store, capsys):
    """``convert -o URL --split`` was refused like the entries above; it now writes ``URL-train`` and ``URL-val``
    into the bucket (tests/write/test_remote_output.py compares them with a local split), nothing locally."""
    options = [f"--storage-option={k}={v}" for k, v in
               {**CREDENTIALS, "endpoint": fresh_store.server.endpoint}.items()]
    argv = ["convert", str(imgs), "--to", "lmdb", "-o", "s3://bucket/x.lmdb", "--split", "0.5", "--workers", "0",
            *options, "--staging-dir", str(in_tmp / "staging")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "packed 2 of 2 files into s3://bucket/x.lmdb-train in " in out
    assert "packed 2 of 2 files into s3://bucket/x.lmdb-val in " in out
    assert {p.name for p in (in_tmp / "root").iterdir() if not p.name.startswith(".")} == {"x.lmdb-train",
                                                                                             "x.lmdb-val"}
    assert all((in_tmp / "root" / part / "manifest.json").is_file() for part in ("x.lmdb-train", "x.lmdb-val"))


def test_the_python_entry_points_refuse_a_url(imgs, in_tmp):
    from packer import LMDBDataset, open_dataset
    from packer.tools.extract import extract
    from packer.tools.info import dataset_info
    from packer.tools.verify import verify

    calls = {
        "LMDBDataset (use open_dataset for a URL)": lambda: LMDBDataset(URL),
        "packer verify --against": lambda: verify("ds", against=URL),
        "packer extract's destination (a local folder)": lambda: extract("ds", URL),
    }
    for by, call in calls.items():
        with pytest.raises(PackerError) as err:
            call()
        assert str(err.value) == MESSAGE.format(by=by)
    with pytest.raises(InputNotFoundError, match=f"^{in_tmp}/nothing"):  # file://: a local path (a URL: test_read)
        open_dataset(f"file://{in_tmp}/nothing")
    with pytest.raises(PackerError, match="not supported yet by packer info: file:///tmp/x"):
        dataset_info("file:///tmp/x")  # a URL naming a local path: info reads object storage, and folders


def test_a_url_where_a_path_goes_is_shown_as_the_url():
    from packer.storage.url import UrlPath

    root = UrlPath(str(parse("s3://bucket/train")))
    assert str(root) == f"{root}" == "s3://bucket/train" and str(root / "a" / "x.jpg") == "s3://bucket/train/a/x.jpg"
    assert str(UrlPath("https://host:8080/d/list.txt").parent) == "https://host:8080/d"
