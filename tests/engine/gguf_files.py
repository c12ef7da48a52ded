"""float32 GGUF files written from the tiny HF checkpoints of tests/engine/checkpoints.py the way
llama.cpp's converter (convert_hf_to_gguf.py) lays them out, for the GGUF loader's tests: the
metadata keys and tensor names of gguf-py's constants, Q and K rows permuted for the "llama"
architecture (interleaved rotary in llama.cpp), experts stacked per projection (or one tensor per
expert, as early Mixtral files), Phi-3's fused attn_qkv and ffn_up (gate then up) with its partial
rotary's dimension count, original context, attention factor and longrope factor tensors.
"""

from __future__ import annotations

import json
import math

import numpy as np
import torch
from safetensors.torch import load_file

ARCH = {"mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2-moe": "qwen2moe", "qwen3-moe": "qwen3moe",
        "phi3": "phi3"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_EXPERT = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def _permute_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's Q/K row order for "llama" models: per head (0, d/2, 1, d/2 + 1, ...)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _phi3_metadata(w, config: dict, out: dict) -> None:
    """Phi3MiniModel's keys: the rotating dims' count, the original context, the window (0: none),
    and for longrope the attention factor and the two factor tensors."""
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    rope = config.get("rope_parameters") or {}
    partial = config.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
    w.add_rope_dimension_count(int(partial * hidden) // heads)
    original = config.get("original_max_position_embeddings") or config["max_position_embeddings"]
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_sliding_window(config.get("sliding_window") or 0)
    if rope.get("rope_type") == "longrope":
        scale = config["max_position_embeddings"] / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        out["rope_factors_long.weight"] = torch.tensor(rope["long_factor"], dtype=torch.float32)
        out["rope_factors_short.weight"] = torch.tensor(rope["short_factor"], dtype=torch.float32)


def write_gguf(hf_dir, path, arch: str, per_expert_tensors: bool = False, edit=None) -> str:
    """Write the checkpoint in ``hf_dir`` (arch: a key of ARCH) as a float32 GGUF file at ``path``
    with a small SentencePiece-style vocabulary; returns the path. ``edit(writer, tensors)``, when
    given, runs before the tensors are written: more metadata, tensors added to or removed from
    the name -> tensor dict (malformed files for the loader's tests)."""
    import gguf

    config = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(hf_dir / "model.safetensors")
    name = ARCH[arch]
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
    w.add_rope_freq_base((config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0)))
    if config.get("head_dim"):
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
    out = {"token_embd.weight": tensors.pop("model.embed_tokens.weight"),
           "output_norm.weight": tensors.pop("model.norm.weight")}
    if "lm_head.weight" in tensors:
        out["output.weight"] = tensors.pop("lm_head.weight")
    if name == "phi3":
        _phi3_metadata(w, config, out)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(config["num_experts_per_tok"])
        if "moe_intermediate_size" in config:
            w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
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
    if edit is not None:
        edit(w, out)
    for gguf_name, t in out.items():
        w.add_tensor(gguf_name, t.float().numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def transformers_logits(hf, path, prompt) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of transformers' own GGUF loader reading ``path``, the HF model's), float32 [T, V],
    over ``prompt``. The HF model's config is given to the loader: transformers' GGUF config reader
    maps only the common fields (not experts' ffn sizes, partial rotary or longrope)."""
    import os

    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                              config=hf.config, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0], hf(torch.tensor([prompt])).logits[0]
