"""What an image costs: a SmolVLM-256M-shaped release (SigLIP-B/16 tower at 512 pixels, pixel shuffle by 4: 64
image tokens; SmolLM2-135M's text model) with random weights (``load_format="dummy"``), on this machine's device.

For one image without splitting it reports, as medians over ``--runs``:

* the host's preparation of one image (transformers' image processor and the prompt's expansion),
* the vision encoder's pass over it (the runner's ``encoder.encode``),
* the time to the first token of a prompt holding the image against a text prompt of as many tokens (the difference
  is what the image adds to a prefill: preparation, encoding, the eager step),
* the decode milliseconds per token after each prompt (an image costs the decode steps nothing).

Prefix caching is off: every run prefills its whole prompt and encodes its image.

    PYTHONSAFEPATH=1 python benchmarks/bench_images.py --threads 2
    PYTHONSAFEPATH=1 python benchmarks/bench_images.py --device cuda --dtype bfloat16   # a GPU session

Random weights: the tokens mean nothing, so speculation's acceptance after image prompts is not measured here.
"""

from __future__ import annotations

import argparse
import json
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
VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, patch_size=16,
              image_size=512)
SCALE, SEQ = 4, 64  # (512 / 16)^2 patches folded 4 x 4 into 64 tokens
TOKENS = ("<image>", "<fake_token_around_image>", "<global-img>")


def write_release(out: Path) -> Path:
    """config.json, the default model's tokenizer with the image tokens, the image processor (no splitting)."""
    from transformers import AutoTokenizer, SmolVLMConfig, SmolVLMImageProcessorPil

    from specray.default_model import default_model_path
    from specray.models.loader import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model(default_model_path(), weights=False).path))
    tok.add_special_tokens({"additional_special_tokens": list(TOKENS)})
    tok.save_pretrained(out)
    ids = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    SmolVLMConfig(text_config={**TEXT, **ids}, vision_config=VISION, scale_factor=SCALE,
                  image_token_id=tok.convert_tokens_to_ids("<image>"),
                  architectures=["SmolVLMForConditionalGeneration"]).save_pretrained(out)
    size = {"longest_edge": VISION["image_size"]}
    SmolVLMImageProcessorPil(do_image_splitting=False, size=size, max_image_size=size).save_pretrained(out)
    (out / "processor_config.json").write_text(json.dumps({"image_seq_len": SEQ, "processor_class":
                                                           "SmolVLMProcessor"}))
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
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from PIL import Image

    from specray import LLM, SamplingParams
    from specray.models.loader import engine_image_processor
    from specray.multimodal import expand_prompt

    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8))
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_release(Path(tmp))
        llm = LLM(model=str(folder), load_format="dummy", device=args.device, dtype=args.dtype, max_model_len=1024,
                  enable_prefix_caching=False)  # every run computes its prompt (and encodes its image) anew
        runner = llm.engine.executor.worker.runner
        tok = llm.get_tokenizer()
        prompt = "User:<image>Describe this picture in a few words.\nAssistant:"
        processor = engine_image_processor(llm.engine_args)
        ids, mm = expand_prompt(tok.encode(prompt), [image], processor)
        data = {name: torch.from_numpy(a).to(args.device, dtype=getattr(torch, args.dtype)
                                             if np.issubdtype(a.dtype, np.floating) else None)
                for name, a in mm.items[0].data.items()}
        rng = np.random.default_rng(1)
        text_ids = [int(t) for t in rng.integers(100, 49000, len(ids))]  # a text prompt of as many tokens

        def first_token(request) -> None:
            llm.generate([request], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)

        def decode(request) -> float:
            start = time.perf_counter()
            llm.generate([request], SamplingParams(max_tokens=1 + args.decode_tokens, temperature=0.0,
                                                   ignore_eos=True), use_tqdm=False)
            return time.perf_counter() - start

        with_image = {"prompt": prompt, "multi_modal_data": {"image": image}}
        text = {"prompt_token_ids": text_ids}
        rows = {"prepare one image (host)": median_ms(lambda: expand_prompt(tok.encode(prompt), [image], processor),
                                                      args.runs),
                "encode one image": median_ms(lambda: runner.encoder.encode(data), args.runs),
                f"first token, text prompt ({len(ids)} tokens)": median_ms(lambda: first_token(text), args.runs),
                f"first token, image prompt ({len(ids)} tokens, {SEQ} of the image)":
                    median_ms(lambda: first_token(with_image), args.runs)}
        for name, request in (("text", text), ("image", with_image)):
            total = statistics.median(decode(request) for _ in range(args.runs))
            rows[f"decode ms / token after the {name} prompt"] = (
                1000 * (total - rows[[k for k in rows if k.startswith(f"first token, {name}")][0]] / 1000)
                / args.decode_tokens)
        llm.shutdown()
    print(f"# {platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}, "
          f"{args.device} {args.dtype}")
    print("| what | ms |\n| --- | ---: |")
    for name, ms in rows.items():
        print(f"| {name} | {ms:.1f} |")


if __name__ == "__main__":
    main()
