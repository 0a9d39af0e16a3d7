"""``StreamDigest``: the sha256 of a file computed while it is written front to back, in a thread.

A shard's checksum otherwise costs a second pass over the finished file, after its last byte:
for the last shard of a conversion nothing else overlaps that pass. Hashing the buffers as they
are written (hashlib releases the GIL on large buffers) leaves nothing to do at the end.
"""

from __future__ import annotations

import hashlib
import queue
import threading

_BATCH_BYTES = 4 << 20  # buffers handed to the thread together: few hand-overs, little held back
_DEPTH = 8  # batches waiting at most: the writer blocks rather than hold more than ~32 MB


class StreamDigest:
    """sha256 of every buffer given to ``update``, in order; buffers must not change after they are given."""

    def __init__(self) -> None:
        self._digest = hashlib.sha256()
        self._batch: list[bytes | memoryview] = []
        self._batch_bytes = 0
        self._queue: queue.Queue[list[bytes | memoryview] | None] = queue.Queue(maxsize=_DEPTH)
        self._thread = threading.Thread(target=self._run, name="packer-sha256", daemon=True)
        self._thread.start()

    def update(self, data: bytes | memoryview) -> None:
        self._batch.append(data)
        self._batch_bytes += len(data) if isinstance(data, bytes) else data.nbytes
        if self._batch_bytes >= _BATCH_BYTES:
            self._queue.put(self._batch)
            self._batch, self._batch_bytes = [], 0

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            for data in batch:
                self._digest.update(data)

    def hexdigest(self) -> str:
        """The digest of everything given; the stream ends here."""
        if self._batch:
            self._queue.put(self._batch)
            self._batch = []
        self._stop()
        return self._digest.hexdigest()

    def cancel(self) -> None:
        """End the stream without a digest (the file failed or was rewritten)."""
        self._batch = []
        self._stop()

    def _stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
