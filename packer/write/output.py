"""The output of a conversion: its path, the checks before anything is written, names unique to the run,
and the journaled swap into place.

Nothing the run did not make is deleted: the output may not be, hold or lie inside the source;
``--overwrite`` replaces only a packer dataset, moved into a fresh ``<out>.packer-old-*`` folder
(journaled, so ``--resume`` finishes a swap killed half-way) and deleted once the new one is in place.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from pathlib import Path

from packer.errors import OptionError, OutputExistsError, arg
from packer.layout.fsutil import fsync_dir
from packer.layout.manifest import MANIFEST_NAME, holds_dataset
from packer.layout.partial import JOURNAL_DIR, OLD_TAG, read_swap
from packer.layout.wdsexport import holds_wds_export
from packer.write.journal import write_swap

log = logging.getLogger(__name__)  # under "packer": the command line prints it, a library user routes it


def default_output(src: Path, fmt: str) -> Path:
    src = Path(os.path.abspath(src))
    return src.with_name(f"{src.name}.{fmt}")


def output_path(src: str | os.PathLike, output: str | os.PathLike | None, fmt: str) -> Path:
    """The absolute output path: ``output``, or ``<src>.<fmt>`` beside the source; an empty one is refused."""
    if output is None:
        return default_output(Path(src), fmt)
    if os.fspath(output) == "":
        raise OptionError(f"the output path is empty: name the dataset folder to create ({arg('output')})")
    return Path(os.path.abspath(output))


def check_destination(src: str | os.PathLike, out: Path, overwrite: bool) -> None:
    """Refuse, before anything is written, an output whose replacement would destroy data.

    The output may not be the source, hold it or lie inside it (symlinks followed); an existing
    path is replaced only when it holds a packer dataset (or a WebDataset export packer made), and then only
    with ``overwrite``.
    """
    source, target = Path(os.path.realpath(src)), Path(os.path.realpath(out))
    if target == source:
        raise OptionError(f"{out}: is the source folder itself; choose another {arg('output')}")
    if source.is_relative_to(target):
        raise OptionError(f"{out}: holds the source folder {src}; choose an {arg('output')} that does not contain it")
    if target.is_relative_to(source):
        raise OptionError(f"{out}: lies inside the source folder {src}; choose an {arg('output')} outside it")
    check_replaceable(out, overwrite)


def check_replaceable(out: Path, overwrite: bool) -> None:
    """``out`` is free, or a packer dataset and ``overwrite`` is given: anything else is refused."""
    if not os.path.lexists(out):
        return
    if not (holds_dataset(out) or holds_wds_export(out)):
        raise OutputExistsError(f"{out}: exists and is {_describe(out)}, not a packer dataset; packer replaces only "
                                f"a dataset, even with {arg('overwrite', True)}: choose another {arg('output')}, or "
                                "move it away yourself")
    if not overwrite:
        raise OutputExistsError(f"{out}: already exists (use {arg('overwrite', True)} to replace it)")


def _describe(path: Path) -> str:
    if path.is_symlink() and not path.exists():
        return "a broken symbolic link"
    if path.is_file():
        return "a file"
    if path.is_dir():
        return f"a folder without a packer {MANIFEST_NAME}"
    return "a special file"


def fresh_name(out: Path, tag: str) -> Path:
    """A name beside ``out`` no earlier run used: ``<out><tag><pid>-<random>`` (made exclusively by the caller)."""
    return out.with_name(f"{out.name}{tag}{os.getpid()}-{secrets.token_hex(4)}")


def swap_into_place(partial: Path, out: Path) -> None:
    """Rename the finished ``partial`` to ``out``; an old output (--overwrite) is moved aside only now.

    The swap is journaled first, naming the fresh folder the old output goes into, so a run
    killed between the two renames is finished by --resume, and only that folder is deleted.
    Readers that already opened the old dataset keep reading its (unlinked) files.
    """
    swapping, name = read_swap(partial, out)
    if not swapping:
        name = fresh_name(out, OLD_TAG).name if os.path.lexists(out) else None
        write_swap(partial, name)
    trash = out.with_name(name) if name else None
    if os.path.lexists(out):
        if trash is None:
            raise OutputExistsError(f"{out}: appeared while {partial} was being moved there; move it away, then run "
                                    f"the same command with {arg('resume', True)}")
        _set_aside(out, trash)
    os.rename(partial, out)
    fsync_dir(out.parent)
    _remove_leftovers(out, trash)


def _set_aside(out: Path, trash: Path) -> None:
    """Move ``out`` into the new folder ``trash`` (made here, or empty: made by a run killed right after)."""
    try:
        os.mkdir(trash)
    except FileExistsError:
        if trash.is_symlink() or not trash.is_dir() or os.listdir(trash):
            raise OutputExistsError(f"{trash}: exists and is not the empty folder packer made, so {out} is not "
                                    f"moved into it; move one of them away, then run the same command with "
                                    f"{arg('resume', True)}") from None
    os.rename(out, trash / out.name)


def _remove_leftovers(out: Path, trash: Path | None) -> None:
    """Delete the old output's folder (if it holds nothing else) and the journal; failing only warns."""
    leftovers = [out / JOURNAL_DIR]
    if trash is not None and trash.is_dir() and not trash.is_symlink():
        if set(os.listdir(trash)) <= {out.name}:
            leftovers.insert(0, trash)
        else:
            log.warning("warning: %s holds more than the old %s; left alone", trash, out.name)
    for path in leftovers:
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("warning: %s is in place, but %s could not be removed (%s); remove it yourself", out,
                        exc.filename or path, exc.strerror or exc)
