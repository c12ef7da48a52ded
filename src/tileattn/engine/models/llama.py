"""One Llama-family decoder covering Llama 2/3/3.x, Mistral, Qwen2/2.5, Qwen3, SmolLM3, Granite, Phi-3/4,
Seed-OSS and ERNIE 4.5 (dense).

The architectures differ only in options of ModelConfig: qkv/o/mlp biases, per-head q/k RMSNorm
(Qwen3), explicit head_dim, rope scaling, tied embeddings; in ModelConfig.extra (loader.py):
"rope_layers" (SmolLM3: the layers without rotary embedding, NoPE, rotate by an identity table),
Granite's "embedding_multiplier", "attention_multiplier" (the attention scale), "residual_multiplier"
(folded into the o and down projections' weights, which feed the residual adds) and
"logits_scaling" (the logits divided by it); "rotary_dim" (Phi-4-mini's partial rotary: q and k dims
reordered at load time, partial_rotary_order) and "rotary_interleaved" (GLM-4, ERNIE 4.5: pairs (2i, 2i
+ 1) reordered the same way). Weights use the HF parameter names; q/k/v and gate/up
checkpoint tensors are copied into row ranges of the fused projections (Phi-3's fused qkv_proj and
gate_up_proj are split into those parts first).

Tensor parallel (a TensorParallel of N > 1 ranks, see distributed.py): every rank builds the model
with its shard's sizes and load_weight copies the rank's slice of each checkpoint tensor: rows of
q/k/v, gate/up, embedding and LM head; input columns of o and down; norms and the row-parallel
biases whole.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from tileattn.api_layers import linear, silu_mul

from ..distributed import TensorParallel, check_tensor_parallel
from ..layers import (
    AttentionBatch,
    GatedMLP,
    PagedAttention,
    RMSNorm,
    Rotary,
    SparseMoE,
    grouped_mm_supported,
    partial_rotary_order,
    rope_attention_factor,
    rope_inv_freq,
)

LLAMA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                       "SmolLM3ForCausalLM", "GraniteForCausalLM", "Phi3ForCausalLM", "SeedOssForCausalLM",
                       "Ernie4_5ForCausalLM")

# fused checkpoint tensors (Phi-3) -> their parts, in row order
_CHECKPOINT_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# checkpoint projection -> (fused parameter, shard index)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class DecoderLayer(nn.Module):
    """Attention and an MLP, each after an RMSNorm with the residual add. mlp: None for the
    GatedMLP of cfg.intermediate_size, or another module taking the normalised [T, hidden]
    (layers.SparseMoE); attention: None for the model's PagedAttention, or one set up for this
    layer (gpt-oss: its window and sinks)."""

    def __init__(self, cfg, dtype: torch.dtype, tp: TensorParallel, mlp: nn.Module | None = None,
                 attention: PagedAttention | None = None):
        super().__init__()
        self.self_attn = attention or PagedAttention(cfg, dtype, tp, scale=cfg.extra.get("attention_multiplier"))
        self.mlp = mlp or GatedMLP(cfg.hidden_size, tp.split(cfg.intermediate_size)[1], cfg.mlp_bias, dtype, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lora = None  # the layer's adapter stacks (lora.LoRAWeights) when the engine serves LoRA

    def forward(self, rope, x, residual, batch):  # x [T, hidden]; residual [T, hidden] or None (first layer)
        if batch.lora is not None:
            return self.forward_lora(rope, x, residual, batch)
        # Each norm (with the residual add before it) runs with the projection that reads it.
        x, residual = self.self_attn(rope, x, residual, self.input_layernorm, batch)  # [T, hidden]
        if not isinstance(self.mlp, GatedMLP):
            x, residual = self.post_attention_layernorm(x, residual)  # [T, hidden]
            return self.mlp(x), residual
        gate_up, residual = self.post_attention_layernorm(x, residual, self.mlp.gate_up_proj)  # [T, 2 ffn]
        return self.mlp(gate_up), residual

    def forward_lora(self, rope, x, residual, batch):
        """forward with each projection's LoRA delta (lora.py) added to its output: the norms, the
        projections, the rotary + cache write and SiLU * up as separate launches."""
        lora, groups, attn, mlp = self.lora, batch.lora, self.self_attn, self.mlp
        if residual is None:  # the first layer: x is the residual stream
            h, residual = self.input_layernorm(x, None), x  # [T, hidden]
        else:
            h, residual = self.input_layernorm(x, residual)
        qkv = attn.qkv_proj(h) + lora.delta("qkv_proj", h, groups)  # [T, (H + 2 Hkv) d]
        out = attn.rotate_and_attend(rope, qkv, batch)  # [T, H d]
        x = attn.o_proj(out) + lora.delta("o_proj", out, groups)  # [T, hidden]
        h, residual = self.post_attention_layernorm(x, residual)
        gate_up = mlp.gate_up_proj(h) + lora.delta("gate_up_proj", h, groups)  # [T, 2 ffn]
        act = silu_mul(gate_up)  # [T, ffn]
        down = linear(act, mlp.down_proj.weight, mlp.down_proj.bias) + lora.delta("down_proj", act, groups)
        return down, residual


class SandwichDecoderLayer(nn.Module):
    """A layer with four norms (Gemma 2/3, GLM-4): input_layernorm before attention,
    post_attention_layernorm on its output before the residual add, pre_feedforward_layernorm before
    the MLP, post_feedforward_layernorm on its output before the add. ``attention``: the layer's
    PagedAttention; ``act``: GatedMLP's activation."""

    def __init__(self, cfg, dtype: torch.dtype, tp, attention: PagedAttention, act: str):
        super().__init__()
        self.self_attn = attention
        self.mlp = GatedMLP(cfg.hidden_size, tp.split(cfg.intermediate_size)[1], cfg.mlp_bias, dtype, tp, act=act)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype))

    def forward(self, rope, x, residual, batch):  # x [T, hidden]; residual [T, hidden] or None (first layer)
        attn, residual = self.self_attn(rope, x, residual, self.input_layernorm, batch)  # [T, hidden]
        attn = self.post_attention_layernorm(attn, None)  # [T, hidden]: the branch normalised before the add
        gate_up, residual = self.pre_feedforward_layernorm(attn, residual, self.mlp.gate_up_proj)  # [T, 2 ffn]
        return self.post_feedforward_layernorm(self.mlp(gate_up), None), residual


class LlamaForCausalLM(nn.Module):
    supports_lora = True  # lora.py serves adapters on this decoder (not on the subclasses that change its layers)

    """forward(input_ids [T], positions [T], batch) -> hidden [T, hidden];
    compute_logits(hidden [N, hidden]) -> float32 logits [N, vocab] (tensor parallel: on rank 0,
    None on the others; every rank must call it).

    Build it under ``torch.device(...)``: parameters are allocated uninitialised on that device and
    filled by load_weight, tensor by tensor. tp: this rank's TensorParallel (None: one GPU).
    Raises ValueError when the config is inconsistent or tp.size cannot split it."""

    def __init__(self, cfg, dtype: torch.dtype, max_positions: int, tp: TensorParallel | None = None):
        super().__init__()
        cfg.validate()
        tp = tp or TensorParallel()
        check_tensor_parallel(cfg, tp.size)
        self.cfg, self.tp, self.dtype = cfg, tp, dtype
        rotary_dim = cfg.extra.get("rotary_dim", cfg.head_dim)  # < head_dim: partial rotary (Phi-4-mini)
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.extra.get("rope_freq_factors"),
                                 rotary_dim, max_positions)
        self.rotary = Rotary(max_positions, inv_freq, dtype, rope_attention_factor(cfg.rope_scaling))
        # q and k dims in the order the rotate-half launch pairs them (None: the checkpoint's)
        interleaved = cfg.extra.get("rotary_interleaved", False)  # GLM: pairs (2i, 2i + 1)
        self.head_dim_order = (partial_rotary_order(cfg.head_dim, rotary_dim, interleaved)
                               if rotary_dim < cfg.head_dim or interleaved else None)
        rope_layers = cfg.extra.get("rope_layers")  # SmolLM3's NoPE layers rotate by the identity
        self.identity_rotary = (Rotary(max_positions, torch.zeros_like(inv_freq), dtype)
                                if rope_layers is not None and not all(rope_layers) else None)
        local = cfg.extra.get("local_rope")  # (theta, scaling) of the windowed layers' own tables (Gemma 3, OLMo 3)
        self.local_rotary = None if local is None else Rotary(
            max_positions, rope_inv_freq(cfg.head_dim, local[0], local[1], None, None, max_positions), dtype,
            rope_attention_factor(local[1]))
        # each layer's tables, chosen once: the local ones on windowed layers that have them, the
        # identity on NoPE layers, the model's elsewhere (extra["layer_windows"], extra["rope_layers"])
        windows = cfg.extra.get("layer_windows") or [None] * cfg.num_layers
        uses = cfg.extra.get("rope_layers") or [True] * cfg.num_layers
        self.layer_rotaries = [self.local_rotary if windows[i] and self.local_rotary is not None
                               else self.rotary if uses[i] else self.identity_rotary for i in range(cfg.num_layers)]
        self.embedding_multiplier = cfg.extra.get("embedding_multiplier", 1.0)
        self.logits_scaling = cfg.extra.get("logits_scaling", 1.0)
        self.residual_multiplier = cfg.extra.get("residual_multiplier", 1.0)
        self.vocab_start, vocab = tp.split(cfg.vocab_size)
        self.embed_tokens = nn.Parameter(torch.empty(vocab, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(self.make_layer(i, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else nn.Parameter(
            torch.empty(vocab, cfg.hidden_size, dtype=dtype), requires_grad=False)
        d = cfg.head_dim
        (h0, h), (k0, k), (f0, f) = tp.split(cfg.num_heads), tp.kv_heads(cfg.num_kv_heads), tp.split(cfg.intermediate_size)
        # fused parameter -> per shard (first row in the parameter, rows, first row in the
        # checkpoint tensor, the checkpoint tensor's rows)
        self._shard_rows = {
            "qkv_proj": [(0, h * d, h0 * d, cfg.num_heads * d), (h * d, k * d, k0 * d, cfg.num_kv_heads * d),
                         ((h + k) * d, k * d, k0 * d, cfg.num_kv_heads * d)],
            "gate_up_proj": [(0, f, f0, cfg.intermediate_size), (f, f, f0, cfg.intermediate_size)]}
        # parameters split along one dim: name suffix -> (dim, first index in the checkpoint, full size)
        self._splits = {"embed_tokens": (0, self.vocab_start, cfg.vocab_size),
                        "lm_head": (0, self.vocab_start, cfg.vocab_size),
                        "o_proj.weight": (1, h0 * d, cfg.num_heads * d),
                        "down_proj.weight": (1, f0, cfg.intermediate_size)}
        self._loaded: set[tuple[str, int]] = set()
        self._tied_head = None  # an lm_head.weight stored beside tie_word_embeddings (load_weight)

    def make_layer(self, index: int, dtype: torch.dtype) -> nn.Module:
        """Decoder layer ``index`` (a subclass builds its family's)."""
        return DecoderLayer(self.cfg, dtype, self.tp)

    def embed(self, input_ids):  # [T] -> [T, hidden]
        if self.tp.size == 1:
            x = F.embedding(input_ids, self.embed_tokens)
        else:
            # Vocab-parallel: ids outside this rank's rows embed to zero; the all-reduce adds the one
            # rank's row that holds each id.
            local = input_ids - self.vocab_start
            outside = (local < 0) | (local >= self.embed_tokens.shape[0])  # [T]
            x = F.embedding(local.masked_fill(outside, 0), self.embed_tokens)  # [T, hidden]
            x = self.tp.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))
        return x * self.embedding_multiplier if self.embedding_multiplier != 1.0 else x

    def layer_ropes(self, positions):
        """Each layer's rotary tables (layer_rotaries: the model's one table; the identity on the NoPE
        layers; the local tables on the windowed layers when they have their own)."""
        return [rotary(positions) for rotary in self.layer_rotaries]

    def forward(self, input_ids, positions, batch: AttentionBatch):
        x = self.embed(input_ids)  # [T, hidden]
        residual = None
        for layer, rope in zip(self.layers, self.layer_ropes(positions)):
            x, residual = layer(rope, x, residual, batch)
        x, _ = self.norm(x, residual)
        return x  # [T, hidden]

    def cuda_graphs_supported(self) -> bool:
        """Whether a decode step of this model can be captured in a CUDA graph (no host sync): yes,
        unless its mixture-of-experts layers lack torch's grouped GEMM in this dtype (routed_experts'
        per-expert fallback reads the group sizes on the host)."""
        experts = any(isinstance(layer.mlp, SparseMoE) for layer in self.layers)
        return not experts or grouped_mm_supported(torch.device("cuda"), self.dtype)

    def compute_logits(self, hidden):  # hidden [N, hidden] -> [N, vocab] float32 (rank 0; others None)
        logits = self.tp.gather_last_dim(linear(hidden, self.lm_head).float())  # rank's part [N, vocab / N]
        return logits / self.logits_scaling if logits is not None and self.logits_scaling != 1.0 else logits

    # ---- weights -------------------------------------------------------------------------------

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        """Copy checkpoint tensor ``name`` (HF naming), or this rank's slice of it, into its
        parameter, casting to the model dtype on the way (the copy runs on the parameter's device).

        Raises ValueError for an unknown name, a shape that does not match the config or a tensor
        that is not floating point."""
        if name.endswith("rotary_emb.inv_freq"):
            return
        if not tensor.is_floating_point():  # copy_ would cast integers silently
            raise ValueError(f"checkpoint tensor {name} has dtype {tensor.dtype}; weights must be floating point")
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            self._tied_head = tensor  # must equal the embedding: check_loaded compares them
            return
        module, kind = name.rsplit(".", 2)[-2:] if name.count(".") >= 2 else ("", "")
        if module in _CHECKPOINT_FUSED:  # Phi-3's qkv_proj / gate_up_proj: loaded as their parts
            pieces = self._checkpoint_fused_sizes(module)
            if tensor.shape[0] != sum(pieces):
                raise ValueError(f"checkpoint tensor {name} has {tensor.shape[0]} rows, the config implies {sum(pieces)}")
            for part, rows in zip(_CHECKPOINT_FUSED[module], tensor.split(pieces)):
                self.load_weight(f"{name[:-len(module + kind) - 1]}{part}.{kind}", rows)
            return
        if self.head_dim_order is not None and module in ("q_proj", "k_proj", "q_norm", "k_norm"):
            # partial rotary: each head's dims in the rotate-half launch's order
            d = self.cfg.head_dim
            tensor = tensor.reshape(-1, d, *tensor.shape[1:])[:, self.head_dim_order].reshape(tensor.shape)
        target, shard = self._target(name)
        param = self.get_parameter(target)
        dim, first, full = 0, 0, None  # the checkpoint tensor's dim holding this rank's slice
        if shard is not None:
            start, rows, first, full = self._fused_rows(target)[shard]
            param = param.narrow(0, start, rows)
        else:
            dim, first, full = next((v for k, v in self._splits.items() if target.endswith(k)), (0, 0, None))
        expected = tuple(full if i == dim and full is not None else n for i, n in enumerate(param.shape))
        if tuple(tensor.shape) != expected:
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, the config "
                             f"implies {expected}")
        if full is not None:
            tensor = tensor.narrow(dim, first, param.shape[dim])
        if self.residual_multiplier != 1.0 and target.split(".")[-2:-1] in (["o_proj"], ["down_proj"]):
            tensor = tensor.float() * self.residual_multiplier  # Granite: the branch scaled before the residual add
        with torch.no_grad():
            param.copy_(tensor)
        self._loaded.add((target, shard))

    def _checkpoint_fused_sizes(self, module: str) -> list[int]:
        """Rows of each part of a fused checkpoint tensor (all heads, the whole ffn)."""
        cfg = self.cfg
        if module == "qkv_proj":
            return [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
        return [cfg.intermediate_size] * 2

    def check_loaded(self) -> None:
        """Raises ValueError listing the parameters no checkpoint tensor filled, or when the config
        ties the LM head to the embedding but the checkpoint stores a different lm_head.weight
        (transformers would untie them; this model would silently compute with the embedding)."""
        missing = [f"{pname}[{s}]" if s is not None else pname
                   for pname, _ in self.named_parameters() for s in self._pieces(pname)
                   if (pname, s) not in self._loaded]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {', '.join(missing[:4])}")
        head, self._tied_head = self._tied_head, None
        if head is not None:
            embedding = self.embed_tokens
            if tuple(head.shape) == (self.cfg.vocab_size, embedding.shape[1]):
                head = head.narrow(0, self.vocab_start, embedding.shape[0])  # this rank's vocabulary rows
            if head.shape != embedding.shape or not torch.equal(head.to(embedding.device, embedding.dtype), embedding):
                raise ValueError("config.json ties the LM head to the embedding (tie_word_embeddings), but the "
                                 "checkpoint's lm_head.weight differs from embed_tokens: set tie_word_embeddings "
                                 "to false to use the stored head")

    def _pieces(self, pname: str) -> list:
        """The shards that fill parameter ``pname`` (load_weight records (pname, shard) for each)."""
        rows = self._fused_rows(pname)
        return list(range(len(rows))) if rows else [None]

    def _fused_rows(self, pname: str):
        """The shard table of fused parameter ``pname`` (the first _shard_rows key its module's
        dotted name ends with), None for a parameter filled by one checkpoint tensor."""
        module = "." + pname.rsplit(".", 1)[0]
        return next((rows for key, rows in self._shard_rows.items() if module.endswith("." + key)), None)

    def _target(self, name: str):
        parts = name.split(".")
        if parts[0] == "model":
            parts = parts[1:]
        if parts[:1] == ["embed_tokens"]:
            return "embed_tokens", None
        if parts[:1] == ["lm_head"]:
            return "lm_head", None
        shard = None
        if len(parts) >= 4 and parts[0] == "layers" and parts[-2] in _FUSED:
            fused, shard = _FUSED[parts[-2]]
            parts = parts[:-2] + [fused, parts[-1]]
        target = ".".join(parts)
        try:  # e.g. a bias the config has none of (attention_bias false), or a layer past num_hidden_layers
            self.get_parameter(target)
        except AttributeError:
            raise ValueError(f"checkpoint tensor {name} has no place in {self.cfg.architecture}") from None
        return target, shard
