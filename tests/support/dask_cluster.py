"""The Dask cluster fixture of the write tests (tests/write/test_cluster.py, test_cluster_to_bucket.py import it: a
conftest.py of their own would shadow tests/conftest.py for `from conftest import ...`)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", name="client")
def cluster_client():
    """The cluster of ``--scheduler local:2``: 2 worker processes, 1 thread each (shared by the module)."""
    pytest.importorskip("distributed", reason="needs the packer[dask] extra (make install adds it)")
    from packer.write.cluster import open_client

    with open_client("local:2") as c:
        assert len(c.nthreads()) == 2 and set(c.nthreads().values()) == {1}
        yield c
