"""The torch.compile decode peer of `bench engine` (engine/compile_peer.py) is a faithful Llama: its
greedy tokens equal transformers' on tiny random models (eager steps; the compiled step runs only
on the GPU benchmark), and its logits match transformers' forward."""

import pytest
import torch
import transformers

from tileattn.engine.compile_peer import GreedyDecoder, StaticCacheLlama

CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300, rms_norm_eps=1e-5,
                  rope_theta=500000.0, max_position_embeddings=256, tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300, rms_norm_eps=1e-6,
                  max_position_embeddings=256, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=300, rms_norm_eps=1e-6,
                  max_position_embeddings=256, tie_word_embeddings=True),
}


def _model(kind):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**CONFIGS[kind])
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # larger weights than the init's: logits far apart, greedy ties impossible
        for p in model.parameters():
            p.mul_(4.0)
    return model


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_logits_match_transformers(kind):
    model = _model(kind)
    ids = torch.randint(0, 300, (1, 19), generator=torch.Generator().manual_seed(1))
    peer = StaticCacheLlama(model, max_len=64)
    with torch.no_grad():
        ref = model(ids).logits.double()
        got = peer(ids, torch.arange(19)).double()
    err = float((got - ref).norm() / ref.norm())
    assert err < 1e-5, f"{kind}: relative error of the peer's logits {err:.2e}"


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_greedy_tokens_match_transformers(kind):
    model = _model(kind)
    ids = torch.randint(0, 300, (1, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)[0, 11:]
    got = GreedyDecoder(model, max_len=48, compile=False).generate(ids, 24)
    assert got.tolist() == ref.tolist()


def test_too_long_is_an_error():
    model = _model("llama")
    with pytest.raises(ValueError, match="exceeds the cache"):
        GreedyDecoder(model, max_len=16, compile=False).generate(torch.zeros(1, 10, dtype=torch.int64), 7)
