"""Size tripwires, not a design rule: a module of over 800 lines or a function of over 120 is a grab-bag in the
making, and this fails before it grows further. Below them a file is split where it holds two concepts, and the
split names the concept each part holds (docs/architecture.md, "Splitting a module"), never to meet a line count;
the layer order (tests/test_structure.py) is what keeps the folders apart. Measured from the source with ``ast``: a
function's length runs from its ``def`` line to its last line (decorators not counted, its docstring and nested
functions counted)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "packer"
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 120
MAX_DATASET_CLASS_LINES = 260


def module_lengths() -> dict[str, int]:
    return {p.relative_to(PACKAGE).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
            for p in sorted(PACKAGE.rglob("*.py"))}


def function_lengths(root: Path = PACKAGE) -> dict[str, int]:
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

    for path in sorted(root.rglob("*.py")):
        walk(ast.parse(path.read_text(encoding="utf-8")), path.relative_to(root).as_posix(), "")
    return out


def _over(lengths: dict[str, int], limit: int) -> list[str]:
    return [f"{name}: {n} lines (tripwire {limit})" for name, n in sorted(lengths.items()) if n > limit]


def test_no_module_past_the_tripwire():
    over = _over(module_lengths(), MAX_MODULE_LINES)
    assert not over, "modules past the tripwire (split by concept, and name it):\n" + "\n".join(over)


def test_no_function_past_the_tripwire():
    over = _over(function_lengths(), MAX_FUNCTION_LINES)
    assert not over, "functions past the tripwire (split them):\n" + "\n".join(over)


def test_the_measure_counts_what_it_says(tmp_path):
    (tmp_path / "m.py").write_text('import os\n\n\nclass A:\n    @staticmethod\n    def f():\n        """doc"""\n\n'
                                   '        def g():\n            return 1\n        return g\n')
    # def to return, the decorator left out, the docstring and the nested g counted
    assert function_lengths(tmp_path) == {"m.py:A.f": 6, "m.py:A.f.g": 2}


def test_the_dataset_class_stays_small():
    """PackedDataset is the ImageFolder surface plus one batch pipeline over a source (issue 41): reading, decoding,
    batches and read-ahead live in the source and the pipeline, not as hooks of the dataset."""
    tree = ast.parse((PACKAGE / "read" / "dataset.py").read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PackedDataset")
    assert (cls.end_lineno or 0) - cls.lineno + 1 <= 200
