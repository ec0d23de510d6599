"""``modelrunner new-plugin KIND NAME [-o DIR]``."""

from __future__ import annotations

import argparse
from typing import Any

from .templates import KINDS


def add_parser(subparsers: Any) -> None:
    """Add ``new-plugin`` to the CLI."""
    parser = subparsers.add_parser("new-plugin", help="write a working skeleton of a plugin distribution")
    parser.add_argument("kind", help=f"one of: {', '.join(KINDS)}")
    parser.add_argument("name", help="lowercase name: the entry point, module suffix and registered name")
    parser.add_argument("-o", "--output", "--dir", dest="dir", default=".", metavar="DIR",
                        help="the folder to create modelrunner-NAME/ in (default: here)")


def run(args: argparse.Namespace) -> int:
    """Write the skeleton and say what to do next."""
    from . import new_plugin

    target = new_plugin(args.kind, args.name, args.dir)
    print(f"wrote {target}/ — next:\n"
          f"  pip install -e {target}\n"
          f"  modelrunner plugins            # lists {args.name}\n"
          f"  pytest {target}/tests          # its conformance suite\n"
          f"  modelrunner check {args.name}")
    return 0
