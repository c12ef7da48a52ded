"""Each architecture against transformers' own implementation of it (fp32, CPU).

Bound: ||logits - logits_hf|| / ||logits_hf|| < 1e-5 over a 40-token prompt (measured 5.8e-7 to 6.6e-7;
both run float32, differing only in summation order), and 32 greedy tokens identical.
"""

import pytest
import torch

from tileattn.engine import LLMEngine, SamplingParams

from .checkpoints import ARCHITECTURES, engine_logits, make_checkpoint, rel_error

PROMPT = [0, 17, 203, 5, 99, 42, 300, 7, 8, 150, 61, 2, 33, 250, 19, 77, 180, 4, 90, 12,
          111, 222, 333, 44, 55, 66, 77, 88, 99, 101, 202, 303, 14, 25, 36, 47, 58, 69, 70, 81]


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch_pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_checkpoint(path, request.param)
    engine = LLMEngine.from_model(str(path), device="cpu", max_model_len=256, kv_cache_blocks=64, block_size=16)
    return request.param, hf, engine


def test_logits_match_transformers(arch_pair):
    arch, hf, engine = arch_pair
    ours = engine_logits(engine, PROMPT)  # [T, V]
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()  # [T, V]
    err = rel_error(ours, ref)
    assert err < 1e-5, f"{arch}: logits relative error {err:.2e} vs transformers (bound 1e-5)"


def test_greedy_tokens_match_transformers(arch_pair):
    arch, hf, engine = arch_pair
    # min_tokens: EOS masked for all 32 tokens, as transformers' min_new_tokens does
    params = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)
    engine.add_request("greedy", PROMPT, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    ours = outputs[-1].outputs[0].token_ids
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                          pad_token_id=1)[0, len(PROMPT):].tolist()
    assert ours == ref, f"{arch}: greedy tokens differ from transformers\n ours {ours}\n   hf {ref}"
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], f"{arch}: blocks leaked: {stats}"


def test_config_fields_read(arch_pair):
    arch, hf, engine = arch_pair
    cfg = engine.model_config
    assert cfg.head_dim == getattr(hf.config, "head_dim", None) or hf.config.hidden_size // hf.config.num_attention_heads
    assert cfg.tie_word_embeddings == bool(hf.config.tie_word_embeddings), arch
    assert cfg.qk_norm == (arch in ("qwen3", "gemma3", "qwen3-moe", "exaone4"))
    assert cfg.qkv_bias == (arch in ("qwen2", "llama2", "qwen2-moe", "gpt-oss", "glm4", "seed-oss", "ernie4.5"))
    if arch == "llama3":
        assert cfg.rope_scaling["rope_type"] == "llama3"


def test_layers_use_only_the_returned_residual(tmp_path, monkeypatch):
    """add_rms_norm_linear and add_rms_norm_qkv_rope_ consume the residual they are given: their
    GEMV path (CUDA, few rows) leaves it untouched and returns the sum in a new tensor, while the
    composition path that runs here updates it in place, which would hide a layer reading the
    stale tensor. Emulated: each call's sum goes to a fresh tensor and the residual passed in is
    overwritten with NaN; the logits must still match transformers'."""
    from tileattn.engine import layers

    calls = []

    def consuming(name):
        composition = getattr(layers, name)

        def call(x, residual, *args, **kwargs):
            y, new_residual = composition(x, None if residual is None else residual.clone(), *args, **kwargs)
            if residual is not None:
                residual.fill_(float("nan"))
            calls.append((name, residual is None))
            return y, new_residual

        monkeypatch.setattr(layers, name, call)

    consuming("add_rms_norm_linear")
    consuming("add_rms_norm_qkv_rope_")
    hf = make_checkpoint(tmp_path, "llama2")
    engine = LLMEngine.from_model(str(tmp_path), device="cpu", max_model_len=256, kv_cache_blocks=64, block_size=16)
    ours = engine_logits(engine, PROMPT)  # [T, V]
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()  # [T, V]
    # 2 layers x 2 norms, the first without a residual: the fused ops ran every time
    qkv, mlp = "add_rms_norm_qkv_rope_", "add_rms_norm_linear"
    assert calls == [(qkv, True), (mlp, False), (qkv, False), (mlp, False)], calls
    err = rel_error(ours, ref)
    assert err < 1e-5, f"logits relative error {err:.2e} vs transformers with the residual consumed (bound 1e-5)"


def test_phi3_longrope_factors_by_context(tmp_path):
    """Phi-3's longrope on a model whose original context is 32 of 512 positions (attention factor
    sqrt(1 + ln 16 / ln 32) on the rotating dims, 12 of 16). transformers picks the short or the long
    factors per forward, by its longest position; the engine per instance, by max_model_len: an
    engine of at most 32 positions uses the short ones (transformers' answer for any prompt it can
    take), a longer one the long ones (transformers' answer for prompts past 32 positions)."""
    hf = make_checkpoint(tmp_path, "phi3", overrides={"original_max_position_embeddings": 32})
    short = LLMEngine.from_model(str(tmp_path), device="cpu", max_model_len=32, kv_cache_blocks=16, block_size=16)
    long = LLMEngine.from_model(str(tmp_path), device="cpu", max_model_len=256, kv_cache_blocks=64, block_size=16)
    for engine, prompt in ((short, PROMPT[:20]), (long, PROMPT)):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        err = rel_error(engine_logits(engine, prompt), ref)
        assert err < 1e-5, f"{len(prompt)}-token prompt on {engine.max_model_len} positions: {err:.2e}"
    assert rel_error(engine_logits(long, PROMPT[:20]), engine_logits(short, PROMPT[:20])) > 1e-2  # the factors differ


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 24, "beta_fast": 16, "beta_slow": 2,
     "truncate": False},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 24, "mscale": 1.0, "mscale_all_dim": 0.5}],
    ids=["yarn", "yarn-untruncated", "yarn-mscale"])
def test_yarn_rope_scaling(tmp_path, rope):
    """YaRN (Qwen3's long-context setting, gpt-oss, DeepSeek): the frequencies blended over the
    correction range and the tables scaled by the attention factor, against transformers over a
    prompt past the original context."""
    hf = make_checkpoint(tmp_path, "qwen3", overrides={"rope_parameters": {**rope, "rope_theta": 10000.0}})
    engine = LLMEngine.from_model(str(tmp_path), device="cpu", max_model_len=256, kv_cache_blocks=64, block_size=16)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    err = rel_error(engine_logits(engine, PROMPT), ref)
    assert err < 1e-5, f"{rope}: logits relative error {err:.2e}"


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "mixtral", "phi3"])
def test_partial_rotary_factor_read_as_transformers_reads_it(tmp_path, arch):
    """config.json's partial_rotary_factor: transformers' Phi-3 (and GLM-4) rotate that fraction of each
    head; its Qwen2, Mistral, Mixtral (the Llama family's rotary) ignore the field. The engine
    follows each: the logits match transformers either way (before 2026-12-05 the engine rotated a
    Qwen2 or Mistral config.json's heads partially, 0.8 relative from transformers)."""
    hf = make_checkpoint(tmp_path, arch, overrides={"partial_rotary_factor": 0.5})
    engine = LLMEngine.from_model(str(tmp_path), device="cpu", max_model_len=128, kv_cache_blocks=16)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    err = rel_error(engine_logits(engine, PROMPT), ref)
    assert err < 1e-5, f"{arch} with partial_rotary_factor 0.5: logits relative error {err:.2e} vs transformers"
