"""torchvision's ImageFolder, re-implemented from its documented rules (torchvision cannot be installed
here, it needs a CUDA-matched torch): ``find_classes`` makes every subdirectory a class, sorted;
``make_dataset`` walks each class folder with ``sorted(os.walk(..., followlinks=True))``, takes the
files whose lower-cased name ends with an ``IMG_EXTENSIONS`` entry, sorted, as
``(os.path.join(walk_root, fname), class_index)``; ``default_loader`` opens a path as RGB PIL.
timm's ``ImageDataset.filename`` is re-implemented from timm 1.0's ``ReaderImageFolder._filename``.
"""

from __future__ import annotations

import os

from PIL import Image

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def find_classes(directory: str) -> tuple[list[str], dict[str, int]]:
    classes = sorted(entry.name for entry in os.scandir(directory) if entry.is_dir())
    return classes, {c: i for i, c in enumerate(classes)}


def make_dataset(directory: str, class_to_idx: dict[str, int]) -> list[tuple[str, int]]:
    out = []
    for target_class in sorted(class_to_idx):
        target_dir = os.path.join(directory, target_class)
        for root, _, fnames in sorted(os.walk(target_dir, followlinks=True)):
            for fname in sorted(fnames):
                path = os.path.join(root, fname)
                if path.lower().endswith(IMG_EXTENSIONS):
                    out.append((path, class_to_idx[target_class]))
    return out


def default_loader(path: str) -> Image.Image:
    with open(path, "rb") as f:
        return Image.open(f).convert("RGB")


class ImageFolder:
    """The parts of torchvision's ImageFolder the tests compare with (no transforms)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = os.fspath(root)
        self.classes, self.class_to_idx = find_classes(self.root)
        self.samples = make_dataset(self.root, self.class_to_idx)
        self.targets = [t for _, t in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Image.Image, int]:
        path, target = self.samples[i]
        return default_loader(path), target

    def timm_filename(self, index: int, basename: bool = False, absolute: bool = False) -> str:
        """timm 1.0 ``ReaderImageFolder._filename`` over these samples."""
        filename = self.samples[index][0]
        if basename:
            filename = os.path.basename(filename)
        elif not absolute:
            filename = os.path.relpath(filename, self.root)
        return filename
