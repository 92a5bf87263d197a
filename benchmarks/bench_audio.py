"""What an audio costs: a Qwen2-Audio-shaped release (a Whisper-base-sized encoder: 80 mel bins, 6 layers of 512,
30 s windows of 3,000 frames, its average pool; SmolLM2-135M's text model) with random weights
(``load_format="dummy"``), on this machine's device.

For audios of a few lengths it reports, as medians over ``--runs``:

* the host's preparation of one audio (transformers' Whisper feature extractor over its 30 s window and the prompt's
  expansion),
* the encoder's pass over it as specray runs it (the window's valid rows only, its padded frames cut) and over the
  whole padded window (every frame computed, as transformers' model computes it, the padding masked as keys: same
  rows out),
* the time to the first token of a prompt holding the audio against a text prompt of as many tokens.

Prefix caching is off: every run prefills its whole prompt and encodes its audio.

    PYTHONSAFEPATH=1 python benchmarks/bench_audio.py --threads 2
    PYTHONSAFEPATH=1 python benchmarks/bench_audio.py --device cuda --dtype bfloat16   # a GPU session

Random weights: the tokens mean nothing, so speculation's acceptance after audio prompts is not measured here.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

TEXT = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
            vocab_size=49280, tie_word_embeddings=True)
AUDIO = dict(model_type="qwen2_audio_encoder", d_model=512, encoder_layers=6, encoder_attention_heads=8,
             encoder_ffn_dim=2048, num_mel_bins=80, max_source_positions=1500)
SPECIALS = ("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")
RATE = 16000


def write_release(out: Path) -> Path:
    """config.json, the default model's tokenizer with the audio tokens, Qwen2AudioProcessor's feature extractor."""
    from transformers import AutoTokenizer, Qwen2AudioConfig, WhisperFeatureExtractor

    from specray.default_model import default_model_path
    from specray.models.loader import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model(default_model_path(), weights=False).path))
    tok.add_special_tokens({"additional_special_tokens": list(SPECIALS)})
    tok.save_pretrained(out)
    ids = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    Qwen2AudioConfig(audio_config=AUDIO, text_config={**TEXT, **ids, "model_type": "qwen2"},
                     audio_token_index=tok.convert_tokens_to_ids("<|AUDIO|>"),
                     architectures=["Qwen2AudioForConditionalGeneration"]).save_pretrained(out)
    WhisperFeatureExtractor(feature_size=AUDIO["num_mel_bins"]).save_pretrained(out)
    return out


def median_ms(fn, runs: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seconds", default="2,10,30", help="audio lengths, comma-separated (at most 30)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from specray import LLM, SamplingParams
    from specray.models.loader import engine_image_processor
    from specray.multimodal import expand_prompt

    rows: list[tuple[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_release(Path(tmp))
        llm = LLM(model=str(folder), load_format="dummy", device=args.device, dtype=args.dtype, max_model_len=2048,
                  enable_prefix_caching=False)  # every run computes its prompt (and encodes its audio) anew
        encoder = llm.engine.executor.worker.runner.encoder
        tok = llm.get_tokenizer()
        processor = engine_image_processor(llm.engine_args)
        prompt = "Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\nWhat does this audio say?"
        rng = np.random.default_rng(0)

        def first_token(request) -> None:
            llm.generate([request], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)

        for seconds in map(float, args.seconds.split(",")):
            wave = (0.1 * rng.standard_normal(int(seconds * RATE))).astype(np.float32)
            ids, mm = expand_prompt(tok.encode(prompt), [], processor, audios=[wave])
            data = {name: torch.from_numpy(a).to(args.device, dtype=getattr(torch, args.dtype)
                                                 if np.issubdtype(a.dtype, np.floating) else None)
                    for name, a in mm.items[0].data.items()}
            whole = [encoder.tower.frames]  # every frame of the window computed (transformers' model)
            text = {"prompt_token_ids": [int(t) for t in rng.integers(100, 49000, len(ids))]}
            audio = {"prompt": prompt, "multi_modal_data": {"audio": wave}}
            label = f"{seconds:g} s ({mm.items[0].length} audio tokens, {len(ids)} in the prompt)"
            rows += [(f"prepare one audio of {label} (host)",
                      median_ms(lambda: expand_prompt(tok.encode(prompt), [], processor, audios=[wave]), args.runs)),
                     ("encode it, valid rows only (specray)", median_ms(lambda: encoder.encode(data), args.runs)),
                     ("encode it, the whole padded window (transformers' way)",
                      median_ms(lambda: encoder.tower(data["input_features"], whole), args.runs)),
                     ("first token, text prompt of as many tokens", median_ms(lambda: first_token(text), args.runs)),
                     ("first token, the audio prompt", median_ms(lambda: first_token(audio), args.runs))]
        llm.shutdown()
    print(f"# {platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}, "
          f"{args.device} {args.dtype}")
    print("| what | ms |\n| --- | ---: |")
    for name, ms in rows:
        print(f"| {name} | {ms:.1f} |")


if __name__ == "__main__":
    main()
