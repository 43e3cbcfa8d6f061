"""The producer's own CPU per record, without a network: the same firehose workload as
``throughput.py`` (100-byte records, 2,000 keys, aggregation on, limits off) against an
in-process transport that answers every PutRecords at once. Best of ``--repeat`` runs, so the
figure is steady enough to compare two versions of the hot path on a busy machine.

    python benchmarks/hot_path.py --records 300000 --backend asyncio
    python benchmarks/hot_path.py --no-aggregation   # one Kinesis record per user record
    python benchmarks/hot_path.py --batch 500        # submit_many, 500 records a call
    python benchmarks/hot_path.py --await-each --keys 10000   # the idiomatic loop

Instructions per record, which the machine's load does not move: run it under callgrind with
``--repeat 1`` for 10,000 and for 30,000 records and divide the difference of the totals by
20,000 (``valgrind --tool=callgrind --callgrind-out-file=/dev/null python
benchmarks/hot_path.py --repeat 1 --records 10000 --await-each --keys 10000``).
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from functools import partial
from typing import Any

import anyio

from anykpl import PendingBatch, PendingRecord, Producer

STEP = (1 << 128) // 4


class _InstantKinesis:
    def __init__(self) -> None:
        self.sequence = 0

    async def put_records(self, stream: str, records: list[dict[str, Any]]) -> Any:
        await anyio.lowlevel.checkpoint()
        out = []
        for entry in records:
            self.sequence += 1
            shard = min(int(entry["ExplicitHashKey"]) // STEP, 3)
            out.append({"ShardId": f"shardId-{shard:012d}", "SequenceNumber": str(self.sequence)})
        return {"FailedRecordCount": 0, "Records": out}

    async def list_shards(self, **kwargs: Any) -> Any:
        return {
            "Shards": [
                {
                    "ShardId": f"shardId-{i:012d}",
                    "HashKeyRange": {
                        "StartingHashKey": str(i * STEP),
                        "EndingHashKey": str((i + 1) * STEP - 1 if i < 3 else (1 << 128) - 1),
                    },
                    "SequenceNumberRange": {"StartingSequenceNumber": "0"},
                }
                for i in range(4)
            ]
        }


async def run(
    records: int,
    aggregation: bool = True,
    batch: int = 0,
    keys_count: int = 2000,
    await_each: bool = False,
    **options: Any,
) -> float:
    data = b"x" * 100
    keys = [f"device-{i}" for i in range(keys_count)]
    async with Producer(
        transport=_InstantKinesis(), rate_limit=1e9, aggregation_enabled=aggregation, **options
    ) as producer:
        await producer.put_record("bench", data, partition_key="warm-up")
        cpu0 = time.process_time()
        window: deque[PendingRecord] = deque()
        failed = 0
        if await_each:
            # the idiomatic loop: a submit per record, then an await on every handle
            handles = [
                await producer.submit("bench", data, partition_key=keys[i % keys_count])
                for i in range(records)
            ]
            for handle in handles:
                failed += not (await handle).success
        elif batch:
            batches: deque[PendingBatch] = deque()
            for start in range(0, records, batch):
                items = [
                    (data, keys[i % keys_count]) for i in range(start, min(records, start + batch))
                ]
                batches.append(await producer.submit_many("bench", items))
                while batches and batches[0].done():
                    failed += batches.popleft().failed
            await producer.flush()
            failed += sum(len(b) - b.succeeded for b in batches)
        else:
            for i in range(records):
                window.append(
                    await producer.submit("bench", data, partition_key=keys[i % keys_count])
                )
                while window and window[0].done():
                    failed += not window.popleft().result().success
        await producer.flush()
        failed += sum(1 for p in window if not p.result().success)
        cpu = time.process_time() - cpu0
    assert failed == 0
    return cpu / records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=300_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument(
        "--no-aggregation",
        dest="aggregation",
        action="store_false",
        help="aggregation_enabled=False: one Kinesis record per user record",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=0,
        help="submit in batches of this many records with submit_many (0: one submit each)",
    )
    parser.add_argument("--keys", type=int, default=2000, help="distinct partition keys")
    parser.add_argument(
        "--await-each",
        action="store_true",
        help="the idiomatic loop: a submit per record, then an await on every handle",
    )
    parser.add_argument(
        "--features-off",
        action="store_true",
        help="adaptive=False and retry_budget=None: every rate-control feature beyond the KPL "
        "off (with no throttles they never act; this measures their bookkeeping)",
    )
    args = parser.parse_args()
    options = {"adaptive": False, "retry_budget": None} if args.features_off else {}
    best = min(
        anyio.run(
            partial(
                run,
                args.records,
                args.aggregation,
                args.batch,
                args.keys,
                args.await_each,
                **options,
            ),
            backend=args.backend,
        )
        for _ in range(args.repeat)
    )
    mode = "aggregation on" if args.aggregation else "aggregation off"
    if args.features_off:
        mode += ", rate-control features off"
    if args.batch:
        mode += f", submit_many of {args.batch}"
    if args.await_each:
        mode += ", submit then await each"
    print(
        f"{args.backend}, {mode}: {best * 1e6:.2f} µs CPU per record "
        f"(≈ {1 / best:,.0f} records/s per core, no network)"
    )


if __name__ == "__main__":
    main()
