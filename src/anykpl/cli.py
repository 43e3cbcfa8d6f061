"""The ``anykpl`` command: ``anykpl emulator``, ``anykpl demo``, ``anykpl bench``.

Each subcommand lives in its own package (``anykpl.emulator``, ``anykpl.demo``,
``anykpl.bench``) and exposes ``add_arguments(parser)`` and ``run(args) -> int``; this module
only wires them together. The producer core never imports any of them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

_COMMANDS = {
    "emulator": ("anykpl.emulator.__main__", "a local Kinesis (and S3) that enforces shard limits"),
    "demo": ("anykpl.demo", "an IoT workload through the producer into the emulator, read back"),
    "bench": ("anykpl.bench", "measure shard throughput on the emulator: JSON, table, plot"),
    "fleet-allocator": ("anykpl.fleet_allocator", "allocate a fleet's cap over S3, standalone"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="anykpl", description="anykpl: a Kinesis producer for asyncio and trio, and its tools."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = {}
    for name, (module_name, help_text) in _COMMANDS.items():
        module = importlib.import_module(module_name)
        modules[name] = module
        sub = commands.add_parser(name, help=help_text, description=module.__doc__)
        module.add_arguments(sub)
    args = parser.parse_args(argv)
    result: int = modules[args.command].run(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
