"""The offline API, shaped like vLLM's: ``LLM(model=..., speculative_config=...).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from jinja2 import TemplateError

from specray.chat import check_chat_options, render_chat, split_media
from specray.config import EngineArgs, check_keys
from specray.engine import plugins
from specray.engine.builder import build_engine, check_engine_args, check_model_args, default_sampling_fields
from specray.lora import LoRARequest
from specray.models.loader import engine_image_processor, read_config
from specray.multimodal import (AUDIO, IMAGE, TEXT_ONLY, VIDEO, MultiModalInputs, check_image_prompt,
                                check_placeholders, expand_prompt, media_of, placeholder_ids)
from specray.outputs import RequestOutput, SpecStats
from specray.sampling_params import SamplingParams, choice_seed
from specray.scheduler.request import check_prompt

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any] | list[int]


class LLM:
    """Keyword arguments are those of :class:`specray.config.EngineArgs`. With ``tensor_parallel_size > 1`` or
    ``distributed_executor_backend="ray"`` the engine runs in a Ray actor that owns the target's TP workers and
    the drafter actors; otherwise everything runs in this process.

    What the engine holds outside this process (Ray actors, placement groups) is released by :meth:`shutdown`, at
    the end of a ``with LLM(...) as llm:`` block, or when the object is garbage collected, whichever comes first."""

    def __init__(self, model: str, **kwargs: Any):
        check_keys("LLM(...)", kwargs, {f.name for f in dataclasses.fields(EngineArgs)} - {"model"})
        self.engine_args = EngineArgs(model=model, **kwargs)
        self._default_sampling = default_sampling_fields(self.engine_args)
        if self._default_sampling:
            logger.info("requests' default sampling parameters come from the model's generation config: %s (pass "
                        "generation_config='vllm' for specray's own)", self._default_sampling)
        if self.engine_args.executor_backend == "ray":
            from specray.models.loader import load_hf_config, load_tokenizer

            check_engine_args(self.engine_args)  # before any actor starts
            trust = self.engine_args.trust_remote_code
            check_model_args(self.engine_args, load_hf_config(model, trust_remote_code=trust))
            client_cls = plugins.lookup("engine_client", self.engine_args.executor_backend)
            self.engine = client_cls(self.engine_args)
            self._tokenizer = load_tokenizer(self.engine_args.tokenizer or model, trust)
        else:
            self.engine = build_engine(self.engine_args)
            self.engine.closed_batches = True  # generate() returns when its whole batch is done
            self._tokenizer = self.engine.tokenizer
        self._image_processor = None  # a vision-language model's (specray.multimodal), built on the first image
        self._placeholder_ids: set[int] | None = None  # the media placeholders' token ids the config names
        # runs once: on shutdown(), on garbage collection, or at exit; holds the engine, never self
        self._release = weakref.finalize(self, _release_engine, self.engine)

    def get_tokenizer(self):
        return self._tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The parameters ``generate`` and ``chat`` use when given none (vLLM's): the model's generation config's
        (``EngineArgs.generation_config``, ``override_generation_config``) over :class:`SamplingParams`'
        defaults. A dict of parameters gets these for the fields it leaves out."""
        return SamplingParams(**self._default_sampling)

    def shutdown(self) -> None:
        """Release the engine: its actors and placement groups (Ray backend), its workers. Idempotent."""
        self._release()

    def _check_open(self) -> None:
        if not self._release.alive:
            raise RuntimeError("this LLM was shut down (shutdown() or the end of its with-block); create a new LLM")

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block (``enable_prefix_caching``), as vLLM's does: later requests compute
        their prompts in full until the cache fills again. False when prefix caching is off."""
        self._check_open()
        return self.engine.reset_prefix_cache()

    @property
    def spec_stats(self) -> SpecStats:
        """Speculation counters over everything this LLM generated."""
        return self.engine.spec_stats

    @property
    def drafter_stats(self) -> dict | None:
        """The drafter's own llama.cpp-style statistics (``#calls``, ``#gen drafts``, ...), when it keeps them."""
        remote = getattr(self.engine, "drafter_stats", None)  # the Ray backend's client asks its engine actor
        if callable(remote):
            return remote()
        stats = getattr(getattr(self.engine, "drafter", None), "stats", None)
        return stats() if callable(stats) else None

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order, each with ``n`` completions (its
        sampling parameters' ``n``; with a seed, completion i draws from ``seed + i``). Prompts are strings,
        token-id prompts ``{"prompt_token_ids": [...]}``, or ``{"prompt": "..."}``; a dict prompt may carry vLLM's
        ``"cache_salt"`` (``SamplingParams.cache_salt``). ``priority`` (vLLM's): one per prompt, for an engine with
        ``scheduling_policy="priority"`` (``SamplingParams.priority``). ``lora_request`` (vLLM's): the LoRA adapter
        every prompt runs with, or one per prompt (None: the base model), for an engine with ``enable_lora``
        (``SamplingParams.lora_request``). All prompts are validated
        before any runs, so a bad one raises ValueError and nothing else is disturbed."""
        self._check_open()
        prompts = _as_list(prompts)
        per_prompt = _params_per_prompt(sampling_params, len(prompts), self._default_sampling)
        if priority is not None:
            if not isinstance(priority, Sequence) or isinstance(priority, str) or len(priority) != len(prompts):
                raise ValueError(f"priority={priority!r:.80} must be a list of one int per prompt ({len(prompts)})")
            per_prompt = [replace(sp, priority=p) for sp, p in zip(per_prompt, priority)]
        if lora_request is not None:
            per_prompt = [replace(sp, lora_request=r) for sp, r in zip(per_prompt, _per_prompt_lora(lora_request,
                                                                                                     len(prompts)))]
        params = [_salted(p, sp) for p, sp in zip(prompts, per_prompt)]
        encoded = [self._encode(p, sp) for p, sp in zip(prompts, params)]
        for (text, ids, _), sp in zip(encoded, params):
            self._validate(ids, sp)
        requests, owner = [], []  # one engine request per completion; owner: its (prompt, completion index)
        for p, ((text, ids, images), sp) in enumerate(zip(encoded, params)):
            for i in range(sp.n):
                requests.append((ids, _choice(sp, i), text, images))
                owner.append((p, i))
        batches = self.engine.run_batch if hasattr(self.engine, "run_batch") else self._run_local
        done: list[list[RequestOutput]] = [[] for _ in prompts]
        bar = _progress(len(prompts)) if use_tqdm else None
        for k, out in batches(requests):
            p, i = owner[k]
            out.outputs[0].index = i
            done[p].append(out)
            if bar is not None and len(done[p]) == params[p].n:
                bar.update(1)
        if bar is not None:
            bar.close()
        return [_one_output(outs) for outs in done]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
             use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template: str | None = None,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of messages) or to several;
        ``continue_final_message`` (with ``add_generation_prompt=False``) continues the last message instead of
        closing it; ``chat_template_kwargs`` go to the template as variables (e.g. Qwen3's ``enable_thinking``);
        ``tools`` (OpenAI's ``{"type": "function", "function": {...}}`` dicts) go to the template, which declares them
        to the model (vLLM's ``LLM.chat(tools=...)``; reading calls out of the output is the caller's)."""
        check_chat_options(add_generation_prompt, continue_final_message, chat_template_kwargs)
        conversations = _conversations(messages)
        conversations, media = zip(*map(split_media, conversations)) if conversations else ((), ())
        conversations = [_text_joined(conversation) for conversation in conversations]
        tokenizer = self.get_tokenizer()
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; pass chat_template=... or use generate()")
        try:
            prompts = [render_chat(tokenizer, conv, add_generation_prompt, continue_final_message, chat_template,
                                   chat_template_kwargs, tools) for conv in conversations]
        except TemplateError as err:  # what the template itself refuses (raise_exception) or cannot read
            raise ValueError(f"messages could not be rendered by the chat template: {err}; check the messages' "
                             "roles and fields") from None
        return self.generate([{"prompt": p, "add_special_tokens": False,
                               **({"multi_modal_data": items} if any(items.values()) else {})}
                              for p, items in zip(prompts, media)], sampling_params, use_tqdm,
                             lora_request=lora_request)

    def _encode(self, prompt: PromptType, params: SamplingParams
                ) -> tuple[str | None, list[int], MultiModalInputs | None]:
        """(its text, the token ids the request runs on, its images, videos and audios) of one prompt."""
        text, ids = self._tokens(prompt)
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        media = {} if data is None else media_of(data)
        if not any(media.values()):
            if not self._placeholders().isdisjoint(ids) and self._processor() is not None:
                check_placeholders(ids, self._image_processor)  # no placeholder without its image
            return text, params.prompt_tokens(ids), None
        if self._processor() is None:
            raise ValueError(TEXT_ONLY)
        ids, mm = expand_prompt(ids, media[IMAGE], self._image_processor, media[VIDEO], media[AUDIO])
        check_image_prompt(mm, ids, params.truncate_prompt_tokens)
        return text, ids, mm

    def _processor(self):
        """The model's image processor (None: it takes no images, videos or audio), built on first use."""
        if self._image_processor is None:
            self._image_processor = engine_image_processor(self.engine_args)
            if self._image_processor is not None:  # its placeholders, whether the config names them or not
                self._placeholders().update(placeholder_ids(self._image_processor))
        return self._image_processor

    def _placeholders(self) -> set[int]:
        """The token ids of the model's media placeholders: those its config names, and its processor's once built
        (a prompt without media holding none of them needs no processor)."""
        if self._placeholder_ids is None:
            args = self.engine_args
            self._placeholder_ids = placeholder_ids(read_config(args.model, args.trust_remote_code, args.hf_overrides))
        return self._placeholder_ids

    def _tokens(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.get_tokenizer().encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__iter__"):
                raise ValueError(f"prompt_token_ids={ids!r:.80} must be a list of token ids (ints); a text prompt goes "
                                 "in {'prompt': str}")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and "prompt" in prompt:
            text = prompt["prompt"]
            return text, self.get_tokenizer().encode(text, add_special_tokens=prompt.get("add_special_tokens", True))
        raise ValueError(f"prompt {prompt!r:.80} is not a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}")

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        check_prompt(ids, self.engine.max_model_len, self.engine.vocab_size)
        params.check(self.engine.vocab_size)

    def _run_local(self, requests: list) -> Iterator[tuple[int, RequestOutput]]:
        """Add every request (all or none), then step until each has finished, yielding them as they do. Whatever
        ends the call early (an error, Ctrl-C, a caller that stops reading) aborts the requests still in flight:
        none is left taking seats and KV blocks from later calls."""
        index: dict[str, int] = {}
        try:
            for ids, params, text, images in requests:
                index[self.engine.add_request(ids, params, prompt=text, multimodal=images)] = len(index)
            while index:
                for out in self.engine.step():
                    if out.finished and out.request_id in index:
                        yield index.pop(out.request_id), out
        finally:
            if index:
                self.engine.abort_request(list(index))


def _release_engine(engine) -> None:
    """Shut down the engine client (Ray backend); the in-process engine holds nothing outside this process."""
    if hasattr(engine, "shutdown"):
        engine.shutdown()


def _per_prompt_lora(lora_request, count: int) -> list:
    if isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    if (not isinstance(lora_request, Sequence) or isinstance(lora_request, str) or len(lora_request) != count
            or any(r is not None and not isinstance(r, LoRARequest) for r in lora_request)):
        raise ValueError(f"lora_request={lora_request!r:.100} must be a LoRARequest, or a list of one LoRARequest (or "
                         f"None) per prompt ({count})")
    return list(lora_request)


def _salted(prompt, params: SamplingParams) -> SamplingParams:
    """A dict prompt's ``cache_salt`` (where vLLM takes it) moved into its sampling parameters."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    return params if salt is None else replace(params, cache_salt=salt)


def _as_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, Iterable):
        raise ValueError(f"prompts={prompts!r:.80} is not a prompt or a list of prompts: pass a string, "
                         "{'prompt': str}, {'prompt_token_ids': [...]}, a list of token ids, or a list of these")
    prompts = list(prompts)
    if prompts and all(_token_ids(p) for p in prompts):  # a token-id prompt
        return [{"prompt_token_ids": prompts}]
    # vLLM's batch of token-id prompts, a list of lists of ints, beside strings and dicts
    return [{"prompt_token_ids": list(p)} if isinstance(p, (list, tuple)) and p and all(_token_ids(t) for t in p)
            else p for p in prompts]


def _token_ids(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _params_per_prompt(sampling_params, n: int, defaults: dict[str, Any]) -> list[SamplingParams]:
    """One SamplingParams per prompt, from one (a SamplingParams or a dict of its fields) or one per prompt;
    ``defaults`` fill what None or a dict leaves out."""
    if sampling_params is None:
        return [SamplingParams(**defaults) for _ in range(n)]
    if isinstance(sampling_params, (SamplingParams, dict, str, bytes)) or not isinstance(sampling_params, Iterable):
        return [_as_params(sampling_params, defaults)] * n
    sampling_params = [_as_params(sp, defaults) for sp in sampling_params]
    if len(sampling_params) != n:
        raise ValueError(f"got {len(sampling_params)} sampling_params for {n} prompts; pass one, or one per prompt")
    return sampling_params


def _as_params(value: Any, defaults: dict[str, Any]) -> SamplingParams:
    if isinstance(value, SamplingParams):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"sampling_params must be a SamplingParams, a dict of its fields, or a list of them (one "
                         f"per prompt), got {type(value).__name__}")
    check_keys("sampling_params", value, {f.name for f in dataclasses.fields(SamplingParams)})
    return SamplingParams(**{**defaults, **value})


def _choice(params: SamplingParams, index: int) -> SamplingParams:
    """Completion ``index``'s own copy of a prompt's parameters: one sequence, its own seed, reported only when it
    finishes (all ``generate`` hands back); the prompt's logprobs are computed by the first completion only."""
    seed = None if params.seed is None else choice_seed(params.seed, index)
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return replace(params, n=1, seed=seed, output_kind="final_only", prompt_logprobs=prompt_logprobs)


def _one_output(outs: list[RequestOutput]) -> RequestOutput:
    """One prompt's output from its completions' (each an engine request of its own), in completion order."""
    if len(outs) == 1:
        return outs[0]
    outs = sorted(outs, key=lambda o: o.outputs[0].index)
    stats = SpecStats()
    for out in outs:
        stats.merge(out.spec_stats)
    first = outs[0]
    failed = next((o for o in outs if o.error is not None), None)
    return RequestOutput(first.request_id, first.prompt, first.prompt_token_ids, [o.outputs[0] for o in outs],
                         finished=True, spec_stats=stats, error=failed and failed.error,
                         prompt_logprobs=first.prompt_logprobs, num_cached_tokens=first.num_cached_tokens,
                         refused=failed is not None and failed.refused)


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Generating", unit="req")


def _conversations(messages) -> list:
    """``LLM.chat``'s ``messages``: one conversation (a list of message dicts) or several (a list of them, maybe
    none); a ValueError for anything else (a string, a list of strings), which the chat template would misread."""
    def conversation(c) -> bool:
        return isinstance(c, (list, tuple)) and bool(c) and all(isinstance(m, dict) for m in c)

    if conversation(messages):
        return [messages]
    if isinstance(messages, (list, tuple)) and all(conversation(c) for c in messages):
        return list(messages)
    raise ValueError(f"messages={messages!r:.80} must be a conversation, a list of message dicts such as "
                     "[{'role': 'user', 'content': 'Hello'}], or a list of such conversations")


def _text_joined(messages: list[dict]) -> list[dict]:
    """The messages with a content of text parts alone as one string, as the server hands them to the chat template
    (and vLLM's ``LLM.chat``; templates read a string); a ValueError for a content that is neither a string, a list
    of parts nor None, or for a part that is neither text (with its string) nor an image, a video or an audio: a
    chat template would otherwise render its placeholder with nothing behind it."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"messages[{i}].content={content!r:.50} must be a string or a list of content parts "
                             "such as [{'type': 'text', 'text': 'Hello'}]")
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{i}].content[{j}] is a text part without its text: send {{'type': "
                                 "'text', 'text': '...'}")
            if kind not in ("text", IMAGE, VIDEO, AUDIO):
                raise ValueError(f"messages[{i}].content[{j}] of type {kind!r} is not supported: the served models "
                                 "read text and (multimodal releases) images, videos and audio; send {'type': "
                                 "'text', 'text': ...}, {'type': 'image_url', 'image_url': {'url': ...}}, {'type': "
                                 "'video_url', 'video_url': {'url': ...}} or {'type': 'input_audio', 'input_audio': "
                                 "{'data': ..., 'format': 'wav'}} parts, or a string")
        if isinstance(content, list) and all(part["type"] == "text" for part in content):
            message = {**message, "content": "".join(part["text"] for part in content)}
        out.append(message)
    return out
