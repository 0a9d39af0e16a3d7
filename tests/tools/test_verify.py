"""``packer verify --against``: errors.json and the manifest's options are read as untrusted input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.storage_servers import served_as_a_user

from packer import PackerError, convert, open_dataset
from packer.cli import main
from packer.tools.verify import verify

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def base(imagefolder, tmp_path_factory):
    return convert(imagefolder, tmp_path_factory.mktemp("verify") / "ds.lmdb", workers=0, progress=False).output


@pytest.fixture
def ds(base, tmp_path):
    shutil.copytree(base, tmp_path / "ds")
    return tmp_path / "ds"


def edit_options(ds: Path, **changes) -> None:
    data = json.loads((ds / "manifest.json").read_text())
    data["options"].update(changes)
    (ds / "manifest.json").write_text(json.dumps(data))


def test_errors_json_fifo_is_refused_not_waited_on(ds, imagefolder):
    (ds / "errors.json").unlink()
    os.mkfifo(ds / "errors.json")
    code = "import sys; from packer.cli import main; sys.exit(main(sys.argv[1:]))"
    res = subprocess.run([sys.executable, "-c", code, "verify", str(ds), "--against", str(imagefolder), "-q"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)  # a hang fails here
    assert res.returncode == 1 and "errors.json: not a regular file" in res.stdout, res.stdout + res.stderr


def test_errors_json_symlink_out_of_the_dataset_is_not_followed(ds, imagefolder, tmp_path):
    outside = tmp_path / "elsewhere.json"
    shutil.copy(ds / "errors.json", outside)
    (ds / "errors.json").unlink()
    os.symlink(outside, ds / "errors.json")
    report = verify(ds, against=imagefolder)
    assert any("errors.json" in p and "outside the dataset" in p for p in report.problems), report.problems


@pytest.mark.parametrize("junk", [b"\xff\xfe not utf-8", b"[1, 2]", b'{"errors": [{"path": ["a"]}]}',
                                  b'{"errors": [{"path": 5}]}', b'{"errors": "abc"}'])
def test_malformed_errors_json_is_a_problem(ds, imagefolder, junk):
    (ds / "errors.json").write_bytes(junk)
    report = verify(ds, against=imagefolder)
    assert len(report.problems) == 1 and "errors.json: not a packer error report" in report.problems[0]


@pytest.mark.parametrize("changes, match", [
    ({"bogus": 1}, "unknown conversion option"),
    ({"resize": "0x0"}, "sizes must be at least 1"),
    ({"validate": "most"}, "unknown validation level"),
    ({"codec": "jpeg"}, "codec is an option of to='mosaic' only"),  # named as the manifest records them
])
def test_edited_options_are_a_problem_not_a_traceback(ds, imagefolder, capsys, changes, match):
    edit_options(ds, **changes)
    assert main(["verify", str(ds), "--against", str(imagefolder), "-q"]) == 1
    out = capsys.readouterr().out
    assert "manifest.json: the recorded conversion options are not valid" in out and match in out, out


@pytest.mark.parametrize("changes", [{"quality": "abc"}, {"quality": 0}, {"seed": -1}, {"upscale": "yes"},
                                     {"shard_bytes": "1GB"}, {"compression": ["lzf"]}, {"seed": True}])
def test_option_values_of_the_wrong_type_or_range_are_refused_when_opening(ds, changes):
    edit_options(ds, **changes)
    with pytest.raises(PackerError, match=f"manifest.*(option |\\(){next(iter(changes))}"):
        open_dataset(ds)


def test_jpeg_mosaic_with_an_edited_quality(imagefolder, tmp_path):
    out = convert(imagefolder, tmp_path / "m.mosaic", to="mosaic", tile="16x16", grid="2x2", codec="jpeg",
                  quality=90, workers=0, progress=False).output
    assert verify(out, against=imagefolder).ok
    edit_options(out, quality="abc")
    report = verify(out, against=imagefolder)
    assert not report.ok and "quality='abc': expected an integer from 1 to 100" in report.problems[0]  # as recorded


def test_missing_against_folder_is_refused_before_any_work(ds, tmp_path, capsys):
    shard = next(ds.glob("*.lmdb"))
    shard.write_bytes(bytes(shard.stat().st_size))  # checksum mismatch: never reached, nothing to compare with
    with pytest.raises(PackerError, match="no such folder"):
        verify(ds, against=tmp_path / "nope")
    assert main(["verify", str(ds), "--against", str(tmp_path / "nope"), "-q"]) == 2
    assert "packer: error:" in capsys.readouterr().err


def test_every_recorded_option_has_a_checked_type():
    from dataclasses import fields

    from packer.layout.manifest import OPTION_TYPES
    from packer.write.options import ConvertOptions

    assert {f.name for f in fields(ConvertOptions)} - {"decoder", "extra"} == set(OPTION_TYPES)


def test_verify_of_a_url_streams_every_object_through_sha256_and_keeps_nothing(base, tmp_path, monkeypatch, capsys):
    server = served_as_a_user(base, tmp_path / "root", monkeypatch, "ds.lmdb")
    cache = tmp_path / "cache"
    try:
        assert main(["verify", "s3://bucket/ds.lmdb", "--cache-dir", str(cache), "-q"]) == 0
        files = len(json.loads((base / "manifest.json").read_text())["meta_files"]) + 2  # + the shard's two files
        assert capsys.readouterr().out.strip() == f"ok: s3://bucket/ds.lmdb ({files} files, 15 samples)"
        shard = json.loads((base / "manifest.json").read_text())["shards"][0]["files"][0]["name"]
        damaged = bytearray((base / shard).read_bytes())
        damaged[5000] ^= 1
        server.write(f"ds.lmdb/{shard}", bytes(damaged))  # same size: only the sha256 can tell
        assert main(["verify", "s3://bucket/ds.lmdb", "--cache-dir", str(cache), "-q", "--json"]) == 1
        report = json.loads(capsys.readouterr().out)
        assert report["problems"] == [f"s3://bucket/ds.lmdb/{shard}: checksum mismatch (damaged or modified)"]
        kept = [p for p in (cache / "packer-cache-v1").rglob("*") if p.is_file() and "datasets" not in p.parts
                and p.suffix not in (".sock", ".lock", ".log") and p.name not in ("locks", "usage")]
        assert kept == []  # the shards were hashed as they came, not kept
    finally:
        server.stop()


@pytest.fixture
def served(base, tmp_path, monkeypatch):
    """The dataset at s3://bucket/ds.lmdb on an emulated store, credentials and endpoint in AWS_* as a user's."""
    server = served_as_a_user(base, tmp_path / "root", monkeypatch, "ds.lmdb")
    yield tmp_path / "root" / "ds.lmdb"
    server.stop()


def test_verify_deep_of_a_url_decodes_what_its_checksums_cannot_judge(served, imagefolder, tmp_path, capsys):
    url, cache = "s3://bucket/ds.lmdb", str(tmp_path / "cache")
    assert main(["verify", url, "--deep", "--cache-dir", cache, "-q", "--json"]) == 0
    checked = json.loads(capsys.readouterr().out)["checked"]
    assert checked["decoded"] == checked["samples"] == 15
    assert main(["verify", url, "--against", str(imagefolder), "--cache-dir", cache, "-q"]) == 0
    assert capsys.readouterr().out.startswith(f"ok: {url} (")
    from support.fuzzing import put_sample_value

    local = open_dataset(served)
    data = bytes(local.read_payload(7))
    local.close()
    put_sample_value(served, 7, data[: len(data) // 2] + bytes(len(data) - len(data) // 2))  # checksums agree
    assert main(["verify", url, "--cache-dir", cache, "-q"]) == 0  # every object as its manifest says
    capsys.readouterr()
    assert main(["verify", url, "--deep", "--cache-dir", cache, "-q", "--json"]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert len(problems) == 1 and "sample 7" in problems[0]
    assert main(["verify", url, "--against", str(imagefolder), "--cache-dir", cache, "-q", "--json"]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert len(problems) == 1 and problems[0].endswith(": stored bytes differ from the source file")
