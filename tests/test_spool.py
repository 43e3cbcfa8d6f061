"""The spool's file format and recovery, on real files: entries written and read back, torn
and corrupt entries skipped (never replayed), stale entries after a segment starts over, and
segments released once their records are terminal."""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import pytest

from anykpl import errors
from anykpl._core._records import Record
from anykpl._core._spool_format import (
    ENTRY_HEADER_SIZE,
    FILE_HEADER_SIZE,
    RecoveredEntry,
    parse_segment,
)
from anykpl._runtime._spool import Spool, SpoolSyncer

MAX = 64 * 1024 * 1024


def record(i: int, *, ehk: str | None = None, tenant: str | None = None) -> Record:
    data = f"{i:07d}|".encode().ljust(50 + i % 7, b".")
    r = Record("stream", f"kéy-{i}", data, 0, ehk, 0.0, 0.0, 0.0)
    r.tenant = tenant
    return r


def entry_of(r: Record) -> RecoveredEntry:
    return RecoveredEntry(r.stream, r.partition_key, r.explicit_hash_key, r.tenant, r.data)


def spool_with(directory: Path, records: list[Record]) -> Spool:
    spool = Spool(directory, MAX)
    assert spool.open() == []
    for r in records:
        spool.append(r)
    return spool


def finish(spool: Spool, records: list[Record], success: bool) -> None:
    """What ``Intake.finish`` does for spooled records."""
    for r in records:
        segment = r.spool_segment
        assert segment is not None
        r.spool_segment = None
        spool.finished(segment, success)


def crash(spool: Spool) -> None:
    """Leave the files as a killed process would: mapped pages written, nothing removed."""
    for segment in spool.segments.values():
        if segment.mm is not None:
            segment.mm.close()
            segment.mm = None
    spool.segments.clear()
    spool.close()


def test_entries_are_read_back_as_written(tmp_path: Path) -> None:
    records = [record(i) for i in range(100)]
    records.append(record(100, ehk="12345678901234567890", tenant="tenant-ü"))
    crash(spool_with(tmp_path, records))
    again = Spool(tmp_path, MAX)
    [recovered] = again.open()
    assert list(recovered.entries) == [entry_of(r) for r in records]
    assert recovered.corrupt == 0
    assert again.corrupt_entries == 0
    assert again.statistics().recovered == 101


def test_a_corrupt_entry_is_skipped_and_the_entries_after_it_are_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    records = [record(i) for i in range(10)]
    spool = spool_with(tmp_path, records)
    segment = spool.active
    assert segment is not None
    assert segment.mm is not None
    # flip one byte of the fourth record's data
    offset = FILE_HEADER_SIZE
    for _r in records[:3]:
        offset += ENTRY_HEADER_SIZE + (segment.mm[offset + 8] | segment.mm[offset + 9] << 8)
    segment.mm[offset + ENTRY_HEADER_SIZE + 20] ^= 0xFF
    crash(spool)
    with caplog.at_level(logging.WARNING, logger="anykpl.spool"):
        [recovered] = Spool(tmp_path, MAX).open()
    assert list(recovered.entries) == [entry_of(r) for i, r in enumerate(records) if i != 3]
    assert recovered.corrupt == 1
    assert "1 torn or corrupt entry; skipped (never replayed)" in caplog.text


def test_a_torn_tail_is_truncated_and_counted(tmp_path: Path) -> None:
    records = [record(i) for i in range(5)]
    spool = spool_with(tmp_path, records)
    segment = spool.active
    assert segment is not None
    assert segment.mm is not None
    segment.mm[segment.pos - 10 : segment.pos] = b"\0" * 10  # the last copy cut short
    path = segment.path
    crash(spool)
    again = Spool(tmp_path, MAX)
    [recovered] = again.open()
    assert list(recovered.entries) == [entry_of(r) for r in records[:4]]
    assert again.corrupt_entries == 1
    assert path.stat().st_size < 4096  # the tail (and the unused space) are gone


def test_a_segment_that_started_over_replays_only_its_new_entries(tmp_path: Path) -> None:
    old = [record(i) for i in range(20)]
    spool = spool_with(tmp_path, old)
    finish(spool, old, True)  # all terminal: the active segment starts over
    assert spool.records == 0
    new = [record(100 + i) for i in range(3)]
    for r in new:
        spool.append(r)
    crash(spool)
    again = Spool(tmp_path, MAX)
    [recovered] = again.open()
    assert list(recovered.entries) == [entry_of(r) for r in new]
    assert again.corrupt_entries == 0


def test_files_that_are_not_segments_do_not_stop_the_start(tmp_path: Path) -> None:
    (tmp_path / "0000000000000001.seg").write_bytes(b"garbage" * 1000)
    (tmp_path / "0000000000000002.seg").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("left alone")
    spool = Spool(tmp_path, MAX)
    assert spool.open() == []
    assert spool.corrupt_entries == 1
    # the unreadable one is set aside, never deleted; the empty one goes
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "0000000000000001.seg.unreadable",
        "LOCK",
        "notes.txt",
    ]
    # new segments are numbered after the old ones
    spool.append(record(1))
    assert spool.active is not None
    assert spool.active.sequence == 3


def test_parse_segment_of_random_bytes_finds_nothing() -> None:
    import random

    rng = random.Random(5)
    content = bytes(rng.randrange(256) for _ in range(200_000))
    assert parse_segment(content)[0] == []


def test_recovered_segments_go_once_their_records_are_terminal(tmp_path: Path) -> None:
    records = [record(i) for i in range(3000)]  # more than one segment of 256 KiB
    spool = Spool(tmp_path, 4 * 1024 * 1024)
    spool.open()
    for r in records:
        spool.append(r)
    assert len(spool.segments) > 1
    crash(spool)
    again = Spool(tmp_path, 4 * 1024 * 1024)
    recovered = again.open()
    assert sum(len(r.entries) for r in recovered) == 3000
    handles = []
    for batch in recovered:
        for _ in batch.entries:
            r = record(0)
            r.spool_segment = batch.segment
            handles.append(r)
    finish(again, handles[:-1], True)
    assert len(list(tmp_path.glob("*.seg"))) == 1
    finish(again, handles[-1:], False)
    assert list(tmp_path.glob("*.seg")) == []
    stats = again.statistics()
    assert (stats.recovered_delivered, stats.recovered_failed, stats.bytes) == (2999, 1, 0)


def test_a_second_spool_on_the_directory_is_refused(tmp_path: Path) -> None:
    first = Spool(tmp_path, MAX)
    first.open()
    with pytest.raises(errors.SpoolLockedError, match="in use by process"):
        Spool(tmp_path, MAX).open()
    first.close()
    Spool(tmp_path, MAX).open()


def test_a_damaged_file_header_sets_the_segment_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool = spool_with(tmp_path, [record(i) for i in range(10)])
    segment = spool.active
    assert segment is not None
    assert segment.mm is not None
    segment.mm[12] ^= 0x01  # one bit of the generation
    path = segment.path
    crash(spool)
    again = Spool(tmp_path, MAX)
    with caplog.at_level(logging.ERROR, logger="anykpl.spool"):
        assert again.open() == []
    assert again.corrupt_entries == 1
    assert not path.exists()
    assert path.with_name(path.name + ".unreadable").exists()
    assert "not a readable segment" in caplog.text


def test_a_torn_first_append_after_a_start_over_is_not_corruption(tmp_path: Path) -> None:
    old = [record(i) for i in range(20)]
    spool = spool_with(tmp_path, old)
    finish(spool, old, True)  # starts over
    segment = spool.active
    assert segment is not None
    assert segment.mm is not None
    # the next append is cut short before its header is written: its body only
    segment.mm[FILE_HEADER_SIZE + ENTRY_HEADER_SIZE : FILE_HEADER_SIZE + 60] = b"z" * 44
    crash(spool)
    again = Spool(tmp_path, MAX)
    assert again.open() == []
    assert again.corrupt_entries == 0


@pytest.mark.anyio
async def test_commit_waiters_are_released_when_the_syncer_stops(tmp_path: Path) -> None:

    spool = Spool(tmp_path, MAX, fsync="commit")
    spool.open()
    syncer = SpoolSyncer(spool, 1.0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(syncer.run)
        await anyio.lowlevel.checkpoint()
        spool.append(record(1))
        await syncer.wait()  # a sync ran for it
        assert syncer.synced == 1
        assert spool.syncs == 1
        tg.cancel_scope.cancel()
    spool.append(record(2))
    with anyio.fail_after(5):
        await syncer.wait()  # nobody syncs any more: it returns instead of hanging
    assert syncer.stopped
    spool.close()
