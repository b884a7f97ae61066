"""``omni-trio compare``: the cancellation scenarios on asyncio and on Trio, side by
side (and on the plain asyncio design, for the scenarios that run it too)."""

from __future__ import annotations

import argparse
import json
import platform
from typing import TYPE_CHECKING, Any

from ._common import Commands, UsageError

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["add_parser"]


def add_parser(commands: Commands) -> None:
    compare = commands.add_parser(
        "compare",
        help="run the cancellation scenarios on asyncio and on Trio, side by side",
        description="Run every cancellation scenario on asyncio and on Trio under this "
        "Python and print what each did. Exits 1 if an outcome is not the documented one.",
    )
    compare.add_argument("--json", action="store_true", help="print JSON instead of a table")
    compare.add_argument("-k", metavar="TEXT", help="only the scenarios whose key contains TEXT")
    compare.set_defaults(run=_compare, check=_check)


def _check(args: argparse.Namespace) -> None:
    from ..compare.scenarios import SCENARIOS

    if args.k is not None and not any(args.k in s.key for s in SCENARIOS):
        keys = ", ".join(s.key for s in SCENARIOS)
        raise UsageError(f"-k must match a scenario key, {args.k!r} matches none of {keys}")


def _compare(args: argparse.Namespace) -> int:
    from importlib.metadata import version

    from rich.console import Console
    from rich.text import Text

    from ..compare.scenarios import (
        SCENARIOS,
        expected_plain_verdict,
        expected_verdicts,
        run_plain,
        run_scenario,
    )

    scenarios = [s for s in SCENARIOS if not args.k or args.k in s.key]
    rows: list[dict[str, Any]] = []
    for number, scenario in enumerate(SCENARIOS, 1):
        if scenario not in scenarios:
            continue
        on_asyncio, on_trio = run_scenario(scenario)
        on_plain = run_plain(scenario)  # None: the scenario has no third run
        plain_verdict = None if on_plain is None else on_plain.verdict
        observed = (on_asyncio.verdict, on_trio.verdict, plain_verdict)
        expected = (*expected_verdicts(scenario.key), expected_plain_verdict(scenario.key))
        rows.append(
            {
                "number": number,
                "key": scenario.key,
                "title": scenario.title,
                "asyncio": {"verdict": on_asyncio.verdict, "detail": on_asyncio.detail},
                "trio": {"verdict": on_trio.verdict, "detail": on_trio.detail},
                "asyncio-plain": None
                if on_plain is None
                else {"verdict": on_plain.verdict, "detail": on_plain.detail},
                "same": len({v for v in observed if v is not None}) == 1,
                "as_documented": observed == expected,
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
    console.print(
        Text(
            f"Cancellation semantics: asyncio vs Trio "
            f"(Python {versions['python']}, trio {versions['trio']})",
            style="bold",
        )
    )
    for row in rows:
        console.print(_scenario_view(row))
    console.print()
    if surprises:
        console.print(f"[red]Not as documented in docs/cancellation.md: {', '.join(surprises)}")
        return 1
    console.print("Every outcome is the one docs/cancellation.md documents for this Python.")
    return 0


def _scenario_view(row: dict[str, Any]) -> Table:
    """One scenario, then one row per framework (and one for the plain asyncio design
    when it ran): it fits 80 columns, and a word longer than its column is folded,
    never cut with an ellipsis."""
    from rich.table import Table
    from rich.text import Text

    outcomes = Table.grid(padding=(0, 1))
    outcomes.add_column(no_wrap=True)
    outcomes.add_column(overflow="fold")
    for label, key in (
        ("asyncio", "asyncio"),
        ("Trio", "trio"),
        ("asyncio-plain", "asyncio-plain"),
    ):
        outcome = row[key]
        if outcome is None:
            continue
        outcomes.add_row(
            f"{label}:", Text.assemble((outcome["verdict"], "bold"), "\n", outcome["detail"])
        )
    view = Table.grid(padding=(0, 1))
    view.add_column(justify="right", no_wrap=True, width=3)
    view.add_column(overflow="fold")
    same = Text("same", style="green") if row["same"] else Text("different", style="yellow")
    view.add_row("", "")
    view.add_row(
        Text(f"{row['number']}.", style="bold"),
        Text.assemble((row["title"], "bold"), " (", same, ")"),
    )
    view.add_row("", outcomes)
    return view
