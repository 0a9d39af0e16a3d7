"""One home per lower-layer concept, as code: each is spelled out in one module and used from there. Read from the
source with ``ast`` (docstrings and comments may still name the concepts): a second copy fails here."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "packer"


def _modules(root: Path) -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(root.rglob("*.py")):
        yield path.relative_to(root).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the docstring constants of a module and of its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def where(found: Callable[[ast.AST], bool], root: Path = PACKAGE) -> set[str]:
    """The modules (relative to packer/) in whose code, docstrings left out, some node is ``found``."""
    out = set()
    for rel, tree in _modules(root):
        skip = _docstrings(tree)
        if any(id(node) not in skip and found(node) for node in ast.walk(tree)):
            out.add(rel)
    return out


def _call_of(node: ast.AST, name: str) -> bool:
    """A call of ``name`` or of ``anything.name``."""
    return isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Name) and node.func.id == name)
        or (isinstance(node.func, ast.Attribute) and node.func.attr == name))


def _constant_starting(node: ast.AST, *prefixes: str | bytes) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)) and any(
        type(node.value) is type(p) and node.value.startswith(p) for p in prefixes)  # type: ignore[arg-type]


def test_the_checker_finds_code_and_not_docstrings(tmp_path):
    (tmp_path / "a.py").write_text('"""mentions /proc/meminfo and find_library"""\nX = f"/proc/{1}"\n')
    (tmp_path / "b.py").write_text('"""/proc/meminfo"""\ndef f():\n    """find_library("c")"""\n    return 1\n')
    assert where(lambda n: _constant_starting(n, "/proc"), tmp_path) == {"a.py"}
    assert where(lambda n: _call_of(n, "find_library"), tmp_path) == set()


def test_libc_is_loaded_and_declared_in_one_module():
    assert where(lambda n: _call_of(n, "find_library")) == {"libc.py"}
    # the page-cache question: pagecache.py (diagnose's residency and read-ahead's both ask it)
    assert where(lambda n: isinstance(n, ast.Attribute) and n.attr == "mincore") <= {"libc.py", "pagecache.py"}


def test_one_lru_class():
    assert where(lambda n: isinstance(n, ast.Attribute) and n.attr in ("move_to_end", "popitem")) == {"lru.py"}


def test_files_are_opened_checked_and_mapped_in_one_module():
    def maps_a_file(node: ast.AST) -> bool:  # mmap.mmap(fd, ...); an anonymous map (fd -1) is memory, not a file
        return _call_of(node, "mmap") and not (isinstance(node, ast.Call) and node.args and isinstance(
            node.args[0], ast.UnaryOp) and isinstance(node.args[0].operand, ast.Constant))

    # pagecache maps a file only to ask mincore about it (layer 0: below formats/)
    assert where(maps_a_file) == {"formats/filemap.py", "pagecache.py"}
    defined = where(lambda n: isinstance(n, ast.FunctionDef) and n.name in ("check_size", "map_readonly", "map_array"))
    assert {m for m in defined if m.startswith("formats/")} == {"formats/filemap.py"}  # images/: an image's size


def test_image_magic_numbers_live_in_one_table():
    found = where(lambda n: _constant_starting(n, b"\xff\xd8", b"\x89PNG", b"GIF8"))
    assert found == {"images/magic.py"}


def test_the_compiled_extensions_are_imported_in_one_module():
    extensions = {p.stem for p in PACKAGE.rglob("_*.c")}
    assert extensions >= {"_jpegregion", "_safecopy"}

    def imports_an_extension(node: ast.AST) -> bool:
        names = [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
        module = (node.module or "") if isinstance(node, ast.ImportFrom) else ""
        return any(part in extensions for name in [*names, module] for part in name.split("."))

    def names_an_extension(node: ast.AST) -> bool:  # importlib's way
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and any(
            part in extensions for part in node.value.split("."))

    assert where(imports_an_extension) == set()
    assert where(names_an_extension) == {"compiled.py"}


def test_proc_is_read_in_one_module():
    def names_proc(node: ast.AST) -> bool:
        return _constant_starting(node, "/proc")

    assert where(names_proc) == {"sysinfo.py"}
