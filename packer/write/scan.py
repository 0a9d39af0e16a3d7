"""Find the images of a loose folder with torchvision ImageFolder semantics.

Exactly torchvision's ``find_classes``/``make_dataset`` by default: classes are the sorted names
of every top-level folder, hidden ones (``.ipynb_checkpoints``) included; images are the files
with an ``IMG_EXTENSIONS`` name (any case), hidden ones included, in ``sorted(os.walk)`` order;
a class with no image is refused unless ``allow_empty``. ``skip_hidden`` leaves out every name
starting with "." (counted in ``ignored``). A folder with no sub-folders is "flat" (where
ImageFolder refuses): no classes, every label is -1. Files are found with ``os.scandir`` alone (no per-file
``stat``); each folder is stat'ed once, to notice links that loop back to a folder above.
Nothing is lost silently: a folder that can't be listed, a link loop or a name that can't be
stat'ed becomes a ``SourceError``; packer outputs (datasets, unfinished ``.partial`` folders)
inside the source are left out and counted in ``ignored`` by name.
"""

from __future__ import annotations

import errno
import os
import posixpath
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from packer.errors import InputNotFoundError, PackerError, arg
from packer.layout.manifest import MANIFEST_NAME, holds_dataset
from packer.layout.partial import PARTIAL_SUFFIX
from packer.write.sources.records import ClassMapper, ScanResult, SourceError, Walk

# torchvision.datasets.folder.IMG_EXTENSIONS
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
NOT_SCANNED = "not scanned"  # ignored[f"not scanned: {folder}/ (why)"]: a packer output inside the source
HIDDEN, HIDDEN_FOLDER, NOT_IMAGE = "hidden", "hidden folder", "not an image"  # reasons in ``ignored``
OUTSIDE_CLASSES = "outside class folders"


def imagefolder_key(rel: str) -> tuple[str, str]:
    """Sort key of a POSIX path in ImageFolder order (torchvision sorts os.walk's folders by path, then
    each folder's file names): the order archive members are given in, like a folder's files."""
    return posixpath.dirname(rel), posixpath.basename(rel)


def is_image_name(name: str) -> bool:
    """torchvision's ``has_file_allowed_extension(name, IMG_EXTENSIONS)``: the suffix, in any case."""
    return name.lower().endswith(IMG_EXTENSIONS)


def _suffix(name: str) -> str:
    """The extension a "not an image" file is counted under: ".txt", or "" for none (".bashrc" has none)."""
    return os.path.splitext(name)[1].lower()


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _stat_failure(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return f"symbolic link loop ({exc.strerror})"
    return f"cannot stat ({exc.strerror or exc})"


def _subfolder(entry: os.DirEntry, rel: str, above: frozenset, found: Walk) -> tuple[int, int] | None:
    """The (st_dev, st_ino) of folder ``entry`` (at ``rel``) when it is to be walked, else None.

    Left out, with the reason recorded in ``found``: a link back to a folder above it (``above``:
    their identities; os.walk would go round until the path is too long) and packer outputs
    (a dataset, an unfinished ``.partial`` folder), which are never source images.
    """
    try:
        key = _identity(entry.stat())
    except OSError as exc:
        found.errors.append(SourceError(rel, _stat_failure(exc), record=False))
        return None
    if key in above:
        found.errors.append(SourceError(rel, "leads back to a folder above it (a link loop): not followed",
                                        record=False))
        return None
    if entry.name.endswith(PARTIAL_SUFFIX):
        found.ignored[f"{NOT_SCANNED}: {rel} (unfinished packer output)"] += 1
        return None
    if holds_dataset(entry.path):
        found.ignored[f"{NOT_SCANNED}: {rel} (packer dataset)"] += 1
        return None
    return key


def _unlisted(found: Walk, rel: str, exc: OSError) -> None:
    rel = rel or "./"
    found.errors.append(SourceError(rel, f"cannot list folder ({exc.strerror or exc}): "
                                         "the images in it are neither packed nor counted", record=False))
    found.unlisted.append(rel)


def _walk(top: str, rel_top: str, found: Walk, above: frozenset = frozenset(), skip_hidden: bool = False) -> None:
    """Add the image paths below ``top`` (relative to the scanned root) and what was left out to ``found``.

    Order is torchvision's ``sorted(os.walk(top, followlinks=True))``: folders sorted by their
    full path (``a/z.jpg`` before ``a/b/c.jpg``), and within a folder its files sorted by name.
    """
    try:
        top_key = _identity(os.stat(top))
    except OSError as exc:
        _unlisted(found, rel_top, exc)
        return
    groups: list[tuple[str, list[str]]] = []
    stack = [(top, rel_top, above | {top_key})]
    while stack:
        path, rel, inner = stack.pop()  # inner: this folder and those above it
        try:
            entries = list(os.scandir(path))
        except OSError as exc:
            _unlisted(found, rel, exc)
            continue
        files = []
        for entry in entries:
            name = entry.name
            try:
                is_dir = entry.is_dir()  # follows symlinks, like os.walk(followlinks=True); uses d_type
            except OSError as exc:  # a link loop (a.jpg -> a.jpg), a link into a folder we may not search
                if is_image_name(name) and not (skip_hidden and name.startswith(".")):
                    files.append(name)  # os.walk lists it as a file, so ImageFolder numbers it: reading it fails
                else:  # no image name: ImageFolder never lists it; named, not counted as a file
                    found.errors.append(SourceError(rel + name, _stat_failure(exc), record=False))
                continue
            if skip_hidden and name.startswith("."):
                found.ignored[HIDDEN_FOLDER if is_dir else HIDDEN] += 1
            elif is_dir:
                key = _subfolder(entry, f"{rel}{name}/", inner, found)
                if key is not None:
                    stack.append((entry.path, f"{rel}{name}/", inner | {key}))
            elif is_image_name(name):
                files.append(name)  # broken or unreadable files stay: convert reports them
            else:
                found.ignored[NOT_IMAGE] += 1
                found.not_images[_suffix(name)] += 1
        groups.append((path, [rel + f for f in sorted(files)]))
    for _, files in sorted(groups, key=lambda g: g[0]):
        found.files.extend(files)


def walk_class(path: str, rel: str, skip_hidden: bool = False) -> Walk:
    """The sorted image paths below one class folder (relative to the root) and what was left out there."""
    found = Walk()
    try:  # the root, above the class folder: a link back to it is a loop too
        above = frozenset({_identity(os.stat(os.path.dirname(path) or "."))})
    except OSError:
        above = frozenset()
    _walk(path, rel, found, above, skip_hidden)
    return found




def scan_folder(root: str | os.PathLike, map_classes: ClassMapper | None = None, *, skip_hidden: bool = False,
                allow_empty: bool = False) -> ScanResult:
    """Scan ``root`` (``root/<class>/**/<img>`` or a flat folder of images) by torchvision's rules.

    ``map_classes`` walks the class folders (``(path, rel_prefix)`` pairs) and yields
    ``walk_class``'s result for each, in order: packer.write.cluster spreads it over a cluster
    (it is given ``skip_hidden`` too). ``skip_hidden``: leave out names starting with ".";
    ``allow_empty``: keep a class folder without images (ImageFolder's ``allow_empty``).
    """
    root = Path(root)
    if not root.exists():
        raise InputNotFoundError(f"{root}: no such folder")
    if not root.is_dir():
        raise InputNotFoundError(f"{root}: not a folder (give the folder that holds the images)")
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
        above = frozenset({_identity(os.stat(root))})
    except OSError as exc:
        raise PackerError(f"{root}: cannot list folder ({exc.strerror})") from exc
    if any(e.name == MANIFEST_NAME for e in entries) and holds_dataset(root):
        raise PackerError(f"{root}: a packed dataset, not a folder of images (give the folder it was converted from)")
    found = Walk()
    class_dirs, others = [], 0
    for e in entries:
        try:
            is_dir = e.is_dir()
        except OSError as exc:  # no class folder, and a file here is outside the classes: no record
            found.errors.append(SourceError(e.name, _stat_failure(exc), record=False))
            continue
        if skip_hidden and e.name.startswith("."):
            found.ignored[HIDDEN_FOLDER if is_dir else HIDDEN] += 1
        elif is_dir:
            if _subfolder(e, e.name + "/", above, found) is not None:
                class_dirs.append(e)
        else:
            others += 1
    labels: list[int] = []
    if class_dirs:
        classes = [e.name for e in class_dirs]
        folders = [(entry.path, entry.name + "/") for entry in class_dirs]
        walked = map_classes(folders) if map_classes else (walk_class(p, r, skip_hidden) for p, r in folders)
        empty = []
        for idx, walk in enumerate(walked):
            labels.extend([idx] * len(walk.files))
            if not walk.files and folders[idx][1] not in walk.unlisted:  # unlisted: an error already
                empty.append(classes[idx])
            found.add(walk)
        if others:
            found.ignored[OUTSIDE_CLASSES] += others
        if empty and found.files and not allow_empty:
            raise PackerError(_empty_classes(root, empty, skip_hidden))
    else:  # flat: walked afresh, the root included (what was found above would count twice)
        classes, found = [], Walk()
        _walk(str(root), "", found, skip_hidden=skip_hidden)
        labels = [-1] * len(found.files)
    if not found.files:
        raise PackerError(_no_images(root, found))
    return ScanResult(root=root, classes=classes, rel_paths=found.files, labels=np.asarray(labels, dtype=np.int64),
                      ignored=found.ignored, errors=found.errors, unlisted=found.unlisted, not_images=found.not_images)


def scan_names(root: Path, names: Iterable[str], *, skip_hidden: bool = False,
               allow_empty: bool = False) -> ScanResult:
    """``scan_folder``'s result for the files named by ``names`` (POSIX paths relative to ``root``, e.g. the keys
    below an object-storage prefix, where a folder is a name's prefix): the same classes, order, extension filter,
    hidden-name and packer-output rules and errors as the folder holding exactly those files."""
    found = Walk()
    left_out: set[str] = set()  # folders counted once in ``ignored`` (hidden, packer outputs)
    holding = {n.rpartition("/")[0] for n in names if n.rpartition("/")[2] == MANIFEST_NAME}
    if "" in holding:
        raise PackerError(f"{root}: holds {MANIFEST_NAME}, a packed dataset, not a folder of images (give the folder "
                          "it was converted from)")
    kept: list[list[str]] = []  # the path components of each file not left out by a folder above it
    for name in names:
        parts = name.split("/")
        for depth in range(1, len(parts)):
            folder, last = "/".join(parts[:depth]), parts[depth - 1]
            if skip_hidden and last.startswith("."):
                reason = HIDDEN_FOLDER
            elif last.endswith(PARTIAL_SUFFIX):
                reason = f"{NOT_SCANNED}: {folder}/ (unfinished packer output)"
            elif folder in holding:
                reason = f"{NOT_SCANNED}: {folder}/ (packer dataset)"
            else:
                continue
            if folder not in left_out:
                left_out.add(folder)
                found.ignored[reason] += 1
            break
        else:
            kept.append(parts)
    classes = sorted({parts[0] for parts in kept if len(parts) > 1})
    index = {c: i for i, c in enumerate(classes)}
    per_class: list[list[str]] = [[] for _ in classes] if classes else [[]]
    for parts in kept:
        file = parts[-1]
        if skip_hidden and file.startswith("."):
            found.ignored[HIDDEN] += 1
        elif classes and len(parts) == 1:
            found.ignored[OUTSIDE_CLASSES] += 1
        elif is_image_name(file):
            per_class[index[parts[0]] if classes else 0].append("/".join(parts))
        else:
            found.ignored[NOT_IMAGE] += 1
            found.not_images[_suffix(file)] += 1
    labels: list[int] = []
    for idx, files in enumerate(per_class):
        found.files.extend(sorted(files, key=imagefolder_key))
        labels.extend([idx if classes else -1] * len(files))
    empty = [c for c, files in zip(classes, per_class) if not files]
    if empty and found.files and not allow_empty:
        raise PackerError(_empty_classes(root, empty, skip_hidden))
    if not found.files:
        raise PackerError(_no_images(root, found))
    return ScanResult(root=root, classes=classes, rel_paths=found.files, labels=np.asarray(labels, dtype=np.int64),
                      ignored=found.ignored, not_images=found.not_images)


def _no_images(root: Path, found: Walk) -> str:
    what = describe_ignored(dict(sorted(found.ignored.items()))) or "nothing"
    errors = "".join(f"; {e.path}: {e.reason}" for e in found.errors[:3])
    return f"{root}: no images found (looked for {', '.join(IMG_EXTENSIONS)}; ignored: {what}{errors})"


def _empty_classes(root: Path, empty: list[str], skip_hidden: bool) -> str:
    """The error for class folders without images: ImageFolder refuses them too (``allow_empty=False``)."""
    names = ", ".join(empty[:5]) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
    hint = ""
    if not skip_hidden and any(c.startswith(".") for c in empty):
        hint = f"; hidden folders are classes, as in ImageFolder: {arg('skip_hidden', True)} leaves them out"
    return (f"{root}: no images in class folder(s) {names} (looked for {', '.join(IMG_EXTENSIONS)}); ImageFolder "
            f"refuses empty classes too: give {arg('allow_empty', True)} to keep them as classes "
            f"without samples{hint}")


def describe_ignored(ignored: dict[str, int]) -> str:
    """``ignored`` in words: "3 hidden, 1 not an image, not scanned: out.lmdb/ (packer dataset)"."""
    return ", ".join(r if r.startswith(NOT_SCANNED) else f"{n} {r}" for r, n in ignored.items())
