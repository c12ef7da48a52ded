"""Mixture-of-experts models: Mixtral, Qwen2-MoE (Qwen1.5-MoE) and Qwen3-MoE, the Llama-family
decoder (llama.py) with a SparseMoE (layers.py) in place of the MLP on its sparse layers.

- Mixtral: every layer sparse, top-k renormalised, no shared expert; the checkpoint calls the block
  ``block_sparse_moe`` and the expert projections w1 (gate), w3 (up), w2 (down).
- Qwen2-MoE: q/k/v biases, a shared expert with a sigmoid gate beside the routed ones; Qwen3-MoE:
  per-head q/k norms. Both renormalise only with norm_topk_prob, and run a dense MLP of
  intermediate_size on the layers mlp_only_layers names or that decoder_sparse_step skips.
- Qwen3-VL-MoE's language model: Qwen3-MoE with its experts stacked in one tensor per layer and
  projection (experts.gate_up_proj, experts.down_proj; either orientation), split expert by expert.
The options arrive in ModelConfig.extra["moe"] (loader._moe_options). Each expert's checkpoint
tensors are copied into its rows of the stacked expert parameters (this rank's ffn slice of them
under tensor parallelism).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ..layers import SparseMoE
from .llama import DecoderLayer, LlamaForCausalLM

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")

# layers.L.mlp.experts.E.<projection>.weight (Mixtral's names after block_sparse_moe -> mlp)
_EXPERT_WEIGHT = re.compile(r"(?:model\.)?layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")
# layers.L.mlp.experts.<gate_up_proj|down_proj>: every expert in one tensor (Qwen3-VL-MoE)
_STACKED_EXPERTS = re.compile(r"(?:model\.)?layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_EXPERT_PROJECTIONS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                       "down_proj": "down", "w2": "down"}


class MoEForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM's interface (forward, compute_logits, load_weight) for the MoE models."""

    supports_lora = False

    def __init__(self, cfg, dtype: torch.dtype, max_positions: int, tp=None):
        super().__init__(cfg, dtype, max_positions, tp)
        shared = cfg.extra["moe"]["shared_ffn"]
        if shared:  # the shared expert's gate/up and down split by its own size
            s0, s = self.tp.split(shared)
            self._shard_rows = {"shared_expert.gate_up_proj": [(0, s, s0, shared), (s, s, s0, shared)],
                                **self._shard_rows}
            self._splits = {"shared_expert.down_proj.weight": (1, s0, shared), **self._splits}

    def make_layer(self, index: int, dtype: torch.dtype) -> nn.Module:
        moe = self.cfg.extra["moe"]
        if not moe["sparse_layers"][index]:
            return DecoderLayer(self.cfg, dtype, self.tp)
        experts = SparseMoE(self.cfg.hidden_size, moe["num_experts"], self.tp.split(moe["expert_ffn"])[1],
                            moe["top_k"], moe["renormalize"], dtype, self.tp,
                            shared_ffn=self.tp.split(moe["shared_ffn"])[1] if moe["shared_ffn"] else 0)
        return DecoderLayer(self.cfg, dtype, self.tp, mlp=experts)

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        stacked = _STACKED_EXPERTS.fullmatch(name)
        if stacked is not None:  # each expert's slices, through the per-expert path
            experts, hidden, full = self.cfg.extra["moe"]["num_experts"], self.cfg.hidden_size, self.cfg.extra["moe"]["expert_ffn"]
            layer, projection = stacked[1], stacked[2]
            rows = 2 * full if projection == "gate_up_proj" else hidden  # [E, rows, cols] as the model keeps them
            # the released checkpoints' [E, in, out], told apart by shape (a square one, hidden == 2 ffn
            # or == ffn, would read as transformers' layout: no released model has one)
            if tensor.dim() == 3 and tensor.shape[0] == experts and tensor.shape[1] != rows:
                tensor = tensor.transpose(1, 2)
            if tensor.dim() != 3 or tensor.shape[:2] != (experts, rows):
                raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, the config implies "
                                 f"{(experts, rows, full if rows == hidden else hidden)} or its transpose")
            for e in range(experts):
                parts = tensor[e].chunk(2) if projection == "gate_up_proj" else (tensor[e],)  # gate | up halves
                for part, proj in zip(parts, ("gate_proj", "up_proj") if len(parts) == 2 else ("down_proj",)):
                    self.load_weight(f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight", part)
            return None
        match = _EXPERT_WEIGHT.fullmatch(name)
        if match is None:
            return super().load_weight(name, tensor)
        layer, expert, projection = int(match[1]), int(match[2]), _EXPERT_PROJECTIONS.get(match[3])
        moe = self.cfg.extra["moe"]
        if (projection is None or layer >= len(self.layers) or not moe["sparse_layers"][layer]
                or expert >= moe["num_experts"]):
            raise ValueError(f"checkpoint tensor {name} has no place in {self.cfg.architecture}")
        full, hidden = moe["expert_ffn"], self.cfg.hidden_size
        first, ffn = self.tp.split(full)
        mlp = self.layers[layer].mlp
        if projection == "down":  # [hidden, ffn]: this rank's input columns
            pname, param, expected = "experts_down", mlp.experts_down[expert], (hidden, full)
            part = tensor.narrow(1, first, ffn) if tuple(tensor.shape) == expected else None
        else:  # [ffn, hidden]: this rank's rows, into the gate or the up half
            pname, expected = "experts_gate_up", (full, hidden)
            param = mlp.experts_gate_up[expert].narrow(0, 0 if projection == "gate" else ffn, ffn)
            part = tensor.narrow(0, first, ffn) if tuple(tensor.shape) == expected else None
        if part is None:
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, the config implies {expected}")
        with torch.no_grad():
            param.copy_(part)
        self._loaded.add((f"layers.{layer}.mlp.{pname}", f"{expert}.{projection}"))

    def _pieces(self, pname: str) -> list:
        experts = range(self.cfg.extra["moe"]["num_experts"])
        if pname.endswith(".experts_gate_up"):
            return [f"{e}.{p}" for e in experts for p in ("gate", "up")]
        if pname.endswith(".experts_down"):
            return [f"{e}.down" for e in experts]
        return super()._pieces(pname)
