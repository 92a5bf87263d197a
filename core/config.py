"""User-facing configuration: :class:`EngineArgs` and the records it holds. Torch-free, and below every other
module: the drafter registry (above) checks a method's options, this module only carries them."""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specray.lora import LoRAConfig
from specray.multimodal import check_media_io_kwargs, check_mm_limits
from specray.sampling_params import check_seed, is_int
from specray.structured_outputs import check_reasoning_parser


def check_keys(what: str, given: Any, known: Any, hint: str = "") -> None:
    """The one unknown-keys check: a ValueError naming the unknown keys, where they were given and the known
    ones."""
    unknown = sorted(set(given) - set(known))
    if unknown:
        close = {key: difflib.get_close_matches(key, list(known), n=1, cutoff=0.75) for key in unknown}
        guess = ", ".join(f"{key!r} -> {match[0]!r}" for key, match in close.items() if match)
        guess = f" (did you mean {guess}?)" if guess else ""
        raise ValueError(f"{what} has unknown keys {unknown}{hint}{guess}; known keys: {sorted(known)}")


def jsonable_fields(cls) -> dict[str, dict[str, Any]]:
    """A dataclass's fields as JSON-able data, ``{name: {"type": "int | None", "default": 5}}``, for servers
    and tools that pass these keys through."""
    out = {}
    for f in dataclasses.fields(cls):
        entry: dict[str, Any] = {"type": str(f.type)}
        if f.default is not dataclasses.MISSING:
            entry["default"] = f.default if _is_jsonable(f.default) else repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            entry["default"] = repr(f.default_factory())
        else:
            entry["required"] = True
        out[f.name] = entry
    return out


def _is_jsonable(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


# TensorRT-LLM's spelling of the draft count, accepted as input only
_COUNT_ALIASES = ("max_draft_len",)


@dataclass(init=False)
class SpeculativeConfig:
    """How to speculate: the keys every method has, and the method's own options.

    ``SpeculativeConfig(method="ngram", num_speculative_tokens=5, prompt_lookup_min=2)``, or the same as a dict
    (:meth:`from_any`). ``num_speculative_tokens`` is the most drafts per step (TensorRT-LLM's ``max_draft_len``
    is accepted for it); with ``adaptive=True`` (default) the engine drafts fewer, or none, per request when the
    measured cost of a verification pass and the request's recent acceptance say more would not pay.
    ``acceptance`` is how drafts are verified: ``"rejection"`` (default, lossless: greedy output is plain greedy
    output, sampled output keeps the target's distribution exactly); ``"typical"``, Medusa's typical acceptance
    (lossy, opt-in, sampled requests only): a draft token x after a position whose target distribution is p is kept
    when p(x) > min(``posterior_threshold``, ``posterior_alpha`` * exp(-H(p))); or ``"relaxed"``, TensorRT-LLM's
    relaxed acceptance for a reasoning model's thinking phase (lossy, opt-in, greedy requests only; TensorRT-LLM's
    ``use_relaxed_acceptance_for_thinking=True`` is accepted for it): after a position inside
    ``begin_thinking_phase_token`` ... ``end_thinking_phase_token`` (default: the tokenizer's ``<think>`` and
    ``</think>``), a draft is kept when it is among the target's ``relaxed_topk`` most likely tokens there and its
    log-probability is within ``relaxed_delta`` of the most likely one's; outside that span, exactly. The other
    requests of each mode are verified exactly.

    Every other key is an option of ``method``, declared next to its drafter class and registered with it in
    ``specray.drafters.registry`` (``options_of`` parses them; an unknown or misplaced key is a ValueError
    naming it, the method and the known keys, raised at the latest when the engine is built). A key given as
    None counts as not given.
    """

    COMMON_KEYS = ("method", "num_speculative_tokens", "adaptive", "acceptance", "posterior_threshold",
                   "posterior_alpha", "relaxed_topk", "relaxed_delta", "begin_thinking_phase_token",
                   "end_thinking_phase_token", "disable_by_batch_size")
    ACCEPTANCE = ("rejection", "typical", "relaxed")

    method: str = "ngram"
    num_speculative_tokens: int = 5
    adaptive: bool = True
    acceptance: str = "rejection"
    posterior_threshold: float = 0.09  # typical acceptance's epsilon (Medusa's default)
    posterior_alpha: float = 0.3  # typical acceptance's delta (Medusa's default: sqrt(posterior_threshold))
    # relaxed acceptance's candidates (TensorRT-LLM's defaults, which keep only the most likely token: strict; its
    # DeepSeek-R1 blog used 10 and 0.6) and the thinking phase's token ids (None: the tokenizer's <think>, </think>)
    relaxed_topk: int = 1
    relaxed_delta: float = 0.0
    begin_thinking_phase_token: int | None = None
    end_thinking_phase_token: int | None = None
    # vLLM's: no drafting in a step while this many requests or more are in the engine, running or waiting (None: the
    # draft policy alone decides)
    disable_by_batch_size: int | None = None
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # the method's own options, as given
    count_given: bool = dataclasses.field(default=True, compare=False, repr=False)  # num_speculative_tokens was given

    def __init__(self, method: str = "ngram", num_speculative_tokens: int | None = None, adaptive: bool = True,
                 options: dict[str, Any] | None = None, acceptance: str = "rejection",
                 posterior_threshold: float | None = None, posterior_alpha: float | None = None,
                 relaxed_topk: int | None = None, relaxed_delta: float | None = None,
                 begin_thinking_phase_token: int | None = None,
                 end_thinking_phase_token: int | None = None, disable_by_batch_size: int | None = None,
                 **method_options: Any):
        if "use_relaxed_acceptance_for_thinking" in method_options:  # TensorRT-LLM's switch for the same thing
            relaxed = method_options.pop("use_relaxed_acceptance_for_thinking")
            if not isinstance(relaxed, bool) or (relaxed and acceptance not in ("rejection", "relaxed")):
                raise ValueError(f"speculative_config.use_relaxed_acceptance_for_thinking={relaxed!r} with acceptance="
                                 f"{acceptance!r}: give acceptance='relaxed' (or the switch as true) only")
            acceptance = "relaxed" if relaxed else acceptance
        aliases = {k: method_options.pop(k) for k in _COUNT_ALIASES if k in method_options}
        given = [v for v in (num_speculative_tokens, *aliases.values()) if v is not None]
        if len(set(given)) > 1:
            raise ValueError(f"speculative_config gives the draft count twice, num_speculative_tokens="
                             f"{num_speculative_tokens!r} and {aliases}; give num_speculative_tokens only")
        # an acceptance mode's settings (None: not given) need that mode
        modes = {"typical": {"posterior_threshold": posterior_threshold, "posterior_alpha": posterior_alpha},
                 "relaxed": {"relaxed_topk": relaxed_topk, "relaxed_delta": relaxed_delta,
                             "begin_thinking_phase_token": begin_thinking_phase_token,
                             "end_thinking_phase_token": end_thinking_phase_token}}
        twice = sorted(set(options or {}) & set(method_options))
        if twice:
            raise ValueError(f"speculative_config gives {twice} both in options and as keys: give each once")
        self.method = method
        self.num_speculative_tokens = given[0] if given else 5
        # not given: the registry may settle it from the method's options (lookahead's whole tree, MTP's modules)
        self.count_given = bool(given)
        self.adaptive = adaptive
        self.acceptance = acceptance
        cls = type(self)  # (its class attributes: the defaults)
        self.posterior_threshold = cls.posterior_threshold if posterior_threshold is None else posterior_threshold
        self.posterior_alpha = cls.posterior_alpha if posterior_alpha is None else posterior_alpha
        self.relaxed_topk = cls.relaxed_topk if relaxed_topk is None else relaxed_topk
        self.relaxed_delta = cls.relaxed_delta if relaxed_delta is None else relaxed_delta
        self.begin_thinking_phase_token, self.end_thinking_phase_token = (begin_thinking_phase_token,
                                                                          end_thinking_phase_token)
        self.disable_by_batch_size = disable_by_batch_size
        merged = {**(options or {}), **method_options}
        self.options = {k: v for k, v in merged.items() if v is not None}
        self._validate()
        for mode, settings in modes.items():  # (valid values: checked above)
            stray = {k: v for k, v in settings.items() if v is not None}
            if stray and acceptance != mode:
                raise ValueError(f"speculative_config gives {stray} with acceptance={acceptance!r}: they set "
                                 f"acceptance={mode!r}'s rule; give acceptance={mode!r} too, or drop them")

    def _validate(self) -> None:
        # the method and its options are checked by the drafter registry (above this module)
        if not isinstance(self.method, str) or not self.method:
            raise ValueError(f"speculative_config.method={self.method!r} must be a drafter's name, e.g. 'ngram'")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens={k!r} must be an int >= 1")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive={self.adaptive!r} must be true or false")
        n = self.disable_by_batch_size
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"speculative_config.disable_by_batch_size={n!r} must be an int >= 1 (no drafting while "
                             "that many requests or more are in the engine) or None")
        if self.acceptance not in self.ACCEPTANCE:
            raise ValueError(f"speculative_config.acceptance={self.acceptance!r} must be one of {list(self.ACCEPTANCE)}"
                             " ('typical' is Medusa's lossy typical acceptance, 'relaxed' TensorRT-LLM's lossy "
                             "relaxed acceptance for the thinking phase)")
        topk = self.relaxed_topk
        if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
            raise ValueError(f"speculative_config.relaxed_topk={topk!r} must be an int >= 1 (1: only the target's "
                             "most likely token, i.e. strict)")
        delta = self.relaxed_delta
        if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0.0 <= delta < float("inf"):
            raise ValueError(f"speculative_config.relaxed_delta={delta!r} must be a number >= 0 (a log-probability "
                             "gap)")
        for name in ("begin_thinking_phase_token", "end_thinking_phase_token"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"speculative_config.{name}={value!r} must be a token id (an int >= 0)")
        tokens = (self.begin_thinking_phase_token, self.end_thinking_phase_token)
        if tokens[0] is not None and tokens[0] == tokens[1]:
            raise ValueError(f"speculative_config.begin_thinking_phase_token and end_thinking_phase_token are both "
                             f"{tokens[0]}: give two different token ids")
        for name, high in (("posterior_threshold", 1.0), ("posterior_alpha", float("inf"))):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < high:
                raise ValueError(f"speculative_config.{name}={value!r} must be a number in [0, {high})")

    @property
    def typical_acceptance(self) -> tuple[float, float] | None:
        """(posterior_threshold, posterior_alpha) when drafts are verified by typical acceptance, else None."""
        return (float(self.posterior_threshold), float(self.posterior_alpha)) if self.acceptance == "typical" else None

    @property
    def relaxed_acceptance(self) -> tuple[int, float] | None:
        """(relaxed_topk, relaxed_delta) when greedy drafts are verified by relaxed acceptance, else None."""
        return (int(self.relaxed_topk), float(self.relaxed_delta)) if self.acceptance == "relaxed" else None

    def to_dict(self) -> dict[str, Any]:
        """The flat, JSON-able form :meth:`from_any` reads back."""
        rule: dict[str, Any] = {}
        if self.acceptance == "typical":
            rule = {"acceptance": "typical", "posterior_threshold": self.posterior_threshold,
                    "posterior_alpha": self.posterior_alpha}
        elif self.acceptance == "relaxed":
            rule = {"acceptance": "relaxed", "relaxed_topk": self.relaxed_topk, "relaxed_delta": self.relaxed_delta}
            phase = ("begin_thinking_phase_token", "end_thinking_phase_token")
            rule.update({name: getattr(self, name) for name in phase if getattr(self, name) is not None})
        if self.disable_by_batch_size is not None:
            rule["disable_by_batch_size"] = self.disable_by_batch_size
        count = {"num_speculative_tokens": self.num_speculative_tokens} if self.count_given else {}
        return {"method": self.method, **count, "adaptive": self.adaptive, **rule, **self.options}

    @classmethod
    def from_any(cls, value: "SpeculativeConfig | dict[str, Any] | None") -> "SpeculativeConfig | None":
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a SpeculativeConfig or a dict, got {type(value).__name__}")
        if any(not isinstance(key, str) for key in value):
            raise ValueError(f"speculative_config keys must be strings, got {sorted(map(repr, value))}")
        return cls(**value)


PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")


@dataclass
class RayPlacement:
    """Where the Ray backend puts its actors. The target's TP ranks share one placement group (one bundle per
    rank, ``strategy`` over nodes); drafter actors are placed on their own, anywhere they fit."""

    # PACK: one node when the ranks fit on one, else several; STRICT_PACK: one node; STRICT_SPREAD: a node each
    strategy: str = "PACK"
    worker_num_cpus: float = 1.0  # per TP rank (fractions are fine; never more than a node has)
    worker_num_gpus: float | None = None  # None: 1 per rank when the cluster has GPUs, else 0
    worker_resources: list[dict[str, float]] | None = None  # extra custom resources, one dict per rank
    drafter_num_cpus: float = 0.5
    drafter_num_gpus: float = 0.0
    drafter_resources: dict[str, float] | None = None  # e.g. {"drafter_node": 0.1} to pin the drafter
    engine_num_cpus: float = 0.1  # the supervisor actor that runs the engine loop
    address: str | None = None  # the Ray cluster to join; None: the running one, else start a local one
    pool_name: str | None = None  # a named shared n-gram pool actor (is_public_pool): replicas share it
    # draft step t+1 while the target verifies step t (assuming step t's drafts are kept): pays when the drafter
    # has hardware of its own; where the two share a few CPU cores they only fight for them
    draft_ahead: bool = False

    def __post_init__(self) -> None:
        if self.strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"ray_placement.strategy={self.strategy!r} is unknown; choose one of "
                             f"{list(PLACEMENT_STRATEGIES)}")
        for name in ("worker_num_cpus", "drafter_num_cpus", "drafter_num_gpus", "engine_num_cpus"):
            if getattr(self, name) < 0:
                raise ValueError(f"ray_placement.{name}={getattr(self, name)} must be >= 0")
        if self.worker_num_gpus is not None and self.worker_num_gpus < 0:
            raise ValueError(f"ray_placement.worker_num_gpus={self.worker_num_gpus} must be >= 0 "
                             "(or None: 1 per rank when the cluster has GPUs)")
        ranks = self.worker_resources
        if ranks is not None and (not isinstance(ranks, (list, tuple)) or not ranks
                                  or not all(_is_resources(r) for r in ranks)):
            raise ValueError(f"ray_placement.worker_resources={ranks!r:.100} must be a list of one dict per target "
                             "rank (tensor_parallel_size x pipeline_parallel_size) of custom resource names to "
                             "amounts >= 0, e.g. [{'node0': 0.01}, {'node1': 0.01}]; the CPUs and GPUs are "
                             "worker_num_cpus / worker_num_gpus")
        if self.drafter_resources is not None and not _is_resources(self.drafter_resources):
            raise ValueError(f"ray_placement.drafter_resources={self.drafter_resources!r:.100} must be a dict of "
                             "custom resource names to amounts >= 0, e.g. {'drafter_node': 0.01}; the CPUs and GPUs "
                             "are drafter_num_cpus / drafter_num_gpus")

    @classmethod
    def from_any(cls, value: "RayPlacement | dict[str, Any] | None") -> "RayPlacement":
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        check_keys("ray_placement", value, {f.name for f in dataclasses.fields(cls)})
        return cls(**value)


def _is_resources(value: Any) -> bool:
    """A dict of custom Ray resources: names (not CPU or GPU, which have options of their own) to amounts >= 0."""
    return isinstance(value, dict) and all(
        isinstance(k, str) and k and k not in ("CPU", "GPU") and isinstance(v, (int, float))
        and not isinstance(v, bool) and v >= 0 for k, v in value.items())


EXECUTOR_BACKENDS = (None, "uni", "ray")


# the dtype a GGUF's conversion is stored in (specray.models.loader): float32 (the default) keeps every dequantized
# value exactly; bfloat16 or float16 halve the disk it takes, each value rounded as loading the model in that dtype
# rounds it anyway
GGUF_DTYPE_ENV = "SPECRAY_GGUF_DTYPE"
GGUF_DTYPES = ("float32", "bfloat16", "float16")
# set (not "0"): 4-bit linears (a GPTQ / AWQ / packed release's, a GGUF's Q4 ones) dequantized to the model's dtype as
# they load on every device, where a GPU would keep them in 4 bits (specray.models.int_quant.keeps_int4): twice the
# memory of bf16's quarter, dense matmuls, which torch's 4-bit kernel trails past a few rows
DEQUANTIZE_INT4_ENV = "SPECRAY_DEQUANTIZE_INT4"

LOAD_FORMATS = ("auto", "dummy")  # vLLM's load_format: the checkpoint's weights, or random ones (none read)
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's scheduling_policy
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's kv_cache_dtype (specray.models.kv_cache)
# vLLM's mamba_ssm_cache_dtype (specray.models.kv_cache.ssm_cache_dtype)
MAMBA_SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's quantization names -> the checkpoint's quantization_config.quant_method they stand for (specray reads the
# method from the checkpoint; the option only confirms it: its Marlin names choose kernels specray does not have)
QUANTIZATIONS = {"awq": "awq", "awq_marlin": "awq", "gptq": "gptq", "gptq_marlin": "gptq",
                 "compressed-tensors": "compressed-tensors", "fp8": "fp8", "mxfp4": "mxfp4",
                 "modelopt": "modelopt", "modelopt_fp4": "modelopt",  # NVIDIA ModelOpt's FP8 and NVFP4 releases
                 "gguf": "specray_gguf"}  # a .gguf model (its 4-bit linears kept, the others dequantized)

# generation_config.json's sampling fields that set requests' defaults (vLLM's set) -> SamplingParams' names
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass
class EngineArgs:
    """The arguments of :class:`specray.LLM` (vLLM's names). Only ``specray.engine.build_engine`` reads this;
    every component gets its own small config from it."""

    model: str
    tokenizer: str | None = None
    speculative_config: SpeculativeConfig | dict | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None
    # most tokens of one request's prefill per step (0: no bound); lets requests behind a long prompt start
    long_prefill_token_threshold: int = 0
    dtype: str = "auto"
    seed: int = 0
    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides the size computed from kv_cache_memory_bytes
    # vLLM's automatic prefix caching: whole KV blocks of earlier requests' tokens are reused by later requests
    # that begin with the same tokens (a shared system prompt, the turns of a chat), which compute only the rest
    enable_prefix_caching: bool = False
    # vLLM's: a reasoning model's thinking phase ("deepseek_r1", "qwen3"); structured outputs govern what follows it
    reasoning_parser: str | None = None
    kv_cache_memory_bytes: int | None = None  # default: 1 GiB on CPU, 80% of free memory on a GPU
    # vLLM's: the share of each GPU's total memory the engine may use, weights included (80% of what is left once
    # the weights are in goes to the KV cache); None: whatever is free. kv_cache_memory_bytes wins; no effect on CPU
    gpu_memory_utilization: float | None = None
    device: str | None = None  # default: cuda when available, else cpu
    tensor_parallel_size: int = 1
    # vLLM's: the decoder layers split into this many consecutive stages, each on tensor_parallel_size ranks of its
    # own (tensor_parallel_size x pipeline_parallel_size ranks in all, across nodes); a step's tokens pass through
    # the stages in turn, and one step is in flight per stage, each over its own max_num_seqs requests
    pipeline_parallel_size: int = 1
    # a mixture-of-experts target's experts split whole over the tensor-parallel ranks (vLLM's name); else each
    # expert is split by width as a dense MLP is
    enable_expert_parallel: bool = False
    distributed_executor_backend: str | None = None  # None: "uni" (this process) at one rank, else "ray"
    ray_placement: RayPlacement | dict | None = None
    num_threads: int | None = None  # torch CPU threads per target rank (None: torch's default)
    # vLLM's name. False: decode and chain-verify steps replay CUDA graphs on a GPU, captured per padded shape
    # (specray.models.step_graphs); True: every step runs eagerly; None: graphs on a GPU, eager elsewhere (a CPU
    # has no graphs to replay: there the padded steps would only add work)
    enforce_eager: bool | None = None
    # vLLM's name: build each step's outputs (detokenizing, stop strings, the reports) while the executor computes
    # the next step, so that host work hides behind a device's; every output comes one step later
    async_scheduling: bool = False
    # vLLM's: a checkpoint whose config or tokenizer class is its own code (auto_map: Kimi K2's tokenizer) may run it
    trust_remote_code: bool = False
    # vLLM's: "auto" reads the checkpoint's weights; "dummy" gives the model random weights and reads none (the folder
    # needs only its config and tokenizer): a model of real shapes for speed and memory measurements
    load_format: str = "auto"
    # vLLM's: "fcfs" (first come, first served) or "priority" (SamplingParams.priority, lowest first, then arrival:
    # who is admitted first, who gets KV blocks first, who gives them back last)
    scheduling_policy: str = "fcfs"
    # vLLM's: where requests' default sampling parameters come from. "auto": the model's generation_config.json
    # (temperature, top_p, top_k, min_p, repetition_penalty; max_new_tokens as max_tokens), for whatever a request
    # leaves unset; "vllm": specray's own defaults; or a folder holding the generation_config.json to read instead.
    # The model's end-of-sequence ids from that file stop generation either way.
    generation_config: str = "auto"
    # vLLM's: those defaults set or replaced, by their generation_config.json names ({"temperature": 0.5})
    override_generation_config: dict[str, Any] | None = None
    # vLLM's multi-LoRA: requests may name LoRA adapters (SamplingParams.lora_request); a step runs at most
    # max_loras of them (a slot each on every rank, of rank at most max_lora_rank), max_cpu_loras kept in host memory
    # vLLM's: attributes of the model's config.json to set once it is read (e.g. {"max_position_embeddings": 65536,
    # "rope_parameters": {...}}); every rank builds the model from the config with them
    hf_overrides: dict[str, Any] | None = None
    # vLLM's: how many images a prompt may hold ({"image": N}; None: any number); {"image": 0} serves a
    # vision-language release's text alone (no vision encoder loaded, images refused)
    limit_mm_per_prompt: dict[str, int] | None = None
    # vLLM's: how media files are read, per kind: {"video": {"num_frames": 16}} takes 16 frames, evenly spaced, from
    # each video file (32 by default); frames given as a list or an array are taken as given
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    # vLLM's: "auto" keeps K/V in the model's dtype; "fp8" (= "fp8_e4m3") or "fp8_e5m2" stores each value in one
    # byte (over the checkpoint's K/V scales, else 1; clamped to the format's range): twice a bf16 cache's tokens in
    # the same memory, at some accuracy
    kv_cache_dtype: str = "auto"
    # vLLM's: the dtype a model's linear-attention and Mamba layers keep their recurrent matrices in between steps:
    # "auto" is the model config's own mamba_ssm_cache_dtype where it has one, else float32; "bfloat16" or "float16"
    # halves the state's memory (more requests fit), at the accuracy of rounding the state once a step
    mamba_ssm_cache_dtype: str = "auto"
    # vLLM's: the checkpoint's quantization method (QUANTIZATIONS), checked against its config.json; None reads it
    # from there (quantized weights load either way: specray.models.int_quant, specray.models.fp8)
    quantization: str | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    _DTYPES = ("auto", "float32", "float16", "bfloat16")
    _DTYPE_ALIASES = {"float": "float32", "half": "float16"}  # vLLM's (torch's names: torch.float, torch.half)

    @classmethod
    def from_dict(cls, kwargs: dict[str, Any]) -> "EngineArgs":
        """From plain data (a server's ``engine_kwargs``, JSON): ``speculative_config`` and ``ray_placement``
        may be dicts. Unknown keys are a ValueError naming them."""
        if not isinstance(kwargs, dict):
            raise ValueError(f"engine arguments must be a dict, got {type(kwargs).__name__}")
        check_keys("engine arguments", kwargs, {f.name for f in dataclasses.fields(cls)})
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-able data that :meth:`from_dict` reads back."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.speculative_config is not None:
            out["speculative_config"] = self.speculative_config.to_dict()
        out["ray_placement"] = dataclasses.asdict(self.ray_placement)
        return out

    @property
    def lora_config(self) -> LoRAConfig | None:
        """The LoRA options as one checked config (None without ``enable_lora``)."""
        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    @property
    def executor_backend(self) -> str:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "ray" if self.world_size > 1 else "uni"

    @property
    def world_size(self) -> int:
        """The target's ranks: tensor-parallel ranks times pipeline stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.from_any(self.speculative_config)
        self.ray_placement = RayPlacement.from_any(self.ray_placement)
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend={self.distributed_executor_backend!r} is unknown; "
                             f"choose one of {list(EXECUTOR_BACKENDS)}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel={self.enable_expert_parallel!r} must be true or false")
        for name in ("enable_prefix_caching", "async_scheduling", "trust_remote_code", "enable_lora"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false")
        check_reasoning_parser(self.reasoning_parser)
        if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager={self.enforce_eager!r} must be true, false or None (graphs on a GPU, "
                             "eager elsewhere)")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
            if value > 1 and self.distributed_executor_backend == "uni":
                raise ValueError(f"{name}={value} needs several processes: use distributed_executor_backend='ray' "
                                 "(or leave it None)")
        ranks = self.ray_placement.worker_resources
        if ranks is not None and len(ranks) != self.world_size:
            raise ValueError(f"ray_placement.worker_resources has {len(ranks)} dicts for {self.world_size} target "
                             f"ranks (tensor_parallel_size={self.tensor_parallel_size} x pipeline_parallel_size="
                             f"{self.pipeline_parallel_size}); give one dict per rank")
        if not self.model:
            raise ValueError("model is required: a local HF folder, a .gguf file, or a hub id")
        if isinstance(self.dtype, str):
            self.dtype = self._DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype not in self._DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; choose one of "
                             f"{list(self._DTYPES) + list(self._DTYPE_ALIASES)} (half: float16, float: float32)")
        if self.device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", str(self.device)):
            raise ValueError(f"device={self.device!r} is not supported; use 'cuda' (or 'cuda:N'), 'cpu', or None "
                             "(cuda when this process sees a GPU, else cpu)")
        check_seed(self.seed)
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={self.load_format!r} must be 'auto' (the checkpoint's weights) or 'dummy' "
                             "(random weights, for speed measurements)")
        if self.hf_overrides is not None and (not isinstance(self.hf_overrides, dict)
                                              or not all(isinstance(k, str) and k for k in self.hf_overrides)):
            raise ValueError(f"hf_overrides={self.hf_overrides!r:.100} must be a dict of config.json attributes, e.g. "
                             "{'max_position_embeddings': 65536}")
        check_mm_limits(self.limit_mm_per_prompt)
        check_media_io_kwargs(self.media_io_kwargs)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} must be one of {list(KV_CACHE_DTYPES)} ('auto': "
                             "the model's dtype; the others store K/V in that FP8 format)")
        if self.mamba_ssm_cache_dtype not in MAMBA_SSM_CACHE_DTYPES:
            raise ValueError(f"mamba_ssm_cache_dtype={self.mamba_ssm_cache_dtype!r} must be one of "
                             f"{list(MAMBA_SSM_CACHE_DTYPES)} ('auto': the model config's, else float32)")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r} is not supported; one of {sorted(QUANTIZATIONS)}, "
                             "or None to read it from the checkpoint's config.json")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r} must be 'fcfs' (first come, first served) "
                             "or 'priority' (SamplingParams.priority, lowest first)")
        self._check_generation_config()
        _ = self.lora_config  # LoRAConfig checks the LoRA options
        for name in ("max_num_seqs", "block_size"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be an int >= 1")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold={self.long_prefill_token_threshold!r} must be an int "
                             ">= 0 (0: no bound)")
        util = self.gpu_memory_utilization
        if util is not None and (isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1):
            raise ValueError(f"gpu_memory_utilization={util!r} must be a number in (0, 1] (the share of each GPU's "
                             "memory the engine may use), or None")
        for name in ("max_model_len", "max_num_batched_tokens", "num_kv_blocks", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(f"{name}={value!r} must be an int >= 1 (or None for the default)")

    def _check_generation_config(self) -> None:
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config={self.generation_config!r} must be 'auto' (the model's "
                             "generation_config.json), 'vllm' (specray's defaults) or a folder holding a "
                             "generation_config.json")
        if self.generation_config not in ("auto", "vllm") and not Path(self.generation_config).expanduser().is_dir():
            raise ValueError(f"generation_config={self.generation_config!r} is not 'auto', 'vllm' or an existing "
                             "folder; pass a folder that holds a generation_config.json")
        override = self.override_generation_config
        if override is None:
            return
        if not isinstance(override, dict):
            raise ValueError(f"override_generation_config={override!r:.100} must be a dict such as "
                             "{'temperature': 0.5}")
        check_keys("override_generation_config", override, GENERATION_CONFIG_FIELDS,
                   " (generation_config.json's names)")
