"""`tileattn bench varlen`'s padded SDPA peer on the CPU (the math backend): its rows inside each
sequence must be that sequence's own attention, causal and not, so that its timing is of a correct
result (before 2026-12-05 the non-causal peer let the zero padding keys into every softmax)."""

import pytest
import torch
from torch.nn.attention import SDPBackend

from tileattn.bench.varlen import padded_sdpa


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_padded_sdpa_rows_are_each_sequences_own_attention(causal, heads, kv_heads):
    torch.manual_seed(0)
    lengths, d = [5, 17, 1, 9], 16
    longest = max(lengths)
    q = torch.randn(len(lengths), heads, longest, d, dtype=torch.float64)
    k, v = (torch.randn(len(lengths), kv_heads, longest, d, dtype=torch.float64) for _ in range(2))
    valid = torch.zeros(len(lengths), longest, dtype=torch.bool)
    for b, n in enumerate(lengths):
        valid[b, :n] = True
        q[b, :, n:], k[b, :, n:], v[b, :, n:] = 0, 0, 0  # zero padding, as the bench pads
    out = padded_sdpa(q, k, v, valid, causal, SDPBackend.MATH)
    for b, n in enumerate(lengths):
        kb, vb = (t[b, :, :n].repeat_interleave(heads // kv_heads, dim=0) for t in (k, v))  # [H, n, d]
        scores = q[b, :, :n] @ kb.transpose(-1, -2) / d ** 0.5  # [H, n, n]
        if causal:
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        want = scores.softmax(-1) @ vb
        torch.testing.assert_close(out[b, :, :n], want, rtol=1e-12, atol=1e-12)
