"""A conversation rendered by a tokenizer's chat template: one place for the offline API (``LLM.chat``) and the
server. Torch-free."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# apply_chat_template's own parameters: chat_template_kwargs (the template's variables) may not set them
TEMPLATE_CALL_PARAMS = frozenset({"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                                  "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                                  "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def check_chat_options(add_generation_prompt: bool, continue_final_message: bool,
                       chat_template_kwargs: dict[str, Any] | None) -> None:
    """ValueError for options that cannot go together: continuing the last message with a generation prompt, or
    template variables that name the template call's own parameters."""
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise ValueError(f"chat_template_kwargs={chat_template_kwargs!r:.80} must be a dict of the chat template's "
                         "variables, such as {'enable_thinking': False}")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message=true continues the last message, so it needs "
                         "add_generation_prompt=false")
    taken = sorted(TEMPLATE_CALL_PARAMS & set(chat_template_kwargs or {}))
    if taken:
        raise ValueError(f"chat_template_kwargs may not set {taken}: they are parameters of the request or of the "
                         "template call itself; give the template's own variables only")


def tool_call_arguments(arguments: Any) -> dict:
    """A tool call's ``arguments`` as chat templates take them, a dict (OpenAI sends JSON text; None or "": no
    arguments). ValueError when they are not a JSON object."""
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            raise ValueError(f"the arguments {arguments!r:.80} are not valid JSON ({err}); give the call's "
                             "arguments as JSON text of an object, such as '{\"city\": \"Paris\"}', or as a "
                             "dict") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"the arguments {arguments!r:.80} are not a JSON object; give the call's arguments as an "
                         "object, such as {\"city\": \"Paris\"}")
    return arguments


def template_messages(messages: list[dict]) -> list[dict]:
    """``messages`` as HF chat templates expect them: an assistant message's ``tool_calls`` carry their
    ``function.arguments`` as a dict, not as JSON text (as vLLM hands them over), and its content, null or left out
    beside its calls (as OpenAI returns such a message and clients send it back), is the empty string the
    templates read (``message.content``). The given dicts are not changed."""
    out = []
    for index, message in enumerate(messages):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(calls, list) and any(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                           for c in calls):
            message = {**message, "tool_calls": [_template_call(index, j, c) for j, c in enumerate(calls)]}
        if calls and message.get("content") is None:
            message = {**message, "content": ""}
        out.append(message)
    return out


# a message's content parts that carry an image: OpenAI's image_url ({"url": ...} or the URL itself) and vLLM's
# image_pil (a PIL image, offline only); a video: vLLM's video_url (a video file's URL); an audio: OpenAI's
# input_audio ({"data": base64, "format": "wav"}) and vLLM's audio_url; by the kind each carries
MEDIA_PARTS = {"image_url": "image", "image_pil": "image", "video_url": "video", "input_audio": "audio",
               "audio_url": "audio"}


def split_media(messages: list[dict]) -> tuple[list[dict], dict[str, list]]:
    """``messages`` with each image (video, audio) content part as the ``{"type": "image"}`` (``"video"``,
    ``"audio"``) part chat templates render their placeholder for, and each kind's items in order (URL strings, or
    PIL images): the prompt's placeholders and its items then pair up in order
    (:func:`specray.multimodal.expand_prompt`). The given dicts are not changed."""
    media: dict[str, list] = {"image": [], "video": [], "audio": []}
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") in MEDIA_PARTS
                                                    for p in content):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in MEDIA_PARTS:
                parts.append(part)
                continue
            media[MEDIA_PARTS[kind]].append(_media_value(part, kind, f"messages[{i}].content[{j}]"))
            parts.append({"type": MEDIA_PARTS[kind]})
        out.append({**message, "content": parts})
    return out, media


def _media_value(part: dict, kind: str, where: str) -> Any:
    """A media content part's item: its URL (an ``input_audio``'s base64 data as a ``data:`` URL), or a PIL image."""
    value = part.get(kind)
    if kind == "input_audio":
        data, form = (value.get("data"), value.get("format")) if isinstance(value, dict) else (None, None)
        if not isinstance(data, str) or not data or not isinstance(form, str) or not form.isalnum():
            raise ValueError(f"{where}.input_audio must hold the audio's base64 'data' and its 'format' (e.g. "
                             "'wav' or 'mp3')")
        return f"data:audio/{form};base64,{data}"
    if kind.endswith("_url"):
        value = value.get("url") if isinstance(value, dict) else value
        if not isinstance(value, str) or not value:
            raise ValueError(f"{where}.{kind} must hold the {MEDIA_PARTS[kind]}'s URL: "
                             f"{{'url': 'data:{MEDIA_PARTS[kind]}/...;base64,...'}} or an http(s) URL")
    elif value is None:
        raise ValueError(f"{where}.image_pil must hold a PIL image")
    return value


def _template_call(index: int, j: int, call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    try:
        arguments = tool_call_arguments(function.get("arguments"))
    except ValueError as err:
        raise ValueError(f"messages[{index}].tool_calls[{j}].function.arguments: {err}") from None
    return {**call, "function": {**function, "arguments": arguments}}


def load_chat_template(template: str | None, field: str = "chat_template") -> str | None:
    """A chat template given as the path of its file (.jinja) or as the template itself (vLLM's
    ``--chat-template``), as its text; a ValueError naming ``field`` when it is neither or does not parse."""
    if template is None:
        return None
    if not isinstance(template, str) or not template.strip():
        raise ValueError(f"{field}={template!r:.80} must be the path of a Jinja chat template file or the template "
                         "itself")
    text = template
    if not any(c in template for c in "{}\n"):  # no Jinja in it: a path
        path = Path(template).expanduser()
        if not path.is_file():
            raise ValueError(f"{field}={template!r} is neither a file nor a Jinja template (it has no {{{{ }}}} or "
                             "{% %}); pass the path of an existing template file, or the template itself")
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"{field}={template!r} cannot be read ({err}); pass a UTF-8 text file") from None
    return check_template_text(text, field)


def check_template_text(text: str, field: str = "chat_template") -> str:
    """``text``, when it parses as a chat template (a ValueError naming ``field`` otherwise)."""
    import jinja2
    from transformers.utils import chat_template_utils

    # transformers' own compiler knows the tags its templates may use ({% generation %}, {% break %})
    compile_template = getattr(chat_template_utils, "_compile_jinja_template",
                               lambda t: jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(t))
    try:
        compile_template(text)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"{field} does not parse as a Jinja template: line {err.lineno}: {err.message}") from None
    return text


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: str | None = None,
                chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict] | None = None,
                documents: list[dict] | None = None) -> str:
    """The prompt text of ``messages``, with the functions ``tools`` (OpenAI's tool dicts) declared to the template
    where given, and ``documents`` (a RAG template's, each a dict such as ``{"title", "text"}``).
    ``continue_final_message``, ``chat_template``, ``tools`` and ``documents`` are passed only when set, so a
    tokenizer without the keyword (an older one) still renders the rest. Tool calls' arguments reach the template as
    dicts (:func:`template_messages`)."""
    check_chat_options(add_generation_prompt, continue_final_message, chat_template_kwargs)
    optional: dict[str, Any] = {"continue_final_message": True} if continue_final_message else {}
    if chat_template is not None:
        optional["chat_template"] = chat_template
    if tools:
        optional["tools"] = tools
    if documents:
        optional["documents"] = documents
    return tokenizer.apply_chat_template(template_messages(messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         **(chat_template_kwargs or {}), **optional)
