"""Memory per outstanding record: admit ``--records`` 100-byte records into a producer whose
transport never answers, and measure what the producer holds per record (tracemalloc), beyond
the 100 bytes of data and the partition key the caller handed over.

The producer's caps are set so that they never bind: ``max_outstanding_records`` twice the
records (the last fifth of it is kept for quiet shards), and ``max_outstanding_time`` off
(``math.inf``), or admission would stop at what the silent path has proven it delivers
(about 8,000 of these records) and the rest wait at ``submit`` until records expire.

    python benchmarks/memory.py --records 100000
"""

from __future__ import annotations

import argparse
import gc
import math
import tracemalloc
from typing import Any

import anyio

from anykpl import Producer


class _SilentKinesis:
    """A transport with one 4-shard stream that accepts requests and never answers."""

    async def put_records(self, stream: str, records: list[dict[str, Any]]) -> Any:
        await anyio.sleep_forever()

    async def list_shards(self, **kwargs: Any) -> Any:
        step = (1 << 128) // 4
        return {
            "Shards": [
                {
                    "ShardId": f"shardId-{i:012d}",
                    "HashKeyRange": {
                        "StartingHashKey": str(i * step),
                        "EndingHashKey": str((i + 1) * step - 1),
                    },
                    "SequenceNumberRange": {"StartingSequenceNumber": "0"},
                }
                for i in range(4)
            ]
        }


async def measure(records: int) -> None:
    payloads = [i.to_bytes(4, "big") * 25 for i in range(records)]  # 100 bytes each
    keys = [f"device-{i % 2000}" for i in range(2000)]
    async with Producer(
        transport=_SilentKinesis(),
        max_outstanding_records=2 * records,
        max_outstanding_time=math.inf,
        close_timeout=0,
    ) as producer:
        await producer.submit("bench", b"warm-up", partition_key="warm-up")
        await anyio.sleep(0.5)  # shard map ready
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        handles = [
            await producer.submit("bench", payloads[i], partition_key=keys[i % 2000])
            for i in range(records)
        ]
        await anyio.sleep(0.5)  # let the aggregates seal and reach the (silent) sender
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        per_record = (after - before) / records
        print(
            f"{records} outstanding records: {after - before:,} bytes allocated, "
            f"{per_record:.0f} bytes per record (the 100-byte payloads were allocated before)"
        )
        del handles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=100_000)
    args = parser.parse_args()
    anyio.run(measure, args.records)


if __name__ == "__main__":
    main()
