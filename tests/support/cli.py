"""Run packer's command line as a user would, with this checkout's packer: in this interpreter through
``packer.cli.main`` (what ``python -m packer`` runs), or in a subprocess where the test is about the process."""

import contextlib
import io
import os
import subprocess
import sys
import traceback
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args, process: bool = False, **kw) -> subprocess.CompletedProcess:
    """``packer *args``: its exit code, stdout and stderr. In this interpreter unless ``process`` (an interpreter
    start-up per call was most of the CLI tests' time); ``process=True`` (or any subprocess keyword, e.g. a
    timeout) runs ``python -m packer`` in a subprocess, for tests of what only a process shows."""
    if process or kw:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        return subprocess.run([sys.executable, "-m", "packer", *map(str, args)], capture_output=True, text=True,
                              env=env, **kw)
    return run_in_process([str(a) for a in args])


def run_in_process(argv: list[str]) -> subprocess.CompletedProcess:
    """``packer.cli.main(argv)`` as ``python -m packer`` would end: the code it returns or exits with (1, with the
    traceback on stderr, for an exception it lets out), and warnings printed on stderr under Python's default
    filters (not pytest's)."""
    from packer.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            warnings.catch_warnings(record=True) as shown:
        warnings.resetwarnings()
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)  # Python's defaults, as a fresh interpreter has them
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's usage errors (2), --help, --version
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if not isinstance(e.code, int | None):
                print(e.code, file=sys.stderr)
        except Exception:  # noqa: BLE001  # as the interpreter ends on an uncaught exception
            traceback.print_exc()
            code = 1
        for w in shown:
            err.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line))
    return subprocess.CompletedProcess(["packer", *argv], code, out.getvalue(), err.getvalue())
