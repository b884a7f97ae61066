"""Priority through ``omni-trio serve``: the ``priority`` field of every endpoint, the
order in which waiting requests are let in, the shedding of the last one at
capacity, and what ``/metrics`` says of queue waits."""

from __future__ import annotations

from collections import defaultdict
from functools import partial
from typing import Any

import httpx
import msgspec
import pytest
import trio
import trio.testing

from omni_trio.config import shipped_pipeline
from omni_trio.serve import RealtimeOptions, ServedModel, create_app
from serve_helpers import MANUAL, PROMPTLY, TEXT, chat_body, running_server, served
from test_serve import assert_error_object, scrape


def http_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=PROMPTLY)


@pytest.mark.parametrize(
    ("priority", "message"),
    [
        (1001, "priority: Expected `int` <= 1000"),
        (-1001, "priority: Expected `int` >= -1000"),
        (1.5, "priority: Expected `int | null`, got `float`"),
        ("high", "priority: Expected `int | null`, got `str`"),
    ],
)
async def test_a_bad_priority_is_a_400_naming_it(priority: Any, message: str) -> None:
    async with running_server() as server, http_client() as client:
        response = await client.post(server.chat_url(), json=chat_body("hi", priority=priority))
        assert response.status_code == 400
        error = assert_error_object(response.json(), "invalid_request_error")
        assert error["param"] == "priority"
        assert error["message"] == message
        assert server.stages[0].submissions == []


async def test_waiting_requests_are_let_in_most_urgent_first() -> None:
    async with running_server(max_in_flight=1, max_waiting=8) as server:
        held = MANUAL + "holds the only slot"
        done: list[str] = []
        async with http_client() as client, trio.open_nursery() as nursery:

            async def post(prompt: str, **fields: Any) -> None:
                response = await client.post(server.chat_url(), json=chat_body(prompt, **fields))
                assert response.status_code == 200, response.text
                done.append(prompt)

            nursery.start_soon(post, held)
            await server.engine.submitted(held)
            asks = [("batch", 10), ("chat", None), ("voice", -10), ("urgent", -10)]
            for index, (prompt, priority) in enumerate(asks):
                fields = {} if priority is None else {"priority": priority}
                nursery.start_soon(partial(post, prompt, **fields))
                with trio.fail_after(PROMPTLY):
                    await server.state.active.wait_value(index + 2)
            assert server.state.statistics().waiting == 4
            await server.engine.play_all(held)
        assert done == [held, "voice", "urgent", "chat", "batch"]
        metrics = await scrape(server)
        count = "omni_trio:queue_wait_seconds_count"
        waits = {
            priority: metrics[count, {"stage": "admission", "priority": priority}]
            for priority in ("-10", "0", "10")
        }
        assert waits == {"-10": 2.0, "0": 2.0, "10": 1.0}


async def test_at_capacity_the_last_waiting_request_is_shed_for_a_more_urgent_one() -> None:
    async with running_server(max_in_flight=1, max_waiting=2) as server:
        held = MANUAL + "holds the only slot"
        responses: dict[str, httpx.Response] = {}
        async with http_client() as client, trio.open_nursery() as nursery:
            answered: defaultdict[str, trio.Event] = defaultdict(trio.Event)

            async def post(prompt: str, priority: int) -> None:
                responses[prompt] = await client.post(
                    server.chat_url(), json=chat_body(prompt, priority=priority)
                )
                answered[prompt].set()

            nursery.start_soon(post, held, 0)
            await server.engine.submitted(held)
            for prompt, priority in [("batch", 5), ("chat", 0)]:
                nursery.start_soon(post, prompt, priority)
                await trio.testing.wait_all_tasks_blocked()
            assert server.state.statistics().waiting == 2
            # Not more urgent than any waiting one: refused itself.
            late = await client.post(server.chat_url(), json=chat_body("late", priority=5))
            assert late.status_code == 503
            assert "none of them after a request of priority 5" in late.json()["error"]["message"]
            # More urgent than the batch request: it takes its place.
            nursery.start_soon(post, "voice", -10)
            with trio.fail_after(PROMPTLY):
                await answered["batch"].wait()
            shed = responses["batch"]
            assert shed.status_code == 503
            assert shed.headers["retry-after"] == "1"
            error = assert_error_object(shed.json(), "server_error")
            assert error["code"] == "server_overloaded"
            assert "gave its place to a more urgent one" in error["message"]
            await server.engine.play_all(held)
        assert {prompt: r.status_code for prompt, r in responses.items()} == {
            held: 200,
            "batch": 503,
            "chat": 200,
            "voice": 200,
        }
        assert not server.engine.was_submitted("batch", 0)
        assert server.state.shed == 1
        metrics = await scrape(server)
        assert metrics["omni_trio:requests_shed_total"] == 1


def test_the_server_checks_its_endpoints_priorities() -> None:
    model = ServedModel("m", (TEXT,))
    with pytest.raises(ValueError, match="priorities: unknown endpoint 'batch'"):
        create_app(model, lambda: None, priorities={"batch": 1})  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match=r"priorities\['chat'\] must be an integer"):
        create_app(model, lambda: None, priorities={"chat": 1.5})  # type: ignore[arg-type,dict-item]
    with pytest.raises(ValueError, match="priority must be an integer from -1000 to 1000"):
        RealtimeOptions(priority=5000)


async def test_a_high_priority_chat_overtakes_queued_low_priority_ones_on_real_workers() -> None:
    """The demo pipeline's worker processes, one request in flight at a time: a
    chat of priority -5, sent after two of priority 5 that wait, is answered
    before both."""
    config = shipped_pipeline("demo").with_pipeline(max_in_flight=1)
    async with served(config) as (url, _pipeline), http_client() as client:
        done: list[str] = []

        async def ask(name: str, priority: int) -> None:
            body = {
                "model": config.pipeline.name,
                "messages": [{"role": "user", "content": name}],
                "modalities": ["text"],
                "priority": priority,
            }
            response = await client.post(f"{url}/v1/chat/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            done.append(name)

        async with trio.open_nursery() as nursery:
            for name, priority in [("first", 0), ("low 1", 5), ("low 2", 5)]:
                nursery.start_soon(ask, name, priority)
                await trio.sleep(0.1)
            nursery.start_soon(ask, "high", -5)
        assert done == ["first", "high", "low 1", "low 2"]


def test_the_request_bodies_take_a_priority() -> None:
    from omni_trio.serve._protocol import ChatCompletionRequest
    from omni_trio.serve._speech import SpeechRequest

    chat = msgspec.json.decode(
        b'{"model": "m", "messages": [], "priority": -3}', type=ChatCompletionRequest
    )
    assert chat.priority == -3
    speech = msgspec.json.decode(
        b'{"model": "m", "input": "hi", "voice": "alloy"}', type=SpeechRequest
    )
    assert speech.priority is None
