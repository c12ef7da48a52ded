"""Checkpoint forms the loader accepts give the same model: sharded safetensors with an index,
config.json in the transformers 4 form (rope_theta + rope_scaling), generation_config.json EOS
lists, tokenizer_config.json chat templates."""

import json
import shutil

import pytest
import torch

from tileattn.engine import LLMEngine, SamplingParams
from tileattn.engine.loader import model_config_from_hf

from .checkpoints import engine_logits, make_checkpoint

PROMPT = [0, 17, 203, 5, 99, 42, 300, 7, 8, 150, 61, 2, 33]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama3")
    model = make_checkpoint(path, "llama3")
    return path, model


def logits(path, **options):
    engine = LLMEngine.from_model(str(path), device="cpu", max_model_len=128, kv_cache_blocks=16, **options)
    return engine, engine_logits(engine, PROMPT)


def test_sharded_checkpoint_loads_the_same(llama, tmp_path):
    path, model = llama
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path / name, tmp_path / name)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    _, ours = logits(tmp_path)
    _, ref = logits(path)
    assert torch.equal(ours, ref)


def test_transformers4_config_form_reads_the_same(llama, tmp_path):
    path, _ = llama
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope  # {"rope_type": "llama3", "factor": ..., ...}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert model_config_from_hf(cfg) == model_config_from_hf(json.loads((path / "config.json").read_text()))
    _, ours = logits(tmp_path)
    _, ref = logits(path)
    assert torch.equal(ours, ref)


def test_generation_config_eos_list_and_defaults(llama, tmp_path):
    path, _ = llama
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [1, 7], "temperature": 0.6, "top_p": 0.9, "do_sample": True}))
    engine, _ = logits(tmp_path)
    assert engine.eos_token_ids == {1, 7}
    assert engine.generation_defaults["temperature"] == 0.6
    params = SamplingParams.from_generation_config(engine.generation_defaults, max_tokens=5)
    assert (params.temperature, params.top_p, params.max_tokens) == (0.6, 0.9, 5)
    greedy = SamplingParams.from_generation_config({"do_sample": False, "temperature": 0.6})
    assert greedy.temperature == 0.0


def test_chat_template_from_tokenizer_config(llama, tmp_path):
    path, _ = llama
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    engine, _ = logits(tmp_path)
    assert engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>[user] hi"


def test_sliding_window_is_read_and_qwen_layer_windows_refused(llama):
    path, _ = llama
    cfg = json.loads((path / "config.json").read_text())
    assert model_config_from_hf({**cfg, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                                 "sliding_window": 4096}).sliding_window == 4096
    qwen = {**cfg, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "sliding_window": 4096}
    assert model_config_from_hf({**qwen, "use_sliding_window": False}).sliding_window is None
    with pytest.raises(ValueError, match="use_sliding_window"):
        model_config_from_hf({**qwen, "use_sliding_window": True})


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
def test_pytorch_bin_checkpoints_load_the_same(llama, tmp_path, sharded):
    """pytorch_model.bin (older checkpoints; or its shards with pytorch_model.bin.index.json), read with
    weights_only: the same logits as the safetensors checkpoint; an unreadable one is a ValueError
    naming the file."""
    path, model = llama
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path / name, tmp_path / name)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if sharded:
        names = sorted(state)
        shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
        for file, keys in shards.items():
            torch.save({k: state[k] for k in keys}, tmp_path / file)
        (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(
            {"weight_map": {k: file for file, keys in shards.items() for k in keys}}))
    else:
        torch.save(state, tmp_path / "pytorch_model.bin")
    _, ours = logits(tmp_path)
    _, ref = logits(path)
    assert torch.equal(ours, ref)
    if not sharded:
        (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle")
        with pytest.raises(ValueError, match="cannot read weights from .*pytorch_model.bin"):
            logits(tmp_path)


def _edited(path, tmp_path, config=None, tensors=None, files=None):
    """A copy of checkpoint `path` with config.json updated by `config` (a function of the dict),
    model.safetensors by `tensors` (a function of the name -> tensor dict), and extra files."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    if config is not None:
        cfg = json.loads((tmp_path / "config.json").read_text())
        config(cfg)
        (tmp_path / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        weights = load_file(tmp_path / "model.safetensors")
        tensors(weights)
        save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    for name, text in (files or {}).items():
        (tmp_path / name).write_text(text)
    return tmp_path


def _int8_projections(weights):
    for name in [n for n in weights if n.endswith("proj.weight")]:
        weights[name] = weights[name].mul(100).round().to(torch.int8)


def _narrower_down_proj(weights):
    name = "model.layers.0.mlp.down_proj.weight"
    weights[name] = weights[name][:, :48].contiguous()


def _bias_without_attention_bias(weights):
    weights["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(weights["model.layers.0.self_attn.q_proj.weight"].shape[0])


# Each loaded before this session (2026-12-05) and then computed something else than the checkpoint
# means, or failed late with a raw KeyError / AttributeError / JSONDecodeError; now a ValueError naming it.
MALFORMED = {
    "gelu MLP": (dict(config=lambda c: c.update(hidden_act="gelu")), "hidden_act 'gelu' is not supported"),
    "tied head that differs": (dict(config=lambda c: c.update(tie_word_embeddings=True)),
                               "lm_head.weight differs from embed_tokens"),
    "int8 weights": (dict(tensors=_int8_projections), "weights must be floating point"),
    "bias the config lacks": (dict(tensors=_bias_without_attention_bias), "q_proj.bias has no place"),
    "rope without its factor": (dict(config=lambda c: c.update(rope_scaling={"rope_type": "linear"})),
                                "linear rope scaling lacks factor"),
    "generation_config not JSON": (dict(files={"generation_config.json": "{bad"}), "is not valid JSON"),
    "generation_config a list": (dict(files={"generation_config.json": "[1]"}), "must hold a JSON object"),
    "tokenizer_config not JSON": (dict(files={"tokenizer_config.json": "{bad"}), "is not valid JSON"),
    "string eos ids": (dict(files={"generation_config.json": '{"eos_token_id": ["1"]}'}),
                       "eos_token_id must be token ids"),
    "a rope type not served": (dict(config=lambda c: c.update(rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
                               "rope scaling type 'dynamic' is not supported"),
    "longrope factors of another length": (
        dict(config=lambda c: c.update(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 3,
                                                     "long_factor": [1.0] * 3, "original_max_position_embeddings": 64})),
        "longrope factors must have 8 entries, got 3"),
    "a weight of another shape": (
        dict(tensors=_narrower_down_proj),
        r"checkpoint tensor model.layers.0.mlp.down_proj.weight has shape \(64, 48\), the config implies \(64, 96\)"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_checkpoints_are_refused_at_load(llama, tmp_path, case):
    path, _ = llama
    edits, message = MALFORMED[case]
    with pytest.raises(ValueError, match=message):
        LLMEngine.from_model(str(_edited(path, tmp_path, **edits)), device="cpu", max_model_len=128, kv_cache_blocks=16)


def test_a_tensor_stored_in_two_shards_is_refused(llama, tmp_path):
    """The last file read used to win, whatever the index's weight_map said."""
    from safetensors.torch import load_file, save_file

    path, _ = llama
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    weights = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    name = "model.layers.0.mlp.down_proj.weight"
    save_file(weights, tmp_path / "model-00001-of-00002.safetensors")
    save_file({name: torch.zeros_like(weights[name])}, tmp_path / "model-00002-of-00002.safetensors")
    index = {n: "model-00001-of-00002.safetensors" for n in weights} | {"x": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    with pytest.raises(ValueError, match=f"{name} is stored twice"):
        LLMEngine.from_model(str(tmp_path), device="cpu", max_model_len=128, kv_cache_blocks=16)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match="must map tensor names to shard files"):
        LLMEngine.from_model(str(tmp_path), device="cpu", max_model_len=128, kv_cache_blocks=16)


def _config_cases(cfg):
    gemma2 = {**cfg, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_activation": "gelu_pytorch_tanh"}
    layers = cfg["num_hidden_layers"]
    lacking = {k: v for k, v in cfg.items() if k != "num_hidden_layers"}
    return [
        (lacking, "^config.json lacks 'num_hidden_layers'"),
        ({**cfg, "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
         "^config.json: longrope scaling needs original_max_position_embeddings"),
        ({**gemma2, "hidden_activation": "relu"}, r"^Gemma2ForCausalLM with hidden_activation 'relu' is not supported"),
        ({**gemma2, "use_bidirectional_attention": True}, "^Gemma2ForCausalLM with use_bidirectional_attention"),
        ({**gemma2, "layer_types": ["full_attention"] * (layers + 1)},
         f"^config.json layer_types must name each of the {layers} layers"),
        ({**cfg, "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "layer_types": ["global"] * layers},
         f"^config.json layer_types must name each of the {layers} layers"),
        ({**cfg, "architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "no_rope_layers": [1]},
         f"^config.json no_rope_layers must name each of the {layers} layers"),
        ({**cfg, "num_key_value_heads": 3}, r"^model config: num_key_value_heads \(3\) must divide num_attention_heads"),
        ({**cfg, "head_dim": 15}, "^model config: head_dim must be even for rotary, got 15"),
        ({**cfg, "vocab_size": 0}, "^model config: vocab_size must be a positive int, got 0"),
        ({**cfg, "architectures": ["Glm4ForCausalLM"], "model_type": "glm4", "partial_rotary_factor": 3 / 16},
         r"^config.json partial_rotary_factor=0.1875 gives 3 rotary dims of 16; rotary needs an even count"),
    ]


def test_unsupported_or_inconsistent_configs_are_refused_by_name(llama):
    """Configs the engine cannot run as written get a ValueError naming the field, before any weight
    is read (model_config_from_hf is what load_model reads config.json with)."""
    path, _ = llama
    cfg = json.loads((path / "config.json").read_text())
    model_config_from_hf(cfg)  # the unedited config is accepted
    for bad, match in _config_cases(cfg):
        with pytest.raises(ValueError, match=match):
            model_config_from_hf(bad)


def test_a_directory_without_config_json_names_what_it_found(tmp_path):
    from tileattn.engine.loader import resolve_checkpoint

    with pytest.raises(ValueError, match=r"has no config.json$"):
        resolve_checkpoint(str(tmp_path))
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"has no config.json and 2 .gguf files \(name one\)"):
        resolve_checkpoint(str(tmp_path))
    (tmp_path / "b.gguf").unlink()
    assert resolve_checkpoint(str(tmp_path)) == ("gguf", str(tmp_path / "a.gguf"))
