"""The remote tier of the engine cache, against a real S3-protocol server on loopback (moto's, started here) and a
shared folder (``file://``): pull verified, push atomic and idempotent, one build across machines, failures."""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer
from botocore.exceptions import IncompleteReadError
from botocore.response import StreamingBody
from typer.testing import CliRunner

from kiln.engines.cache import CacheEntryNotFoundError, EngineCache, engine_key
from kiln.engines.cache.remote import RemoteCorruptError, RemoteSpec, RemoteUnavailableError, filesystem
from kiln.engines.cache.remote.layout import blob_name, lease_name, manifest_name
from kiln.engines.cache.remote.lease import LeaseTiming, build_lease
from kiln.engines.cache.remote.maintenance import prune_remote, remote_entries, verify_remote
from kiln.engines.cache.units import format_bytes
from kiln.engines.cache.verify import verify_entry
from kiln.pipeline.cache_commands import cache_app
from kiln.pipeline.config import ConfigError, KilnConfig, remote_spec
from tests.calibration_factories import quick_fp8_config
from tests.subprocess_env import REPO, repo_env

AWS_ENV = {"AWS_ACCESS_KEY_ID": "kiln-test", "AWS_SECRET_ACCESS_KEY": "kiln-test-secret",
           "AWS_DEFAULT_REGION": "us-east-1"}
FAST_LEASE = LeaseTiming(poll_s=0.05, refresh_s=0.2, stale_s=1.5, tell_every_s=0.0)
runner = CliRunner()


@dataclass
class Remote:
    spec: RemoteSpec
    env: dict[str, str]  # what a machine sets to use it: $KILN_CACHE_REMOTE and, for S3, the AWS chain


@pytest.fixture(scope="module")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(params=["s3", "file"])
def remote(request, tmp_path, monkeypatch) -> Remote:
    for name, value in AWS_ENV.items():
        monkeypatch.setenv(name, value)
    if request.param == "file":
        folder = tmp_path / "shared"
        folder.mkdir()
        url = f"file://{folder}"
        return Remote(RemoteSpec(url), {"KILN_CACHE_REMOTE": url})
    import boto3

    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = f"kiln-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/team-cache"
    return Remote(RemoteSpec(url, endpoint), {**AWS_ENV, "KILN_CACHE_REMOTE": url, "AWS_ENDPOINT_URL": endpoint})


def material(name: str) -> dict:
    return {"key_schema": 1, "kind": "engine", "model": name}


def builder(calls: list, content: bytes = b"weights") -> callable:
    def build(out: Path) -> dict:
        calls.append(out)
        (out / "engine.json").write_text('{"format": "test"}')
        (out / "shards").mkdir()
        (out / "shards" / "rank0.safetensors").write_bytes(content * 1000)
        return {"built_by": os.getpid()}

    return build


def machine(tmp_path: Path, name: str, remote: Remote, **spec_changes) -> EngineCache:
    spec = RemoteSpec(**{**vars(remote.spec), **spec_changes})
    warnings: list[str] = []
    cache = EngineCache.open(tmp_path / name, remote=spec, warn=warnings.append)
    cache.remote.timing = FAST_LEASE
    cache.warnings = warnings
    return cache


def payload_bytes(cache: EngineCache, key: str) -> dict[str, bytes]:
    payload = cache.entries.payload_dir(key)
    return {p.relative_to(payload).as_posix(): p.read_bytes() for p in sorted(payload.rglob("*")) if p.is_file()}


def test_an_entry_built_on_one_machine_is_pulled_verified_by_another(tmp_path, remote):
    key, first_calls, second_calls = engine_key(material("a")), [], []
    first, second = machine(tmp_path, "first", remote), machine(tmp_path, "second", remote)
    built = first.entries.get_or_build(key, material("a"), builder(first_calls))
    pulled = second.entries.get_or_build(key, material("a"), builder(second_calls))
    assert not built.hit and len(first_calls) == 1
    assert pulled.hit and pulled.pulled and not second_calls
    assert payload_bytes(second, key) == payload_bytes(first, key)
    assert second.entries.lookup(key, material("a")).hit  # a whole local entry: manifest, files, sizes
    lookups = second.stats.summary("entries")
    assert (lookups["lookups"], lookups["hits"], lookups["remote_hits"], lookups["hit_rate"]) == (2, 2, 1, 1.0)
    assert lookups["misses_by_reason"]["new"] == 0  # served by the remote: no miss of the team's cache
    assert second.stats.hits_by_key() == {("entries", key): 2}  # what `kiln cache ls` shows: the pull's too
    assert lookups["build_seconds_saved"] == 2 * built.build_seconds  # the pull's and the local hit's
    remote_figures = lookups["remote"]
    assert remote_figures["hits"] == 1
    assert remote_figures["pulled_bytes"] == sum(map(len, payload_bytes(first, key).values()))
    assert first.stats.summary("entries")["remote"]["pushes"] == 1
    assert verify_remote(first.remote) == [{"key": key, "store": "entries", "ok": True, "files_checked": 2,
                                            "problems": []}]


def test_an_entry_pulled_with_a_hold_is_held_from_before_it_is_published(tmp_path, remote):
    key = engine_key(material("a"))
    machine(tmp_path, "first", remote).entries.get_or_build(key, material("a"), builder([]))
    second = machine(tmp_path, "second", remote)
    pulled = second.entries.pull(key, hold=True)
    evicting = EngineCache(second.root, max_size_bytes=None, max_entries=0, verify_on_load="changed")
    assert [e.key for e in evicting.evict().in_use] == [key]  # another process publishing over its limits
    pulled.hold.release()


def test_a_remote_manifest_edited_to_list_no_engine_json_is_refused_on_pull(tmp_path, remote):
    key = engine_key(material("a"))
    first = machine(tmp_path, "first", remote)
    first.entries.get_or_build(key, material("a"), builder([]))
    objects = first.remote.objects
    manifest = json.loads(objects.read(manifest_name("entries", key)))
    manifest["files"] = [item for item in manifest["files"] if item["path"] != "engine.json"]
    manifest["total_bytes"] = sum(item["size"] for item in manifest["files"])
    objects.write(manifest_name("entries", key), json.dumps(manifest).encode())
    second = machine(tmp_path, "second", remote)
    with pytest.raises(RemoteCorruptError, match="no engine.json"):
        second.entries.pull(key)
    assert not second.entries.entry_dir(key).exists()


def test_a_remote_manifest_whose_total_bytes_is_not_its_files_sum_is_refused_and_evicts_nothing(tmp_path, remote):
    kept, key = engine_key(material("kept")), engine_key(material("a"))
    first, second = machine(tmp_path, "first", remote), machine(tmp_path, "second", remote)
    first.entries.get_or_build(key, material("a"), builder([]))
    second.entries.get_or_build(kept, material("kept"), builder([]))
    objects = first.remote.objects
    manifest = json.loads(objects.read(manifest_name("entries", key)))
    objects.write(manifest_name("entries", key), json.dumps({**manifest, "total_bytes": 10 ** 15}).encode())
    with pytest.raises(RemoteCorruptError, match="is not the sum of its files' sizes"):
        second.entries.pull(key)  # before: installed as 1000 TB, evicting every other local entry
    assert not second.entries.entry_dir(key).exists() and second.entries.lookup(kept, material("kept")).hit


def test_a_flipped_byte_in_a_remote_file_is_refused_on_pull_then_replaced_by_a_good_build(tmp_path, remote):
    key, calls = engine_key(material("a")), []
    first = machine(tmp_path, "first", remote)
    first.entries.get_or_build(key, material("a"), builder([]))
    manifest = json.loads(first.entries.entry_dir(key).joinpath("manifest.json").read_bytes())
    weights = next(item for item in manifest["files"] if item["path"].endswith(".safetensors"))
    objects = first.remote.objects
    data = bytearray(objects.read(blob_name(weights["sha256"])))
    data[100] ^= 0x01
    objects.write(blob_name(weights["sha256"]), bytes(data))

    second = machine(tmp_path, "second", remote)
    with pytest.raises(RemoteCorruptError, match="shards/rank0.safetensors: sha256 differs"):
        second.entries.pull(key)
    assert not second.entries.entry_dir(key).exists() and not list((second.v1 / "tmp").iterdir())
    assert verify_remote(first.remote)[0]["ok"] is False
    result = second.entries.get_or_build(key, material("a"), builder(calls))  # builds here, pushes a good copy
    assert not result.hit and len(calls) == 1 and any("refused" in w for w in second.warnings)
    assert second.stats.summary("entries")["remote"]["corrupt"] == 2
    assert verify_remote(first.remote)[0]["ok"] is True
    third = machine(tmp_path, "third", remote)
    assert third.entries.pull(key).pulled


PUSHER = r"""
import os, signal, sys
from pathlib import Path
from kiln.engines.cache import EngineCache
from kiln.engines.cache.remote import RemoteSpec

root, url, endpoint, key, mode = sys.argv[1:6]
cache = EngineCache.open(Path(root), remote=RemoteSpec(url, endpoint or None))
objects = cache.remote.objects
die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
if mode == "before_manifest":  # every file is up, the manifest is not
    real_write = objects.write
    objects.write = lambda name, *a, **k: die() if name.endswith("manifest.json") else real_write(name, *a, **k)
else:  # the first file is up, the second dies in the middle of its upload
    uploads = []
    real_upload = objects.upload
    def upload(name, path, progress):
        uploads.append(name)
        real_upload(name, path, die if len(uploads) == 2 else progress)
    objects.upload = upload
cache.entries.push(key)
"""


@pytest.mark.parametrize("mode", ["before_manifest", "mid_upload"])
def test_a_push_killed_half_way_leaves_nothing_a_reader_installs(tmp_path, remote, mode):
    key = engine_key(material("a"))
    local = EngineCache.open(tmp_path / "builder")  # built without the remote, pushed by the killed process
    local.entries.get_or_build(key, material("a"), builder([]))
    proc = subprocess.run([sys.executable, "-c", PUSHER, str(tmp_path / "builder"), remote.spec.url,
                           remote.spec.endpoint_url or "", key, mode], env=repo_env(), capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    reader = machine(tmp_path, "reader", remote)
    assert reader.remote.objects.stat(manifest_name("entries", key)) is None
    with pytest.raises(CacheEntryNotFoundError):
        reader.entries.pull(key)
    assert remote_entries(reader.remote) == [] and not reader.entries.entry_dir(key).exists()
    calls = []
    reader.entries.get_or_build(key, material("a"), builder(calls))  # builds and pushes a whole entry
    assert len(calls) == 1 and verify_remote(reader.remote)[0]["ok"]
    objects, is_s3 = reader.remote.objects, "AWS_ENDPOINT_URL" in remote.env
    if is_s3:  # the multipart upload a killed push of a large file began (no file here is that large)
        objects._client.create_multipart_upload(Bucket=objects.bucket, Key=objects._key(blob_name("ab" * 32)))
        time.sleep(1.1)  # the store's clock has whole seconds
    unfinished = objects.discard_unfinished(objects.now(), dry_run=True)  # file: the killed uploads' temporaries
    assert unfinished >= 1 if is_s3 or mode == "mid_upload" else unfinished == 0
    assert prune_remote(reader.remote, older_than_s=None, max_size_bytes=None, grace_s=0)[
        "unfinished_writes_removed"] == unfinished
    assert objects.discard_unfinished(objects.now() + 1) == 0 and verify_remote(reader.remote)[0]["ok"]

INTERRUPTED_PUSHER = r"""
import sys, time
from pathlib import Path
from kiln.engines.cache import EngineCache
from kiln.engines.cache.remote import RemoteSpec

root, url, key = sys.argv[1:4]
cache = EngineCache.open(Path(root), remote=RemoteSpec(url))
real_upload = cache.remote.objects.upload
def upload(name, path, progress):  # the large file moves slowly: ten minutes unless stopped
    if path.name == "rank0.safetensors":
        print("started", flush=True)
        try:
            for _ in range(120000):
                progress(1)
                time.sleep(0.005)
        except Exception as exc:
            print("stopped", type(exc).__name__, flush=True)
            raise
    real_upload(name, path, progress)
cache.remote.objects.upload = upload
try:
    cache.entries.push(key)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(130)
"""


def test_ctrl_c_during_a_push_stops_the_uploads_in_flight(tmp_path):
    key, shared = engine_key(material("a")), tmp_path / "shared"
    shared.mkdir()
    EngineCache.open(tmp_path / "builder").entries.get_or_build(key, material("a"), builder([]))
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPTED_PUSHER, str(tmp_path / "builder"), f"file://{shared}",
                             key], env=repo_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=120)  # a hang guard: the upload, not stopped, would run ten minutes
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    # "interrupted" may come first: a Ctrl-C while the pool still starts its thread leaves that thread unjoined
    # until the interpreter exits (it joins pool threads then); the transfer stops at its next chunk either way
    assert proc.returncode == 130 and sorted(out.split()) == ["TransferStopped", "interrupted", "stopped"], err[-2000:]
    assert not any(shared.rglob("manifest.json")) and not any(shared.rglob(".partial-*"))


def test_concurrent_pushes_of_one_key_with_different_bytes_leave_one_whole_entry(tmp_path, remote):
    key = engine_key(material("a"))
    machines = []
    for i in range(3):  # each built alone: same key, different bytes (builds need not be reproducible)
        cache = EngineCache.open(tmp_path / f"m{i}", remote=remote.spec)
        cache.remote = None
        for store in cache.stores.values():
            store.remote = None
        cache.entries.get_or_build(key, material("a"), builder([], content=f"build {i}".encode()))
        cache = EngineCache.open(tmp_path / f"m{i}", remote=remote.spec)
        machines.append(cache)
    threads = [threading.Thread(target=cache.entries.push, args=(key,), kwargs={"replace": True})
               for cache in machines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert verify_remote(machines[0].remote)[0]["ok"]
    reader = machine(tmp_path, "reader", remote)
    assert reader.entries.pull(key).pulled
    assert payload_bytes(reader, key) in [payload_bytes(cache, key) for cache in machines]


def test_a_machine_waits_for_the_lease_holder_then_pulls_instead_of_building(tmp_path, remote):
    key, calls, go = engine_key(material("a")), [], threading.Event()
    holder, waiter = machine(tmp_path, "holder", remote), machine(tmp_path, "waiter", remote)
    build_slowly = builder([])
    holding = threading.Thread(target=holder.entries.get_or_build,
                               args=(key, material("a"), lambda out: go.wait(30) and build_slowly(out)))
    holding.start()
    while holder.remote.objects.stat(lease_name("entries", key)) is None:
        time.sleep(0.02)
    notes: list[str] = []
    result: list = []
    waiting = threading.Thread(target=lambda: result.append(
        waiter.entries.get_or_build(key, material("a"), builder(calls), on_wait=notes.append)))
    waiting.start()
    deadline = time.monotonic() + 30  # its local miss and remote miss first, then the lease it waits on
    while not notes and time.monotonic() < deadline:
        time.sleep(0.02)
    assert waiting.is_alive() and any("is building entries" in note for note in notes)
    go.set()
    holding.join(timeout=30)
    waiting.join(timeout=30)
    assert result[0].pulled and not calls


def test_a_machine_waiting_on_the_repair_of_a_damaged_copy_takes_the_repaired_one(tmp_path, remote):
    key, outcome = engine_key(material("a")), []
    objects = machine(tmp_path, "waiter", remote).remote.objects
    objects.write(manifest_name("entries", key), b"the damaged copy's manifest")
    objects.write(lease_name("entries", key), b'{"host": "repairer", "pid": 1}')  # another machine rebuilds it

    def wait_for_the_lease() -> None:
        with build_lease(objects, "entries", key, timing=FAST_LEASE, on_wait=None, failed=print, damaged=True) as got:
            outcome.append(got)

    waiting = threading.Thread(target=wait_for_the_lease)
    waiting.start()
    time.sleep(0.3)  # several polls, well before the lease would go stale
    assert waiting.is_alive()  # the damaged copy is not "published"
    objects.write(manifest_name("entries", key), b"the repaired copy's manifest")
    waiting.join(timeout=30)
    assert outcome == ["published"]  # pull the repair rather than build again


def test_a_stale_lease_of_a_dead_builder_is_taken_over(tmp_path, remote):
    key, calls = engine_key(material("a")), []
    cache = machine(tmp_path, "second", remote)
    cache.remote.objects.write(lease_name("entries", key), b'{"host": "gone", "pid": 1}')  # never refreshed
    started = time.monotonic()
    result = cache.entries.get_or_build(key, material("a"), builder(calls))
    assert not result.hit and len(calls) == 1
    assert time.monotonic() - started >= FAST_LEASE.stale_s - 1.0  # the lease's clock has one-second steps (S3)
    assert cache.remote.objects.stat(lease_name("entries", key)) is None  # released after the build


def test_a_lease_stamped_by_a_clock_far_ahead_is_taken_over_once_it_stays_unchanged(tmp_path, remote):
    key, calls = engine_key(material("a")), []
    cache = machine(tmp_path, "second", remote)

    def lease_from_ahead() -> None:
        cache.remote.objects.write(lease_name("entries", key), b'{"host": "gone", "pid": 1}')
        if remote.spec.url.startswith("file"):  # a share whose server's clock runs ten minutes ahead
            lease = Path(remote.spec.url.removeprefix("file://"), lease_name("entries", key))
            os.utime(lease, (time.time() + 600, time.time() + 600))

    if not remote.spec.url.startswith("file"):  # S3 stamps with its own clock: this one runs ten minutes behind it
        cache.remote.objects.now = lambda now=cache.remote.objects.now: now() - 600
    lease_from_ahead()
    result = cache.entries.get_or_build(key, material("a"), builder(calls))  # within seconds, not ten minutes
    assert not result.hit and len(calls) == 1
    lease_from_ahead()  # a live builder's, as such a share stamps it: prune, which looks once, keeps it
    assert prune_remote(cache.remote, older_than_s=None, max_size_bytes=None)["stale_leases_removed"] == 0


def test_an_unreachable_remote_warns_and_builds_locally_unless_required(tmp_path, remote):
    unreachable = {"url": f"file://{tmp_path}/not-mounted"} if remote.spec.url.startswith("file") \
        else {"endpoint_url": "http://127.0.0.1:9"}
    key, calls = engine_key(material("a")), []
    cache = machine(tmp_path, "tolerant", remote, **unreachable)
    result = cache.entries.get_or_build(key, material("a"), builder(calls))
    assert not result.hit and len(calls) == 1 and cache.entries.lookup(key).hit
    other = engine_key(material("b"))
    cache.entries.get_or_build(other, material("b"), builder(calls))  # the run goes on without asking again
    assert len(cache.warnings) == 1 and "going on without the remote cache" in cache.warnings[0]
    assert cache.stats.summary("entries")["remote"]["errors"] == 1
    strict = machine(tmp_path, "strict", remote, required=True, **unreachable)
    with pytest.raises(RemoteUnavailableError, match="remote_required"):
        strict.entries.get_or_build(key, material("a"), builder(calls))
    assert len(calls) == 2


def test_a_required_remote_that_fails_the_push_keeps_the_local_build(tmp_path, remote, monkeypatch):
    key = engine_key(material("a"))
    cache = machine(tmp_path, "strict", remote, required=True)

    def refuse(*args, **kwargs):
        raise RemoteUnavailableError("remote cache: uploading refused (AccessDenied)")

    monkeypatch.setattr(cache.remote.objects, "upload", refuse)
    with pytest.raises(RemoteUnavailableError, match="AccessDenied"):
        cache.entries.get_or_build(key, material("a"), builder([]))
    assert cache.entries.lookup(key, material("a")).hit
    assert cache.remote.objects.stat(manifest_name("entries", key)) is None


def test_prune_remote_drops_the_least_recently_used_entry_and_its_files_only(tmp_path, remote):
    cache = machine(tmp_path, "m", remote)
    old, new = engine_key(material("old")), engine_key(material("new"))
    cache.entries.get_or_build(old, material("old"), builder([], b"old"))
    time.sleep(1.1)  # S3 times have one-second steps
    cache.entries.get_or_build(new, material("new"), builder([], b"new"))
    size = remote_entries(cache.remote)[0].size_bytes
    dry = prune_remote(cache.remote, older_than_s=None, max_size_bytes=size, dry_run=True, grace_s=0)
    assert [e["key"] for e in dry["removed"]] == [old] and len(remote_entries(cache.remote)) == 2
    report = prune_remote(cache.remote, older_than_s=None, max_size_bytes=size, grace_s=0)
    assert [e["key"] for e in report["removed"]] == [old] and report["files_removed"] == 1  # engine.json is shared
    assert [e.key for e in remote_entries(cache.remote)] == [new] and verify_remote(cache.remote)[0]["ok"]
    kept = prune_remote(cache.remote, older_than_s=0, max_size_bytes=None)  # used within the grace hour
    assert kept["removed"] == [] and kept["kept"] == 1


def test_prune_remote_keeps_a_damaged_entry_for_the_grace_and_a_newer_kilns_entry_and_files_always(tmp_path,
                                                                                                    remote):
    cache = machine(tmp_path, "m", remote)
    newer, damaged = engine_key(material("newer")), engine_key(material("damaged"))
    for name in ("newer", "damaged"):
        cache.entries.get_or_build(engine_key(material(name)), material(name), builder([], name.encode()))
    objects = cache.remote.objects
    manifest = json.loads(objects.read(manifest_name("entries", newer)))
    objects.write(manifest_name("entries", newer), json.dumps({**manifest, "manifest_version": 2}).encode())
    objects.write(manifest_name("entries", damaged), b"torn")
    assert prune_remote(cache.remote, older_than_s=0, max_size_bytes=0)["removed"] == []  # used within the grace
    report = prune_remote(cache.remote, older_than_s=0, max_size_bytes=0, grace_s=0)
    assert [e["key"] for e in report["removed"]] == [damaged] and report["newer_entries"] == 1
    assert report["files_removed"] == 0 and [e.key for e in remote_entries(cache.remote)] == [newer]
    [checked] = verify_remote(cache.remote)  # not this Kiln's to judge, as a local one: no problem, no read
    assert checked["ok"] and checked["files_checked"] == 0 and "a newer Kiln's entry" in checked["incompatible"]


def test_prune_remote_caps_the_files_stored_once_not_each_entrys_listed_size(tmp_path, monkeypatch):
    folder = tmp_path / "shared"
    folder.mkdir()
    cache, keys = machine(tmp_path, "m", Remote(RemoteSpec(folder.as_uri()), {})), []
    for age, batch in ((300, 1), (200, 2), (100, 4)):  # one weights file, an engine.json per max_batch_size
        keys.append(key := engine_key({**material("w"), "max_batch_size": batch}))

        def build(out: Path, batch=batch) -> dict:
            (out / "engine.json").write_text(f'{{"max_batch_size": {batch}}}')
            (out / "rank0.safetensors").write_bytes(b"w" * 10_000)
            return {}

        cache.entries.get_or_build(key, {**material("w"), "max_batch_size": batch}, build)
        for name in ("manifest.json", "last_used"):
            os.utime(folder / "v1" / "entries" / key[:2] / key / name, (time.time() - age,) * 2)
    stored = sum(path.stat().st_size for path in (folder / "v1" / "blobs").rglob("*") if path.is_file())
    oldest_config = len('{"max_batch_size": 1}')
    assert sum(entry.size_bytes for entry in remote_entries(cache.remote)) == 3 * 10_000 + stored - 10_000
    fits = prune_remote(cache.remote, older_than_s=None, max_size_bytes=stored, dry_run=True, grace_s=0)
    assert fits["removed"] == [] and fits["freed_bytes"] == 0 and fits["stored_bytes"] == stored
    over = prune_remote(cache.remote, older_than_s=None, max_size_bytes=stored - 1, grace_s=0)
    assert [e["key"] for e in over["removed"]] == keys[:1]  # the weights stay: the other two list them
    assert over["freed_bytes"] == oldest_config and over["stored_bytes"] == stored - oldest_config
    monkeypatch.setenv("KILN_CACHE_REMOTE", folder.as_uri())
    listed = runner.invoke(cache_app, ["ls", "--remote", "--cache-dir", str(tmp_path / "m")])
    assert f"2 entries, {format_bytes(2 * 10_000 + stored - oldest_config - 10_000)} listed, " \
           f"{format_bytes(stored - oldest_config)} stored on {folder.as_uri()}" in listed.stderr


def test_prune_remote_of_a_read_only_shared_folder_fails_in_one_line_at_an_unfinished_upload(tmp_path, monkeypatch):
    folder = tmp_path / "shared"
    (folder / "v1" / "blobs" / "ab").mkdir(parents=True)
    partial = folder / "v1" / "blobs" / "ab" / f"{filesystem.TEMPORARY}ab12.3f4e"
    partial.write_bytes(b"half")
    os.utime(partial, (0, 0))  # a push killed long ago
    unlink = Path.unlink

    def read_only(path: Path, missing_ok: bool = False) -> None:
        if path.name.startswith(filesystem.TEMPORARY):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", read_only)
    monkeypatch.setenv("KILN_CACHE_REMOTE", folder.as_uri())
    result = runner.invoke(cache_app, ["prune", "--remote", "--older-than", "30d", "--cache-dir", str(tmp_path / "c"),
                                       "--json"])
    assert result.exit_code == 2 and json.loads(result.stdout)["error"]["message"] == (
        f"remote cache {folder.as_uri()}: deleting v1/blobs/ab/{partial.name} failed (Read-only file system)")


def test_prune_remote_of_a_shared_folder_with_an_unreadable_folder_fails_and_deletes_nothing(tmp_path, monkeypatch):
    folder = tmp_path / "shared"
    folder.mkdir()
    cache = machine(tmp_path, "m", Remote(RemoteSpec(folder.as_uri()), {}))
    key = engine_key(material("a"))
    cache.entries.get_or_build(key, material("a"), builder([]))
    files = sorted(folder.rglob("*"))
    unreadable, scandir = folder / "v1" / "entries" / key[:2], os.scandir

    def scandir_denied_there(path="."):
        if Path(path) == unreadable:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", scandir_denied_there)
    with pytest.raises(RemoteUnavailableError, match=f"listing v1/entries/{key[:2]} failed"):
        prune_remote(cache.remote, older_than_s=None, max_size_bytes=None, grace_s=0)
    monkeypatch.undo()
    assert sorted(folder.rglob("*")) == files


def test_a_read_error_mid_file_fails_verify_remote_as_an_unreachable_remote(tmp_path, remote, monkeypatch):
    cache = machine(tmp_path, "m", remote)
    cache.entries.get_or_build(engine_key(material("a")), material("a"), builder([]))

    class FailsAfterOneByte(io.BytesIO):
        def read(self, size: int = -1) -> bytes:
            if self.tell():
                raise OSError(errno.EIO, "Input/output error")
            return super().read(1)

    def chunks_then_a_dropped_connection(body, size):
        yield body.read(1)
        raise IncompleteReadError(actual_bytes=1, expected_bytes=2)

    monkeypatch.setattr(filesystem, "open", lambda *args: FailsAfterOneByte(b"ab"), raising=False)
    monkeypatch.setattr(StreamingBody, "iter_chunks", chunks_then_a_dropped_connection)
    with pytest.raises(RemoteUnavailableError, match="reading v1/blobs/.* failed"):
        verify_remote(cache.remote)


def test_cache_commands_push_ls_verify_and_pull_through_the_remote(tmp_path, remote, monkeypatch):
    for name, value in remote.env.items():
        monkeypatch.setenv(name, value)
    first = EngineCache.open(tmp_path / "first")
    key = engine_key(material("a"))
    first.entries.get_or_build(key, material("a"), builder([]), describe={"model": "tiny", "format": "fp8"})

    def kiln_cache(root: str, *args: str) -> tuple[int, object]:
        result = runner.invoke(cache_app, [*args, "--cache-dir", str(tmp_path / root), "--json"])
        return result.exit_code, json.loads(result.stdout) if result.stdout.strip() else None

    code, pushed = kiln_cache("first", "push", "--all")
    assert code == 0 and [row["outcome"] for row in pushed["pushed"]] == ["pushed"]
    assert kiln_cache("first", "push", key[:8])[1]["pushed"][0]["outcome"] == "present"
    code, rows = kiln_cache("first", "ls", "--remote")
    assert code == 0 and [(r["key"], r["model"]) for r in rows] == [(key, "tiny")]
    assert kiln_cache("first", "verify", "--remote", "--all")[0] == 0
    code, verified = kiln_cache("first", "verify", "--remote", key[:6])
    assert code == 0 and [r["key"] for r in verified] == [key]
    assert kiln_cache("first", "verify", "--remote", key[:3])[0] != 0  # too short to be a key's prefix
    code, pulled = kiln_cache("second", "pull", key[:10])
    assert code == 0 and pulled["pulled"] and Path(pulled["path"], "engine.json").is_file()
    assert kiln_cache("second", "pull", "0000")[0] != 0
    code, stats = kiln_cache("second", "stats")
    assert stats["remote"]["hits"] == 1 and stats["remote"]["url"] == remote.spec.url
    code, kept = kiln_cache("first", "prune", "--remote", "--older-than", "0s")
    assert code == 0 and kept["removed"] == [] and kept["kept"] == 1  # used within the default grace hour
    code, pruned = kiln_cache("first", "prune", "--remote", "--max-size", "0", "--grace", "0s")
    assert code == 0 and [e["key"] for e in pruned["removed"]] == [key] and pruned["files_removed"] == 2
    assert kiln_cache("first", "ls", "--remote")[1] == []
    assert kiln_cache("typo", "ls", "--remote")[0] == 0 and not (tmp_path / "typo").exists()  # the remote's alone


def test_push_says_how_many_entries_it_pushed_not_how_many_the_remote_holds(tmp_path, monkeypatch):
    (tmp_path / "shared").mkdir()
    url = (tmp_path / "shared").as_uri()
    monkeypatch.setenv("KILN_CACHE_REMOTE", url)
    EngineCache.open(tmp_path / "cache").entries.get_or_build(engine_key(material("a")), material("a"), builder([]))

    def push() -> str:
        return runner.invoke(cache_app, ["push", "--all", "--cache-dir", str(tmp_path / "cache")]).stderr

    assert push().endswith(f"pushed 1 entry to {url}\n")
    assert push().endswith(f"pushed 0 entries to {url}; 1 was already there\n")


@pytest.mark.parametrize(("damage", "problem"), [
    ({"key": "f" * 64}, f"manifest names key '{'f' * 64}'"),
    ({"material": {**material("a"), "max_batch_size": 9}}, "stored key material does not hash to the key"),
])
def test_push_refuses_an_entry_whose_manifest_verify_calls_corrupt(tmp_path, monkeypatch, damage, problem):
    key = engine_key(material("a"))
    entry = EngineCache.open(tmp_path / "cache").entries.get_or_build(key, material("a"), builder([])).entry_dir
    manifest = json.loads((entry / "manifest.json").read_text())
    (entry / "manifest.json").write_text(json.dumps({**manifest, **damage}))
    (tmp_path / "shared").mkdir()
    monkeypatch.setenv("KILN_CACHE_REMOTE", (tmp_path / "shared").as_uri())
    for force in ([], ["--force"]):
        result = runner.invoke(cache_app, ["push", key[:4], *force, "--cache-dir", str(tmp_path / "cache")])
        assert result.exit_code != 0 and "not pushed, the local entry is damaged" in result.stderr
        assert problem in result.stderr.replace("\n", "")
    assert not [p for p in (tmp_path / "shared").rglob("*") if p.is_file()]  # nothing reached the team's remote


def test_ls_and_verify_json_rows_have_the_same_keys_and_values_local_and_remote(tmp_path, monkeypatch):
    (tmp_path / "shared").mkdir()
    monkeypatch.setenv("KILN_CACHE_REMOTE", (tmp_path / "shared").as_uri())
    key = engine_key(material("a"))
    EngineCache.open(tmp_path / "cache").entries.get_or_build(key, material("a"), builder([]),
                                                              describe={"model": "tiny", "format": "fp8"})

    def rows(*args: str) -> list[dict]:
        return json.loads(runner.invoke(cache_app, [*args, "--cache-dir", str(tmp_path / "cache"), "--json"]).stdout)

    rows("push", "--all")
    [local], [remote] = rows("ls"), rows("ls", "--remote")
    assert list(local) == list(remote)
    assert {**local, "hits": None, "last_used": None} == {**remote, "last_used": None}  # a remote counts no hits
    assert local["hits"] == 0 and local["problem"] is None and remote["model"] == "tiny"
    assert rows("verify", "--all") == rows("verify", "--all", "--remote") == [
        {"key": key, "store": "entries", "ok": True, "files_checked": 2, "problems": [], "incompatible": None}]


def test_remote_commands_without_a_remote_say_how_to_name_one_and_create_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("KILN_CACHE_REMOTE", raising=False)
    for command in (["ls", "--remote"], ["verify", "--all", "--remote"], ["prune", "--older-than", "1d", "--remote"],
                    ["pull", "abcd"]):
        result = runner.invoke(cache_app, [*command, "--cache-dir", str(tmp_path / "typo")])
        assert result.exit_code == 2 and "KILN_CACHE_REMOTE" in result.stderr, command
    assert not (tmp_path / "typo").exists()


def test_an_empty_kiln_cache_remote_turns_off_the_remote_a_cache_recorded_too(tmp_path, monkeypatch):
    (tmp_path / "remote").mkdir()
    EngineCache.open(tmp_path / "cache", remote=RemoteSpec((tmp_path / "remote").as_uri()))  # a build recorded it
    listing = ["ls", "--remote", "--cache-dir", str(tmp_path / "cache")]
    monkeypatch.delenv("KILN_CACHE_REMOTE", raising=False)
    assert runner.invoke(cache_app, listing).exit_code == 0
    monkeypatch.setenv("KILN_CACHE_REMOTE", "")
    result = runner.invoke(cache_app, listing)
    assert result.exit_code == 2 and "no remote cache is configured" in result.stderr
    assert runner.invoke(cache_app, ["push", "--all", "--cache-dir", str(tmp_path / "cache")]).exit_code == 2


@pytest.mark.parametrize("record", [{"url": 5}, {"url": "file:///shared", "required": "yes"}])
def test_a_recorded_remote_with_a_field_of_the_wrong_type_is_ignored_as_garbage_is(tmp_path, monkeypatch, record):
    monkeypatch.delenv("KILN_CACHE_REMOTE", raising=False)
    cache = EngineCache.open(tmp_path / "cache")
    (cache.v1 / "remote.json").write_text(json.dumps(record))
    assert runner.invoke(cache_app, ["ls", "--cache-dir", str(tmp_path / "cache")]).exit_code == 0
    result = runner.invoke(cache_app, ["ls", "--remote", "--cache-dir", str(tmp_path / "cache")])
    assert result.exit_code == 2 and "no remote cache is configured" in result.stderr


def test_remote_settings_are_checked_where_they_are_written(monkeypatch):
    for url, problem in (("s3://key:secret@bucket/x", "credentials"), ("http://bucket/x", "s3://bucket/prefix"),
                         ("file://relative/x", "absolute"), ("s3://B/x", "bucket name")):
        with pytest.raises(ValueError, match=problem):
            KilnConfig.model_validate({"model": {"path": "m"}, "cache": {"remote": url}})
    with pytest.raises(ValueError, match="credentials"):
        KilnConfig.model_validate({"model": {"path": "m"},
                                   "cache": {"remote": "s3://bucket/x", "remote_endpoint": "http://u:p@minio:9000"}})
    secret = "X-Amz-Signature=s3cr3t"
    for cache in ({"remote": f"s3://bucket/x?{secret}"}, {"remote": "s3://bucket/x", "remote_endpoint":
                  f"http://minio:9000/?{secret}"}, {"remote": "s3://bucket/x", "remote_endpoint": "minio://AK:s3cr3t@h"}):
        with pytest.raises(ValueError, match="not shown") as refused:
            KilnConfig.model_validate({"model": {"path": "m"}, "cache": cache})
        assert "s3cr3t" not in refused.value.errors()[0]["msg"]  # what Kiln prints of it (not pydantic's input)
    monkeypatch.delenv("KILN_CACHE_REMOTE", raising=False)
    for endpoint, required, setting in ((None, True, "remote_required"),
                                        ("http://minio:9000", False, "remote_endpoint")):
        with pytest.raises(ConfigError, match=f"cache.{setting} is set, but no remote cache is"):
            remote_spec(None, endpoint, required)
    with pytest.raises(ValueError, match="cache.remote_endpoint names an S3-compatible service, which the file"):
        KilnConfig.model_validate({"model": {"path": "m"}, "cache": {"remote": "file:///shared/kiln",
                                                                     "remote_endpoint": "http://minio:9000"}})
    monkeypatch.setenv("KILN_CACHE_REMOTE", "file:///shared/kiln")  # an s3 config's endpoint is left aside
    assert remote_spec("s3://bucket/x", "http://minio:9000").url == "file:///shared/kiln"
    monkeypatch.setenv("KILN_CACHE_REMOTE", "ftp://nowhere")
    with pytest.raises(ConfigError, match=r"\$KILN_CACHE_REMOTE"):
        remote_spec("s3://bucket/x")
    monkeypatch.setenv("KILN_CACHE_REMOTE", "")
    assert remote_spec("s3://bucket/x") is None  # an empty value turns the configured remote off
    assert remote_spec("s3://bucket/x", "http://minio:9000", True) is None  # and what goes with it


@pytest.mark.slow
def test_four_machines_building_one_config_together_build_once_and_pull_three_times(tmp_path, remote):
    """Four processes, four local caches, one remote: one calibration and one engine build, three verified pulls
    of the engine (the bundled tiny model, FP8, calibrated in one small round: the tiers are under test, not the
    calibration). A fifth machine with another batch size (another engine key) pulls the quantized checkpoint and
    skips calibration."""
    small = quick_fp8_config(tmp_path)
    procs = [subprocess.Popen([sys.executable, "-m", "kiln", "build", str(small), "--json"],
                              env=repo_env(**remote.env, KILN_CACHE=str(tmp_path / f"machine{i}")),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(4)]
    outputs = [proc.communicate(timeout=600) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), [err.decode()[-1500:] for _, err in outputs]
    results = [json.loads(out) for out, _ in outputs]
    assert len({r["engine_key"] for r in results}) == 1
    assert sorted(r["cache"]["hit"] for r in results) == [False, True, True, True]
    caches = [EngineCache.open_configured(tmp_path / f"machine{i}") for i in range(4)]
    engines = [cache.stats.summary("entries") for cache in caches]
    checkpoints = [cache.stats.summary("quantized") for cache in caches]
    assert sum(s["builds"] for s in engines) == 1 and sum(s["remote"]["hits"] for s in engines) == 3
    # one calibration; a machine that planned after the engine was pushed needs no checkpoint at all
    quantize_ran = sum(r["stages"][0]["action"] == "run" for r in results)
    assert sum(s["builds"] for s in checkpoints) == 1
    assert sum(s["remote"]["hits"] for s in checkpoints) == quantize_ran - 1
    key = results[0]["engine_key"]
    assert len({tuple(sorted(payload_bytes(cache, key).items())) for cache in caches}) == 1
    assert all(verify_entry(cache.entries, key).ok for cache in caches)
    tier = EngineCache.open(tmp_path / "checker", remote=remote.spec).remote
    assert [r["ok"] for r in verify_remote(tier)] == [True, True]

    (tmp_path / "bigger").mkdir()
    config = quick_fp8_config(tmp_path / "bigger", **{"max_batch_size: 8": "max_batch_size: 4"})
    fifth = subprocess.run([sys.executable, "-m", "kiln", "build", str(config), "--json"], capture_output=True,
                           env=repo_env(**remote.env, KILN_CACHE=str(tmp_path / "machine4")), timeout=600)
    assert fifth.returncode == 0, fifth.stderr.decode()[-1500:]
    assert json.loads(fifth.stdout)["engine_key"] != key
    quantized = EngineCache.open_configured(tmp_path / "machine4").stats.summary("quantized")
    assert quantized["builds"] == 0 and quantized["remote"]["hits"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("remote", ["file"], indirect=True)
def test_an_engine_refused_on_pull_is_rebuilt_from_the_checkpoint_the_plan_had_deferred(tmp_path, remote):
    """The remote has the engine, so the plan skips the quantize stage; the engine's copy is damaged, so the build
    stage fetches the checkpoint after all (pulled, not recalibrated) and builds."""
    config = quick_fp8_config(tmp_path)

    def build(machine: str) -> dict:
        proc = subprocess.run([sys.executable, "-m", "kiln", "build", str(config), "--json"], capture_output=True,
                              env=repo_env(**remote.env, KILN_CACHE=str(tmp_path / machine)), timeout=600)
        assert proc.returncode == 0, proc.stderr.decode()[-1500:]
        return json.loads(proc.stdout)

    key = build("first")["engine_key"]
    dry = subprocess.run([sys.executable, "-m", "kiln", "build", str(config), "--dry-run", "--json"],
                         capture_output=True, env=repo_env(**remote.env, KILN_CACHE=str(tmp_path / "fresh")))
    plan = {stage["name"]: stage for stage in json.loads(dry.stdout)["stages"]}  # no local cache: the remote's
    assert plan["quantize"]["action"] == "skip" and "will be pulled" in plan["build"]["reason"]
    assert not (tmp_path / "fresh").exists()
    first = EngineCache.open_configured(tmp_path / "first")
    manifest = json.loads(first.entries.entry_dir(key).joinpath("manifest.json").read_bytes())
    blob = Path(remote.spec.url.removeprefix("file://")) / blob_name(manifest["files"][0]["sha256"])
    blob.write_bytes(blob.read_bytes()[:-1] + b"\0")
    second = build("second")
    assert second["stages"][0]["action"] == "skip" and "fetched only if" in second["stages"][0]["reason"]
    assert not second["cache"]["hit"] and second["quantization"]["format"] == "fp8"
    cache = EngineCache.open_configured(tmp_path / "second")
    assert cache.stats.summary("entries")["builds"] == 1 and cache.stats.summary("entries")["remote"]["corrupt"] == 1
    assert cache.stats.summary("quantized")["builds"] == 0 and cache.stats.summary("quantized")["remote"]["hits"] == 1


def test_serving_a_key_this_machine_lacks_pulls_the_engine_from_the_remote(tmp_path, remote, monkeypatch):
    from kiln.pipeline.targets import resolve_target

    key = engine_key(material("a"))
    machine(tmp_path, "builder", remote).entries.get_or_build(key, material("a"), builder([]))
    for name, value in remote.env.items():
        monkeypatch.setenv(name, value)
    target = resolve_target(key[:10], tmp_path / "server")  # as `kiln serve KEY` on a fresh machine
    assert target.kind == "engine" and target.cache_key == key and (target.path / "engine.json").is_file()
    assert EngineCache.open_configured(tmp_path / "server").stats.summary("entries")["remote"]["hits"] == 1
    with pytest.raises(CacheEntryNotFoundError, match="no entry on"):
        resolve_target("abcdef12", tmp_path / "server")


def test_a_push_completes_an_entry_missing_files_on_the_remote_and_survives_a_concurrent_prune(tmp_path, remote):
    key = engine_key(material("a"))
    cache = machine(tmp_path, "a", remote)
    cache.entries.get_or_build(key, material("a"), builder([]))  # built and pushed
    objects = cache.remote.objects
    manifest = json.loads(objects.read(manifest_name("entries", key)))
    blobs = [blob_name(item["sha256"]) for item in manifest["files"]]
    objects.delete(blobs[0])  # the entry on the remote lacks a file: it is not "present"
    assert cache.entries.push(key).outcome == "pushed" and verify_remote(cache.remote)[0]["ok"]
    real_write = objects.write

    def write_after_a_prune(name, *args, **kwargs):  # a prune deletes the files no manifest lists yet
        if name == manifest_name("entries", key):
            for blob in blobs:
                objects.delete(blob)
        return real_write(name, *args, **kwargs)

    objects.write = write_after_a_prune
    assert cache.entries.push(key, replace=True).outcome == "pushed"
    assert verify_remote(cache.remote)[0]["ok"]


def test_bench_refuses_an_engine_key_before_pulling_it(tmp_path, remote, monkeypatch):
    from kiln.pipeline.bench.command import bench

    key = engine_key(material("a"))
    machine(tmp_path, "builder", remote).entries.get_or_build(key, material("a"), builder([]))
    for name, value in {**remote.env, "KILN_CACHE": str(tmp_path / "bencher")}.items():
        monkeypatch.setenv(name, value)
    app = typer.Typer()
    app.command()(bench)
    result = runner.invoke(app, [key[:10]])
    assert result.exit_code == 2 and "kiln loadtest" in result.stderr and "cache key" in result.stderr
    assert not (tmp_path / "bencher").exists()  # nothing pulled


def test_a_remote_entry_was_created_when_it_was_built_not_when_it_was_pushed(tmp_path, remote):
    from kiln.engines.cache.units import parse_iso

    cache = machine(tmp_path, "m", remote)
    key = engine_key(material("a"))
    entry = cache.entries.get_or_build(key, material("a"), builder([])).entry_dir
    built = parse_iso(json.loads((entry / "manifest.json").read_text())["created"])
    time.sleep(1.1)  # a push a second later (S3 times have one-second steps)
    cache.remote.objects.upload(manifest_name("entries", key), entry / "manifest.json", lambda n: None)
    [listed] = remote_entries(cache.remote)
    assert listed.created == built < listed.last_used


def test_a_dry_run_or_explain_reads_the_cache_and_leaves_its_recorded_limits_and_remote(tmp_path, monkeypatch):
    from kiln.pipeline.config import load_config
    from kiln.pipeline.runner import open_cache

    (tmp_path / "remote").mkdir()
    cache = EngineCache.open(tmp_path / "cache", max_size_bytes=10**9, remote=RemoteSpec((tmp_path / "remote")
                                                                                           .as_uri()))
    recorded = {name: (cache.v1 / name).read_bytes() for name in ("limits.json", "remote.json")}
    config = tmp_path / "other.yaml"  # no remote, a smaller limit
    config.write_text(f"model:\n  path: {REPO / 'models' / 'tiny-llama'}\ncache:\n  dir: {tmp_path / 'cache'}\n"
                      "  max_size_gb: 0.001\n")
    monkeypatch.delenv("KILN_CACHE_REMOTE", raising=False)
    monkeypatch.delenv("KILN_CACHE", raising=False)
    open_cache(load_config(config), create=False)  # what build --dry-run and cache explain open
    assert {name: (cache.v1 / name).read_bytes() for name in recorded} == recorded


def test_a_file_url_names_its_folder_percent_decoded_as_path_as_uri_writes_it(tmp_path):
    from kiln.engines.cache.remote.spec import open_objects

    folder = tmp_path / "team cache"
    assert open_objects(RemoteSpec(folder.as_uri())).root == folder


MONTH = 30 * 86400


def shared_folder_machine(tmp_path: Path, name: str) -> EngineCache:
    folder = tmp_path / "shared"
    folder.mkdir(exist_ok=True)
    return machine(tmp_path, name, Remote(RemoteSpec(folder.as_uri()), {}))


def unused_for_40_days(tmp_path: Path) -> None:
    for path in (tmp_path / "shared").rglob("*"):
        os.utime(path, (time.time() - 40 * 86400,) * 2)


def test_prune_remote_keeps_a_month_old_entry_while_a_pull_of_it_is_in_flight(tmp_path, monkeypatch):
    key = engine_key(material("a"))
    builder_machine, puller = shared_folder_machine(tmp_path, "a"), shared_folder_machine(tmp_path, "b")
    builder_machine.entries.get_or_build(key, material("a"), builder([]))
    unused_for_40_days(tmp_path)
    reports, download = [], puller.remote.objects.download

    def prune_then_download(name, path, progress):  # a prune that starts while the pull reads the files
        if not reports:
            reports.append(prune_remote(builder_machine.remote, older_than_s=MONTH, max_size_bytes=None))
        return download(name, path, progress)

    monkeypatch.setattr(puller.remote.objects, "download", prune_then_download)
    assert puller.entries.pull(key).pulled and reports[0]["removed"] == []
    unused_for_40_days(tmp_path)
    listed = remote_entries(builder_machine.remote)

    def listed_then_a_pull_starts(tier):  # what a pull does first: its entry is used from now on
        puller.remote.mark_used("entries", key)
        return listed

    monkeypatch.setattr("kiln.engines.cache.remote.maintenance.remote_entries", listed_then_a_pull_starts)
    assert prune_remote(builder_machine.remote, older_than_s=MONTH, max_size_bytes=None)["removed"] == []
    assert verify_remote(builder_machine.remote)[0]["ok"]


def test_a_pull_whose_entry_a_prune_removes_meanwhile_is_a_miss_not_damage(tmp_path, monkeypatch):
    key = engine_key(material("a"))
    builder_machine, puller = shared_folder_machine(tmp_path, "a"), shared_folder_machine(tmp_path, "b")
    builder_machine.entries.get_or_build(key, material("a"), builder([]))
    objects = builder_machine.remote.objects
    files = [blob_name(item["sha256"]) for item in json.loads(objects.read(manifest_name("entries", key)))["files"]]
    download = puller.remote.objects.download

    def removed_then_download(name, path, progress):
        for gone in [manifest_name("entries", key), *files]:
            objects.delete(gone)
        return download(name, path, progress)

    monkeypatch.setattr(puller.remote.objects, "download", removed_then_download)
    with pytest.raises(CacheEntryNotFoundError, match="no engine entry on"):
        puller.entries.pull(key)
    remote_stats = puller.stats.summary("entries")["remote"]
    assert remote_stats["corrupt"] == 0 and remote_stats["misses"] == 1


def test_a_push_reusing_old_files_keeps_them_from_a_prune_that_listed_the_manifests_before_it(tmp_path, monkeypatch):
    old, new = engine_key(material("w")), engine_key({**material("w"), "max_batch_size": 2})
    pusher = shared_folder_machine(tmp_path, "a")
    pusher.entries.get_or_build(old, material("w"), builder([]))  # pushed; the new one shares both files
    unused_for_40_days(tmp_path)
    EngineCache.open(tmp_path / "a").entries.get_or_build(new, {**material("w"), "max_batch_size": 2}, builder([]))
    listed = remote_entries(pusher.remote)

    def listed_then_a_push(tier):  # the push lands after the prune read the manifests
        assert pusher.entries.push(new).files_uploaded == 0
        return listed

    monkeypatch.setattr("kiln.engines.cache.remote.maintenance.remote_entries", listed_then_a_push)
    report = prune_remote(shared_folder_machine(tmp_path, "b").remote, older_than_s=MONTH, max_size_bytes=None)
    monkeypatch.undo()
    assert [e["key"] for e in report["removed"]] == [old] and report["files_removed"] == 0
    assert [(r["key"], r["ok"]) for r in verify_remote(pusher.remote)] == [(new, True)]
    assert prune_remote(pusher.remote, older_than_s=None, max_size_bytes=None, grace_s=0)["files_removed"] == 0
    assert not [path for path in (tmp_path / "shared" / "v1" / "reused").rglob("*") if path.is_file()]
    assert verify_remote(pusher.remote)[0]["ok"]  # the marks go once older than the grace; the files are listed


def test_push_all_json_names_the_entries_pushed_before_one_failed(tmp_path, monkeypatch):
    cache = EngineCache.open(tmp_path / "a")
    keys = {engine_key(material(name)): material(name) for name in ("a", "b")}
    for key, key_material in keys.items():
        cache.entries.get_or_build(key, key_material, builder([]))
    first, second = sorted(keys)  # the order push --all takes them in
    (tmp_path / "shared").mkdir()
    (cache.entries.payload_dir(second) / "engine.json").write_text('{"format": "altered"}')
    monkeypatch.setenv("KILN_CACHE_REMOTE", (tmp_path / "shared").as_uri())
    result = runner.invoke(cache_app, ["push", "--all", "--json", "--cache-dir", str(tmp_path / "a")])
    report = json.loads(result.stdout)
    assert result.exit_code == 3 and [row["key"] for row in report["pushed"]] == [first]
    assert report["error"]["type"] == "CacheCorruptError" and second in report["error"]["message"]
