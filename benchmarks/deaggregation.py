"""Deaggregation for consumers: ``anykpl.aggregation`` against AWS's ``aws_kinesis_agg``.

The same Lambda events (Kinesis records of ``--size``-byte user records under ``--keys``
partition keys, aggregated by anykpl's encoder into the KPL's 51,200-byte aggregates, 100 Kinesis
records per event, as a Kinesis trigger's default batch) are deaggregated by both, ``--rounds``
times, alternating; the best time of each is reported as user records per second, and both
must return the same user records (keys and data).

Run::

    python benchmarks/deaggregation.py
    python benchmarks/deaggregation.py --records 200000 --size 1000
"""

from __future__ import annotations

import argparse
import base64
import time
from typing import Any

from aws_kinesis_agg import deaggregator

from anykpl._core._wire import AggregateBuilder
from anykpl.aggregation import deaggregate_lambda_event

AGGREGATE_SIZE = 51_200


def events(records: int, size: int, keys: int, batch: int) -> list[dict[str, Any]]:
    aggregates: list[bytes] = []
    builder = AggregateBuilder()
    for i in range(records):
        key = f"device-{i % keys}"
        data = (f"{i:010d}" * (size // 10 + 1)).encode()[:size]
        if len(builder) and builder.size_with(key, None, len(data)) > AGGREGATE_SIZE:
            aggregates.append(builder.serialize())
            builder = AggregateBuilder()
        builder.add(key, None, data)
    if len(builder):
        aggregates.append(builder.serialize())
    entries = [
        {
            "eventSource": "aws:kinesis",
            "kinesis": {
                "kinesisSchemaVersion": "1.0",
                "partitionKey": "a",
                "sequenceNumber": str(index),
                "approximateArrivalTimestamp": 0.0,
                "data": base64.b64encode(aggregate).decode("ascii"),
            },
        }
        for index, aggregate in enumerate(aggregates)
    ]
    return [{"Records": entries[i : i + batch]} for i in range(0, len(entries), batch)]


def ours(batch: list[dict[str, Any]]) -> list[tuple[str, bytes]]:
    return [
        (record.partition_key, record.data)
        for event in batch
        for record in deaggregate_lambda_event(event)
    ]


def theirs(batch: list[dict[str, Any]]) -> list[tuple[str, bytes]]:
    return [
        (record["kinesis"]["partitionKey"], base64.b64decode(record["kinesis"]["data"]))
        for event in batch
        for record in deaggregator.deaggregate_records(event["Records"])
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000, help="user records")
    parser.add_argument("--size", type=int, default=100, help="bytes of data per user record")
    parser.add_argument("--keys", type=int, default=1000, help="distinct partition keys")
    parser.add_argument("--batch", type=int, default=100, help="Kinesis records per event")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    batch = events(args.records, args.size, args.keys, args.batch)
    kinesis_records = sum(len(event["Records"]) for event in batch)
    best = {"anykpl.aggregation": float("inf"), "aws_kinesis_agg": float("inf")}
    results: dict[str, list[tuple[str, bytes]]] = {}
    for _ in range(args.rounds):
        for name, function in (("anykpl.aggregation", ours), ("aws_kinesis_agg", theirs)):
            started = time.perf_counter()
            results[name] = function(batch)
            best[name] = min(best[name], time.perf_counter() - started)
    if results["anykpl.aggregation"] != results["aws_kinesis_agg"]:
        raise SystemExit("the two deaggregators disagree")
    print(
        f"{args.records:,} user records of {args.size} B in {kinesis_records:,} Kinesis "
        f"records, {len(batch)} Lambda events; best of {args.rounds}:"
    )
    for name, seconds in best.items():
        print(f"  {name:20} {seconds:7.3f} s  {args.records / seconds:12,.0f} user records/s")
    ratio = best["aws_kinesis_agg"] / best["anykpl.aggregation"]
    print(f"  anykpl.aggregation is {ratio:.1f}x as fast; both read the same user records")


if __name__ == "__main__":
    main()
