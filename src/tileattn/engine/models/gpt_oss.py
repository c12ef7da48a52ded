"""gpt-oss (OpenAI's open-weight mixture-of-experts models), on llama.py's decoder:

- attention: q/k/v/o biases, a learned sink logit per head (PagedAttention(sinks=True): the output
  scaled by sigmoid(lse - sink)), a window on the layers ``layer_types`` names sliding_attention
  (128 keys, every other layer), YaRN rotary (layers.rope_inv_freq);
- MLP: a SparseMoE with the router's bias, top-k softmax (the renormalised top-k probabilities),
  biased experts and the clamped SwiGLU (layers.clamped_swiglu: alpha 1.702, limit 7);
- checkpoints: the experts stacked per layer, either as transformers keeps them dequantized
  (gate_up_proj [E, hidden, 2 ffn] with gate and up interleaved, gate the even columns; down_proj
  [E, ffn, hidden]) or as the released MXFP4 files (``*_blocks`` [E, out, in / 32, 16] bytes holding two
  FP4 E2M1 values each, low nibble first, and ``*_scales`` [E, out, in / 32] E8M0 exponents, bias
  127), dequantized at load (dequantize_mxfp4).
The options arrive in ModelConfig.extra (loader._extra_options): "layer_windows", "moe", "swiglu".
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ..layers import PagedAttention, SparseMoE, clamped_swiglu
from .llama import DecoderLayer, LlamaForCausalLM

GPT_OSS_ARCHITECTURES = ("GptOssForCausalLM",)

# layers.L.mlp.experts.<gate_up_proj|down_proj>[_bias|_blocks|_scales]
_EXPERTS = re.compile(r"(?:model\.)?layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?")
# FP4 E2M1: sign, two exponent bits, one mantissa bit
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 -> float32: blocks uint8 [..., G, 16] (32 FP4 values per group, the low nibble first),
    scales uint8 [..., G] (each group's power of two, biased by 127) -> [..., G * 32]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
                         "([..., G, 16] and [..., G])")
    table = torch.tensor(_FP4_VALUES, dtype=torch.float32, device=blocks.device)
    blocks = blocks.to(torch.uint8).long()
    values = torch.stack((table[blocks & 0x0F], table[blocks >> 4]), dim=-1).flatten(-2)  # [..., G, 32]
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2)


class GptOssForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM's interface (forward, compute_logits, load_weight) for gpt-oss."""

    supports_lora = False

    def __init__(self, cfg, dtype: torch.dtype, max_positions: int, tp=None):
        super().__init__(cfg, dtype, max_positions, tp)
        h0, _ = self.tp.split(cfg.num_heads)
        self._splits = {"sinks": (0, h0, cfg.num_heads), **self._splits}
        self._mxfp4: dict[tuple[int, str], dict] = {}  # (layer, projection) -> the blocks or scales seen so far

    def make_layer(self, index: int, dtype: torch.dtype) -> nn.Module:
        cfg, extra = self.cfg, self.cfg.extra
        moe, (alpha, limit) = extra["moe"], extra["swiglu"]
        attention = PagedAttention(cfg, dtype, self.tp, sliding_window=extra["layer_windows"][index], sinks=True)
        experts = SparseMoE(cfg.hidden_size, moe["num_experts"], self.tp.split(moe["expert_ffn"])[1], moe["top_k"],
                            True, dtype, self.tp, biases=True, activation=clamped_swiglu(alpha, limit))
        return DecoderLayer(cfg, dtype, self.tp, mlp=experts, attention=attention)

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        name = name.replace(".mlp.router.", ".mlp.gate.")  # the router: SparseMoE's gate
        match = _EXPERTS.fullmatch(name)
        if match is None:
            return super().load_weight(name, tensor)
        layer, projection, kind = int(match[1]), match[2], match[3] or ""
        if layer >= len(self.layers):
            raise ValueError(f"checkpoint tensor {name} has no place in {self.cfg.architecture}")
        if kind in ("_blocks", "_scales"):
            pending = self._mxfp4.setdefault((layer, projection), {})
            pending[kind] = tensor
            if len(pending) < 2:
                return
            del self._mxfp4[(layer, projection)]
            self._load_experts(layer, projection, "", dequantize_mxfp4(pending["_blocks"], pending["_scales"]), name)
            return
        if kind == "":  # transformers' dequantized form: [E, in, out]
            tensor = tensor.transpose(1, 2)
        self._load_experts(layer, projection, kind, tensor, name)

    def _load_experts(self, layer: int, projection: str, kind: str, tensor: torch.Tensor, name: str) -> None:
        """tensor: gate_up [E, 2 ffn, hidden] (rows interleaved gate, up) or its bias [E, 2 ffn];
        down [E, hidden, ffn] or its bias [E, hidden]."""
        moe, hidden = self.cfg.extra["moe"], self.cfg.hidden_size
        experts, full = moe["num_experts"], moe["expert_ffn"]
        first, ffn = self.tp.split(full)
        mlp = self.layers[layer].mlp
        expected = {("gate_up_proj", ""): (experts, 2 * full, hidden), ("gate_up_proj", "_bias"): (experts, 2 * full),
                    ("down_proj", ""): (experts, hidden, full), ("down_proj", "_bias"): (experts, hidden)}[projection, kind]
        if tuple(tensor.shape) != expected:
            raise ValueError(f"checkpoint tensor {name} gives experts of shape {tuple(tensor.shape)}, the config "
                             f"implies {expected}")
        if projection == "gate_up_proj":  # de-interleave into [gate | up], this rank's rows of each
            param = mlp.experts_gate_up if kind == "" else mlp.experts_gate_up_bias
            parts = (tensor[:, 0::2].narrow(1, first, ffn), tensor[:, 1::2].narrow(1, first, ffn))
            with torch.no_grad():
                param[:, :ffn].copy_(parts[0])
                param[:, ffn:].copy_(parts[1])
        else:
            param = mlp.experts_down if kind == "" else mlp.experts_down_bias
            with torch.no_grad():
                param.copy_(tensor.narrow(2, first, ffn) if kind == "" else tensor)
        self._loaded.add((f"layers.{layer}.mlp.{'experts_gate_up' if projection == 'gate_up_proj' else 'experts_down'}"
                          f"{'_bias' if kind == '_bias' else ''}", None))

    def check_loaded(self) -> None:
        if self._mxfp4:
            (layer, projection), pending = next(iter(self._mxfp4.items()))
            raise ValueError(f"checkpoint has layer {layer}'s experts.{projection}{next(iter(pending))} without its "
                             "MXFP4 pair (_blocks and _scales)")
        super().check_loaded()
