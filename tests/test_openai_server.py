"""The OpenAI-compatible server on Ray Serve (tiny model, CPU), driven with the official `openai` client and raw
HTTP: endpoints, streaming, sampling parameters, logprobs, the speculative extension, errors, client disconnects,
metrics, bench-serve, and a load test (32 streaming clients for 6 s; SPECRAY_LOAD_SECONDS=<seconds> adds a longer
soak of the same test), all through one Serve deployment shared by this module. The app's logic that needs a
controllable engine (queue full, engine failures) runs without Ray: tests/test_openai_app.py.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import socket
import threading
import time
import urllib.request

import jsonschema
import openai
import pytest

from specray import SamplingParams
from specray.engine.llm_engine import bad_word_sequences
from specray_test_openai_helpers import (  # tests/openai_helpers.py (tests/conftest.py registers it)
    ANSWER_SCHEMA, COMPACT, NAMED, TIME_SCHEMA, TOOLS, WEATHER_CHAT, WEATHER_SCHEMA, error_of, free_port, http_json,
    http_json_text, kv_state, metric_value, post_in_thread, sse_events, streamed_chat, wait_for_free_blocks)

MODEL = "tiny"
SPEC = {"method": "ngram", "num_speculative_tokens": 3}
MAX_MODEL_LEN = 256
LOAD_PROMPTS = ["def add(a, b):", "The quick brown fox", "Hello world! How are", "for i in range(10):",
                "Summarize the following text", "Extract the names from: Alice", "Alice met Bob", "print(i)"]
LOAD_MAX_TOKENS = 24
LOAD_CLIENTS = 32
SHORT_LOAD_SECONDS = 6.0
LONG_LOAD_SECONDS = os.environ.get("SPECRAY_LOAD_SECONDS")  # the soak: asked for, not in the default run


# ---- the Serve deployment --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(ray_cluster, tiny_llama_dir):
    """One deployment of the tiny model with n-gram speculation and prefix caching (so every test's greedy
    comparison with ``offline``, which caches nothing, also checks cached prefixes); yields its base URL."""
    from ray import serve

    from specray.cluster.serve import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    app = build_app({"model": str(tiny_llama_dir), "served_model_name": MODEL, "spec_method": SPEC["method"],
                     "num_spec_tokens": SPEC["num_speculative_tokens"], "max_model_len": MAX_MODEL_LEN,
                     "max_num_seqs": 8, "max_queue_len": 1000, "seed": 0, "num_cpus": 0.5,
                     "enable_debug_routes": True, "enable_prefix_caching": True})
    serve.run(app, name="specray", route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    """The same engine settings, in this process: the reference for greedy outputs."""
    from specray import LLM

    return LLM(model=str(tiny_llama_dir), speculative_config=SPEC, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
               seed=0)


@pytest.fixture(scope="module")
def start_blocks(server) -> int:
    state = kv_state(server)
    assert state["free_blocks"] == state["total_blocks"] > 0
    return state["free_blocks"]


def offline_greedy(offline, prompts: list[str], max_tokens: int, **kwargs) -> list:
    return offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs),
                            use_tqdm=False)


# ---- endpoints -------------------------------------------------------------------------------------------

def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    status, body = http_json(server + "/health")
    assert status == 200 and body["status"] == "ok"


def test_completion_matches_offline_greedy(client, offline):
    prompt = "Alice met Bob"
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    want = offline_greedy(offline, [prompt], 20)[0]
    choice = resp.choices[0]
    assert choice.text == want.outputs[0].text and choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids)
    assert resp.usage.completion_tokens == 20 and resp.usage.total_tokens == resp.usage.prompt_tokens + 20
    spec = resp.usage.model_extra["speculative"]
    assert set(spec) >= {"drafts", "draft_tokens", "accepted_tokens", "mean_accepted_length"}
    assert spec["accepted_tokens"] <= spec["draft_tokens"]


def test_penalties_reach_the_engine(client, offline):
    """OpenAI's presence and frequency penalties and vLLM's repetition_penalty give the offline engine's output
    with the same penalties, which differs from the unpenalized one."""
    prompt = "Alice met Bob"
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.8}
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                      presence_penalty=1.5, frequency_penalty=0.5,
                                      extra_body={"repetition_penalty": 1.8})
    want = offline_greedy(offline, [prompt], 20, **penalties)[0].outputs[0].text
    assert resp.choices[0].text == want != offline_greedy(offline, [prompt], 20)[0].outputs[0].text
    eos = offline.get_tokenizer().eos_token_id
    biased = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                       logit_bias={str(eos): 100, "7": 50}, extra_body={"min_tokens": 3})
    want = offline_greedy(offline, [prompt], 5, logit_bias={eos: 100.0, 7: 50.0}, min_tokens=3)[0].outputs[0]
    assert biased.choices[0].text == want.text and want.token_ids[:3] == [7, 7, 7]
    assert biased.choices[0].finish_reason == "stop" == want.finish_reason


def test_completion_with_token_ids_and_batch_of_prompts(client, offline):
    ids = offline.get_tokenizer().encode("print(i)")
    resp = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=8, temperature=0)
    want = offline.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=8),
                            use_tqdm=False)
    assert [c.index for c in resp.choices] == [0, 1]
    assert all(c.text == want[0].outputs[0].text for c in resp.choices)
    assert resp.usage.prompt_tokens == 2 * len(ids) and resp.usage.completion_tokens == 16


def test_chat_uses_the_chat_template(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12, temperature=0)
    want = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == want.outputs[0].text
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids) and resp.usage.completion_tokens == 12


def test_chat_continues_the_final_message(server, offline):
    """vLLM's continue_final_message: the assistant's started answer is continued, as offline; OpenAI's metadata
    is accepted and store=true refused (nothing is stored)."""
    messages = [{"role": "user", "content": "Hello world!"}, {"role": "assistant", "content": "The answer"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "add_generation_prompt": False, "continue_final_message": True, "metadata": {"team": "a"}}
    status, resp = http_json(server + "/v1/chat/completions", body)
    want = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False,
                        add_generation_prompt=False, continue_final_message=True)[0]
    closed = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False,
                          add_generation_prompt=False)[0]
    assert status == 200 and resp["choices"][0]["message"]["content"] == want.outputs[0].text
    assert resp["usage"]["prompt_tokens"] == len(want.prompt_token_ids) < len(closed.prompt_token_ids)
    for override, param in (({"add_generation_prompt": True}, "continue_final_message"), ({"store": True}, "store")):
        status, err = error_of(http_json(server + "/v1/chat/completions", {**body, **override}))
        assert (status, err["param"]) == (400, param), err


def test_streaming_completion_chunks_done_and_usage(server, client):
    body = {"model": MODEL, "prompt": "Hello world! How are", "max_tokens": 16, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    events = sse_events(server + "/v1/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 16
    assert "speculative" in usage["usage"]
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    plain = client.completions.create(model=MODEL, prompt=body["prompt"], max_tokens=16, temperature=0)
    assert text == plain.choices[0].text


def test_streaming_without_include_usage_has_no_usage_chunk(server):
    events = sse_events(server + "/v1/completions",
                        {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "stream": True})
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["choices"] for e in events[:-1])


def test_streaming_chat_with_openai_client(client):
    messages = [{"role": "user", "content": "Alice met Bob"}]
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-2].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert text == plain.choices[0].message.content


def _stop_for(text: str) -> str:
    """A two-character stop string that first occurs after the first character of ``text`` (control characters
    too: the tiny model writes them; no replacement character, which a later token may complete otherwise)."""
    for i in range(1, len(text) - 1):
        candidate = text[i:i + 2]
        if "\ufffd" not in candidate and text.find(candidate) == i:
            return candidate
    pytest.skip(f"the tiny model's output {text!r} has no stop candidate")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences(server, client, stream):
    prompt = "Alice met Bob"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    stop = _stop_for(full)
    expected = full[:full.find(stop)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "stop": ["\x00zz", stop]}
    if stream:
        chunks = [json.loads(e) for e in sse_events(server + "/v1/completions", {**body, "stream": True})[:-1]]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        finish, reason = chunks[-1]["choices"][0]["finish_reason"], chunks[-1]["choices"][0]["stop_reason"]
    else:
        choice = client.completions.create(**body).choices[0]
        text, finish, reason = choice.text, choice.finish_reason, choice.stop_reason  # vLLM's stop_reason
    assert (text, finish, reason) == (expected, "stop", stop)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0}
    full = http_json(server + "/v1/chat/completions", chat)[1]["choices"][0]
    assert full["stop_reason"] is None and full["finish_reason"] == "length"
    stop = _stop_for(full["message"]["content"])
    if stream:
        events = [json.loads(e) for e in sse_events(server + "/v1/chat/completions",
                                                    {**chat, "stop": [stop], "stream": True})[:-1]]
        last = events[-1]["choices"][0]
    else:
        last = http_json(server + "/v1/chat/completions", {**chat, "stop": [stop]})[1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop)


def test_stop_token_ids(client, offline):
    prompt = "Alice met Bob"
    token_ids = offline_greedy(offline, [prompt], 12)[0].outputs[0].token_ids
    stop_id = token_ids[4]
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"stop_token_ids": [stop_id], "ignore_eos": True})
    assert (resp.choices[0].finish_reason, resp.choices[0].stop_reason) == ("stop", stop_id)
    assert resp.usage.completion_tokens == token_ids.index(stop_id) + 1


def test_n_choices_and_seeded_sampling_repeat(client):
    kwargs = dict(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=1.0, seed=1234, n=2)
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    single = client.completions.create(**{**kwargs, "n": 1, "seed": 1235})  # choice 1 has seed + 1
    assert single.choices[0].text == first.choices[1].text


def test_completion_logprobs_legacy_format(client, offline):
    prompt = "Hello world! How are"
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    want = offline_greedy(offline, [prompt], 8, logprobs=2)[0].outputs[0]
    for i, (token_id, entry) in enumerate(zip(want.token_ids, want.logprobs)):
        assert lp.token_logprobs[i] == pytest.approx(entry[token_id].logprob, abs=1e-3)
        assert 1 <= len(lp.top_logprobs[i]) <= 3
        assert max(lp.top_logprobs[i].values()) == pytest.approx(lp.token_logprobs[i], abs=1e-6)  # greedy


def test_tokens_as_token_ids(server, offline):
    """vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:<id>" (completions, echoed prompts and
    chat), so a client reads the exact tokens: the offline engine's greedy ones."""
    prompt = "Hello world! How are"
    want = offline_greedy(offline, [prompt], 8)[0].outputs[0].token_ids
    prompt_ids = offline.engine.tokenizer.encode(prompt)

    def ids(names):
        assert all(re.fullmatch(r"token_id:\d+", n) for n in names), names
        return [int(n.split(":")[1]) for n in names]

    status, body = http_json(server + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 8,
                                                           "temperature": 0, "logprobs": 2, "echo": True,
                                                           "return_tokens_as_token_ids": True})
    assert status == 200
    lp = body["choices"][0]["logprobs"]
    assert ids(lp["tokens"]) == prompt_ids + want
    assert all(ids(list(top)) for top in lp["top_logprobs"] if top)
    status, body = http_json(server + "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "temperature": 0,
        "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True})
    assert status == 200
    content = body["choices"][0]["logprobs"]["content"]
    assert len(ids([c["token"] for c in content])) == 4
    assert all(ids([t["token"] for t in c["top_logprobs"]]) for c in content)
    status, body = http_json(server + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2,
                                                           "temperature": 0, "logprobs": 1})
    assert not any(t.startswith("token_id:") for t in body["choices"][0]["logprobs"]["tokens"])


def test_completion_echo_with_logprobs_as_lm_eval_reads_it(client, offline):
    """lm-evaluation-harness scores a continuation with echo=true, logprobs=1, max_tokens=1 over token-id prompts
    and reads token_logprobs[ctxlen:-1]: every prompt token's logprob (null for the first), then the output's."""
    prompts = [offline.engine.tokenizer.encode(p) for p in ("The quick brown fox jumps", "def add(a, b):")]
    resp = client.completions.create(model=MODEL, prompt=prompts, max_tokens=1, temperature=0, logprobs=1, echo=True)
    want = offline.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    for choice, ids, ref in zip(sorted(resp.choices, key=lambda c: c.index), prompts, want):
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for j in range(1, len(ids)):
            assert lp.token_logprobs[j] == pytest.approx(ref.prompt_logprobs[j][ids[j]].logprob, abs=1e-3)
            assert max(lp.top_logprobs[j].values()) >= lp.token_logprobs[j] - 1e-6 and len(lp.top_logprobs[j]) <= 2
        assert lp.token_logprobs[-1] == pytest.approx(max(lp.top_logprobs[-1].values()), abs=1e-6)  # greedy
        assert choice.text == offline.engine.tokenizer.decode(ids) + ref.outputs[0].text
        assert lp.text_offset == sorted(lp.text_offset) and "".join(lp.tokens) == choice.text


def test_completion_echo_text_streamed_and_not(server, client):
    kwargs = dict(model=MODEL, prompt="Hello world! How are", max_tokens=6, temperature=0)
    plain = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs, echo=True).choices[0].text == kwargs["prompt"] + plain
    events = sse_events(server + "/v1/completions", {**kwargs, "echo": True, "logprobs": 0, "stream": True})
    chunks = [json.loads(e)["choices"] for e in events[:-1]]
    first = chunks[0][0]
    assert first["text"].startswith(kwargs["prompt"]) and first["logprobs"]["token_logprobs"][0] is None
    assert "".join(c[0]["text"] for c in chunks if c) == kwargs["prompt"] + plain
    offsets = [o for c in chunks if c and c[0]["logprobs"] for o in c[0]["logprobs"]["text_offset"]]
    tokens = [t for c in chunks if c and c[0]["logprobs"] for t in c[0]["logprobs"]["tokens"]]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_prompt_logprobs_extra_parameter(server, offline, endpoint):
    """vLLM's prompt_logprobs: per prompt token null (the first) or {id: {logprob, rank, decoded_token}}; on a
    completion's choices, on a chat completion's response. Not with stream=true."""
    if endpoint == "chat":
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2,
                "temperature": 0, "prompt_logprobs": 2}
        status, resp = http_json(server + "/v1/chat/completions", body)
        got = resp["prompt_logprobs"]
        tokenizer = offline.engine.tokenizer
        ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False,
                                                             add_generation_prompt=True), add_special_tokens=False)
    else:
        body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 2, "temperature": 0,
                "prompt_logprobs": 2, "n": 2}
        status, resp = http_json(server + "/v1/completions", body)
        got = resp["choices"][0]["prompt_logprobs"]
        assert resp["choices"][1]["prompt_logprobs"] == got  # the prompt's, for each of its choices
        ids = offline.engine.tokenizer.encode(body["prompt"])
    assert status == 200, resp
    ref = offline.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=2),
                           use_tqdm=False)[0].prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    for j in range(1, len(ids)):
        entry = got[j]
        assert str(ids[j]) in entry and 2 <= len(entry) <= 3
        ranked = sorted(entry.items(), key=lambda kv: -kv[1]["logprob"])
        assert [e["rank"] for _, e in ranked[:2]] == [1, 2]  # then the prompt token's own, when not in the top 2
        for token, e in entry.items():
            assert e["logprob"] == pytest.approx(ref[j][int(token)].logprob, abs=1e-3)
            assert e["rank"] == ref[j][int(token)].rank
            assert e["decoded_token"] == offline.engine.tokenizer.decode([int(token)])
    status, err = error_of(http_json(server + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions"),
                                     {**body, "stream": True}))
    assert status == 400 and err["param"] == "prompt_logprobs", err


def test_allowed_token_ids_and_bad_words(server, client, offline):
    """vLLM's extra parameters: the served output is the offline one under the same constraint, which it
    changes; bad values are 400s naming them."""
    kwargs = dict(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0)
    plain = offline_greedy(offline, [kwargs["prompt"]], 12)[0].outputs[0]
    allowed = sorted(set(plain.token_ids[::2]))[:4] + [5, 9]
    banned = offline.engine.tokenizer.decode(plain.token_ids[:2])
    for extra in ({"allowed_token_ids": allowed}, {"bad_words": [banned]}):
        resp = client.completions.create(**kwargs, extra_body=extra)
        want = offline_greedy(offline, [kwargs["prompt"]], 12, **extra)[0].outputs[0]
        assert resp.choices[0].text == want.text and want.token_ids != plain.token_ids, extra
    for seq in bad_word_sequences(offline.engine.tokenizer, extra["bad_words"]):  # no banned sequence is left
        assert not any(want.token_ids[i : i + len(seq)] == seq for i in range(len(want.token_ids)))
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                          temperature=0, extra_body={"allowed_token_ids": allowed})
    assert chat.choices[0].finish_reason == "length"
    status, err = error_of(http_json(server + "/v1/completions", {**kwargs, "allowed_token_ids": [1, 10 ** 6]}))
    assert status == 400 and "allowed_token_ids" in err["message"], err
    status, err = error_of(http_json(server + "/v1/completions", {**kwargs, "bad_words": ["  "]}))
    assert status == 400 and err["param"] == "bad_words", err


def test_tokenize_and_detokenize(server, client, offline):
    """vLLM's /tokenize (a prompt, or a chat rendered as a chat completion renders it) and /detokenize."""
    tokenizer = offline.engine.tokenizer
    status, got = http_json(server + "/tokenize", {"model": MODEL, "prompt": "The quick brown fox"})
    assert status == 200 and got["tokens"] == tokenizer.encode("The quick brown fox")
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == MAX_MODEL_LEN
    messages = [{"role": "user", "content": "Hello"}]
    status, chat = http_json(server + "/tokenize", {"messages": messages})
    usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert status == 200 and chat["count"] == usage.prompt_tokens
    status, text = http_json(server + "/detokenize", {"model": MODEL, "tokens": got["tokens"]})
    assert status == 200 and text == {"prompt": "The quick brown fox"}
    for path, body, param in [("/tokenize", {"prompt": "a", "messages": messages}, "messages"),
                              ("/tokenize", {}, "prompt"), ("/detokenize", {"tokens": [1, 10 ** 6]}, "tokens"),
                              ("/tokenize", {"prompt": "a", "model": "other"}, "model")]:
        status, err = error_of(http_json(server + path, body))
        assert status in (400, 404) and err["param"] == param, (path, body, err)


def test_chat_logprobs_format(client):
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == 6
    for item in content:
        assert item.logprob <= 0 and isinstance(item.bytes, list) and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-6)  # greedy: the best one
        assert [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs),
                                                                reverse=True)
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                           max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None


def test_speculative_extension(client):
    kwargs = dict(model=MODEL, prompt="Hello world! How are", max_tokens=24, temperature=0)
    default = client.completions.create(**kwargs)
    off = client.completions.create(**kwargs, extra_body={"speculative": {"enabled": False}})
    one = client.completions.create(**kwargs, extra_body={"speculative": {"num_speculative_tokens": 1}})
    suffix = client.completions.create(**kwargs, extra_body={"speculative": {"method": "suffix"}})
    assert off.choices[0].text == default.choices[0].text == one.choices[0].text  # greedy is lossless
    assert suffix.choices[0].text == default.choices[0].text
    assert suffix.usage.model_extra["speculative"]["drafts"] > 0  # suffix's own drafts (this prompt repeats)
    spec_on, spec_off = default.usage.model_extra["speculative"], off.usage.model_extra["speculative"]
    assert spec_on["drafts"] > 0
    assert spec_off == {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "acceptance_rate": 0.0,
                        "mean_accepted_length": 1.0}
    spec_one = one.usage.model_extra["speculative"]
    assert spec_one["draft_tokens"] == spec_one["drafts"] > 0


# ---- errors ----------------------------------------------------------------------------------------------

BAD_PARAMS = [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"temperature": "hot"}, "temperature"),
    ({"n": "two"}, "n"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"logprobs": 50}, "logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream=true
    ({"max_tokenz": 5}, "max_tokenz"),
    ({"speculative": {"num_speculative_tokens": -1}}, "speculative.num_speculative_tokens"),
    ({"speculative": {"enable": False}}, "speculative.enable"),
    ({"speculative": {"method": "bogus"}}, "speculative.method"),  # refused by the engine replica
    ({"speculative": {"method": "draft_model", "num_speculative_tokens": 2}}, "speculative.method"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9}, "min_tokens"),  # above max_tokens
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),  # outside the vocabulary: refused by the engine replica
    ({"stop_token_ids": [99999]}, "stop_token_ids"),  # the same, with a message of the form "name contains ..."
    ({"prompt": ""}, "prompt"),
    ({"prompt": [99999]}, "prompt"),
    ({"prompt": [1.5]}, "prompt"),  # the message names every shape a prompt may have
    ({"priority": 1}, "priority"),  # this engine serves first come, first served: refused by the engine replica
    ({"priority": "high"}, "priority"),
]


@pytest.mark.parametrize("override,param", BAD_PARAMS, ids=[p for _, p in BAD_PARAMS])
def test_bad_parameters_are_400_naming_the_param(server, override, param):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **override}
    status, err = error_of(http_json(server + "/v1/completions", body))
    assert status == 400 and err["type"] == "invalid_request_error"
    assert err["param"] == param and param.split(".")[-1] in err["message"]
    assert "Traceback" not in err["message"] and "Ray" not in err["message"]  # an engine replica's error, unwrapped


@pytest.mark.parametrize("override,param", [({"top_logprobs": 2}, "top_logprobs"), ({"messages": []}, "messages"),
                                            ({"max_completion_tokens": 0}, "max_completion_tokens"),
                                            ({"messages": [{"content": "x"}]}, "messages.0.role")])
def test_bad_chat_parameters(server, override, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **override}
    status, err = error_of(http_json(server + "/v1/chat/completions", body))
    assert (status, err["param"]) == (400, param)


def test_out_of_range_seed_is_400_and_does_not_touch_other_requests(server, client, offline):
    prompt = "Extract the names from: Alice"
    want = offline_greedy(offline, [prompt], 24)[0].outputs[0].text
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True)
    parts = [next(iter(stream)).choices[0].text]
    for seed in (2 ** 70, 2 ** 63, -(2 ** 63) - 1):
        status, err = error_of(http_json(server + "/v1/completions",
                                         {"model": MODEL, "prompt": "x", "max_tokens": 2, "seed": seed}))
        assert (status, err["param"]) == (400, "seed") and "922337203685477580" in err["message"]
    parts += [c.choices[0].text for c in stream]
    assert "".join(parts) == want
    edge = client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=1.0, n=2,
                                     seed=2 ** 63 - 1)  # choice 1's seed is past OpenAI's range
    assert len(edge.choices) == 2


def test_chat_messages_are_checked_in_openai_terms(server):
    url = server + "/v1/chat/completions"
    status, err = error_of(http_json(url, {"messages": [{"role": "user", "content": None}]}))
    assert (status, err["param"]) == (400, "messages.0.content")
    assert "null" in err["message"] and "'user'" in err["message"] and "template" not in err["message"]
    status, err = error_of(http_json(url, {"messages": [{"role": "system", "content": "x"},
                                                        {"role": "wizard", "content": "hi"}]}))
    assert (status, err["param"]) == (400, "messages.1.role")
    assert "'wizard'" in err["message"] and all(r in err["message"] for r in ("user", "assistant", "developer"))
    image = {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}
    status, err = error_of(http_json(url, {"messages": [{"role": "user", "content": [image]}]}))
    assert (status, err["param"]) == (400, "messages")
    assert "reads text only" in err["message"]
    audio = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    status, err = error_of(http_json(url, {"messages": [{"role": "user", "content": [audio]}]}))
    assert (status, err["param"]) == (400, "messages") and "reads text only" in err["message"]
    audio = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
    status, err = error_of(http_json(url, {"messages": [{"role": "user", "content": [audio]}]}))
    assert status == 400 and "input_audio must hold the audio's base64 'data'" in err["message"]
    status, body = http_json(url, {"messages": [{"role": "developer", "content": "Be brief."},
                                                {"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] == 2


def test_feature_parameters_left_off_are_accepted_and_others_named(server):
    url = server + "/v1/chat/completions"
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    # null stands for a parameter's default, as in OpenAI's API (the openai client sends an explicit None so)
    off = {"tools": [], "tool_choice": "none", "parallel_tool_calls": False, "functions": None,
           "response_format": {"type": "text"}, "modalities": ["text"], "service_tier": "auto", "audio": None,
           "n": None, "stream": None, "logprobs": None, "seed": None}
    status, body = http_json(url, {**base, **off})
    assert status == 200 and body["usage"]["completion_tokens"] == 2 and len(body["choices"]) == 1
    assert body["choices"][0]["message"]["tool_calls"] == [] and body["choices"][0]["logprobs"] is None
    status, body = http_json(server + "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": None,
                                                          "stream": None, "echo": None, "logprobs": None,
                                                          "return_token_ids": True})
    assert status == 200 and len(body["choices"]) == 1 and body["usage"]["completion_tokens"] == 2
    choice = body["choices"][0]  # vLLM's return_token_ids: the engine's ids of the prompt and of the output
    assert len(choice["prompt_token_ids"]) == body["usage"]["prompt_tokens"] and len(choice["token_ids"]) == 2
    for name, value, says in (("functions", [{"name": "f"}], "in tools"), ("function_call", "auto", "tool_choice"),
                              ("modalities", ["text", "audio"], "text only"), ("parallel_tool_calls", 1, "boolean"),
                              ("audio", {"voice": "alloy", "format": "wav"}, "no audio output")):
        status, err = error_of(http_json(url, {**base, name: value}))
        assert (status, err["param"]) == (400, name) and says in err["message"], (name, err)


def test_lone_surrogate_is_400(server):
    surrogate = b'"Hi \\ud800 there"'
    for path, body, param in (
            ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": %s}]}', "messages.0.content"),
            ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": %s}]}]}',
             "messages.0.content.0.text"),
            ("/v1/completions", b'{"prompt": %s}', "prompt"),
            ("/v1/completions", b'{"prompt": "x", "stop": [%s]}', "stop.0")):
        status, err = error_of(http_json(server + path, body % surrogate))
        assert (status, err["param"]) == (400, param) and "surrogate" in err["message"], (path, err)


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hello", temperature=-1)
    assert info.value.status_code == 400 and info.value.body["param"] == "temperature"


def test_unknown_model_is_404(server, client):
    status, err = error_of(http_json(server + "/v1/completions", {"model": "gpt-9", "prompt": "x"}))
    assert (status, err["code"], err["param"]) == (404, "model_not_found", "model")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    # OpenAI's retrieve-model route
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    status, err = error_of(http_json(server + "/v1/models/org/gpt-9"))
    assert (status, err["code"]) == (404, "model_not_found")


def test_context_length_exceeded(server):
    long_prompt = "Hello world " * 200
    status, err = error_of(http_json(server + "/v1/completions", {"model": MODEL, "prompt": long_prompt}))
    assert (status, err["code"], err["param"]) == (400, "context_length_exceeded", "prompt")
    status, err = error_of(http_json(server + "/v1/completions",
                                     {"model": MODEL, "prompt": "Hello", "max_tokens": MAX_MODEL_LEN}))
    assert (status, err["code"], err["param"]) == (400, "context_length_exceeded", "max_tokens")
    assert str(MAX_MODEL_LEN) in err["message"]
    status, err = error_of(http_json(server + "/v1/chat/completions",
                                     {"model": MODEL, "messages": [{"role": "user", "content": long_prompt}]}))
    assert (status, err["code"]) == (400, "context_length_exceeded")


def test_malformed_bodies(server):
    status, err = error_of(http_json(server + "/v1/completions", b"{not json"))
    assert status == 400 and "JSON" in err["message"]
    status, err = error_of(http_json(server + "/v1/completions", b"[1, 2]"))
    assert status == 400
    status, err = error_of(http_json(server + "/v1/completions", {"model": MODEL}))
    assert (status, err["param"]) == (400, "prompt")
    status, err = error_of(http_json(server + "/v1/nothing-here"))
    assert status == 404


def test_bad_requests_do_not_disturb_a_running_stream(server, client, offline, start_blocks):
    prompt = "Extract the names from: Alice"
    want = offline_greedy(offline, [prompt], 40)[0].outputs[0].text
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True)
    parts = [next(iter(stream)).choices[0].text]
    for override, _ in BAD_PARAMS[:6]:
        assert http_json(server + "/v1/completions", {"model": MODEL, "prompt": "x", **override})[0] == 400
    parts += [c.choices[0].text for c in stream]
    assert "".join(parts) == want
    assert wait_for_free_blocks(server, start_blocks)["free_blocks"] == start_blocks


# ---- structured outputs ----------------------------------------------------------------------------------

CHAT = [{"role": "user", "content": "Is the sky blue?"}]


def _text(resp: dict) -> str:
    choice = resp["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def _request(endpoint: str, **fields) -> tuple[str, dict]:
    """The URL and body of a greedy request to /v1/completions or /v1/chat/completions with ``fields``."""
    if endpoint == "chat":
        return "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "temperature": 0, **fields}
    return "/v1/completions", {"model": MODEL, "prompt": "Is the sky blue?", "temperature": 0, **fields}


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_response_format_json_schema_output_validates(server, endpoint):
    schema_format = {"type": "json_schema",
                     "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    path, body = _request(endpoint, response_format=schema_format, max_tokens=32, **COMPACT)
    status, resp = http_json(server + path, body)
    assert status == 200, resp
    assert resp["choices"][0]["finish_reason"] == "stop"  # the grammar completed
    jsonschema.validate(json.loads(_text(resp)), ANSWER_SCHEMA)


def test_responses_api_on_the_engine(server, client):
    """/v1/responses on the served engine through the openai client: a text.format JSON schema's answer validates
    and completes; max_output_tokens cuts a free answer ("incomplete"), streamed alike; a stored response continues
    through previous_response_id."""
    text_format = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    resp = client.responses.create(model=MODEL, input=CHAT, temperature=0, text=text_format, max_output_tokens=32,
                                   extra_body=COMPACT)
    assert resp.status == "completed", resp
    jsonschema.validate(json.loads(resp.output_text), ANSWER_SCHEMA)
    cut = client.responses.create(model=MODEL, input="Tell me a story.", temperature=0, max_output_tokens=4)
    assert (cut.status, cut.incomplete_details.reason, cut.usage.output_tokens) == ("incomplete", "max_output_tokens", 4)
    events = list(client.responses.create(model=MODEL, input="Tell me a story.", temperature=0, max_output_tokens=4,
                                          stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == cut.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == cut.output_text
    off = client.responses.create(model=MODEL, input="Tell me a story.", temperature=0, max_output_tokens=4,
                                  extra_body={"speculative": {"enabled": False}})  # per request, as on the chat route
    assert off.output_text == cut.output_text and off.usage.model_extra["speculative"]["drafts"] == 0
    # a stored response continued (previous_response_id) answers as the whole conversation sent in input does
    follow = client.responses.create(model=MODEL, input="And then?", previous_response_id=cut.id, temperature=0,
                                     max_output_tokens=6)
    whole = client.responses.create(model=MODEL, temperature=0, max_output_tokens=6, store=False, input=[
        {"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": cut.output_text},
        {"role": "user", "content": "And then?"}])
    assert follow.previous_response_id == cut.id and follow.output_text == whole.output_text
    assert follow.usage.input_tokens == whole.usage.input_tokens > cut.usage.input_tokens
    assert client.responses.retrieve(cut.id).output_text == cut.output_text


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_response_format_json_object_starts_an_object(server, endpoint):
    path, body = _request(endpoint, response_format={"type": "json_object"}, max_tokens=8)
    status, resp = http_json(server + path, body)
    assert status == 200 and _text(resp).startswith("{"), resp


def test_guided_choice_regex_and_structured_outputs(client):
    choices = ["red", "green", "blue"]
    out = client.completions.create(model=MODEL, prompt="Pick a colour:", max_tokens=16, temperature=0,
                                    extra_body={"guided_choice": choices})
    assert out.choices[0].text in choices and out.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0,
                                          extra_body={"structured_outputs": {"choice": choices}})
    assert chat.choices[0].message.content in choices and chat.choices[0].finish_reason == "stop"
    pattern = r"[0-9]{3}-[a-z]{2}"
    out = client.completions.create(model=MODEL, prompt="A code:", max_tokens=16, temperature=0,
                                    extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, out.choices[0].text) and out.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0, stream=True,
                                            extra_body={"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, "".join(c.choices[0].delta.content or "" for c in stream if c.choices))


def test_invalid_structured_outputs_are_400_and_harm_no_other_request(server, client, offline, start_blocks):
    """A regex, schema or grammar the engine cannot compile is refused at admission: a 400 in OpenAI's shape
    naming the request's own field, while a running stream goes on untouched; the next valid request succeeds."""
    prompt = "Extract the names from: Alice"
    want = offline_greedy(offline, [prompt], 40)[0].outputs[0].text
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True)
    parts = [next(iter(stream)).choices[0].text]
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    for endpoint, fields, param, says in (
            ("completions", {"guided_regex": "(unclosed"}, "guided_regex", "regex"),
            ("chat", {"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "regex"),
            ("chat", {"response_format": bad_schema}, "response_format.json_schema.schema", "nonsense"),
            ("completions", {"guided_grammar": "start: undefined_rule"}, "guided_grammar", "undefined_rule")):
        path, body = _request(endpoint, max_tokens=4, **fields)
        status, err = error_of(http_json(server + path, body))
        assert (status, err["type"], err["param"]) == (400, "invalid_request_error", param), err
        assert err["message"].startswith(param) and says in err["message"], err
        assert "Traceback" not in err["message"] and "Ray" not in err["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"guided_regex": "("})
    assert info.value.body["param"] == "guided_regex"
    parts += [c.choices[0].text for c in stream]
    assert "".join(parts) == want
    out = client.completions.create(model=MODEL, prompt="A code:", max_tokens=16, temperature=0,
                                    extra_body={"guided_regex": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", out.choices[0].text)
    assert wait_for_free_blocks(server, start_blocks)["free_blocks"] == start_blocks


def test_structured_output_parameters_are_checked_in_openai_terms(server):
    schema_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
    for fields, param, says in (
            ({"response_format": schema_format, "guided_regex": "a+"}, "guided_regex", "each constrain"),
            ({"guided_choice": ["a"], "structured_outputs": {"regex": "a"}}, "guided_choice", "each constrain"),
            ({"response_format": {"type": "json_object"}, "guided_json": ANSWER_SCHEMA}, "guided_json",
             "each constrain"),
            ({"response_format": {"type": "xml"}}, "response_format.type", "'json_schema'"),
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
             "response_format.json_schema.schema", "missing"),
            ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "missing"),
            ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
            ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs", "none of"),
            ({"structured_outputs": {"backend": "xgrammar", "regex": "a"}}, "structured_outputs.backend",
             "not a supported"),
            ({"guided_choice": []}, "guided_choice", "non-empty")):
        for endpoint in ("completions", "chat"):
            path, body = _request(endpoint, max_tokens=4, **fields)
            status, err = error_of(http_json(server + path, body))
            assert (status, err["param"]) == (400, param) and says in err["message"], (endpoint, fields, err)


# ---- tool calling ----------------------------------------------------------------------------------------

SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}


def _tool_request(**fields) -> dict:
    return {"model": MODEL, "messages": WEATHER_CHAT, "tools": TOOLS, "temperature": 0, "max_tokens": 64,
            **COMPACT, **fields}


def _calls(message: dict) -> list[dict]:
    return [{"id": c["id"], "type": c["type"], **c["function"]} for c in message["tool_calls"]]


def _check_call(call: dict, names=("get_weather",)) -> None:
    assert call["type"] == "function" and re.fullmatch("chatcmpl-tool-[0-9a-f]{32}", call["id"]), call
    assert call["name"] in names, call
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_named_tool_choice_calls_that_function_with_arguments_following_its_schema(server, client):
    """A named tool choice constrains the output to the function's parameters schema: content null, one call
    whose arguments validate, finish_reason "stop"; the openai client and a stream give the same call."""
    status, resp = http_json(server + "/v1/chat/completions", _tool_request(tool_choice=NAMED))
    assert status == 200, resp
    choice = resp["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
    [call] = _calls(choice["message"])
    _check_call(call)
    out = client.chat.completions.create(model=MODEL, messages=WEATHER_CHAT, tools=TOOLS, tool_choice=NAMED,
                                         temperature=0, max_tokens=64, extra_body=COMPACT)
    message = out.choices[0].message
    assert message.content is None and out.choices[0].finish_reason == "stop"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("get_weather",
                                                                                    call["arguments"])]
    content, calls, finish = streamed_chat(sse_events(server + "/v1/chat/completions",
                                                      _tool_request(tool_choice=NAMED, stream=True)))
    assert (content, finish) == ("", "stop")
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call["arguments"])]
    stream = client.chat.completions.create(model=MODEL, messages=WEATHER_CHAT, tools=TOOLS, tool_choice=NAMED,
                                            temperature=0, max_tokens=64, extra_body=COMPACT, stream=True)
    parts = [part for chunk in stream if chunk.choices for part in chunk.choices[0].delta.tool_calls or []]
    assert parts[0].id.startswith("chatcmpl-tool-") and parts[0].function.name == "get_weather"
    assert "".join(p.function.arguments or "" for p in parts) == call["arguments"]


@pytest.mark.parametrize("parallel", [False, None])
def test_required_tool_choice_makes_calls_of_declared_functions(server, parallel):
    """tool_choice "required": one call or more (one with parallel_tool_calls=false), each naming a declared
    function with arguments following its schema, finish_reason "tool_calls"; streamed, the same calls."""
    fields = {"tool_choice": "required", "max_tokens": 96}
    if parallel is not None:
        fields["parallel_tool_calls"] = parallel
    status, resp = http_json(server + "/v1/chat/completions", _tool_request(**fields))
    assert status == 200, resp
    choice = resp["choices"][0]
    calls = _calls(choice["message"])
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, resp
    assert len(calls) == 1 if parallel is False else len(calls) >= 1
    for call in calls:
        _check_call(call, names=tuple(SCHEMAS))
    assert len({c["id"] for c in calls}) == len(calls)
    content, streamed, finish = streamed_chat(sse_events(server + "/v1/chat/completions",
                                                         _tool_request(stream=True, **fields)))
    assert (content, finish) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c["name"], c["arguments"]) for c in calls]


def test_a_tool_calling_turn_without_content_renders_with_templates_that_read_it(offline):
    """An assistant turn of calls only (content null, as OpenAI returns it, or left out) reaches the template with
    content "" (vLLM's), so a template that reads every message's content renders it; what a template refuses is
    a ValueError naming the messages (not jinja's own error)."""
    from specray import SamplingParams

    reads_content = "{% for m in messages %}[{{ m['role'] + ': ' + m['content'] }}]{% endfor %}"  # as SmolLM2's
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    for turn in ({"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "assistant", "tool_calls": [call]}):
        chat = [{"role": "user", "content": "hi"}, turn, {"role": "tool", "tool_call_id": "call_1", "content": "1"}]
        [out] = offline.chat(chat, greedy, use_tqdm=False, chat_template=reads_content)
        assert out.prompt == "[user: hi][assistant: ][tool: 1]" and len(out.outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="could not be rendered by the chat template: no tools here"):
        offline.chat([{"role": "user", "content": "hi"}], greedy, use_tqdm=False,
                     chat_template="{{ raise_exception('no tools here') }}")


def test_messages_with_tool_calls_and_tool_results_are_accepted(server, client):
    """An assistant turn's tool calls (content null, arguments as JSON text) and the tool's answer render through
    the chat template, for chat completions and /tokenize; arguments that are not a JSON object are a 400."""
    history = WEATHER_CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    status, resp = http_json(server + "/v1/chat/completions",
                             {"model": MODEL, "messages": history, "tools": TOOLS, "tool_choice": "none",
                              "max_tokens": 4})
    assert status == 200 and resp["choices"][0]["message"]["tool_calls"] == [], resp
    out = client.chat.completions.create(model=MODEL, messages=history, max_tokens=4)
    assert out.choices[0].message.content is not None
    status, tokens = http_json(server + "/tokenize", {"model": MODEL, "messages": history, "tools": TOOLS})
    assert status == 200 and tokens["count"] > 0
    broken = [*history[:1], {**history[1], "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": "{oops"}}]}]
    status, err = error_of(http_json(server + "/v1/chat/completions", {"model": MODEL, "messages": broken}))
    assert (status, err["param"]) == (400, "messages.1.tool_calls.0.function.arguments")
    assert "not valid JSON" in err["message"]
    status, err = error_of(http_json(server + "/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "hi", "tool_calls": history[1]["tool_calls"]}]}))
    assert (status, err["param"]) == (400, "messages.0.tool_calls") and "'tool' message" in err["message"]


def test_bad_tool_requests_are_400s_naming_the_field(server, client):
    custom = [{"type": "custom", "custom": {"name": "grep"}}]
    broken = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]
    for fields, param, says in (
            ({"tools": None, "tool_choice": NAMED}, "tool_choice", "needs tools"),
            ({"tools": [], "tool_choice": "required"}, "tool_choice", "needs tools"),
            ({"tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice.function.name",
             "names no function"),
            ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name", "missing"),
            ({"tool_choice": {"type": "allowed_tools", "allowed_tools": {}}}, "tool_choice.type", "name a function"),
            ({"tool_choice": "sometimes"}, "tool_choice", "'required'"),
            ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools.1.function.name", "declared twice"),
            ({"tools": custom, "tool_choice": "required"}, "tools.0.type", "functions only"),
            ({"tool_choice": NAMED, "response_format": {"type": "json_object"}}, "response_format",
             "constrains the output"),
            ({"tool_choice": "required", "guided_regex": "a+"}, "guided_regex", "constrains the output"),
            ({"tool_choice": "auto", "structured_outputs": None}, "tool_choice",
             "--enable-auto-tool-choice --tool-call-parser"),
            ({"structured_outputs": None}, "tool_choice", "the default when tools are given"),  # auto by default
            ({"tools": broken, "tool_choice": {"type": "function", "function": {"name": "f"}}},
             "tools.0.function.parameters", "nonsense")):  # compiled by the engine
        status, err = error_of(http_json(server + "/v1/chat/completions", _tool_request(**fields)))
        assert (status, err["type"], err["param"]) == (400, "invalid_request_error", param), (fields, err)
        assert says in err["message"], (fields, err)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=WEATHER_CHAT, tools=TOOLS, tool_choice="auto")
    assert info.value.body["param"] == "tool_choice" and "--enable-auto-tool-choice" in info.value.body["message"]


def test_llm_chat_passes_tools_to_the_chat_template(offline):
    template = ("{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
                "{% for c in m.tool_calls or [] %}[{{ c.function.name }}({{ c.function.arguments.city }})]"
                "{% endfor %}|{% endfor %}{% for t in tools or [] %}tool {{ t.function.name }}|{% endfor %}")
    messages = WEATHER_CHAT + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]}]
    out = offline.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=template,
                       add_generation_prompt=False, tools=TOOLS)
    assert out[0].prompt == ("user:What is the weather in Paris?|assistant:[get_weather(Rome)]|"
                             "tool get_weather|tool get_time|")


# ---- disconnects, metrics --------------------------------------------------------------------------------

def test_client_disconnect_mid_stream_frees_kv_blocks(server, start_blocks):
    port = int(server.rsplit(":", 1)[1])
    before = http_json_text(server + "/metrics")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": MAX_MODEL_LEN - 8, "temperature": 0,
            "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    assert kv_state(server)["free_blocks"] < start_blocks  # the request holds blocks now
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    state = wait_for_free_blocks(server, start_blocks)
    assert state["free_blocks"] == start_blocks and state["num_queued"] == 0
    cancelled = metric_value(before, "specray_requests_total", status="cancelled") + 1
    deadline = time.monotonic() + 10  # the engine may free the blocks before the front end counts the departure
    while (now := metric_value(http_json_text(server + "/metrics"), "specray_requests_total", status="cancelled")) \
            < cancelled and time.monotonic() < deadline:
        time.sleep(0.1)
    assert now == cancelled


@pytest.mark.parametrize("stream", [True, False])
def test_clients_that_leave_do_not_disturb_the_others(server, offline, start_blocks, stream):
    """Requests arriving together after an idle spell: the first to reach the engine replica opens the ingress's
    output stream that all of them share. Serve cancels a request's handle calls when its client leaves; the
    shared stream must not be one of them, or the requests beside it never finish."""
    from specray.cluster.serve import OUTBOX_IDLE_S

    wait_for_free_blocks(server, start_blocks)
    prompts = LOAD_PROMPTS[:3]
    expected = [o.outputs[0].text for o in offline_greedy(offline, prompts, 24)]
    long = {"model": MODEL, "max_tokens": MAX_MODEL_LEN - 16, "temperature": 0, "ignore_eos": True, "n": 4,
            "stream": stream}  # long enough that their clients leave before they finish
    for _ in range(2):
        time.sleep(OUTBOX_IDLE_S + 0.5)  # the shared stream ends; the next request opens a new one
        results: list = []
        leavers = [threading.Thread(target=_leave_after, args=(server, {**long, "prompt": f"Hello {i}"}, 0.15))
                   for i in range(3)]
        for thread in leavers:  # first, so that one of them opens the shared stream
            thread.start()
        time.sleep(0.05)
        stayers = [post_in_thread(server + "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 24,
                                                               "temperature": 0}, results) for p in prompts]
        for thread in leavers + stayers:
            thread.join(60)
        assert len(results) == len(prompts) and all(status == 200 for status, _ in results), results
        assert sorted(b["choices"][0]["text"] for _, b in results) == sorted(expected)
    assert wait_for_free_blocks(server, start_blocks)["free_blocks"] == start_blocks


def _leave_after(server: str, body: dict, seconds: float) -> None:
    """POST ``body`` and hang up after ``seconds``, whatever came back by then."""
    port = int(server.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=seconds)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    with contextlib.suppress(TimeoutError, OSError, http.client.HTTPException):
        conn.getresponse().read()
    conn.close()


def test_a_client_leaving_is_logged_as_a_departure_not_an_error(caplog):
    """What Serve raises in a request whose client left (on a stream's disconnect check), or whose HTTP proxy died
    under it (Serve shutting down on Ctrl-C), is no server fault: logged as a departure, without a traceback. A
    worker's death is a 503 to retry (the engine restarts its workers)."""
    import logging

    from ray.exceptions import ActorDiedError
    from ray.serve.exceptions import RequestCancelledError

    import specray.cluster.serve  # noqa: F401  (it names Serve's cancellation to the app)
    from specray.cluster.openai_app import to_openai_error
    from specray.errors import RequestFailedError, WorkerDiedError

    with caplog.at_level(logging.INFO, logger="specray.cluster.openai_app"):
        errors = [to_openai_error(RequestCancelledError("r-1")), to_openai_error(ActorDiedError())]
        assert to_openai_error(RuntimeError("a bug")).status == 500
    death = WorkerDiedError("target rank 1 died")
    for raised in (death, RequestFailedError("r-2", death)):  # (the engine fails a running request with it as cause)
        err = to_openai_error(raised)
        assert (err.status, err.code) == (503, "engine_unavailable") and "target rank 1 died" in err.message
    assert [(err.status, err.code) for err in errors] == [(499, "client_closed_request")] * 2
    levels = [(r.levelno, r.getMessage(), r.exc_info) for r in caplog.records]
    assert [(level, exc_info) for level, _, exc_info in levels[:2]] == [(logging.INFO, None)] * 2
    assert all("client left" in message for _, message, _ in levels[:2])
    assert levels[2][0] == logging.ERROR  # an unexpected error still is one


def test_metrics_endpoint(server, client):
    client.completions.create(model=MODEL, prompt="Hello world! How are", max_tokens=16, temperature=0)
    http_json(server + "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1})
    text = http_json_text(server + "/metrics")
    assert metric_value(text, "specray_requests_total", model=MODEL, status="200") >= 1
    assert metric_value(text, "specray_requests_total", status="400") >= 1
    for name in ("specray_time_to_first_token_seconds_count", "specray_time_per_output_token_seconds_count",
                 "specray_e2e_request_latency_seconds_count", "specray_generation_tokens_total",
                 "specray_spec_drafts_total", "specray_spec_draft_tokens_total", "specray_spec_accepted_tokens_total",
                 "specray_kv_blocks_total"):
        assert metric_value(text, name) > 0, name
    assert metric_value(text, "specray_spec_accepted_tokens_per_position_total", position="0") > 0
    assert "specray_num_requests_waiting" in text and "specray_kv_blocks_used" in text
    accepted = metric_value(text, "specray_spec_accepted_tokens_total")
    drafts = metric_value(text, "specray_spec_drafts_total")
    assert metric_value(text, "specray_spec_mean_accepted_length") == pytest.approx(1 + accepted / drafts)
    # every series names its Serve replica (the ingress's, or the engine's), so that with several replicas, whose
    # answers to /metrics alternate, no series seems to reset
    samples = [line for line in text.splitlines() if line.startswith("specray_")]
    assert samples and all('replica="' in line for line in samples), [s for s in samples if 'replica="' not in s]


def test_repeated_prefix_is_reported_cached_in_usage_and_metrics(server, client, offline):
    prompt = "Tell me about the quick brown fox and the lazy dog, slowly, in order. " * 3
    before = metric_value(http_json_text(server + "/metrics"), "specray_prefix_cache_hits_total")
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert n - 16 <= again.usage.prompt_tokens_details.cached_tokens < n  # whole blocks, never the last token
    assert kv_state(server)["cached_blocks"] >= n // 16
    assert again.choices[0].text == first.choices[0].text == offline_greedy(offline, [prompt], 8)[0].outputs[0].text
    text = http_json_text(server + "/metrics")
    assert metric_value(text, "specray_prefix_cache_hits_total") - before >= again.usage.prompt_tokens_details.cached_tokens
    assert metric_value(text, "specray_prefix_cache_queries_total") >= 2 * n
    # another tenant's salt finds nothing of it; the same salt twice does
    salted = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                        extra_body={"cache_salt": "tenant-a"}) for _ in range(2)]
    assert [r.usage.prompt_tokens_details.cached_tokens == 0 for r in salted] == [True, False]
    status, body = http_json(server + "/v1/completions", {"model": MODEL, "prompt": "x", "cache_salt": ""})
    assert status == 400 and body["error"]["param"] == "cache_salt"


def test_engine_state_through_the_deployment_handle(server):
    from ray import serve

    handle = serve.get_app_handle("specray")
    state = handle.engine_state.remote().result(timeout_s=60)
    assert state["total_blocks"] > 0 and set(state) >= {"free_blocks", "num_waiting", "num_running"}


def _engine_replica_actor():
    """The engine deployment's replica actor (Serve names its replica actors in the "serve" namespace)."""
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "serve" and "SpecrayEngine" in a["name"]]
    assert len(names) == 1, names
    return ray.get_actor(names[0], namespace="serve")


def _stream_lines(url: str, body: dict):
    """POST a streaming request; returns the open response and an iterator over its `data:` payloads."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=60)
    payloads = (line.decode().strip()[len("data: "):] for line in resp if line.startswith(b"data: "))
    return resp, payloads


def test_engine_replica_death_gives_openai_errors_a_fast_503_then_recovers(server):
    """Killing the engine replica: an open stream ends with an error event, a request in flight (and its queued
    choices) gets OpenAI error JSON, a request sent right after gets a fast 503, and once Serve has started a new
    replica, requests succeed again."""
    import ray

    long = {"model": MODEL, "prompt": "Hello", "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True,
            "temperature": 0}
    in_flight: list = []  # n=8 with 4 seats per request: 4 choices run, 4 wait their turn
    waiter = threading.Thread(target=lambda: in_flight.append(
        http_json(server + "/v1/completions", {**long, "n": 8, "temperature": 1.0, "seed": 1})))
    waiter.start()
    # the stream starts once the in-flight request's first choices generate: were its thread late, the stream
    # could have been killed alone. Sampled, those choices take a step per token (drafts rarely pass), so two rounds
    # of them outlast the stream's first chunk by far.
    deadline = time.monotonic() + 30
    while kv_state(server)["num_running"] < 4 and not in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not in_flight, in_flight
    resp, payloads = _stream_lines(server + "/v1/completions", {**long, "stream": True})
    with resp:
        first = json.loads(next(payloads))
        assert first["choices"][0]["finish_reason"] is None
        ray.kill(_engine_replica_actor(), no_restart=True)
        rest = list(payloads)
    error = json.loads(rest[-2])["error"]
    assert rest[-1] == "[DONE]" and (error["type"], error["code"]) == ("server_error", "engine_unavailable")
    waiter.join(timeout=60)
    status, err = error_of(in_flight[0])
    assert (status, err["code"]) == (503, "engine_unavailable"), in_flight
    start = time.monotonic()
    status, err = error_of(http_json(server + "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}))
    assert (status, err["type"], err["code"]) == (503, "server_error", "engine_unavailable")
    assert time.monotonic() - start < 2
    assert error_of(http_json(server + "/health"))[0] == 503
    deadline = time.monotonic() + 45
    while http_json(server + "/health")[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.25)
    status, body = http_json(server + "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4})
    assert status == 200 and body["usage"]["completion_tokens"] == 4


def test_stopping_the_server_tells_every_ingress_replica_and_waits_for_them(ray_cluster):
    """``specray serve``'s Ctrl-C path on Ray (``run_server``: ``end_open_requests``, then Serve shuts down): each
    ingress replica's watch (``watch_stop``, one call pending on the app's ``StopSignal``) fires, its server ends
    its open requests (``OpenAIServing.shut_down``: test_openai_app.py checks the 503s and the stream's error
    event), and ``end_open_requests`` returns once every replica has answered; an app without a signal has nothing
    to watch. Here two watches stand in for two replicas' (a replica is a process start: seconds)."""
    import asyncio

    import ray

    from specray.cluster.serve import create_stop_signal, end_open_requests, watch_stop

    class Serving:
        def __init__(self, open_requests: int):
            self.open_requests, self.ended = open_requests, None

        async def shut_down(self, timeout: float) -> int:
            await asyncio.sleep(0.2)  # the replica's handlers answering
            self.ended = self.open_requests
            return self.open_requests

    async def watches(servings):
        await asyncio.gather(*(watch_stop(s, "stopping") for s in servings))

    servings = [Serving(2), Serving(1)]
    stop_signal = create_stop_signal("stopping")
    loop = asyncio.new_event_loop()
    watching = threading.Thread(target=loop.run_until_complete, args=(watches(servings),))
    watching.start()
    assert ray.get(stop_signal.wait_watchers.remote(2, 30.0)) == 2  # (run_server waits so before "serving at")
    assert watching.is_alive() and [s.ended for s in servings] == [None, None]
    start = time.monotonic()
    assert end_open_requests(stop_signal) == (2, 2, 3)
    assert [s.ended for s in servings] == [2, 1] and time.monotonic() - start < 5  # both had answered
    watching.join(timeout=10)
    assert not watching.is_alive()
    loop.close()
    asyncio.run(asyncio.wait_for(watch_stop(Serving(1), "no-such-app"), 10))  # no signal: returns at once


# ---- bench-serve and load --------------------------------------------------------------------------------

def test_bench_serve_library_reports(server):
    from specray.cluster.bench_serve import benchmark, format_report

    summary = benchmark(base_url=server, model=None, prompts=LOAD_PROMPTS[:3], num_requests=6, concurrency=3,
                        max_tokens=8, stream=True)
    assert (summary["completed"], summary["failed"]) == (6, 0)
    assert summary["total_output_tokens"] == 48 and summary["request_throughput"] > 0
    assert summary["ttft_ms"]["p50"] > 0 and summary["tpot_ms"]["p99"] >= summary["tpot_ms"]["p50"]
    report = format_report(summary)
    assert "req/s" in report and "TTFT" in report and "p99" in report
    spec = summary["speculation"]
    assert 0 <= spec["accepted_tokens"] <= spec["draft_tokens"] and set(spec) >= {"drafts", "acceptance_rate"}
    chat = benchmark(base_url=server, model=MODEL, prompts=["Hello"], num_requests=2, request_rate=20.0,
                     max_tokens=4, stream=False, chat=True)
    assert chat["completed"] == 2 and chat["ttft_ms"]["p50"] is None


def test_bench_serve_prints_acceptance_figures(server, capsys):
    from specray.cluster.cli import main

    argv = ["bench-serve", "--base-url", server, "--prompt", "Hello world! How are", "--num-requests", "2",
            "--max-tokens", "24", "--concurrency", "2"]
    assert main([*argv, "--stream"]) == 0
    out = capsys.readouterr().out
    assert "speculation:" in out and "accepted (acceptance rate" in out, out
    assert "prompt tokens" in out and "read from the cache" in out, out
    assert main([*argv, "--json"]) == 0  # non-streaming: the figures come from the response's usage
    spec = json.loads(capsys.readouterr().out)["speculation"]
    assert spec["draft_tokens"] > 0 and spec["acceptance_rate"] == spec["accepted_tokens"] / spec["draft_tokens"]


def _load(server, offline, start_blocks, seconds: float) -> None:
    """LOAD_CLIENTS streaming greedy clients for ``seconds`` while side tasks send bad requests and requests whose
    clients leave early: no request fails, every output equals the offline one, and the KV blocks all come back."""
    from specray.cluster.bench_serve import benchmark

    reference = offline_greedy(offline, LOAD_PROMPTS, LOAD_MAX_TOKENS)
    expected = [(o.outputs[0].text, len(o.outputs[0].token_ids)) for o in reference]
    stop = threading.Event()
    bad_statuses: list[int] = []
    leaving = {"model": MODEL, "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True, "n": 2}

    def send_bad_requests() -> None:
        while not stop.is_set():
            bad_statuses.append(http_json(server + "/v1/completions",
                                           {"model": MODEL, "prompt": "x", "top_p": 0})[0])
            time.sleep(0.2)

    def send_leaving_requests() -> None:
        for i in range(10**6):
            if stop.is_set():
                return
            _leave_after(server, {**leaving, "prompt": f"Leaving {i}", "stream": i % 2 == 0}, 0.05 + 0.1 * (i % 3))
            time.sleep(0.1)

    sides = [threading.Thread(target=f, daemon=True) for f in (send_bad_requests, send_leaving_requests)]
    for side in sides:
        side.start()
    try:
        summary = benchmark(return_outputs=True, base_url=server, model=MODEL, prompts=LOAD_PROMPTS,
                            num_requests=None, duration_s=seconds, concurrency=LOAD_CLIENTS,
                            max_tokens=LOAD_MAX_TOKENS, stream=True)
    finally:
        stop.set()
        for side in sides:
            side.join()
    assert summary["failed"] == 0, summary["errors"]
    assert summary["completed"] >= LOAD_CLIENTS
    mismatches = [(o["prompt_index"], o["text"]) for o in summary["outputs"]
                  if (o["text"], o["output_tokens"]) != expected[o["prompt_index"]]]
    assert not mismatches, mismatches[:3]
    assert bad_statuses and set(bad_statuses) == {400}
    assert wait_for_free_blocks(server, start_blocks)["free_blocks"] == start_blocks


def test_load_short(server, offline, start_blocks):
    _load(server, offline, start_blocks, SHORT_LOAD_SECONDS)


@pytest.mark.slow
@pytest.mark.skipif(LONG_LOAD_SECONDS is None, reason="a soak: set SPECRAY_LOAD_SECONDS=<seconds> to run it")
def test_load_long(server, offline, start_blocks):
    _load(server, offline, start_blocks, float(LONG_LOAD_SECONDS))


# ---- build_app arguments ---------------------------------------------------------------------------------

def test_a_replica_that_cannot_start_fails_the_deploy_with_its_own_error(server, tiny_llama_dir):
    from ray import serve

    from specray.cluster.serve import ServerStartError, build_app, deploy_app

    app = build_app({"model": str(tiny_llama_dir), "max_model_len": 100_000, "num_cpus": 0.1})
    start = time.monotonic()
    try:
        with pytest.raises(ServerStartError, match="max_model_len=100000 exceeds the model's max_position_emb"):
            deploy_app(app, "broken", route_prefix="/broken")
    finally:
        serve.delete("broken")
    assert time.monotonic() - start < 60  # one try, not three


def test_default_model_is_served_under_its_name(smollm2_gguf):
    from specray.cluster.serve import ServeArgs

    parsed = ServeArgs.from_dict({})
    assert parsed.model == str(smollm2_gguf) and parsed.served_model_name == "SmolLM2-135M-Instruct"
    assert ServeArgs.from_dict({"served_model_name": "smol"}).served_model_name == "smol"


def test_build_app_args_accept_serve_cli_strings(tiny_llama_dir):
    from specray.cluster.serve import ServeArgs, replica_resources

    parsed = ServeArgs.from_dict({"model": str(tiny_llama_dir), "max_num_seqs": "4", "spec_method": "null",
                                  "max_queue_len": "none", "num_cpus": "0.25"})
    assert (parsed.engine_args().max_num_seqs, parsed.max_queue_len) == (4, None)
    assert parsed.served_model_name == tiny_llama_dir.name
    assert parsed.engine_args().speculative_config is None
    assert replica_resources(parsed)["num_cpus"] == 0.25
    with pytest.raises(ValueError, match="unknown keys"):
        ServeArgs.from_dict({"model": str(tiny_llama_dir), "modle": "x"})
    with pytest.raises(ValueError, match="max_num_seqs='four' must be an integer"):
        ServeArgs.from_dict({"model": str(tiny_llama_dir), "max_num_seqs": "four"})
    with pytest.raises(ValueError, match="num_replicas=0"):
        ServeArgs.from_dict({"model": str(tiny_llama_dir), "num_replicas": 0})
