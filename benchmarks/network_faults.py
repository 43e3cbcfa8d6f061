"""Network faults injected by the kernel and by a relay, not by anything that speaks HTTP for us.

The whole run happens in a private network namespace (``unshare -n``, as root): its own
loopback, on which the endpoint (anykpl's emulator with limits off, or moto's own server)
listens, and on which the faults are set with the kernel's own tools:

- ``bandwidth``: ``tc`` caps the loopback (a token bucket, ``tbf``) far below what the producer
  offers; every record is put with ``submit`` as fast as the call returns. Judged: nothing
  fails (nothing expires), the callers wait at the call (backpressure), the backlog stays
  bounded.
- ``resets``: ``iptables`` answers a random share of the request packets with a TCP reset
  (``REJECT --reject-with tcp-reset``), mid-request. Judged: nothing fails, and no record is
  stored more often than it had failed attempts plus one.
- ``blackhole``: ``iptables`` drops every packet to the endpoint for longer than
  ``request_timeout``, then lets them through again. Judged: nothing fails, no attempt outlasts
  its timeouts, and delivery resumes once the black hole lifts.
- ``idle``: a relay closes every connection that stays idle between requests for
  ``--idle-close`` seconds (a FIN, then a close half a second later, as load balancers do),
  while the records come in bursts with pauses around that length. Judged: nothing fails.
- ``latency``: a relay delays every request by 200 ms ± 50 ms. Judged: nothing fails, and the
  throughput is at least what ``max_connections`` and the request size allow: each connection
  carries one request at a time, so at most ``max_connections × collection_max_count`` records
  per (latency + service time). Measured twice: with the defaults (where that bound is far
  above what the CPU allows, so the figure is the CPU's), and with a configuration small enough
  for the bound to bind (``--bound-config``).

Every record has a partition key and data of its own; every one is read back from the stream
once the fault is lifted, deaggregated with AWS's ``aws_kinesis_agg``: an acknowledged record
missing, a record stored twice without a failed attempt to explain it, or one nobody put fails
the run (exit status 1). Where network namespaces are not permitted (not root, no ``unshare``,
no ``tc``; no ``iptables`` for its two faults), it says so and exits with status 77. ::

    python benchmarks/network_faults.py
    python benchmarks/network_faults.py --scenario latency,idle --endpoint moto --backend trio
    python benchmarks/network_faults.py --records 5000 --json faults.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from collections import Counter
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from endpoints import CREDENTIALS, REGION, client_for, overrides, read_back, start_endpoint

SCENARIOS = ("bandwidth", "resets", "blackhole", "idle", "latency")
#: the exit status that says "cannot run here" (as automake's skip)
CANNOT_RUN = 77
#: set in the namespace this script re-runs itself in
IN_NAMESPACE = "ANYKPL_NETWORK_FAULTS_NAMESPACE"
SIZE = 100  # bytes of data per record
SHARDS = 4


def record(index: int) -> tuple[str, bytes]:
    """(partition key, data) of record ``index``: unique, ``SIZE`` bytes."""
    return f"k{index}", f"{index}:".encode().ljust(SIZE, b".")


# --- the relay: latency and idle closes, in a process of its own -----------------------------


async def relay(port: int, target: int, latency: float, jitter: float, idle_close: float) -> None:
    """Forward 127.0.0.1:``port`` to 127.0.0.1:``target``, printing the port once it listens.

    With ``latency``, each request's bytes reach the target ``latency ± jitter`` seconds after
    its first byte reached the relay (a request begins with the first byte after a response;
    the order of the bytes is kept). With ``idle_close``, a connection idle that long after a
    response is closed: a FIN to the client, then a close half a second later; what the client
    sends in between is dropped."""
    rng = random.Random(7)
    loop = asyncio.get_running_loop()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            writer.close()
            return
        state = {"last": loop.time(), "answered": True, "closing": False}
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def from_client() -> None:
            release_at = 0.0
            while data := await reader.read(65536):
                if state["closing"]:
                    continue  # half-closed: dropped, as a load balancer drops it
                now = loop.time()
                state["last"] = now
                if state["answered"]:  # the first byte of a new request
                    state["answered"] = False
                    release_at = now + max(0.0, rng.uniform(latency - jitter, latency + jitter))
                queue.put_nowait((release_at, data))
            queue.put_nowait(None)

        async def to_target() -> None:
            while (item := await queue.get()) is not None:
                release_at, data = item
                delay = release_at - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                if state["closing"]:
                    return
                up_writer.write(data)
                await up_writer.drain()
            if not state["closing"]:
                up_writer.write_eof()

        async def to_client() -> None:
            while data := await up_reader.read(65536):
                state["last"] = loop.time()
                state["answered"] = True
                writer.write(data)
                await writer.drain()
            if not state["closing"]:
                writer.close()

        async def close_when_idle() -> None:
            while True:
                await asyncio.sleep(idle_close / 4)
                idle = loop.time() - state["last"]
                if state["answered"] and queue.empty() and idle >= idle_close:
                    state["closing"] = True
                    writer.write_eof()
                    up_writer.close()
                    print("closed", flush=True)  # counted by Relay
                    await asyncio.sleep(0.5)
                    writer.close()
                    return

        tasks = [asyncio.ensure_future(c) for c in (from_client(), to_target(), to_client())]
        if idle_close > 0:
            tasks.append(asyncio.ensure_future(close_when_idle()))
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            await asyncio.wait(tasks[:3], timeout=30)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
            for task in tasks:
                if not task.cancelled():
                    task.exception()  # retrieved: a reset connection is this relay's normal
            writer.close()
            up_writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", port)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


class Relay:
    """``relay`` in a child process, for as long as the block runs."""

    def __init__(self, target: int, latency: float = 0.0, jitter: float = 0.0, idle: float = 0.0):
        self.idle_closes = 0
        self.command = [
            sys.executable,
            os.path.abspath(__file__),
            "--relay",
            json.dumps([0, target, latency, jitter, idle]),
        ]

    def __enter__(self) -> str:
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        port = self.process.stdout.readline().strip()
        if not port:
            raise RuntimeError("the relay did not start")
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        self.process.kill()  # at once: its connections are the faults, not worth a clean end
        output, _ = self.process.communicate(timeout=10)
        self.idle_closes = output.split().count("closed")


# --- the kernel's faults ------------------------------------------------------------------------


def run(*command: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")


def iptables_rule(scenario: str, port: int, probability: float) -> list[str]:
    rule = ["INPUT", "-p", "tcp", "--dport", str(port)]
    if scenario == "resets":
        # packets that carry request bytes (not the bare ACKs), a random share of them
        rule += ["-m", "length", "--length", "200:65535"]
        rule += ["-m", "statistic", "--mode", "random", "--probability", str(probability)]
        return [*rule, "-j", "REJECT", "--reject-with", "tcp-reset"]
    return [*rule, "-j", "DROP"]


class Fault:
    """Turns one scenario's kernel fault on and off (idempotent), and notes when."""

    def __init__(self, scenario: str, port: int, args: argparse.Namespace) -> None:
        self.scenario = scenario
        self.port = port
        self.args = args
        self.on_at: float | None = None  # seconds from the producer's opening
        self.off_at: float | None = None
        self.active = False

    def set(self, on: bool, now: float) -> None:
        if on == self.active or self.scenario in ("idle", "latency"):
            return
        if self.scenario == "bandwidth":
            if on:
                # bursts of one 1,500-byte packet at a time: the cap holds at every instant
                rate = f"{self.args.bandwidth}bit"
                run("tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate, "burst",
                    "4kb", "latency", "400ms")  # fmt: skip
            else:
                run("tc", "qdisc", "del", "dev", "lo", "root")
        else:
            rule = iptables_rule(self.scenario, self.port, self.args.reset_probability)
            run("iptables", "-A" if on else "-D", *rule)
        self.active = on
        if on:
            self.on_at = now
        else:
            self.off_at = now


# --- one case: a producer through a fault ---------------------------------------------------


async def put_all(case: dict[str, Any], url: str, fault: Fault) -> dict[str, Any]:
    """Put the case's records through ``url`` with the fault on as the scenario says; the
    figures, every result's attempts, and a timeline."""
    import anyio

    from anykpl import Producer
    from anykpl.errors import RecordFailedError

    scenario, count, stream = case["scenario"], case["records"], case["stream"]
    rng = random.Random(3)
    handles = []
    submit_waits = 0  # submits that returned after more than 10 ms: the caller waited
    submit_wait_time = 0.0
    timeline: list[tuple[float, int, int]] = []  # (seconds, finished, outstanding)
    opened = time.perf_counter()

    def elapsed() -> float:
        return time.perf_counter() - opened

    async with Producer(
        region=REGION, endpoint_url=url, **CREDENTIALS, **case["config"]
    ) as producer:

        def sample() -> None:
            statistics = producer.statistics()
            outstanding = statistics.outstanding_records
            finished = sum(
                s.user_records_received - s.outstanding_records for s in statistics.streams.values()
            )
            timeline.append((round(elapsed(), 3), finished, outstanding))

        async def watch() -> None:
            while True:
                sample()
                if scenario == "blackhole":
                    start, length = case["blackhole_at"], case["blackhole_for"]
                    fault.set(start <= elapsed() < start + length, elapsed())
                await anyio.sleep(0.05)

        try:
            async with anyio.create_task_group() as group:
                if scenario in ("bandwidth", "resets"):
                    fault.set(True, elapsed())
                group.start_soon(watch)
                pace = case.get("pace")  # records/s offered, or None: as fast as admitted
                burst = case.get("burst")
                for index in range(count):
                    if burst and index % burst == 0 and index:
                        await anyio.sleep(rng.uniform(*case["pause"]))
                    elif pace and index % 100 == 0:
                        ahead = index / pace - elapsed()
                        if ahead > 0:
                            await anyio.sleep(ahead)
                    key, data = record(index)
                    began = time.perf_counter()
                    handles.append(await producer.submit(stream, data, key))
                    waited = time.perf_counter() - began
                    if waited > 0.01:
                        submit_waits += 1
                        submit_wait_time += waited
                offered = elapsed()
                results: list[Any] = []
                for handle in handles:
                    try:
                        results.append(await handle)
                    except RecordFailedError as exc:
                        results.append(exc.result)
                last_result = elapsed()
                sample()
                group.cancel_scope.cancel()
            requests = request_figures(producer, stream)
        finally:
            fault.set(False, elapsed())
    closed = elapsed()
    failed = [i for i, result in enumerate(results) if not result.success]
    collided = repeated_sequence_numbers(results)
    codes = Counter(
        result.attempts[-1].error_code if result.attempts else "none"
        for result in results
        if not result.success
    )
    failed_attempts = [sum(not a.success for a in result.attempts) for result in results]
    error_codes = Counter(
        a.error_code for result in results for a in result.attempts if not a.success
    )
    durations = [a.duration for result in results for a in result.attempts]
    return {
        **{k: case[k] for k in ("scenario", "backend", "endpoint", "records", "stream")},
        "label": case["label"],
        "config": case["config"],
        "seconds": last_result,
        "records_per_second": count / last_result,
        "offer_seconds": offered,
        "close_seconds": closed - last_result,
        "failed": failed,
        "failure_codes": dict(codes),
        "repeated_sequence_numbers": collided,
        "failed_attempts": failed_attempts,
        "attempt_errors": dict(error_codes),
        "longest_attempt": max(durations, default=0.0),
        "submit_waits": submit_waits,
        "submit_wait_seconds": submit_wait_time,
        "peak_outstanding": max((o for _, _, o in timeline), default=0),
        "fault_on": fault.on_at,
        "fault_off": fault.off_at,
        "timeline": timeline,
        **requests,
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def repeated_sequence_numbers(results: list[Any]) -> list[int]:
    """The acknowledged records whose place in the stream (shard, sequence number and
    sub-sequence number) the endpoint also gave another record. Two Kinesis records acknowledged
    with one sequence number are the endpoint's doing: moto's server numbers a shard's records
    as its highest sequence number plus one, without a lock, on a threaded server
    (moto/kinesis/models.py, ``Shard.put_record``, moto 5.2.5), so two requests at once can get
    the same number, and the stream then keeps only one of the two records."""
    places: dict[tuple[Any, ...], list[int]] = {}
    for index, result in enumerate(results):
        if result.success:
            key = (result.shard_id, result.sequence_number, result.sub_sequence_number)
            places.setdefault(key, []).append(index)
    return sorted(i for indexes in places.values() if len(indexes) > 1 for i in indexes)


def request_figures(producer: Any, stream: str) -> dict[str, float]:
    """The PutRecords requests the stream made: how many, Kinesis records in each, seconds
    each (means), from the producer's own metrics."""
    figures = {"requests": 0.0, "records_per_request": 0.0, "request_seconds": 0.0}
    for value in producer.metrics():
        if value.stream != stream or value.shard is not None or not value.count:
            continue
        if value.name == "KinesisRecordsPerPutRecordsRequest":
            figures["requests"] = value.count
            figures["records_per_request"] = value.sum / value.count
        elif value.name == "RequestTime":
            figures["request_seconds"] = value.sum / value.count / 1000
    return figures


def check(client: Any, result: dict[str, Any], case: dict[str, Any]) -> list[str]:
    """What is wrong with the case: read back, and judged by the scenario's bars."""
    from anykpl.readback import judge

    count = result["records"]
    failed = set(result["failed"])
    acknowledged = [record(i) for i in range(count) if i not in failed]
    found = read_back(client, result["stream"])
    verdict = judge(acknowledged, found, {record(i) for i in failed})
    result["read_back"] = sum(found.values())
    result["duplicates"] = verdict.duplicates
    problems = []
    if failed:
        problems.append(f"{len(failed)} records failed: {result['failure_codes']}")
    missing = verdict.missing
    if result["endpoint"] == "moto" and verdict.missing:
        # acknowledged under a sequence number moto also gave another record: moto's race (see
        # repeated_sequence_numbers), counted apart, not as records the producer lost
        lost_by_moto = sum(
            1 for i in result["repeated_sequence_numbers"] if not found.get(record(i))
        )
        result["lost_by_endpoint"] = lost_by_moto
        missing -= lost_by_moto
    if missing:
        problems.append(f"{missing} acknowledged records missing")
    if verdict.unexpected:
        problems.append(f"{verdict.unexpected} records nobody put")
    # a copy beyond the first needs a failed attempt of that record to explain it
    unexplained = sum(
        max(0, found[record(i)] - 1 - result["failed_attempts"][i]) for i in range(count)
    )
    if unexplained:
        problems.append(f"{unexplained} copies beyond the record's failed attempts")
    scenario = result["scenario"]
    if scenario == "bandwidth" and not result["submit_waits"]:
        problems.append("no submit waited: the backpressure did not reach the caller")
    if scenario == "blackhole":
        # an attempt ends at request_timeout (a connection that cannot open: connect_timeout)
        config = case["config"]
        bound = config.get("request_timeout", 6.0) + config.get("connect_timeout", 6.0) + 1.0
        if result["longest_attempt"] > bound:
            problems.append(f"an attempt took {result['longest_attempt']:.1f} s (bound {bound} s)")
        resumed = resumed_after(result)
        result["resumed_after"] = resumed
        if resumed is None or resumed > case["resume_bound"]:
            problems.append(f"delivery resumed {resumed} s after the black hole lifted")
    if scenario == "latency" and case.get("bound_rate"):
        # the connections kept busy: C requests of the size sent, one per request time
        config = case["config"]
        busy = (
            config["max_connections"]
            * result["records_per_request"]
            / max(result["request_seconds"], 1e-3)
        )
        result["busy_bound_rate"] = busy
        result["request_fill"] = result["records_per_request"] / config["collection_max_count"]
        if result["records_per_second"] < 0.8 * case["bound_rate"]:
            problems.append(
                f"{result['records_per_second']:.0f} records/s, under 0.8 × "
                f"{case['bound_rate']:.0f} (max_connections × collection_max_count / latency)"
            )
        if result["records_per_second"] < 0.8 * busy:
            problems.append(
                f"{result['records_per_second']:.0f} records/s, under 0.8 × "
                f"{busy:.0f} (max_connections × the requests' size / their time)"
            )
    return problems


def resumed_after(result: dict[str, Any]) -> float | None:
    """Seconds from the black hole's end to the first record finished after it."""
    off = result["fault_off"]
    if off is None:
        return None
    before = max((f for t, f, _ in result["timeline"] if t <= off), default=0)
    for t, finished, _ in result["timeline"]:
        if t > off and finished > before:
            return round(float(t - off), 2)
    return None


# --- the cases of a run ---------------------------------------------------------------------


def cases_for(args: argparse.Namespace, endpoint: str, backend: str) -> list[dict[str, Any]]:
    settings = overrides(args.set)
    cases = []
    for scenario in args.scenario:
        base = {
            "scenario": scenario,
            "backend": backend,
            "endpoint": endpoint,
            "records": args.records,
            "config": dict(settings),
            "label": "defaults" if not settings else "with " + ", ".join(args.set),
        }
        if scenario == "bandwidth" and args.pace:
            base["pace"] = args.pace
        if scenario == "blackhole":
            timeout = settings.get("request_timeout", 6.0)
            length = timeout + 2.0
            base |= {
                "blackhole_at": 1.0,
                "blackhole_for": length,
                # offered at a steady pace over the black hole and 1 s either side of it
                "pace": args.records / (length + 2.0),
                "resume_bound": settings.get("connect_timeout", 6.0) + 1.0,
            }
        elif scenario == "resets":
            # offered over 3 s, so that the resets meet many requests, not a few big ones
            base["pace"] = args.records / 3.0
        elif scenario == "idle":
            base |= {
                "records": args.idle_records,
                "burst": 50,
                "pause": (args.idle_close / 3, args.idle_close * 3),
            }
        cases.append(base)
        if scenario == "latency":
            # small enough for latency to bind: C connections, n records a request, no
            # aggregation: at most C × n / (latency + service) records/s
            bound_config = {
                "max_connections": 4,
                "collection_max_count": 50,
                "aggregation_enabled": False,
                **overrides(args.bound_config),
            }
            rate = (
                bound_config["max_connections"]
                * bound_config["collection_max_count"]
                / (args.latency + 0.01)
            )
            cases.append(
                base
                | {
                    "config": bound_config,
                    "label": "bound: " + ", ".join(f"{k}={v}" for k, v in bound_config.items()),
                    "bound_rate": rate,
                    "records": int(rate * args.bound_seconds),
                }
            )
    return cases


def run_cases(args: argparse.Namespace) -> list[dict[str, Any]]:
    """In the namespace: the endpoint, then every case on every backend, read back."""
    import anyio

    run("ip", "link", "set", "lo", "up")
    run("ip", "link", "set", "lo", "mtu", "1500")  # an Ethernet's packets, not 64 KiB ones
    results = []
    for endpoint in args.endpoint:
        with start_endpoint(endpoint) as url:
            client = client_for(url)
            port = urlsplit(url).port or 80
            for backend in args.backend:
                for number, case in enumerate(cases_for(args, endpoint, backend)):
                    stream = f"faults-{case['scenario']}-{backend}-{number}-{os.getpid()}"
                    client.create_stream(StreamName=stream, ShardCount=SHARDS)
                    client.get_waiter("stream_exists").wait(
                        StreamName=stream, WaiterConfig={"Delay": 0.2, "MaxAttempts": 300}
                    )
                    case["stream"] = stream
                    fault = Fault(case["scenario"], port, args)
                    relay_options: dict[str, float] = {}
                    if case["scenario"] == "latency":
                        relay_options = {"latency": args.latency, "jitter": args.jitter}
                    elif case["scenario"] == "idle":
                        relay_options = {"idle": args.idle_close}
                    if relay_options:
                        relay = Relay(port, **relay_options)
                        with relay as relayed:
                            result = anyio.run(put_all, case, relayed, fault, backend=backend)
                        result["idle_closes"] = relay.idle_closes
                    else:
                        result = anyio.run(put_all, case, url, fault, backend=backend)
                    result["problems"] = check(client, result, case)
                    if case.get("bound_rate"):
                        result["bound_rate"] = case["bound_rate"]
                    print(summary(result), file=sys.stderr, flush=True)
                    results.append(result)
    return results


def summary(result: dict[str, Any]) -> str:
    errors = ", ".join(f"{code} {n}" for code, n in sorted(result["attempt_errors"].items()))
    line = (
        f"{result['scenario']:9} {result['backend']:7} {result['endpoint']:8} "
        f"{result['label'][:40]:40} {result['records']:6} records "
        f"{result['records_per_second']:8.0f}/s  waits {result['submit_waits']:5} "
        f"peak {result['peak_outstanding']:6}  failed {len(result['failed'])}  "
        f"dup {result['duplicates']}  retried: {errors or '-'}"
    )
    if result.get("bound_rate"):
        line += (
            f"  bound C×n/L {result['bound_rate']:.0f}/s, busy {result['busy_bound_rate']:.0f}/s"
            f", requests {result['request_fill']:.0%} full"
        )
    if result.get("resumed_after") is not None:
        line += f"  resumed {result['resumed_after']} s after"
    if result.get("lost_by_endpoint"):
        line += f"  lost by moto (a sequence number given twice): {result['lost_by_endpoint']}"
    if result["problems"]:
        line += "\n    PROBLEMS: " + "; ".join(result["problems"])
    return line


# --- entering the namespace -----------------------------------------------------------------


def cannot_run(args: argparse.Namespace) -> str | None:
    """Why this machine cannot run the scenarios asked for, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root here (run as root, or with sudo)"
    for tool in ("unshare", "ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian: apt install util-linux iproute2)"
    if {"resets", "blackhole"} & set(args.scenario) and shutil.which("iptables") is None:
        return "iptables is not installed (Debian: apt install iptables)"
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True, check=False)
    if probe.returncode:
        return f"unshare -n is not permitted here: {probe.stderr.strip()}"
    return None


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--relay":
        port, target, latency, jitter, idle = json.loads(sys.argv[2])
        # connections torn down mid-way are this relay's everyday work: no tracebacks for them
        sys.unraisablehook = lambda _: None
        loop = asyncio.new_event_loop()
        loop.set_exception_handler(lambda _loop, _context: None)
        loop.run_until_complete(relay(port, target, latency, jitter, idle))
        return
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )

    def listed(text: str) -> list[str]:
        return [part for part in text.split(",") if part]

    parser.add_argument(
        "--scenario", type=listed, default=list(SCENARIOS), help=",".join(SCENARIOS)
    )
    parser.add_argument("--backend", type=listed, default=["asyncio", "trio"])
    parser.add_argument("--endpoint", type=listed, default=["emulator", "moto"])
    parser.add_argument("--records", type=int, default=20_000, help="records per case (20,000)")
    parser.add_argument("--bandwidth", default="4m", help="tc rate for 'bandwidth' (4m: 4 Mbit/s)")
    parser.add_argument(
        "--pace",
        type=float,
        help="'bandwidth': records/s offered (default: each submit as soon as the last returns)",
    )
    parser.add_argument("--reset-probability", type=float, default=0.01)
    parser.add_argument("--latency", type=float, default=0.2)
    parser.add_argument("--jitter", type=float, default=0.05)
    parser.add_argument("--idle-close", type=float, default=0.1)
    parser.add_argument(
        "--idle-records", type=int, default=2_000, help="records for 'idle', in bursts of 50"
    )
    parser.add_argument("--set", action="append", default=[], help="ProducerConfig field=value")
    parser.add_argument(
        "--bound-config",
        action="append",
        default=[],
        help="field=value for latency's bound case (max_connections=4, collection_max_count=50, "
        "aggregation_enabled=False)",
    )
    parser.add_argument(
        "--bound-seconds", type=float, default=6.0, help="latency's bound case: its length (6)"
    )
    parser.add_argument("--json", help="write every case's figures here")
    args = parser.parse_args()
    unknown = set(args.scenario) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    if os.environ.get(IN_NAMESPACE) != "1":
        reason = cannot_run(args)
        if reason:
            print(f"network_faults: cannot run here: {reason}", file=sys.stderr)
            raise SystemExit(CANNOT_RUN)
        env = dict(os.environ, **{IN_NAMESPACE: "1"})
        done = subprocess.run(["unshare", "-n", sys.executable, *sys.argv], env=env, check=False)
        raise SystemExit(done.returncode)
    results = run_cases(args)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)
    bad = [r for r in results if r["problems"]]
    if bad:
        print(f"{len(bad)} of {len(results)} cases had problems", file=sys.stderr)
        raise SystemExit(1)
    print(f"all {len(results)} cases passed", file=sys.stderr)


if __name__ == "__main__":
    main()
