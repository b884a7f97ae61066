"""Engines for the process-stage tests (imported by the worker processes)."""

from __future__ import annotations

import os
import sys
import time

import trio

from omni_trio.process import Last


def stream(count: int = 3, delay: float = 0.0, chunked: bool = True):
    """Yields ``count`` items; streams each one downstream too, when connected."""

    async def engine(request, io):
        for i in range(count):
            if delay:
                await trio.sleep(delay)
            item = f"{request.inputs}:{request.stage_id}:{i}"
            if chunked and io.connected:
                await io.send(item.encode())
            yield item

    return engine


def relay(delay: float = 0.0):
    """async_chunk: yields (and passes on) each upstream chunk; forward: its inputs."""

    async def engine(request, io):
        if io.connected:
            async for chunk in io:
                if delay:
                    await trio.sleep(delay)
                await io.send(chunk)
                yield chunk.decode().upper()
        else:
            for item in request.inputs:
                yield str(item).upper()

    return engine


def marks_last(count: int = 3, meta: dict | None = None):
    """Yields ``count`` items, the last wrapped in ``Last`` (with ``meta``): stage 0
    makes them up, a later stage upper-cases its upstream chunks (it stops at the
    ``count``-th, its last) or its forwarded inputs; each item is streamed downstream
    too, when connected."""

    async def engine(request, io):
        if request.stage_id == 0:
            for i in range(count):
                item = f"{request.inputs}:{i}"
                if io.connected:
                    await io.send(item.encode())
                yield Last(item, meta) if i == count - 1 else item
        elif io.connected:
            i = 0
            async for chunk in io:
                i += 1
                item = chunk.decode().upper()
                await io.send(item.encode())
                yield Last(item, meta) if i == count else item
        else:
            items = [str(item).upper() for item in request.inputs]
            for i, item in enumerate(items):
                yield Last(item, meta) if i == len(items) - 1 else item

    return engine


def last_when_told(signal: str):
    """Yields ``first``, then waits until the file ``signal`` exists, then yields
    ``Last("second")``: the test creates it only once ``first`` reached it."""

    async def engine(request, io):
        yield "first"
        while not await trio.Path(signal).exists():  # noqa: ASYNC110 - the test is another process
            await trio.sleep(0.01)
        yield Last("second")

    return engine


def fails(when: str = "boom"):
    async def engine(request, io):
        yield "before"
        if request.inputs == when:
            raise ValueError("the engine broke")
        yield "after"

    return engine


def unencodable():
    async def engine(request, io):
        yield object()

    return engine


def blocks_the_loop(seconds: float = 3.0):
    """Holds the worker's event loop (no pongs) when asked to."""

    async def engine(request, io):
        if request.inputs == "block":
            time.sleep(seconds)  # noqa: ASYNC251 - the point: the worker's loop is stuck
        yield "done"

    return engine


def hangs():
    """Yields once, then waits forever: a hung engine in a healthy worker (it still
    answers heartbeats), which only ``stage_idle_timeout`` ends."""

    async def engine(request, io):
        yield "first"
        await trio.sleep_forever()

    return engine


def corrupts_its_control_stream():
    """Writes garbage where frames should be: a worker gone wrong."""

    async def engine(request, io):
        fd = int(sys.argv[sys.argv.index("--control-fd") + 1])
        os.write(fd, b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1")
        yield "never seen"

    return engine


def broken_factory():
    raise RuntimeError("no weights found")


def forward_join(outputs):
    return outputs


def slow_to_load(seconds: float = 5.0):
    time.sleep(seconds)
    return stream()


def exits_while_loading(code: int = 3):
    os._exit(code)


def exits(code: int = 3):
    """Exits the whole worker mid-request, as a crashing native library would."""

    async def engine(request, io):
        yield "before"
        os._exit(code)

    return engine


def exits_then_loads_slowly(marker: str, seconds: float = 3.0, code: int = 3):
    """The first worker exits mid-request; every later one takes ``seconds`` to load."""
    if os.path.exists(marker):
        time.sleep(seconds)
    else:
        with open(marker, "w"):
            pass
    return exits(code)


def relay_reloading_slowly(marker: str, seconds: float = 1.0):
    """``relay``, whose workers after the first take ``seconds`` to load."""
    if os.path.exists(marker):
        time.sleep(seconds)
    else:
        with open(marker, "w"):
            pass
    return relay()


def sized_chunk(request_id: str, seq: int, size: int) -> bytes:
    """``size`` bytes that say whose and which chunk they are, wherever they are cut."""
    return (f"{request_id}:{seq};".encode() * (size // 4 + 1))[:size]


def sends(sizes: list[int], repeat: int = 1, start: float = 0.0, delay: float = 0.0):
    """Streams ``repeat`` rounds of one chunk of each of ``sizes`` (see
    :func:`sized_chunk`), starting after ``start`` seconds (time for the reading
    stage's submit to arrive first), ``delay`` seconds before each; yields, as each
    chunk is sent, how many have been: its progress, as the orchestrator sees it."""

    async def engine(request, io):
        await trio.sleep(start)
        seq = 0
        for _ in range(repeat):
            for size in sizes:
                if delay:
                    await trio.sleep(delay)
                await io.send(sized_chunk(request.request_id, seq, size))
                seq += 1
                yield seq

    return engine


def reads(gate: str = "", delay: float = 0.0):
    """Reads its upstream chunks (``delay`` seconds after each); yields, per chunk,
    its size if it is the one :func:`sends` sent in its place, whole, else what is
    wrong with it. A request whose id starts with ``held`` reads nothing until the
    file ``gate`` exists."""

    async def engine(request, io):
        if request.request_id.startswith("held"):
            while not await trio.Path(gate).exists():  # noqa: ASYNC110 - the test is another process
                await trio.sleep(0.01)
        seq = 0
        async for chunk in io:
            if delay:
                await trio.sleep(delay)
            if chunk == sized_chunk(request.request_id, seq, len(chunk)):
                yield len(chunk)
            else:
                yield f"chunk {seq} is not the one sent ({len(chunk)} bytes)"
            seq += 1

    return engine


def records_cancel(directory: str, count: int = 1000, delay: float = 0.02):
    """Stage 0 streams ``count`` items, one per ``delay`` seconds (and downstream,
    when connected); a later stage relays its upstream chunks (or yields its forwarded
    inputs). Any stage writes ``<directory>/<stage>-<request>`` when its request is
    cancelled (or its generator closed before its end): the proof, from another
    process, that an abort reached the engine."""

    async def engine(request, io):
        try:
            if request.stage_id == 0:
                for i in range(count):
                    await trio.sleep(delay)
                    item = f"{request.inputs}:{i}"
                    if io.connected:
                        await io.send(item.encode())
                    yield item
            elif io.connected:
                async for chunk in io:
                    await io.send(chunk)
                    yield chunk.decode()
            else:
                for item in request.inputs:
                    yield item
        except BaseException:  # Cancelled, or GeneratorExit if stopped at a yield
            marker = os.path.join(directory, f"{request.stage_id}-{request.request_id}")
            with open(marker, "w"):  # noqa: ASYNC230 - one small file, as the engine dies
                pass
            raise

    return engine


def echo(tokens_per_second: float = 0.0):
    """A thinker that reads its prompt aloud: yields (and streams downstream, when
    connected) the prompt's words as tokens ``"word "``, the last as ``Last``."""

    async def engine(request, io):
        words = str(request.inputs).split()
        for index, word in enumerate(words, 1):
            if tokens_per_second:
                await trio.sleep(1 / tokens_per_second)
            token = word + " "
            if io.connected:
                await io.send(token.encode())
            yield Last(token) if index == len(words) else token

    return engine


def loaded_modules():
    """Yields the names of every module this worker process has loaded."""

    async def engine(request, io):
        yield sorted(sys.modules)

    return engine


def counts(size: int = 10, delay: float = 0.0):
    """Yields ``request.inputs`` outputs of ``size`` bytes (``-1``: for ever), as fast
    as it may; streams each downstream too, when connected."""

    async def engine(request, io):
        i = 0
        while i != request.inputs:
            data = b"%d" % (i % 10) * size
            if io.connected:
                await io.send(data)
            yield data
            i += 1
            if delay:
                await trio.sleep(delay)

    return engine


def whoami(delay: float = 0.0):
    """Yields, after ``delay`` seconds (or as long as the request's inputs say, when
    they are a number), which worker ran it: its pid and its ``CUDA_VISIBLE_DEVICES``;
    relays its upstream chunks, when connected, as ``"<pid>:<chunk>"``."""

    async def engine(request, io):
        me = f"{os.getpid()}"
        if io.connected and request.stage_id:
            async for chunk in io:
                await io.send(chunk)
                yield f"{me}:{chunk.decode()}"
            return
        seconds = request.inputs if isinstance(request.inputs, (int, float)) else delay
        await trio.sleep(seconds)
        if io.connected:
            await io.send(me.encode())
        yield {"pid": os.getpid(), "devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    return engine


def sends_its_inputs():
    """Stage 0 of the replica tests: streams one :func:`sized_chunk` per size in its
    inputs, and yields ``[pid, seq]`` for each."""

    async def engine(request, io):
        for seq, size in enumerate(request.inputs):
            await io.send(sized_chunk(request.request_id, seq, size))
            yield [os.getpid(), seq]

    return engine


def passes_on():
    """Passes each upstream chunk on as it is, and yields ``[pid, its size]``."""

    async def engine(request, io):
        async for chunk in io:
            await io.send(chunk)
            yield [os.getpid(), len(chunk)]

    return engine


def checks():
    """Reads its upstream chunks; yields ``[pid, size]`` for each that is the one
    :func:`sends_its_inputs` sent in its place, whole, else ``[pid, what is
    wrong]``."""

    async def engine(request, io):
        seq = 0
        async for chunk in io:
            if chunk == sized_chunk(request.request_id, seq, len(chunk)):
                yield [os.getpid(), len(chunk)]
            else:
                yield [os.getpid(), f"chunk {seq} is not the one sent ({len(chunk)} bytes)"]
            seq += 1

    return engine


def enters_or_relays():
    """Where a request enters (its input is the prompt): sends and yields the
    prompt's words; elsewhere (a placeholder, ``None``): upper-cases and passes on
    each upstream chunk, as :func:`relay` does."""

    async def engine(request, io):
        if request.inputs is not None:
            for word in str(request.inputs).split():
                await io.send(word.encode())
                yield word
            return
        async for chunk in io:
            await io.send(chunk)
            yield chunk.decode().upper()

    return engine


def shows_its_inputs():
    """Yields its inputs as they came (forward mode: a join's are a dict, by stage)."""

    async def engine(request, io):
        yield request.inputs

    return engine


def joins(sequential: bool = False):
    """A fan-in: yields ``"<source>:<chunk>"`` for every chunk of every stage it
    reads -- as they come (``io.chunks()``), or each source's whole stream in turn
    (``io.source(k)``, for sources that do not wait on each other)."""

    async def engine(request, io):
        if sequential:
            for source in io.sources:
                async for chunk in io.source(source):
                    yield f"{source}:{chunk.decode()}"
        else:
            async for source, chunk in io.chunks():
                yield f"{source}:{chunk.decode()}"

    return engine


def deals(count: int = 0):
    """Where a request enters: deals its words out to the stages that read it, one
    each in turn (``send(to=)``), and yields each; with ``count``, sends that many
    numbered words more the same way (to fill windows)."""

    async def engine(request, io):
        targets = io.targets
        words = str(request.inputs).split() + [f"w{i}" for i in range(count)]
        for i, word in enumerate(words):
            await io.send(word.encode(), to=targets[i % len(targets)])
            yield word

    return engine


def breaks_on(word: str):
    """Relays as :func:`enters_or_relays` does, and raises on the chunk ``word``."""

    async def engine(request, io):
        async for chunk in io:
            if chunk.decode() == word:
                raise ValueError(f"the engine broke on {word!r}")
            await io.send(chunk)
            yield chunk.decode().upper()

    return engine


def misreads(how: str):
    """Uses ``io`` wrongly, as ``how`` says: iterates a fan-in's ``io``, reads a
    stage it does not read, sends to a stage that does not read it."""

    async def engine(request, io):
        if how == "iterate":
            async for chunk in io:
                yield chunk
        elif how == "source":
            io.source(7)
        else:
            await io.send(b"x", to=9)
        yield None

    return engine
