"""Tiny image sets the tests generate for themselves (real JPEG/PNG encoder output)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
from PIL import Image

from packer.tools.sample import photo_like


def jpeg_bytes(rng: np.random.Generator, h: int, w: int, quality: int = 90, **kw) -> bytes:
    buf = io.BytesIO()
    photo_like(rng, h, w, int(rng.integers(0, 10))).save(buf, format="JPEG", quality=quality, **kw)
    return buf.getvalue()


def make_imagefolder(root: Path, classes: int = 3, per_class: int = 5, seed: int = 0, size=(24, 32)) -> Path:
    """root/class_k/img_i.jpg with slightly varying sizes; returns root."""
    rng = np.random.default_rng(seed)
    for c in range(classes):
        folder = root / f"class_{c}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            h, w = size[0] + int(rng.integers(0, 8)), size[1] + int(rng.integers(0, 8))
            (folder / f"img_{i:03d}.jpg").write_bytes(jpeg_bytes(rng, h, w))
    return root


def tiny_photos(root: Path, classes: int = 3, per_class: int = 20, seed: int = 1) -> Path:
    """An ImageFolder of tiny JPEGs (8-12 x 8+class pixels): many objects, little data, for object-storage tests."""
    rng = np.random.default_rng(seed)
    for c in range(classes):
        for i in range(per_class):
            path = root / f"c{c}" / f"{i:03d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(jpeg_bytes(rng, 8 + i % 5, 8 + c))
    return root


def make_flat(root: Path, count: int = 6, seed: int = 1) -> Path:
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (root / f"p{i}.jpg").write_bytes(jpeg_bytes(rng, 20, 28))
    return root


def make_bad_inputs(root: Path) -> dict[str, bool]:
    """One class folder full of awkward files; returns rel path -> should it be packed."""
    rng = np.random.default_rng(7)
    d = root / "weird"
    d.mkdir(parents=True, exist_ok=True)
    good = jpeg_bytes(rng, 30, 40)
    expect: dict[str, bool] = {}

    def put(name: str, data: bytes, packed: bool) -> None:
        (d / name).write_bytes(data)
        expect[f"weird/{name}"] = packed

    put("ok.jpg", good, True)
    put("empty.jpg", b"", False)
    put("truncated.jpg", good[: len(good) * 85 // 100], False)
    put("random.jpg", rng.bytes(3000), False)
    img = photo_like(rng, 30, 40)
    for name, mode, fmt in (("png_named.JPEG", "RGB", "PNG"), ("cmyk.jpg", "CMYK", "JPEG"), ("gray.jpg", "L", "JPEG"),
                            ("rgba.png", "RGBA", "PNG"), ("palette.png", "P", "PNG"), ("gray16.png", "I;16", "PNG")):
        buf = io.BytesIO()
        if mode == "I;16":
            Image.fromarray(np.asarray(img.convert("L")).astype(np.uint16) * 257).save(buf, format=fmt)
        else:
            img.convert(mode).save(buf, format=fmt)
        put(name, buf.getvalue(), True)
    put("ünïcødé_猫.jpg", good, True)
    put("progressive.jpg", jpeg_bytes(rng, 30, 40, progressive=True), True)
    os.symlink(d / "does-not-exist.jpg", d / "broken_link.jpg")
    expect["weird/broken_link.jpg"] = False
    # Unreadable even for root: reading /proc/self/mem at offset 0 fails with EIO.
    os.symlink("/proc/self/mem", d / "unreadable.jpg")
    expect["weird/unreadable.jpg"] = False
    if os.geteuid() != 0:  # permissions only bind non-root users
        put("no_permission.jpg", good, False)
        os.chmod(d / "no_permission.jpg", 0)
    (d / "notes.txt").write_text("not an image")
    put(".hidden.jpg", good, True)  # a hidden image is a sample, as in ImageFolder
    return expect
