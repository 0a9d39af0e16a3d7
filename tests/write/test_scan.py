import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.cli import run_cli
from support.imagesets import jpeg_bytes, make_bad_inputs, make_imagefolder

from packer import convert, open_dataset
from packer.errors import PackerError
from packer.tools.verify import verify
from packer.write.scan import scan_folder


def imagefolder_reference(root, allow_empty=False):
    """torchvision.datasets.folder's find_classes + make_dataset, restated (torchvision can't be installed here):
    every sub-folder is a class, hidden ones too; sorted(os.walk(followlinks=True)), then sorted file names,
    kept when path.lower().endswith(IMG_EXTENSIONS); a class without images raises unless allow_empty."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    out = []
    for idx, cls in enumerate(classes):
        for dirpath, _, files in sorted(os.walk(os.path.join(root, cls), followlinks=True)):
            for f in sorted(files):
                path = os.path.join(dirpath, f)
                if path.lower().endswith((".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")):
                    out.append((os.path.relpath(path, root).replace(os.sep, "/"), idx))
    empty = set(range(len(classes))) - {idx for _, idx in out}
    if empty and not allow_empty:
        raise FileNotFoundError(f"Found no valid file for the classes {', '.join(sorted(classes[i] for i in empty))}")
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


HIDDEN_TREE = {  # rel path -> packed with --skip-hidden
    ".ipynb_checkpoints/x-checkpoint.jpg": False,  # a hidden class: shifts every class index by one
    "cat/x.JPG": True, "cat/.hidden.jpg": False, "cat/a/z.jpg": True, "cat/a/b/c.jpg": True,
    "cat/a-2/y.jpeg": True, "cat/.thumbs/t.jpg": False, "dog/IMG_1.PNG": True, "dog/d.Tiff": True,
}
NOT_IMAGES = ["cat/notes.txt", "cat/.DS_Store", "dog/labels.csv", "LICENSE"]


def make_hidden_tree(root: Path, empty_class: bool = False) -> Path:
    rng = np.random.default_rng(0)
    for rel in [*HIDDEN_TREE, *NOT_IMAGES]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(jpeg_bytes(rng, 8, 8) if rel in HIDDEN_TREE else b"text")
    if empty_class:
        (root / "empty").mkdir()
        (root / "empty" / "readme.txt").write_text("nothing yet")
    return root


def test_default_is_imagefolder_exactly_hidden_folders_and_files_included(tmp_path):
    root = make_hidden_tree(tmp_path / "src")
    classes, ref = imagefolder_reference(root)
    assert classes == [".ipynb_checkpoints", "cat", "dog"]
    assert [p for p, _ in ref][1:5] == ["cat/.hidden.jpg", "cat/x.JPG", "cat/.thumbs/t.jpg", "cat/a/z.jpg"]
    assert ref.index(("cat/a/z.jpg", 1)) < ref.index(("cat/a/b/c.jpg", 1))  # os.walk order, not sorted full paths
    scan = scan_folder(root)
    assert scan.classes == classes and scan.class_to_idx == {c: i for i, c in enumerate(classes)}
    assert list(zip(scan.rel_paths, scan.labels.tolist())) == ref
    assert scan.ignored == {"not an image": 3, "outside class folders": 1}
    assert dict(scan.not_images) == {".txt": 1, "": 1, ".csv": 1}

    ds = open_dataset(convert(root, tmp_path / "o.lmdb", order="source", workers=0, progress=False).output)
    assert ds.classes == classes and ds.class_to_idx == scan.class_to_idx
    assert [(p, t) for p, t in zip(ds.index.rel_paths(), ds.targets)] == ref
    assert verify(ds.root, against=root).ok


def test_skip_hidden_leaves_out_exactly_the_hidden_names(tmp_path):
    root = make_hidden_tree(tmp_path / "src")
    _, ref = imagefolder_reference(root)
    scan = scan_folder(root, skip_hidden=True)
    assert scan.classes == ["cat", "dog"]
    assert scan.rel_paths == [p for p, _ in ref if HIDDEN_TREE[p]]  # the default's order, less the hidden names
    assert scan.labels.tolist() == [0, 0, 0, 0, 1, 1]
    assert scan.ignored == {"hidden": 2, "hidden folder": 2, "not an image": 2, "outside class folders": 1}

    out = tmp_path / "o.lmdb"
    res = run_cli("convert", root, "-o", out, "--skip-hidden", "--order", "source", "--workers", "0")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith(f"packed 6 of 11 files into {out}/ in ")  # 11: the hidden folders' files uncounted
    assert lines[1] == ("left out: 2 not images (.csv x1, .txt x1), 1 outside class folders, "
                        "2 hidden files and 2 hidden folders (--skip-hidden)")
    ds = open_dataset(out)
    assert ds.manifest.options["skip_hidden"] is True and ds.classes == ["cat", "dog"]
    assert list(ds.index.rel_paths()) == scan.rel_paths
    assert verify(out, against=root).ok  # re-scanned with the recorded --skip-hidden


def test_an_empty_class_is_refused_unless_allowed(tmp_path):
    root = make_hidden_tree(tmp_path / "src", empty_class=True)
    with pytest.raises(FileNotFoundError, match="empty"):
        imagefolder_reference(root)
    with pytest.raises(PackerError, match=r"no images in class folder\(s\) empty .*allow_empty=True"):
        scan_folder(root)
    res = run_cli("convert", root, "-o", tmp_path / "o.lmdb", "-q")
    assert res.returncode == 2 and "--allow-empty" in res.stderr and not (tmp_path / "o.lmdb").exists()

    classes, ref = imagefolder_reference(root, allow_empty=True)
    res = convert(root, tmp_path / "o.lmdb", allow_empty=True, order="source", workers=0, progress=False)
    ds = open_dataset(res.output)
    assert ds.classes == classes == [".ipynb_checkpoints", "cat", "dog", "empty"]
    assert list(zip(ds.index.rel_paths(), ds.targets)) == ref
    assert verify(res.output, against=root).ok


def test_datasets_from_before_the_scan_options_keep_opening_and_verifying(tmp_path):
    root = make_hidden_tree(tmp_path / "src", empty_class=True)
    res = convert(root, tmp_path / "o.lmdb", skip_hidden=True, allow_empty=True, workers=0, progress=False)
    manifest = json.loads((res.output / "manifest.json").read_text())
    for key in ("skip_hidden", "allow_empty"):  # as packer wrote it before: hidden names skipped, empty classes kept
        del manifest["options"][key]
    (res.output / "manifest.json").write_text(json.dumps(manifest))
    assert open_dataset(res.output).classes == ["cat", "dog", "empty"]
    assert verify(res.output, against=root).ok


def test_a_hidden_class_without_images_points_at_skip_hidden(tmp_path):
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=2)
    (src / ".git").mkdir()
    (src / ".git" / "HEAD").write_text("ref: refs/heads/main")
    with pytest.raises(PackerError, match=r"class folder\(s\) \.git .*skip_hidden=True"):
        scan_folder(src)
    assert scan_folder(src, skip_hidden=True).classes == ["class_0", "class_1"]


def test_quiet_prints_errors_only(tmp_path):
    make_bad_inputs(tmp_path / "src")
    res = run_cli("convert", tmp_path / "src", "-o", tmp_path / "o.lmdb", "-q", "--workers", "0")
    assert res.returncode == 1 and res.stdout == ""
    assert "not packed, see errors.json" in res.stderr and "weird/empty.jpg" in res.stderr


def test_flat_folder_has_no_labels(flatfolder):
    scan = scan_folder(flatfolder)
    assert scan.classes == [] and len(scan) == 6
    assert (scan.labels == -1).all()


def test_non_images_are_ignored_and_counted(tmp_path):
    expect = make_bad_inputs(tmp_path / "src")
    scan = scan_folder(tmp_path / "src")
    assert set(scan.rel_paths) == set(expect)  # broken links and unreadable files stay: convert reports them
    assert scan.ignored == {"not an image": 1} and scan.not_images == {".txt": 1}


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
    assert list(zip(scan.rel_paths, scan.labels.tolist())) == [  # self.jpg too: os.walk lists it, ImageFolder
        ("class_0/img_000.jpg", 0), ("class_0/img_001.jpg", 0), ("class_0/plain/flat.jpg", 0),  # numbers it
        ("class_0/sub/deep.jpg", 0), ("class_1/img_000.jpg", 1), ("class_1/img_001.jpg", 1),
        ("class_1/self.jpg", 1), ("class_1/alias/flat.jpg", 1)]
    reasons = {e.path: e.reason for e in scan.errors}
    assert set(reasons) == {"again/", "class_0/sub/up/", "class_0/sub/top/"}
    assert all("loop" in r for r in reasons.values()), reasons

    res = convert(src, tmp_path / "o.lmdb", workers=0, progress=False)  # goes on, and reports each loop
    assert res.num_samples == len(scan) - 1
    report = json.loads((res.output / "errors.json").read_text())
    assert {e["path"] for e in report["errors"]} == {*reasons, "class_1/self.jpg"}
    looped = next(e for e in report["errors"] if e["path"] == "class_1/self.jpg")
    assert "symbolic link loop" in looped["reason"] and looped["index"] == 6  # ImageFolder's index
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

    res = run_packer([], "convert", src, "-o", tmp_path / "again.lmdb")  # -q: errors only, no summary
    assert res.returncode == 0, res.stderr
    left_out = res.stdout.splitlines()[1]
    assert left_out.startswith("left out: 1 not an image (.json x1); not scanned: "), res.stdout  # names each one
    assert all(k.removeprefix("not scanned: ") in left_out for k in skipped), res.stdout
    report = json.loads((tmp_path / "again.lmdb" / "errors.json").read_text())
    assert skipped <= set(report["ignored"])
