"""An S3-compatible bucket prefix as the remote tier's object store (AWS S3, MinIO, Ceph, R2, ...), through boto3.

Credentials, region and endpoint come from the standard AWS chain (environment, shared config and credentials
files, instance roles; ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``) unless an endpoint is given; nothing here
logs or stores them. Large files move as parallel multipart transfers (boto3's transfer manager)."""

from __future__ import annotations

import email.utils
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import boto3
from boto3.exceptions import RetriesExceededError, S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError
from botocore.exceptions import ConnectionError as EndpointUnreachable

from kiln.engines.cache.remote.objects import ObjectInfo, Progress, RemoteUnavailableError

PART_BYTES = 64 * 2**20  # multipart part size; an 8 GB engine file moves as 128 parts
CHUNK_BYTES = 8 * 2**20
MISSING = {"404", "NoSuchKey", "NotFound"}
CONDITION_FAILED = {"412", "PreconditionFailed", "409", "ConditionalRequestConflict"}
# no connection, no answer in time, a connection cut (RetriesExceededError: a download's, after its retries)
UNANSWERED = (EndpointUnreachable, HTTPClientError, RetriesExceededError)
T = TypeVar("T")
_RAISE = object()  # a missing object or failed condition is an error


class S3Objects:
    """The objects under ``s3://bucket/prefix``; ``transfer_threads`` parts of one file move at once.

    A request waits ``connect_timeout_s`` for a connection and ``read_timeout_s`` for each socket read of the
    answer, three attempts in all. The read timeout bounds a silence, not a transfer (bytes that flow reset it);
    10 s is ample for a healthy service, whose answers start within a second (a slow multipart completion sends
    keep-alive whitespace meanwhile). A remote that stops answering so costs one request's attempts, at most 33 s
    (three reads of 10 s, up to 3 s of backoff): every later request fails at once, without being sent."""

    def __init__(self, bucket: str, prefix: str, *, endpoint_url: str | None = None, transfer_threads: int = 8,
                 connect_timeout_s: float = 5.0, read_timeout_s: float = 10.0) -> None:
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.unanswered: str | None = None  # why a request found the remote unreachable: no other is sent
        config = Config(connect_timeout=connect_timeout_s, read_timeout=read_timeout_s,
                        max_pool_connections=4 * transfer_threads,
                        retries={"total_max_attempts": 3, "mode": "standard"})
        self._client = boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)
        self._transfer = TransferConfig(multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES,
                                        max_concurrency=transfer_threads, use_threads=True)

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _call(self, what: str, name: str, call: Callable[[], T], *, if_missing: object = _RAISE,
              if_condition_failed: object = _RAISE) -> T:
        """``call()``, with a missing object or a failed condition answered as given (else an error) and every
        other failure a RemoteUnavailableError naming the remote, the object and the service's reason. Once a request
        found the remote unreachable or silent, no other is sent: each fails at once, naming that first failure."""
        if self.unanswered is not None:
            raise RemoteUnavailableError(f"remote cache {self.url}: {what} {name} not tried (an earlier request "
                                         f"failed: {self.unanswered})")
        try:
            return call()
        except ClientError as exc:
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            if code in MISSING and if_missing is not _RAISE:
                return if_missing
            if code in CONDITION_FAILED and if_condition_failed is not _RAISE:
                return if_condition_failed
            reason = f"{code or '?'}: {error.get('Message') or 'no message'}"
        except UNANSWERED as exc:
            reason = self.unanswered = f"{type(exc).__name__}: {exc}"
        except (BotoCoreError, S3UploadFailedError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        raise RemoteUnavailableError(f"remote cache {self.url}: {what} {name} failed ({reason})")

    def read(self, name: str) -> bytes | None:
        return self._call("reading", name, lambda: self._client.get_object(
            Bucket=self.bucket, Key=self._key(name))["Body"].read(), if_missing=None)

    def stat(self, name: str) -> ObjectInfo | None:
        head = self._call("looking up", name, lambda: self._client.head_object(Bucket=self.bucket,
                                                                               Key=self._key(name)), if_missing=None)
        return None if head is None else ObjectInfo(name, int(head["ContentLength"]), head["LastModified"].timestamp(),
                                                    head["ETag"])

    def write(self, name: str, data: bytes, *, if_absent: bool = False, if_tag: str | None = None) -> bool:
        conditions = {"IfNoneMatch": "*"} if if_absent else {"IfMatch": if_tag} if if_tag else {}
        return self._call("writing", name, lambda: self._client.put_object(
            Bucket=self.bucket, Key=self._key(name), Body=data, **conditions) and True,
            if_condition_failed=False if conditions else _RAISE)

    def upload(self, name: str, path: Path, progress: Progress) -> None:
        self._call("uploading", name, lambda: self._client.upload_file(
            str(path), self.bucket, self._key(name), Callback=progress, Config=self._transfer))

    def download(self, name: str, path: Path, progress: Progress) -> bool:
        return self._call("downloading", name, lambda: self._client.download_file(
            self.bucket, self._key(name), str(path), Callback=progress, Config=self._transfer) or True,
            if_missing=False)

    def chunks(self, name: str) -> Iterator[bytes] | None:
        body = self._call("reading", name, lambda: self._client.get_object(Bucket=self.bucket, Key=self._key(name)),
                          if_missing=None)
        return None if body is None else self._read_chunks(name, body["Body"].iter_chunks(CHUNK_BYTES))

    def _read_chunks(self, name: str, chunks: Iterator[bytes]) -> Iterator[bytes]:
        """``chunks`` of a body being read, a failure mid-way a RemoteUnavailableError as any other request's."""
        while chunk := self._call("reading", name, lambda: next(chunks, b"")):
            yield chunk

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        strip = len(self._key(""))
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(prefix))
        for page in self._call("listing", prefix or "(all)", lambda: list(pages)):
            for item in page.get("Contents", []):
                yield ObjectInfo(item["Key"][strip:], int(item["Size"]), item["LastModified"].timestamp(),
                                 item["ETag"])

    def delete(self, name: str, *, if_tag: str | None = None) -> None:
        condition = {"IfMatch": if_tag} if if_tag else {}
        self._call("deleting", name, lambda: self._client.delete_object(
            Bucket=self.bucket, Key=self._key(name), **condition), if_missing=None, if_condition_failed=None)

    def discard_unfinished(self, started_before: float, *, dry_run: bool = False) -> int:
        pages = self._client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket,
                                                                             Prefix=self._key(""))
        uploads = [upload for page in self._call("listing uploads", "(all)", lambda: list(pages))
                   for upload in page.get("Uploads", []) if upload["Initiated"].timestamp() < started_before]
        if not dry_run:
            for upload in uploads:
                abort = {"Bucket": self.bucket, "Key": upload["Key"], "UploadId": upload["UploadId"]}
                self._call("aborting the upload of", upload["Key"],
                           lambda abort=abort: self._client.abort_multipart_upload(**abort), if_missing=None)
        return len(uploads)

    def now(self) -> float:
        head = self._call("reaching bucket", self.bucket, lambda: self._client.head_bucket(Bucket=self.bucket))
        return email.utils.parsedate_to_datetime(head["ResponseMetadata"]["HTTPHeaders"]["date"]).timestamp()
