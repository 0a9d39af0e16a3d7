"""The output of a write: its path, the checks before anything is written, and ``Output``, the one place its files
are made (``<out>.partial``, locked), journaled and swapped into place.

Nothing the run did not make is deleted: the output may not be, hold or lie inside the source;
``--overwrite`` replaces only a packer dataset, moved into a fresh ``<out>.packer-old-*`` folder
(journaled, so ``--resume`` finishes a swap killed half-way) and deleted once the new one is in place.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from packer.errors import OptionError, OutputExistsError, PackerError, arg
from packer.layout.fsutil import fsync_dir, fsync_tree
from packer.layout.manifest import MANIFEST_NAME, Manifest, Shard, holds_dataset, read_manifest
from packer.layout.partial import JOURNAL_DIR, OLD_TAG, PARTIAL_SUFFIX, made_by_packer, read_swap
from packer.layout.ranges import PayloadRanges
from packer.layout.wdsexport import holds_wds_export
from packer.write.journal import (
    ShardResult,
    intact_files,
    load_done_shards,
    read_plan,
    record_shard,
    write_plan,
    write_swap,
)
from packer.write.lock import OutputLock, check_free
from packer.write.sources.records import ScanResult

log = logging.getLogger(__name__)  # under "packer": the command line prints it, a library user routes it
NEW_TAG = ".packer-new-"  # <out>.packer-new-<pid>-<random>: a new .partial until its plan is written


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


class ShardPutter(Protocol):
    """Puts a shard written in a local folder where its output keeps it (``remote_output.ShardUploader``: a
    bucket); picklable, so that a Dask task on a machine sharing no disk with the driver puts the shard it wrote."""

    def put(self, folder: Path, result: ShardResult, names: list[str]) -> tuple[ShardResult, list[str]]:
        """Checksum, journal and put the shard's files ``names`` in ``folder``; the result and the keys put."""
        ...

    def close(self) -> None:
        """Release what this process opened to put shards (a storage client)."""
        ...


class Output:
    """A write's output on this machine: its files are made in ``folder`` (``<path>.partial``, locked while a run
    writes it), each shard journaled as it is done, and the folder moved to ``path`` once complete. The writers
    (a conversion's sinks, the ``Writer``) go through these methods for the folder's life, so that another kind
    of output (shards uploaded as they are done, the last file last) can stand in for it."""

    max_pending: int | None = None  # finished shards whose ``shard_done`` may still run while the next is written

    def __init__(self, path: Path) -> None:
        self.path = path
        self.folder = path.with_name(path.name + PARTIAL_SUFFIX)

    @property
    def shown(self) -> str:
        """The output as messages and results name it."""
        return str(self.path)

    @property
    def result_name(self) -> Path | str:
        """The output as ``ConvertResult.output`` names it."""
        return self.path

    @property
    def kept_in(self) -> str:
        """Where an interrupted run's work is kept, as messages name it."""
        return str(self.folder)

    @property
    def remedy(self) -> str:
        """What to fix before ``resume`` when a write failed part-way (a full disk, mostly)."""
        return "free space (or fix the problem)"

    def check(self, src: str | os.PathLike, replaces: bool) -> None:
        """Refuse, before anything is written, an output whose making would destroy data (``check_destination``)."""
        check_destination(src, self.path, replaces)

    def complete(self) -> bool:
        """Whether a packer dataset is at the output already (``if_changed`` and ``resume`` look at it first)."""
        return holds_dataset(self.path)

    def finished(self) -> tuple[Manifest, Path, list[str]]:
        """The dataset at the output (``complete``): its manifest, a local folder holding its manifest and
        errors.json, and what is wrong with its files (missing, or of another size); a PackerError where its
        manifest does not load."""
        manifest = read_manifest(self.path)
        return manifest, self.path, manifest.file_problems(self.path, first=True)

    def staged_bytes(self, needed: float, per_shard: float) -> float:
        """The most of an output of ``needed`` bytes (shards of ``per_shard``) on this machine's disk at once."""
        return needed

    def done_shards(self, num_shards: int, scan: ScanResult) -> dict[int, ShardResult]:
        """The shards an interrupted run finished that can be kept (``load_done_shards``)."""
        return load_done_shards(self.folder, num_shards, scan)

    def kept_shard(self, result: ShardResult) -> bool:
        """Whether a journaled shard's files are all still where the run put them, intact (a resume keeps it)."""
        return intact_files(self.folder, result)

    def made_by_packer(self) -> bool:
        """Whether ``folder`` is one a write made (a real folder holding its journaled plan)."""
        return made_by_packer(self.folder)

    def left_over(self) -> bool:
        """Whether ``folder`` exists already (an interrupted run's, a live run's, or not packer's)."""
        return os.path.lexists(self.folder)

    def plan(self) -> dict[str, Any] | None:
        """The plan journaled in ``folder``, or None where packer did not make it."""
        return read_plan(self.folder)

    def check_free(self) -> None:
        """A PackerError naming the live run that writes ``folder``, else nothing (nothing is written)."""
        check_free(self.folder, self.path)

    def swapping(self) -> bool:
        """Whether ``folder`` holds a finished output whose move into place was journaled (a kill interrupted it)."""
        return read_swap(self.folder, self.path)[0]

    def take(self) -> OutputLock:
        """Lock a ``folder`` an interrupted run left, to go on with it."""
        return OutputLock.take(self.folder, self.path)

    def start(self, plan: dict[str, Any]) -> OutputLock:
        """Make ``folder`` holding ``plan``, locked (the lock returned): made under a fresh name and renamed once
        the plan is on disk and the lock taken, so a ``.partial`` without a plan is never one of packer's, and one
        of a live run is never seen unlocked."""
        self.make_parent()
        tmp = fresh_name(self.path, NEW_TAG)
        lock: OutputLock | None = None
        try:
            os.mkdir(tmp)
            try:
                write_plan(tmp, plan)
                lock = OutputLock.take(tmp, self.path)
                os.rename(tmp, self.folder)
            except BaseException:
                if lock is not None:
                    lock.release()
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            fsync_dir(self.path.parent)
        except OSError as exc:
            if lock is not None:
                lock.release()
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST) and read_plan(self.folder) is not None:
                self.check_free()  # another run made it meanwhile: "in use by pid N" while it lives
                raise PackerError(self.left_over_reason()) from None
            why = exc.strerror or exc
            raise PackerError(f"{exc.filename or self.folder}: cannot create the output ({why})") from exc
        return lock

    def make_parent(self) -> None:
        """Make the folder the output goes in (and its parents); a PackerError naming it where that fails."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            where = exc.filename or self.path.parent
            raise PackerError(f"{where}: cannot create the output's folder ({exc.strerror or exc})") from exc

    def left_over_reason(self) -> str:
        """Why a packer-made ``folder`` blocks a run without ``resume``, and the ways out."""
        partial, out = self.folder, self.path
        swapping, trash = read_swap(partial, out)
        if not swapping:
            return (f"{partial}: left over from an interrupted conversion; go on with it by running the same "
                    f"command with {arg('resume', True)}, or remove it (rm -r '{partial}')")
        old = out.with_name(trash) / out.name if trash else None
        where = f"the old dataset was moved to {old.parent}" if old is not None and os.path.lexists(old) \
            else f"{out} is not replaced yet"
        return (f"{partial}: holds the complete result of an interrupted conversion that was being moved into place "
                f"({where}); run the same command with {arg('resume', True)} to finish that (nothing is converted "
                "again)")

    def not_resumable(self, why: str, again: str = "convert again") -> str:
        """Why the interrupted run's ``folder`` cannot be gone on with, and the way out (``again``: a Writer's
        "write again")."""
        return f"{self.folder}: {why}, so it can't be resumed; remove it (rm -r '{self.folder}') and {again}"

    def shard_done(self, result: ShardResult, names: list[str]) -> ShardResult:
        """A shard's files are all written: flush and checksum them, then journal the shard as done."""
        return record_shard(self.folder, result, names)

    def shard_uploader(self, shard_id: int) -> ShardPutter | None:
        """What a Dask task on another machine needs to put shard ``shard_id``, written in its own temporary folder,
        into this output (an output in a bucket: its ``ShardUploader``); None here: the task writes into ``folder``,
        on storage every worker shares."""
        return None

    def shard_put(self, result: ShardResult, keys: list[str]) -> ShardResult:
        """A shard a task put with ``shard_uploader`` (``keys``: the objects it put), recorded as this run's."""
        return result

    def files_done(self, names: list[str]) -> None:
        """Files of ``folder`` that are finished and will not change (an export's tars as each is closed): they stay
        here until the output is sealed (an output in a bucket uploads them now)."""

    def recorded_ranges(self, shard: Shard) -> PayloadRanges | None:
        """The payload ranges kept for a finished ``shard`` whose files are no longer in ``folder`` (none here: a
        local output's shards stay, and their ranges are read from them at the end: ``write.ranges``)."""
        return None

    def seal(self, write_last: Callable[[Path], None]) -> None:
        """Flush everything written, write the file that marks the output complete (``write_last(folder)``: the
        manifest, an export's index), then move the output into place (journaled: ``swap_into_place``)."""
        fsync_tree(self.folder)
        write_last(self.folder)
        swap_into_place(self.folder, self.path)

    def finish_swap(self) -> None:
        """Finish the journaled move into place that a killed run began (``swapping``)."""
        swap_into_place(self.folder, self.path)

    def discard(self) -> None:
        """Remove ``folder``: this run's work, where nothing of it is worth keeping."""
        shutil.rmtree(self.folder, ignore_errors=True)
