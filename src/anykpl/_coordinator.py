"""The fleet coordinator: the async shell that moves ``_fleet.py``'s documents through S3.

Every member of a fleet runs a :class:`FleetWorker` (one per producer with a ``FleetConfig``);
``anykpl fleet-allocator`` runs a :class:`FleetAllocator`. The maths, the documents and the
worker's state machine are pure and live in ``_fleet.py``; this module only reads and writes
S3 objects, sleeps, and applies rates. ``docs/fleet.md`` draws the loop.

One worker's cycle, every ``sync_interval`` × U(0.9, 1.1), start to start:

1. GET ``grants.json``; apply this worker's grant if it is newer and unexpired.
2. PUT ``workers/<id>.json``: its demand, the rate it applies, and the generation applied —
   after step 1, so the report acknowledges the grant just read and the allocator can hand
   the capacity that worker gave up to others one cycle sooner. ``If-Match`` on the ETag of
   its own last write tells it when another process shares its ``worker_id``.
3. With ``elect``: create, renew or take over ``allocator.json`` (``If-None-Match: *`` /
   ``If-Match``). The holder LISTs and GETs the reports and PUTs the next ``grants.json`` with
   ``If-Match`` on the ETag it read in step 1, then applies its own new grant at once.

A member that does not hold the lease wakes when the holder's lease would expire, not only at
its next cycle, so a dead allocator is replaced about one lease after its last renewal.

S3 errors never stop the producer: every call is bounded, every error is counted, logged at
WARNING on the ``anykpl.fleet`` logger once per kind (again after S3 has answered a whole cycle
without error), and the state machine's fallback applies: grants expire into the safe rate on
a timer of their own, whatever the S3 calls are doing.
"""

from __future__ import annotations

import email.utils
import json
import logging
import math
import os
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc

from ._aws import create_client
from ._fleet import (
    Allocator,
    DemandEstimator,
    DocumentError,
    FleetDemand,
    FleetStatistics,
    GrantsDocument,
    LeaseDocument,
    Mode,
    ObservedReport,
    Rates,
    ServerClock,
    WorkerReport,
    WorkerState,
    lease_expiry,
    parse_grants,
    parse_lease,
    parse_report,
)
from ._sender import error_code
from .config import FleetConfig, ProducerConfig

__all__ = ("CLOSE_TIMEOUT", "FleetAllocator", "FleetWorker")

logger = logging.getLogger("anykpl.fleet")

#: How long the last S3 calls may take on close (delete the report, release the lease);
#: :meth:`FleetWorker.aclose` returns within half a second more.
CLOSE_TIMEOUT = 1.5
#: Reports read at once by the allocator.
READ_CONCURRENCY = 16
#: A report stale for this many leases is a crashed worker's leftover: the allocator deletes it.
LEFTOVER_LEASES = 10
#: S3's clock is known well enough once a member's uncertainty about it is below this.
CLOCK_TARGET = 0.1
#: A worker whose report was overwritten by someone else this many times in a row says that
#: another process shares its worker_id.
OVERWRITTEN_REPORTS = 3
#: After the holder's lease would expire, a contender looks again this much later.
_LEASE_MARGIN = 0.01
_CONFLICT_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict", "412", "409"})
_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})

ClientFactory = Callable[[], AbstractAsyncContextManager[Any]]


class _Conflict(Exception):
    """A conditional write or delete lost: someone else changed the object first."""


@dataclass(frozen=True, slots=True)
class _Read:
    """``grants.json`` as read at the start of a cycle."""

    document: GrantsDocument | None  # None: missing or junk
    etag: str | None
    exists: bool


class _Store:
    """The few S3 calls of the coordinator, each bounded in time and fed to S3's clock."""

    def __init__(self, client: Any, fleet: FleetConfig, clock: ServerClock, timeout: float) -> None:
        self._client = client
        self._bucket = fleet.bucket
        self._prefix = fleet.prefix.rstrip("/")
        self._clock = clock
        self._timeout = timeout
        #: the shortest round trip of a dated answer: how well S3's clock can be known
        self.round_trip = math.inf

    def key(self, name: str) -> str:
        return f"{self._prefix}/{name}"

    def _observe(self, response: Any, sent_at: float, *, written: bool) -> None:
        headers = (response or {}).get("ResponseMetadata", {}).get("HTTPHeaders", {}) or {}
        # S3 dates every answer; a server that does not (moto) still dates what it stores,
        # and a write's Last-Modified is the time of the write.
        stamp = headers.get("date") or (headers.get("last-modified") if written else None)
        if not stamp:
            return
        try:
            when = email.utils.parsedate_to_datetime(stamp).timestamp()
        except (TypeError, ValueError, IndexError, OverflowError):
            return
        received_at = anyio.current_time()
        self.round_trip = min(self.round_trip, received_at - sent_at)
        self._clock.observe(when, sent_at, received_at)

    async def _call(self, operation: str, *, written: bool = False, **kwargs: Any) -> Any:
        from botocore.exceptions import ClientError

        sent_at = anyio.current_time()
        try:
            with anyio.fail_after(self._timeout):
                response = await getattr(self._client, operation)(Bucket=self._bucket, **kwargs)
        except ClientError as exc:
            self._observe(exc.response, sent_at, written=False)
            raise
        self._observe(response, sent_at, written=written)
        return response

    async def put(
        self, key: str, body: bytes, *, if_match: str | None = None, if_none_match: bool = False
    ) -> str:
        """Write an object; return its ETag. Raises :class:`_Conflict` if a condition fails."""
        from botocore.exceptions import ClientError

        kwargs: dict[str, Any] = {"Key": key, "Body": body, "ContentType": "application/json"}
        if if_match is not None:
            kwargs["IfMatch"] = if_match
        if if_none_match:
            kwargs["IfNoneMatch"] = "*"
        try:
            response = await self._call("put_object", written=True, **kwargs)
        except ClientError as exc:
            code = _code(exc)
            if code in _CONFLICT_CODES or (if_match is not None and code in _MISSING_CODES):
                raise _Conflict(code) from None
            raise
        return str(response.get("ETag", ""))

    async def get(self, key: str) -> tuple[bytes, str, float] | None:
        """``(body, ETag, LastModified)`` of an object, or ``None`` if there is none."""
        from botocore.exceptions import ClientError

        from ._fleet import MAX_DOCUMENT_BYTES

        sent_at = anyio.current_time()
        try:
            with anyio.fail_after(self._timeout):
                response = await self._client.get_object(Bucket=self._bucket, Key=key)
                length = response.get("ContentLength")
                async with response["Body"] as stream:
                    if isinstance(length, int) and length > MAX_DOCUMENT_BYTES:
                        raise DocumentError(f"{key} is {length} bytes, over {MAX_DOCUMENT_BYTES}")
                    data = await stream.read()
        except ClientError as exc:
            self._observe(exc.response, sent_at, written=False)
            if _code(exc) in _MISSING_CODES:
                return None
            raise
        self._observe(response, sent_at, written=False)
        return bytes(data), str(response.get("ETag", "")), _epoch(response.get("LastModified"))

    async def list(self, prefix: str) -> list[tuple[str, float, str]]:
        """``(key, LastModified, ETag)`` of every object under ``prefix``."""
        found: list[tuple[str, float, str]] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Prefix": prefix}
            if token:
                kwargs["ContinuationToken"] = token
            response = await self._call("list_objects_v2", **kwargs)
            for item in response.get("Contents", ()) or ():
                found.append(
                    (str(item["Key"]), _epoch(item.get("LastModified")), str(item.get("ETag")))
                )
            token = response.get("NextContinuationToken")
            if not response.get("IsTruncated") or not token:
                return found

    async def delete(self, key: str, *, if_match: str | None = None) -> None:
        from botocore.exceptions import ClientError

        kwargs: dict[str, Any] = {"Key": key}
        if if_match is not None:
            kwargs["IfMatch"] = if_match
        try:
            await self._call("delete_object", **kwargs)
        except ClientError as exc:
            code = _code(exc)
            if code in _CONFLICT_CODES or code in _MISSING_CODES:
                raise _Conflict(code) from None
            raise


def _code(exc: Any) -> str:
    error = exc.response.get("Error", {}) or {}
    code = str(error.get("Code") or "")
    if not code:
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = str(status or "")
    return code


def _epoch(value: Any) -> float:
    if value is None:
        return -math.inf  # unknown: as stale as can be
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    return float(value)


class _Member:
    """What workers and the standalone allocator share: S3, errors, the lease, allocating."""

    _role_name = "member"

    def __init__(
        self,
        fleet: FleetConfig,
        config: ProducerConfig,
        *,
        member_id: str,
        client_factory: ClientFactory | None,
        on_allocation: Callable[[GrantsDocument], None] | None,
    ) -> None:
        self.fleet = fleet
        self.config = config
        self.worker_id = member_id
        self._incarnation = os.urandom(8).hex()
        self._lease = float(fleet.lease or 3 * fleet.sync_interval)
        self._client_factory = client_factory or self._default_client
        self._on_allocation = on_allocation
        self._clock = ServerClock()
        self._allocator = Allocator(
            allocator_id=member_id,
            cap=Rates(fleet.records_per_second, fleet.bytes_per_second),
            lease=self._lease,
            bootstrap_fraction=fleet.bootstrap_fraction,
        )
        # every S3 call is bounded: a hung call must not hold a cycle much beyond an interval
        self._call_timeout = min(
            config.connect_timeout + config.request_timeout, max(1.0, fleet.sync_interval)
        )
        self._random = random.Random(os.urandom(8))
        self._lease_etag: str | None = None
        self._lease_acquired_at: float | None = None
        self._lease_wake: float | None = None  # local time to look at someone else's lease
        self._gather_until = -math.inf  # local time before which a fresh fleet gets no grants
        self._taking_over = False  # acquired the lease; the takeover is decided when S3 answers
        self._next_sweep = -math.inf  # local time to look for leftover presence objects
        self._close_deadline: float | None = None  # local time by which closing must end
        self.s3_errors = 0
        self.last_error: str | None = None
        self._logged: set[str] = set()
        self._stopping = False
        self._stop_event: anyio.Event | None = None
        self._cycle_scope: anyio.CancelScope | None = None
        self._run_scope: anyio.CancelScope | None = None
        self._done: anyio.Event | None = None
        #: the last grants document this member wrote
        self.last_document: GrantsDocument | None = None

    def __repr__(self) -> str:
        role = "allocator" if self.holds_lease else self._role_name
        return f"<{type(self).__name__} {self.worker_id} {role} errors={self.s3_errors}>"

    @property
    def holds_lease(self) -> bool:
        return self._lease_etag is not None

    def _default_client(self) -> AbstractAsyncContextManager[Any]:
        return create_client(
            self.config,
            "s3",
            max_pool_connections=READ_CONCURRENCY,
            endpoint_url=self.fleet.endpoint_url,
        )

    # -- errors ---------------------------------------------------------------------------

    def _record_error(self, operation: str, exc: BaseException) -> None:
        if isinstance(exc, DocumentError):
            code, message = "InvalidDocument", str(exc)
        else:
            code, message = error_code(exc)
        self.s3_errors += 1
        self.last_error = f"{operation}: {code}: {message}"
        # once per kind of failure: an outage fails every call of a cycle, every cycle
        if code in self._logged:
            logger.debug("fleet %s: %s failed again: %s", self.worker_id, operation, message)
            return
        self._logged.add(code)
        logger.warning(
            "fleet %s: %s failed (%s: %s); %s",
            self.worker_id,
            operation,
            code,
            message,
            self._fallback_description(),
            extra={"operation": operation, "error_code": code},
        )

    def _fallback_description(self) -> str:
        """What happens meanwhile, for the warning about a failed call."""
        return "it tries again next cycle; the workers' grants expire into their safe rates"

    def _recovered(self) -> None:
        if self._logged:
            logger.info("fleet %s: S3 answers again", self.worker_id)
            self._logged.clear()

    async def _attempt(self, operation: str, call: Awaitable[Any]) -> tuple[bool, Any]:
        """Await ``call``; on an error, record it and return ``(False, None)``."""
        try:
            return True, await call
        except anyio.get_cancelled_exc_class():
            raise
        except _Conflict:
            raise
        except Exception as exc:
            self._record_error(operation, exc)
            return False, None

    # -- the lease ------------------------------------------------------------------------

    def _server_now(self) -> tuple[float, float] | None:
        return self._clock.bounds(anyio.current_time())

    def _lease_document(self, now: tuple[float, float]) -> bytes:
        middle = (now[0] + now[1]) / 2
        if self._lease_acquired_at is None:
            self._lease_acquired_at = middle
        return LeaseDocument(
            holder=self.worker_id,
            incarnation=self._incarnation,
            acquired_at=self._lease_acquired_at,
            renewed_at=middle,
            expires_at=middle + self._lease,
            lease=self._lease,
        ).to_json()

    def _lost_lease(self, why: str) -> None:
        if self._lease_etag is not None:
            logger.info("fleet %s: no longer the allocator (%s)", self.worker_id, why)
        self._lease_etag = None
        self._lease_acquired_at = None
        self._taking_over = False
        self._allocator.step_down()

    async def _lease_step(self, store: _Store) -> str | None:
        """Renew, acquire or watch the lease: ``"held"``, ``"acquired"``, ``"other"``, or
        ``None`` when S3 did not answer."""
        now = self._server_now()
        if now is None:
            return None
        key = store.key("allocator.json")
        if self._lease_etag is not None:
            try:
                ok, etag = await self._attempt(
                    "renew the lease",
                    store.put(key, self._lease_document(now), if_match=self._lease_etag),
                )
            except _Conflict:
                self._lost_lease("another member took the lease")
                return "other"
            if not ok:
                return None
            self._lease_etag = etag
            return "held"
        ok, found = await self._attempt("read the lease", store.get(key))
        if not ok:
            return None
        if found is None:
            return await self._acquire(store, key, now, if_match=None)
        data, etag, last_modified = found
        try:
            lease: LeaseDocument | None = parse_lease(data)
        except DocumentError:
            lease = None
        if lease is not None and (lease.holder, lease.incarnation) == (
            self.worker_id,
            self._incarnation,
        ):
            # our renewal went through although its answer was lost: still ours
            self._lease_etag = etag
            return "held"
        expiry = lease_expiry(lease, last_modified, self._lease)
        now = self._server_now() or now
        if now[0] >= expiry:
            return await self._acquire(store, key, now, if_match=etag)
        local = anyio.current_time()
        surely = self._clock.surely_local(expiry, local)
        self._lease_wake = None if surely is None else surely + _LEASE_MARGIN
        return "other"

    async def _acquire(
        self, store: _Store, key: str, now: tuple[float, float], *, if_match: str | None
    ) -> str | None:
        self._lease_acquired_at = None
        body = self._lease_document(now)
        try:
            ok, etag = await self._attempt(
                "take the lease",
                store.put(key, body, if_match=if_match, if_none_match=if_match is None),
            )
        except _Conflict:
            return "other"  # another member was quicker
        if not ok:
            return None
        self._lease_etag = etag
        self._lease_wake = None
        self._taking_over = True
        logger.info("fleet %s: now the allocator", self.worker_id)
        return "acquired"

    async def _release(self, store: _Store) -> None:
        if self._lease_etag is None:
            return
        etag, self._lease_etag = self._lease_etag, None
        self._taking_over = False
        self._allocator.step_down()
        with suppress(_Conflict):  # taken over meanwhile: not ours to delete
            await self._attempt(
                "release the lease", store.delete(store.key("allocator.json"), if_match=etag)
            )

    # -- allocating -----------------------------------------------------------------------

    async def _read_grants(self, store: _Store) -> _Read | None:
        ok, found = await self._attempt("read grants", store.get(store.key("grants.json")))
        if not ok:
            return None
        if found is None:
            return _Read(None, None, False)
        data, etag, _ = found
        try:
            return _Read(parse_grants(data), etag, True)
        except DocumentError as exc:
            self._record_error("read grants", exc)
            return _Read(None, etag, True)

    async def _read_reports(self, store: _Store) -> list[ObservedReport] | None:
        prefix = store.key("workers/")
        ok, listing = await self._attempt("list reports", store.list(prefix))
        if not ok:
            return None
        now = self._server_now()
        if now is None:
            return None
        reports: list[ObservedReport] = []
        failed = False
        limiter = anyio.CapacityLimiter(READ_CONCURRENCY)

        async def read(key: str) -> None:
            nonlocal failed
            async with limiter:
                ok, found = await self._attempt("read a report", store.get(key))
            if not ok:
                failed = True
                return
            if found is None:
                return  # deleted since the listing
            data, _, last_modified = found
            try:
                report = parse_report(data)
            except DocumentError as exc:
                self._record_error(f"read {key.rsplit('/', 1)[-1]}", exc)
                return
            if f"{prefix}{report.worker_id}.json" != key:
                self._record_error(
                    "read a report",
                    DocumentError(f"{key} holds the report of {report.worker_id}"),
                )
                return
            reports.append(ObservedReport(report, last_modified))

        leftover = LEFTOVER_LEASES * self._lease
        async with anyio.create_task_group() as tg:
            for key, last_modified, _ in listing:
                if not key.endswith(".json"):
                    continue
                if now[0] - last_modified > leftover:
                    tg.start_soon(self._delete_leftover, store, key)
                elif not self._allocator.is_stale(last_modified, now):
                    tg.start_soon(read, key)
        return None if failed else reports

    async def _delete_leftover(self, store: _Store, key: str) -> None:
        try:
            await store.delete(key)
            logger.info("fleet %s: deleted the leftover object %s", self.worker_id, key)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:  # best effort: it is only a leftover
            logger.debug("fleet %s: could not delete %s: %s", self.worker_id, key, exc)

    async def _sweep_presence(self, store: _Store) -> None:
        """Delete the presence objects of standalone allocators gone for long (they rewrite
        theirs every cycle; one stale for :data:`LEFTOVER_LEASES` leases is a leftover). Once
        a lease at most: it costs a LIST."""
        if anyio.current_time() < self._next_sweep:
            return
        self._next_sweep = anyio.current_time() + self._lease
        ok, listing = await self._attempt("list allocators", store.list(store.key("allocators/")))
        now = self._server_now()
        if not ok or now is None:
            return
        for key, last_modified, _ in listing:
            if now[0] - last_modified > LEFTOVER_LEASES * self._lease:
                await self._delete_leftover(store, key)

    def _warn_duplicates(self, reports: list[ObservedReport]) -> None:
        for worker_id in self._allocator.duplicates(reports):
            logger.warning(
                "fleet %s: the report of worker %s keeps changing hands between processes: "
                "several processes run with worker_id=%r, share one grant and each apply it, "
                "so the fleet can exceed its cap. Give each process its own worker_id (such "
                'as f"{hostname}-{pid}"), or leave it None for a random one',
                self.worker_id,
                worker_id,
                worker_id,
                extra={"duplicate_worker_id": worker_id},
            )

    async def _allocate(self, store: _Store, grants: _Read | None, status: str | None) -> None:
        if status not in ("held", "acquired") or grants is None:
            return
        if anyio.current_time() < self._gather_until:
            return
        reports = await self._read_reports(store)
        now = self._server_now()
        if reports is None or now is None:
            return  # (a takeover is decided at the first cycle whose reads succeed)
        self._warn_duplicates(reports)
        if self._taking_over:
            self._taking_over = False
            if not self._allocator.take_over(grants.document, reports, now) and not grants.exists:
                # No grants were ever written: the fleet is starting. Members that start
                # together report within a cycle; a first allocation that saw only some of
                # them would grant those the whole cap, and taking it back costs a cycle of
                # acknowledgements. So the first grants wait one cycle — but the fleet size
                # goes out at once, in a document without grants, so that the members'
                # bootstrap rates share the cap × bootstrap_fraction meanwhile.
                self._gather_until = anyio.current_time() + 0.8 * self.fleet.sync_interval
                document = self._allocator.gather(grants.document, reports, now)
            else:
                document = self._allocator.allocate(grants.document, reports, now)
        else:
            document = self._allocator.allocate(grants.document, reports, now)
        await self._write_grants(store, grants, document)
        await self._sweep_presence(store)

    async def _write_grants(self, store: _Store, grants: _Read, document: GrantsDocument) -> None:
        """PUT ``document`` as the next ``grants.json``, on condition that the one read
        (``grants``) is still there."""
        key = store.key("grants.json")
        try:
            ok, _ = await self._attempt(
                "write grants",
                store.put(
                    key,
                    document.to_json(),
                    if_match=grants.etag if grants.exists else None,
                    if_none_match=not grants.exists,
                ),
            )
        except _Conflict:
            logger.info(
                "fleet %s: grants.json changed under this allocator; it reads it again",
                self.worker_id,
            )
            return
        if not ok:
            return
        self.last_document = document
        logger.debug(
            "fleet %s: generation %d for %d worker(s)",
            self.worker_id,
            document.generation,
            document.granted,
        )
        self._allocated(document)
        if self._on_allocation is not None:
            self._on_allocation(document)

    def _allocated(self, document: GrantsDocument) -> None:
        """The member wrote ``document``."""

    # -- running --------------------------------------------------------------------------

    async def _cycle(self, store: _Store) -> None:
        """One sync cycle: each kind of member (FleetWorker, FleetAllocator) defines its own."""
        raise NotImplementedError  # an abstract method: both subclasses override it

    async def _cleanup(self, store: _Store) -> None:
        await self._release(store)

    def _interval(self) -> float:
        return self.fleet.sync_interval * self._random.uniform(0.9, 1.1)

    def _next_start(self, start: float) -> float:
        """When the cycle after the one that began at ``start`` begins."""
        return start + self._interval()

    async def _cycles(self, store: _Store) -> None:
        assert self._stop_event is not None
        failures: set[str] = set()  # kinds of exception logged since the last clean cycle
        while not self._stopping:
            start = anyio.current_time()
            errors = self.s3_errors
            with anyio.CancelScope() as scope:
                self._cycle_scope = scope
                try:
                    await self._cycle(store)
                except anyio.get_cancelled_exc_class():
                    raise
                except Exception as exc:  # a bug must not stop the producer either
                    # with its traceback once per kind, not once per cycle
                    kind = type(exc).__qualname__
                    if kind in failures:
                        logger.debug("fleet %s: a sync cycle failed again: %r", self.worker_id, exc)
                    else:
                        failures.add(kind)
                        logger.exception("fleet %s: a sync cycle failed", self.worker_id)
                    self._record_error("sync", exc)
                else:
                    failures.clear()
            self._cycle_scope = None
            if self.s3_errors == errors:
                self._recovered()
            now = anyio.current_time()
            wake = self._next_start(start)
            if self._lease_wake is not None and self._lease_wake < wake:
                wake = self._lease_wake
                self._lease_wake = None
            with anyio.move_on_after(max(0.0, wake - now)):
                await self._stop_event.wait()

    @asynccontextmanager
    async def _store(self) -> AsyncIterator[_Store]:
        async with self._client_factory() as client:
            yield _Store(client, self.fleet, self._clock, self._call_timeout)

    async def _serve(self) -> None:
        """Cycle until stopped, reopening the S3 client if it fails; then clean up."""
        assert self._stop_event is not None
        while not self._stopping:
            try:
                async with self._store() as store:
                    try:
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(self._calibrate, store)
                            await self._cycles(store)
                            tg.cancel_scope.cancel()
                    finally:
                        with anyio.move_on_after(self._cleanup_time(), shield=True):
                            await self._cleanup(store)
                return
            except anyio.get_cancelled_exc_class():
                raise
            except Exception as exc:
                self._record_error("open an S3 client", exc)
                with anyio.move_on_after(self._interval()):
                    await self._stop_event.wait()

    def _probe(self, store: _Store) -> tuple[str, bytes] | None:
        """An object this member may rewrite at any moment, and its body (see
        :meth:`_calibrate`)."""
        return None

    async def _calibrate(self, store: _Store) -> None:
        """Learn S3's clock to better than its one-second stamps.

        Grants and leases are judged by S3's time, and a member's view of it is as wide as
        the fractions of a second its observations fell at; cycles locked to the allocator's
        phase keep falling at the same ones. While the uncertainty is over
        :data:`CLOCK_TARGET` (or twice the best round trip, if that is more), rewrite this
        member's own object — its report, or an allocator's presence — at the moment that
        halves it; at most once per ``sync_interval``. A few PUTs at start-up bring it from a
        second to a few milliseconds on a fast network.
        """
        while True:
            now = anyio.current_time()
            width = self._clock.width(now)
            probe = self._probe(store)
            target = max(CLOCK_TARGET, 2 * store.round_trip)
            at = self._clock.probe_time(now)
            if width is None or width <= target or probe is None or at is None:
                await anyio.sleep(self.fleet.sync_interval)
                continue
            await anyio.sleep(max(0.0, at - now))
            await self._rewrite(store, probe)
            await anyio.sleep(self.fleet.sync_interval)

    async def _rewrite(self, store: _Store, probe: tuple[str, bytes]) -> None:
        """Rewrite the object :meth:`_probe` named, for :meth:`_calibrate`."""
        await self._attempt("calibrate the clock", store.put(*probe))

    def _cleanup_time(self) -> float:
        """How long the last S3 calls may take: :data:`CLOSE_TIMEOUT`, or less if
        :meth:`aclose` was given less."""
        if self._close_deadline is None:
            return CLOSE_TIMEOUT
        return max(0.0, min(CLOSE_TIMEOUT, self._close_deadline - anyio.current_time()))

    async def aclose(self, *, deadline: float | None = None) -> None:
        """Stop: delete this member's objects (its report; the lease if it holds it), best
        effort, and return by ``deadline`` (``anyio.current_time()``; default: within
        :data:`CLOSE_TIMEOUT` and half a second more), whatever S3 is doing. What is not
        deleted by then expires on its own: a report goes stale, a lease runs out."""
        now = anyio.current_time()
        latest = now + CLOSE_TIMEOUT + 0.5
        self._close_deadline = latest if deadline is None else min(latest, deadline)
        bound = max(0.0, self._close_deadline - now)
        self._stopping = True
        if self._stop_event is not None:
            self._stop_event.set()
        if self._cycle_scope is not None:
            self._cycle_scope.cancel()
        if self._done is None:
            return
        with anyio.move_on_after(bound, shield=True):
            await self._done.wait()
        if not self._done.is_set() and self._run_scope is not None:
            self._run_scope.cancel()


class FleetWorker(_Member):
    """A producer's member of a fleet: reports demand, applies grants, may allocate.

    ``demand()`` returns the producer's :class:`~anykpl._fleet.FleetDemand`;
    ``apply(records_per_second, bytes_per_second)`` sets the producer's shared bucket
    (``None``: unlimited). Start :meth:`run` with ``await task_group.start(worker.run)``: it
    applies the bootstrap rate before it reports started, so the producer never runs
    unlimited. Stop with :meth:`aclose`.
    """

    _role_name = "worker"

    def __init__(
        self,
        fleet: FleetConfig,
        config: ProducerConfig,
        demand: Callable[[], FleetDemand],
        apply: Callable[[float | None, float | None], None],
        *,
        client_factory: ClientFactory | None = None,
        on_allocation: Callable[[GrantsDocument], None] | None = None,
    ) -> None:
        super().__init__(
            fleet,
            config,
            member_id=fleet.worker_id or f"worker-{os.urandom(6).hex()}",
            client_factory=client_factory,
            on_allocation=on_allocation,
        )
        self._demand = demand
        self._apply = apply
        self._estimator = DemandEstimator(fleet.sync_interval)
        self._state = WorkerState(
            worker_id=self.worker_id,
            cap=Rates(fleet.records_per_second, fleet.bytes_per_second),
            lease=self._lease,
            safe_fraction=fleet.safe_fraction,
            bootstrap_fraction=fleet.bootstrap_fraction,
            started_at=0.0,
        )
        self._applied: Rates | None = None
        self._mode: Mode | None = None
        self._warned_cap = False
        self._sequence = 0
        self._rate_changed: anyio.Event | None = None
        self._pending: GrantsDocument | None = None  # read before S3's clock was known
        self._phase_source: GrantsDocument | None = None  # the grants read this cycle
        self._report_body: bytes | None = None  # the last report written
        self._report_etag: str | None = None  # its ETag, if this process wrote it last
        self._overwritten = 0  # times in a row someone else wrote the report in between
        self._warned_overwritten = False
        self._report_lock: anyio.Lock | None = None

    def statistics(self) -> FleetStatistics:
        """A snapshot: role, mode, the rates applied, the grant's expiry, errors."""
        try:
            now = anyio.current_time()
        except Exception:  # outside the event loop, after close
            now = math.inf
        mode, rates = self._state.rates(now)
        if self._mode is not None and self._applied is not None:
            mode, rates = self._mode, self._applied  # what the producer's bucket holds
        return FleetStatistics(
            worker_id=self.worker_id,
            role="allocator" if self.holds_lease else "worker",
            mode=mode,
            records_per_second=rates.records_per_second,
            bytes_per_second=rates.bytes_per_second,
            grant_expires_at=self._state.grant_expires_at if mode == "granted" else None,
            fleet_size=self._state.fleet_size or 1,
            s3_errors=self.s3_errors,
            last_error=self.last_error,
            generation=self._state.generation,
        )

    def _fallback_description(self) -> str:
        mode, rates = self._state.rates(anyio.current_time())
        if self._mode is not None and self._applied is not None:
            mode, rates = self._mode, self._applied
        return (
            f"the producer carries on ({mode} rate now {_describe(rates)}; an expired grant "
            "falls back to the safe rate)"
        )

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Run until cancelled or :meth:`aclose` (started: the bootstrap rate is applied)."""
        self._state.bootstrap_until = anyio.current_time() + self._lease
        self._done = anyio.Event()
        self._stop_event = anyio.Event()
        self._rate_changed = anyio.Event()
        try:
            with anyio.CancelScope() as self._run_scope:
                self._refresh()
                task_status.started()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._enforce)
                    await self._serve()
                    tg.cancel_scope.cancel()
        finally:
            self._done.set()

    # -- applying rates -------------------------------------------------------------------

    def _refresh(self) -> None:
        """Apply the state machine's rate for now, if it changed. Never raises: the rate
        stays as it was if the producer refuses the new one."""
        now = anyio.current_time()
        mode, rates = self._state.rates(now)
        if rates != self._applied:
            try:
                self._apply(rates.records_per_second, rates.bytes_per_second)
            except Exception as exc:  # (the state machine never makes such a rate)
                self._record_error("apply the rate", exc)
                return
            self._applied = rates
        if mode != self._mode:
            if self._mode is not None:
                log = logger.warning if mode == "safe" else logger.info
                log(
                    "fleet %s: %s → %s, %s",
                    self.worker_id,
                    self._mode,
                    mode,
                    _describe(rates),
                    extra={"mode": mode},
                )
            self._mode = mode

    def _changed(self) -> None:
        """The state machine took something in: apply its rate now, and wake the timer,
        whose next change may be another one."""
        self._refresh()
        if self._rate_changed is not None:
            self._rate_changed.set()

    async def _enforce(self) -> None:
        """Keep the applied rate true to the state machine as time passes (grants expire on
        this timer, whatever the S3 calls are doing)."""
        while True:
            self._refresh()
            now = anyio.current_time()
            change = self._state.next_change(now)
            self._rate_changed = event = anyio.Event()
            delay = math.inf if change is None else max(0.0, change - now)
            with anyio.move_on_after(delay):
                await event.wait()

    def _receive(self, document: GrantsDocument) -> None:
        if not self._warned_cap and self._state.foreign_cap(document):
            self._warned_cap = True
            logger.warning(
                "fleet %s: grants.json was written for the caps %s, this worker's are %s: "
                "every member of a fleet (and anykpl fleet-allocator) needs the same caps. "
                "It applies its grants within its own caps; in a dimension only its own "
                "configuration caps, at its safe share",
                self.worker_id,
                _describe(document.cap),
                _describe(self._state.cap),
                extra={"document_cap": tuple(document.cap), "cap": tuple(self._state.cap)},
            )
        # even without a new grant: the fleet size, or the time its bootstrap lasts, may change
        self._state.receive(document, self._clock, anyio.current_time())
        self._changed()

    # -- the cycle ------------------------------------------------------------------------

    async def _cycle(self, store: _Store) -> None:
        grants = await self._read_grants(store)
        self._phase_source = grants.document if grants is not None else None
        if grants is not None and not grants.exists:
            self._state.no_grants_yet(anyio.current_time())
            self._changed()
        if grants is not None and grants.document is not None:
            if self._clock.known:
                self._receive(grants.document)
                self._pending = None
            else:
                self._pending = grants.document
        self._report_body = self._report().to_json()
        await self._write_report(store, "write the report")
        if self._pending is not None and self._clock.known:
            self._receive(self._pending)
            self._pending = None
        if self.fleet.elect:
            status = await self._lease_step(store)
            await self._allocate(store, grants, status)
        elif self.holds_lease:  # pragma: no cover - elect cannot change
            await self._release(store)

    def _report(self) -> WorkerReport:
        now = anyio.current_time()
        demand = self._demand()
        offered, wants = self._estimator.update(demand, now)
        mode, rates = self._state.rates(now)
        if self._mode is not None and self._applied is not None:
            mode, rates = self._mode, self._applied  # what it applies, not what it should
        self._sequence += 1
        return WorkerReport(
            worker_id=self.worker_id,
            incarnation=self._incarnation,
            sequence=self._sequence,
            mode=mode,
            generation=self._state.generation,
            has=rates,
            wants=wants,
            offered=offered,
            backlog=(max(0, demand.backlog_records), max(0, demand.backlog_bytes)),
        )

    def _allocated(self, document: GrantsDocument) -> None:
        self._receive(document)  # the allocator's own grant applies at once

    def _probe(self, store: _Store) -> tuple[str, bytes] | None:
        if self._report_body is None:
            return None
        return store.key(f"workers/{self.worker_id}.json"), self._report_body

    async def _rewrite(self, store: _Store, probe: tuple[str, bytes]) -> None:
        await self._write_report(store, "calibrate the clock")

    async def _write_report(self, store: _Store, operation: str) -> None:
        """PUT the report, with ``If-Match`` on the ETag of this process's last write.

        Nobody else writes ``workers/<id>.json``, unless another process runs with the same
        ``worker_id``: then the two overwrite each other's report, the allocator sees one
        worker, and each applies its grant — the fleet exceeds its cap. The condition fails
        when someone wrote in between; the report is written anyway, and after
        :data:`OVERWRITTEN_REPORTS` such cycles in a row the worker says so, once. (The
        allocator notices it too when the reports it reads alternate between the two.)"""
        if self._report_lock is None:
            self._report_lock = anyio.Lock()
        async with self._report_lock:  # (the cycle and the clock's calibration both write it)
            assert self._report_body is not None
            key = store.key(f"workers/{self.worker_id}.json")
            etag, self._report_etag = self._report_etag, None
            if etag is not None:
                try:
                    ok, written = await self._attempt(
                        operation, store.put(key, self._report_body, if_match=etag)
                    )
                except _Conflict:
                    self._overwritten += 1
                    if self._overwritten >= OVERWRITTEN_REPORTS and not self._warned_overwritten:
                        self._warned_overwritten = True
                        self._warn_overwritten()
                else:
                    if ok:
                        self._overwritten = 0
                        self._report_etag = written
                    return
            ok, written = await self._attempt(operation, store.put(key, self._report_body))
            if ok:
                self._report_etag = written

    def _warn_overwritten(self) -> None:
        logger.warning(
            "fleet %s: another process keeps overwriting this worker's report: several "
            "processes run with worker_id=%r, share one grant and each apply it, so the "
            "fleet can exceed its cap. Give each process its own worker_id (such as "
            'f"{hostname}-{pid}"), or leave it None for a random one',
            self.worker_id,
            self.worker_id,
            extra={"duplicate_worker_id": self.worker_id},
        )

    def _next_start(self, start: float) -> float:
        """Half a period after the allocator's, when one is alive.

        Capacity a worker gives up can be granted to others only once its report says it
        applied the reduction. A worker whose cycles fall just after the allocator's would
        report that a whole period late; one whose cycles fall half a period after the
        allocator's always reports in time for the next allocation. So a worker that read
        live grants locks its phase to them: its next cycle is the one point ``issued_at +
        (k + ½) × sync_interval`` between a half and one and a half periods after this start,
        with the usual ±10 % jitter. Its second cycle only comes half a period after its
        first, whatever the phase.
        """
        period = self.fleet.sync_interval
        if self._sequence <= 1 and not self.holds_lease:
            # A first report says nothing of demand (a rate takes two samples), and a first
            # allocation that sees only first reports grants each worker its floor: the second
            # comes half a period later, before the allocator's next cycle.
            return start + self._interval() / 2
        document = self._phase_source
        offsets = self._clock.offsets(start)
        if self.holds_lease or document is None or offsets is None:
            return super()._next_start(start)
        issued = document.issued_at - (offsets[0] + offsets[1]) / 2  # local time
        if document.expires_at - offsets[0] <= start:  # no allocator alive
            return super()._next_start(start)
        aligned = issued + period / 2
        aligned += math.ceil((start + period / 2 - aligned) / period) * period
        return aligned + period * self._random.uniform(-0.1, 0.1)

    async def _cleanup(self, store: _Store) -> None:
        with suppress(_Conflict):
            await self._attempt(
                "delete the report", store.delete(store.key(f"workers/{self.worker_id}.json"))
            )
        await self._release(store)


class FleetAllocator(_Member):
    """The allocator alone, without a producer (``anykpl fleet-allocator``).

    It competes for the lease like any member (run the workers with ``elect=False`` to leave
    the role to it) and, since it writes no report, PUTs a small presence object
    ``allocators/<id>.json`` each cycle: that keeps its estimate of S3's clock fresh where S3
    sends no ``Date`` header, and shows operators which allocators run.
    ``on_allocation(document)`` is called after each generation it writes.
    """

    _role_name = "standby"

    def __init__(
        self,
        fleet: FleetConfig,
        config: ProducerConfig,
        *,
        allocator_id: str | None = None,
        client_factory: ClientFactory | None = None,
        on_allocation: Callable[[GrantsDocument], None] | None = None,
    ) -> None:
        super().__init__(
            fleet,
            config,
            member_id=allocator_id or fleet.worker_id or f"allocator-{os.urandom(6).hex()}",
            client_factory=client_factory,
            on_allocation=on_allocation,
        )

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Allocate (whenever it holds the lease) until cancelled or :meth:`aclose`."""
        self._done = anyio.Event()
        self._stop_event = anyio.Event()
        try:
            with anyio.CancelScope() as self._run_scope:
                task_status.started()
                await self._serve()
        finally:
            self._done.set()

    def _probe(self, store: _Store) -> tuple[str, bytes]:
        presence = {"allocator": self.worker_id, "incarnation": self._incarnation}
        return store.key(f"allocators/{self.worker_id}.json"), json.dumps(presence).encode()

    async def _cycle(self, store: _Store) -> None:
        await self._attempt("write presence", store.put(*self._probe(store)))
        status = await self._lease_step(store)
        if status in ("held", "acquired"):
            await self._allocate(store, await self._read_grants(store), status)

    async def _cleanup(self, store: _Store) -> None:
        with suppress(_Conflict):
            await self._attempt(
                "delete presence", store.delete(store.key(f"allocators/{self.worker_id}.json"))
            )
        await self._release(store)


def _describe(rates: Rates) -> str:
    parts = []
    if rates.records_per_second is not None:
        parts.append(f"{rates.records_per_second:.1f} records/s")
    if rates.bytes_per_second is not None:
        parts.append(f"{rates.bytes_per_second:.0f} bytes/s")
    return ", ".join(parts) or "unlimited"
