"""Tenant quotas: per-tenant token buckets with FIFO reservations, pure and clock-injected. The
thin async admission that waits on them is the runtime's (``_runtime/_tenants.py``).

Beyond the KPL (docs/tenants.md): the KPL has no tenants. A record put with ``tenant="t1"`` first
draws from that tenant's bucket in :meth:`Producer.submit <anykpl.Producer.submit>`, before
the backpressure wait; then, inside the pipeline, the Limiter serves a shard's tenants round
robin (``_limiter.py``), so a tenant's backlog cannot delay another tenant's records on the
same shard. This module is the first half; docs/tenants.md has the picture.

The buckets. Two dimensions, records and bytes (data + partition key, as everywhere), each
holding ``burst`` seconds of its rate and starting full, like the Limiter's
:class:`~anykpl._core._token_bucket.TokenBucket`. A dimension whose rate is ``None`` is not limited;
a tenant with no quota at all (not in ``tenant_quotas``, no ``default_tenant_quota``) has no
bucket: it costs a dictionary lookup and its counters.

Reservations, and where we differ from Go's ``rate.Limiter``. A put over its quota waits, and
waiters are served FIFO in reservation order: a newcomer never takes the tokens a waiter is
waiting for. Go's ``ReserveN`` (and GCRA) get FIFO by taking every reservation's tokens at
once, into debt, each waiter sleeping until its debt is repaid. That breaks down when waiters
give up: a cancelled waiter's tokens cannot simply be refunded, since the waiters behind it
keep their wake-up times and the refund would let a newcomer go at the same moment as them
(over the burst), so Go's ``CancelAt`` refunds only what no later waiter was promised —
nothing, when waiters time out oldest first, which is how timeouts fire (golang/go#56924,
#69419 are about those refunds). A tenant whose callers time out would then stay in debt for
records that were never sent. So here a reservation that cannot go at once joins its tenant's
FIFO queue and takes its tokens only when it reaches the head and they are there (the
head-of-line waiter sleeps until then; the others wait for their turn). Cancelling a queued
reservation removes it, exactly — the ones behind it move up — and the schedule is the one
Go's debt would give when nobody cancels: a reservation's ``ready`` time, computed up front
from the tokens and the queue ahead of it, is when it goes (earlier if someone ahead gives
up). One timer per tenant, not one per waiter (the aiolimiter lesson in the rate-limiting
research). What is kept from the debt model:

- A record bigger than the bucket is not an error (Go refuses ``n > burst``): it waits until
  the bucket is full, then goes, leaving debt, as the Limiter's buckets do — it never
  deadlocks and the rate holds on average.
- The wait is known up front: with ``admission_timeout``, a reservation that would wait longer
  is not made at all (as Go's ``WaitN`` fails at once when the delay would pass the context's
  deadline). Up front, each dimension is reckoned on its own; when one dimension's bucket
  would fill up while the head waits for the other's, the estimate can come out short, so the
  shell also gives up at the timeout itself.
- A record that took its tokens and then was not enqueued (the backpressure wait failed) gives
  them back if nothing was taken after it: undoing the tenant's latest take is exact (the
  bucket is as if it never happened); any other refund could exceed the burst, so there is
  none.

Memory. Buckets are made on a tenant's first put. Once more than ``PRUNE_ABOVE`` tenants are
held, adding one sweeps out every tenant that is not named in ``tenant_quotas``, has nobody
waiting, and whose bucket is full again (forgetting it changes nothing but its counters). The
next sweep waits until the table has doubled, so sweeps cost O(1) per new tenant.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..config import TenantQuota

__all__ = ("PRUNE_ABOVE", "Reservation", "TenantQuotas", "TenantStatistics")

#: The quota core starts pruning idle tenants once it holds more than this many.
PRUNE_ABOVE = 1024

# Float tolerance in tokens: a take short by less than this goes now (a waiter that slept for
# exactly the computed time must not find itself a hair short and sleep again).
_EPSILON = 1e-9

# reservation states
_QUEUED, _TAKEN, _CANCELLED = 0, 1, 2


@dataclass(frozen=True, slots=True)
class TenantStatistics:
    """A snapshot of one tenant's quota, in :attr:`ProducerStatistics.tenants
    <anykpl.ProducerStatistics.tenants>`.

    Attributes:
        quota: the :class:`~anykpl.TenantQuota` that applies (from ``tenant_quotas`` or
            ``default_tenant_quota``), or ``None``: not limited.
        admitted_records: records that got their tokens (less those then withdrawn because
            the backpressure wait failed).
        admitted_bytes: their data + partition key bytes.
        rejected_records: records refused by the quota: ``TenantQuotaExceeded`` (reject mode),
            or ``BackpressureTimeout`` because the wait would have exceeded
            ``admission_timeout``.
        waits: admitted records that had to wait for tokens.
        waited_seconds: the total time those records waited for tokens.
        waiting: records waiting for tokens now.
        token_levels: (records, bytes) tokens available now, negative after a record larger
            than the bucket (debt); ``None`` for a dimension that is not limited.
    """

    quota: TenantQuota | None
    admitted_records: int
    admitted_bytes: int
    rejected_records: int
    waits: int
    waited_seconds: float
    waiting: int
    token_levels: tuple[float | None, float | None]


class Reservation:
    """One record's claim on its tenant's tokens.

    ``ready`` is when it may go: for a reservation that took its tokens, when it did; for one
    still queued, when it will reach the head and find its tokens, unless someone ahead gives
    up (then earlier). ``wait`` is ``ready`` minus the time it was made. ``waker`` belongs to
    the async shell (the head-of-line waiter's wake-up); the core never touches it.
    """

    __slots__ = ("_state", "_tenant", "nbytes", "ready", "reserved_at", "waker")

    def __init__(
        self, tenant: _Tenant, nbytes: int, reserved_at: float, ready: float, state: int
    ) -> None:
        self._tenant = tenant
        self.nbytes = nbytes
        self.reserved_at = reserved_at
        self.ready = ready
        self._state = state
        self.waker: Any = None

    @property
    def wait(self) -> float:
        """Seconds from the reservation to ``ready``."""
        return self.ready - self.reserved_at

    def __repr__(self) -> str:
        state = ("queued", "taken", "cancelled")[self._state]
        return f"<Reservation {self.nbytes} bytes ready={self.ready:.6f} {state}>"

    @property
    def queued(self) -> bool:
        """Whether it still waits for its tokens."""
        return self._state == _QUEUED


class _Tenant:
    """One tenant's bucket (two dimensions, either possibly unlimited), queue and counters.

    A rate of 0.0 means "not limited"; ``limited`` is whether either dimension is.
    ``queued_records``/``queued_bytes`` are what the queued reservations will take.
    """

    __slots__ = (
        "admitted_bytes",
        "admitted_records",
        "bytes",
        "bytes_capacity",
        "bytes_rate",
        "last_take",
        "limited",
        "named",
        "queue",
        "queued_bytes",
        "queued_records",
        "quota",
        "records",
        "records_capacity",
        "records_rate",
        "rejected",
        "updated",
        "waited",
        "waiting",
        "waits",
    )

    def __init__(self, quota: TenantQuota | None, named: bool, now: float) -> None:
        self.quota = quota
        self.named = named  # listed in tenant_quotas: never pruned
        records_rate = quota.records_per_second if quota is not None else None
        bytes_rate = quota.bytes_per_second if quota is not None else None
        burst = quota.burst if quota is not None else 1.0
        self.records_rate = float(records_rate or 0.0)
        self.bytes_rate = float(bytes_rate or 0.0)
        self.limited = bool(self.records_rate or self.bytes_rate)
        self.records_capacity = max(1.0, self.records_rate * burst)
        self.bytes_capacity = max(1.0, self.bytes_rate * burst)
        self.records = self.records_capacity
        self.bytes = self.bytes_capacity
        self.updated = now
        # FIFO of reservations waiting for tokens; cancelled ones stay until they reach the
        # front (removing from the middle of a deque is O(n))
        self.queue: deque[Reservation] = deque()
        self.waiting = 0  # queued and not cancelled
        self.queued_records = 0.0
        self.queued_bytes = 0.0
        self.last_take: Reservation | None = None  # the latest reservation that took tokens
        self.admitted_records = 0
        self.admitted_bytes = 0
        self.rejected = 0
        self.waits = 0
        self.waited = 0.0

    def refill(self, now: float) -> None:
        # (conditional expressions rather than min(): this runs once per record)
        elapsed = now - self.updated
        if elapsed > 0:
            self.updated = now
            rate = self.records_rate
            if rate:
                records = self.records + elapsed * rate
                capacity = self.records_capacity
                self.records = records if records < capacity else capacity
            rate = self.bytes_rate
            if rate:
                nbytes = self.bytes + elapsed * rate
                capacity = self.bytes_capacity
                self.bytes = nbytes if nbytes < capacity else capacity

    def take_now(self, nbytes: int, now: float) -> bool:
        """Refill to ``now``; if nobody is queued and one record of ``nbytes`` has its
        tokens, take them (the caller then records the take) and return True. The fast
        path of every put with a tenant, so :meth:`refill` and :meth:`has_tokens` are
        inlined."""
        elapsed = now - self.updated
        records_rate = self.records_rate
        bytes_rate = self.bytes_rate
        records = self.records
        nbytes_held = self.bytes
        if elapsed > 0:
            self.updated = now
            if records_rate:
                records += elapsed * records_rate
                if records > self.records_capacity:
                    records = self.records_capacity
                self.records = records
            if bytes_rate:
                nbytes_held += elapsed * bytes_rate
                if nbytes_held > self.bytes_capacity:
                    nbytes_held = self.bytes_capacity
                self.bytes = nbytes_held
        if self.waiting:
            return False
        if records_rate and records < 1.0 - _EPSILON:
            return False
        if bytes_rate:
            capacity = self.bytes_capacity
            if nbytes_held < (nbytes if nbytes < capacity else capacity) - _EPSILON:
                return False
            self.bytes = nbytes_held - nbytes
        if records_rate:
            self.records = records - 1.0
        self.admitted_records += 1
        self.admitted_bytes += nbytes
        return True

    def has_tokens(self, nbytes: int) -> bool:
        """Whether one record of ``nbytes`` may take its tokens now (after :meth:`refill`,
        with nobody queued). A record larger than a bucket needs only a full bucket; the
        records capacity is at least one record."""
        if self.records_rate and self.records < 1.0 - _EPSILON:
            return False
        if self.bytes_rate:
            capacity = self.bytes_capacity
            if self.bytes < (nbytes if nbytes < capacity else capacity) - _EPSILON:
                return False
        return True

    def wait_for(self, nbytes: int, records_ahead: float, bytes_ahead: float) -> float:
        """Seconds until one record of ``nbytes`` may take its tokens, after the reservations
        ahead of it took theirs (call :meth:`refill` first). A record larger than a bucket
        needs only a full bucket."""
        wait = 0.0
        if self.records_rate:
            need = records_ahead + 1.0 - self.records
            if need > _EPSILON:
                wait = need / self.records_rate
        if self.bytes_rate:
            need = bytes_ahead + min(nbytes, self.bytes_capacity) - self.bytes
            if need > _EPSILON:
                wait = max(wait, need / self.bytes_rate)
        return wait

    def take(self, reservation: Reservation) -> None:
        if self.records_rate:
            self.records -= 1.0
        if self.bytes_rate:
            self.bytes -= reservation.nbytes
        reservation._state = _TAKEN
        self.last_take = reservation
        self.admitted_records += 1
        self.admitted_bytes += reservation.nbytes

    def head(self) -> Reservation | None:
        """The first queued reservation (dropping cancelled ones from the front)."""
        queue = self.queue
        while queue:
            first = queue[0]
            if first._state == _QUEUED:
                return first
            queue.popleft()
        return None

    def full(self, now: float) -> bool:
        self.refill(now)
        return (
            self.records >= self.records_capacity - _EPSILON
            and self.bytes >= self.bytes_capacity - _EPSILON
        )

    def levels(self, now: float | None) -> tuple[float | None, float | None]:
        if now is not None:
            self.refill(now)
        return (
            self.records if self.records_rate else None,
            self.bytes if self.bytes_rate else None,
        )


class TenantQuotas:
    """Every tenant's bucket, queue and counters; pure and clock-injected (``now`` is passed
    in). ``quotas`` and ``default`` are ``ProducerConfig.tenant_quotas`` and
    ``default_tenant_quota``.

    A reservation that cannot go at once is queued; whoever holds it calls :meth:`poll` when
    it may be at the head (at first, after the head before it went or gave up, and at the
    time ``poll`` named), and :meth:`cancel` if it gives up.
    """

    __slots__ = ("_default", "_prune_above", "_prune_at", "_quotas", "_tenants")

    def __init__(
        self,
        quotas: Mapping[str, TenantQuota],
        default: TenantQuota | None,
        *,
        prune_above: int = PRUNE_ABOVE,
    ) -> None:
        self._quotas = dict(quotas)
        self._default = default
        self._tenants: dict[str, _Tenant] = {}
        self._prune_above = prune_above
        self._prune_at = prune_above

    def __len__(self) -> int:
        return len(self._tenants)

    def __contains__(self, tenant: object) -> bool:
        return tenant in self._tenants

    def quota_of(self, tenant: str) -> TenantQuota | None:
        """The quota that applies to ``tenant``; ``None``: not limited."""
        quota = self._quotas.get(tenant, self._default)
        if quota is None or (quota.records_per_second is None and quota.bytes_per_second is None):
            return None
        return quota

    def _tenant(self, tenant: str, now: float) -> _Tenant:
        state = self._tenants.get(tenant)
        if state is None:
            if len(self._tenants) >= self._prune_at:
                self._prune(now)
            state = self._tenants[tenant] = _Tenant(
                self.quota_of(tenant), tenant in self._quotas, now
            )
        return state

    def _prune(self, now: float) -> None:
        tenants = self._tenants
        idle = [
            name
            for name, state in tenants.items()
            if not state.named and not state.waiting and (not state.limited or state.full(now))
        ]
        for name in idle:
            del tenants[name]
        self._prune_at = max(self._prune_above, 2 * len(tenants))

    def reserve(
        self, tenant: str, nbytes: int, now: float, max_wait: float = math.inf
    ) -> Reservation | None:
        """Reserve one record of ``nbytes`` for ``tenant``.

        When nobody is queued and the tokens are there, it takes them: the reservation is
        done (``wait == 0.0``). Otherwise it joins the tenant's queue, due at ``ready``. When
        it would wait more than ``max_wait`` seconds, nothing happens and ``None`` is
        returned (counted as rejected).
        """
        state = self._tenants.get(tenant) or self._tenant(tenant, now)
        if not state.limited:
            state.admitted_records += 1
            state.admitted_bytes += nbytes
            return Reservation(state, nbytes, now, now, _TAKEN)
        if state.take_now(nbytes, now):
            reservation = state.last_take = Reservation(state, nbytes, now, now, _TAKEN)
            return reservation
        wait = state.wait_for(nbytes, state.queued_records, state.queued_bytes)
        if wait > max_wait:
            state.rejected += 1
            return None
        reservation = Reservation(state, nbytes, now, now + wait, _QUEUED)
        state.queue.append(reservation)
        state.waiting += 1
        state.queued_records += 1.0
        state.queued_bytes += nbytes
        return reservation

    def try_take(self, tenant: str, nbytes: int, now: float) -> Reservation | None:
        """Take one record of ``nbytes`` only if it may go now (reject mode); otherwise
        ``None``, nothing taken, counted as rejected. It never queues: with others queued
        (in wait mode), it is refused."""
        state = self._tenant(tenant, now)
        if state.waiting:
            state.rejected += 1
            return None
        return self.reserve(tenant, nbytes, now, max_wait=0.0)

    def time_until(self, tenant: str, nbytes: int, now: float) -> float:
        """Seconds from ``now`` until a record of ``nbytes`` reserved now would go, taking
        nothing (0.0 for a tenant with no quota)."""
        state = self._tenants.get(tenant)
        if state is None or not state.limited:
            return 0.0
        state.refill(now)
        return state.wait_for(nbytes, state.queued_records, state.queued_bytes)

    def poll(self, reservation: Reservation, now: float) -> float | None:
        """For a queued reservation: ``None`` while others are ahead of it; at the head, the
        seconds until its tokens are there, or 0.0 when they are — then it took them and is
        done. 0.0 also for a reservation that is already done."""
        if reservation._state != _QUEUED:
            return 0.0
        state = reservation._tenant
        if state.head() is not reservation:
            return None
        state.refill(now)
        if not state.has_tokens(reservation.nbytes):
            wait = state.wait_for(reservation.nbytes, 0.0, 0.0)
            reservation.ready = now + wait
            return wait
        state.queue.popleft()
        state.waiting -= 1
        state.queued_records -= 1.0
        state.queued_bytes -= reservation.nbytes
        state.take(reservation)
        reservation.ready = now
        state.waits += 1
        state.waited += reservation.wait
        return 0.0

    def head_of(self, reservation: Reservation) -> Reservation | None:
        """The first queued reservation of ``reservation``'s tenant (perhaps itself)."""
        return reservation._tenant.head()

    def cancel(self, reservation: Reservation, now: float) -> bool:
        """The record will not go after all: its caller gave up or timed out, the producer
        closed, or the backpressure wait after the quota failed. A queued reservation leaves
        the queue; one that took its tokens gives them back if it was its tenant's latest
        take (module docstring), and leaves the admitted counters. Twice does nothing.

        Returns whether the tenant's head should look again (it may go sooner): the
        reservation was the head, or tokens came back.
        """
        state = reservation._tenant
        if reservation._state == _CANCELLED:
            return False
        if reservation._state == _QUEUED:
            was_head = state.head() is reservation
            reservation._state = _CANCELLED
            state.waiting -= 1
            state.queued_records -= 1.0
            state.queued_bytes -= reservation.nbytes
            if was_head:
                state.queue.popleft()
            return was_head
        reservation._state = _CANCELLED
        state.admitted_records -= 1
        state.admitted_bytes -= reservation.nbytes
        if state.last_take is not reservation or not state.limited:
            return False
        # Undo the latest take: exact whatever happened since (if the bucket filled up
        # meanwhile, it is full either way).
        state.last_take = None
        state.refill(now)
        if state.records_rate:
            state.records = min(state.records_capacity, state.records + 1.0)
        if state.bytes_rate:
            state.bytes = min(state.bytes_capacity, state.bytes + reservation.nbytes)
        return bool(state.waiting)

    def queued(self) -> Iterator[Reservation]:
        """Every reservation waiting for tokens, tenant by tenant."""
        for state in self._tenants.values():
            for reservation in state.queue:
                if reservation._state == _QUEUED:
                    yield reservation

    def statistics(self, now: float | None) -> dict[str, TenantStatistics]:
        """Every tenant held, with token levels at ``now`` (``None``: as last updated)."""
        return {
            name: TenantStatistics(
                quota=state.quota,
                admitted_records=state.admitted_records,
                admitted_bytes=state.admitted_bytes,
                rejected_records=state.rejected,
                waits=state.waits,
                waited_seconds=state.waited,
                waiting=state.waiting,
                token_levels=state.levels(now),
            )
            for name, state in self._tenants.items()
        }
