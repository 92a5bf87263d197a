"""Wires an :class:`LLMEngine` from :class:`EngineArgs`: the one place that reads all the arguments."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from specray.config import (GENERATION_CONFIG_FIELDS, EngineArgs, RayPlacement, SpeculativeConfig,
                            jsonable_fields)
from specray.contract import KVCacheInfo
from specray.drafters import registry
from specray.drafters.base import DrafterContext, prepared, proposes_cheaply
from specray.drafters.router import DrafterRouter
from specray.engine import plugins
from specray.engine.llm_engine import FORCED_DRAFT_LIMIT, LLMEngine
from specray.engine.executor import CacheConfig, executor_class
from specray.lora import AdapterChecker, LoRAConfig
from specray.models.registry import multimodal_classes
from specray.multimodal import MODALITIES, text_only
from specray.models.cpu_kernels import rows_for
from specray.models.layers import max_positions, rope_scaled_positions, set_max_model_len
from specray.parallel import stage_layers
from specray.models.loader import (check_model_path, check_path, check_quantization, load_hf_config, load_tokenizer,
                                   read_config, read_generation_config, resolve_model)
from specray.sampling_params import SamplingParams
from specray.scheduler.draft_policy import DraftLengthPolicy
from specray.scheduler.scheduler import Scheduler, SchedulerConfig
from specray.workers.worker import WorkerConfig

logger = logging.getLogger(__name__)


def resolve_max_model_len(requested: int | None, hf_config) -> int:
    """``requested``, or by default the longest sequence the model serves: its max_position_embeddings, or longer
    where linear, dynamic or YaRN RoPE scaling stretches it (vLLM's derived length); a ValueError past that."""
    positions = max_positions(hf_config)
    stretched = rope_scaled_positions(hf_config)
    limit = max(positions, stretched or 0)
    if requested is None:
        return limit
    if requested > limit:
        scaled = (f" stretched by its rope scaling to {limit}" if limit > positions else "")
        raise ValueError(f"max_model_len={requested} exceeds the model's max_position_embeddings={positions}{scaled}; "
                         f"pass max_model_len <= {limit}")
    return requested


def check_draft_count(spec: SpeculativeConfig | None, max_model_len: int) -> None:
    """A step verifies at most ``num_speculative_tokens`` drafts of one request, all inside its context."""
    if spec is not None and spec.num_speculative_tokens >= max_model_len:
        k, options = spec.num_speculative_tokens, registry.options_of(spec)
        fix = "lower it (a few to a few tens)"
        if getattr(options, "default_draft_count", None) == k:  # maybe not given: a tree's size set it
            if getattr(options, "TREE_SIZED_BY", None):  # a tree of the method's own (lookahead's)
                fix = f"it is method={spec.method!r}'s whole tree of {k} nodes: lower {options.TREE_SIZED_BY}"
            elif getattr(options, "speculative_token_tree", None) is not None:
                fix = f"it is the speculative_token_tree's {k} nodes: give fewer paths, or num_speculative_tokens"
        raise ValueError(f"speculative_config.num_speculative_tokens={k} is not below max_model_len={max_model_len}: "
                         f"a step cannot verify more tokens than the context holds; {fix}")


def generation_config(args: EngineArgs) -> dict[str, Any]:
    """The generation_config.json that ``args`` reads (the model's, or the folder ``generation_config`` names;
    {} when there is none)."""
    own = args.generation_config in ("auto", "vllm")
    return read_generation_config(args.model if own else args.generation_config)


def default_sampling_fields(args: EngineArgs, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a request that leaves a sampling field unset gets (vLLM's ``--generation-config``): the
    generation config's temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (as
    ``max_tokens``), unless ``generation_config`` is "vllm", then ``override_generation_config`` over them; as
    :class:`SamplingParams` keyword arguments. As in vLLM, ``do_sample`` is not read: a temperature given is a
    temperature used. A ValueError when SamplingParams refuses the values."""
    config = generation_config(args) if config is None else config
    fields = {} if args.generation_config == "vllm" else {
        ours: config[theirs] for theirs, ours in GENERATION_CONFIG_FIELDS.items() if config.get(theirs) is not None}
    fields.update({GENERATION_CONFIG_FIELDS[k]: v for k, v in (args.override_generation_config or {}).items()})
    if fields.get("top_k") == -1:  # vLLM's "no top-k"
        fields["top_k"] = 0
    try:
        SamplingParams(**fields)
    except (TypeError, ValueError) as err:
        raise ValueError(f"the default sampling parameters {fields} (from the generation config and "
                         f"override_generation_config) are refused: {err}; set them in override_generation_config, "
                         "or pass generation_config='vllm' to leave the model's out") from None
    return fields


def eos_ids(hf_config, tokenizer, generation: dict[str, Any] | None = None) -> frozenset[int]:
    """Every id that ends a sequence: the model config's, the tokenizer's and the generation config's
    ``eos_token_id`` (an instruction model's end of turn is often only there: Gemma 3's ``<end_of_turn>``)."""
    ids = set()
    sources = (getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None),
               (generation or {}).get("eos_token_id"))
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(source)
    return frozenset(ids)


def check_engine_args(args: EngineArgs) -> None:
    """What :class:`EngineArgs` cannot check on its own (it sits below the drafter registry and the backends):
    the speculation method and its options, and where a split drafter can run. Call before anything starts, so
    a user error is a ValueError here and not an actor's failure."""
    spec = args.speculative_config
    registry.check(spec)
    if spec is None:
        return
    if registry.runs_in_worker(spec.method):  # a draft TP it cannot run, or a head whose heads do not split
        options = registry.options_of(spec)
        if options.splits_over(args.tensor_parallel_size) and getattr(options, "model", None):
            check_head_split(spec.method, options.model, args.tensor_parallel_size)
        lookup_beside_head(spec)  # its combine_with, before the head loads
    tp = registry.tensor_parallel_size(spec)
    if tp > 1 and plugins.find("remote_drafter", args.executor_backend) is None:
        raise ValueError(f"speculative_config.draft_tensor_parallel_size={tp} needs a backend that runs drafters "
                         f"as actors (its ranks are actors), not {args.executor_backend!r}: set "
                         "distributed_executor_backend='ray'")


# A model with linear attention verifies any drafter's drafts in the engine (the lookups', a draft model's, predicted
# outputs, a user's drafter's: chains of at most num_speculative_tokens, which the state keeps pending, and token trees,
# each draft's state following its own path), and these heads' on the worker, chains and trees alike: they read the
# verify pass's hidden rows (an accepted tree path's among them; EAGLE-3, DFlash: the residual streams entering chosen
# layers) and keep K/V of their own (Medusa's and ReDrafter's none), never the recurrent state, and the tree they draft
# is verified as a lookup's is. Gemma 4's assistant (it reads the target's own K/V) is not.
RECURRENT_HEADS = ("mtp", "eagle", "eagle3", "dflash", "medusa", "redrafter")


def max_pending_drafts(spec: SpeculativeConfig | None) -> int:
    """The most drafts one chunk verifies: what a linear-attention layer keeps pending per request."""
    # a grammar's forced tokens are verified as drafts too, with or without a drafter
    return max(FORCED_DRAFT_LIMIT, spec.num_speculative_tokens if spec is not None else 0)


def check_recurrent(args: EngineArgs, hf_config) -> bool:
    """Whether the target keeps a recurrent state per request (linear attention: Qwen3.5, Qwen3-Next; Mamba-2: Bamba,
    Granite 4.0's hybrids, Nemotron-H), with a ValueError for what such a model does not support yet; and a draft
    model of that kind is refused for any target."""
    from specray.models.registry import get_model_class

    spec = args.speculative_config
    draft = getattr(registry.options_of(spec), "model", None) if spec is not None and spec.method == "draft_model" \
        else None
    if draft and getattr(get_model_class(load_hf_config(draft, read_config(draft, args.trust_remote_code))),
                         "recurrent", False):
        raise ValueError(f"speculative_config.model={draft!r} has recurrent layers (linear-attention layers or "
                         "Mamba-2's: a recurrent state per request), which the draft model's runner does not keep: "
                         "pick a draft model with attention layers only, or method='ngram'")
    model_class = get_model_class(hf_config)
    if not getattr(model_class, "recurrent", False) or not model_class.recurrent_layers(hf_config):
        return False
    kind = f"{getattr(hf_config, 'model_type', '?')} (linear attention or Mamba-2: a recurrent state per request)"
    if spec is not None and registry.runs_in_worker(spec.method) and spec.method not in RECURRENT_HEADS:
        raise ValueError(f"speculative_config method={spec.method!r} is not supported for {kind}: use a drafter "
                         "in the engine (ngram, suffix, lookahead, the llama.cpp lookups, draft_model, prediction, "
                         f"your own) or one of {list(RECURRENT_HEADS)} (chains, or trees: use_dynamic_tree, "
                         "speculative_token_tree, medusa_choices, redrafter_num_beams)")
    return True


def check_heads_served(args: EngineArgs, hf_config) -> None:
    """A hidden-state head (a method that runs on the target's worker: EAGLE, MTP, Medusa, ...) is refused for a
    model that hands none its hidden states (its class's ``serves_heads`` False: Hunyuan 4), or only to the heads
    it names (DeepSeek-V4: its MTP module), with a ValueError naming what drafts for it."""
    from specray.models.registry import get_model_class

    spec = args.speculative_config
    served = True if spec is None else getattr(get_model_class(hf_config), "serves_heads", True)
    if served is True or not registry.runs_in_worker(spec.method) or spec.method in (served or ()):
        return
    heads = f"its MTP module (method={served[0]!r}), or " if served else ""
    raise ValueError(f"speculative_config method={spec.method!r} (a head reading the target's hidden states) is "
                     f"not supported for model_type={getattr(hf_config, 'model_type', '?')!r}: use {heads}a drafter "
                     "that needs no hidden states (ngram and its tree options, suffix, lookahead, the llama.cpp "
                     "lookups, draft_model, prediction, or your own)")


def engine_seats(args: EngineArgs) -> int:
    """The requests the engine runs at once: ``max_num_seqs`` per step, and over pipeline stages one step in flight
    per stage, each with a cohort of its own (vLLM's virtual engines), so ``max_num_seqs`` per stage."""
    return args.max_num_seqs * args.pipeline_parallel_size


def check_local_paths(args: EngineArgs) -> None:
    """The tokenizer's and the drafter's model paths exist, when they are local paths, on the machine that is to
    load them (not checked with the other arguments: a cluster's head may not hold the paths its workers mount)."""
    if args.tokenizer is not None:
        check_path(args.tokenizer, "tokenizer")
    spec = args.speculative_config
    options = registry.options_of(spec) if spec is not None else None
    model = getattr(options, "model", None)
    if model:
        check_model_path(model, "speculative_config.model")
    static = getattr(options, "static_cache_path", None)
    if static and not Path(static).expanduser().is_file():
        raise ValueError(f"speculative_config.static_cache_path={str(static)!r} is not a file; pass a static n-gram "
                         "cache built with specray.drafters.ngram_cache.build_static_cache, or leave it out")


def check_model_split(config, tp: int, pp: int = 1) -> None:
    """``tp`` ranks split the model's attention and KV heads, and ``pp`` pipeline stages its decoder layers (at least
    one each): checked before any rank starts."""
    from specray.models.layers import check_heads_split

    check_heads_split(config, tp)
    stage_layers(config.num_hidden_layers, 0, pp)


def check_family_split(config, tp: int, pp: int) -> None:
    """What the model's family itself checks of a split (its class's ``check_split``; Gemma 4: its KV-shared
    layers on their sources' stages), before any rank starts."""
    from specray.models.registry import get_model_class

    cls = get_model_class(config)
    if hasattr(cls, "refuse_stages"):
        cls.refuse_stages(config, pp)
    family_check = getattr(cls, "check_split", None)
    if family_check is not None:
        family_check(config, tp, pp)


def check_model_args(args: EngineArgs, config) -> None:
    """What the model's config alone decides of ``args``, before any rank or actor starts (the engine's builder, the
    Ray-backed ``LLM`` and ``specray serve`` call it): the split over TP ranks and stages, the family's own split
    check, and a hidden-state head for a model that serves none."""
    check_model_split(config, args.tensor_parallel_size, args.pipeline_parallel_size)
    check_family_split(config, args.tensor_parallel_size, args.pipeline_parallel_size)
    check_heads_served(args, config)


def check_head_split(method: str, model: str, tp: int) -> None:
    """A head to split over ``tp`` ranks, in a local folder: its attention heads divide (checked from its config.json
    before any rank starts; a hub id's, as the ranks load it)."""
    from specray.models.draft_head import check_split

    config = Path(model) / "config.json"
    if config.is_file():
        raw = json.loads(config.read_text())
        if "num_attention_heads" in raw:
            check_split(method, raw["num_attention_heads"], raw.get("num_key_value_heads"), tp)


def engine_args_schema() -> dict[str, Any]:
    """Every engine argument as JSON-able data (type, default), with the keys of ``ray_placement`` and of
    ``speculative_config`` (common and per method): what a server passes through as ``engine_kwargs``."""
    schema: dict[str, Any] = jsonable_fields(EngineArgs)
    schema["ray_placement"]["keys"] = jsonable_fields(RayPlacement)
    schema["speculative_config"]["keys"] = registry.options_schema()
    return schema


def serves_images(args: EngineArgs, model_config) -> bool:
    """The checkpoint is a vision-language release whose images we serve, and ``limit_mm_per_prompt`` allows some
    (the encoder's own split check, where it has one, refuses a split it cannot serve: Qwen3-VL's DeepStack)."""
    classes = multimodal_classes(model_config)
    if classes is None or text_only(args.limit_mm_per_prompt):
        return False
    if hasattr(classes[0], "check_split"):
        classes[0].check_split(model_config, args.tensor_parallel_size, args.pipeline_parallel_size)
    return True


def build_engine(args: EngineArgs) -> LLMEngine:
    check_engine_args(args)
    check_local_paths(args)
    resolve_model(args.model, weights=args.load_format != "dummy")  # its weights are there, before any rank starts
    spec = args.speculative_config
    if spec is not None and spec.method == "draft_model":  # a hub id fetched here, its failure named by the option
        resolve_model(registry.options_of(spec).model, weights=False, field="speculative_config.model")
    model_config = read_config(args.model, args.trust_remote_code, args.hf_overrides)
    hf_config = load_hf_config(args.model, model_config)
    check_model_args(args, hf_config)
    recurrent = check_recurrent(args, hf_config)
    check_quantization(args.quantization, model_config, args.model)
    tokenizer = load_tokenizer(args.tokenizer or args.model, args.trust_remote_code)
    max_model_len = resolve_max_model_len(args.max_model_len, hf_config)
    set_max_model_len(model_config, max_model_len)  # what every rank builds from
    check_draft_count(spec, max_model_len)
    generation = generation_config(args)
    default_sampling_fields(args, generation)  # refused defaults fail here, before any worker starts
    in_worker = spec is not None and registry.runs_in_worker(spec.method)
    lora = args.lora_config
    adapters = adapter_checker(lora, hf_config)  # a family without LoRA refuses enable_lora here
    thinking = thinking_tokens(spec, tokenizer, hf_config.vocab_size)
    worker_drafter = (registry.worker_drafter_config(spec, args.model, args.tensor_parallel_size) if in_worker
                      else None)
    images = serves_images(args, model_config)
    # prefix caching with linear attention: a kept state per seat at block boundaries (SchedulerConfig's field)
    snapshots = engine_seats(args) if recurrent and args.enable_prefix_caching else 0
    worker_config = WorkerConfig(args.model, args.dtype, args.device, args.seed, args.block_size,
                                 args.kv_cache_memory_bytes, args.gpu_memory_utilization, args.num_threads,
                                 worker_drafter=worker_drafter,
                                 typical_acceptance=spec.typical_acceptance if spec is not None else None,
                                 relaxed_acceptance=None if thinking is None else (*spec.relaxed_acceptance, *thinking),
                                 enable_expert_parallel=args.enable_expert_parallel, model_config=model_config,
                                 enforce_eager=args.enforce_eager, load_format=args.load_format,
                                 lora=None if lora is None else dataclasses.asdict(lora),
                                 kv_cache_dtype=args.kv_cache_dtype,
                                 mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype, quantization=args.quantization,
                                 pipeline_parallel_size=args.pipeline_parallel_size,
                                 max_num_seqs=engine_seats(args),
                                 max_draft_tokens=max_pending_drafts(spec) if recurrent else 0,
                                 recurrent_snapshots=snapshots, images=images)
    draft_ctx = drafter_context(args, hf_config.vocab_size, tokenizer, max_model_len)  # checked before any actor
    cache = CacheConfig(max_model_len, engine_seats(args), args.block_size, args.num_kv_blocks)
    backend = args.executor_backend
    executor = executor_class(backend)(worker_config, args.tensor_parallel_size, cache, args.ray_placement)
    try:
        drafter, policy, router = build_drafter(args, executor.info, draft_ctx, backend)
    except Exception:
        executor.shutdown()
        raise
    sched_config = SchedulerConfig(
        max_num_seqs=engine_seats(args),
        max_num_batched_tokens=args.max_num_batched_tokens or max(2048, args.max_num_seqs),
        max_model_len=max_model_len,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        block_size=args.block_size,
        num_blocks=executor.num_kv_blocks,
        vocab_size=hf_config.vocab_size,
        worker_draft_steps=spec.num_speculative_tokens if in_worker else 0,
        worker_tree_slots=registry.worker_lookahead_slots(spec) if in_worker else 0,
        worker_writes_kv=not in_worker or registry.worker_writes_kv(spec),
        worker_block_slots=in_worker and registry.worker_block_slots(spec),
        thinking_tokens=thinking,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        max_loras=0 if lora is None else lora.max_loras,
        recurrent_snapshots=snapshots,
    )
    logger.info("KV cache: %d blocks of %d tokens (%s), executor %s, TP=%d, PP=%d", executor.num_kv_blocks,
                args.block_size, executor.info.dtype, backend, args.tensor_parallel_size, args.pipeline_parallel_size)
    pool_tokens = executor.num_kv_blocks * args.block_size
    if pool_tokens < max_model_len:
        logger.warning("the KV cache holds %d tokens, fewer than max_model_len=%d: longer prompts are refused and "
                       "outputs end (length) when the cache is full; raise kv_cache_memory_bytes (or num_kv_blocks) "
                       "or lower max_model_len", pool_tokens, max_model_len)
    engine = LLMEngine(Scheduler(sched_config), executor, tokenizer, hf_config.vocab_size, max_model_len,
                       eos_ids(hf_config, tokenizer, generation), drafter, policy, router,
                       worker_method=spec.method if in_worker else None,
                       worker_trees=in_worker and registry.worker_drafts_trees(spec),
                       worker_tree_shape=registry.worker_tree_shape(spec) if in_worker else None,
                       reasoning_parser=args.reasoning_parser, async_scheduling=args.async_scheduling,
                       disable_by_batch_size=spec.disable_by_batch_size if spec is not None else None,
                       adapters=adapters)
    limits = args.limit_mm_per_prompt or {}
    engine.mm_limits = {kind: limits.get(kind) if images else 0 for kind in MODALITIES}
    try:
        engine.structured.thinking_ids()  # a parser whose tags the tokenizer lacks fails now, not per request
    except ValueError:
        engine.shutdown()
        raise
    return engine


def adapter_checker(lora: LoRAConfig | None, hf_config) -> AdapterChecker:
    """What checks requests' LoRA adapters against the model: the projections that take LoRA, with their shapes, from
    the model built on the meta device (no memory); a ValueError when ``enable_lora`` asks for adapters on a family
    that takes none."""
    import torch

    from specray.models.lora import adapter_shapes
    from specray.models.registry import get_model_class
    from specray.parallel import TPGroup

    if lora is None:
        return AdapterChecker(None, {})
    model_class = get_model_class(hf_config)
    if not model_class.lora_modules:
        raise ValueError(f"enable_lora: LoRA adapters are not applied to {getattr(hf_config, 'model_type', '?')} "
                         "models in specray yet; serve this model without enable_lora")
    with torch.device("meta"):  # the whole model's projections, shapes only (no memory, no weights)
        model = model_class(hf_config, TPGroup.single())
        shapes = adapter_shapes(model)
    return AdapterChecker(lora, shapes, getattr(model, "adapter_module", None))


THINKING_TOKENS = ("<think>", "</think>")  # what reasoning models' tokenizers call the thinking phase's ends


def thinking_tokens(spec: SpeculativeConfig | None, tokenizer, vocab_size: int) -> tuple[int, int] | None:
    """Relaxed acceptance's (begin, end) thinking-phase token ids: the config's, else the tokenizer's
    ``<think>`` and ``</think>``; None unless ``acceptance="relaxed"``. A ValueError when neither names them or
    an id is outside the vocabulary."""
    if spec is None or spec.acceptance != "relaxed":
        return None
    vocab = tokenizer.get_vocab()
    ids = []
    for name, text in zip(("begin_thinking_phase_token", "end_thinking_phase_token"), THINKING_TOKENS):
        given = getattr(spec, name)
        token = vocab.get(text) if given is None else given
        if token is None:
            raise ValueError(f"speculative_config.acceptance='relaxed' relaxes only inside the thinking phase, and "
                             f"this model's tokenizer has no {text!r} token: give speculative_config.{name} (a token "
                             "id)")
        if not 0 <= token < vocab_size:
            raise ValueError(f"speculative_config.{name}={token} is outside the model's vocabulary (size "
                             f"{vocab_size})")
        ids.append(token)
    if ids[0] == ids[1]:
        raise ValueError(f"speculative_config's thinking phase begins and ends with the same token {ids[0]}: give "
                         "begin_thinking_phase_token and end_thinking_phase_token")
    return ids[0], ids[1]


def lookup_beside_head(spec: SpeculativeConfig) -> SpeculativeConfig | None:
    """A hidden-state drafter's ``combine_with``: the lookup drafter's config (None without one); a ValueError
    unless it names a method a request could pick for itself (no model of its own, cheap proposals)."""
    given = registry.options_of(spec).lookup_config(spec.num_speculative_tokens)
    if given is None:
        return None
    try:  # the lookup's own checks, said of combine_with (its keys are not the head's)
        lookup = SpeculativeConfig.from_any(given)
    except ValueError as e:
        raise ValueError(f"speculative_config.combine_with={given!r}: {e}") from e
    if lookup.method not in registry.request_methods():
        raise ValueError(f"speculative_config.combine_with names method {lookup.method!r}; a head can be combined "
                         f"with a lookup drafter only: one of {list(registry.request_methods())}")
    try:
        registry.check(lookup)
    except ValueError as e:
        raise ValueError(f"speculative_config.combine_with={given!r}: {e}") from e
    return lookup


def drafter_context(args: EngineArgs, vocab_size: int, tokenizer, max_model_len: int) -> DrafterContext | None:
    """What the engine's drafter is built from, prepared in this process before any actor starts (a draft model's
    tokenizer and heads are checked here, so a bad one fails at once); :func:`build_drafter` adds the target's
    dtype and device once its workers have them. None without speculation."""
    spec: SpeculativeConfig | None = args.speculative_config
    if spec is None:
        return None
    ctx = DrafterContext(target_model=args.model, vocab_size=vocab_size, max_model_len=max_model_len,
                         max_num_seqs=engine_seats(args), seed=args.seed, block_size=args.block_size,
                         target_tokenizer=tokenizer, enable_prefix_caching=args.enable_prefix_caching,
                         reasoning_parser=args.reasoning_parser, enforce_eager=args.enforce_eager,
                         kv_cache_dtype=args.kv_cache_dtype)
    if registry.runs_in_worker(spec.method):
        return ctx
    return prepared(registry.drafter_class(spec.method), spec, ctx)


def build_drafter(args: EngineArgs, target_info: KVCacheInfo, ctx: DrafterContext | None, backend: str):
    """The engine's drafter, its draft policy, and the router the engine puts in front of the drafter once a
    request picks a method of its own (it builds those drafters here, in the engine's process); all None
    without speculation. ``ctx``: :func:`drafter_context`'s."""
    spec: SpeculativeConfig | None = args.speculative_config
    if spec is None:
        return None, None, None
    ctx = replace(ctx, vocab_size=target_info.vocab_size, dtype=target_info.dtype, device=target_info.device)
    def policy(cheap: bool, count: int = spec.num_speculative_tokens) -> DraftLengthPolicy:
        return DraftLengthPolicy(count, adaptive=spec.adaptive, probe_backoff=0 if cheap else 3,  # probes back off
                                 rows=rows_for(target_info.device, target_info.dtype))  # where proposing runs a model

    if registry.runs_in_worker(spec.method):  # it drafts inside the target's driver rank: nothing to build here
        lookup = lookup_beside_head(spec)  # but a lookup drafter beside it, in this process
        if lookup is None:
            return None, policy(cheap=False), None
        drafter = registry.drafter_class(lookup.method)(lookup, ctx)
        return drafter, policy(False, max(spec.num_speculative_tokens, lookup.num_speculative_tokens)), None
    remote = plugins.find("remote_drafter", backend)  # a backend may run its drafter beside the target's ranks
    if remote is not None:
        drafter = remote(spec, ctx, args.ray_placement)
    else:
        drafter = registry.drafter_class(spec.method)(spec, ctx)
    return drafter, policy(proposes_cheaply(drafter)), DrafterRouter(drafter, spec, ctx)
