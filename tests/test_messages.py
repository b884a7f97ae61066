"""The message types: immutable, typed, cheap, and equal whatever their timings."""

from __future__ import annotations

import inspect
import pickle

import msgspec
import pytest

from omni_trio import OrchOutput, RequestMetrics, StageOutput

METRICS = RequestMetrics(
    arrival_time=1.0,
    terminal_time=2.0,
    first_output_times={0: 1.5},
    stage_finish_times={0: 1.9},
    num_outputs=2,
)


def test_outputs_are_immutable() -> None:
    out = OrchOutput("r", 0, "hi", False)
    with pytest.raises(AttributeError):
        out.data = "changed"  # type: ignore[misc]
    stage_out = StageOutput("r", "hi")
    with pytest.raises(AttributeError):
        stage_out.finished = True  # type: ignore[misc]


def test_stage_output_defaults_and_equality() -> None:
    assert StageOutput("r") == StageOutput("r", None, False, None)
    assert StageOutput("r", 1) != StageOutput("r", 2)
    assert StageOutput("r", error="boom").error == "boom"


def test_orch_output_equality_and_hash_ignore_metrics() -> None:
    plain = OrchOutput("r", 2, None, True, "completed")
    timed = msgspec.structs.replace(plain, metrics=METRICS)
    assert timed.metrics is METRICS
    assert plain == timed
    assert (plain != timed) is False  # __ne__ agrees
    assert hash(plain) == hash(timed)
    assert "metrics" not in repr(timed)
    # every other field counts
    for change in (
        {"request_id": "s"},
        {"stage_id": 0},
        {"data": b"x"},
        {"finished": False},
        {"finish_reason": "aborted"},
        {"error": "boom"},
    ):
        assert msgspec.structs.replace(plain, **change) != plain, change
    assert plain != ("r", 2, None, True, "completed")


def test_repr_names_what_is_set() -> None:
    out = OrchOutput("r", 1, None, True, "error", "stage 1 (talker) failed")
    assert repr(out) == (
        "OrchOutput(request_id='r', stage_id=1, data=None, finished=True, "
        "finish_reason='error', error='stage 1 (talker) failed')"
    )
    assert repr(OrchOutput("r", 0, "a", False)) == (
        "OrchOutput(request_id='r', stage_id=0, data='a', finished=False)"
    )


def test_outputs_pickle() -> None:
    out = msgspec.structs.replace(OrchOutput("r", 0, b"pcm", True, "completed"), metrics=METRICS)
    back = pickle.loads(pickle.dumps(out))
    assert back == out
    assert back.metrics == METRICS
    assert pickle.loads(pickle.dumps(StageOutput("r", [1, 2], True))) == StageOutput(
        "r", [1, 2], True
    )


def test_match_args_keep_the_field_order() -> None:
    match OrchOutput("r", 0, "a", False):
        case OrchOutput(request_id, stage_id, data, finished):
            assert (request_id, stage_id, data, finished) == ("r", 0, "a", False)


def test_signatures_resolve_from_the_package() -> None:
    # The types are re-exported as omni_trio.X; their signatures (help(), Sphinx)
    # must not need names from the module they were defined in.
    assert list(inspect.signature(OrchOutput).parameters) == [
        "request_id",
        "stage_id",
        "data",
        "finished",
        "finish_reason",
        "error",
        "metrics",
        "meta",
        "output_type",
    ]
    assert list(inspect.signature(StageOutput).parameters) == [
        "request_id",
        "data",
        "finished",
        "error",
        "released",
        "meta",
    ]


def test_meta_is_part_of_the_message() -> None:
    # What a stage says about its data is compared and shown; timings are not.
    said = OrchOutput("r", 0, "a", True, "completed", meta={"finish_reason": "length"})
    assert said != OrchOutput("r", 0, "a", True, "completed")
    assert said == msgspec.structs.replace(said, metrics=METRICS)
    assert repr(said).endswith(", meta={'finish_reason': 'length'})")
    assert hash(said) == hash(OrchOutput("r", 0, "a", True, "completed", meta=dict(said.meta)))
