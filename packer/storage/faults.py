"""What can go wrong talking to object storage, as packer's errors: each names the (redacted) URL and the cause.

``classify`` turns a client library's exception into ``(retry, error)``: whether one more try may help (a complete
response with a body shorter than asked, which the library accepts) and the PackerError to raise once the tries
are spent. What the library already retried with backoff (5xx, 503 SlowDown, resets, timeouts, bodies cut mid-way)
is final when it reaches here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from packer.errors import PackerError
from packer.storage.url import redact_text


class StorageError(PackerError):
    """A request to object storage failed after its retries; the message names the URL and the cause."""


class ObjectNotFound(StorageError, FileNotFoundError):
    """404: no such object (or bucket)."""


class AccessDenied(StorageError, PermissionError):
    """403/401: the credentials in use may not do this."""


class ObjectChanged(StorageError):
    """The object's ETag/generation differs from the one it was opened with: it was replaced while being read;
    its bytes are never mixed with the old ones."""


class ObjectExists(StorageError, FileExistsError):
    """A conditional put (create only) found an object there already (412 on If-None-Match)."""


class ShortRead(StorageError):
    """A body shorter (or longer) than the range asked for: cut mid-way or truncated by the server."""


@dataclass(frozen=True)
class RetryPolicy:
    """Timeouts and retries for every request. ``retries``: tries after the first, for 5xx, 503 SlowDown,
    resets, timeouts and bodies cut short; backoff doubles from ``backoff`` up to ``max_backoff`` seconds, with
    jitter, and gives up after ``retry_timeout``. ``timeout``: one request, body included; ``connect_timeout``:
    its connection."""

    retries: int = 5
    backoff: float = 0.1
    max_backoff: float = 5.0
    retry_timeout: float = 120.0
    timeout: float = 60.0
    connect_timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.retries < 0 or min(self.backoff, self.max_backoff, self.retry_timeout, self.timeout,
                                   self.connect_timeout) <= 0:
            raise PackerError(f"{self}: retries >= 0 and positive times expected")

    def delay(self, attempt: int) -> float:
        """Seconds before try ``attempt`` + 1 (``attempt`` >= 1), full jitter."""
        import random

        return random.uniform(0, min(self.max_backoff, self.backoff * 2 ** (attempt - 1)))


_STATUS = re.compile(r"status(?: code)?:? (\d{3})")
_HTTP_KIND = re.compile(r"HttpError \{\s*kind: (\w+)")
_KINDS = {"Timeout": "timed out", "Interrupted": "the connection was cut mid-body", "Connect": "could not connect",
          "Request": "the request failed", "Decode": "the body could not be decoded"}


def _cause(exc: BaseException) -> str:
    """The library's message, first line, secrets redacted, without its debug dump."""
    text = str(exc).split("\n\nDebug source:", 1)[0].strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    kind = _HTTP_KIND.search(str(exc))
    if kind:
        first = f"{_KINDS.get(kind.group(1), kind.group(1))}: {first}"
    return redact_text(first)[:400]


def classify(exc: BaseException, url: str) -> tuple[bool, StorageError]:
    """(retry?, the error to raise) for an exception from the storage client while reading ``url``."""
    if isinstance(exc, StorageError):
        return isinstance(exc, ShortRead), exc
    name = type(exc).__name__
    cause = _cause(exc)
    where = redact_text(url)
    if name == "NotFoundError" or isinstance(exc, FileNotFoundError):
        return False, ObjectNotFound(f"{where}: no such object (404)")
    status = _STATUS.search(str(exc))
    code = int(status.group(1)) if status else None
    if name in ("PermissionDeniedError", "UnauthenticatedError") or code in (401, 403):
        return False, AccessDenied(f"{where}: access denied ({code or name}); check the credentials (environment, "
                                   "~/.aws, instance role or storage_options=)")
    if name == "AlreadyExistsError":
        return False, ObjectExists(f"{where}: exists already (a conditional put found an object there)")
    if name == "PreconditionError":
        return False, ObjectChanged(f"{where}: the object changed since it was opened (its ETag no longer "
                                    "matches); open the dataset again")
    if code == 404:
        return False, ObjectNotFound(f"{where}: no such object (404)")
    return False, StorageError(f"{where}: {cause}")
