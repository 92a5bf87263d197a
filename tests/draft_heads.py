"""Tiny random draft-head checkpoints in the public layouts (EAGLE-1, EAGLE-3, DeepSeek-style MTP), for tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def _layer(prefix: str, h: int, inter: int, heads: int, kv_heads: int, head_dim: int, qkv_in: int,
           input_norm: bool, hidden_norm: bool, gen: torch.Generator, std: float) -> dict[str, torch.Tensor]:
    def w(*shape):
        return torch.randn(*shape, generator=gen) * std

    def norm():
        return 1.0 + 0.1 * torch.randn(h, generator=gen)

    out = {
        f"{prefix}self_attn.q_proj.weight": w(heads * head_dim, qkv_in),
        f"{prefix}self_attn.k_proj.weight": w(kv_heads * head_dim, qkv_in),
        f"{prefix}self_attn.v_proj.weight": w(kv_heads * head_dim, qkv_in),
        f"{prefix}self_attn.o_proj.weight": w(h, heads * head_dim),
        f"{prefix}post_attention_layernorm.weight": norm(),
        f"{prefix}mlp.gate_proj.weight": w(inter, h),
        f"{prefix}mlp.up_proj.weight": w(inter, h),
        f"{prefix}mlp.down_proj.weight": w(h, inter),
    }
    if input_norm:
        out[f"{prefix}input_layernorm.weight"] = norm()
    if hidden_norm:
        out[f"{prefix}hidden_norm.weight"] = norm()
    return out


def head_config(target_config: dict, **extra) -> dict:
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
            "max_position_embeddings", "vocab_size", "rope_theta", "hidden_act")
    config = {k: target_config[k] for k in keys if k in target_config}
    if "intermediate_size" not in config and "ffn_hidden_size" in target_config:  # (LongCat's dense MLP width)
        config["intermediate_size"] = target_config["ffn_hidden_size"]
    config.update(model_type="llama", num_hidden_layers=1, **extra)
    return config


def write_random_head(folder: Path, method: str, target_dir: Path, seed: int = 0, std: float = 0.2,
                      draft_vocab_size: int = 96, midlayer: bool = True, with_lm_head: bool = True,
                      aux_layers: list[int] | None = None, num_modules: int = 1) -> Path:
    """A random ``method`` head for the target in ``target_dir``, written as its public layout: a folder of its
    own for EAGLE-1/EAGLE-3; for MTP, a copy of the target's folder with ``model.layers.{L}.*`` added (and
    ``num_modules`` - 1 more modules at ``model.layers.{L+1}`` ...)."""
    from safetensors.torch import load_file, save_file

    target = json.loads((target_dir / "config.json").read_text())
    h, inter = target["hidden_size"], target.get("intermediate_size") or target["ffn_hidden_size"]  # (LongCat's)
    heads, kv = target["num_attention_heads"], target["num_key_value_heads"]
    head_dim = h // heads
    gen = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    if method == "eagle":
        tensors = {"fc.weight": torch.randn(h, 2 * h, generator=gen) * std, "fc.bias": torch.randn(h, generator=gen) * std}
        tensors.update(_layer("layers.0.", h, inter, heads, kv, head_dim, h, False, False, gen, std))
        (folder / "config.json").write_text(json.dumps(head_config(target, architectures=["EagleLlamaForCausalLM"])))
        save_file(tensors, str(folder / "model.safetensors"))
        return folder
    if method == "eagle3":
        vocab = target["vocab_size"]
        ids = torch.randperm(vocab, generator=gen)[:draft_vocab_size].sort().values
        aux = aux_layers or range(3)  # (the head reads three layers unless told which: fc takes their streams)
        tensors = {"fc.weight": torch.randn(h, len(aux) * h, generator=gen) * std,
                   "norm.weight": 1.0 + 0.1 * torch.randn(h, generator=gen),
                   "d2t": ids - torch.arange(draft_vocab_size),
                   "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)}
        if with_lm_head:
            tensors["lm_head.weight"] = torch.randn(draft_vocab_size, h, generator=gen) * std
        prefix = "midlayer." if midlayer else "layers.0."
        tensors.update(_layer(prefix, h, inter, heads, kv, head_dim, 2 * h, True, True, gen, std))
        extra = {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab_size}
        if aux_layers is not None:
            extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers}
        (folder / "config.json").write_text(json.dumps(head_config(target, **extra)))
        save_file(tensors, str(folder / "model.safetensors"))
        return folder
    assert method == "mtp", method
    import shutil

    shutil.copytree(target_dir, folder, dirs_exist_ok=True)
    weights = load_file(str(folder / "model.safetensors"))
    for k in range(num_modules):
        p = f"model.layers.{target['num_hidden_layers'] + k}."
        weights.update({f"{p}enorm.weight": 1.0 + 0.1 * torch.randn(h, generator=gen),
                        f"{p}hnorm.weight": 1.0 + 0.1 * torch.randn(h, generator=gen),
                        f"{p}eh_proj.weight": torch.randn(h, 2 * h, generator=gen) * std,
                        f"{p}shared_head.norm.weight": 1.0 + 0.1 * torch.randn(h, generator=gen)})
        weights.update(_layer(p, h, inter, heads, kv, head_dim, h, True, False, gen, std))
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def write_accepting_head(folder: Path, method: str, target_dir: Path, seed: int = 5, gain: float = 10.0,
                         alpha: float = 0.3, num_modules: int = 1) -> Path:
    """A ``method`` head whose drafts a tiny random target often accepts, for tests of the accepted-drafts path
    (written as :func:`write_random_head` writes its layout, so it loads and runs through the same code).

    Its fusion passes one token's embedding straight through to the residual stream: EAGLE-1's ``fc`` and MTP's
    ``eh_proj`` copy the embedding of the token the head reads (``t[p+1]``, the one the target just kept), and
    EAGLE-3's ``fc`` copies the target's residual stream entering layer 0 (``aux_layers`` (0, ...)): the embedding
    of ``t[p]`` (``gain`` lifts the raw embedding over the rest; MTP's ``enorm`` has already normed it). The rest stays random, scaled by ``alpha``: the target's features (EAGLE-3's other two layers)
    still enter the residual stream, and the attention and MLP still shape every draft and write the head's K/V.
    Under the tied LM head (the target's, or EAGLE-3's rows of it over a draft vocabulary with offsets) its argmax
    is mostly that token: it drafts "the same token again", and a tiny random model's greedy output has runs of
    repeated tokens. Not a trained head, but an honest one: nothing in it knows the target's continuation."""
    from safetensors.torch import load_file, save_file

    target = json.loads((target_dir / "config.json").read_text())
    h, layers, vocab = target["hidden_size"], target["num_hidden_layers"], target["vocab_size"]
    if method == "eagle3":
        aux = [0, layers // 2, layers - 1]
        write_random_head(folder, method, target_dir, seed=seed, draft_vocab_size=vocab - 16, with_lm_head=False,
                          aux_layers=aux)
    else:
        write_random_head(folder, method, target_dir, seed=seed, num_modules=num_modules)
    weights = load_file(str(folder / "model.safetensors"))
    prefixes = {"eagle": ["layers.0."], "eagle3": ["midlayer."],
                "mtp": [f"model.layers.{layers + k}." for k in range(num_modules)]}[method]
    eye = torch.eye(h)
    for prefix in prefixes:
        weights[prefix + "self_attn.o_proj.weight"] *= alpha
        weights[prefix + "mlp.down_proj.weight"] *= alpha
        fc = "fc.weight" if method != "mtp" else prefix + "eh_proj.weight"
        weights[fc] = torch.cat([(gain if method != "mtp" else 1.0) * eye, alpha * weights[fc][:, h:]], 1)
    if method == "eagle":
        weights["fc.bias"].zero_()
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def write_dflash(folder: Path, target_dir: Path, num_layers: int = 2, block_size: int = 5,
                 target_layer_ids: list[int] | None = None, seed: int = 3, std: float = 0.2,
                 layer_types: list[str] | None = None, sliding_window: int | None = None,
                 always_token_zero: bool = False, accepting: bool = False) -> Path:
    """A random DFlash checkpoint for the target in ``target_dir``, in z-lab's ``DFlashDraftModel`` layout: a Qwen3
    config with ``dflash_config`` (``target_layer_ids``, ``mask_token_id``) and ``block_size``, and ``layers.{i}.*``
    (q/k norms), ``fc``, ``hidden_norm``, ``norm`` (no embedding or LM head: the target's). The mask token is the
    target's last id. ``always_token_zero``: the final norm's weight is zero, so every logit is 0 and every draft is
    token 0 (argmax's first index), which a target made to emit token 0 always accepts. ``accepting``: a head that
    drafts "the sampled token again" at every block position (:func:`_anchor_copier`), which a tiny random model's
    runs of repeated tokens often accept; it needs a target whose mask token's embedding row is zero
    (:func:`zero_mask_row`)."""
    from safetensors.torch import save_file

    target = json.loads((target_dir / "config.json").read_text())
    h, inter = target["hidden_size"], target["intermediate_size"]
    heads, kv = target["num_attention_heads"], target["num_key_value_heads"]
    head_dim = h // heads
    layers = target_layer_ids or [0, target["num_hidden_layers"] // 2, target["num_hidden_layers"] - 2]
    gen = torch.Generator().manual_seed(seed)
    tensors = {"fc.weight": torch.randn(h, len(layers) * h, generator=gen) * std,
               "hidden_norm.weight": 1.0 + 0.1 * torch.randn(h, generator=gen),
               "norm.weight": torch.zeros(h) if always_token_zero else 1.0 + 0.1 * torch.randn(h, generator=gen)}
    for i in range(num_layers):
        p = f"layers.{i}."
        tensors.update(_layer(p, h, inter, heads, kv, head_dim, h, True, False, gen, std))
        tensors[p + "self_attn.q_norm.weight"] = 1.0 + 0.1 * torch.randn(head_dim, generator=gen)
        tensors[p + "self_attn.k_norm.weight"] = 1.0 + 0.1 * torch.randn(head_dim, generator=gen)
    config = head_config(target, architectures=["DFlashDraftModel"], head_dim=head_dim, block_size=block_size,
                         num_target_layers=target["num_hidden_layers"],
                         dflash_config={"target_layer_ids": layers, "mask_token_id": target["vocab_size"] - 1})
    config.update(model_type="qwen3", num_hidden_layers=num_layers)
    if layer_types is not None:
        config.update(layer_types=layer_types, sliding_window=sliding_window, use_sliding_window=True)
    if accepting:
        tensors = _anchor_copier(tensors, config, h, heads, kv, head_dim, num_layers)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def zero_mask_row(target_dir: Path) -> Path:
    """Zero the embedding row of the target's last token id (the DFlash test heads' mask token) in place: a mask
    token embeds to nothing, as an untrained row nearly does, so :func:`_anchor_copier`'s block rows start empty."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(target_dir / "model.safetensors"))
    weights["model.embed_tokens.weight"][-1] = 0.0
    save_file(weights, str(target_dir / "model.safetensors"))
    return target_dir


def _anchor_copier(tensors: dict, config: dict, h: int, heads: int, kv: int, head_dim: int, num_layers: int,
                   gain: float = 8.0, sharpness: float = 3.0) -> dict:
    """A DFlash head that copies the block's first row (the sampled token's embedding) one row further per layer,
    so that with as many layers as drafts every draft row holds it, and under the tied LM head drafts that token.
    Every layer is causal with a window of 2 (each row sees itself and the row before); q and k are biases alone
    (no weights), the same at every row, in the first RoPE pair only, turned so that the score peaks one position
    back (RoPE's first pair turns one radian per position); values copy the first half of the normed input, which
    only the sampled token's row has (the mask token embeds to zero, and the context features are zero there:
    ``hidden_norm`` keeps the second half only); o_proj puts it back with ``gain``; the MLPs add nothing. Not a
    trained head, but an honest one: nothing in it knows the target's continuation."""
    import math

    config.update(attention_bias=True, layer_types=["sliding_attention"] * num_layers, sliding_window=2,
                  use_sliding_window=True, max_window_layers=0)
    half, group = h // 2, heads // kv
    tensors["hidden_norm.weight"][:half] = 0.0
    for i in range(num_layers):
        p = f"layers.{i}."
        q_bias, k_bias = torch.zeros(heads * head_dim), torch.zeros(kv * head_dim)
        for n in range(heads):
            q_bias[n * head_dim] = math.cos(-1.0)
            q_bias[n * head_dim + head_dim // 2] = math.sin(-1.0)
        for n in range(kv):
            k_bias[n * head_dim] = 1.0
        v = torch.zeros(kv * head_dim, h)
        v[: min(kv * head_dim, half), : min(kv * head_dim, half)] = torch.eye(min(kv * head_dim, half))
        o = torch.zeros(h, heads * head_dim)
        for n in range(heads):  # head n reads KV head n // group: its dims, averaged over the group
            g = n // group
            o[g * head_dim: (g + 1) * head_dim, n * head_dim: (n + 1) * head_dim] = torch.eye(head_dim) * gain / group
        norm_in = torch.zeros(h)
        norm_in[:half] = 1.0
        tensors.update({
            p + "self_attn.q_proj.weight": torch.zeros(heads * head_dim, h), p + "self_attn.q_proj.bias": q_bias,
            p + "self_attn.k_proj.weight": torch.zeros(kv * head_dim, h), p + "self_attn.k_proj.bias": k_bias,
            p + "self_attn.v_proj.weight": v, p + "self_attn.v_proj.bias": torch.zeros(kv * head_dim),
            p + "self_attn.o_proj.weight": o, p + "self_attn.o_proj.bias": torch.zeros(h),
            p + "self_attn.q_norm.weight": torch.full((head_dim,), sharpness),
            p + "self_attn.k_norm.weight": torch.full((head_dim,), sharpness),
            p + "input_layernorm.weight": norm_in,
            p + "mlp.down_proj.weight": torch.zeros_like(tensors[p + "mlp.down_proj.weight"]),
        })
    tensors["norm.weight"] = torch.ones(h)
    return tensors


def write_medusa_heads(folder: Path, target_dir: Path, num_heads: int = 4, num_layers: int = 1, seed: int = 0,
                       std: float = 0.2, accepting: bool = False, layout: str = "medusa") -> Path:
    """Random Medusa heads for the target in ``target_dir``, in FasterDecoding's layout (or vLLM's). ``accepting``:
    identity blocks and the target's own LM head in every head, so each guesses "the token just sampled, again",
    which a tiny random model's runs of repeated tokens often accept (nothing in it knows the continuation)."""
    from safetensors.torch import load_file

    from specray.models.medusa import MedusaHeads, save_medusa_heads

    target = json.loads((target_dir / "config.json").read_text())
    heads = MedusaHeads(num_heads, num_layers, target["hidden_size"], target["vocab_size"])
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        if accepting:
            weights = load_file(str(target_dir / "model.safetensors"))
            lm = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
            for k in range(num_heads):
                for block in heads.blocks[k]:
                    block.weight.zero_()
                    block.bias.zero_()
                heads.lm_heads[k].weight.copy_(lm)
    save_medusa_heads(heads, folder, layout, {"base_model_name_or_path": str(target_dir)})
    return folder


def write_mlp_speculator(folder: Path, target_dir: Path, n_predict: int = 3, seed: int = 0, std: float = 0.2,
                         accepting: bool = False, tie_weights: bool = False, scale_input: bool = False,
                         inner_dim: int | None = None) -> Path:
    """A random MLP speculator for the target in ``target_dir``, in IBM's layout. ``accepting``: every stage's
    embedding and head the target's embedding and its projection zero (inner_dim the target's width), so each stage
    guesses "the token it read, again", which a tiny random model's runs of repeated tokens often accept."""
    from safetensors.torch import load_file

    from specray.models.mlp_speculator import MLPSpeculatorHead, save_mlp_speculator

    target = json.loads((target_dir / "config.json").read_text())
    h, v = target["hidden_size"], target["vocab_size"]
    head = MLPSpeculatorHead(h, h if accepting or inner_dim is None else inner_dim, v, n_predict, tie_weights,
                             scale_input)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        for norm in head.ln:
            norm.weight.add_(1.0)
        if accepting:
            embedding = load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"]
            for k in range(len(head.emb)):
                head.emb[k].weight.copy_(embedding)
                head.head[k].weight.copy_(embedding)
                head.ln[k].weight.fill_(1.0)
                head.ln[k].bias.zero_()
            for proj in head.proj:
                proj.weight.zero_()
    save_mlp_speculator(head, folder)
    return folder


def write_redrafter(folder: Path, target_dir: Path, seed: int = 0, std: float = 0.2, accepting: bool = False,
                    rnn: bool = True, exit_dim: int | None = None, num_draft_layers: int = 1,
                    gain: float = 8.0) -> Path:
    """A random recurrent drafter (ReDrafter) for the target in ``target_dir``, in Apple's layout (``exit_dim``
    other than 2H adds ``input_proj``). ``accepting``: its state is SiLU(gain E(last token)) (W = gain I, U = 0),
    its blocks identities and its LM head the target's embedding over the state (nothing over the context), so it
    guesses "the last token again", which a tiny random model's runs of repeated tokens often accept."""
    from safetensors.torch import load_file

    from specray.models.redrafter import ReDrafterHead, save_redrafter

    target = json.loads((target_dir / "config.json").read_text())
    h, v = target["hidden_size"], target["vocab_size"]
    head = ReDrafterHead(h, v, 2 * h if accepting or exit_dim is None else exit_dim, num_draft_layers, rnn)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        if accepting:
            embedding = load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"]
            for block in head.blocks:
                block.weight.zero_()
                block.bias.zero_()
            head.rnn_w.weight.copy_(gain * torch.eye(h))
            head.rnn_u.weight.zero_()
            head.rnn_u.bias.zero_()
            head.lm_head.weight.copy_(torch.cat([torch.zeros(v, h), embedding], dim=1))
    save_redrafter(head, folder, {"base_model_name_or_path": str(target_dir)})
    return folder


def write_deepseek_mtp(folder: Path, target_dir: Path, seed: int = 7, accepting: bool = True,
                       alpha: float = 0.1, bias_std: float = 0.0) -> Path:
    """A copy of a tiny DeepSeek-V3 (or GLM-4.5 or Hunyuan 3, laid out alike) target's folder with one MTP module added
    at ``model.layers.{L}``: the family's block (DeepSeek's latent attention, GLM's or Hunyuan's, experts with a shared
    one) from a random model one layer deeper, plus ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm``
    (Hunyuan 3's ``final_layernorm``). ``accepting``:
    ``eh_proj`` passes the token's embedding through and the block's outputs are scaled by ``alpha``, so the module
    mostly drafts "the same token again" (as :func:`write_accepting_head`'s heads do). ``bias_std``: the block's
    router correction bias drawn with this spread (0: transformers' zeros at init)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    shutil.copytree(target_dir, folder, dirs_exist_ok=True)
    config = AutoConfig.from_pretrained(target_dir)
    layers, h = config.num_hidden_layers, config.hidden_size
    config.num_hidden_layers = layers + 1
    # per-layer lists (DeepSeek-V3.2's, GLM-5's) one longer: the MTP layer has experts, and its own indexer
    for field, kind in (("mlp_layer_types", "sparse"), ("layer_types", None), ("indexer_types", "full")):
        kinds = getattr(config, field, None)
        if isinstance(kinds, list) and len(kinds) == layers:
            setattr(config, field, kinds + [kind or kinds[-1]])
    torch.manual_seed(seed)
    deeper = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    p = f"model.layers.{layers}."
    weights = load_file(str(folder / "model.safetensors"))
    for name, tensor in deeper.state_dict().items():
        if name.startswith(p):
            weights[name] = tensor.detach().clone().contiguous()
            if bias_std and name.endswith("e_score_correction_bias"):
                weights[name] = torch.randn(tensor.shape, generator=gen) * bias_std
    eh = torch.randn(h, 2 * h, generator=gen) * 0.2
    if accepting:
        eh = torch.cat([torch.eye(h), alpha * eh[:, h:]], 1)
        for name in list(weights):
            if name.startswith(p) and name.endswith(("o_proj.weight", "down_proj", "down_proj.weight")):
                weights[name] = weights[name] * alpha
    last = "final_layernorm" if config.model_type == "hy_v3" else "shared_head.norm"  # the module's last norm
    weights.update({f"{p}enorm.weight": 1.0 + 0.1 * torch.randn(h, generator=gen),
                    f"{p}hnorm.weight": 1.0 + 0.1 * torch.randn(h, generator=gen),
                    f"{p}eh_proj.weight": eh,
                    f"{p}{last}.weight": 1.0 + 0.1 * torch.randn(h, generator=gen)})
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    return folder


def deepseek_v4_mtp_config(target_dir: Path, kind: str = "sliding_attention"):
    """transformers' config of a tiny DeepSeek-V4 target one layer deeper: its last layer is where the MTP module's
    block sits (a ``kind`` attention layer with scored experts)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target_dir)
    config.num_hidden_layers += 1
    config.layer_types = [*config.layer_types, kind]
    config.mlp_layer_types = [*config.mlp_layer_types, "moe"]
    return config


def write_deepseek_v4_mtp(folder: Path, target_dir: Path, seed: int = 23, accepting: bool = False,
                          alpha: float = 0.03, kind: str = "sliding_attention") -> Path:
    """A copy of a tiny DeepSeek-V4 target's folder with one MTP module added as the release names it, ``mtp.0.*``:
    the block of a random model one layer deeper (in the names transformers saves, DeepSeek's: ``attn.wq_a``,
    ``hc_attn_fn``, ``ffn.experts.3.w1``, ...; a ``kind`` attention layer), plus ``e_proj``, ``h_proj``, ``enorm``,
    ``hnorm``, ``norm`` and ``hc_head_fn`` / ``_base`` / ``_scale``. ``accepting``: the target's layers' outputs
    (and the module's block's and ``h_proj``) scaled by ``alpha``, so the target's next token follows mostly from
    the last one; ``e_proj`` passes the token's embedding through, and the module's final norm and hc_head are the
    target's, so its draft after token t is mostly the target's next token after t: often right."""
    import shutil
    import tempfile

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    shutil.copytree(target_dir, folder, dirs_exist_ok=True)
    config = deepseek_v4_mtp_config(target_dir, kind)
    layers, h, n = config.num_hidden_layers - 1, config.hidden_size, config.hc_mult
    torch.manual_seed(seed)
    deeper = AutoModelForCausalLM.from_config(config)
    with tempfile.TemporaryDirectory() as tmp:  # saved: in the names transformers writes (DeepSeek's own)
        deeper.save_pretrained(tmp)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
    p = f"model.layers.{layers}."
    gen = torch.Generator().manual_seed(seed)
    weights = load_file(str(folder / "model.safetensors"))
    outputs = ("wo_b.weight", "w2.weight")  # a block's attention and experts' output projections
    if accepting:
        weights.update({k: alpha * v for k, v in weights.items()
                        if k.startswith("model.layers.") and k.endswith(outputs)})
    for name, tensor in saved.items():
        if name.startswith(p):
            scaled = accepting and name.endswith(outputs)
            weights["mtp.0." + name[len(p):]] = (alpha * tensor if scaled else tensor).clone().contiguous()
    e_proj, h_proj = 0.3 * torch.randn(h, h, generator=gen), 0.3 * torch.randn(h, h, generator=gen)
    own = {"mtp.0.enorm.weight": 1.0 + 0.1 * torch.randn(h, generator=gen),
           "mtp.0.hnorm.weight": 1.0 + 0.1 * torch.randn(h, generator=gen),
           "mtp.0.norm.weight": 1.0 + 0.1 * torch.randn(h, generator=gen),
           "mtp.0.hc_head_fn": 0.1 * torch.randn(n, n * h, generator=gen),
           "mtp.0.hc_head_base": 0.1 * torch.randn(n, generator=gen),
           "mtp.0.hc_head_scale": 0.5 + torch.rand(1, generator=gen)}
    if accepting:
        e_proj, h_proj = torch.eye(h), alpha * h_proj
        own.update({f"mtp.0.hc_head_{k}": weights[f"model.hc_head.hc_{k}"].clone() for k in ("fn", "base", "scale")})
        own.update({"mtp.0.enorm.weight": torch.ones(h), "mtp.0.norm.weight": weights["model.norm.weight"].clone()})
    weights.update({"mtp.0.e_proj.weight": e_proj, "mtp.0.h_proj.weight": h_proj, **own})
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    return folder


HYBRID_LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def write_exaone_mtp(folder: Path, target_dir: Path, kind: str = "sliding_attention", seed: int = 19) -> Path:
    """A copy of a tiny K-EXAONE target's folder with its release's MTP module under ``mtp.`` (vLLM's
    ``ExaoneMoeMTP`` layout): ``fc`` [H, 2H], ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``layers.0.*`` (a
    ``kind`` layer with a dense MLP, from a random model one layer deeper, as transformers writes it) and ``norm``;
    its config naming the layer's kind (``mtp_layer_types``)."""
    import shutil
    import tempfile

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    shutil.copytree(target_dir, folder, dirs_exist_ok=True)
    config = AutoConfig.from_pretrained(target_dir)
    layers, h = config.num_hidden_layers, config.hidden_size
    config.num_hidden_layers = layers + 1
    config.layer_types = [*config.layer_types, kind]
    config.mlp_layer_types = [*config.mlp_layer_types, "dense"]
    torch.manual_seed(seed)
    deeper = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in deeper.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
    with tempfile.TemporaryDirectory() as tmp:
        deeper.save_pretrained(tmp)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
    p = f"model.layers.{layers}."
    weights = load_file(str(folder / "model.safetensors"))
    weights.update({"mtp.layers.0." + name[len(p):]: t.clone() for name, t in saved.items() if name.startswith(p)})
    weights.update({"mtp.fc.weight": torch.randn(h, 2 * h, generator=gen) * 0.2,
                    "mtp.pre_fc_norm_embedding.weight": 0.5 + torch.rand(h, generator=gen),
                    "mtp.pre_fc_norm_hidden.weight": 0.5 + torch.rand(h, generator=gen),
                    "mtp.norm.weight": 0.5 + torch.rand(h, generator=gen)})
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "mtp_layer_types": [kind], "num_nextn_predict_layers": 1}))
    return folder


def ernie_mtp_config(target_dir: Path):
    """transformers' config of a tiny ERNIE 4.5 MoE target one layer deeper, its last layer dense (the MTP block's)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target_dir)
    config.num_hidden_layers += 1
    config.moe_layer_end_index = config.num_hidden_layers - 2
    return config


def write_ernie_mtp(folder: Path, target_dir: Path, seed: int = 29) -> Path:
    """A copy of a tiny ERNIE 4.5 MoE target's folder with its release's MTP module: ``model.mtp_emb_norm.0``,
    ``model.mtp_hidden_norm.0``, ``model.mtp_linear_proj.0`` [H, 2H] and ``model.mtp_block.0.*`` (a dense decoder
    layer of a random model one layer deeper, in the names transformers writes); the target's final norm made random
    (the module reads the stream before it, and ends with it)."""
    import shutil
    import tempfile

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    shutil.copytree(target_dir, folder, dirs_exist_ok=True)
    config = ernie_mtp_config(target_dir)
    layers, h = config.num_hidden_layers - 1, config.hidden_size
    torch.manual_seed(seed)
    deeper = AutoModelForCausalLM.from_config(config)
    with tempfile.TemporaryDirectory() as tmp:
        deeper.save_pretrained(tmp)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
    p = f"model.layers.{layers}."
    gen = torch.Generator().manual_seed(seed)
    weights = load_file(str(folder / "model.safetensors"))
    weights.update({"model.mtp_block.0." + n[len(p):]: t.clone() for n, t in saved.items() if n.startswith(p)})
    weights["model.norm.weight"] = 0.5 + torch.rand(h, generator=gen)  # (the module reads past it: make it show)
    weights.update({"model.mtp_emb_norm.0.weight": 0.5 + torch.rand(h, generator=gen),
                    "model.mtp_hidden_norm.0.weight": 0.5 + torch.rand(h, generator=gen),
                    "model.mtp_linear_proj.0.weight": torch.randn(h, 2 * h, generator=gen) * 0.2})
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 1}))
    return folder


def write_tiny_hybrid(folder: Path, arch: str, seed: int = 0) -> Path:
    """A tiny random Qwen3.5 (``arch`` "qwen3_5"), Qwen3.5-MoE ("qwen3_5_moe") or Qwen3-Next ("qwen3_next") model
    folder with a tokenizer, laid out as the releases are (linear layers, then a full-attention one last, which
    transformers' ``MtpModel`` takes its norm class from); norms and gates random (zero-centred norms), the
    embedding tied and doubled so that greedy decoding repeats tokens now and then (as tests/test_qwen3_5.py's)."""
    from specray_test_hybrid_models import hf_pair  # tests/hybrid_models.py (registered by conftest)
    from tests.conftest import build_tiny_tokenizer

    tok = build_tiny_tokenizer(folder)
    _, model = hf_pair(arch, seed, num_hidden_layers=4, layer_types=HYBRID_LAYERS, vocab_size=len(tok),
                       eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(2.0)
    model.save_pretrained(folder)
    return folder


def write_qwen_mtp(folder: Path, target_dir: Path, seed: int = 11, accepting: bool = True,
                   alpha: float = 0.1) -> Path:
    """A copy of a tiny Qwen3.5 / Qwen3.5-MoE / Qwen3-Next target's folder with its release's MTP layer added under
    ``mtp.``: ``fc`` [H, 2H] over [norm(embedding); norm(hidden)], ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``,
    ``layers.0.*`` (the family's full-attention layer, taken as transformers writes it from a random model one layer
    deeper whose last layer is a full-attention one: per-expert tensors, a gated shared expert) and ``norm``; the norms
    zero-centred (1 + w) and random. ``accepting``: ``fc`` passes the token's normed embedding through and the
    block's outputs are scaled by ``alpha``, so the layer mostly drafts "the same token again" (as
    :func:`write_deepseek_mtp`'s module does)."""
    import shutil
    import tempfile

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    shutil.copytree(target_dir, folder, dirs_exist_ok=True)
    config = AutoConfig.from_pretrained(target_dir)
    layers, h = config.num_hidden_layers, config.hidden_size
    config.num_hidden_layers = layers + 1
    config.layer_types = list(config.layer_types) + ["full_attention"]
    torch.manual_seed(seed)
    deeper = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # transformers initializes the 1 + w norms and gates at zero: make a wrong formula show
        for name, param in deeper.named_parameters():
            if name.endswith("norm.weight") or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    with tempfile.TemporaryDirectory() as tmp:
        deeper.save_pretrained(tmp)  # the checkpoint's own names (per-expert tensors), as a release has them
        saved = load_file(str(Path(tmp) / "model.safetensors"))
    p = f"model.layers.{layers}."
    block = {"mtp.layers.0." + name[len(p):]: t.clone() for name, t in saved.items() if name.startswith(p)}
    fc = torch.randn(h, 2 * h, generator=gen) * 0.2
    if accepting:
        fc = torch.cat([torch.eye(h), alpha * fc[:, h:]], 1)
        for name in block:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                block[name] = block[name] * alpha
    weights = load_file(str(folder / "model.safetensors"))
    weights.update(block)
    weights.update({"mtp.fc.weight": fc,
                    "mtp.pre_fc_norm_embedding.weight": 0.1 * torch.randn(h, generator=gen),
                    "mtp.pre_fc_norm_hidden.weight": 0.3 * torch.randn(h, generator=gen),
                    "mtp.norm.weight": 0.1 * torch.randn(h, generator=gen)})
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    return folder


# transformers' MtpModel names of a MiMo-V2-Flash MTP module (after layers.{k}.) and the release's (after
# model.mtp.layers.{k}.), where they differ
MIMO_MTP_RELEASE = (("mtp_block.self_attn.sinks", "self_attn.attention_sink_bias"),
                    ("mtp_block.post_attention_layernorm.", "pre_mlp_layernorm."), ("post_norm.", "final_layernorm."),
                    ("mtp_block.", ""))


def _renamed(name: str, pairs) -> str:
    return next((new + name[len(old):] for old, new in pairs if name.startswith(old)), name)


def mimo_mtp_model_name(release_name: str, k: int) -> str:
    """The release's ``model.mtp.layers.{k}.*`` name in transformers' ``MtpModel`` (``layers.{k}.*``)."""
    rest = release_name[len(f"model.mtp.layers.{k}."):]
    if rest.startswith(("enorm.", "hnorm.", "eh_proj.")):
        return f"layers.{k}.{rest}"
    renamed = _renamed(rest, [(theirs, ours) for ours, theirs in MIMO_MTP_RELEASE if theirs])
    return f"layers.{k}." + (renamed if renamed != rest else "mtp_block." + rest)


def mimo_mtp_model(target_dir: Path, num_modules: int):
    """transformers' ``MtpModel`` of ``num_modules`` MiMo-V2-Flash MTP modules over the target (its layers: a
    sliding-window layer with a dense MLP, as the release's), and the target model."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    hf.config.num_mtp_layers = num_modules
    hf.config.mtp_layer_types = ["sliding_attention"] * num_modules
    hf.config.mtp_mlp_layer_types = ["dense"] * num_modules
    return MtpModel(hf, num_modules).float().eval(), hf


def write_mimo_mtp(folder: Path, target_dir: Path, num_modules: int = 2, seed: int = 13, accepting: bool = True,
                   alpha: float = 0.1) -> Path:
    """A copy of a tiny MiMo-V2-Flash target's folder with ``num_modules`` MTP modules added as the release has them
    (``model.mtp.layers.{k}.``: ``enorm``, ``hnorm``, ``eh_proj``, ``final_layernorm``, ``input_layernorm``,
    ``pre_mlp_layernorm``, ``self_attn.*`` with its ``attention_sink_bias``, a dense ``mlp.*``), drawn as
    transformers' ``MtpModel`` initializes them, the norms and sinks made random. ``accepting``: ``eh_proj`` passes
    the token's embedding through and the block's outputs are scaled by ``alpha`` (as :func:`write_deepseek_mtp`)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(target_dir, folder, dirs_exist_ok=True)
    torch.manual_seed(seed)
    mtp, _ = mimo_mtp_model(target_dir, num_modules)
    gen = torch.Generator().manual_seed(seed)
    weights = load_file(str(folder / "model.safetensors"))
    h = mtp.config.hidden_size
    for name, tensor in mtp.state_dict().items():
        if not name.startswith("layers."):
            continue  # the embedding and head: the target's
        value = tensor.detach().clone()
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * torch.randn(value.shape, generator=gen)
        elif name.endswith("sinks"):
            value = 0.5 * torch.randn(value.shape, generator=gen)
        elif name.endswith("eh_proj.weight"):
            value = torch.randn(h, 2 * h, generator=gen) * 0.2
            if accepting:
                value = torch.cat([torch.eye(h), alpha * value[:, h:]], 1)
        elif accepting and name.endswith(("o_proj.weight", "down_proj.weight")):
            value = value * alpha
        k, rest = name.split(".")[1], name.split(".", 2)[2]
        weights[f"model.mtp.layers.{k}." + _renamed(rest, MIMO_MTP_RELEASE)] = value
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    return folder


def nemotron_mtp_blocks(config, block_weights: dict[str, torch.Tensor] | None = None, seed: int = 0):
    """transformers' two Nemotron-H blocks of a Nemotron 3 MTP module (attention, then experts) for ``config`` (the
    target's): random (norms, routers and correction biases too) or holding ``block_weights`` (the release's
    ``mtp.layers.{0,1}.norm / mixer.*`` names); and the release's names of their tensors (as transformers saves a
    model of those two layers)."""
    import copy
    import tempfile

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    config.num_hidden_layers, config.layers_block_type = 2, ["full_attention", "moe"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(0.5 + torch.rand(param.shape, generator=gen))
            elif name.endswith(".mixer.gate.weight"):
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=gen))
    with tempfile.TemporaryDirectory() as tmp:
        if block_weights is not None:  # the blocks' tensors into the model as a release would load them
            model.save_pretrained(tmp)
            saved = load_file(str(Path(tmp) / "model.safetensors"))
            saved.update({"backbone." + name[len("mtp."):]: t for name, t in block_weights.items()})
            from safetensors.torch import save_file

            save_file(saved, str(Path(tmp) / "model.safetensors"))
            model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
            return model.get_decoder().layers, None
        model.save_pretrained(tmp)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
    return model.get_decoder().layers, {"mtp." + name[len("backbone."):]: t for name, t in saved.items()
                                        if name.startswith("backbone.layers.")}


def write_nemotron_mtp(folder: Path, target_dir: Path, seed: int = 17, accepting: bool = True,
                       alpha: float = 0.1) -> Path:
    """A copy of a tiny Nemotron-H target's folder with Nemotron 3's MTP module added as its release has it:
    ``mtp.layers.0`` (``enorm``, ``hnorm``, ``eh_proj``, and an attention block: ``norm``, ``mixer.*``) and
    ``mtp.layers.1`` (an experts block as the target's, and ``final_layernorm``). ``accepting``: ``eh_proj`` passes
    the token's embedding through and the blocks' outputs are scaled by ``alpha`` (as :func:`write_deepseek_mtp`),
    and the copy's LM head (never tied in Nemotron-H) is made its embedding, so that the module drafts "the same token
    again" and the target falls into such loops (serve the copy for both outputs compared)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    shutil.copytree(target_dir, folder, dirs_exist_ok=True)
    config = AutoConfig.from_pretrained(target_dir)
    _, blocks = nemotron_mtp_blocks(config, seed=seed)
    h = config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    eh = torch.randn(h, 2 * h, generator=gen) * 0.2
    if accepting:
        eh = torch.cat([torch.eye(h), alpha * eh[:, h:]], 1)
        blocks = {k: v * alpha if k.endswith(("o_proj.weight", "down_proj.weight")) else v for k, v in blocks.items()}
    weights = load_file(str(folder / "model.safetensors"))
    weights.update(blocks)
    if accepting:
        weights["lm_head.weight"] = weights["backbone.embeddings.weight"].clone()
    weights.update({"mtp.layers.0.enorm.weight": 0.5 + torch.rand(h, generator=gen),
                    "mtp.layers.0.hnorm.weight": 0.5 + torch.rand(h, generator=gen),
                    "mtp.layers.0.eh_proj.weight": eh,
                    "mtp.layers.1.final_layernorm.weight": 0.5 + torch.rand(h, generator=gen)})
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    raw = json.loads((folder / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    return folder


# one drafter of each kind: host lookups (chains, a suffix tree), a draft model, a head reading the target's states
DRAFTER_KINDS = ("ngram", "suffix", "draft_model", "eagle3")


def speculative_config(kind: str, target_dir: Path, draft_dir: Path, folder: Path) -> dict:
    """A speculative_config of ``kind`` (:data:`DRAFTER_KINDS`) for the tiny target in ``target_dir``: the draft
    model in ``draft_dir``, an often-accepted EAGLE-3 head written into ``folder``."""
    if kind == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4}
    if kind == "suffix":
        return {"method": "suffix", "num_speculative_tokens": 6}
    if kind == "draft_model":
        return {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3}
    assert kind == "eagle3", kind
    head = write_accepting_head(folder / "eagle3", "eagle3", target_dir)
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}


def record_head_rows(monkeypatch, rope: bool = False) -> list[tuple]:
    """Has every pass of a draft head record what its layer reads: (the pass's positions, its rope positions where
    ``rope``, the fused rows' embeddings [T, H] on the host) per pass. A pass a CUDA graph capture records is left
    out (its replays run no Python; reading positions back during a capture would fail)."""
    from specray.models.draft_head import DraftHead

    seen, current = [], {}
    forward, fuse = DraftHead.forward, DraftHead.fuse

    def remember(self, input_ids, features, meta):
        current["capturing"] = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if not current["capturing"]:
            current["row"] = (meta.positions.tolist(),) + ((None if meta.rope_positions is None else
                                                            meta.rope_positions.tolist(),) if rope else ())
        return forward(self, input_ids, features, meta)

    def record(self, e, features):  # what the head's layer reads for each row's token
        if not current["capturing"]:
            seen.append((*current["row"], e.detach().to("cpu", copy=True)))
        return fuse(self, e, features)

    monkeypatch.setattr(DraftHead, "forward", remember)
    monkeypatch.setattr(DraftHead, "fuse", record)
    return seen
