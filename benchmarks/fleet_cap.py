"""Fleet-wide caps over S3 (issue 4): four producer processes share a cap of half a stream.

The emulator (its own process) serves a 2-shard stream with the service's limits (2,000
records/s and 2 MiB/s in all) and S3. Four producer processes (two on asyncio, two on trio;
``tests/integration/fleet_producer.py``) each put 100-byte records as fast as they are
admitted, with ``FleetConfig(records_per_second=1000, bytes_per_second=1 MiB)``: half the
stream. Aggregation is off, so a user record is a Kinesis record and the record cap binds.
Three runs per sync interval:

* **converge**: all four for ``--duration`` s. Reports the time from the last process's start
  until the sum of the rates the four apply is within ±5 % of the cap for good (sampled every
  0.25 s), the emulator-accepted rate over the steady part (mean, and the worst second), and
  the largest sum of grants in force over every generation of ``grants.json`` (the bucket is
  versioned, so every generation is kept).
* **takeover**: the allocator's process is killed (SIGKILL) mid-run. Reports the time from the
  kill until another process holds ``allocator.json``, against the lease, and until the three
  survivors apply a third of the cap each.
* **cut off**: one process reaches the store through a TCP proxy, which is cut mid-run.
  Reports how long until it is in safe mode, and the rate it applies then (its budget rate).

    python benchmarks/fleet_cap.py                       # sync interval 1 s
    python benchmarks/fleet_cap.py --intervals 1 5       # and the default 5 s (slower)
    python benchmarks/fleet_cap.py --store dynamodb      # the fleet's table on the emulator

With ``--store dynamodb`` the fleet coordinates through a table on the emulator (moto's
DynamoDB) instead of a bucket; the table keeps no versions, so the generations are those a
thread saw, reading the grants item every 50 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

import boto3

from anykpl._fleet import GrantsDocument, parse_grants, parse_lease
from anykpl._fleet._dynamodb_store import TABLE_SCHEMA
from anykpl.emulator import EmulatorClient, spawn

HELPER = Path(__file__).resolve().parent.parent / "tests" / "integration" / "fleet_producer.py"
CAP = 1000.0
CAP_BYTES = 1 << 20
CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
PREFIX = "anykpl-fleet"


class Proxy:
    """A threaded TCP forwarder that can be cut: listener and connections closed at once."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = []
        self.cut_at: float | None = None
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while self.cut_at is None:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.close()

    def cut(self) -> None:
        self.cut_at = time.time()
        for s in (self.listener, *self.sockets):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # (wakes the thread blocked in accept)
            with contextlib.suppress(OSError):
                s.close()


class TableView:
    """The fleet's items in a DynamoDB table, as the benchmark reads them: the table keeps no
    versions, so a thread samples the grants item every 50 ms to see each generation."""

    def __init__(self, client: Any, table: str) -> None:
        self.client = client
        self.table = table
        self.seen: dict[int, GrantsDocument] = {}
        self.stopped = False
        threading.Thread(target=self._sample, daemon=True).start()

    def item(self, name: str) -> bytes | None:
        found = self.client.get_item(
            TableName=self.table,
            Key={"pk": {"S": PREFIX}, "sk": {"S": f"{PREFIX}/{name}"}},
            ConsistentRead=True,
        ).get("Item")
        return None if found is None else zlib.decompress(found["body"]["B"])

    def _sample(self) -> None:
        while not self.stopped:
            with contextlib.suppress(Exception):
                body = self.item("grants.json")
                if body is not None:
                    document = parse_grants(body)
                    self.seen.setdefault(document.generation, document)
            time.sleep(0.05)


def launch(
    url: str,
    s3_url: str,
    store: tuple[str, str],
    worker: int,
    interval: float,
    duration: float,
) -> subprocess.Popen[str]:
    command = [
        *(sys.executable, str(HELPER), "--endpoint", url, "--stream", "fleet"),
        *store,
        *("--worker-id", f"p{worker}", "--duration", str(duration)),
        *("--records-per-second", str(CAP), "--bytes-per-second", str(CAP_BYTES)),
        *("--sync-interval", str(interval), "--max-outstanding", "1000"),
        *("--backend", "asyncio" if worker % 2 == 0 else "trio"),
    ]
    environment = dict(os.environ)
    if s3_url != url:
        # the producer's Kinesis goes direct; its S3 goes through the proxy
        command += ["--s3-endpoint", s3_url]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=environment)


def generations(s3: Any, bucket: str) -> list[GrantsDocument]:
    if isinstance(s3, TableView):
        return sorted(s3.seen.values(), key=lambda d: d.generation)
    key = f"{PREFIX}/grants.json"
    found = []
    for page in s3.get_paginator("list_object_versions").paginate(Bucket=bucket, Prefix=key):
        for version in page.get("Versions", []):
            body = s3.get_object(Bucket=bucket, Key=key, VersionId=version["VersionId"])
            found.append(parse_grants(body["Body"].read()))
    return sorted(found, key=lambda d: d.generation)


def holder(s3: Any, bucket: str) -> str | None:
    if isinstance(s3, TableView):
        body = s3.item("allocator.json")
        return None if body is None else parse_lease(body).holder
    try:
        body = s3.get_object(Bucket=bucket, Key=f"{PREFIX}/allocator.json")["Body"].read()
    except s3.exceptions.NoSuchKey:
        return None
    return parse_lease(body).holder


def applied_sum(results: list[dict[str, Any]], at: float, only: set[str] | None = None) -> float:
    """The sum of the rates the processes applied at wall time ``at`` (their last sample)."""
    total = 0.0
    for r in results:
        if only is not None and r["worker_id"] not in only:
            continue
        before = [s for s in r["samples"] if s["t"] <= at]
        if before and before[-1]["records_per_second"] is not None:
            total += before[-1]["records_per_second"]
    return total


def settled(
    results: list[dict[str, Any]], start: float, end: float, target: float, only: set[str] | None
) -> float | None:
    """Seconds from ``start`` until the applied sum is within ±5 % of ``target`` for good."""
    times = sorted({s["t"] for r in results for s in r["samples"] if start <= s["t"] <= end})
    last_outside = start
    seen_inside = False
    for t in times:
        if abs(applied_sum(results, t, only) - target) > 0.05 * target:
            last_outside = t
            seen_inside = False
        else:
            seen_inside = True
    return (last_outside - start) if seen_inside else None


def accepted(control: EmulatorClient) -> dict[int, int]:
    per_second: dict[int, int] = {}
    for shard in control.stats()["shards"]:
        if shard["stream"] == "fleet":
            for second, records, *_ in shard["per_second"]:
                per_second[second] = per_second.get(second, 0) + records
    return per_second


def run(kind: str, interval: float, duration: float, store_kind: str = "s3") -> dict[str, Any]:
    with spawn(streams={"fleet": 2}) as url:
        control = EmulatorClient(url)
        bucket = f"fleet-{uuid.uuid4().hex[:10]}"
        s3: Any
        if store_kind == "s3":
            s3 = boto3.client("s3", region_name="us-east-1", endpoint_url=url, **CREDENTIALS)
            s3.create_bucket(Bucket=bucket)
            s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
            store = ("--bucket", bucket)
        else:
            client = boto3.client(
                "dynamodb", region_name="us-east-1", endpoint_url=url, **CREDENTIALS
            )
            client.create_table(TableName=bucket, **TABLE_SCHEMA)
            s3 = TableView(client, bucket)
            store = ("--table", bucket)
        uptime, wall = control.stats()["uptime"], time.time()
        proxy = Proxy(url) if kind == "cut off" else None
        processes = [
            launch(url, proxy.url if proxy and i == 3 else url, store, i, interval, duration)
            for i in range(4)
        ]
        event: dict[str, Any] = {}
        middle = wall + 3 + duration / 2  # startup takes about 3 s on this machine
        if kind != "converge":
            time.sleep(max(0.0, middle - time.time()))
        if kind == "takeover":
            victim = holder(s3, bucket)
            assert victim is not None
            killed_at = time.time()
            processes[int(victim[1:])].send_signal(signal.SIGKILL)
            while holder(s3, bucket) in (victim, None):
                time.sleep(0.02)
            event = {"victim": victim, "at": killed_at, "replaced": time.time() - killed_at}
        elif kind == "cut off" and proxy is not None:
            proxy.cut()
            event = {"at": proxy.cut_at}
        results = []
        for process in processes:
            # (a producer cut off from the store falls to its budget rate: what it admitted
            # ends by its record TTL, so its close can take that long)
            out, _ = process.communicate(timeout=duration + 240)
            if process.returncode == 0:
                results.append(json.loads(out.strip().splitlines()[-1]))
        per_second = accepted(control)
        documents = generations(s3, bucket)
        if isinstance(s3, TableView):
            s3.stopped = True
    started = max(r["started"] for r in results)
    stopped = min(r["stopped"] for r in results)
    summary: dict[str, Any] = {
        "kind": kind,
        "interval": interval,
        "generations": len(documents),
        "largest_in_force": max(d.total_reserved().records_per_second or 0 for d in documents),
        "largest_granted": max(d.total_granted().records_per_second or 0 for d in documents),
        "failed": sum(r["failed"] for r in results),
        "acknowledged": sum(r["acknowledged"] for r in results),
        "s3_errors": {r["worker_id"]: r["samples"][-1]["errors"] for r in results},
    }
    if kind == "converge":
        summary["converged"] = settled(results, started, stopped, CAP, None)
        begin = started + 4 * interval
        window = [
            per_second.get(s, 0)
            for s in range(int(begin - wall + uptime) + 1, int(stopped - wall + uptime))
        ]
        summary["window"] = window
        summary["mean"] = sum(window) / len(window) if window else None
    elif kind == "takeover":
        survivors = {r["worker_id"] for r in results}
        summary["replaced"] = event["replaced"]
        summary["victim"] = event["victim"]
        summary["reconverged"] = settled(results, event["at"], stopped, CAP, survivors)
    else:
        far = next(r for r in results if r["worker_id"] == "p3")
        after = [s for s in far["samples"] if s["t"] >= event["at"]]
        safe = next((s for s in after if s["mode"] == "safe"), None)
        summary["to_safe"] = None if safe is None else safe["t"] - event["at"]
        summary["safe_rate"] = None if safe is None else safe["records_per_second"]
        summary["others_after"] = applied_sum(results, stopped, {"p0", "p1", "p2"})
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--intervals", type=float, nargs="+", default=[1.0])
    parser.add_argument("--duration", type=float, default=None, help="default: 20 intervals")
    parser.add_argument("--runs", nargs="+", default=["converge", "takeover", "cut off"])
    parser.add_argument(
        "--store",
        choices=("s3", "dynamodb"),
        default="s3",
        help="the fleet's store (on the emulator)",
    )
    args = parser.parse_args()
    for interval in args.intervals:
        duration = args.duration or max(20.0, 20 * interval)
        lease = 3 * interval
        for kind in args.runs:
            s = run(kind, interval, duration, args.store)
            line = f"{args.store}, R={interval:g} s, lease {lease:g} s | {kind}: "
            if kind == "converge":
                window = s["window"]
                line += (
                    f"within ±5 % after {s['converged']:.2f} s "
                    f"({s['converged'] / interval:.1f} intervals) from the last start; "
                    f"accepted {s['mean']:.0f}/s mean over {len(window)} s "
                    f"(worst second {min(window)}–{max(window)})"
                )
            elif kind == "takeover":
                line += (
                    f"allocator {s['victim']} killed, replaced after {s['replaced']:.2f} s; "
                    f"three survivors within ±5 % of the cap after "
                    f"{s['reconverged']:.2f} s"
                    if s["reconverged"] is not None
                    else "survivors did not settle"
                )
            else:
                line += (
                    f"cut off → safe after {s['to_safe']:.2f} s at {s['safe_rate']:.0f}/s; "
                    f"the three others then apply {s['others_after']:.0f}/s"
                )
            line += (
                f" | generations {s['generations']}, largest sum of grants in force "
                f"{s['largest_in_force']:.1f} of {CAP:.0f} | acknowledged {s['acknowledged']}, "
                f"failed {s['failed']}"
            )
            print(line, flush=True)
            print("  " + json.dumps(s), flush=True)


if __name__ == "__main__":
    main()
