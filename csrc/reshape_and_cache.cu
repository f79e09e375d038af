// reshape_and_cache: K/V [num_tokens, num_kv_heads, head_size] -> the paged cache interiors.
//
// Grid (ceil(num_tokens / 16), num_kv_heads), 128 threads: a CTA writes 16 tokens of one KV
// head. K: one thread per 16-byte packet (x channels of a token: its place in the
// [head_size/x, block_size, x] page). V: one thread per (channel, group of x tokens); when the
// group's tokens fill x consecutive slots of one block from an x-aligned offset (prefill), the
// group is one 16-byte store in both V layouts, else each token is stored alone (decode,
// padding). fp8 caches store value / scale saturated to the format's largest finite value.
#include "launch_util.h"
#include "ra_compat.cuh"

namespace rocm_attn_native {

namespace {

constexpr int kWriteTile = 16;
constexpr int kWriteThreads = 128;

template <int CK>
RA_DEVICE float ra_fp8_max() {
  if (CK == static_cast<int>(DType::kFp8E4M3FN)) return 448.0f;
  if (CK == static_cast<int>(DType::kFp8E4M3FNUZ)) return 240.0f;
  return 57344.0f;  // e5m2, e5m2fnuz
}

template <int CK>
RA_DEVICE uint32_t ra_quantize(float v, float scale) {
  using K = CacheKind<CK>;
  if constexpr (K::kFp8) {
    const float m = ra_fp8_max<CK>();
    v = v / scale;
    v = v > m ? m : (v < -m ? -m : v);  // NaN stays NaN
  }
  return K::from_float(v);
}

template <int CK>
RA_GLOBAL void RA_LAUNCH_BOUNDS(kWriteThreads) reshape_and_cache_kernel(CacheWriteParams p) {
  using K = CacheKind<CK>;
  constexpr int ESZ = K::kBytes;
  constexpr int X = 16 / ESZ;
  RA_DYNAMIC_SMEM(smem);
  int64_t* slots = reinterpret_cast<int64_t*>(smem);
  const int tid = static_cast<int>(ra_tid());
  const int nthreads = static_cast<int>(ra_ntid());
  const int t0 = static_cast<int>(ra_bid_x()) * kWriteTile;
  const int head = static_cast<int>(ra_bid_y());
  if (tid < kWriteTile)
    slots[tid] = t0 + tid < p.num_tokens ? ra_load_index(p.slot_mapping, t0 + tid, p.slot_mapping_is64) : -1;
  ra_syncthreads();

  const int D = p.head_size, bs = p.block_size;
  const int64_t head_off = static_cast<int64_t>(head) * D * bs;
  unsigned char* kc = static_cast<unsigned char*>(p.k_cache);
  unsigned char* vc = static_cast<unsigned char*>(p.v_cache);
  const float k_scale = K::kFp8 ? p.k_scale[0] : 1.0f;
  const float v_scale = K::kFp8 ? p.v_scale[0] : 1.0f;
  const int in_bytes = p.input_dtype == static_cast<int>(DType::kFloat32) ? 4 : 2;

  // K: packet (token t, channel group c).
  const int ncp = D / X;
  for (int item = tid; item < kWriteTile * ncp; item += nthreads) {
    const int t = item / ncp, c = item % ncp;
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    const int64_t src = static_cast<int64_t>(t0 + t) * p.key_stride_t + static_cast<int64_t>(head) * p.key_stride_h + c * X;
    float v[X];
    if (p.vector_loads) {  // 16-byte loads of the input row
      const ra_u128* s = reinterpret_cast<const ra_u128*>(static_cast<const unsigned char*>(p.key) + src * in_bytes);
      constexpr int per = 16 / 2;  // elements of a 16-bit input per load
      if (in_bytes == 2) {
#pragma unroll
        for (int i = 0; i < X / per; ++i) {
          ra_u128 w = s[i];
          uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const uint16_t b = static_cast<uint16_t>(ws[j / 2] >> (16 * (j % 2)));
            v[i * 8 + j] = p.input_dtype == static_cast<int>(DType::kBFloat16) ? ra_bf16_to_float(b) : ra_fp16_to_float(b);
          }
        }
      } else {
#pragma unroll
        for (int i = 0; i < X / 4; ++i) {
          ra_u128 w = s[i];
          v[i * 4 + 0] = ra_bits_float(w.x);
          v[i * 4 + 1] = ra_bits_float(w.y);
          v[i * 4 + 2] = ra_bits_float(w.z);
          v[i * 4 + 3] = ra_bits_float(w.w);
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < X; ++j) v[j] = ra_load_model(p.key, src + j, p.input_dtype);
    }
    uint32_t packed[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int j = 0; j < X; ++j) packed[(j * ESZ) / 4] |= ra_quantize<CK>(v[j], k_scale) << (8 * ((j * ESZ) % 4));
    const int64_t blk = slot / bs, off = slot % bs;
    ra_u128 out;
    out.x = packed[0];
    out.y = packed[1];
    out.z = packed[2];
    out.w = packed[3];
    *reinterpret_cast<ra_u128*>(kc + ((blk * p.cache_block_stride + head_off) + (static_cast<int64_t>(c) * bs + off) * X) * ESZ) = out;
  }

  // V: (token group g, channel d).
  constexpr int groups = kWriteTile / X;
  for (int item = tid; item < groups * D; item += nthreads) {
    const int g = item / D, d = item % D;
    const int64_t s0 = slots[g * X];
    bool fast = s0 >= 0 && s0 % X == 0;
#pragma unroll
    for (int j = 1; j < X; ++j) fast = fast && slots[g * X + j] == s0 + j;
    float v[X];
#pragma unroll
    for (int j = 0; j < X; ++j) {
      const int t = t0 + g * X + j;
      v[j] = slots[g * X + j] >= 0
                 ? ra_load_model(p.value, static_cast<int64_t>(t) * p.value_stride_t + static_cast<int64_t>(head) * p.value_stride_h + d, p.input_dtype)
                 : 0.0f;
    }
    if (fast) {
      uint32_t packed[4] = {0u, 0u, 0u, 0u};
#pragma unroll
      for (int j = 0; j < X; ++j) packed[(j * ESZ) / 4] |= ra_quantize<CK>(v[j], v_scale) << (8 * ((j * ESZ) % 4));
      const int64_t blk = s0 / bs, off = s0 % bs;
      const int64_t e = p.interleaved_v ? (off / X * D + d) * X : static_cast<int64_t>(d) * bs + off;
      ra_u128 out;
      out.x = packed[0];
      out.y = packed[1];
      out.z = packed[2];
      out.w = packed[3];
      *reinterpret_cast<ra_u128*>(vc + (blk * p.cache_block_stride + head_off + e) * ESZ) = out;
    } else {
#pragma unroll
      for (int j = 0; j < X; ++j) {
        const int64_t slot = slots[g * X + j];
        if (slot < 0) continue;
        const int64_t blk = slot / bs, off = slot % bs;
        const int64_t e = p.interleaved_v ? (off / X * D + d) * X + off % X : static_cast<int64_t>(d) * bs + off;
        unsigned char* dst = vc + (blk * p.cache_block_stride + head_off + e) * ESZ;
        const uint32_t q = ra_quantize<CK>(v[j], v_scale);
        if (ESZ == 2) *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(q);
        else *dst = static_cast<unsigned char>(q);
      }
    }
  }
}

template <int CK>
int launch_write(const CacheWriteParams& p, void* stream) {
  constexpr int X = 16 / CacheKind<CK>::kBytes;
  if (p.head_size % X != 0)
    return fail("reshape_and_cache: head_size %d is not a multiple of %d (16 bytes of the cache dtype)", p.head_size, X);
  const ra_grid grid = {static_cast<unsigned>((p.num_tokens + kWriteTile - 1) / kWriteTile),
                        static_cast<unsigned>(p.num_kv_heads), 1u};
  ra_launch(&reshape_and_cache_kernel<CK>, grid, static_cast<unsigned>(kWriteThreads),
            static_cast<size_t>(kWriteTile * 8), stream, p);
  if (const char* e = ra_launch_error()) return fail("reshape_and_cache: launch failed: %s", e);
  return 0;
}

}  // namespace

int reshape_and_cache(const CacheWriteParams& p, void* stream) {
  if (p.num_tokens == 0) return 0;
  if (p.block_size <= 0 || p.block_size % kWriteTile != 0)
    return fail("reshape_and_cache: block_size %d is not supported; it must be a multiple of %d", p.block_size,
                kWriteTile);
  if (p.input_dtype != static_cast<int>(DType::kBFloat16) && p.input_dtype != static_cast<int>(DType::kFloat16) &&
      p.input_dtype != static_cast<int>(DType::kFloat32))
    return fail("reshape_and_cache: key/value dtype %d is not supported; supported: float16, bfloat16, float32",
                p.input_dtype);
  switch (static_cast<DType>(p.cache_dtype)) {
#define RA_WRITE_CASE(E) \
  case DType::E:         \
    return launch_write<static_cast<int>(DType::E)>(p, stream);
    RA_WRITE_CASE(kBFloat16)
    RA_WRITE_CASE(kFloat16)
    RA_WRITE_CASE(kFp8E4M3FN)
    RA_WRITE_CASE(kFp8E4M3FNUZ)
    RA_WRITE_CASE(kFp8E5M2)
    RA_WRITE_CASE(kFp8E5M2FNUZ)
#undef RA_WRITE_CASE
    default: return fail("reshape_and_cache: cache dtype %d is not supported", p.cache_dtype);
  }
}

}  // namespace rocm_attn_native
