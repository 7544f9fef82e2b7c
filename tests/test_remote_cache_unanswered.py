"""An S3 remote that accepts connections and never answers (a hung server) costs a build one request's attempts,
then the run goes on without it, sending nothing more; a required one fails the build as promptly."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kiln.engines.cache import EngineCache, engine_key
from kiln.engines.cache.remote import RemoteSpec, RemoteUnavailableError
from kiln.engines.cache.remote.s3 import S3Objects

AWS_ENV = {"AWS_ACCESS_KEY_ID": "kiln-test", "AWS_SECRET_ACCESS_KEY": "kiln-test-secret",
           "AWS_DEFAULT_REGION": "us-east-1"}
MATERIAL = {"key_schema": 1, "kind": "engine", "model": "a"}
KEY = engine_key(MATERIAL)


@contextmanager
def silent_endpoint() -> Iterator[tuple[str, list[socket.socket]]]:
    """An endpoint that accepts every connection and never answers; the list holds the connections accepted."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(listener.accept()[0])
            except OSError:  # closed: the test is over
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", accepted
    finally:
        listener.close()
        for connection in accepted:
            connection.close()


def silent_machine(tmp_path: Path, endpoint: str, required: bool = False) -> EngineCache:
    warnings: list[str] = []
    cache = EngineCache.open(tmp_path / f"machine-{required}", remote=RemoteSpec("s3://kiln-test/team", endpoint,
                                                                                  required), warn=warnings.append)
    cache.remote.objects = S3Objects("kiln-test", "team", endpoint_url=endpoint, read_timeout_s=0.2)
    cache.warnings = warnings
    return cache


def build(out: Path) -> dict:
    (out / "engine.json").write_text('{"format": "test"}')
    return {"built_by": os.getpid()}


def test_a_remote_that_never_answers_is_asked_once_then_the_build_goes_on_locally(tmp_path, monkeypatch):
    for name, value in AWS_ENV.items():
        monkeypatch.setenv(name, value)
    with silent_endpoint() as (endpoint, accepted):
        cache = silent_machine(tmp_path, endpoint)
        started = time.monotonic()
        with pytest.raises(RemoteUnavailableError, match="ReadTimeoutError"):
            cache.remote.has("entries", KEY)  # a build's plan asks first
        sent = len(accepted)
        result = cache.entries.get_or_build(KEY, MATERIAL, build)  # pull, lease, push: none sent
        assert time.monotonic() - started < 6  # 3 attempts of 0.2 s and their backoff (at most 3 s)
        assert not result.hit and cache.entries.lookup(KEY).hit
        assert len(accepted) == sent
        assert len(cache.warnings) == 1 and "going on without the remote cache" in cache.warnings[0]


def test_a_required_remote_that_never_answers_fails_the_build_promptly(tmp_path, monkeypatch):
    for name, value in AWS_ENV.items():
        monkeypatch.setenv(name, value)
    with silent_endpoint() as (endpoint, _):
        cache = silent_machine(tmp_path, endpoint, required=True)
        started = time.monotonic()
        with pytest.raises(RemoteUnavailableError, match="ReadTimeoutError.*remote_required"):
            cache.entries.get_or_build(KEY, MATERIAL, build)
        assert time.monotonic() - started < 6
