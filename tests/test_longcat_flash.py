"""LongCat-Flash (``LongcatFlashForCausalLM``): two latent-attention sublayers per layer (the KV cache's layers 2i and
2i + 1), two dense MLPs and a shortcut MoE read from the first MLP's input and added after the second, whose router
scores zero-computation experts beside the routed ones; against transformers on the same random tiny weights (fp32,
max abs diff < 1e-4; the checkpoint as transformers saves it). Each difference from DeepSeek-V3 shown to matter (broken
on purpose, the logits move), the experts' zero-computation option on its own (graph path against the loop, ranks by
width and by expert), tensor parallel 2, pipeline stages 2 and expert parallel 2 equal to one rank, graph steps equal
to eager ones, the engine's greedy output with n-gram drafts equal to transformers' ``generate``, a LoRA adapter's
logits equal to transformers' with it merged, the release's MTP module drafting as vLLM's formula over transformers'
own modules computes it, and the config values this port does not serve refused by name."""

from __future__ import annotations

import sys
import textwrap
import types
from types import SimpleNamespace

import pytest
import torch

from specray import LLM
from specray.models.kv_cache import MLAAttentionSpec
from specray.models.llama import LlamaMLP, norm_stream
from specray.models.loader import load_model, read_config
from specray.models.longcat_flash import (LongcatFlashDecoderLayer, LongcatFlashForCausalLM, LongcatFlashMLA,
                                          check_config)
from specray.models.moe import SparseMoE, sync_free_experts
from specray.parallel import TPGroup
from specray_test_engine_runs import greedy, refused_on_this_gpu, token_ids  # tests/engine_runs.py
from specray_test_model_checks import (  # tests/model_checks.py
    SCHEDULES, WORKER_PRELUDE, assert_ranks_match_one_rank, chunked_logits, max_diff,
    mutated_logits, prompt, reference_logits, run_ranks)

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the logits at least this much (a hundred times TOL)


@pytest.fixture(scope="module")
def longcat(tiny_longcat_flash_dir):
    """(the tiny model's folder, transformers' logits of the prompt)."""
    return tiny_longcat_flash_dir, reference_logits(tiny_longcat_flash_dir)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(longcat, schedule):
    folder, reference = longcat
    model = load_model(str(folder))
    assert isinstance(model, LongcatFlashForCausalLM) and len(model.model.layers) == 2  # num_layers, not 4
    layer = model.model.layers[0]
    assert isinstance(layer, LongcatFlashDecoderLayer) and isinstance(layer.mlp, SparseMoE)
    assert all(isinstance(m, LlamaMLP) for m in layer.mlps) and all(isinstance(a, LongcatFlashMLA)
                                                                     for a in layer.self_attn)
    assert model.kv_cache_specs() == [MLAAttentionSpec(16, 8, 0)] * 4  # two attention blocks per layer
    assert layer.mlp.zero_experts == 4 and layer.mlp.router_module.weight.shape == (12, 64)
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), reference) < TOL


def test_the_router_stays_float32_in_a_half_precision_model(tiny_longcat_flash_dir):
    """transformers keeps the router's weight in float32 (``_keep_in_fp32_modules``): so does a bf16 model here."""
    model = load_model(str(tiny_longcat_flash_dir), dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert all(layer.mlp.router_module.weight.dtype == torch.float32 for layer in model.model.layers)


# ---- each difference from DeepSeek-V3, broken on purpose -------------------------------------------------------------

def _each_layer(fn):
    def mutate(model):
        for layer in model.model.layers:
            fn(layer)
    return mutate


def _each_attention(fn):
    return _each_layer(lambda layer: [fn(attn) for attn in layer.self_attn])


def _layer_forward(shortcut_input: int, shortcut_after: int):
    """The layer's forward with its MoE reading sublayer ``shortcut_input``'s MLP input and added to sublayer
    ``shortcut_after``'s MLP output (the port's: 0 and 1)."""
    def forward(self, x, residual, cos, sin, meta):
        x, residual = norm_stream(self.input_layernorm[0], x, residual)
        out = shortcut = None
        for i in range(2):
            if i:
                x, residual = self.input_layernorm[1](out, residual)
            x, residual = self.post_attention_layernorm[i](self.self_attn[i](x, cos, sin, meta), residual)
            if i == shortcut_input:
                shortcut = self.mlp(x)
            out = self.mlps[i](x)
            if i == shortcut_after:
                out = out + shortcut
        return out, residual
    return _each_layer(lambda layer: setattr(layer, "forward", types.MethodType(forward, layer)))


def _no_zero_experts(layer):
    layer.mlp.zero_experts = 0  # a token's zero experts add nothing (their weights are still in the routing)


def _no_bias(layer):
    layer.mlp.router_module.e_score_correction_bias.data.zero_()


MUTATIONS = {
    # the port's own layer forward, through the test's variant: must equal transformers (the variant is right)
    "shortcut-as-ported": (None, _layer_forward(0, 1), False),
    "shortcut-added-after-the-first-mlp": (None, _layer_forward(0, 0), True),
    "shortcut-reads-the-second-mlp-input": (None, _layer_forward(1, 1), True),
    "no-zero-experts": (None, _each_layer(_no_zero_experts), True),
    "no-correction-bias": (None, _each_layer(_no_bias), True),
    "unscaled-weights": (lambda c: setattr(c, "routed_scaling_factor", 1.0), None, True),
    "renormalised-weights": (lambda c: setattr(c, "norm_topk_prob", True), None, True),
    "sigmoid-scores": (lambda c: setattr(c, "scoring_func", "sigmoid"), None, True),
    "unscaled-query-latent": (None, _each_attention(lambda a: setattr(a.q_a_layernorm, "scale", 1.0)), True),
    "unscaled-kv-latent": (None, _each_attention(lambda a: setattr(a.kv_a_layernorm, "scale", 1.0)), True),
    "rope-on-halves": (None, _each_attention(lambda a: setattr(a, "interleave", False)), True),
    "mla-scales-off-by-config": (lambda c: setattr(c, "mla_scale_kv_lora", False), None, True),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_difference_shows_in_the_logits(longcat, mutation):
    """Each part of the layer broken once (the shortcut's input or its place, the zero experts, the router's bias,
    scale, normalisation and scores, each latent's scale, interleaved RoPE): the logits move by more than a hundred
    times the tolerance; the test's own variant of the layer, wired as ported, equals transformers (so the variants
    break only what they name)."""
    folder, reference = longcat
    mutate_config, mutate, moves = MUTATIONS[mutation]
    diff = max_diff(mutated_logits(folder, mutate_config, mutate), reference)
    assert (diff > MOVED) if moves else (diff < TOL), diff


# ---- the experts' zero-computation option on its own -----------------------------------------------------------------

H, I, E, Z = 64, 32, 8, 4


def longcat_moe(tp: TPGroup = TPGroup(), expert_parallel: bool = False) -> SparseMoE:
    config = SimpleNamespace(model_type="longcat_flash", hidden_act="silu", hidden_size=H, n_routed_experts=E,
                             zero_expert_num=Z, moe_topk=3, expert_ffn_hidden_size=I, routed_scaling_factor=2.0)
    block = SparseMoE(config, tp, expert_parallel)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.5)
    return block.eval()


def test_zero_experts_grouped_path_equals_the_loop_with_no_host_sync(no_host_sync):
    """The block's forward inside ``sync_free_experts`` (graph steps: pairs on zero experts sorted past this rank's
    experts, their weights times x added with no host sync) equals the eager loop's; some tokens chose zero experts,
    and without their identity term the output differs."""
    block = longcat_moe()
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want = block(x)
        with sync_free_experts(), no_host_sync():
            got = block(x)
        ids = block.route(x)[1]
        block.zero_experts = 0
        without = block(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (ids >= E).any() and (ids < E).any() and max_diff(without, want) > 1e-2


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["by-width", "by-expert"])
def test_zero_experts_are_added_once_over_the_ranks(expert_parallel):
    """Two ranks' shares (split by width, or whole experts each) sum to the whole block's output: the zero experts'
    term is added by rank 0 alone (each share taken as it enters the all-reduce)."""
    whole = longcat_moe()
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(3))
    parts = []
    for rank in range(2):
        block = longcat_moe(_Share(rank=rank, size=2), expert_parallel)
        block.load_state_dict(_share(whole.state_dict(), rank, expert_parallel), strict=True)
        with torch.no_grad():
            parts.append(block(x))
    with torch.no_grad():
        torch.testing.assert_close(parts[0] + parts[1], whole(x), atol=1e-5, rtol=1e-5)


class _Share(TPGroup):
    """A rank of a group whose sum over ranks is left out: its share as it enters the all-reduce."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _share(state: dict[str, torch.Tensor], rank: int, expert_parallel: bool) -> dict[str, torch.Tensor]:
    """Rank ``rank`` of 2's share of a whole block's experts (whole experts E/2 each, or half of every width)."""
    out = dict(state)
    if expert_parallel:
        half = slice(rank * E // 2, (rank + 1) * E // 2)
        out["w13"], out["w2"] = state["w13"][half], state["w2"][half]
        return out
    cols = slice(rank * I // 2, (rank + 1) * I // 2)
    gate, up = state["w13"][:, :I], state["w13"][:, I:]
    out["w13"] = torch.cat((gate[:, cols], up[:, cols]), dim=1)
    out["w2"] = state["w2"][:, :, cols]
    return out


# ---- ranks, graphs, the engine ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("stages", [1, 2], ids=["tp2", "pp2"])
def test_two_ranks_match_one_rank(tiny_longcat_flash_dir, tmp_path, stages):
    """Two tensor-parallel ranks (heads, MLP widths and experts' widths split; the latent replicated) or two pipeline
    stages (one whole layer, both its attention blocks, each): the last rank's logits equal one rank's."""
    assert_ranks_match_one_rank(tmp_path, [str(tiny_longcat_flash_dir)], stages, TOL)


EP_WORKER = WORKER_PRELUDE + textwrap.dedent("""

    folder = folders[0]
    diff = (logits(load_model(folder, tp, expert_parallel=True)) - logits(load_model(folder))).abs().max().item()
    gc.collect()
    dist.destroy_process_group()
    json.dump({"diffs": [diff]}, open(f"{out}/{rank}.json", "w"))
""")


def test_expert_parallel_ranks_match_one_rank(tiny_longcat_flash_dir, tmp_path):
    """Two ranks holding four whole experts each (the zero experts' term added by rank 0 alone): one rank's logits."""
    results = run_ranks(tmp_path, EP_WORKER, 2, 1, [str(tiny_longcat_flash_dir)])
    assert all(d < TOL for r in results for d in r["diffs"]), results


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
PROMPTS = ["def add(a, b):\n    return a + b\n", "The quick brown fox", "Hello world! How are you today?",
           "for i in range(10):", "x"]


def test_graph_steps_equal_eager_steps(tiny_longcat_flash_dir):
    """Greedy tokens with n-gram drafts for 5 requests (padded to 8) and for one, graphs against eager (the experts'
    grouped path with zero experts, both attention blocks' latent caches); the graphs were used."""
    folder = str(tiny_longcat_flash_dir)
    kwargs = dict(max_model_len=128, block_size=4, speculative_config=NGRAM)
    eager = LLM(model=folder, **kwargs)
    graphs = LLM(model=folder, enforce_eager=False, **kwargs)
    for prompts in (PROMPTS, PROMPTS[:1]):
        want = token_ids(eager.generate(prompts, greedy(12), use_tqdm=False))
        assert token_ids(graphs.generate(prompts, greedy(12), use_tqdm=False)) == want
    if refused_on_this_gpu(graphs):
        return
    shapes = list(graphs.engine.executor.worker.runner.graphs.graphs)
    assert any(q > 1 for _, q, _ in shapes) and any(b == 8 for b, _, _ in shapes), shapes


def test_engine_greedy_with_ngram_drafts_equals_transformers(tiny_longcat_flash_dir):
    sys.modules["specray_test_engine_runs"].assert_ngram_greedy_equals_transformers(tiny_longcat_flash_dir)


# ---- the release's MTP module (model.mtp.*), the mtp drafter's -------------------------------------------------------

def _mtp_parts(folder, seed: int):
    """transformers' config of the tiny model, and random modules of an MTP block from transformers' own classes: its
    latent attention (LongCat's scaled latents), a dense MLP of ffn_hidden_size, and the norms (eps rms_norm_eps)."""
    from transformers import AutoConfig
    from transformers.models.longcat_flash import modeling_longcat_flash as lc

    config = AutoConfig.from_pretrained(str(folder))
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    h, eps = config.hidden_size, config.rms_norm_eps
    parts = torch.nn.ModuleDict({"self_attn": lc.LongcatFlashMLA(config, 0), "mlp": lc.LongcatFlashMLP(config),
                                 **{name: lc.LongcatFlashRMSNorm(h, eps) for name in
                                    ("enorm", "hnorm", "input_layernorm", "post_attention_layernorm", "norm")}})
    parts["eh_proj"] = torch.nn.Linear(2 * h, h, bias=False)
    with torch.no_grad():
        for name, param in parts.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.1 if name != "eh_proj.weight" else 0.2)
    return config, parts.float().eval()


def _release_names(parts) -> dict[str, torch.Tensor]:
    """The MTP block's tensors under the release's names (as vLLM's longcat_flash_mtp reads them)."""
    where = {"enorm.": "model.mtp.layers.0.enorm.m.", "hnorm.": "model.mtp.layers.0.hnorm.m.",
             "eh_proj.": "model.mtp.layers.0.eh_proj.", "norm.": "model.mtp.norm.",
             "mlp.": "model.mtp.layers.0.transformer_layer.mlp.", "": "model.mtp.layers.0."}
    out = {}
    for name, tensor in parts.state_dict().items():
        ours = next(prefix for prefix in where if name.startswith(prefix))
        out[where[ours] + name[len(ours):]] = tensor.detach().clone()
    return out


def write_longcat_mtp(folder, target_dir, seed: int = 17, accepting: bool = False):
    """A copy of the tiny target's folder with an MTP module under the release's names (and its own copy of the
    embedding, ``model.mtp.embed_tokens``, which vLLM replaces by the target's). ``accepting``: the module passes
    the target's hidden state through (eh_proj its identity on the hidden half, unit norms on that path, the
    block's outputs scaled down), so its drafts repeat the target's last prediction and a repeating output accepts
    them. Returns (folder, transformers' config, the MTP parts)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(target_dir, folder, dirs_exist_ok=True)
    config, parts = _mtp_parts(target_dir, seed)
    if accepting:
        h = config.hidden_size
        with torch.no_grad():
            parts["eh_proj"].weight.copy_(torch.cat((torch.zeros(h, h), torch.eye(h)), dim=1))
            for name in ("hnorm", "norm"):
                parts[name].weight.fill_(1.0)
            parts["self_attn"].o_proj.weight.mul_(0.01)
            parts["mlp"].down_proj.weight.mul_(0.01)
    weights = load_file(str(folder / "model.safetensors"))
    weights.update(_release_names(parts))
    weights["model.mtp.embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    return folder, config, parts


@torch.no_grad()
def reference_mtp(config, parts, embeddings: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The MTP module over a whole sequence as vLLM's ``LongCatMultiTokenPredictorLayer`` computes it, on
    transformers' modules: embeddings [n, H] (of t[p+1]) and the target's last hidden states [n, H] (at p) ->
    ``norm(block(eh_proj(cat(enorm(e), hnorm(h)))))`` [n, H], the block a pre-norm layer (causal attention)."""
    from transformers.models.longcat_flash import modeling_longcat_flash as lc

    n = hidden.shape[0]
    x = parts["eh_proj"](torch.cat((parts["enorm"](embeddings), parts["hnorm"](hidden)), dim=-1))[None]
    rope = lc.LongcatFlashRotaryEmbedding(config)(x, torch.arange(n)[None])
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    x = x + parts["self_attn"](parts["input_layernorm"](x), rope, mask)[0]
    x = x + parts["mlp"](parts["post_attention_layernorm"](x))
    return parts["norm"](x)[0]


@pytest.mark.parametrize("accepting", [False, True], ids=["random", "accepting"])
def test_mtp_module_drafts_as_the_release_lays_it_out(tiny_longcat_flash_dir, tmp_path, accepting, caplog):
    """``method="mtp"`` reads the release's module (``model.mtp.layers.0.*``, ``model.mtp.norm``) into a head of
    LongCat's latent attention and a dense MLP (one latent cache); its normed output over a sequence on shuffled
    blocks equals vLLM's formula over transformers' own modules (the random module: every part matters); the target
    reads none of it; greedy output with its drafts equals plain decoding (batch of 8, mixed caps), no block leaks,
    an accepting module's drafts are accepted."""
    from specray.models.attention import build_attention_metadata
    from specray.models.draft_head_loader import load_draft_head
    from specray.models.kv_cache import allocate_kv_cache
    from specray.models.loader import load_hf_config

    target = tiny_longcat_flash_dir
    folder, config, parts = write_longcat_mtp(tmp_path / "mtp", target, accepting=accepting)
    head = load_draft_head("mtp", folder, load_model(str(target)), load_hf_config(str(target)))
    layer = head.layers[0]
    assert isinstance(layer.self_attn, LongcatFlashMLA) and isinstance(layer.mlp, LlamaMLP)
    assert head.kv_cache_specs() == [MLAAttentionSpec(16, 8, 0)]
    hf = load_model(str(target))  # our target, whose final hidden states the head reads
    allocate_kv_cache(head, 16, 4)
    allocate_kv_cache(hf, 16, 4)
    seq = torch.randint(0, config.vocab_size, (22,), generator=torch.Generator().manual_seed(5))
    n = len(seq) - 1
    with torch.no_grad():
        hidden = hf(seq[:n], build_attention_metadata([n], [0], [[3, 7, 1, 12, 9, 0]], 4))
        want = reference_mtp(config, parts, hf.embed(seq[1:]), hidden)
        got = head(seq[1:], hidden, build_attention_metadata([n], [0], [[9, 2, 14, 5, 11, 0]], 4))[1]
    assert max_diff(got, want) < TOL
    batch = (PROMPTS * 2)[:8]
    plain = token_ids(LLM(str(target), max_model_len=256).generate(batch, greedy(12), use_tqdm=False))
    llm = LLM(str(folder), max_model_len=256,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2, "adaptive": False})
    start = llm.engine.scheduler.block_manager.num_free_blocks
    caps = [greedy(12), greedy(5), greedy(12), greedy(1), greedy(12), greedy(7), greedy(12), greedy(3)]
    outs = token_ids(llm.generate(batch, caps, use_tqdm=False))
    assert outs == [p[: len(o)] for p, o in zip(plain, outs)] and [len(o) for o in outs] == [12, 5, 12, 1, 12, 7, 12, 3]
    assert llm.engine.scheduler.block_manager.num_free_blocks == start
    assert llm.spec_stats.draft_tokens > 0 and (llm.spec_stats.accepted_tokens > 0 or not accepting)
    assert "ignoring checkpoint tensor" not in caplog.text


def test_mtp_refusals_name_the_module(tiny_longcat_flash_dir, tmp_path):
    """A checkpoint without the module, two chained modules asked of a release with one, and a tensor the head has no
    place for: each a ValueError saying so."""
    from safetensors.torch import load_file, save_file

    from specray.models.draft_head_loader import load_draft_head
    from specray.models.loader import load_hf_config

    target = load_model(str(tiny_longcat_flash_dir))
    config = load_hf_config(str(tiny_longcat_flash_dir))
    with pytest.raises(ValueError, match="has no MTP module"):
        load_draft_head("mtp", tiny_longcat_flash_dir, target, config)
    folder, _, _ = write_longcat_mtp(tmp_path / "mtp", tiny_longcat_flash_dir)
    with pytest.raises(ValueError, match="num_nextn_predict_layers=2 but the checkpoint .* has 1 MTP module"):
        load_draft_head("mtp", folder, target, config, num_modules=2)
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.mtp.layers.0.shared_head.extra.weight"] = torch.zeros(4)
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="has no place in a mtp head"):
        load_draft_head("mtp", folder, target, config)


def test_an_adapter_matches_transformers_with_it_merged(tiny_longcat_flash_dir, tmp_path):
    """A PEFT adapter on every latent-attention projection but kv_b_proj (read as W_UK, W_UV: refused, as
    DeepSeek-V3's) and on both dense MLPs of every layer: a prefill's logits equal transformers' on the merged
    weights, and differ from the base model's."""
    import specray_test_checkpoints as checkpoints  # tests/checkpoints.py (registered by conftest)
    from transformers import AutoModelForCausalLM

    from specray.lora import LoRAConfig, LoRARequest
    from specray.models.attention import build_attention_metadata
    from specray.models.kv_cache import allocate_kv_cache
    from specray.models.lora import LoRASlots

    base = tiny_longcat_flash_dir
    modules = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapter = checkpoints.write_lora(base, tmp_path / "adapter", modules=modules, std=0.1)
    merged = checkpoints.merge_lora(base, adapter, tmp_path / "merged")
    ours = load_model(base)
    slots = LoRASlots(ours, LoRAConfig(max_loras=1, max_lora_rank=4), torch.device("cpu"))
    ids = prompt()[:17]
    slots.context.set_token_slots(torch.tensor(slots.slots_for([LoRARequest("a", 1, str(adapter))]) * len(ids)))
    allocate_kv_cache(ours, 8, 4)
    with torch.no_grad():
        got = ours.compute_logits(ours(torch.tensor(ids), build_attention_metadata([17], [0], [[6, 1, 4, 0, 7]], 4)))

    def hf_logits(folder):
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0]

    assert max_diff(got, hf_logits(merged)) < TOL and max_diff(got, hf_logits(base)) > 1e-2


# ---- refusals --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, match", [
    ("router_bias", True, "router_bias=True is not supported"),
    ("zero_expert_type", "zero", "zero_expert_type='zero' is not supported"),
    ("q_lora_rank", None, "q_lora_rank=None is not supported"),
    ("head_dim", 16, "head_dim=16 must equal qk_rope_head_dim=8"),
    ("qk_head_dim", 20, "qk_head_dim=20 must equal qk_nope_head_dim"),
])
def test_unsupported_config_values_are_refused_by_name(tiny_longcat_flash_dir, field, value, match):
    config = read_config(str(tiny_longcat_flash_dir))
    setattr(config, field, value)
    with pytest.raises(ValueError, match=match):
        check_config(config)
    with pytest.raises(ValueError, match=match):
        load_model(str(tiny_longcat_flash_dir), config=config)


def test_more_stages_than_layers_are_refused(tiny_longcat_flash_dir):
    """Stages split the config's two layers (num_hidden_layers counts four attention blocks): three are refused
    before any rank starts."""
    from specray.engine.builder import check_family_split

    config = read_config(str(tiny_longcat_flash_dir))
    check_family_split(config, 1, 2)
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds num_layers=2"):
        check_family_split(config, 1, 3)


def test_an_eagle3_head_without_layer_ids_reads_the_stack_layers(tiny_longcat_flash_deep_dir, tmp_path):
    """An EAGLE-3 head that names no aux layers reads the usual three of the stack's ``num_layers`` layers (not of
    ``num_hidden_layers``, which counts the attention blocks, twice as many: its layer 9 does not exist), and greedy
    output with its drafts equals plain decoding's."""
    import specray_test_draft_heads as draft_heads  # tests/draft_heads.py (registered by conftest)
    from specray import LLM
    from specray.models.draft_head_loader import head_aux_layers, read_head_config
    from specray.models.loader import load_hf_config

    folder = tiny_longcat_flash_deep_dir
    runs = sys.modules["specray_test_engine_runs"]
    head = draft_heads.write_random_head(tmp_path / "head", "eagle3", folder)
    target_config = load_hf_config(str(folder))
    assert (target_config.num_layers, target_config.num_hidden_layers) == (6, 12)
    assert head_aux_layers("eagle3", read_head_config(str(head)), target_config) == (2, 3, 3)
    plain = LLM(model=str(folder), max_model_len=128, block_size=4)
    want = runs.token_ids(plain.generate(runs.PROMPTS[:2], runs.greedy(8), use_tqdm=False))
    llm = LLM(model=str(folder), max_model_len=128, block_size=4,
              speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 3,
                                  "adaptive": False})
    assert runs.token_ids(llm.generate(runs.PROMPTS[:2], runs.greedy(8), use_tqdm=False)) == want
    assert llm.spec_stats.draft_tokens > 0
