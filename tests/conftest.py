import signal
from pathlib import Path

import pytest
from support import procs
from support import spawned as spawned_probes
from support.imagesets import make_flat, make_imagefolder
from support.storage_servers import Emulated, make_bucket, moto_server


def pytest_addoption(parser):
    # `make test` passes this in CI and wherever ldconfig lists libturbojpeg: the libjpeg-turbo
    # path must then really run, so tests that need it fail instead of skipping.
    parser.addoption("--require-turbojpeg", action="store_true",
                     help="fail (not skip) when libturbojpeg does not load")
    parser.addoption("--require-jpegregion", action="store_true",
                     help="fail (not skip) when the JPEG region decoder (packer.images._jpegregion) isn't built")
    # `make test` passes this in CI: the cloud emulators (tests/support/emulators.py) must be installed, so the
    # gs:// and az:// tests fail instead of skipping without them.
    parser.addoption("--require-emulators", action="store_true",
                     help="fail (not skip) when a storage emulator (Azurite) is not installed")
    parser.addoption("--fuzz-cases", type=int, default=120,
                     help="mutated datasets tried per format and payload in tests/test_fuzz.py (make fuzz: 5000)")
    # `make test-fast`: the tests that start no process (tests/support/procs.py)
    parser.addoption("--no-procs", action="store_true",
                     help="leave out the tests of tests/procs.txt (they start processes) and fail any other that "
                          "starts one")
    parser.addoption("--procs-log", type=Path, default=None,
                     help="with --no-procs: append the id of each test that started a process to this file")


def pytest_configure(config):
    config.addinivalue_line("markers", "procs: starts a process (listed in tests/procs.txt); make test-fast leaves "
                                       "it out")
    if config.getoption("--no-procs"):
        config.stash[GUARD] = procs.Guard(config.getoption("--procs-log"))
    # Started in the background by a shell without job control (nohup ... &, some CI runners), the suite inherits
    # SIGINT ignored, and so would every child it starts (an ignored signal stays ignored across exec), so the
    # tests that press Ctrl-C in a child could see nothing happen. A handler is reset to the default by exec.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


GUARD = pytest.StashKey[procs.Guard]()


def pytest_collection_modifyitems(config, items):
    # The files holding slow tests first: make test runs files on pytest-xdist workers (--dist loadfile, with
    # --no-loadscope-reorder: test_make_test_keeps_the_slow_files_first) in this order, so the longest ones start
    # at once instead of ending the run alone.
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)
    entries = procs.listed()
    marked = [item for item in items if any(procs.matches(item.nodeid, e) for e in entries)]
    for item in marked:
        item.add_marker(pytest.mark.procs)
    if config.getoption("--no-procs"):
        left = set(map(id, marked))
        config.hook.pytest_deselected(items=marked)
        items[:] = [item for item in items if id(item) not in left]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Under --procs-log, a test that failed because a process start was refused (its own, or a shared fixture's
    set up for an earlier test) is logged too."""
    report = yield
    guard = item.config.stash.get(GUARD, None)
    if guard is not None and guard.log is not None and call.excinfo is not None \
            and call.excinfo.errisinstance(procs.ProcessStarted):
        with guard.log.open("a", encoding="utf-8") as f:
            f.write(item.nodeid + "\n")
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under --no-procs, the guard is in place while a test runs (its fixtures' set-up and teardown included; not
    while collecting: an import may look a library up with ldconfig) and names it."""
    guard = item.config.stash.get(GUARD, None)
    if guard is None:
        return (yield)
    guard.current = item.nodeid
    guard.install()
    try:
        return (yield)
    finally:
        guard.uninstall()


@pytest.hookimpl(wrapper=True)
def pytest_report_to_serializable(config, report):
    """Reports sent from a pytest-xdist worker: a test about undecodable file names can capture text holding
    surrogate escapes, which execnet refuses to send (the whole run then stops); they are sent as ``\\udcff``."""
    data = yield
    return _utf8(data)


def _utf8(value):
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {_utf8(k): _utf8(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_utf8(v) for v in value)
    return value


def turbojpeg_or_skip(required: bool):
    """The process's TurboJPEG handle; skips without libturbojpeg, or fails if it is required."""
    from packer.images.decode import turbojpeg_handle, turbojpeg_missing_reason

    handle = turbojpeg_handle()
    if handle is None:
        reason = f"libturbojpeg did not load: {turbojpeg_missing_reason()}"
        if required:
            pytest.fail(reason + " (--require-turbojpeg)")
        pytest.skip(reason)
    return handle


@pytest.fixture
def turbojpeg(request):
    """Tests that exercise libjpeg-turbo take this fixture (see --require-turbojpeg)."""
    return turbojpeg_or_skip(request.config.getoption("--require-turbojpeg"))


@pytest.fixture
def jpegregion(request):
    """Tests of the compiled region decoder take this fixture (see --require-jpegregion)."""
    from packer.images.jpegregion import region_decode_available, region_decode_missing_reason

    if not region_decode_available():
        reason = (f"the JPEG region decoder is not built ({region_decode_missing_reason()}): "
                  "python setup.py build_ext --inplace")
        if request.config.getoption("--require-jpegregion"):
            pytest.fail(reason + " (--require-jpegregion)")
        pytest.skip(reason)


@pytest.fixture(scope="session")
def imagefolder(tmp_path_factory):
    """3 classes x 5 small JPEGs, shared read-only by the tests of a session."""
    return make_imagefolder(tmp_path_factory.mktemp("src") / "imgs")


@pytest.fixture(scope="session")
def _spawned_all(request, tmp_path_factory):
    """Every selected test's spawn probe run by one DataLoader of two spawned workers (tests/support/spawned.py)."""
    selected = {(item.module.__name__, item.originalname) for item in request.session.items
                if isinstance(item, pytest.Function) and item.module is not None}
    builders = {key: build for key, build in spawned_probes.REGISTRY.items() if key in selected}
    return spawned_probes.run_all(builders, tmp_path_factory, tmp_path_factory.mktemp("spawned-cwd"))


@pytest.fixture
def spawned(request, _spawned_all) -> spawned_probes.Outcome:
    """What the session's spawned workers returned for this test's probe (registered with ``probe_for``)."""
    key = (request.module.__name__, request.function.__name__)
    assert key in _spawned_all, f"no spawn probe registered for {key} (support/spawned.py: probe_for)"
    return _spawned_all[key]


@pytest.fixture(scope="session")
def flatfolder(tmp_path_factory):
    return make_flat(tmp_path_factory.mktemp("flat") / "flat")


# Object storage: a real S3 API (moto's server) and the emulated store, on localhost ports chosen by the OS.
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


@pytest.fixture
def fresh_store(tmp_path):
    """A fresh emulated store (its counts and faults this test's) over ``tmp_path/root``, bucket ``bucket``."""
    (tmp_path / "root").mkdir()
    server = Emulated(tmp_path / "root")
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _no_faults_left(request):
    yield
    if "emulated" in request.fixturenames:
        request.getfixturevalue("emulated").faults.clear()
