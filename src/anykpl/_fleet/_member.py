"""What every member of a fleet shares — a producer's :class:`~anykpl._fleet._worker.FleetWorker`
and the standalone :class:`~anykpl._fleet._standalone_allocator.FleetAllocator`: the S3 client,
error counting and logging, the allocator's lease, allocating while it holds it, S3's clock
calibration, the cycle loop and closing.

Each kind of member defines its own sync cycle (the abstract :meth:`Member._cycle`). S3 errors
never stop a member: every call is bounded, every error is counted and logged at WARNING on the
``anykpl.fleet`` logger once per kind (again after S3 has answered a whole cycle without
error). docs/fleet.md draws the control loop and the failure modes.
"""

from __future__ import annotations

import abc
import logging
import math
import os
import random
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import anyio

from .._transport._aws import create_client
from .._transport._botocore import error_code
from ..config import FleetConfig, ProducerConfig
from ..errors import CONNECTION_ERROR, TIMEOUT
from ._allocation import Allocator, ObservedReport
from ._clock import ServerClock
from ._documents import (
    DocumentError,
    GrantsDocument,
    LeaseDocument,
    lease_expiry,
    parse_grants,
    parse_lease,
    parse_report,
)
from ._dynamodb_store import DynamoDBStore
from ._rates import Rates
from ._store import Conflict, S3Store, Store
from ._worker_state import LEFTOVER_LEASES

__all__ = (
    "CLOCK_TARGET",
    "CLOSE_TIMEOUT",
    "LEFTOVER_LEASES",
    "STRAIN_CODES",
    "is_strain",
    "READ_CONCURRENCY",
    "MAX_STRETCH",
    "READ_PHASE",
    "ClientFactory",
    "GrantsRead",
    "ReportsRead",
    "Member",
)

logger = logging.getLogger("anykpl.fleet")

#: How long the last S3 calls may take on close (delete the report, release the lease);
#: :meth:`Member.aclose` returns within half a second more.
CLOSE_TIMEOUT = 1.5
#: Reports read at once by the allocator: this many, or one reader per REPORTS_PER_READER
#: reports for a large fleet (on a 50 ms round trip, 1,000 reports in about 0.4 s), up to
#: MAX_READ_CONCURRENCY (the store client's connection pool). With one reader per 16 up to
#: 64, the reads of 1,000 reports took 1.1-1.4 s where one answer in twenty failed and was
#: tried again: over STRAINED_READS of a 5 s interval, which stretched the interval of a
#: store that kept up.
READ_CONCURRENCY = 16
REPORTS_PER_READER = 8
MAX_READ_CONCURRENCY = 128
#: The share of a sync interval the allocator spends reading reports at most: a report not
#: read by then (a slow store) keeps its worker's grant for one more generation.
READ_PHASE = 0.5
#: The longest sync interval a slow store stretches the fleet's to, in configured intervals.
MAX_STRETCH = 12.0
#: A read phase longer than this share of the interval (a running mean: this cycle's and the
#: mean before, each weighing half — one slow cycle is noise), or a failed listing, or more
#: than STRAINED_SHARE of the reports left unread (:attr:`ReportsRead.strained`), stretches
#: the interval by STRETCH_STEP; one shorter than CALM_READS of it shrinks it back by the
#: same step. The band between is wide: on a store that cannot keep up, reads take longer at
#: a shorter interval (the fleet asks more of it), and a narrower band (0.15) made a
#: 1,000-member fleet on a store serving 230 requests/s swing between 25 and 38 s.
STRAINED_READS = 0.25
STRAINED_SHARE = 0.05
STRETCH_STEP = 1.5
CALM_READS = 0.1
#: An interval stretched only because reads failed (never because they were slow) shrinks
#: back after this many cycles in a row without a failure, as soon as the reads would not
#: strain the shorter one: a failed read in a store that fails one request in twenty is no
#: sign of a slow store, and kept a 1,000-member fleet at 7.5 s for good (its reads take a
#: second, over CALM_READS of it).
CLEAN_CYCLES = 3
#: The answers by which a store says it is overloaded: throttles, 5xx and timeouts. A member
#: without a grant (not the allocator: it stretches the fleet's interval, :meth:`Member._adapt`)
#: whose calls get one in a cycle waits STRETCH_STEP times longer for its next, up to
#: MAX_STRETCH sync intervals, and shrinks back by as much after a cycle without: a store too
#: slow for the allocator to tell the fleet to stretch (its reads are refused too) gets fewer
#: calls anyway.
STRAIN_CODES = frozenset(
    {
        "SlowDown",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeout",
        "Throttling",
        "ThrottlingException",
        "ProvisionedThroughputExceededException",
        "RequestLimitExceeded",
        "InternalServerError",
        TIMEOUT,
    }
)
#: The errors after which a member tries a call again, up to TRANSIENT_RETRIES times, each
#: RETRY_PAUSE seconds later (while its retry budget lasts): a store's occasional internal
#: error or a dropped connection, which the AWS SDKs retry (three attempts in all, as their
#: standard mode). With one retry, a store that failed one answer in twenty made a call fail
#: twice in a row for one in four hundred: one of a hundred members joining together lost a
#: whole interval to it. Not a throttle nor a timeout: a store that is overloaded gets fewer calls,
#: not more (see STRAIN_CODES). Only the calls that are safe twice are tried again: the reads;
#: a worker's report (its ``If-Match`` fails if the first try went through after all, and the
#: report is written as after any other conflict); and a leaving worker's mark and the
#: deletion of its report (a conflict there leaves the report to the allocator).
TRANSIENT_CODES = frozenset({"InternalError", "InternalServerError", "HTTP500", CONNECTION_ERROR})
TRANSIENT_RETRIES = 2
RETRY_PAUSE = (0.02, 0.1)
#: The one exception to "no retry after a throttle": the allocator's grants write, refused as
#: overloaded, is tried again once after THROTTLED_PAUSE of an interval (the same document, on
#: the same condition). It is the fleet's most important write: refused, every worker's grant runs
#: out a cycle later, and a thousand members then calling to learn their ranks kept a store
#: serving 230 requests/s refusing the allocator's reads for a minute.
THROTTLED_PAUSE = (0.1, 0.3)
#: The retry budget: RETRY_BUDGET retries, and each call that succeeds at its first try earns
#: RETRY_EARNED of one back: a store that fails more than about a tenth of the calls gets
#: hardly any retries (as botocore's retry quota).
RETRY_BUDGET = 5.0
RETRY_EARNED = 0.1
#: The allocator's reads of the reports have an allowance of their own: retries for up to this
#: share of the reports due in a cycle (at least RETRY_BUDGET). A thousand reads go out in a
#: fraction of a second, so the member's budget of five was spent in the first moments of a
#: phase on a store failing one answer in twenty: the other forty-odd reads that failed kept
#: their workers' grants a generation (unacknowledged), and the members joining meanwhile got
#: a share that much smaller for an interval. Bounded all the same: a store failing every call
#: gets a tenth more reads, not twice as many.
READ_RETRY_SHARE = 0.1
#: S3's clock is known well enough once a member's uncertainty about it is below this.
CLOCK_TARGET = 0.1
#: After the holder's lease would expire, a contender looks again this much later, and a
#: random part of TAKEOVER_SPREAD intervals more: a thousand members whose allocator died do
#: not all call the store at the same instant (the grants outlive the lease by an interval,
#: so the successor still publishes in time).
_LEASE_MARGIN = 0.01
TAKEOVER_SPREAD = 0.25
#: An allocator whose reads failed tries again this share of an interval later, not a whole
#: interval (after a takeover, the grants in force run out within an interval).
RETRY_SOON = 0.25

ClientFactory = Callable[[], AbstractAsyncContextManager[Any]]


def is_strain(code: str) -> bool:
    """Whether an error code says the store is overloaded (see :data:`STRAIN_CODES`): a named
    one, or a bare 5xx status (an error without a body: botocore names it by its status,
    ``"503"``, or :func:`~anykpl._transport._botocore.error_code` as ``"HTTP503"``)."""
    status = code.removeprefix("HTTP")
    return code in STRAIN_CODES or (len(status) == 3 and status.isdigit() and status[0] == "5")


@dataclass(slots=True)
class ReportsRead:
    """What the allocator read of the reports in one cycle."""

    reports: list[ObservedReport] = field(default_factory=list)
    #: workers whose fresh report was listed but not read (failed, or not read in time)
    unread: set[str] = field(default_factory=set)
    #: reads that failed (the store's errors and timeouts, not junk documents)
    failed: int = 0
    #: reports due to be read (listed and fresh)
    due: int = 0
    #: workers that left (``left/<id>.json``): worker id -> (its incarnation, the mark's ETag)
    left: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: the reports read: worker id -> (its incarnation, its ETag)
    tags: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def strained(self) -> bool:
        """Whether the store failed (or did not answer in time) more than
        :data:`STRAINED_SHARE` of the reads: it is overloaded, or failing, and fewer calls help
        either way. Fewer failures are noise that the next cycle's reads absorb (an unread
        worker keeps its grant meanwhile): a thousand reads with 1 % of errors stretched the
        fleet's interval to its longest."""
        return len(self.unread) > STRAINED_SHARE * self.due


@dataclass(frozen=True, slots=True)
class GrantsRead:
    """``grants.json`` as read at the start of a cycle."""

    document: GrantsDocument | None  # None: missing or junk
    etag: str | None
    exists: bool


class RetryBudget:
    """The retries left (``capacity`` at most): each takes one; a call that succeeds at its
    first try earns ``earned`` of one back (as botocore's retry quota)."""

    __slots__ = ("capacity", "earned", "left")

    def __init__(self, capacity: float, earned: float) -> None:
        self.capacity = capacity
        self.earned = earned
        self.left = capacity

    def take(self) -> bool:
        if self.left < 1:
            return False
        self.left -= 1
        return True

    def earn(self) -> None:
        self.left = min(self.capacity, self.left + self.earned)


class Member(abc.ABC):
    """What workers and the standalone allocator share: S3, errors, the lease, allocating."""

    _role_name = "member"
    #: whether it stretches its own interval while the store refuses its calls (a standby
    #: allocator does not: it must see the lease run out in time)
    _backs_off = True

    def __init__(
        self,
        fleet: FleetConfig,
        config: ProducerConfig,
        *,
        member_id: str,
        client_factory: ClientFactory | None,
        on_allocation: Callable[[GrantsDocument], None] | None,
        local_clock: Callable[[], float] | None = None,
    ) -> None:
        self.fleet = fleet
        # This machine's monotonic clock (``anyio.current_time``): every local time a member
        # keeps is read here, never its wall clock, so members' clocks may disagree by any
        # offset (a simulation gives each its own, with drift: benchmarks/fleet_scale.py).
        self._now: Callable[[], float] = local_clock or anyio.current_time
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
            sync_interval=fleet.sync_interval,
        )
        # every S3 call is bounded: a hung call must not hold a cycle much beyond an interval
        self._call_timeout = min(
            config.connect_timeout + config.request_timeout, max(1.0, fleet.sync_interval)
        )
        self._random = random.Random(os.urandom(8))
        self._lease_etag: str | None = None
        self._lease_acquired_at: float | None = None
        self._lease_wake: float | None = None  # local time to look at someone else's lease
        #: local time until which the lease is surely this member's (see :meth:`_lease_step`)
        self._lease_sure_until = -math.inf
        self._renew_due = False  # the lease is renewed once this cycle's grants are written
        self._gather_until = -math.inf  # local time before which a fresh fleet gets no grants
        self._taking_over = False  # acquired the lease; the takeover is decided when S3 answers
        self._next_sweep = -math.inf  # local time to look for leftover presence objects
        self._close_deadline: float | None = None  # local time by which closing must end
        self.s3_errors = 0
        self._retry_budget = RetryBudget(RETRY_BUDGET, RETRY_EARNED)
        #: calls tried again (:meth:`_attempt_retrying`)
        self.retries = 0
        self._strained_calls = 0  # calls the store refused as overloaded (STRAIN_CODES)
        self._backoff = 1.0  # this member's own stretch of its interval while they come
        self.last_error: str | None = None
        self._logged: set[str] = set()
        self._callback_failed = False
        self._stopping = False
        self._retry_soon = False  # the allocator's last reads failed: its next cycle comes soon
        self._stop_event: anyio.Event | None = None
        self._cycle_scope: anyio.CancelScope | None = None
        self._run_scope: anyio.CancelScope | None = None
        # the cleanup under way is for good (stopped or cancelled), not before going on with a
        # new client
        self._leaving = False
        self._done: anyio.Event | None = None
        #: the last grants document this member wrote
        self.last_document: GrantsDocument | None = None
        #: the sync interval this member keeps to now: the configured one, or the longer one
        #: the allocator asks of the fleet while the store is slow (see :meth:`_adapt`)
        self.period = fleet.sync_interval
        self._took: float | None = None  # how long the allocator's reads took, smoothed
        self._slow_reads = False  # the interval was stretched because the reads were slow
        self._clean_cycles = 0  # the allocator's cycles in a row whose reads did not fail
        #: the store requests made, by kind (see FleetStatistics.requests)
        self.requests: Counter[str] = Counter()
        self._started_at: float | None = None  # local time of the first cycle

    def __repr__(self) -> str:
        role = "allocator" if self.holds_lease else self._role_name
        return f"<{type(self).__name__} {self.worker_id} {role} errors={self.s3_errors}>"

    @property
    def holds_lease(self) -> bool:
        return self._lease_etag is not None

    def _default_client(self) -> AbstractAsyncContextManager[Any]:
        return create_client(
            self.config,
            "s3" if self.fleet.table is None else "dynamodb",
            max_pool_connections=MAX_READ_CONCURRENCY,
            endpoint_url=self.fleet.endpoint_url,
        )

    # -- errors ---------------------------------------------------------------------------

    def _record_error(self, operation: str, exc: BaseException) -> None:
        if isinstance(exc, DocumentError):
            code, message = "InvalidDocument", str(exc)
        else:
            code, message = error_code(exc)
        self.s3_errors += 1
        if is_strain(code):
            self._strained_calls += 1
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
            logger.info("fleet %s: the store answers again", self.worker_id)
            self._logged.clear()

    async def _attempt(
        self,
        operation: str,
        call: Awaitable[Any],
        *,
        again: Callable[[], Awaitable[Any]] | None = None,
        retries: int = 1,
        throttled_too: bool = False,
        budget: RetryBudget | None = None,
    ) -> tuple[bool, Any]:
        """Await ``call``; on an error, record it and return ``(False, None)``.

        With ``again`` (what makes the call anew), a transient error (:data:`TRANSIENT_CODES`)
        is followed by a retry, up to ``retries`` of them, while the retry budget lasts: one
        failed read in a hundred would otherwise cost a worker its acknowledgement for a
        whole interval, and the allocator a whole cycle. Not once the call (since its first
        try) has taken over half the call's timeout: with the last try's timeout, a call takes
        at most one and a half timeouts, and the pauses. A first try that succeeds earns back
        part of a retry (:data:`RETRY_EARNED`); a retry's conflict says so
        (:attr:`Conflict.retried`). ``throttled_too``: a throttle too is followed by a retry
        (one, the last), :data:`THROTTLED_PAUSE` of an interval later. ``budget``: the
        retries are drawn from it instead of the member's own."""
        if budget is None:
            budget = self._retry_budget
        started_at = self._now()
        retried = False
        while True:
            try:
                result = await call
            except anyio.get_cancelled_exc_class():
                raise
            except Conflict as exc:
                exc.retried = retried
                raise
            except Exception as exc:
                if again is None or retries <= 0:
                    self._record_error(operation, exc)
                    return False, None
                code, message = error_code(exc)
                # (a store's 500 is both transient and a sign of strain: the short pause)
                throttled = (
                    throttled_too
                    and code in STRAIN_CODES
                    and code not in TRANSIENT_CODES
                    and code != TIMEOUT
                )
                if (
                    (code not in TRANSIENT_CODES and not throttled)
                    or self._now() - started_at > self._call_timeout / 2
                    or not budget.take()
                ):
                    self._record_error(operation, exc)
                    return False, None
                # counted, but neither logged nor taken as strain unless the retry fails too
                self.retries += 1
                self.s3_errors += 1
                self.last_error = f"{operation}: {code}: {message}"
            else:
                if not retried:
                    budget.earn()
                return True, result
            if throttled:
                await anyio.sleep(self.period * self._random.uniform(*THROTTLED_PAUSE))
                retries = 0  # (the retry after a throttle is the last)
            else:
                await anyio.sleep(self._random.uniform(*RETRY_PAUSE))
                retries -= 1
            call, retried = again(), True

    async def _attempt_retrying(
        self,
        operation: str,
        call: Callable[[], Awaitable[Any]],
        budget: RetryBudget | None = None,
    ) -> tuple[bool, Any]:
        """:meth:`_attempt` ``call()``, tried again after a transient error, up to
        :data:`TRANSIENT_RETRIES` times (from ``budget``, or the member's own)."""
        return await self._attempt(
            operation, call(), again=call, retries=TRANSIENT_RETRIES, budget=budget
        )

    # -- the lease ------------------------------------------------------------------------

    def _server_now(self) -> tuple[float, float] | None:
        return self._clock.bounds(self._now())

    def _follow(self, document: GrantsDocument) -> None:
        """Keep to the interval an unexpired grants document of another allocator asks of
        the fleet (its lease and grants stretch with it: a member taking over must too)."""
        if self.holds_lease:
            return
        now = self._now()
        ends = self._clock.earliest_local(document.expires_at, now)
        if ends is not None and ends > now:
            self.period = document.sync_interval or self.fleet.sync_interval

    @property
    def stretch(self) -> float:
        """How many configured sync intervals the interval kept to now lasts (at least 1)."""
        return max(1.0, self.period / self.fleet.sync_interval)

    def _lease_document(self, now: tuple[float, float]) -> bytes:
        middle = (now[0] + now[1]) / 2
        if self._lease_acquired_at is None:
            self._lease_acquired_at = middle
        lease = self._lease * self.stretch  # renewed once an interval, however long
        return LeaseDocument(
            holder=self.worker_id,
            incarnation=self._incarnation,
            acquired_at=self._lease_acquired_at,
            renewed_at=middle,
            expires_at=middle + lease,
            lease=lease,
        ).to_json()

    def _leased(self, etag: str, now: tuple[float, float]) -> None:
        """The lease document made at ``now`` (:meth:`_lease_document`) is in the store, as
        ``etag``. Others judge it to end no earlier than the earliest the store's time was
        then, plus the lease (its expiry, or when the store wrote it plus the lease)."""
        self._lease_etag = etag
        self._lease_sure_until = self._surely_before(now[0] + self._lease * self.stretch)

    def _surely_before(self, server_time: float) -> float:
        """The local time until which the store's time surely has not reached ``server_time``
        (its earliest local time; -inf while the store's clock is unknown)."""
        sure = self._clock.earliest_local(server_time, self._now())
        return -math.inf if sure is None else sure

    def _lost_lease(self, why: str) -> None:
        self._retry_soon = False
        self._renew_due = False
        self._lease_sure_until = -math.inf
        if self._lease_etag is not None:
            logger.info("fleet %s: no longer the allocator (%s)", self.worker_id, why)
        self._lease_etag = None
        self._lease_acquired_at = None
        self._taking_over = False
        self._allocator.step_down()

    async def _lease_step(self, store: Store) -> str | None:
        """Renew, acquire or watch the lease: ``"held"``, ``"acquired"``, ``"other"``, or
        ``None`` when S3 did not answer."""
        now = self._server_now()
        if now is None:
            return None
        key = store.key("allocator.json")
        if self._lease_etag is not None:
            return await self._hold(store, now)
        ok, found = await self._attempt_retrying("read the lease", lambda: store.get(key))
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
            self._lease_sure_until = self._surely_before(
                min(lease.expires_at, last_modified + lease.lease)
            )
            return await self._hold(store, now)
        expiry = lease_expiry(lease, last_modified, self._lease)
        now = self._server_now() or now
        if now[0] >= expiry:
            return await self._acquire(store, key, now, if_match=etag)
        local = self._now()
        surely = self._clock.surely_local(expiry, local)
        spread = self._random.uniform(0.0, TAKEOVER_SPREAD * self.period)
        self._lease_wake = None if surely is None else surely + _LEASE_MARGIN + spread
        return "other"

    async def _renew(self, store: Store, now: tuple[float, float]) -> str | None:
        """Renew the lease held: ``"held"``, ``"other"`` if another member took it, or
        ``None`` when the store did not answer."""
        assert self._lease_etag is not None
        self._renew_due = False
        try:
            ok, etag = await self._attempt(
                "renew the lease",
                store.put(
                    store.key("allocator.json"),
                    self._lease_document(now),
                    if_match=self._lease_etag,
                ),
            )
        except Conflict:
            self._lost_lease("another member took the lease")
            return "other"
        if not ok:
            return None
        self._leased(etag, now)
        return "held"

    async def _hold(self, store: Store, now: tuple[float, float]) -> str | None:
        """The lease held: renewed now, or — while it is surely this member's for longer
        than a call — put off until this cycle's grants are written (:meth:`_allocate_held`).
        Renewed before the reads, a lease would outlive the last grants written before it
        by the reads' time only, not by the interval that a successor needs to publish its
        own grants, should this process die between the renewal and the write."""
        if self._now() + self._call_timeout < self._lease_sure_until:
            self._renew_due = True
            return "held"
        return await self._renew(store, now)

    async def _allocate_held(
        self, store: Store, grants: GrantsRead | None, status: str | None
    ) -> None:
        """:meth:`_allocate`, and the lease's renewal put off by :meth:`_hold`: after the
        grants are written; before the lease could run out, if the cycle is still under way
        then; and at the end of a cycle that wrote none, only if the lease would not last
        until the next (renewed after a cycle without grants, the lease would outlive the
        last ones written)."""
        try:
            async with anyio.create_task_group() as tg:
                if self._renew_due:
                    tg.start_soon(self._renew_in_time, store)
                await self._allocate(store, grants, status)
                tg.cancel_scope.cancel()
        finally:
            late = self._now() + self._interval() + self._call_timeout
            if late >= self._lease_sure_until:
                with anyio.CancelScope(shield=True):
                    await self._renew_put_off(store)
            self._renew_due = False

    async def _renew_in_time(self, store: Store) -> None:
        await anyio.sleep(max(0.0, self._lease_sure_until - self._call_timeout - self._now()))
        with anyio.CancelScope(shield=True):  # (a renewal cut short loses the lease's tag)
            await self._renew_put_off(store)

    async def _renew_put_off(self, store: Store) -> None:
        if not self._renew_due or self._lease_etag is None:
            return
        now = self._server_now()
        if now is not None:
            await self._renew(store, now)

    async def _acquire(
        self, store: Store, key: str, now: tuple[float, float], *, if_match: str | None
    ) -> str | None:
        self._lease_acquired_at = None
        body = self._lease_document(now)
        try:
            ok, etag = await self._attempt(
                "take the lease",
                store.put(key, body, if_match=if_match, if_none_match=if_match is None),
            )
        except Conflict:
            return "other"  # another member was quicker
        if not ok:
            return None
        self._leased(etag, now)
        self._lease_wake = None
        self._taking_over = True
        self._took = None
        self._clean_cycles = 0
        self._backoff = 1.0  # (the allocator keeps to the fleet's interval)
        logger.info("fleet %s: now the allocator", self.worker_id)
        return "acquired"

    async def _release(self, store: Store) -> None:
        if self._lease_etag is None:
            return
        etag, self._lease_etag = self._lease_etag, None
        self._taking_over = False
        self._renew_due = False
        self._lease_sure_until = -math.inf
        self._allocator.step_down()
        with suppress(Conflict):  # taken over meanwhile: not ours to delete
            await self._attempt(
                "release the lease", store.delete(store.key("allocator.json"), if_match=etag)
            )

    # -- allocating -----------------------------------------------------------------------

    async def _read_grants(self, store: Store) -> GrantsRead | None:
        ok, found = await self._attempt_retrying(
            "read grants", lambda: store.get(store.key("grants.json"))
        )
        if not ok:
            return None
        if found is None:
            return GrantsRead(None, None, False)
        data, etag, _ = found
        try:
            return GrantsRead(parse_grants(data), etag, True)
        except DocumentError as exc:
            self._record_error("read grants", exc)
            return GrantsRead(None, etag, True)

    async def _read_reports(self, store: Store) -> ReportsRead | None:
        """The fresh reports, and the workers whose fresh report was listed but not read.

        Every read is bounded, and the reads together take at most :data:`READ_PHASE` of a
        sync interval, so a slow store delays an allocation but never stops it (an unread
        worker keeps its grant for one more generation). They go in a random order, so the
        same workers are not the ones left unread cycle after cycle, and :data:`READ_CONCURRENCY`
        at a time, or one per :data:`REPORTS_PER_READER` reports for a large fleet. ``None``
        when the listing fails."""
        prefix = store.key("workers/")
        ok, listing = await self._attempt_retrying("list reports", lambda: store.list(prefix))
        if not ok:
            return None
        # the marks of workers that left (few, or none): a failed listing only means that
        # what they had is freed a cycle later
        marked, marks = await self._attempt_retrying(
            "list left workers", lambda: store.list(store.key("left/"))
        )
        now = self._server_now()
        if now is None:
            return None
        read = ReportsRead()
        leftover = LEFTOVER_LEASES * self._lease
        due: list[str] = []
        stale: list[tuple[str, str]] = []
        for key, last_modified, etag in listing:
            if not key.endswith(".json"):
                continue
            if now[0] - last_modified > leftover:
                stale.append((key, etag))
            elif not self._allocator.is_stale(last_modified, now):
                due.append(key)
        self._random.shuffle(due)
        read.due = len(due)
        allowance = max(RETRY_BUDGET, READ_RETRY_SHARE * len(due))
        budget = RetryBudget(allowance, 0.0)
        limiter = anyio.CapacityLimiter(
            min(MAX_READ_CONCURRENCY, max(READ_CONCURRENCY, len(due) // REPORTS_PER_READER))
        )

        async def read_one(key: str) -> None:
            worker_id = key[len(prefix) : -len(".json")]
            read.unread.add(worker_id)
            async with limiter:
                ok, found = await self._attempt_retrying(
                    "read a report", lambda: store.get(key), budget
                )
            if not ok:
                read.failed += 1
                return
            read.unread.discard(worker_id)
            if found is None:
                return  # deleted since the listing
            data, etag, last_modified = found
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
            read.tags[report.worker_id] = (report.incarnation, etag)
            read.reports.append(ObservedReport(report, last_modified))

        async def read_mark(key: str, etag: str) -> None:
            async with limiter:
                ok, found = await self._attempt_retrying("read a left mark", lambda: store.get(key))
            if not ok or found is None:
                return
            try:
                mark = parse_report(found[0])
            except DocumentError as exc:
                self._record_error(f"read {key.rsplit('/', 1)[-1]}", exc)
                return
            if mark.left and key == store.key(f"left/{mark.worker_id}.json"):
                read.left[mark.worker_id] = (mark.incarnation, found[1])

        with anyio.move_on_after(READ_PHASE * self.period) as phase:
            async with anyio.create_task_group() as tg:
                for key, etag in stale:
                    tg.start_soon(self._delete_leftover, store, key, etag)
                for key, last_modified, etag in marks if marked else ():
                    if now[0] - last_modified > leftover:  # (unread junk, or never cleared)
                        tg.start_soon(self._delete_leftover, store, key, etag)
                    elif key.endswith(".json"):
                        tg.start_soon(read_mark, key, etag)
                for key in due:
                    tg.start_soon(read_one, key)
        if phase.cancelled_caught:
            self._record_error(
                "read reports",
                TimeoutError(f"{len(read.unread)} report(s) not read within the read phase"),
            )
        return read

    async def _delete_leftover(self, store: Store, key: str, etag: str) -> None:
        """Delete a long-stale object — only as it was listed (``If-Match``): one its owner
        wrote again meanwhile is not a leftover."""
        try:
            await store.delete(key, if_match=etag or None)
            logger.info("fleet %s: deleted the leftover object %s", self.worker_id, key)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:  # best effort: it is only a leftover
            logger.debug("fleet %s: could not delete %s: %s", self.worker_id, key, exc)

    async def _sweep_presence(self, store: Store) -> None:
        """Delete the presence objects of standalone allocators gone for long (they rewrite
        theirs every cycle; one stale for :data:`LEFTOVER_LEASES` leases is a leftover). Once
        a lease at most: it costs a LIST."""
        if self._now() < self._next_sweep:
            return
        self._next_sweep = self._now() + self._lease
        ok, listing = await self._attempt_retrying(
            "list allocators", lambda: store.list(store.key("allocators/"))
        )
        now = self._server_now()
        if not ok or now is None:
            return
        for key, last_modified, etag in listing:
            if now[0] - last_modified > LEFTOVER_LEASES * self._lease:
                await self._delete_leftover(store, key, etag)

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

    async def _allocate(self, store: Store, grants: GrantsRead | None, status: str | None) -> None:
        if status not in ("held", "acquired"):
            return
        if grants is None:  # (not read this cycle: the next comes soon, not an interval on)
            self._retry_soon = True
            return
        if self._now() < self._gather_until:
            return
        if self._taking_over and grants.document is not None:
            # keep to the interval the predecessor asked of the fleet, to begin with
            self.period = grants.document.sync_interval or self.fleet.sync_interval
        # which reports are fresh, and which current, by the interval the fleet keeps to now
        # (a member taking over a stretched fleet must not judge its reports by its own)
        self._allocator.use_interval(self.period, self._allocator.interval)
        began = self._now()
        began_at = self._server_now()  # (the next reads begin a period later)
        read = await self._read_reports(store)
        now = self._server_now()
        if read is None or now is None:
            self._adapt(strained=True, took=None)
            self._retry_soon = True
            return  # (a takeover is decided at the first cycle whose reads succeed)
        reports, unread = read.reports, frozenset(read.unread)
        left = {w: incarnation for w, (incarnation, _) in read.left.items()}
        self._adapt(strained=read.strained, took=self._now() - began)
        if unread and grants.document is None:
            # no document says what the unread workers may apply: wait for a complete read
            self._retry_soon = True
            return
        self._retry_soon = False
        self._warn_duplicates(reports)
        if self._taking_over:
            self._taking_over = False
            taken = self._allocator.take_over(grants.document, reports, now, unread)
            if not taken and not grants.exists:
                # No grants were ever written: the fleet is starting. Members that start
                # together report within a cycle; a first allocation that saw only some of
                # them would grant those the whole cap, and taking it back costs a cycle of
                # acknowledgements. So the first grants wait one cycle — but the fleet size
                # goes out at once, in a document without grants.
                self._gather_until = self._now() + 0.8 * self.fleet.sync_interval
                document = self._allocator.gather(grants.document, reports, now, began_at)
            else:
                document = self._allocator.allocate(
                    grants.document, reports, now, unread, left, began_at
                )
        else:
            document = self._allocator.allocate(
                grants.document, reports, now, unread, left, began_at
            )
        if await self._write_grants(store, grants, document):
            await self._renew_put_off(store)
            await self._delete_left(store, read, document)
        await self._sweep_presence(store)

    def _adapt(self, *, strained: bool, took: float | None) -> None:
        """Stretch the fleet's sync interval while the store is slow, shrink it back when it
        is not: the fleet's requests per second are about three per member per interval, so
        a store that cannot serve them gets fewer, later — never looser rates. The interval
        goes out in the next grants document; the lease and the grants' lifetime stretch
        with it."""
        previous = self.period
        if took is not None:  # (None: the reads failed, and say nothing of how long they take)
            self._took = took if self._took is None else (took + self._took) / 2
        took = self._took or 0.0
        shorter = max(self.fleet.sync_interval, previous / STRETCH_STEP)
        slow = took > STRAINED_READS * previous
        if strained or slow:
            period = min(MAX_STRETCH * self.fleet.sync_interval, previous * STRETCH_STEP)
            self._slow_reads = self._slow_reads or slow
            self._clean_cycles = 0
        else:
            self._clean_cycles += 1
            calm = took < CALM_READS * previous or (
                not self._slow_reads
                and self._clean_cycles >= CLEAN_CYCLES
                and took <= STRAINED_READS * shorter
            )
            period = shorter if calm else previous
            if calm:
                self._clean_cycles = 0
        if period == self.fleet.sync_interval:
            self._slow_reads = False
        if period != previous:
            logger.info(
                "fleet %s: the store %s: the fleet syncs every %.1f s (configured: %.1f s)",
                self.worker_id,
                "is slow" if period > previous else "keeps up",
                period,
                self.fleet.sync_interval,
            )
        self.period = period
        self._allocator.use_interval(period, previous)

    async def _delete_left(self, store: Store, read: ReportsRead, document: GrantsDocument) -> None:
        """Delete the marks of workers that left, now that ``document`` (written) no longer
        counts what they had (or, where the mark named another process of the worker id than
        the grants did, never counted it); and first the report of one that could not delete
        its own. Each only as it was read (``If-Match``); a mark stays while its report
        could not be deleted (it would count again without it)."""

        if not read.left:
            return
        limiter = anyio.CapacityLimiter(READ_CONCURRENCY)

        async def clear(worker_id: str, incarnation: str, etag: str) -> None:
            entry = document.workers.get(worker_id)
            report = read.tags.get(worker_id)
            newer = report is not None and report[0] != incarnation  # another process reports
            counted = entry is not None and (entry.incarnation is None or entry.names(incarnation))
            if counted and not newer:
                return  # (not freed by this document: the mark waits for the next)
            async with limiter:
                if report is not None and report[0] == incarnation:
                    key = store.key(f"workers/{worker_id}.json")
                    if not await self._delete_as_read(store, key, report[1]):
                        return
                await self._delete_as_read(store, store.key(f"left/{worker_id}.json"), etag)

        with anyio.move_on_after(READ_PHASE * self.period):  # (what is left waits a cycle)
            async with anyio.create_task_group() as tg:
                for worker_id, (incarnation, etag) in read.left.items():
                    tg.start_soon(clear, worker_id, incarnation, etag)

    async def _delete_as_read(self, store: Store, key: str, etag: str) -> bool:
        """Delete ``key`` if it is still as read (``If-Match``); whether it is gone."""
        try:
            ok, _ = await self._attempt(
                f"delete {key.rsplit('/', 1)[-1]}", store.delete(key, if_match=etag)
            )
        except Conflict:
            return False
        return bool(ok)

    async def _write_grants(
        self, store: Store, grants: GrantsRead, document: GrantsDocument
    ) -> bool:
        """PUT ``document`` as the next ``grants.json``, on condition that the one read
        (``grants``) is still there; return whether it was written."""
        key = store.key("grants.json")
        body = document.to_json()

        def write() -> Awaitable[str]:
            return store.put(
                key,
                body,
                if_match=grants.etag if grants.exists else None,
                if_none_match=not grants.exists,
            )

        try:
            # (tried again once after a 500 or a throttle: a retry whose first try went
            # through after all fails its condition, and the allocator reads grants.json anew)
            ok, _ = await self._attempt("write grants", write(), again=write, throttled_too=True)
        except Conflict:
            logger.info(
                "fleet %s: grants.json changed under this allocator; it reads it again",
                self.worker_id,
            )
            return False
        if not ok:
            return False
        self.last_document = document
        logger.debug(
            "fleet %s: generation %d for %d worker(s)",
            self.worker_id,
            document.generation,
            document.granted,
        )
        self._allocated(document)
        if self._on_allocation is not None:
            try:
                self._on_allocation(document)
            except Exception:  # (the grants are written: the allocator carries on)
                (logger.debug if self._callback_failed else logger.exception)(
                    "fleet %s: the on_allocation callback failed", self.worker_id
                )
                self._callback_failed = True  # (logged with its traceback once)
        return True

    def _allocated(self, document: GrantsDocument) -> None:  # noqa: B027 (a hook: a no-op here)
        """The member wrote ``document``."""

    # -- running --------------------------------------------------------------------------

    @abc.abstractmethod
    async def _cycle(self, store: Store) -> None:
        """One sync cycle: each kind of member (FleetWorker, FleetAllocator) defines its own."""

    async def _cleanup(self, store: Store) -> None:
        await self._release(store)

    @property
    def cycle_period(self) -> float:
        """The time from one cycle's start to the next (before jitter): the fleet's interval
        (:attr:`period`), or this member's own longer one while the store refuses its calls
        as overloaded (:data:`STRAIN_CODES`). The allocator keeps to the fleet's: its lease
        is renewed once an interval."""
        if self._keeps_to_interval():
            return self.period
        return max(self.period, self.fleet.sync_interval * self._backoff)

    def _keeps_to_interval(self) -> bool:
        """Whether this member keeps to the fleet's interval whatever the store answers: the
        allocator (its lease is renewed once an interval), and a member that does not back
        off (:attr:`_backs_off`). A worker applying a grant does too (see FleetWorker)."""
        return self.holds_lease or not self._backs_off

    def _back_off(self, strained: bool) -> None:
        """Stretch this member's own interval after a cycle in which the store refused a
        call as overloaded; shrink it back after one without."""
        if strained and not self._keeps_to_interval():
            backoff = min(MAX_STRETCH, self._backoff * STRETCH_STEP)
        else:
            backoff = max(1.0, self._backoff / STRETCH_STEP)
        if backoff != self._backoff:
            logger.debug(
                "fleet %s: the store %s: this member syncs every %.1f s at least",
                self.worker_id,
                "refuses calls" if backoff > self._backoff else "answers",
                self.fleet.sync_interval * backoff,
            )
        self._backoff = backoff

    def _interval(self) -> float:
        if self.holds_lease:
            # the allocator keeps time: the workers time their reports by its documents, to
            # fall between its reads (a random period would come early for some of them)
            return self.cycle_period
        return self.cycle_period * self._random.uniform(0.9, 1.1)

    def _next_start(self, start: float) -> float:
        """When the cycle after the one that began at ``start`` begins."""
        if self.holds_lease and self._retry_soon:
            return start + RETRY_SOON * self._interval()
        return start + self._interval()

    def requests_per_minute(self) -> dict[str, float]:
        """The store requests made per minute since the first cycle, by kind."""
        if self._started_at is None:
            return {}
        minutes = max(self._now() - self._started_at, 1e-9) / 60
        return {kind: count / minutes for kind, count in sorted(self.requests.items())}

    async def _cycles(self, store: Store) -> None:
        assert self._stop_event is not None
        if self._started_at is None:
            self._started_at = self._now()
        failures: set[str] = set()  # kinds of exception logged since the last clean cycle
        while not self._stopping:
            start = self._now()
            errors, strained = self.s3_errors, self._strained_calls
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
            self._back_off(self._strained_calls != strained)
            now = self._now()
            wake = self._next_start(start)
            if self._lease_wake is not None and self._lease_wake < wake:
                wake = self._lease_wake
                self._lease_wake = None
            with anyio.move_on_after(max(0.0, wake - now)):
                await self._stop_event.wait()

    @asynccontextmanager
    async def _store(self) -> AsyncIterator[Store]:
        async with self._client_factory() as client:
            if self.fleet.table is None:
                yield S3Store(
                    client, self.fleet, self._clock, self._call_timeout, self.requests, self._now
                )
            else:
                yield DynamoDBStore(
                    client, self.fleet, self._clock, self._call_timeout, self.requests, self._now
                )

    async def _serve(self) -> None:
        """Cycle until stopped, reopening the S3 client if it fails; then clean up."""
        assert self._stop_event is not None
        while not self._stopping:
            try:
                async with self._store() as store:
                    going_on = False  # a failure, after which it goes on with a new client
                    try:
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(self._calibrate, store)
                            await self._cycles(store)
                            tg.cancel_scope.cancel()
                    except Exception:
                        going_on = not self._stopping
                        raise
                    finally:
                        self._leaving = not going_on
                        with anyio.move_on_after(self._cleanup_time(), shield=True):
                            await self._cleanup(store)
                return
            except anyio.get_cancelled_exc_class():
                raise
            except Exception as exc:
                self._record_error("open an S3 client", exc)
                with anyio.move_on_after(self._interval()):
                    await self._stop_event.wait()

    def _probe(self, store: Store) -> tuple[str, bytes] | None:
        """An object this member may rewrite at any moment, and its body (see
        :meth:`_calibrate`)."""
        return None

    async def _calibrate(self, store: Store) -> None:
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
            now = self._now()
            width = self._clock.width(now)
            probe = self._probe(store)
            target = max(CLOCK_TARGET, 2 * store.round_trip)
            at = self._clock.probe_time(now)
            if width is None or width <= target or probe is None or at is None:
                await anyio.sleep(self.cycle_period)
                continue
            await anyio.sleep(max(0.0, at - now))
            await self._rewrite(store, probe)
            await anyio.sleep(self.cycle_period)

    async def _rewrite(self, store: Store, probe: tuple[str, bytes]) -> None:
        """Rewrite the object :meth:`_probe` named, for :meth:`_calibrate`."""
        await self._attempt("calibrate the clock", store.put(*probe))

    def _cleanup_time(self) -> float:
        """How long the last S3 calls may take: :data:`CLOSE_TIMEOUT`, or less if
        :meth:`aclose` was given less."""
        if self._close_deadline is None:
            return CLOSE_TIMEOUT
        return max(0.0, min(CLOSE_TIMEOUT, self._close_deadline - self._now()))

    async def aclose(self, *, deadline: float | None = None) -> None:
        """Stop: delete this member's objects (its report; the lease if it holds it), best
        effort, and return by ``deadline`` (``anyio.current_time()``; default: within
        :data:`CLOSE_TIMEOUT` and half a second more), whatever S3 is doing. What is not
        deleted by then expires on its own: a report goes stale, a lease runs out."""
        now = self._now()
        latest = now + CLOSE_TIMEOUT + 0.5
        if deadline is not None:  # on the event loop's clock: as a bound on the member's own
            deadline = now + (deadline - anyio.current_time())
        self._close_deadline = latest if deadline is None else min(latest, deadline)
        bound = max(0.0, self._close_deadline - now)
        self._stopping = True
        if self._stop_event is not None:
            self._stop_event.set()
        if self._cycle_scope is not None:
            # A write the cycle has already sent (a lease renewal) could land after the
            # clean-up's deletes and put the lease back: the cycle gets half the bound to
            # finish, and is cancelled only then.
            self._cycle_scope.deadline = min(
                self._cycle_scope.deadline, anyio.current_time() + bound / 2
            )
        if self._done is None:
            return
        with anyio.move_on_after(bound, shield=True):
            await self._done.wait()
        if not self._done.is_set() and self._run_scope is not None:
            self._run_scope.cancel()
