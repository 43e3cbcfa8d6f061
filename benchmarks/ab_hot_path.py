"""A/B the producer's hot path against another version of anykpl, in one process.

Separate runs on a shared 2-core machine vary by ±20 %, too much to see a few per cent. This
loads a second copy of the package (another checkout's ``src/anykpl``, as ``anykpl_base``) next
to this one and runs ``hot_path.py``'s workload with each, alternately, ``--rounds`` times, so
both see the same machine at the same moments. It prints the CPU per record of each and the
median of the per-round ratios. ::

    git worktree add /tmp/base 3309ce8
    python benchmarks/ab_hot_path.py /tmp/base/src --rounds 10
    python benchmarks/ab_hot_path.py /tmp/base/src --await-each   # the idiomatic loop
    python benchmarks/ab_hot_path.py /tmp/base/src --option adaptive=False \
        --option retry_budget=None
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio

import anykpl
from hot_path import _InstantKinesis  # type: ignore[import-not-found]


def load_base(src: Path) -> ModuleType:
    """Import ``src/anykpl`` under the name ``anykpl_base`` (its relative imports follow)."""
    spec = importlib.util.spec_from_file_location(
        "anykpl_base",
        src / "anykpl" / "__init__.py",
        submodule_search_locations=[str(src / "anykpl")],
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["anykpl_base"] = module
    spec.loader.exec_module(module)
    return module


async def run(
    package: ModuleType,
    records: int,
    aggregation: bool,
    options: dict[str, Any],
    await_each: bool = False,
) -> float:
    data = b"x" * 100
    keys = [f"device-{i}" for i in range(2000)]
    async with package.Producer(
        transport=_InstantKinesis(), rate_limit=1e9, aggregation_enabled=aggregation, **options
    ) as producer:
        await producer.put_record("bench", data, partition_key="warm-up")
        cpu0 = time.process_time()
        if await_each:
            # the idiomatic loop: a submit per record, then an await on every handle
            handles = [
                await producer.submit("bench", data, partition_key=keys[i % 2000])
                for i in range(records)
            ]
            for handle in handles:
                await handle
            return (time.process_time() - cpu0) / records
        window: deque[Any] = deque()
        for i in range(records):
            window.append(await producer.submit("bench", data, partition_key=keys[i % 2000]))
            while window and window[0].done():
                window.popleft().result()
        await producer.flush()
        for record in window:
            record.result()
        return (time.process_time() - cpu0) / records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base_src", type=Path, help="the other checkout's src/ folder")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--no-aggregation", dest="aggregation", action="store_false")
    parser.add_argument(
        "--await-each",
        action="store_true",
        help="the idiomatic loop: submit every record, then await every handle (held meanwhile)",
    )
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a ProducerConfig override for this version only (a Python literal)",
    )
    args = parser.parse_args()
    options = {}
    for item in args.option:
        name, _, value = item.partition("=")
        options[name] = ast.literal_eval(value)
    base = load_base(args.base_src)
    this_cpu, base_cpu, ratios = [], [], []
    for round_number in range(args.rounds):
        # alternate which goes first, so neither always runs on a warmer (or busier) machine
        order = [(anykpl, options), (base, {})]
        if round_number % 2:
            order.reverse()
        cpu = {
            package.__name__: anyio.run(
                run,
                package,
                args.records,
                args.aggregation,
                opts,
                args.await_each,
                backend=args.backend,
            )
            for package, opts in order
        }
        mine, theirs = cpu["anykpl"], cpu["anykpl_base"]
        this_cpu.append(mine)
        base_cpu.append(theirs)
        ratios.append(mine / theirs)
    print(
        f"{args.backend}, aggregation {'on' if args.aggregation else 'off'}, "
        f"{'submit then await each' if args.await_each else 'window'}, options {options}: "
        f"this {statistics.median(this_cpu) * 1e6:.2f} µs, base "
        f"{statistics.median(base_cpu) * 1e6:.2f} µs per record (medians of {args.rounds}); "
        f"per-round ratio this/base: median {statistics.median(ratios):.3f}, "
        f"range {min(ratios):.3f}–{max(ratios):.3f}"
    )


if __name__ == "__main__":
    main()
