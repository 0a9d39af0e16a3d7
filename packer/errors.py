"""The exceptions packer raises for bad input, bad datasets and refused operations: ``PackerError`` and its kinds.

Every one is a ``PackerError``; the kinds also inherit the built-in exception a Python user would catch:

================================  =====================  ==============================================
``InputNotFoundError``            ``FileNotFoundError``  no dataset, source, list or folder at the path
``OutputExistsError``             ``FileExistsError``    the output path holds something packer won't replace
``OptionError``                   ``ValueError``         an argument out of its range or choices
``DatasetError``                  (none)                 a dataset, journal or index that fails its checks
``MissingPackageError``           ``ImportError``        an optional package (an extra) is not installed
================================  =====================  ==============================================

``DatasetError`` is not an ``OSError``: code that retries ``OSError`` (a flaky mount) must not retry damage. The
command line exits 1 on a ``RunError`` (the command ran and met a problem; a kind met once work is under way is
raised as one, still of its kind: ``under_way``) and 2 on any other ``PackerError``. ``arg(name, value)`` names an
argument as the Python API takes it (``str(exc)``) or as the command line does (``exc.cli_message()``).
"""

from __future__ import annotations

import contextlib
import re
import shlex
from collections.abc import Iterator

_ARG = re.compile("\x1d([^\x1d\x1e]*)\x1e([^\x1d\x1e]*)\x1d")  # arg()'s mark: API form, CLI form


def arg(name: str, value: object = ..., cli: str | None = None) -> str:
    """Argument ``name`` (with ``value``, if given) inside an error message: ``str(exc)`` renders it as a Python
    keyword (``payload='raw'``, ``overwrite=True``, or ``resize`` without a value), ``cli_message()`` as the
    command line's flag (``--payload raw``, ``--overwrite``, ``--resize``). ``cli``: the flag's name where it is
    not the keyword's with ``-`` for ``_`` (``shard_bytes`` is ``--shard-size``)."""
    flag = "--" + (cli or name.replace("_", "-"))
    if value is ...:
        api, shown = name, flag
    elif value is True:
        api, shown = f"{name}=True", flag
    else:
        text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
        api, shown = f"{name}={value!r}", f"{flag} {shlex.quote(text)}"
    return f"\x1d{_unmarked(api)}\x1e{_unmarked(shown)}\x1d"


def _unmarked(text: str) -> str:
    return text.replace("\x1d", "").replace("\x1e", "")


def render(message: str, cli: bool = False) -> str:
    """``message`` with its ``arg`` marks as the Python API (default) or the command line names them."""
    return _ARG.sub(lambda m: m.group(2 if cli else 1), message)


class _Rendered(BaseException):
    """An exception whose message may name arguments (``arg``): shown as the API or the command line names them."""

    def __str__(self) -> str:
        return render(self.template)

    @property
    def template(self) -> str:
        """The message as raised, ``arg`` marks included (to build another message from this one). Not called
        ``message``: torch re-raises a DataLoader worker's exception as ``type(message=...)`` when the class has
        an attribute of that name."""
        return str(self.args[0]) if len(self.args) == 1 else BaseException.__str__(self)

    def cli_message(self) -> str:
        """The message with arguments named as the command line's flags."""
        return render(self.template, cli=True)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"


class PackerError(_Rendered, Exception):
    """A problem packer found and explains: the message names the file and the reason."""


class Interrupted(_Rendered, KeyboardInterrupt):
    """Ctrl-C during a conversion: the message says what was kept and how to go on."""


class InputNotFoundError(PackerError, FileNotFoundError):
    """No dataset, source, list or folder where one was named (or a directory that is not a packer dataset)."""


class OutputExistsError(PackerError, FileExistsError):
    """The output path holds files or folders packer does not replace (only a packer dataset, and only on request)."""


class OptionError(PackerError, ValueError):
    """An argument out of its range or choices, or arguments that do not go together."""


class DatasetError(PackerError):
    """A dataset (or a conversion's journal, index or error report) that fails its checks: damaged or replaced."""


class MissingPackageError(PackerError, ImportError):
    """An optional package is not installed; the message says which extra installs it."""


class RunError(PackerError):
    """A problem met once a command was under way (its input and destination accepted): exit 1, not 2."""


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


class SharedCacheWarning(UserWarning):
    """A remote dataset's ``cache_dir`` is on a network or parallel filesystem: nodes sharing it rely on the
    server's byte-range locks, and every cached byte crosses that network again; a node-local disk is the safe choice.
    """


_RUN_KINDS: dict[type[PackerError], type[RunError]] = {}


def run_error_of(kind: type[PackerError]) -> type[RunError]:
    """``kind`` met under way: a RunError (exit 1) that still is a ``kind`` (so still caught as its built-in)."""
    if issubclass(kind, RunError):
        return kind
    if kind is PackerError:
        return RunError
    made = _RUN_KINDS.get(kind)
    if made is None:
        made = _RUN_KINDS[kind] = type(kind.__name__, (RunError, kind), {
            "__module__": kind.__module__, "__qualname__": kind.__qualname__, "__reduce__": _reduce_run_kind,
            "__doc__": f"{kind.__name__} met once the work was under way (a RunError)."})
    return made


def _reduce_run_kind(self: PackerError) -> tuple:
    kind = next(k for k in type(self).__mro__[1:] if k in _RUN_KINDS)
    return _remake_run_kind, (kind, self.args)


def _remake_run_kind(kind: type[PackerError], args: tuple) -> PackerError:
    """Unpickling: the made class is found again from its kind (it has no module-level name)."""
    return run_error_of(kind)(*args)


@contextlib.contextmanager
def under_way() -> Iterator[None]:
    """Re-raise a PackerError from inside as a RunError of the same kind and message: the work had started."""
    try:
        yield
    except RunError:
        raise
    except PackerError as exc:
        raise run_error_of(type(exc))(exc.template) from exc


def install_hint(extra: str) -> str:
    """How to install one of packer's optional extras: from the source checkout (packer-images is not on the
    package index)."""
    return f"pip install -e '.[{extra}]' in packer's source checkout"
