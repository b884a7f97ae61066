"""The core's decision table, as data: what one output of a stage does.

As h11 keeps its state machines as data (``h11/_state.py``'s
``EVENT_TRIGGERED_TRANSITIONS``), the core keeps its output decision here, in
:data:`TABLE`. A *key* says what an output is and what its request's state makes of
it; a row gives the *steps* the core takes for it, in order. A key's parts:

- **output**: what the output is, the first of :data:`OUTPUTS` that applies (not a
  :class:`~omni_trio.StageOutput`; a ``request_id`` that cannot be looked up; a
  release fence; of no request in flight; of an earlier life of the id, its stage's
  fence still to come; of a stage the request was not submitted to, or that
  finished it already; an ``error``; else ``data``, or ``last`` when it says
  ``finished=True``);
- **final**: its stage is one of the request's final stages;
- **all_final** and **all_done**: once this output is counted, every final stage
  (every submitted stage) has finished the request;
- **held**: the request's ``"completed"`` terminal is held (``pending_final``).

``ANY`` in a row matches either value. Every key matches exactly one row, and a row
tells apart only what the core computes for its output: an output's kind alone for
the lookups (the kinds before ``data``), and the stage's role for ``data``. This
module checks both at import, with the steps the core can take for each kind.

:class:`~omni_trio._core.OrchestratorCore` classifies each output into a key, an int
(:func:`key_code`: the output's :data:`OUTPUTS` index times 16 plus the bits
:data:`FINAL`, :data:`ALL_FINAL`, :data:`ALL_DONE` and :data:`HELD`), and takes the
steps of its :class:`Plan` in :data:`PLAN`, the table compiled to one plan per key.
``tests/test_core.py`` checks that the core does what each row says, and that
docs/architecture.md shows this table.
"""

from __future__ import annotations

import itertools
import logging
from typing import Final, TypeAlias

import attrs

__all__ = [
    "ALL_DONE",
    "ALL_FINAL",
    "ALREADY_FINISHED",
    "ANY",
    "DATA",
    "DATA_FROM_FINAL",
    "DATA_FROM_NON_FINAL",
    "DROPS",
    "EARLIER_LIFE",
    "ERROR",
    "FENCE",
    "FINAL",
    "HELD",
    "KINDS",
    "LAST",
    "LAST_OUTPUT",
    "LOOKUPS",
    "NOT_A_STAGE_OUTPUT",
    "NOT_SUBMITTED",
    "OUTPUTS",
    "PLAN",
    "STEPS",
    "TABLE",
    "UNHASHABLE_ID",
    "UNKNOWN_REQUEST",
    "Key",
    "Pattern",
    "Plan",
    "Row",
    "decide",
    "key_code",
    "keys",
]

# -- what an output is: the key's first part, in the order the core asks ------------

NOT_A_STAGE_OUTPUT: Final = "not a StageOutput"
UNHASHABLE_ID: Final = "unhashable request_id"
FENCE: Final = "fence"
UNKNOWN_REQUEST: Final = "unknown request"
EARLIER_LIFE: Final = "earlier life"
NOT_SUBMITTED: Final = "not submitted"
ALREADY_FINISHED: Final = "already finished"
ERROR: Final = "error"
DATA: Final = "data"
LAST_OUTPUT: Final = "last"

#: What an output can be, in the order the core tells them apart: the first that
#: applies is the output's.
OUTPUTS: Final = (
    NOT_A_STAGE_OUTPUT,
    UNHASHABLE_ID,
    FENCE,
    UNKNOWN_REQUEST,
    EARLIER_LIFE,
    NOT_SUBMITTED,
    ALREADY_FINISHED,
    ERROR,
    DATA,
    LAST_OUTPUT,
)

#: The kinds of output that alone decide: the core computes nothing more for them.
LOOKUPS: Final = frozenset(OUTPUTS[: OUTPUTS.index(DATA)])

#: Why each dropped kind of output is dropped, and the level it is logged at.
DROPS: Final = {
    NOT_A_STAGE_OUTPUT: ("it is not a StageOutput", logging.WARNING),
    UNHASHABLE_ID: ("its request_id is not hashable", logging.DEBUG),
    UNKNOWN_REQUEST: ("the request is unknown or already ended", logging.DEBUG),
    EARLIER_LIFE: ("it is of an ended request with the same id", logging.DEBUG),
    NOT_SUBMITTED: ("the stage was not submitted for the request", logging.DEBUG),
    ALREADY_FINISHED: ("the stage already finished the request", logging.DEBUG),
}

# -- the steps: what the core does --------------------------------------------------

#: Each step, by name, and what the core does for it (docs/architecture.md shows
#: these). A row's steps run in this order.
STEPS: Final = {
    "drop": "count it in `dropped_outputs` and log why (debug; not a `StageOutput`: warning)",
    "lift fence": "one fence of that id and stage has come (`StageOutput.released`)",
    "fail": "end the request: an `error` terminal (the held one if set), abort, release",
    "stream": "send `OrchOutput(..., finished=False)` with the output's data",
    "complete": "send the `finished=True` terminal built from the output; release",
    "hold": "keep that terminal in `pending_final`; send nothing",
    "release held": "send `pending_final`; release",
    "forward": "forward mode: submit each stage reading it that now has every input",
}

#: The steps the core can take for a kind that alone decides, and for the others.
_LOOKUP_STEPS: Final = frozenset({"drop", "lift fence", "fail"})
_DECIDED_STEPS: Final = frozenset(STEPS) - _LOOKUP_STEPS
#: Steps that end the request (or hold its end): no step may follow them.
_ENDING: Final = frozenset({"fail", "complete", "hold", "release held"})


@attrs.frozen
class Plan:
    """A row's steps as the core reads them: a flag per step.

    A slotted attribute is the cheapest test CPython 3.11 has for a flag: cheaper
    than unpacking a tuple of flags, indexing one, or ``&`` on an int, which it does
    not specialize (docs/architecture.md has the measurements).
    """

    steps: tuple[str, ...]
    drop: bool
    lift_fence: bool
    fail: bool
    stream: bool
    complete: bool
    hold: bool
    release_held: bool
    forward: bool
    #: ``stream``, ``complete`` or ``hold``: the output's data goes to the user.
    to_user: bool

    @classmethod
    def of(cls, steps: tuple[str, ...]) -> Plan:
        stream, complete, hold = "stream" in steps, "complete" in steps, "hold" in steps
        return cls(
            steps,
            drop="drop" in steps,
            lift_fence="lift fence" in steps,
            fail="fail" in steps,
            stream=stream,
            complete=complete,
            hold=hold,
            release_held="release held" in steps,
            forward="forward" in steps,
            to_user=stream or complete or hold,
        )


# -- the table ----------------------------------------------------------------------

#: A row's value for a part of the key it does not look at.
ANY: Final = None

Key: TypeAlias = tuple[str, bool, bool, bool, bool]
"""A concrete key: (output, final, all_final, all_done, held)."""
Pattern: TypeAlias = tuple[str, bool | None, bool | None, bool | None, bool | None]
Row: TypeAlias = tuple[Pattern, tuple[str, ...]]
"""A row: a key's pattern (``ANY`` matches either value), and its steps."""

#: The decision table: (output, final, all_final, all_done, held) -> steps.
TABLE: Final[tuple[Row, ...]] = (
    # (output, final, all_final, all_done, held), steps
    ((NOT_A_STAGE_OUTPUT, ANY, ANY, ANY, ANY), ("drop",)),
    ((UNHASHABLE_ID, ANY, ANY, ANY, ANY), ("drop",)),
    ((FENCE, ANY, ANY, ANY, ANY), ("lift fence",)),
    ((UNKNOWN_REQUEST, ANY, ANY, ANY, ANY), ("drop",)),
    ((EARLIER_LIFE, ANY, ANY, ANY, ANY), ("drop",)),
    ((NOT_SUBMITTED, ANY, ANY, ANY, ANY), ("drop",)),
    ((ALREADY_FINISHED, ANY, ANY, ANY, ANY), ("drop",)),
    ((ERROR, ANY, ANY, ANY, ANY), ("fail",)),
    ((DATA, True, ANY, ANY, ANY), ("stream",)),
    ((DATA, False, ANY, ANY, ANY), ()),
    ((LAST_OUTPUT, True, False, ANY, ANY), ("stream", "forward")),
    ((LAST_OUTPUT, True, True, True, ANY), ("complete",)),
    ((LAST_OUTPUT, True, True, False, ANY), ("hold",)),
    ((LAST_OUTPUT, False, ANY, True, True), ("release held",)),
    ((LAST_OUTPUT, False, ANY, True, False), ("forward",)),
    ((LAST_OUTPUT, False, ANY, False, ANY), ("forward",)),
)

# -- the compiled form: what the core reads -----------------------------------------

FINAL: Final = 8
ALL_FINAL: Final = 4
ALL_DONE: Final = 2
HELD: Final = 1


def key_code(output: str, final: bool, all_final: bool, all_done: bool, held: bool) -> int:
    """A key as the core computes it: an index of :data:`PLAN`."""
    return (
        OUTPUTS.index(output) * 16
        + FINAL * final
        + ALL_FINAL * all_final
        + ALL_DONE * all_done
        + HELD * held
    )


def keys() -> list[Key]:
    """Every concrete key, in :data:`PLAN`'s order (``key_code(*keys()[i]) == i``)."""
    bits = list(itertools.product((False, True), repeat=4))
    return [(output, f, af, ad, held) for output in OUTPUTS for f, af, ad, held in bits]


def _matches(pattern: Pattern, key: Key) -> bool:
    return all(want is ANY or want == have for want, have in zip(pattern, key, strict=True))


def decide(key: Key) -> tuple[str, ...]:
    """The steps of ``key``'s row: the table read as written (the tests' reference).

    Raises:
      LookupError: no row, or more than one, matches ``key``.
    """
    found = [steps for pattern, steps in TABLE if _matches(pattern, key)]
    if len(found) != 1:
        raise LookupError(f"{len(found)} rows of the decision table match {key}")
    return found[0]


def _compile() -> tuple[Plan, ...]:
    """:data:`TABLE` as one :class:`Plan` per key code, once the core is known to
    follow it: each key has one row; a row's steps are ones the core takes for its
    kind of output, in order, none after an end; a row tells apart only what the
    core computes (an output's kind alone for the lookups, the stage's role for
    ``data``)."""
    order = list(STEPS)
    for pattern, steps in TABLE:
        allowed = _LOOKUP_STEPS if pattern[0] in LOOKUPS else _DECIDED_STEPS
        if not set(steps) <= allowed or sorted(steps, key=order.index) != list(steps):
            raise AssertionError(f"the core cannot take the steps {steps} for {pattern}")
        if any(step in _ENDING for step in steps[:-1]):
            raise AssertionError(f"{pattern}: a step follows the request's end in {steps}")
    plans: dict[tuple[str, ...], Plan] = {}
    compiled = []
    for key in keys():
        output, final = key[0], key[1]
        if output in LOOKUPS:
            computed: Key = (output, False, False, False, False)
        elif output == DATA:
            computed = (output, final, False, False, False)
        else:
            computed = key
        steps = decide(key)
        if decide(computed) != steps:
            raise AssertionError(f"the table tells {key} from {computed}: the core does not")
        compiled.append(plans.setdefault(steps, Plan.of(steps)))
    return tuple(compiled)


#: Per key code (:func:`key_code`), the steps of its row.
PLAN: Final = _compile()
#: Each kind of output's code with no bits: the key of a kind that alone decides.
KINDS: Final = {output: key_code(output, False, False, False, False) for output in OUTPUTS}
#: The plans of an output that is not its stage's last: its stage's role is its whole
#: key (:func:`_compile` checks it), so the core compares no set for it, and looks
#: nothing up.
DATA_FROM_FINAL: Final = PLAN[key_code(DATA, True, False, False, False)]
DATA_FROM_NON_FINAL: Final = PLAN[key_code(DATA, False, False, False, False)]
#: The code of a stage's last output, before its bits.
LAST: Final = KINDS[LAST_OUTPUT]
