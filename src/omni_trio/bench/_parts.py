"""What the benchmarks that run their parts in processes of their own share: a part
run with its status shown, its JSON read back; whether a module is installed; how
their tables write milliseconds."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from typing import Any

from rich.console import Console

__all__ = ["importable", "ms", "run_part"]


def importable(module: str) -> bool:
    """Whether ``module`` can be imported (found, not imported)."""
    return importlib.util.find_spec(module) is not None


def run_part(argv: list[str], status: str, console: Console) -> Any:
    """Run ``argv`` (a part, in a process of its own) while ``console`` shows
    ``status``; what it printed, as JSON, or ``None`` if it failed (the end of its
    error output is printed)."""
    with console.status(status):
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode:
        console.print(done.stderr[-5000:])
        return None
    return json.loads(done.stdout)


def ms(seconds: float) -> str:
    """Milliseconds: two decimals below 1, one below 10."""
    value = seconds * 1e3
    if abs(value) < 1:
        return f"{value:.2f}"
    return f"{value:.1f}" if abs(value) < 10 else f"{value:,.0f}"
