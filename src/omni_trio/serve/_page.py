"""The voice page at ``/``: a browser client of ``/v1/realtime``, shipped in the
package (``page/``: HTML, CSS and two scripts; no build step, nothing fetched from
elsewhere).

The page speaks to the model through the realtime session, as any client does: the
microphone through an AudioWorklet (resampled to 24 kHz PCM16), the answer's audio
played as it streams and stopped at ``speech_started`` (barge-in), both transcripts,
each turn's latency. What it may do comes from the server, in the page itself: the
model's name, whether it listens and speaks, the voices, and the session's limits.
A model that cannot listen gets the same page without the microphone: text in,
text (or audio) out.
"""

from __future__ import annotations

import html
import importlib.resources
import string
from typing import TYPE_CHECKING

from starlette.responses import Response
from starlette.routing import Route

from ._protocol import encode

if TYPE_CHECKING:
    from starlette.requests import Request

    from ._model import ServedModel
    from ._realtime_options import RealtimeOptions

__all__ = ["page_routes"]

_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
#: The page's files are read once; a browser may keep them for a minute.
_CACHE = {"cache-control": "max-age=60"}


def page_config(model: ServedModel, options: RealtimeOptions) -> dict[str, object]:
    """What the page is told of the server: the model, what it can do, the limits."""
    speaks = "audio" in model.modalities
    voices: list[str] = []
    if speaks and model.speech is not None:
        from ..speech._voices import VOICES

        voices = sorted(VOICES)
    return {
        "model": model.name,
        "listens": model.hearing is not None,
        "speaks": speaks,
        "voices": voices,
        "limits": {
            "max_buffer_seconds": options.max_buffer_seconds,
            "max_event_bytes": options.max_event_bytes,
            "idle_timeout": options.idle_timeout,
        },
    }


def page_routes(model: ServedModel, options: RealtimeOptions) -> list[Route]:
    """``GET /`` (the page, with its config) and ``GET /page/{name}`` (its files)."""
    files = importlib.resources.files(__package__).joinpath("page")
    assets: dict[str, bytes] = {}
    for entry in files.iterdir():
        if entry.name.endswith((".js", ".css")):
            assets[entry.name] = entry.read_bytes()
    config = page_config(model, options)
    # JSON inside <script>: "</" would end the element, so it is escaped.
    data = encode(config).decode().replace("</", "<\\/")
    text = string.Template(files.joinpath("index.html").read_text("utf-8")).substitute(
        model=html.escape(model.name),
        config=data,
        kind=" ".join(
            (["text-only"] if not config["listens"] else [])
            + (["no-voices"] if not config["voices"] else [])
        ),
    )
    index_body = text.encode()

    async def index(request: Request) -> Response:
        return Response(index_body, media_type=_TYPES[".html"], headers=_CACHE)

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        body = assets.get(name)
        if body is None:
            return Response(b"not found", 404, media_type="text/plain")
        return Response(body, headers=_CACHE, media_type=_TYPES[name[name.rfind(".") :]])

    return [
        Route("/", index, methods=["GET"]),
        Route("/page/{name}", asset, methods=["GET"]),
    ]
