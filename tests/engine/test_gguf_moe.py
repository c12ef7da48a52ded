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

import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tileattn.engine import LLMEngine
from tileattn.engine.loader import read_model_config

from .checkpoints import engine_logits, make_checkpoint, rel_error
from .test_models import PROMPT

gguf = pytest.importorskip("gguf")

_ARCH = {"mixtral": "llama", "qwen2-moe": "qwen2moe", "qwen3-moe": "qwen3moe"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_EXPERT = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def _permute_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's Q/K row order for "llama" models: per head (0, d/2, 1, d/2 + 1, ...)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_moe_gguf(hf_dir, path, arch: str, per_expert_tensors: bool = False) -> str:
    config = __import__("json").loads((hf_dir / "config.json").read_text())
    tensors = load_file(hf_dir / "model.safetensors")
    name = _ARCH[arch]
    w = gguf.GGUFWriter(str(path), name)
    vocab = config["vocab_size"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581p{i}" for i in range(vocab - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(vocab - 259)])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (vocab - 259))
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    experts = config.get("num_experts") or config.get("num_local_experts")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    if config.get("head_dim"):
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
    w.add_expert_count(experts)
    w.add_expert_used_count(config["num_experts_per_tok"])
    if "moe_intermediate_size" in config:
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    out = {"token_embd.weight": tensors.pop("model.embed_tokens.weight"),
           "output_norm.weight": tensors.pop("model.norm.weight")}
    if "lm_head.weight" in tensors:
        out["output.weight"] = tensors.pop("lm_head.weight")
    stacked = {}  # (layer, projection) -> {expert: tensor}
    for hf_name, t in tensors.items():
        parts = hf_name.replace("block_sparse_moe", "mlp").split(".")  # model.layers.L....
        layer, rest = parts[2], parts[3:]
        if rest[:2] == ["mlp", "experts"]:
            expert, projection = int(rest[2]), _EXPERT[rest[3]]
            if per_expert_tensors:
                out[f"blk.{layer}.ffn_{projection}.{expert}.weight"] = t
            stacked.setdefault((layer, projection), {})[expert] = t
            continue
        gguf_name = f"blk.{layer}.{_LAYER['.'.join(rest[:-1])]}.{rest[-1]}"
        if name == "llama" and rest[1] in ("q_proj", "k_proj"):
            t = _permute_rotary(t, heads if rest[1] == "q_proj" else kv_heads)
        if rest[1] == "shared_expert_gate":
            t = t.reshape(-1)
        out[gguf_name] = t
    if not per_expert_tensors:
        for (layer, projection), by_expert in stacked.items():
            out[f"blk.{layer}.ffn_{projection}_exps.weight"] = torch.stack([by_expert[e] for e in range(experts)])
    for gguf_name, t in out.items():
        w.add_tensor(gguf_name, t.float().numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


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
            cache[arch] = arch, hf, folder, write_moe_gguf(folder, folder / "model.gguf", arch)
        return cache[arch]

    return get


@pytest.fixture(params=sorted(_ARCH))
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
    import transformers

    _, hf, folder, path = written(arch)

    # config given: transformers' GGUF config reader does not map the experts' ffn sizes
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=os.path.basename(path),
                                                              config=hf.config, dtype=torch.float32).eval()
    with torch.no_grad():
        ours, ref = model(torch.tensor([PROMPT])).logits[0], hf(torch.tensor([PROMPT])).logits[0]
    assert rel_error(ours, ref) < 1e-6


def test_early_mixtral_files_with_one_tensor_per_expert(tmp_path):
    hf = make_checkpoint(tmp_path, "mixtral")
    path = write_moe_gguf(tmp_path, tmp_path / "old.gguf", "mixtral", per_expert_tensors=True)
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
