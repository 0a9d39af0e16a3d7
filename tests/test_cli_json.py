"""``--json`` on info, convert, verify, extract and sample: one document on stdout with the shared envelope, the
exit code of the text output, failing runs included; every field named in docs/library.md."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from support.cli import REPO, run_cli
from support.imagesets import make_bad_inputs, make_imagefolder

ENVELOPE = {"command", "packer_version", "schema", "ok", "exit_code"}


def document(res, command: str, exit_code: int) -> dict:
    """The one JSON document on stdout (nothing else there), with the envelope; the exit code as given."""
    assert res.returncode == exit_code, res.stderr
    doc = json.loads(res.stdout)  # the whole of stdout: a progress line or a summary there would break it
    assert ENVELOPE <= set(doc) and doc["command"] == command and doc["schema"] == 1
    assert doc["exit_code"] == exit_code and doc["ok"] is (exit_code == 0)
    return doc


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("json")


@pytest.fixture(scope="module")
def sample_doc(work):
    return document(run_cli("sample", work / "imgs", "--count", "8", "--classes", "2", "--size", "24x32", "--json"),
                    "sample", 0)


@pytest.fixture(scope="module")
def convert_doc(work, sample_doc):
    return document(run_cli("convert", work / "imgs", "-o", work / "o.lmdb", "--workers", "0", "--json"), "convert", 0)


def test_sample(work, sample_doc):
    assert sample_doc["output"] == str(work / "imgs") and sample_doc["count"] == 8 and sample_doc["classes"] == 2
    assert sample_doc["num_bytes"] == sum(p.stat().st_size for p in (work / "imgs").rglob("*.jpg"))


def test_convert(work, convert_doc):
    (out,) = convert_doc["outputs"]
    assert out["output"] == str(work / "o.lmdb") and out["num_samples"] == 8 and out["errors"] == []
    assert out["num_errors"] == 0 and out["reused"] is False


def test_convert_with_unpackable_files_exits_1_and_lists_them(tmp_path):
    src = make_imagefolder(tmp_path / "bad", classes=2, per_class=2)
    expect = make_bad_inputs(src)
    res = run_cli("convert", src, "-o", tmp_path / "o.lmdb", "--workers", "0", "--json")
    (out,) = document(res, "convert", 1)["outputs"]
    left_out = sorted(p for p, packed in expect.items() if not packed)
    assert sorted(e["path"] for e in out["errors"]) == left_out and out["num_errors"] == len(left_out)
    assert all(e["reason"] for e in out["errors"]) and out["not_images"] == {".txt": 1}
    assert "files not packed" in res.stderr  # the notice stays on stderr


def test_convert_split_gives_both_outputs(work, sample_doc, tmp_path):
    res = run_cli("convert", work / "imgs", "-o", tmp_path / "pets", "--split", "0.5", "--workers", "0", "--json")
    outputs = document(res, "convert", 0)["outputs"]
    assert [o["output"] for o in outputs] == [str(tmp_path / "pets-train"), str(tmp_path / "pets-val")]
    assert sum(o["num_samples"] for o in outputs) == 8


def test_info(work, convert_doc):
    doc = document(run_cli("info", work / "o.lmdb", "--json"), "info", 0)
    assert doc["num_samples"] == 8 and doc["format"] == "lmdb" and doc["version"] == 1  # the manifest's own


def test_verify_and_verify_finding_damage(work, convert_doc, tmp_path):
    doc = document(run_cli("verify", work / "o.lmdb", "--against", work / "imgs", "--json"), "verify", 0)
    assert doc["problems"] == [] and doc["num_problems"] == 0 and doc["checked"]["samples"] == 8
    damaged = tmp_path / "d.lmdb"
    shutil.copytree(work / "o.lmdb", damaged)
    shard = damaged / "shard-00000.lmdb"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: the checksum finds it
    shard.write_bytes(bytes(data))
    doc = document(run_cli("verify", damaged, "--json"), "verify", 1)
    assert doc["num_problems"] == len(doc["problems"]) >= 1 and "shard-00000.lmdb" in doc["problems"][0]
    assert run_cli("verify", damaged, process=True).returncode == 1  # the text output's, from a real process


def test_extract(work, convert_doc, tmp_path):
    doc = document(run_cli("extract", work / "o.lmdb", tmp_path / "x", "--json"), "extract", 0)
    assert doc["output"] == str(tmp_path / "x") and doc["num_files"] == 8 and doc["as_png"] is False
    assert doc["num_bytes"] == sum(p.stat().st_size for p in (tmp_path / "x").rglob("*.jpg"))


@pytest.mark.parametrize("argv, command, code", [
    (["info", "{tmp}/nope", "--json"], "info", 2),
    (["verify", "{tmp}/nope", "--json"], "verify", 2),
    (["extract", "{tmp}/nope", "{tmp}/x", "--json"], "extract", 2),
    (["convert", "{tmp}/nope", "--json"], "convert", 2),
    (["convert", "{work}/imgs", "-o", "{work}/o.lmdb", "--json"], "convert", 2),  # exists: --overwrite
])
def test_a_failed_run_still_prints_its_document(argv, command, code, work, convert_doc, tmp_path):
    res = run_cli(*(a.format(tmp=tmp_path, work=work) for a in argv))
    doc = document(res, command, code)
    assert set(doc) == ENVELOPE | {"error"} and res.stderr.strip() == f"packer: error: {doc['error']}"
    if "o.lmdb" in argv[-2]:
        assert "--overwrite" in doc["error"]  # the command line's words, as on stderr


def test_damaged_dataset_under_way_exits_1_in_json_too(work, convert_doc, tmp_path):
    damaged = tmp_path / "d.lmdb"
    shutil.copytree(work / "o.lmdb", damaged)
    (damaged / "manifest.json").write_text("{ not json")
    doc = document(run_cli("extract", damaged, tmp_path / "x", "--json"), "extract", 1)
    assert "manifest.json" in doc["error"]


def test_every_field_is_documented(work, sample_doc, convert_doc, tmp_path):
    """Each key the commands print is named (in backquotes) in docs/library.md's JSON section."""
    text = (REPO / "docs" / "library.md").read_text()
    section = text[text.index("## JSON output"):text.index("## Installing")]
    named = set(re.findall(r"`([a-z_]+)`", section))
    info = json.loads(run_cli("info", work / "o.lmdb", "--json").stdout)
    verify = json.loads(run_cli("verify", work / "o.lmdb", "--json").stdout)
    extract = json.loads(run_cli("extract", work / "o.lmdb", tmp_path / "x", "--json").stdout)
    keys = set(sample_doc) | set(convert_doc) | set(convert_doc["outputs"][0]) | set(info) | set(info["stats"]) \
        | set(verify) | set(extract) | {"error"}
    assert keys - named == set()
