"""Tool call parsers (specray.cluster.tool_parsers) on text: whole, and streamed in every split, which must give
what the whole text gives. No Ray, no engine."""

from __future__ import annotations

import json

import pytest

from specray.cluster.tool_parsers import (DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_BEGIN, DS_CALLS_END, DS_SEP,
                                          TOOL_CALL_PARSERS, DeepSeekV3Streamer, HermesStreamer, KimiK2Streamer,
                                          Llama3JsonStreamer, MistralStreamer, ParsedToolCall, PythonicStreamer,
                                          Qwen3CoderStreamer, RequiredArrayStreamer, check_tool_call_parser,
                                          parse_llama3_json, parse_mistral, parse_pythonic, parse_tool_calls,
                                          tool_call_streamer)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {}}'


def call(name: str, **arguments) -> ParsedToolCall:
    return ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False))


def streamed(factory, pieces: list[str]) -> tuple[str, list[ParsedToolCall]]:
    streamer = factory()
    content, calls = "", []
    for piece in pieces:
        c, k = streamer.push(piece)
        content, calls = content + c, calls + k
    c, k = streamer.finish()
    return content + c, calls + k


def assert_every_split_gives_the_whole(factory, text: str) -> tuple[str, list[ParsedToolCall]]:
    """Split at each character position (and one character at a time): the same content and calls as whole."""
    whole = parse_tool_calls(factory(), text)
    for at in range(len(text) + 1):
        assert streamed(factory, [text[:at], text[at:]]) == whole, (text, at)
    assert streamed(factory, list(text)) == whole
    return whole


HERMES_CASES = [
    # several calls, text around and between them
    (f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{TIME}</tool_call> Done.",
     "Let me check.\n\n Done.", [call("get_weather", city="Paris", unit="celsius"), call("get_time")]),
    # calls only
    (f"<tool_call>{TIME}</tool_call>", "", [call("get_time")]),
    # malformed JSON stays in the content, tags and all; the next call still counts
    (f'<tool_call>{{"name": "f", "arguments": {{oops</tool_call>x<tool_call>{TIME}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {oops</tool_call>x', [call("get_time")]),
    # JSON that is not a call (no name; arguments not an object) is content too
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     []),
    # arguments as JSON text, or "parameters", or none
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [call("f", a=1)]),
    ('<tool_call>{"name": "f", "parameters": {"a": "é"}}</tool_call>', "", [call("f", a="é")]),
    ('<tool_call>{"name": "f"}</tool_call>', "", [call("f")]),
    # the output stopped before </tool_call> (a stop string): a complete body is a call, an incomplete one content
    (f"ok <tool_call>{TIME}", "ok ", [call("get_time")]),
    ('ok <tool_call>{"name": "get_ti', 'ok <tool_call>{"name": "get_ti', []),
    # plain text, a lone "<" and a start tag's beginning at the end
    ("No tools needed: 1 < 2.", "No tools needed: 1 < 2.", []),
    ("ends with <tool_c", "ends with <tool_c", []),
]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes(text, content, calls):
    assert assert_every_split_gives_the_whole(HermesStreamer, text) == (content, calls)


def test_hermes_hands_over_each_call_once_it_is_complete():
    streamer = HermesStreamer()
    assert streamer.push("Sure. <tool") == ("Sure. ", [])
    assert streamer.push(f"_call>{TIME}</tool_") == ("", [])
    assert streamer.push("call> and <tool_call>") == (" and ", [call("get_time")])
    assert streamer.finish() == ("<tool_call>", [])  # an empty call at the end is content
    streamer = HermesStreamer()
    assert streamer.push(f"a<tool_call>{TIME}</tool_call>b") == ("ab", [call("get_time")])
    assert streamer.push("<tool_call>{") == ("", [])
    assert streamer.finish() == ("<tool_call>{", [])


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [call("get_weather", city="Paris")]),
    # several, separated by ";", after <|python_tag|> and whitespace; "arguments" is read too
    (' <|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}};',
     "", [call("a", x=1), call("b")]),
    # plain text, and anything that does not parse whole: the whole text is content
    ("The weather is fine.", "The weather is fine.", []),
    ('{"name": "a", "parameters": {"x": 1}} and then text', '{"name": "a", "parameters": {"x": 1}} and then text', []),
    ('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "par',
     '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "par', []),
    ('{"answer": 42}', '{"answer": 42}', []),
    ("<|python_tag|>print('hi')", "<|python_tag|>print('hi')", []),
    ("<|python", "<|python", []),
    ("", "", []),
]


def test_llama3_json_streams_plain_text_at_once_and_holds_calls_to_the_end():
    streamer = Llama3JsonStreamer()
    assert streamer.push("  ") == ("", [])  # blank: not known yet
    assert streamer.push("Hello") == ("  Hello", [])
    assert streamer.push(" world") == (" world", [])
    streamer = Llama3JsonStreamer()
    assert streamer.push('{"name": "a", "parameters": {}}') == ("", [])
    assert streamer.finish() == ("", [call("a")])


MISTRAL_CASES = [
    # before v11: one JSON array after [TOOL_CALLS], content before it
    ('Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
     '"arguments": {}}]', "Checking.", [call("get_weather", city="Paris"), call("get_time")]),
    (' [TOOL_CALLS] [{"name": "f", "parameters": {"a": 1}}] \n', " ", [call("f", a=1)]),
    # v11 and later: name[ARGS]{...}, each call after its own [TOOL_CALLS]
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}', "",
     [call("get_weather", city="Paris"), call("get_time")]),
    ('[TOOL_CALLS]f[ARGS] {"q": "[ARGS] inside"}', "", [call("f", q="[ARGS] inside")]),
    # plain text; and anything after [TOOL_CALLS] that does not parse whole: the whole text is content
    ("No call [TOOL is needed.", "No call [TOOL is needed.", []),
    ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}] and text', '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}] '
     "and text", []),
    ('[TOOL_CALLS][{"name": "f", "argu', '[TOOL_CALLS][{"name": "f", "argu', []),
    ("[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
    ('[TOOL_CALLS]not a name[ARGS]{}', '[TOOL_CALLS]not a name[ARGS]{}', []),
    ('[TOOL_CALLS]f[ARGS][1, 2]', '[TOOL_CALLS]f[ARGS][1, 2]', []),
    ("ends with [TOOL_CA", "ends with [TOOL_CA", []),
]


def test_mistral_streams_content_at_once_and_holds_calls_to_the_end():
    streamer = MistralStreamer()
    assert streamer.push("Let me look [TOOL") == ("Let me look ", [])
    assert streamer.push("_CALLS]get_time[ARGS]") == ("", [])
    assert streamer.push("{}") == ("", [])
    assert streamer.finish() == ("", [call("get_time")])


PYTHONIC_CASES = [
    ('[get_weather(city="Paris", unit=\'celsius\'), get_time()]', "",
     [call("get_weather", city="Paris", unit="celsius"), call("get_time")]),
    # Llama 4's tags kept, whitespace, dotted names, every literal kind (JSON's true/false/null too)
    ('<|python_start|> [tools.search(q="a b", n=-3, w=2.5, on=True, off=false, none=None, xs=[1, (2, 3)], '
     'd={"k": {"v": null}})] <|python_end|>', "",
     [call("tools.search", q="a b", n=-3, w=2.5, on=True, off=False, none=None, xs=[1, [2, 3]], d={"k": {"v": None}})]),
    # plain text and anything not a list of calls with literal keyword arguments: the whole text is content
    ("The answer is 4.", "The answer is 4.", []),
    ("[1] is a footnote.", "[1] is a footnote.", []),
    ("[f(1)]", "[f(1)]", []),  # positional arguments name nothing
    ("[f(x=y)]", "[f(x=y)]", []),  # a name is no literal
    ("[f(x=g())]", "[f(x=g())]", []),  # nor is a call, which is never run
    ("[f(**kw)]", "[f(**kw)]", []),
    ("[f(x=1e999)]", "[f(x=1e999)]", []),  # not finite: no JSON number
    ("[f(x=1), 2]", "[f(x=1), 2]", []),
    ("[]", "[]", []),
    ('[f(x="unclosed)]', '[f(x="unclosed)]', []),
    ("[get_time()] and more", "[get_time()] and more", []),
    ("", "", []),
]


@pytest.mark.parametrize("streamer,parse,text,content,calls", [
    pytest.param(streamer, parse, *case, id=f"{name}-{i}")
    for name, streamer, parse, cases in (("llama3_json", Llama3JsonStreamer, parse_llama3_json, LLAMA_CASES),
                                         ("mistral", MistralStreamer, parse_mistral, MISTRAL_CASES),
                                         ("pythonic", PythonicStreamer, parse_pythonic, PYTHONIC_CASES))
    for i, case in enumerate(cases)])
def test_parsers_of_whole_texts(streamer, parse, text, content, calls):
    """Each parser's cases, whole and streamed in every split alike."""
    assert assert_every_split_gives_the_whole(streamer, text) == (content, calls)
    assert parse(text) == (content, calls)


def test_pythonic_streams_plain_text_at_once_and_holds_calls_to_the_end():
    streamer = PythonicStreamer()
    assert streamer.push(" Sure") == (" Sure", [])
    streamer = PythonicStreamer()
    assert streamer.push("[get_") == ("", [])
    assert streamer.push("time()]") == ("", [])
    assert streamer.finish() == ("", [call("get_time")])


REQUIRED_CASES = [
    ('[{"name": "get_time", "parameters": {}}]', "", [call("get_time")]),
    ('[ {"name":"a","parameters":{"x":1}} , {"name":"b","parameters":{"y":[1,2]}} ]', "",
     [call("a", x=1), call("b", y=[1, 2])]),
    # cut short (max_tokens): the complete items
    ('[{"name":"a","parameters":{"x":1}},{"name":"b","param', "", [call("a", x=1)]),
    # nothing complete: the text is content
    ('[{"name":"a","param', '[{"name":"a","param', []),
    ("not an array", "not an array", []),
]


@pytest.mark.parametrize("text,content,calls", REQUIRED_CASES)
def test_required_array(text, content, calls):
    assert assert_every_split_gives_the_whole(RequiredArrayStreamer, text) == (content, calls)


def test_required_array_hands_over_each_item_as_it_completes():
    streamer = RequiredArrayStreamer()
    assert streamer.push('[{"name": "a", "parameters": {"x": ') == ("", [])
    assert streamer.push('1}}, {"name": "b", ') == ("", [call("a", x=1)])
    assert streamer.push('"parameters": {}}]') == ("", [call("b")])
    assert streamer.finish() == ("", [])


def ds_call(name: str, arguments: str, v31: bool = False) -> str:
    """One DeepSeek call: V3/R1's layout (``function``, the name, fenced JSON) or V3.1's."""
    if v31:
        return f"{DS_CALL_BEGIN}{name}{DS_SEP}{arguments}{DS_CALL_END}"
    return f"{DS_CALL_BEGIN}function{DS_SEP}{name}\n```json\n{arguments}\n```{DS_CALL_END}"


PARIS, OSLO = json.dumps({"city": "Paris"}), json.dumps({"city": "Oslo"})
DEEPSEEK_CASES = [
    # V3 / R1: content, then a section of two calls
    ("Let me look." + DS_CALLS_BEGIN + ds_call("get_weather", PARIS) + "\n" + ds_call("get_time", "{}") + DS_CALLS_END,
     "Let me look.", [call("get_weather", city="Paris"), call("get_time")]),
    # V3.1's layout
    (DS_CALLS_BEGIN + ds_call("get_weather", OSLO, v31=True) + DS_CALLS_END, "", [call("get_weather", city="Oslo")]),
    # stopped inside the section, after a complete call (the end markers are stop tokens for some servers)
    (DS_CALLS_BEGIN + ds_call("get_time", "{}"), "", [call("get_time")]),
    # arguments that are not an object: the section stays content
    (DS_CALLS_BEGIN + ds_call("f", "[1]") + DS_CALLS_END + "x",
     DS_CALLS_BEGIN + ds_call("f", "[1]") + DS_CALLS_END + "x", []),
    ("No calls here.", "No calls here.", []),
]


@pytest.mark.parametrize("text,content,calls", DEEPSEEK_CASES)
def test_deepseek_v3(text, content, calls):
    assert assert_every_split_gives_the_whole(DeepSeekV3Streamer, text) == (content, calls)


def kimi_call(name: str, index: int, arguments: str) -> str:
    return f"<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>{arguments}<|tool_call_end|>"


KIMI_CASES = [
    ("I will check. <|tool_calls_section_begin|>" + kimi_call("get_weather", 0, '{"city": "Paris"}')
     + kimi_call("get_time", 1, "{}") + "<|tool_calls_section_end|>",
     "I will check. ", [call("get_weather", city="Paris"), call("get_time")]),
    ("<|tool_calls_section_begin|>" + kimi_call("f", 0, "{oops") + "<|tool_calls_section_end|>",
     "<|tool_calls_section_begin|>" + kimi_call("f", 0, "{oops") + "<|tool_calls_section_end|>", []),
    ("Plain answer.", "Plain answer.", []),
]


@pytest.mark.parametrize("text,content,calls", KIMI_CASES)
def test_kimi_k2(text, content, calls):
    assert assert_every_split_gives_the_whole(KimiK2Streamer, text) == (content, calls)


QWEN_TOOLS = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "hours": {"type": "array"}, "ratio": {"type": ["number", "null"]}}}}
QWEN_CASES = [
    ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n[1, 2]\n"
     "</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n<parameter=note>\n42\n</parameter>\n</function>\n"
     "</tool_call>",
     "Checking.\n", [ParsedToolCall("get_weather", json.dumps(
         {"city": "New York", "days": 3, "metric": True, "hours": [1, 2], "ratio": 0.5, "note": "42"}))]),
    # a string parameter that looks like a number stays a string; an integer that does not read stays text
    ("<tool_call><function=get_weather><parameter=city>1984</parameter><parameter=days>three</parameter>"
     "</function></tool_call>", "", [ParsedToolCall("get_weather", json.dumps({"city": "1984", "days": "three"}))]),
    # not such a call: content
    ("<tool_call>{\"name\": \"f\"}</tool_call>", "<tool_call>{\"name\": \"f\"}</tool_call>", []),
]


@pytest.mark.parametrize("text,content,calls", QWEN_CASES)
def test_qwen3_coder(text, content, calls):
    assert assert_every_split_gives_the_whole(lambda: Qwen3CoderStreamer(QWEN_TOOLS), text) == (content, calls)
    assert isinstance(tool_call_streamer("qwen3_coder", QWEN_TOOLS), Qwen3CoderStreamer)


def test_registry_and_configuration_errors():
    assert set(TOOL_CALL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "deepseek_v3",
                                      "kimi_k2"}
    assert isinstance(tool_call_streamer("hermes"), HermesStreamer)
    check_tool_call_parser(None)
    check_tool_call_parser("llama3_json", enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser='granite' is not known.*hermes"):
        check_tool_call_parser("granite")
    with pytest.raises(ValueError, match="enable_auto_tool_choice.*needs tool_call_parser"):
        check_tool_call_parser(None, enable_auto_tool_choice=True)
