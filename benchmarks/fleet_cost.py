"""What a fleet costs in store requests, on S3 and on DynamoDB (issue 31, item 3).

Runs the fleet simulation (``fleet_scale.py``: the real worker and allocator code on a virtual
clock, a store that keeps up) for 10, 100 and 1,000 members at the default 5 s interval, all
joined within 5 s and then steady, and counts the requests the members made in the last
minute, by kind. Those are the same calls on either store (the members do not know which one
they talk to): a PUT, GET, LIST or DELETE of S3 is a PutItem, GetItem, Query or DeleteItem of
DynamoDB. Priced at published on-demand list prices (us-east-1):

* S3 Standard: PUT and LIST $0.005, GET $0.0004 per 1,000 requests; DELETE free.
* DynamoDB on demand: $0.625 per million write request units (one per KB written), $0.125
  per million read request units (one per 4 KB read, strongly consistent); a Query reads
  every item of the fleet's reports. The grants item's size is that of a document whose every
  worker has a grant of its own (distinct rates in both dimensions, as uneven demand gives),
  zlib-compressed as the DynamoDB store writes it: larger than the simulation's, whose
  workers often get equal shares.

10,000 members are not simulated (an hour of CPU); their line scales the 1,000-member counts
by ten, and the grants document from its measured size per worker.

    python benchmarks/fleet_cost.py
"""

from __future__ import annotations

import math
import random
import sys
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fleet_scale

S3_PRICE = {"PutObject": 0.005e-3, "ListObjectsV2": 0.005e-3, "GetObject": 0.0004e-3}
WRU, RRU = 0.625e-6, 0.125e-6
REPORT_ITEM = 400  # bytes: a report (compressed) with its key and attributes
ITEM_OVERHEAD = 120  # bytes: a grants item's key and attributes beside its body


def measure(members: int) -> dict[str, Any]:
    args = fleet_scale.parse(
        [
            *("--members", str(members), "--store-rate", "100000", "--offer", "30"),
            *("--join", "5", "--duration", "120", "--cap", str(5 * members)),
        ]
    )
    args.crash = None
    return fleet_scale.run(args)


def grants_size(members: int) -> int:
    """The compressed size of a grants document of ``members`` distinct grants."""
    from anykpl._fleet import GrantsDocument, Outstanding, Rates, WorkerEntry
    from anykpl._fleet._allocation import _short
    from anykpl._fleet._documents import INCARNATION_TAG

    rng = random.Random(members)
    workers = {}
    for _ in range(members):
        records, nbytes = _short(rng.uniform(1, 100)), _short(rng.uniform(1e3, 1e5))
        workers[f"worker-{rng.getrandbits(48):012x}"] = WorkerEntry(
            grant=Rates(records, nbytes),
            incarnation=f"{rng.getrandbits(4 * INCARNATION_TAG):0{INCARNATION_TAG}x}",
            acked=4021,
            outstanding=(
                Outstanding(4021, Rates(_short(records * 1.1), _short(nbytes * 1.1)), 1.8e9),
            ),
        )
    document = GrantsDocument(
        generation=4022,
        allocator="worker-000000000000",
        issued_at=1.8e9,
        expires_at=1.8e9 + 20,
        learning=False,
        cap=Rates(5000.0, 5e6),
        workers=workers,
        fleet_size=members,
        sync_interval=5.0,
        bootstrap_fraction=0.04,
        leftover_after=150.0,
    )
    return len(zlib.compress(document.to_json()))


def priced(members: int, per_minute: dict[str, float], grants_bytes: int) -> dict[str, float]:
    s3 = sum(count * S3_PRICE.get(kind, 0.0) for kind, count in per_minute.items())
    grants_kb = math.ceil((grants_bytes + ITEM_OVERHEAD) / 1024)
    grants_reads = math.ceil((grants_bytes + ITEM_OVERHEAD) / 4096)
    # of the GETs, one per worker per cycle reads the grants, one per report the allocator
    cycles = per_minute.get("PutObject", 0.0) / (members + 2)
    grants_gets = members * cycles
    report_gets = max(0.0, per_minute.get("GetObject", 0.0) - grants_gets)
    query_units = math.ceil(members * REPORT_ITEM / 4096)
    write_units = (per_minute.get("PutObject", 0.0) - cycles) * 1 + cycles * grants_kb
    write_units += per_minute.get("DeleteObject", 0.0)
    read_units = grants_gets * grants_reads + report_gets
    read_units += per_minute.get("ListObjectsV2", 0.0) * query_units
    return {"s3": s3, "dynamodb": write_units * WRU + read_units * RRU}


def main() -> int:
    print(
        "| members | requests/min (PUT, GET, LIST) | grants document | S3 $/min | DynamoDB $/min |"
    )
    print("|---:|---|---:|---:|---:|")
    per_worker: dict[str, float] = {}
    document_per_worker = 0.0
    for members in (10, 100, 1000):
        result = measure(members)
        per_minute = {k: float(v) for k, v in result["last_minute_by_kind"].items()}
        compressed = max(result["grants_document_compressed_bytes"], grants_size(members))
        row(members, per_minute, compressed)
        per_worker = {k: v / members for k, v in per_minute.items()}
        document_per_worker = compressed / members
    ten_thousand = {k: v * 10_000 for k, v in per_worker.items()}
    row(10_000, ten_thousand, max(int(document_per_worker * 10_000), grants_size(10_000)), True)
    return 0


def row(members: int, per_minute: dict[str, float], grants: int, scaled: bool = False) -> None:
    cost = priced(members, per_minute, grants)
    counts = ", ".join(
        f"{per_minute.get(k, 0.0):,.0f}" for k in ("PutObject", "GetObject", "ListObjectsV2")
    )
    note = " (scaled)" if scaled else ""
    print(
        f"| {members:,}{note} | {counts} | {grants / 1024:,.0f} KB | "
        f"${cost['s3']:.4f} | ${cost['dynamodb']:.4f} |"
    )


if __name__ == "__main__":
    sys.exit(main())
