"""Command line: argparse only. ``parser.py`` builds the parser, one ``_add_<name>(sub)`` per subcommand;
``commands.py`` has one ``cmd_<name>(args) -> int`` per subcommand; the work lives elsewhere.

Exit codes: see ``EXIT_CODES`` (``packer --help``). Numeric options are checked by their argparse
type (out of range: a usage error, exit 2) before any work starts.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from typing import NoReturn

from packer.cli.commands import json_document, wants_json
from packer.cli.parser import EXIT_CODES, build_parser
from packer.errors import IndexingWarning, Interrupted, PackerError, RunError

__all__ = ["EXIT_CODES", "build_parser", "main", "end_process", "notices_on_stderr", "run"]


@contextlib.contextmanager
def notices_on_stderr() -> Iterator[None]:
    """The library's notices (``logging.getLogger("packer")``, INFO and up) on stderr as ``packer: <message>``, as
    the command line has always printed them; the logger is left as it was afterwards (``main`` may run in a
    process that uses packer as a library too)."""
    logger = logging.getLogger("packer")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("packer: %(message)s"))
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # printed once, here, whatever handlers the root logger has
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        with notices_on_stderr(), warnings.catch_warnings():
            warnings.simplefilter("ignore", IndexingWarning)  # for library users: `packer info` says it in words
            return args.func(args)
    except PackerError as exc:
        print(f"packer: error: {exc.cli_message()}", file=sys.stderr)
        return _failed(args, 1 if isinstance(exc, RunError) else 2, exc.cli_message())  # ResumableError: a RunError
    except KeyboardInterrupt as exc:  # convert's says what it kept and how to go on
        message = (exc.cli_message() if isinstance(exc, Interrupted) else str(exc)) or "interrupted"
        print(f"packer: {message}", file=sys.stderr)
        return _failed(args, 130, message)


def run() -> NoReturn:
    """The program ``packer`` (``python -m packer`` and the console scripts): ``main`` on ``sys.argv``, then exit
    with its code. Where obstore's runtime ran in this process (a bucket read or written here: ``convert`` from or
    to a URL, ``doctor``'s link), the process ends with ``os._exit`` once the interpreter's exit work is done
    (``atexit`` handlers, weakref finalizers, output flushed) and before its finalization: tokio threads still
    finishing requests that Ctrl-C or an error cancelled would otherwise find no interpreter and print a Rust
    panic after packer's one line, or abort the process (docs/remote.md, "Known limits")."""
    try:
        code = main()
    except BrokenPipeError:  # stdout's reader went away mid-output (packer info ... | head -1): no traceback
        _stdout_gone()
        code = 1  # the command was cut short (Python's own advice for this case: the signal module's docs)
    end_process(code)


def _stdout_gone() -> None:
    """Point stdout at /dev/null: what is still buffered for a reader that left is dropped, and the interpreter's
    last flush does not print "Exception ignored ... BrokenPipeError"."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def end_process(code: int) -> NoReturn:
    """Exit with ``code``; where obstore's runtime ran in this process, by ``os._exit`` after the ``atexit``
    handlers and the flush of stdout and stderr, without the interpreter's finalization (``run``)."""
    client = sys.modules.get("packer.storage.client")  # imported only where a store was used
    if client is not None and client.runtime_started():
        atexit._run_exitfuncs()  # what exit runs before finalization: temporary folders, child processes, logging
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a closed pipe (packer ... | head): nothing to add
                stream.flush()
        os._exit(code)
    sys.exit(code)


def _failed(args, code: int, message: str) -> int:
    """With ``--json``, a run that failed still prints its document: the envelope and the error (docs/library.md)."""
    if wants_json(args):
        print(json_document(args.command, code, {"error": message}))
    return code
