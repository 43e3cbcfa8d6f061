"""Side by side: the same workload through anykpl, async-kinesis and aiokpl, one endpoint, one run.

Workload: 100-byte user records, each with its own id in the payload, random partition keys
drawn from ``--keys`` distinct keys (same seed for everyone), KPL aggregation on wherever the
library has it, rate limits off in the producer *and* in the emulator, a fresh ``--shards``
stream per contender. The emulator (``anykpl.emulator.spawn``) runs in its own process for
the whole run; each contender runs in a fresh interpreter of its own (a subprocess of this
script), so no contender inherits another's garbage, connection pools or warmed caches.

Each contender imports its library before its event loop starts (as a program with its imports
at the top does), builds its workload, collects garbage once (``start_clock``), and its clock runs
from opening its producer until everything is acknowledged, as a user's program would see it
(``--timing warm``: from after one warm-up record, acknowledged, and 0.5 s, with connections
open and the shard map loaded):

- anykpl ``-await`` (asyncio and trio, the idiomatic loop): a ``submit`` per record, then an
  ``await`` on every handle;
- anykpl (asyncio and trio): until ``flush()`` returns, then every ``PendingRecord`` checked;
- anykpl ``-batch``: ``submit_many`` of 500 records at a time, each batch's handle checked;
- aiokpl (asyncio only): ``flush()`` then ``await outcome.wait()`` on every record, because its
  ``flush()`` does not wait for outcomes;
- async-kinesis (asyncio only): until ``flush()`` returns; it has no per-record results, so
  "acknowledged" counts the user records in the batches passed to ``after_flush_fun``, which
  it calls only for PutRecords batches that had no failed record.

Records/s = acknowledged records / that wall time. Afterwards this process reads every stream
back (GetRecords from TRIM_HORIZON on every shard), deaggregates each Kinesis record with
``anykpl._core._wire.deaggregate`` (KPL magic + MD5; anything else counts as one plain record) and
reports, per contender: distinct record ids delivered / expected, duplicates, how many user
records kept the partition key they were put with, and how many sit on a shard whose hash-key
range holds their own hash key (a KCL 2.x consumer drops the others from aggregates).

Modes (fixed, see docs/benchmarks.md): anykpl and aiokpl aggregate per predicted shard with the
user's keys (KPL defaults, 51,200-byte aggregates). async-kinesis aggregates with
``KPLStringProcessor`` (aws-kinesis-agg, up to 1 MiB aggregates), which refuses user partition
keys: every user record gets key ``"a"`` and each aggregate a random routing key.
``--with-plain`` adds async-kinesis without aggregation (``StringProcessor``, user keys kept).
Apart from the rate limits every setting is the library's default (anykpl collects its
``"detailed"`` metrics by default; aiokpl and async-kinesis collect none by default).

Needs Python ≥ 3.11 (async-kinesis 3.0.1) and, besides anykpl's ``test`` extra (moto server,
boto3, trio, httpx2, aws-kinesis-agg, six), the peers; neither changes anykpl's dependencies::

    pip install aiokpl==0.2.0 'async-kinesis[kpl]==3.0.1'

Run::

    python benchmarks/compare_peers.py                  # 200k records (aiokpl: 30k), one round
    python benchmarks/compare_peers.py --timing warm    # clocks from after a warm-up record
    python benchmarks/compare_peers.py --rounds 3 --with-plain --json compare.json
    python benchmarks/compare_peers.py --endpoint moto     # moto's own server instead
    python benchmarks/compare_peers.py --endpoint http://127.0.0.1:4567   # kinesalite, ...

``--endpoint`` chooses where the streams live: ``emulator`` (the default; anykpl's emulator
with limits off), ``moto`` (moto's own Werkzeug server, ``python -m moto.server``, in its own
process) or the URL of a running endpoint. Every endpoint is read back the same way.

With ``--rounds N`` every contender runs N times, interleaved, each time on a fresh stream;
ratios are taken inside a round (never across rounds) and their median is printed. Each round
starts one contender further along the list (round 2 with the second, ...), so that none
always runs first or last: this VM's speed drifts within a round, and a fixed order would
hand the drift to the same contender every time.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib
import importlib.metadata
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import deque
from typing import Any

from endpoints import ENDPOINT_HELP, check_endpoint, start_endpoint

REGION = "us-east-1"
CREDENTIALS = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench"}
RECORD_SIZE = 100
ID_PREFIX = b"R"  # payload: b"R" + 9-digit id, padded with b"." to RECORD_SIZE
WARM_UP = b"W".ljust(RECORD_SIZE, b".")
SEED = 20261121
RESULT_TAG = "COMPARE-RESULT "

# contender -> (library, backend, mode shown in the table)
CONTENDERS: dict[str, tuple[str, str, str]] = {
    "anykpl-asyncio-await": ("anykpl", "asyncio", "KPL aggregation, user keys, submit, await each"),
    "anykpl-trio-await": ("anykpl", "trio", "KPL aggregation, user keys, submit, await each"),
    "anykpl-asyncio": ("anykpl", "asyncio", "KPL aggregation, user keys"),
    "anykpl-trio": ("anykpl", "trio", "KPL aggregation, user keys"),
    "anykpl-asyncio-batch": ("anykpl", "asyncio", "KPL aggregation, user keys, submit_many"),
    "anykpl-trio-batch": ("anykpl", "trio", "KPL aggregation, user keys, submit_many"),
    "async-kinesis": ("async-kinesis", "asyncio", "KPL aggregation (aws-kinesis-agg), key 'a'"),
    "aiokpl": ("aiokpl", "asyncio", "KPL aggregation, user keys"),
    "async-kinesis-plain": ("async-kinesis", "asyncio", "no aggregation, user keys"),
}
#: the module a program imports for each library
LIBRARY_MODULES = {"anykpl": "anykpl", "async-kinesis": "kinesis", "aiokpl": "aiokpl"}
TARGETS = {"async-kinesis": 1.5, "aiokpl": 20.0}
#: the bars where anykpl runs as the pure-Python package (no C compiler at install; issue 30)
PURE_TARGETS = {"async-kinesis": 1.0}
#: the bar against async-kinesis for ``submit_many`` (issue 30), where it differs
BATCH_TARGETS = {"async-kinesis": 2.0}
#: the bar for anykpl on trio against anykpl on asyncio, in each mode (issue 30)
TRIO_TARGET = 0.9
#: records per submit_many call for the ``-batch`` contenders (a PutRecords request's worth)
BATCH = 500


# ---------------------------------------------------------------------------------------------
# the workload (built identically in the worker and in the checker)


def payload(i: int) -> bytes:
    return (ID_PREFIX + b"%09d" % i).ljust(RECORD_SIZE, b".")


def key_names(records: int, keys: int) -> list[str]:
    """The partition key of every record: ``keys`` distinct keys in random order."""
    names = [f"device-{k:05d}" for k in range(keys)]
    rng = random.Random(SEED)
    return [names[rng.randrange(keys)] for _ in range(records)]


# ---------------------------------------------------------------------------------------------
# workers: one contender in this (fresh) interpreter


def start_clock() -> tuple[float, float]:
    """(CPU, wall) time when a contender's clock starts, after a full garbage collection. The
    workload (hundreds of thousands of payloads and keys, built just before) otherwise leaves
    the collector's counters wherever its construction happened to stop, and the full
    collection it has made due (70 ms: it walks every payload) falls on whichever contender
    allocates next, inside the clock or not by luck of the count. Collected first, every
    contender starts from the same state, and a full collection inside the clock is its own."""
    gc.collect()
    return time.process_time(), time.perf_counter()


async def run_anykpl(
    endpoint: str,
    stream: str,
    records: int,
    keys: int,
    from_open: bool,
    batch: int = 0,
    await_each: bool = False,
) -> dict[str, Any]:
    import anyio

    from anykpl import PendingBatch, PendingRecord, Producer, ProducerConfig
    from anykpl.errors import RecordFailedError

    datas = [payload(i) for i in range(records)]
    pks = key_names(records, keys)
    items = list(zip(datas, pks, strict=True))  # submit_many's (data, partition_key) items
    # rate_limit is a percentage of the shard limits: 1e9 % is limits off
    config = ProducerConfig(region=REGION, endpoint_url=endpoint, rate_limit=1e9, **CREDENTIALS)
    cpu0, wall0 = start_clock()
    async with Producer(config) as producer:
        if not from_open:
            await producer.put_record(stream, WARM_UP, partition_key="warm-up")
            await anyio.sleep(0.5)
            cpu0, wall0 = start_clock()
        failed = 0
        if await_each:
            # the idiomatic loop: a submit per record, then an await on every handle
            handles = [
                await producer.submit(stream, data, partition_key=pk)
                for data, pk in zip(datas, pks, strict=True)
            ]
            for handle in handles:
                try:
                    await handle
                except RecordFailedError:
                    failed += 1
        elif batch:
            # a firehose that has its records in batches: submit_many, each batch's handle
            # checked as the oldest completes (its failed records counted, none overlooked)
            batches: deque[PendingBatch] = deque()
            for start in range(0, records, batch):
                batches.append(await producer.submit_many(stream, items[start : start + batch]))
                while batches and batches[0].done():
                    failed += batches.popleft().failed
            await producer.flush()
            failed += sum(len(b) - b.succeeded for b in batches)
        else:
            window: deque[PendingRecord] = deque()
            for data, pk in zip(datas, pks, strict=True):
                window.append(await producer.submit(stream, data, partition_key=pk))
                while window and window[0].done():
                    failed += not window.popleft().result().success
            await producer.flush()
            failed += sum(1 for p in window if not p.done() or not p.result().success)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        # after the clock: the Kinesis records the endpoint acknowledged (the producer's own
        # count), which the checker compares with what the stream holds (see verdicts)
        kinesis_records = sum(
            int(value.sum)
            for value in producer.metrics("KinesisRecordsPut")
            if value.stream is None and value.shard is None
        )
    return {
        "acknowledged": records - failed,
        "seconds": wall,
        "cpu_seconds": cpu,
        "kinesis_records_acknowledged": kinesis_records,
    }


async def run_aiokpl(
    endpoint: str, stream: str, records: int, keys: int, from_open: bool
) -> dict[str, Any]:
    import asyncio

    from aiokpl import Config, Producer

    datas = [payload(i) for i in range(records)]
    pks = key_names(records, keys)
    config = Config(
        region=REGION,
        endpoint_url=endpoint,
        rate_limit_records_per_sec_per_shard=1e9,  # limits off
        rate_limit_bytes_per_sec_per_shard=1e12,
        **CREDENTIALS,
    )
    cpu0, wall0 = start_clock()
    async with Producer(config) as producer:
        if not from_open:
            warm = await producer.put_record(stream=stream, partition_key="warm-up", data=WARM_UP)
            await producer.flush()
            await warm.wait()
            await asyncio.sleep(0.5)
            cpu0, wall0 = start_clock()
        outcomes = [
            await producer.put_record(stream=stream, partition_key=pk, data=data)
            for data, pk in zip(datas, pks, strict=True)
        ]
        await producer.flush()  # does not wait for outcomes: await each below
        acknowledged = 0
        for outcome in outcomes:
            acknowledged += (await outcome.wait()).success
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return {"acknowledged": acknowledged, "seconds": wall, "cpu_seconds": cpu}


async def run_async_kinesis(
    endpoint: str, stream: str, records: int, keys: int, from_open: bool, aggregate: bool = True
) -> dict[str, Any]:
    import asyncio

    from kinesis import Producer
    from kinesis.processors import KPLStringProcessor, StringProcessor

    # StringProcessor sends str(item).encode(): give it the same 100 ASCII bytes as a str
    datas = [payload(i).decode("ascii") for i in range(records)]
    pks: list[str | None] = [None] * records if aggregate else list(key_names(records, keys))
    acked = [0]

    async def after_flush(items: list[Any]) -> None:
        # called for every PutRecords batch with FailedRecordCount == 0; .n = user records
        acked[0] += sum(item.n for item in items)

    cpu0, wall0 = start_clock()
    async with Producer(
        stream,
        endpoint_url=endpoint,
        region_name=REGION,
        processor=KPLStringProcessor() if aggregate else StringProcessor(),
        put_rate_limit_per_shard=10**9,  # limits off
        put_bandwidth_limit_per_shard=10**9,
        after_flush_fun=after_flush,  # type: ignore[arg-type]  # annotated () -> ..., called (items)
    ) as producer:
        if not from_open:
            await producer.put(WARM_UP.decode("ascii"), partition_key=None if aggregate else "w")
            await producer.flush()
            await asyncio.sleep(0.5)
            acked[0] = 0
            cpu0, wall0 = start_clock()
        for data, pk in zip(datas, pks, strict=True):
            await producer.put(data, partition_key=pk)
        await producer.flush()
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        task = producer.flush_task
        if task is not None and task.done() and task.exception() is not None:
            raise RuntimeError(f"async-kinesis flush task failed: {task.exception()!r}")
    return {"acknowledged": acked[0], "seconds": wall, "cpu_seconds": cpu}


def worker(spec: dict[str, Any]) -> None:
    import logging

    logging.basicConfig(level=logging.ERROR)  # async-kinesis warns about limits above 1 MiB/s
    library, backend, _ = CONTENDERS[spec["contender"]]
    args = (spec["endpoint"], spec["stream"], spec["records"], spec["keys"])
    args += (spec.get("timing", "open") == "open",)
    # The library is imported here, before the event loop starts, as a program imports it at
    # its top: anykpl imported before trio (a sorted import block) leaves httpx's transport,
    # which it imports with itself in a program that imported trio first, to its first
    # producer's opening, inside the clock (anykpl/_transport/_aws.py)
    importlib.import_module(LIBRARY_MODULES[library])
    if library == "anykpl":
        import anyio

        batch = BATCH if spec["contender"].endswith("-batch") else 0
        await_each = spec["contender"].endswith("-await")
        result = anyio.run(run_anykpl, *args, batch, await_each, backend=backend)
    else:
        import asyncio

        if library == "aiokpl":
            result = asyncio.run(run_aiokpl(*args))
        else:
            aggregate = spec["contender"] == "async-kinesis"
            result = asyncio.run(run_async_kinesis(*args, aggregate=aggregate))
    print(RESULT_TAG + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------
# the checker: read a stream back


def read_back(client: Any, stream: str, records: int, keys: int) -> dict[str, Any]:
    """Deaggregate everything in ``stream`` and check it against the workload."""
    from anykpl._core._wire import deaggregate, is_aggregated

    expected_keys = key_names(records, keys)
    seen = bytearray(records)
    kinesis_records = aggregated = user_records = duplicates = foreign = 0
    keys_kept = in_range = 0
    hashes: dict[str, int] = {}
    shards = client.list_shards(StreamName=stream)["Shards"]
    for shard in shards:
        low = int(shard["HashKeyRange"]["StartingHashKey"])
        high = int(shard["HashKeyRange"]["EndingHashKey"])
        iterator = client.get_shard_iterator(
            StreamName=stream, ShardId=shard["ShardId"], ShardIteratorType="TRIM_HORIZON"
        )["ShardIterator"]
        while iterator:
            response = client.get_records(ShardIterator=iterator, Limit=10_000)
            if not response["Records"]:
                break
            iterator = response.get("NextShardIterator")
            for record in response["Records"]:
                kinesis_records += 1
                data = record["Data"]
                aggregated += is_aggregated(data)
                for user in deaggregate(data, record["PartitionKey"]):
                    if user.data == WARM_UP:
                        continue
                    user_records += 1
                    if user.data[:1] != ID_PREFIX or len(user.data) != RECORD_SIZE:
                        foreign += 1
                        continue
                    i = int(user.data[1:10])
                    if not 0 <= i < records:
                        foreign += 1
                        continue
                    if seen[i]:
                        duplicates += 1
                    seen[i] = 1
                    keys_kept += user.partition_key == expected_keys[i]
                    if user.explicit_hash_key is not None:
                        hash_key = int(user.explicit_hash_key)
                    else:
                        hash_key = hashes.get(user.partition_key, -1)
                        if hash_key < 0:
                            digest = hashlib.md5(user.partition_key.encode()).digest()
                            hash_key = hashes[user.partition_key] = int.from_bytes(digest, "big")
                    in_range += low <= hash_key <= high
    return {
        "kinesis_records": kinesis_records,
        "aggregated_kinesis_records": aggregated,
        "user_records": user_records,
        "delivered": sum(seen),
        "duplicates": duplicates,
        "foreign": foreign,
        "keys_kept": keys_kept,
        "in_shard_range": in_range,
    }


# ---------------------------------------------------------------------------------------------
# the driver


def throttled_records(endpoint: str) -> int | None:
    """The emulator's count of throttled records, if this emulator keeps one."""
    try:
        from anykpl.emulator import EmulatorClient

        return int(EmulatorClient(endpoint).stats()["totals"]["throttled_records"])
    except Exception:
        return None


def run_contender(
    name: str,
    endpoint: str,
    stream: str,
    records: int,
    keys: int,
    timeout: float,
    timing: str = "open",
) -> dict[str, Any]:
    spec = {"contender": name, "endpoint": endpoint, "stream": stream}
    spec.update(records=records, keys=keys, timing=timing)
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": CREDENTIALS["aws_access_key_id"],
        "AWS_SECRET_ACCESS_KEY": CREDENTIALS["aws_secret_access_key"],
        "AWS_DEFAULT_REGION": REGION,
        "PYTHONWARNINGS": "ignore",
    }
    command = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return dict(json.loads(line[len(RESULT_TAG) :]))
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"exit {done.returncode}: {tail}"}


REFERENCES = (
    "anykpl-asyncio-await",
    "anykpl-trio-await",
    "anykpl-asyncio",
    "anykpl-trio",
    "anykpl-asyncio-batch",
    "anykpl-trio-batch",
)


def table(rows: list[dict[str, Any]]) -> str:
    rounds = max(row["round"] for row in rows)
    refs = [ref for ref in REFERENCES if any(row["contender"] == ref for row in rows)]
    header = ["round"] if rounds > 1 else []
    header += ["contender", "backend", "mode", "records", "seconds", "records/s", "CPU s"]
    header += ["delivered", "dup", "keys kept", "in shard range"]
    header += [f"{ref} ÷ this" for ref in refs]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        by_name = {r["contender"]: r for r in rows if r["round"] == row["round"]}
        _, backend, mode = CONTENDERS[row["contender"]]
        cells = [str(row["round"])] if rounds > 1 else []
        cells += [row["contender"], backend, mode, f"{row['records']:,}"]
        if "error" in row:
            cells += ["—", "—", "—", f"ERROR: {row['error']}"] + ["—"] * (3 + len(refs))
        else:
            check = row["check"]
            n = row["records"]
            delivered = f"{check['delivered']:,}/{n:,}"
            if check["delivered"] < n:
                delivered += " **LOST**"
            cells += [f"{row['seconds']:.2f}", f"{row['rps']:,.0f}", f"{row['cpu_seconds']:.2f}"]
            cells += [delivered, str(check["duplicates"]), f"{check['keys_kept'] / n:.0%}"]
            cells += [f"{check['in_shard_range'] / n:.0%}"]
            for ref in refs:
                if row["contender"] == ref or not by_name.get(ref, {}).get("rps"):
                    cells.append("—")
                else:
                    cells.append(f"{by_name[ref]['rps'] / row['rps']:.2f}×")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pair_ratios(rows: list[dict[str, Any]], pairs: list[tuple[str, str]]) -> dict[str, list[float]]:
    """``"a / b"`` -> a's records/s over b's in each round where both ran, for each ``(a, b)``
    of ``pairs``."""
    out: dict[str, list[float]] = {}
    for round_ in sorted({row["round"] for row in rows}):
        by_name = {r["contender"]: r for r in rows if r["round"] == round_ and r.get("rps")}
        for a, b in pairs:
            if a in by_name and b in by_name:
                out.setdefault(f"{a} / {b}", []).append(by_name[a]["rps"] / by_name[b]["rps"])
    return out


def ratios(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """``"ref / peer"`` -> that ratio of records/s in each round where both ran."""
    peers = [peer for peer in CONTENDERS if peer not in REFERENCES]
    return pair_ratios(rows, [(ref, peer) for peer in peers for ref in REFERENCES])


def backend_ratios(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """``"anykpl-trio-X / anykpl-asyncio-X"`` -> trio's records/s over asyncio's in the same
    mode, in each round where both ran."""
    trio = [name for name in CONTENDERS if name.startswith("anykpl-trio")]
    return pair_ratios(rows, [(name, name.replace("-trio", "-asyncio", 1)) for name in trio])


def verdict(pair: str, values: list[float], target: float | None) -> str:
    """One pair's ratios, their median, and in how many rounds they met ``target``."""
    line = f"{pair} = " + ", ".join(f"{v:.2f}×" for v in values)
    if len(values) > 1:
        line += f" (median {statistics.median(values):.2f}×)"
    if target is not None:
        met = sum(v >= target for v in values)
        line += f": ≥ {target:g}× bar met in {met} of {len(values)} round(s)"
    return line


def verdicts(rows: list[dict[str, Any]], build: str = "compiled") -> list[str]:
    """The bars' lines (``build``: anykpl's, as :func:`anykpl._compat.build_kind` says)."""
    out = [verdict(pair, values, TRIO_TARGET) for pair, values in backend_ratios(rows).items()]
    for pair, values in ratios(rows).items():
        reference, peer = pair.split(" / ")
        target = TARGETS.get(peer)
        if build != "compiled":
            target = PURE_TARGETS.get(peer, target)
        if target is not None and reference.endswith("-batch"):
            target = BATCH_TARGETS.get(peer, target)
        out.append(verdict(pair, values, target))
    for row in rows:
        check = row.get("check")
        if "error" in row:
            out.append(f"round {row['round']} {row['contender']}: FAILED, {row['error']}")
        elif check and (
            check["delivered"] < row["records"] or row["acknowledged"] < row["records"]
        ):
            line = (
                f"round {row['round']} {row['contender']}: FLAGGED, {row['acknowledged']:,} "
                f"acknowledged and {check['delivered']:,} delivered of {row['records']:,}"
            )
            sent = row.get("kinesis_records_acknowledged")
            if sent is not None and check["kinesis_records"] < sent:
                # the endpoint answered success for Kinesis records it does not hold: moto's
                # threaded server gives two PutRecords to one shard the same sequence number
                # when they run at once, the second record replacing the first (docs/emulator.md)
                line += (
                    f"; the endpoint acknowledged {sent:,} Kinesis records and holds "
                    f"{check['kinesis_records']:,}: it dropped "
                    f"{sent - check['kinesis_records']:,} it had acknowledged"
                )
            out.append(line)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, default=200_000, help="records for anykpl")
    parser.add_argument(
        "--peer-records",
        type=int,
        default=None,
        help="records for each peer (default: --records for async-kinesis with aggregation, "
        "30,000 for aiokpl and for async-kinesis without aggregation, which run at a few "
        "thousand records/s; records/s is what is compared)",
    )
    parser.add_argument("--keys", type=int, default=10_000, help="distinct partition keys")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument(
        "--contenders",
        default="anykpl-asyncio-await,anykpl-trio-await,anykpl-asyncio-batch,"
        "anykpl-trio-batch,async-kinesis,aiokpl",
        help=f"comma-separated, in run order, from: {', '.join(CONTENDERS)}",
    )
    parser.add_argument(
        "--with-plain", action="store_true", help="also run async-kinesis without aggregation"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="run every contender this many times, interleaved"
    )
    parser.add_argument(
        "--settle", type=float, default=3.0, help="idle seconds before each contender"
    )
    parser.add_argument(
        "--endpoint",
        default="emulator",
        type=check_endpoint,
        help=ENDPOINT_HELP,
    )
    parser.add_argument(
        "--timing",
        choices=["open", "warm"],
        default="open",
        help="open (the default): each contender's clock runs from opening its producer to its "
        "last result, as a user's program would; warm: from after a warm-up record and 0.5 s",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per contender")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return

    import boto3

    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    if args.with_plain and "async-kinesis-plain" not in names:
        names.append("async-kinesis-plain")
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        parser.error(f"unknown contenders: {', '.join(unknown)}")

    def records_for(name: str) -> int:
        if CONTENDERS[name][0] == "anykpl":
            return int(args.records)
        if args.peer_records is not None:
            return int(args.peer_records)
        return int(args.records) if name == "async-kinesis" else 30_000

    rows: list[dict[str, Any]] = []
    print(f"endpoint: {args.endpoint}", flush=True)
    with start_endpoint(args.endpoint) as endpoint:
        client = boto3.client("kinesis", region_name=REGION, endpoint_url=endpoint, **CREDENTIALS)
        for round_ in range(1, args.rounds + 1):
            shift = (round_ - 1) % len(names)  # the order rotates (see the module's docstring)
            for name in names[shift:] + names[:shift]:
                stream = f"compare-{round_}-{name}"
                client.create_stream(StreamName=stream, ShardCount=args.shards)
                client.get_waiter("stream_exists").wait(
                    StreamName=stream, WaiterConfig={"Delay": 0.2, "MaxAttempts": 100}
                )
                records = records_for(name)
                time.sleep(args.settle)  # let the emulator finish with the previous contender
                print(f"round {round_} {name}: {records:,} records ...", end=" ", flush=True)
                row: dict[str, Any] = {"round": round_, "contender": name, "stream": stream}
                row["records"] = records
                row.update(
                    run_contender(
                        name, endpoint, stream, records, args.keys, args.timeout, args.timing
                    )
                )
                if "error" not in row:
                    row["rps"] = row["acknowledged"] / row["seconds"]
                    row["check"] = read_back(client, stream, records, args.keys)
                    print(
                        f"{row['rps']:,.0f} records/s, {row['check']['delivered']:,} delivered",
                        flush=True,
                    )
                else:
                    print(row["error"], flush=True)
                rows.append(row)
        throttled = throttled_records(endpoint) if args.endpoint == "emulator" else None

    from anykpl._compat import build_kind

    build = build_kind()
    versions: dict[str, str | None] = {}
    for dist in ("anykpl", "aiokpl", "async-kinesis", "aws-kinesis-agg", "aiobotocore", "moto"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    print()
    print(table(rows))
    print()
    for line in verdicts(rows, build):
        print(line)
    if throttled is not None:
        print(f"emulator: {throttled} throttled records in the whole run (limits off)")
    print(
        f"python {sys.version.split()[0]}, anykpl's build: {build}, "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
    )
    if args.json:
        settings = {
            "keys": args.keys,
            "shards": args.shards,
            "record_size": RECORD_SIZE,
            "endpoint": args.endpoint,
        }
        with open(args.json, "w") as f:
            json.dump(
                {
                    "settings": settings,
                    "versions": versions,
                    "python": sys.version,
                    "rows": rows,
                    "ratios": ratios(rows),
                    "build": build,
                    "verdicts": verdicts(rows, build),
                    "emulator_throttled_records": throttled,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
