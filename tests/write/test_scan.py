import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.imagesets import make_bad_inputs, make_imagefolder

from packer import convert
from packer.errors import PackerError
from packer.tools.verify import verify
from packer.write.scan import scan_folder


def imagefolder_reference(root):
    """torchvision.datasets.folder.make_dataset, restated: sorted(os.walk) then sorted files."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    out = []
    for idx, cls in enumerate(classes):
        for dirpath, _, files in sorted(os.walk(os.path.join(root, cls), followlinks=True)):
            for f in sorted(files):
                if f.lower().endswith((".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")):
                    out.append((os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/"), idx))
    return classes, out


def test_classes_and_order_match_imagefolder(tmp_path):
    root = tmp_path / "src"
    for rel in ["b/x.jpg", "b/sub/y.jpg", "b/sub-2/z.png", "b/sub/deeper/w.jpg", "b/a.JPEG", "a/1.jpg", "c/k.webp"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x")
    scan = scan_folder(root)
    classes, ref = imagefolder_reference(root)
    assert scan.classes == classes == ["a", "b", "c"]
    assert list(zip(scan.rel_paths, scan.labels.tolist())) == ref


def test_flat_folder_has_no_labels(flatfolder):
    scan = scan_folder(flatfolder)
    assert scan.classes == [] and len(scan) == 6
    assert (scan.labels == -1).all()


def test_hidden_and_non_images_are_ignored_and_counted(tmp_path):
    expect = make_bad_inputs(tmp_path / "src")
    scan = scan_folder(tmp_path / "src")
    assert set(scan.rel_paths) == set(expect)  # broken links and unreadable files stay: convert reports them
    assert scan.ignored["hidden"] == 1 and scan.ignored["not an image"] == 1


def test_empty_and_missing_sources_are_clear_errors(tmp_path):
    with pytest.raises(PackerError, match="no such folder"):
        scan_folder(tmp_path / "nope")
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    (tmp_path / "empty" / "cls" / "readme.txt").write_text("x")
    with pytest.raises(PackerError, match="no images found.*1 not an image"):
        scan_folder(tmp_path / "empty")


# ---------------------------------------------------------------- what the scan can't or mustn't follow

REPO = Path(__file__).resolve().parents[1]


def run_packer(prefix: list[str], *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([*prefix, sys.executable, "-m", "packer", *map(str, args)], capture_output=True,
                          text=True, env=env)


def without_read_override(tmp_path: Path) -> list[str]:
    """A command prefix under which folder modes bind, even for root (CAP_DAC_* dropped); skips if impossible."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("needs setpriv to drop CAP_DAC_OVERRIDE (root reads any folder)")
    prefix = [setpriv, "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search", "--"]
    probe = tmp_path / "probe"
    probe.mkdir(mode=0)
    try:
        r = subprocess.run([*prefix, "ls", str(probe)], capture_output=True, text=True)
    finally:
        probe.rmdir()
    if r.returncode == 0 or "Permission denied" not in r.stderr:
        pytest.skip(f"cannot drop CAP_DAC_OVERRIDE here ({r.stderr.strip() or 'the folder stayed readable'})")
    return prefix


def test_unreadable_folders_are_reported_and_fail_convert_and_verify(tmp_path):
    prefix = without_read_override(tmp_path)
    src = make_imagefolder(tmp_path / "src", classes=3, per_class=4)
    (src / "class_0" / "sub").mkdir()
    shutil.copy(src / "class_0" / "img_000.jpg", src / "class_0" / "sub" / "deep.jpg")
    locked = [src / "class_1", src / "class_0" / "sub"]  # a whole class, and a folder inside one
    for folder in locked:
        folder.chmod(0)
    try:
        out = tmp_path / "out.lmdb"
        res = run_packer(prefix, "convert", src, "-o", out, "--workers", "0", "-q")
        assert res.returncode == 1, res.stdout + res.stderr  # not everything was packed
        reasons = {e["path"]: e["reason"] for e in json.loads((out / "errors.json").read_text())["errors"]}
        assert set(reasons) == {"class_1/", "class_0/sub/"}
        assert all("cannot list folder" in r and "Permission denied" in r for r in reasons.values())
        assert "class_1/" in res.stderr and "class_0/sub/" in res.stderr
        check = run_packer(prefix, "verify", out, "--against", src, "-q")
        assert check.returncode == 1 and "class_1" in check.stdout and "class_0/sub" in check.stdout, check.stdout
    finally:
        for folder in locked:
            folder.chmod(0o755)


def test_link_loops_are_reported_and_not_followed(tmp_path):
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=2)
    (src / "class_0" / "sub").mkdir()
    (src / "class_0" / "plain").mkdir()
    shutil.copy(src / "class_0" / "img_000.jpg", src / "class_0" / "sub" / "deep.jpg")
    shutil.copy(src / "class_0" / "img_001.jpg", src / "class_0" / "plain" / "flat.jpg")
    os.symlink("..", src / "class_0" / "sub" / "up")  # back to the class folder
    os.symlink("../..", src / "class_0" / "sub" / "top")  # back to the root
    os.symlink(".", src / "again")  # a class folder that is the root itself
    os.symlink("self.jpg", src / "class_1" / "self.jpg")  # a file link to itself: ELOOP
    os.symlink("../class_0/plain", src / "class_1" / "alias")  # no loop: followed, as ImageFolder does
    scan = scan_folder(src)
    assert scan.classes == ["class_0", "class_1"]
    assert list(zip(scan.rel_paths, scan.labels.tolist())) == [
        ("class_0/img_000.jpg", 0), ("class_0/img_001.jpg", 0), ("class_0/plain/flat.jpg", 0),
        ("class_0/sub/deep.jpg", 0), ("class_1/img_000.jpg", 1), ("class_1/img_001.jpg", 1),
        ("class_1/alias/flat.jpg", 1)]
    reasons = {e.path: e.reason for e in scan.errors}
    assert set(reasons) == {"again/", "class_0/sub/up/", "class_0/sub/top/", "class_1/self.jpg"}
    assert all("loop" in r for r in reasons.values()), reasons

    res = convert(src, tmp_path / "o.lmdb", workers=0, progress=False)  # goes on, and reports each loop
    assert res.num_samples == len(scan)
    report = json.loads((res.output / "errors.json").read_text())
    assert {e["path"] for e in report["errors"]} == set(reasons)
    assert verify(res.output, against=src).ok  # reported loops are no problem for verify


def test_packer_outputs_inside_the_source_are_not_scanned(tmp_path):
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=3)
    before = scan_folder(src)
    convert(src, tmp_path / "out.bmp", to="bmp", workers=0, progress=False)
    shutil.copytree(tmp_path / "out.bmp", src / "out.bmp")  # would be a class of its own
    shutil.copytree(tmp_path / "out.bmp", src / "class_0" / "old.bmp")  # inside a class
    (src / "class_1" / "x.lmdb.partial").mkdir()  # an unfinished conversion
    shutil.copy(src / "class_1" / "img_000.jpg", src / "class_1" / "x.lmdb.partial" / "a.jpg")
    album = src / "class_1" / "album"  # some other manifest.json: an ordinary folder
    album.mkdir()
    (album / "manifest.json").write_text('{"kind": "photo album"}')
    shutil.copy(src / "class_1" / "img_000.jpg", album / "a.jpg")

    scan = scan_folder(src)
    assert scan.classes == before.classes
    assert [p for p in scan.rel_paths if p != "class_1/album/a.jpg"] == before.rel_paths
    assert "class_1/album/a.jpg" in scan.rel_paths
    skipped = {"not scanned: out.bmp/ (packer dataset)", "not scanned: class_0/old.bmp/ (packer dataset)",
               "not scanned: class_1/x.lmdb.partial/ (unfinished packer output)"}
    assert {k for k in scan.ignored if k.startswith("not scanned")} == skipped
    with pytest.raises(PackerError, match="a packed dataset, not a folder of images"):
        scan_folder(src / "out.bmp")

    res = run_packer([], "convert", src, "-o", tmp_path / "again.lmdb", "-q")
    assert res.returncode == 0, res.stderr
    assert all(k in res.stdout for k in skipped), res.stdout  # the terminal summary names each one
    report = json.loads((tmp_path / "again.lmdb" / "errors.json").read_text())
    assert skipped <= set(report["ignored"])
