"""``packer extract``: write a packed dataset's samples back as files under their relative paths.

Encoded payloads come back byte-identical to the source files (a ``--jpeg-restarts`` dataset: the rewritten
JPEGs, the same pixels). Raw payloads (decoded pixels) are written as PNG, lossless for the stored pixels,
with the extension changed to ``.png``
(``a.jpg`` -> ``a.png``); where two samples would then share a name (the source had ``a.jpg``
and ``a.png``), each renamed one keeps its whole name instead (``a.jpg.png``; ``a.png`` stays).
The relative paths come from the dataset, which may be crafted, so every target is checked
before anything is written: inside the destination (no absolute paths, no ``..``, no symlink
inside the destination leading out of it), no two samples on one name, no name both a file and
a folder, every name short enough for the filesystem, the destination writable. Existing files
are never replaced unless ``overwrite``. Files are written through a short temporary name in
the same folder, so no partial file is ever left under a target's name.
"""

from __future__ import annotations

import io
import json
import os
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from PIL import Image

from packer.errors import DatasetError, IndexingWarning, OutputExistsError, PackerError, RunError, arg, under_way
from packer.layout.fields import json_value
from packer.layout.fsutil import create_temp, destination_dir, nearest_existing
from packer.layout.manifest import dataset_directory
from packer.layout.remote import default_cache_dir, is_remote
from packer.layout.trust import check_class_name, check_inner_name
from packer.progress import bar
from packer.read.dataset import open_dataset
from packer.storage.url import redact, refuse_urls


@dataclass
class ExtractResult:
    """What ``extract`` wrote: where, how many files and bytes, and how raw payloads were named."""

    output: Path
    num_files: int
    num_bytes: int
    as_png: bool  # raw payload: written as PNG, names end in .png
    kept_extension: int = 0  # raw payload: PNGs named <original name>.png because of a name clash
    fields_file: Path | None = None  # the per-sample fields, one JSON line per sample (datasets with fields)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON values (``packer extract --json``, docs/library.md)."""
        return {"output": str(self.output), "num_files": self.num_files, "num_bytes": self.num_bytes,
                "as_png": self.as_png, "kept_extension": self.kept_extension,
                "fields_file": None if self.fields_file is None else str(self.fields_file)}


FIELDS_NAME = "packer-fields.jsonl"  # beside the extracted files: {"path": name, field: value, ...} per sample


def target_names(rel_paths: Sequence[str], raw: bool) -> list[str]:
    """The names samples are extracted to: their relative paths; for raw payloads PNG names (see the module doc)."""
    if not raw:
        return list(rel_paths)
    names = [str(PurePosixPath(r).with_suffix(".png")) for r in rel_paths]
    count = Counter(names)
    return [n if count[n] == 1 or n == r else r + ".png" for r, n in zip(rel_paths, names, strict=True)]


def extract(path: str | os.PathLike, dest: str | os.PathLike, overwrite: bool = False,
            progress: bool | None = None, cache_dir: str | os.PathLike | None = None,
            storage_options: dict[str, Any] | None = None) -> ExtractResult:
    """Write every sample of the dataset at ``path`` under ``dest``; every target is checked before writing.

    ``path`` may be a URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``): its shards are read through
    ``cache_dir`` as ``open_dataset(url)`` reads them. Refusals before anything is written raise PackerError; a
    dataset that fails to read, or a write failing part-way (disk full), raises RunError (the command line's exit 1).
    """
    refuse_urls("packer extract's destination (a local folder)", dest)
    remote = is_remote(path)
    if not remote:
        refuse_urls("packer extract", path)
        dataset_directory(path)
    where = redact(str(path))
    remote_options: dict[str, Any] = {"cache_dir": cache_dir or default_cache_dir(),
                                      "storage_options": storage_options} if remote else {}
    with under_way(), warnings.catch_warnings():
        warnings.simplefilter("ignore", IndexingWarning)  # about indices a user maps: extract writes every file
        ds = open_dataset(path, image="numpy", **remote_options)
    try:
        if not ds.has_images:
            raise PackerError(f"{where}: its samples have no image, so there is no ImageFolder to extract; read "
                              "its fields with open_dataset(path, fields='all')")
        raw = ds.manifest.payload == "raw"
        rels = [_checked(rel, where) for rel in ds.index.rel_paths()]
        names = target_names(rels, raw)
        dest = Path(dest)
        sidecar = [FIELDS_NAME] if ds.field_specs else []
        _check_names(where, dest, rels + sidecar, names + sidecar, ds.classes)
        dest = destination_dir(dest, "extract destination")
        real_dest = dest.resolve()
        targets = [_target(real_dest, dest, n) for n in names + sidecar]
        _check_existing(dest, targets, [_target(real_dest, dest, c + "/x").parent for c in ds.classes], overwrite)
        with under_way():
            total = _write_all(ds, real_dest, dest, names, raw, overwrite, progress)
            if sidecar:
                _write(targets[-1], fields_lines(ds, names), overwrite)
    finally:
        ds.close()
    kept = sum(n != str(PurePosixPath(r).with_suffix(".png")) for r, n in zip(rels, names, strict=True)) if raw else 0
    return ExtractResult(dest, len(names), total, raw, kept, dest / FIELDS_NAME if sidecar else None)


def fields_lines(ds, names: list[str]) -> bytes:
    """One JSON line per stored sample: its extracted name and its fields (arrays as lists, bytes as base64)."""
    lines = []
    for i, name in enumerate(names):
        record = {"path": name, **{k: json_value(ds.field_store.value(k, i, str(ds.root))) for k in ds.field_specs}}
        lines.append(json.dumps(record, ensure_ascii=False))
    return ("\n".join(lines) + "\n").encode("utf-8", "surrogateescape")


def _checked(name: str, where) -> str:
    check_inner_name(name, f"{where}: sample path")
    if name.startswith("/") or name in (".", "") or any(p in (".", "") for p in name.split("/")):
        raise DatasetError(f"{where}: sample path {name!r} is not a plain relative path")
    return name


def _check_names(where, dest: Path, rels: list[str], names: list[str], classes: Sequence[str]) -> None:
    """Refuse, before writing anything: two samples on one name, a name both file and folder, names too long."""
    for k, c in enumerate(classes):  # one folder each under dest
        check_class_name(c, f"{where}: class {k}")
    first: dict[str, str] = {}
    for rel, name in zip(rels, names, strict=True):
        if name in first:
            raise DatasetError(f"{where}: samples {first[name]!r} and {rel!r} would both be written to {name!r}")
        first[name] = rel
    folders = set(classes) | {str(p) for n in names for p in PurePosixPath(n).parents if str(p) != "."}
    clash = next((n for n in names if n in folders), None)
    if clash is not None:
        raise DatasetError(f"{where}: {clash!r} would be both a file and a folder under {dest}")
    base = Path(os.path.abspath(dest))
    probe = nearest_existing(base)
    name_max, path_max = _limit(probe, "PC_NAME_MAX", 255), _limit(probe, "PC_PATH_MAX", 4096)
    for name in sorted(set(names) | folders):
        longest = max(PurePosixPath(name).parts, key=lambda p: len(os.fsencode(p)))
        if len(os.fsencode(longest)) > name_max:
            raise PackerError(f"{base / name}: the name {longest[:40]!r}... is {len(os.fsencode(longest))} bytes, "
                              f"longer than the {name_max} this filesystem allows")
        if len(os.fsencode(str(base / name))) >= path_max:
            raise PackerError(f"{base / name[:60]}...: path longer than the {path_max} bytes this system allows")


def _limit(path: Path, name: str, default: int) -> int:
    try:
        return int(os.pathconf(path, name))
    except (OSError, ValueError):
        return default


def _target(real_dest: Path, dest: Path, name: str) -> Path:
    """``dest/name``, refusing it when an existing folder or link on the way leads out of ``dest``."""
    target = dest / name
    real = target.resolve()  # follows symlinks that exist; the rest is taken literally
    if real_dest not in real.parents:
        raise PackerError(f"{target}: would be written outside {dest} (to {real}); refusing")
    return target


def _check_existing(dest: Path, targets: list[Path], class_dirs: list[Path], overwrite: bool) -> None:
    """Refuse targets that exist (unless ``overwrite``) or are folders, and files where folders are needed."""
    for d in {p for t in targets for p in t.parents if dest in p.parents} | set(class_dirs):
        if os.path.lexists(d) and not d.is_dir():
            raise OutputExistsError(f"{d}: exists and is not a folder, but files are to be extracted into it")
    existing = [t for t in targets if os.path.lexists(t)]
    folder = next((t for t in existing if t.is_dir() and not t.is_symlink()), None)
    if folder is not None:
        raise OutputExistsError(f"{folder}: a folder is in the way of a file to extract")
    if existing and not overwrite:
        raise OutputExistsError(f"{dest}: {len(existing)} of the files to extract exist already, e.g. {existing[0]} "
                                f"(use {arg('overwrite', True)} to replace them)")


def _write_all(ds, real_dest: Path, dest: Path, names: list[str], raw: bool, overwrite: bool,
               progress: bool | None) -> int:
    """Write every sample (class folders too, even empty ones, so ImageFolder finds the same classes)."""
    for c in ds.classes:
        _mkdir(_target(real_dest, dest, c))
    total = 0
    for i in bar(range(len(ds)), desc="extracting", progress=progress):  # storage order: sequential
        if raw:
            buf = io.BytesIO()
            Image.fromarray(ds.pixels_at(i)).save(buf, format="PNG")
            data = buf.getvalue()
        else:
            data = bytes(ds.payload_at(i))
        target = _target(real_dest, dest, names[i])
        _mkdir(target.parent)
        _target(real_dest, dest, names[i])  # again, after creating folders: nothing on the way leads out
        _write(target, data, overwrite)
        total += len(data)
    return total


def _mkdir(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunError(f"{folder}: cannot create folder ({exc.strerror or exc}); "
                       "the files before it were written") from None


def _write(target: Path, data: bytes, overwrite: bool) -> None:
    """Write via a short temporary file in the same folder: no partial file, never through a symlink.

    ``overwrite``: ``os.replace`` (a link itself is replaced, never what it points to); otherwise
    ``os.link``, which refuses to replace a file that appeared since the checks.
    """
    try:
        fd, tmp = create_temp(target.parent)
    except OSError as exc:
        raise RunError(f"{target}: cannot write ({exc.strerror or exc}); the files before it were written") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        if overwrite:
            os.replace(tmp, target)
        else:
            os.link(tmp, target)
    except FileExistsError:
        raise RunError(f"{target}: appeared while extracting; left as it is") from None
    except OSError as exc:
        raise RunError(f"{target}: cannot write ({exc.strerror or exc}); the files before it were written") from None
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
