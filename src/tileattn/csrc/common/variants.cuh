// Attention variants (issue #15): sliding window, logit softcap, ALiBi, dropout. The sm_80 kernels
// implement all four (below); the Hopper forward (attention_fwd_sm90.cu) window, softcap and ALiBi
// as compile-time flags, with the same definitions and fp32 arithmetic.
//
// The sm_80 variant kernels are separate instantiations (template flag kVariants) of the plain kernels'
// bodies, so the plain ones compile to exactly the code they had. Inside such a kernel every
// variant is a run-time, CTA-uniform choice read from the kernel parameters (constant bank: no
// register holds them across the main loop), so one instantiation per (head dim, dtype, dense or
// varlen) serves every combination; causal is the window's right edge 0.
//
// Definitions (query i, key j of a sequence with nq queries and nk keys, diag = nk - nq; logits in
// natural-log units before the softmax, s = scale * q_i . k_j):
//   window:  j is visible iff i + diag - left <= j <= i + diag + right (kUnbounded: no limit).
//   softcap: logit = cap * tanh(s / cap); d logit / d s = 1 - tanh^2.
//   ALiBi:   logit += -slope[b, h] * |i + diag - j|.
//   dropout: P' = P * keep(i, j) / (1 - p); keep from Philox4x32-7 (dropout_bits below), the same
//            function in the forward, both backward kernels and tileattn.dropout_mask.
// The kernels work in log2 units: x = logit * log2(e), p = 2^(x - shift).
#pragma once
#include "sm80.cuh"

namespace tileattn {

// A window edge that never limits: beyond any index difference (the host keeps Nq, Nk <= 2^28, so
// i + Nk - Nq +- kUnbounded stays inside int32). Python: attention_fwd_sm80.UNBOUNDED.
constexpr int kUnbounded = 1 << 29;

// The variants of one launch. The entry points take them as scalar parameters (VARIANT_PARAMS, in
// this order; the alibi pointer, seed, offset and rng_state are the launch plan's dynamic 64-bit slots) and
// pass them on by reference: every field stays a kernel parameter (constant bank) for ptxas.
struct Variants {
  const float* alibi;  // slopes, [H] (alibi_sb = 0) or [B, H] (alibi_sb = H) fp32; nullptr: off
  int64_t alibi_sb;    // batch stride of the slopes, in elements
  uint64_t seed;       // dropout: Philox key
  uint64_t offset;     // dropout: Philox counter offset
  const uint64_t* rng_state;  // dropout: nullptr, or {seed, offset} in device memory (replaces the two)
  int left, right;     // window edges (>= 0, kUnbounded: none)
  float cap_in;        // softcap: scale / cap (multiplies q . k); 0: softcap off
  float cap_out;       // softcap: cap * log2(e)
  float scale_log2;    // scale * log2(e): the logit without softcap
  unsigned drop_thr;   // dropout: drop iff 16-bit uniform < drop_thr (= round(p * 65536)); 0: off
  float drop_scale;    // 1 / (1 - p)
};
//
// rng_state: nullptr, or the dropout seed and offset in device memory ({seed, offset}, 16 bytes), read
// when the kernel runs instead of the seed and offset parameters. A CUDA graph captures parameters by
// value; through this pointer each replay can apply the mask of whatever state the graph (or the
// caller) wrote there before the launch. Kernels without dropout never read it (the load is dead).
#define VARIANT_PARAMS                                                                                       \
  const float *__restrict__ alibi, uint64_t seed, uint64_t offset, int64_t alibi_sb, int win_left, int win_right, \
      float cap_in, float cap_out, unsigned drop_thr, float drop_scale, const uint64_t *__restrict__ rng_state
// The Variants of an entry point with VARIANT_PARAMS and a scale_log2 parameter.
#define VARIANTS_FROM_PARAMS                                                                              \
  Variants {                                                                                              \
    alibi, alibi_sb, seed, offset, rng_state, win_left, win_right, cap_in, cap_out, scale_log2, drop_thr, \
        drop_scale                                                                                        \
  }

// A 32-bit value that every lane of the (converged, full) warp holds, through redux.sync: its result is
// warp-uniform for ptxas, so what is computed from it stays in uniform registers as it does from the
// constant bank (the dropout key schedule).
__device__ __forceinline__ unsigned warp_uniform(unsigned v) { return __reduce_or_sync(0xffffffffu, v); }
// va with the dropout seed and offset read from va.rng_state (never nullptr here), by a full, converged
// warp. Only the three words Philox takes are kept (dropout_bits: key (seed_lo, seed_hi + offset_hi),
// counter word offset_lo): the offset's high word becomes 0 and the seed's absorbs it. The kernels call
// this only in their kRngState instantiations: the ones that take the values as parameters keep their
// code (reading the state costs registers; docs/attention_variants.md, "Dropout's rng state in device
// memory").
__device__ __forceinline__ Variants with_rng_state(const Variants& va) {
  const unsigned long long* state = reinterpret_cast<const unsigned long long*>(va.rng_state);
  const uint64_t seed = __ldg(state), offset = __ldg(state + 1);
  Variants out = va;
  const unsigned key_x = warp_uniform(static_cast<unsigned>(seed));
  const unsigned key_y = warp_uniform(static_cast<unsigned>(seed >> 32) + static_cast<unsigned>(offset >> 32));
  out.seed = (static_cast<uint64_t>(key_y) << 32) | key_x;
  out.offset = warp_uniform(static_cast<unsigned>(offset));
  return out;
}
// The Variants an entry point runs with: as given, or with_rng_state's for a kRngState instantiation.
template <bool kRngState>
__device__ __forceinline__ Variants resolved_variants(const Variants& va) {
  if constexpr (kRngState) return with_rng_state(va);
  else return va;
}

// ---- Philox4x32-7 (Salmon et al., SC'11): a bijection of the 128-bit counter under a 64-bit key.
// Seven rounds, the fewest with which Philox4x32 passes TestU01's BigCrush in the paper (ten is
// its default, with a margin), as in FlashAttention-2's and PyTorch's flash-attention dropout:
// each round is ~4 of a dropout kernel's integer instructions per 8 scores, and the 7-round mask
// measured 11-16 % faster in the Hopper forward (docs/attention_variants.md, "The dropout mask").
__device__ __forceinline__ uint4 philox4x32_7(uint4 c, uint2 k) {
  constexpr unsigned kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#pragma unroll
  for (int r = 0; r < 7; ++r) {
    const unsigned hi0 = __umulhi(kM0, c.x), lo0 = kM0 * c.x;
    const unsigned hi1 = __umulhi(kM1, c.z), lo1 = kM1 * c.z;
    c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
    k.x += kW0;
    k.y += kW1;
  }
  return c;
}

// The 8 16-bit uniforms of (query i, 32-key group G = j >> 5, lane class t = (j >> 1) & 3) of head
// bh = b * H + h. Key j's uniform is 16-bit half (j & 1) of word (j >> 3) & 3. This assignment
// matches the mma accumulator layout: a thread holds keys 8 nb + 2t, 8 nb + 2t + 1 of its rows, so
// one Philox call serves 8 of its scores (forward, deterministic dQ); the transposed backward tile
// uses 4 (or 2) of 8.
__device__ __forceinline__ uint4 dropout_bits(const Variants& va, int bh, int i, int group, int t) {
  const uint4 ctr = make_uint4(static_cast<unsigned>(4 * group + t), static_cast<unsigned>(i),
                               static_cast<unsigned>(bh), static_cast<unsigned>(va.offset));
  const uint2 key = make_uint2(static_cast<unsigned>(va.seed),
                               static_cast<unsigned>(va.seed >> 32) + static_cast<unsigned>(va.offset >> 32));
  return philox4x32_7(ctr, key);
}
// Whether key j is kept, from the group's bits.
__device__ __forceinline__ bool dropout_keep(const Variants& va, const uint4& bits, int j) {
  const int w = (j >> 3) & 3;
  const unsigned word = w == 0 ? bits.x : w == 1 ? bits.y : w == 2 ? bits.z : bits.w;
  return ((j & 1) ? (word >> 16) : (word & 0xffffu)) >= va.drop_thr;
}

// Raw score q . k -> logit in log2 units (softcap or plain scale), and tanh for the backward.
// tanh by the hardware's tanh.approx.f32 (one MUFU.TANH): the softmax's one MUFU.EX2 per score
// already keeps the exp unit half as busy as the tensor cores at d = 128, and the exact form
// 1 - 2 / (1 + e^(2y)) cost a second EX2 plus a reciprocal (a third MUFU, or ~9 FMA-pipe
// instructions), which capped the softcap forward at ~0.6x of the plain kernel
// (docs/attention_variants.md, "Softcap by the hardware tanh"). Its error, measured on the H200 in
// the same doc, bounds the logit's: |logit error| <= cap * tanh's absolute error. Every kernel (the
// forwards, both backwards, the paged kernel) calls this one function, so a backward recomputes
// exactly the forward's logits against its lse. Saturates to +-1 (never NaN) for any finite or
// infinite argument.
__device__ __forceinline__ float hw_tanh(float y) {
  float t;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(t) : "f"(y));
  return t;
}
// tanh(scale q.k / cap); cap_in = scale / cap.
__device__ __forceinline__ float softcap_tanh(const Variants& va, float s) { return hw_tanh(s * va.cap_in); }
__device__ __forceinline__ float variant_logit(const Variants& va, float s) {
  return va.cap_in != 0.f ? va.cap_out * softcap_tanh(va, s) : s * va.scale_log2;
}

// ALiBi slope of (b, h) times -log2(e) (0 when off): the logit gains slope * |i + diag - j|.
__device__ __forceinline__ float alibi_slope_log2(const Variants& va, int b, int h) {
  return va.alibi != nullptr ? -1.4426950408889634f * __ldg(va.alibi + b * va.alibi_sb + h) : 0.f;
}

// Visible key range [lo, hi] of query i (may be empty: lo > hi), clipped to [0, nk - 1].
__device__ __forceinline__ int window_lo(const Variants& va, int i, int diag) {
  return max(0, i + diag - va.left);
}
__device__ __forceinline__ int window_hi(const Variants& va, int i, int diag, int nk) {
  return min(nk - 1, i + diag + va.right);
}

}  // namespace tileattn
