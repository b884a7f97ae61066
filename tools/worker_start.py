"""What a stage worker process imports, and how long it takes to be ready.

Behind the "worker process" figures of docs/process.md. A worker running the demo's
thinker engine (which imports ``omni_trio.process`` for ``EngineRequest``, as a
user's engine does):

- modules: what ``python -m omni_trio.process.worker`` plus the engine's module load;
- import: the CPU time (user + system) of a fresh interpreter importing both, median
  of ``--runs`` (steadier than wall time on a busy machine);
- ready: ``open_process_stage`` from spawn to ``Ready``, median of ``--runs``.

Run: python tools/worker_start.py [--runs 20]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys

import trio

from omni_trio.process import open_process_stage

ENGINE = "omni_trio.demo.engines:thinker"
IMPORTS = "import omni_trio.process.worker._main, omni_trio.demo.engines"


def modules() -> tuple[int, list[str]]:
    probe = (
        f"import json, sys; {IMPORTS}; "
        "print(json.dumps([len(sys.modules), sorted(m for m in sys.modules "
        "if m.startswith('omni_trio'))]))"
    )
    total, ours = json.loads(subprocess.check_output([sys.executable, "-c", probe], text=True))
    return total, ours


def import_seconds() -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", IMPORTS], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


async def ready_seconds() -> float:
    start = trio.current_time()
    async with open_process_stage(ENGINE):
        ready = trio.current_time() - start
    return ready


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    total, ours = modules()
    imports = statistics.median(import_seconds() for _ in range(args.runs))
    ready = statistics.median(trio.run(ready_seconds) for _ in range(args.runs))
    print(f"modules loaded: {total} ({len(ours)} of omni_trio: {', '.join(ours)})")
    print(f"import, CPU of a fresh interpreter: {imports * 1e3:.0f} ms (median of {args.runs})")
    print(f"spawn to Ready: {ready * 1e3:.0f} ms (median of {args.runs})")


if __name__ == "__main__":
    main()
