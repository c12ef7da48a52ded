"""The layers of a Llama-family decoder: RMSNorm, rotary embedding (incl. llama3 scaling), gated
MLP with a fused gate/up projection, and attention over the paged KV cache.

Every token of a step (prefill chunks and decodes of all sequences) is packed along one axis T;
attention is the only layer that needs to know where sequences begin and end (AttentionBatch).

The elementwise steps are handed to the projections next to them: each RMSNorm (with the residual
add before it) to the qkv / gate_up projection after it (RMSNorm(x, residual, proj)), SiLU(gate) *
up to the down projection (Linear(..., activation="silu_mul")). Where tileattn runs the projection
on its GEMV kernel (few rows on CUDA, i.e. decode, where the dispatcher enables it) the step costs
no launch of its own, so a decode layer is four projection launches, rotary + KV write, and
attention; elsewhere the ops compose the same arithmetic from the separate kernels and cuBLAS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tileattn.api_layers import (add_rms_norm, add_rms_norm_linear, add_rms_norm_qkv_rope_, linear,
                                 norm_rotary_write_kv_cache_, silu_mul)


@dataclass
class AttentionBatch:
    """Where the packed tokens of one step go in the paged cache (contract A's arguments).

    cu_seqlens_q int32 [B+1]: query tokens of sequence b are rows cu[b]:cu[b+1] of the packed axis.
    seqlens_k int32 [B]: keys of sequence b, its query tokens included (they are the last ones).
    block_tables int32 [B, max_blocks]: the cache blocks of each sequence, in order.
    slot_mapping int64 [T]: block * block_size + offset where each token's k/v is written (-1: skip).
    max_seqlen_q, max_seqlen_k: Python ints bounding the two above.
    lora: the step's LoRA groups (lora.LoRAAdapters.groups: tokens ordered by adapter slot, group
        ends) when the engine serves adapters, else None.
    """

    cu_seqlens_q: torch.Tensor
    seqlens_k: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    lora: tuple | None = None


def paged_attention_ops(device: torch.device):
    """(attention_paged, write_kv_cache) for ``device``: tileattn's kernels on CUDA, the pure-torch
    reference elsewhere (same signatures, contract A). Imported here, not at module import, so the
    engine imports on machines (and at commits) where either is absent."""
    if device.type == "cuda":
        import tileattn

        return tileattn.attention_paged, tileattn.write_kv_cache
    from tileattn import reference

    return reference.attention_paged, reference.write_kv_cache


class Linear(nn.Module):
    """y = act(x) W^T (+ b) through tileattn.linear: its GEMV kernel for the few rows of a decode
    step on CUDA where the dispatcher allows it, cuBLAS through F.linear otherwise. activation None: x [T, in], act the identity;
    "silu_mul": x [T, 2 in] = [gate | up], act(x) = silu(gate) * up (inside the GEMV's launch on
    the kernel path). Parameters are allocated uninitialised: the loader fills every one."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 activation: str | None = None):
        super().__init__()
        self.activation = activation
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x):  # x [T, in] (silu_mul: [T, 2 in]) -> [T, out]
        return linear(x, self.weight, self.bias, activation=self.activation)


class RowParallelLinear(Linear):
    """Linear whose input features are split across tensor-parallel ranks (weight [out, in / N]):
    each rank multiplies its part, one all-reduce sums the partial products, the bias is added once
    after it. With one rank, a plain Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, tp,
                 activation: str | None = None):
        super().__init__(in_features, out_features, bias, dtype, activation)
        self.tp = tp

    def forward(self, x):  # x [T, in / N] (silu_mul: [T, 2 in / N]) -> [T, out]
        if self.tp.size == 1:
            return super().forward(x)
        y = self.tp.all_reduce(linear(x, self.weight, activation=self.activation))
        return y if self.bias is None else y + self.bias


class RMSNorm(nn.Module):
    """x / rms(x) * weight, accumulated in float32 (the mean of squares of a bf16 row loses too many
    bits otherwise), with the residual add before it in the same launch (the written-out formula
    is eight elementwise kernels, each a few microseconds of fixed cost per layer at decode).

    forward(x, residual, proj) -> (proj(norm(s)), s) with s = x + residual (x itself when residual
    is None: the first layer): tileattn's add_rms_norm_linear, the norm folded into the projection
    that reads it (the decoder layer's two norms; proj a Linear without activation).
    forward(x, residual) -> (norm(s), s): tileattn's add_rms_norm (the model's final norm).
    The residual passed in is consumed (it may be overwritten with s): use the one returned."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x, residual, proj: Linear | None = None):  # x, residual [T, dim]
        if proj is None:
            return add_rms_norm(x, self.weight, self.eps, residual=residual)
        return add_rms_norm_linear(x, residual, self.weight, self.eps, proj.weight, proj.bias)  # [T, out], [T, dim]


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None, freq_factors=None,
                  rotary_dim: int | None = None, max_positions: int | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] (float32) of rotary embedding, with the scaling of
    ``scaling["rope_type"]``: None/"default", "linear" (positions / factor), "llama3" (long
    wavelengths / factor, short ones kept, a smooth blend between), "yarn" (YaRN: the frequencies
    that turn fewer than beta_slow times over the original context divided by factor, those that turn
    more than beta_fast times kept, a linear ramp over the dims between) or "longrope" (Phi-3: each
    frequency divided by its short_factor, or by its long_factor when the engine runs past
    original_max_position_embeddings, i.e. max_positions exceeds it; rope_attention_factor gives the
    tables' scale). ``freq_factors`` (GGUF's rope_freqs tensor) divides the frequencies instead.
    rotary_dim < head_dim (partial rotary, Phi-4-mini): the rotary_dim / 2 frequencies of a
    rotary_dim-wide embedding, then zeros (slots that rotate by nothing; partial_rotary_order puts the
    dims that do not rotate there). Raises ValueError for other rope types."""
    rotary_dim = rotary_dim or head_dim
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (theta ** exponent)  # [rotary_dim / 2]
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if freq_factors is not None:
        inv_freq = inv_freq / torch.as_tensor(freq_factors, dtype=torch.float32, device=inv_freq.device)
    elif kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_context = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
        inv_freq = torch.where(medium, blended, scaled)
    elif kind == "longrope":
        long = max_positions is not None and max_positions > scaling["original_max_position_embeddings"]
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"longrope factors must have {inv_freq.shape[0]} entries, got {factors.shape[0]}")
        inv_freq = inv_freq / factors
    elif kind == "yarn":
        inv_freq = _yarn_inv_freq(inv_freq, rotary_dim, theta, scaling)
    elif kind != "default":
        raise ValueError(f"rope scaling type {kind!r} is not supported (default, linear, llama3, longrope, yarn)")
    return torch.cat((inv_freq, inv_freq.new_zeros((head_dim - rotary_dim) // 2)))


def rope_attention_factor(scaling: dict | None) -> float:
    """The scale of the rotary tables (cos and sin): the given attention_factor, else longrope's
    sqrt(1 + ln(factor) / ln(original_max_position_embeddings)) and YaRN's 0.1 ln(factor) + 1 (with
    mscale and mscale_all_dim: the ratio of the two such terms) for factor > 1; 1 for the other types."""
    kind = (scaling or {}).get("rope_type")
    if kind not in ("longrope", "yarn"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if factor <= 1.0:
        return 1.0
    if kind == "longrope":
        return math.sqrt(1 + math.log(factor) / math.log(float(scaling["original_max_position_embeddings"])))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return (0.1 * mscale * math.log(factor) + 1) / (0.1 * mscale_all_dim * math.log(factor) + 1)
    return 0.1 * math.log(factor) + 1


def _yarn_inv_freq(inv_freq, dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN's blend of the interpolated (inv_freq / factor) and the original frequencies over the
    dims between the correction bounds (truncated to whole dims unless truncate is false)."""
    factor, original = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):  # the dim whose wavelength fits `rotations` times into the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # 0: keep, 1: interpolate
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def partial_rotary_order(head_dim: int, rotary_dim: int, interleaved: bool = False) -> torch.Tensor:
    """The order of a head's dims for partial or interleaved rotary: order[j] is the checkpoint dim
    that slot j of the rotate-half layout reads. transformers rotates dims (i, i + rotary_dim / 2)
    (interleaved, GLM: (2i, 2i + 1)) for i < rotary_dim / 2 and passes the rest; the engine rotates (i,
    i + head_dim / 2), so the rotated pairs take slots i and i + head_dim / 2 and the passed dims the
    slots whose frequency is 0. Permuting q's and k's dims alike leaves every q . k unchanged. -> int64
    [head_dim]."""
    half, rot = head_dim // 2, rotary_dim // 2
    passed = torch.arange(rotary_dim, head_dim)  # [head_dim - rotary_dim]
    first, second = passed[:half - rot], passed[half - rot:]
    pairs = ((torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)) if interleaved
             else (torch.arange(rot), torch.arange(rot, rotary_dim)))
    return torch.cat((pairs[0], first, pairs[1], second))


class Rotary(nn.Module):
    """Rotate-half rotary embedding: per head (x1 cos - x2 sin, x2 cos + x1 sin) for the halves
    x1, x2; cos and sin times ``scale`` where the frequency is not 0 (longrope's or YaRN's attention
    factor). The tables hold cos twice and (-sin, sin) [max_positions, head_dim] (float32);
    tileattn's add_rms_norm_qkv_rope_ reads them at each token's position in the one launch after
    the qkv projection, which also applies Qwen3's per-head q/k norm and writes k/v into the cache.
    forward(positions [T]) -> the (positions, cos, sin) every layer passes to it."""

    def __init__(self, max_positions: int, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
        super().__init__()
        self.dtype = dtype
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.to(positions.device)[None, :]  # [max_positions, d/2]
        # scale (the attention factor) on the rotating slots only; partial rotary's passed dims stay
        scale = torch.where(inv_freq.to(positions.device) != 0, scale, 1.0)  # [d/2]
        cos, sin = freqs.cos() * scale, freqs.sin() * scale
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), dim=-1), persistent=False)

    def forward(self, positions):  # positions int64 [T]
        return positions, self.cos, self.sin


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up in one [2 * ffn, hidden] GEMM. The decoder layer
    runs gate_up_proj with the RMSNorm before it (RMSNorm(x, residual, proj)); forward takes its
    output. act "silu" (Llama, Qwen, Mistral): SiLU * up inside down_proj's launch (activation
    "silu_mul"); "gelu_tanh" (Gemma 2): GELU's tanh form * up in torch, then down_proj. Tensor
    parallel (tp: TensorParallel): ``ffn`` is this rank's part, gate/up column-parallel, down
    row-parallel."""

    def __init__(self, hidden: int, ffn: int, bias: bool, dtype: torch.dtype, tp, act: str = "silu"):
        super().__init__()
        if act not in ("silu", "gelu_tanh"):
            raise ValueError(f"MLP activation must be silu or gelu_tanh, got {act!r}")
        self.act = act
        self.gate_up_proj = Linear(hidden, 2 * ffn, bias, dtype)
        self.down_proj = RowParallelLinear(ffn, hidden, bias, dtype, tp, activation="silu_mul" if act == "silu" else None)

    def forward(self, gate_up):  # gate_up [T, 2 ffn] -> [T, hidden]
        if self.act == "gelu_tanh":
            gate, up = gate_up.chunk(2, dim=-1)  # [T, ffn] each
            gate_up = F.gelu(gate, approximate="tanh") * up  # [T, ffn]
        return self.down_proj(gate_up)


def clamped_swiglu(alpha: float, limit: float):
    """gpt-oss's expert activation on h = [gate | up]: gate clamped above at limit, up to [-limit,
    limit], then (up + 1) * gate * sigmoid(alpha gate)."""
    def activation(h):
        ffn = h.shape[1] // 2
        gate, up = h[:, :ffn].clamp(max=limit), h[:, ffn:].clamp(-limit, limit)
        return (up + 1) * gate * torch.sigmoid(gate * alpha)

    return activation


def routed_experts(x, gate_up, down, weights, experts, grouped: bool | None = None, gate_up_bias=None,
                   activation=silu_mul):
    """sum_j weights[t, j] * expert_{experts[t, j]}(x[t]) for each token t, the experts gated MLPs
    (activation([gate | up]), tileattn's silu_mul by default, then down) held stacked: gate_up [E, 2 ffn,
    hidden] (gate_up_bias [E, 2 ffn] added when given), down [E, hidden, ffn] (a down bias is the
    caller's: sum_j weights[t, j] b_j).

    x [T, hidden]; weights float32 [T, k]; experts int64 [T, k] -> [T, hidden] in x's dtype. The
    T k (token, slot) pairs are sorted by expert so each expert's rows are contiguous, then
    multiplied by torch's grouped GEMM (F.grouped_mm, one launch per projection for all experts;
    the group ends stay on the device, so a CUDA graph can capture it), and put back in token order
    before the weighted sum (in float32, in slot order: no atomics). grouped None: the grouped GEMM
    where torch has it for this device and dtype (every dtype on CPU; bfloat16 on CUDA), else one
    matmul pair per expert with rows, which reads the group sizes on the host (not capturable)."""
    tokens, k = experts.shape
    num_experts = gate_up.shape[0]
    if grouped is None:
        grouped = grouped_mm_supported(x.device, x.dtype)
    flat = experts.reshape(-1)  # [T k]
    order = flat.argsort(stable=True)  # [T k]: pairs grouped by expert
    rows = x.index_select(0, order // k)  # [T k, hidden]
    sizes = torch.zeros(num_experts, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))  # [E]
    bias = None if gate_up_bias is None else gate_up_bias.index_select(0, flat.index_select(0, order))  # [T k, 2 ffn]
    if grouped:
        ends = sizes.cumsum(0, dtype=torch.int32)  # [E]
        h = F.grouped_mm(rows, gate_up.transpose(1, 2), offs=ends)  # [T k, 2 ffn]
        y = F.grouped_mm(activation(h if bias is None else h + bias), down.transpose(1, 2), offs=ends)  # [T k, hidden]
    else:
        y = torch.empty_like(rows)  # [T k, hidden]
        start = 0
        for e, n in enumerate(sizes.tolist()):
            if n:
                h = F.linear(rows[start:start + n], gate_up[e])  # [n, 2 ffn]
                h = h if bias is None else h + bias[start:start + n]
                y[start:start + n] = F.linear(activation(h), down[e])
                start += n
    by_token = torch.empty_like(y).index_copy_(0, order, y).view(tokens, k, x.shape[1])  # [T, k, hidden]
    return (by_token.float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM runs here (routed_experts, lora.grouped_delta): a torch with
    F.grouped_mm, on the CPU in any dtype, on CUDA in bfloat16 (the dtype its CUDA kernels take)."""
    return hasattr(F, "grouped_mm") and (device.type != "cuda" or dtype == torch.bfloat16)


class SparseMoE(nn.Module):
    """A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss): a router picks each token's
    top_k of num_experts gated MLPs by softmax probability (renormalised over the chosen ones when
    ``renormalize``: Mixtral and gpt-oss always, Qwen when norm_topk_prob) and sums their outputs so
    weighted (routed_experts). Qwen2-MoE adds a shared expert, a GatedMLP of shared_ffn every token
    runs, scaled by sigmoid(shared_expert_gate(x)). gpt-oss: ``biases`` (the router's, each expert's
    gate/up and down) and its clamped SwiGLU (``activation``).

    Tensor parallel (tp): every rank holds all experts with its ``ffn`` rows of gate and up and the
    matching columns of down (``ffn`` is this rank's part), routes every token (the router is
    replicated), and one all-reduce sums the ranks' partial outputs; the shared expert splits as
    GatedMLP does. forward(x [T, hidden], already normalised) -> [T, hidden]."""

    def __init__(self, hidden: int, num_experts: int, ffn: int, top_k: int, renormalize: bool,
                 dtype: torch.dtype, tp, shared_ffn: int = 0, biases: bool = False, activation=silu_mul):
        super().__init__()
        self.top_k, self.renormalize, self.tp, self.activation = top_k, renormalize, tp, activation
        self.gate = Linear(hidden, num_experts, biases, dtype)  # the router
        self.experts_gate_up_bias = self.experts_down_bias = None
        if biases:  # gate/up's follow this rank's rows; down's is whole, added once after the all-reduce
            self.experts_gate_up_bias = nn.Parameter(torch.empty(num_experts, 2 * ffn, dtype=dtype), requires_grad=False)
            self.experts_down_bias = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype), requires_grad=False)
        self.experts_gate_up = nn.Parameter(torch.empty(num_experts, 2 * ffn, hidden, dtype=dtype), requires_grad=False)
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden, ffn, dtype=dtype), requires_grad=False)
        self.shared_expert = GatedMLP(hidden, shared_ffn, False, dtype, tp) if shared_ffn else None
        self.shared_expert_gate = Linear(hidden, 1, False, dtype) if shared_ffn else None

    def forward(self, x):  # x [T, hidden] -> [T, hidden]
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, E]
        weights, experts = probs.topk(self.top_k, dim=-1)  # [T, k] each
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.tp.all_reduce(routed_experts(x, self.experts_gate_up, self.experts_down, weights, experts,
                                                gate_up_bias=self.experts_gate_up_bias, activation=self.activation))
        if self.experts_down_bias is not None:  # sum_j w_j b_j
            bias = self.experts_down_bias.index_select(0, experts.reshape(-1)).view(*experts.shape, -1)  # [T, k, hidden]
            out = out + (bias.float() * weights.unsqueeze(-1)).sum(1).to(out.dtype)
        if self.shared_expert is not None:
            shared = self.shared_expert(self.shared_expert.gate_up_proj(x))  # [T, hidden]
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out


class PagedAttention(nn.Module):
    """Self-attention: fused qkv projection, the optional per-head q/k RMSNorm (Qwen3), rotary and
    the new k/v written into the paged cache in one launch, then attention
    of the step's queries over each sequence's cached keys (prefill, chunked prefill and decode all
    take this one path), then the output projection. forward also runs the layer's input RMSNorm
    (with the residual add) with the qkv projection: tileattn.api_layers' add_rms_norm_qkv_rope_.

    Tensor parallel (tp: TensorParallel): this rank's heads and KV heads only (qkv column-parallel,
    o row-parallel), its KV cache holds its KV heads."""

    def __init__(self, cfg, dtype: torch.dtype, tp, *, sliding_window: int | None = None,
                 softcap: float | None = None, scale: float | None = None, sinks: bool = False):
        """sliding_window: this layer's window (default cfg.sliding_window, Mistral v0.1's on every
        layer); softcap: scores capped as c tanh(s / c) (Gemma 2); scale: default head_dim^-1/2;
        sinks: a learned logit per head that joins every row's softmax without a value (gpt-oss):
        the output scaled by exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink)."""
        super().__init__()
        self.heads, self.head_dim = tp.split(cfg.num_heads)[1], cfg.head_dim
        self.kv_heads = tp.kv_heads(cfg.num_kv_heads)[1]
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5 if scale is None else scale
        self.softcap = softcap
        # Sliding-window attention: a query sees itself and the W - 1 keys before it.
        window = cfg.sliding_window if sliding_window is None else sliding_window
        self.window = (window - 1, 0) if window else None
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias, dtype)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, cfg.o_bias, dtype, tp)
        self.sinks = nn.Parameter(torch.empty(self.heads, dtype=torch.float32), requires_grad=False) if sinks else None
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        # Set by the model runner: [num_blocks, block_size, Hkv, d] views of its one cache tensor,
        # and the (attention_paged, write_kv_cache) pair for the cache's device (the cache write
        # itself is fused into the rotary launch; only attention_paged is called here).
        self.k_cache = self.v_cache = None
        self.ops = None

    def forward(self, rope, x, residual, input_norm, batch: AttentionBatch):
        """rope: Rotary's (positions, cos, sin); x, residual [T, hidden] (residual None in the
        first layer); input_norm: the layer's RMSNorm before attention. -> (out [T, hidden], the
        new residual)."""
        positions, cos, sin = rope
        norm = self.q_norm is not None
        # The residual add + RMSNorm, the qkv projection, q/k normalised (Qwen3) and rotated, k and
        # v written into the paged cache: the projection's launch (the norm in its prologue) and one
        # rotary + cache-write launch.
        # qkv's k columns stay unrotated; nothing below reads them (attention reads the cache).
        qkv, residual = add_rms_norm_qkv_rope_(
            x, residual, input_norm.weight, input_norm.eps, self.qkv_proj.weight, self.qkv_proj.bias,
            heads=self.heads, kv_heads=self.kv_heads, k_cache=self.k_cache, v_cache=self.v_cache,
            slot_mapping=batch.slot_mapping, positions=positions, cos=cos, sin=sin,
            q_weight=self.q_norm.weight if norm else None, k_weight=self.k_norm.weight if norm else None,
            qk_eps=self.q_norm.eps if norm else 1e-6)  # [T, (H + 2 Hkv) d]
        return self.o_proj(self.attend(qkv, batch)), residual

    def rotate_and_attend(self, rope, qkv, batch: AttentionBatch):
        """The unfused path's second half (LoRA: the delta joins qkv before the rotary): qkv [T, (H +
        2 Hkv) d], projected from the normalised input -> q/k normalised (Qwen3) and rotated, k and v
        written into the cache, attention -> [T, H d] (o_proj's input)."""
        tokens, d = qkv.shape[0], self.head_dim
        positions, cos, sin = rope
        q, k, v = (t.view(tokens, n, d) for t, n in zip(  # column views of qkv
            qkv.split([self.q_size, self.kv_size, self.kv_size], dim=1), (self.heads, self.kv_heads, self.kv_heads)))
        norm = self.q_norm is not None
        norm_rotary_write_kv_cache_(q, k, v, self.k_cache, self.v_cache, batch.slot_mapping, positions, cos, sin,
                                    self.q_norm.weight if norm else None, self.k_norm.weight if norm else None,
                                    self.q_norm.eps if norm else 1e-6)
        return self.attend(qkv, batch)

    def attend(self, qkv, batch: AttentionBatch):
        """Attention of qkv's (rotated) queries over the cache -> [T, H d]."""
        tokens = qkv.shape[0]
        q = qkv[:, :self.q_size].view(tokens, self.heads, self.head_dim)  # [T, H, d], a strided view of qkv
        attention_paged = self.ops[0]
        out = attention_paged(q, self.k_cache, self.v_cache, batch.block_tables, batch.cu_seqlens_q,
                              batch.seqlens_k, batch.max_seqlen_q, batch.max_seqlen_k, causal=True, scale=self.scale,
                              window=self.window, softcap=self.softcap, return_lse=self.sinks is not None)  # [T, H, d]
        if self.sinks is not None:
            out, lse = out  # lse [H, T] float32, natural log
            keep = torch.sigmoid(lse.t() - self.sinks)  # [T, H]: the share of the softmax the keys hold
            out = (out.float() * keep.unsqueeze(-1)).to(out.dtype)
        return out.reshape(tokens, self.q_size)
