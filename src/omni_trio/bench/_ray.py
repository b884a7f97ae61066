"""The Ray scenarios: stages as Ray actors on two nodes of a local cluster, beside the
same stages as worker processes, in the same run.

``python -m omni_trio.bench._ray [--quick]`` starts a local multi-node cluster
(:func:`omni_trio.process.testing.local_ray_cluster`: a head with no CPUs and two worker
nodes, every port on 127.0.0.1), runs the scenarios and prints their results as
JSON; :mod:`omni_trio.bench._ray_report` judges the goals and prints the table.

- ``chunks``: the process family's two-stage pipeline (``sender -> reader``, see
  :mod:`omni_trio.bench._process`) with the sender an actor on one node and the
  reader an actor on the other, alternating with the same pipeline as worker
  processes: 64 B, 4 KB and 48 KB chunks, each a warm-up, then chunks one per
  millisecond (the hop: from the sender's stamp to the reader's ``async for``), then
  a flood (chunks/s, from the first chunk's stamp to the completion reaching the
  orchestrator).
- ``startup``: the cluster coming up, and a Ray stage's first worker getting ready
  (actor placed and started, engine loaded, connected back).
- ``node_death``: a one-stage pipeline on a node of its own, streaming; the node is
  removed (its raylet and workers killed); the time from the removal to the
  request's error terminal, which must name the node.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

import attrs
import msgspec
import trio

from .. import open_pipeline
from ..config import PipelineConfig, parse_pipeline
from ..process.testing import LocalRayCluster, local_ray_cluster
from ._process import CHUNKS_TOML, Counts, best, omni_chunks, summarize

__all__ = ["RAY_SIZES", "main", "on_nodes", "run"]

#: Chunk sizes between the two Ray stages.
RAY_SIZES = [64, 4096, 48 * 1024]
#: The nodes' custom resources: one per stage of the chunks pipeline, one per death.
NODES = ("bench_a", "bench_b")

DEATH_TOML = """
[pipeline]
name = "bench-node-death"
async_chunk = false
connector = "none"

[[stages]]
stage_id = 0
name = "doomed"
engine = "omni_trio.bench._chunk_engines:output_source"
final_output = true
[stages.runtime]
backend = "ray"
resources = {{ {resource} = 1 }}
"""


def on_nodes(config: PipelineConfig, resources: Sequence[str]) -> PipelineConfig:
    """``config`` with stage k a Ray actor on the node that has the custom resource
    ``resources[k]`` (the tests place their pipelines with it too)."""
    stages = [
        msgspec.structs.replace(
            stage,
            runtime=attrs.evolve(
                stage.runtime, backend="ray", resources={resources[stage.stage_id]: 1}
            ),
        )
        for stage in config.stages
    ]
    return msgspec.structs.replace(config, stages=stages)


async def chunks(counts: Counts) -> dict[str, Any]:
    runs: dict[int, dict[str, list[dict[str, float]]]] = {size: {} for size in RAY_SIZES}
    process = parse_pipeline(CHUNKS_TOML, source="bench chunks")
    configs = {"process": process, "ray": on_nodes(process, NODES)}
    startup = {}
    async with open_pipeline(configs["process"]) as by_process:
        started = time.monotonic()
        async with open_pipeline(configs["ray"]) as by_ray:
            startup["ray_pipeline_ready"] = time.monotonic() - started
            nodes = [stage.statistics().node_id for stage in by_ray.stages]
            orchs = {"process": by_process.orchestrator, "ray": by_ray.orchestrator}
            for _ in range(counts.rounds):  # process, ray, process, ray, ...
                for size in RAY_SIZES:
                    phases = counts.phases(counts.flood[size])
                    for side, orch in orchs.items():
                        found = summarize(await omni_chunks(orch, size, phases))
                        runs[size].setdefault(side, []).append(found)
    return {
        "counts": {"paced": counts.paced, "flood": counts.flood, "rounds": counts.rounds},
        "nodes": nodes,
        "startup": startup,
        "sizes": {
            str(size): {side: best(found) for side, found in sides.items()}
            for size, sides in runs.items()
        },
    }


async def node_death(local: LocalRayCluster, resource: str) -> dict[str, Any]:
    """One trial: the time from removing the node to the request's error terminal."""
    node = local.add_node({resource: 1})  # the main thread's: Ray's rule
    config = parse_pipeline(DEATH_TOML.format(resource=resource), source="bench node death")
    async with open_pipeline(config) as pipeline:
        orch = pipeline.orchestrator
        assert pipeline.stages[0].statistics().node_id == node.node_id
        removed_at = ended_at = 0.0
        terminal = None
        task = {"count": 10**9, "interval": 0.001}
        async with trio.open_nursery() as nursery, orch.open_request(task) as stream:
            async for out in stream:
                if not removed_at:  # it streams: remove its node (in a thread, as
                    removed_at = time.monotonic()  # the loop reads on meanwhile)
                    remove = local.cluster.remove_node
                    nursery.start_soon(trio.to_thread.run_sync, remove, node, False)
                if out.finished:
                    ended_at = time.monotonic()
                    terminal = out
    assert terminal is not None
    return {
        "seconds": ended_at - removed_at,
        "finish_reason": terminal.finish_reason,
        "error": terminal.error,
        "names_node": f"node {node.node_id[:8]}" in (terminal.error or ""),
    }


async def run(local: LocalRayCluster, *, quick: bool, cluster_seconds: float) -> dict[str, Any]:
    counts = Counts.quick() if quick else Counts.full()
    found = {"chunks": await chunks(counts)}
    trials = 1 if quick else 3
    found["node_death"] = {
        "trials": [await node_death(local, f"bench_death{i}") for i in range(trials)]
    }
    found["chunks"]["startup"]["cluster"] = cluster_seconds
    return found


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m omni_trio.bench._ray")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    started = time.monotonic()
    with local_ray_cluster(*({name: 4} for name in NODES)) as local:
        cluster_seconds = time.monotonic() - started
        found = trio.run(lambda: run(local, quick=args.quick, cluster_seconds=cluster_seconds))
    print(json.dumps(found))


if __name__ == "__main__":
    main()
