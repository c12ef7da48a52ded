"""Mixture-of-experts GGUF files (llama.cpp's layout) against the HF checkpoint they were written from.

The tiny HF checkpoints of tests/engine/checkpoints.py are written as float32 GGUF files the way
llama.cpp's converter lays them out: the experts stacked per projection (blk.N.ffn_gate_exps [E, ffn,
hidden], ffn_up_exps, ffn_down_exps [E, hidden, ffn]), the router as ffn_gate_inp, Qwen2-MoE's shared
expert as ffn_*_shexp with its gate as a vector (ffn_gate_inp_shexp [hidden]), Mixtral under the
"llama" architecture with Q and K rows permuted for interleaved rotary, early Mixtral files with
one tensor per expert (blk.N.ffn_gate.E.weight). transformers' own GGUF loader reads the Qwen files
(an independent reader of the layout: its logits must equal the HF model's), and the engine's logits
from each file must equal the HF model's within 1e-5 (both float32).
"""

import numpy as np
import pytest
import torch

from tileattn.engine import LLMEngine
from tileattn.engine.loader import read_model_config

from .checkpoints import engine_logits, make_checkpoint, rel_error
from .gguf_files import transformers_logits, write_gguf
from .test_models import PROMPT

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """written(arch) -> (arch, HF model, folder, GGUF path), each architecture written once."""
    cache = {}

    def get(arch):
        if arch not in cache:
            folder = tmp_path_factory.mktemp(arch)
            # llama.cpp's qwen2moe has no dense layers (its tensor list lacks ffn_gate / up / down)
            overrides = {"mlp_only_layers": []} if arch == "qwen2-moe" else None
            hf = make_checkpoint(folder, arch, overrides=overrides)
            cache[arch] = arch, hf, folder, write_gguf(folder, folder / "model.gguf", arch)
        return cache[arch]

    return get


@pytest.fixture(params=["mixtral", "qwen2-moe", "qwen3-moe"])
def moe_gguf(request, written):
    return written(request.param)


def test_gguf_moe_logits_match_the_hf_checkpoint(moe_gguf):
    arch, hf, _, path = moe_gguf
    engine = LLMEngine.from_model(path, device="cpu", max_model_len=128, kv_cache_blocks=16)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    err = rel_error(engine_logits(engine, PROMPT), ref)
    assert err < 1e-5, f"{arch} GGUF: logits relative error {err:.2e} vs the HF checkpoint (bound 1e-5)"


def test_gguf_moe_config_equals_the_hf_one(moe_gguf):
    arch, _, folder, path = moe_gguf
    ours, ref = read_model_config(path), read_model_config(str(folder))
    assert ours.architecture == ref.architecture
    assert ours.extra["moe"] == ref.extra["moe"], arch
    assert (ours.qkv_bias, ours.qk_norm, ours.head_dim) == (ref.qkv_bias, ref.qk_norm, ref.head_dim)


@pytest.mark.parametrize("arch", ["qwen2-moe", "qwen3-moe"])
def test_transformers_reads_the_written_layout_the_same(written, arch):
    """The file follows the tensor layout transformers' GGUF loader (after llama.cpp) expects: loaded
    by it, the Qwen files give the HF model's logits (transformers reads no GGUF Mixtral: that layout
    rests on the llama permutation the SmolLM2 test checks and the stacked experts checked here)."""
    _, hf, _, path = written(arch)
    assert rel_error(*transformers_logits(hf, path, PROMPT)) < 1e-6


def test_early_mixtral_files_with_one_tensor_per_expert(tmp_path):
    hf = make_checkpoint(tmp_path, "mixtral")
    path = write_gguf(tmp_path, tmp_path / "old.gguf", "mixtral", per_expert_tensors=True)
    engine = LLMEngine.from_model(path, device="cpu", max_model_len=128, kv_cache_blocks=16)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    assert rel_error(engine_logits(engine, PROMPT), ref) < 1e-5


def test_gguf_expert_metadata_errors(tmp_path):
    from tileattn.engine.loader import model_config_from_gguf

    base = {"general.architecture": "qwen3moe", "qwen3moe.embedding_length": 64, "qwen3moe.attention.head_count": 4,
            "qwen3moe.block_count": 1, "qwen3moe.feed_forward_length": 96, "qwen3moe.expert_count": 4,
            "qwen3moe.expert_used_count": 2}
    shapes = {"token_embd.weight": (384, 64), "blk.0.ffn_gate_inp.weight": (4, 64),
              "blk.0.ffn_gate_exps.weight": (4, 32, 64)}
    cfg = model_config_from_gguf(base, set(shapes), shapes)
    assert cfg.architecture == "Qwen3MoeForCausalLM"
    assert cfg.extra["moe"] == {"num_experts": 4, "top_k": 2, "expert_ffn": 32, "renormalize": True,
                                "sparse_layers": [True], "shared_ffn": 0}
    for change, message in (({"qwen3moe.expert_count": None}, "lacks qwen3moe.expert_count"),
                            ({"qwen3moe.expert_used_count": 5}, "exceeds the 4 experts"),
                            ({"qwen3moe.expert_gating_func": 2}, "expert_gating_func=2"),
                            ({"qwen3moe.expert_used_count": None}, "num_experts_per_tok")):
        with pytest.raises(ValueError, match=message):
            model_config_from_gguf({**base, **change}, set(shapes), shapes)
    no_router = {k: v for k, v in shapes.items() if "gate_inp" not in k}
    with pytest.raises(ValueError, match="no router tensor"):
        model_config_from_gguf(base, set(no_router), no_router)


def _yarn(w, tensors):
    w.add_string("llama.rope.scaling.type", "yarn")
    w.add_float32("llama.rope.scaling.factor", 4.0)


def _linear_without_factor(w, tensors):
    w.add_string("llama.rope.scaling.type", "linear")


def _unknown_tensor(w, tensors):
    tensors["blk.0.foo.weight"] = torch.zeros(4)


def _no_embedding(w, tensors):
    del tensors["token_embd.weight"]


def _short_rope_freqs(w, tensors):
    tensors["rope_freqs.weight"] = torch.ones(3)


def _q8_1_tensor(w, tensors):
    import gguf

    shape = tuple(tensors.pop("blk.0.attn_output.weight").shape)  # [rows, cols]: Q8_1 blocks of 32 values, 40 bytes
    w.add_tensor("blk.0.attn_output.weight", np.zeros((shape[0], shape[1] // 32 * 40), np.uint8),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_1)


# Each loaded before this session (2026-12-05) and computed something else than the file means (yarn
# ignored, an unknown tensor skipped) or failed with a raw KeyError / NotImplementedError /
# shape error; now a ValueError naming it.
MALFORMED_GGUF = {
    "yarn scaling": (_yarn, "rope.scaling.type 'yarn' is not supported"),
    "linear scaling without its factor": (_linear_without_factor, "lacks llama.rope.scaling.factor"),
    "an unknown tensor": (_unknown_tensor, "blk.0.foo.weight has no place"),
    "no embedding": (_no_embedding, "lacks the token_embd.weight tensor"),
    "rope_freqs of the wrong length": (_short_rope_freqs, "rope_freqs.weight holds 3 factors"),
    "a tensor type gguf cannot read": (_q8_1_tensor, "blk.0.attn_output.weight has type Q8_1"),
}


@pytest.mark.parametrize("case", list(MALFORMED_GGUF))
def test_malformed_gguf_files_are_refused_at_load(tmp_path, case):
    edit, message = MALFORMED_GGUF[case]
    make_checkpoint(tmp_path, "mixtral")  # written with the llama GGUF architecture
    path = write_gguf(tmp_path, tmp_path / "bad.gguf", "mixtral", edit=edit)
    with pytest.raises(ValueError, match=message):
        LLMEngine.from_model(path, device="cpu", max_model_len=64, kv_cache_blocks=8)
