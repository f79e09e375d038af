// reshape_and_cache: K/V [num_tokens, num_kv_heads, head_size] -> the paged cache interiors.
//
// Grid (ceil(num_tokens / 16), num_kv_heads), 128 threads: a CTA writes 16 tokens of one KV
// head. The work unit is a packet: x channels of one token (16 bytes of the cache dtype), a
// token-major thread order (16 tokens of a packet column, then the next column), so one warp
// instruction reads 32-byte halves of input rows and, for consecutive slots, stores 256
// contiguous bytes of the x-packed K page.
//
// Every thread first issues all of its loads (slots, its K and V packets), then stores: the
// writer is a chain of memory latencies otherwise (a store may alias the next load, so the
// compiler keeps them in order). K packets go to the cache from registers. V is transposed
// through shared memory ([16 tokens][head_size], rows padded by 16 bytes against bank
// conflicts) and stored per (group of x tokens, channel): when the group's tokens fill x
// consecutive slots of one block from an x-aligned offset (prefill) the group is one 16-byte
// store in both V layouts, else each token is stored alone (decode, padding). fp8 caches
// store value / scale saturated to the format's largest finite value.
#include "launch_util.h"
#include "ra_compat.cuh"

namespace rocm_attn_native {

namespace {

constexpr int kWriteTile = 16;
constexpr int kWriteThreads = 128;
constexpr int kWritePer = 2;  // packets of K and of V a thread holds at once

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

// X input elements (IN: the model dtype, bf16, fp16 or fp32) from element i on, as floats:
// 16-byte loads when the rows are 16-byte aligned.
template <int X, int IN>
RA_DEVICE void load_packet(const void* RA_RESTRICT src, int64_t i, int vector, float (&v)[X]) {
  if constexpr (IN == static_cast<int>(DType::kFloat32)) {
    const float* s = static_cast<const float*>(src) + i;
    if (vector) {
#pragma unroll
      for (int k = 0; k < X / 4; ++k) {
        const ra_u128 w = reinterpret_cast<const ra_u128*>(s)[k];
        v[4 * k] = ra_bits_float(w.x);
        v[4 * k + 1] = ra_bits_float(w.y);
        v[4 * k + 2] = ra_bits_float(w.z);
        v[4 * k + 3] = ra_bits_float(w.w);
      }
    } else {
#pragma unroll
      for (int j = 0; j < X; ++j) v[j] = s[j];
    }
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src) + i;
    uint16_t b[X];
    if (vector) {
#pragma unroll
      for (int k = 0; k < X / 8; ++k) {
        const ra_u128 w = reinterpret_cast<const ra_u128*>(s)[k];
        const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) b[8 * k + j] = static_cast<uint16_t>(ws[j / 2] >> (16 * (j % 2)));
      }
    } else {
#pragma unroll
      for (int j = 0; j < X; ++j) b[j] = s[j];
    }
#pragma unroll
    for (int j = 0; j < X; ++j)
      v[j] = IN == static_cast<int>(DType::kBFloat16) ? ra_bf16_to_float(b[j]) : ra_fp16_to_float(b[j]);
  }
}

// slot -> (block, offset in block): a shift and a mask for power-of-two block sizes (64-bit
// division is a long instruction sequence, paid per packet otherwise).
struct SlotSplit {
  int bs, shift;
  bool pow2;
  RA_DEVICE explicit SlotSplit(int block_size) : bs(block_size), shift(0), pow2((block_size & (block_size - 1)) == 0) {
    while ((1 << shift) < block_size) ++shift;
  }
  RA_DEVICE int64_t block(int64_t slot) const { return pow2 ? slot >> shift : slot / bs; }
  RA_DEVICE int64_t offset(int64_t slot) const { return pow2 ? slot & (bs - 1) : slot % bs; }
};

// X floats as one 16-byte packet of the cache dtype.
template <int CK>
RA_DEVICE ra_u128 quantize_packet(const float* v, float scale) {
  constexpr int ESZ = CacheKind<CK>::kBytes;
  constexpr int X = 16 / ESZ;
  uint32_t packed[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int j = 0; j < X; ++j) packed[(j * ESZ) / 4] |= ra_quantize<CK>(v[j], scale) << (8 * ((j * ESZ) % 4));
  ra_u128 out;
  out.x = packed[0];
  out.y = packed[1];
  out.z = packed[2];
  out.w = packed[3];
  return out;
}

template <int ESZ>
RA_DEVICE uint32_t load_elem(const unsigned char* p) {
  return ESZ == 2 ? static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(p)) : static_cast<uint32_t>(*p);
}

template <int CK, int IN>
RA_GLOBAL void RA_LAUNCH_BOUNDS(kWriteThreads) reshape_and_cache_kernel(CacheWriteParams p) {
  using K = CacheKind<CK>;
  constexpr int ESZ = K::kBytes;
  constexpr int X = 16 / ESZ;
  RA_DYNAMIC_SMEM(smem);
  int64_t* tile_slots = reinterpret_cast<int64_t*>(smem);
  unsigned char* vt = smem + kWriteTile * 8;  // V tile [16][row_bytes], cache dtype
  const int tid = static_cast<int>(ra_tid());
  const int t0 = static_cast<int>(ra_bid_x()) * kWriteTile;
  const int head = static_cast<int>(ra_bid_y());
  const int D = p.head_size, bs = p.block_size;
  const int ncp = D / X;  // packets per token
  const int row_bytes = D * ESZ + 16;
  const SlotSplit split(bs);
  const int64_t head_off = static_cast<int64_t>(head) * D * bs;
  unsigned char* RA_RESTRICT kc = static_cast<unsigned char*>(p.k_cache);
  unsigned char* RA_RESTRICT vc = static_cast<unsigned char*>(p.v_cache);

  if (tid < kWriteTile)
    tile_slots[tid] = t0 + tid < p.num_tokens ? ra_load_index(p.slot_mapping, t0 + tid, p.slot_mapping_is64) : -1;
  const float k_scale = K::kFp8 ? p.k_scale[0] : 1.0f;
  const float v_scale = K::kFp8 ? p.v_scale[0] : 1.0f;

  // Packets in rounds of kWritePer per thread (one round up to head_size 128 at 16 bits).
  const int units = kWriteTile * ncp;
  for (int base = 0; base < units; base += kWriteThreads * kWritePer) {
    int64_t slot[kWritePer];
    float kv[kWritePer][X], vv[kWritePer][X];
#pragma unroll
    for (int r = 0; r < kWritePer; ++r) {
      const int u = base + tid + r * kWriteThreads;
      const int t = u % kWriteTile, c = u / kWriteTile;
      const bool live = u < units && t0 + t < p.num_tokens;
      slot[r] = live ? ra_load_index(p.slot_mapping, t0 + t, p.slot_mapping_is64) : -1;
      if (live) {
        const int64_t tok = t0 + t;
        load_packet<X, IN>(p.key, tok * p.key_stride_t + static_cast<int64_t>(head) * p.key_stride_h + c * X,
                           p.vector_loads, kv[r]);
        load_packet<X, IN>(p.value, tok * p.value_stride_t + static_cast<int64_t>(head) * p.value_stride_h + c * X,
                           p.vector_loads, vv[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < kWritePer; ++r) {
      const int u = base + tid + r * kWriteThreads;
      if (u >= units) continue;
      const int t = u % kWriteTile, c = u / kWriteTile;
      if (t0 + t < p.num_tokens)  // V to the shared tile (a padding slot's row is never read)
        *reinterpret_cast<ra_u128*>(vt + t * row_bytes + c * 16) = quantize_packet<CK>(vv[r], v_scale);
      if (slot[r] < 0) continue;
      const int64_t blk = split.block(slot[r]), off = split.offset(slot[r]);
      *reinterpret_cast<ra_u128*>(kc + ((blk * p.cache_block_stride + head_off) + (static_cast<int64_t>(c) * bs + off) * X) * ESZ) =
          quantize_packet<CK>(kv[r], k_scale);
    }
  }
  ra_syncthreads();

  // V: (token group g, channel d); in the standard layout the group runs fastest (a channel's
  // two 16-byte groups are adjacent there), in the interleaved one the channel does.
  constexpr int groups = kWriteTile / X;
  for (int item = tid; item < groups * D; item += kWriteThreads) {
    const int g = p.interleaved_v ? item / D : item % groups;
    const int d = p.interleaved_v ? item % D : item / groups;
    const int64_t s0 = tile_slots[g * X];
    bool fast = s0 >= 0 && s0 % X == 0;
#pragma unroll
    for (int j = 1; j < X; ++j) fast = fast && tile_slots[g * X + j] == s0 + j;
    if (fast) {
      uint32_t packed[4] = {0u, 0u, 0u, 0u};
#pragma unroll
      for (int j = 0; j < X; ++j) packed[(j * ESZ) / 4] |= load_elem<ESZ>(vt + (g * X + j) * row_bytes + d * ESZ) << (8 * ((j * ESZ) % 4));
      const int64_t blk = split.block(s0), off = split.offset(s0);
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
        const int64_t slot = tile_slots[g * X + j];
        if (slot < 0) continue;
        const int64_t blk = split.block(slot), off = split.offset(slot);
        const int64_t e = p.interleaved_v ? (off / X * D + d) * X + off % X : static_cast<int64_t>(d) * bs + off;
        unsigned char* dst = vc + (blk * p.cache_block_stride + head_off + e) * ESZ;
        const uint32_t q = load_elem<ESZ>(vt + (g * X + j) * row_bytes + d * ESZ);
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
  // the slots and the V tile; within the 48 KB every GPU grants without an opt-in
  const size_t smem = static_cast<size_t>(kWriteTile) * (8 + p.head_size * CacheKind<CK>::kBytes + 16);
  if (smem > 48 * 1024)
    return fail("reshape_and_cache: head_size %d is not supported: its V tile needs %zu bytes of shared memory, "
                "more than 48 KB", p.head_size, smem);
  const ra_grid grid = {static_cast<unsigned>((p.num_tokens + kWriteTile - 1) / kWriteTile),
                        static_cast<unsigned>(p.num_kv_heads), 1u};
  if (p.input_dtype == static_cast<int>(DType::kBFloat16))
    ra_launch(&reshape_and_cache_kernel<CK, static_cast<int>(DType::kBFloat16)>, grid,
              static_cast<unsigned>(kWriteThreads), smem, stream, p);
  else if (p.input_dtype == static_cast<int>(DType::kFloat16))
    ra_launch(&reshape_and_cache_kernel<CK, static_cast<int>(DType::kFloat16)>, grid,
              static_cast<unsigned>(kWriteThreads), smem, stream, p);
  else
    ra_launch(&reshape_and_cache_kernel<CK, static_cast<int>(DType::kFloat32)>, grid,
              static_cast<unsigned>(kWriteThreads), smem, stream, p);
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
