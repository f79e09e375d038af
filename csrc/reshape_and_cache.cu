// reshape_and_cache: K/V [num_tokens, num_kv_heads, head_size] -> the paged cache interiors.
//
// The work unit is a packet: x channels of one (token, head), 16 bytes of the cache dtype.
// fp8 caches store value / scale saturated to the format's largest finite value. Two kernels
// (WriterVariant in native_api.h; kAuto picks by token count, writer_variant_for):
//
// scatter: grid ceil(num_tokens * num_kv_heads * packets / 128), one packet a thread (head,
// then packet fastest: a warp reads whole input rows). Slot, K and V packets are loaded
// together, then K is one 16-byte store and V x element stores to their scattered addresses.
// No shared memory, no barrier: a decode batch's write is one load round trip, then stores.
//
// tiled<TILE>: grid (ceil(num_tokens / TILE), num_kv_heads), 128 threads: a CTA writes TILE
// tokens of one KV head. Packets in a token-major thread order (runs of min(TILE, 16) tokens
// of a packet column), so one warp instruction reads 32 bytes (TILE 8: 64) of each input row
// and, for consecutive slots, stores 256-byte (128) contiguous runs of the x-packed K page. Every thread first
// issues all of its loads (TILE / 8 packets of K and of V: one round at head_size 128, 16-bit),
// then stores: a store may alias the next load, so the compiler keeps them in order. K goes
// to the cache from registers. V is transposed through shared memory ([TILE tokens]
// [head_size], rows padded by 16 bytes against bank conflicts) and stored per (group of
// min(TILE, x) tokens, channel): when the group fills consecutive slots from a group-aligned
// offset (prefill) it is one 16-byte (8-byte: fp8, TILE 8) store in both V layouts, else each
// token is stored alone (decode, padding); warp 0 decides that once per group (shuffles)
// before the barrier.
#include "launch_util.h"
#include "ra_compat.cuh"

namespace rocm_attn_native {

namespace {

constexpr int kWriteThreads = 128;  // both kernels
constexpr int kMinTile = 16;        // block sizes are multiples of this (x-aligned V groups fit a block)

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

// X input elements (IN: bf16, fp16 or fp32) as raw 32-bit words: loaded first, converted
// when stored (a thread's loads issue together, and raw words take fewer registers than
// floats); 16-byte loads when the rows are 16-byte aligned.
template <int X, int IN>
struct InPacket {
  static constexpr int kBytes = IN == static_cast<int>(DType::kFloat32) ? 4 : 2;
  static constexpr int kWords = X * kBytes / 4;
  uint32_t w[kWords];
};

template <int X, int IN>
RA_DEVICE void load_in(const void* RA_RESTRICT src, int64_t i, int vector, InPacket<X, IN>& pk) {
  constexpr int B = InPacket<X, IN>::kBytes, W = InPacket<X, IN>::kWords;
  const unsigned char* s = static_cast<const unsigned char*>(src) + i * B;
  if (vector) {
#pragma unroll
    for (int k = 0; k < W / 4; ++k) {
      const ra_u128 q = reinterpret_cast<const ra_u128*>(s)[k];
      pk.w[4 * k] = q.x;
      pk.w[4 * k + 1] = q.y;
      pk.w[4 * k + 2] = q.z;
      pk.w[4 * k + 3] = q.w;
    }
  } else if constexpr (B == 4) {
#pragma unroll
    for (int k = 0; k < W; ++k) pk.w[k] = reinterpret_cast<const uint32_t*>(s)[k];
  } else {  // 2-byte aligned rows
    const uint16_t* h = reinterpret_cast<const uint16_t*>(s);
#pragma unroll
    for (int k = 0; k < W; ++k) pk.w[k] = static_cast<uint32_t>(h[2 * k]) | (static_cast<uint32_t>(h[2 * k + 1]) << 16);
  }
}

template <int X, int IN>
RA_DEVICE float in_value(const InPacket<X, IN>& pk, int j) {
  if constexpr (IN == static_cast<int>(DType::kFloat32)) {
    return ra_bits_float(pk.w[j]);
  } else {
    const uint16_t b = static_cast<uint16_t>(pk.w[j / 2] >> (16 * (j % 2)));
    return IN == static_cast<int>(DType::kBFloat16) ? ra_bf16_to_float(b) : ra_fp16_to_float(b);
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

// A packet in the cache dtype: the input's bits when it is the cache's own 16-bit type (as
// torch's same-dtype copy: NaN payloads kept), else converted (fp8: value / scale, saturated).
template <int CK, int IN>
RA_DEVICE ra_u128 to_cache_packet(const InPacket<16 / CacheKind<CK>::kBytes, IN>& pk, float scale) {
  constexpr int ESZ = CacheKind<CK>::kBytes;
  constexpr int X = 16 / ESZ;
  uint32_t packed[4] = {0u, 0u, 0u, 0u};
  if constexpr (CK == IN) {
#pragma unroll
    for (int k = 0; k < 4; ++k) packed[k] = pk.w[k];
  } else {
#pragma unroll
    for (int j = 0; j < X; ++j)
      packed[(j * ESZ) / 4] |= ra_quantize<CK>(in_value(pk, j), scale) << (8 * ((j * ESZ) % 4));
  }
  ra_u128 out;
  out.x = packed[0];
  out.y = packed[1];
  out.z = packed[2];
  out.w = packed[3];
  return out;
}

// Element j of a cache-dtype packet.
template <int ESZ>
RA_DEVICE uint32_t packet_elem(const ra_u128& q, int j) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  const uint32_t word = w[(j * ESZ) / 4];
  return ESZ == 2 ? (word >> (16 * (j % 2))) & 0xffffu : (word >> (8 * (j % 4))) & 0xffu;
}

template <int ESZ>
RA_DEVICE uint32_t load_elem(const unsigned char* p) {
  return ESZ == 2 ? static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(p)) : static_cast<uint32_t>(*p);
}


// Packets of one (token, head): the key/value row offsets.
RA_DEVICE int64_t row_offset(int64_t tok, int head, int64_t stride_t, int64_t stride_h) {
  return tok * stride_t + static_cast<int64_t>(head) * stride_h;
}

// unit -> (token, head, packet); 32-bit division where the unit count fits (the common case:
// 64-bit division is a long instruction sequence ahead of the loads).
template <typename I>
RA_DEVICE void split_unit(I u, int ncp, int heads, int64_t& tok, int& head, int& c) {
  const I pair = u / static_cast<I>(ncp);
  c = static_cast<int>(u - pair * static_cast<I>(ncp));
  const I t = pair / static_cast<I>(heads);
  head = static_cast<int>(pair - t * static_cast<I>(heads));
  tok = static_cast<int64_t>(t);
}

template <int CK, int IN>
RA_GLOBAL void RA_LAUNCH_BOUNDS(kWriteThreads) reshape_and_cache_scatter_kernel(CacheWriteParams p) {
  using K = CacheKind<CK>;
  constexpr int ESZ = K::kBytes;
  constexpr int X = 16 / ESZ;
  const int D = p.head_size, bs = p.block_size;
  const int ncp = D / X;
  const uint64_t units = static_cast<uint64_t>(p.num_tokens) * p.num_kv_heads * ncp;
  const uint64_t u = static_cast<uint64_t>(ra_bid_x()) * kWriteThreads + ra_tid();
  if (u >= units) return;
  int64_t tok;
  int head, c;
  if (units <= 0xffffffffull) split_unit<uint32_t>(static_cast<uint32_t>(u), ncp, p.num_kv_heads, tok, head, c);
  else split_unit<uint64_t>(u, ncp, p.num_kv_heads, tok, head, c);

  const int64_t slot = ra_load_index(p.slot_mapping, tok, p.slot_mapping_is64);
  InPacket<X, IN> kin, vin;
  load_in(p.key, row_offset(tok, head, p.key_stride_t, p.key_stride_h) + c * X, p.vector_loads, kin);
  load_in(p.value, row_offset(tok, head, p.value_stride_t, p.value_stride_h) + c * X, p.vector_loads, vin);
  const float k_scale = K::kFp8 ? p.k_scale[0] : 1.0f;
  const float v_scale = K::kFp8 ? p.v_scale[0] : 1.0f;
  if (slot < 0) return;
  const SlotSplit split(bs);
  const int64_t blk = split.block(slot), off = split.offset(slot);
  const int64_t page = blk * p.cache_block_stride + static_cast<int64_t>(head) * D * bs;
  unsigned char* RA_RESTRICT kc = static_cast<unsigned char*>(p.k_cache);
  unsigned char* RA_RESTRICT vc = static_cast<unsigned char*>(p.v_cache);
  *reinterpret_cast<ra_u128*>(kc + (page + (static_cast<int64_t>(c) * bs + off) * X) * ESZ) =
      to_cache_packet<CK, IN>(kin, k_scale);
  const ra_u128 vq = to_cache_packet<CK, IN>(vin, v_scale);
  // V: channel d of this token at d * bs + off (standard) or (off / x * D + d) * x + off % x.
  const int64_t v0 = p.interleaved_v ? (off / X * D + static_cast<int64_t>(c) * X) * X + off % X
                                     : static_cast<int64_t>(c) * X * bs + off;
  const int64_t vstep = p.interleaved_v ? X : bs;
#pragma unroll
  for (int j = 0; j < X; ++j) {
    unsigned char* dst = vc + (page + v0 + j * vstep) * ESZ;
    const uint32_t q = packet_elem<ESZ>(vq, j);
    if (ESZ == 2) *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(q);
    else *dst = static_cast<unsigned char>(q);
  }
}

// TILE tokens of one head; PER packets of K and of V a thread holds at once.
template <int CK, int IN, int TILE, int PER>
RA_GLOBAL void RA_LAUNCH_BOUNDS(kWriteThreads) reshape_and_cache_tiled_kernel(CacheWriteParams p) {
  using K = CacheKind<CK>;
  constexpr int ESZ = K::kBytes;
  constexpr int X = 16 / ESZ;
  constexpr int RUN = TILE < 16 ? TILE : 16;  // tokens of one packet column in consecutive threads
  constexpr int G = TILE < X ? TILE : X;      // tokens of one V group (one vector store)
  constexpr int groups = TILE / G;
  static_assert(TILE % RUN == 0 && TILE % G == 0 && G * ESZ >= 8 && TILE <= 32 && groups <= 4, "tile shape");
  RA_DYNAMIC_SMEM(smem);
  int64_t* tile_slots = reinterpret_cast<int64_t*>(smem);
  int64_t* group_first = tile_slots + TILE;  // [4]: a group's first slot when its run is one store, else -1
  unsigned char* vt = smem + TILE * 8 + 32;  // V tile [TILE][row_bytes], cache dtype
  const int tid = static_cast<int>(ra_tid());
  const int t0 = static_cast<int>(ra_bid_x()) * TILE;
  const int head = static_cast<int>(ra_bid_y());
  const int D = p.head_size, bs = p.block_size;
  const int ncp = D / X;  // packets per token
  const int row_bytes = D * ESZ + 16;
  const SlotSplit split(bs);
  const int64_t head_off = static_cast<int64_t>(head) * D * bs;
  unsigned char* RA_RESTRICT kc = static_cast<unsigned char*>(p.k_cache);
  unsigned char* RA_RESTRICT vc = static_cast<unsigned char*>(p.v_cache);

  // token tid's slot (tid < TILE); warp 0 publishes it after its own loads are issued
  const int64_t my_slot = tid < TILE && t0 + tid < p.num_tokens ? ra_load_index(p.slot_mapping, t0 + tid, p.slot_mapping_is64) : -1;
  const float k_scale = K::kFp8 ? p.k_scale[0] : 1.0f;
  const float v_scale = K::kFp8 ? p.v_scale[0] : 1.0f;

  const int units = TILE * ncp;
  for (int base = 0; base < units; base += kWriteThreads * PER) {
    int64_t slot[PER];
    InPacket<X, IN> kin[PER], vin[PER];
#pragma unroll
    for (int r = 0; r < PER; ++r) {
      const int u = base + tid + r * kWriteThreads;
      const int col = u / RUN;
      const int t = col / ncp * RUN + u % RUN, c = col % ncp;
      const bool live = u < units && t0 + t < p.num_tokens;
      slot[r] = live ? ra_load_index(p.slot_mapping, t0 + t, p.slot_mapping_is64) : -1;
      if (live) {
        const int64_t tok = t0 + t;
        load_in(p.key, row_offset(tok, head, p.key_stride_t, p.key_stride_h) + c * X, p.vector_loads, kin[r]);
        load_in(p.value, row_offset(tok, head, p.value_stride_t, p.value_stride_h) + c * X, p.vector_loads, vin[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < PER; ++r) {
      const int u = base + tid + r * kWriteThreads;
      if (u >= units) continue;
      const int col = u / RUN;
      const int t = col / ncp * RUN + u % RUN, c = col % ncp;
      if (t0 + t < p.num_tokens)  // V to the shared tile (a padding slot's row is never read)
        *reinterpret_cast<ra_u128*>(vt + t * row_bytes + c * 16) = to_cache_packet<CK, IN>(vin[r], v_scale);
      if (slot[r] < 0) continue;
      const int64_t blk = split.block(slot[r]), off = split.offset(slot[r]);
      *reinterpret_cast<ra_u128*>(kc + ((blk * p.cache_block_stride + head_off) + (static_cast<int64_t>(c) * bs + off) * X) * ESZ) =
          to_cache_packet<CK, IN>(kin[r], k_scale);
    }
  }
  // Warp 0: the tile's slots to shared memory and, per group of G tokens, its first slot when
  // the G slots run consecutively from a G-aligned offset (every slot minus its place in the
  // group is the same value, a multiple of G), else -1: a V item then reads one value, not G.
  if (tid < RA_WARP_SIZE) {
    if (tid < TILE) tile_slots[tid] = my_slot;
    const int64_t key = my_slot < 0 ? -1 : my_slot - tid % G;
    int64_t lo = key, hi = key;
#pragma unroll
    for (int m = 1; m < G; m <<= 1) {
      const int64_t a = ra_shfl_xor(lo, m), b = ra_shfl_xor(hi, m);
      lo = a < lo ? a : lo;
      hi = b > hi ? b : hi;
    }
    if (tid < TILE && tid % G == 0) group_first[tid / G] = lo == hi && lo >= 0 && lo % G == 0 ? lo : -1;
  }
  ra_syncthreads();

  // V: (token group g, channel d); in the standard layout the group runs fastest (a channel's
  // groups are adjacent there), in the interleaved one the channel does.
  for (int item = tid; item < groups * D; item += kWriteThreads) {
    const int g = p.interleaved_v ? item / D : item % groups;
    const int d = p.interleaved_v ? item % D : item / groups;
    const int64_t s0 = group_first[g];
    if (s0 >= 0) {  // G consecutive slots from a G-aligned offset: one block (block sizes are multiples of 16)
      uint32_t packed[4] = {0u, 0u, 0u, 0u};
#pragma unroll
      for (int j = 0; j < G; ++j) packed[(j * ESZ) / 4] |= load_elem<ESZ>(vt + (g * G + j) * row_bytes + d * ESZ) << (8 * ((j * ESZ) % 4));
      const int64_t blk = split.block(s0), off = split.offset(s0);
      const int64_t e = p.interleaved_v ? (off / X * D + d) * X + off % X : static_cast<int64_t>(d) * bs + off;
      unsigned char* dst = vc + (blk * p.cache_block_stride + head_off + e) * ESZ;
      if constexpr (G * ESZ == 16) {
        ra_u128 out;
        out.x = packed[0];
        out.y = packed[1];
        out.z = packed[2];
        out.w = packed[3];
        *reinterpret_cast<ra_u128*>(dst) = out;
      } else {
        ra_u64 out;
        out.x = packed[0];
        out.y = packed[1];
        *reinterpret_cast<ra_u64*>(dst) = out;
      }
    } else {
#pragma unroll
      for (int j = 0; j < G; ++j) {
        const int64_t slot = tile_slots[g * G + j];
        if (slot < 0) continue;
        const int64_t blk = split.block(slot), off = split.offset(slot);
        const int64_t e = p.interleaved_v ? (off / X * D + d) * X + off % X : static_cast<int64_t>(d) * bs + off;
        unsigned char* dst = vc + (blk * p.cache_block_stride + head_off + e) * ESZ;
        const uint32_t q = load_elem<ESZ>(vt + (g * G + j) * row_bytes + d * ESZ);
        if (ESZ == 2) *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(q);
        else *dst = static_cast<unsigned char>(q);
      }
    }
  }
}

template <int CK, int IN, int TILE>
int launch_tiled(const CacheWriteParams& p, void* stream) {
  // the slots and the V tile; within the 48 KB every GPU grants without an opt-in
  const size_t smem = static_cast<size_t>(TILE) * (8 + p.head_size * CacheKind<CK>::kBytes + 16) + 32;
  if (smem > 48 * 1024)
    return fail("reshape_and_cache: head_size %d is not supported by the %d-token tile: its V tile needs %zu bytes "
                "of shared memory, more than 48 KB", p.head_size, TILE, smem);
  const ra_grid grid = {static_cast<unsigned>((p.num_tokens + TILE - 1) / TILE),
                        static_cast<unsigned>(p.num_kv_heads), 1u};
  ra_launch(&reshape_and_cache_tiled_kernel<CK, IN, TILE, TILE / 8>, grid, static_cast<unsigned>(kWriteThreads),
            smem, stream, p);
  return 0;
}

template <int CK, int IN>
int launch_variant(const CacheWriteParams& p, WriterVariant variant, void* stream) {
  switch (variant) {
    case WriterVariant::kScatter: {
      const uint64_t units = static_cast<uint64_t>(p.num_tokens) * p.num_kv_heads * (p.head_size / (16 / CacheKind<CK>::kBytes));
      const ra_grid grid = {static_cast<unsigned>((units + kWriteThreads - 1) / kWriteThreads), 1u, 1u};
      ra_launch(&reshape_and_cache_scatter_kernel<CK, IN>, grid, static_cast<unsigned>(kWriteThreads), 0, stream, p);
      return 0;
    }
    case WriterVariant::kTile8: return launch_tiled<CK, IN, 8>(p, stream);
    case WriterVariant::kTile16: return launch_tiled<CK, IN, 16>(p, stream);
    case WriterVariant::kTile32: return launch_tiled<CK, IN, 32>(p, stream);
    default: return fail("reshape_and_cache: writer variant %d is not supported", static_cast<int>(variant));
  }
}

template <int CK>
int launch_write(const CacheWriteParams& p, WriterVariant variant, void* stream) {
  constexpr int X = 16 / CacheKind<CK>::kBytes;
  if (p.head_size % X != 0)
    return fail("reshape_and_cache: head_size %d is not a multiple of %d (16 bytes of the cache dtype)", p.head_size, X);
  int rc;
  if (p.input_dtype == static_cast<int>(DType::kBFloat16))
    rc = launch_variant<CK, static_cast<int>(DType::kBFloat16)>(p, variant, stream);
  else if (p.input_dtype == static_cast<int>(DType::kFloat16))
    rc = launch_variant<CK, static_cast<int>(DType::kFloat16)>(p, variant, stream);
  else
    rc = launch_variant<CK, static_cast<int>(DType::kFloat32)>(p, variant, stream);
  if (rc != 0) return rc;
  if (const char* e = ra_launch_error()) return fail("reshape_and_cache: launch failed: %s", e);
  return 0;
}

}  // namespace

// The launch rule, from the H200 A/B (bench_native.py --writer-variants, bf16, 8 KV heads,
// d 128, block 16; us, history 2026-12-05_1411_*): scatter wins at T = 16 / 64 (6.9 / 6.8 vs
// tile16 7.9 / 7.9), tile8/16 from T = 256 (8.7 / 8.9 vs scatter 10.1; scatter 4.5x slower at
// 4096), tile16 at 4096 / 16384 (17.1 / 44.5 vs tile8 17.6 / 48.9, tile32 18.2 / 47.8).
// So scatter up to kScatterMaxTokens (between the measured 64 and 256), tile16 above; tile32
// never won and is only reached by name.
constexpr int32_t kScatterMaxTokens = 128;

WriterVariant writer_variant_for(int32_t num_tokens) {
  return num_tokens <= kScatterMaxTokens ? WriterVariant::kScatter : WriterVariant::kTile16;
}

int reshape_and_cache(const CacheWriteParams& p, void* stream) {
  if (p.num_tokens == 0) return 0;
  if (p.block_size <= 0 || p.block_size % kMinTile != 0)
    return fail("reshape_and_cache: block_size %d is not supported; it must be a multiple of %d", p.block_size,
                kMinTile);
  if (p.input_dtype != static_cast<int>(DType::kBFloat16) && p.input_dtype != static_cast<int>(DType::kFloat16) &&
      p.input_dtype != static_cast<int>(DType::kFloat32))
    return fail("reshape_and_cache: key/value dtype %d is not supported; supported: float16, bfloat16, float32",
                p.input_dtype);
  const WriterVariant variant = p.variant == static_cast<int32_t>(WriterVariant::kAuto)
                                    ? writer_variant_for(p.num_tokens)
                                    : static_cast<WriterVariant>(p.variant);
  if (variant != WriterVariant::kScatter && variant != WriterVariant::kTile8 && variant != WriterVariant::kTile16 &&
      variant != WriterVariant::kTile32)
    return fail("reshape_and_cache: writer variant %d is not supported; supported: 0 auto, 1 scatter, 2 tile8, "
                "3 tile16, 4 tile32", p.variant);
  switch (static_cast<DType>(p.cache_dtype)) {
#define RA_WRITE_CASE(E) \
  case DType::E:         \
    return launch_write<static_cast<int>(DType::E)>(p, variant, stream);
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
