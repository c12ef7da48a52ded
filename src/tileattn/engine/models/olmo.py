"""OLMo 2 and OLMo 3 (AllenAI's open models) and EXAONE 4.0 (LG's), on llama.py's decoder pieces:

- no norm before attention or the MLP: each branch's output is normalised (post_attention_layernorm,
  post_feedforward_layernorm) before its residual add;
- q and k normalised by an RMSNorm over the whole projection (all heads together, not per head),
  before the rotary: under tensor parallelism the sum of squares is all-reduced across the ranks'
  heads (divided by the replication of KV heads that several ranks hold);
- OLMo 3: a window (sliding_window) on the layers ``layer_types`` names sliding_attention (three in
  four), whose rotary has no scaling: rope_parameters["full_attention"]'s scaling (YaRN) is the full
  layers' only.
EXAONE 4.0 has the same layers with per-head q/k norms (PagedAttention's, as Qwen3's) instead of the
whole-projection ones ("whole_qk_norm" false), a window on three layers of four and no rotary on the
others ("rope_layers": the identity tables of llama.py).
The options arrive in ModelConfig.extra (loader._extra_options): "layer_windows", "local_rope",
"whole_qk_norm", "rope_layers".
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers import GatedMLP, PagedAttention, RMSNorm
from .llama import LlamaForCausalLM

OLMO_ARCHITECTURES = ("Olmo2ForCausalLM", "Olmo3ForCausalLM", "Exaone4ForCausalLM")


class OlmoDecoderLayer(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype, tp, sliding_window: int | None):
        super().__init__()
        self.tp = tp
        self.self_attn = PagedAttention(cfg, dtype, tp, sliding_window=sliding_window)
        self.mlp = GatedMLP(cfg.hidden_size, tp.split(cfg.intermediate_size)[1], cfg.mlp_bias, dtype, tp)
        attn = self.self_attn
        whole = cfg.extra.get("whole_qk_norm", True)  # else PagedAttention's per-head norms (EXAONE)
        self.q_norm = RMSNorm(attn.q_size, cfg.rms_norm_eps, dtype) if whole else None  # this rank's columns
        self.k_norm = RMSNorm(attn.kv_size, cfg.rms_norm_eps, dtype) if whole else None
        self.q_dims, self.k_dims = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.k_replicas = max(tp.size // cfg.num_kv_heads, 1)  # ranks holding each KV head
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def norm_across_ranks(self, x, norm: RMSNorm, dims: int, replicas: int):
        """RMSNorm of x [T, n] (this rank's part of a [T, dims] projection) over all dims."""
        if self.tp.size == 1:
            return norm(x, None)
        squares = self.tp.all_reduce(x.float().pow(2).sum(-1, keepdim=True)) / replicas  # [T, 1]
        return (x.float() * torch.rsqrt(squares / dims + norm.eps)).to(x.dtype) * norm.weight

    def forward(self, rope, x, residual, batch):  # x [T, hidden]; residual [T, hidden] or None (first layer)
        attn = self.self_attn
        stream = x if residual is None else x + residual  # [T, hidden]
        qkv = attn.qkv_proj(stream)  # [T, (H + 2 Hkv) d]
        if self.q_norm is not None:
            q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=1)
            q = self.norm_across_ranks(q, self.q_norm, self.q_dims, 1)
            k = self.norm_across_ranks(k, self.k_norm, self.k_dims, self.k_replicas)
            qkv = torch.cat((q, k, v), dim=1)
        out = attn.rotate_and_attend(rope, qkv, batch)  # [T, H d] (per-head q/k norms there, when the model has them)
        stream = stream + self.post_attention_layernorm(attn.o_proj(out), None)
        return self.post_feedforward_layernorm(self.mlp(self.mlp.gate_up_proj(stream)), None), stream


class OlmoForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM's interface (forward, compute_logits, load_weight) for OLMo 2 and 3, EXAONE 4.0."""

    supports_lora = False

    def __init__(self, cfg, dtype: torch.dtype, max_positions: int, tp=None):
        super().__init__(cfg, dtype, max_positions, tp)
        if cfg.extra.get("whole_qk_norm", True):  # each rank's columns of the whole-projection norms
            d = cfg.head_dim
            (h0, _), (k0, _) = self.tp.split(cfg.num_heads), self.tp.kv_heads(cfg.num_kv_heads)
            self._splits = {"q_norm.weight": (0, h0 * d, cfg.num_heads * d),
                            "k_norm.weight": (0, k0 * d, cfg.num_kv_heads * d), **self._splits}

    def make_layer(self, index: int, dtype: torch.dtype) -> nn.Module:
        return OlmoDecoderLayer(self.cfg, dtype, self.tp, self.cfg.extra["layer_windows"][index])

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        if self.cfg.extra.get("whole_qk_norm", True):  # the whole-projection q/k norms belong to the layer
            name = name.replace(".self_attn.q_norm.", ".q_norm.").replace(".self_attn.k_norm.", ".k_norm.")
        super().load_weight(name, tensor)
