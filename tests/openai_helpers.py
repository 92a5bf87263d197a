"""HTTP helpers and request parts shared by tests/test_openai_server.py (the Serve deployment) and
tests/test_openai_app.py (the app on a fake engine)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(app):
    """``app`` served by uvicorn on a free loopback port, in a thread: yields its base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            thread.join(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def http_json(url: str, body: dict | bytes | None = None, timeout: float = 60.0,
              headers: dict | None = None) -> tuple[int, dict]:
    """GET (body None) or POST ``body``; returns (status, parsed JSON)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())



def chat_equals(base: str, messages: list[dict], want) -> tuple[str, dict]:
    """POST a greedy chat completion of ``messages`` (8 tokens, ``ignore_eos``, token ids returned) to the server at
    ``base`` and check that its tokens and prompt's are ``want``'s (an ``LLM`` output of the same); returns the
    endpoint and the request's body, for more requests built from it."""
    chat = f"{base}/v1/chat/completions"
    body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 8, "ignore_eos": True,
            "return_token_ids": True}
    status, got = http_json(chat, body)
    assert status == 200, got
    assert got["choices"][0]["token_ids"] == want.outputs[0].token_ids
    assert got["prompt_token_ids"] == want.prompt_token_ids
    return chat, body

def http_json_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        assert resp.status == 200
        return resp.read().decode()


def sse_events(url: str, body: dict) -> list[str]:
    """POST a streaming request and return the raw `data:` payloads, in order."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = resp.read().decode().split("\n\n")
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def kv_state(base: str) -> dict:
    return http_json(base + "/v1/debug/kv")[1]


def wait_for_free_blocks(base: str, expected: int, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    state = kv_state(base)
    while (state["free_blocks"] != expected or state["num_running"] or state["num_waiting"]) and \
            time.monotonic() < deadline:
        time.sleep(0.1)
        state = kv_state(base)
    return state


def metric_value(text: str, name: str, **labels: str) -> float:
    """A sample's value from Prometheus text (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def error_of(status_body: tuple[int, dict]) -> tuple[int, dict]:
    status, body = status_body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return status, body["error"]


def post_in_thread(url: str, body: dict, results: list) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.append(http_json(url, body)), daemon=True)
    thread.start()
    return thread


def streamed_chat(events: list[str]) -> tuple[str, list[dict], str | None]:
    """A streamed chat choice's content, its tool calls (per index: id, type, name, arguments joined) and its
    finish reason; the first delta of each call carries its id, type and name, as OpenAI clients expect."""
    content, calls, finish = "", {}, None
    for event in events:
        if event == "[DONE]":
            continue
        for choice in json.loads(event)["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for part in delta.get("tool_calls", []):
                if part["index"] not in calls:
                    assert {"id", "type"} <= set(part) and "name" in part["function"], part
                    calls[part["index"]] = {"id": part["id"], "type": part["type"], "name": "", "arguments": ""}
                calls[part["index"]]["name"] += part["function"].get("name", "")
                calls[part["index"]]["arguments"] += part["function"].get("arguments", "")
            finish = choice["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


# ---- request parts both files send

ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
                 "additionalProperties": False}
# the random-weight model pads JSON with whitespace until max_tokens where the grammar allows it
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
# small schemas with bounded values, so that the random-weight model's constrained calls finish
# small schemas with bounded values, so that the random-weight model's constrained calls finish
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TIME_SCHEMA = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
               "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER_SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME_SCHEMA, "strict": True}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
WEATHER_CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
