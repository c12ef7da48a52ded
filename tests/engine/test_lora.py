"""LoRA adapters (PEFT's format, lora.py) on the CPU against transformers with the adapter merged into
the weights (W + s B A: the definition): logits within 1e-5 (float32), greedy tokens identical with
requests of the base model and of two adapters in the same steps, the prefix cache kept apart per
adapter, and the errors before anything changes."""

import copy
import json

import pytest
import torch
from safetensors.torch import save_file

from tileattn.engine import LLM, LLMEngine, SamplingParams

from .checkpoints import engine_logits, make_checkpoint, rel_error
from .test_models import PROMPT

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PHI3 = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # what Phi-3's adapters target: its fused modules
GREEDY = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)


def write_adapter(path, hf, targets, rank: int, alpha: float, seed: int, rslora: bool = False, **config):
    """A PEFT adapter of random A and B for ``targets`` of every layer of ``hf``; returns a copy of
    ``hf`` with it merged (W += s B A, s = alpha / r or alpha / sqrt(r))."""
    gen = torch.Generator().manual_seed(seed)
    merged = copy.deepcopy(hf)
    scale = alpha / (rank ** 0.5 if rslora else rank)
    tensors = {}
    for i, layer in enumerate(merged.model.layers):
        for module in targets:
            parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj") else "mlp"
            weight = getattr(getattr(layer, parent), module).weight
            a = torch.randn(rank, weight.shape[1], generator=gen) / weight.shape[1] ** 0.5
            b = torch.randn(weight.shape[0], rank, generator=gen) * 0.3 / rank ** 0.5
            key = f"base_model.model.model.layers.{i}.{parent}.{module}"
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
            with torch.no_grad():
                weight += scale * b @ a
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none",
        "use_rslora": rslora, **config}))
    return merged.eval()


def hf_logits(model, prompt):
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


@pytest.mark.parametrize("arch", ["llama3", "qwen3", "phi3", "granite"])
def test_adapter_logits_match_the_merged_model(tmp_path, arch):
    """llama3: GQA; qwen3: q/k norms after the projection; phi3: fused targets, partial rotary (q/k
    rows reordered); granite: the residual multiplier on o and down."""
    hf = make_checkpoint(tmp_path / "base", arch)
    targets = PHI3 if arch == "phi3" else ALL
    merged_a = write_adapter(tmp_path / "a", hf, targets, rank=8, alpha=16, seed=1)
    merged_b = write_adapter(tmp_path / "b", hf, targets[:2], rank=4, alpha=8, seed=2, rslora=True)
    engine = LLMEngine.from_model(str(tmp_path / "base"), device="cpu", max_model_len=256, kv_cache_blocks=64,
                                  max_loras=2, max_lora_rank=8)
    engine.add_lora("a", str(tmp_path / "a"))
    engine.add_lora("b", str(tmp_path / "b"))
    assert engine.lora_names == ["a", "b"]
    for lora, model in ((None, hf), ("a", merged_a), ("b", merged_b)):
        err = rel_error(engine_logits(engine, PROMPT, lora), hf_logits(model, PROMPT))
        assert err < 1e-5, f"{arch} adapter {lora}: logits relative error {err:.2e} (bound 1e-5)"
    assert rel_error(hf_logits(merged_a, PROMPT), hf_logits(hf, PROMPT)) > 1e-2  # the adapter changes the answer


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora")
    hf = make_checkpoint(path / "base", "llama3")
    merged = {None: hf, "a": write_adapter(path / "a", hf, ALL, rank=8, alpha=16, seed=1),
              "b": write_adapter(path / "b", hf, ("q_proj", "v_proj", "down_proj"), rank=16, alpha=16, seed=3)}
    llm = LLM(str(path / "base"), device="cpu", max_model_len=128, kv_cache_blocks=64, block_size=8,
              max_num_batched_tokens=24, max_loras=3, max_lora_rank=16)
    llm.engine.add_lora("a", str(path / "a"))
    llm.engine.add_lora("b", str(path / "b"))
    return llm, merged, path


def hf_greedy(model, prompt):
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                              pad_token_id=1)[0, len(prompt):].tolist()


def test_base_and_adapters_in_the_same_steps(served):
    """Six requests, two per model, with a 24-token budget: chunked prefills and decodes of the
    base model and both adapters mixed in each step; each answer is its own merged model's."""
    llm, merged, _ = served
    prompts = [PROMPT, PROMPT[:9], list(range(3, 30)), PROMPT[5:30], [0, 7, 9], PROMPT]
    adapters = [None, "a", "b", "a", None, "b"]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora=adapters)
    for prompt, adapter, out in zip(prompts, adapters, outs):
        assert out.outputs[0].token_ids == hf_greedy(merged[adapter], prompt), adapter
    assert len({tuple(o.outputs[0].token_ids) for o in (outs[0], outs[5])}) == 2  # the same prompt, two answers


def test_prefix_cache_is_kept_apart_per_adapter(served):
    llm, merged, _ = served
    prompt = [(5 * i) % 300 + 2 for i in range(40)]
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    other = llm.generate(prompt, GREEDY, use_tqdm=False, lora="a")[0]
    again = llm.generate(prompt, GREEDY, use_tqdm=False, lora="a")[0]
    assert other.num_cached_tokens == 0, "the adapter's request reused the base model's blocks"
    assert again.num_cached_tokens > 0 and first.outputs[0].token_ids == hf_greedy(merged[None], prompt)
    assert other.outputs[0].token_ids == again.outputs[0].token_ids == hf_greedy(merged["a"], prompt)


def test_adapter_errors(served, tmp_path):
    llm, merged, path = served
    engine = llm.engine
    with pytest.raises(ValueError, match="unknown LoRA adapter 'c'"):
        engine.add_request("x", PROMPT, GREEDY, lora="c")
    with pytest.raises(ValueError, match="already loaded"):
        engine.add_lora("a", str(path / "a"))
    hf = merged[None]
    cases = {"rank 32": dict(targets=ALL, rank=32),
             "use_dora=True": dict(targets=ALL, rank=4, use_dora=True),
             "modules_to_save": dict(targets=ALL, rank=4, modules_to_save=["lm_head"]),
             "bias='all'": dict(targets=ALL, rank=4, bias="all"),
             "rank_pattern": dict(targets=ALL, rank=4, rank_pattern={"q_proj": 2}),
             # loaded before 2026-12-05 and computed something else than PEFT: a bias on B dropped, an
             # activated LoRA applied to every token
             "lora_bias=True": dict(targets=ALL, rank=4, lora_bias=True),
             "alora_invocation_tokens": dict(targets=ALL, rank=4, alora_invocation_tokens=[5, 6]),
             "peft_type='LOHA'": dict(targets=ALL, rank=4, peft_type="LOHA")}
    for message, options in cases.items():
        folder = tmp_path / message.replace(" ", "_").replace("'", "").replace("=", "")
        write_adapter(folder, hf, options.pop("targets"), alpha=8, seed=5, **options)
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            engine.add_lora("c", str(folder))
    # malformed files and tensors: ValueErrors naming them, not TypeError / AttributeError / SafetensorError
    write_adapter(tmp_path / "m", hf, ALL[:1], rank=4, alpha=8, seed=8)
    config = json.loads((tmp_path / "m" / "adapter_config.json").read_text())
    for text, says in ((json.dumps({**config, "lora_alpha": "16"}), "lora_alpha must be a finite number"),
                       (json.dumps({**config, "lora_alpha": None}), "lora_alpha must be a finite number"),
                       ("[1]", "must hold a JSON object"), ("{bad", "is not valid JSON")):
        (tmp_path / "m" / "adapter_config.json").write_text(text)
        with pytest.raises(ValueError, match=says):
            engine.add_lora("c", str(tmp_path / "m"))
    (tmp_path / "m" / "adapter_config.json").write_text(json.dumps(config))
    weights = tmp_path / "m" / "adapter_model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:len(good) // 2])
    with pytest.raises(ValueError, match="cannot read"):
        engine.add_lora("c", str(tmp_path / "m"))
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    fused = "base_model.model.model.layers.0.self_attn.qkv_proj"  # Phi-3's fused module beside its part
    a, b = torch.randn(4, 64), torch.randn(64, 4)
    for tensors, says in (({f"{key}.lora_A.weight": a.int(), f"{key}.lora_B.weight": b}, "not a floating-point"),
                          ({f"{key}.lora_A.default.weight": a, f"{key}.lora_B.default.weight": b}, "PEFT's saved form"),
                          ({f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": b, f"{key}.lora_B.bias": b[:, 0].clone()},
                           "not a floating-point lora_A / lora_B weight"),
                          ({"base_model.model.model.vision_tower.layers.0.self_attn.q_proj.lora_A.weight": a,
                            "base_model.model.model.vision_tower.layers.0.self_attn.q_proj.lora_B.weight": b},
                           "adapts a vision module"),
                          ({f"{key}.lora_A.weight": a, "model.layers.0.self_attn.q_proj.lora_A.weight": a.clone(),
                            f"{key}.lora_B.weight": b}, "layer 0 q_proj has two lora_A tensors"),
                          ({f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": b,
                            f"{fused}.lora_A.weight": a.clone(), f"{fused}.lora_B.weight": b.clone()},
                           "layer 0 has both qkv_proj and q_proj"),
                          ({f"{key}.lora_A.weight": a}, "layer 0 q_proj has lora_A only"),
                          ({k.replace("layers.0", "layers.99"): t for k, t in
                            ((f"{key}.lora_A.weight", a), (f"{key}.lora_B.weight", b))}, "has no place"),
                          ({"base_model.model.lm_head.lora_A.weight": a}, "targets no decoder projection")):
        save_file(tensors, weights)
        with pytest.raises(ValueError, match=says):
            engine.add_lora("c", str(tmp_path / "m"))
    weights.write_bytes(good)
    (tmp_path / "m" / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 1e41}))
    with pytest.raises(ValueError, match=r"its weights \(lora_B scaled by lora_alpha / r = 2.5e\+40\) are not all finite"):
        engine.add_lora("c", str(tmp_path / "m"))
    (tmp_path / "m" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="a LoRA adapter needs a non-empty name, got ''"):
        engine.add_lora("", str(tmp_path / "m"))
    assert json.loads((tmp_path / "m" / "adapter_config.json").read_text()).get("lora_alpha") == 8
    other = make_checkpoint(tmp_path / "wide", "llama3", overrides={"hidden_size": 96})
    write_adapter(tmp_path / "wide_adapter", other, ALL, rank=4, alpha=8, seed=6)
    with pytest.raises(ValueError, match="the model implies"):
        engine.add_lora("c", str(tmp_path / "wide_adapter"))
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        engine.add_lora("c", str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="path must be a directory path"):
        engine.add_lora("c", 3)
    assert engine.lora_names == ["a", "b"]  # nothing half-loaded
    write_adapter(tmp_path / "c", hf, ALL, rank=4, alpha=8, seed=7)
    engine.add_lora("c", str(tmp_path / "c"))
    with pytest.raises(ValueError, match="all 3 LoRA slots are taken"):
        engine.add_lora("d", str(tmp_path / "c"))


def test_engines_that_cannot_serve_adapters(tmp_path):
    make_checkpoint(tmp_path / "llama", "llama3")
    plain = LLMEngine.from_model(str(tmp_path / "llama"), device="cpu", max_model_len=64, kv_cache_blocks=8)
    with pytest.raises(ValueError, match="max_loras > 0"):
        plain.add_lora("a", str(tmp_path))
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        plain.add_request("x", PROMPT, GREEDY, lora="a")
    make_checkpoint(tmp_path / "gemma", "gemma2")
    with pytest.raises(ValueError, match="Llama-family decoder only, not Gemma2ForCausalLM"):
        LLMEngine.from_model(str(tmp_path / "gemma"), device="cpu", max_model_len=64, kv_cache_blocks=8, max_loras=1)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLMEngine.from_model(str(tmp_path / "llama"), device="cpu", max_loras=1, tensor_parallel_size=2)


def test_grouped_delta_paths_agree(monkeypatch):
    """The grouped GEMM and the per-slot loop (CUDA fp16, where torch's grouped GEMM does not run)
    against the definition, with slots left empty and tokens out of slot order."""
    from tileattn.engine import lora

    gen = torch.Generator().manual_seed(0)
    slots_of_tokens = torch.tensor([2, 0, 2, 3, 0, 0, 2])
    x = torch.randn(7, 16, generator=gen)
    a, b = torch.randn(4, 8, 16, generator=gen), torch.randn(4, 24, 8, generator=gen)
    ref = torch.stack([b[s] @ (a[s] @ x[t]) for t, s in enumerate(slots_of_tokens.tolist())])
    adapters = lora.LoRAAdapters.__new__(lora.LoRAAdapters)
    adapters.max_loras = 3
    groups = adapters.groups(slots_of_tokens.numpy(), torch.device("cpu"))
    assert groups[2] == [3, 3, 6, 7]
    grouped = lora.grouped_delta(x, a, b, groups)
    monkeypatch.setattr(lora, "grouped_mm_supported", lambda device, dtype: False)
    looped = lora.grouped_delta(x, a, b, groups)
    for y in (grouped, looped):
        assert rel_error(y, ref) < 1e-6


def test_adapters_unloaded_and_replaced_at_run_time(tmp_path):
    """remove_lora frees a slot (refused while a request uses it); an adapter loaded into the freed
    slot answers as its own merged model, and shares no prefix-cache blocks with the one before it
    (nor with the base model); cache_salt keeps requests' blocks apart the same way."""
    hf = make_checkpoint(tmp_path / "base", "llama3")
    merged = {"a": write_adapter(tmp_path / "a", hf, ALL, rank=8, alpha=16, seed=1),
              "b": write_adapter(tmp_path / "b", hf, ALL, rank=8, alpha=16, seed=2)}
    llm = LLM(str(tmp_path / "base"), device="cpu", max_model_len=128, kv_cache_blocks=64, block_size=8,
              max_loras=1, max_lora_rank=8)
    engine = llm.engine
    engine.add_lora("a", str(tmp_path / "a"))
    prompt = [(5 * i) % 300 + 2 for i in range(40)]
    assert llm.generate(prompt, GREEDY, use_tqdm=False, lora="a")[0].outputs[0].token_ids == hf_greedy(merged["a"], prompt)
    engine.add_request("running", prompt, GREEDY, lora="a")
    with pytest.raises(ValueError, match="in use by 1 unfinished request"):
        engine.remove_lora("a")
    engine.abort_request("running")
    for bad, says in ((None, "an adapter's name"), ("zz", "unknown LoRA adapter 'zz'")):
        with pytest.raises(ValueError, match=says):
            engine.remove_lora(bad)  # the base model's slot is not an adapter's
    engine.remove_lora("a")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'a'"):
        engine.add_request("x", prompt, GREEDY, lora="a")
    engine.add_lora("b", str(tmp_path / "b"))  # the same slot
    out = llm.generate(prompt, GREEDY, use_tqdm=False, lora="b")[0]
    assert out.num_cached_tokens == 0, "b reused blocks a computed in the same slot"
    assert out.outputs[0].token_ids == hf_greedy(merged["b"], prompt)
    base = [llm.generate(prompt, GREEDY, use_tqdm=False, cache_salt=s)[0] for s in (None, "tenant-1", "tenant-1")]
    assert [o.num_cached_tokens > 0 for o in base] == [False, False, True]
    assert len({tuple(o.outputs[0].token_ids) for o in base}) == 1
    with pytest.raises(ValueError, match="cache_salt must be a str"):
        engine.add_request("y", prompt, GREEDY, cache_salt=3)


def test_steps_without_adapter_tokens_keep_the_fused_path(served, monkeypatch):
    """A step in which no token has an adapter runs the layers' fused path (no LoRA deltas); one with
    any adapter token runs the unfused path for all its tokens."""
    from tileattn.engine.models.llama import DecoderLayer

    llm, merged, _ = served
    calls = []
    forward_lora = DecoderLayer.forward_lora
    monkeypatch.setattr(DecoderLayer, "forward_lora", lambda self, *a: (calls.append(1), forward_lora(self, *a))[1])
    base = engine_logits(llm.engine, PROMPT)
    assert not calls and rel_error(base, hf_logits(merged[None], PROMPT)) < 1e-5
    engine_logits(llm.engine, PROMPT, "a")
    assert len(calls) == len(llm.engine.runner.model.layers)


def test_a_missing_lora_alpha_is_peft_default_8(tmp_path):
    """PEFT's LoraConfig defaults lora_alpha to 8, not to r (the engine took r before 2026-12-05)."""
    hf = make_checkpoint(tmp_path / "base", "llama3")
    merged = write_adapter(tmp_path / "a", hf, ALL[:2], rank=16, alpha=8, seed=3)
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    del config["lora_alpha"]
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config))
    engine = LLMEngine.from_model(str(tmp_path / "base"), device="cpu", max_model_len=128, kv_cache_blocks=16,
                                  max_loras=1, max_lora_rank=16)
    engine.add_lora("a", str(tmp_path / "a"))
    assert rel_error(engine_logits(engine, PROMPT, lora="a"), hf_logits(merged, PROMPT)) < 1e-5
