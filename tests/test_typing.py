"""What a type checker sees of packer: real types for the public names (pyright on a user's script), the names
it sees the same as those that load at run time, and the PEP 561 marker."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from support.typecheck import USER_SCRIPT, check_real_types, run_pyright

import packer

ROOT = Path(__file__).resolve().parent.parent


def test_pyright_sees_the_real_types_of_the_public_api(tmp_path):
    check_real_types(run_pyright(tmp_path, USER_SCRIPT))


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
