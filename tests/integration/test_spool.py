"""The durable spool (issue 15) against the emulator, with real processes killed by SIGKILL.

A child process (``spool_child.py``) submits records with a spool and dies by ``kill -9`` at
a chosen moment; a producer opened on the same directory sends what it finds; the stream is
read back and deaggregated, and every record whose ``submit`` had returned must be in it
(duplicates are counted, never a wrong byte). The other cases: records failed at close stay
for the next producer, ``spool_max_bytes`` is backpressure, a full disk, a directory that
cannot be written, and two producers on one directory.
"""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import struct
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import boto3
import pytest

from anykpl import PendingRecord, Producer, errors
from anykpl.emulator import Emulator, EmulatorClient, Faults

from .conftest import CREDENTIALS, REGION
from .spool_child import partition_key, payload
from .test_end_to_end import Sent, check_read_back, read_stream_async

pytestmark = pytest.mark.anyio

CHILD = Path(__file__).with_name("spool_child.py")
RECORDS = 12_000


def _stream() -> str:
    return f"spool-{random.randrange(1 << 32):08x}"


def _sent(records: int, size: int = 100) -> dict[int, Sent]:
    return {uid: Sent(uid, partition_key(uid), None, payload(uid, size)) for uid in range(records)}


async def _read_back(url: str, stream: str, sent: dict[int, Sent]) -> Counter[int]:
    client = boto3.client("kinesis", region_name=REGION, endpoint_url=url, **CREDENTIALS)
    return check_read_back(await read_stream_async(client, stream), sent)


async def _run_child(url: str, stream: str, tmp_path: Path, kill: str, backend: str) -> int:
    """Run the child until it dies; return how many of its submits had returned."""
    progress = tmp_path / "progress"
    command = [
        *(sys.executable, str(CHILD), "--endpoint", url, "--stream", stream),
        *("--spool-dir", str(tmp_path / "spool"), "--progress", str(progress)),
        *("--records", str(RECORDS), "--kill", kill, "--backend", backend),
    ]
    with anyio.fail_after(120):
        done = await anyio.run_process(command, check=False)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-3000:]
    return int(struct.unpack("<Q", progress.read_bytes())[0])


async def _recover(url: str, spool_dir: Path) -> tuple[list[PendingRecord], Any]:
    recovered: list[PendingRecord] = []
    async with Producer(
        region=REGION,
        endpoint_url=url,
        spool_dir=spool_dir,
        on_recovered=recovered.append,
        **CREDENTIALS,
    ) as producer:
        with anyio.fail_after(60):
            await producer.flush()
        stats = producer.statistics().spool
    return recovered, stats


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kill", ["after:3000", "append:7000", "request:1", "end"])
async def test_every_record_whose_submit_returned_survives_kill_9(
    kill: str, tmp_path: Path, anyio_backend_name: str
) -> None:
    stream = _stream()
    with Emulator(streams={stream: 4}) as url:
        returned = await _run_child(url, stream, tmp_path, kill, anyio_backend_name)
        if kill.startswith("after:"):
            assert returned == int(kill.split(":")[1])
        elif kill == "end":
            assert returned == RECORDS
        assert returned > 0
        spool_dir = tmp_path / "spool"
        assert any(p.suffix == ".seg" for p in spool_dir.iterdir())
        recovered, stats = await _recover(url, spool_dir)
        sent = _sent(RECORDS)
        arrived = await _read_back(url, stream, sent)
    missing = [uid for uid in range(returned) if not arrived[uid]]
    assert not missing, f"{len(missing)} records whose submit returned are missing"
    # every recovered record was delivered, and its hook ran once
    assert len(recovered) == stats.recovered > 0
    assert all(p.result().success for p in recovered)
    assert stats.recovered_delivered == stats.recovered
    assert stats.recovered_failed == 0
    duplicates = sum(count - 1 for count in arrived.values() if count > 1)
    if kill.startswith("request:"):
        # the killed request's records were in the stream already: sent again, counted here
        assert duplicates > 0
    assert duplicates <= stats.recovered
    if kill.startswith("append:"):
        assert stats.corrupt_entries == 1  # the torn entry, skipped, never replayed
        assert not arrived[returned]  # the torn record itself (its submit never returned)
    # nothing outstanding: the directory holds the lock file only
    assert sorted(p.name for p in spool_dir.iterdir()) == ["LOCK"]
    assert stats.bytes == 0 or stats.segments <= 1


@pytest.mark.timeout(60)
async def test_records_failed_at_close_stay_spooled_for_the_next_producer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stream = _stream()
    spool_dir = tmp_path / "spool"
    sent = _sent(500)
    with Emulator(streams={stream: 2}) as url:
        options = {"region": REGION, "endpoint_url": url, "spool_dir": spool_dir, **CREDENTIALS}
        # held in the aggregator for 60 s (the KPL's batching), and a close that does not
        # wait: they fail at close
        async with Producer(
            record_max_buffered_time=60.0,
            record_ttl=120.0,
            close_timeout=0.0,
            adaptive_batching=False,
            **options,
        ) as producer:
            handles = [
                await producer.submit(stream, s.data, s.partition_key) for s in sent.values()
            ]
        for handle in handles:
            with pytest.raises(errors.RecordFailedError) as failed:
                handle.result()
            assert failed.value.error_code == errors.PRODUCER_CLOSED
            assert "stays in the spool" in str(failed.value)
        assert any(p.suffix == ".seg" for p in spool_dir.iterdir())
        with caplog.at_level(logging.INFO, logger="anykpl.spool"):
            recovered, stats = await _recover(url, spool_dir)
        arrived = await _read_back(url, stream, sent)
    assert stats.recovered == len(recovered) == 500
    assert set(arrived) == set(sent)
    assert max(arrived.values()) == 1
    assert "every recovered record is terminal: 500 delivered, 0 failed" in caplog.text
    assert sorted(p.name for p in spool_dir.iterdir()) == ["LOCK"]


@pytest.mark.timeout(60)
async def test_spool_max_bytes_is_backpressure(tmp_path: Path) -> None:
    stream = _stream()
    spool_dir = tmp_path / "spool"
    # every PutRecords answered 3 s late: records stay outstanding, and spooled, meanwhile
    with Emulator(streams={stream: 2}, faults=Faults(latency=3.0)) as url:
        async with Producer(
            region=REGION,
            endpoint_url=url,
            spool_dir=spool_dir,
            spool_max_bytes=4 * 1024 * 1024,  # 16 segments of 256 KiB
            admission_timeout=0.5,
            # no backlog limits: neither the shards' nor what the path has proven (a path
            # answering 3 s late proves little in 0.5 s), so that the spool is what fills
            max_outstanding_time=math.inf,
            **CREDENTIALS,
        ) as producer:
            handles: list[PendingRecord] = []

            async def fill() -> None:
                for i in range(1000):
                    handles.append(await producer.submit(stream, b"x" * 20_000, f"k{i}"))

            with pytest.raises(errors.BackpressureTimeout, match="spool_max_bytes=4194304"):
                await fill()
            full = producer.statistics().spool
            assert full is not None
            assert full.bytes <= 4 * 1024 * 1024
            assert 150 < len(handles) < 210, len(handles)
            EmulatorClient(url).clear_faults()
            await producer.flush()
            assert all(h.result().success for h in handles)
            # room again, and the disk is back to one (empty) segment
            emptied = producer.statistics().spool
            assert emptied is not None
            assert emptied.records == 0
            assert emptied.segments <= 1
            await producer.put_record(stream, b"y" * 20_000, "after")


async def test_two_producers_on_one_directory(tmp_path: Path) -> None:
    spool_dir = tmp_path / "spool"
    with Emulator(streams={}) as url:
        options = {"region": REGION, "endpoint_url": url, "spool_dir": spool_dir, **CREDENTIALS}
        async with Producer(**options):
            with pytest.raises(errors.SpoolLockedError, match=f"process {os.getpid()}"):
                async with Producer(**options):
                    pass  # pragma: no cover
            # another process too
            probe = textwrap.dedent(
                f"""
                from anykpl._runtime._spool import Spool
                from anykpl import errors
                try:
                    Spool({str(spool_dir)!r}, 1 << 30).open()
                except errors.SpoolLockedError as exc:
                    print(exc)
                """
            )
            out = await anyio.run_process([sys.executable, "-c", probe])
            assert f"in use by process {os.getpid()}" in out.stdout.decode()
        # closed: the directory is free again
        async with Producer(**options):
            pass


async def test_a_lock_left_by_a_dead_process_is_taken_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool_dir = tmp_path / "spool"
    holder = textwrap.dedent(
        f"""
        import os, signal
        from anykpl._runtime._spool import Spool
        Spool({str(spool_dir)!r}, 1 << 30).open()
        print(os.getpid(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    out = await anyio.run_process([sys.executable, "-c", holder], check=False)
    assert out.returncode == -signal.SIGKILL
    dead = out.stdout.decode().strip()
    assert (spool_dir / "LOCK").read_text().strip() == dead
    with Emulator(streams={}) as url, caplog.at_level(logging.INFO, logger="anykpl.spool"):
        async with Producer(region=REGION, endpoint_url=url, spool_dir=spool_dir, **CREDENTIALS):
            assert (spool_dir / "LOCK").read_text().strip() == str(os.getpid())
    assert f"taking over from process {dead}" in caplog.text


async def test_a_directory_that_cannot_be_written_is_a_clear_error(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    targets = [(a_file / "spool", "cannot be created: Not a directory")]
    # /sys refuses new entries even to root
    targets.append((Path("/sys/anykpl-spool"), "cannot be created: Operation not permitted"))
    if os.geteuid() != 0:  # root writes anywhere a mode says it may not
        read_only = tmp_path / "read-only"
        read_only.mkdir()
        read_only.chmod(0o555)
        targets.append((read_only, "Permission denied"))
    with Emulator(streams={}) as url:
        for target, reason in targets:
            with pytest.raises(errors.SpoolError, match=f"spool_dir '{target}'.*{reason}"):
                async with Producer(
                    region=REGION, endpoint_url=url, spool_dir=target, **CREDENTIALS
                ):
                    pass  # pragma: no cover


_FULL_DISK = textwrap.dedent(
    """
    import resource, signal, sys, anyio
    from anykpl import Producer, errors
    # the file size limit stands in for a full disk: allocating past it fails with EFBIG
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024 * 1024, 1024 * 1024))
    async def main():
        handles = []
        async with Producer(region="us-east-1", endpoint_url=sys.argv[1],
                            aws_access_key_id="t", aws_secret_access_key="t",
                            spool_dir=sys.argv[2], spool_max_bytes=64 << 20,
                            record_max_buffered_time=60.0, record_ttl=120.0,
                            adaptive_batching=False) as producer:
            try:
                for i in range(100_000):
                    data = b"%07d|" % i + b"." * 992
                    handles.append(await producer.submit(sys.argv[3], data, "k%d" % i))
            except errors.SpoolError as exc:
                print("refused after", len(handles), exc, flush=True)
            await producer.flush()
            print("delivered", sum(h.result().success for h in handles), flush=True)
    anyio.run(main)
    """
)


async def test_a_full_disk_refuses_the_record_and_loses_nothing(tmp_path: Path) -> None:
    stream = _stream()
    with Emulator(streams={stream: 2}) as url:
        out = await anyio.run_process(
            [sys.executable, "-c", _FULL_DISK, url, str(tmp_path / "spool"), stream],
            check=True,
        )
        lines = out.stdout.decode().splitlines()
        assert lines[0].startswith("refused after "), lines
        admitted = int(lines[0].split()[2])
        assert "the disk or the file size limit is full" in lines[0]
        assert "the record was not admitted" in lines[0]
        assert lines[1] == f"delivered {admitted}"
        sent = {i: Sent(i, f"k{i}", None, b"%07d|" % i + b"." * 992) for i in range(admitted + 1)}
        arrived = await _read_back(url, stream, sent)
    assert set(arrived) == set(range(admitted))  # every admitted record, and not the refused one
