import pytest
from support.storage_servers import Emulated, make_bucket, moto_server


@pytest.fixture(scope="session")
def moto_endpoint():
    """moto's S3 server for the whole session (a bucket per test: see ``bucket``)."""
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def bucket(moto_endpoint, request):
    """A fresh bucket in moto, named after the test."""
    name = "t-" + "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:50].strip("-")
    make_bucket(moto_endpoint, name)
    return name


@pytest.fixture(scope="session")
def emulated(tmp_path_factory):
    """The emulated store (no latency, no limit) over a session folder; faults cleared after each test."""
    server = Emulated(tmp_path_factory.mktemp("emulated"))
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _no_faults_left(request):
    yield
    if "emulated" in request.fixturenames:
        request.getfixturevalue("emulated").faults.clear()
