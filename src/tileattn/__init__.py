"""tileattn: fused attention kernels in CUDA C++, compiled at run time, driven from PyTorch.

Public API:
- `attention(q, k, v, causal=False, scale=None, return_lse=False, deterministic=False)`: dense
  [B, H, N, d] attention with autograd.
- `attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)`: packed
  sequences of different lengths ([T, H, d]), with autograd.
- `attention_paged(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, max_seqlen_q,
  max_seqlen_k, ...)`: packed queries against a paged KV cache (decode, chunked prefill).
- `write_kv_cache(k, v, k_cache, v_cache, slot_mapping)`: store keys and values into their slots.
- `dropout_mask(...)`: the dense dropout mask the kernels apply for a seed/offset (tests, analysis).
- `linear(x, weight, bias=None, activation=None)`, `add_rms_norm_linear(x, residual, norm_weight,
  eps, weight, bias=None)`: decode-sized projections (optionally fused with SiLU * up, or with the
  residual add + RMSNorm before them) on a hand-written GEMV; F.linear where it does not apply.
Importing tileattn registers the torch.library ops; it does not initialise CUDA or compile anything
(kernels are compiled, or loaded from the disk cache, on first use, one instantiation at a time).
"""

from .api import attention
from .api_layers import add_rms_norm_linear, linear
from .api_paged import attention_paged, write_kv_cache
from .api_varlen import attention_varlen
from .dropout import dropout_mask

__version__ = "0.1.0"

__all__ = ["__version__", "add_rms_norm_linear", "attention", "attention_paged", "attention_varlen", "dropout_mask",
           "linear", "write_kv_cache"]
