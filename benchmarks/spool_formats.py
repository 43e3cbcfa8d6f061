"""How to keep records on disk so that each survives ``kill -9`` once ``submit`` returns:
the spool's mmap'd segments against the alternatives (docs/spool.md says why it is the first).

For each way, µs per record to append ``--records`` records of ``--size`` bytes (each durable
against a crash of the process when its append returns, as ``submit`` promises) and to remove
them once terminal:

- ``mmap segments``: anykpl's spool (``Spool.append``; segments unlinked when done);
- ``os.write per record``: a plain log file, one ``write`` system call per record;
- ``sqlite3 WAL, commit per record``: the standard library's sqlite3, WAL mode,
  ``synchronous=OFF``, one INSERT and COMMIT per record, one DELETE per record;
- ``sqlite3 WAL, commit per 500``: the same with 500 records per transaction (what a batch
  call could do; a lone ``submit`` cannot).

    python benchmarks/spool_formats.py --records 200000
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import tempfile
import time
from collections.abc import Callable

from anykpl._core._records import Record
from anykpl._runtime._spool import Spool


def records(n: int, size: int) -> list[Record]:
    data = b"x" * size
    return [Record("stream", f"device-{i % 2000}", data, 0, None, 0, 0, 0) for i in range(n)]


def spool_way(directory: str, batch: list[Record]) -> tuple[float, float]:
    spool = Spool(directory, 1 << 34)
    spool.open()
    t0 = time.perf_counter()
    for r in batch:
        spool.append(r)
    t1 = time.perf_counter()
    for r in batch:
        segment = r.spool_segment
        assert segment is not None
        r.spool_segment = None
        spool.finished(segment, True)
    t2 = time.perf_counter()
    spool.close()
    return t1 - t0, t2 - t1


def write_way(directory: str, batch: list[Record]) -> tuple[float, float]:
    path = os.path.join(directory, "log")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    t0 = time.perf_counter()
    for r in batch:
        os.write(fd, r.partition_key.encode() + r.data)
    t1 = time.perf_counter()
    os.close(fd)
    os.unlink(path)
    return t1 - t0, time.perf_counter() - t1


def sqlite_way(every: int) -> Callable[[str, list[Record]], tuple[float, float]]:
    def run(directory: str, batch: list[Record]) -> tuple[float, float]:
        db = sqlite3.connect(os.path.join(directory, "spool.db"), isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=OFF")
        db.execute("CREATE TABLE r (id INTEGER PRIMARY KEY, k TEXT, d BLOB)")
        t0 = time.perf_counter()
        ids = []
        for start in range(0, len(batch), every):
            db.execute("BEGIN")
            for r in batch[start : start + every]:
                ids.append(
                    db.execute(
                        "INSERT INTO r (k, d) VALUES (?, ?)", (r.partition_key, r.data)
                    ).lastrowid
                )
            db.execute("COMMIT")
        t1 = time.perf_counter()
        for start in range(0, len(ids), every):
            db.execute("BEGIN")
            for i in ids[start : start + every]:
                db.execute("DELETE FROM r WHERE id = ?", (i,))
            db.execute("COMMIT")
        t2 = time.perf_counter()
        db.close()
        return t1 - t0, t2 - t1

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--size", type=int, default=100)
    args = parser.parse_args()
    ways = {
        "mmap segments": spool_way,
        "os.write per record": write_way,
        "sqlite3 WAL, commit per record": sqlite_way(1),
        "sqlite3 WAL, commit per 500": sqlite_way(500),
    }
    batch = records(args.records, args.size)
    here = os.path.dirname(os.path.abspath(__file__))
    print(f"{'way':32} {'append µs/record':>17} {'remove µs/record':>17}")
    for name, way in ways.items():
        with tempfile.TemporaryDirectory(dir=here) as directory:
            append, remove = way(directory, batch)
        n = args.records
        print(f"{name:32} {append / n * 1e6:17.2f} {remove / n * 1e6:17.2f}", flush=True)


if __name__ == "__main__":
    main()
