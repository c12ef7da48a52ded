"""Gemma 2 and Gemma 3 (text): the Llama-family decoder (llama.py) with Gemma's differences, each
mapped onto the engine's existing pieces:

- RMSNorm scales by (1 + w): load_weight adds 1 to every norm weight (Gemma 3's q/k norms too), so
  the shared RMSNorm runs unchanged (one more rounding of the weight in bf16 / fp16 than
  transformers' fp32 product).
- the embeddings are multiplied by sqrt(hidden), rounded to the model dtype as transformers does.
- sandwich norms: the attention's and the MLP's outputs are normalised (post_attention_layernorm,
  post_feedforward_layernorm) before they join the residual; pre_feedforward_layernorm precedes the MLP.
- the MLP gates with GELU's tanh form (GatedMLP(act="gelu_tanh")).
- attention scale query_pre_attn_scalar^-1/2; a sliding window on the layers ``layer_types`` names
  "sliding_attention"; Gemma 2 caps the scores (attn_logit_softcapping: tileattn's softcap) and
  the logits (final_logit_softcapping: c tanh(logits / c)); Gemma 3 normalises q and k per head
  (the fused qkv + rotary launch's q/k norm) and rotates the sliding layers with their own rope
  base (rope_local_base_freq: extra["local_rope"], which LlamaForCausalLM.layer_ropes gives the
  windowed layers), the full layers with the global one (and its scaling).
The options arrive in ModelConfig.extra (loader._gemma_options).
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers import PagedAttention
from .llama import LlamaForCausalLM, SandwichDecoderLayer

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


class GemmaForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM's interface (forward, compute_logits, load_weight) for Gemma 2 and 3."""

    supports_lora = False

    def __init__(self, cfg, dtype: torch.dtype, max_positions: int, tp=None):
        super().__init__(cfg, dtype, max_positions, tp)
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype)  # rounded as transformers does

    def make_layer(self, index: int, dtype: torch.dtype) -> nn.Module:
        cfg, extra = self.cfg, self.cfg.extra
        attention = PagedAttention(cfg, dtype, self.tp, sliding_window=extra["layer_windows"][index],
                                   softcap=extra["attn_softcap"], scale=extra["query_pre_attn_scalar"] ** -0.5)
        return SandwichDecoderLayer(cfg, dtype, self.tp, attention, "gelu_tanh")

    def embed(self, input_ids):  # [T] -> [T, hidden]
        return super().embed(input_ids) * self.embed_scale

    def compute_logits(self, hidden):  # [N, hidden] -> [N, vocab] float32 (rank 0; others None)
        logits = super().compute_logits(hidden)
        cap = self.cfg.extra["final_softcap"]
        if logits is None or not cap:
            return logits
        return torch.tanh(logits / cap) * cap

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        if name.endswith("norm.weight"):  # Gemma's RMSNorm scales by 1 + w
            tensor = tensor.float() + 1.0
        super().load_weight(name, tensor)
