"""A producer's member of a fleet: :class:`FleetWorker` reports its demand, applies its grant
to the producer's fleet bucket, and may allocate.

One cycle, every ``sync_interval`` × U(0.9, 1.1), start to start, half a period after the
allocator's once it reads live grants:

1. GET ``grants.json``; apply this worker's grant if it is newer and unexpired.
2. PUT ``workers/<id>.json``: its demand, the rate it applies, and the generation applied —
   after step 1, so the report acknowledges the grant just read. ``If-Match`` on the ETag of
   its own last write tells it when another process shares its ``worker_id``.
3. With ``elect``: hold, take or renew the lease, and allocate while it holds it
   (:class:`~anykpl._fleet._member.Member`).

Grants expire into the safe rate on a timer of its own, whatever the S3 calls are doing. See
docs/fleet.md ("The control loop").
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from contextlib import suppress
from dataclasses import replace

import anyio
import anyio.abc

from ..config import FleetConfig, ProducerConfig
from ._demand import DemandEstimator, FleetDemand
from ._documents import GrantsDocument, WorkerReport
from ._member import ClientFactory, GrantsRead, Member
from ._rates import Mode, Rates, max_of
from ._statistics import FleetStatistics
from ._store import Conflict, Store
from ._worker_state import WorkerState

__all__ = ("OVERWRITTEN_REPORTS", "FleetWorker")

logger = logging.getLogger("anykpl.fleet")

#: Grants issued within this many sync intervals show that their allocator is alive.
RECENT_GRANTS = 1.5
#: A worker whose report was overwritten by someone else this many times in a row says that
#: another process shares its worker_id.
OVERWRITTEN_REPORTS = 3
#: A new worker's first reports (this many) fall early in the allocator's period, with a grant
#: or without (see FleetWorker._locked_start).
EARLY_READS = 4
#: What a leaving worker applies before it marks itself as left: nothing.
LEFT = Rates(0.0, 0.0)


class FleetWorker(Member):
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
        local_clock: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(
            fleet,
            config,
            member_id=fleet.worker_id or f"worker-{os.urandom(6).hex()}",
            client_factory=client_factory,
            on_allocation=on_allocation,
            local_clock=local_clock,
        )
        self._demand = demand
        self._apply = apply
        self._estimator = DemandEstimator(fleet.sync_interval)
        self._held_before = False  # whether callers were held back at the last report
        self._state = WorkerState(
            worker_id=self.worker_id,
            cap=Rates(fleet.records_per_second, fleet.bytes_per_second),
            lease=self._lease,
            safe_fraction=fleet.safe_fraction,
            bootstrap_fraction=fleet.bootstrap_fraction,
            started_at=0.0,
            incarnation=self._incarnation,
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
        # the ETag of the last write known to have landed (a write cut short may have too)
        self._confirmed_etag: str | None = None
        self._overwritten = 0  # times in a row someone else wrote the report in between
        self._warned_overwritten = False
        self._report_lock: anyio.Lock | None = None
        self._listed_at = -math.inf  # local time of the last listing that gave a rank
        self._left = False  # leaving: applies nothing (LEFT) before its report is deleted

    def statistics(self) -> FleetStatistics:
        """A snapshot: role, mode, the rates applied, the grant's expiry, errors."""
        try:
            now = self._now()
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
            sync_interval=self.cycle_period,
            rank=self._state.rank,
            requests=dict(sorted(self.requests.items())),
            requests_per_minute=self.requests_per_minute() if math.isfinite(now) else {},
        )

    def _fallback_description(self) -> str:
        mode, rates = self._state.rates(self._now())
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
        self._state.bootstrap_until = self._now() + self._lease
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
        now = self._now()
        mode, rates = self._state.rates(now)
        if self._left:
            rates = LEFT
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
            now = self._now()
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
        self._state.receive(document, self._clock, self._now())
        self._follow(document)  # the interval the allocator asks of the fleet
        self._changed()

    # -- the cycle ------------------------------------------------------------------------

    async def _cycle(self, store: Store) -> None:
        grants = await self._read_grants(store)
        self._phase_source = grants.document if grants is not None else None
        if grants is not None and not grants.exists:
            self._state.no_grants_yet(self._now())
            self._changed()
        if grants is not None and grants.document is not None:
            if self._clock.known:
                self._receive(grants.document)
                self._pending = None
            else:
                self._pending = grants.document
        self._report_body = self._report().to_json()
        written = await self._write_report(store, "write the report")
        if self._pending is not None and self._clock.known:
            self._receive(self._pending)
            self._pending = None
        if written and self._wants_rank():
            await self._learn_rank(store)
        if self.fleet.elect:
            status: str | None
            if self._allocator_alive(grants):
                status = "other"  # its lease is not worth a call
            else:
                status = await self._lease_step(store)
            await self._allocate_held(store, grants, status)
        elif self.holds_lease:  # pragma: no cover - elect cannot change
            await self._release(store)

    def _wants_rank(self) -> bool:
        """A listing is due: no rank yet, or outside a grant and not listed for a lease."""
        now = self._now()
        if self._state.rank is None:
            return True
        return self._state.needs_rank(now) and now - self._listed_at >= self._lease * self.stretch

    async def _learn_rank(self, store: Store) -> None:
        """Count the reports in the store, this worker's own included: its rank in the
        bootstrap budget (see :func:`~anykpl._fleet._worker_state.budget_share`)."""
        sent_at = self._now()
        ok, listing = await self._attempt_retrying(
            "list reports", lambda: store.list(store.key("workers/"))
        )
        if not ok:
            return
        self._listed_at = sent_at
        self._state.learn_rank(sum(1 for key, _, _ in listing if key.endswith(".json")), sent_at)
        self._changed()

    def _allocator_alive(self, grants: GrantsRead | None) -> bool:
        """Whether ``grants`` were written by another allocator within the last interval and
        a half: it allocates every interval, so its lease is held, and a thousand members need
        not each read it every cycle. An allocator that stopped writing (it released its lease
        on close, or died) is looked at again from the next cycle on."""
        if self.holds_lease or grants is None or grants.document is None:
            return False
        document = grants.document
        now = self._server_now()
        if document.allocator == self.worker_id or now is None:
            return False
        interval = document.sync_interval or self.fleet.sync_interval
        return now[1] - document.issued_at <= RECENT_GRANTS * interval

    def _report(self) -> WorkerReport:
        now = self._now()
        demand = self._demand()
        offered, wants = self._estimator.update(demand, now)
        mode, rates = self._state.rates(now)
        if self._mode is not None and self._applied is not None:
            mode, rates = self._mode, self._applied  # what it applies, not what it should
        held = self._estimator.held
        if held:
            # callers wait for room: it would send whatever it gets (the grant is max-min fair:
            # those that want less get what they want first)
            wants = Rates(
                *(
                    mine if cap is None or mine is None else max(mine, cap)
                    for mine, cap in zip(wants, self._state.cap, strict=True)
                )
            )
        elif self._held_before:
            # no longer held back, since the rate it applies now: what it admitted since the
            # last report was held back for part of the time, so it still wants that rate at
            # least (the next report, of a whole interval at it, says what it wants)
            wants = Rates(
                *(max_of((mine, now_rate)) for mine, now_rate in zip(wants, rates, strict=True))
            )
        self._held_before = held
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

    def _keeps_to_interval(self) -> bool:
        # a worker applying a grant reports every interval: a report older than an interval
        # and a quarter gets it no new grant, and one older than a lease is not counted by an
        # allocator that takes over without a readable grants.json
        granted = self._state.mode(self._now()) == "granted"
        return granted or super()._keeps_to_interval()

    def _allocated(self, document: GrantsDocument) -> None:
        self._receive(document)  # the allocator's own grant applies at once

    def _probe(self, store: Store) -> tuple[str, bytes] | None:
        if self._report_body is None:
            return None
        return store.key(f"workers/{self.worker_id}.json"), self._report_body

    async def _rewrite(self, store: Store, probe: tuple[str, bytes]) -> None:
        await self._write_report(store, "calibrate the clock")

    async def _write_report(self, store: Store, operation: str) -> bool:
        """PUT the report, with ``If-Match`` on the ETag of this process's last write.

        Nobody else writes ``workers/<id>.json``, unless another process runs with the same
        ``worker_id``: then the two overwrite each other's report, the allocator sees one
        worker, and each applies its grant — the fleet exceeds its cap. The condition fails
        when someone wrote in between; the report is written anyway, and after
        :data:`OVERWRITTEN_REPORTS` such cycles in a row the worker says so, once. (The
        allocator notices it too when the reports it reads alternate between the two.) Returns
        whether the report was written."""
        if self._report_lock is None:
            self._report_lock = anyio.Lock()
        async with self._report_lock:  # (the cycle and the clock's calibration both write it)
            body = self._report_body
            assert body is not None
            key = store.key(f"workers/{self.worker_id}.json")
            etag, self._report_etag = self._report_etag, None
            sent_at = self._now()
            if etag is not None:
                try:
                    ok, written = await self._attempt_retrying(
                        operation, lambda: store.put(key, body, if_match=etag)
                    )
                except Conflict as exc:
                    # someone else wrote it, or it was deleted (a leftover, by a slow
                    # allocator): others may have listed without it
                    self._state.forget_rank()
                    # (after a retry, most likely the first try's own write, whose answer was
                    # lost: it is written again below, unconditionally, and not counted)
                    self._overwritten += 0 if exc.retried else 1
                    if self._overwritten >= OVERWRITTEN_REPORTS and not self._warned_overwritten:
                        self._warned_overwritten = True
                        self._warn_overwritten()
                else:
                    if ok:
                        self._overwritten = 0
                        self._written(written, sent_at)
                    return bool(ok)
            sent_at = self._now()
            ok, written = await self._attempt_retrying(operation, lambda: store.put(key, body))
            if ok:
                self._written(written, sent_at)
            return bool(ok)

    def _written(self, etag: str, sent_at: float) -> None:
        """The report sent at local time ``sent_at`` is in the store, as ``etag``."""
        self._report_etag = self._confirmed_etag = etag
        self._state.report_written(sent_at)
        self._changed()

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
        """The phase-locked start (:meth:`_locked_start`), but sooner when the grant applied
        would expire first: the grants are read once more before (a successor's may be there).
        (Not sooner when a call failed: a thousand members retrying would bury a slow store.)"""
        at = self._locked_start(start)
        expires = self._state.grant_expires_at
        if expires is not None and self._state.mode(start) == "granted":
            # at a point of its own in the last half interval: every worker of a fleet whose
            # allocator died holds grants that expire at the same instant, and a thousand
            # reads at once would bury a slow store
            before = expires - self.period * self._random.uniform(0.1, 0.5)
            if start < before < at:
                at = before
        return at

    def _locked_start(self, start: float) -> float:
        """Between a fifth and four fifths of a period after the allocator's (a new worker,
        its first :data:`EARLY_READS` cycles: early in it), when one is alive.

        Capacity a worker gives up can be granted to others only once its report says it
        applied the reduction. A worker whose cycles fall just after the allocator's would
        report that a whole period late; one whose cycles fall well inside the period after
        the allocator's always reports in time for the next allocation. So a worker that read
        live grants locks its phase to them: its next cycle is the one point ``issued_at +
        (k + phase) × sync_interval`` between a half and one and a half periods after this
        start, where ``phase`` is drawn for each cycle from U(0.2, 0.8): a thousand workers
        spread their calls over most of the period instead of calling the store all at once.
        A new worker (its first :data:`EARLY_READS` cycles) draws it from U(0.15, 0.35): it
        reads its first grants sooner, and each that raises it towards its share.
        Its second cycle only comes half a period after its first, whatever the phase.
        """
        period = self.period
        if self._sequence <= 1 and not self.holds_lease:
            # A first report says nothing of demand (a rate takes two samples), and a first
            # allocation that sees only first reports grants each worker its floor: the second
            # comes half a period later, before the allocator's next cycle.
            return start + self._interval() / 2
        document = self._phase_source
        offsets = self._clock.offsets(start)
        if self.holds_lease or document is None or offsets is None or self.cycle_period > period:
            return super()._next_start(start)  # (backing off: no phase to keep)
        issued = document.issued_at - (offsets[0] + offsets[1]) / 2  # local time
        if document.expires_at - offsets[0] <= start:  # no allocator alive
            return super()._next_start(start)
        # a new worker reads early in the period: its grant comes in the allocator's next
        # document, and each of its reads that falls later leaves it on its budget rate, or
        # short of its share, for longer (a first grant can be part of a share: the rest is
        # freed when the members already there acknowledge their cut, a generation later, and
        # read late in the period it came up to 0.8 of an interval after that). Not for long
        # (a worker that never gets a grant, as one of two processes that share a worker_id,
        # would always report before the other: the allocator would not see their reports
        # alternate), and not while the store is slow (the fleet's interval stretched): a
        # thousand such reads in a third of the period would be refused.
        waiting = self._sequence <= EARLY_READS and self.stretch == 1.0
        phase, spread = (0.25, 0.1) if waiting else (0.5, 0.3)
        # (the phase is of the span from the document's writing to the allocator's next reads,
        # where it says when they begin: reads that take a second for a thousand reports
        # leave less than a period, and a report timed past them is read a generation late)
        span = period
        if document.next_allocation_at is not None:
            span = min(period, max(period / 2, document.next_allocation_at - document.issued_at))
        aligned = issued + phase * span
        aligned += math.ceil((start + period / 2 - aligned) / period) * period
        return aligned + span * self._random.uniform(-spread, spread)

    async def _cleanup(self, store: Store) -> None:
        # the lease first: a successor can take over at once (what follows may run out of time)
        await self._release(store)
        if self._leaving:
            # Leaving: nothing goes out under a grant from here on, and only then does a mark
            # say so (``left/<id>.json``, naming this process); the allocator frees what it
            # had at its next cycle (docs/fleet.md, "Allocation"). Then the report goes, only
            # if this process surely wrote it last (If-Match: another process under the same
            # id keeps its own).
            self._left = True
            self._refresh()
            # (if a write was cut short and landed after all, the condition fails and the
            # report stays: the allocator deletes it with the mark)
            etag = self._confirmed_etag
            if self._applied == LEFT:
                await self._mark_left(store)
                if etag is not None:
                    with suppress(Conflict):
                        key = store.key(f"workers/{self.worker_id}.json")
                        await self._attempt_retrying(
                            "delete the report", lambda: store.delete(key, if_match=etag)
                        )
            self._state.forget_rank()
        # (a member that goes on with a new client keeps its report, and rewrites it next)
        self._report_etag = self._confirmed_etag = None

    async def _mark_left(self, store: Store) -> None:
        """Write ``left/<id>.json``: this process's last report, saying it left."""
        if self._report_body is None:
            return  # (it never reported: nothing of it was granted)
        try:
            mark = replace(self._report(), left=True, wants=LEFT, offered=LEFT)
        except Exception as exc:  # (the producer's demand, read for the report)
            self._record_error("mark this worker as left", exc)
            return
        key = store.key(f"left/{self.worker_id}.json")
        body = mark.to_json()
        await self._attempt_retrying("mark this worker as left", lambda: store.put(key, body))


def _describe(rates: Rates) -> str:
    parts = []
    if rates.records_per_second is not None:
        parts.append(f"{rates.records_per_second:.1f} records/s")
    if rates.bytes_per_second is not None:
        parts.append(f"{rates.bytes_per_second:.0f} bytes/s")
    return ", ".join(parts) or "unlimited"
