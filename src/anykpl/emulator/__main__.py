"""``python -m anykpl.emulator --port 4567``: serve the local endpoint until interrupted."""

from __future__ import annotations

import argparse
import logging

from . import serve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m anykpl.emulator", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4567)
    args = parser.parse_args(argv)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    serve(args.host, args.port)


if __name__ == "__main__":
    main()
