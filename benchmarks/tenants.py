"""A quiet tenant's put latency, alone and next to a noisy tenant, on one shard with limits.

The emulator (``anykpl.emulator.spawn``, the service's limits: 1 MiB/s and 1000 records/s per
shard) runs in its own process, with one 1-shard stream per phase. A *quiet* tenant puts a
100-byte record every 10 ms (each ``put_record`` in a task of its own, so a slow record does
not hold back the next) and we take the latency of each put, call to result. A *noisy*
tenant puts 1 KiB records at a fixed offered rate, each ``submit`` in a task of its own (at
most ``--max-noisy-tasks`` at a time; the rest count as shed by the load generator):

1. ``alone``: the quiet tenant only.
2. ``10x quota``: the noisy tenant offers 10 times its quota (quota 100 KiB/s, offered
   1000 KiB/s); ``admission_timeout`` 1 s, so what would wait longer is refused at once. The
   quota keeps the shard below its limit.
3. ``over the shard``: the noisy tenant's quota (2 MiB/s) is above the shard's limit and it
   uses it all: the shard is saturated and its backlog grows by 1 MiB/s. The Limiter's fair
   queue keeps the quiet tenant's records from waiting behind that backlog.
4. ``over the shard, no tenants``: the same load put without ``tenant=`` (what a producer
   without tenants does): the quiet records wait behind the backlog.

Bar (issue 4): a tenant sending 10x its quota does not raise another tenant's p99 put latency
by more than one ``record_max_buffered_time`` (phase 2 against phase 1; phase 3 too).

    python benchmarks/tenants.py                       # asyncio, 10 s per phase
    python benchmarks/tenants.py --backend trio --duration 20
    python benchmarks/tenants.py --plot docs/img/tenants.png   # latency CDFs (matplotlib)
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import Any

import anyio

from anykpl import Producer, ProducerConfig, TenantQuota, errors
from anykpl.emulator import EmulatorClient, spawn

CREDENTIALS = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench"}
KIB = 1024
MIB = 1024 * 1024

QUIET_INTERVAL = 0.01  # a 100-byte record every 10 ms
NOISY_RECORD = 1000  # bytes of data; with its 24-character partition key, 1 KiB
NOISY_KEY = "noisy-partition-key-0000"


@dataclass
class Phase:
    name: str
    noisy_rate: float  # records/s offered by the noisy tenant (0: none)
    noisy_quota: TenantQuota | None
    tenants: bool = True  # put with tenant= (False: the plain producer)


@dataclass
class Result:
    phase: str
    quiet_latencies: list[float]
    quiet_failed: int
    noisy_offered: int
    noisy_admitted: int
    noisy_refused: int
    noisy_shed: int
    duration: float  # seconds of offered load
    throttled: int

    def percentile(self, q: float) -> float:
        ordered = sorted(self.quiet_latencies)
        if not ordered:
            return math.nan
        return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def phases() -> list[Phase]:
    record = NOISY_RECORD + len(NOISY_KEY)
    over_quota = TenantQuota(bytes_per_second=100 * KIB)
    big_quota = TenantQuota(bytes_per_second=2 * MIB)
    return [
        Phase("alone", 0, None),
        Phase("10x quota", 10 * 100 * KIB / record, over_quota),
        Phase("over the shard", 2 * MIB / record, big_quota),
        Phase("over the shard, no tenants", 2 * MIB / record, None, tenants=False),
    ]


async def run_phase(
    endpoint: str,
    stream: str,
    phase: Phase,
    duration: float,
    options: dict[str, Any],
    max_noisy_tasks: int = 4000,
) -> Result:
    quotas = {"noisy": phase.noisy_quota} if phase.noisy_quota is not None else {}
    config = ProducerConfig(
        region="us-east-1",
        endpoint_url=endpoint,
        tenant_quotas=quotas,
        admission_timeout=1.0,
        close_timeout=1.0,  # the noisy backlog is failed at the end, not delivered
        **CREDENTIALS,
        **options,
    )
    latencies: list[float] = []
    quiet_failed = 0
    noisy = {"offered": 0, "admitted": 0, "refused": 0, "shed": 0, "in_flight": 0}
    quiet_tenant = "quiet" if phase.tenants else None
    noisy_tenant = "noisy" if phase.tenants else None
    data = b"q" * 90
    noisy_data = b"n" * NOISY_RECORD

    async with Producer(config) as producer:
        await producer.put_record(stream, data, partition_key="warm-up")

        async def quiet_put(i: int) -> None:
            nonlocal quiet_failed
            start = anyio.current_time()
            try:
                await producer.put_record(
                    stream, data, partition_key=f"quiet-{i % 16}", tenant=quiet_tenant
                )
            except errors.AnyKplError:
                quiet_failed += 1
            else:
                latencies.append(anyio.current_time() - start)

        async def noisy_put() -> None:
            try:
                await producer.submit(
                    stream, noisy_data, partition_key=NOISY_KEY, tenant=noisy_tenant
                )
            except (errors.BackpressureTimeout, errors.TenantQuotaExceeded):
                noisy["refused"] += 1
            except errors.ProducerClosedError:
                pass
            else:
                noisy["admitted"] += 1
            finally:
                noisy["in_flight"] -= 1

        async def offer_noise(tg: anyio.abc.TaskGroup, until: float) -> None:
            start = anyio.current_time()
            while (now := anyio.current_time()) < until:
                due = int((now - start) * phase.noisy_rate) - noisy["offered"]
                for _ in range(due):
                    noisy["offered"] += 1
                    if noisy["in_flight"] >= max_noisy_tasks:
                        noisy["shed"] += 1
                        continue
                    noisy["in_flight"] += 1
                    tg.start_soon(noisy_put)
                await anyio.sleep(0.005)

        started = anyio.current_time()
        until = started + duration
        async with (
            anyio.create_task_group() as quiet_tasks,
            anyio.create_task_group() as noisy_tasks,
        ):
            if phase.noisy_rate:
                noisy_tasks.start_soon(offer_noise, noisy_tasks, until)
            i = 0
            while anyio.current_time() < until:
                quiet_tasks.start_soon(quiet_put, i)
                i += 1
                await anyio.sleep_until(started + i * QUIET_INTERVAL)
            # records still waiting for the noisy quota are not part of the measurement
            noisy_tasks.cancel_scope.cancel()
    return Result(
        phase.name,
        latencies,
        quiet_failed,
        noisy["offered"],
        noisy["admitted"],
        noisy["refused"],
        noisy["shed"],
        duration,
        0,
    )


def run(backend: str, duration: float, rmbt: float) -> list[Result]:
    names = [f"phase{i}" for i in range(len(phases()))]
    with spawn(streams=dict.fromkeys(names, 1)) as endpoint:
        client = EmulatorClient(endpoint)
        results = []
        for stream, phase in zip(names, phases(), strict=True):
            before = client.stats()["totals"]["throttled_records"]
            result = anyio.run(
                run_phase,
                endpoint,
                stream,
                phase,
                duration,
                {"record_max_buffered_time": rmbt},
                backend=backend,
            )
            result.throttled = client.stats()["totals"]["throttled_records"] - before
            results.append(result)
    return results


def table(results: list[Result], rmbt: float) -> str:
    alone = results[0].percentile(0.99)
    lines = [
        "| phase | quiet p50 (ms) | quiet p99 (ms) | p99 − alone (ms) | quiet max (ms) "
        "| noisy offered KiB/s | noisy admitted KiB/s | noisy refused | throttled |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    record = (NOISY_RECORD + len(NOISY_KEY)) / KIB
    for r in results:
        p99 = r.percentile(0.99)
        lines.append(
            f"| {r.phase} | {r.percentile(0.5) * 1000:.0f} | {p99 * 1000:.0f} "
            f"| {(p99 - alone) * 1000:+.0f} | {max(r.quiet_latencies) * 1000:.0f} "
            f"| {r.noisy_offered * record / r.duration:.0f} "
            f"| {r.noisy_admitted * record / r.duration:.0f} "
            f"| {r.noisy_refused + r.noisy_shed} | {r.throttled} |"
        )
    lines.append("")
    lines.append(f"bar: p99 − alone ≤ record_max_buffered_time = {rmbt * 1000:.0f} ms")
    return "\n".join(lines)


def plot(results: list[Result], path: str, title: str) -> None:
    """The quiet tenant's latency distribution in each phase, one line per phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.5))
    for r in results:
        ordered = sorted(r.quiet_latencies)
        share = [(i + 1) / len(ordered) for i in range(len(ordered))]
        axes.plot([x * 1000 for x in ordered], share, label=r.phase)
    axes.set_xscale("log")
    axes.set_xlabel("quiet tenant's put_record latency (ms, log scale)")
    axes.set_ylabel("share of records")
    axes.axhline(0.99, color="grey", linewidth=0.5, linestyle=":")
    axes.set_title(title)
    axes.grid(True, which="both", linewidth=0.3)
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per phase")
    parser.add_argument(
        "--rmbt", type=float, default=0.1, help="record_max_buffered_time (default 0.1 s)"
    )
    parser.add_argument("--plot", metavar="PNG", help="write the latency CDFs to this file")
    args = parser.parse_args()
    wall = time.perf_counter()
    results = run(args.backend, args.duration, args.rmbt)
    title = f"{args.backend}, {args.duration:g} s per phase, 1 shard (1 MiB/s, 1000 records/s)"
    print(title)
    print(table(results, args.rmbt))
    if args.plot:
        plot(results, args.plot, f"A quiet tenant next to a noisy one\n{title}")
    for r in results:
        if r.quiet_failed:
            print(f"{r.phase}: {r.quiet_failed} quiet record(s) failed")
    print(f"({time.perf_counter() - wall:.0f} s)")


if __name__ == "__main__":
    main()
