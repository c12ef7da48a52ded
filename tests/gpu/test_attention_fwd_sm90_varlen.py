"""GPU tests of the Hopper forward on packed variable-length batches and on paged K/V caches
(attention_fwd_sm90.forward_varlen_plan and PagedPlan: the kVariant = kVarlen / kPaged
instantiations of csrc/attention_fwd_sm90.cu).

The plans are called directly (tileattn.api_varlen still runs the sm80 plan until the lead wires
this one in after these tests pass). Oracles: tileattn.reference.attention_varlen in float64 on the
same 16-bit inputs, with the dense tests' relative bounds (bf16 1e-2, fp16 2e-3; lse 2e-4 (1 +
|lse|) absolute); the sm80 varlen plan on the same inputs (both within the bound of the
reference, and of each other); and, bit for bit, the Hopper dense kernel on B equal-length
sequences seen as a [B, N, H, d] batch (same tiles: the varlen path only adds offsets, a V clear
of rows that meet P = 0, and a different store of the same staged 16-bit rows).

Outputs are NaN-poisoned before every launch, so an element the kernel does not write fails; the
token rows after the last sequence are NaN in q and NaN / Inf in k and v (a padded token buffer),
so a box that reads them into a stored row, or a V row that meets P = 0 without being cleared,
shows up as NaN. Paged cases reuse tests/gpu/test_attention_paged.py's Case (shuffled non-contiguous
block tables, a block shared by two sequences, junk int32 in every table entry past a sequence's
length) and its checks, against reference.attention_paged and the sm80 PagedLaunch; cache rows past
each sequence's length are NaN. Skipped with a reason on GPUs other than compute capability 9.0.
Markers: `gpu` (all), `sanitize` (small cases re-run under compute-sanitizer).
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from tileattn import dropout as dr
from tileattn import reference
from tileattn.kernels import attention_fwd_sm80 as sm80
from tileattn.kernels import attention_fwd_sm90 as sm90

from .conftest import requires_sm90
from .test_attention_paged import Case as PagedCase
from .test_attention_paged import capture, check_padding, spoil_block_table
from .test_attention_paged import check as check_paged

pytestmark = [pytest.mark.gpu, requires_sm90]

BF16, FP16 = torch.bfloat16, torch.float16
TOL = {BF16: 1e-2, FP16: 2e-3}
DEVICE = "cuda"


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def seed_of(*key) -> int:
    return zlib.crc32(repr(key).encode())


def offsets(lens) -> torch.Tensor:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=DEVICE)


class Case:
    """Packed q [Tq, H, d], k/v [Tk, Hkv, d] (unit normals in the input dtype) with pad_q / pad_k
    token rows after the last sequence holding NaN (q, k) and Inf (v)."""

    def __init__(self, lens_q, lens_k, heads, kv_heads, d, dtype, seed, *, pad_q=5, pad_k=70):
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        self.lens_q, self.lens_k = tuple(lens_q), tuple(lens_k)
        nq, nk = sum(lens_q), sum(lens_k)
        self.q = torch.randn(nq + pad_q, heads, d, device=DEVICE, generator=g).to(dtype)
        self.k = torch.randn(nk + pad_k, kv_heads, d, device=DEVICE, generator=g).to(dtype)
        self.v = torch.randn(nk + pad_k, kv_heads, d, device=DEVICE, generator=g).to(dtype)
        self.q[nq:], self.k[nk:], self.v[nk:] = math.nan, math.nan, math.inf
        self.cu_q, self.cu_k = offsets(lens_q), offsets(lens_k)
        self.max_q, self.max_k = max(lens_q, default=0), max(lens_k, default=0)
        self.nq, self.nk = nq, nk
        self.dtype, self.d = dtype, d
        self.what = f"lens_q={self.lens_q} lens_k={self.lens_k} H={heads} Hkv={kv_heads} d={d} {dtype}"

    def outputs(self, out=None):
        """NaN-poisoned out [Tq, H, d] (or the given view, poisoned) and lse [H, Tq]."""
        if out is None:
            out = torch.empty_like(self.q)
        out.fill_(math.nan)
        lse = torch.full((self.q.shape[1], self.q.shape[0]), math.nan, device=DEVICE)
        return out, lse

    def run_sm90(self, causal, *, scale=None, config=None, pack_gqa=None, out=None, **options):
        """(out, lse) of the Hopper varlen plan; `options`: window / softcap / alibi_slopes as
        attention_varlen takes them (the packed variant kernel, causal folded into the window)."""
        scale = 1.0 / math.sqrt(self.d) if scale is None else scale
        out, lse = self.outputs(out)
        variants, alibi = variant_args(options, causal, len(self.lens_q), self.q.shape[1])
        plan = sm90.forward_varlen_plan(self.q, self.k, self.v, out, lse, self.cu_q, self.cu_k, self.max_q,
                                        causal=causal and variants is None, scale=scale, config=config,
                                        pack_gqa=pack_gqa, variants=variants)
        plan.launch(self.q.data_ptr(), self.k.data_ptr(), self.v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                    self.cu_q.data_ptr(), self.cu_k.data_ptr(),
                    *((alibi, *dropout_values(options)) if variants is not None else ()))
        torch.cuda.synchronize()
        return out, lse

    def run_sm80(self, causal, *, scale=None):
        scale = 1.0 / math.sqrt(self.d) if scale is None else scale
        out, lse = self.outputs()
        plan = sm80.forward_varlen_plan(self.q, self.k, self.v, out, lse, self.cu_q, self.cu_k, self.max_q,
                                        causal=causal, scale=scale)
        plan.launch(self.q.data_ptr(), self.k.data_ptr(), self.v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                    self.cu_q.data_ptr(), self.cu_k.data_ptr())
        torch.cuda.synchronize()
        return out, lse

    def reference(self, causal, *, scale=None, **options):
        """float64 (out [nq, H, d], lse [H, nq]) of the sequences (padding rows excluded)."""
        return reference.attention_varlen(self.q[:self.nq], self.k[:self.nk], self.v[:self.nk], self.cu_q,
                                          self.cu_k, self.max_q, self.max_k, causal=causal, scale=scale,
                                          return_lse=True, compute_dtype=torch.float64, **options)


def variant_args(options, causal, batch, heads):
    """(VariantArgs or None, the slopes' address or 0) of window / softcap / alibi_slopes options,
    as tileattn.attention_varlen builds them (causal folded into the window); with dropout_p also
    the kRngState choice (a seed tensor)."""
    if not options:
        return None, 0
    left, right = dr.check_window(options.get("window"), causal)
    slopes = options.get("alibi_slopes")
    sb = None if slopes is None else dr.check_alibi(slopes, batch, heads, slopes.device, dtype_strict=True)
    variants = sm80.VariantArgs(left, right, dr.check_softcap(options.get("softcap")), sb,
                                options.get("dropout_p", 0.0), isinstance(options.get("seed"), torch.Tensor))
    return variants, 0 if slopes is None else slopes.data_ptr()


def dropout_values(options):
    """(seed, offset, rng state address) a varlen plan's launch takes for these options."""
    seed = options.get("seed", 0)
    if isinstance(seed, torch.Tensor):
        return 0, 0, seed.data_ptr()
    return seed, options.get("offset") or 0, 0


def rel_err(x, ref) -> float:
    x, ref = x.double(), ref.double()
    den = float(ref.norm())
    num = float((x - ref).norm())
    return num / den if den > 0 else num


def check(case: Case, out, lse, causal, *, scale=None, what="", **options):
    """out/lse against the float64 reference (sequences, with the variant `options`) and the padding
    contract (rows past the last sequence: out 0, lse -inf), with a message that says what differed
    and where."""
    what = f"{case.what} causal={causal} {what}"
    n = case.nq
    bad = torch.isnan(out)
    assert not bad.any(), (f"{what}: {int(bad.sum())} NaN in out (unwritten or NaN-producing), first (token, "
                           f"head, col) {tuple(bad.nonzero()[0].tolist())}")
    bad = torch.isnan(lse)
    assert not bad.any(), f"{what}: {int(bad.sum())} NaN in lse, first (head, token) {tuple(bad.nonzero()[0].tolist())}"
    assert bool((out[n:] == 0).all()), f"{what}: rows past cu_seqlens_q[B] are not 0"
    assert bool((lse[:, n:] == -math.inf).all()), f"{what}: lse past cu_seqlens_q[B] is not -inf"
    ref, ref_lse = case.reference(causal, scale=scale, **options)
    err = rel_err(out[:n], ref)
    if err > TOL[case.dtype]:
        row = (out[:n].double() - ref).norm(dim=-1)  # [nq, H]
        tok, head = (int(i) for i in torch.nonzero(row == row.max())[0])
        seq = int(torch.searchsorted(case.cu_q.cpu(), torch.tensor(tok, dtype=torch.int32), right=True)) - 1
        raise AssertionError(f"{what}: relative error {err:.3e} > {TOL[case.dtype]:g}; worst row token {tok} "
                             f"(sequence {seq}, position {tok - int(case.cu_q[seq])}), head {head}: "
                             f"|out - ref| = {row.max().item():.3e}")
    seen = torch.isfinite(ref_lse)
    got = torch.isfinite(lse[:, :n])
    assert torch.equal(got, seen), (f"{what}: rows that see no key differ: (head, token) "
                                    f"{tuple((got != seen).nonzero()[0].tolist())}")
    assert bool((out[:n].transpose(0, 1)[~seen] == 0).all()), f"{what}: a row that sees no key is not 0"
    if seen.any():
        diff = (lse[:, :n].double() - ref_lse).abs()[seen]
        bound = (2e-4 * (1 + ref_lse.abs()[seen]))
        assert bool((diff <= bound).all()), f"{what}: lse differs by up to {diff.max().item():.3e}"


# Sequence lengths: 0 (produces nothing), 1, 31, 33, 127, 129, 1000; Nq != Nk both ways
# (causal rows with no visible key where Nq > Nk).
LENS_Q = (0, 1, 31, 33, 127, 129, 1000, 64, 7)
LENS_K = (5, 1, 40, 33, 100, 300, 1000, 0, 129)


# ---------------------------------------------------------------------------------------------
# against the float64 reference
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("group", [1, 4, 8], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", sm90.HEAD_DIMS)
def test_varlen_matches_reference(d, causal, group, dtype):
    case = Case(LENS_Q, LENS_K, 8, 8 // group, d, dtype, seed_of(d, causal, group, dtype))
    out, lse = case.run_sm90(causal)
    check(case, out, lse, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", sm90.HEAD_DIMS)
def test_long_sequence(d, causal):
    """One long sequence among short ones (many query tiles, the causal order's longest first)."""
    case = Case((4097, 3, 200), (4097, 600, 100), 4, 2, d, BF16, seed_of("long", d, causal))
    out, lse = case.run_sm90(causal)
    check(case, out, lse, causal)


@pytest.mark.parametrize("pack_gqa", [True, False], ids=["pack", "nopack"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("group", [2, 4, 8, 16])
def test_gqa_packing_forced(group, causal, pack_gqa):
    """Short query runs (decode, speculative verification, short chunks) with the heads of a group
    packed into one tile or not: a packed tile's rows of several heads and positions, partially
    inside the sequence."""
    case = Case((1, 2, 17, 0, 5, 33), (300, 2, 17, 9, 70, 128), 16, 16 // group, 128, BF16,
                seed_of("pack", group, causal))
    out, lse = case.run_sm90(causal, pack_gqa=pack_gqa)
    check(case, out, lse, causal, what=f"pack_gqa={pack_gqa}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", sm90.HEAD_DIMS)
def test_every_registered_config(d, causal):
    for config in sm90.tuning_candidates(d, causal, BF16):  # persistent grids too: empty tiles skipped in the walk
        case = Case((130, 1, 257), (70, 64, 300), 4, 1, d, BF16, seed_of("cfg", d, causal, str(config)))
        out, lse = case.run_sm90(causal, config=config)
        check(case, out, lse, causal, what=f"config {config}")


# ---------------------------------------------------------------------------------------------
# against the sm80 varlen plan and the Hopper dense kernel
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", sm90.HEAD_DIMS)
def test_agrees_with_the_sm80_varlen_plan(d, causal, dtype):
    case = Case(LENS_Q, LENS_K, 8, 2, d, dtype, seed_of("sm80", d, causal, dtype))
    out, lse = case.run_sm90(causal)
    out80, lse80 = case.run_sm80(causal)
    what = f"{case.what} causal={causal}"
    n = case.nq
    err = rel_err(out[:n], out80[:n])
    assert err < 2 * TOL[dtype], f"{what}: sm90 and sm80 varlen outputs differ by {err:.3e} (relative)"
    assert torch.equal(torch.isfinite(lse), torch.isfinite(lse80)), f"{what}: -inf rows of lse differ from sm80's"
    fin = torch.isfinite(lse80)
    diff = (lse - lse80).abs()[fin]
    assert diff.numel() == 0 or diff.max().item() < 4e-4 * (1 + lse80.abs()[fin].max().item()), (
        f"{what}: lse differs from sm80's by up to {diff.max().item():.3e}")


@pytest.mark.parametrize("group", [1, 4], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", sm90.HEAD_DIMS)
def test_equal_lengths_match_the_dense_kernel_bitwise(d, causal, group):
    """B sequences of Nq queries and Nk keys are a dense [B, N, H, d] batch: the varlen kernel must
    give the dense Hopper kernel's bits (same tiles and arithmetic; only offsets, the V clear and the
    store differ). Nq is a multiple of the tile's 128 rows: a partial tile's rows past Nq read the
    next sequence instead of zeros, and their row maxima may change the warp's rescale vote (the
    values stay exact, the bits may not). Nk = 200 leaves an edge block: cleared V rows vs zero fill."""
    b, nq, nk, h = 3, 256, 200, 8
    case = Case((nq,) * b, (nk,) * b, h, h // group, d, BF16, seed_of("bitwise", d, causal, group), pad_q=0,
                pad_k=0)
    out, lse = case.run_sm90(causal)
    dense = lambda t, n: t.view(b, n, t.shape[1], d).transpose(1, 2)  # noqa: E731  [B, H, N, d] view
    out_d = torch.full((b, nq, h, d), math.nan, device=DEVICE, dtype=BF16).transpose(1, 2)
    lse_d = torch.full((b, h, nq), math.nan, device=DEVICE)
    sm90.launch_forward_sm90(dense(case.q, nq), dense(case.k, nk), dense(case.v, nk), out_d, lse_d, causal=causal,
                             scale=1.0 / math.sqrt(d))
    torch.cuda.synchronize()
    what = f"{case.what} causal={causal}"
    mismatch = out != out_d.transpose(1, 2).reshape(b * nq, h, d)
    assert not mismatch.any(), (f"{what}: {int(mismatch.sum())} out elements differ from the dense kernel's, first "
                                f"(token, head, col) {tuple(mismatch.nonzero()[0].tolist())}")
    lse_v = lse.view(h, b, nq).transpose(0, 1)  # [B, H, Nq]
    assert torch.equal(lse_v, lse_d), f"{what}: lse differs from the dense kernel's"


# ---------------------------------------------------------------------------------------------
# layouts, reuse, graphs, edges
# ---------------------------------------------------------------------------------------------
def test_strided_views_of_a_fused_buffer():
    """q, k, v as head slices of one fused [T, H + 2 Hkv, d] buffer and out a column slice of a
    wider buffer: the maps and the masked store follow the strides."""
    lens = (33, 0, 129, 1)
    h, hkv, d = 8, 2, 128
    g = torch.Generator(device=DEVICE).manual_seed(7)
    t = sum(lens)
    qkv = torch.randn(t, h + 2 * hkv, d, device=DEVICE, generator=g).to(BF16)
    case = Case(lens, lens, h, hkv, d, BF16, 7, pad_q=0, pad_k=0)
    case.q, case.k, case.v = qkv[:, :h], qkv[:, h:h + hkv], qkv[:, h + hkv:]
    wide = torch.full((t, h, 2 * d), math.nan, device=DEVICE, dtype=BF16)
    for causal in (False, True):
        out, lse = case.run_sm90(causal, out=wide[:, :, d:])
        check(case, out, lse, causal, what="fused-buffer views")
        assert torch.isnan(wide[:, :, :d]).all(), "the masked store wrote outside the out view"


def test_plan_reuse_and_cuda_graph_with_new_lengths():
    """One plan, launched on new buffers, and captured once in a CUDA graph then replayed after
    the lengths (device cu_seqlens) change under the same max_seqlen_q."""
    h, d = 4, 128
    lens_a, lens_b = (100, 28, 0, 3), (3, 0, 100, 28)  # same totals, same maximum
    a = Case(lens_a, lens_a, h, h, d, BF16, 1, pad_q=4, pad_k=4)
    b = Case(lens_b, lens_b, h, h, d, BF16, 2, pad_q=4, pad_k=4)
    out, lse = a.outputs()
    plan = sm90.forward_varlen_plan(a.q, a.k, a.v, out, lse, a.cu_q, a.cu_k, a.max_q, causal=True,
                                    scale=1.0 / math.sqrt(d))
    ptrs = lambda c: (c.q.data_ptr(), c.k.data_ptr(), c.v.data_ptr(), out.data_ptr(), lse.data_ptr(),  # noqa: E731
                      c.cu_q.data_ptr(), c.cu_k.data_ptr())
    for c in (a, b, a):
        out.fill_(math.nan), lse.fill_(math.nan)
        plan.launch(*ptrs(c))
        torch.cuda.synchronize()
        check(c, out, lse, True, what="plan reused")
    # Graph: captured on a's buffers, then a's tensors take b's contents in place.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        plan.launch(*ptrs(a))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.launch(*ptrs(a))
    for src in (b, a):
        for name in ("q", "k", "v", "cu_q", "cu_k"):
            getattr(a, name).copy_(getattr(src, name))
        out.fill_(math.nan), lse.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        a.lens_q = a.lens_k = src.lens_q
        check(a, out, lse, True, what="CUDA graph replay")


def test_only_padding_rows():
    """No sequence (B = 0) or only empty sequences: every row is padding (out 0, lse -inf)."""
    for lens in ((), (0, 0, 0)):
        case = Case(lens, lens, 2, 1, 64, FP16, 3, pad_q=37, pad_k=5)
        out, lse = case.run_sm90(False)
        assert bool((out == 0).all()) and bool((lse == -math.inf).all()), f"lens {lens}: padding rows not 0 / -inf"


def test_no_keys_at_all():
    """Tk = 0 (TMA cannot describe it: the plan's one-row dummy): every row sees nothing."""
    case = Case((3, 129), (0, 0), 4, 4, 128, BF16, 4, pad_q=2, pad_k=0)
    for causal in (False, True):
        out, lse = case.run_sm90(causal)
        assert bool((out == 0).all()) and bool((lse == -math.inf).all()), f"causal={causal}: rows with no key"


def test_custom_scale_and_lse_units():
    case = Case((129, 33), (200, 33), 2, 2, 64, BF16, 5)
    out, lse = case.run_sm90(True, scale=0.3)
    check(case, out, lse, True, scale=0.3, what="scale 0.3")


def test_supports_varlen_on_this_gpu():
    q = torch.empty(10, 4, 128, device=DEVICE, dtype=BF16)
    assert sm90.supports_varlen(128, BF16, device=DEVICE, tensors=(q, q, q, q), batch=2, heads=4, max_seqlen_q=8)
    odd = torch.empty(10, 4, 68, device=DEVICE, dtype=BF16)[:, :, :64]  # head stride 136 bytes
    assert not sm90.supports_varlen(64, BF16, device=DEVICE, tensors=(odd,))


def test_argument_errors():
    case = Case((5,), (5,), 4, 2, 64, BF16, 6)
    out, lse = case.outputs()
    with pytest.raises(ValueError, match="head_dim"):
        q96 = torch.zeros(5, 4, 96, device=DEVICE, dtype=BF16)
        sm90.forward_varlen_plan(q96, q96[:, :2], q96[:, :2], q96, lse, case.cu_q, case.cu_k, 5, causal=False,
                                 scale=0.1)
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        sm90.forward_varlen_plan(case.q[:, :3], case.k, case.v, out[:, :3], lse, case.cu_q, case.cu_k, 5,
                                 causal=False, scale=0.1)
    odd = torch.zeros(5, 4, 68, device=DEVICE, dtype=BF16)[:, :, :64]
    with pytest.raises(ValueError, match="TMA"):
        sm90.forward_varlen_plan(odd, case.k, case.v, out, lse, case.cu_q, case.cu_k, 5, causal=False, scale=0.1)
    with pytest.raises(ValueError, match="dtype"):
        sm90.forward_varlen_plan(case.q, case.k.half(), case.v, out, lse, case.cu_q, case.cu_k, 5, causal=False,
                                 scale=0.1)


# ---------------------------------------------------------------------------------------------
# paged K/V cache (PagedPlan)
# ---------------------------------------------------------------------------------------------
def poison_past_lengths(case: PagedCase) -> None:
    """NaN in every cache row of a sequence's last block past its length (stale rows): a box row
    there that is neither masked (K) nor cleared (V) turns the output NaN."""
    table = case.block_table.cpu()
    bs = case.block_size
    for b, nk in enumerate(case.seqlens_k.tolist()):
        if nk <= 0 or -(-nk // bs) > table.shape[1]:
            continue
        keys = torch.arange(nk, -(-nk // bs) * bs)
        blocks = table[b, keys // bs].long()
        ok = (blocks >= 0) & (blocks < case.num_blocks)
        case.k_cache[blocks[ok].cuda(), (keys[ok] % bs).cuda()] = math.nan
        case.v_cache[blocks[ok].cuda(), (keys[ok] % bs).cuda()] = math.nan


def run_paged(case: PagedCase, causal=True, *, scale=None, config=None, pack_gqa=None, **options):
    """(out, lse, plan) of PagedPlan on the case, out / lse NaN-poisoned; `options`: window / softcap
    / alibi_slopes as attention_paged takes them (the packed variant kernel)."""
    scale = 1.0 / math.sqrt(case.q.shape[-1]) if scale is None else scale
    variants, _ = variant_args(options, causal, len(case.seqs), case.q.shape[1])
    plan = sm90.PagedPlan(case.q, case.k_cache, case.v_cache, case.block_table, max_seqlen_q=case.max_seqlen_q,
                          causal=causal and variants is None, scale=scale, return_lse=True, config=config,
                          pack_gqa=pack_gqa, variants=variants)
    out = torch.full_like(case.q, math.nan)
    lse = torch.full((case.q.shape[1], case.q.shape[0]), math.nan, device=DEVICE)
    out, lse = plan(*case.tensors(), out=out, lse=lse, alibi_slopes=options.get("alibi_slopes"))
    torch.cuda.synchronize()
    return out, lse, plan


def prefill_seqs(block_size):
    """Chunks after cached prefixes (lengths at and around the block and tile edges), a whole
    prompt, a one-token and an empty chunk: the shapes a chunked-prefill step mixes."""
    bs = block_size
    return [(129, 129 + 700), (64, 64), (100, bs * 3 + 1), (1, 33), (0, 17), (31, bs - 1), (33, 1000)]


@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2), (16, 2)], ids=["G1", "G4", "G8"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", sm90.HEAD_DIMS)
def test_paged_matches_reference(d, causal, heads, kv_heads, dtype, block_size):
    seed = seed_of("paged", d, causal, heads, kv_heads, dtype, block_size)
    case = PagedCase(prefill_seqs(block_size), heads, kv_heads, d, dtype, block_size, seed, pad_tokens=3)
    ref_out, ref_lse = case.reference(causal=causal)
    poison_past_lengths(case)
    out, lse, plan = run_paged(case, causal)
    what = f"sm90 paged d={d} H={heads}/{kv_heads} bs={block_size} {dtype} causal={causal} ({plan.config})"
    check_paged(case, out, lse, ref_out, ref_lse, what)
    check_padding(case, out, lse, what)


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_paged_chunk_after_a_4k_prefix_agrees_with_sm80(block_size, causal):
    """The issue's chunked-prefill shape (512 queries after a 4096-key cached prefix), several
    sequences, against the reference and the sm80 paged kernel on the same inputs."""
    seqs = [(512, 4096 + 512)] * 3 + [(200, 200)]
    case = PagedCase(seqs, 16, 4, 128, BF16, block_size, seed_of("4k", block_size, causal))
    ref_out, ref_lse = case.reference(causal=causal)
    out, lse, _ = run_paged(case, causal)
    what = f"chunk after 4k prefix bs={block_size} causal={causal}"
    check_paged(case, out, lse, ref_out, ref_lse, what)
    out80, lse80, _ = case.launch(causal=causal)
    err = rel_err(out, out80)
    assert err < 2 * TOL[BF16], f"{what}: sm90 and sm80 paged outputs differ by {err:.3e} (relative)"
    fin = torch.isfinite(lse80)
    assert torch.equal(torch.isfinite(lse), fin), f"{what}: -inf rows of lse differ from sm80's"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_paged_bad_block_ids_are_masked(causal):
    """Block ids outside [0, num_blocks) inside a sequence's length, and a length past the table's
    capacity: those keys are masked (the reference's rule), never read."""
    case = PagedCase([(100, 100), (70, 170), (40, 40)], 8, 2, 128, BF16, 16, seed=5, share=False)
    spoil_block_table(case)
    case.max_seqlen_k = 10_000
    ref_out, ref_lse = case.reference(causal=causal)
    out, lse, _ = run_paged(case, causal)
    check_paged(case, out, lse, ref_out, ref_lse, f"sm90 paged, bad block ids, causal={causal}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", sm90.HEAD_DIMS)
def test_persistent_grids_walk_and_skip_tiles(d, causal):
    """A persistent config (one CTA per SM walking the tiles): many sequences of very different
    lengths make most tiles empty, so each CTA skips many between the ones it computes; varlen and
    paged, against the reference."""
    persistent = sm90.Sm90Config(sm90.DEFAULTS[(d, causal)].block_n, sm90.DEFAULTS[(d, causal)].stages, False, True)
    lens_q = (1000, 3, 0, 129, 1, 700) * 6
    lens_k = (1000, 40, 7, 129, 1, 900) * 6
    case = Case(lens_q, lens_k, 16, 4, d, BF16, seed_of("persistent", d, causal))
    out, lse = case.run_sm90(causal, config=persistent)
    check(case, out, lse, causal, what=f"persistent {persistent}")
    paged_case = PagedCase([(q, k) for q, k in zip(lens_q, lens_k)], 16, 4, d, BF16, 32,
                           seed_of("persistent-paged", d, causal))
    ref_out, ref_lse = paged_case.reference(causal=causal)
    poison_past_lengths(paged_case)
    out, lse, _ = run_paged(paged_case, causal, config=persistent)
    check_paged(paged_case, out, lse, ref_out, ref_lse, f"paged persistent {persistent} d={d} causal={causal}")


@pytest.mark.parametrize("pack_gqa", [True, False], ids=["pack", "nopack"])
def test_paged_gqa_packing_forced(pack_gqa):
    case = PagedCase([(5, 300), (17, 17), (64, 100)], 16, 2, 128, BF16, 32, seed=11)
    ref_out, ref_lse = case.reference()
    poison_past_lengths(case)
    out, lse, _ = run_paged(case, True, pack_gqa=pack_gqa)
    check_paged(case, out, lse, ref_out, ref_lse, f"sm90 paged pack_gqa={pack_gqa}")


def test_paged_call_shape_reuse_and_cuda_graph():
    """PagedLaunch's call shape (out / lse allocated, lse None unless asked), one plan over new
    tables and lengths, and a CUDA graph captured once and replayed after the device-side lengths
    and table change (same max_seqlen_q)."""
    d, bs = 128, 16
    a = PagedCase([(64, 300), (80, 80), (3, 40)], 8, 2, d, BF16, bs, seed=21, spare=40)
    plan = sm90.PagedPlan(a.q, a.k_cache, a.v_cache, a.block_table, max_seqlen_q=a.max_seqlen_q, causal=True,
                          scale=1.0 / math.sqrt(d), return_lse=False)
    out, lse = plan(*a.tensors())
    assert lse is None and out.shape == a.q.shape and out.dtype == a.q.dtype
    ref_out, _ = a.reference()
    rows = int(a.cu_seqlens_q[-1])
    err = rel_err(out[:rows], ref_out[:rows])
    assert err < TOL[BF16], f"return_lse=False: relative error {err:.3e} (out allocated by the plan)"
    # New lengths and a reshuffled table, same shapes: the same plan, then a graph.
    out_buf = torch.full_like(a.q, math.nan)
    lse_buf = torch.full((a.q.shape[1], a.q.shape[0]), math.nan, device=DEVICE)
    graph, _ = capture(lambda: plan(*a.tensors(), out=out_buf, lse=lse_buf))
    for step in range(2):
        perm = torch.randperm(a.num_blocks, generator=torch.Generator().manual_seed(step))[:a.block_table.numel()]
        a.block_table.copy_(perm.view_as(a.block_table).to(torch.int32))
        a.seqlens_k.copy_(torch.tensor([300 - 7 * step, 80 + step, 40 + 9 * step], dtype=torch.int32))
        out_buf.fill_(math.nan), lse_buf.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = a.reference()
        check_paged(a, out_buf, lse_buf, ref_out, ref_lse, f"CUDA graph replay {step}")


def test_supports_paged():
    kw = dict(block_size=16, batch=4, heads=32, kv_heads=8, device=DEVICE)
    assert sm90.supports_paged(128, BF16, max_seqlen_q=512, **kw)  # chunked prefill: 4 x 32 x 4 tiles
    assert not sm90.supports_paged(128, BF16, max_seqlen_q=1, **kw)  # decode: sm80's split-KV path
    assert not sm90.supports_paged(128, BF16, max_seqlen_q=512, **{**kw, "batch": 1, "heads": 8})  # 32 tiles
    assert not sm90.supports_paged(128, BF16, max_seqlen_q=512, **{**kw, "block_size": 8})
    assert not sm90.supports_paged(96, BF16, max_seqlen_q=512, **kw)


def test_paged_argument_errors():
    case = PagedCase([(70, 100)], 4, 2, 64, BF16, 16, seed=8)
    args = (case.q, case.k_cache, case.v_cache, case.block_table)
    kw = dict(max_seqlen_q=70, causal=True, scale=0.1, return_lse=True)
    with pytest.raises(ValueError, match="split"):
        sm90.PagedPlan(*args, **kw, num_splits=2)
    with pytest.raises(ValueError, match="variants"):
        sm90.PagedPlan(*args, **kw, variants=object())
    small = torch.zeros(4, 8, 2, 64, device=DEVICE, dtype=BF16)
    with pytest.raises(ValueError, match="block_size"):
        sm90.PagedPlan(case.q, small, small, case.block_table, **kw)


# ---------------------------------------------------------------------------------------------
# Variants on the packed layouts (window, softcap, ALiBi: PACKED_VARIANT_INSTANTIATIONS)
# ---------------------------------------------------------------------------------------------
# name -> (options, causal, q multiplier, kVariant flags the call runs). Every flag set of
# PACKED_VARIANT_FLAGS: windows smaller than, equal to (0, 0: one key) and larger than the sequences,
# two-sided without causal; softcap 5 with q x 8 (extreme logits: tanh saturates); ALiBi [H] and [B, H]
# (B = sequences), with softcap and with a window.
PACKED_VARIANTS = {
    "window_causal": ({"window": (40, 0)}, True, 1.0, sm90.WINDOW),
    "window_two_sided": ({"window": (100, 7)}, False, 1.0, sm90.WINDOW),
    "window_zero": ({"window": (0, 0)}, False, 1.0, sm90.WINDOW),
    "window_large": ({"window": (5000, 5000)}, False, 1.0, sm90.WINDOW),
    "softcap_extreme": ({"softcap": 5.0}, False, 8.0, sm90.SOFTCAP),
    "softcap_causal": ({"softcap": 30.0}, True, 2.0, sm90.WINDOW | sm90.SOFTCAP),
    "alibi_h": ({"alibi": "h"}, False, 1.0, sm90.ALIBI),
    "alibi_bh_causal": ({"alibi": "bh"}, True, 1.0, sm90.WINDOW | sm90.ALIBI),
    "softcap_alibi": ({"softcap": 20.0, "alibi": "bh"}, False, 2.0, sm90.SOFTCAP | sm90.ALIBI),
    "all": ({"window": (64, 0), "softcap": 20.0, "alibi": "bh"}, True, 2.0, sm90.WINDOW | sm90.SOFTCAP | sm90.ALIBI),
}


def spec_options(spec, batch, heads, seed):
    """A case's options for the plans / the reference: `spec` with its "alibi" entry ("h": slopes [H],
    "bh": [B, H]) replaced by fp32 slopes in [0, 0.5) drawn from `seed`."""
    options = {k: v for k, v in spec.items() if k != "alibi"}
    if "alibi" in spec:
        shape = (heads,) if spec["alibi"] == "h" else (batch, heads)
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        options["alibi_slopes"] = 0.5 * torch.rand(shape, device=DEVICE, generator=gen)
    return options


def packed_options(name, q, batch, seed):
    """(options for the plans / the reference, causal, q scaled by the case's multiplier)."""
    spec, causal, mult, _ = PACKED_VARIANTS[name]
    return spec_options(spec, batch, q.shape[1], seed), causal, q if mult == 1.0 else (q.float() * mult).to(q.dtype)


def test_packed_variant_cases_cover_every_flag_set():
    flags = {sm90.variant_flags(variant_args(packed_options(name, torch.zeros(1, 4, 64, device=DEVICE), 2, 0)[0],
                                             PACKED_VARIANTS[name][1], 2, 4)[0]) for name in PACKED_VARIANTS}
    assert flags == set(sm90.PACKED_VARIANT_FLAGS)
    for name, (_, causal, _, expected) in PACKED_VARIANTS.items():
        options = packed_options(name, torch.zeros(1, 4, 64, device=DEVICE), 2, 0)[0]
        assert sm90.variant_flags(variant_args(options, causal, 2, 4)[0]) == expected, name


@pytest.mark.parametrize("dtype,group", [(BF16, 4), (FP16, 1)], ids=["bf16-G4", "fp16-G1"])
@pytest.mark.parametrize("name", list(PACKED_VARIANTS))
@pytest.mark.parametrize("d", sm90.HEAD_DIMS)
def test_varlen_variants_match_reference(d, name, dtype, group):
    seed = seed_of("varlen-variants", d, name, dtype, group)
    case = Case(LENS_Q, LENS_K, 8, 8 // group, d, dtype, seed)
    options, causal, case.q = packed_options(name, case.q, len(LENS_Q), seed)
    out, lse = case.run_sm90(causal, **options)
    check(case, out, lse, causal, what=name, **options)


@pytest.mark.parametrize("name", ["window_causal", "softcap_causal", "all"])
@pytest.mark.parametrize("d", sm90.HEAD_DIMS)
def test_varlen_variants_long_sequence(d, name):
    """One long sequence among short ones: a window visits a band of blocks (the ones below and above
    it neither loaded nor visited), on the causal tile order."""
    seed = seed_of("varlen-variants-long", d, name)
    case = Case((4097, 3, 200), (4097, 600, 100), 4, 2, d, BF16, seed)
    options, causal, case.q = packed_options(name, case.q, 3, seed)
    options = {**options, "window": (1000, 0)} if "window" in options else options
    out, lse = case.run_sm90(causal, **options)
    check(case, out, lse, causal, what=name, **options)


@pytest.mark.parametrize("pack_gqa", [True, False], ids=["pack", "nopack"])
@pytest.mark.parametrize("name", ["alibi_bh_causal", "all", "window_two_sided"])
def test_varlen_variants_gqa_packing_forced(name, pack_gqa):
    """Short query runs with a group's heads packed into one tile: each row's own head slope, position
    and window edges."""
    seed = seed_of("varlen-variants-pack", name, pack_gqa)
    case = Case((1, 2, 17, 0, 5, 33), (300, 2, 17, 9, 70, 128), 16, 2, 128, BF16, seed)
    options, causal, case.q = packed_options(name, case.q, 6, seed)
    out, lse = case.run_sm90(causal, pack_gqa=pack_gqa, **options)
    check(case, out, lse, causal, what=f"{name} pack_gqa={pack_gqa}", **options)


@pytest.mark.parametrize("d", sm90.HEAD_DIMS)
def test_varlen_variants_persistent_grid(d):
    """The variant tile on a persistent grid: CTAs walk tiles, most of them empty."""
    base = sm90.VARIANT_DEFAULTS[d]
    persistent = sm90.Sm90Config(base.block_n, base.stages, False, True)
    seed = seed_of("varlen-variants-persistent", d)
    case = Case((1000, 3, 0, 129, 1, 700) * 4, (1000, 40, 7, 129, 1, 900) * 4, 8, 2, d, BF16, seed)
    options, causal, case.q = packed_options("all", case.q, 24, seed)
    out, lse = case.run_sm90(causal, config=persistent, **options)
    check(case, out, lse, causal, what=f"all {persistent}", **options)


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("name", ["window_causal", "window_two_sided", "softcap_causal", "alibi_h", "all"])
@pytest.mark.parametrize("d", sm90.HEAD_DIMS)
def test_paged_variants_match_reference(d, name, block_size):
    seed = seed_of("paged-variants", d, name, block_size)
    case = PagedCase(prefill_seqs(block_size), 8, 2, d, BF16, block_size, seed, pad_tokens=3)
    options, causal, case.q = packed_options(name, case.q, len(case.seqs), seed)
    ref_out, ref_lse = case.reference(causal=causal, **options)
    poison_past_lengths(case)
    out, lse, plan = run_paged(case, causal, **options)
    what = f"sm90 paged {name} d={d} bs={block_size} ({plan.config})"
    check_paged(case, out, lse, ref_out, ref_lse, what)
    check_padding(case, out, lse, what)


def test_paged_variants_bad_block_ids_are_masked():
    case = PagedCase([(100, 100), (70, 170), (40, 40)], 8, 2, 128, BF16, 16, seed=7, share=False)
    spoil_block_table(case)
    case.max_seqlen_k = 10_000
    options, causal, case.q = packed_options("all", case.q, 3, 7)
    ref_out, ref_lse = case.reference(causal=causal, **options)
    out, lse, _ = run_paged(case, causal, **options)
    check_paged(case, out, lse, ref_out, ref_lse, "sm90 paged variants, bad block ids")


def public_varlen_round_trip(case: Case, options, causal, seed, what, hopper_backward=False):
    """attention_varlen with `options` and autograd on an unpadded case (allocations poisoned): a Hopper
    VarlenPlan runs the forward, which matches the float64 reference, and the gradients (the backward as
    dispatched; hopper_backward: a Hopper BackwardVarlenPlan) match the reference's."""
    from tileattn.kernels import attention_bwd_sm90
    import tileattn
    from tileattn import api

    from .conftest import poisoned_allocations

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    dout = torch.randn(case.q.shape, device=DEVICE, generator=g).to(BF16)
    api.clear_plans()
    q, k, v = (t.detach().requires_grad_() for t in (case.q, case.k, case.v))
    with poisoned_allocations():
        out, lse = tileattn.attention_varlen(q, k, v, case.cu_q, case.cu_k, case.max_q, case.max_k, causal,
                                             return_lse=True, **options)
        out.backward(dout)
    plans = [getattr(e, "forward", None) for e in api._plans.values()]
    assert any(isinstance(p, sm90.VarlenPlan) for p in plans), f"{what}: no Hopper varlen plan ran: {plans}"
    if hopper_backward:
        plans = [p for e in api._plans.values() for p in getattr(e, "backward", {}).values()]
        assert any(isinstance(p, attention_bwd_sm90.BackwardVarlenPlan) for p in plans), f"{what}: {plans}"
    check(case, out.detach(), lse, causal, what=what, **options)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (case.q, case.k, case.v))
    ref = reference.attention_varlen(q64, k64, v64, case.cu_q, case.cu_k, case.max_q, case.max_k, causal=causal,
                                     compute_dtype=torch.float64, **options)
    ref.backward(dout.double())
    for name, got, want in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        err = rel_err(got, want)
        assert err < 2e-2, f"{what} {name}: relative error {err:.3e}"


def test_packed_variants_through_the_public_ops():
    """attention_varlen and attention_paged with variants as dispatched on this GPU (the dispatcher's
    SM90_VARLEN_VARIANT_FORWARD / SM90_PAGED_VARIANT_PREFILL and SM90_VARLEN_VARIANT_BACKWARD): the
    Hopper plans run, the forward and the varlen gradients match the reference."""
    from tileattn import api_paged

    seed = seed_of("public-variants")
    case = Case((300, 0, 129, 1), (400, 5, 129, 40), 8, 2, 128, BF16, seed, pad_q=0, pad_k=0)
    options, causal, case.q = packed_options("all", case.q, 4, seed)
    public_varlen_round_trip(case, options, causal, seed, "public op")

    # 5 x 16 x 2 = 160 query tiles: at least one per SM (supports_paged)
    paged = PagedCase([(600, 600 + 900), (600, 600)], 16, 4, 128, BF16, 16, seed)
    options, causal, paged.q = packed_options("all", paged.q, 2, seed)
    ref_out, ref_lse = paged.reference(causal=causal, **options)
    api_paged._paged_cache.clear()
    out, lse = paged.api(causal=causal, **options)
    assert any(isinstance(p, sm90.PagedPlan) for p in api_paged._paged_cache.values())
    check_paged(paged, out, lse, ref_out, ref_lse, "public attention_paged with variants")


def test_packed_variant_argument_errors():
    case = Case((5,), (7,), 4, 2, 64, BF16, 3)
    out, lse = case.outputs()
    dropout = sm80.VariantArgs(dropout_p=0.1)
    with pytest.raises(ValueError, match="not variant flags 36"):  # dropout with ALiBi: no d = 256 form
        q256 = torch.zeros(5, 4, 256, device=DEVICE, dtype=BF16)
        sm90.forward_varlen_plan(q256, q256[:, :2], q256[:, :2], q256, lse, case.cu_q, case.cu_k, 5, causal=False,
                                 scale=0.1, variants=sm80.VariantArgs(alibi_batch_stride=0, dropout_p=0.1))
    with pytest.raises(ValueError, match="causal must be folded"):
        sm90.forward_varlen_plan(case.q, case.k, case.v, out, lse, case.cu_q, case.cu_k, 5, causal=True, scale=0.1,
                                 variants=sm80.VariantArgs(softcap=5.0))
    plan = sm90.forward_varlen_plan(case.q, case.k, case.v, out, lse, case.cu_q, case.cu_k, 5, causal=False,
                                    scale=0.1, variants=sm80.VariantArgs(softcap=5.0))
    with pytest.raises(ValueError, match="no dropout"):
        plan.launch(case.q.data_ptr(), case.k.data_ptr(), case.v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                    case.cu_q.data_ptr(), case.cu_k.data_ptr(), 0, 1, 0, 0)
    paged = PagedCase([(70, 70)], 4, 2, 64, BF16, 16, seed=3)
    with pytest.raises(ValueError, match="not variant flags 32"):
        sm90.PagedPlan(paged.q, paged.k_cache, paged.v_cache, paged.block_table, max_seqlen_q=70, causal=False,
                       scale=0.1, return_lse=True, variants=dropout)


# ---------------------------------------------------------------------------------------------
# Dropout on the varlen layout (VARLEN_DROPOUT_INSTANTIATIONS, dispatched by SM90_VARLEN_DROPOUT_FORWARD)
# ---------------------------------------------------------------------------------------------
# name -> (options besides dropout, causal): each registered set's variants (the window bit is always
# the kernel's; ALiBi with dropout has no d = 256 form, so that case runs at d = 64 / 128 only).
DROPOUT_CASES = {
    "alone": ({}, False),
    "causal": ({}, True),
    "window_softcap": ({"window": (50, 3), "softcap": 20.0}, False),
    "alibi_causal": ({"alibi": "bh"}, True),
}


def dropout_case(name, d, dtype, seed, *, seed_tensor=False, **pads):
    case = Case(LENS_Q, LENS_K, 8, 2, d, dtype, seed, **pads)
    spec, causal = DROPOUT_CASES[name]
    options = spec_options(spec, len(LENS_Q), 8, seed)
    drop_seed, drop_offset = 0x1234_5678_9ABC + seed, 4 * (seed % 1000)
    options["dropout_p"] = 0.2
    if seed_tensor:
        options["seed"] = torch.tensor([drop_seed, drop_offset], dtype=torch.int64, device=DEVICE)
    else:
        options["seed"], options["offset"] = drop_seed, drop_offset
    return case, options, causal, (drop_seed, drop_offset)


def _dropout_ids():
    return [(d, name) for d in sm90.HEAD_DIMS for name in DROPOUT_CASES if not (d == 256 and "alibi" in name)]


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d,name", _dropout_ids(), ids=lambda x: str(x))
def test_varlen_dropout_matches_reference(d, name, dtype):
    """The Hopper varlen dropout kernel against the float64 reference with the same seed and offset
    (the reference applies tileattn.dropout.dropout_mask per sequence), and the kRngState form (a seed
    tensor holding the same values) bitwise against the by-value one."""
    seed = seed_of("varlen-dropout", d, name, dtype)
    case, options, causal, _ = dropout_case(name, d, dtype, seed)
    out, lse = case.run_sm90(causal, **options)
    check(case, out, lse, causal, what=f"dropout {name}", **options)
    _, tensor_options, _, _ = dropout_case(name, d, dtype, seed, seed_tensor=True)  # the same slopes' values
    out_t, lse_t = case.run_sm90(causal, **tensor_options)
    assert torch.equal(out_t, out) and torch.equal(lse_t, lse), f"dropout {name}: seed tensor != int seed"


def test_varlen_dropout_keeps_the_expected_fraction_and_seeds_differ():
    case, options, causal, _ = dropout_case("alone", 64, BF16, 5)
    ones = Case(LENS_Q, LENS_K, 8, 2, 64, BF16, 5)
    ones.v = torch.ones_like(ones.v)  # out = kept probability mass / (1 - p) per row
    first, lse = ones.run_sm90(causal, **options)
    again, _ = ones.run_sm90(causal, **options)
    assert torch.equal(first, again), "the same seed and offset gave different masks"
    other, _ = ones.run_sm90(causal, **{**options, "seed": options["seed"] + 1})
    assert not torch.equal(first, other), "different seeds gave the same mask"
    seen = torch.isfinite(lse[:, :ones.nq]).t()  # [nq, H]: rows that see some key
    rows = first[:ones.nq].float().mean(-1)[seen]
    kept = float(rows.mean()) * (1 - options["dropout_p"])  # each row's kept probability mass, averaged
    assert abs(kept - (1 - options["dropout_p"])) < 0.02, f"kept fraction {kept:.4f}, expected 0.8"


def test_varlen_dropout_through_the_public_op():
    """attention_varlen with dropout and autograd as the dispatcher runs it (SM90_VARLEN_DROPOUT_FORWARD /
    _BACKWARD): the Hopper plans run, the forward and the gradients (the backward regenerating the mask:
    the Hopper varlen dropout backward for causal dropout, the sm80 one with softcap) match the float64
    reference with the same seed."""
    for name, hopper_backward in (("causal", True), ("window_softcap", False)):
        seed = seed_of("public-varlen-dropout", name)
        case, options, causal, _ = dropout_case(name, 128, BF16, seed, pad_q=0, pad_k=0)
        public_varlen_round_trip(case, options, causal, seed, f"public dropout {name}", hopper_backward)


# ---------------------------------------------------------------------------------------------
# Small cases that compute-sanitizer re-runs (memcheck / racecheck / synccheck / initcheck)
# ---------------------------------------------------------------------------------------------
@pytest.mark.sanitize
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", sm90.HEAD_DIMS)
def test_sanitize_small(d, causal):
    case = Case((0, 1, 33, 70), (3, 1, 31, 129), 4, 1, d, BF16, seed_of("san", d, causal), pad_q=3, pad_k=9)
    out, lse = case.run_sm90(causal)
    check(case, out, lse, causal)
    packed = Case((1, 2, 0), (65, 3, 1), 8, 1, d, FP16, seed_of("san-pack", d, causal), pad_q=1, pad_k=2)
    out, lse = packed.run_sm90(causal, pack_gqa=True)
    check(packed, out, lse, causal, what="packed")


@pytest.mark.sanitize
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_three_consumers_sanitize_small(causal):
    """A three-consumer (192-row) varlen config: partial V edge blocks cleared by all 384 consumer
    threads, a sequence longer than one tile, an empty one, GQA 3 packed into 192 rows."""
    config = next(c for c in sm90.tuning_candidates(64, causal, BF16) if c.consumers == 3)
    case = Case((0, 200, 33, 70), (3, 201, 31, 129), 6, 2, 64, BF16, seed_of("san3", causal), pad_q=3, pad_k=9)
    for pack_gqa in (False, True):
        out, lse = case.run_sm90(causal, config=config, pack_gqa=pack_gqa)
        check(case, out, lse, causal, what=f"{config} pack_gqa={pack_gqa}")


@pytest.mark.sanitize
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", sm90.HEAD_DIMS)
def test_paged_sanitize_small(d, causal, block_size):
    case = PagedCase([(70, 70 + 90), (1, 17), (0, 5), (33, 33)], 4, 2, d, BF16, block_size,
                     seed=seed_of("psan", d, causal, block_size), pad_tokens=2)
    ref_out, ref_lse = case.reference(causal=causal)
    poison_past_lengths(case)
    out, lse, _ = run_paged(case, causal)
    check_paged(case, out, lse, ref_out, ref_lse, f"sanitize paged d={d} bs={block_size} causal={causal}")
    check_padding(case, out, lse, "sanitize paged")


@pytest.mark.sanitize
@pytest.mark.parametrize("name", ["all", "alibi_h", "window_two_sided"])
@pytest.mark.parametrize("d", sm90.HEAD_DIMS)
def test_packed_variants_sanitize_small(d, name):
    """The packed variant kernels, varlen (with a packed GQA case) and paged, on small shapes."""
    seed = seed_of("san-variants", d, name)
    case = Case((0, 1, 33, 70), (3, 1, 31, 129), 4, 1, d, BF16, seed, pad_q=3, pad_k=9)
    options, causal, case.q = packed_options(name, case.q, 4, seed)
    out, lse = case.run_sm90(causal, **options)
    check(case, out, lse, causal, what=name, **options)
    packed = Case((1, 2, 0), (65, 3, 1), 8, 1, d, FP16, seed, pad_q=1, pad_k=2)
    options, causal, packed.q = packed_options(name, packed.q, 3, seed)
    out, lse = packed.run_sm90(causal, pack_gqa=True, **options)
    check(packed, out, lse, causal, what=f"{name} packed", **options)
    paged = PagedCase([(70, 70 + 90), (1, 17), (0, 5), (33, 33)], 4, 2, d, BF16, 16, seed=seed, pad_tokens=2)
    options, causal, paged.q = packed_options(name, paged.q, 4, seed)
    ref_out, ref_lse = paged.reference(causal=causal, **options)
    poison_past_lengths(paged)
    out, lse, _ = run_paged(paged, causal, **options)
    check_paged(paged, out, lse, ref_out, ref_lse, f"sanitize paged {name} d={d}")
    check_padding(paged, out, lse, f"sanitize paged {name}")


@pytest.mark.sanitize
@pytest.mark.parametrize("d", sm90.HEAD_DIMS)
def test_varlen_dropout_sanitize_small(d):
    seed = seed_of("san-dropout", d)
    case = Case((0, 1, 33, 70), (3, 1, 31, 129), 4, 1, d, BF16, seed, pad_q=3, pad_k=9)
    options = {"dropout_p": 0.3, "seed": 77, "offset": 8}
    out, lse = case.run_sm90(True, **options)
    check(case, out, lse, True, what="sanitize dropout", **options)
