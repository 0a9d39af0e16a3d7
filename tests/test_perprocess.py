"""PerProcess: made once per process, never shared with a forked child (which releases its copy), pickled empty."""

import multiprocessing as mp
import os
import pickle

from packer.perprocess import PerProcess


def _in_child(value: PerProcess, released: list, queue) -> None:
    made = value.get()
    queue.put((made["pid"], len(released)))


def test_a_forked_child_makes_its_own_and_releases_the_inherited_one():
    released: list = []
    value = PerProcess(lambda: {"pid": os.getpid()}, inherited=released.append)
    assert value.peek() is None and value.get()["pid"] == os.getpid() and value.get() is value.get()
    queue = mp.get_context("fork").Queue()
    child = mp.get_context("fork").Process(target=_in_child, args=(value, released, queue))
    child.start()
    child_pid, child_released = queue.get(timeout=60)
    child.join(60)
    assert child_pid == child.pid and child_released == 1  # the child made its own, after releasing the parent's
    assert value.get()["pid"] == os.getpid() and not released  # the parent's is untouched


def test_pickled_empty_and_closed_with_its_closer():
    value = PerProcess(dict)
    value.get()["x"] = 1
    copy = pickle.loads(pickle.dumps(value))
    assert copy.peek() is None and copy.get() == {}
    closed: list = []
    value.close(closed.append)
    assert closed == [{"x": 1}] and value.peek() is None
