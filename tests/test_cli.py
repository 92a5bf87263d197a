"""`specray generate` on a tiny model: prints outputs and a speed/acceptance summary."""

import json

from specray.cluster.cli import main


def test_generate_prompt_with_ngram(tiny_llama_dir, capsys):
    rc = main(["generate", "--model", str(tiny_llama_dir), "--spec-method", "ngram", "--num-spec-tokens", "3",
               "--max-tokens", "12", "--prompt", "def add(a, b):", "--prompt", "Hello", "--json",
               "--max-model-len", "128"])
    out, err = capsys.readouterr()
    assert rc == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert [len(x["token_ids"]) for x in lines] == [12, 12] or all(x["finish_reason"] for x in lines)
    assert "throughput" in err


def test_generate_jsonl_input(tiny_llama_dir, tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Hello world"}\n{"prompt_token_ids": [5, 6, 7]}\n')
    assert main(["generate", "--model", str(tiny_llama_dir), "--input", str(path), "--max-tokens", "4",
                 "--max-model-len", "128"]) == 0
    out, err = capsys.readouterr()
    assert out.count("--- prompt") == 2 and "requests: 2" in err


def test_bad_arguments_are_clear_errors(tiny_llama_dir, capsys):
    rc = main(["generate", "--model", str(tiny_llama_dir), "--spec-method", "nope", "--prompt", "x"])
    assert rc == 2 and "speculative_config.method" in capsys.readouterr().err
    rc = main(["generate", "--model", "/no/such/model", "--prompt", "x"])
    assert rc == 2
