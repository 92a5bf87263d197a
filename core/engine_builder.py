"""Wires an :class:`LLMEngine` from :class:`EngineArgs`: the one place that reads all the arguments."""

from __future__ import annotations

import logging

import torch

from specray.config import EngineArgs, SpeculativeConfig
from specray.drafters.base import DrafterContext
from specray.drafters.registry import drafter_class
from specray.engine import LLMEngine
from specray.models.loader import load_hf_config, load_model, load_tokenizer
from specray.parallel import TPGroup
from specray.scheduler.draft_policy import DraftLengthPolicy
from specray.scheduler.scheduler import Scheduler, SchedulerConfig
from specray.workers.model_runner import ModelRunner

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30
GPU_KV_CACHE_FRACTION = 0.8


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available here; use device='cpu'")
    return torch.device(device)


def resolve_dtype(dtype: str, hf_config, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cpu":
        return torch.float32
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = getattr(torch, config_dtype, None)
    return config_dtype if config_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def resolve_max_model_len(requested: int | None, hf_config) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds the model's max_position_embeddings={limit}; "
                         f"pass max_model_len <= {limit}")
    return requested


def eos_ids(hf_config, tokenizer) -> frozenset[int]:
    ids = set()
    for source in (getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(source)
    return frozenset(ids)


def num_kv_blocks(args: EngineArgs, model, device: torch.device, max_model_len: int) -> int:
    """Enough blocks for every seat at full length, capped by the KV memory budget."""
    if args.num_kv_blocks is not None:
        return args.num_kv_blocks
    per_block = model.kv_cache_bytes_per_block(args.block_size)
    budget = args.kv_cache_memory_bytes
    if budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * GPU_KV_CACHE_FRACTION)
        else:
            budget = CPU_KV_CACHE_BYTES
    wanted = args.max_num_seqs * (-(-max_model_len // args.block_size) + 1)
    blocks = min(wanted, budget // per_block)
    if blocks < 1:
        raise ValueError(f"kv_cache_memory_bytes={budget} holds no KV block of {per_block} bytes; raise it")
    return blocks


def build_engine(args: EngineArgs) -> LLMEngine:
    if args.tensor_parallel_size != 1 or args.distributed_executor_backend not in (None, "mp", "uni"):
        raise ValueError(
            f"tensor_parallel_size={args.tensor_parallel_size}, distributed_executor_backend="
            f"{args.distributed_executor_backend!r}: this build runs in one process (tensor_parallel_size=1); "
            "the Ray executor is not available yet"
        )
    device = resolve_device(args.device)
    hf_config = load_hf_config(args.model)
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    dtype = resolve_dtype(args.dtype, hf_config, device)
    torch.manual_seed(args.seed)
    model = load_model(args.model, TPGroup.single(), dtype=dtype, device=device)
    max_model_len = resolve_max_model_len(args.max_model_len, hf_config)
    blocks = num_kv_blocks(args, model, device, max_model_len)
    sched_config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens or max(2048, args.max_num_seqs),
        max_model_len=max_model_len,
        block_size=args.block_size,
        num_blocks=blocks,
    )
    logger.info("KV cache: %d blocks of %d tokens (%s)", blocks, args.block_size, dtype)
    runner = ModelRunner(model, blocks, args.block_size, device)
    drafter, policy = build_drafter(args.speculative_config, args, model, tokenizer, max_model_len, device)
    return LLMEngine(Scheduler(sched_config), runner, tokenizer, hf_config.vocab_size, max_model_len,
                     eos_ids(hf_config, tokenizer), drafter, policy)


def build_drafter(spec: SpeculativeConfig | None, args: EngineArgs, model, tokenizer, max_model_len: int,
                  device: torch.device):
    if spec is None:
        return None, None
    ctx = DrafterContext(
        target_model=args.model,
        vocab_size=model.vocab_size,
        max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs,
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        device=str(device),
        seed=args.seed,
        target_tokenizer=tokenizer,
    )
    drafter = drafter_class(spec.method)(spec, ctx)
    return drafter, DraftLengthPolicy(spec.num_speculative_tokens, adaptive=spec.adaptive)
