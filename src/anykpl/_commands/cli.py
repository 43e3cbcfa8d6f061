"""The ``anykpl`` command: ``anykpl emulator``, ``anykpl emulator-stats``, ``anykpl demo``,
``anykpl bench``, ``anykpl fleet-allocator``, ``anykpl fleet-table``.

Each subcommand lives in its own module (``anykpl.emulator``, ``anykpl._commands.demo``,
``anykpl._commands.bench``...) and exposes ``add_arguments(parser)`` and ``run(args) -> int``;
this module only wires them together, with one line of help and examples each. Exit status: what
the command returns (0 success, 1 a failed check), 2 for bad options (argparse's, as every
command says what is wrong), 130 when interrupted. The producer core never imports any of them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .. import __version__
from .._compat import build_kind

#: command -> (module, one line of help, examples for its --help; None: the module sets its own)
_COMMANDS = {
    "emulator": (
        "anykpl.emulator.__main__",
        "a local Kinesis (and S3) that enforces shard limits",
        """\
examples:
  anykpl emulator                                   # http://127.0.0.1:4567, no streams yet
  anykpl emulator --port 4600 --streams demo:4,logs:1
  anykpl emulator --streams demo:2 --record-throttle-rate 0.25   # throttles whatever the rate
  anykpl emulator --no-limits                       # accept any rate
""",
    ),
    "emulator-stats": (
        "anykpl._commands.emulator_stats",
        "what a running emulator has seen, per shard (table or --json)",
        """\
examples:
  anykpl emulator-stats                                  # the emulator on 127.0.0.1:4567
  anykpl emulator-stats --endpoint http://127.0.0.1:4600 --json | jq .totals
  anykpl emulator-stats --watch 2                        # again every 2 s, until Ctrl-C
  anykpl emulator-stats --reset                          # print, then zero the counters
""",
    ),
    "demo": (
        "anykpl._commands.demo",
        "an IoT workload through the producer into the emulator, read back",
        None,
    ),
    "bench": (
        "anykpl._commands.bench",
        "measure shard throughput on the emulator: JSON, table, plot",
        """\
examples:
  anykpl bench --quick                              # about a minute: 2 sizes, short cases
  anykpl bench                                      # every size, aggregation on and off
  anykpl bench --sizes 100,10000 --aggregation on --backend trio
  anykpl bench --quick --json > bench.json          # the results document on stdout
  anykpl bench --endpoint http://127.0.0.1:4567 --stream mine   # an endpoint of your own
""",
    ),
    "fleet-allocator": (
        "anykpl._commands.fleet_allocator",
        "allocate a fleet's cap over S3 or DynamoDB, standalone",
        """\
examples:
  anykpl fleet-allocator --bucket my-fleet --bytes-per-second 4000000
  anykpl fleet-allocator --bucket my-fleet --records-per-second 5000 \\
      --endpoint-url http://127.0.0.1:4567 --region us-east-1
  anykpl fleet-allocator --table my-fleets --prefix orders --records-per-second 5000
""",
    ),
    "fleet-table": (
        "anykpl._commands.fleet_table",
        "make the DynamoDB table a fleet can coordinate through",
        """\
examples:
  anykpl fleet-table create --table my-fleets --region eu-west-1
  anykpl fleet-table create --table fleet --endpoint-url http://127.0.0.1:4567 --region us-east-1
""",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The ``anykpl`` parser with every command (imports each command's module)."""
    parser = argparse.ArgumentParser(
        prog="anykpl",
        description="anykpl: a Kinesis producer for asyncio and trio, and its tools.",
        epilog="Run 'anykpl COMMAND --help' for a command's options and examples.",
    )
    parser.add_argument(
        "--version", action="version", version=f"anykpl {__version__} ({build_kind()})"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text, examples) in _COMMANDS.items():
        module = importlib.import_module(module_name)
        sub = commands.add_parser(
            name,
            help=help_text,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sub.set_defaults(_module=module, _parser=sub)
        module.add_arguments(sub)
        if examples is not None:
            sub.epilog = examples
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # said by the command's own parser, with its usage (argparse's top-level parser
        # would name only "anykpl")
        args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        result: int = args._module.run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return result


if __name__ == "__main__":
    sys.exit(main())
