"""The model's generation config (vLLM's ``generation_config`` / ``override_generation_config``): its sampling
fields are the defaults of what a request leaves unset, and its end-of-sequence ids end sequences; and the chat
template given as a file or as text (vLLM's ``--chat-template``)."""

import json
import shutil

import pytest

from specray import LLM, SamplingParams
from specray.chat import load_chat_template
from specray.config import EngineArgs
from specray.engine.builder import default_sampling_fields
from specray_test_engine_runs import PROMPTS, greedy, token_ids  # tests/engine_runs.py, via conftest


def with_generation_config(src, dst, **fields):
    """A copy of the model folder ``src`` whose generation_config.json also sets ``fields``."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "generation_config.json").read_text())
    (dst / "generation_config.json").write_text(json.dumps({**config, **fields}))
    return dst


def test_unset_fields_take_the_generation_configs_values(tiny_llama_dir, tmp_path, plain):
    """A model whose generation config asks for greedy decoding of 12 tokens: generate() without parameters, and a
    dict of parameters that leaves them out, decode greedily for 12 tokens (the plain engine's output); a
    SamplingParams is taken as given; generation_config='vllm' leaves the file out, the override sets fields either
    way."""
    folder = with_generation_config(tiny_llama_dir, tmp_path / "m", temperature=0.0, max_new_tokens=12, top_k=-1,
                                    do_sample=False, repetition_penalty=1.0)
    llm = LLM(model=str(folder), max_model_len=256)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=12)
    expected = token_ids(plain.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False))
    assert token_ids(llm.generate(PROMPTS[:3], use_tqdm=False)) == expected
    assert token_ids(llm.generate(PROMPTS[:3], {"seed": 3}, use_tqdm=False)) == expected
    explicit = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)
    assert len(explicit[0].outputs[0].token_ids) == 5
    assert default_sampling_fields(EngineArgs(model=str(folder), generation_config="vllm")) == {}
    override = EngineArgs(model=str(folder), override_generation_config={"temperature": 0.7, "top_p": 0.5})
    assert default_sampling_fields(override) == {"temperature": 0.7, "top_p": 0.5, "max_tokens": 12,
                                                 "top_k": 0, "repetition_penalty": 1.0}
    only = EngineArgs(model=str(folder), generation_config="vllm", override_generation_config={"max_new_tokens": 4})
    assert default_sampling_fields(only) == {"max_tokens": 4}
    # another folder's generation config
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.25}))
    assert default_sampling_fields(EngineArgs(model=str(folder), generation_config=str(other))) == {"top_p": 0.25}


def test_the_generation_configs_eos_ids_end_sequences(tiny_llama_dir, tmp_path, plain):
    """An instruction model's end of turn is often only in generation_config.json (Gemma 3's <end_of_turn>): a
    token of the plain greedy output named there ends the output where it first appears, with "vllm" too (as in
    vLLM, which reads the ids either way), and not when the request ignores EOS."""
    outputs = token_ids(plain.generate(PROMPTS, greedy(16), use_tqdm=False))
    # a prompt whose output brings a new token at index 3 or later: that token, named EOS, ends it there
    prompt, full, cut = next((p, out, i) for p, out in zip(PROMPTS, outputs) for i in range(3, len(out))
                             if out[i] not in out[:i])
    stop = full[cut]
    eos = json.loads((tiny_llama_dir / "generation_config.json").read_text())["eos_token_id"]
    folder = with_generation_config(tiny_llama_dir, tmp_path / "m", eos_token_id=[eos, stop])
    for mode in ("auto", "vllm"):
        llm = LLM(model=str(folder), max_model_len=256, generation_config=mode,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3})
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop"
        assert out.token_ids[:cut] == full[:cut] and len(out.token_ids) in (cut, cut + 1)
    ignored = llm.generate([prompt], greedy(16), use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == full


def test_generation_config_errors(tiny_llama_dir, tmp_path):
    with pytest.raises(ValueError, match="override_generation_config has unknown keys .'temprature'"):
        EngineArgs(model="m", override_generation_config={"temprature": 0.5})
    with pytest.raises(ValueError, match="override_generation_config=.* must be a dict"):
        EngineArgs(model="m", override_generation_config="temperature=0.5")
    with pytest.raises(ValueError, match="generation_config='nowhere' is not 'auto', 'vllm' or an existing folder"):
        EngineArgs(model="m", generation_config="nowhere")
    with pytest.raises(ValueError, match="temperature=-1 must be .* set them in override_generation_config"):
        LLM(model=str(tiny_llama_dir), max_model_len=256, override_generation_config={"temperature": -1})
    folder = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json' is not valid JSON"):
        LLM(model=str(folder), max_model_len=256)
    (folder / "generation_config.json").write_text(json.dumps({"top_p": 7}))
    with pytest.raises(ValueError, match="top_p=7"):
        default_sampling_fields(EngineArgs(model=str(folder)))
    (folder / "generation_config.json").unlink()  # none: no defaults
    assert default_sampling_fields(EngineArgs(model=str(folder))) == {}


def test_chat_templates_from_a_file_or_text(tmp_path):
    text = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    file = tmp_path / "chat.jinja"
    file.write_text(text)
    assert load_chat_template(str(file)) == text
    assert load_chat_template(text) == text
    assert load_chat_template(None) is None
    # transformers' own tags parse
    tagged = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% break %}{% endfor %}"
    assert load_chat_template(tagged) == tagged
    with pytest.raises(ValueError, match="chat_template='missing.jinja' is neither a file nor a Jinja template"):
        load_chat_template("missing.jinja")
    with pytest.raises(ValueError, match="does not parse as a Jinja template: line 1"):
        load_chat_template("{% for m in messages %}")
