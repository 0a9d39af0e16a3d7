import os

import pytest
from support.imagesets import make_bad_inputs

from packer.errors import PackerError
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
