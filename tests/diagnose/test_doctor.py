"""packer doctor: bounded probes on tiny data, the JSON's structure, and verdicts that name their figures."""

from __future__ import annotations

import copy
import json

import pytest
from support._tiny import make_lmdb

from packer.cli import main
from packer.diagnose.doctor import diagnose, render
from packer.diagnose.doctor_rules import judge
from packer.diagnose.system import fs_kind


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("doctor")
    return make_lmdb(root, count=20), root / "imgs"


def test_fs_kind():
    assert fs_kind("ext4") == "local" and fs_kind("xfs") == "local"
    assert fs_kind("nfs4") == "network" and fs_kind("cifs") == "network"
    assert fs_kind("lustre") == "parallel" and fs_kind("overlay") == "overlay" and fs_kind("tmpfs") == "memory"
    assert fs_kind(None) == "unknown"


def test_doctor_on_a_loose_folder(data):
    _, folder = data
    r = diagnose(folder, seconds=0.1, progress=False)
    assert r["data"]["kind"] == "loose image files" and r["data"]["samples"] == 20
    st = r["storage"]
    assert st["fstype"] and st["kind"] == fs_kind(st["fstype"])
    assert st["small_file_read"]["files"] == 20 and st["small_file_read"]["files_per_s"] > 0
    assert st["sequential_read"]["MB_per_s"] > 0  # scratch file written beside the data, then removed
    assert not [p for p in folder.iterdir() if p.name.startswith(".packer")]
    assert "pil" in r["decode"]["per_core"] and r["decode"]["per_core"]["pil"]["img_per_s"] > 0
    assert r["machine"]["cores_usable"] >= 1 and r["machine"]["open_files_limit"]["soft"] > 0
    assert r["gpu"]["available"] in (True, False)
    assert r["verdict"] and all(f["text"] and isinstance(f["figures"], dict) for f in r["verdict"])
    assert any("num_workers=" in f["text"] for f in r["verdict"])
    text = render(r)
    assert "verdict" in text and "cold small-file reads" in text
    json.dumps(r)  # JSON-ready


def test_doctor_on_a_packed_dataset_via_cli(data, capsys):
    lmdb_path, folder = data
    assert main(["doctor", str(lmdb_path), "--json", "--seconds", "0.1"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["data"]["kind"].startswith("packed dataset (lmdb") and r["data"]["samples"] == 20
    assert "samples of" in r["decode"]["samples"]  # decoders timed on the user's own images


def _report(small_fps: float, seq_mbps: float, per_core: float, fstype: str = "nfs4", cores: int = 8) -> dict:
    return {
        "machine": {"cores_usable": cores, "cores": cores, "load_average": [0.1, 0.1, 0.1],
                    "memory": {"MemAvailable": 8 << 30, "MemTotal": 16 << 30},
                    "shm": {"free": 64 << 20, "size": 64 << 20}, "open_files_limit": {"soft": 1024, "hard": 4096}},
        "gpu": {"available": False, "torch": "2.x", "cuda_build": None, "devices": []},
        "decode": {"libturbojpeg": True, "libturbojpeg_error": None,
                   "per_core": {"pil": {"img_per_s": per_core * 0.75}, "turbojpeg": {"img_per_s": per_core}}},
        "data": {"kind": "loose image files", "samples": 100000, "bytes": 100000 * 110_000,
                 "mean_sample_bytes": 110_000},
        "storage": {"fstype": fstype, "kind": fs_kind(fstype), "device": None, "rotational": None,
                    "small_file_read": {"files_per_s": small_fps, "eviction_verified": True},
                    "sequential_read": {"MB_per_s": seq_mbps}},
    }


def test_verdict_io_bound_names_its_figures():
    text = "\n".join(f["text"] for f in judge(_report(small_fps=180, seq_mbps=400, per_core=240)))
    assert "IO-bound" in text and "180 files/s" in text and "1,920 img/s" in text  # 240 x 8 cores
    assert "pack it" in text and "10.7x" in text  # min(400e6/110e3, 1920) / 180
    assert "nfs4" in text and "network" in text
    assert "num_workers=7" in text
    assert "/dev/shm has 67.1 MB free" in text and "open-files limit is 1024" in text
    assert "does not fit in RAM" in text


def test_verdict_decode_bound():
    r = _report(small_fps=9000, seq_mbps=3000, per_core=500, fstype="ext4", cores=2)
    text = "\n".join(f["text"] for f in judge(r))
    assert "decode-bound" in text and "9,000 files/s" in text and "1,000 img/s" in text
    assert "IO-bound on loose files" not in text
    r2 = copy.deepcopy(r)
    r2["storage"]["rotational"], r2["storage"]["device"] = True, "sda"
    assert "no spinning disk does" in "\n".join(f["text"] for f in judge(r2))
