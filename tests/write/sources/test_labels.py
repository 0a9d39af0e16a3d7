"""The one label rule every source and the Writer apply (packer.write.sources.labels)."""

from __future__ import annotations

import pytest

from packer.write.sources.labels import MAX_IMPLICIT_CLASSES, integer_classes, label_problem, parse_label

ABOVE = "above 1,048,575: give --classes-file to name its classes"


@pytest.mark.parametrize(("text", "named", "want"), [
    ("0", None, 0), (" 7\n", None, 7), (b"12", None, 12), ("-0", None, 0), ("0007", None, 7),
    (str(MAX_IMPLICIT_CLASSES - 1), None, MAX_IMPLICIT_CLASSES - 1),
    (str(MAX_IMPLICIT_CLASSES), None, f"label {MAX_IMPLICIT_CLASSES} {ABOVE}"),
    (str(MAX_IMPLICIT_CLASSES), MAX_IMPLICIT_CLASSES + 1, MAX_IMPLICIT_CLASSES),  # named classes: no bound
    ("5", 5, "label 5 is not one of the 5 classes (0..4)"),
    ("99999999999999999999", None, f"label 99999999999999999999 {ABOVE}"),
    ("9" * 10**6, None, f"label {'9' * 36}... (1000000 characters) {ABOVE}"),  # judged by its length
    ("9" * 10**6, 3, f"label {'9' * 36}... (1000000 characters) is not one of the 3 classes (0..2)"),
    ("-" + "9" * 10**6, None, f"label -{'9' * 35}... (1000001 characters): negative, not a class index"),
    ("-1", None, "label -1: negative, not a class index"), ("", None, "empty label"),
    ("1.0", None, "label '1.0': not an integer"), ("+1", None, "label '+1': not an integer"),
    ("\u0663", None, "label '\u0663': not an integer"), (b"\xff", None, "label '\ufffd': not an integer"),
])
def test_parse_label(text, named, want):
    assert parse_label(text, named) == want


def test_label_problem_and_classes():
    assert label_problem(2**100, None) == f"label {2**100} {ABOVE}"
    assert label_problem(10**5000, None) == f"label of 16610 bits {ABOVE}"  # str() would raise
    assert label_problem(3, None, hint="pass classes=") is None
    assert label_problem(MAX_IMPLICIT_CLASSES, None, hint="pass classes=") == \
        "label 1048576 above 1,048,575: pass classes= to name its classes"
    assert integer_classes([2, 0], None) == ["0", "1", "2"] and integer_classes([], None) == []
    assert integer_classes([5], ["a", "b"]) == ["a", "b"]
