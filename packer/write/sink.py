"""Where a conversion's samples go: the ``Sink`` interface behind the one driver (write/convert.py), and
``ConvertResult``, what a conversion did.

The driver checks the options, scans and orders the source, holds the output's lock, numbers the records left out
and turns a failure into one line; a sink plans, writes and finishes its own files through the ``Output``
(write/output.py): ``DatasetSink`` the shards of a format (write/dataset_sink.py), ``ExportSink`` WebDataset tars
(write/export_wds.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packer.write.lock import OutputLock
from packer.write.options import ConvertOptions, Declared, RunOptions
from packer.write.output import Output
from packer.write.sources.base import SourceOptions
from packer.write.sources.records import ScanResult, SourceError


@dataclass
class ConvertResult:
    """What a conversion did (``convert``, ``export_wds``): the output, what was packed, what was left out and why."""

    output: Path | str  # a local folder, or the (redacted) URL of a dataset in object storage
    num_samples: int
    errors: list[SourceError]
    seconds: float
    bytes_read: int
    ignored: dict[str, int] = field(default_factory=dict)  # reason -> count (packer.write.scan)
    not_images: dict[str, int] = field(default_factory=dict)  # the "not an image" files by suffix
    reused: bool = False  # if_changed found the output up to date: nothing was converted
    nothing_to_resume: str = ""  # resume found this conversion finished already (how it knows): nothing was done
    rewritten: int | None = None  # --jpeg-restarts: samples stored rewritten (None: not asked, or not converted here)

    @property
    def files_per_second(self) -> float:
        return (self.num_samples + len(self.errors)) / max(self.seconds, 1e-9)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON values (``packer convert --json``'s entries, docs/library.md)."""
        return {"output": str(self.output), "num_samples": self.num_samples, "num_errors": len(self.errors),
                "errors": [e.to_json() for e in self.errors], "ignored": dict(self.ignored),
                "not_images": dict(self.not_images), "seconds": self.seconds, "bytes_read": self.bytes_read,
                "reused": self.reused, "nothing_to_resume": self.nothing_to_resume, "rewritten": self.rewritten}


@dataclass
class Finished:
    """What a sink's ``finish`` wrote: the samples in the output, their bytes, and how many were rewritten."""

    num_samples: int
    num_bytes: int
    rewritten: int | None = None  # --jpeg-restarts only


class Sink(ABC):
    """One conversion's destination kind, made per run (it keeps what it wrote between ``write`` and ``finish``).

    ``name`` is what ``to`` names (and the default output's suffix); ``resumable``: an interrupted run's
    folder is kept for ``resume`` (otherwise a failure removes it, and nothing of the run is left)."""

    name: str
    command: str = "packer convert"  # how a refusal (a URL) names the command
    resumable: bool = True

    def refuse(self, given: Sequence[tuple[Declared, Any]]) -> None:
        """Refuse options this sink does not take (given with a value other than their default); default: none."""

    @abstractmethod
    def options(self, given: dict[str, Any]) -> ConvertOptions:
        """The checked conversion options from ``convert``'s keywords other than the run's and the source's."""

    def replaces(self, run: RunOptions) -> bool:
        """Whether an existing output passes the destination check (to be replaced, or looked at first)."""
        return run.overwrite

    @abstractmethod
    def accept(self, scan: ScanResult, options: ConvertOptions, payload: str | None) -> None:
        """Refuse a source this sink can't store as asked, or settle what it decides (the payload), before anything
        is written; ``payload``: the one asked for (None: none)."""

    def up_to_date(self, scan: ScanResult, output: Output, options: ConvertOptions, run: RunOptions,
                   started: float) -> ConvertResult | None:
        """The result where nothing is to be written (an output found up to date); default None: write."""
        return None

    @abstractmethod
    def start(self, scan: ScanResult, output: Output, options: ConvertOptions, resume: bool) -> OutputLock:
        """Make the output's folder holding this run's plan, or take the one an interrupted run left (``resume``);
        the lock held until the run ends. ``scan``: in dataset order."""

    @abstractmethod
    def recorded_samples(self, folder: Path) -> int:
        """The samples of the finished output in ``folder`` (its move into place is all that is left)."""

    @abstractmethod
    def write(self, scan: ScanResult, output: Output, options: ConvertOptions, run: RunOptions) -> list[SourceError]:
        """Write every record of ``scan`` (dataset order) into the output's folder; the records that could not be."""

    @abstractmethod
    def finish(self, scan: ScanResult, output: Output, errors: list[SourceError], options: ConvertOptions,
               source: SourceOptions) -> Finished:
        """Write what describes the output and, last, the file that marks it complete; move it into place.
        ``scan``: in the source's order; ``errors``: every record left out, numbered and located."""
