"""Helpers for the tests that run real worker processes."""

from __future__ import annotations

import os
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import msgspec
import trio

from omni_trio import open_pipeline
from omni_trio.config import parse_pipeline
from omni_trio.process._process_launcher import WORKER_MAIN
from omni_trio.process.worker import _shm

STAGE = """
[[stages]]
stage_id = {sid}
engine = "process_engines:{engine}"
engine_args = {args}
final_output = {final}
{extra}
"""


#: ``OMNI_TRIO_STAGE_BACKEND=ray`` (``nox -s ray``): every config of these helpers runs
#: its stages as Ray actors, on the cluster tests/conftest.py starts -- so the process
#: tests hold the Ray backend to the same semantics.
BACKEND = os.environ.get("OMNI_TRIO_STAGE_BACKEND")


def pipeline_config(*stages, **pipeline):
    """stages: (engine, args, final, extra) per stage. ``inline_chunk_bytes=0`` puts
    every chunk in its sender's shared-memory ring, of ``ring_bytes``: for tests of
    the rings."""
    config = parse_pipeline(pipeline_text(*stages, **pipeline))
    if BACKEND is None:
        return config
    return msgspec.structs.replace(
        config,
        stages=[
            msgspec.structs.replace(s, runtime=attrs.evolve(s.runtime, backend=BACKEND))
            if s.runtime.backend == "process"
            else s  # a test's in-process stages stay in-process
            for s in config.stages
        ],
    )


def pipeline_text(
    *stages,
    async_chunk=True,
    inline_chunk_bytes=None,
    ring_bytes=None,
    window=None,
    window_bytes=None,
    ray_address=None,
):
    """:func:`pipeline_config`'s TOML (and ``ray_address``, for Ray stages)."""
    text = f"""
[pipeline]
async_chunk = {str(async_chunk).lower()}
connector = "{"shm" if async_chunk else "none"}"
"""
    if inline_chunk_bytes is not None:
        text += f"inline_chunk_bytes = {inline_chunk_bytes}\n"
    if ring_bytes is not None:
        text += f"ring_bytes = {ring_bytes}\n"
    if window is not None:
        text += f"window = {window}\n"
    if window_bytes is not None:
        text += f"window_bytes = {window_bytes}\n"
    if ray_address is not None:
        text += f'ray_address = "{ray_address}"\n'
    for sid, (engine, args, final, extra) in enumerate(stages):
        text += STAGE.format(
            sid=sid, engine=engine, args=args, final=str(final).lower(), extra=extra
        )
    return text


def live_processes():
    """``(pid, ppid, pgid, cmdline)`` of every live (not zombie) process, from /proc."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        if fields[0] != "Z":
            yield int(entry.name), int(fields[1]), int(fields[2]), cmdline


def children_of(pids):
    """``(pid, cmdline)`` of the live children of ``pids``."""
    pids = set(pids)
    return [(pid, cmdline) for pid, ppid, _, cmdline in live_processes() if ppid in pids]


def is_worker(cmdline: bytes) -> bool:
    """Whether a command line is a stage worker's: the program the process launcher
    gives its workers (``python -c "'omni-trio worker NAME'; WORKER_MAIN" --control-fd
    N``), so the test follows the code wherever the worker moves."""
    args = cmdline.split(b"\0")
    return args[1:2] == [b"-c"] and len(args) > 2 and args[2].endswith(WORKER_MAIN.encode())


def worker_processes():
    """Pids of this process's live stage workers (any pipeline, any restart)."""
    mine = os.getpid()
    return [
        pid for pid, ppid, _, cmdline in live_processes() if ppid == mine and is_worker(cmdline)
    ]


async def eventually(predicate):
    """Poll another process's doing (segments unlinked, a worker restarted): it has no
    event we could wait on. Fails after 10 s."""
    with trio.fail_after(10):
        while not predicate():  # noqa: ASYNC110 - the state is in another process
            await trio.sleep(0.01)


@asynccontextmanager
async def running(config, **pipeline_overrides):
    """A pipeline (``open_pipeline``) and its orchestrator; afterwards, nothing may be
    left: no segment with its prefix, no worker process (the first ones, or any
    restarted). The workers of the running pipeline must be seen first, so that the
    check after it looks for something that can be found."""
    assert worker_processes() == [], "a worker process of an earlier test is alive"
    async with open_pipeline(config, **pipeline_overrides) as pipeline:
        processes = {stage.pid for stage in pipeline.stages if stage.options.backend == "process"}
        assert processes <= set(worker_processes()), "the pipeline's workers are not seen"
        yield pipeline, pipeline.orchestrator
        # A resource tracker warns about (or unlinks) what it tracks when it exits:
        # the data plane keeps out of it.
        trackers = [c for c in children_of(worker_processes()) if b"resource_tracker" in c[1]]
        assert trackers == [], "a worker started a resource tracker"
    assert _shm.listing(pipeline.prefix) == [], "shared memory left behind"
    assert worker_processes() == [], "a worker process outlived the block"
