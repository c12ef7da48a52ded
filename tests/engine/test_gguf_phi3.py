"""Phi-3 GGUF files (llama.cpp's layout: fused attn_qkv and ffn_up, rope.dimension_count for the
partial rotary, longrope's factors as tensors) against the HF checkpoint they were written from.

transformers' own GGUF loader reads the written file (an independent reader of the tensor layout:
its logits must equal the HF model's), and the engine's logits from the file must equal the HF
model's within 1e-5 (both float32), with the short factors and with the long ones.
"""

import math

import pytest
import torch

from tileattn.engine import LLMEngine
from tileattn.engine.loader import model_config_from_gguf, read_model_config

from .checkpoints import engine_logits, make_checkpoint, rel_error
from .gguf_files import transformers_logits, write_gguf
from .test_models import PROMPT

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """(HF model, folder, GGUF path) of a Phi-3 whose original context is 32 of 512 positions
    (attention factor above 1; 12 of 16 head dims rotating)."""
    folder = tmp_path_factory.mktemp("phi3")
    hf = make_checkpoint(folder, "phi3", overrides={"original_max_position_embeddings": 32})
    return hf, folder, write_gguf(folder, folder / "model.gguf", "phi3")


def test_transformers_reads_the_written_layout_the_same(phi3):
    hf, _, path = phi3
    assert rel_error(*transformers_logits(hf, path, PROMPT)) < 1e-6


def test_gguf_phi3_logits_match_the_hf_checkpoint_short_and_long(phi3):
    """As test_models' longrope test: an engine of at most 32 positions runs the short factors, a
    longer one the long factors and the attention factor the file states."""
    hf, _, path = phi3
    short = LLMEngine.from_model(path, device="cpu", max_model_len=32, kv_cache_blocks=16, block_size=16)
    long = LLMEngine.from_model(path, device="cpu", max_model_len=256, kv_cache_blocks=64, block_size=16)
    for engine, prompt in ((short, PROMPT[:20]), (long, PROMPT)):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        err = rel_error(engine_logits(engine, prompt), ref)
        assert err < 1e-5, f"{len(prompt)}-token prompt on {engine.max_model_len} positions: {err:.2e}"


def test_gguf_phi3_config_equals_the_hf_one(phi3):
    _, folder, path = phi3
    ours, ref = read_model_config(path), read_model_config(str(folder))
    assert ours.architecture == ref.architecture == "Phi3ForCausalLM"
    assert ours.extra == ref.extra == {"rotary_dim": 12}
    for key in ("rope_type", "original_max_position_embeddings", "factor"):
        assert ours.rope_scaling[key] == ref.rope_scaling[key], key
    for key in ("long_factor", "short_factor"):
        assert ours.rope_scaling[key] == pytest.approx(ref.rope_scaling[key]), key
    assert ours.rope_scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(16) / math.log(32)), rel=1e-6)
    assert (ours.sliding_window, ours.head_dim, ours.num_kv_heads) == (ref.sliding_window, ref.head_dim, ref.num_kv_heads)


def test_gguf_phi3_metadata_errors():
    base = {"general.architecture": "phi3", "phi3.embedding_length": 64, "phi3.attention.head_count": 4,
            "phi3.block_count": 1, "phi3.feed_forward_length": 96, "phi3.context_length": 512}
    shapes = {"token_embd.weight": (384, 64)}
    cfg = model_config_from_gguf({**base, "phi3.attention.sliding_window": 2047}, set(shapes), shapes)
    assert (cfg.extra, cfg.rope_scaling, cfg.sliding_window) == ({}, None, 2047)
    assert model_config_from_gguf({**base, "phi3.attention.sliding_window": 0}, set(shapes), shapes).sliding_window is None
    factors = {"long": [2.0] * 6, "short": [1.0] * 6}
    for change, given, message in (({"phi3.rope.dimension_count": 13}, None, "even count"),
                                   ({"phi3.rope.dimension_count": 12}, factors, "original_context_length"),
                                   ({"phi3.rope.dimension_count": 12, "phi3.rope.scaling.original_context_length": 32},
                                    {"long": [2.0] * 6, "short": [1.0] * 5}, "rope_factors_short must hold 6")):
        with pytest.raises(ValueError, match=message):
            model_config_from_gguf({**base, **change}, set(shapes), shapes, given)
