"""`generate` and `chat` (tileattn.engine.cli) on a tiny checkpoint, in process."""

import io
import json

import pytest

from tileattn.engine.cli import main

from .checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli")
    make_checkpoint(path, "qwen2")
    return str(path)


def test_generate_prints_each_completion(checkpoint, capsys):
    rc = main(["generate", checkpoint, "--prompt", "the quick", "--prompt", "hello", "--max-tokens", "5",
               "--device", "cpu", "--max-model-len", "64"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "--- 'the quick' (5 tokens, length)" in out and "--- 'hello' (5 tokens, length)" in out


def test_chat_reads_turns_from_piped_stdin_until_eof(checkpoint, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello there\n\nwhat now\n"))
    rc = main(["chat", checkpoint, "--max-tokens", "4", "--device", "cpu", "--max-model-len", "128",
               "--system", "be brief"])
    captured = capsys.readouterr()
    assert rc == 0
    assert captured.err.count("prompt tokens at") == 2, captured.err  # two turns, the blank line skipped
    assert captured.out.count("\n") >= 2


def test_generate_with_two_tensor_parallel_ranks_prints_the_same(checkpoint, capsys):
    argv = ["generate", checkpoint, "--prompt", "the quick", "--prompt", "hello", "--max-tokens", "8",
            "--device", "cpu", "--max-model-len", "64"]
    assert main(argv) == 0
    single = capsys.readouterr().out
    assert main([*argv, "--tensor-parallel-size", "2"]) == 0
    assert capsys.readouterr().out == single


def test_missing_model_is_a_clean_error(tmp_path, capsys):
    rc = main(["generate", str(tmp_path / "none"), "--prompt", "x", "--device", "cpu"])
    assert rc == 2
    assert "does not exist" in capsys.readouterr().err


def test_generate_held_to_a_schema_a_regex_or_choices(checkpoint, capsys, tmp_path):
    pytest.importorskip("llguidance")
    base = ["generate", checkpoint, "--prompt", "the quick", "--max-tokens", "40", "--device", "cpu",
            "--max-model-len", "128"]
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"], '
                      '"additionalProperties": false}')
    for extra, answers in ((["--json-schema", str(schema)], ('{"n": 1}', '{"n": 2}')),
                           (["--regex", "[ab]{2}"], ("aa", "ab", "ba", "bb")),
                           (["--choice", "yes", "--choice", "no"], ("yes", "no"))):
        assert main(base + extra) == 0
        lines = capsys.readouterr().out.splitlines()
        assert ", stop)" in lines[0] and lines[1] in answers, (extra, lines)
    assert main(base + ["--json-schema", "{not json"]) == 2
    assert "--json-schema is not JSON" in capsys.readouterr().err
    assert main(base + ["--regex", "a(b"]) == 2
    assert "structured_outputs['regex'] is not valid" in capsys.readouterr().err


def test_generate_and_chat_with_a_lora_adapter(checkpoint, capsys, monkeypatch, tmp_path):
    """--lora PATH: the answers are the engine's with that adapter (LLM.generate / LLM.chat with it),
    not the base model's; chat streams the same."""
    import torch
    from transformers import AutoModelForCausalLM

    from tileattn.engine import LLM, SamplingParams

    from .test_lora import ALL, write_adapter

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    write_adapter(tmp_path / "adapter", hf, ALL, rank=8, alpha=32, seed=4)
    llm = LLM(checkpoint, device="cpu", max_model_len=128, max_loras=1, max_lora_rank=8)
    llm.engine.add_lora("a", str(tmp_path / "adapter"))
    params = SamplingParams(temperature=0, max_tokens=6)
    tuned = llm.generate("the quick", params, use_tqdm=False, lora="a")[0].outputs[0].text
    base = llm.generate("the quick", params, use_tqdm=False)[0].outputs[0].text
    assert tuned != base
    rc = main(["generate", checkpoint, "--prompt", "the quick", "--max-tokens", "6", "--device", "cpu",
               "--max-model-len", "128", "--lora", str(tmp_path / "adapter")])
    out = capsys.readouterr().out
    assert rc == 0 and out.split("\n", 1)[1].rstrip("\n") == tuned
    chat = llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False, lora="a")[0].outputs[0].text
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    rc = main(["chat", checkpoint, "--max-tokens", "6", "--device", "cpu", "--max-model-len", "128",
               "--lora", str(tmp_path / "adapter")])
    assert rc == 0 and capsys.readouterr().out.rstrip("\n") == chat
    config = tmp_path / "adapter" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "r": 0}))
    rc = main(["generate", checkpoint, "--prompt", "the quick", "--device", "cpu", "--lora", str(tmp_path / "adapter")])
    assert rc == 2 and "r must be a positive int, got 0" in capsys.readouterr().err
