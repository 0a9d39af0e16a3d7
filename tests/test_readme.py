"""Every code block of README.md runs as pasted, in order, on the `make demo` data made small.

Blocks are fenced with a language: ``sh`` (each line a shell command, must exit 0), ``python``
(run in one interpreter per block, in the same folder), ``console`` (``$ `` lines are commands,
the rest their sample output, not compared: figures differ per machine), ``text`` (synopses with
placeholders, output, and the long measurement commands of examples/: shown, not run). A block
without a language fails the test, so nothing in the README is left unchecked by accident.

The only change to what is pasted: the sample set is 48 images instead of 2,000 (``--count``),
so the whole README runs in about a minute. The commands run in a fresh folder holding the
`make demo` outputs (the Makefile's demo targets, ``DEMO_COUNT`` images) under ``demo/``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COUNT = 48  # images instead of the README's and the Makefile's 2,000
FENCE = re.compile(r"^```(\S*)\s*$")
RUN = {"sh", "python", "console"}


def readme_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line number, language, body) of every fenced block."""
    blocks, lang, start, body = [], None, 0, []
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m and lang is None:
            lang, start, body = m.group(1), n, []
        elif line.strip() == "```" and lang is not None:
            blocks.append((start, lang, "\n".join(body)))
            lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def _small(command: str) -> str:
    return re.sub(r"--count \d[\d,]*", f"--count {COUNT}", command)


def shell_commands(lang: str, body: str) -> list[str]:
    """The commands of an sh or console block, one per logical line, comments kept (bash ignores them)."""
    lines = body.replace("\\\n", " ").splitlines()
    if lang == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    return [_small(line) for line in lines if line.strip() and not line.lstrip().startswith("#")]


def demo_command(demo: Path) -> str:
    """The Makefile's demo, made small (``DEMO_COUNT``), with this interpreter's packer (not the install step)."""
    return shlex.join(["make", "-s", "-C", str(REPO), "demo-datasets", f"{demo}/bench.json", f"DEMO={demo}",
                       f"DEMO_COUNT={COUNT}", f"BIN={Path(sys.executable).parent}"])


def _run(command: str, cwd: Path, env: dict, what: str, ok: tuple[int, ...] = (0,), timeout: int = 300) -> None:
    """Run one command; ``ok``: the exit codes it may end with (console examples: 1 is a finding, see exit codes)."""
    t0 = time.perf_counter()
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    print(f"{time.perf_counter() - t0:6.1f} s  {command}")
    tail = f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode in ok, f"{what}: `{command}` exited {proc.returncode}\n{tail}"
    assert "Traceback" not in proc.stderr, f"{what}: `{command}` printed a traceback\n{proc.stderr[-3000:]}"


def test_every_block_has_a_language():
    untagged = [n for n, lang, _ in readme_blocks((REPO / "README.md").read_text()) if not lang]
    assert not untagged, f"README.md blocks without a language (sh, python, console or text) at lines {untagged}"


@pytest.mark.slow
def test_readme_runs_as_pasted(tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PYTHONWARNINGS": "error::UserWarning"}  # e.g. DataLoader's "num_workers exceeds the cores" warning
    _run(demo_command(tmp_path / "demo"), tmp_path, env, "Makefile demo")
    ran = 0
    for line, lang, body in readme_blocks((REPO / "README.md").read_text()):
        if lang not in RUN:
            continue
        what = f"README.md block at line {line}"
        if lang == "python":
            script = tmp_path / f"readme_{line}.py"
            script.write_text(body + "\n")
            _run(shlex.join([sys.executable, str(script)]), tmp_path, env, what)
        else:
            for command in shell_commands(lang, body):  # a console example may report a finding (exit 1)
                _run(command, tmp_path, env, what, ok=(0, 1) if lang == "console" else (0,))
        ran += 1
    assert ran >= 5
