"""The fleet allocator's maths, the worker's state machine and the documents, on a virtual
clock: no event loop, no S3.

S3's clock is simulated as ``SERVER_EPOCH + local time`` with whole-second stamps, as S3's
``Date`` and ``LastModified`` are.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anykpl._fleet import (
    HEADROOM,
    LEFTOVER_LEASES,
    MAX_DOCUMENT_BYTES,
    Allocator,
    DemandEstimator,
    DocumentError,
    FleetDemand,
    GrantsDocument,
    LeaseDocument,
    ObservedReport,
    Outstanding,
    Rates,
    ServerClock,
    WorkerEntry,
    WorkerReport,
    WorkerState,
    allocate_dimension,
    budget_share,
    in_force,
    lease_expiry,
    parse_grants,
    parse_lease,
    parse_report,
    water_fill,
)

SERVER_EPOCH = 1_800_000_000.0
CAP = 1000.0
LEASE = 15.0
#: what the test allocator grants at most: the cap less its bootstrap budget (10 %)
GRANTABLE = CAP * 0.9
#: how long grants outlive the lease: a sync interval (a third of the lease)
GRACE = LEASE / 3
TOLERANCE = 1e-6


def server_stamp(local: float) -> float:
    """S3's whole-second stamp of local time ``local``."""
    return math.floor(SERVER_EPOCH + local)


def known_clock(local: float = 0.0) -> ServerClock:
    clock = ServerClock()
    clock.observe(server_stamp(local), local, local)
    return clock


def exact(local: float) -> tuple[float, float]:
    """Exact bounds on S3's time at local time ``local``."""
    return SERVER_EPOCH + local, SERVER_EPOCH + local


def report(
    worker_id: str,
    wants: float = 10_000.0,
    *,
    mode: str = "bootstrap",
    generation: int | None = None,
    has: float | None = None,
    sequence: int = 1,
) -> WorkerReport:
    return WorkerReport(
        worker_id=worker_id,
        incarnation="abc",
        sequence=sequence,
        mode=mode,  # type: ignore[arg-type]
        generation=generation,
        has=Rates(has, None),
        wants=Rates(wants, wants * 100),
        offered=Rates(wants, wants * 100),
        backlog=(0, 0),
    )


def observed(rep: WorkerReport, written_at: float) -> ObservedReport:
    return ObservedReport(rep, server_stamp(written_at))


def allocator(cap: float = CAP, lease: float = LEASE, bootstrap: float = 0.1) -> Allocator:
    return Allocator(
        allocator_id="alloc", cap=Rates(cap, None), lease=lease, bootstrap_fraction=bootstrap
    )


def outstanding(doc: GrantsDocument, worker_id: str) -> list[tuple[int, float | None, float]]:
    return [
        (o.generation, o.rates.records_per_second, o.expires_at)
        for o in doc.workers[worker_id].outstanding
    ]


def grants_of(doc: GrantsDocument) -> dict[str, float]:
    return {w: e.grant.records_per_second or 0.0 for w, e in doc.workers.items() if e.grant}


# -- water-filling ------------------------------------------------------------------------


def test_water_fill_gives_everyone_their_demand_when_it_fits() -> None:
    assert water_fill(100, {"a": 10, "b": 20}) == {"a": 10, "b": 20}


def test_water_fill_is_max_min_fair() -> None:
    shares = water_fill(100, {"small": 10, "big": 500, "bigger": 1000})
    assert shares == pytest.approx({"small": 10, "big": 45, "bigger": 45})


def test_water_fill_with_nothing_to_give() -> None:
    assert water_fill(0, {"a": 5}) == {"a": 0}
    assert water_fill(10, {}) == {}


@given(
    capacity=st.floats(0, 1e7),
    demands=st.dictionaries(st.text("abcdef", min_size=1, max_size=3), st.floats(0, 1e7)),
)
def test_water_fill_never_gives_more_than_capacity_or_demand(
    capacity: float, demands: dict[str, float]
) -> None:
    shares = water_fill(capacity, demands)
    assert sum(shares.values()) <= capacity * (1 + TOLERANCE) + TOLERANCE
    for key, demand in demands.items():
        assert shares[key] <= demand + TOLERANCE
    # max-min: whoever got less than it asked got at least as much as anybody else
    short = [shares[k] for k in demands if shares[k] < demands[k] - 1e-6 * max(1, demands[k])]
    if short:
        assert min(short) >= max(shares.values()) * (1 - 1e-9) - 1e-6


# -- one dimension under the invariant ----------------------------------------------------


def test_reductions_apply_at_once_increases_wait_for_free_capacity() -> None:
    # a holds 600 and is cut to 200; b holds 400 and should get 800: the 400 a gives up is not
    # free while a's grant of 600 is in force
    new = allocate_dimension(1000, {"a": 200, "b": 800}, in_force={"a": 600, "b": 400}, in_use={})
    assert new == pytest.approx({"a": 200, "b": 400})
    # once a reports it applies the reduction, its 600 is no longer in force
    new = allocate_dimension(1000, {"a": 200, "b": 800}, in_force={"a": 200, "b": 400}, in_use={})
    assert new == pytest.approx({"a": 200, "b": 800})


def test_grants_in_force_of_workers_not_granted_still_count() -> None:
    new = allocate_dimension(1000, {"a": 1000}, in_force={"gone": 700}, in_use={})
    assert new["a"] == pytest.approx(300)


def test_a_worker_on_its_budget_rate_gets_no_sliver_of_a_grant() -> None:
    # b runs its budget rate, 100, and would get 10 of the 20 free: it keeps its budget rate
    new = allocate_dimension(1000, {"a": 1000, "b": 50}, in_force={"a": 980}, in_use={"b": 100})
    assert new["b"] == 0
    assert new["a"] == pytest.approx(990)
    # the budget rates are not granted capacity: they do not hold it
    new = allocate_dimension(1000, {"a": 1000, "b": 50}, in_force={}, in_use={"b": 100})
    assert new == pytest.approx({"a": 950, "b": 50})


def test_over_committed_grants_are_never_added_to() -> None:
    # the cap was lowered under grants in force: nothing grows, and the new grants alone fit
    new = allocate_dimension(500, {"a": 400, "b": 400}, in_force={"a": 400, "b": 400}, in_use={})
    assert sum(new.values()) <= 500 * (1 + TOLERANCE)


# -- the allocator ------------------------------------------------------------------------


def test_a_fresh_fleet_with_equal_demand_gets_equal_shares() -> None:
    alloc = allocator()
    reports = [observed(report(f"w{i}"), 0.0) for i in range(4)]
    doc = alloc.allocate(None, reports, exact(0.5))
    # the cap less the bootstrap budget, which the workers outside a grant share
    assert grants_of(doc) == pytest.approx({f"w{i}": GRANTABLE / 4 for i in range(4)})
    assert doc.generation == 1
    assert doc.expires_at == pytest.approx(doc.issued_at + LEASE + GRACE)
    assert doc.total_reserved().records_per_second == pytest.approx(GRANTABLE)
    assert doc.cap == Rates(CAP, None)
    assert all(e.grant and e.grant.bytes_per_second is None for e in doc.workers.values())


def test_small_demand_gets_its_demand_with_headroom_and_the_rest_goes_to_the_busy() -> None:
    alloc = allocator()
    reports = [observed(report("idle", wants=100), 0.0), observed(report("busy"), 0.0)]
    doc = alloc.allocate(None, reports, exact(0.5))
    assert grants_of(doc) == pytest.approx({"idle": 100 * HEADROOM, "busy": GRANTABLE - 125})


def test_a_worker_with_no_demand_still_gets_its_bootstrap_share() -> None:
    alloc = allocator()
    reports = [observed(report("idle", wants=0), 0.0), observed(report("busy"), 0.0)]
    doc = alloc.allocate(None, reports, exact(0.5))
    assert grants_of(doc)["idle"] == pytest.approx(GRANTABLE * 0.1 / 2)


def test_capacity_moves_only_after_the_giver_acknowledges() -> None:
    alloc = allocator()
    first = alloc.allocate(None, [observed(report("a"), 0), observed(report("b"), 0)], exact(0.5))
    assert grants_of(first) == pytest.approx({"a": 450, "b": 450})
    # a's demand falls; both applied generation 1
    second = alloc.allocate(
        first,
        [
            observed(report("a", wants=80, mode="granted", generation=1, has=450), 5),
            observed(report("b", mode="granted", generation=1, has=450), 5),
        ],
        exact(5.5),
    )
    assert grants_of(second) == pytest.approx({"a": 100, "b": 450})  # a cut at once
    assert outstanding(second, "a") == [(1, pytest.approx(450), first.expires_at)]
    assert second.total_reserved().records_per_second == pytest.approx(GRANTABLE)
    # b's increase waits until a reports it applied generation 2...
    third = alloc.allocate(
        second,
        [
            observed(report("a", wants=80, mode="granted", generation=1, has=450), 10),
            observed(report("b", mode="granted", generation=2, has=450), 10),
        ],
        exact(10.5),
    )
    assert grants_of(third) == pytest.approx({"a": 100, "b": 450})
    fourth = alloc.allocate(
        third,
        [
            observed(report("a", wants=80, mode="granted", generation=3, has=100), 15),
            observed(report("b", mode="granted", generation=3, has=450), 15),
        ],
        exact(15.5),
    )
    assert grants_of(fourth) == pytest.approx({"a": 100, "b": 800})
    assert outstanding(fourth, "a") == [(3, pytest.approx(100), third.expires_at)]


def test_earlier_grants_stop_counting_when_they_expire() -> None:
    alloc = allocator()
    first = alloc.allocate(None, [observed(report("a"), 0)], exact(0.5))
    assert grants_of(first) == pytest.approx({"a": GRANTABLE})
    # a vanished (its report is surely older than a lease, its grant expired) and b came
    later = 0.5 + LEASE + GRACE + 0.5
    doc = alloc.allocate(first, [observed(report("b"), later - 1)], exact(later))
    assert "a" not in doc.workers
    assert grants_of(doc) == pytest.approx({"b": GRANTABLE})


def test_every_document_says_how_many_workers_reported() -> None:
    alloc = allocator()
    doc = alloc.allocate(None, [observed(report(f"w{i}"), 0) for i in range(3)], exact(0.5))
    assert doc.fleet_size == 3
    assert parse_grants(doc.to_json()).fleet_size == 3
    assert doc.fleet_size_for("w0") == 3
    assert doc.fleet_size_for("newcomer") == 4  # not among them: one more


def test_a_starting_fleet_is_told_its_size_before_any_grant() -> None:
    # the first allocator waits a cycle before its first grants, so that every member of a
    # starting fleet has reported; meanwhile it writes the fleet's size, without grants
    alloc = allocator()
    reports = [observed(report(f"w{i}"), 0) for i in range(20)]
    gathering = alloc.gather(None, reports, exact(0.5))
    assert gathering.granted == 0
    assert gathering.fleet_size == 20
    assert gathering.total_reserved().records_per_second == 0
    assert gathering.expires_at == pytest.approx(gathering.issued_at + LEASE + GRACE)
    assert parse_grants(gathering.to_json()) == gathering
    state = worker_state("w3")
    assert not state.receive(gathering, known_clock(0.5), 0.5)
    assert state.fleet_size == 20
    assert state.mode(1.0) == "bootstrap"
    # the first grants build on it: generation 2, sharing the cap less the bootstrap budget
    later = [observed(report(f"w{i}", has=CAP * 0.1 / 20), 1) for i in range(20)]
    doc = alloc.allocate(gathering, later, exact(1.5))
    assert doc.generation == 2
    assert grants_of(doc) == pytest.approx({f"w{i}": GRANTABLE / 20 for i in range(20)})


def test_reports_alternating_between_two_incarnations_are_a_shared_worker_id() -> None:
    alloc = allocator()

    def seen(*incarnations: str, worker_id: str = "w") -> list[str]:
        found: list[str] = []
        for incarnation in incarnations:
            rep = replace(report(worker_id), incarnation=incarnation)
            found += alloc.duplicates([observed(rep, 0)])
        return found

    # restarts bring new incarnations, never an old one back
    assert seen("a", "a", "b", "b", "c") == []
    # two processes overwriting each other's report: said once
    assert seen("d", "c", "d", "c", "d") == ["w"]
    assert seen("a", "b", "a", worker_id="v") == ["v"]


def test_stale_workers_are_dropped_by_s3_time_but_their_grants_stay_reserved() -> None:
    alloc = allocator()
    # a reported at 0 s and was granted at 3 s, until 23 s (a lease and its grace)
    first = alloc.allocate(None, [observed(report("a"), 0), observed(report("b"), 0)], exact(3))
    # at 17.5 s by S3's clock, a's report is surely older than the lease of 15 s (allowing a
    # second for the whole-second stamp); b's is fresh
    reports = [
        observed(report("a", mode="granted", generation=1, has=450), 0),
        observed(report("b", mode="granted", generation=1, has=450), 16),
    ]
    doc = alloc.allocate(first, reports, exact(17.5))
    assert doc.workers["a"].grant is None  # dropped...
    assert outstanding(doc, "a") == [(1, pytest.approx(450), SERVER_EPOCH + 3 + LEASE + GRACE)]
    assert grants_of(doc) == pytest.approx({"b": 450})
    assert alloc.fresh(reports, exact(17.5)) == reports[1:]
    # S3's clock only: the same reports a second earlier by S3's clock are both fresh
    assert alloc.fresh(reports, exact(16.0)) == reports


def test_a_worker_that_missed_its_reports_gets_no_new_grant() -> None:
    # (lease 15 s: a sync interval of 5 s) a's last report is 7 s old at 12 s: more than
    # 1.25 intervals, it may be dead; its grant in force still counts, and nobody gets it yet
    alloc = allocator()
    first = alloc.allocate(None, [observed(report("a"), 4), observed(report("b"), 4)], exact(5))
    reports = [
        observed(report("a", mode="granted", generation=1, has=450), 4),
        observed(report("b", mode="granted", generation=1, has=450), 11),
    ]
    doc = alloc.allocate(first, reports, exact(12))
    assert doc.workers["a"].grant is None
    assert outstanding(doc, "a") == [(1, pytest.approx(450), first.expires_at)]
    assert grants_of(doc) == pytest.approx({"b": 450})
    assert doc.fleet_size == 2  # still in the fleet: its report is fresh
    # once its grant expired, b gets it all
    later = 5 + LEASE + GRACE + 0.5
    reports = [
        observed(report("a", mode="granted", generation=1, has=450), 4),
        observed(report("b", mode="granted", generation=doc.generation, has=450), later - 1),
    ]
    assert grants_of(alloc.allocate(doc, reports, exact(later))) == pytest.approx({"b": 900})


def test_a_newcomer_gets_its_share_while_some_report_goes_unread() -> None:
    """A store that fails some reads leaves a worker or two unread in every cycle: each keeps
    its grant. The others share only what is left: sharing the whole capacity among them
    booked the unread worker's grant twice, and the invariant then kept the workers already
    granted at the larger share and a newcomer at nothing, cycle after cycle."""
    alloc = allocator()
    doc = alloc.allocate(None, [observed(report(w), 0) for w in "abc"], exact(1))
    assert grants_of(doc) == pytest.approx(dict.fromkeys("abc", GRANTABLE / 3))

    def granted(*workers: str, generation: int, has: float, at: float) -> list[ObservedReport]:
        return [
            observed(report(w, mode="granted", generation=generation, has=has), at) for w in workers
        ]

    # d joins; c's report cannot be read: it keeps its 300, a, b and d share the other 600
    reports = [*granted("a", "b", generation=1, has=300, at=5), observed(report("d"), 5)]
    doc = alloc.allocate(doc, reports, exact(6), unread={"c"})
    assert grants_of(doc)["a"] == pytest.approx(200)
    assert grants_of(doc)["c"] == pytest.approx(300)
    # a and b applied their 200; c is unread again: d gets the 200 they freed
    reports = [*granted("a", "b", generation=2, has=200, at=10), observed(report("d"), 10)]
    doc = alloc.allocate(doc, reports, exact(11), unread={"c"})
    assert grants_of(doc) == pytest.approx({"a": 200, "b": 200, "c": 300, "d": 200})


def test_a_report_that_could_not_be_read_keeps_its_grant() -> None:
    # a slow store: b's report was listed but not read in time. b keeps its grant (within the
    # invariant) and counts in the fleet; a worker unread and never granted gets nothing
    alloc = allocator()
    first = alloc.allocate(None, [observed(report("a"), 0), observed(report("b"), 0)], exact(1))
    reports = [observed(report("a", mode="granted", generation=1, has=450), 5)]
    doc = alloc.allocate(first, reports, exact(6), unread={"b", "nobody"})
    assert grants_of(doc) == pytest.approx({"a": 450, "b": 450})
    assert doc.fleet_size == 2
    assert "nobody" not in doc.workers
    # a takeover that could not read every report assumes grants may be in force
    assert allocator().take_over(None, reports[:0], exact(6), unread={"b"})


def test_without_a_document_what_workers_report_applying_counts_in_force() -> None:
    # grants.json was lost: a's report (7 s old, not current) says it applies 450 under a
    # grant; nobody may take that capacity, although a gets no new grant
    alloc = allocator()
    reports = [
        observed(report("a", mode="granted", generation=3, has=450), 5),
        observed(report("b"), 11),
    ]
    alloc.take_over(None, reports, exact(12))
    doc = alloc.allocate(None, reports, exact(12))
    assert grants_of(doc)["b"] <= GRANTABLE - 450 + TOLERANCE


def test_staleness_allows_for_whole_second_timestamps() -> None:
    alloc = allocator(lease=1.5)
    # written at 10.9 s, stamped 10; at 12.2 s by S3's clock it is 1.3 s old, not 2.2
    written = ObservedReport(report("a"), SERVER_EPOCH + 10)
    assert not alloc.is_stale(written.last_modified, (SERVER_EPOCH + 12.2, SERVER_EPOCH + 12.2))
    assert alloc.is_stale(written.last_modified, (SERVER_EPOCH + 12.6, SERVER_EPOCH + 12.6))


def test_generations_continue_after_acknowledgements_even_without_the_document() -> None:
    alloc = allocator()
    doc = alloc.allocate(
        None, [observed(report("a", mode="granted", generation=41, has=10), 0)], exact(0)
    )
    assert doc.generation == 42


def test_a_takeover_with_the_last_document_allocates_as_its_predecessor_would() -> None:
    """The last grants document bounds every grant that may be in force, so a new allocator
    that read it needs no learning mode (Doorman learns because its new master cannot know
    the leases out there): it allocates as the allocator before it would have, reductions at
    once and increases from free capacity only. A rolling redeploy hands the lease over with
    every process; a learning mode after each hand-over kept the new processes waiting for
    their grants (a cap change took 19 s instead of 7.6 s to settle)."""
    old = allocator()
    previous = old.allocate(
        None,
        [observed(report("a", wants=100), 0), observed(report("b"), 0)],
        exact(0),
    )
    assert grants_of(previous) == pytest.approx({"a": 125, "b": 775})
    new = allocator()
    reports = [
        observed(report("a", wants=900, mode="granted", generation=1, has=125), 4),
        observed(report("b", wants=10, mode="granted", generation=1, has=775), 4),
        observed(report("c", wants=900), 4),
    ]
    assert new.take_over(previous, reports, exact(4.5))  # (grants may be in force)
    assert not new.learning(exact(4.5))
    doc = new.allocate(previous, reports, exact(4.5))
    assert not doc.learning
    assert doc.generation == 2
    assert grants_of(doc) == grants_of(old.allocate(previous, reports, exact(4.5)))
    # b's reduction applies at once; a and c wait for the capacity it frees (b's 775 is in
    # force until b acknowledges): the newcomer gets no grant yet
    assert grants_of(doc) == pytest.approx({"a": 125, "b": GRANTABLE * 0.1 / 3})
    # b acknowledged: a and c share what is left
    reports = [
        observed(report("a", wants=900, mode="granted", generation=2, has=125), 9),
        observed(report("b", wants=10, mode="granted", generation=2, has=30), 9),
        observed(report("c", wants=900, has=10), 9),
    ]
    doc = new.allocate(doc, reports, exact(9.5))
    share = (GRANTABLE - GRANTABLE * 0.1 / 3) / 2
    assert grants_of(doc) == pytest.approx({"a": share, "b": GRANTABLE * 0.1 / 3, "c": share})


@pytest.mark.parametrize("takeover", [True, False])
def test_grants_of_a_lost_document_are_learnt_through_a_takeover_and_without_one(
    takeover: bool,
) -> None:
    """a, b and c apply 300 each; c reads generation 2, then is cut off from the store (its
    last report says generation 1), and grants.json is deleted. The grants of the lost
    document stay in force until they expire (t = 25): whoever allocates next learns for a
    lease — the allocator that lost it, or a new one — and so does an allocator that takes
    over from a document written in learning mode (which does not bound what is in force).
    Neither hands c's share to a and b before c's grant expired."""
    states = {
        w: WorkerState(
            worker_id=w,
            cap=Rates(CAP, None),
            lease=LEASE,
            safe_fraction=0.0,
            bootstrap_fraction=0.1,
            started_at=0.0,
            incarnation=f"{w}00000-x",
        )
        for w in "abc"
    }
    clocks = {w: known_clock() for w in "abc"}
    written: dict[str, ObservedReport] = {}

    def write_report(w: str, at: float) -> None:
        state = states[w]
        mode, rates = state.rates(at)
        rep = replace(
            report(w, mode=mode, generation=state.generation, has=rates.records_per_second),
            incarnation=state.incarnation or "",
        )
        written[w] = observed(rep, at)
        state.report_written(at)
        state.learn_rank(3, at)

    def applied(at: float) -> float:
        return sum(state.rates(at)[1].records_per_second or 0.0 for state in states.values())

    first = allocator()
    for w in "abc":
        write_report(w, 0)
    doc = first.allocate(None, list(written.values()), exact(0))
    for w in "abc":
        states[w].receive(doc, clocks[w], 0.5)
        write_report(w, 1)
    doc = first.allocate(doc, list(written.values()), exact(5))
    for w in "abc":
        states[w].receive(doc, clocks[w], 6)
    assert applied(6) == pytest.approx(GRANTABLE)
    for w in "ab":  # c is cut off from here on
        write_report(w, 6)
        write_report(w, 8)
    # t = 7: grants.json is deleted
    current = first
    if takeover:  # B takes over (there is no document), then hands over on close to C
        b = allocator()
        b.take_over(None, list(written.values()), exact(9))
        doc = b.allocate(None, list(written.values()), exact(9))
        assert doc.learning
        for w in "ab":
            states[w].receive(doc, clocks[w], 9.5)
            write_report(w, 10)
        current = allocator()
        current.take_over(doc, list(written.values()), exact(11))
        assert current.learning(exact(11))
    else:
        doc = first.allocate(None, list(written.values()), exact(9))
        assert doc.learning
        for w in "ab":
            states[w].receive(doc, clocks[w], 9.5)
            write_report(w, 10)
    worst = 0.0
    at = 11.0
    while at < 40:
        doc = current.allocate(doc, list(written.values()), exact(at))
        for w in "ab":
            states[w].receive(doc, clocks[w], at + 0.5)
            write_report(w, at + 1)
        worst = max(worst, applied(at), applied(at + 1))
        at += 5
    assert worst <= CAP + 1e-6
    # once c's grant expired, its share went to a and b
    assert states["a"].rates(at)[1].records_per_second == pytest.approx(GRANTABLE / 2, rel=0.05)


def test_a_mark_frees_only_the_grants_made_for_the_process_that_left() -> None:
    # One worker id, two processes one after the other: P leaves (it applies nothing, then
    # writes its mark), S starts and is granted. P's last report, cut short, lands after S's,
    # in a cycle whose listing of the marks failed: the entry names P again, while S applies
    # its own grant. When the mark is read, it frees what was made for P, not S's grant.
    alloc = allocator()

    def process(incarnation: str, started_at: float) -> WorkerState:
        return WorkerState(
            worker_id="w",
            cap=Rates(CAP, None),
            lease=LEASE,
            safe_fraction=0.0,
            bootstrap_fraction=0.1,
            started_at=started_at,
            incarnation=incarnation,
        )

    states = {"w": process("pppppp-1", 0.0), "x": worker_state("x")}
    clocks = {w: ServerClock() for w in "wx"}
    for clock in clocks.values():
        clock.observe(server_stamp(0), 0, 0)
    written: dict[str, ObservedReport] = {}

    def write(worker_id: str, at: float) -> ObservedReport:
        state = states[worker_id]
        mode, rates = state.rates(at)
        rep = replace(
            report(worker_id, 5000.0, mode=mode, generation=state.generation),
            incarnation=state.incarnation or "xxxxxx-1",
            has=rates,
        )
        written[worker_id] = observed(rep, at)
        ranked(state, 2, at)
        return written[worker_id]

    def applied(at: float) -> float:
        return sum(s.rates(at)[1].records_per_second or 0.0 for s in states.values())

    write("w", 0)
    write("x", 0)
    doc = alloc.allocate(None, list(written.values()), exact(0))
    for w in "wx":
        states[w].receive(doc, clocks[w], 0.5)
    late = write("w", 1)  # P's last report (its PUT is cut short)
    write("x", 1)
    states["w"] = replace_state = process("ssssss-2", 2.0)
    clocks["w"] = ServerClock()
    clocks["w"].observe(server_stamp(2), 2, 2)
    write("w", 2)  # S's first report; P's mark is written, but not listed below
    doc = alloc.allocate(doc, list(written.values()), exact(3))
    for w in "wx":
        states[w].receive(doc, clocks[w], 3.5)
    assert replace_state.mode(3.5) == "granted"
    write("x", 4)
    written["w"] = observed(late.report, 5)  # P's report lands late
    doc = alloc.allocate(doc, list(written.values()), exact(6))
    assert doc.workers["w"].incarnation == "pppppp"  # (the entry names P again)
    states["x"].receive(doc, clocks["x"], 6.5)
    write("x", 7)
    doc = alloc.allocate(doc, list(written.values()), exact(8), left={"w": "pppppp-1"})
    # S's grant is still in force, and reserved
    assert doc.total_reserved().records_per_second <= GRANTABLE * (1 + TOLERANCE)
    assert [o.incarnation for o in doc.workers["w"].outstanding] == ["ssssss"]
    states["x"].receive(doc, clocks["x"], 8.5)
    assert applied(8.5) <= CAP * 0.9 * (1 + TOLERANCE)
    assert parse_grants(doc.to_json()) == doc


def test_grants_outlive_the_lease_renewed_before_the_interval_shrank() -> None:
    # the allocator renewed its lease at the stretched interval, then shrank the interval:
    # its grants must still outlive that lease by an interval, or a successor taking over
    # when it expires finds every grant expired
    alloc = allocator()
    alloc.use_interval(LEASE)  # stretched to three times the configured interval
    renewed_lease = alloc.lease
    alloc.use_interval(LEASE / 3, previous=LEASE)
    doc = alloc.allocate(None, [observed(report("a"), 0)], exact(0))
    assert doc.expires_at >= SERVER_EPOCH + renewed_lease + doc.sync_interval
    alloc.use_interval(LEASE / 3, previous=LEASE / 3)
    assert alloc.lease == LEASE


def test_a_takeover_without_a_readable_document_echoes_what_workers_report() -> None:
    new = allocator()
    reports = [
        observed(report("a", mode="granted", generation=7, has=300), 0),
        observed(report("b", mode="granted", generation=7, has=300), 0),
    ]
    new.take_over(None, reports, exact(0.5))
    assert new.learning(exact(0.5))
    doc = new.allocate(None, reports, exact(0.5))
    assert grants_of(doc) == pytest.approx({"a": 300, "b": 300})
    assert doc.generation == 8


def test_no_learning_when_nothing_can_be_in_force() -> None:
    new = allocator()
    expired = allocator().allocate(None, [observed(report("a"), 0)], exact(0))
    new.take_over(expired, [observed(report("a", mode="safe", generation=1), 30)], exact(30))
    assert not new.learning(exact(30))
    new.take_over(None, [observed(report("a"), 0)], exact(0.5))
    assert new.learning_until is None
    new.learning_until = SERVER_EPOCH + 10
    new.step_down()
    assert not new.learning(exact(1))


def test_in_force_skips_generations_older_than_the_acknowledged_one() -> None:
    doc = GrantsDocument(
        generation=5,
        allocator="x",
        issued_at=SERVER_EPOCH,
        expires_at=SERVER_EPOCH + 15,
        learning=False,
        cap=Rates(CAP, None),
        workers={
            "a": WorkerEntry(
                grant=Rates(10, None),
                acked=3,
                outstanding=(
                    Outstanding(3, Rates(50, None), SERVER_EPOCH + 5),
                    Outstanding(4, Rates(70, None), SERVER_EPOCH + 10),
                ),
            )
        },
    )
    assert [o.generation for o in in_force(doc, "a", 3, SERVER_EPOCH)] == [3, 4, 5]
    assert [o.generation for o in in_force(doc, "a", 4, SERVER_EPOCH)] == [4, 5]
    assert [o.generation for o in in_force(doc, "a", 4, SERVER_EPOCH + 12)] == [5]
    assert in_force(doc, "nobody", None, SERVER_EPOCH) == []
    assert in_force(None, "a", None, SERVER_EPOCH) == []
    assert doc.workers["a"].reserved() == Rates(70, None)


def test_bytes_and_records_are_allocated_independently() -> None:
    alloc = Allocator(
        allocator_id="x", cap=Rates(1000, 1_000_000), lease=LEASE, bootstrap_fraction=0.1
    )
    reports = [
        observed(replace(report("a"), wants=Rates(900, 100)), 0),
        observed(replace(report("b"), wants=Rates(100, 900_000)), 0),
    ]
    doc = alloc.allocate(None, reports, exact(0))
    a, b = doc.grant_for("a"), doc.grant_for("b")
    assert a is not None
    assert b is not None
    assert a.records_per_second == pytest.approx(GRANTABLE - 125)
    # a's floor: 10 % of what may be granted, over the two
    assert b.bytes_per_second == pytest.approx(900_000 - 45_000)


# -- the property: grants in force never sum over the cap ---------------------------------


@st.composite
def fleet_runs(draw: Any) -> dict[str, Any]:
    workers = draw(st.integers(1, 5))
    steps = draw(
        st.lists(
            st.fixed_dictionaries(
                {
                    "advance": st.floats(0.05, 4.0),
                    "allocate": st.booleans(),
                    "takeover": st.integers(0, 9).map(lambda x: x == 0),
                    "cap": st.sampled_from([CAP, CAP, CAP, CAP / 2]),
                    "workers": st.lists(
                        st.tuples(
                            st.booleans(),  # reads the grants
                            st.booleans(),  # writes its report
                            st.floats(0, 3 * CAP),  # its demand
                            st.floats(0, 0.5),  # the round trip of its S3 calls (0: none)
                            # leaves (applies nothing, then a mark says so, and its report
                            # goes, or stays); a process with the same id may come back later
                            st.integers(0, 11).map(lambda x: x == 0),
                            # its report, if stale for ten leases, is deleted as a leftover
                            # (it may still hold an unexpired grant after that long)
                            st.integers(0, 11).map(lambda x: x == 0),
                        ),
                        min_size=workers,
                        max_size=workers,
                    ),
                }
            ),
            min_size=1,
            max_size=40,
        )
    )
    return {"workers": workers, "steps": steps}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(run=fleet_runs())
def test_the_sum_of_grants_in_force_never_exceeds_the_cap(run: dict[str, Any]) -> None:
    """Arbitrary demand, arbitrary reading and reporting, workers leaving and coming back,
    allocator takeovers and a lowered cap: at every instant the rates the workers apply —
    granted, and their budget rates outside a grant — sum to at most the cap, and every
    document's reservations fit its cap less the bootstrap budget."""
    lease = 3.0
    ids = [f"w{i}" for i in range(run["workers"])]
    started = Counter[str]()

    def process(w: str) -> WorkerState:
        started[w] += 1
        return WorkerState(
            worker_id=w,
            cap=Rates(CAP, None),
            lease=lease,
            safe_fraction=0.0,
            bootstrap_fraction=0.1,
            started_at=0.0,
            incarnation=f"{started[w]:06d}-{w}",  # (a grant names its first 6 characters)
        )

    states = {w: process(w) for w in ids}
    clocks = {w: ServerClock() for w in ids}
    allocator_clock = ServerClock()
    alloc = allocator(lease=lease)
    latest: GrantsDocument | None = None
    history: list[GrantsDocument] = []
    written: dict[str, ObservedReport] = {}
    released: dict[str, int] = {}  # worker -> the generation that freed what it had
    marks: dict[str, str] = {}  # worker -> the incarnation that marked itself as left
    now = 0.0

    def applied_sum(at: float) -> float:
        return sum(state.rates(at)[1].records_per_second or 0.0 for state in states.values())

    for step in run["steps"]:
        now += step["advance"]
        # S3's clock, as each member learns it: whole-second stamps, its own round trips
        allocator_clock.observe(server_stamp(now), now - 0.01, now)
        for w, (*_, round_trip, _leaves, _deleted) in zip(ids, step["workers"], strict=True):
            if round_trip:
                stamped = now - round_trip * 0.3  # S3 stamps somewhere during the call
                clocks[w].observe(server_stamp(stamped), now - round_trip, now)
        for w, (reads, reports, wants, _, leaves, deleted) in zip(
            ids, step["workers"], strict=True
        ):
            mine = written.get(w)
            if deleted and mine and server_stamp(now) - mine.last_modified > 10 * lease + 1:
                del written[w]
            if leaves:
                # it applies nothing from now on (a new process of the same id starts from
                # nothing), and then its mark says so; its own report goes, unless its
                # demand says otherwise (it could not delete it)
                incarnation = states[w].incarnation
                assert incarnation is not None
                marks[w] = incarnation
                mine = written.get(w)
                if mine is not None and mine.report.incarnation == incarnation and wants > CAP:
                    del written[w]
                states[w] = process(w)
                clocks[w] = ServerClock()
                continue
            if reads and latest is not None:
                states[w].receive(latest, clocks[w], now)
            if reports:
                mode, rates = states[w].rates(now)
                rep = WorkerReport(
                    worker_id=w,
                    incarnation=states[w].incarnation or "i",
                    sequence=1,
                    mode=mode,
                    generation=states[w].generation,
                    has=rates,
                    wants=Rates(wants, 0.0),
                    offered=Rates(wants, 0.0),
                    backlog=(0, 0),
                )
                written[w] = ObservedReport(rep, server_stamp(now))
                states[w].report_written(now)
                states[w].learn_rank(len(written), now)  # then it lists the reports
        assert applied_sum(now) <= CAP * (1 + TOLERANCE)
        if step["allocate"]:
            bounds = allocator_clock.bounds(now)
            assert bounds is not None
            assert bounds[0] <= SERVER_EPOCH + now <= bounds[1]
            if step["takeover"]:
                alloc = allocator(cap=step["cap"], lease=lease)
                alloc.take_over(latest, list(written.values()), bounds)
            # what a mark frees in this generation: the grants made for the process that
            # wrote it (it applies nothing), unless a successor of the id already applies a
            # grant of its own (the document then no longer says whose grants are whose)
            freed = set()
            for w, incarnation in marks.items():
                entry = latest.workers.get(w) if latest is not None else None
                successor = written.get(w)
                if (
                    entry is not None
                    and entry.names(incarnation)
                    and (
                        successor is None
                        or successor.report.incarnation == incarnation
                        or successor.report.generation is None
                    )
                ):
                    freed.add(w)
            doc = alloc.allocate(latest, list(written.values()), bounds, left=dict(marks))
            for w in freed:
                released[w] = doc.generation
            for w, incarnation in list(marks.items()):
                entry = doc.workers.get(w)
                if entry is None:  # what it had is free; its mark (and report) go
                    released[w] = doc.generation
                    del marks[w]
                    mine = written.get(w)
                    if mine is not None and mine.report.incarnation == incarnation:
                        del written[w]
                elif entry.incarnation and not incarnation.startswith(entry.incarnation):
                    del marks[w]  # another process of the id is granted: the mark is stale
            reserved = doc.total_reserved().records_per_second
            assert reserved is not None
            granted = doc.total_granted().records_per_second
            assert granted is not None
            assert granted <= (doc.cap.records_per_second or CAP) * 0.9 * (1 + TOLERANCE)
            # within the cap less the budget — or, just after the cap was lowered, the higher
            # cap of grants that may still be in force
            caps = [d.cap.records_per_second or CAP for d in history if d.expires_at > bounds[0]]
            limit = max([doc.cap.records_per_second or CAP, *caps]) * 0.9
            assert reserved <= limit * (1 + TOLERANCE)
            assert latest is None or doc.generation > latest.generation
            # the document says what may be in force: check it against the history
            for w, entry in doc.workers.items():
                for earlier in history:
                    old = earlier.grant_for(w)
                    if (
                        old is not None
                        and earlier.generation >= released.get(w, -1)
                        and earlier.expires_at > bounds[0]
                        and earlier.generation >= (entry.acked if entry.acked is not None else -1)
                    ):
                        assert (entry.reserved().records_per_second or 0.0) >= (
                            old.records_per_second or 0.0
                        ) - TOLERANCE
            latest = doc
            history.append(doc)
            # the allocator's own worker (w0) applies its grant at once
            states[ids[0]].receive(doc, clocks[ids[0]], now)
        assert applied_sum(now) <= CAP * (1 + TOLERANCE)


# -- S3's clock ---------------------------------------------------------------------------


def test_server_clock_is_unknown_until_observed() -> None:
    clock = ServerClock()
    assert not clock.known
    assert clock.bounds(5.0) is None
    assert clock.earliest_local(SERVER_EPOCH, 5.0) is None
    assert clock.surely_local(SERVER_EPOCH, 5.0) is None


def test_one_observation_bounds_s3_time_within_a_second_and_the_round_trip() -> None:
    clock = ServerClock()
    # S3 said 100 (its time was in [100, 101)) during local [10.0, 10.2]
    clock.observe(100.0, 10.0, 10.2)
    low, high = clock.bounds(10.2) or (0.0, 0.0)
    assert low == pytest.approx(100.0)
    assert high == pytest.approx(101.2)
    # S3 time 105 may come at local 14.0, and surely has by local 15.2
    assert clock.earliest_local(105.0, 10.2) == pytest.approx(14.0)
    assert clock.surely_local(105.0, 10.2) == pytest.approx(15.2)


def test_observations_at_different_phases_narrow_the_bounds() -> None:
    clock = ServerClock()
    offset = SERVER_EPOCH + 0.37  # S3 time = local + offset
    for i in range(12):
        local = i * 1.13
        clock.observe(math.floor(local + offset), local - 0.005, local + 0.005)
    low, high = clock.offsets(12.0) or (0.0, 0.0)
    assert low <= offset <= high
    assert high - low < 0.15


def test_a_stepped_s3_clock_replaces_older_observations() -> None:
    clock = ServerClock()
    clock.observe(100.0, 0.0, 0.0)
    clock.observe(500.0, 1.0, 1.0)  # inconsistent with the first: S3's clock jumped
    low, high = clock.bounds(1.0) or (0.0, 0.0)
    assert low == pytest.approx(500.0)
    assert high == pytest.approx(501.0)


def test_non_finite_observations_are_ignored() -> None:
    clock = ServerClock()
    clock.observe(math.nan, 0.0, 0.0)
    assert not clock.known


# -- the worker's state machine -----------------------------------------------------------


def worker_state(worker_id: str = "w0", *, lease: float = LEASE) -> WorkerState:
    return WorkerState(
        worker_id=worker_id,
        cap=Rates(CAP, 1_000_000),
        lease=lease,
        safe_fraction=0.5,
        bootstrap_fraction=0.1,
        started_at=0.0,
    )


def grants_document(
    generation: int, grants: dict[str, float], *, issued: float = 0.0, lease: float = LEASE
) -> GrantsDocument:
    return GrantsDocument(
        generation=generation,
        allocator="x",
        issued_at=SERVER_EPOCH + issued,
        expires_at=SERVER_EPOCH + issued + lease,
        learning=False,
        cap=Rates(CAP, None),
        workers={w: WorkerEntry(grant=Rates(g, None), acked=None) for w, g in grants.items()},
    )


def ranked(state: WorkerState, rank: int, at: float = 0.0) -> WorkerState:
    """``state`` after writing its report at ``at`` and listing ``rank`` reports."""
    state.report_written(at)
    state.learn_rank(rank, at)
    return state


def test_a_new_worker_sends_nothing_until_it_knows_its_rank() -> None:
    state = worker_state()
    assert state.rates(0.0) == ("bootstrap", Rates(0.0, 0.0))
    assert state.next_change(0.0) == LEASE
    # a listing sent before its report was written does not count
    state.learn_rank(1, 0.5)
    assert state.rank is None
    state.report_written(1.0)
    state.learn_rank(1, 0.5)
    assert state.rank is None
    # the first to list: half of the budget (10 % of the cap)
    state.learn_rank(1, 1.0)
    assert state.rates(1.0) == ("bootstrap", Rates(CAP * 0.1 / 2, 1_000_000 * 0.1 / 2))
    # the third: a twelfth
    assert ranked(worker_state(), 3).rates(0.0)[1] == Rates(CAP * 0.1 / 12, 1_000_000 * 0.1 / 12)


def test_the_stricter_of_the_workers_and_the_allocators_settings_holds() -> None:
    # an allocator with a smaller bootstrap budget, and a shorter lease (it deletes leftover
    # reports sooner): the worker's budget rate and its rank follow the allocator's
    state = ranked(worker_state(), 1)
    doc = replace(grants_document(1, {"w1": 100}), bootstrap_fraction=0.02, leftover_after=60.0)
    state.receive(doc, known_clock(), 0.0)
    assert state.budget(0.0).records_per_second == pytest.approx(CAP * 0.02 / 2)
    assert state.rank_until == pytest.approx(60.0 - LEASE)
    # and never back to the looser ones
    state.receive(replace(doc, generation=2, bootstrap_fraction=0.5), known_clock(), 0.0)
    assert state.budget(0.0).records_per_second == pytest.approx(CAP * 0.02 / 2)
    assert parse_grants(doc.to_json()) == doc


def test_budget_shares_never_sum_over_the_budget() -> None:
    assert budget_share(1) == pytest.approx(0.5)
    assert sum(budget_share(rank) for rank in range(1, 100_000)) < 1.0


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(
        st.tuples(st.sampled_from(["join", "list", "leave"]), st.integers(0, 30)), max_size=120
    )
)
def test_the_budget_rates_of_live_workers_sum_to_less_than_the_budget(
    events: list[tuple[str, int]],
) -> None:
    """Workers join (write their report, then list), list again and leave (delete their
    report) in any order: the rates of the live ones always sum to less than the budget."""
    states: dict[int, WorkerState] = {}
    reports: set[int] = set()
    now = 0.0
    for kind, who in events:
        now += 0.01
        if kind == "join" and who not in states:
            states[who] = worker_state(f"w{who}")
            states[who].report_written(now)
            reports.add(who)
            states[who].learn_rank(len(reports), now)
        elif kind == "list" and who in states:
            states[who].learn_rank(len(reports), now)
        elif kind == "leave" and who in states:
            del states[who]
            reports.discard(who)
        total = sum(state.budget(now).records_per_second or 0.0 for state in states.values())
        assert total < CAP * 0.1


def test_a_rank_lapses_when_the_report_may_have_been_deleted_as_a_leftover() -> None:
    state = ranked(worker_state(), 1)
    lapse = (LEFTOVER_LEASES - 1) * LEASE
    assert state.budget(lapse - 0.1).records_per_second == pytest.approx(CAP * 0.1 / 2)
    assert state.next_change(LEASE + 1) == lapse
    assert state.budget(lapse).records_per_second == 0.0
    # a report written before then renews it
    state.report_written(lapse - 1)
    assert state.budget(lapse).records_per_second == pytest.approx(CAP * 0.1 / 2)
    # one written after: others may have listed without it meanwhile, it must list again
    state.report_written(2 * lapse)
    assert state.rank is None
    assert state.budget(2 * lapse).records_per_second == 0.0
    state.learn_rank(3, 2 * lapse)
    assert state.budget(2 * lapse).records_per_second == pytest.approx(CAP * 0.1 / 12)


def test_a_grant_applies_until_it_expires_then_the_budget_rate() -> None:
    state = ranked(worker_state(), 4)
    clock = known_clock()
    assert state.receive(grants_document(1, {"w0": 300, "w1": 300, "w2": 300}), clock, 0.0)
    mode, rates = state.rates(1.0)
    assert mode == "granted"
    # the bytes the document does not cap, but the worker's own configuration does, are
    # held to its budget rate
    budget = Rates(CAP * 0.1 / 20, 1_000_000 * 0.1 / 20)
    assert rates == pytest.approx(Rates(300, budget.bytes_per_second))
    expires = state.next_change(1.0)
    assert expires is not None
    # expiry is judged early: S3's time may reach expires_at up to a second before
    assert LEASE - 1.0 - 1e-9 <= expires <= LEASE
    # safe_fraction 0.5 (opted in): half the cap over the three, up to the last grant
    assert state.rates(expires) == ("safe", Rates(CAP * 0.5 / 3, 1_000_000 * 0.5 / 3))
    # by default (0), the budget rate alone
    state.safe_fraction = 0.0
    assert state.rates(expires) == ("safe", pytest.approx(budget))
    assert state.next_change(expires) == (LEFTOVER_LEASES - 1) * LEASE


def test_the_safe_rate_is_never_more_than_the_last_grant() -> None:
    # ratelimit.md, Recommendation C.4: A's grant was small, B's large; A is cut off from S3
    # and its grant expires first. At cap × safe_fraction ÷ N it would go to 500 while B
    # still applies 900: 1400 of a 1000 cap.
    a = WorkerState(
        worker_id="a",
        cap=Rates(CAP, None),
        lease=LEASE,
        safe_fraction=1.0,
        bootstrap_fraction=0.1,
        started_at=0.0,
    )
    a.receive(grants_document(1, {"a": 100, "b": 900}), known_clock(), 0.0)
    assert a.rates(LEASE + 1) == ("safe", Rates(100, None))
    # and the safe share when that is less
    a.safe_fraction = 0.1
    assert a.rates(LEASE + 1) == ("safe", Rates(CAP * 0.1 / 2, None))


def test_a_grant_is_applied_within_the_workers_own_caps() -> None:
    # an allocator started with other caps (a standalone one given only a record cap, and a
    # higher one): the worker holds to its own
    state = worker_state()  # its own caps: 1000 records/s and 1,000,000 bytes/s
    doc = replace(grants_document(1, {"w0": 1500, "w1": 500}), cap=Rates(2 * CAP, None))
    assert state.foreign_cap(doc)
    assert not state.foreign_cap(replace(doc, cap=Rates(CAP, 1_000_000)))
    assert state.receive(doc, known_clock(), 0.0)
    # records: no more than its own cap; bytes, which the document does not cap: its budget
    # rate (none before it knows its rank)
    assert state.rates(1.0) == ("granted", Rates(CAP, 0.0))


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.6, 0.99])
def test_a_grant_never_outlives_its_expiry_by_s3_time(fraction: float) -> None:
    # S3's time is local + SERVER_EPOCH + fraction; the worker sees whole seconds only
    offset = SERVER_EPOCH + fraction
    clock = ServerClock()
    for local in (0.0, 0.45, 1.2):
        clock.observe(math.floor(local + offset), local - 0.02, local)
    state = worker_state()
    doc = grants_document(1, {"w0": 300}, issued=fraction + 1.0)
    assert state.receive(doc, clock, 1.2)
    assert state.grant_expires_at is not None
    truly_expires = doc.expires_at - offset  # local time at which S3 reaches expires_at
    assert truly_expires - 1.1 <= state.grant_expires_at <= truly_expires


def test_older_expired_or_foreign_grants_are_not_applied() -> None:
    state = worker_state()
    clock = known_clock()
    assert state.receive(grants_document(5, {"w0": 300}), clock, 0.0)
    assert not state.receive(grants_document(4, {"w0": 900}), clock, 0.0)  # older
    assert not state.receive(grants_document(5, {"w0": 900}), clock, 0.0)  # same
    assert not state.receive(grants_document(6, {"w1": 900}), clock, 0.0)  # not ours
    assert not state.receive(grants_document(7, {"w0": 900}, issued=-LEASE), clock, 0.0)
    assert state.rates(0.0)[1].records_per_second == 300
    assert state.generation == 5


def test_a_grant_cannot_be_judged_before_s3_time_is_known() -> None:
    state = worker_state()
    assert not state.receive(grants_document(1, {"w0": 300}), ServerClock(), 0.0)
    assert state.mode(0.0) == "bootstrap"


def test_a_worker_not_granted_yet_runs_its_budget_rate() -> None:
    state = ranked(worker_state(), 5)
    # not granted yet, four others are: five in all
    state.receive(grants_document(1, {f"w{i}": 100 for i in range(1, 5)}), known_clock(), 0.0)
    assert state.fleet_size == 5
    assert state.rates(0.0) == ("bootstrap", Rates(CAP * 0.1 / 30, 1_000_000 * 0.1 / 30))
    assert state.needs_rank(0.0)


def test_bootstrap_lasts_while_s3_answers_that_no_grants_exist_or_grants_are_live() -> None:
    state = worker_state(lease=3.0)
    state.no_grants_yet(2.0)  # S3 answered: no grants document yet
    assert state.mode(4.9) == "bootstrap"
    assert state.mode(5.0) == "safe"
    # an allocator is alive (grants not expired) but has not granted this worker yet
    assert not state.receive(grants_document(1, {"w1": 500}, issued=4.0), known_clock(4.0), 4.0)
    assert state.mode(6.0) == "bootstrap"
    # expired grants say nothing is alive
    state = worker_state(lease=3.0)
    assert not state.receive(grants_document(1, {"w1": 500}, issued=-20), known_clock(), 0.0)
    assert state.mode(3.0) == "safe"


def test_without_any_grant_bootstrap_ends_in_the_safe_mode_after_a_lease() -> None:
    state = ranked(worker_state(lease=3.0), 1)
    assert state.mode(2.9) == "bootstrap"
    # never more than the budget rate for a worker that never had a grant
    assert state.rates(3.0) == ("safe", Rates(CAP * 0.1 / 2, 100_000.0 / 2))
    state.safe_fraction = 1.0
    assert state.rates(3.0) == ("safe", Rates(CAP * 0.1 / 2, 100_000.0 / 2))


def test_uncapped_dimensions_stay_unlimited() -> None:
    state = WorkerState(
        worker_id="w",
        cap=Rates(None, 5000),
        lease=LEASE,
        safe_fraction=1.0,
        bootstrap_fraction=0.1,
        started_at=0.0,
    )
    assert state.rates(0.0) == ("bootstrap", Rates(None, 0.0))
    assert ranked(state, 1).rates(0.0) == ("bootstrap", Rates(None, 250.0))


# -- demand -------------------------------------------------------------------------------


def test_demand_is_an_ewma_of_admissions_plus_the_backlog() -> None:
    estimator = DemandEstimator(sync_interval=5.0)
    offered, wants = estimator.update(FleetDemand(0, 0, 50, 5000), 0.0)
    assert offered == Rates(0.0, 0.0)
    assert wants == Rates(10.0, 1000.0)  # nothing admitted yet: the backlog alone
    offered, wants = estimator.update(FleetDemand(1000, 100_000, 0, 0), 5.0)
    assert offered == Rates(200.0, 20_000.0)  # the first rate, as it is
    offered, wants = estimator.update(FleetDemand(1500, 150_000, 100, 10_000), 10.0)
    assert offered == pytest.approx(Rates(150.0, 15_000.0))  # half old, half new
    assert wants == pytest.approx(Rates(150.0 + 20, 15_000.0 + 2000))


def test_callers_waiting_for_room_while_the_fleet_rate_binds_say_the_worker_is_held() -> None:
    # Admission holds a shard's backlog to what the shard sends in max_outstanding_time: at a
    # small rate the backlog is small, and only the waiting callers say that it wants more —
    # when the fleet's bucket is what holds the records back, not Kinesis.
    estimator = DemandEstimator(sync_interval=1.0)

    def sample(at: float, waits: int, waiting: int, refusals: int, holding: bool) -> bool:
        demand = FleetDemand(0, 0, 0, 0, waits, waiting, refusals, holding)
        estimator.update(demand, at)
        return estimator.held

    assert sample(0.0, 1, 1, 0, True)  # waiting now, at the first sample already
    assert sample(1.0, 40, 0, 3, False)  # 39 waits and 3 refusals since the last sample
    assert not sample(2.0, 40, 0, 3, False)  # none since
    assert not sample(3.0, 90, 1, 3, False)  # waiting, but for Kinesis: the fleet lets it go
    assert not sample(4.0, 90, 0, 9, True)  # the fleet binds, but nobody waits
    assert sample(5.0, 91, 0, 9, True)


def test_demand_samples_at_the_same_instant_do_not_divide_by_zero() -> None:
    estimator = DemandEstimator(sync_interval=1.0)
    estimator.update(FleetDemand(0, 0, 0, 0), 1.0)
    offered, _ = estimator.update(FleetDemand(10, 10, 0, 0), 1.0)
    assert offered == Rates(0.0, 0.0)


# -- documents ----------------------------------------------------------------------------


def test_documents_survive_a_round_trip() -> None:
    rep = report("w-1.a_b", mode="granted", generation=3, has=12.5)
    assert parse_report(rep.to_json()) == rep
    lease = LeaseDocument(
        holder="w1",
        incarnation="ff00",
        acquired_at=SERVER_EPOCH,
        renewed_at=SERVER_EPOCH + 5,
        expires_at=SERVER_EPOCH + 20,
        lease=15.0,
    )
    assert parse_lease(lease.to_json()) == lease
    doc = allocator().allocate(
        None, [observed(report("a"), 0), observed(report("b"), 0)], exact(1), began=exact(0)
    )
    # the next reads begin an interval after these began
    assert doc.next_allocation_at == SERVER_EPOCH + LEASE / 3
    doc = replace(
        doc,
        workers={
            **doc.workers,
            "gone": WorkerEntry(None, 4, (Outstanding(4, Rates(1.5, None), SERVER_EPOCH),)),
            # an earlier grant made for another process than the entry's newest
            "again": WorkerEntry(
                Rates(2.0, None),
                5,
                (
                    Outstanding(4, Rates(1.5, None), SERVER_EPOCH, "aaaaaa"),
                    Outstanding(5, Rates(1.0, None), SERVER_EPOCH, None),
                ),
                incarnation="bbbbbb",
            ),
        },
    )
    assert parse_grants(doc.to_json()) == doc
    # an earlier grant that does not say for whom was made for the entry's process
    again = json.loads(doc.to_json())["workers"]["again"]
    assert [o.get("incarnation", "-") for o in again["outstanding"]] == ["aaaaaa", None]
    del again["outstanding"][0]["incarnation"]
    raw = json.loads(doc.to_json())
    raw["workers"]["again"] = again
    parsed = parse_grants(json.dumps(raw).encode())
    assert [o.incarnation for o in parsed.workers["again"].outstanding] == ["bbbbbb", None]
    # in a document of an older version, which never said, for none: a mark frees none
    del raw["outstanding_named"]
    parsed = parse_grants(json.dumps(raw).encode())
    assert [o.incarnation for o in parsed.workers["again"].outstanding] == [None, None]
    unknown = WorkerEntry(
        None, None, (Outstanding(1, Rates(100.0, None), SERVER_EPOCH + 100, None),), "aaaaaa"
    )
    legacy = replace(parsed, workers={"again": unknown})
    kept = allocator().allocate(legacy, [], exact(0), left={"again": "aaaaaa-1"})
    assert kept.workers["again"].outstanding == unknown.outstanding


def valid_report() -> dict[str, Any]:
    return json.loads(report("w1").to_json())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(kind="anykpl-fleet-grants"), "kind"),
        (lambda d: d.update(version=2), "version"),
        (lambda d: d.update(version=True), "version"),
        (lambda d: d.update(worker_id="../etc/passwd"), "worker_id"),
        (lambda d: d.update(worker_id=""), "worker_id"),
        (lambda d: d.update(sequence=-1), "sequence"),
        (lambda d: d.update(sequence=1.5), "sequence"),
        (lambda d: d.update(generation=True), "generation"),
        (lambda d: d.update(mode="turbo"), "mode"),
        (lambda d: d.update(wants={"records_per_second": -5, "bytes_per_second": 1}), "wants"),
        (lambda d: d.update(wants={"records_per_second": 5}), "bytes_per_second"),
        (lambda d: d.update(wants="lots"), "wants"),
        (lambda d: d.update(backlog={"records": "x", "bytes": 0}), "records"),
        (lambda d: d.pop("offered"), "offered"),
    ],
)
def test_invalid_reports_are_rejected(change: Any, message: str) -> None:
    doc = valid_report()
    change(doc)
    with pytest.raises(DocumentError, match=message):
        parse_report(json.dumps(doc).encode())


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not json",
        b"\xff\xfe",
        b"[1, 2]",
        b'{"kind": "anykpl-fleet-report", "version": 1, "wants": NaN}',
        b'{"kind": "anykpl-fleet-report", "version": 1, "sequence": Infinity}',
        b"[" * 100_000,
        b" " * (MAX_DOCUMENT_BYTES + 1),
    ],
)
def test_junk_is_rejected(data: bytes) -> None:
    for parse in (parse_report, parse_lease, parse_grants):
        with pytest.raises(DocumentError):
            parse(data)  # type: ignore[operator]


def test_invalid_grants_are_rejected() -> None:
    doc = json.loads(grants_document(1, {"a": 1.0}).to_json())
    for change in (
        lambda d: d.update(cap={"records_per_second": None, "bytes_per_second": None}),
        lambda d: d.update(expires_at=d["issued_at"] - 1),
        lambda d: d.update(learning="no"),
        lambda d: d.update(workers={"bad id": {"grant": None, "acked": None}}),
        lambda d: d.update(workers={"a": []}),
        lambda d: d.update(workers={"a": {"grant": 5, "acked": None}}),
        lambda d: d.update(workers={"a": {"grant": None, "acked": None, "outstanding": {}}}),
        lambda d: d.update(workers={"a": {"grant": None, "acked": None, "outstanding": [1]}}),
        lambda d: d.update(allocator=None),
        lambda d: d.update(generation=-1),
    ):
        changed = json.loads(json.dumps(doc))
        change(changed)
        with pytest.raises(DocumentError):
            parse_grants(json.dumps(changed).encode())


def test_an_integer_too_long_to_read_is_junk() -> None:
    # json.loads raises a plain ValueError past 4300 digits; float() an OverflowError past
    # 1e308: either escaped the parsers, and every sync cycle failed
    digits = b"9" * 5000
    for kind, parse in (
        ("grants", parse_grants),
        ("report", parse_report),
        ("lease", parse_lease),
    ):
        with pytest.raises(DocumentError, match="not JSON"):
            parse(b'{"kind": "anykpl-fleet-%s", "version": 1, "n": %s}' % (kind.encode(), digits))
    lease = json.loads(
        LeaseDocument(
            holder="a", incarnation="b", acquired_at=1, renewed_at=1, expires_at=2, lease=1
        ).to_json()
    )
    lease["expires_at"] = 10**400
    with pytest.raises(DocumentError, match="expires_at"):
        parse_lease(json.dumps(lease).encode())


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d["workers"]["a"].update(grant={"records_per_second": 0}),
        lambda d: d["workers"]["a"].update(grant={"records_per_second": 5, "bytes_per_second": 0}),
        lambda d: d["workers"]["a"].update(grant={"records_per_second": -1}),
        lambda d: d["workers"]["a"].update(
            outstanding=[{"generation": 0, "expires_at": 1, "records_per_second": 0}]
        ),
        lambda d: d.update(cap={"records_per_second": 0, "bytes_per_second": None}),
    ],
)
def test_a_rate_of_zero_is_junk(change: Any) -> None:
    # applied, a grant of 0 made the producer's bucket divide by zero
    doc = json.loads(grants_document(1, {"a": 1.0}).to_json())
    change(doc)
    with pytest.raises(DocumentError, match="positive"):
        parse_grants(json.dumps(doc).encode())


def test_invalid_leases_are_rejected() -> None:
    lease = json.loads(
        LeaseDocument(
            holder="a", incarnation="b", acquired_at=1, renewed_at=1, expires_at=2, lease=1
        ).to_json()
    )
    lease["lease"] = 0
    with pytest.raises(DocumentError, match="lease"):
        parse_lease(json.dumps(lease).encode())


def test_lease_expiry_trusts_the_holder_only_within_what_last_modified_allows() -> None:
    def lease(expires_at: float) -> LeaseDocument:
        return LeaseDocument("a", "b", 0.0, 0.0, expires_at, 15.0)

    assert lease_expiry(lease(115.4), 100.0, 15.0) == 115.4
    assert lease_expiry(lease(90.0), 100.0, 15.0) == 115.0  # too early: not before LM + lease
    assert lease_expiry(lease(1e12), 100.0, 15.0) == 116.0  # too late: at most a second more
    assert lease_expiry(None, 100.0, 15.0) == 116.0  # junk: LastModified alone


class _DatedTable:
    """A DynamoDB client whose answers carry a ``Date`` an hour ahead of this machine's."""

    def __init__(self) -> None:
        self.items: dict[str, dict[str, Any]] = {}
        self.calls: list[str] = []

    def _metadata(self) -> dict[str, Any]:
        import email.utils
        import time

        date = email.utils.formatdate(math.floor(time.time()) + 3600, usegmt=True)
        return {"ResponseMetadata": {"HTTPStatusCode": 200, "HTTPHeaders": {"date": date}}}

    async def get_item(self, *, TableName: str, Key: Any, **options: Any) -> Any:
        self.calls.append("GetItem")
        item = self.items.get(Key["sk"]["S"])
        return {**self._metadata(), **({"Item": item} if item else {})}

    async def put_item(self, *, TableName: str, Item: Any, **conditions: Any) -> Any:
        self.calls.append("PutItem")
        self.items[Item["sk"]["S"]] = Item
        return self._metadata()


@pytest.mark.anyio
async def test_a_dynamodb_write_is_stamped_with_the_stores_time_from_the_first() -> None:
    # DynamoDB keeps no time on an item: the writer stamps it. A member that has not heard
    # from the store yet reads first, so that its first report is not stamped with its own
    # wall clock (here an hour behind the store's)
    import time

    from anykpl import FleetConfig
    from anykpl._fleet import ServerClock
    from anykpl._fleet._dynamodb_store import DynamoDBStore

    client = _DatedTable()
    store = DynamoDBStore(
        client, FleetConfig(table="fleet", records_per_second=1), ServerClock(), 5
    )
    await store.put(store.key("workers/w.json"), b"{}")
    assert client.calls == ["GetItem", "PutItem"]
    modified = float(client.items[store.key("workers/w.json")]["modified"]["N"])
    assert modified == pytest.approx(time.time() + 3600, abs=3)
    await store.put(store.key("workers/w.json"), b"{}")
    assert client.calls == ["GetItem", "PutItem", "PutItem"]  # the clock is known now
