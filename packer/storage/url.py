"""What a location is: a local path or an object-storage URL (s3://, gs://, az://, http(s)://, file://).

Parsing, joining and redaction. Secrets ride in URLs (a password in the userinfo, a presigned query's
X-Amz-Signature, an Azure SAS ``sig=``): ``Location.url`` keeps them for the client; ``str``, ``repr`` and every
message use ``redact``, so they never reach a log line, an error or a manifest.
"""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path, PosixPath
from urllib.parse import quote, unquote, urlsplit

from packer.errors import PackerError

SCHEMES = ("s3", "gs", "az", "http", "https", "file")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")
# query parameters that carry a secret, lowercased: AWS SigV4 presigned, GCS signed, Azure SAS, OAuth and friends
_SECRET_PARAMS = frozenset({
    "x-amz-signature", "x-amz-credential", "x-amz-security-token", "signature", "awsaccesskeyid",
    "x-goog-signature", "x-goog-credential", "googleaccessid", "sig", "sv-signature", "token", "access_token",
    "code", "key", "apikey", "api_key", "password", "secret", "client_secret", "sas", "skoid", "sktid",
})
_SECRET_WORDS = ("sig", "token", "secret", "password", "credential", "key")
REDACTED = "REDACTED"


def is_url(location: str | os.PathLike) -> bool:
    """True for any ``scheme://...`` text (supported or not); paths and ``os.PathLike`` objects are not URLs."""
    return isinstance(location, str) and _SCHEME.match(location) is not None


def _redact_query(query: str) -> str:
    if not query:
        return query
    out = []
    for part in query.split("&"):
        name, eq, _value = part.partition("=")
        low = unquote(name).lower()
        secret = low in _SECRET_PARAMS or any(w in low for w in _SECRET_WORDS)
        out.append(f"{name}{eq}{REDACTED}" if secret and eq else part)
    return "&".join(out)


def redact(url: str) -> str:
    """``url`` with its password (userinfo) and secret query values replaced by REDACTED; a path is returned as
    is."""
    if not is_url(url):
        return url
    scheme, rest = url.split("://", 1)
    authority, sep, tail = rest.partition("/")
    if "@" in authority:  # user:password@ keeps the user name; a lone userinfo may be a token (TOKEN@host)
        user, _, host = authority.rpartition("@")
        authority = f"{user.split(':', 1)[0]}:{REDACTED}@{host}" if ":" in user else f"{REDACTED}@{host}"
    path, qmark, query = (sep + tail).partition("?")
    query, hash_, fragment = query.partition("#")
    return f"{scheme}://{authority}{path}{qmark}{_redact_query(query)}{hash_}{fragment}"


def redact_text(text: str) -> str:
    """Every URL inside ``text`` (a library's error message, a log line) redacted."""
    def one(m: re.Match) -> str:
        url = m.group(0)
        core = url.rstrip(".,;:)]}")
        return redact(core) + url[len(core):]

    return _URL_IN_TEXT.sub(one, text)


def refuse_url(location: str | os.PathLike, by: str) -> None:
    """Until a command reads and writes object storage end to end, a URL given to it is refused in one line (never
    taken as a local path, which made a folder named ``s3:``)."""
    if is_url(location):
        raise PackerError(f"object storage is not supported yet by {by}: {redact(str(location))}")


class UrlPath(PosixPath):
    """A URL where a source's path goes (``Source.path``, ``ScanResult.root``, messages): shown as the URL
    (``s3://b/k``), not the ``s3:/b/k`` a Path makes of it. Nothing opens it: URL sources read through the store."""

    def __str__(self) -> str:
        return _SCHEME_ONE_SLASH.sub(r"\1://", super().__str__(), count=1)


_SCHEME_ONE_SLASH = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):/(?!/)")


@dataclass(frozen=True)
class Location:
    """A parsed location. ``scheme`` is "" for a local path (``key`` the absolute path); for a URL ``bucket`` is the
    bucket, container or ``host[:port]`` and ``key`` the object name without a leading slash. ``query`` (http(s)
    only) may hold a signature: it is kept for requests and redacted everywhere else."""

    scheme: str
    bucket: str
    key: str
    query: str = ""
    userinfo: str = ""

    @property
    def is_local(self) -> bool:
        return self.scheme == ""

    @property
    def path(self) -> Path:
        """The local path (a ``file://`` URL or a plain path)."""
        if not self.is_local:
            raise PackerError(f"not a local path: {self}")
        return Path(self.key)

    @property
    def url(self) -> str:
        """The full URL with any secrets: for the storage client only, never for a message."""
        if self.is_local:
            return self.key
        user = f"{self.userinfo}@" if self.userinfo else ""
        query = f"?{self.query}" if self.query else ""
        return f"{self.scheme}://{user}{self.bucket}/{quote(self.key, safe='/~!$&()*+,;=:@-._')}{query}"

    def join(self, *parts: str) -> Location:
        """A location inside this one: ``parts`` are relative names ('shard-00000.mdb', 'meta/labels.npy');
        absolute names and '..' are refused. A query (a signed URL) is for one object: joining drops it."""
        names = [p for part in parts for p in part.split("/") if p not in ("", ".")]
        bad = [p for p in parts if p.startswith("/") or "\\" in p or "\0" in p] + [p for p in names if p == ".."]
        if bad:
            raise PackerError(f"{self}: cannot join {bad[0]!r} (a relative name inside it was expected)")
        if self.is_local:
            return Location("", "", str(Path(self.key, *names)))
        key = posixpath.join(self.key, *names) if self.key else "/".join(names)
        return Location(self.scheme, self.bucket, key, "", self.userinfo)

    @property
    def name(self) -> str:
        return posixpath.basename(self.key.rstrip("/"))

    def __str__(self) -> str:
        return redact(self.url)

    def __repr__(self) -> str:
        return f"Location({str(self)!r})"


def parse(location: str | os.PathLike) -> Location:
    """A path or URL -> ``Location``; an unknown scheme, a URL without a bucket or host, or a ``file://`` URL naming
    another host is a PackerError (redacted)."""
    if not is_url(location):
        return Location("", "", os.path.abspath(os.fspath(location)))
    text = str(location)
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise PackerError(f"{redact(text)}: unknown storage scheme {scheme!r} (packer knows {', '.join(SCHEMES)})")
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise PackerError(f"{redact(text)}: a file:// URL names a path on this machine, not host {parts.netloc!r}")
        return Location("", "", os.path.abspath(unquote(parts.path) or "/"))
    userinfo, _, host = parts.netloc.rpartition("@")
    if not host:
        raise PackerError(f"{redact(text)}: no {'host' if scheme.startswith('http') else 'bucket'} in the URL")
    if scheme not in ("http", "https") and (parts.query or userinfo):
        raise PackerError(f"{redact(text)}: {scheme}:// URLs take credentials from the environment or "
                          "storage_options=, not from the URL")
    if parts.fragment:
        raise PackerError(f"{redact(text)}: a URL fragment ('#...') names no object")
    return Location(scheme, host, unquote(parts.path).lstrip("/"), parts.query, userinfo)



def refuse_urls(by: str, *locations: str | os.PathLike | None) -> None:
    """``refuse_url`` for each location given (None skipped): a command's source, output, ``--against``..."""
    for location in locations:
        if location is not None:
            refuse_url(location, by)
