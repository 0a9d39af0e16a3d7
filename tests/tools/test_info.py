import json

from support.cli import run_cli

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
