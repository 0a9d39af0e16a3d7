"""Integer labels and their classes, for sources whose labels are numbers (WebDataset, Hugging Face, RecordIO).

The rule: integers keep their values; ``classes`` are the lines of ``--classes-file`` when given,
else ``"0"``..``"max"``; a label outside those classes is an error for its record, not a renumbering.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from packer.layout.trust import check_inner_name
from packer.write.scan import SourceError
from packer.write.sources.listfile import read_classes


def integer_classes(labels: np.ndarray, classes_file: str | None) -> list[str]:
    """``classes`` of integer labels: ``classes_file``'s names, else "0".."max" (none when no label is >= 0)."""
    if classes_file:
        return read_classes(Path(classes_file))
    top = int(labels.max()) if len(labels) else -1
    return [str(i) for i in range(top + 1)]


def keep_in_range(keys: list[str], labels: np.ndarray, classes: list[str], where: list[str],
                  errors: list[SourceError], numbers: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
    """The positions whose label names one of ``classes``; the others become errors (with their location and,
    given ``numbers``, their number in the source's numbering)."""
    ok = (labels >= 0) & (labels < len(classes))
    for i in np.flatnonzero(~ok).tolist():
        errors.append(SourceError(keys[i], f"label {int(labels[i])} is not one of the {len(classes)} classes "
                                           f"(0..{len(classes) - 1})", where[i],
                                  None if numbers is None else int(numbers[i])))
    return np.flatnonzero(ok)


def inside_root(path: str, where: str) -> str:
    """``path`` when it is a plain relative path (read below ``--root``), else a PackerError naming ``where``."""
    return check_inner_name(path, f"{where}: image path")
