"""A shard and its producers on a virtual clock, for the adaptive controller's tests.

Fluid enough to run thousands of simulated seconds in a test, concrete enough to show what
the controller does to delivery: each producer releases Kinesis records through its own token
bucket at the controller's fraction of the ceiling, sends them in a request every
``REQUEST_INTERVAL``, and learns the outcome one ``RTT`` later. The shard throttles a record
when its own bucket (one second of its limit) is empty, or by ``noise`` whatever the rate.
Throttled records go back to the producer's backlog (retries cost tokens like any record).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable

from anykpl._core._adaptive import RateController

#: Kinesis records per second a shard accepts in the simulation (aggregates of ~25 KB).
CEILING = 40.0
STEP = 0.01
REQUEST_INTERVAL = 0.05
RTT = 0.1
#: the producer's token bucket holds this many seconds of its rate (as _token_bucket.py)
BURST = 0.5


class SimProducer:
    def __init__(self, controller: RateController | None, backlog: float = float("inf")) -> None:
        self.controller = controller
        self.backlog = backlog  # records not yet delivered (inf: saturated)
        self.tokens = 0.0
        self.batch = 0
        self.sent = 0
        self.throttled = 0
        self.delivered = 0
        self.in_flight: deque[tuple[float, float, int]] = deque()  # (arrives, sent_at, n)
        self.finished_at: float | None = None

    def fraction(self, now: float) -> float:
        return 1.0 if self.controller is None else self.controller.fraction(now)


def run(
    producers: list[SimProducer],
    seconds: float,
    *,
    noise: float = 0.0,
    limit: Callable[[float], float] = lambda now: 1.0,
    seed: int = 1,
    on_step: Callable[[float], None] | None = None,
) -> float:
    """Run until ``seconds`` or until every producer with a finite backlog is done; return
    the simulated time."""
    rng = random.Random(seed)
    shard_tokens = CEILING
    now = 0.0
    next_request = 0.0
    while now < seconds:
        now += STEP
        shard_tokens = min(CEILING * limit(now), shard_tokens + CEILING * limit(now) * STEP)
        for p in producers:
            rate = p.fraction(now) * CEILING
            p.tokens = min(rate * BURST, p.tokens + rate * STEP)
            waiting = p.backlog - p.batch - sum(n for _, _, n in p.in_flight)
            take = int(min(p.tokens, waiting))
            if take > 0:
                p.tokens -= take
                p.batch += take
        if now >= next_request:
            next_request = now + REQUEST_INTERVAL
            order = list(producers)
            rng.shuffle(order)
            for p in order:
                if not p.batch:
                    continue
                n, p.batch = p.batch, 0
                accepted = 0
                for _ in range(n):
                    if noise and rng.random() < noise:
                        continue
                    if shard_tokens >= 1.0:
                        shard_tokens -= 1.0
                        accepted += 1
                p.in_flight.append((now + RTT, now, n * 1000 + accepted))
        for p in producers:
            while p.in_flight and p.in_flight[0][0] <= now + 1e-9:
                _, sent_at, packed = p.in_flight.popleft()
                n, accepted = divmod(packed, 1000)
                throttled = n - accepted
                p.sent += n
                p.throttled += throttled
                p.delivered += accepted
                p.backlog -= accepted
                if p.controller is not None:
                    p.controller.outcome(now, sent_at, n, throttled)
                if p.backlog <= 0 and p.finished_at is None:
                    p.finished_at = now
        if on_step is not None:
            on_step(now)
        if all(p.finished_at is not None for p in producers if p.backlog != float("inf")) and any(
            p.backlog != float("inf") for p in producers
        ):
            break
    return now


def controller(**overrides: float) -> RateController:
    options: dict[str, object] = {
        "records_ceiling": CEILING,
        "bytes_ceiling": CEILING * 25_000,
        "decrease": 0.7,
        "increase": 0.005,
        "floor": 0.05,
        "window": 0.25,
    }
    options.update(overrides)
    return RateController(**options)  # type: ignore[arg-type]
