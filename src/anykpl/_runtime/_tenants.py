"""Tenant admission: the thin async shell over the tenant quotas (``_core/_tenant_quotas.py``,
where the buckets, the FIFO reservations and docs/tenants.md's reasoning live). It admits a
record in the ``tenant_overflow`` mode, within ``admission_timeout``, sleeping while its tenant
is over its quota.
"""

from __future__ import annotations

import math

import anyio

from .. import errors
from .._core._tenant_quotas import Reservation, TenantQuotas, TenantStatistics
from ..config import ProducerConfig

__all__ = ("TenantAdmission",)


class TenantAdmission:
    """The async shell over :class:`TenantQuotas`: admits records in the
    ``tenant_overflow`` mode and within the ``admission_timeout`` of ``config``, sleeping
    while a tenant is over its quota.

    Time is the caller's ``now`` (the producer's clock) and ``anyio.current_time()`` for the
    waits (the same time base), so trio's ``MockClock`` drives it in tests.
    """

    __slots__ = ("_closed", "_reject", "_timeout", "quotas")

    def __init__(self, config: ProducerConfig) -> None:
        self.quotas = TenantQuotas(config.tenant_quotas, config.default_tenant_quota)
        self._reject = config.tenant_overflow == "reject"
        self._timeout = config.admission_timeout
        self._closed = False

    async def admit(self, tenant: str, size: int, now: float) -> Reservation:
        """Admit one record of ``size`` bytes for ``tenant`` at ``now``.

        Returns at once, without a checkpoint, when the tenant has the tokens and nobody of
        that tenant is waiting; otherwise waits its turn (FIFO per tenant). If the wait is
        cancelled, the reservation is withdrawn and the cancellation propagates.

        :raises ~anykpl.errors.TenantQuotaExceeded: reject mode, and the tokens are not there.
        :raises ~anykpl.errors.BackpressureTimeout: the wait would exceed (or did exceed)
            ``admission_timeout``; nothing was taken.
        :raises ~anykpl.errors.ProducerClosedError: the producer closed during the wait.
        """
        quotas = self.quotas
        if self._reject:
            reservation = quotas.try_take(tenant, size, now)
            if reservation is None:
                quota = quotas.quota_of(tenant)
                assert quota is not None  # a tenant with no quota is never refused
                raise errors.TenantQuotaExceeded(
                    tenant, quota, quotas.time_until(tenant, size, now)
                )
            return reservation
        timeout = self._timeout
        if timeout is None:
            reservation = quotas.reserve(tenant, size, now)
        else:
            reservation = quotas.reserve(tenant, size, now, timeout)
        if reservation is None:
            raise self._timed_out(tenant, quotas.time_until(tenant, size, now))
        if reservation.queued:
            await self._wait(tenant, reservation)
        return reservation

    async def _wait(self, tenant: str, reservation: Reservation) -> None:
        quotas = self.quotas
        give_up_at = math.inf if self._timeout is None else reservation.reserved_at + self._timeout
        try:
            while True:
                if self._closed:
                    raise errors.ProducerClosedError(
                        "the producer closed while the record waited for its tenant's quota; "
                        "nothing was enqueued"
                    )
                now = anyio.current_time()
                wait = quotas.poll(reservation, now)
                if wait == 0.0:
                    break
                if now >= give_up_at:
                    raise self._timed_out(tenant, None)
                # at the head: until its tokens are there; behind it: until woken
                wake_at = give_up_at if wait is None else min(give_up_at, now + wait)
                reservation.waker = waker = anyio.Event()
                with anyio.CancelScope(deadline=wake_at):
                    await waker.wait()
        except BaseException:
            reservation.waker = None
            if quotas.cancel(reservation, anyio.current_time()):
                self._wake_head(reservation)
            raise
        reservation.waker = None
        self._wake_head(reservation)  # the next one is at the head now

    def _wake_head(self, reservation: Reservation) -> None:
        head = self.quotas.head_of(reservation)
        if head is not None and head.waker is not None:
            head.waker.set()

    def _timed_out(self, tenant: str, wait: float | None) -> errors.BackpressureTimeout:
        """``wait``: when the tokens would come (refused up front), or ``None`` (waited)."""
        quota = self.quotas.quota_of(tenant)
        assert quota is not None
        when = "did not come within" if wait is None else f"come in {wait:.3f} s, after"
        return errors.BackpressureTimeout(
            f"tenant {tenant!r} is over its quota ({quota.describe()}): its "
            f"tokens for this record {when} admission_timeout={self._timeout} s; "
            "nothing was enqueued"
        )

    def release(self, reservation: Reservation, now: float) -> None:
        """The record was not enqueued after all (the backpressure wait failed)."""
        if self.quotas.cancel(reservation, now):
            self._wake_head(reservation)

    def close(self) -> None:
        """The producer is closing: every waiter withdraws and raises
        ``ProducerClosedError`` now instead of at its time."""
        self._closed = True
        for reservation in list(self.quotas.queued()):
            if reservation.waker is not None:
                reservation.waker.set()

    def statistics(self, now: float | None) -> dict[str, TenantStatistics]:
        return self.quotas.statistics(now)
