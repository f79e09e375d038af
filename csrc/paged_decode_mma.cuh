// Tensor-core paged decode (NVIDIA sm_80+): the same CTA, ring and merge as the CUDA-core
// kernel (paged_decode.cuh), with both products on mma.sync m16n8k16.
//
// Per 16-key tile a warp computes S = Q K^T as two 16x8 tiles (rows: the CTA's <= 8 query
// heads, padded to 16; columns: keys) over head_size / 16 k-steps, K fed by ldmatrix from
// the swizzled ring slot; the S accumulator layout is the A-operand layout of P, so
// O += P V follows without a shuffle, V fed by ldmatrix as well (its tile rows are channels:
// 8 keys of one channel per 16 bytes, the B layout). Lane (g = lane / 4, t = lane % 4) owns
// head g: keys 2t, 2t+1, 8+2t, 9+2t of each tile and output channels 8j + 2t, 8j + 2t + 1,
// so the softmax needs two shuffles per reduction and no shared memory.
// Operands are bf16 for bf16 caches, fp16 otherwise (fp16, and fp8 caches whose values
// convert to fp16 exactly); the query is rounded to that type once, P each tile (as every
// tensor-core attention kernel does); accumulation is fp32.
#pragma once

#include "paged_decode.cuh"

#if defined(RA_HAS_TENSOR_CORE_KERNEL)

namespace rocm_attn_native {

// Two fp8 values (16 bits of shared memory) as an fp16 pair (exact; value * 2^-k, the
// decode factor folded into the scales).
template <int CK>
RA_DEVICE uint32_t fp8_pair_as_f16x2(const unsigned char* p) {
  const uint32_t b = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8);
  return static_cast<uint32_t>(CacheKind<CK>::to_half_bits(b & 0xffu)) |
         (static_cast<uint32_t>(CacheKind<CK>::to_half_bits(b >> 8)) << 16);
}

template <int CK, int D, int GT>
RA_GLOBAL void RA_LAUNCH_BOUNDS(256) paged_decode_mma_kernel(DecodeParams p, DecodeRuntime rt, int stages) {
  using K = CacheKind<CK>;
  static_assert(GT <= 8, "a tile holds at most 8 query heads");
  constexpr bool BF16 = CK == static_cast<int>(DType::kBFloat16);
  constexpr int ESZ = K::kBytes;
  constexpr int X = 16 / ESZ;
  constexpr int PPC = kTile / X;
  constexpr int KS = D / 16;  // k-steps of S
  constexpr int NT = D / 8;   // 8-channel column tiles of O
  static_assert(NT % 2 == 0, "V is read two column tiles at a time");

  RA_DYNAMIC_SMEM(smem);
  DecodeCta c;
  c.init<GT>(p, rt);
  if (!c.active) return;  // uniform over the CTA
  const int lane = c.lane;
  const int g = lane >> 2, t4 = lane & 3;
  const DecodeSmem lay(D, ESZ, GT, c.num_warps, stages);
  unsigned char* ring = smem + c.warp * lay.warp_bytes;

  // Q as A fragments: row g, channels ks*16 + 2t (+1) and + 8; rows g + 8 are zero.
  const bool real = g < c.nh;
  uint32_t qa[KS][2];
  {
    // Value i: k-step i / 4, half (i / 2) % 2, element i % 2. Rows past nh read row 0 and
    // are zeroed after.
    const int64_t base = c.q_row * p.q_stride_t + static_cast<int64_t>(c.head_base + (real ? g : 0)) * p.q_stride_h +
                         2 * t4;
    float qv[KS * 4];
    ra_load_model_all(p.query, p.model_dtype, qv,
                      [&](int i) { return base + (i / 4) * 16 + ((i / 2) % 2) * 8 + i % 2; });
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        qa[ks][h] = real ? ra_pack2<BF16>(qv[ks * 4 + h * 2], qv[ks * 4 + h * 2 + 1]) : 0u;
  }
  const bool softcap = p.logits_soft_cap > 0.0f;
  const float k_mul = K::kFp8 ? p.k_scale[0] * rt.k_factor : 1.0f;
  const float s_mul = p.scale * k_mul * (softcap ? 1.0f / p.logits_soft_cap : RA_LOG2E);
  const float cap_log2 = softcap ? p.logits_soft_cap * RA_LOG2E : 0.0f;
  const float slope = (p.alibi_slopes != nullptr && real) ? p.alibi_slopes[c.head_base + g] * RA_LOG2E : 0.0f;
  float m_run = RA_NEG_INF, l_run = 0.0f;
  float o[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;

  tile_loop<CK, D, true>(p, c, ring, lay.tile_bytes, stages, [&](const unsigned char* ks_ptr, int ts) {
    unsigned char* vs = const_cast<unsigned char*>(ks_ptr) + lay.tile_bytes;
    if (ts < c.lo || ts + kTile > c.hi) {  // keys outside [lo, hi) may hold anything (NaN): zero their V
      for (int i = lane; i < D * kTile; i += RA_WARP_SIZE) {
        const int d = i / kTile, tok = i % kTile;
        if (ts + tok >= c.lo && ts + tok < c.hi) continue;
        if (ESZ == 2) *reinterpret_cast<uint16_t*>(vs + v_slot<PPC, true>(d, tok / 8) * 16 + (tok % 8) * 2) = 0;
        else vs[d * 16 + tok] = 0;
      }
      ra_syncwarp();
    }

    // S = Q K^T: s[nt] holds keys nt*8 + 2t, + 1 of head g in [0], [1].
    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      uint32_t b[4];
      if constexpr (ESZ == 2) {  // matrices: keys 0-7 / 8-15 x packets 2ks, 2ks+1
        const int m = lane >> 3, r = lane & 7;
        ra_ldmatrix_x4(b, ks_ptr + k_slot_col((m >> 1) * 8 + r, 2 * ks + (m & 1)) * 16);  // b0 b1 of keys 0-7, 8-15
      } else {  // fp8: packet ks holds channels ks*16 .. + 15 of a key
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const unsigned char* row = ks_ptr + k_slot_col(nt * 8 + g, ks) * 16;
          b[2 * nt] = fp8_pair_as_f16x2<CK>(row + 2 * t4);
          b[2 * nt + 1] = fp8_pair_as_f16x2<CK>(row + 8 + 2 * t4);
        }
      }
      const uint32_t a[4] = {qa[ks][0], 0u, qa[ks][1], 0u};
      ra_mma_16816<BF16>(s[0], a, b[0], b[1]);
      ra_mma_16816<BF16>(s[1], a, b[2], b[3]);
    }

    // Online softmax of head g over the tile's 16 keys (4 per lane, 4 lanes a head).
    float sc[4];
    float mx = RA_NEG_INF;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int k_pos = ts + (e >> 1) * 8 + 2 * t4 + (e & 1);
      float x = s[e >> 1][e & 1] * s_mul;
      if (softcap) x = cap_log2 * ra_tanh(x);
      x += slope * static_cast<float>(k_pos - c.q_pos);
      if (k_pos < c.lo || k_pos >= c.hi) x = RA_NEG_INF;
      sc[e] = x;
      mx = mx > x ? mx : x;
    }
#pragma unroll
    for (int m = 1; m <= 2; m *= 2) {
      const float other = ra_shfl_xor(mx, m);
      mx = mx > other ? mx : other;
    }
    const float m_new = m_run > mx ? m_run : mx;
    const float m_safe = m_new == RA_NEG_INF ? 0.0f : m_new;
    const float alpha = ra_exp2(m_run - m_safe);
    float pr[4], ps = 0.0f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      pr[e] = ra_exp2(sc[e] - m_safe);
      ps += pr[e];
    }
    ps += ra_shfl_xor(ps, 1);
    ps += ra_shfl_xor(ps, 2);
    l_run = l_run * alpha + ps;
    m_run = m_new;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      o[j][0] *= alpha;
      o[j][1] *= alpha;
    }

    // O += P V: P as A (row g: keys 2t.. and 8+2t..), V as B (keys x channels).
    const uint32_t pa[4] = {ra_pack2<BF16>(pr[0], pr[1]), 0u, ra_pack2<BF16>(pr[2], pr[3]), 0u};
#pragma unroll
    for (int j = 0; j < NT; j += 2) {
      uint32_t b[4];
      if constexpr (ESZ == 2) {  // matrices: channels 8j.. / 8(j+1).. x keys 0-7, 8-15
        const int m = lane >> 3, r = lane & 7;
        ra_ldmatrix_x4(b, vs + v_slot<PPC, true>(8 * (j + (m >> 1)) + r, m & 1) * 16);
      } else {  // fp8: one packet of 16 keys per channel
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const unsigned char* row = vs + (8 * (j + u) + g) * 16;
          b[2 * u] = fp8_pair_as_f16x2<CK>(row + 2 * t4);
          b[2 * u + 1] = fp8_pair_as_f16x2<CK>(row + 8 + 2 * t4);
        }
      }
      ra_mma_16816<BF16>(o[j], pa, b[0], b[1]);
      ra_mma_16816<BF16>(o[j + 1], pa, b[2], b[3]);
    }
  });

  ra_syncthreads();  // every warp is done with its ring: the merge area overlaps them
  float* m_acc = reinterpret_cast<float*>(smem);  // [num_warps][GT][D]
  float* m_max = m_acc + c.num_warps * GT * D;    // [num_warps][GT]
  float* m_sum = m_max + c.num_warps * GT;        // [num_warps][GT]
  if (g < GT) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      m_acc[(c.warp * GT + g) * D + 8 * j + 2 * t4] = o[j][0];
      m_acc[(c.warp * GT + g) * D + 8 * j + 2 * t4 + 1] = o[j][1];
    }
    if (t4 == 0) {
      m_max[c.warp * GT + g] = m_run;
      m_sum[c.warp * GT + g] = l_run;
    }
  }
  ra_syncthreads();
  merge_and_store<D, GT>(p, c, m_acc, m_max, m_sum, K::kFp8 ? p.v_scale[0] * rt.v_factor : 1.0f);
}

}  // namespace rocm_attn_native

#endif  // RA_HAS_TENSOR_CORE_KERNEL
