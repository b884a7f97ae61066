"""The project's invariants, checked after every simulated run.

Each check returns what it found wrong, as sentences naming the request or the
stage; an empty list is a pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .._messages import OrchOutput
from ._simulation import RequestRecord, SimulatedPipeline

__all__ = ["check_outputs", "check_released", "terminal_of"]


def terminal_of(record: RequestRecord) -> OrchOutput | None:
    outputs = record.outputs
    return outputs[-1] if outputs and outputs[-1].finished else None


def check_outputs(
    records: Sequence[RequestRecord],
    belongs: Callable[[RequestRecord, OrchOutput], bool],
    complete: Callable[[RequestRecord], str | None],
) -> list[str]:
    """Exactly one terminal per request, and it comes last; no request reads data
    that is not its own (``belongs``); a ``"completed"`` request has all of its
    data (``complete`` says what is missing, else ``None``)."""
    found = []
    for record in records:
        name = f"request {record.index} ({record.request_id}, {record.prompt!r})"
        terminals = [i for i, out in enumerate(record.outputs) if out.finished]
        if len(terminals) != 1:
            found.append(f"{name} got {len(terminals)} terminals")
        elif terminals[0] != len(record.outputs) - 1:
            found.append(f"{name}: its terminal is not its last output")
        for out in record.outputs:
            if out.request_id != record.request_id:
                found.append(f"{name} got an output of {out.request_id}")
            elif out.data is not None and not belongs(record, out):
                found.append(f"{name} got {out.data!r} from stage {out.stage_id}: not its data")
        terminal = terminal_of(record)
        if terminal is not None and terminal.finish_reason == "completed":
            missing = complete(record)
            if missing:
                found.append(f"{name} completed without all of its data: {missing}")
    return found


def check_released(sim: SimulatedPipeline) -> list[str]:
    """Every stage a request was submitted to got its abort, or finished it."""
    return [
        f"stage {stage_id}: request {request_id} was submitted, never finished nor aborted"
        for stage_id, requests in sim.open_stage_requests().items()
        for request_id in sorted(requests)
    ]
