"""Hidden-state heads drafting for vision-language targets on requests with images: Qwen3.5's own MTP layer (a hybrid
target whose gated attention rotates a partial, interleaved multimodal RoPE). The head's row of position p reads the
token at p + 1: where that is an image's token it takes the target's embedding of it (the image's row), and a head
whose RoPE is multimodal takes the target's position ids; greedy output equals plain greedy output (lossless).
(EAGLE-1 / EAGLE-3 over LLaVA and Qwen2-VL, and over Apertus 1.5's image codes: tests/test_multimodal.py,
tests/test_qwen2_vl_images.py, tests/test_apertus1p5_images.py.)"""

from __future__ import annotations

import json

import torch

from specray import LLM, SamplingParams
from specray_test_draft_heads import record_head_rows  # tests/draft_heads.py


def _with_mtp_layer(folder, tmp_path):
    """The release in ``folder`` with a Qwen3.5 MTP layer (``mtp.*``) added, written as tests/draft_heads.py writes
    one for the text model."""
    from safetensors.torch import load_file, save_file
    from specray_test_draft_heads import write_qwen_mtp  # tests/draft_heads.py

    text = tmp_path / "text"
    text.mkdir()
    config = json.loads((folder / "config.json").read_text())["text_config"]
    (text / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3_5ForCausalLM"]}))
    save_file({}, str(text / "model.safetensors"))
    mtp = load_file(str(write_qwen_mtp(tmp_path / "mtp", text) / "model.safetensors"))
    weights = load_file(str(folder / "model.safetensors"))
    save_file({**weights, **{k: v for k, v in mtp.items() if k.startswith("mtp.")}}, str(folder / "model.safetensors"))
    return folder


def test_qwen3_5_mtp_layer_reads_image_rows_and_positions(tmp_path, monkeypatch):
    from tests.test_qwen3_5_images import build_release, images, prompt_ids

    folder, hf = build_release("qwen3_5", tmp_path / "release", seed=0)
    folder = _with_mtp_layer(folder, tmp_path)
    prompt = {"prompt_token_ids": prompt_ids(folder), "multi_modal_data": {"image": images()}}
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    kw = dict(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=16)
    want = LLM(**kw).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    seen = record_head_rows(monkeypatch, rope=True)
    llm = LLM(**kw, speculative_config={"method": "mtp", "num_speculative_tokens": 2, "adaptive": False})
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want and llm.spec_stats.draft_tokens > 0
    from specray.multimodal import expand_prompt
    from tests.test_qwen3_5_images import hf_processor

    # the request's prompt, positions and image rows as its processor made them, the rows from transformers' tower
    ids, inputs = expand_prompt(prompt["prompt_token_ids"], images(), llm._image_processor)
    assert ids == out.prompt_token_ids and inputs.rope_delta != 0
    batch = hf_processor(folder)(text=[llm.get_tokenizer().decode(prompt["prompt_token_ids"])], images=images(),
                                 return_tensors="pt")
    with torch.no_grad():
        hf_rows = torch.cat(list(hf.model.get_image_features(batch["pixel_values"],
                                                             batch["image_grid_thw"]).pooler_output))
        want_rows = hf.get_input_embeddings()(torch.tensor(ids))
    image_rows = [p for item in inputs.items for p in range(item.offset, item.end)]
    want_rows[image_rows] = hf_rows
    rows_checked = past = 0
    for positions, rope, e in seen:
        assert rope is not None  # the request has a position table: every pass of its head takes its ids
        for j, p in enumerate(positions):
            expect = [axis[p] for axis in inputs.rope_positions] if p < len(ids) else [p + inputs.rope_delta] * 3
            assert [axis[j] for axis in rope] == expect, (p, j)
            past += p >= len(ids)
            if p + 1 < len(ids):
                torch.testing.assert_close(e[j], want_rows[p + 1], atol=1e-4, rtol=1e-4)
                rows_checked += p + 1 in image_rows
    assert rows_checked == len(image_rows) and past > 0
