"""One Llama-family decoder covering Llama 2/3/3.x, Mistral, Qwen2/2.5 and Qwen3.

The architectures differ only in options of ModelConfig: qkv/o/mlp biases, per-head q/k RMSNorm
(Qwen3), explicit head_dim, rope scaling, tied embeddings. Weights use the HF parameter names;
q/k/v and gate/up checkpoint tensors are copied into row ranges of the fused projections.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import (
    AttentionBatch,
    GatedMLP,
    PagedAttention,
    RMSNorm,
    Rotary,
    rope_inv_freq,
)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

# checkpoint projection -> (fused parameter, shard index)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class DecoderLayer(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype):
        super().__init__()
        self.self_attn = PagedAttention(cfg, dtype)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, rope, x, residual, batch):  # x, residual [T, hidden]
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], batch) -> hidden [T, hidden];
    compute_logits(hidden [N, hidden]) -> float32 logits [N, vocab].

    Build it under ``torch.device(...)``: parameters are allocated uninitialised on that device and
    filled by load_weight, tensor by tensor."""

    def __init__(self, cfg, dtype: torch.dtype, max_positions: int):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                 cfg.extra.get("rope_freq_factors"))
        self.rotary = Rotary(max_positions, inv_freq, dtype)
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype),
                                         requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self._shard_rows = {"qkv_proj": [(0, q), (q, kv), (q + kv, kv)],
                            "gate_up_proj": [(0, cfg.intermediate_size), (cfg.intermediate_size,) * 2]}
        self._loaded: set[tuple[str, int]] = set()

    def forward(self, input_ids, positions, batch: AttentionBatch):
        x = F.embedding(input_ids, self.embed_tokens)  # [T, hidden]
        rope = self.rotary(positions)
        residual = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual, batch)
        x, _ = self.norm(x, residual)
        return x  # [T, hidden]

    def compute_logits(self, hidden):  # hidden [N, hidden] -> [N, vocab] float32
        return F.linear(hidden, self.lm_head).float()

    # ---- weights -------------------------------------------------------------------------------

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        """Copy checkpoint tensor ``name`` (HF naming) into its parameter, casting to the model dtype
        on the way (the copy runs on the parameter's device).

        Raises ValueError for an unknown name or a shape that does not match the config."""
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
            return
        target, shard = self._target(name)
        param = self.get_parameter(target)
        if shard is not None:
            fused = target.split(".")[-2]
            start, rows = self._shard_rows[fused][shard]
            param = param.narrow(0, start, rows)
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, the config "
                             f"implies {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
        self._loaded.add((target, shard))

    def check_loaded(self) -> None:
        """Raises ValueError listing the parameters no checkpoint tensor filled."""
        missing = []
        for pname, _ in self.named_parameters():
            fused = pname.split(".")[-2] if "." in pname else ""
            shards = range(len(self._shard_rows[fused])) if fused in self._shard_rows else [None]
            missing += [f"{pname}[{s}]" if s is not None else pname
                        for s in shards if (pname, s) not in self._loaded]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {', '.join(missing[:4])}")

    def _target(self, name: str):
        parts = name.split(".")
        if parts[0] == "model":
            parts = parts[1:]
        if parts[:1] == ["embed_tokens"]:
            return "embed_tokens", None
        if parts[:1] == ["lm_head"]:
            return "lm_head", None
        if len(parts) >= 4 and parts[0] == "layers" and parts[-2] in _FUSED:
            fused, shard = _FUSED[parts[-2]]
            return ".".join(parts[:-2] + [fused, parts[-1]]), shard
        target = ".".join(parts)
        try:
            self.get_parameter(target)
        except AttributeError:
            raise ValueError(f"checkpoint tensor {name} has no place in {self.cfg.architecture}") from None
        return target, None
