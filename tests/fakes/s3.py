"""A fake S3 bucket in memory with S3's conditional writes, for the fleet's coordination tests.

Objects live in a dict; PUT honours ``IfMatch`` and ``IfNoneMatch: *`` and DELETE honours
``IfMatch`` the way S3 does (412 ``PreconditionFailed``, 404 ``NoSuchKey``); every version of
every object is kept, so a test can check each generation of a document; ``down`` cuts the
bucket off, ``throttled`` answers every call ``503 SlowDown``, and ``failing`` fails the next
call of each operation it names, on a key that contains the text it gives, with its error (a
store's occasional 500), and ``lost_answers`` answers a PUT that was done with a 500. The clock is
``SERVER_EPOCH`` plus the running backend's clock, stamped in whole seconds like S3's ``Date``
and ``LastModified``, so under trio's MockClock minutes of S3 time pass in milliseconds. The
fake knows nothing of the fleet's documents: the fleet tests read them.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from email.utils import formatdate
from typing import Any

import anyio
import anyio.lowlevel
from botocore.exceptions import ClientError, EndpointConnectionError

#: S3's time when the backend's clock reads 0 (a MockClock starts there).
SERVER_EPOCH = 1_800_000_000.0


class FakeBody:
    """The streaming body of a GetObject response."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    async def __aenter__(self) -> FakeBody:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def read(self) -> bytes:
        await anyio.lowlevel.checkpoint()
        return self._data


class FakeS3:
    """Objects in a dict, conditional PUT and DELETE like S3, every version of every object
    kept (to check each generation of grants), and an outage switch."""

    def __init__(self, bucket: str, *, send_date: bool = True) -> None:
        self.bucket = bucket
        self.objects: dict[str, tuple[bytes, str, float]] = {}  # key -> body, ETag, stamp
        self.versions: dict[str, list[bytes]] = {}
        self.send_date = send_date
        self.down = False
        self.throttled = False  # every call answered 503 SlowDown, as an overloaded bucket does
        #: (operation, part of the key, code, status): the next such call fails with that error
        self.failing: list[tuple[str, str, str, int]] = []
        #: parts of keys: the next PUT of such a key is done, but answered with a 500
        self.lost_answers: list[str] = []
        self.calls = 0

    def stamp(self) -> float:
        return float(math.floor(SERVER_EPOCH + anyio.current_time()))

    def _metadata(self, status: int = 200, **headers: str) -> dict[str, Any]:
        if self.send_date:
            headers["date"] = formatdate(self.stamp(), usegmt=True)
        return {"HTTPStatusCode": status, "HTTPHeaders": headers}

    def _error(self, code: str, status: int, operation: str) -> ClientError:
        return ClientError(
            {
                "Error": {"Code": code, "Message": f"{code} (fake)"},
                "ResponseMetadata": self._metadata(status),
            },
            operation,
        )

    async def _enter(self, bucket: str, operation: str = "S3", key: str = "") -> None:
        await anyio.lowlevel.checkpoint()
        self.calls += 1
        if self.down:
            raise EndpointConnectionError(endpoint_url="http://fake-s3")
        if self.throttled:
            raise self._error("SlowDown", 503, "S3")
        for index, (failing, part, code, status) in enumerate(self.failing):
            if failing == operation and part in key:
                del self.failing[index]
                raise self._error(code, status, operation)
        assert bucket == self.bucket

    async def put_object(
        self,
        *,
        Bucket: str,
        Key: str,
        Body: bytes,
        ContentType: str = "",
        IfMatch: str | None = None,
        IfNoneMatch: str | None = None,
    ) -> dict[str, Any]:
        await self._enter(Bucket, "PutObject", Key)
        existing = self.objects.get(Key)
        if IfNoneMatch == "*" and existing is not None:
            raise self._error("PreconditionFailed", 412, "PutObject")
        if IfMatch is not None:
            if existing is None:
                raise self._error("NoSuchKey", 404, "PutObject")
            if existing[1] != IfMatch:
                raise self._error("PreconditionFailed", 412, "PutObject")
        etag = '"' + hashlib.md5(Body + str(self.calls).encode()).hexdigest() + '"'
        stamp = self.stamp()
        self.objects[Key] = (bytes(Body), etag, stamp)
        self.versions.setdefault(Key, []).append(bytes(Body))
        for index, part in enumerate(self.lost_answers):
            if part in Key:
                del self.lost_answers[index]
                raise self._error("InternalError", 500, "PutObject")
        last_modified = formatdate(stamp, usegmt=True)
        return {
            "ETag": etag,
            "ResponseMetadata": self._metadata(**{"last-modified": last_modified}),
        }

    async def get_object(self, *, Bucket: str, Key: str) -> dict[str, Any]:
        await self._enter(Bucket, "GetObject", Key)
        if Key not in self.objects:
            raise self._error("NoSuchKey", 404, "GetObject")
        body, etag, stamp = self.objects[Key]
        return {
            "Body": FakeBody(body),
            "ETag": etag,
            "ContentLength": len(body),
            "LastModified": datetime.fromtimestamp(stamp, timezone.utc),
            "ResponseMetadata": self._metadata(),
        }

    async def list_objects_v2(
        self, *, Bucket: str, Prefix: str, ContinuationToken: str | None = None
    ) -> dict[str, Any]:
        await self._enter(Bucket, "ListObjectsV2", Prefix)
        keys = sorted(k for k in self.objects if k.startswith(Prefix))
        start = int(ContinuationToken or 0)
        page = keys[start : start + 2]  # small pages, to exercise the paging
        truncated = start + 2 < len(keys)
        return {
            "Contents": [
                {
                    "Key": k,
                    "ETag": self.objects[k][1],
                    "LastModified": datetime.fromtimestamp(self.objects[k][2], timezone.utc),
                }
                for k in page
            ],
            "IsTruncated": truncated,
            "NextContinuationToken": str(start + 2) if truncated else None,
            "ResponseMetadata": self._metadata(),
        }

    async def delete_object(
        self, *, Bucket: str, Key: str, IfMatch: str | None = None
    ) -> dict[str, Any]:
        await self._enter(Bucket, "DeleteObject", Key)
        existing = self.objects.get(Key)
        if IfMatch is not None and (existing is None or existing[1] != IfMatch):
            raise self._error("PreconditionFailed", 412, "DeleteObject")
        self.objects.pop(Key, None)
        return {"ResponseMetadata": self._metadata(204)}

    # -- for the tests ---------------------------------------------------------------------

    def factory(self) -> Callable[[], Any]:
        """A client factory handing out this bucket, like ``_aws.create_client``."""

        @asynccontextmanager
        async def client() -> AsyncIterator[FakeS3]:
            yield self

        return client
