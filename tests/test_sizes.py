"""Size limits as code (the redesign issue): no module in packer/ over 450 lines, no function or method over 80
lines. Measured from the source with ``ast``: a function's length runs from its ``def`` line to its last line
(decorators not counted, its docstring and nested functions counted)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "packer"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80

# What is still over, each entry at most its present size (none today). Delete an entry once it is under the
# limit; the test fails on an entry that no longer applies.
ALLOWED_MODULES: dict[str, int] = {}
ALLOWED_FUNCTIONS: dict[str, int] = {}  # "folder/module.py:Class.method" -> lines


def _rel(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def module_lengths() -> dict[str, int]:
    return {_rel(p): len(p.read_text(encoding="utf-8").splitlines()) for p in sorted(PACKAGE.rglob("*.py"))}


def function_lengths() -> dict[str, int]:
    """``module.py:Qualified.name`` -> lines, for every function and method (nested ones too)."""
    out: dict[str, int] = {}

    def walk(node: ast.AST, rel: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[f"{rel}:{prefix}{child.name}"] = (child.end_lineno or child.lineno) - child.lineno + 1
                walk(child, rel, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, rel, f"{prefix}{child.name}.")
            else:
                walk(child, rel, prefix)

    for path in sorted(PACKAGE.rglob("*.py")):
        walk(ast.parse(path.read_text(encoding="utf-8")), _rel(path), "")
    return out


def _over(lengths: dict[str, int], limit: int, allowed: dict[str, int]) -> list[str]:
    return [f"{name}: {n} lines (limit {limit}{f', allowed {allowed[name]}' if name in allowed else ''})"
            for name, n in sorted(lengths.items()) if n > max(limit, allowed.get(name, 0))]


def test_no_module_over_the_limit():
    over = _over(module_lengths(), MAX_MODULE_LINES, ALLOWED_MODULES)
    assert not over, "modules too long (split them by job):\n" + "\n".join(over)


def test_no_function_over_the_limit():
    over = _over(function_lengths(), MAX_FUNCTION_LINES, ALLOWED_FUNCTIONS)
    assert not over, "functions too long (split them):\n" + "\n".join(over)


def test_the_allow_lists_hold_only_what_is_still_over_in_write_and_read():
    for allowed, lengths, limit in ((ALLOWED_MODULES, module_lengths(), MAX_MODULE_LINES),
                                    (ALLOWED_FUNCTIONS, function_lengths(), MAX_FUNCTION_LINES)):
        for name in allowed:
            assert name.startswith(("write/", "read/")), f"{name}: only write/ and read/ may be allow-listed"
            assert lengths.get(name, 0) > limit, f"{name} is within the limit now: delete its allow-list entry"


def test_the_dataset_class_stays_small():
    """PackedDataset is the ImageFolder surface plus one batch pipeline over a source (issue 41): reading, decoding,
    batches and read-ahead live in the source and the pipeline, not as hooks of the dataset."""
    tree = ast.parse((PACKAGE / "read" / "dataset.py").read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PackedDataset")
    assert (cls.end_lineno or 0) - cls.lineno + 1 <= 200
