import json
import os

from support.cli import run_cli
from support.imagesets import make_imagefolder

from packer import convert, open_dataset


def test_info_prints_manifest_and_sample_statistics(imagefolder, tmp_path):
    out = convert(imagefolder, tmp_path / "i.lmdb", workers=0, progress=False).output
    res = run_cli("info", out, "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    ds = open_dataset(out)
    assert data["num_samples"] == len(ds) and data["classes"] == ds.classes
    assert data["stats"]["samples_per_class"] == {"min": 5, "median": 5.0, "max": 5}
    assert data["stats"]["height"] == {"min": int(ds.index.heights.min()), "max": int(ds.index.heights.max())}
    assert data["total_bytes"] == sum(p.stat().st_size for p in out.rglob("*")
                                      if p.is_file() and p.name not in ("manifest.json", "errors.json"))
    text = run_cli("info", out).stdout
    assert "per class" in text and "5 to 5 samples" in text and "lmdb" in text
    assert run_cli("info", tmp_path / "missing").returncode == 2


def _rows(out) -> dict[str, str]:
    res = run_cli("info", out)
    assert res.returncode == 0, res.stderr
    return {line[:12].strip(): line[12:].strip() for line in res.stdout.splitlines()}


def test_info_lists_classes_sizes_and_shards_people_can_read(tmp_path):
    src = make_imagefolder(tmp_path / "src", classes=25, per_class=2)
    lmdb = convert(src, tmp_path / "i.lmdb", workers=0, progress=False, shard_bytes=64 << 20).output
    rows = _rows(lmdb)
    names = [f"class_{i}" for i in range(25)]  # make_imagefolder's names, sorted as strings
    shown = sorted(names)
    assert rows["classes"] == f"25: {', '.join(shown[:5])}, ..., {', '.join(shown[-5:])}"
    assert rows["options"].startswith("validate=full, shard_bytes=64 MiB,")
    assert rows["order"] == "shuffled (seed 0): neighbours on disk are unrelated"
    assert rows["scan"] == "ImageFolder's: hidden folders and files kept"
    assert rows["shards"].startswith("1 shard (") and rows["shards"].endswith(" in all")

    few = make_imagefolder(tmp_path / "few", classes=3, per_class=4)
    bmp = convert(few, tmp_path / "i.bmp", to="bmp", order="source", skip_hidden=True, workers=0,
                  progress=False).output
    rows = _rows(bmp)
    assert rows["classes"] == "3: class_0, class_1, class_2"
    assert rows["shards"].startswith("12 files, one per sample, in 1 shard, 8 metadata files; ")
    assert rows["order"] == "ImageFolder's (source) order" and rows["scan"] == "hidden names skipped"
    mosaic = convert(few, tmp_path / "i.mosaic", to="mosaic", tile="16x16", grid="2x3", workers=0,
                     progress=False).output
    assert _rows(mosaic)["shards"].startswith("2 mosaics of up to 2x3 tiles of 16x16 in 1 shard, ")


def test_info_names_a_shard_truncated_in_place_and_exits_1(imagefolder, tmp_path):
    """A stat per file against the manifest (no hashing): a shard cut short is shown as a problem, exit 1 (a dataset
    failing its checks), in the table and in --json; the rest of the information is still shown."""
    out = convert(imagefolder, tmp_path / "i.lmdb", workers=0, progress=False, shard_bytes=6_000).output
    shard = out / json.loads((out / "manifest.json").read_text())["shards"][-1]["files"][0]["name"]
    size = shard.stat().st_size
    os.truncate(shard, size // 3)
    res = run_cli("info", out)
    assert res.returncode == 1, res.stdout + res.stderr
    problems = [line for line in res.stdout.splitlines() if line.startswith("problem")]
    assert problems == [f"problem     {shard}: {size // 3} bytes, manifest says {size} (damaged or replaced)"]
    assert "samples" in res.stdout and "packer verify" in res.stdout
    res = run_cli("info", out, "--json")
    assert res.returncode == 1 and json.loads(res.stdout)["problems"] == [problems[0][12:]]
    shard.unlink()
    assert f"{shard}: missing" in run_cli("info", out).stdout


def _served(tmp_path, dataset, monkeypatch):
    """``dataset`` in the emulated store as s3://bucket/<name>, the environment set as a user's would be."""
    from support.storage_servers import served_as_a_user

    return served_as_a_user(dataset, tmp_path / "root", monkeypatch)


def test_info_of_a_url_shows_the_rows_of_the_local_dataset(imagefolder, tmp_path, monkeypatch, capsys):
    from packer.cli import main

    few = make_imagefolder(tmp_path / "few", classes=3, per_class=4)
    for out in (convert(imagefolder, tmp_path / "i.lmdb", workers=0, progress=False).output,
                convert(few, tmp_path / "i.mosaic", to="mosaic", tile="16x16", grid="2x3", workers=0,
                        progress=False).output):
        server = _served(tmp_path / out.name, out, monkeypatch)
        url = f"s3://bucket/{out.name}"
        try:
            shown = {}
            for where in (str(out), url):
                assert main(["info", where, "--cache-dir", str(tmp_path / "cache")]) == 0
                text = capsys.readouterr().out.replace(str(out), "WHERE").replace(url, "WHERE")
                assert main(["info", where, "--json", "--cache-dir", str(tmp_path / "cache")]) == 0
                shown[where] = (text, json.loads(capsys.readouterr().out))
            assert shown[url] == shown[str(out)]  # the same rows, the same --json
            assert "look at     WHERE/mosaic-" in shown[url][0] or out.suffix != ".mosaic"
            name = shown[url][1]["shards"][0]["files"][0]["name"]
            server.write(f"{out.name}/{name}", b"cut")  # a shard cut short in the bucket: shown, exit 1
            assert main(["info", url, "--cache-dir", str(tmp_path / "cache")]) == 1
            assert f"problem     {url}/{name}: 3 bytes, manifest says" in capsys.readouterr().out
            assert main(["info", "s3://bucket/nothing", "--cache-dir", str(tmp_path / "cache")]) == 2
            assert capsys.readouterr().err.strip() == ("packer: error: s3://bucket/nothing: no packer dataset there "
                                                        "(manifest.json is missing: not a dataset, or an upload that "
                                                        "did not finish)")
        finally:
            server.stop()


def test_storage_options_on_the_command_line_reach_the_store_and_a_path_refuses_them(tmp_path, monkeypatch, capsys):
    """info, verify, extract and profile take --storage-option as bench and doctor do: without AWS_* set, the
    endpoint and keys given on the command line are the ones used; with a local path they are refused."""
    from packer.cli import main

    out = convert(make_imagefolder(tmp_path / "few", classes=2, per_class=3), tmp_path / "d.lmdb", workers=0,
                  progress=False).output
    server = _served(tmp_path, out, monkeypatch)
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    given = [f"--storage-option=endpoint={server.server.endpoint}", "--storage-option", "aws_access_key_id=k",
             "--storage-option", "aws_secret_access_key=s3cret", "--cache-dir", str(tmp_path / "cache")]
    try:
        assert main(["info", "s3://bucket/d.lmdb", "--json", *given]) == 0
        assert json.loads(capsys.readouterr().out)["num_samples"] == 6
        assert main(["verify", "s3://bucket/d.lmdb", "--deep", "-q", *given]) == 0
        assert main(["extract", "s3://bucket/d.lmdb", str(tmp_path / "x"), "-q", *given]) == 0
        assert "s3cret" not in capsys.readouterr().out
    finally:
        server.stop()
    assert len([p for p in (tmp_path / "x").rglob("*") if p.is_file()]) == 6
    for argv in (["info", str(out)], ["verify", str(out), "-q"], ["extract", str(out), str(tmp_path / "y")],
                 ["profile", str(out), "-q"]):
        assert main([*argv, "--storage-option", "region=x"]) == 2
        assert capsys.readouterr().err.strip() == ("packer: error: --storage-option is for a dataset at a URL (s3://, "
                                                   "gs://, az://, http(s)://)")
