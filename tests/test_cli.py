"""The ``anykpl`` command line: subcommands are wired, and bad options fail clearly."""

from __future__ import annotations

import importlib.metadata
import re

import pytest

import anykpl
import anykpl._core._wire
from anykpl._commands.cli import _COMMANDS, main

COMMANDS = sorted(_COMMANDS)


def test_help_lists_every_command_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert set(COMMANDS) == {
        "emulator",
        "emulator-stats",
        "demo",
        "bench",
        "fleet-allocator",
        "fleet-table",
    }
    for command in COMMANDS:
        # "  name   help" or, for a long name, "  name" and the help on the next line
        assert re.search(rf"^    {command}\s+\S.{{10,}}$", out, flags=re.MULTILINE), command


def test_version_is_the_package_s(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    out = capsys.readouterr().out.strip()
    # and which build runs: the compiled modules are extension modules, not .py files
    compiled = not anykpl._core._wire.__file__.endswith(".py")
    assert out == f"anykpl {anykpl.__version__} ({'compiled' if compiled else 'pure Python'})"
    # one source: the installed distribution's metadata says the same
    assert importlib.metadata.version("anykpl") == anykpl.__version__


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_examples(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: anykpl {command}")
    examples = out.split("examples:\n", 1)[1]
    assert re.search(rf"^  anykpl {command}\b", examples, flags=re.MULTILINE)


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unknown_option_exits_2_and_names_it(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    required = {"fleet-allocator": ["--bucket", "b"], "fleet-table": ["create", "--table", "t"]}
    required_args = required.get(command, [])
    with pytest.raises(SystemExit) as exited:
        main([command, *required_args, "--no-such-option"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"anykpl {command}: error:" in err
    assert "--no-such-option" in err


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
        (["emulator", "--streams", "demo:many"], "'demo:many' is not NAME or NAME:SHARDS"),
        (["emulator", "--streams", "demo:0"], "'demo:0' is not NAME or NAME:SHARDS"),
        (["demo", "--devices", "lots"], "argument --devices: not a whole number: 'lots'"),
        (["demo", "--rate", "fast"], "argument --rate: not a number: 'fast'"),
        (["demo", "--rate", "-1"], "argument --rate: must be a positive number"),
        (["emulator-stats", "--watch", "0"], "argument --watch: must be above 0"),
        (["emulator-stats", "--watch", "soon"], "not a number of seconds: 'soon'"),
        (["emulator-stats", "--json", "--watch", "1"], "not allowed with argument"),
    ],
)
def test_bad_options_are_rejected_with_the_reason(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
