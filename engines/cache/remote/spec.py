"""Which remote a cache shares entries through: ``cache.remote`` (or ``$KILN_CACHE_REMOTE``), parsed and checked."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import SplitResult, unquote, urlsplit, urlunsplit

from kiln.engines.cache.remote.objects import ObjectStore

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")


@dataclass(frozen=True)
class RemoteSpec:
    """``url``: ``s3://bucket/prefix`` or ``file:///shared/folder``; ``endpoint_url``: an S3-compatible service
    other than AWS (MinIO, Ceph, R2), else the AWS chain's; ``required``: an unreachable remote fails the build
    instead of a warning and a local build."""

    url: str
    endpoint_url: str | None = None
    required: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.url, str) and isinstance(self.endpoint_url, str | None)
                and isinstance(self.required, bool)):
            raise TypeError(f"{self!r}: url and endpoint_url are text, required is true or false")
        problem = url_problem(self.url) or endpoint_problem(self.endpoint_url)
        if problem:
            raise ValueError(problem)


def _shown(parts: SplitResult) -> str:
    """A URL as an error may print it: without credentials, query or fragment (a presigned query holds a secret)."""
    host = parts.hostname or ""
    return urlunsplit((parts.scheme, f"{host}:{parts.port}" if parts.port else host, parts.path, "", ""))


def url_problem(url: str) -> str | None:
    """Why ``url`` is not a remote cache URL (None when it is one); the message never repeats a secret."""
    parts = urlsplit(url)
    if parts.username or parts.password:
        return ("cache.remote must not carry credentials: they come from the AWS chain (AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY, ~/.aws/credentials, a role)")
    if parts.query or parts.fragment:
        return (f"cache.remote {_shown(parts)!r} has a query or fragment (not shown: it may hold a signature); give "
                f"s3://bucket/prefix, the endpoint as cache.remote_endpoint and credentials by the AWS chain")
    if parts.scheme == "s3":
        if not _BUCKET.fullmatch(parts.netloc):
            return f"cache.remote {url!r}: {parts.netloc!r} is not an S3 bucket name (3-63 of a-z 0-9 . -)"
        return None
    if parts.scheme == "file":
        if parts.netloc or not parts.path.startswith("/"):
            return f"cache.remote {url!r}: a file URL names an absolute folder, file:///shared/kiln-cache"
        return None
    return f"cache.remote {url!r}: give s3://bucket/prefix or file:///shared/folder"


def endpoint_problem(endpoint_url: str | None) -> str | None:
    """Why ``endpoint_url`` is not an S3-compatible service's address (None when it is one, or not given)."""
    if endpoint_url is None:
        return None
    endpoint = urlsplit(endpoint_url)
    if endpoint.username or endpoint.password or endpoint.query or endpoint.fragment:
        return ("cache.remote_endpoint must carry no credentials, query or fragment (not shown): credentials come "
                "from the AWS chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, ~/.aws/credentials, a role)")
    if endpoint.scheme not in ("http", "https") or not endpoint.hostname:
        return f"cache.remote_endpoint {_shown(endpoint)!r}: give the service's http(s)://host:port"
    return None


def open_objects(spec: RemoteSpec) -> ObjectStore:
    """The object store ``spec`` names (boto3 is imported only for an s3:// remote)."""
    parts = urlsplit(spec.url)
    if parts.scheme == "file":
        from kiln.engines.cache.remote.filesystem import FileObjects

        return FileObjects(Path(unquote(parts.path)))  # file:///my%20cache, as Path.as_uri() writes it
    from kiln.engines.cache.remote.s3 import S3Objects

    return S3Objects(parts.netloc, parts.path, endpoint_url=spec.endpoint_url)
