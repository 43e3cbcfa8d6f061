"""A fleet at scale on a virtual clock: the real worker and allocator code for a hundred and
more members against a simulated store (``benchmarks/fleet_scale.py``), fast and slow.

The bar everywhere: the rates the members apply never sum over the cap, at any instant.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
try:
    import fleet_scale
finally:
    sys.path.pop(0)

INTERVAL = 5.0


def simulate(*argv: str) -> dict[str, Any]:
    return fleet_scale.run(fleet_scale.parse(list(argv)))


def test_a_hundred_members_on_a_fast_store_hold_the_cap_and_converge() -> None:
    # joins, then ten leave gracefully, then ten more join, then the allocator crashes
    result = simulate(
        *("--members", "100", "--offer", "200", "--store-rate", "5000"),
        *("--join", "10", "--leave", "10", "--leave-at", "30", "--late", "10"),
        *("--late-at", "60", "--crash", "90", "--duration", "140"),
    )
    assert result["max_applied_over_cap"] <= 1 + 1e-6
    # the grants share the cap less the bootstrap budget (4 %): within ±5 % of the cap
    assert result["final_applied_over_cap"] == pytest.approx(0.96, abs=0.01)
    # within 3 intervals of the last join; within a lease (3 intervals) and 3 intervals of the
    # allocator's crash
    assert result["converged_after_join"] is not None
    assert result["converged_after_join"] <= 3 * INTERVAL
    # a graceful leave frees its share at the allocator's next cycle: within 3 intervals
    assert result["left"] == 10
    assert result["converged_after_leave"] is not None
    assert result["converged_after_leave"] <= 3 * INTERVAL
    # members joining late reach their fair share (what the others apply) within 3 intervals
    assert result["converged_after_late"] is not None
    assert result["converged_after_late"] <= 3 * INTERVAL
    assert result["fair_share"] == pytest.approx(5000 * 0.96 / 100, rel=0.01)
    assert result["late_fair_share_after"] is not None
    assert result["late_fair_share_after"] <= 3 * INTERVAL
    assert result["converged_after_crash"] is not None
    assert result["converged_after_crash"] <= 6 * INTERVAL
    assert result["longest_interval"] == INTERVAL  # the store keeps up: no stretching


def test_members_joining_faster_than_a_slow_store_serves_never_exceed_the_cap() -> None:
    # 150 members would ask 90 requests/s of a store that serves 50: it throttles, calls time
    # out, reports go unread. The fleet stretches its interval instead of loosening its rates
    # (the members back off on their own until the allocator can tell them to).
    # (no crash: on this store a takeover waits out a stretched lease of about two minutes,
    # which benchmarks/fleet_scale.py measures; here the end of the run would fall in it)
    result = simulate(
        *("--members", "150", "--offer", "200", "--store-rate", "50"),
        *("--join", "10", "--crash", "-1", "--duration", "200"),
    )
    assert result["max_applied_over_cap"] <= 1 + 1e-6
    assert result["longest_interval"] > INTERVAL
    # once stretched, the fleet asks no more than the store serves
    assert result["requests_per_second_last_minute"] <= 50
    # and the fleet sends what it may by the end: 0.92-0.96 of the cap over the last minute
    # in 16 runs (the grants share 0.96)
    assert result["final_applied_over_cap"] >= 0.9
    assert result["mean_applied_over_cap_last_minute"] >= 0.85


@pytest.mark.parametrize("store", ["s3", "dynamodb"])
def test_members_whose_clocks_disagree_hold_the_cap_and_converge(store: str) -> None:
    # every member's monotonic clock has its own offset (up to a day either way) and rate (up
    # to the 200 ppm the store's clock allows for): staleness is judged by the store's time,
    # learnt from its stamps, never by comparing one member's clock with another's; on S3 and
    # on DynamoDB (simulated: conditional writes, dated answers, pages of a Query)
    result = simulate(
        *("--members", "50", "--offer", "400", "--store-rate", "5000"),
        *("--join", "10", "--leave", "5", "--leave-at", "20", "--crash", "40"),
        *("--duration", "90", "--skew", "86400", "--drift", "200", "--store", store),
    )
    assert result["store"] == store
    assert result["skew"] == 86400
    assert result["drift_ppm"] == 200
    assert result["max_applied_over_cap"] <= 1 + 1e-6
    assert result["final_applied_over_cap"] == pytest.approx(0.96, abs=0.01)
    assert result["converged_after_join"] is not None
    assert result["converged_after_join"] <= 3 * INTERVAL
    assert result["converged_after_leave"] is not None
    assert result["converged_after_leave"] <= 3 * INTERVAL
    assert result["converged_after_crash"] is not None
    assert result["converged_after_crash"] <= 6 * INTERVAL


@pytest.mark.parametrize("new_cap", [3000, 8000])
def test_a_cap_changed_by_a_rolling_redeploy_is_held_and_reached(new_cap: int) -> None:
    # every member's process is replaced, over 10 s, by one configured with the new cap: the
    # sum applied never exceeds the cap in force (either one while both are deployed), and it
    # settles within ±5 % of the new cap within 3 intervals of the rollout's end (issue 31's
    # bar; docs/benchmarks.md, "A fleet at scale")
    result = simulate(
        *("--members", "50", "--offer", "400", "--store-rate", "5000", "--join", "10"),
        *("--crash", "-1", "--new-cap", str(new_cap), "--cap-change-at", "30"),
        *("--rollout", "10", "--duration", "80"),
    )
    assert result["cap_changed_at"] == 50
    assert result["max_applied_over_cap"] <= 1 + 1e-6
    assert result["converged_after_cap_change"] is not None
    assert result["converged_after_cap_change"] <= 3 * INTERVAL
    assert result["final_applied_over_cap"] == pytest.approx(0.96, abs=0.01)
