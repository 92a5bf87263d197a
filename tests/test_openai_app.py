"""The OpenAI-compatible app's logic that needs a controllable engine (queue full, engine failures, tool calls,
the Responses API): in-process on uvicorn with a fake engine client, no Ray. (tests/test_openai_server.py drives
the real Serve deployment.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import openai
import pytest

from specray import SamplingParams
from specray.outputs import CompletionOutput, RequestOutput, SpecStats
from specray_test_openai_helpers import (  # tests/openai_helpers.py (tests/conftest.py registers it)
    ANSWER_SCHEMA, COMPACT, NAMED, TIME_SCHEMA, TOOLS, WEATHER_CHAT, WEATHER_SCHEMA, error_of, free_port, http_json,
    http_json_text, kv_state, metric_value, post_in_thread, sse_events, streamed_chat)

# ---- app logic with a fake engine (in-process uvicorn, no Ray) ------------------------------------------

class FakeTokenizer:
    chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 250 + 1 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(96 + i % 26) for i in ids)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, chat_template=None,
                            tools=None):
        return "".join(m["content"] for m in messages)


class FakeEngineClient:
    """Emits ``tokens`` outputs per request once ``gate`` opens; ``fail_after`` raises an engine failure after
    that many outputs (``refuse``: the request's own constraints cannot be met); ``cached``: the prompt tokens each
    request finds in the prefix cache."""

    max_model_len = 64
    tokenizer = FakeTokenizer()

    def __init__(self, tokens: int = 3, fail_after: int | None = None, cached: int = 0, refuse: bool = False):
        self.tokens = tokens
        self.refuse = refuse
        self.cached = cached
        self.fail_after = fail_after
        self.loop: asyncio.AbstractEventLoop | None = None
        self.gate: asyncio.Event | None = None
        self.open = True
        self.active = 0  # engine requests in flight now, and the most at once
        self.max_active = 0

    async def generate(self, prompt_token_ids, params, prompt=None, req_id=None, multimodal=None):
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            async for out in self._generate(prompt_token_ids, params, prompt, req_id):
                yield out
        finally:
            self.active -= 1

    def release(self) -> None:
        self.loop.call_soon_threadsafe(self.gate.set)

    async def _generate(self, prompt_token_ids, params, prompt=None, req_id=None):
        from specray.errors import RequestFailedError, RequestRefusedError

        self.loop = asyncio.get_running_loop()
        if self.gate is None:
            self.gate = asyncio.Event()
            if self.open:
                self.gate.set()
        await self.gate.wait()
        for n in range(1, self.tokens + 1):
            if self.fail_after is not None and n > self.fail_after:
                if self.refuse:
                    raise RequestRefusedError(req_id, "structured_outputs cannot be met: allowed_token_ids left none")
                raise RequestFailedError(req_id, "worker died")
            done = n == self.tokens
            out = CompletionOutput(0, "x" * n, list(range(n)), finish_reason="length" if done else None)
            stats = SpecStats(drafts=n, draft_tokens=2 * n, accepted_tokens=n, accepted_per_position=[n])
            yield RequestOutput(req_id, prompt, prompt_token_ids, [out], finished=done, spec_stats=stats,
                                num_cached_tokens=self.cached)

    async def engine_state(self) -> dict:
        return {"free_blocks": 1, "total_blocks": 1, "used_blocks": 0, "num_waiting": 0, "num_running": 0}

    async def engine_metrics(self, unloaded: set[str] = frozenset()) -> bytes:
        return b""

    async def is_healthy(self) -> bool:
        return True


class ScriptedEngineClient(FakeEngineClient):
    """Answers every request with ``pieces`` of text, one output each (cumulative)."""

    def __init__(self, pieces: list[str]):
        super().__init__(tokens=len(pieces))
        self.pieces = pieces

    async def _generate(self, prompt_token_ids, params, prompt=None, req_id=None):
        for n in range(1, len(self.pieces) + 1):
            done = n == len(self.pieces)
            out = CompletionOutput(0, "".join(self.pieces[:n]), list(range(n)), finish_reason="stop" if done else None)
            yield RequestOutput(req_id, prompt, prompt_token_ids, [out], finished=done)


@pytest.mark.parametrize("parser,pieces,reasoning,content", [
    ("deepseek_r1", ["Let me th", "ink: 2+2.</th", "ink>\n\nIt is", " 4."], "Let me think: 2+2.", "\n\nIt is 4."),
    ("qwen3", ["<thi", "nk>Hmm.</think>", "Four."], "Hmm.", "Four."),
    ("qwen3", ["Four", "."], None, "Four."),  # no thinking phase: all content
    ("deepseek_r1", ["Still thinking", " about it <"], "Still thinking about it <", None),  # never ended
])
def test_reasoning_parser_splits_thinking_from_the_answer(parser, pieces, reasoning, content):
    """vLLM's --reasoning-parser: the message's reasoning_content and content, whole and streamed (tags split
    over deltas, a held tail flushed at the end); the completions endpoint keeps the text as it is."""
    with app_in_thread(ScriptedEngineClient(pieces), reasoning_parser=parser) as base:
        body = {"model": "fake", "messages": [{"role": "user", "content": "2+2?"}]}
        status, whole = http_json(base + "/v1/chat/completions", body)
        assert status == 200, whole
        message = whole["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == (reasoning, content)
        deltas = [json.loads(e)["choices"][0]["delta"] for e in sse_events(base + "/v1/chat/completions",
                                                                            {**body, "stream": True})
                  if e != "[DONE]" and json.loads(e)["choices"]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == (reasoning or "")
        assert "".join(d.get("content", "") for d in deltas) == (content or "")
        status, completion = http_json(base + "/v1/completions", {"model": "fake", "prompt": "2+2?"})
        assert completion["choices"][0]["text"] == "".join(pieces)


def test_reasoning_parser_starts_from_the_prompt_for_qwen3():
    from specray.cluster.reasoning import ReasoningSplitter, check_reasoning_parser, starts_thinking

    assert starts_thinking("qwen3", "<|im_start|>assistant\n<think>\n")
    assert not starts_thinking("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking turned off
    assert starts_thinking("deepseek_r1", "")
    splitter = ReasoningSplitter(thinking=True)
    assert [splitter.push(t) for t in ["a</", "b", "</think", ">c"]] == [("a", ""), ("</b", ""), ("", ""), ("", "c")]
    # an output's thinking tokens, by the tags' ids where each is one token: from <think> (or the start) to </think>
    from specray.cluster.reasoning import reasoning_tokens

    class Tags:
        unk_token_id = 0

        def convert_tokens_to_ids(self, token):
            return {"<think>": 7, "</think>": 8}[token]

    assert reasoning_tokens(Tags(), [5, 7, 1, 2, 8, 3], "ab", thinking_first=False) == 4
    assert reasoning_tokens(Tags(), [1, 2, 8, 3], "ab", thinking_first=True) == 3
    assert reasoning_tokens(Tags(), [1, 2], "ab", thinking_first=True) == 2  # never ended: all of it
    assert reasoning_tokens(Tags(), [1, 2], None, thinking_first=True) == 0
    with pytest.raises(ValueError, match="reasoning_parser='r1'"):
        check_reasoning_parser("r1")


def test_reasoning_tags_that_are_special_tokens_stay_in_chat_text(tmp_path):
    """A tokenizer holding <think> / </think> as special tokens: a chat request's text keeps special tokens (else
    the split would never see its tags, and an answer after </think> would come back as reasoning), unless the
    request asks for skip_special_tokens itself; a server without a reasoning parser leaves the default."""
    from specray.cluster.reasoning import tags_are_special
    from tests.conftest import build_tiny_tokenizer

    special = build_tiny_tokenizer(tmp_path / "special", extra_special_tokens=("<think>", "</think>"))
    assert tags_are_special(special) and not tags_are_special(build_tiny_tokenizer(tmp_path / "plain"))
    assert not tags_are_special(FakeTokenizer())

    class SpecialTags(TemplateTokenizer):
        all_special_ids = [7, 8]
        unk_token_id = None

        def convert_tokens_to_ids(self, token):
            return {"<think>": 7, "</think>": 8}.get(token)

    body = {"model": "fake", "messages": [{"role": "user", "content": "2+2?"}]}
    for parser, given, skipped in (("deepseek_r1", None, False), ("deepseek_r1", True, True), (None, None, True)):
        fake = RecordingEngineClient()
        fake.tokenizer = SpecialTags()
        with app_in_thread(fake, reasoning_parser=parser) as base:
            extra = {} if given is None else {"skip_special_tokens": given}
            assert http_json(base + "/v1/chat/completions", {**body, **extra})[0] == 200
            assert fake.seen[-1][1].skip_special_tokens is skipped, (parser, given)


@contextlib.contextmanager
def app_in_thread(fake: FakeEngineClient, max_queue_len: int | None = None, response_store=None, **config):
    import uvicorn

    from specray.cluster.openai_app import ServerConfig, build_openai_app

    app = build_openai_app(fake, ServerConfig("fake", max_queue_len, **{"enable_debug_routes": True, **config}),
                           response_store=response_store)
    fake.serving = app.state.serving
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_queue_full_is_503():
    fake = FakeEngineClient()
    fake.open = False
    with app_in_thread(fake, max_queue_len=1) as base:
        body = {"model": "fake", "prompt": "hi", "max_tokens": 3}
        first: list = []
        waiter = threading.Thread(target=lambda: first.append(http_json(base + "/v1/completions", body)))
        waiter.start()
        deadline = time.monotonic() + 10
        while kv_state(base)["num_queued"] != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        status, err = error_of(http_json(base + "/v1/completions", body))
        assert (status, err["type"], err["code"]) == (503, "server_error", "queue_full")
        fake.release()
        waiter.join(timeout=30)
        assert first[0][0] == 200 and first[0][1]["choices"][0]["text"] == "xxx"
        assert http_json(base + "/v1/completions", body)[0] == 200  # the queue drained
        assert kv_state(base)["num_queued"] == 0


def test_unset_sampling_fields_take_the_models_defaults():
    """The model's generation config's defaults (ServerConfig.default_sampling) fill what a request leaves unset,
    on both routes (a completion's max_tokens keeps OpenAI's default, 16); a value given wins (top_k -1 too: no
    top-k); the default max_tokens is cut to what the prompt's context leaves rather than refused, and counts
    against the per-request token cap."""
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                "max_tokens": 10}
    fake = RecordingEngineClient()

    def last():
        params = fake.seen.pop()[1]
        return (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty,
                params.max_tokens)

    with app_in_thread(fake, default_sampling=defaults, max_tokens_per_request=16) as base:
        assert http_json(base + "/v1/completions", {"prompt": "hi"})[0] == 200
        assert last() == (0.6, 0.9, 20, 0.05, 1.1, 16)
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        assert http_json(base + "/v1/chat/completions", chat)[0] == 200
        assert last() == (0.6, 0.9, 20, 0.05, 1.1, 10)
        given = {"temperature": 0.0, "top_k": -1, "top_p": 1.0, "repetition_penalty": 1.0, "max_tokens": 3}
        assert http_json(base + "/v1/chat/completions", {**chat, **given})[0] == 200
        assert last() == (0.0, 1.0, 0, 0.05, 1.0, 3)
        # 60 prompt tokens of a 64-token context: 4 left, fewer than the default 10
        assert http_json(base + "/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 60}]})[0] == 200
        assert last()[-1] == 4
        status, err = error_of(http_json(base + "/v1/chat/completions", {**chat, "n": 2}))
        assert status == 400 and "max_tokens's default, 10" in err["message"]


def test_a_chat_prediction_reaches_the_engine_and_its_usage():
    """OpenAI's Predicted Outputs: the prediction's text (a string or text parts) goes to the engine as token ids
    where the engine drafts from it, and the usage tells the accepted and rejected prediction tokens (the fake
    engine's counters: 1 draft of 2 tokens, 1 kept, per step), summed over choices, streamed too; elsewhere, or for
    a request that picks another drafting method, there are no such details; a prediction of another type is a
    400 naming prediction.type."""
    fake = RecordingEngineClient()
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "prediction": {"type": "content", "content": [{"type": "text", "text": "def f"}, {"type": "text",
                                                                                           "text": "(): pass"}]}}
    with app_in_thread(fake, drafts_predictions=True) as base:
        status, body = http_json(base + "/v1/chat/completions", {**chat, "n": 2})
        # tokenized by the server, off its event loop, as prompts are
        assert status == 200 and fake.seen[-1][1].prediction == fake.tokenizer.encode("def f(): pass")
        details = body["usage"]["completion_tokens_details"]
        assert details == {"accepted_prediction_tokens": 6, "rejected_prediction_tokens": 6}
        events = sse_events(base + "/v1/chat/completions",
                            {**chat, "stream": True, "stream_options": {"include_usage": True}})
        assert json.loads(events[-2])["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 3
        other = {**chat, "speculative": {"method": "suffix"}}
        assert "completion_tokens_details" not in http_json(base + "/v1/chat/completions", other)[1]["usage"]
        metrics = http_json_text(base + "/metrics")  # the 3 predicted choices above: 3 kept, 3 not, each
        assert metric_value(metrics, "specray_prediction_tokens_total", outcome="accepted") == 9
        assert metric_value(metrics, "specray_prediction_tokens_total", outcome="rejected") == 9
        plain = {k: v for k, v in chat.items() if k != "prediction"}
        assert "completion_tokens_details" not in http_json(base + "/v1/chat/completions", plain)[1]["usage"]
        status, err = error_of(http_json(base + "/v1/chat/completions",
                                         {**chat, "prediction": {"type": "image", "content": "x"}}))
        assert (status, err["param"]) == (400, "prediction.type") and "'content'" in err["message"]
    with app_in_thread(fake) as base:  # an engine that cannot draft from it: not sent, no details
        status, body = http_json(base + "/v1/chat/completions", chat)
        assert status == 200 and "completion_tokens_details" not in body["usage"]
        assert fake.seen[-1][1].prediction is None


def test_reasoning_effort_reaches_the_chat_template(tiny_llama_dir):
    """OpenAI's reasoning_effort (and the Responses API's reasoning.effort) is the chat template's variable
    reasoning_effort; chat_template_kwargs' own value wins; a value OpenAI does not have is a 400 naming the
    parameter."""
    from transformers import AutoTokenizer

    fake = RecordingEngineClient()
    fake.tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    template = ("{% if reasoning_effort is defined %}[{{ reasoning_effort }}]{% endif %}"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

    def prompt() -> str:
        return fake.tokenizer.decode(fake.seen.pop()[0])

    with app_in_thread(fake, chat_template=template) as base:
        assert http_json(base + "/v1/chat/completions", {**chat, "reasoning_effort": "low"})[0] == 200
        assert prompt() == "[low]Hi"
        assert http_json(base + "/v1/chat/completions", chat)[0] == 200
        assert prompt() == "Hi"
        both = {**chat, "reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}
        assert http_json(base + "/v1/chat/completions", both)[0] == 200
        assert prompt() == "[high]Hi"
        body = {"input": "Hi", "max_output_tokens": 2, "reasoning": {"effort": "medium"}}
        status, resp = http_json(base + "/v1/responses", body)
        assert status == 200 and resp["reasoning"] == {"effort": "medium", "summary": None}, resp  # echoed
        assert prompt() == "[medium]Hi"
        status, err = error_of(http_json(base + "/v1/chat/completions", {**chat, "reasoning_effort": "max"}))
        assert (status, err["param"]) == (400, "reasoning_effort")
        status, err = error_of(http_json(base + "/v1/responses", {**body, "reasoning": {"effort": "max"}}))
        assert (status, err["param"]) == (400, "reasoning.effort")


def test_a_chat_template_of_the_servers_own(tiny_llama_dir):
    """A tokenizer without a chat template: chat requests get a 400 that names --chat-template; with the server's
    template they are rendered by it (/tokenize shows the tokens the engine gets)."""
    from transformers import AutoTokenizer

    fake = FakeEngineClient(tokens=1)
    fake.tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    fake.tokenizer.chat_template = None  # a base model's
    chat = {"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}]}
    with app_in_thread(fake) as base:
        status, err = error_of(http_json(base + "/v1/chat/completions", chat))
        assert status == 400 and "--chat-template" in err["message"]
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    with app_in_thread(fake, chat_template=template) as base:
        before = http_json_text(base + "/metrics")
        status, tokens = http_json(base + "/tokenize", chat)
        assert status == 200
        assert tokens["tokens"] == fake.tokenizer.encode("<user>Hello<assistant>Hi", add_special_tokens=False)
        assert http_json(base + "/detokenize", {"tokens": tokens["tokens"]})[0] == 200
        assert http_json(base + "/tokenize", {})[0] == 400
        assert http_json(base + "/v1/chat/completions", chat)[0] == 200
        # specray_requests_total counts generation requests: the chat, not /tokenize's or /detokenize's
        after = http_json_text(base + "/metrics")
        for status, grown in (("200", 1), ("400", 0)):
            assert metric_value(after, "specray_requests_total", status=status) == \
                metric_value(before, "specray_requests_total", status=status) + grown, status


class StallingEngineClient(FakeEngineClient):
    """Emits one output per request, then waits until the request is closed."""

    async def _generate(self, prompt_token_ids, params, prompt=None, req_id=None):
        self.loop = asyncio.get_running_loop()
        yield RequestOutput(req_id, prompt, prompt_token_ids, [CompletionOutput(0, "x", [1])], finished=False)
        await asyncio.Event().wait()


def test_shutting_down_ends_open_requests_with_503s_and_refuses_new_ones():
    """What ``specray serve`` does on Ctrl-C before Serve goes: a stream that is generating ends with an error
    event and [DONE], a request waiting for its whole answer gets a 503, and so does every later request."""
    fake = StallingEngineClient()
    with app_in_thread(fake) as base:
        streamed, whole = [], []
        body = {"model": "fake", "prompt": "hi", "max_tokens": 30}
        stream = threading.Thread(target=lambda: streamed.append(sse_events(base + "/v1/completions",
                                                                            {**body, "stream": True})))
        stream.start()
        waiter = post_in_thread(base + "/v1/completions", {**body, "n": 2}, whole)
        deadline = time.monotonic() + 10
        while fake.active < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert fake.active == 3 and http_json(base + "/health")[0] == 200
        ended = asyncio.run_coroutine_threadsafe(fake.serving.shut_down(timeout=10), fake.loop).result(20)
        stream.join(timeout=10)
        waiter.join(timeout=10)
        assert ended == 2 and fake.active == 0  # the engine's streams were closed (their requests aborted)
        events = streamed[0]
        assert json.loads(events[0])["choices"][0]["text"] == "x" and events[-1] == "[DONE]"
        shutting_down = (503, "server_error", "server_shutting_down")
        error = json.loads(events[-2])["error"]
        assert (503, error["type"], error["code"]) == shutting_down
        for status, err in (error_of(whole[0]), error_of(http_json(base + "/v1/completions", body)),
                            error_of(http_json(base + "/health"))):
            assert (status, err["type"], err["code"]) == shutting_down


def test_engine_failure_is_500_before_output_and_an_error_event_mid_stream():
    with app_in_thread(FakeEngineClient(tokens=3, fail_after=0)) as base:
        status, err = error_of(http_json(base + "/v1/completions", {"prompt": "hi"}))
        assert (status, err["type"]) == (500, "server_error") and "worker died" in err["message"]
    with app_in_thread(FakeEngineClient(tokens=3, fail_after=1)) as base:
        events = sse_events(base + "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hi"}], "stream": True})
        assert events[-1] == "[DONE]" and "worker died" in json.loads(events[-2])["error"]["message"]


def test_constraints_that_cannot_be_met_mid_output_are_a_400_naming_the_request_s_field():
    """A request the engine fails mid-output because its own constraints leave its structured output no token
    (RequestRefusedError): a 400 naming the request's field for the constraint, whole; streamed, a 400 error
    event; it crosses from an engine replica to the ingress as a ValueError."""
    from specray.cluster.serve import _portable_errors
    from specray.errors import RequestRefusedError

    body = {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}}
    with app_in_thread(FakeEngineClient(tokens=3, fail_after=1, refuse=True)) as base:
        status, err = error_of(http_json(base + "/v1/chat/completions", body))
        assert (status, err["param"]) == (400, "response_format") and "cannot be met" in err["message"], err
        events = sse_events(base + "/v1/chat/completions", {**body, "stream": True})
        error = json.loads(events[-2])["error"]
        assert events[-1] == "[DONE]" and error["type"] == "invalid_request_error", error
        assert "cannot be met" in error["message"], error
    with pytest.raises(ValueError, match="^structured_outputs cannot") as caught, _portable_errors():
        raise RequestRefusedError("r1", "structured_outputs cannot be met")
    assert type(caught.value) is ValueError


def test_n_choices_stream_interleaved_with_indices():
    with app_in_thread(FakeEngineClient(tokens=4)) as base:
        events = sse_events(base + "/v1/completions", {"prompt": ["a", "b"], "n": 2, "stream": True,
                                                        "stream_options": {"include_usage": True}})
        chunks = [json.loads(e) for e in events[:-1]]
        texts: dict[int, str] = {}
        for chunk in chunks[:-1]:
            for choice in chunk["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        assert texts == {i: "xxxx" for i in range(4)}
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == 16 and usage["prompt_tokens"] == 2
        assert usage["speculative"] == {"drafts": 16, "draft_tokens": 32, "accepted_tokens": 16,
                                        "acceptance_rate": 0.5, "mean_accepted_length": 2.0}  # summed over choices


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": ["a", "bb"], "n": 2}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_continuous_usage_stats_put_each_choice_s_usage_so_far_in_every_chunk(path, body):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): each chunk carries its choice's prompt
    and output tokens so far and its speculation figures, so a client sees acceptance as it streams (a chat's
    opening role chunk too: none of its tokens yet, as vLLM's, and its prompt's cache hit, known by then); the last
    chunk still sums every choice; without the option, chunks carry no usage."""
    with app_in_thread(FakeEngineClient(tokens=3, cached=1)) as base:
        options = {"include_usage": True, "continuous_usage_stats": True}
        chunks = [json.loads(e) for e in sse_events(base + path, {**body, "stream": True,
                                                                  "stream_options": options})[:-1]]
        seen: dict[int, list[int]] = {}
        for chunk in chunks[:-1]:
            usage, choice = chunk["usage"], chunk["choices"][0]
            if path.endswith("chat/completions") and choice["delta"] == {"role": "assistant", "content": ""}:
                assert (usage["prompt_tokens"], usage["completion_tokens"]) == (2, 0), usage  # no output yet
                assert usage["prompt_tokens_details"]["cached_tokens"] == 1, usage
                continue
            seen.setdefault(choice["index"], []).append(usage["completion_tokens"])
            prompt = 1 + (choice["index"] >= 2) if path == "/v1/completions" else 2
            assert usage["prompt_tokens"] == prompt and usage["total_tokens"] == prompt + usage["completion_tokens"]
            assert usage["speculative"]["drafts"] == usage["completion_tokens"]  # the fake's figures per output
            assert usage["prompt_tokens_details"]["cached_tokens"] == 1, usage
        assert all(counts == [1, 2, 3] for counts in seen.values()) and len(seen) == len(chunks[-1:]) * (
            4 if path == "/v1/completions" else 1), seen
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3 * len(seen)
        plain = [json.loads(e) for e in sse_events(base + path, {**body, "stream": True})[:-1]]
        assert all(c.get("usage") is None for c in plain)


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_api_key_is_required_except_for_health_and_debug_route_is_off():
    with app_in_thread(FakeEngineClient(), api_key="sekret", enable_debug_routes=False) as base:
        status, err = error_of(http_json(base + "/v1/completions", {"prompt": "hi"}))
        assert (status, err["type"], err["code"]) == (401, "invalid_request_error", "invalid_api_key")
        status, err = error_of(http_json(base + "/v1/models", headers={"Authorization": "Bearer wrong"}))
        assert status == 401
        assert http_json(base + "/health")[0] == 200
        client = openai.OpenAI(base_url=base + "/v1", api_key="sekret", max_retries=0, timeout=30)
        assert client.completions.create(model="fake", prompt="hi").choices[0].text == "xxx"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0).models.list()
        status, err = error_of(http_json(base + "/v1/debug/kv", headers={"Authorization": "Bearer sekret"}))
        assert status == 404
        # bench-serve takes the key, and the base URL as OpenAI clients spell it (with /v1)
        from specray.cluster.bench_serve import benchmark

        args = dict(base_url=base + "/v1/", model=None, prompts=["hi"], num_requests=2, concurrency=1, max_tokens=3)
        assert benchmark(api_key="sekret", **args)["completed"] == 2
        with pytest.raises(ValueError, match="401"):  # no key: listing the models fails
            benchmark(**args)


def test_a_model_served_under_several_names():
    """vLLM's several --served-model-name: requests may give any name, responses carry the first, /v1/models lists
    them all; another name is a 404."""
    with app_in_thread(FakeEngineClient(), model_aliases=("gpt-4o", "my-model")) as base:
        assert [m["id"] for m in http_json(base + "/v1/models")[1]["data"]] == ["fake", "gpt-4o", "my-model"]
        assert http_json(base + "/v1/models/gpt-4o")[1]["id"] == "gpt-4o"
        status, body = http_json(base + "/v1/completions", {"model": "my-model", "prompt": "hi"})
        assert status == 200 and body["model"] == "fake"
        status, err = error_of(http_json(base + "/v1/completions", {"model": "gpt-5", "prompt": "hi"}))
        assert (status, err["code"]) == (404, "model_not_found")


def test_browser_pages_of_allowed_origins_only():
    """--allowed-origins (vLLM's; none by default, where vLLM allows any): a page of an allowed origin gets CORS
    headers, its preflight answered without the API key; another origin, or a server allowing none, gets none."""
    def call(base: str, method: str, path: str, origin: str, headers: dict | None = None):
        request = urllib.request.Request(base + path, method=method, headers={"Origin": origin, **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                return resp.status, resp.headers
        except urllib.error.HTTPError as err:
            return err.code, err.headers

    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    page = "https://app.example.com"
    with app_in_thread(FakeEngineClient(), api_key="sekret", allowed_origins=(page,)) as base:
        status, headers = call(base, "OPTIONS", "/v1/chat/completions", page, preflight)
        assert status == 200 and headers["access-control-allow-origin"] == page
        status, headers = call(base, "GET", "/v1/models", page, {"Authorization": "Bearer sekret"})
        assert status == 200 and headers["access-control-allow-origin"] == page
        status, headers = call(base, "OPTIONS", "/v1/chat/completions", "https://evil.example.com", preflight)
        assert status == 400 and "access-control-allow-origin" not in headers
    with app_in_thread(FakeEngineClient()) as base:
        status, headers = call(base, "GET", "/v1/models", page)
        assert status == 200 and "access-control-allow-origin" not in headers


def test_one_request_cannot_hold_every_seat_or_fill_the_queue():
    fake = FakeEngineClient(tokens=2)
    fake.open = False
    caps = dict(max_seats_per_request=2, max_n=4, max_tokens_per_request=40)
    with app_in_thread(fake, max_queue_len=3, **caps) as base:
        url = base + "/v1/completions"
        status, err = error_of(http_json(url, {"prompt": "hi", "n": 5, "max_tokens": 2}))
        assert (status, err["param"]) == (400, "n") and "4" in err["message"]
        status, err = error_of(http_json(url, {"prompt": ["a", "b"], "n": 2, "max_tokens": 11}))
        assert (status, err["param"]) == (400, "max_tokens") and "44" in err["message"] and "40" in err["message"]
        status, err = error_of(http_json(base + "/v1/chat/completions",
                                         {"messages": [{"role": "user", "content": "hi"}], "n": 2}))
        assert (status, err["param"]) == (400, "max_tokens")  # no max_tokens: each choice may take the context
        big: list = []
        big_thread = post_in_thread(url, {"prompt": "hi", "n": 4, "max_tokens": 2}, big)
        # two of its four choices hold engine seats, the others wait their turn (the seated ones reach the engine
        # a moment after the queue counts the waiting ones: wait for both; max_active below bounds the seats)
        wait_until(lambda: kv_state(base)["num_queued"] == 2 and fake.active == 2)
        small: list = []
        small_thread = post_in_thread(url, {"prompt": "hi", "max_tokens": 2}, small)
        wait_until(lambda: kv_state(base)["num_queued"] == 3)
        status, err = error_of(http_json(url, {"prompt": "hi", "max_tokens": 2}))
        assert (status, err["code"]) == (503, "queue_full")
        fake.release()
        big_thread.join(timeout=30)
        small_thread.join(timeout=30)
        assert big[0][0] == 200 and len(big[0][1]["choices"]) == 4 and small[0][0] == 200
        assert fake.max_active == 3 and kv_state(base)["num_queued"] == 0


class SlowTokenizer(FakeTokenizer):
    """Counts encodes; each takes ``delay`` seconds (a long prompt's tokenization)."""

    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self.calls = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        time.sleep(self.delay)
        return super().encode(text, add_special_tokens)


def test_body_limit_and_text_too_long_to_fit_are_refused_before_tokenizing():
    fake = FakeEngineClient()
    fake.tokenizer = SlowTokenizer()
    with app_in_thread(fake, max_request_body_bytes=10_000) as base:
        start = time.monotonic()
        status, err = error_of(http_json(base + "/v1/completions", {"prompt": "x" * 20_000}))
        assert (status, err["code"]) == (413, "request_too_large") and "10000" in err["message"]
        assert time.monotonic() - start < 5
        # 64 tokens of at most 32 characters (FakeTokenizer lists no vocabulary), with slack 2: 4096 characters
        for path, body in (("/v1/completions", {"prompt": "x" * 5000}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 5000}]})):
            status, err = error_of(http_json(base + path, body))
            assert (status, err["code"]) == (400, "context_length_exceeded") and "5000 characters" in err["message"]
        assert fake.tokenizer.calls == 0
        assert http_json(base + "/v1/completions", {"prompt": "x" * 40, "max_tokens": 3})[0] == 200


class SpecialTokenizer(FakeTokenizer):
    """Adds a BOS (255) when asked for special tokens; its chat template writes the documents before the chat."""

    BOS = 255

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.BOS] * add_special_tokens + super().encode(text)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, chat_template=None,
                            tools=None, documents=None):
        if chat_template is not None:
            import jinja2

            return jinja2.Template(chat_template).render(messages=messages)
        return "".join(d["text"] for d in documents or []) + "".join(m["content"] for m in messages)


def test_vllm_request_options_token_ids_request_id_special_tokens_and_documents():
    """vLLM's return_token_ids (the prompt's ids and each choice's, whole or per chunk, the prompt's once per
    choice), request_id (the response's id), add_special_tokens (completions: on by default, chat: off) and a
    chat's documents (to the template); beam search's parameters accepted only with their off values."""
    fake = FakeEngineClient(tokens=3)
    fake.tokenizer = tok = SpecialTokenizer()
    with app_in_thread(fake) as base:
        cmpl, chat = base + "/v1/completions", base + "/v1/chat/completions"
        status, body = http_json(cmpl, {"prompt": "ab", "return_token_ids": True, "request_id": "r1"})
        assert status == 200 and body["id"] == "cmpl-r1"
        [choice] = body["choices"]
        assert (choice["prompt_token_ids"], choice["token_ids"]) == (tok.encode("ab"), [0, 1, 2])
        _, body = http_json(cmpl, {"prompt": "ab", "return_token_ids": True, "add_special_tokens": False})
        assert body["choices"][0]["prompt_token_ids"] == tok.encode("ab", add_special_tokens=False)
        assert body["id"].startswith("cmpl-") and body["id"] != "cmpl-r1"
        _, body = http_json(cmpl, {"prompt": "ab"})
        assert body["choices"][0]["token_ids"] is None and body["choices"][0]["prompt_token_ids"] is None
        messages = [{"role": "user", "content": "hi"}]
        status, body = http_json(chat, {"messages": messages, "documents": [{"title": "t", "text": "doc"}],
                                        "return_token_ids": True, "request_id": "r2"})
        assert status == 200 and body["id"] == "chatcmpl-r2" and body["choices"][0]["token_ids"] == [0, 1, 2]
        assert body["prompt_token_ids"] == tok.encode("dochi", add_special_tokens=False)
        _, body = http_json(chat, {"messages": messages, "return_token_ids": True, "add_special_tokens": True})
        assert body["prompt_token_ids"] == tok.encode("hi")
        for url, first in ((cmpl, {"prompt": "ab", "n": 2}), (chat, {"messages": messages, "n": 2})):
            events = [json.loads(e) for e in sse_events(url, {**first, "stream": True, "return_token_ids": True})
                      if e != "[DONE]"]
            for index in (0, 1):
                mine = [e for e in events if e["choices"] and e["choices"][0]["index"] == index]
                assert sum((e["choices"][0]["token_ids"] or [] for e in mine), []) == [0, 1, 2]
                prompts = [e.get("prompt_token_ids") or e["choices"][0].get("prompt_token_ids") for e in mine]
                assert [p for p in prompts if p] == [tok.encode("ab") if url == cmpl else tok.encode("hi", False)]
        assert http_json(cmpl, {"prompt": "ab", "use_beam_search": False, "length_penalty": 1.0})[0] == 200
        for name, value in (("use_beam_search", True), ("length_penalty", 0.5)):
            status, err = error_of(http_json(cmpl, {"prompt": "ab", name: value}))
            assert (status, err["param"]) == (400, name) and "beam" in err["message"]


def test_a_requests_own_chat_template_needs_the_servers_trust():
    """vLLM's chat_template in a request: a 400 naming --trust-request-chat-template on a server without it; on one
    with it, the chat is rendered with the request's template (one that does not parse is a 400)."""
    fake = FakeEngineClient()
    fake.tokenizer = tok = SpecialTokenizer()
    body = {"messages": [{"role": "user", "content": "hi"}], "return_token_ids": True,
            "chat_template": "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"}
    with app_in_thread(fake) as base:
        status, err = error_of(http_json(base + "/v1/chat/completions", body))
        assert (status, err["param"]) == (400, "chat_template") and "--trust-request-chat-template" in err["message"]
    with app_in_thread(fake, trust_request_chat_template=True) as base:
        status, reply = http_json(base + "/v1/chat/completions", body)
        assert status == 200 and reply["prompt_token_ids"] == tok.encode("<hi>", add_special_tokens=False)
        assert http_json(base + "/tokenize", {k: body[k] for k in ("messages", "chat_template")})[1]["tokens"] == \
            tok.encode("<hi>", add_special_tokens=False)
        status, err = error_of(http_json(base + "/v1/chat/completions", {**body, "chat_template": "{% for %}"}))
        assert (status, err["param"]) == (400, "chat_template") and "does not parse" in err["message"]


def test_deeply_nested_bodies_are_400_and_leave_the_server_serving():
    """A body nested past what the JSON parser takes (RecursionError), and one it parses but that nests past
    ``MAX_JSON_DEPTH`` (Ray's pickling of the request would fail on it), are 400s naming the limit, not 500s."""
    from specray.cluster.openai_app import MAX_JSON_DEPTH

    def nested(depth: int) -> dict:
        schema: dict = {"type": "string"}
        for _ in range(depth):
            schema = {"type": "array", "items": schema}
        return schema

    fake = FakeEngineClient()
    with app_in_thread(fake) as base:
        url = base + "/v1/chat/completions"
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        too_deep = json.dumps(chat)[:-1].encode() + b', "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        schema = {"type": "json_schema", "json_schema": {"name": "deep", "schema": nested(MAX_JSON_DEPTH)}}
        for body in (too_deep, {**chat, "response_format": schema}):
            status, err = error_of(http_json(url, body))
            assert status == 400 and f"more than {MAX_JSON_DEPTH} levels deep" in err["message"], err
        within = {"type": "function", "function": {"name": "f", "parameters": nested(MAX_JSON_DEPTH - 10)}}
        assert http_json(url, {**chat, "tools": [within], "tool_choice": "none"})[0] == 200  # deep, within the limit
        assert http_json(url, chat)[0] == 200


class RefusingEngineClient(FakeEngineClient):
    """Refuses every request's input, as the engine refuses a prompt over ``limit_mm_per_prompt``."""

    async def _generate(self, prompt_token_ids, params, prompt=None, req_id=None):
        raise ValueError("the prompt holds 2 audio items; this engine takes at most 1 per prompt")
        yield


def test_errors_of_a_chat_s_prompt_name_messages():
    """An input_audio part with empty data is a 400 naming messages (it was a ValueError reported as param
    'prompt'), and one without its format, or an audio_url without its url, names the missing field (pydantic's
    error of the content's string branch said "should be a valid string"); a chat's prompt too long for the context
    (with the legacy max_tokens too) and the engine's refusal of its input name messages, a completion's prompt."""
    with app_in_thread(RefusingEngineClient()) as base:
        url = base + "/v1/chat/completions"
        for part, param, says in (
                ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "messages",
                 "messages[0].content[1].input_audio must hold the audio's base64 'data'"),
                ({"type": "input_audio", "input_audio": {"data": "UklGRg=="}},
                 "messages.0.content.1.input_audio.format", "messages.0.content.1.input_audio.format: Field required"),
                ({"type": "audio_url", "audio_url": {}}, "messages.0.content.1.audio_url.url",
                 "audio_url.url: Field required"),
                ({"type": "audio_url", "audio_url": "data:audio/wav;base64,UklGRg=="}, "messages.0.content.1.audio_url",
                 "valid dictionary or instance of AudioURL")):  # (it said VideoURL)
            body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]}
            status, err = error_of(http_json(url, body))
            assert (status, err["param"]) == (400, param) and says in err["message"], err
        for body, code, says in (({"messages": [{"role": "user", "content": "x" * 70}], "max_tokens": 2},
                                  "context_length_exceeded", "the prompt has 70 tokens"),
                                 ({"messages": [{"role": "user", "content": "hi"}]}, None, "2 audio items")):
            status, err = error_of(http_json(url, body))
            assert (status, err["param"], err["code"]) == (400, "messages", code) and says in err["message"], err
        status, err = error_of(http_json(base + "/v1/completions", {"prompt": "hi"}))
        assert (status, err["param"]) == (400, "prompt") and "2 audio items" in err["message"], err


def test_tokenizing_a_long_prompt_does_not_stall_other_requests():
    fake = FakeEngineClient()
    fake.tokenizer = SlowTokenizer(delay=4.0)
    with app_in_thread(fake) as base:
        slow: list = []
        thread = post_in_thread(base + "/v1/completions", {"prompt": "a long prompt", "max_tokens": 3}, slow)
        wait_until(lambda: fake.tokenizer.calls == 1)
        start = time.monotonic()
        assert http_json(base + "/health")[0] == 200
        assert time.monotonic() - start < 2.0  # the event loop was free while the tokenizer ran (4 s)
        thread.join(timeout=30)
        assert slow[0][0] == 200


def test_dead_engine_gives_a_fast_503_in_openai_shape():
    from specray.cluster.openai_app import AsyncEngineClient

    dead = SimpleNamespace(is_running=False, engine=SimpleNamespace(tokenizer=FakeTokenizer(), max_model_len=64))
    with app_in_thread(AsyncEngineClient(dead)) as base:
        start = time.monotonic()
        status, err = error_of(http_json(base + "/v1/completions", {"prompt": "hi", "max_tokens": 2}))
        assert (status, err["type"], err["code"]) == (503, "server_error", "engine_unavailable")
        status, err = error_of(http_json(base + "/v1/chat/completions",
                                         {"messages": [{"role": "user", "content": "hi"}], "stream": True}))
        assert (status, err["code"]) == (503, "engine_unavailable")
        status, err = error_of(http_json(base + "/health"))
        assert (status, err["code"], err["message"]) == (503, "engine_unavailable", "the engine loop is not running")
        status, err = error_of(http_json(base + "/v1/debug/kv"))
        assert (status, err["code"]) == (503, "engine_unavailable")
        assert time.monotonic() - start < 5


def test_engine_replica_sends_each_request_s_new_output_per_item():
    """An ingress's output stream carries, per item, what every request produced since the last item (the
    engine replica's outputs are deltas, and a reader that falls behind gets a request's deltas joined into one:
    one hop per read, not one per request per step), the ingress rebuilds the cumulative outputs from them, and
    an engine error still reaches its request."""
    from specray.cluster.serve import _Outbox
    from specray.errors import EngineError
    from specray.outputs import accumulate

    def delta(rid: str, n: int) -> RequestOutput:  # token n-1, and the prompt in the first delta only
        return RequestOutput(rid, "p" if n == 1 else None, [7] if n == 1 else [],
                             [CompletionOutput(0, f"<{n}>", [n - 1])], finished=False)

    async def engine(rid: str, gate: asyncio.Event, fail: bool):
        yield delta(rid, 1)
        await gate.wait()
        for n in (2, 3):
            yield delta(rid, n)
        if fail:
            raise EngineError("worker died")

    async def read() -> list[dict]:
        box, gate = _Outbox(), asyncio.Event()
        for rid, fail in (("a", False), ("b", True)):
            box.tasks[rid] = asyncio.create_task(box.pump(rid, engine(rid, gate, fail)))
        batches = [await box.take(1.0)]
        gate.set()
        await asyncio.sleep(0.05)  # the engine produced the rest meanwhile
        batches.append(await box.take(1.0))
        assert await box.take(0.05) is None and not box.tasks  # nothing in flight: the stream may end
        return batches

    first, rest = asyncio.run(read())
    assert {rid: out.outputs[0].token_ids for rid, out in first.items()} == {"a": [0], "b": [0]}
    assert (rest["a"].outputs[0].token_ids, rest["a"].outputs[0].text, rest["a"].prompt) == ([1, 2], "<2><3>", None)
    assert isinstance(rest["b"], EngineError) and "worker died" in str(rest["b"])
    whole = accumulate(accumulate(None, first["a"]), rest["a"])
    assert (whole.prompt, whole.prompt_token_ids, whole.outputs[0].token_ids, whole.outputs[0].text) == \
        ("p", [7], [0, 1, 2], "<1><2><3>")


class _FakeEngineHandle:
    """A DeploymentHandle stand-in for the engine: requests that no replica takes (the add never returns), and a
    ``ready`` probe that succeeds once ``up`` is set."""

    def __init__(self):
        self.up = False
        self.cancelled = 0
        self.add = SimpleNamespace(remote=lambda *args: self._Add(self))
        self.ready = SimpleNamespace(remote=lambda: self._Probe(self))
        self.engine_state = SimpleNamespace(remote=lambda: self._Probe(self, hang=True))

    def options(self, **_options):
        return self

    class _Add:
        def __init__(self, handle):
            self.handle = handle

        def __await__(self):
            yield from asyncio.Event().wait().__await__()  # no replica takes the request

        def cancel(self):
            self.handle.cancelled += 1

    class _Probe:
        def __init__(self, handle, hang: bool = False):
            self.handle = handle
            self.hang = hang

        def __await__(self):
            yield from (asyncio.Event().wait() if self.hang else asyncio.sleep(0)).__await__()
            return self.handle.up

        def cancel(self):
            pass


def test_a_request_no_engine_replica_takes_is_a_503_and_the_next_ones_fail_fast_until_one_is_ready():
    """While no engine replica runs, Serve's router would hold a request until one starts: the ingress gives up
    after the acknowledgement timeout, answers 503 at once from then on, and serves again once a probe succeeds."""
    from specray.cluster.openai_app import EngineUnavailableError
    from specray.cluster.serve import RemoteEngineClient

    async def scenario() -> None:
        handle = _FakeEngineHandle()
        client = RemoteEngineClient(handle, FakeTokenizer(), 64, ack_timeout_s=1.0, probe_interval_s=0.05)
        assert not await client.is_healthy()  # before any engine replica has answered: /health is 503
        assert "still starting" in client.down_reason()  # its message: not a dead engine
        with pytest.raises(EngineUnavailableError, match="still starting"):
            await anext(client.generate([1], SamplingParams(max_tokens=2)))
        handle.up = True
        while not await client.is_healthy():
            await asyncio.sleep(0.02)
        with pytest.raises(EngineUnavailableError, match="no engine replica answered"):
            await client.engine_state()  # /metrics and the debug route do not hang either
        while not await client.is_healthy():  # the probe finds the replica up again
            await asyncio.sleep(0.02)
        handle.up = False
        with pytest.raises(EngineUnavailableError, match="no engine replica took the request"):
            await anext(client.generate([1], SamplingParams(max_tokens=2)))
        assert handle.cancelled == 1 and not await client.is_healthy()
        assert "down and Serve is starting a new one" in client.down_reason()
        start = time.monotonic()
        with pytest.raises(EngineUnavailableError, match="retry shortly"):
            await anext(client.generate([1], SamplingParams(max_tokens=2)))
        assert time.monotonic() - start < 0.5  # at once, not after the 1 s acknowledgement timeout
        handle.up = True
        deadline = time.monotonic() + 5
        while not await client.is_healthy() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert await client.is_healthy()

    asyncio.run(asyncio.wait_for(scenario(), 30))  # a client that waits for a replica fails, not hangs


def test_pinned_calls_reach_the_named_engine_replica_only():
    """An ingress's output stream and its aborts name the engine replica that holds its requests: the router
    sends them there or nowhere (a call that waits is bounded by the caller), never to another replica. A new
    request goes to the replica with the fewest of this process's requests in flight."""
    from specray.cluster import serve as serve_module
    from specray.cluster.serve import PIN_PREFIX, PinnedRouter

    def replica(uid: str):
        return SimpleNamespace(replica_id=SimpleNamespace(unique_id=uid))

    def pending(session: str):
        return SimpleNamespace(metadata=SimpleNamespace(session_id=session),
                               routing_context=SimpleNamespace(should_backoff=False))

    router = object.__new__(PinnedRouter)  # the pinned path uses no router state
    a, b = replica("a"), replica("b")
    assert asyncio.run(router.choose_replicas([a, b], pending(PIN_PREFIX + "b"))) == [[b]]
    assert asyncio.run(router.choose_replicas([a], pending(PIN_PREFIX + "b"))) == []
    serve_module._IN_FLIGHT.update({"a": 3, "b": 1})
    try:
        assert asyncio.run(router.choose_replicas([a, b], pending(""))) == [[b], [a]]
    finally:
        serve_module._IN_FLIGHT.subtract({"a": 3, "b": 1})


def test_serve_lets_a_stopped_replica_finish_its_requests(tiny_llama_dir):
    """Serve stops a replica (a scale-down, a config update, serve shutdown) once it has no calls in flight, or kills
    it after the deployment's graceful_shutdown_timeout_s: both deployments wait DRAIN_TIMEOUT_S, not Serve's 20 s,
    so a long generation on an engine replica being scaled down is finished, not cut (its output stream ends once
    its ingress has nothing in flight there)."""
    from specray.cluster.serve import DRAIN_TIMEOUT_S, build_app

    ingress = build_app({"model": str(tiny_llama_dir)})._bound_deployment
    engine = ingress.init_args[1]._bound_deployment
    assert DRAIN_TIMEOUT_S >= 60
    for deployment in (ingress, engine):
        assert deployment._deployment_config.graceful_shutdown_timeout_s == DRAIN_TIMEOUT_S, deployment.name


def test_adds_prefer_the_replica_that_took_their_prefix_while_it_is_not_much_busier():
    """With prefix caching over several engine replicas, a request goes where a prompt with the longest common
    prefix went (its blocks are likely cached there) unless that replica has more than AFFINITY_SLACK requests in
    flight beyond the least loaded one's; salts keep tenants apart; other calls go by load alone."""
    from specray.cluster import serve as serve_module
    from specray.cluster.serve import AFFINITY_SLACK, PinnedRouter, PrefixAffinity

    def replica(uid: str):
        return SimpleNamespace(replica_id=SimpleNamespace(unique_id=uid))

    def add(ids, salt=None):
        params = SamplingParams(max_tokens=4, cache_salt=salt)
        return SimpleNamespace(args=["ingress", "r", ids, params, None], metadata=SimpleNamespace(session_id=""),
                               routing_context=SimpleNamespace(should_backoff=False))

    router = object.__new__(PinnedRouter)
    a, b = replica("a"), replica("b")
    system = list(range(100, 140))  # 40 tokens: prefixes of 16 and 32 are keys
    old = serve_module._AFFINITY
    serve_module._AFFINITY = PrefixAffinity()
    try:
        serve_module._AFFINITY.record(PrefixAffinity.keys(system + [1, 2], None), "b")
        serve_module._IN_FLIGHT.update({"a": 1, "b": 1 + AFFINITY_SLACK})
        assert asyncio.run(router.choose_replicas([a, b], add(system + [7, 8, 9])))[0] == [b]
        assert asyncio.run(router.choose_replicas([a, b], add(system[:20] + [5] * 20)))[0] == [b]  # 16 in common
        assert asyncio.run(router.choose_replicas([a, b], add([5] * 40)))[0] == [a]  # nothing in common: by load
        assert asyncio.run(router.choose_replicas([a, b], add(system + [7], salt="t")))[0] == [a]  # another salt
        assert asyncio.run(router.choose_replicas([a], add(system + [7])))[0] == [a]  # b is gone
        serve_module._IN_FLIGHT["b"] += 1  # now too busy for the cache to pay
        assert asyncio.run(router.choose_replicas([a, b], add(system + [7, 8, 9])))[0] == [a]
    finally:
        serve_module._AFFINITY = old
        serve_module._IN_FLIGHT.subtract({"a": 1, "b": 2 + AFFINITY_SLACK})
    small = PrefixAffinity(capacity=2)
    small.record(PrefixAffinity.keys(list(range(40)), None), "a")  # two keys
    small.record(PrefixAffinity.keys(list(range(50, 70)), None), "b")  # one more: the oldest goes
    assert small.replica_for(PrefixAffinity.keys(list(range(20)), None), {"a", "b"}) is None
    assert small.replica_for(PrefixAffinity.keys(list(range(40)), None), {"a", "b"}) == "a"


class _FakeEngineReplica:
    """A DeploymentHandle stand-in for one live engine replica ``r1``: ``add`` answers its id, ``outputs``
    streams what the test puts into ``batches`` (after the empty first item), ``abort`` records its ids."""

    def __init__(self):
        self.batches: asyncio.Queue = asyncio.Queue()
        self.streams = 0
        self.aborted: list[str] = []
        self.pins: set[str] = set()
        self.add = SimpleNamespace(remote=lambda *args: self._Call("r1"))
        self.abort = SimpleNamespace(remote=lambda _ingress, req_ids: self._Call(self.aborted.extend(req_ids)))
        self.outputs = SimpleNamespace(remote=lambda _ingress: self._Stream(self))
        self.up = True  # what the ingress's readiness probe hears
        self.ready = SimpleNamespace(remote=lambda: self._Call(self.up))

    def options(self, stream: bool = False, session_id: str | None = None):
        if session_id is not None:
            self.pins.add(session_id)
        return self

    class _Call:
        def __init__(self, value):
            self.value = value

        def __await__(self):
            yield from asyncio.sleep(0).__await__()
            return self.value

        def cancel(self):
            pass

    class _Stream:
        def __init__(self, replica):
            self.replica = replica
            self.first = True
            replica.streams += 1

        def __aiter__(self):
            return self

        async def __anext__(self):
            if self.first:
                self.first = False
                return {}
            item = await self.replica.batches.get()
            if isinstance(item, BaseException):
                raise item
            return item

        def cancel(self):
            pass


def test_requests_on_one_engine_replica_share_one_output_stream_and_fail_together():
    """The ingress reads one stream per engine replica whose items carry every request's new output (a delta);
    it hands each request its cumulative output, the newest to a slow reader; a client that leaves is aborted on
    that replica (pinned by its id); when the replica dies, every request on the stream gets the dead-replica 503
    and the next ones fail fast."""
    from ray.exceptions import RayActorError

    from specray.cluster.openai_app import EngineUnavailableError
    from specray.cluster.serve import _IN_FLIGHT, PIN_PREFIX, RemoteEngineClient

    def output(rid: str, n: int) -> RequestOutput:  # the delta adding token n - 1
        return RequestOutput(rid, "p" if n == 1 else None, [1] if n == 1 else [],
                             [CompletionOutput(0, "x", [n - 1])], finished=False)

    async def scenario() -> None:
        replica = _FakeEngineReplica()
        client = RemoteEngineClient(replica, FakeTokenizer(), 64, ack_timeout_s=1.0, probe_interval_s=0.05)
        streams = {rid: client.generate([1], SamplingParams(max_tokens=8), req_id=rid) for rid in "abc"}
        firsts = {rid: asyncio.ensure_future(anext(s)) for rid, s in streams.items()}
        await asyncio.sleep(0.05)
        replica.batches.put_nowait({rid: output(rid, 1) for rid in "abc"})
        assert [(await f).request_id for f in firsts.values()] == list("abc")
        assert replica.streams == 1 and replica.pins == {PIN_PREFIX + "r1"} and _IN_FLIGHT["r1"] == 3
        await streams["a"].aclose()  # the client left
        await asyncio.sleep(0.05)
        assert replica.aborted == ["a"]
        replica.batches.put_nowait({"b": output("b", 2), "c": output("c", 2)})
        replica.batches.put_nowait({"b": output("b", 3)})
        await asyncio.sleep(0.05)
        newest = await anext(streams["b"])  # a slow reader gets the newest
        assert (newest.prompt_token_ids, newest.outputs[0].token_ids, newest.outputs[0].text) == ([1], [0, 1, 2], "xxx")
        replica.up = False
        replica.batches.put_nowait(RayActorError())  # the replica died
        for rid in "bc":
            with pytest.raises(EngineUnavailableError, match="engine replica died"):
                while True:
                    await anext(streams[rid])
        assert not await client.is_healthy()
        with pytest.raises(EngineUnavailableError, match="retry shortly"):
            await anext(client.generate([1], SamplingParams(max_tokens=2)))
        assert _IN_FLIGHT["r1"] == 0

    asyncio.run(asyncio.wait_for(scenario(), 30))


class GatedEngineClient:
    """Each request waits for its own gate, then finishes with one output."""

    def __init__(self):
        self.gates: dict[str, asyncio.Event] = {}

    async def generate(self, prompt_token_ids, params, prompt=None, req_id=None, multimodal=None):
        gate = self.gates[req_id] = asyncio.Event()
        await gate.wait()
        out = CompletionOutput(0, "x", [0], finish_reason="length")
        yield RequestOutput(req_id, prompt, prompt_token_ids, [out], finished=True)


async def _until(condition, steps: int = 200) -> None:
    for _ in range(steps):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


def test_engine_replica_reports_its_requests_in_flight_to_the_autoscaler():
    """record_autoscaling_stats counts the requests added and not yet finished or aborted, across ingresses,
    without an engine step: what Serve's ongoing-call count misses once an add returns at once."""
    from specray.cluster.autoscaling import IN_FLIGHT_METRIC
    from specray.cluster.serve import SpecrayEngine

    async def scenario() -> None:
        engine = object.__new__(SpecrayEngine)  # no Ray, no model: the outboxes over a fake engine client
        engine.client, engine.replica_id, engine._outboxes = GatedEngineClient(), "replica-0", {}
        stats = engine.record_autoscaling_stats
        assert await stats() == {IN_FLIGHT_METRIC: 0}
        for ingress, req_id in (("ingress-a", "a"), ("ingress-b", "b"), ("ingress-a", "c")):
            await engine.add(ingress, req_id, [1, 2], SamplingParams(max_tokens=1))
        await _until(lambda: len(engine.client.gates) == 3)
        assert await stats() == {IN_FLIGHT_METRIC: 3}
        engine.client.gates["a"].set()  # finishes
        await _until(lambda: "a" not in engine._outboxes["ingress-a"].tasks)
        assert await stats() == {IN_FLIGHT_METRIC: 2}
        await engine.abort("ingress-b", ["b"])  # its client left
        assert await stats() == {IN_FLIGHT_METRIC: 1}
        await engine.abort("ingress-a", ["c"])
        await asyncio.sleep(0)

    asyncio.run(scenario())


def _autoscaling_context(in_flight: dict[str, float] | None, current: int, target: int, **config):
    from ray.serve._private.common import DeploymentID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    from specray.cluster.autoscaling import IN_FLIGHT_METRIC

    cfg = AutoscalingConfig(min_replicas=1, max_replicas=4, target_ongoing_requests=32, **config)
    return AutoscalingContext(
        deployment_id=DeploymentID(name="SpecrayEngine", app_name="default"), deployment_name="SpecrayEngine",
        app_name="default", current_num_replicas=current, target_num_replicas=target,
        running_replicas=[], total_num_requests=0.0, total_queued_requests=0.0,
        aggregated_metrics={} if in_flight is None else {IN_FLIGHT_METRIC: in_flight}, raw_metrics={},
        capacity_adjusted_min_replicas=cfg.min_replicas, capacity_adjusted_max_replicas=cfg.max_replicas,
        policy_state={}, last_scale_up_time=None, last_scale_down_time=None, current_time=time.time(),
        config=cfg)


def test_autoscaling_policy_sizes_by_requests_in_flight():
    """Replicas = total in-flight requests / target_ongoing_requests; with nothing reported it holds the target.
    Through Serve's own wrapper (factors, delays) the count is rounded up and, by default, delayed."""
    from ray.serve.autoscaling_policy import _apply_autoscaling_config

    from specray.cluster.autoscaling import scale_by_requests_in_flight as policy

    assert policy(_autoscaling_context({"r1": 40, "r2": 60}, current=2, target=2))[0] == pytest.approx(100 / 32)
    assert policy(_autoscaling_context({"r1": 0, "r2": 0}, current=2, target=2))[0] == 0
    assert policy(_autoscaling_context(None, current=2, target=3))[0] == 3  # no replica reported yet
    assert policy(_autoscaling_context({}, current=0, target=1))[0] == 1
    wrapped = _apply_autoscaling_config(policy)
    now = {"upscale_delay_s": 0, "downscale_delay_s": 0}
    assert wrapped(_autoscaling_context({"r1": 40, "r2": 60}, current=2, target=2, **now))[0] == 4
    assert wrapped(_autoscaling_context({"r1": 10, "r2": 5}, current=2, target=2, **now))[0] == 1
    assert wrapped(_autoscaling_context({"r1": 40, "r2": 60}, current=2, target=2))[0] == 2  # upscale delay


class TemplateTokenizer(FakeTokenizer):
    """A chat template with a variable of its own (as Qwen3's enable_thinking)."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, chat_template=None,
                            greeting=""):
        return greeting + "".join(m["content"] for m in messages)


class RecordingEngineClient(FakeEngineClient):
    tokenizer = TemplateTokenizer()

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[list[int], SamplingParams]] = []

    async def generate(self, prompt_token_ids, params, prompt=None, req_id=None, multimodal=None):
        self.seen.append((list(prompt_token_ids), params))
        async for out in super().generate(prompt_token_ids, params, prompt, req_id):
            yield out


def test_vllm_request_options_reach_the_engine():
    """truncate_prompt_tokens keeps the prompt's last tokens (a prompt past the context then fits),
    skip_special_tokens and include_stop_str_in_output go to the engine's parameters, and chat_template_kwargs to
    the chat template (never in place of the call's own parameters)."""
    fake = RecordingEngineClient()
    with app_in_thread(fake) as base:
        long = "abcdefghij" * 10  # 100 tokens, past the fake's 64
        status, err = error_of(http_json(base + "/v1/completions", {"prompt": long, "max_tokens": 3}))
        assert status == 400 and err["code"] == "context_length_exceeded"
        body = {"prompt": long, "max_tokens": 3, "truncate_prompt_tokens": 10, "skip_special_tokens": False,
                "include_stop_str_in_output": True, "stop": ["x"]}
        status, resp = http_json(base + "/v1/completions", body)
        assert status == 200 and resp["usage"]["prompt_tokens"] == 10
        ids, params = fake.seen[-1]
        assert ids == FakeTokenizer().encode(long)[-10:] and params.truncate_prompt_tokens == 10
        assert params.skip_special_tokens is False and params.include_stop_str_in_output is True
        # OpenAI's logit_bias: token ids as strings, read as ints; two keys of one token (one bias dropped) a 400
        status, resp = http_json(base + "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                            "logit_bias": {"5": 1, " 7": -2.5}})
        assert status == 200 and fake.seen[-1][1].logit_bias == {5: 1.0, 7: -2.5}
        status, err = error_of(http_json(base + "/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1, "05": 2}}))
        assert status == 400 and err["param"] == "logit_bias" and "'5' and '05' both name token 5" in err["message"]
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        plain = http_json(base + "/tokenize", chat)[1]["tokens"]
        greeted = http_json(base + "/tokenize", {**chat, "chat_template_kwargs": {"greeting": "hey "}})[1]["tokens"]
        assert greeted == FakeTokenizer().encode("hey ") + plain
        status, resp = http_json(base + "/v1/chat/completions", {**chat, "max_tokens": 2,
                                                                 "chat_template_kwargs": {"greeting": "hey "}})
        assert status == 200 and fake.seen[-1][0] == greeted
        status, err = error_of(http_json(base + "/v1/chat/completions",
                                         {**chat, "chat_template_kwargs": {"tokenize": True}}))
        assert status == 400 and err["param"] == "chat_template_kwargs"


def test_structured_outputs_reach_the_engine():
    """Every way of asking for structured outputs becomes the same SamplingParams.structured_outputs, on both
    endpoints and for every choice; {"type": "text"} asks for nothing."""
    from specray.sampling_params import StructuredOutputsParams

    schema_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA, "strict": True}}
    cases = [({"response_format": {"type": "text"}}, None),
             ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
             ({"response_format": schema_format}, StructuredOutputsParams(json=ANSWER_SCHEMA)),
             ({"response_format": schema_format, **COMPACT},
              StructuredOutputsParams(json=ANSWER_SCHEMA, disable_any_whitespace=True)),
             ({"guided_json": json.dumps(ANSWER_SCHEMA)}, StructuredOutputsParams(json=ANSWER_SCHEMA)),
             ({"guided_regex": "a+"}, StructuredOutputsParams(regex="a+")),
             ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"])),
             ({"guided_grammar": 'start: "a"'}, StructuredOutputsParams(grammar='start: "a"')),
             ({"structured_outputs": {"json": ANSWER_SCHEMA, "disable_additional_properties": True}},
              StructuredOutputsParams(json=ANSWER_SCHEMA, disable_additional_properties=True))]
    fake = RecordingEngineClient()
    with app_in_thread(fake) as base:
        for fields, want in cases:
            for path, body in (("/v1/completions", {"prompt": "hi"}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
                fake.seen.clear()
                status, resp = http_json(base + path, {**body, "max_tokens": 3, "n": 2, **fields})
                assert status == 200, (path, fields, resp)
                assert [params.structured_outputs for _, params in fake.seen] == [want, want], (path, fields)


# ---- tool calling with a fake engine ---------------------------------------------------------------------

WEATHER_CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'


@pytest.mark.parametrize("parser,pieces,content,calls", [
    ("hermes", ["Sure.<tool", "_call>" + WEATHER_CALL[:20], WEATHER_CALL[20:] + "</tool_call>"], "Sure.",
     [("get_weather", {"city": "Paris", "unit": "C"})]),
    ("hermes", ["<tool_call>", WEATHER_CALL, "</tool_call>\n<tool_call>", '{"name": "get_time", "arguments": ',
                '{"zone": "UTC"}}</tool_call>'], None,
     [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"zone": "UTC"})]),
    ("hermes", ["It is sunny", " in <b>Paris</b>."], "It is sunny in <b>Paris</b>.", []),
    ("hermes", ["<tool_call>{bro", "ken}</tool_call>"], "<tool_call>{broken}</tool_call>", []),  # left as content
    ("llama3_json", ['{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_weather", ',
                     '"parameters": {"city": "Rome", "unit": "F"}}'], None,
     [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Rome", "unit": "F"})]),
    ("llama3_json", ["The weather ", "is fine."], "The weather is fine.", []),
    ("mistral", ["Checking.[TOOL_", "CALLS]get_time[ARGS]", '{"zone": "UTC"}'], "Checking.",
     [("get_time", {"zone": "UTC"})]),
    ("pythonic", ['[get_weather(city="Rome", ', 'unit="F"), get_time(zone="UTC")]'], None,
     [("get_weather", {"city": "Rome", "unit": "F"}), ("get_time", {"zone": "UTC"})]),
    ("qwen3_coder", ["Let me check.\n<tool_call>\n<function=get_", "weather>\n<parameter=city>\nRome\n</parameter>",
                     "\n<parameter=unit>\nF\n</parameter>\n</function>\n</tool_call>"], "Let me check.\n",
     [("get_weather", {"city": "Rome", "unit": "F"})]),
    ("deepseek_v3", ["Sure.<\uff5ctool\u2581calls\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin\uff5c>function",
                     "<\uff5ctool\u2581sep\uff5c>get_time\n```json\n", '{"zone": "UTC"}\n```',
                     "<\uff5ctool\u2581call\u2581end\uff5c><\uff5ctool\u2581calls\u2581end\uff5c>"], "Sure.",
     [("get_time", {"zone": "UTC"})]),
    ("kimi_k2", ["<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>",
                 '{"city": "Paris", "unit": "C"}<|tool_call_end|><|tool_calls_section_end|>'], None,
     [("get_weather", {"city": "Paris", "unit": "C"})]),
])
def test_auto_tool_choice_reads_the_calls_with_the_server_s_parser(parser, pieces, content, calls):
    """With --enable-auto-tool-choice --tool-call-parser, tool_choice "auto" (the default with tools) gives the
    calls the parser finds (finish_reason "tool_calls") and the rest as content, whole and streamed alike."""
    with app_in_thread(ScriptedEngineClient(pieces), enable_auto_tool_choice=True, tool_call_parser=parser) as base:
        body = {"messages": WEATHER_CHAT, "tools": TOOLS}
        status, whole = http_json(base + "/v1/chat/completions", body)
        assert status == 200, whole
        choice = whole["choices"][0]
        assert choice["message"]["content"] == content
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in choice["message"]["tool_calls"]] == calls
        assert choice["finish_reason"] == ("tool_calls" if calls else "stop")
        text, streamed, finish = streamed_chat(sse_events(base + "/v1/chat/completions",
                                                          {**body, "tool_choice": "auto", "stream": True}))
        assert (text, finish) == (content or "", choice["finish_reason"])
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == calls
        status, plain = http_json(base + "/v1/chat/completions", {**body, "tool_choice": "none"})
        assert plain["choices"][0]["message"] == {"role": "assistant", "content": "".join(pieces),
                                                  "reasoning_content": None, "tool_calls": []}
        if len(calls) > 1:  # parallel_tool_calls false: the first call only (vLLM's), whole and streamed
            single = {**body, "parallel_tool_calls": False}
            status, whole = http_json(base + "/v1/chat/completions", single)
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                    for c in whole["choices"][0]["message"]["tool_calls"]] == calls[:1]
            _, streamed, _ = streamed_chat(sse_events(base + "/v1/chat/completions", {**single, "stream": True}))
            assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == calls[:1]


def test_auto_tool_choice_reads_calls_in_the_answer_after_the_reasoning():
    pieces = ["<think>Call it.</think>", "<tool_call>", WEATHER_CALL, "</tool_call>"]
    with app_in_thread(ScriptedEngineClient(pieces), reasoning_parser="qwen3", enable_auto_tool_choice=True,
                       tool_call_parser="hermes") as base:
        status, whole = http_json(base + "/v1/chat/completions", {"messages": WEATHER_CHAT, "tools": TOOLS})
        message = whole["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("Call it.", None)
        assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]


class ToolTemplateTokenizer(FakeTokenizer):
    """A chat template that takes tools and records what it was given."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, chat_template=None,
                            tools=None):
        self.messages, self.tools = messages, tools
        return "".join(m.get("content") or "" for m in messages) + ("".join(t["function"]["name"] for t in tools)
                                                                      if tools else "")


class ToolRecordingEngineClient(RecordingEngineClient):
    tokenizer = ToolTemplateTokenizer()


def test_tools_reach_the_chat_template_and_tool_choices_the_engine():
    """tools go to the chat template (with tool_choice "none" too, as vLLM renders them by default) and tool calls'
    arguments as dicts; a named choice constrains the output to the function's schema (an object without one),
    "required" to an array of calls; auto with hermes keeps special tokens in the text (its tags may be some)."""
    from specray.sampling_params import StructuredOutputsParams

    fake = ToolRecordingEngineClient()
    tokenizer = fake.tokenizer
    history = WEATHER_CHAT + [
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]
    bare = [{"type": "function", "function": {"name": "ping"}}]
    with app_in_thread(fake, enable_auto_tool_choice=True, tool_call_parser="hermes") as base:
        def run(**fields):
            fake.seen.clear()
            status, resp = http_json(base + "/v1/chat/completions", {"messages": history, "max_tokens": 3, **fields})
            assert status == 200, (fields, resp)
            return resp, fake.seen[-1][1]

        resp, params = run(tools=TOOLS, tool_choice=NAMED, **COMPACT)
        assert params.structured_outputs == StructuredOutputsParams(json=WEATHER_SCHEMA, disable_any_whitespace=True)
        assert tokenizer.tools == TOOLS and tokenizer.messages[1]["tool_calls"][0]["function"]["arguments"] == {
            "city": "Paris", "unit": "C"} and tokenizer.messages[2]["tool_call_id"] == "c1"
        assert fake.seen[-1][0] == FakeTokenizer().encode("What is the weather in Paris?18 Cget_weatherget_time")
        message = resp["choices"][0]["message"]  # the fake engine's "xxx" is the call's arguments, as generated
        assert message["content"] is None and [(c["function"]["name"], c["function"]["arguments"])
                                               for c in message["tool_calls"]] == [("get_weather", "xxx")]
        _, params = run(tools=bare, tool_choice={"type": "function", "function": {"name": "ping"}})
        assert params.structured_outputs == StructuredOutputsParams(json={"type": "object"})
        _, params = run(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        schema = params.structured_outputs.json
        assert (schema["type"], schema["minItems"], schema["maxItems"]) == ("array", 1, 1)
        assert [b["properties"]["name"]["enum"] for b in schema["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
        assert [b["properties"]["parameters"] for b in schema["items"]["anyOf"]] == [WEATHER_SCHEMA, TIME_SCHEMA]
        _, params = run(tools=TOOLS, tool_choice="none")
        assert params.structured_outputs is None and params.skip_special_tokens and tokenizer.tools == TOOLS
        _, params = run(tools=TOOLS)
        assert params.structured_outputs is None and params.skip_special_tokens is False
        _, params = run()
        assert tokenizer.tools is None and params.skip_special_tokens


def test_required_calls_schema_gathers_each_tool_s_defs():
    from specray.cluster.openai_protocol import ChatTool, OpenAIError, required_calls_schema

    def tool(name, defs):
        return ChatTool.model_validate({"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"x": {"$ref": "#/$defs/X"}}, "$defs": defs}}})

    schema = required_calls_schema([tool("a", {"X": {"enum": [1]}}), tool("b", {"X": {"enum": [1]}, "Y": {}})])
    assert schema["$defs"] == {"X": {"enum": [1]}, "Y": {}} and "maxItems" not in schema
    assert all("$defs" not in b["properties"]["parameters"] for b in schema["items"]["anyOf"])
    with pytest.raises(OpenAIError) as info:
        required_calls_schema([tool("a", {"X": {"enum": [1]}}), tool("b", {"X": {"enum": [2]}})])
    assert info.value.param == "tools.1.function.parameters.$defs.X"
    # every other local reference ("#" itself, draft-07's definitions, a property) points where it pointed in its
    # tool's own schema, not into the array of calls around it; data ("const", "enum") is left as it is
    tree = {"type": "object", "definitions": {"U": {"enum": ["C", "F"]}}, "properties": {
        "u": {"$ref": "#/definitions/U"}, "same": {"$ref": "#/properties/u"}, "default": {"$ref": "#/$defs/X"},
        "kids": {"type": "array", "items": {"$ref": "#"}}, "tag": {"const": {"$ref": "#"}}}, "$defs": {"X": {}}}
    schema = required_calls_schema([tool("a", {"X": {}}), ChatTool.model_validate(
        {"type": "function", "function": {"name": "tree", "parameters": tree}})])

    def resolve(root, ref):
        for part in ref[2:].split("/") if ref != "#" else []:
            root = root[int(part)] if isinstance(root, list) else root[part]
        return root

    params = schema["items"]["anyOf"][1]["properties"]["parameters"]
    tree_alone = {key: value for key, value in tree.items() if key != "$defs"}
    assert resolve(schema, params["properties"]["kids"]["items"]["$ref"]) == params
    assert params == {**tree_alone, "definitions": tree["definitions"], "properties": {
        **tree["properties"], "kids": {"type": "array", "items": {"$ref": "#/items/anyOf/1/properties/parameters"}},
        "u": {"$ref": "#/items/anyOf/1/properties/parameters/definitions/U"},
        "same": {"$ref": "#/items/anyOf/1/properties/parameters/properties/u"}}}
    assert resolve(schema, params["properties"]["u"]["$ref"]) == {"enum": ["C", "F"]}
    assert resolve(schema, params["properties"]["same"]["$ref"]) == params["properties"]["u"]


# ---- the Responses API with a fake engine ----------------------------------------------------------------

def responses_events(base: str, body: dict) -> list[dict]:
    """A streamed Responses request's events, each checked against its ``event:`` line."""
    req = urllib.request.Request(base + "/v1/responses", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        blocks = [b for b in resp.read().decode().split("\n\n") if b]
    events = []
    for block in blocks:
        kind, data = block.split("\n")
        event = json.loads(data[len("data: "):])
        assert kind == f"event: {event['type']}", block
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_responses_api_answers_and_streams_text():
    """POST /v1/responses: instructions and input become the chat, the answer a message item (the openai client's
    output_text); streamed, the typed events in order, their deltas the text, response.completed last with the
    same output; max_output_tokens reached is status "incomplete", the response's and its cut message item's (with
    its text). Its objects' ids are OpenAI's form (``resp_<hex>``, ``msg_<hex>``)."""
    from specray.cluster.openai_responses import ResponsesRequest, chat_body

    with app_in_thread(ScriptedEngineClient(["Hello", " wor", "ld"])) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)
        resp = client.responses.create(model="fake", input="Say hi", instructions="Be brief.")
        assert (resp.status, resp.output_text, resp.object) == ("completed", "Hello world", "response")
        assert [item.type for item in resp.output] == ["message"] and resp.id.startswith("resp_")
        assert resp.output[0].id.startswith("msg_") and resp.output[0].status == "completed"
        assert resp.usage.input_tokens == len("Be brief.Say hi") and resp.usage.output_tokens == 3
        events = responses_events(base, {"model": "fake", "input": "Say hi"})
        assert [e["type"] for e in events] == [
            "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
            "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
            "response.output_text.done", "response.content_part.done", "response.output_item.done",
            "response.completed"]
        assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hello world"
        final = events[-1]["response"]
        assert final["status"] == "completed" and final["output"] == [events[-2]["item"]]
        assert final["output"][0]["content"][0]["text"] == "Hello world" and final["usage"]["output_tokens"] == 3
        streamed = list(client.responses.create(model="fake", input="Say hi", stream=True))  # the client parses it
        assert streamed[-1].type == "response.completed" and streamed[-1].response.output_text == "Hello world"
    with app_in_thread(FakeEngineClient(tokens=2)) as base:  # it ends on "length"
        status, resp = http_json(base + "/v1/responses", {"input": "x", "max_output_tokens": 2})
        assert status == 200 and resp["status"] == "incomplete", resp
        assert resp["incomplete_details"] == {"reason": "max_output_tokens"} and resp["max_output_tokens"] == 2
        [item] = resp["output"]
        assert item["status"] == "incomplete" and item["content"][0]["text"], item
        events = responses_events(base, {"input": "x"})
        assert events[-1]["type"] == "response.incomplete"
        assert events[-2]["type"] == "response.output_item.done" and events[-2]["item"]["status"] == "incomplete"
        assert events[-1]["response"]["output"] == [events[-2]["item"]]
    with app_in_thread(FakeEngineClient(tokens=3, fail_after=1)) as base:  # the engine fails it mid-stream
        events = responses_events(base, {"input": "x"})
        assert [e["type"] for e in events[-3:]] == ["response.output_text.delta", "error", "response.failed"]
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == events[-2]["code"] == "internal_error"
        assert "worker died" in failed["error"]["message"] and failed["output"] == []
    # the chat request a Responses request becomes
    body = chat_body(ResponsesRequest.model_validate({
        "input": [{"role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
                  {"type": "message", "role": "user", "content": "Weather?"},
                  {"type": "reasoning", "id": "rs_1", "summary": []},
                  {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                  {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "18 C"}],
        "instructions": "Be brief.", "max_output_tokens": 9, "seed": 3, "speculative": {"enabled": False},
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}}}))
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]
    assert body["tools"] == [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}
    assert (body["max_completion_tokens"], body["seed"], body["stream"]) == (9, 3, False)
    assert body["speculative"] == {"enabled": False}  # specray's per-request speculation, as a chat request's


class LogprobEngineClient(ScriptedEngineClient):
    """Answers ``pieces``, token i (id i) with logprob -1 - i and a runner-up (id 100 + i) of -9."""

    async def _generate(self, prompt_token_ids, params, prompt=None, req_id=None):
        from specray.outputs import Logprob

        async for out in super()._generate(prompt_token_ids, params, prompt, req_id):
            out.outputs[0].logprobs = [{t: Logprob(-1.0 - t, 1), 100 + t: Logprob(-9.0, 2)}
                                       for t in out.outputs[0].token_ids]
            yield out


def test_responses_api_includes_logprobs_when_asked():
    """include ["message.output_text.logprobs"] (or top_logprobs): the output text's tokens' logprobs, with the
    most likely tokens at each, in the message's output_text, each text delta's with it when streamed; none
    otherwise (the include was accepted and ignored)."""
    with app_in_thread(LogprobEngineClient(["Hello", " wor", "ld"]), return_tokens_as_token_ids=True) as base:
        body = {"input": "Say hi", "include": ["message.output_text.logprobs"], "top_logprobs": 2}
        status, resp = http_json(base + "/v1/responses", body)
        assert status == 200, resp
        logprobs = resp["output"][0]["content"][0]["logprobs"]
        assert [(e["token"], e["logprob"]) for e in logprobs] == [("token_id:0", -1.0), ("token_id:1", -2.0),
                                                                  ("token_id:2", -3.0)], logprobs
        assert [[t["logprob"] for t in e["top_logprobs"]] for e in logprobs] == [[-1, -9], [-2, -9], [-3, -9]]
        events = responses_events(base, body)
        assert [e["logprobs"] for e in events if e["type"] == "response.output_text.delta"] == [[e] for e in logprobs]
        done = next(e for e in events if e["type"] == "response.output_text.done")
        assert done["logprobs"] == events[-1]["response"]["output"][0]["content"][0]["logprobs"] == logprobs
        status, resp = http_json(base + "/v1/responses", {"input": "Say hi", "top_logprobs": 0})
        assert [e["top_logprobs"] for e in resp["output"][0]["content"][0]["logprobs"]] == [[], [], []], resp
        status, resp = http_json(base + "/v1/responses", {"input": "Say hi"})
        assert "logprobs" not in resp["output"][0]["content"][0], resp
        status, err = error_of(http_json(base + "/v1/responses", {"input": "Say hi", "top_logprobs": 21}))
        assert (status, err["param"]) == (400, "top_logprobs")


def test_responses_api_tool_calls_and_reasoning_become_output_items():
    """With the server's tool call parser, calls are function_call items (whole and streamed: added, arguments,
    done); with its reasoning parser, the thinking is a reasoning item before the message."""
    pieces = ["Checking.<tool", "_call>" + WEATHER_CALL + "</tool_call>"]
    with app_in_thread(ScriptedEngineClient(pieces), enable_auto_tool_choice=True, tool_call_parser="hermes") as base:
        tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
        status, resp = http_json(base + "/v1/responses", {"input": "Weather in Paris?", "tools": tools})
        assert status == 200, resp
        message, call = resp["output"]
        assert message["content"][0]["text"] == "Checking."
        assert (call["type"], call["name"], json.loads(call["arguments"])) == (
            "function_call", "get_weather", {"city": "Paris", "unit": "C"})
        assert call["call_id"] and call["status"] == "completed"
        events = responses_events(base, {"input": "Weather in Paris?", "tools": tools})
        kinds = [e["type"] for e in events]
        assert kinds.count("response.output_item.added") == 2 and "response.function_call_arguments.done" in kinds
        done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
        assert json.loads(done["arguments"]) == {"city": "Paris", "unit": "C"} and done["name"] == "get_weather"
        assert [i["type"] for i in events[-1]["response"]["output"]] == ["message", "function_call"]
    with app_in_thread(ScriptedEngineClient(["<thi", "nk>Hmm.</think>", "Four."]), reasoning_parser="qwen3") as base:
        status, resp = http_json(base + "/v1/responses", {"input": "2+2?"})
        assert [i["type"] for i in resp["output"]] == ["reasoning", "message"], resp
        assert resp["output"][0]["content"][0]["text"] == "Hmm." and resp["output"][1]["content"][0]["text"] == "Four."
        # the thinking's tokens (this tokenizer holds no tags: its text encoded again, at most the output's 3)
        assert resp["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}, resp["usage"]
        events = responses_events(base, {"input": "2+2?"})
        assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "Hmm."
        assert [i["type"] for i in events[-1]["response"]["output"]] == ["reasoning", "message"]
        assert events[-1]["response"]["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}


class RoleTemplate(FakeTokenizer):
    """A chat template that shows each message's role: ``<role>content``."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, chat_template=None,
                            tools=None):
        return "".join(f"<{m['role']}>{m.get('content') or ''}" for m in messages)


class ConversationClient(ScriptedEngineClient):
    """Answers ``pieces``, keeping each prompt's text (the conversation the chat template laid out)."""

    max_model_len = 4096
    tokenizer = RoleTemplate()

    def __init__(self, pieces: list[str]):
        super().__init__(pieces)
        self.prompts: list[str] = []

    async def generate(self, prompt_token_ids, params, prompt=None, req_id=None, multimodal=None):
        self.prompts.append(prompt)
        async for out in super().generate(prompt_token_ids, params, prompt, req_id):
            yield out


def test_replicas_share_stored_responses():
    """Several ingress replicas (two apps here) over one store deployment: a response stored through one is read,
    continued and deleted through the other; while the store is down, reading it is a 503 to retry and a new
    response is still answered (unstored)."""
    from specray.cluster.serve import SharedResponseStore, SpecrayResponseStore

    from specray_test_fakes import FakeDeploymentHandle

    handle = FakeDeploymentHandle(SpecrayResponseStore(10))
    one, two = ConversationClient(["Hello", "!"]), ConversationClient(["Again", "."])
    with app_in_thread(one, response_store=SharedResponseStore(handle)) as a, \
            app_in_thread(two, response_store=SharedResponseStore(handle)) as b:
        status, first = http_json(a + "/v1/responses", {"input": "Hi"})
        assert status == 200 and http_json(b + f"/v1/responses/{first['id']}") == (200, first)
        status, second = http_json(b + "/v1/responses", {"input": "More", "previous_response_id": first["id"]})
        assert status == 200 and two.prompts[-1].count("Hi") == 1 and "Hello!" in two.prompts[-1]
        request = urllib.request.Request(a + f"/v1/responses/{second['id']}", method="DELETE")
        with urllib.request.urlopen(request, timeout=30) as resp:
            assert json.loads(resp.read())["deleted"] is True
        assert http_json(b + f"/v1/responses/{second['id']}")[0] == 404
        handle.down = True
        status, err = error_of(http_json(b + f"/v1/responses/{first['id']}"))
        assert status == 503 and err["code"] == "response_store_unavailable"
        status, unstored = http_json(a + "/v1/responses", {"input": "Hi"})
        assert status == 200
        handle.down = False
        assert http_json(b + f"/v1/responses/{unstored['id']}")[0] == 404


def test_stored_responses_are_bounded_by_count_and_by_size():
    """The store drops its least recently used responses past its count or past its characters of JSON (a client
    cannot fill the replica's memory through large stored requests), always keeping the newest."""
    from specray.cluster.openai_responses import ResponseStore

    store = ResponseStore(3, max_chars=300)
    for rid in "abc":  # about 120 characters each
        store.put(rid, [{"content": "y" * 100}], {"id": rid})
    assert list(store._entries) == ["b", "c"] and store.get("a") is None  # past 300 characters: a went
    assert store.get("b")[1] == {"id": "b"}  # read: the most recently used now
    store.put("d", [{"content": "short"}], {"id": "d"})
    store.put("e", [], {"id": "e"})
    assert list(store._entries) == ["b", "d", "e"]  # at most 3: c, the least recently used, went
    store.put("big", [{"content": "y" * 1000}], {"id": "big"})
    assert list(store._entries) == ["big"] and store.chars > 300  # the newest stays, alone
    assert store.delete("big") and store.chars == 0 and not store.delete("big")


def test_version_route():
    from specray import __version__

    with app_in_thread(FakeEngineClient()) as base:
        assert http_json(base + "/version") == (200, {"version": __version__})


def test_responses_api_keeps_responses_for_previous_response_id():
    """Stored responses (``store``, true by default): ``previous_response_id`` continues the conversation (the
    previous input and output items before the new input; instructions not carried over), whole and streamed;
    ``GET``/``DELETE /v1/responses/{id}``; ``store: false`` keeps nothing; the least recently used goes first past
    the bound; an unknown id is a 404 in OpenAI's shape."""
    fake = ConversationClient(["Hello", " there"])
    with app_in_thread(fake, max_stored_responses=3) as base:
        status, first = http_json(base + "/v1/responses", {"input": "Hi", "instructions": "Be brief."})
        assert status == 200 and first["store"] is True and first["previous_response_id"] is None, first
        status, second = http_json(base + "/v1/responses", {"input": "And then?", "previous_response_id": first["id"]})
        assert status == 200 and second["previous_response_id"] == first["id"], second
        assert fake.prompts[-2:] == ["<system>Be brief.<user>Hi", "<user>Hi<assistant>Hello there<user>And then?"]
        events = responses_events(base, {"input": [{"role": "user", "content": "More?"}],
                                         "previous_response_id": second["id"], "instructions": "Now long."})
        third = events[-1]["response"]
        assert events[-1]["type"] == "response.completed" and third["store"] is True
        assert fake.prompts[-1] == ("<system>Now long.<user>Hi<assistant>Hello there<user>And then?<assistant>Hello "
                                    "there<user>More?")
        status, got = http_json(base + f"/v1/responses/{third['id']}")  # the streamed one, as it ended
        assert status == 200 and got == third
        status, got = http_json(base + f"/v1/responses/{first['id']}")
        assert status == 200 and got == first
        status, unstored = http_json(base + "/v1/responses", {"input": "Secret", "store": False})
        assert status == 200 and unstored["store"] is False
        assert http_json(base + f"/v1/responses/{unstored['id']}")[0] == 404
        status, fourth = http_json(base + "/v1/responses", {"input": "Fourth"})  # 4 stored: the oldest goes
        assert http_json(base + f"/v1/responses/{second['id']}")[0] == 404  # first was read since: second is oldest
        assert http_json(base + f"/v1/responses/{first['id']}")[0] == 200
        request = urllib.request.Request(base + f"/v1/responses/{first['id']}", method="DELETE")
        with urllib.request.urlopen(request, timeout=30) as resp:
            assert json.loads(resp.read()) == {"id": first["id"], "object": "response.deleted", "deleted": True}
        status, err = http_json(base + "/v1/responses", {"input": "x", "previous_response_id": first["id"]})
        assert status == 404 and err["error"]["param"] == "previous_response_id", err
        assert err["error"]["code"] == "previous_response_not_found"
        status, err = http_json(base + "/v1/responses/resp_unknown")
        assert status == 404 and err["error"]["code"] == "response_not_found"
        # a function call's output answers a call made before it, here in the stored conversation; an error names
        # the item by its index in this request's input
        status, called = http_json(base + "/v1/responses", {"input": [
            {"role": "user", "content": "Hi"}, {"type": "function_call", "call_id": "c9", "name": "f"}]})
        assert status == 200, called
        status, err = http_json(base + "/v1/responses", {"previous_response_id": called["id"], "input": [
            {"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": "c8", "output": "1"}]})
        assert status == 400 and err["error"]["param"] == "input.1.call_id" and "'c8'" in err["error"]["message"]
        status, answered = http_json(base + "/v1/responses", {"previous_response_id": called["id"], "input": [
            {"type": "function_call_output", "call_id": "c9", "output": "1"}]})
        assert status == 200, answered


def test_responses_api_errors_name_its_own_parameters():
    """What this server cannot do is a 400 naming the Responses request's parameter, also where the chat
    machinery finds the fault; structured text formats reach the engine."""
    fake = RecordingEngineClient()
    with app_in_thread(fake) as base:
        cases = [
            ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "keeps none"),
            ({"input": "x", "background": True}, "background", "background"),
            ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
             "input.0.content.0.type", "not supported"),
            ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
             "input", "reads text only"),
            ({"input": [{"role": "wizard", "content": "x"}]}, "input.0.role", "not a valid role"),
            ({"input": [{"type": "file_search_call"}]}, "input.0.type", "not supported; send message, function_call"),
            ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                          "arguments": "{bad"}]}, "input.1.arguments", "valid JSON"),
            ({"input": [{"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": "c",
                                                          "output": "1"}]}, "input.1.call_id", "answers no"),
            ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type", "functions only"),
            ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type", "not supported"),
            ({"input": "x", "text": {"format": "json"}}, "text.format", "must be an object"),
            ({"input": "x", "max_output_tokens": 1000}, "max_output_tokens", "max_output_tokens"),
            ({"input": "x", "max_tokens": 5}, "max_tokens", "not a supported parameter"),  # a chat field
            ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
              "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name", "names no function"),
            ({"input": "x", "tool_choice": "required"}, "tool_choice",  # the tools' shape of this API, flat
             "as tools=[{'type': 'function', 'name': ..., 'parameters': {...}}], or omit"),
            ({"input": "x", "tool_choice": "any"}, "tool_choice", "or {'type': 'function', 'name': ...} to call"),
            ({"input": "x", "include": ["reasoning.encrypted_content", "logprobs"]}, "include.1",
             "include[1]='logprobs' is not one of 'message.output_text.logprobs'"),
        ]
        for body, param, words in cases:
            status, resp = http_json(base + "/v1/responses", body)
            assert status == 400 and resp["error"]["param"] == param and words in resp["error"]["message"], (body,
                                                                                                              resp)
        fake.seen.clear()
        status, resp = http_json(base + "/v1/responses", {"input": "x", "text": {"format": {"type": "json_object"}}})
        assert status == 200 and fake.seen[-1][1].structured_outputs.json_object, resp
    # an engine's refusal of a schema names the chat request's field: renamed
    from specray.cluster.openai_protocol import bad_request
    from specray.cluster.openai_responses import in_responses_terms

    err = in_responses_terms(bad_request("response_format.json_schema.schema is not a valid schema; messages[2] too",
                                         "response_format.json_schema.schema"))
    assert (err.param, err.message) == ("text.format.schema", "text.format.schema is not a valid schema; input too")
    # an adapter the engine cannot read names the request's model
    from specray.cluster.openai_protocol import from_value_error

    err = from_value_error(ValueError("lora_request='m:a': cannot read adapter_config.json"), "prompt")
    assert err.param == "model"
