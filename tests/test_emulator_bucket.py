"""The emulator's per-shard buckets (``anykpl.emulator._write_path._Bucket``): records of up to
1 MiB need their size in tokens; a larger one (a stream whose maximum record size was raised)
goes through once the bucket is full and leaves it in debt, which the rate pays back, and not
during a storm that cut the rate below 1 MiB/s."""

from __future__ import annotations

from anykpl.emulator._write_path import _Bucket

MiB = 1024 * 1024
RATES = (1000.0, float(MiB))  # the service's: 1,000 records/s and 1 MiB/s per shard


def test_a_large_record_bursts_into_debt_once_the_bucket_is_full() -> None:
    bucket = _Bucket(*RATES, 0.0)
    assert bucket.try_take(10 * MiB, *RATES, 0.0)  # full: it goes, 9 MiB in debt
    assert not bucket.try_take(100, *RATES, 8.0)  # the debt is paid back at 1 MiB/s
    assert bucket.try_take(100, *RATES, 9.5)
    # a record of 1 MiB or less never goes into debt
    bucket = _Bucket(*RATES, 0.0)
    assert bucket.try_take(MiB, *RATES, 0.0)
    assert not bucket.try_take(MiB, *RATES, 0.5)


def test_during_a_storm_a_large_record_waits_for_its_end() -> None:
    storm = (300.0, 0.3 * MiB)
    bucket = _Bucket(*RATES, 0.0)
    assert not bucket.try_take(2 * MiB, *storm, 0.0)  # cut below 1 MiB/s: no burst
    assert not bucket.try_take(2 * MiB, *storm, 5.0)
    assert bucket.try_take(2 * MiB, *RATES, 6.0)  # the storm is over and the bucket full
