"""The code blocks of a Markdown page, run in order as a reader pastes them (tests/test_readme.py, the formats pages).

A block is fenced with its language: ``sh`` (each logical line a shell command, which must exit 0), ``console``
(``$ `` lines are commands, the rest their sample output, not compared), ``python`` (one interpreter per block), or
``text`` (output, exit codes, layouts: never a command, ``text_commands`` finds any). A block that cannot run on
a test machine (a cluster, a GPU, object storage, the whole suite) starts with a comment line the reader sees too,
``# needs: WHAT``: it is reported, never run. Commands run in a folder that stands for the checkout (``checkout``):
the repository's files linked in, a ``.venv`` whose ``bin`` is this interpreter's, so ``make`` installs nothing.
The only changes to what is pasted are a page's explicit ``Substitution`` table (smaller counts, fewer repeats).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(\S*)\s*$")
RUN = ("sh", "console", "python")
NEEDS = re.compile(r"^#\s*needs:\s*(\S.*)$")
# what a command line starts with: a `text` block holding one hides a command from the test
COMMAND = re.compile(r"^(\$ |(packer|packer-images|python3?|pip|make|dask|pytest|torchrun|cd|export)\s|\.venv/|"
                     r"from \w|import \w)")
# the repository's files a page's commands use, linked into the stand-in checkout (outputs stay in the temp folder)
CHECKOUT = ("Makefile", "pyproject.toml", "setup.py", "packer", "examples", "tests", "requirements", "docs",
            "README.md")


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence
    lang: str
    body: str

    @property
    def needs(self) -> str | None:
        """What the block needs that a test machine lacks, from its first line ``# needs: ...``; None: it runs."""
        first = next((line.strip() for line in self.body.splitlines() if line.strip()), "")
        m = NEEDS.match(first)
        return m.group(1) if m else None


@dataclass(frozen=True)
class Substitution:
    """One change to what is pasted, applied to every shell command: ``pattern`` -> ``replacement``, and why."""

    pattern: str
    replacement: str
    why: str

    def apply(self, command: str) -> str:
        return re.sub(self.pattern, self.replacement, command)


def blocks(text: str) -> list[Block]:
    """Every fenced block of a Markdown text, in order."""
    found, lang, start, body = [], None, 0, []
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m and lang is None:
            lang, start, body = m.group(1), n, []
        elif line.strip() == "```" and lang is not None:
            found.append(Block(start, lang, "\n".join(body)))
            lang = None
        elif lang is not None:
            body.append(line)
    return found


def text_commands(block: Block) -> list[str]:
    """The lines of a ``text`` block that read as commands (a block to run, or to mark ``# needs:``)."""
    return [line for line in block.body.splitlines() if COMMAND.match(line.lstrip())] if block.lang == "text" else []


def commands(block: Block, substitutions: tuple[Substitution, ...] = ()) -> list[str]:
    """The commands of an ``sh`` or ``console`` block, one per logical line, each with the substitutions applied;
    comment lines left out (a command's own trailing comment stays: bash ignores it)."""
    lines = block.body.replace("\\\n", " ").splitlines()
    if block.lang == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    out = []
    for line in lines:
        if line.strip() and not line.lstrip().startswith("#"):
            for s in substitutions:
                line = s.apply(line)
            out.append(line)
    return out


def checkout(where: Path) -> Path:
    """A folder standing for the checkout the pages' commands run in: the repository's files linked in, and a
    ``.venv`` whose ``bin`` is this interpreter's with a fresh install stamp (``make`` then installs nothing)."""
    where.mkdir(parents=True, exist_ok=True)
    for name in CHECKOUT:
        (where / name).symlink_to(REPO / name)
    venv = where / ".venv"
    venv.mkdir()
    (venv / "bin").symlink_to(Path(sys.executable).parent)
    (venv / ".installed").touch()  # newer than pyproject.toml and the rest the Makefile's install depends on
    return where


def environment() -> dict[str, str]:
    """This interpreter's commands first on PATH, this checkout's packer on PYTHONPATH; DataLoader's warnings
    (e.g. more workers than cores) are errors, as a pasted block must not print them."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "PYTHONWARNINGS": "error::UserWarning"}


def run(command: str, cwd: Path, env: dict, what: str, ok: tuple[int, ...] = (0,), timeout: int = 300) -> str:
    """Run one command, returning its output; ``ok``: the exit codes it may end with (console examples: 1 is a
    finding, see exit codes)."""
    t0 = time.perf_counter()
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    print(f"{time.perf_counter() - t0:6.1f} s  {command}")
    tail = f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode in ok, f"{what}: `{command}` exited {proc.returncode}\n{tail}"
    assert "Traceback" not in proc.stderr, f"{what}: `{command}` printed a traceback\n{proc.stderr[-3000:]}"
    return proc.stdout


def run_page(page: Path, cwd: Path, substitutions: tuple[Substitution, ...] = (), timeout: int = 300,
             epilogue: str = "") -> dict:
    """Every block of ``page`` in order, in ``cwd``: {"ran": blocks run, "needs": [(line, what)] of those not run,
    "stdout": what they printed}. ``epilogue``: the test's own Python, run after each python block in its
    interpreter (to check what the block read)."""
    env, ran, needs, printed = environment(), 0, [], []
    for block in blocks(page.read_text(encoding="utf-8")):
        if block.lang not in RUN:
            continue
        what = f"{page.name} block at line {block.line}"
        if block.needs:
            print(f"not run: {what}: needs {block.needs}")
            needs.append((block.line, block.needs))
            continue
        if block.lang == "python":
            script = cwd / f"{page.stem}_{block.line}.py"
            script.write_text(block.body + "\n\n" + epilogue)
            printed.append(run(shlex.join([sys.executable, str(script)]), cwd, env, what, timeout=timeout))
        else:
            for command in commands(block, substitutions):  # a console example may report a finding (exit 1)
                printed.append(run(command, cwd, env, what, ok=(0, 1) if block.lang == "console" else (0,),
                                   timeout=timeout))
        ran += 1
    return {"ran": ran, "needs": needs, "stdout": "".join(printed)}
