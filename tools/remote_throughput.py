"""Push and pull throughput of the engine cache's remote tier against a local S3-protocol server (moto's, in its own
process on loopback) and a file:// folder, next to a plain file copy on the same disk (the floor here).

    python tools/remote_throughput.py [--gb 1.0] [--json]

An entry of two files (3/4 and 1/4 of the size, random bytes) is built in one local cache, pushed, then pulled into a
second cache (every file's sha256 checked before the local publish). Prints one row per remote."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import boto3

from kiln.engines.cache import EngineCache, engine_key
from kiln.engines.cache.remote import RemoteSpec

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen, str]:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return server, endpoint
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("moto server did not start")


def write_random(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        for start in range(0, size, 64 * 2**20):
            f.write(os.urandom(min(64 * 2**20, size - start)))


def measure(work: Path, spec: RemoteSpec, size: int) -> dict:
    material = {"key_schema": 1, "kind": "engine", "bench": spec.url}
    key = engine_key(material)
    source = EngineCache.open(work / f"source-{spec.url.split(':')[0]}")

    def build(out: Path) -> dict:
        write_random(out / "rank0.safetensors", size * 3 // 4)
        write_random(out / "tokenizer.safetensors", size - size * 3 // 4)
        (out / "engine.json").write_text("{}")  # an engine's entry: a pull refuses one without
        return {}

    source.entries.get_or_build(key, material, build)
    source = EngineCache.open(source.root, remote=spec)
    push = source.entries.push(key)
    target = EngineCache.open(work / f"target-{spec.url.split(':')[0]}", remote=spec)
    started = time.monotonic()
    target.entries.pull(key)
    pull_s = time.monotonic() - started
    return {"remote": spec.url.split(":")[0], "bytes": size, "push_s": push.seconds,
            "push_mb_s": size / push.seconds / 1e6, "pull_s": round(pull_s, 3), "pull_mb_s": size / pull_s / 1e6}


def boto3_alone(endpoint: str, payload: Path, target: Path) -> dict:
    """The same server through boto3's transfer manager with Kiln's settings and nothing else (no hashing, one
    file): what the server and client can do, for comparison."""
    from kiln.engines.cache.remote.s3 import S3Objects

    objects = S3Objects("kiln-bench", "alone", endpoint_url=endpoint)
    size = payload.stat().st_size
    started = time.monotonic()
    objects.upload("file", payload, lambda n: None)
    push_s = time.monotonic() - started
    started = time.monotonic()
    objects.download("file", target, lambda n: None)
    pull_s = time.monotonic() - started
    return {"remote": "s3, boto3 alone (one file)", "bytes": size, "push_s": round(push_s, 3),
            "push_mb_s": size / push_s / 1e6, "pull_s": round(pull_s, 3), "pull_mb_s": size / pull_s / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="size of the entry in GB (10^9 bytes)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    size = int(args.gb * 1e9)
    os.environ.update(CREDENTIALS)
    server, endpoint = start_moto()
    rows = []
    try:
        with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
            work = Path(tmp)
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="kiln-bench")
            rows.append(measure(work, RemoteSpec("s3://kiln-bench/cache", endpoint), size))
            (work / "shared").mkdir()
            rows.append(measure(work, RemoteSpec(f"file://{work / 'shared'}"), size))
            payload = next((work / "source-s3").rglob("rank0.safetensors"))
            rows.append(boto3_alone(endpoint, payload, work / "downloaded"))
            started = time.monotonic()
            shutil.copyfile(payload, work / "copy")
            copy_s = time.monotonic() - started
            rows.append({"remote": "cp (one file, same disk)", "bytes": payload.stat().st_size,
                         "pull_mb_s": payload.stat().st_size / copy_s / 1e6})
    finally:
        server.terminate()
        server.wait()
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'remote':<26}{'GB':>6}{'push MB/s':>11}{'pull MB/s':>11}")
    for row in rows:
        push = f"{row['push_mb_s']:.0f}" if "push_mb_s" in row else "-"
        print(f"{row['remote']:<26}{row['bytes'] / 1e9:>6.2f}{push:>11}{row['pull_mb_s']:>11.0f}")


if __name__ == "__main__":
    main()
