"""The batch-1 decode a PyTorch user would write instead of using an engine (a `bench engine` peer).

gpt-fast's recipe (the one behind issue #13's 173 tok/s Llama-3-8B figure on the H200): a
plain-torch Llama over the transformers model's own weights, a static KV cache written by index,
`F.scaled_dot_product_attention` with a boolean mask over the whole cache, and one decode step
compiled with `torch.compile(mode="reduce-overhead", fullgraph=True)` (Inductor kernels replayed
through CUDA graphs). The prompt runs eagerly; only the one-token step is compiled, so the
benchmark pays one compilation (transformers' static-cache `generate`, the earlier peer, compiled
per cache length and took > 170 s on the H200 machine before its first token).

Covers the Llama family the benchmark shapes use: Llama 2/3 (rope scaling through the model's own
rotary module), Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm); tied or untied output head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' LlamaRMSNorm: the statistics in fp32, the result cast back before the weight."""
    f = x.float()
    return weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half rotary embedding (transformers' apply_rotary_pos_emb) of x [1, H, T, d] with
    cos, sin [1, 1, T, d]."""
    half = x.shape[-1] // 2
    rolled = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rolled * sin


class _Layer(torch.nn.Module):
    """One decoder layer's weights as buffers: transformers' tensors, q/k/v and gate/up fused."""

    def __init__(self, layer):
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        fused = {
            "input_norm": layer.input_layernorm.weight,
            "wqkv": torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),  # [(H + 2 Hkv) d, hidden]
            "bqkv": (None if attn.q_proj.bias is None
                     else torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])),
            "q_norm": getattr(getattr(attn, "q_norm", None), "weight", None),
            "k_norm": getattr(getattr(attn, "k_norm", None), "weight", None),
            "wo": attn.o_proj.weight,                                                       # [hidden, H d]
            "post_norm": layer.post_attention_layernorm.weight,
            "w13": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),                   # [2 ffn, hidden]
            "w2": mlp.down_proj.weight,                                                     # [hidden, ffn]
        }
        for name, tensor in fused.items():
            self.register_buffer(name, tensor, persistent=False)  # None registers as an absent buffer


class StaticCacheLlama(torch.nn.Module):
    """Decoder-only Llama-family forward with a static KV cache of `max_len` positions, batch 1.

    The weights are the transformers model's tensors, shared except for the fused q/k/v and
    gate/up projections (concatenated once, as gpt-fast fuses them: one GEMM where transformers
    runs two or three). The caches are [layers, 1, Hkv, max_len, d] in the model's dtype.
    """

    def __init__(self, hf_model, max_len: int):
        super().__init__()
        cfg = hf_model.config
        inner = hf_model.model
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.max_len = max_len
        weight = inner.embed_tokens.weight
        device, dtype = weight.device, weight.dtype
        # Buffers, not plain attributes: torch.compile's CUDA graphs treat a module's buffers as
        # static inputs (their addresses are baked in); other tensors would be copied in every replay.
        self.register_buffer("embed", weight, persistent=False)                # [V, hidden]
        self.register_buffer("norm", inner.norm.weight, persistent=False)      # [hidden]
        self.register_buffer("lm_head", hf_model.lm_head.weight, persistent=False)  # [V, hidden] (tied: the embedding)
        self.layers = torch.nn.ModuleList(_Layer(layer) for layer in inner.layers)
        shape = (len(self.layers), 1, self.kv_heads, max_len, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        # cos / sin of every cache position from the model's own rotary module (rope scaling included).
        positions = torch.arange(max_len, device=device)[None]
        probe = torch.zeros(1, device=device, dtype=dtype)
        cos, sin = inner.rotary_emb(probe, positions)  # [1, max_len, d] each
        self.register_buffer("cos", cos[0], persistent=False)
        self.register_buffer("sin", sin[0], persistent=False)
        # mask[p, j]: position p sees key j (causal over the whole cache; unwritten slots are later).
        self.register_buffer("mask", torch.ones(max_len, max_len, dtype=torch.bool, device=device).tril(),
                             persistent=False)

    def forward(self, tokens: Tensor, input_pos: Tensor) -> Tensor:
        """tokens int64 [1, T] at cache positions input_pos int64 [T] -> logits [1, T, V] (the
        cache rows at input_pos are overwritten with the tokens' keys and values)."""
        t = tokens.shape[1]
        h, hkv, d = self.heads, self.kv_heads, self.head_dim
        x = F.embedding(tokens, self.embed)                       # [1, T, hidden]
        cos = self.cos[input_pos][None, None]                     # [1, 1, T, d]
        sin = self.sin[input_pos][None, None]
        mask = self.mask[input_pos][None, None]                   # [1, 1, T, max_len]
        for i, w in enumerate(self.layers):  # w: _Layer
            a = _rms_norm(x, w.input_norm, self.eps)
            qkv = F.linear(a, w.wqkv, w.bqkv)                # [1, T, (H + 2 Hkv) d]
            q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
            q = q.view(1, t, h, d)
            k = k.view(1, t, hkv, d)
            if w.q_norm is not None:
                q = _rms_norm(q, w.q_norm, self.eps)
                k = _rms_norm(k, w.k_norm, self.eps)
            q = _rotate(q.transpose(1, 2), cos, sin)               # [1, H, T, d]
            k = _rotate(k.transpose(1, 2), cos, sin)               # [1, Hkv, T, d]
            v = v.view(1, t, hkv, d).transpose(1, 2)
            self.k_cache[i][:, :, input_pos] = k
            self.v_cache[i][:, :, input_pos] = v
            o = F.scaled_dot_product_attention(q, self.k_cache[i], self.v_cache[i], attn_mask=mask,
                                               enable_gqa=True)     # [1, H, T, d]
            x = x + F.linear(o.transpose(1, 2).reshape(1, t, h * d), w.wo)
            a = _rms_norm(x, w.post_norm, self.eps)
            gate, up = F.linear(a, w.w13).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w.w2)
        return F.linear(_rms_norm(x, self.norm, self.eps), self.lm_head)


class GreedyDecoder:
    """Greedy generation with StaticCacheLlama: the prompt eagerly, then one compiled step per
    token (compile=False: every step eager, for tests on machines without a compiler)."""

    def __init__(self, hf_model, max_len: int, compile: bool = True):
        self.model = StaticCacheLlama(hf_model, max_len)
        step = self._step
        self.step = torch.compile(step, mode="reduce-overhead", fullgraph=True) if compile else step

    def _step(self, token: Tensor, pos: Tensor) -> Tensor:  # token [1, 1], pos [1] -> next token [1, 1]
        return self.model(token, pos)[:, -1].argmax(-1, keepdim=True)

    @torch.no_grad()
    def generate(self, prompt: Tensor, new_tokens: int) -> Tensor:
        """prompt int64 [1, P] -> the new_tokens greedy tokens, int64 [new_tokens]."""
        p = prompt.shape[1]
        if p + new_tokens > self.model.max_len:
            raise ValueError(f"prompt ({p}) + new_tokens ({new_tokens}) exceeds the cache ({self.model.max_len})")
        token = self.model(prompt, torch.arange(p, device=prompt.device))[:, -1].argmax(-1, keepdim=True)  # [1, 1]
        pos = torch.full((1,), p, dtype=torch.int64, device=prompt.device)  # advanced in place, as gpt-fast does
        out = [token]
        for _ in range(new_tokens - 1):
            # clone: the compiled step's output lives in a CUDA-graph buffer the next replay overwrites
            token = self.step(token, pos).clone()
            pos += 1
            out.append(token)
        return torch.cat(out, dim=1)[0]
