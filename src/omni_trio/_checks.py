"""Argument checks shared by the core, both drivers, the process wing and the configs.

Each raises ``TypeError`` or ``ValueError`` with a message that names the argument and
shows what it got. No trio, no asyncio.
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any

import attrs

from ._errors import OmniTrioDeprecationWarning

__all__ = [
    "check_max_in_flight",
    "check_positive_int",
    "check_request_id",
    "check_seconds",
    "check_stage_methods",
    "seconds",
    "submit_is_legacy",
]


def check_request_id(request_id: object) -> str:
    """Return ``request_id`` if it is a ``str``, else raise ``TypeError``."""
    if not isinstance(request_id, str):
        raise TypeError(f"request_id must be a str, got {type(request_id).__name__} {request_id!r}")
    return request_id


def check_seconds(name: str, value: object, *, positive: bool, optional: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a number of seconds (> 0 if ``positive``,
    else >= 0; ``None`` too if ``optional``). NaN and booleans are refused."""
    if value is None and optional:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and not math.isnan(value) and (value > 0 if positive else value >= 0):  # type: ignore[operator, arg-type]
        return
    wanted = "a positive number of seconds" if positive else "a number of seconds >= 0"
    raise ValueError(f"{name} must be {wanted}{' or None' if optional else ''}, got {value!r}")


def check_max_in_flight(max_in_flight: object) -> None:
    """Raise ``ValueError`` unless ``max_in_flight`` is a positive ``int`` or ``None``."""
    if max_in_flight is not None and (
        not isinstance(max_in_flight, int) or isinstance(max_in_flight, bool) or max_in_flight < 1
    ):
        raise ValueError(f"max_in_flight must be a positive int or None, got {max_in_flight!r}")


def check_positive_int(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is an ``int`` >= 1 (a bound: bytes, outputs)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_stage_methods(index: int, stage: object) -> None:
    """Raise ``TypeError`` unless ``stage`` has ``outputs`` and callable ``submit``
    and ``abort`` (what each driver needs beyond that, it checks itself)."""
    missing = [name for name in ("outputs", "submit", "abort") if not hasattr(stage, name)]
    if missing:
        raise TypeError(
            f"stages[{index}] ({stage!r}) is not a Stage: it lacks {', '.join(missing)}"
        )
    for name in ("submit", "abort"):
        if not callable(getattr(stage, name)):
            raise TypeError(f"stages[{index}].{name} must be an async method")


def submit_is_legacy(index: int, stage: object) -> bool:
    """Whether ``stage.submit`` still has the old signature, ``submit(request_id,
    inputs)`` -- two positional parameters, where a stage now takes one
    :class:`~omni_trio.StageRequest` -- and if so, say it is deprecated (an
    :class:`~omni_trio.OmniTrioDeprecationWarning`): the orchestrator then calls it
    the old way, for one version more."""
    try:
        parameters = inspect.signature(stage.submit).parameters.values()  # type: ignore[attr-defined]
    except (TypeError, ValueError):  # no signature to read: take it as the new one
        return False
    positional = [
        p
        for p in parameters
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    if len(positional) < 2:
        return False
    warnings.warn(
        f"stages[{index}] ({type(stage).__name__}): submit(request_id, inputs) is "
        f"deprecated and goes in the next version; take the request's envelope instead, "
        f"submit(request), where request.request_id and request.inputs are what it got, "
        f"and request.life and request.route are new (see omni_trio.StageRequest)",
        OmniTrioDeprecationWarning,
        stacklevel=2,
    )
    return True


def seconds(*, positive: bool) -> Any:
    """An attrs validator: :func:`check_seconds` on the attribute, named after it."""

    def validate(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        check_seconds(attribute.name, value, positive=positive)

    return validate
