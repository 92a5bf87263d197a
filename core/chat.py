"""A conversation rendered by a tokenizer's chat template: one place for the offline API (``LLM.chat``) and the
server. Torch-free."""

from __future__ import annotations

from typing import Any

# apply_chat_template's own parameters: chat_template_kwargs (the template's variables) may not set them
TEMPLATE_CALL_PARAMS = frozenset({"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                                  "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                                  "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def check_chat_options(add_generation_prompt: bool, continue_final_message: bool,
                       chat_template_kwargs: dict[str, Any] | None) -> None:
    """ValueError for options that cannot go together: continuing the last message with a generation prompt, or
    template variables that name the template call's own parameters."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message=true continues the last message, so it needs "
                         "add_generation_prompt=false")
    taken = sorted(TEMPLATE_CALL_PARAMS & set(chat_template_kwargs or {}))
    if taken:
        raise ValueError(f"chat_template_kwargs may not set {taken}: they are parameters of the request or of the "
                         "template call itself; give the template's own variables only")


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: str | None = None,
                chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text of ``messages``. ``continue_final_message`` and ``chat_template`` are passed only when set,
    so a tokenizer without the keyword (an older one) still renders the rest."""
    check_chat_options(add_generation_prompt, continue_final_message, chat_template_kwargs)
    optional = {"continue_final_message": True} if continue_final_message else {}
    if chat_template is not None:
        optional["chat_template"] = chat_template
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **(chat_template_kwargs or {}), **optional)
