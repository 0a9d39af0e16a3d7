"""packer's structure as code: the import graph from the source (ast), its layer order, no cycles, and start-up
that does not import torch."""

from __future__ import annotations

import ast
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "packer"

# Lower layers never import higher ones; write/ and read/ are peers that never import each other.
LAYERS = {
    "packer._version": 0, "packer._random": 0, "packer.argtypes": 0, "packer.perprocess": 0, "packer.errors": 0,
    "packer.units": 0, "packer.sysinfo": 0, "packer.pagecache": 0, "packer.progress": 0, "packer.libc": 0,
    "packer.lru": 0, "packer.compiled": 0,
    "packer.storage": 1, "packer.layout": 2, "packer.images": 3, "packer.formats": 4, "packer.write": 5,
    "packer.read": 5, "packer.tools": 6, "packer.dali": 6, "packer.diagnose": 7, "packer.cli": 8, "packer.__main__": 8,
}
PEERS = {("packer.write", "packer.read"), ("packer.read", "packer.write")}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, known: set[str], typing_too: bool = False) -> set[str]:
    """Every packer module ``path`` imports, at any depth (function-level imports too); imports under
    ``if TYPE_CHECKING:`` never run, so they are left out unless ``typing_too``."""
    found: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                   for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only and not typing_too:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("packer"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("packer") and not node.level:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
    return found


def layer_of(module: str) -> tuple[str, int]:
    for prefix, layer in sorted(LAYERS.items(), key=lambda kv: -len(kv[0])):
        if module == prefix or module.startswith(prefix + "."):
            return prefix, layer
    raise AssertionError(f"{module}: in no layer of tests/test_structure.py's LAYERS (add it)")


def graph(typing_too: bool = False) -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    # packer/__init__.py is the lazy public facade: nothing inside packer may import through it
    return {m: imports_of(p, known, typing_too) for m, p in mods.items() if m != "packer"}


def test_nothing_inside_packer_imports_the_public_facade():
    offenders = sorted(m for m, deps in graph().items() if "packer" in deps)
    assert not offenders, f"import from packer's submodules, not from the lazy facade 'packer': {offenders}"


def test_imports_follow_the_layer_order():
    wrong = []
    for mod, deps in graph().items():
        (home, layer) = layer_of(mod)
        for dep in deps - {"packer"}:
            (dep_home, dep_layer) = layer_of(dep)
            if dep_layer > layer or (home, dep_home) in PEERS:
                wrong.append(f"{mod} -> {dep}")
    assert not wrong, "imports against the layer order:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles():
    g = graph()
    for deps in g.values():  # a package's __init__ is part of importing its submodules: follow both
        deps.discard("packer")
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(g.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for mod in sorted(g):
        if mod not in state:
            visit(mod, [mod])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def circles(g: dict[str, set[str]]) -> list[frozenset[str]]:
    """The import circles of ``g``: each set of modules that reach one another (Tarjan's strongly connected
    components of more than one module, or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in sorted(g.get(node, ())):
            if dep not in g:
                continue
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            members = {stack.pop()}
            while node not in members:
                members.add(stack.pop())
            if len(members) > 1 or node in g[node]:
                found.append(frozenset(members))

    for mod in sorted(g):
        if mod not in index:
            visit(mod)
    return found


# Circles through type-only imports still to remove; reported below, not failed (none left).
KNOWN_TYPE_ONLY_CIRCLES: set[frozenset[str]] = set()


def test_no_import_circles_even_through_type_only_imports():
    """A ``TYPE_CHECKING`` import never runs, but two modules naming each other's types are one concept split
    in two (or an interface in the wrong module): no circle at all, type-only imports counted."""
    g = graph(typing_too=True)
    for deps in g.values():
        deps.discard("packer")
    found = circles(g)
    for known in sorted(set(found) & KNOWN_TYPE_ONLY_CIRCLES, key=sorted):
        warnings.warn(f"known type-only import circle, to be removed: {' <-> '.join(sorted(known))}", stacklevel=1)
    unexpected = [" <-> ".join(sorted(c)) for c in found if c not in KNOWN_TYPE_ONLY_CIRCLES]
    assert not unexpected, "import circles (type-only imports counted):\n" + "\n".join(unexpected)


def test_the_circle_finder_sees_type_only_and_long_circles(tmp_path):
    """The checker itself: a circle through a ``TYPE_CHECKING`` import counts; so does one of three modules."""
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from packer.layout.index import Index\n")
    assert imports_of(src, {"packer.layout.index"}, typing_too=True) == {"packer.layout.index"}
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"d"}}
    assert sorted(map(sorted, circles(g))) == [["a", "b", "c"], ["e"]]


def test_the_graph_sees_function_level_imports(tmp_path):
    """The checker itself: a lazy import inside a function counts, a typing-only one does not."""
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from packer.layout.index import Index\n"
                   "def f():\n    from packer.read.dataset import open_dataset\n")
    assert imports_of(src, {"packer.read.dataset", "packer.layout.index"}) == {"packer.read.dataset"}


@pytest.mark.parametrize("argv", [["--help"], ["convert", "--help"], ["info", "{ds}"], ["info", "{ds}", "--json"]])
def test_help_and_info_do_not_import_torch(argv, tmp_path):
    ds = tmp_path / "d.lmdb"
    if "{ds}" in argv:
        from support.imagesets import make_imagefolder

        from packer import convert

        convert(make_imagefolder(tmp_path / "imgs"), ds, to="lmdb", workers=0, progress=False)
    code = ("import sys; from packer.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    res = subprocess.run([sys.executable, "-c", code, *(a.format(ds=ds) for a in argv)], capture_output=True,
                         text=True, cwd=PACKAGE.parent, timeout=120)
    assert res.stdout.strip().splitlines()[-1] == "NO-TORCH", res.stdout + res.stderr


def test_reading_a_dataset_imports_no_other_formats_library(tmp_path):
    """A DataLoader worker spawned for an lmdb dataset imports packer.read.dataset anew: h5py (~0.2 s) only loads
    where an hdf5 dataset is read."""
    from support.imagesets import make_imagefolder

    from packer import convert

    imgs = make_imagefolder(tmp_path / "imgs")
    for fmt in ("lmdb", "hdf5"):
        convert(imgs, tmp_path / f"d.{fmt}", to=fmt, workers=0, progress=False)
    code = ("import sys\nfrom packer.read.dataset import open_dataset\n"
            "assert 'h5py' not in sys.modules, 'imported with packer.read.dataset'\n"
            f"open_dataset({str(tmp_path / 'd.lmdb')!r}, image='numpy')[0]\n"
            "assert 'h5py' not in sys.modules, 'imported by reading lmdb'\n"
            f"open_dataset({str(tmp_path / 'd.hdf5')!r}, image='numpy')[0]\n"
            "assert 'h5py' in sys.modules\nprint('OK')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent, timeout=120)
    assert res.stdout.strip() == "OK", res.stderr


def test_every_public_name_resolves_and_stays_lazy():
    """``packer.X`` for every name in ``__all__`` loads its module on first use; importing packer loads none."""
    code = ("import sys, packer\n"
            "assert 'packer.read.dataset' not in sys.modules and 'torch' not in sys.modules\n"
            "names = packer.__all__\n"
            "assert {'convert', 'open_dataset', 'LMDBDataset', 'MosaicDataset', 'BlockShuffleSampler'} <= set(names)\n"
            "missing = [n for n in names if getattr(packer, n, None) is None]\n"
            "assert not missing, missing\n"
            "ns = {}; exec('from packer import *', ns)\n"
            "assert ns['LMDBDataset'].__name__ == 'LMDBDataset'\n"
            "print('OK')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent, timeout=120)
    assert res.stdout.strip() == "OK", res.stderr
