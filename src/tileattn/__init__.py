"""tileattn: fused attention kernels in CUDA C++, compiled at run time, driven from PyTorch.

Public API: `tileattn.attention(q, k, v, causal=False, scale=None, return_lse=False,
deterministic=False)`. Importing tileattn registers the torch.library ops `tileattn::attention_fwd`
and `tileattn::attention_bwd`; it does not initialise CUDA or compile anything (kernels are
compiled on first use).
"""

from .api import attention

__version__ = "0.1.0"

__all__ = ["__version__", "attention"]
