"""The ``omni-trio`` command line.

Every argument is checked before anything starts. A bad one -- argparse's own
complaints included -- is one line on stderr naming the option and the rule, and exit
status 2: ``omni-trio demo: --concurrency must be a positive integer, got 0``.

Each command is a module of this package (``compare``, ``bench``, ``demo``, ``run``,
``serve``) holding its parser (``add_parser``), its checks and its body; what they
share is in ``_common``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from .._runtime import exits_on_interrupt
from . import bench, compare, demo, run, serve, simulate, talk
from ._common import Parser, UsageError

__all__ = ["main"]

#: The commands, in the order ``--help`` lists them.
_COMMANDS = (compare, bench, demo, run, serve, simulate, talk)


@exits_on_interrupt
def main(argv: Sequence[str] | None = None) -> int:
    """Run ``omni-trio ARGV`` (default: ``sys.argv[1:]``); return its exit status (2 for
    a bad argument, whose one line is on stderr; 0 after ``--help`` or ``--version``)."""
    try:
        args = _parse(argv)
    except SystemExit as exit:  # argparse's way out, and ours for a failed check
        return exit.code if isinstance(exit.code, int) else 2
    args.argv = None if argv is None else " ".join(["omni-trio", *argv])
    status: int = args.run(args)
    return status


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The parsed and checked arguments; raises :exc:`SystemExit` after printing
    help, the version, or the one line that says what is wrong."""
    from .. import __version__

    parser = Parser(
        prog="omni-trio",
        description="omni_trio: a Trio control plane for multi-stage streaming pipelines.",
    )
    parser.add_argument("--version", action="version", version=f"omni-trio {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _COMMANDS:
        module.add_parser(commands)
    args, extra = parser.parse_known_args(argv)
    command = commands.choices[args.command]
    if extra:  # said by the subcommand, as argparse would not
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        args.check(args)
    except UsageError as exc:
        command.error(str(exc))
    return args
