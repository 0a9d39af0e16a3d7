"""Find the images of a loose folder with torchvision ImageFolder semantics.

Classes are the sorted names of the top-level folders; images are found recursively below
them and sorted, so the result is deterministic. A folder with no sub-folders is "flat":
no classes, every label is -1. Only ``os.scandir`` is used: no per-file ``stat``.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterable
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


def walk_class(path: str, rel: str) -> tuple[list[str], dict[str, int]]:
    """The sorted image paths below one class folder (relative to the root) and what was ignored there."""
    out: list[str] = []
    ignored: Counter = Counter()
    _walk(path, rel, out, ignored)
    return out, dict(ignored)


def _walk_locally(folders: list[tuple[str, str]]) -> Iterable[tuple[list[str], dict[str, int]]]:
    return (walk_class(path, rel) for path, rel in folders)


ClassMapper = Callable[[list[tuple[str, str]]], Iterable[tuple[list[str], dict[str, int]]]]


def scan_folder(root: str | os.PathLike, map_classes: ClassMapper | None = None) -> ScanResult:
    """Scan ``root`` (``root/<class>/**/<img>`` or a flat folder of images).

    ``map_classes`` walks the class folders (``(path, rel_prefix)`` pairs) and yields
    ``walk_class``'s result for each, in order: packer.write.cluster spreads it over a cluster.
    """
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
        walked = (map_classes or _walk_locally)([(entry.path, entry.name + "/") for entry in class_dirs])
        for idx, (files, skipped) in enumerate(walked):
            rel_paths.extend(files)
            labels.extend([idx] * len(files))
            ignored.update(skipped)
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
