"""Draw requests' stage spans: when each stage worked on a request, and when the user
got its first text and first audio.

The pure part, :class:`StageSpan`, :class:`RequestTimeline` and
:func:`request_timeline`, turns a :class:`~omni_trio.RequestMetrics` into times
relative to the request's arrival. :func:`timeline_figure` and :func:`plot_timeline`
draw them with matplotlib, the optional extra ``plot`` (``pip install
'omni-trio[plot]'``): one panel per run (``async_chunk`` above ``forward``, say), one
lane per stage, one bar per request and stage, from submission to completion. In
async_chunk mode the bars overlap; in forward mode they make a staircase.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from importlib.util import find_spec
from statistics import fmean
from typing import TYPE_CHECKING

import attrs

from ._messages import RequestMetrics

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "RequestTimeline",
    "StageSpan",
    "have_matplotlib",
    "plot_timeline",
    "request_timeline",
    "timeline_figure",
]

MISSING_MATPLOTLIB = "the timeline needs matplotlib: pip install 'omni-trio[plot]'"

#: Requests of a panel get a row of their own in each lane, up to this many; more
#: share rows (request ``j`` takes row ``j % MAX_ROWS``).
MAX_ROWS = 5
#: How the first output of a final stage is marked, by output type.
MARKERS = {
    "transcript": ("o", "first transcript"),
    "text": ("^", "first text"),
    "audio": ("*", "first audio"),
}


@attrs.frozen
class StageSpan:
    """When a stage worked on a request, in seconds since the request's arrival.

    Attributes:
      stage_id: The stage.
      start: When the orchestrator submitted the request to the stage.
      end: When the stage reported finishing it; ``None`` if it never did (the request
          was aborted or failed first).
    """

    stage_id: int
    start: float
    end: float | None


@attrs.frozen
class RequestTimeline:
    """One request's times, relative to its arrival.

    Attributes:
      label: What to call the request.
      spans: One span per stage the request was submitted to, by stage id.
      first_outputs: Per final stage that emitted any, when its first output reached
          the user.
      e2e: When the request's terminal output was emitted.
    """

    label: str
    spans: tuple[StageSpan, ...]
    first_outputs: dict[int, float]
    e2e: float

    def span_end(self, span: StageSpan) -> float:
        """Where ``span`` is drawn up to: its end, or :attr:`e2e` if it has none."""
        return self.e2e if span.end is None else span.end


def request_timeline(metrics: RequestMetrics, label: str = "") -> RequestTimeline:
    """The timeline of the request ``metrics`` describes.

    A stage the request was never submitted to (it has no
    ``metrics.stage_submit_times`` entry) has no span.
    """
    t0 = metrics.arrival_time
    finish = metrics.stage_finish_times
    spans = tuple(
        StageSpan(stage_id, submit - t0, finish[stage_id] - t0 if stage_id in finish else None)
        for stage_id, submit in sorted(metrics.stage_submit_times.items())
    )
    first = {stage_id: t - t0 for stage_id, t in sorted(metrics.first_output_times.items())}
    return RequestTimeline(label, spans, first, metrics.terminal_time - t0)


def have_matplotlib() -> bool:
    """Whether matplotlib, which :func:`timeline_figure` needs, is installed."""
    return find_spec("matplotlib") is not None


def timeline_figure(
    panels: Mapping[str, Sequence[RequestMetrics]],
    *,
    stage_names: Mapping[int, str],
    output_types: Mapping[int, str],
    title: str | None = None,
) -> Figure:
    """Draw the requests of each panel, panels stacked top to bottom in order.

    The panels share the x axis, seconds since each request's own arrival (requests
    are overlaid). Each has a lane per stage of ``stage_names`` (stage 0 on top)
    where each request is a bar from submission to completion, its first outputs are
    marked (a triangle for a ``"text"`` stage of ``output_types``, a star for an
    ``"audio"`` one, a circle for a ``"transcript"`` one) and a dotted line marks its
    terminal output. The panel is titled with its key on the left and, on the right,
    the mean times to first transcript (if any), first text, first audio and terminal
    output of its requests. Stages not in ``stage_names`` are not drawn. Built without
    pyplot: no global state, no GUI.

    Raises:
      ValueError: ``panels`` is empty.
      ImportError: matplotlib is not installed.
    """
    if not panels:
        raise ValueError("no panels to draw")
    try:
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
    except ImportError as exc:
        raise ImportError(MISSING_MATPLOTLIB) from exc

    lanes = {stage_id: lane for lane, stage_id in enumerate(sorted(stage_names))}
    height = 0.9 + 0.45 * max(len(lanes), 1)
    fig = Figure(figsize=(9, 0.6 + height * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (name, requests) in zip(axes, panels.items(), strict=True):
        timelines = [request_timeline(m, f"{name} #{j}") for j, m in enumerate(requests)]
        _draw_panel(ax, name, timelines, lanes, stage_names, output_types)
    axes[-1].set_xlabel("seconds since the request's arrival")
    axes[-1].set_xlim(left=0)
    handles = [
        Line2D([], [], color="black", marker=marker, ls="none", label=label)
        for kind, (marker, label) in MARKERS.items()
        if kind in output_types.values()
    ]
    handles.append(Line2D([], [], color="grey", lw=0.8, ls=":", label="terminal (E2E)"))
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize="small")
    if title is not None:
        fig.suptitle(title)
    return fig


def plot_timeline(
    path: str | os.PathLike[str],
    panels: Mapping[str, Sequence[RequestMetrics]],
    *,
    stage_names: Mapping[int, str],
    output_types: Mapping[int, str],
    title: str | None = None,
) -> None:
    """Save :func:`timeline_figure` of the same arguments to ``path``, as a PNG.

    Raises:
      ImportError: matplotlib is not installed.
    """
    fig = timeline_figure(panels, stage_names=stage_names, output_types=output_types, title=title)
    fig.savefig(path, format="png", dpi=120, bbox_inches="tight")


def _draw_panel(
    ax: Axes,
    name: str,
    timelines: Sequence[RequestTimeline],
    lanes: Mapping[int, int],
    stage_names: Mapping[int, str],
    output_types: Mapping[int, str],
) -> None:
    """One panel: a lane per stage (``lanes``: stage id -> lane, 0 on top)."""
    rows = min(max(len(timelines), 1), MAX_ROWS)
    row_height = 0.8 / rows

    def row_center(lane: int, j: int) -> float:
        return lane - 0.4 + row_height * (j % rows + 0.5)

    for stage_id, lane in lanes.items():
        bars = [
            (row_center(lane, j), t.span_end(span) - span.start, span.start)
            for j, t in enumerate(timelines)
            for span in t.spans
            if span.stage_id == stage_id
        ]
        if bars:
            y, width, left = zip(*bars, strict=True)
            ax.barh(y, width, left=left, height=row_height * 0.8, color=f"C{lane}", alpha=0.55)
        kind = output_types.get(stage_id)
        marks = [
            (t.first_outputs[stage_id], row_center(lane, j))
            for j, t in enumerate(timelines)
            if stage_id in t.first_outputs
        ]
        if kind in MARKERS and marks:
            x, y = zip(*marks, strict=True)
            marker, label = MARKERS[kind]
            ax.plot(x, y, ls="none", marker=marker, color="black", ms=7, label=label, zorder=3)
    if timelines:
        bottom, top = -0.5, len(lanes) - 0.5
        ax.vlines([t.e2e for t in timelines], bottom, top, color="grey", lw=0.8, ls=":")
    else:
        ax.text(0.5, 0.5, "no requests", transform=ax.transAxes, ha="center", va="center")
    ax.set_yticks(list(lanes.values()), [stage_names[stage_id] for stage_id in lanes])
    for tick, lane in zip(ax.get_yticklabels(), lanes.values(), strict=True):
        tick.set_color(f"C{lane}")
    ax.set_ylim(len(lanes) - 0.5, -0.5)  # stage 0 on top
    ax.set_title(name, loc="left", fontweight="bold")
    ax.set_title(_summary(timelines, output_types), loc="right", fontsize="small")


def _summary(timelines: Sequence[RequestTimeline], output_types: Mapping[int, str]) -> str:
    """``"mean: first text 20 ms, first audio 90 ms, E2E 300 ms"``: each request's
    earliest output of a kind, averaged over the requests that had one."""
    parts = []
    for kind in MARKERS:
        stages = {stage_id for stage_id, k in output_types.items() if k == kind}
        firsts = [
            min(t for stage_id, t in tl.first_outputs.items() if stage_id in stages)
            for tl in timelines
            if stages & tl.first_outputs.keys()
        ]
        if firsts:
            parts.append(f"first {kind} {fmean(firsts) * 1e3:,.0f} ms")
    if timelines:
        parts.append(f"E2E {fmean(t.e2e for t in timelines) * 1e3:,.0f} ms")
    return "mean: " + ", ".join(parts) if parts else ""
