"""GLM-4 (Glm4ForCausalLM: GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1), on llama.py's decoder pieces:

- four norms per layer, as Gemma's (llama.SandwichDecoderLayer; plain RMSNorm weights): the
  checkpoint's post_self_attn_layernorm is the one on the attention's output, its
  post_attention_layernorm the one before the MLP, its post_mlp_layernorm the one on the MLP's output;
- interleaved partial rotary: half of each head's dims rotate, in pairs (2i, 2i + 1) (the loader's
  "rotary_dim" and "rotary_interleaved"; llama.py reorders q's and k's rows at load time);
- the MLP's gate and up fused in the checkpoint (gate_up_proj: split at load time, as Phi-3's).
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers import PagedAttention
from .llama import LlamaForCausalLM, SandwichDecoderLayer

GLM_ARCHITECTURES = ("Glm4ForCausalLM",)

# the checkpoint's norm names -> SandwichDecoderLayer's
_NORMS = {"post_self_attn_layernorm": "post_attention_layernorm",
          "post_attention_layernorm": "pre_feedforward_layernorm",
          "post_mlp_layernorm": "post_feedforward_layernorm"}


class GlmForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM's interface (forward, compute_logits, load_weight) for GLM-4."""

    supports_lora = False

    def make_layer(self, index: int, dtype: torch.dtype) -> nn.Module:
        return SandwichDecoderLayer(self.cfg, dtype, self.tp, PagedAttention(self.cfg, dtype, self.tp), "silu")

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in _NORMS:
            name = ".".join(parts[:-2] + [_NORMS[parts[-2]], parts[-1]])
        super().load_weight(name, tensor)
