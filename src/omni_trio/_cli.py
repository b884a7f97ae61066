"""The ``omni-trio`` command line."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Sequence
from importlib.metadata import version
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["main"]


def _compare(args: argparse.Namespace) -> int:
    from .compare.scenarios import SCENARIOS, expected_verdicts, run_scenario

    scenarios = [s for s in SCENARIOS if not args.k or args.k in s.key]
    rows: list[dict[str, Any]] = []
    for number, scenario in enumerate(SCENARIOS, 1):
        if scenario not in scenarios:
            continue
        on_asyncio, on_trio = run_scenario(scenario)
        expected = expected_verdicts(scenario.key)
        rows.append(
            {
                "number": number,
                "key": scenario.key,
                "title": scenario.title,
                "asyncio": {"verdict": on_asyncio.verdict, "detail": on_asyncio.detail},
                "trio": {"verdict": on_trio.verdict, "detail": on_trio.detail},
                "same": on_asyncio.verdict == on_trio.verdict,
                "as_documented": (on_asyncio.verdict, on_trio.verdict) == expected,
            }
        )
    versions = {
        "python": platform.python_version(),
        "trio": version("trio"),
        "implementation": platform.python_implementation(),
    }
    surprises = [row["key"] for row in rows if not row["as_documented"]]
    if args.json:
        print(json.dumps({"versions": versions, "scenarios": rows}, indent=2))
        return 1 if surprises else 0

    console = Console()
    table = Table(
        title=f"Cancellation semantics: asyncio vs Trio "
        f"(Python {versions['python']}, trio {versions['trio']})",
        show_lines=True,
    )
    table.add_column("#", justify="right")
    table.add_column("scenario")
    table.add_column("asyncio")
    table.add_column("Trio")
    table.add_column("")
    for row in rows:
        table.add_row(
            str(row["number"]),
            row["title"],
            f"[bold]{row['asyncio']['verdict']}[/bold]\n{row['asyncio']['detail']}",
            f"[bold]{row['trio']['verdict']}[/bold]\n{row['trio']['detail']}",
            "same" if row["same"] else "[yellow]different[/yellow]",
        )
    console.print(table)
    if surprises:
        console.print(f"[red]Not as documented in docs/cancellation.md: {', '.join(surprises)}")
        return 1
    console.print("Every outcome is the one docs/cancellation.md documents for this Python.")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="omni-trio",
        description="omni_trio: a Trio control plane for multi-stage streaming pipelines.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    compare = commands.add_parser(
        "compare",
        help="run the cancellation scenarios on asyncio and on Trio, side by side",
        description="Run every cancellation scenario on asyncio and on Trio under this "
        "Python and print what each did. Exits 1 if an outcome is not the documented one.",
    )
    compare.add_argument("--json", action="store_true", help="print JSON instead of a table")
    compare.add_argument("-k", metavar="TEXT", help="only the scenarios whose key contains TEXT")
    compare.set_defaults(run=_compare)
    args = parser.parse_args(argv)
    status: int = args.run(args)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
