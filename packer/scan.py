"""Find the images of a loose folder with torchvision ImageFolder semantics.

Classes are the sorted names of the top-level folders; images are found recursively below
them and sorted, so the result is deterministic. A folder with no sub-folders is "flat":
no classes, every label is -1. Only ``os.scandir`` is used: no per-file ``stat``.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from packer.errors import PackerError

# torchvision.datasets.folder.IMG_EXTENSIONS
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@dataclass
class ScanResult:
    """The images of one source folder, in ImageFolder order."""

    root: Path
    classes: list[str]
    rel_paths: list[str]  # POSIX-style, relative to root
    labels: np.ndarray  # int64, -1 for a flat folder
    ignored: Counter = field(default_factory=Counter)  # reason -> count

    def __len__(self) -> int:
        return len(self.rel_paths)

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.classes)}


def is_image_name(name: str) -> bool:
    return name.lower().endswith(IMG_EXTENSIONS)


def _walk(top: str, rel_top: str, out: list[str], ignored: Counter) -> None:
    """Append image paths below ``top`` to ``out``, relative to the scanned root.

    Order is torchvision's ``sorted(os.walk(...))``: folders sorted by their full path, and
    within a folder its files sorted by name.
    """
    groups: list[tuple[str, list[str]]] = []
    stack = [(top, rel_top)]
    while stack:
        path, rel = stack.pop()
        try:
            entries = list(os.scandir(path))
        except OSError as exc:
            ignored[f"unreadable folder ({exc.strerror})"] += 1
            continue
        files = []
        for entry in entries:
            name = entry.name
            if name.startswith("."):
                ignored["hidden"] += 1
            elif entry.is_dir():  # follows symlinks, like os.walk(followlinks=True); uses d_type
                stack.append((entry.path, f"{rel}{name}/"))
            elif is_image_name(name):
                files.append(name)  # broken or unreadable files stay: convert reports them
            else:
                ignored["not an image"] += 1
        groups.append((path, [rel + f for f in sorted(files)]))
    for _, files in sorted(groups, key=lambda g: g[0]):
        out.extend(files)


def scan_folder(root: str | os.PathLike) -> ScanResult:
    """Scan ``root`` (``root/<class>/**/<img>`` or a flat folder of images)."""
    root = Path(root)
    if not root.exists():
        raise PackerError(f"{root}: no such folder")
    if not root.is_dir():
        raise PackerError(f"{root}: not a folder (give the folder that holds the images)")
    ignored: Counter = Counter()
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError as exc:
        raise PackerError(f"{root}: cannot list folder ({exc.strerror})") from exc
    class_dirs = [e for e in entries if not e.name.startswith(".") and e.is_dir()]
    rel_paths: list[str] = []
    if class_dirs:
        classes = [e.name for e in class_dirs]
        labels: list[int] = []
        for idx, entry in enumerate(class_dirs):
            before = len(rel_paths)
            _walk(entry.path, entry.name + "/", rel_paths, ignored)
            labels.extend([idx] * (len(rel_paths) - before))
        for e in entries:
            if e.name.startswith("."):
                ignored["hidden"] += 1
            elif not e.is_dir():
                ignored["outside class folders"] += 1
        label_array = np.asarray(labels, dtype=np.int64)
    else:
        classes = []
        _walk(str(root), "", rel_paths, ignored)
        label_array = np.full(len(rel_paths), -1, dtype=np.int64)
    if not rel_paths:
        what = ", ".join(f"{n} {r}" for r, n in sorted(ignored.items())) or "nothing"
        raise PackerError(
            f"{root}: no images found (looked for {', '.join(IMG_EXTENSIONS)}; ignored: {what})"
        )
    return ScanResult(root=root, classes=classes, rel_paths=rel_paths, labels=label_array, ignored=ignored)
