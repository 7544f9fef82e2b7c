"""An S3-compatible bucket prefix as the remote tier's object store (AWS S3, MinIO, Ceph, R2, ...), through boto3.

Credentials, region and endpoint come from the standard AWS chain (environment, shared config and credentials
files, instance roles; ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``) unless an endpoint is given; nothing here
logs or stores them. Large files move as parallel multipart transfers (boto3's transfer manager)."""

from __future__ import annotations

import email.utils
from collections.abc import Iterator
from pathlib import Path

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from kiln.engines.cache.remote.objects import ObjectInfo, Progress, RemoteUnavailableError

PART_BYTES = 64 * 2**20  # multipart part size; an 8 GB engine file moves as 128 parts
CHUNK_BYTES = 8 * 2**20
MISSING = {"404", "NoSuchKey", "NotFound"}
CONDITION_FAILED = {"412", "PreconditionFailed", "409", "ConditionalRequestConflict"}


class S3Objects:
    """The objects under ``s3://bucket/prefix``; ``transfer_threads`` parts of one file move at once."""

    def __init__(self, bucket: str, prefix: str, *, endpoint_url: str | None = None, transfer_threads: int = 8,
                 connect_timeout_s: float = 5.0) -> None:
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        config = Config(connect_timeout=connect_timeout_s, read_timeout=60, max_pool_connections=4 * transfer_threads,
                        retries={"max_attempts": 3, "mode": "standard"})
        self._client = boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)
        self._transfer = TransferConfig(multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES,
                                        max_concurrency=transfer_threads, use_threads=True)

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _fail(self, what: str, name: str, exc: Exception) -> RemoteUnavailableError:
        if isinstance(exc, ClientError):
            error = exc.response.get("Error", {})
            reason = f"{error.get('Code', '?')}: {error.get('Message') or 'no message'}"
        else:
            reason = f"{type(exc).__name__}: {exc}"
        return RemoteUnavailableError(f"remote cache {self.url}: {what} {name or '(listing)'} failed ({reason})")

    @staticmethod
    def _code(exc: ClientError) -> str:
        return str(exc.response.get("Error", {}).get("Code", ""))

    def read(self, name: str) -> bytes | None:
        try:
            return self._client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"].read()
        except ClientError as exc:
            if self._code(exc) in MISSING:
                return None
            raise self._fail("reading", name, exc) from None
        except BotoCoreError as exc:
            raise self._fail("reading", name, exc) from None

    def stat(self, name: str) -> ObjectInfo | None:
        try:
            head = self._client.head_object(Bucket=self.bucket, Key=self._key(name))
        except ClientError as exc:
            if self._code(exc) in MISSING:
                return None
            raise self._fail("looking up", name, exc) from None
        except BotoCoreError as exc:
            raise self._fail("looking up", name, exc) from None
        return ObjectInfo(name, int(head["ContentLength"]), head["LastModified"].timestamp(), head["ETag"])

    def write(self, name: str, data: bytes, *, if_absent: bool = False, if_tag: str | None = None) -> bool:
        conditions = {"IfNoneMatch": "*"} if if_absent else {"IfMatch": if_tag} if if_tag else {}
        try:
            self._client.put_object(Bucket=self.bucket, Key=self._key(name), Body=data, **conditions)
        except ClientError as exc:
            if conditions and self._code(exc) in CONDITION_FAILED:
                return False
            raise self._fail("writing", name, exc) from None
        except BotoCoreError as exc:
            raise self._fail("writing", name, exc) from None
        return True

    def upload(self, name: str, path: Path, progress: Progress) -> None:
        try:
            self._client.upload_file(str(path), self.bucket, self._key(name), Callback=progress,
                                     Config=self._transfer)
        except (ClientError, BotoCoreError) as exc:
            raise self._fail("uploading", name, exc) from None
        except boto3.exceptions.S3UploadFailedError as exc:
            raise RemoteUnavailableError(f"remote cache {self.url}: uploading {name} failed ({exc})") from None

    def download(self, name: str, path: Path, progress: Progress) -> bool:
        try:
            self._client.download_file(self.bucket, self._key(name), str(path), Callback=progress,
                                       Config=self._transfer)
        except ClientError as exc:
            if self._code(exc) in MISSING:
                return False
            raise self._fail("downloading", name, exc) from None
        except BotoCoreError as exc:
            raise self._fail("downloading", name, exc) from None
        return True

    def chunks(self, name: str) -> Iterator[bytes] | None:
        try:
            body = self._client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"]
        except ClientError as exc:
            if self._code(exc) in MISSING:
                return None
            raise self._fail("reading", name, exc) from None
        except BotoCoreError as exc:
            raise self._fail("reading", name, exc) from None
        return body.iter_chunks(CHUNK_BYTES)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        strip = len(self._key(""))
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(prefix))
            for page in pages:
                for item in page.get("Contents", []):
                    yield ObjectInfo(item["Key"][strip:], int(item["Size"]), item["LastModified"].timestamp(),
                                     item["ETag"])
        except (ClientError, BotoCoreError) as exc:
            raise self._fail("listing", prefix, exc) from None

    def delete(self, name: str, *, if_tag: str | None = None) -> None:
        try:
            condition = {"IfMatch": if_tag} if if_tag else {}
            self._client.delete_object(Bucket=self.bucket, Key=self._key(name), **condition)
        except ClientError as exc:
            if self._code(exc) not in MISSING | CONDITION_FAILED:
                raise self._fail("deleting", name, exc) from None
        except BotoCoreError as exc:
            raise self._fail("deleting", name, exc) from None

    def now(self) -> float:
        try:
            head = self._client.head_bucket(Bucket=self.bucket)
        except (ClientError, BotoCoreError) as exc:
            raise self._fail("reaching bucket", self.bucket, exc) from None
        date = head["ResponseMetadata"]["HTTPHeaders"].get("date")
        return email.utils.parsedate_to_datetime(date).timestamp()
