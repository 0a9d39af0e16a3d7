"""The one exception type packer raises for bad input, bad datasets and refused operations.

The command line turns them into exit codes (see ``packer --help``): a ``RunError`` exits 1
(the command ran and met a problem: damaged data, a write failing part-way), any other
``PackerError`` exits 2 (the command could not run as asked: usage, a missing or unreadable
input path, a refused destination).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class PackerError(Exception):
    """A problem packer found and explains: the message names the file and the reason."""


class RunError(PackerError):
    """A problem met once a command was under way (its input and destination accepted): exit 1, not 2."""


@contextlib.contextmanager
def under_way() -> Iterator[None]:
    """Re-raise a PackerError from inside as a RunError (same message): the work had started."""
    try:
        yield
    except RunError:
        raise
    except PackerError as exc:
        raise RunError(str(exc)) from exc


class ResumableError(RunError):
    """A conversion failed mid-way (a full disk, an I/O error); its work is kept for ``--resume``.

    The CLI exits with 1 for it (the problem was met while working), 2 for other PackerErrors
    (refused up front).
    """


class NotPackedError(PackerError, LookupError):
    """A source sample that is not in the dataset (damaged, or left out by a selection): ``ds.from_imagefolder``."""


class IndexingWarning(UserWarning):
    """A dataset's indices are not its source's: some source records were not packed (``ds.from_imagefolder``).

    Warned once when such a dataset is opened; the CLI does not show it (``packer info`` says it in words).
    """
