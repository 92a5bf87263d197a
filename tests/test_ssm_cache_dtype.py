"""vLLM's ``mamba_ssm_cache_dtype``: the recurrent matrices of linear-attention and Mamba layers kept in a half type
between steps (the math stays float32; what is stored is rounded). "auto" is the model config's own field
(Nemotron-H's) where it has one, else float32."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specray.config import MAMBA_SSM_CACHE_DTYPES, EngineArgs
from specray.models.kv_cache import SSM_CACHE_DTYPES, recurrent_bytes, ssm_cache_dtype
from specray_test_hybrid_models import (  # tests/hybrid_models.py
    NGRAM, TOL, Stepper, generate, greedy, hf_logits, ours, save, tokens)


def test_names_and_sizes(tmp_path):
    """"auto" reads the model config's field, else float32; the engine's names are the module's; a bad name is a
    ValueError naming the field; a half type's state takes half the matrices' bytes in the budget."""
    assert set(MAMBA_SSM_CACHE_DTYPES) == {"auto", *SSM_CACHE_DTYPES}
    assert ssm_cache_dtype("auto") is torch.float32
    assert ssm_cache_dtype("auto", SimpleNamespace(mamba_ssm_cache_dtype="bfloat16")) is torch.bfloat16
    assert ssm_cache_dtype("float32", SimpleNamespace(mamba_ssm_cache_dtype="bfloat16")) is torch.float32
    assert ssm_cache_dtype("float16") is torch.float16
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype='fp8' must be 'auto' or one of"):
        ssm_cache_dtype("fp8")
    with pytest.raises(ValueError, match="the model config's mamba_ssm_cache_dtype='int8'"):
        ssm_cache_dtype("auto", SimpleNamespace(mamba_ssm_cache_dtype="int8"))
    with pytest.raises(ValueError, match=r"mamba_ssm_cache_dtype='fp8' must be one of \['auto'"):
        EngineArgs(model=str(tmp_path), mamba_ssm_cache_dtype="fp8")
    model, _ = ours(tmp_path, "qwen3_5")
    specs = model.recurrent_state_specs()
    matrices = sum(s.num_heads * s.key_dim * s.value_dim for s in specs) * (2 * 3 + 1)  # 3 requests' 2 slots + 1
    full = recurrent_bytes(specs, 3, torch.float32, 4)
    assert full - recurrent_bytes(specs, 3, torch.float32, 4, state_dtype=torch.bfloat16) == matrices * 2


@torch.no_grad()
def test_a_half_state_rounds_only_what_it_stores(tmp_path):
    """Prefill, then decode token by token (the state stored after each): float32 logits match transformers' within
    TOL; a bfloat16 or float16 state is stored in that type and stays within its rounding of them (not within TOL:
    the rounding is real); a verify chunk's accepted drafts replayed over a half state give logits within the same
    bound."""
    model, hf = ours(tmp_path, "qwen3_5")
    seq = tokens(40, 4)
    ref = hf_logits(hf, seq)
    errors = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        run = Stepper(model, state_dtype=dtype)
        assert {layer.matrix.dtype for layer in run.state.layers} == {dtype}
        outs = [run.step([(0, seq[:10], 0, 0)])[0]]
        outs += [run.step([(0, [seq[pos]], pos, 0)])[0] for pos in range(10, 40)]
        errors[dtype] = float((torch.cat(outs) - ref).abs().max())
    assert errors[torch.float32] < TOL
    assert TOL < errors[torch.float16] < 2e-3 and TOL < errors[torch.bfloat16] < 2e-2, errors
    run = Stepper(model, state_dtype=torch.bfloat16)
    run.step([(0, seq[:10], 0, 0)])
    pos = 10
    for accepted in (0, 2, 3, 1):
        drafts = seq[pos + 1: pos + 1 + accepted] + tokens(3 - accepted, 100 + pos)
        out = run.step([(0, [seq[pos]] + drafts, pos, 3)])[0]
        assert (out[: accepted + 1] - ref[pos: pos + accepted + 1]).abs().max() < 2e-2, accepted
        pos += accepted + 1


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_engine_keeps_the_state_in_the_asked_type(tiny_qwen3_5_dir, eager):
    """``mamba_ssm_cache_dtype="bfloat16"`` reaches the worker (eager steps and steps replayed from graphs, whose
    fixed-shape path writes the state too): its matrices are bfloat16 (the KV budget counts them so), and n-gram drafts give plain decoding's greedy
    tokens over the same state type (on this model, whose margins exceed the state's rounding: in general a half
    state is rounded at different tokens by the two, as by two batch schedules) with drafts accepted and rejected."""
    from specray import LLM

    outs = {}
    for spec in (None, NGRAM):
        with LLM(model=str(tiny_qwen3_5_dir), max_model_len=128, speculative_config=spec, enforce_eager=eager,
                 mamba_ssm_cache_dtype="bfloat16") as llm:
            outs[spec is None] = generate(llm, greedy())
            worker = llm.engine.executor.worker
            state = worker.runner.recurrent_state
            assert {layer.matrix.dtype for layer in state.layers} == {torch.bfloat16}
            assert worker._recurrent_bytes(1 << 40) == state.bytes()  # the KV budget counts what is allocated
            if spec is not None:
                assert 0 < llm.spec_stats.accepted_tokens < llm.spec_stats.draft_tokens
    assert outs[True] == outs[False]


def test_auto_follows_the_model_config(tmp_path):
    """Nemotron-H's config names its state type (float32 in transformers' default): "auto" takes it, here set to
    bfloat16 through hf_overrides; an explicit engine value wins over it."""
    from specray import LLM

    folder = save(tmp_path, "nemotron_h", 3)
    override = {"mamba_ssm_cache_dtype": "bfloat16"}
    for kw, want in (({}, torch.bfloat16), ({"mamba_ssm_cache_dtype": "float32"}, torch.float32)):
        with LLM(model=str(folder), max_model_len=64, hf_overrides=override, **kw) as llm:
            llm.generate([{"prompt_token_ids": [3, 4, 5]}], greedy(2), use_tqdm=False)
            state = llm.engine.executor.worker.runner.recurrent_state
            assert {layer.matrix.dtype for layer in state.layers} == {want}


def test_cli_flag_reaches_the_engine(tiny_llama_dir):
    pytest.importorskip("ray")  # (the CLI's; not in a GPU image)
    from specray.cluster.cli import build_parser, engine_kwargs, serve_app_args
    from specray.cluster.serve import ServeArgs

    flags = ["--mamba-ssm-cache-dtype", "bfloat16"]
    gen = build_parser().parse_args(["generate", "--model", str(tiny_llama_dir), "--prompt", "x", *flags])
    assert engine_kwargs(gen)["mamba_ssm_cache_dtype"] == "bfloat16"
    serve = build_parser().parse_args(["serve", "--model", str(tiny_llama_dir), *flags])
    assert ServeArgs.from_dict(serve_app_args(serve)).engine_args().mamba_ssm_cache_dtype == "bfloat16"
