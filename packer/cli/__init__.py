"""Command line: argparse only. ``parser.py`` builds the parser, one ``_add_<name>(sub)`` per subcommand;
``commands.py`` has one ``cmd_<name>(args) -> int`` per subcommand; the work lives elsewhere.

Exit codes: see ``EXIT_CODES`` (``packer --help``). Numeric options are checked by their argparse
type (out of range: a usage error, exit 2) before any work starts.
"""

from __future__ import annotations

import sys
import warnings

from packer.cli.parser import EXIT_CODES, build_parser
from packer.errors import IndexingWarning, PackerError, RunError

__all__ = ["EXIT_CODES", "build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", IndexingWarning)  # for library users: `packer info` says it in words
            return args.func(args)
    except PackerError as exc:
        print(f"packer: error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, RunError) else 2  # ResumableError is a RunError
    except KeyboardInterrupt as exc:  # convert's says what it kept and how to go on
        print(f"packer: {str(exc) or 'interrupted'}", file=sys.stderr)
        return 130
