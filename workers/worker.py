"""One rank of the target model (a tensor-parallel shard of one pipeline stage), Ray-free: the in-process executor
holds one, the Ray executor wraps one per actor.

A rank joins the torch.distributed group (gloo on CPU, NCCL on GPU), loads only its shard of its stage's weights,
allocates the KV cache for its own heads and layers once the executor has agreed a block count with every rank, and
then executes step plans. Only the driver (the last stage's first tensor-parallel rank) samples and answers.
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from specray.contract import KVCacheInfo, StepPlan, StepResult
from specray.models.interface import CausalLM
from specray.lora import LoRAConfig
from specray.models.kv_cache import bytes_per_block, fp8_format, recurrent_bytes, ssm_cache_dtype, storage_dtype
from specray.models.lora import LoRASlots
from specray.models.loader import load_hf_config, load_image_encoder, load_model, read_config
from specray.models.plain_config import PlainConfig
from specray.parallel import PPGroup, TPGroup
from specray.workers.model_runner import ModelRunner
from specray.models.step_graphs import graphs_wanted, why_eager

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # per rank, unless the engine arguments say otherwise
GPU_KV_CACHE_FRACTION = 0.8  # of the memory left after the weights are loaded (the rest: activations, graphs)
DIST_TIMEOUT_S = 120  # a collective that waits longer than this on a dead peer fails instead of hanging


@dataclass
class WorkerConfig:
    """What every rank needs to build its shard (plain data: it crosses Ray)."""

    model: str
    dtype: str = "auto"
    device: str | None = None  # None: cuda when this process sees a GPU, else cpu
    seed: int = 0
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    # vLLM's: the share of a GPU's total memory this engine may use, weights included (None: all that is free)
    gpu_memory_utilization: float | None = None
    num_threads: int | None = None  # torch CPU threads for this rank
    # a drafter that runs on the driver rank beside the target (hidden-state heads), as plain data
    # (specray.drafters.hidden_state.worker_config); None: none
    worker_drafter: dict | None = None
    # sampled drafts verified by Medusa's typical acceptance, (posterior_threshold, posterior_alpha); None: rejection
    # sampling (lossless)
    typical_acceptance: tuple[float, float] | None = None
    # greedy drafts verified by relaxed acceptance in the thinking phase, (relaxed_topk, relaxed_delta, begin token,
    # end token); None: exactly (specray.tree_verification.RelaxedAcceptance)
    relaxed_acceptance: tuple[int, float, int, int] | None = None
    enable_expert_parallel: bool = False  # a mixture of experts' experts whole per rank (else split by width)
    # the whole checkpoint's config as the engine read it (specray.models.loader.read_config), so a rank needs no
    # transformers; None: the rank reads it
    model_config: PlainConfig | None = None
    # False: decode and chain-verify steps run from graphs (CUDA graphs on a GPU; specray.models.step_graphs);
    # None: graphs on a GPU, eager elsewhere
    enforce_eager: bool | None = None
    load_format: str = "auto"  # "dummy": random weights, none read (specray.models.loader.load_model)
    # LoRA adapters (enable_lora): specray.lora.LoRAConfig's fields; None: none
    lora: dict | None = None
    kv_cache_dtype: str = "auto"  # the target's K/V in the model's dtype, or in an FP8 format (kv_cache_dtype)
    mamba_ssm_cache_dtype: str = "auto"  # the recurrent matrices' dtype (specray.models.kv_cache.ssm_cache_dtype)
    quantization: str | None = None  # vLLM's option: "fp8" over an unquantized checkpoint quantizes it as it loads
    # the decoder layers split into this many stages (global ranks numbered stage by stage, each stage's
    # tensor-parallel ranks consecutive)
    pipeline_parallel_size: int = 1
    # a model with linear-attention layers keeps a recurrent state per running request (the engine's seats), with up
    # to max_draft_tokens drafts of its last verify chunk pending: both sized into the KV cache's memory budget
    max_num_seqs: int = 8
    max_draft_tokens: int = 0
    # with prefix caching, the states it keeps at block boundaries (SchedulerConfig.recurrent_snapshots)
    recurrent_snapshots: int = 0
    images: bool = False  # a vision-language release whose images are served: its encoder on the first stage


def gpu_kv_budget(free: int, total: int, utilization: float | None) -> int:
    """The KV cache's bytes on a GPU with ``free`` of ``total`` bytes free once the weights are loaded:
    ``GPU_KV_CACHE_FRACTION`` of what this engine may still take (the rest is headroom for activations and CUDA
    graphs), which is all that is free, or with ``utilization`` (vLLM's ``gpu_memory_utilization``) that share of
    the total less what is in use already (this engine's weights, other processes). A ValueError when that share
    is used up before the cache."""
    if utilization is None:
        return int(free * GPU_KV_CACHE_FRACTION)
    allowed = utilization * total - (total - free)
    if allowed <= 0:
        gib = 1 << 30
        raise ValueError(f"gpu_memory_utilization={utilization} allows {utilization * total / gib:.2f} GiB of this "
                         f"GPU's {total / gib:.2f} GiB, and {(total - free) / gib:.2f} GiB are in use already (the "
                         "weights and any other process): nothing is left for the KV cache; raise "
                         "gpu_memory_utilization or free the GPU")
    return int(allowed * GPU_KV_CACHE_FRACTION)


def resolve_device(device: str | None) -> torch.device:
    """The device to run on, a GPU's with its index: ``torch.cuda.set_device`` refuses a bare "cuda", and the
    index is the one the process sees (a Ray GPU actor sees only its own GPUs, from 0)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available here; use device='cpu'")
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def resolve_dtype(dtype: str, hf_config, device: torch.device) -> torch.dtype:
    """'auto' is float32 on CPU, else the checkpoint's half type (bfloat16 when it names none)."""
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cpu":
        return torch.float32
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = getattr(torch, config_dtype, None)
    return config_dtype if config_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def join_tp_group(device: torch.device, rank: int, world_size: int, init_method: str | None) -> TPGroup:
    """Join this process's tensor-parallel group (NCCL on a GPU, gloo on CPU); one rank needs none."""
    return join_groups(device, rank, world_size, init_method)[0]


def join_groups(device: torch.device, rank: int, world_size: int, init_method: str | None,
                pp_size: int = 1) -> tuple[TPGroup, PPGroup]:
    """Join the world of ``world_size`` ranks (NCCL on a GPU, gloo on CPU): this rank's tensor-parallel group and
    its place in a pipeline of ``pp_size`` stages (each stage's ranks consecutive). One rank needs no group."""
    assert world_size % pp_size == 0, (world_size, pp_size)
    if world_size == 1:
        return TPGroup.single(), PPGroup.single()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if init_method and "//127." in init_method:  # all ranks on this host: keep gloo on loopback
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # torch.distributed.nn.functional binds ``group=group.WORLD`` defaults when imported; imported after the group
    # exists (transformers does, inside from_pretrained) they pin it for good, so destroy_process_group can never
    # free it and gloo's threads outlive it into interpreter shutdown (where a late one aborts the process).
    import torch.distributed.nn  # noqa: F401
    dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank,
                            timeout=timedelta(seconds=DIST_TIMEOUT_S))
    logger.info("rank %d/%d joined the %s group at %s", rank, world_size, backend, init_method)
    tp_size = world_size // pp_size
    pp = PPGroup.of_rank(rank, tp_size, pp_size)
    if pp_size == 1:
        return TPGroup.from_world(), pp
    tp = TPGroup.single()
    if tp_size > 1:
        for stage in range(pp_size):  # every rank creates every stage's group, in the same order
            group = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)))
            if stage == pp.stage:
                tp = TPGroup(rank - stage * tp_size, tp_size, group)
    return tp, pp


class Worker:
    def __init__(self, config: WorkerConfig, rank: int = 0, world_size: int = 1, init_method: str | None = None):
        self.config = config
        self.rank = rank
        self.device = resolve_device(config.device)
        self.num_threads = config.num_threads or torch.get_num_threads()
        self.bind_thread()
        tp, pp = join_groups(self.device, rank, world_size, init_method, config.pipeline_parallel_size)
        # over pipeline stages, a worker drafter runs on the last stage, which then also holds the token embedding
        self.pp = replace(pp, last_stage_embeds=bool(config.worker_drafter) and pp.size > 1)
        self.world_size = world_size
        self.is_driver = self.pp.is_last and tp.rank == 0  # samples and answers
        model_config = config.model_config or read_config(config.model)
        hf_config = load_hf_config(config.model, model_config)
        self.dtype = resolve_dtype(config.dtype, hf_config, self.device)
        torch.manual_seed(config.seed)
        self.model: CausalLM = load_model(config.model, tp, dtype=self.dtype, device=self.device,
                                          expert_parallel=config.enable_expert_parallel, config=model_config,
                                          load_format=config.load_format, pp=self.pp,
                                          quantization=config.quantization)
        # a vision-language checkpoint's image encoder, on the stage that embeds the prompt (whole on every TP rank)
        self.encoder = (load_image_encoder(config.model, model_config, self.dtype, self.device, config.load_format)
                        if config.images and self.pp.is_first else None)
        # the target layers whose residual stream the drafter reads: every stage hands those among its layers on
        self.aux_layers = (self._drafter_class().aux_layers_of(config.worker_drafter, hf_config)
                           if config.worker_drafter else ())
        self.head = self._load_head(hf_config, tp) if config.worker_drafter and self.pp.is_last else None
        # the adapters' slots, allocated before the KV cache is sized
        self.lora = LoRASlots(self.model, LoRAConfig(**config.lora), self.device) if config.lora else None
        self.runner: ModelRunner | None = None

    def _load_head(self, hf_config, tp: TPGroup):
        """The worker-side drafter's head (see docs/hidden_state_drafters.md). Split over the ranks
        (``worker_drafter["split"]``), every rank holds its share and reads the target's own split embedding and LM
        head. Otherwise it is whole on the driver rank only, and over several ranks it reads the target's embedding
        and LM head gathered whole (:func:`~specray.workers.head_drafter.whole_target`), which every rank takes part
        in."""
        from specray.workers.head_drafter import whole_target

        config = {**self.config.worker_drafter, "expert_parallel": self.config.enable_expert_parallel}
        if tp.size > 1 and config.get("split"):
            return self._drafter_class().load_head(config, self.model, hf_config, tp)
        target = self.model if tp.size == 1 else whole_target(self.model, keep=tp.rank == 0)
        if tp.rank != 0:
            return None
        return self._drafter_class().load_head(config, target, hf_config)

    def _drafter_class(self):
        """The worker drafter's class (``HiddenStateDrafter``, ``MedusaDrafter``): the registry names it in the
        plain-data config as ``"module:Class"``."""
        module, _, name = self.config.worker_drafter["drafter"].partition(":")
        return getattr(importlib.import_module(module), name)

    def bind_thread(self) -> None:
        """Make the calling thread run this rank's work as the constructing one does: the CPU thread count and
        the current CUDA device are per-thread settings (OpenMP, CUDA), so a thread that executes steps calls
        this first."""
        torch.set_num_threads(self.num_threads)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    # ---- KV cache -----------------------------------------------------------------------------------------
    def kv_cache_info(self) -> KVCacheInfo:
        """This rank's bytes per KV block and the bytes it can give the cache."""
        budget = self.config.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                budget = gpu_kv_budget(*torch.cuda.mem_get_info(self.device), self.config.gpu_memory_utilization)
            else:
                budget = CPU_KV_CACHE_BYTES
        target = storage_dtype(self.dtype, fp8_format(self.config.kv_cache_dtype))
        budget -= self._recurrent_bytes(budget)
        per_block = bytes_per_block(self.model.kv_cache_specs(), self.config.block_size, target)
        if self.head is not None:  # a head's cache in the target's format too (Medusa's and ReDrafter's: none)
            per_block += bytes_per_block(self.head.kv_cache_specs(), self.config.block_size, target)
        return KVCacheInfo(bytes_per_block=per_block,
                           budget_bytes=budget, dtype=str(self.dtype).removeprefix("torch."),
                           device=str(self.device), vocab_size=self.model.vocab_size)

    def _recurrent_bytes(self, budget: int) -> int:
        """What the recurrent state of the model's linear-attention layers takes out of the KV budget (0 without
        such layers); a ValueError when it leaves nothing for the paged cache."""
        specs = getattr(self.model, "recurrent_state_specs", lambda: [])()
        if not specs:
            return 0
        need = recurrent_bytes(specs, self.config.max_num_seqs, self.dtype, self.config.max_draft_tokens,
                               self.config.recurrent_snapshots, self._ssm_dtype())
        if need >= budget:
            raise ValueError(f"the recurrent state of {self.config.max_num_seqs} requests (max_num_seqs) takes "
                             f"{need} bytes, and the KV cache's budget is {budget} bytes: lower max_num_seqs or "
                             "raise kv_cache_memory_bytes (gpu_memory_utilization on a GPU)")
        logger.info("recurrent state: %d requests (two slots each), %.1f MiB, matrices in %s",
                    self.config.max_num_seqs, need / (1 << 20), str(self._ssm_dtype()).removeprefix("torch."))
        return need

    def _ssm_dtype(self) -> torch.dtype:
        return ssm_cache_dtype(self.config.mamba_ssm_cache_dtype, getattr(self.model, "config", None))

    def init_cache(self, num_blocks: int) -> None:
        drafter = None
        graphs = self._use_graphs()
        if self.head is not None:  # the driver's and, for a head split over the ranks, every rank's
            config = {**self.config.worker_drafter, "seed": self.config.seed, "driver": self.is_driver,
                      "step_graphs": graphs, "kv_cache_dtype": self.config.kv_cache_dtype}
            drafter = self._drafter_class().build(self.head, config, num_blocks, self.config.block_size)
            assert tuple(drafter.aux_layers) == self.aux_layers, (drafter.aux_layers, self.aux_layers)
        self.runner = ModelRunner(self.model, num_blocks, self.config.block_size, self.device,
                                  is_driver=self.is_driver, drafter=drafter,
                                  typical_acceptance=self.config.typical_acceptance,
                                  relaxed_acceptance=self.config.relaxed_acceptance,
                                  step_graphs=graphs, lora=self.lora, kv_cache_dtype=self.config.kv_cache_dtype,
                                  aux_layers=self.aux_layers, max_num_seqs=self.config.max_num_seqs,
                                  max_draft_tokens=self.config.max_draft_tokens,
                                  recurrent_snapshots=self.config.recurrent_snapshots,
                                  ssm_cache_dtype=self._ssm_dtype(), encoder=self.encoder)

    def _use_graphs(self) -> bool:
        """Whether this rank replays steps from graphs: asked for (enforce_eager=False) or by default on a GPU, and
        possible; if not possible, a log line says why (a warning when they were asked for)."""
        eager = self.config.enforce_eager
        if not graphs_wanted(eager, self.device):
            return False
        reason = why_eager(self.model, self.world_size, asked=eager is False)
        if reason is None and self.pp.size > 1:  # a stage's forward hands its rows on to the next stage mid-step
            reason = f"graphs do not replay pipeline stages (pipeline_parallel_size={self.pp.size})"
        if reason is not None:
            log = logger.warning if eager is False else logger.info
            log("%severy step runs eagerly, as %s", "enforce_eager=False: " if eager is False else "", reason)
        return reason is None

    # ---- steps --------------------------------------------------------------------------------------------
    def execute(self, plan: StepPlan, draft_probs: dict | None = None) -> StepResult | None:
        assert self.runner is not None, "init_cache must run before the first step"
        return self.runner.execute(plan, draft_probs)

    def shutdown(self) -> None:
        """Drop the model (its layers hold the process group) before destroying the group, so that the group is
        freed and gloo's threads are joined now, not left running into interpreter shutdown. (Without a group
        nothing waits on the model's release: a full collection there would only cost time.)"""
        self.runner = self.model = self.head = self.encoder = None
        if dist.is_initialized():
            gc.collect()
            dist.destroy_process_group()
