"""The Starlette application: routes, and the pipeline in its lifespan.

The chat endpoint is an ASGI app of its own, called ahead of Starlette's middleware
and router (:class:`_ChatFirst`): a streamed answer sends once per batch of outputs,
straight to the server's ``send``, not through two wrappers of it. Middleware added
with ``add_middleware`` still wraps everything, the chat endpoint too.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any, Protocol

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from .._checks import check_positive_int
from .._priority import check_priority
from . import _defaults as defaults
from ._answer import Plan
from ._body import read_body, refuse
from ._chat import ChatResponse, send_json
from ._metrics import CONTENT_TYPE
from ._model import ServedModel
from ._page import page_routes
from ._protocol import Model, ModelList, OpenAIError, check_model, decode_request, encode
from ._realtime import RealtimeEndpoint
from ._realtime_options import RealtimeOptions
from ._response import EndpointResponse
from ._speech import SpeechResponse, plan_speech
from ._state import DEFAULT_PRIORITIES, OutputsHook, ServerState
from ._transcription import TranscriptionResponse, plan_transcription

if TYPE_CHECKING:
    from .._orchestrator import Orchestrator
    from ..config import PipelineConfig
    from ._chat import Receive, Scope, Send

__all__ = [
    "OpenPipeline",
    "ServedPipeline",
    "app_for_config",
    "create_app",
    "server_state",
]

_CHAT_PATH = "/v1/chat/completions"
_REALTIME_PATH = "/v1/realtime"


class ServedPipeline(Protocol):
    """What the server needs of a running pipeline: an :class:`omni_trio.Pipeline`
    (from :func:`omni_trio.open_pipeline`), or any object with these two attributes
    (a pipeline of scripted stages, in tests)."""

    @property
    def orchestrator(self) -> Orchestrator:
        """Where the server admits its requests."""

    @property
    def stages(self) -> Sequence[object]:
        """The pipeline's stages, in order: ``/metrics`` labels them by their ``name``,
        and shows the ``statistics()`` of those that have one."""


OpenPipeline = Callable[[], AbstractAsyncContextManager[ServedPipeline]]
"""``open_pipeline()``: an async context manager whose value is the running pipeline."""


def _json(body: object, status: int = 200) -> Response:
    return Response(encode(body), status, media_type="application/json")


def create_app(
    model: ServedModel,
    open_pipeline: OpenPipeline,
    *,
    max_waiting: int = defaults.MAX_WAITING,
    max_request_bytes: int = defaults.MAX_REQUEST_BYTES,
    on_outputs: OutputsHook | None = None,
    realtime: RealtimeOptions | None = None,
    max_audio_seconds: float = defaults.MAX_AUDIO_SECONDS,
    priorities: Mapping[str, int] | None = None,
) -> Starlette:
    """An OpenAI-compatible ASGI app serving ``model``: chat completions, the
    Realtime API's WebSocket at ``/v1/realtime`` (see ``docs/voice.md``), and speech
    (``/v1/audio/speech``) and transcription (``/v1/audio/transcriptions``) where the
    model's pipeline has a talker, and a listening stage.

    Args:
      model: The name clients ask for and the pipeline's final outputs.
      open_pipeline: Called once, in the app's lifespan: an async context manager
          whose value is the running pipeline (see :class:`ServedPipeline`), e.g.
          ``lambda: omni_trio.open_pipeline(config)``, which is what
          :func:`app_for_config` does. The app is ready (``/health`` 200) once it has
          entered, and it is left when the server stops.
      max_waiting: With the orchestrator's ``max_in_flight`` reached, how many more
          requests may wait for a slot; beyond that a request gets 503 at once.
      max_request_bytes: The largest chat request body the server reads; a longer
          one gets 413, before the rest of it is read.
      on_outputs: Called with each batch of a request's outputs, in the response's
          task, the moment the response takes it from the orchestrator (before it
          becomes SSE events or part of a whole answer): a hook for timing what
          happens after, as ``tools/bench_serve.py`` does. It must not block, and
          what it raises fails the response.
      realtime: The limits of ``/v1/realtime`` sessions (the defaults of
          :class:`RealtimeOptions` if ``None``).
      max_audio_seconds: The longest audio ``/v1/audio/transcriptions`` takes (a
          longer file gets 400, found while it is decoded).
      priorities: Per endpoint (``chat``, ``speech``, ``transcription``,
          ``realtime``), the priority of a request that gives none; those not
          given keep their defaults (0, and -10 for realtime).

    Raises:
      ValueError: ``max_waiting`` is negative, ``max_request_bytes`` is not
          positive, ``max_audio_seconds`` is not a positive number, or
          ``priorities`` names an unknown endpoint or a bad priority.
    """
    if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0:
        raise ValueError(f"max_waiting must be an integer >= 0, got {max_waiting!r}")
    check_positive_int("max_request_bytes", max_request_bytes)
    if not isinstance(max_audio_seconds, int | float) or not max_audio_seconds > 0:
        raise ValueError(f"max_audio_seconds must be a number > 0, got {max_audio_seconds!r}")
    state = ServerState(model, max_waiting, on_outputs, _priorities(priorities))
    state.realtime = RealtimeEndpoint(state, realtime or RealtimeOptions())
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        started = False
        try:
            async with open_pipeline() as pipeline:
                orchestrator = pipeline.orchestrator
                labels = [
                    getattr(stage, "name", None) or f"stage{index}"
                    for index, stage in enumerate(pipeline.stages)
                ]
                state.metrics.watch(orchestrator.statistics, labels, pipeline.stages)
                state.orchestrator = orchestrator
                started = True
                try:
                    yield
                finally:
                    state.orchestrator = None
                    state.metrics.watch(None, [])
        except Exception as exc:
            if not started:  # the server reports it as it is, not as a lifespan failure
                state.startup_error = exc
            raise

    async def health(request: Request) -> Response:
        if state.ready:
            return Response(status_code=200)
        return Response(b"draining" if state.draining else b"starting", 503)

    async def models(request: Request) -> Response:
        return _json(ModelList(data=[Model(id=model.name, created=created)]))

    async def metrics(request: Request) -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    def _plan(body: bytes) -> Plan:
        chat_request = decode_request(body)
        check_model(chat_request.model, model.name)
        outputs = model.select(chat_request.modalities)
        return Plan.of(
            chat_request,
            outputs,
            listens=model.hearing is not None,
            conversation=model.takes_utterances,
            speaks=model.speech is not None,
        )

    async def chat_response(scope: Scope, body: bytes) -> EndpointResponse:
        return ChatResponse(state, _plan(body))

    async def speech_response(scope: Scope, body: bytes) -> EndpointResponse:
        return SpeechResponse(state, plan_speech(body, model))

    async def transcription_response(scope: Scope, body: bytes) -> EndpointResponse:
        plan = await plan_transcription(scope, body, model, max_request_bytes=max_request_bytes)
        return TranscriptionResponse(state, plan, max_audio_seconds)

    chat = _Endpoint(chat_response, max_request_bytes)
    speech = _Endpoint(speech_response, max_request_bytes)
    transcription = _Endpoint(transcription_response, max_request_bytes)

    app = _App(
        chat,
        state.realtime,
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route(_CHAT_PATH, chat, methods=["POST"]),  # what _ChatFirst does not take
            Route("/v1/audio/speech", speech, methods=["POST"]),
            Route("/v1/audio/transcriptions", transcription, methods=["POST"]),
            *page_routes(model, state.realtime.options),
        ],
        lifespan=lifespan,
    )
    app.state.omni_trio = state
    return app


class _Endpoint:
    """A POST endpoint, as a plain ASGI app (Starlette calls it as it is): it reads
    the body itself, up to ``max_request_bytes`` (413 beyond, the rest unread), has
    ``respond`` check it -- an :class:`OpenAIError` is the answer -- and runs the
    response it makes."""

    def __init__(
        self,
        respond: Callable[[Scope, bytes], Awaitable[EndpointResponse]],
        max_request_bytes: int,
    ) -> None:
        self._respond = respond
        self._max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await read_body(scope, receive, self._max_request_bytes)
        except OpenAIError as exc:  # 413: the rest of the body stays unread
            await refuse(receive, send, exc)
            return
        if body is None:  # the client hung up: no one to answer
            return
        try:
            response = await self._respond(scope, body)
        except OpenAIError as exc:
            await send_json(send, exc.status, exc.body(), exc.headers)
            return
        await response(scope, receive, send)


class _App(Starlette):
    """Starlette, with ``chat`` called ahead of its own middleware and router for
    ``POST /v1/chat/completions`` (what ``add_middleware`` adds wraps both)."""

    def __init__(self, chat: ASGIApp, realtime: ASGIApp, **options: Any) -> None:
        super().__init__(**options)
        self._chat = chat
        self._realtime = realtime

    def build_middleware_stack(self) -> ASGIApp:
        added, self.user_middleware = self.user_middleware, []
        try:
            rest = super().build_middleware_stack()
        finally:
            self.user_middleware = added
        app: ASGIApp = _ChatFirst(self._chat, self._realtime, rest)
        for cls, args, kwargs in reversed(added):
            app = cls(app, *args, **kwargs)
        return app


class _ChatFirst:
    """``chat`` for ``POST /v1/chat/completions``, ``realtime`` for the WebSocket
    ``/v1/realtime``; ``rest`` (Starlette's middleware and router) for anything else.
    What the chat endpoint raises reaches the server as it is (Hypercorn answers 500
    if nothing was sent, and logs it)."""

    def __init__(self, chat: ASGIApp, realtime: ASGIApp, rest: ASGIApp) -> None:
        self._chat = chat
        self._realtime = realtime
        self._rest = rest

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] == _CHAT_PATH
            and scope["method"] == "POST"
            and not scope.get("root_path")
        ):
            await self._chat(scope, receive, send)
        elif (
            scope["type"] == "websocket"
            and scope["path"] == _REALTIME_PATH
            and not scope.get("root_path")
        ):
            await self._realtime(scope, receive, send)
        else:
            await self._rest(scope, receive, send)


def server_state(app: Starlette) -> ServerState:
    """The state :func:`create_app` keeps on ``app`` (for the server and tests)."""
    state: ServerState = app.state.omni_trio
    return state


def _priorities(given: Mapping[str, int] | None) -> dict[str, int]:
    priorities = dict(DEFAULT_PRIORITIES)
    for endpoint, priority in (given or {}).items():
        if endpoint not in priorities:
            raise ValueError(
                f"priorities: unknown endpoint {endpoint!r}: it is one of "
                + ", ".join(DEFAULT_PRIORITIES)
            )
        priorities[endpoint] = check_priority(priority, f"priorities[{endpoint!r}]")
    return priorities


def app_for_config(
    config: PipelineConfig,
    *,
    max_waiting: int = defaults.MAX_WAITING,
    max_request_bytes: int = defaults.MAX_REQUEST_BYTES,
    on_outputs: OutputsHook | None = None,
    realtime: RealtimeOptions | None = None,
    max_audio_seconds: float = defaults.MAX_AUDIO_SECONDS,
) -> Starlette:
    """:func:`create_app` for a pipeline config: its lifespan runs the config's
    pipeline (:func:`omni_trio.open_pipeline`)."""
    from .. import open_pipeline

    return create_app(
        ServedModel.from_config(config),
        lambda: open_pipeline(config),
        priorities=config.serve.priority.as_dict(),
        max_waiting=max_waiting,
        max_request_bytes=max_request_bytes,
        on_outputs=on_outputs,
        realtime=realtime,
        max_audio_seconds=max_audio_seconds,
    )
