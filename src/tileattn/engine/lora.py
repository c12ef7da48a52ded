"""LoRA adapters (PEFT's format) served beside the base model, several in one batch.

An adapter adds (alpha / r) B A x to a projection's output (rsLoRA: alpha / sqrt(r)), A [r, in] and
B [out, r] per target module. The engine holds ``max_loras`` slots, each projection's adapters
stacked: A [slots + 1, R, in], B [slots + 1, out, R] with R = max_lora_rank rounded up to a multiple
of 8 (the grouped GEMM's 16-byte rows), a smaller rank zero-padded, the scale folded into B, and slot
0 all zeros for the requests without an adapter. The fused projections take their parts' adapters
side by side: qkv's A stacks q's, k's and v's rows and its B is block-diagonal (gate/up alike), so one
pair of GEMMs serves the three.

A step's tokens are grouped by slot on the host (``groups``: the token order that makes each slot's
rows contiguous and the group ends), and each projection's delta is two torch grouped GEMMs over all
slots (x A^T, then B^T), put back in token order and added to the base projection. With adapters the
decoder runs its unfused path: the RMSNorm, the projection and the rotary + cache write as separate
launches (the delta must join the projection's output before the rotary and the activation).

Supported: the Llama-family decoder (llama.py's architectures), targets among q/k/v/o/gate/up/down
projections (and Phi-3's fused qkv_proj / gate_up_proj: one A, B over all rows), one rank and scale
for all modules (no rank_pattern / alpha_pattern), no bias training, no DoRA, nothing in
modules_to_save, one GPU (no tensor parallelism). Decode steps with adapter tokens run eagerly; the
CUDA graphs serve the steps without them.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from .layers import grouped_mm_supported
from .tokenizer import read_json_object

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "qkv_proj", "gate_up_proj")  # the last two: Phi-3's fused modules
# the engine's projection -> the checkpoint modules it fuses, in row order
_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
          "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def grouped_delta(x, a, b, groups):
    """x [T, in]; a [S, R, in], b [S, out, R]; groups (order int64 [T] on x's device, ends int32 [S] on
    x's device, ends as a host list) -> [T, out]: row t is b[s] a[s] x[t] for its slot s."""
    order, ends, host_ends = groups
    rows = x.index_select(0, order)  # [T, in], grouped by slot
    if grouped_mm_supported(x.device, x.dtype):
        y = F.grouped_mm(F.grouped_mm(rows, a.transpose(1, 2), offs=ends), b.transpose(1, 2), offs=ends)
    else:  # one GEMM pair per slot with tokens (eager only: the sizes come from the host)
        y = rows.new_empty(rows.shape[0], b.shape[1])
        start = 0
        for slot, end in enumerate(host_ends):
            if end > start:
                y[start:end] = F.linear(F.linear(rows[start:end], a[slot]), b[slot])
            start = end
    return torch.empty_like(y).index_copy_(0, order, y)


class LoRAWeights:
    """One layer's adapter stacks, by the engine's projection name; ``delta(name, x, groups)``."""

    def __init__(self):
        self.stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def delta(self, name: str, x, groups):
        a, b = self.stacks[name]
        return grouped_delta(x, a, b, groups)


class LoRAAdapters:
    """The engine's adapter slots over ``model`` (LlamaForCausalLM). load(name, path) fills the next
    free slot; slot(name) is what a request carries (0: none). Raises ValueError for max_loras or
    max_lora_rank below 1, and for a model it cannot serve (tensor parallel, another family)."""

    def __init__(self, model, max_loras: int, max_lora_rank: int, dtype: torch.dtype, device: torch.device):
        for name, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not model.supports_lora:
            raise ValueError(f"LoRA adapters are served on the Llama-family decoder only, not {model.cfg.architecture}")
        if model.tp.size > 1:
            raise ValueError("LoRA adapters are not served with tensor parallelism (tensor_parallel_size > 1)")
        self.model, self.max_rank = model, max_lora_rank
        self.rank = -(-max_lora_rank // 8) * 8  # the stacks' rank: rows of 16 bytes for the grouped GEMM
        self.names: dict[str, int] = {}  # adapter name -> slot (1..max_loras)
        self.keys: dict[str, int] = {}  # adapter name -> a number no other load gets (its prefix-cache salt)
        self._loads = 0
        self.max_loras = max_loras
        slots = max_loras + 1
        cfg = model.cfg
        for layer in model.layers:
            weights = LoRAWeights()
            attn, mlp = layer.self_attn, layer.mlp
            for name, proj in (("qkv_proj", attn.qkv_proj), ("o_proj", attn.o_proj),
                               ("gate_up_proj", mlp.gate_up_proj), ("down_proj", mlp.down_proj)):
                out, inp = proj.weight.shape
                parts = len(_PARTS[name])
                weights.stacks[name] = (torch.zeros(slots, parts * self.rank, inp, dtype=dtype, device=device),
                                        torch.zeros(slots, out, parts * self.rank, dtype=dtype, device=device))
            layer.lora = weights
        self._row_splits = {"qkv_proj": [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2,
                            "gate_up_proj": [cfg.intermediate_size] * 2}

    def slot(self, name: str | None) -> int:
        """The slot of adapter ``name`` (None: 0, the base model). Raises ValueError for an unknown name."""
        if name is None:
            return 0
        if name not in self.names:
            raise ValueError(f"unknown LoRA adapter {name!r}; loaded: {sorted(self.names) or 'none'}")
        return self.names[name]

    def load(self, name: str, path: str) -> int:
        """Read PEFT adapter ``path`` (adapter_config.json + adapter_model.safetensors) into a free
        slot under ``name``; returns the slot. Raises ValueError (FileNotFoundError for missing files)
        naming what is wrong before any slot changes: a used name, no free slot, a rank above
        max_lora_rank, targets, options or tensor shapes it cannot serve."""
        from safetensors.torch import load_file

        if not isinstance(name, str) or not name:
            raise ValueError(f"a LoRA adapter needs a non-empty name, got {name!r}")
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"LoRA adapter {name!r}: path must be a directory path, got {type(path).__name__}")
        if name in self.names:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        free = sorted(set(range(1, self.max_loras + 1)) - set(self.names.values()))
        if not free:
            raise ValueError(f"all {self.max_loras} LoRA slots are taken (max_loras)")
        config_file, weights_file = (os.path.join(path, f) for f in ("adapter_config.json", "adapter_model.safetensors"))
        for f in (config_file, weights_file):
            if not os.path.isfile(f):
                raise FileNotFoundError(f"LoRA adapter {name!r}: {f} does not exist")
        config = read_json_object(config_file)
        # PEFT's defaults: lora_alpha 8 (not r), peft_type LORA
        rank, alpha = config.get("r"), config.get("lora_alpha", 8)
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1 or rank > self.max_rank:
            raise ValueError(f"LoRA adapter {name!r} has rank {rank!r}; this engine serves ranks 1..{self.max_rank} "
                             "(max_lora_rank)")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
            raise ValueError(f"LoRA adapter {name!r}: lora_alpha must be a finite number, got {alpha!r}")
        for option, ok in (("peft_type", config.get("peft_type", "LORA") == "LORA"),
                           ("use_dora", not config.get("use_dora")), ("bias", config.get("bias", "none") == "none"),
                           ("lora_bias", not config.get("lora_bias")),  # a bias on B, scaled like it
                           ("alora_invocation_tokens", not config.get("alora_invocation_tokens")),  # activated LoRA
                           ("layer_replication", not config.get("layer_replication")),
                           ("modules_to_save", not config.get("modules_to_save")),
                           ("fan_in_fan_out", not config.get("fan_in_fan_out")),
                           ("rank_pattern", not config.get("rank_pattern")),  # per-module ranks and scales
                           ("alpha_pattern", not config.get("alpha_pattern"))):
            if not ok:
                raise ValueError(f"LoRA adapter {name!r}: {option}={config.get(option)!r} is not supported")
        scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        try:
            tensors = load_file(weights_file)
        except Exception as exc:  # safetensors' own error types: a truncated or corrupt file
            raise ValueError(f"LoRA adapter {name!r}: cannot read {weights_file}: {exc}") from None
        pieces = {}  # (layer, module) -> {"A": [r, in], "B": [out, r]}
        for key, tensor in tensors.items():
            if not key.endswith(".weight") or not tensor.is_floating_point():
                raise ValueError(f"LoRA adapter {name!r}: tensor {key} ({tensor.dtype}) is not a floating-point "
                                 "lora_A / lora_B weight")
            place = self._place(name, key)
            ab = key.rsplit(".", 2)[-2][-1]
            if ab in pieces.setdefault(place, {}):
                raise ValueError(f"LoRA adapter {name!r}: layer {place[0]} {place[1]} has two lora_{ab} tensors")
            pieces[place][ab] = tensor
        for layer, module in pieces:  # a fused module and one of its parts would write the same rows
            overlap = [part for part in _PARTS.get(module, ()) if part != module and (layer, part) in pieces]
            if overlap:
                raise ValueError(f"LoRA adapter {name!r}: layer {layer} has both {module} and {', '.join(overlap)}")
        slot = free[0]
        staged = []  # (destination view, source): every check passes before a slot changes
        for (layer, module), ab in pieces.items():
            if set(ab) != {"A", "B"}:
                raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} has lora_{''.join(ab)} only")
            staged += self._stage(name, slot, layer, module, ab["A"], ab["B"] * scale, rank)
        for _, source in staged:  # e.g. a huge lora_alpha: an inf in the slot would make every logit of its requests NaN
            if not torch.isfinite(source).all():
                raise ValueError(f"LoRA adapter {name!r}: its weights (lora_B scaled by lora_alpha / r = {scale:g}) "
                                 "are not all finite")
        with torch.no_grad():
            for destination, source in staged:
                destination.copy_(source)
        self.names[name] = slot
        self._loads += 1
        self.keys[name] = self._loads
        return slot

    def unload(self, name: str) -> None:
        """Free adapter ``name``'s slot (its stacks zeroed; the caller makes sure no request uses
        it). Raises ValueError for an unknown name."""
        slot = self.slot(name)
        with torch.no_grad():
            for layer in self.model.layers:
                for a, b in layer.lora.stacks.values():
                    a[slot].zero_()
                    b[slot].zero_()
        del self.names[name], self.keys[name]

    def _place(self, name: str, key: str) -> tuple[int, str]:
        """(layer, module) of a PEFT tensor name (...layers.L.<self_attn|mlp>.<module>.lora_<A|B>.weight)."""
        parts = key.split(".")
        try:
            at = parts.index("layers")
            layer, module, ab = int(parts[at + 1]), parts[at + 3], parts[at + 4]
        except (ValueError, IndexError):
            raise ValueError(f"LoRA adapter {name!r}: tensor {key} targets no decoder projection") from None
        if any(p in ("vision_tower", "visual", "vision_model", "multi_modal_projector") for p in parts[:at]):
            raise ValueError(f"LoRA adapter {name!r}: tensor {key} adapts a vision module (text only here)")
        if len(parts) != at + 6:  # ...layers.L.<self_attn|mlp>.<module>.lora_<A|B>.weight, PEFT's saved form
            raise ValueError(f"LoRA adapter {name!r}: tensor {key} is not <...>.layers.L.<block>.<module>.lora_A|B.weight "
                             "(an adapter name inside the key, as in lora_A.default.weight, is not PEFT's saved form)")
        if module not in TARGETS or ab not in ("lora_A", "lora_B") or not 0 <= layer < len(self.model.layers):
            raise ValueError(f"LoRA adapter {name!r}: tensor {key} has no place (targets served: {', '.join(TARGETS)})")
        return layer, module

    def _stage(self, name, slot, layer, module, a, b, rank):
        """[(destination view, source)] putting one module's A and B (scale folded) into the slot."""
        model = self.model
        if module in _PARTS:  # an engine projection as a whole (Phi-3's fused qkv_proj, gate_up_proj; o; down)
            fused, index, first = module, 0, 0
        else:
            fused = next(f for f, parts in _PARTS.items() if module in parts)
            index = _PARTS[fused].index(module)
            first = sum(self._row_splits[fused][:index])
        stack_a, stack_b = model.layers[layer].lora.stacks[fused]
        inp = stack_a.shape[2]
        rows = stack_b.shape[1] if module in _PARTS else self._row_splits[fused][index]
        if tuple(a.shape) != (rank, inp) or tuple(b.shape) != (rows, rank):
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} and B "
                             f"{tuple(b.shape)}; the model implies ({rank}, {inp}) and ({rows}, {rank})")
        if fused in ("o_proj", "down_proj"):  # Granite's residual multiplier, folded into those weights too
            b = b * model.residual_multiplier
        if fused == "qkv_proj" and model.head_dim_order is not None:  # partial rotary: q's and k's dim order
            cfg, b = model.cfg, b.clone()
            for start, count in ((0, cfg.num_heads * cfg.head_dim),
                                 (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)):
                lo, hi = max(start, first), min(start + count, first + rows)  # q or k rows this module holds
                if lo < hi:
                    part = b[lo - first:hi - first]
                    b[lo - first:hi - first] = part.reshape(-1, cfg.head_dim, rank)[:, model.head_dim_order].reshape(
                        part.shape)
        col = index * self.rank
        return [(stack_a[slot, col:col + rank], a), (stack_b[slot, first:first + rows, col:col + rank], b)]

    def groups(self, token_slots, device):
        """token_slots: numpy int [T] (each token's slot) -> the (order, ends, host ends) of
        grouped_delta: tokens sorted by slot (stable), cumulative counts per slot; None when no token
        has an adapter (the step then runs the model's fused path, as without LoRA)."""
        import numpy as np

        if not token_slots.any():
            return None
        order = np.argsort(token_slots, kind="stable")
        ends = np.cumsum(np.bincount(token_slots, minlength=self.max_loras + 1)).astype(np.int32)
        return (torch.from_numpy(order).to(device), torch.from_numpy(ends).to(device), ends.tolist())
