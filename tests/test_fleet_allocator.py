"""``anykpl fleet-allocator``: its options, and the line it prints per generation (it is run
against the emulator in tests/integration/test_fleet.py)."""

from __future__ import annotations

import pytest

from anykpl._commands.cli import main
from anykpl._commands.fleet_allocator import describe
from anykpl._fleet import GrantsDocument, Outstanding, Rates, WorkerEntry


def test_the_command_is_listed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "fleet-allocator" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["fleet-allocator"], "--bucket"),
        (["fleet-allocator", "--bucket", "b-1", "--sync-interval", "soon"], "invalid float"),
    ],
)
def test_bad_options_are_rejected_by_the_parser(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ([], "records_per_second"),  # no cap at all
        (["--records-per-second", "-5"], "records_per_second"),
        (["--records-per-second", "10", "--lease", "0.01"], "lease"),
        (["--records-per-second", "10", "--sync-interval", "1", "--lease", "1.5"], "lease"),
        (["--records-per-second", "10", "--bootstrap-fraction", "2"], "bootstrap_fraction"),
        (["--records-per-second", "10", "--bootstrap-fraction", "0"], "bootstrap_fraction"),
        (["--records-per-second", "10", "--endpoint-url", "ftp://x"], "endpoint_url"),
    ],
)
def test_invalid_settings_exit_with_status_2_and_the_reason(
    extra: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["fleet-allocator", "--bucket", "bucket-1", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("anykpl fleet-allocator: ")
    assert field in err


def test_one_line_per_generation_with_the_sum_against_the_cap() -> None:
    document = GrantsDocument(
        generation=7,
        allocator="a",
        issued_at=100.0,
        expires_at=115.0,
        learning=True,
        cap=Rates(1000.0, None),
        workers={
            "w1": WorkerEntry(Rates(600.0, None), 6, (Outstanding(6, Rates(700, None), 110),)),
            "w2": WorkerEntry(Rates(300.0, None), 6),
            "gone": WorkerEntry(None, 5, (Outstanding(5, Rates(0.5, None), 105),)),
        },
    )
    line = describe(document)
    assert "generation 7 | 2 worker(s) | records/s [w1=600 w2=300] sum 900 of 1000" in line
    assert "(in force ≤ 1000)" in line
    assert "bytes/s" not in line
    assert line.endswith("| learning")


def test_the_line_of_a_starting_fleet_says_how_many_reported() -> None:
    document = GrantsDocument(
        generation=1,
        allocator="a",
        issued_at=100.0,
        expires_at=115.0,
        learning=False,
        cap=Rates(1000.0, None),
        workers={"w1": WorkerEntry(None, None), "w2": WorkerEntry(None, None)},
        fleet_size=2,
    )
    assert describe(document).endswith(
        "| generation 1 | 0 worker(s) | no grants yet: 2 worker(s) reported"
    )
