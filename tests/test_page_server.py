"""What the server does for the voice page (the page itself runs in a browser in
tests/test_page.py): ``/`` and its files, told what the model can do; a refused
browser session told why; the voice a session asks for."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest
import trio
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from omni_trio.serve import RealtimeOptions, SpeechRoute
from realtime_helpers import (
    AUDIO,
    HEARD,
    MODEL,
    TEXT,
    Client,
    realtime_server,
    talk,
)


async def get(url: str) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.get(url)


def page_config(html: str) -> Any:
    found = re.search(r'<script id="config" type="application/json">(.*?)</script>', html)
    assert found, html
    return json.loads(found.group(1))


async def test_the_page_and_its_files_are_served_with_what_the_model_can_do() -> None:
    options = RealtimeOptions(max_buffer_seconds=30, max_event_bytes=4096)
    async with realtime_server(options=options) as server:
        page = await get(server.url + "/")
        assert page.status_code == 200
        assert page.headers["content-type"] == "text/html; charset=utf-8"
        config = page_config(page.text)
        assert config == {
            "model": MODEL,
            "listens": True,
            "speaks": True,
            "voices": [],  # no talker to ask for one
            "limits": {"max_buffer_seconds": 30.0, "max_event_bytes": 4096, "idle_timeout": 300.0},
        }
        assert "<title>omni_trio · omni-listening-scripted</title>" in page.text
        assert '<body class="no-voices">' in page.text
        for name, kind in [
            ("app.js", "text/javascript"),
            ("capture.js", "text/javascript"),
            ("style.css", "text/css"),
        ]:
            asset = await get(f"{server.url}/page/{name}")
            assert asset.status_code == 200
            assert asset.headers["content-type"].startswith(kind)
            assert asset.content
        for missing in ["nothing.js", "index.html", "..%2Fapp.py"]:
            assert (await get(f"{server.url}/page/{missing}")).status_code == 404


async def test_a_model_that_cannot_listen_gets_the_text_page() -> None:
    async with realtime_server(outputs=(TEXT,)) as server:
        page = await get(server.url + "/")
    config = page_config(page.text)
    assert config["listens"] is False
    assert config["speaks"] is False
    assert '<body class="text-only no-voices">' in page.text


async def test_a_model_that_speaks_offers_the_voices() -> None:
    async with realtime_server(speech=SpeechRoute(2, AUDIO)) as server:
        config = page_config((await get(server.url + "/")).text)
    assert "nova" in config["voices"]
    assert config["voices"] == sorted(config["voices"])


async def test_a_browser_refused_a_session_is_told_why_in_an_error_and_the_close() -> None:
    """A browser cannot read a refused upgrade's 503: a client that sends an
    ``Origin`` (every browser does) is accepted, told, and closed with 1013."""
    async with realtime_server(options=RealtimeOptions(max_sessions=1)) as server:

        def script() -> tuple[dict[str, Any], int, str]:
            with connect(server.ws_url()) as first:
                first.recv(timeout=5)
                with connect(server.ws_url(), origin="http://127.0.0.1") as browser:
                    error = json.loads(browser.recv(timeout=5))
                    with pytest.raises(ConnectionClosed) as closed:
                        browser.recv(timeout=5)
                    close = closed.value.rcvd
                    assert close is not None
                    return error, close.code, close.reason

        error, code, reason = await trio.to_thread.run_sync(script)
    message = "the server is at capacity: 1 realtime session (--realtime-max-sessions 1)"
    assert error["type"] == "error"
    assert error["error"]["code"] == "server_overloaded"
    assert error["error"]["message"] == message
    assert code == 1013
    assert reason == message


async def test_a_session_speaks_in_the_voice_it_asks_for() -> None:
    async with realtime_server(speech=SpeechRoute(2, AUDIO)) as server:

        def script(client: Client) -> list[Any]:
            client.send(
                "session.update",
                session={"type": "realtime", "audio": {"output": {"voice": "nova"}}},
            )
            updated = client.until("session.updated")["session"]
            client.send(
                "conversation.item.create",
                item={
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "hi"}],
                },
            )
            client.send("response.create")
            client.until("response.done")
            bad = client.send(
                "session.update",
                session={"type": "realtime", "audio": {"output": {"voice": "nobody-at-all"}}},
            )
            error = client.until("error")["error"]
            return [updated, error, bad]

        updated, error, bad = await talk(server.ws_url(), script)
    assert updated["audio"]["output"]["voice"] == "nova"
    (prompt,) = server.script.prompts.values()
    assert prompt["speech"] == {"speed": 1.0, "voice": "en-us+f4"}  # nova, in eSpeak NG
    assert error["param"] == "session.audio.output.voice"
    assert error["event_id"] == bad
    assert "unknown voice 'nobody-at-all'" in error["message"]


async def test_a_model_with_no_talker_takes_a_voice_and_leaves_it() -> None:
    """OpenAI's clients send a voice; a pipeline with no talker to give it to
    accepts it (as before) and says it has none."""
    async with realtime_server(outputs=(HEARD, TEXT, AUDIO)) as server:

        def script(client: Client) -> Any:
            client.send(
                "session.update",
                session={"type": "realtime", "audio": {"output": {"voice": "nova"}}},
            )
            return client.until("session.updated")["session"]

        session = await talk(server.ws_url(), script)
    assert session["audio"]["output"]["voice"] is None
