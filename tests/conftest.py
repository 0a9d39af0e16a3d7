import pytest
from imagesets import make_flat, make_imagefolder


@pytest.fixture(scope="session")
def imagefolder(tmp_path_factory):
    """3 classes x 5 small JPEGs, shared read-only by the tests of a session."""
    return make_imagefolder(tmp_path_factory.mktemp("src") / "imgs")


@pytest.fixture(scope="session")
def flatfolder(tmp_path_factory):
    return make_flat(tmp_path_factory.mktemp("flat") / "flat")


def pytest_addoption(parser):
    parser.addoption("--fuzz-cases", type=int, default=120,
                     help="mutated datasets tried per format and payload in tests/test_fuzz.py (make fuzz: 5000)")
