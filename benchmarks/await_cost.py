"""The cost of ``await handle`` on a record whose result is already there.

The idiomatic loop awaits every handle after its ``submit`` loop, when most results are in:
this times that await alone, on 100,000 done records (no producer, no network), best of
``--passes`` passes, for each backend. ::

    python benchmarks/await_cost.py
    python benchmarks/await_cost.py --backend trio

The time moves with the machine. To count instructions instead (callgrind, not moved by the
machine's load), run it under valgrind with ``--passes 1`` and ``--passes 3`` and divide the
difference of the two totals by ``2 * --records``::

    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python benchmarks/await_cost.py --backend asyncio --passes 1
"""

from __future__ import annotations

import argparse
import time

import anyio

import anykpl
from anykpl._core._records import AttemptRecord, Record
from anykpl._runtime import _awaiting  # noqa: F401  # installs how records wait


def done_record() -> Record:
    record = Record("stream", "key", b"data", 1, None, 0.0, 1.0, 2.0)
    record.add_attempt(AttemptRecord(0.1, 0.2, True, None, None))
    record.resolve(True)
    return record


async def main(records: list[Record], passes: int) -> float:
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for record in records:
            await record
        best = min(best, time.perf_counter() - start)
    return best


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--backend", choices=("asyncio", "trio", "both"), default="both")
    args = parser.parse_args()
    records = [done_record() for _ in range(args.records)]
    backends = ("asyncio", "trio") if args.backend == "both" else (args.backend,)
    print(f"anykpl {anykpl.__version__}, {anykpl._compat.build_kind()} build")
    for backend in backends:
        seconds = anyio.run(main, records, args.passes, backend=backend)
        print(f"{backend}: {seconds / len(records) * 1e9:.0f} ns per await (best of {args.passes})")


if __name__ == "__main__":
    cli()
