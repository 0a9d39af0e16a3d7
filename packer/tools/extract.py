"""``packer extract``: write a packed dataset's samples back as files under their relative paths.

Encoded payloads come back byte-identical to the source files. Raw payloads (decoded pixels)
are written as PNG, lossless for the stored pixels, with the extension changed to ``.png``.
The relative paths come from the dataset, which may be crafted, so every target is checked
to land inside the destination: no absolute paths, no ``..``, no symlink inside the
destination leading out of it. Existing files are never replaced unless ``overwrite``.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from packer.errors import PackerError
from packer.layout.trust import check_inner_name
from packer.read.dataset import open_dataset


@dataclass
class ExtractResult:
    output: Path
    num_files: int
    num_bytes: int
    as_png: bool  # raw payload: written as PNG, names end in .png


def target_name(rel: str, raw: bool) -> str:
    """The file name a sample is extracted to (raw payloads: the extension becomes ``.png``)."""
    return str(Path(rel).with_suffix(".png")) if raw else rel


def extract(path: str | os.PathLike, dest: str | os.PathLike, overwrite: bool = False,
            progress: bool = False) -> ExtractResult:
    """Write every sample of the dataset at ``path`` under ``dest``; refuse before writing if any target exists."""
    from tqdm import tqdm

    ds = open_dataset(path, image="numpy")
    raw = ds.manifest.payload == "raw"
    dest = Path(dest)
    names = [target_name(_checked(rel, path), raw) for rel in ds.index.rel_paths()]
    if len(set(names)) != len(names):
        seen: set[str] = set()
        dup = next(n for n in names if n in seen or seen.add(n))
        raise PackerError(f"{path}: two samples would both be written to {dup!r}")
    for c in ds.classes:
        if "/" in _checked(c, path):
            raise PackerError(f"{path}: class name {c!r} is not a single folder name")
    dest.mkdir(parents=True, exist_ok=True)
    real_dest = dest.resolve()
    targets = [_target(real_dest, dest, n) for n in names]
    if not overwrite:
        existing = [t for t in targets if os.path.lexists(t)]
        if existing:
            raise PackerError(f"{dest}: {len(existing)} of the files to extract exist already, e.g. {existing[0]} "
                              "(use --overwrite to replace them)")
    for c in ds.classes:  # class folders even when empty, so ImageFolder finds the same classes
        _target(real_dest, dest, c + "/x").parent.mkdir(parents=True, exist_ok=True)
    total = 0
    for i in tqdm(range(len(ds)), unit="img", desc="extracting", disable=not progress):
        if raw:
            buf = io.BytesIO()
            Image.fromarray(ds.pixels(i)).save(buf, format="PNG")
            data = buf.getvalue()
        else:
            data = bytes(ds.read_payload(i))
        target = _target(real_dest, dest, names[i])
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            _target(real_dest, dest, names[i])  # again, after creating folders: nothing on the way leads out
            _write(target, data, overwrite)
        except OSError as exc:
            raise PackerError(f"{target}: cannot write ({exc.strerror or exc})") from None
        total += len(data)
    ds.close()
    return ExtractResult(dest, len(ds), total, raw)


def _checked(name: str, where) -> str:
    check_inner_name(name, f"{where}: sample path")
    if name.startswith("/") or name in (".", "") or any(p in (".", "") for p in name.split("/")):
        raise PackerError(f"{where}: sample path {name!r} is not a plain relative path")
    return name


def _target(real_dest: Path, dest: Path, name: str) -> Path:
    """``dest/name``, refusing it when an existing folder or link on the way leads out of ``dest``."""
    target = dest / name
    real = target.resolve()  # follows symlinks that exist; the rest is taken literally
    if real_dest not in real.parents:
        raise PackerError(f"{target}: would be written outside {dest} (to {real}); refusing")
    return target


def _write(target: Path, data: bytes, overwrite: bool) -> None:
    """Write via a temporary file in the same folder: no partial file, never through a symlink."""
    tmp = target.with_name(f".{target.name}.packer-tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        if overwrite:
            os.replace(tmp, target)  # replaces a link itself, never what it points to
        else:
            try:
                os.link(tmp, target)  # fails if the target exists: nothing is replaced
            except FileExistsError:
                raise PackerError(f"{target}: exists already (use --overwrite to replace it)") from None
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
