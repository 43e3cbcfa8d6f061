"""The ``anykpl`` command line: subcommands are wired, and bad options fail clearly."""

from __future__ import annotations

import pytest

from anykpl.cli import main


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for command in ("emulator", "demo", "bench"):
        assert command in out


def test_a_command_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([])
    assert exited.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["emulator", "--storm", "demo:1"], "is not stream:shard:start:duration"),
        (["emulator", "--reshard", "demo:explode:*:1"], "reshard action"),
        (["emulator", "--port", "many"], "invalid int value"),
        (["emulator", "--record-throttle-rate", "often"], "'often' is not a number"),
        (["emulator", "--record-throttle-rate", "1.5"], "1.5 is not between 0 and 1"),
    ],
)
def test_bad_emulator_options_are_rejected_with_the_reason(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
