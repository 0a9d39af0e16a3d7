"""Generate an ImageFolder of photo-like JPEGs, so demos and benchmarks need no download.

Flat colours or white noise would make decoding and file sizes unrealistic: flat images
compress to a few KB, noise to several hundred. These images mix smooth gradients, shapes
with soft edges, textures at several scales and a little sensor-like grain, which lands near
ImageNet's figures: about 500x375 pixels and about 100 KB at JPEG quality 90.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from packer.errors import OptionError, OutputExistsError, RunError, arg, under_way
from packer.layout.fsutil import destination_dir
from packer.progress import bar


def _noise_field(rng: np.random.Generator, h: int, w: int, cells: int) -> np.ndarray:
    """Smooth random field in [-1, 1]: a coarse random grid upsampled bicubically."""
    gh, gw = max(2, cells * h // max(h, w)), max(2, cells * w // max(h, w))
    grid = rng.uniform(-1, 1, (gh, gw)).astype(np.float32)
    return np.asarray(Image.fromarray(grid, mode="F").resize((w, h), Image.Resampling.BICUBIC))


def photo_like(rng: np.random.Generator, height: int, width: int, class_id: int = 0) -> Image.Image:
    """One RGB image with the statistics of a casual photograph (roughly)."""
    base = np.array([(class_id * 47) % 255, (class_id * 91 + 60) % 255, (class_id * 23 + 120) % 255], np.float32)
    c1 = np.clip(base + rng.normal(0, 40, 3), 0, 255)
    c2 = np.clip(255 - base + rng.normal(0, 40, 3), 0, 255)
    t = np.linspace(0, 1, height, dtype=np.float32)[:, None, None]
    img = c1 * (1 - t) + c2 * t  # sky-to-ground gradient
    img = np.broadcast_to(img, (height, width, 3)).copy()
    for cells, amp in ((4, 40), (16, 22), (64, 12)):  # textures at several scales
        img += amp * np.stack([_noise_field(rng, height, width, cells) for _ in range(3)], axis=-1)
    canvas = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(canvas)
    for _ in range(int(rng.integers(4, 10))):  # objects
        x0, y0 = rng.integers(0, width), rng.integers(0, height)
        x1 = x0 + rng.integers(max(1, width // 25), max(2, width // 2))
        y1 = y0 + rng.integers(max(1, height // 20), max(2, height // 2))
        color = tuple(int(v) for v in np.clip(base + rng.normal(0, 70, 3), 0, 255))
        if rng.random() < 0.5:
            draw.ellipse([int(x0), int(y0), int(x1), int(y1)], fill=color)
        else:
            corners = int(rng.integers(3, 7))
            pts = [(int(rng.integers(x0, x1 + 1)), int(rng.integers(y0, y1 + 1))) for _ in range(corners)]
            draw.polygon(pts, fill=color)
    canvas = canvas.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(0.6, 1.4))))
    arr = np.asarray(canvas).astype(np.float32)
    arr += 35 * np.stack([_noise_field(rng, height, width, 160) for _ in range(3)], axis=-1)  # fine detail
    arr += 30 * _noise_field(rng, height, width, 320)[..., None]  # finest luminance texture
    arr += rng.normal(0, 8.0, arr.shape).astype(np.float32)  # grain
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def _write_one(args: tuple[str, int, int, int, int, int]) -> int:
    path, seed, class_id, height, width, quality = args
    rng = np.random.default_rng(seed)
    try:
        photo_like(rng, height, width, class_id).save(path, format="JPEG", quality=quality)
        return os.path.getsize(path)
    except OSError as exc:
        raise RunError(f"{path}: cannot write ({exc.strerror or exc}); the images before it were written") from None


MAX_SIDE = 4096  # largest --size side: a generated image is built in float32 arrays (~200 MB at 4096x4096)
MAX_COUNT = 10_000_000


def check_sample_options(count: int, classes: int, size: tuple[int, ...], seed: int, quality: int,
                         workers: int | None) -> None:
    """Refuse values ``make_sample`` can't honour, with a message naming the option (``packer sample``'s flags)."""
    def whole(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not whole(count) or not 1 <= count <= MAX_COUNT:
        raise OptionError(f"{arg('count', count)}: expected an integer from 1 to {MAX_COUNT}")
    if not whole(classes) or not 0 <= classes <= MAX_COUNT:
        raise OptionError(f"{arg('classes', classes)}: expected an integer from 0 (a flat folder) to {MAX_COUNT}")
    if len(size) != 2 or not all(whole(v) and 1 <= v <= MAX_SIDE for v in size):
        raise OptionError(f"{arg('size', size)}: expected height and width from 1 to {MAX_SIDE}")
    if not whole(seed) or seed < 0:
        raise OptionError(f"{arg('seed', seed)}: expected a non-negative integer")
    if not whole(quality) or not 1 <= quality <= 100:
        raise OptionError(f"{arg('quality', quality)}: expected an integer from 1 to 100")
    if workers is not None and (not whole(workers) or workers < 1):
        raise OptionError(f"workers {workers!r}: expected a positive integer (or None: all cores)")


def make_sample(
    out: str | os.PathLike,
    count: int = 2000,
    classes: int = 10,
    size: tuple[int, int] = (375, 500),
    seed: int = 0,
    quality: int = 90,
    workers: int | None = None,
    progress: bool | None = None,
) -> int:
    """Write ``count`` JPEGs into ``out/class_XX/img_XXXXXX.jpg``; returns bytes written.

    ``size`` is (height, width); each image varies it by up to 10 % so shapes are mixed,
    as in real datasets. Deterministic for a given ``seed``. Bad values, a non-empty or
    unwritable ``out`` are refused (PackerError) before anything is written; a write failing
    part-way (disk full) raises RunError naming the file.
    """
    check_sample_options(count, classes, tuple(size), seed, quality, workers)
    out = Path(out)
    if out.is_dir() and any(out.iterdir()):
        raise OutputExistsError(f"{out}: exists and is not empty")
    destination_dir(out, "sample folder")
    rng = np.random.default_rng(seed)
    jobs = []
    for i in range(count):
        cls = i % classes if classes else 0
        folder = out / f"class_{cls:02d}" if classes else out
        h = max(1, int(size[0] * rng.uniform(0.9, 1.1)))
        w = max(1, int(size[1] * rng.uniform(0.9, 1.1)))
        jobs.append((str(folder / f"img_{i:06d}.jpg"), seed * 1_000_003 + i, cls, h, w, quality))
    total = 0
    with under_way():
        for cls in range(min(classes, count)):
            _mkdir(out / f"class_{cls:02d}")
        with ProcessPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
            for n in bar(pool.map(_write_one, jobs, chunksize=8), total=count, desc="generating", progress=progress):
                total += n
    return total


def _mkdir(folder: Path) -> None:
    try:
        folder.mkdir(exist_ok=True)
    except OSError as exc:
        raise RunError(f"{folder}: cannot create folder ({exc.strerror or exc})") from None
