"""omni_trio.timeline: requests' stage spans, relative to their arrival, and their picture."""

from __future__ import annotations

import itertools
import sys

import pytest

from omni_trio import RequestMetrics
from omni_trio.timeline import (
    RequestTimeline,
    StageSpan,
    have_matplotlib,
    plot_timeline,
    request_timeline,
    timeline_figure,
)

NAMES = {0: "thinker", 1: "talker", 2: "code2wav"}
TYPES = {0: "text", 2: "audio"}


def async_chunk(t0: float) -> RequestMetrics:
    """All stages submitted at arrival, overlapping; first audio after 0.09 s."""
    return RequestMetrics(
        arrival_time=t0,
        terminal_time=t0 + 0.5,
        first_output_times={0: t0 + 0.02, 2: t0 + 0.09},
        stage_finish_times={0: t0 + 0.2, 1: t0 + 0.35, 2: t0 + 0.5},
        num_outputs=10,
        stage_submit_times={0: t0, 1: t0, 2: t0},
    )


def forward(t0: float) -> RequestMetrics:
    """Stage k+1 submitted when stage k finished; first audio after 0.6 s."""
    return RequestMetrics(
        arrival_time=t0,
        terminal_time=t0 + 0.9,
        first_output_times={0: t0 + 0.02, 2: t0 + 0.6},
        stage_finish_times={0: t0 + 0.2, 1: t0 + 0.5, 2: t0 + 0.9},
        num_outputs=10,
        stage_submit_times={0: t0, 1: t0 + 0.2, 2: t0 + 0.5},
    )


# -- the pure part (no matplotlib) --------------------------------------------------------


def test_async_chunk_spans_overlap_from_arrival():
    timeline = request_timeline(async_chunk(100.0), "r0")
    assert timeline.label == "r0"
    assert [span.stage_id for span in timeline.spans] == [0, 1, 2]
    assert [span.start for span in timeline.spans] == [0.0, 0.0, 0.0]
    assert [span.end for span in timeline.spans] == pytest.approx([0.2, 0.35, 0.5])
    assert timeline.first_outputs == pytest.approx({0: 0.02, 2: 0.09})
    assert timeline.e2e == pytest.approx(0.5)


def test_forward_spans_are_a_staircase():
    spans = request_timeline(forward(7.0), "r").spans
    assert [(s.start, s.end) for s in spans] == [
        (0.0, pytest.approx(0.2)),
        (pytest.approx(0.2), pytest.approx(0.5)),
        (pytest.approx(0.5), pytest.approx(0.9)),
    ]
    for before, after in itertools.pairwise(spans):
        assert after.start == pytest.approx(before.end)


def test_spans_are_sorted_by_stage_and_only_for_submitted_stages():
    metrics = RequestMetrics(
        arrival_time=1.0,
        terminal_time=2.0,
        first_output_times={},
        stage_finish_times={2: 1.5, 0: 1.25},
        num_outputs=1,
        stage_submit_times={2: 1.0, 0: 1.0},
    )
    timeline = request_timeline(metrics, "r")
    assert timeline.spans == (StageSpan(0, 0.0, 0.25), StageSpan(2, 0.0, 0.5))
    assert timeline.first_outputs == {}


def test_a_stage_that_never_finished_has_no_end_and_is_drawn_up_to_e2e():
    metrics = RequestMetrics(
        arrival_time=10.0,
        terminal_time=10.75,
        first_output_times={0: 10.25},
        stage_finish_times={0: 10.5},
        num_outputs=2,
        stage_submit_times={0: 10.0, 1: 10.5},
    )
    timeline = request_timeline(metrics, "aborted")
    unfinished = timeline.spans[1]
    assert unfinished == StageSpan(1, 0.5, None)
    assert timeline.span_end(unfinished) == 0.75
    assert timeline.span_end(timeline.spans[0]) == 0.5


def test_metrics_without_submit_times_have_no_spans():
    metrics = RequestMetrics(1.0, 2.0, {0: 1.5}, {0: 2.0}, 3)
    assert request_timeline(metrics, "old") == RequestTimeline("old", (), {0: 0.5}, 1.0)


def test_without_matplotlib_the_figure_says_how_to_install_it(monkeypatch):
    for module in ("matplotlib", "matplotlib.figure", "matplotlib.lines"):
        monkeypatch.setitem(sys.modules, module, None)
    assert not have_matplotlib()
    with pytest.raises(ImportError, match=r"pip install 'omni-trio\[plot\]'"):
        timeline_figure({"one": [async_chunk(0.0)]}, stage_names=NAMES, output_types=TYPES)


# -- the figure ---------------------------------------------------------------------------


@pytest.fixture
def mpl():
    return pytest.importorskip("matplotlib")


def figure(panels, **kwargs):
    return timeline_figure(panels, stage_names=NAMES, output_types=TYPES, **kwargs)


def markers(ax, marker):
    """The (x, y) of every point drawn with ``marker`` on ``ax``."""
    return sorted(
        (float(x), float(y))
        for line in ax.lines
        if line.get_marker() == marker
        for x, y in zip(line.get_xdata(), line.get_ydata(), strict=True)
    )


def test_one_axes_per_panel_sharing_x_with_a_lane_per_stage(mpl):
    assert have_matplotlib()
    pyplot_loaded = "matplotlib.pyplot" in sys.modules
    fig = figure(
        {"async_chunk": [async_chunk(0.0), async_chunk(3.0)], "forward": [forward(5.0)]},
        title="two modes",
    )
    top, bottom = fig.axes
    assert top.get_shared_x_axes().joined(top, bottom)
    assert [top.get_title(loc="left"), bottom.get_title(loc="left")] == ["async_chunk", "forward"]
    assert fig.get_suptitle() == "two modes"
    for ax in fig.axes:
        assert [t.get_text() for t in ax.get_yticklabels()] == ["thinker", "talker", "code2wav"]
        assert list(ax.get_yticks()) == [0, 1, 2]
        low, high = ax.get_ylim()
        assert low > high  # stage 0 on top
    assert (len(top.patches), len(bottom.patches)) == (3 * 2, 3 * 1)
    assert ("matplotlib.pyplot" in sys.modules) == pyplot_loaded  # no pyplot


def test_bars_run_from_submission_to_completion_in_their_lane(mpl):
    (ax,) = figure({"forward": [forward(5.0)]}).axes
    bars = sorted((bar.get_x(), bar.get_x() + bar.get_width(), bar.get_y()) for bar in ax.patches)
    assert [(start, end) for start, end, _ in bars] == [
        (0.0, pytest.approx(0.2)),
        (pytest.approx(0.2), pytest.approx(0.5)),
        (pytest.approx(0.5), pytest.approx(0.9)),
    ]
    for lane, (_, _, y) in enumerate(bars):
        assert lane - 0.5 < y < lane + 0.5


def test_requests_of_a_panel_are_offset_within_their_lane(mpl):
    (ax,) = figure({"async_chunk": [async_chunk(float(t)) for t in range(5)]}).axes
    thinker_bars = [bar for bar in ax.patches if bar.get_y() < 0.5]
    rows = {round(bar.get_y() + bar.get_height() / 2, 6) for bar in thinker_bars}
    assert len(thinker_bars) == len(rows) == 5
    assert all(-0.5 < row < 0.5 for row in rows)


def test_first_text_and_first_audio_are_marked_on_their_stages_lanes(mpl):
    top, bottom = figure({"async_chunk": [async_chunk(0.0)], "forward": [forward(1.0)]}).axes
    for ax, first_audio in ((top, 0.09), (bottom, 0.6)):
        ((text_x, text_y),) = markers(ax, "^")
        ((audio_x, audio_y),) = markers(ax, "*")
        assert text_x == pytest.approx(0.02)
        assert audio_x == pytest.approx(first_audio)
        assert abs(text_y - 0) < 0.5  # the thinker's lane
        assert abs(audio_y - 2) < 0.5  # the code2wav's lane
        assert f"first audio {first_audio * 1e3:.0f} ms" in ax.get_title(loc="right")
    legend = [text.get_text() for text in top.figure.legends[0].get_texts()]
    assert legend[:2] == ["first text", "first audio"]


def test_the_summary_averages_over_the_panels_requests(mpl):
    late = forward(0.0)
    late = RequestMetrics(0.0, 1.0, {0: 0.04, 2: 0.8}, late.stage_finish_times, 1, {0: 0.0})
    (ax,) = figure({"forward": [forward(0.0), late]}).axes
    assert ax.get_title(loc="right") == "mean: first text 30 ms, first audio 700 ms, E2E 950 ms"


def test_stages_missing_from_the_metrics_have_no_bar(mpl):
    partial = RequestMetrics(0.0, 0.3, {0: 0.1}, {0: 0.3}, 2, {0: 0.0})
    (ax,) = figure({"text only": [partial]}).axes
    assert len(ax.patches) == 1
    assert markers(ax, "*") == []
    assert "first audio" not in ax.get_title(loc="right")


def test_an_empty_panel_says_it_has_no_requests(mpl):
    fig = figure({"async_chunk": [async_chunk(0.0)], "forward": []})
    empty = fig.axes[1]
    assert len(empty.patches) == 0
    assert [t.get_text() for t in empty.texts] == ["no requests"]
    assert [t.get_text() for t in empty.get_yticklabels()] == ["thinker", "talker", "code2wav"]


def test_no_panels_is_an_error(mpl):
    with pytest.raises(ValueError, match="no panels"):
        figure({})


def test_plot_timeline_writes_a_png(mpl, tmp_path):
    import matplotlib.image

    path = tmp_path / "timeline.png"
    panels = {"async_chunk": [async_chunk(0.0)] * 3, "forward": [forward(0.0)] * 3, "none": []}
    plot_timeline(path, panels, stage_names=NAMES, output_types=TYPES, title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, channels = matplotlib.image.imread(path).shape
    assert height > 300
    assert width > 600
    assert channels in (3, 4)


def test_a_single_request_single_panel_png(mpl, tmp_path):
    path = tmp_path / "one.png"
    plot_timeline(str(path), {"run": [forward(2.0)]}, stage_names=NAMES, output_types=TYPES)
    assert path.read_bytes().startswith(b"\x89PNG")
