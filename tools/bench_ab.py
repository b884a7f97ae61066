"""Before and after: the bench's in-process scenarios (Trio) and its process chunk
scenarios, for two source trees, run alternately in one sitting.

A change that must not cost speed is held to this: each round runs both trees, in
alternating order (ABBA...), each run in fresh processes; the report is each figure's
median per tree and their ratio. Scenario 5 runs at fixed offered loads, so both
trees are asked the same: fractions of a fixed capacity, or, for a tree from before
scenario 5 measured its capacity, one fixed load.

Run: python tools/bench_ab.py --before OLD/src --after src [--rounds 3] [--json FILE]
[--only inprocess|chunks]
(for instance with OLD a ``git worktree`` of the commit before the change).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: Scenario 5's offered loads are fractions of this rate (events/s) for both trees; a
#: tree from before the capacity was measured runs at half of it.
LATENCY_CAPACITY = 300_000


def _run(src: Path, module: str, *args: str) -> Any:
    env = dict(os.environ, PYTHONPATH=str(src))
    command = [sys.executable, "-m", module, *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def _flatten(prefix: str, value: Any, into: dict[str, float]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), inner, into)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        into[prefix] = float(value)


def one_run(src: Path, only: str | None = None) -> dict[str, float]:
    """Every figure of one run of both benches on the tree at ``src`` (``only``: of
    that one, ``"inprocess"`` or ``"chunks"``)."""
    figures: dict[str, float] = {}
    main = (src / "omni_trio" / "bench" / "__main__.py").read_text()
    if "--latency-capacity" in main:
        load = ["--latency-capacity", str(LATENCY_CAPACITY)]
    else:
        load = ["--latency-load", str(LATENCY_CAPACITY / 2)]
    if only != "chunks":
        _flatten("inprocess", _run(src, "omni_trio.bench", "--impl", "trio", *load), figures)
    if only == "inprocess":
        return figures
    chunks = _run(src, "omni_trio.bench._process", "--family", "chunks")
    for size, sides in chunks["sizes"].items():
        for side in ("omni", "socket"):
            for key in ("hop_p50", "hop_p99", "rate"):
                figures[f"chunks.{size}.{side}.{key}"] = sides[side][key]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(prog="python tools/bench_ab.py")
    parser.add_argument("--before", type=Path, required=True, help="the old tree's src/")
    parser.add_argument("--after", type=Path, default=Path("src"), help="the new tree's src/")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="save every run's figures here")
    parser.add_argument(
        "--only", choices=["inprocess", "chunks"], help="run one of the two benches alone"
    )
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for round_ in range(args.rounds):
        order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
        for name in order:
            started = time.monotonic()
            runs[name].append(one_run(trees[name], args.only))
            print(
                f"round {round_ + 1}: {name} ({time.monotonic() - started:.0f} s)", file=sys.stderr
            )
    if args.json is not None:
        args.json.write_text(json.dumps(runs, indent=1))
    keys = sorted(set(runs["before"][0]) & set(runs["after"][0]))
    title = f"figure (median of {args.rounds})"
    print(f"{title:50} {'before':>11} {'after':>11} {'ratio':>7}")
    for key in keys:
        before = statistics.median(run[key] for run in runs["before"])
        after = statistics.median(run[key] for run in runs["after"])
        ratio = after / before if before else float("nan")
        print(f"{key:50} {before:11.4g} {after:11.4g} {ratio:7.3f}")


if __name__ == "__main__":
    main()
