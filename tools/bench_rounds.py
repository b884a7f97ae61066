"""Throughput ratios between implementations, as medians of alternated rounds.

One ``omni-trio bench`` runs each implementation once, one after the other, so a ratio
between two columns carries whatever the machine did in between. This runs scenarios
1 to 3 (``python -m omni_trio.bench --impl NAME --throughput-only``, each in a fresh
process) for Trio, the asyncio twin and the plain asyncio design, in alternating order
(ABC, CBA, ...), and reports each round's ratios and their medians:

- forward mode at par: (Trio / twin in scenario 3) / (Trio / twin in scenario 1),
  goal >= 0.95;
- against the plain design, one output at a time (``next_output()``, ``async for``):
  goal >= 1.0 each; in batches (``next_outputs()``, ``receive_batch()``, against its
  one at a time, as it has no batches): goal >= 1.2 each.

Run::

    PYTHONPATH=src python tools/bench_rounds.py [--rounds 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

IMPLS = ("trio", "asyncio", "asyncio-plain")

#: ratio -> (comparison, goal); a goal of 0 is reported without a verdict.
RATIOS: dict[str, tuple[str, float]] = {
    "forward at par: (trio/asyncio in 3) / (trio/asyncio in 1)": (">=", 0.95),
    "trio / plain, next_output()": (">=", 1.0),
    "trio / plain, async for": (">=", 1.0),
    "trio / plain, next_outputs()": (">=", 1.2),
    "trio / plain, receive_batch()": (">=", 1.2),
    "trio / asyncio, next_output()": (">=", 0.0),
    "trio / asyncio, forward mode": (">=", 0.0),
}


def _ratios(run: dict[str, dict[str, float]]) -> dict[str, float]:
    trio, twin, plain = run["trio"], run["asyncio"], run["asyncio-plain"]
    s1 = trio["throughput_next_output"] / twin["throughput_next_output"]
    s3 = trio["throughput_forward"] / twin["throughput_forward"]
    return {
        "forward at par: (trio/asyncio in 3) / (trio/asyncio in 1)": s3 / s1,
        "trio / plain, next_output()": trio["throughput_next_output"]
        / plain["throughput_next_output"],
        "trio / plain, async for": trio["throughput_streams"] / plain["throughput_streams"],
        "trio / plain, next_outputs()": trio["throughput_next_output_batches"]
        / plain["throughput_next_output"],
        "trio / plain, receive_batch()": trio["throughput_streams_batches"]
        / plain["throughput_streams"],
        "trio / asyncio, next_output()": s1,
        "trio / asyncio, forward mode": s3,
    }


def _one(impl: str) -> dict[str, float]:
    argv = [sys.executable, "-m", "omni_trio.bench", "--impl", impl, "--throughput-only"]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    results: dict[str, float] = json.loads(done.stdout)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(prog="python tools/bench_rounds.py")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write every round's figures here")
    args = parser.parse_args()
    rounds: list[dict[str, Any]] = []
    for index in range(args.rounds):
        order = IMPLS if index % 2 == 0 else tuple(reversed(IMPLS))
        run = {impl: _one(impl) for impl in order}
        rounds.append({"order": list(order), "results": run, "ratios": _ratios(run)})
        print(f"round {index + 1} ({', '.join(order)}) done", file=sys.stderr)
    medians = {name: statistics.median(r["ratios"][name] for r in rounds) for name in RATIOS}
    figures = sorted(rounds[0]["results"]["trio"])
    print(f"Python {platform.python_version()}; {os.cpu_count()} CPUs; {args.rounds} rounds")
    print(f"{'figure (median, events/s)':36}" + "".join(f"{impl:>15}" for impl in IMPLS))
    for key in figures:
        cells = []
        for impl in IMPLS:
            values = [r["results"][impl].get(key) for r in rounds]
            known = [v for v in values if v is not None]
            cells.append(f"{statistics.median(known):>15,.0f}" if known else f"{'—':>15}")
        print(f"{key:36}" + "".join(cells))
    verdicts = {}
    for name, (op, bound) in RATIOS.items():
        value = medians[name]
        per_round = " ".join(f"{r['ratios'][name]:.2f}" for r in rounds)
        if bound:
            met = value >= bound if op == ">=" else value <= bound
            verdicts[name] = met
            verdict = f"goal {op} {bound}: {'met' if met else 'not met'}"
        else:
            verdict = ""
        print(f"{name}: median {value:.3f} (rounds: {per_round}) {verdict}")
    if args.json is not None:
        report = {
            "command": "python tools/bench_rounds.py " + " ".join(sys.argv[1:]),
            "python": platform.python_version(),
            "rounds": rounds,
            "medians": medians,
            "goals": verdicts,
        }
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
