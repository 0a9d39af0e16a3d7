"""README.md as pasted: every sh, console and python block runs, in order, in a folder standing for the checkout
(tests/support/pasted.py), so a block that cannot be pasted after the ones above it fails here. A block that
cannot run on a test machine says so to the reader in its first line (``# needs: ...``) and is reported, not
run; a ``text`` block holds no command; a block without a language fails.

The only changes to what is pasted are in ``SUBSTITUTIONS`` below: 48 sample photos instead of 2,000, one
timed repeat and 4 profiled batches, so the whole README runs in a few minutes.
"""

from __future__ import annotations

import re

import pytest
from support.pasted import REPO, Substitution, blocks, checkout, commands, run_page, text_commands

README = REPO / "README.md"
COUNT = 48
SUBSTITUTIONS = (
    Substitution(r"--count 2,?000\b", f"--count {COUNT}", "the sample set: 48 photos, not 2,000"),
    Substitution(r"^make demo\b", f"make demo DEMO_COUNT={COUNT}", "make demo's sample set, the same 48"),
    Substitution(r"--repeats \d+", "--repeats 1", "one timed repeat of each measurement, not 3"),
    Substitution(r"--batches \d+", "--batches 4", "4 timed batches per packer profile setting, not 20: 48 photos "
                 "fill 1.5 batches of 32, and each setting's wait and verdict are computed the same"),
)


def test_every_block_has_a_language():
    untagged = [b.line for b in blocks(README.read_text()) if not b.lang]
    assert not untagged, f"README.md blocks without a language (sh, python, console or text) at lines {untagged}"


def test_no_text_block_hides_a_command():
    """A command shown as ``text`` was never run by this test: it goes in an sh block, marked ``# needs:`` if it
    cannot run here (a synopsis with ``[...]`` goes in the prose)."""
    hidden = [f"line {b.line}: {line}" for b in blocks(README.read_text()) for line in text_commands(b)]
    assert not hidden, "commands in README.md text blocks:\n" + "\n".join(hidden)


def test_the_substitutions_only_make_the_run_smaller():
    """Each substitution changes at least one pasted command, and nothing but counts, repeats and make's count."""
    pasted = [c for b in blocks(README.read_text()) if b.lang in ("sh", "console") and not b.needs
              for c in commands(b)]
    for s in SUBSTITUTIONS:
        changed = [(c, s.apply(c)) for c in pasted if s.apply(c) != c]
        assert changed, f"{s.pattern}: changes no command of README.md ({s.why})"
        for before, after in changed:
            assert re.sub(r"\d[\d,]*", "N", before).replace("make demo", "make demo DEMO_COUNT=N") == \
                re.sub(r"\d[\d,]*", "N", after), (before, after)


def test_make_demo_is_described_by_what_the_makefile_packs():
    """The README's `make demo` line names the formats the Makefile's demo packs (it once said "every format"
    and packed 5 of 9)."""
    from packer.formats import FORMATS

    packed = re.search(r"^DEMO_SETS := \$\(foreach f,([\w ]+),", (REPO / "Makefile").read_text(), re.M)
    assert packed, "DEMO_SETS not found in the Makefile"
    demo = packed.group(1).split()
    lines = [line for b in blocks(README.read_text()) for line in b.body.splitlines()]
    line = next(line for line in lines if line.startswith("make demo"))
    if "every format" in line:
        assert set(demo) == set(FORMATS), (demo, line)
    else:
        assert all(re.search(rf"\b{f}\b", line) for f in demo), (demo, line)


@pytest.mark.slow
def test_readme_runs_as_pasted(tmp_path):
    done = run_page(README, checkout(tmp_path / "checkout"), SUBSTITUTIONS)
    assert done["ran"] >= 10
    assert all(what for _, what in done["needs"])
