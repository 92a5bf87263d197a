"""Images in prompts through the engine (specray.multimodal), independent of any vision family: a stand-in encoder
and processor over the tiny Llama. The engine's greedy output with images must equal transformers' greedy
``generate`` over the same ``inputs_embeds``, with chunked prefill splitting image spans, n-gram drafts, prefix
caching (a prompt that differs only in its image must not reuse the other's blocks) and preemption; plus the
pieces: prompt expansion, image loading, content parts."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import wave

import numpy as np
import pytest
import torch
from torch import nn

import specray.engine.builder as builder
import specray.models.loader as loader
from specray import LLM, SamplingParams
from specray.chat import split_media
from specray.config import EngineArgs
from specray.multimodal import (MAX_IMAGE_BYTES, MultiModalInputs, MultiModalItem, ProcessedImage, expand_prompt,
                                images_of, load_image, load_video, media_of, step_rows)

IMAGE_TOKEN = 7  # the placeholder id of the stand-in processor
BREAK_TOKEN = 9  # a token inside an image's span that takes no embedding (Pixtral's row breaks)


class StandInProcessor:
    """Each image: 6 rows of 3 pixel values; with ``breaks``, a break token after every 3 rows (no embedding)."""

    image_token_id = IMAGE_TOKEN
    breaks = False

    @classmethod
    def from_pretrained(cls, folder, config):
        return cls()

    def process(self, image) -> ProcessedImage:
        from PIL import Image

        pixels = np.asarray(image.convert("RGB").resize((2, 3), Image.NEAREST), dtype=np.float32).reshape(6, 3)
        pixels = (pixels / 255.0 - 0.5) * 4
        image = self.image_token_id
        if not self.breaks:
            return ProcessedImage([image] * 6, {"pixels": pixels})
        replacement = [image] * 3 + [BREAK_TOKEN] + [image] * 3 + [BREAK_TOKEN]
        return ProcessedImage(replacement, {"pixels": pixels}, embed_rows=[0, 1, 2, 4, 5, 6])

    def rope_positions(self, token_ids, items):
        return None


class BreakProcessor(StandInProcessor):
    breaks = True


class StandInEncoder(nn.Module):
    """pixels [6, 3] -> [6, hidden]: a fixed random projection (the same in every process that builds it)."""

    def __init__(self, config):
        super().__init__()
        g = torch.Generator().manual_seed(1234)
        self.proj = nn.Parameter(torch.randn(3, config.hidden_size, generator=g, device="cpu").to(  # (a host seed)
            torch.get_default_device(), torch.get_default_dtype()))

    def load_weights(self, weights) -> None:
        for _ in weights:  # its weights are its own
            pass

    def encode(self, data):
        return data["pixels"] @ self.proj


def _image(seed: int, size=(5, 4)):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def vision(monkeypatch):
    """The tiny Llama served as a vision-language model with the stand-in classes; yields a setter for the
    processor class."""
    classes = {"processor": StandInProcessor}

    def multimodal_classes(config):
        return StandInEncoder, classes["processor"]

    monkeypatch.setattr(loader, "multimodal_classes", multimodal_classes)
    monkeypatch.setattr(builder, "multimodal_classes", multimodal_classes)
    return classes


def _reference(folder, ids: list[int], mm: MultiModalInputs | None, max_tokens: int) -> list[int]:
    """transformers' greedy tokens from the prompt's embeddings with the images' rows in place."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    encoder = StandInEncoder(AutoConfig.from_pretrained(folder))
    with torch.no_grad():
        embeds = model.get_input_embeddings()(torch.tensor([ids]))
        for item in mm.items if mm is not None else ():
            rows = [item.offset + r for r in (range(item.length) if item.embed_rows is None else item.embed_rows)]
            embeds[0, rows] = encoder.encode({"pixels": torch.from_numpy(item.data["pixels"])})
        out = model.generate(inputs_embeds=embeds, attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens)
    return out[0].tolist()


# token ids of the tiny tokenizer's "The quick brown fox" and "def add(a, b):" with placeholders among them
PROMPT_A = [304, 223, IMAGE_TOKEN, 83, 87, 75, 309, 263, 84, 269, 80, 290, 90]
PROMPT_B = [294, IMAGE_TOKEN, 260, 310, IMAGE_TOKEN, 10, 67, 14, 263]


def test_expand_prompt_places_each_image_and_keys_blocks_by_content():
    processor = StandInProcessor()
    ids, mm = expand_prompt(PROMPT_B, [_image(1), _image(2)], processor)
    assert [(i.offset, i.length) for i in mm.items] == [(1, 6), (9, 6)]
    assert ids == [294] + [IMAGE_TOKEN] * 6 + [260, 310] + [IMAGE_TOKEN] * 6 + [10, 67, 14, 263]
    assert mm.items[0].hash != mm.items[1].hash
    _, again = expand_prompt(PROMPT_B, [_image(1), _image(2)], processor)
    assert [i.hash for i in again.items] == [i.hash for i in mm.items]
    keys = mm.cache_keys(ids)
    assert keys[1] == ("image", mm.items[0].hash) and keys[9] == ("image", mm.items[1].hash)
    assert keys[2:9] == ids[2:9]
    with pytest.raises(ValueError, match="2 image placeholder token.*but 1 image"):
        expand_prompt(PROMPT_B, [_image(1)], processor)
    with pytest.raises(ValueError, match="only \\['image', 'video', 'audio'\\] are supported"):
        images_of({"speech": [1]})


def test_step_rows_cover_a_span_split_over_chunks():
    item = MultiModalItem("image", offset=4, length=8, hash="h", data={}, embed_rows=[0, 1, 2, 4, 5, 6])
    seen = []
    for start in range(0, 16, 3):
        positions, indices = step_rows(item, start, start + 3)
        assert all(start <= p < start + 3 for p in positions)
        seen += list(zip(positions, indices))
    assert seen == [(4, 0), (5, 1), (6, 2), (8, 3), (9, 4), (10, 5)]


def test_load_image_sources(tmp_path):
    image = _image(3)
    data = _png(image)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    for source in (image, data, url):
        assert np.array_equal(np.asarray(load_image(source)), np.asarray(image))
    path = tmp_path / "a.png"
    path.write_bytes(data)
    assert np.array_equal(np.asarray(load_image(str(path))), np.asarray(image))
    with pytest.raises(ValueError, match="data: URL"):
        load_image(str(path), local=False)  # a server's client never reads the server's files
    with pytest.raises(ValueError, match="could not be decoded"):
        load_image(b"not an image")
    with pytest.raises(ValueError, match="invalid base64"):
        load_image("data:image/png;base64,@@@")


def test_load_image_fetches_http_urls_within_limits(monkeypatch):
    body = _png(_image(4))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/away":  # a redirect to another host
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/a.png")
                self.end_headers()
                return
            payload = body if self.path == "/a.png" else b"x" * 64
            self.send_response(200 if self.path != "/missing" else 404)
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert np.array_equal(np.asarray(load_image(f"{base}/a.png", local=False)), np.asarray(_image(4)))
        with pytest.raises(ValueError, match="could not be fetched"):
            load_image(f"{base}/missing", local=False)
        assert load_image(f"{base}/a.png", local=False, domains={"127.0.0.1"}).size == _image(4).size
        with pytest.raises(ValueError, match="host '127.0.0.1' is not among .* allowed media domains"):
            load_image(f"{base}/a.png", local=False, domains={"example.com"})
        with pytest.raises(ValueError, match="host 'localhost' is not among"):
            load_image(f"{base}/away", local=False, domains={"127.0.0.1"})
        assert load_image(f"{base}/away", local=False).size == _image(4).size  # any host: the redirect is followed
        monkeypatch.setattr("specray.multimodal.MAX_IMAGE_BYTES", 32)
        with pytest.raises(ValueError, match="more than 32 bytes"):
            load_image(f"{base}/big", local=False)
    finally:
        server.shutdown()
    assert MAX_IMAGE_BYTES > 1 << 20


def test_split_media_pairs_placeholders_with_images_and_videos_in_order():
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "image_url", "image_url": {"url": "data:x"}},
                                             {"type": "video_url", "video_url": {"url": "data:v"}},
                                             {"type": "image_url", "image_url": "http://h/b.png"}]},
                {"role": "assistant", "content": "ok"}]
    out, media = split_media(messages)
    assert media == {"image": ["data:x", "http://h/b.png"], "video": ["data:v"], "audio": []}
    assert out[0]["content"] == [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "video"},
                                 {"type": "image"}]
    assert out[1] is messages[1] and messages[0]["content"][1]["type"] == "image_url"
    with pytest.raises(ValueError, match="content\\[0\\].image_url"):
        split_media([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(ValueError, match="content\\[0\\].video_url must hold the video's URL"):
        split_media([{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}])


@pytest.mark.parametrize("processor", [StandInProcessor, BreakProcessor], ids=["all-rows", "break-rows"])
def test_engine_with_images_equals_transformers(tiny_llama_dir, vision, processor):
    """Greedy with n-gram drafts, prefill chunks of 5 tokens (every image span split), prefix caching: each output
    equals transformers' over the same embeddings; the second round, the first prompt again with another image, gets
    its own output, and the third, the first prompt and image again, finds its blocks cached."""
    vision["processor"] = processor
    llm = LLM(model=str(tiny_llama_dir), max_model_len=128, block_size=4, max_num_batched_tokens=5,
              enable_prefix_caching=True, enforce_eager=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3, "adaptive": False})
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = [{"prompt_token_ids": PROMPT_A, "multi_modal_data": {"image": _image(10)}},
             {"prompt_token_ids": PROMPT_B, "multi_modal_data": {"image": [_image(11), _image(12, (7, 3))]}},
             {"prompt_token_ids": PROMPT_A[:2] + PROMPT_A[3:]}]
    rounds = [first, [{"prompt_token_ids": PROMPT_A, "multi_modal_data": {"image": _image(13)}}], first[:1]]
    outputs = []
    for prompts in rounds:
        outs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            images = images_of(prompt.get("multi_modal_data", {}))
            ids, mm = expand_prompt(prompt["prompt_token_ids"], images, processor())
            assert out.prompt_token_ids == ids
            assert out.outputs[0].token_ids == _reference(tiny_llama_dir, ids, mm if images else None, 12)
            outputs.append(out)
    assert outputs[0].outputs[0].token_ids != outputs[3].outputs[0].token_ids  # the image changes the output
    assert outputs[4].num_cached_tokens >= 8  # its own blocks, image included, cached by the first round
    assert outputs[3].num_cached_tokens == 0  # no block holding another image's rows (its first block has one)
    assert llm.spec_stats.accepted_tokens > 0


class BothWaysProcessor(StandInProcessor):
    """Images whose tokens attend to each other both ways (Gemma 3's)."""

    def process(self, image) -> ProcessedImage:
        done = super().process(image)
        done.bidirectional = True
        return done


def _reference_both_ways(folder, ids: list[int], mm: MultiModalInputs, max_tokens: int
                         ) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs, one full forward per token, each image's rows seeing each
    other (a 4D mask)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    encoder = StandInEncoder(AutoConfig.from_pretrained(folder))
    out, logprobs = [], []
    with torch.no_grad():
        embeds = model.get_input_embeddings()(torch.tensor([ids]))
        for item in mm.items:
            embeds[0, item.offset:item.end] = encoder.encode({"pixels": torch.from_numpy(item.data["pixels"])})
        for _ in range(max_tokens):
            n = embeds.shape[1]
            allowed = torch.ones(n, n, dtype=torch.bool).tril()
            for item in mm.items:
                allowed[item.offset:item.end, item.offset:item.end] = True
            logits = model(inputs_embeds=embeds, attention_mask=allowed[None, None]).logits[0, -1]
            token = int(logits.argmax())
            out.append(token)
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            embeds = torch.cat((embeds, model.get_input_embeddings()(torch.tensor([[token]]))), dim=1)
    return out, logprobs


def test_images_seen_both_ways_are_never_split(tiny_llama_dir, vision):
    """Images whose tokens see each other: chunks of at most 7 tokens stop before an image and take it whole (or,
    after cached blocks that end inside one, the rest of it), and the outputs are transformers' under that mask;
    the mask matters (a causal image's logprobs differ); an image longer than a step is refused."""
    vision["processor"] = BothWaysProcessor
    llm = LLM(model=str(tiny_llama_dir), max_model_len=128, block_size=4, max_num_batched_tokens=7,
              enable_prefix_caching=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                              "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": PROMPT_A, "multi_modal_data": {"image": _image(50)}},
               {"prompt_token_ids": PROMPT_B, "multi_modal_data": {"image": [_image(51), _image(52)]}},
               {"prompt_token_ids": PROMPT_A[:3], "multi_modal_data": {"image": _image(53)}}]
    for round_ in range(2):  # the second: every prompt from cached blocks (the last one's end inside its image)
        outs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            ids, mm = expand_prompt(prompt["prompt_token_ids"], images_of(prompt["multi_modal_data"]),
                                    BothWaysProcessor())
            tokens, logprobs = _reference_both_ways(tiny_llama_dir, ids, mm, 8)
            assert out.outputs[0].token_ids == tokens
            got = [entry[t].logprob for entry, t in zip(out.outputs[0].logprobs, tokens)]
            assert np.allclose(got, logprobs, atol=1e-4), (got, logprobs)
            assert not round_ or out.num_cached_tokens > 0
    assert outs[2].num_cached_tokens == 4  # its image spans positions 2-7: the rest computed after a cached block
    causal = LLM(model=str(tiny_llama_dir), max_model_len=128)
    vision["processor"] = StandInProcessor
    gaps = [abs(plain.outputs[0].logprobs[0][t].logprob - seen.outputs[0].logprobs[0][t].logprob)
            for plain, seen in zip(causal.generate(prompts, params, use_tqdm=False), outs)
            for t in [seen.outputs[0].token_ids[0]]]
    assert max(gaps) > 5e-4, gaps  # five times the tolerance the comparison with transformers holds
    vision["processor"] = BothWaysProcessor
    small = LLM(model=str(tiny_llama_dir), max_model_len=128, max_num_batched_tokens=5)
    with pytest.raises(ValueError, match="takes 6 tokens, computed in one step.*more than a step computes"):
        small.generate(prompts[0], params, use_tqdm=False)


def test_preempted_requests_embed_their_images_again(tiny_llama_dir, vision):
    """A KV cache too small for every request at once: preempted requests recompute their prompts, images included,
    and still give transformers' tokens."""
    llm = LLM(model=str(tiny_llama_dir), max_model_len=64, block_size=4, num_kv_blocks=14, max_num_batched_tokens=8)
    prompts = [{"prompt_token_ids": PROMPT_B, "multi_modal_data": {"image": [_image(30 + i), _image(40 + i)]}}
               for i in range(3)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        ids, mm = expand_prompt(PROMPT_B, prompt["multi_modal_data"]["image"], StandInProcessor())
        assert out.outputs[0].token_ids == _reference(tiny_llama_dir, ids, mm, 16)
    assert not llm.engine.executor.worker.runner.image_embeds  # nothing kept past the requests


def test_sampled_and_structured_requests_with_images(tiny_llama_dir, vision):
    """With images too: a seeded sampled request with n-gram drafts gives what decoding without speculation gives
    (lookup drafts have no q: the seeded stream is the target's), and a request held to a choice answers one of
    them (its grammar masks the steps after an image prompt)."""
    from specray import StructuredOutputsParams

    prompts = [{"prompt_token_ids": PROMPT_A, "multi_modal_data": {"image": _image(60)}},
               {"prompt_token_ids": PROMPT_B, "multi_modal_data": {"image": [_image(61), _image(62)]}}]
    sampled = SamplingParams(temperature=0.5, seed=7, max_tokens=16, ignore_eos=True)
    plain = LLM(model=str(tiny_llama_dir), max_model_len=128, block_size=4, max_num_batched_tokens=9)
    drafted = LLM(model=str(tiny_llama_dir), max_model_len=128, block_size=4, max_num_batched_tokens=9,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                      "prompt_lookup_max": 3, "adaptive": False})
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sampled, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in drafted.generate(prompts, sampled, use_tqdm=False)] == want
    assert drafted.spec_stats.draft_tokens > 0
    greedy = [o.outputs[0].token_ids for o in plain.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16,
                                                                                     ignore_eos=True), use_tqdm=False)]
    assert want != greedy  # the draws are samples, not the argmax
    choices = ["red", "green", "blue"]
    held = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=choices))
    assert all(o.outputs[0].text in choices for o in drafted.generate(prompts, held, use_tqdm=False))


def test_images_refused_where_not_served(tiny_llama_dir, vision):
    """A prompt with images where they cannot be served, placeholders without their images (no multi_modal_data, or
    no image in it), an empty image: a ValueError saying so."""
    from PIL import Image

    llm = LLM(model=str(tiny_llama_dir), max_model_len=64)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate({"prompt_token_ids": PROMPT_A, "multi_modal_data": {"image": _image(1)}},
                     SamplingParams(max_tokens=2, truncate_prompt_tokens=4), use_tqdm=False)
    for prompt in ({"prompt_token_ids": PROMPT_A}, {"prompt_token_ids": PROMPT_A, "multi_modal_data": {"image": []}}):
        with pytest.raises(ValueError, match="holds 1 image placeholder token.*but 0 image.*send the images in"):
            llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    for size in ((0, 0), (5, 0)):
        with pytest.raises(ValueError, match=f"the image is {size[0]}x{size[1]} pixels, empty"):
            llm.generate({"prompt_token_ids": PROMPT_A, "multi_modal_data": {"image": Image.new("RGB", size)}},
                         SamplingParams(max_tokens=2), use_tqdm=False)


def test_text_model_refuses_images(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=64)
    with pytest.raises(ValueError, match="reads text only"):
        llm.generate({"prompt_token_ids": PROMPT_A, "multi_modal_data": {"image": _image(1)}},
                     SamplingParams(max_tokens=2), use_tqdm=False)


# a chat template that renders an image part as the placeholder token
IMAGE_TEMPLATE = ("{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
                  "{% if p.type == 'image' %}<image>{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}"
                  "{% endfor %}")


class ChatProcessor(StandInProcessor):
    image_token_id = 3  # "<image>": the tiny tokenizer's fourth special token


@pytest.fixture(scope="module")
def image_chat_dir(tmp_path_factory):
    from tests.conftest import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama_images"), "llama", extra_special_tokens=("<image>",))


def test_server_chat_with_image_url_equals_llm_chat(image_chat_dir, vision):
    """An OpenAI chat request with an image_url part (a data: URL) answers what LLM.chat answers for the same
    messages (which the engine test above ties to transformers); a bad image is a 400 naming messages."""
    pytest.importorskip("uvicorn")  # (the server's; not in a GPU image)
    from specray_test_openai_helpers import chat_equals, http_json, serving  # tests/openai_helpers.py

    from specray.cluster.openai_app import AsyncEngineClient, ServerConfig, build_openai_app
    from specray.engine.async_engine import AsyncLLMEngine

    vision["processor"] = ChatProcessor
    url = "data:image/png;base64," + base64.b64encode(_png(_image(21))).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "The quick"},
                                             {"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": " brown fox"}]}]
    llm = LLM(model=str(image_chat_dir), max_model_len=64)
    assert llm.get_tokenizer().convert_tokens_to_ids("<image>") == ChatProcessor.image_token_id
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = llm.chat(messages, params, use_tqdm=False, chat_template=IMAGE_TEMPLATE)[0]
    assert want.prompt_token_ids.count(ChatProcessor.image_token_id) == 6
    without = llm.chat([{"role": "user", "content": "The quick brown fox"}], params, use_tqdm=False,
                       chat_template=IMAGE_TEMPLATE)[0]
    assert want.outputs[0].token_ids != without.outputs[0].token_ids
    until_eos = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False,
                         chat_template=IMAGE_TEMPLATE)[0].outputs[0].text

    aengine = AsyncLLMEngine(llm.engine)
    app = build_openai_app(AsyncEngineClient(aengine, image_processor=ChatProcessor()),
                           ServerConfig("tiny", chat_template=IMAGE_TEMPLATE))
    try:
        with serving(app) as base:
            chat, body = chat_equals(base, messages, want)
            responses = {"model": "tiny", "temperature": 0, "max_output_tokens": 8, "store": False,
                         "input": [{"role": "user", "content": [{"type": "input_text", "text": "The quick"},
                                                                {"type": "input_image", "image_url": url},
                                                                {"type": "input_text", "text": " brown fox"}]}]}
            status, got = http_json(f"{base}/v1/responses", responses)
            assert status == 200, got
            assert got["output"][-1]["content"][0]["text"] == until_eos
            part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
            status, err = http_json(chat, {**body, "messages": [{"role": "user", "content": [part]}]})
            assert status == 400 and err["error"]["param"] == "messages", err
            assert "could not be decoded" in err["error"]["message"]
            audio = {**body, "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}
            status, err = http_json(chat, audio)
            assert status == 400 and "input_audio" in err["error"]["message"]
            status, err = http_json(chat, {**body, "messages": [{"role": "user", "content": "The <image> fox"}]})
            assert status == 400 and err["error"]["param"] == "messages", err  # a placeholder without its image
            assert "1 image placeholder token(s) (id 3) but 0 image(s)" in err["error"]["message"]
    finally:
        aengine.shutdown()


@pytest.fixture(scope="module")
def tiny_llava_dir(tmp_path_factory):
    from tests.test_llava import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.mktemp("tiny_llava_ray"), "clip")


@pytest.mark.usefixtures("ray_cluster")
# (two tensor-parallel ranks with images: each family's own test, in process; over Ray the plan carries the images
# alike to stages and to ranks)
@pytest.mark.parametrize("parallel", [{"pipeline_parallel_size": 2}],
                         ids=["pp2-ray"])  # ("-ray]": run in the Ray tests' worker, tests/conftest.py)
def test_images_over_ray_ranks_equal_one_rank(tiny_llava_dir, parallel):
    """A real vision-language family (LLaVA) over two Ray ranks: the requests' images cross to every rank with the
    plan, each rank of the first stage encodes them, and the greedy tokens equal one in-process rank's."""
    from tests.test_llava import _images

    prompts = [{"prompt": "USER: <image>\nWhat is this? ASSISTANT:", "multi_modal_data": {"image": image}}
               for image in _images()]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    one = LLM(model=str(tiny_llava_dir), max_model_len=128, max_num_batched_tokens=12)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    with LLM(model=str(tiny_llava_dir), max_model_len=128, max_num_batched_tokens=12,
             ray_placement={"worker_num_cpus": 0.5, "engine_num_cpus": 0.1}, **parallel) as many:
        assert [o.outputs[0].token_ids for o in many.generate(prompts, params, use_tqdm=False)] == want


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_hidden_state_heads_draft_for_prompts_with_images(tiny_llava_dir, tmp_path, method):
    """A hidden-state head (EAGLE-1, EAGLE-3) drafting for a vision-language target: it reads the target's rows of
    image prompts (placeholder tokens embedded as tokens: drafts are guesses there), and greedy output with images
    equals plain greedy output with images, token for token (lossless)."""
    import json

    from specray_test_draft_heads import write_random_head  # tests/draft_heads.py
    from tests.test_llava import _images

    text = tmp_path / "text"  # the target's text config where the head writer reads it
    text.mkdir()
    whole = json.loads((tiny_llava_dir / "config.json").read_text())
    (text / "config.json").write_text(json.dumps(whole["text_config"]))
    head = write_random_head(tmp_path / method, method, text, **({"aux_layers": [0, 1]} if method == "eagle3" else {}))
    spec = {"method": method, "model": str(head), "num_speculative_tokens": 3}
    prompts = [{"prompt": "USER: <image>\nWhat is this? ASSISTANT:", "multi_modal_data": {"image": image}}
               for image in _images()]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    plain = LLM(model=str(tiny_llava_dir), max_model_len=128, max_num_batched_tokens=12)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    drafted = LLM(model=str(tiny_llava_dir), max_model_len=128, max_num_batched_tokens=12, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in drafted.generate(prompts, params, use_tqdm=False)] == want
    assert drafted.spec_stats.draft_tokens > 0


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_hidden_state_heads_embed_image_rows_as_the_target_does(tiny_llava_dir, tmp_path, monkeypatch, method):
    """Where a head's row reads an image's token (the row of position p reads the token at p + 1), it takes the
    target's embedding there, the image's row (as vLLM's EAGLE does), not the placeholder token's; also where a
    chunk ends just before an image's row (its last row reads the next chunk's first token)."""
    import json

    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from specray_test_draft_heads import record_head_rows, write_random_head  # tests/draft_heads.py
    from tests.test_llava import _images

    text = tmp_path / "text"
    text.mkdir()
    whole = json.loads((tiny_llava_dir / "config.json").read_text())
    (text / "config.json").write_text(json.dumps(whole["text_config"]))
    head = write_random_head(tmp_path / method, method, text, **({"aux_layers": [0, 1]} if method == "eagle3" else {}))
    seen = record_head_rows(monkeypatch)
    prompt = "USER: <image>\nWhat is this? ASSISTANT:"
    image = _images()[0]
    # (eagerly: a graph step's padding rows, at the positions after its last token, would be recorded too; passes
    # that read image rows are eager either way)
    llm = LLM(model=str(tiny_llava_dir), max_model_len=128, max_num_batched_tokens=12, enforce_eager=True,
              speculative_config={"method": method, "model": str(head), "num_speculative_tokens": 3})
    llm.generate([{"prompt": prompt, "multi_modal_data": {"image": image}}],
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)

    hf = LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir, dtype=torch.float32).eval()
    inputs = AutoProcessor.from_pretrained(tiny_llava_dir)(text=prompt, images=[image], return_tensors="pt")
    ids = inputs["input_ids"][0]
    with torch.no_grad():
        want = hf.get_input_embeddings()(ids)
        image_rows = (ids == whole["image_token_index"]).nonzero()[:, 0]
        want[image_rows] = hf.model.get_image_features(inputs["pixel_values"]).pooler_output[0]
    checked = at_chunk_end = 0
    for positions, e in seen:
        for j, p in enumerate(positions):
            if p + 1 < len(ids):
                torch.testing.assert_close(e[j], want[p + 1], atol=1e-5, rtol=1e-5)
                checked += int(p + 1 in image_rows)
                at_chunk_end += int(p + 1 in image_rows and j == len(positions) - 1)
    assert checked == len(image_rows) and at_chunk_end > 0


def test_image_rows_reach_each_chained_module_one_token_further():
    """Distinct MTP modules: module k's row of position p reads the token at p + 1 + k, so it takes the image row
    there, up to the last committed token; a piece of rows is forgotten once no later pass reads it (the next first
    pass runs again from the last ``num_modules - 1`` positions)."""
    from types import SimpleNamespace

    from specray.workers.head_drafter import HiddenStateDrafter, _Row

    drafter = HiddenStateDrafter.__new__(HiddenStateDrafter)  # what the rows need: the pieces, two modules
    drafter.images, drafter.tail_positions = {}, 1
    rows = torch.arange(4.0)[:, None].expand(4, 3)  # the image's rows 0..3 at positions 5..8
    drafter.add_images({"a": ([5, 6, 7, 8], rows)})
    plan = SimpleNamespace(chunks=[SimpleNamespace(req_id="b"), SimpleNamespace(req_id="a")])
    # request b's two rows first (no images), then a's rows of positions 3..6 (tokens up to position 7)
    first, second = drafter._image_embeds(plan, [_Row(0, [], [1, 2], 10, 1), _Row(1, [], [0] * 4, 3, 1)], 2)
    assert first[0].tolist() == [3, 4, 5] and first[1][:, 0].tolist() == [0, 1, 2]  # p + 1 = 5, 6, 7
    assert second[0].tolist() == [2, 3, 4] and second[1][:, 0].tolist() == [0, 1, 2]  # p + 2 = 5, 6, 7
    assert "a" in drafter.images  # position 8 is still to be read
    # the next pass from position 6 (the tail) reads tokens up to position 10
    first, second = drafter._image_embeds(plan, [_Row(1, [], [0] * 4, 6, 1)], 2)
    assert first[0].tolist() == [0, 1] and first[1][:, 0].tolist() == [2, 3]  # p + 1 = 7, 8
    assert second[0].tolist() == [0] and second[1][:, 0].tolist() == [3]  # p + 2 = 8
    assert drafter.images == {}
    assert drafter._image_embeds(plan, [_Row(1, [], [0] * 4, 10, 1)], 2) == [None, None]


def test_special_token_ids_name_what_the_tokenizer_lacks(tmp_path):
    """A family's processor reads the ids of the tokens it writes for an image; a tokenizer without one (or one it
    does not name at all) is refused naming the token and who writes it."""
    from specray.multimodal import special_token_ids
    from tests.conftest import build_tiny_tokenizer

    tok = build_tiny_tokenizer(tmp_path, extra_special_tokens=("<img>", "</img>"))
    assert special_token_ids(tok, ["<img>", "</img>"], tmp_path, "X") == tok.convert_tokens_to_ids(["<img>", "</img>"])
    for tokens, named in ((["<img>", "<image>"], "'<image>'"), ([None], "None")):
        with pytest.raises(ValueError, match=f"has no {named} token, which XProcessor writes for an image"):
            special_token_ids(tok, tokens, tmp_path, "XProcessor")


VIDEO_TOKEN = 8  # the stand-in video placeholder


class VideoProcessor(StandInProcessor):
    """Images as the stand-in's; each video: two rows of 3 pixel values per frame (the frame at 2 x 1 pixels)."""

    video_token_id = VIDEO_TOKEN

    def process_video(self, frames) -> ProcessedImage:
        from PIL import Image

        rows = [np.asarray(f.resize((2, 1), Image.NEAREST), dtype=np.float32).reshape(2, 3) for f in frames]
        pixels = (np.concatenate(rows) / 255.0 - 0.5) * 4
        return ProcessedImage([self.video_token_id] * len(pixels), {"pixels": pixels})


def _video(seed: int, frames: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (frames, 4, 5, 3), dtype=np.uint8)


def test_videos_take_their_placeholders_in_order_beside_images():
    """A prompt's image and video placeholders take the images and the videos, each kind in order; a video is a list
    of frames or an array [T, H, W, 3] (several: a list of them); counts that differ, videos to a processor without
    them, frames of two sizes are refused by name."""
    prompt = [294, VIDEO_TOKEN, 260, IMAGE_TOKEN, 310, VIDEO_TOKEN, 10]
    array, frames = _video(1), [_image(2), _image(3)]
    media = media_of({"image": _image(4), "video": [array, frames]})
    ids, mm = expand_prompt(prompt, media["image"], VideoProcessor(), media["video"])
    assert [(i.modality, i.offset, i.length) for i in mm.items] == [("video", 1, 6), ("image", 8, 6),
                                                                    ("video", 15, 4)]
    assert ids == [294] + [VIDEO_TOKEN] * 6 + [260] + [IMAGE_TOKEN] * 6 + [310] + [VIDEO_TOKEN] * 4 + [10]
    assert len(media_of({"video": array})["video"]) == 1 and len(media_of({"video": frames})["video"]) == 1
    assert [f.size for f in load_video(array)] == [(5, 4)] * 3 and load_video(list(array))[1].size == (5, 4)
    still = expand_prompt([VIDEO_TOKEN], [], VideoProcessor(), [[_image(4)]])[1].items[0]
    assert still.hash != expand_prompt([IMAGE_TOKEN], [_image(4)], VideoProcessor())[1].items[0].hash
    with pytest.raises(ValueError, match="2 video placeholder token.*but 1 video"):
        expand_prompt(prompt, media["image"], VideoProcessor(), [array])
    with pytest.raises(ValueError, match="takes no videos \\(only images\\)"):
        expand_prompt(prompt, media["image"], StandInProcessor(), media["video"])
    with pytest.raises(ValueError, match="frames must share one size"):
        load_video([_image(1), _image(2, (7, 3))])
    with pytest.raises(ValueError, match="must be \\[frames, height, width, 3\\] of uint8"):
        load_video(array.astype(np.float32))


def test_videos_through_the_engine_equal_transformers(vision, tiny_llama_dir):
    """A video (its rows split over prefill chunks) beside an image through ``LLM.generate``: transformers' greedy
    tokens from the prompt's embeddings with the rows in place; ``limit_mm_per_prompt`` caps videos apart from
    images."""
    vision["processor"] = VideoProcessor
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": [304, VIDEO_TOKEN, 83, IMAGE_TOKEN, 87, 75],
              "multi_modal_data": {"video": _video(5, frames=4), "image": _image(6)}}
    llm = LLM(model=str(tiny_llama_dir), max_model_len=128, block_size=4, max_num_batched_tokens=5)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    media = media_of(prompt["multi_modal_data"])
    ids, mm = expand_prompt(prompt["prompt_token_ids"], media["image"], VideoProcessor(), media["video"])
    assert out.prompt_token_ids == ids and [i.modality for i in mm.items] == ["video", "image"]
    assert out.outputs[0].token_ids == _reference(tiny_llama_dir, ids, mm, 8)
    capped = LLM(model=str(tiny_llama_dir), max_model_len=128, limit_mm_per_prompt={"video": 0, "image": 1})
    with pytest.raises(ValueError, match="takes no videos"):
        capped.generate([prompt], params, use_tqdm=False)
    assert capped.generate([{"prompt_token_ids": [304, IMAGE_TOKEN, 83], "multi_modal_data": {"image": _image(6)}}],
                           params, use_tqdm=False)[0].outputs[0].token_ids


def _mp4(frames: int, seed: int = 0, size=(32, 24)) -> bytes:
    """An MP4 (MPEG-4 part 2) of ``frames`` frames: frame i a flat grey of level 5 * i plus a little noise."""
    import av

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        stream.codec_context.gop_size, stream.bit_rate = 1, 4_000_000  # every frame whole, near lossless
        for i in range(frames):
            pixels = np.clip(5 * i + rng.integers(0, 2, (size[1], size[0], 3)), 0, 255).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def test_video_files_decode_to_evenly_spaced_frames(tmp_path):
    """A video file (bytes, a data: URL, a path) gives VIDEO_FRAMES frames evenly spaced over it, first and last
    included (all of a shorter one); what FFmpeg cannot read is refused by name."""
    from specray.multimodal import VIDEO_FRAMES, decode_video

    frames = decode_video(_mp4(VIDEO_FRAMES + 9))
    levels = [int(round(np.asarray(f).mean() / 5)) for f in frames]  # each frame's index in the file
    assert len(frames) == VIDEO_FRAMES and levels[0] == 0 and levels[-1] == VIDEO_FRAMES + 8
    assert levels == sorted(levels) and len(set(levels)) == VIDEO_FRAMES
    assert [int(round(np.asarray(f).mean() / 5)) for f in decode_video(_mp4(5))] == [0, 1, 2, 3, 4]
    assert [int(round(np.asarray(f).mean() / 5)) for f in load_video(_mp4(9), num_frames=4)] == [0, 3, 5, 8]
    for bad, says in [({"video": {"num_frames": 0}}, "num_frames=0 must be an int from 1"),
                      ({"video": {"num_frames": True}}, "num_frames=True"),
                      ({"video": {"fps": 2}}, "must map a kind to its settings"), ({"image": {}}, "must map a kind")]:
        with pytest.raises(ValueError, match=says):
            EngineArgs(model="m", media_io_kwargs=bad)
    (tmp_path / "v.mp4").write_bytes(_mp4(3))
    url = "data:video/mp4;base64," + base64.b64encode(_mp4(3)).decode()
    assert [len(load_video(v)) for v in (str(tmp_path / "v.mp4"), url, _mp4(3))] == [3, 3, 3]
    assert len(media_of({"video": [url, url]})["video"]) == 2
    with pytest.raises(ValueError, match="video could not be decoded"):
        decode_video(_png(_image(1))[:40])
    sound = io.BytesIO()  # a WAV: no video stream (it said "tuple index out of range")
    with wave.open(sound, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(8000), w.writeframes(bytes(1600))
    with pytest.raises(ValueError, match=r"video could not be decoded \(the file holds no video stream, only audio\)"):
        decode_video(sound.getvalue())
    with pytest.raises(ValueError, match="is not a file"):
        load_video("/nonexistent.mp4")
    with pytest.raises(ValueError, match="video '/nonexistent.mp4' is not supported"):
        load_video("/nonexistent.mp4", local=False)


# renders image and video parts as the placeholder tokens
MEDIA_TEMPLATE = ("{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
                  "{% if p.type == 'image' %}<image>{% elif p.type == 'video' %}<video>{% else %}{{ p.text }}{% endif %}"
                  "{% endfor %}{% endif %}{% endfor %}")


class ChatVideoProcessor(VideoProcessor):
    image_token_id, video_token_id = 3, 4  # "<image>", "<video>": the tiny tokenizer's fourth and fifth specials


def test_server_chat_with_video_url_equals_llm_chat(tmp_path, vision):
    """An OpenAI chat request with a video_url part (vLLM's; a data: URL of an MP4) beside an image_url part
    answers what LLM.chat answers for the same messages, each taking the frames media_io_kwargs names (3 of the
    video's 6); an undecodable video is a 400 naming messages."""
    pytest.importorskip("uvicorn")  # (the server's; not in a GPU image)
    from specray_test_openai_helpers import chat_equals, http_json, serving  # tests/openai_helpers.py

    from specray.cluster.openai_app import AsyncEngineClient, ServerConfig, build_openai_app
    from specray.engine.async_engine import AsyncLLMEngine
    from specray.models.loader import engine_image_processor
    from tests.conftest import build_tiny_model

    folder = build_tiny_model(tmp_path / "tiny", "llama", extra_special_tokens=("<image>", "<video>"))
    vision["processor"] = ChatVideoProcessor
    video = "data:video/mp4;base64," + base64.b64encode(_mp4(6, seed=3)).decode()
    image = "data:image/png;base64," + base64.b64encode(_png(_image(21))).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "The quick"},
                                             {"type": "video_url", "video_url": {"url": video}},
                                             {"type": "image_url", "image_url": {"url": image}},
                                             {"type": "text", "text": " brown fox"}]}]
    llm = LLM(model=str(folder), max_model_len=64, media_io_kwargs={"video": {"num_frames": 3}})
    assert llm.get_tokenizer().convert_tokens_to_ids(["<image>", "<video>"]) == [3, 4]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = llm.chat(messages, params, use_tqdm=False, chat_template=MEDIA_TEMPLATE)[0]
    assert want.prompt_token_ids.count(4) == 6 and want.prompt_token_ids.count(3) == 6  # 3 frames, 1 image

    aengine = AsyncLLMEngine(llm.engine)
    processor = engine_image_processor(llm.engine_args)  # (as the Serve app builds the server's)
    assert processor.num_frames == 3
    app = build_openai_app(AsyncEngineClient(aengine, image_processor=processor),
                           ServerConfig("tiny", chat_template=MEDIA_TEMPLATE))
    try:
        with serving(app) as base:
            chat, body = chat_equals(base, messages, want)
            part = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
            status, err = http_json(chat, {**body, "messages": [{"role": "user", "content": [part]}]})
            assert status == 400 and err["error"]["param"] == "messages", err
            assert "video could not be decoded" in err["error"]["message"]
    finally:
        aengine.shutdown()
