"""What a type checker sees of packer: real types for the public names (pyright on a user's script), the names
it sees the same as those that load at run time, and the PEP 561 marker."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import packer

ROOT = Path(__file__).resolve().parent.parent
PYRIGHT = Path(sys.executable).parent / "pyright"  # the dev extra installs it beside the interpreter

USER_SCRIPT = '''\
import packer

ds = packer.open_dataset("imgs.lmdb", image="numpy")
reveal_type(ds)
reveal_type(packer.open_dataset("imgs.lmdb", cache="ram"))
reveal_type(packer.BlockShuffleSampler(ds, batch_size=64))
reveal_type(packer.convert("imgs", "imgs.lmdb", to="hdf5"))
reveal_type(packer.LMDBDataset)
count: str = packer.convert("imgs").num_samples  # a deliberate mistake: an int
packer.open_dataset("imgs.lmdb", image="jpeg")  # another: not one of pil, numpy, tensor
'''


def run_pyright(tmp_path: Path, script: str) -> list[dict]:
    """pyright's diagnostics on ``script`` as a user's file outside the repository, packer found on its path."""
    assert PYRIGHT.exists(), f"{PYRIGHT}: pyright is missing (pip install -e '.[dev]')"
    (tmp_path / "user.py").write_text(script)
    (tmp_path / "pyrightconfig.json").write_text(json.dumps(
        {"extraPaths": [str(ROOT)], "pythonVersion": "3.11", "typeCheckingMode": "basic"}))
    res = subprocess.run([str(PYRIGHT), "--outputjson", "--pythonpath", sys.executable, "user.py"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    return json.loads(res.stdout)["generalDiagnostics"]


def test_pyright_sees_the_real_types_of_the_public_api(tmp_path):
    diags = run_pyright(tmp_path, USER_SCRIPT)
    by_line: dict[int, list[dict]] = {}
    for d in diags:
        by_line.setdefault(d["range"]["start"]["line"] + 1, []).append(d)
    revealed = {n: d["message"] for n, ds in by_line.items() for d in ds if d["message"].startswith("Type of")}
    assert revealed[4].endswith('is "PackedDataset"'), revealed
    assert revealed[5].endswith('is "CachedDataset"'), revealed
    assert revealed[6].endswith('is "BlockShuffleSampler"'), revealed
    assert revealed[7].endswith('is "ConvertResult"'), revealed
    assert revealed[8].endswith('is "type[PackedDataset]"'), revealed
    errors = {n: [d["message"] for d in ds if d["severity"] == "error"] for n, ds in by_line.items()}
    assert any('"int" is not assignable to "str"' in m for m in errors.get(9, [])), diags
    assert any("Literal['jpeg']" in m and '"image"' in m for m in errors.get(10, [])), diags
    assert not [m for n, ms in errors.items() if n not in (9, 10) for m in ms], diags  # nothing else, no Unknown import


def type_checking_names() -> set[str]:
    """The names ``packer/__init__.py`` imports or declares under ``if TYPE_CHECKING:``."""
    tree = ast.parse((ROOT / "packer" / "__init__.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    names = set()
    for node in block.body:
        if isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_type_checkers_see_every_name_that_loads_at_run_time():
    """The ``TYPE_CHECKING`` block and the lazy table (plus the registry's dataset classes) list the same names."""
    from packer.formats import FORMATS

    at_run_time = set(packer._PUBLIC) | packer._SUBMODULES | {f.dataset_class for f in FORMATS.values()}
    assert type_checking_names() == at_run_time


def test_the_pep_561_marker_is_in_the_package():
    """(tests/test_packaging.py checks that a built wheel holds it.)"""
    assert (ROOT / "packer" / "py.typed").is_file()


@pytest.mark.parametrize("name", ["open_dataset", "convert", "Writer", "BlockShuffleSampler", "ThreadLoader"])
def test_public_names_are_the_defining_modules_objects(name):
    """What pyright reads (the TYPE_CHECKING import) is what ``packer.<name>`` gives at run time."""
    module = packer._PUBLIC[name]
    assert getattr(packer, name) is getattr(__import__(module, fromlist=[name]), name)
