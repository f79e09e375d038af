// Paged decode kernels (query_len == 1), written once for CUDA and HIP.
//
// Grid (num_seqs, num_kv_heads * head_chunks, num_splits); a CTA handles up to GT query heads
// of one KV head (all of them when gqa <= 8), so each K/V byte of its key range is read once.
// Keys come in tiles of 16 (one run of one cache block; block sizes are multiples of 16).
// Each warp of the CTA streams its own tiles (t_begin + warp, + num_warps, ...) with its own
// online softmax, so the loop has no CTA barrier; the warps merge once at the end.
//
// Per tile, a warp
//   1. copies the K tile (16 tokens x head_size) and the V tile (head_size x 16 tokens) into its
//      shared-memory ring with 16-byte copies, `stages - 1` tiles ahead (cp.async on sm_80+);
//   2. K phase: lane (r = lane % NCR, sub = lane / NCR) holds query channels r*8 .. r*8+7 of all
//      GT heads in registers and dots them with tokens sub, sub + TPI, ...; the partial dots are
//      summed over the NCR lanes of a token by a transposed butterfly (reduce-scatter: each
//      step halves the values a lane holds, so a step costs one shuffle per two values);
//   3. softmax phase: lane (token lane % 16, head group lane / 16) applies soft cap, ALiBi and
//      the key mask, updates the running max / sum of its heads and writes P to shared memory;
//   4. V phase: lane owns 8-token halves of channels (lane + W*i) / 2 and accumulates P V.
// Scores live in log2 units (exp2); scale, k_scale and the fp8 decode factor are folded into
// the query.
#pragma once

#include "ra_compat.cuh"

namespace rocm_attn_native {

constexpr int kTile = 16;  // keys per tile

RA_HOST_DEVICE constexpr int ra_min(int a, int b) { return a < b ? a : b; }
RA_HOST_DEVICE constexpr int ra_max(int a, int b) { return a > b ? a : b; }

// Shared-memory layout of one decode CTA (bytes): per warp a ring of `stages` K+V tiles, then
// the tile's scores, probabilities and rescale factors; after the loop the same memory holds
// every warp's (acc, max, sum) for the merge.
struct DecodeSmem {
  int tile_bytes, warp_bytes, scores, probs, alphas, total;
  RA_HOST_DEVICE DecodeSmem(int head_size, int elem_bytes, int gt, int num_warps, int stages) {
    tile_bytes = kTile * head_size * elem_bytes;
    scores = stages * 2 * tile_bytes;
    probs = scores + gt * kTile * 4;
    alphas = probs + gt * kTile * 4;
    warp_bytes = alphas + ((gt + 3) / 4) * 16;
    int merge = num_warps * (gt * head_size + 2 * gt) * 4;
    total = ra_max(num_warps * warp_bytes, merge);
  }
};

// Sum each of the N values of a lane over the NCR lanes that differ in the low bits of the
// lane index (NCR a power of two). Afterwards the lane holds the totals of original values
// base .. base + count - 1 (count = max(1, N / NCR)) in v[0 .. count). When N < NCR, lanes
// that differ in the bits of `dup_mask` hold the same totals.
template <int N, int NCR>
struct ReduceScatter {
  static constexpr int kCount = N >= NCR ? N / NCR : 1;
  static constexpr int kDupMask = N >= NCR ? 0 : NCR / N - 1;
  RA_DEVICE static int run(float (&v)[N], int lane) {
    int base = 0;
    int n = N;
#pragma unroll
    for (int m = NCR / 2; m >= 1; m /= 2) {
      if (n >= 2) {
        const bool hi = (lane & m) != 0;
        const int half = n / 2;
#pragma unroll
        for (int j = 0; j < N / 2; ++j) {
          if (j < half) {
            float send = hi ? v[j] : v[j + half];
            float keep = hi ? v[j + half] : v[j];
            v[j] = keep + ra_shfl_xor(send, m);
          }
        }
        base += hi ? half : 0;
        n = half;
      } else {
        v[0] += ra_shfl_xor(v[0], m);
      }
    }
    return base;
  }
};

struct DecodeRuntime {  // per-call values every kernel variant needs
  int head_chunks;
  float k_factor, v_factor;  // fp8 decode factors (1 for 16-bit caches)
};

// Finish one output element: join the sink (a zero-value logit), normalise, dequantize V.
RA_DEVICE float ra_finish(float acc, float m, float l, const float* sinks, int head, float v_mul) {
  if (sinks != nullptr) {
    float sk = sinks[head] * RA_LOG2E;
    float m2 = m > sk ? m : sk;
    float a = ra_exp2(m - m2);  // m = -inf: 0
    acc *= a;
    l = l * a + ra_exp2(sk - m2);
  }
  return l > 0.0f ? acc / l * v_mul : 0.0f;
}

// Where one CTA works: its sequence, KV head, query heads and key range, and the tiles of
// this thread's warp. `active` is false for a sequence whose query_len is not 1.
struct DecodeCta {
  int lane, warp, num_warps, seq, kv_head, split, seq_len, q_pos, lo, hi, t_begin, t_end, nh, head_base, n_my;
  int bs_shift;  // log2(block_size) for power-of-two block sizes (the supported 16 and 32), else -1
  int64_t row;   // (sequence, KV head, head chunk): its splits' merge counter
  int64_t q_row;
  bool active;

  template <int GT>
  RA_DEVICE void init(const DecodeParams& p, const DecodeRuntime& rt) {
    const int tid = static_cast<int>(ra_tid());
    lane = tid % RA_WARP_SIZE;
    warp = tid / RA_WARP_SIZE;
    num_warps = static_cast<int>(ra_ntid()) / RA_WARP_SIZE;
    seq = static_cast<int>(ra_bid_x());
    kv_head = static_cast<int>(ra_bid_y()) / rt.head_chunks;
    const int chunk = static_cast<int>(ra_bid_y()) % rt.head_chunks;
    split = static_cast<int>(ra_bid_z());
    bs_shift = (p.block_size & (p.block_size - 1)) == 0 ? ra_log2_pow2(p.block_size) : -1;
    row = static_cast<int64_t>(seq) * p.num_kv_heads * rt.head_chunks + static_cast<int>(ra_bid_y());
    q_row = ra_load_index(p.query_start_loc, seq, p.query_start_loc_is64);
    active = ra_load_index(p.query_start_loc, seq + 1, p.query_start_loc_is64) - q_row == 1;
    seq_len = active ? static_cast<int>(ra_load_index(p.seq_lens, seq, p.seq_lens_is64)) : 0;
    const int gqa = p.num_heads / p.num_kv_heads;
    nh = ra_min(GT, gqa - chunk * GT);  // real heads of this CTA
    head_base = kv_head * gqa + chunk * GT;
    // Visible keys [lo, hi): every key is <= the query position (causal or not); the window
    // keeps q_pos - k_pos < sliding_window.
    q_pos = seq_len - 1;
    hi = seq_len;
    lo = p.sliding_window > 0 ? ra_max(seq_len - p.sliding_window, 0) : 0;
    t_begin = lo / kTile;
    t_end = (hi + kTile - 1) / kTile;
    if (p.num_splits > 1) {
      const int per = (t_end - t_begin + p.num_splits - 1) / p.num_splits;
      t_begin = ra_min(t_begin + split * per, t_end);
      t_end = ra_min(t_begin + per, t_end);
    }
    n_my = t_begin + warp < t_end ? (t_end - t_begin - warp + num_warps - 1) / num_warps : 0;
  }
  RA_DEVICE int tile_start(int k) const { return (t_begin + warp + k * num_warps) * kTile; }
  // Block-table column and offset in the block of key position t: a shift and a mask for
  // power-of-two block sizes (an integer division by a runtime value costs ~20 instructions,
  // and the tile loop needs both on every tile).
  RA_DEVICE int block_col(int t, int bs) const { return bs_shift >= 0 ? t >> bs_shift : t / bs; }
  RA_DEVICE int block_off(int t, int bs) const { return bs_shift >= 0 ? t & (bs - 1) : t % bs; }
};

// Position (in 16-byte packets) of K packet c of token t in a tile, for the CUDA-core
// kernel: rows of NCP packets, XOR-swizzled so that both the copies (16 tokens of one packet
// column) and the reads (all packets of a token) spread over the shared-memory banks.
template <int NCP>
RA_DEVICE int k_slot(int t, int c) {
  constexpr int SWM = ra_min(NCP, 8);
  constexpr int SWD = ra_max(1, 8 / NCP);
  return t * NCP + (c ^ ((t / SWD) % SWM));
}

// The tensor-core kernel's K slot: columns of 16 tokens, as in the cache page. The copies of
// 8 consecutive tokens (128 contiguous bytes of global memory) then fill one 128-byte
// shared-memory row, and ldmatrix reads its 8 rows (8 keys of one column) from one such row.
// Scattering those 8 tokens over 8 rows, as k_slot does, made each cp.async instruction of
// K take 8 shared-memory wavefronts instead of 1 and request every global sector twice
// (Nsight Compute on the H200: 24 sectors and 18 wavefronts per copy instruction, against
// 16 and 4 in Triton's decode).
RA_DEVICE int k_slot_col(int t, int c) { return c * kTile + t; }

// Position of V packet g (tokens g*x ..) of channel d in a tile: [D][16 / x]; with VSWZ (the
// tensor-core kernel's ldmatrix reads 8 channels of one packet column) the two packets of a
// 16-bit row swap every 4 channels.
template <int PPC, bool VSWZ>
RA_DEVICE int v_slot(int d, int g) {
  return VSWZ && PPC == 2 ? d * 2 + (g ^ ((d >> 2) & 1)) : d * PPC + g;
}

// Copy the K and V tiles of keys ts .. ts + 15 (block `blk`) into a ring slot (16-byte copies,
// asynchronous where the hardware has them). MMA: the tensor-core kernel's layout (K by
// k_slot_col, V swizzled for ldmatrix), else the CUDA-core kernel's (k_slot, plain V).
template <int CK, int D, bool MMA>
RA_DEVICE void issue_tile(const DecodeParams& p, const DecodeCta& c, unsigned char* slot, int tile_bytes, int ts,
                          int64_t blk) {
  constexpr int W = RA_WARP_SIZE;
  constexpr int ESZ = CacheKind<CK>::kBytes;
  constexpr int X = 16 / ESZ;
  constexpr int NCP = D / X;
  constexpr int PPC = kTile / X;  // V packets per channel of a tile
  static_assert((kTile * NCP) % W == 0 && (D * PPC) % W == 0, "tile copies");
  const int bs = p.block_size;
  const int off = c.block_off(ts, bs);
  const int64_t page = (blk * p.cache_block_stride + static_cast<int64_t>(c.kv_head) * D * bs) * ESZ;
  const unsigned char* k_src = static_cast<const unsigned char*>(p.k_cache) + page;
  const unsigned char* v_src = static_cast<const unsigned char*>(p.v_cache) + page;
  unsigned char* vd = slot + tile_bytes;
  if constexpr (MMA) {
    // In this layout copy i of a lane is its first copy moved by a fixed step, in global and
    // shared memory alike: K, token lane % 16 of packet column lane / 16 + (W / 16) i (slot
    // lane + W i); V, packet g = lane % PPC of channel lane / PPC + (W / PPC) i (slot + W i: the
    // swizzle bit, (d >> 2) & 1, does not change for steps of 16 channels). So the loop is
    // straight-line copies with one address add each.
    static_assert((W / PPC) % 8 == 0, "the V step keeps the swizzle bit");
    const int lane = c.lane;
    const unsigned char* k_at = k_src + ((static_cast<int64_t>(lane / kTile)) * bs + off + lane % kTile) * 16;
    const int64_t k_step = static_cast<int64_t>(W / kTile) * bs * 16;
    const int d0 = lane / PPC, g = lane % PPC, tok = off + g * X;
    const unsigned char* v_at =
        v_src + (p.interleaved_v ? (static_cast<int64_t>(tok / X) * D + d0) * X : static_cast<int64_t>(d0) * bs + tok) * ESZ;
    const int64_t v_step = static_cast<int64_t>(W / PPC) * (p.interleaved_v ? X : bs) * ESZ;
    unsigned char* v_to = vd + v_slot<PPC, true>(d0, g) * 16;
#pragma unroll
    for (int i = 0; i < kTile * NCP / W; ++i) ra_copy16_async(slot + (lane + W * i) * 16, k_at + i * k_step);
#pragma unroll
    for (int i = 0; i < D * PPC / W; ++i) ra_copy16_async(v_to + W * i * 16, v_at + i * v_step);
    return;
  }
  // Not unrolled: unrolled, the compiler keeps every copy's tile-invariant offsets in
  // registers across the whole key loop.
#pragma unroll 1
  for (int i = 0; i < kTile * NCP / W; ++i) {
    const int j = c.lane + W * i;
    const int t = j % kTile, cc = j / kTile;
    ra_copy16_async(slot + k_slot<NCP>(t, cc) * 16, k_src + (static_cast<int64_t>(cc) * bs + off + t) * 16);
  }
#pragma unroll 1
  for (int i = 0; i < D * PPC / W; ++i) {
    const int j = c.lane + W * i;
    const int d = j / PPC, g = j % PPC;
    const int tok = off + g * X;
    const int64_t e = p.interleaved_v ? (static_cast<int64_t>(tok / X) * D + d) * X : static_cast<int64_t>(d) * bs + tok;
    ra_copy16_async(vd + v_slot<PPC, false>(d, g) * 16, v_src + e * ESZ);
  }
}

// The warp's tile loop: a ring of `stages` slots, stages - 1 tiles in flight, the block id of
// the next tile loaded one iteration ahead. compute(slot, ts) runs once per tile.
template <int CK, int D, bool MMA, typename F>
RA_DEVICE void tile_loop(const DecodeParams& p, const DecodeCta& c, unsigned char* ring, int tile_bytes, int stages,
                         F&& compute) {
  const int64_t bt_row = static_cast<int64_t>(c.seq) * p.block_table_stride;
  auto block_of = [&](int k) -> int64_t {
    return ra_load_index(p.block_table, bt_row + c.block_col(c.tile_start(k), p.block_size), p.block_table_is64);
  };
  // The prologue's block ids are read together, before the first copy: each copy's address
  // needs its id, and read one before each copy they cost a global round trip apiece (on a
  // small grid a warp's whole key range is these few tiles).
  int64_t first[4];
#pragma unroll
  for (int s = 0; s < 4; ++s) first[s] = s < stages && s < c.n_my ? block_of(s) : 0;
#pragma unroll
  for (int s = 0; s < 3; ++s) {
    if (s < stages - 1) {
      if (s < c.n_my) issue_tile<CK, D, MMA>(p, c, ring + s * 2 * tile_bytes, tile_bytes, c.tile_start(s), first[s]);
      ra_copy_commit();
    }
  }
  int64_t next_blk = stages == 2 ? first[1] : stages == 3 ? first[2] : first[3];
  // Ring slots of tile k and of tile k + stages - 1, advanced by a compare (stages is a
  // runtime value: k % stages would be an integer division per tile).
  int slot_k = 0, slot_kk = stages - 1;
  for (int k = 0; k < c.n_my; ++k) {
    const int kk = k + stages - 1;
    if (kk < c.n_my)
      issue_tile<CK, D, MMA>(p, c, ring + slot_kk * 2 * tile_bytes, tile_bytes, c.tile_start(kk), next_blk);
    ra_copy_commit();
    next_blk = kk + 1 < c.n_my ? block_of(kk + 1) : 0;  // used next iteration
    ra_copy_wait(stages - 1);
    ra_syncwarp();
    compute(ring + slot_k * 2 * tile_bytes, c.tile_start(k));
    ra_syncwarp();  // the next iteration's copies overwrite this slot
    slot_k = slot_k + 1 == stages ? 0 : slot_k + 1;
    slot_kk = slot_kk + 1 == stages ? 0 : slot_kk + 1;
  }
}

// With merge_counters: after every thread of the CTA stored its split's partial rows, take a
// ticket on the CTA row's counter; the CTA with the last ticket merges every split of its heads
// (the reduce kernel's sums) and sets the counter back to 0 for the next launch (so launches
// on one device must run in stream order). `smem`: scratch of at least (4 + GT * (S + 2))
// floats, free once the partials are stored.
template <int D, int GT>
RA_DEVICE void merge_if_last_split(const DecodeParams& p, const DecodeCta& c, unsigned char* smem, float v_mul) {
  const int S = p.num_splits;
  int* flag = reinterpret_cast<int*>(smem);
  float* w = reinterpret_cast<float*>(smem) + 4;  // [GT][S] split weights exp2(m_s - max)
  float* l_all = w + GT * S;                      // [GT] the sums' weighted total
  float* m_all = l_all + GT;                      // [GT] the max over splits
  ra_threadfence();  // release: this thread's partial stores before the ticket
  ra_syncthreads();
  if (ra_tid() == 0) {
    int* counter = p.merge_counters + c.row;
    const int last = ra_atomic_add(counter, 1) == S - 1;
    if (last) *counter = 0;
    *flag = last;
  }
  ra_syncthreads();
  if (!*flag) return;
  ra_threadfence();  // acquire: the other splits' partials, stored before their tickets
  // 1. A warp per head: max over the splits, then each split's weight and the total sum.
  for (int h = c.warp; h < c.nh; h += c.num_warps) {
    const int64_t row0 = (static_cast<int64_t>(c.seq) * p.num_heads + c.head_base + h) * S;
    float mx = RA_NEG_INF;
    for (int s = c.lane; s < S; s += RA_WARP_SIZE) {
      const float m = ra_load_coherent(p.part_ml + (row0 + s) * 2);
      mx = mx > m ? mx : m;
    }
#pragma unroll
    for (int m = RA_WARP_SIZE / 2; m >= 1; m /= 2) {
      const float o = ra_shfl_xor(mx, m);
      mx = mx > o ? mx : o;
    }
    const float m_safe = mx == RA_NEG_INF ? 0.0f : mx;  // every split empty: weights 0
    float l = 0.0f;
    for (int s = c.lane; s < S; s += RA_WARP_SIZE) {
      const float f = ra_exp2(ra_load_coherent(p.part_ml + (row0 + s) * 2) - m_safe);
      w[h * S + s] = f;
      l += f * ra_load_coherent(p.part_ml + (row0 + s) * 2 + 1);
    }
#pragma unroll
    for (int m = RA_WARP_SIZE / 2; m >= 1; m /= 2) l += ra_shfl_xor(l, m);
    if (c.lane == 0) {
      l_all[h] = l;
      m_all[h] = mx;
    }
  }
  ra_syncthreads();
  // 2. Each output element: the weighted sum of its splits' accumulators.
  for (int e = static_cast<int>(ra_tid()); e < c.nh * D; e += static_cast<int>(ra_ntid())) {
    const int h = e / D, d = e % D;
    const int head = c.head_base + h;
    const float* acc = p.part_acc + (static_cast<int64_t>(c.seq) * p.num_heads + head) * S * D + d;
    float a = 0.0f;
#pragma unroll 4
    for (int s = 0; s < S; ++s) a += w[h * S + s] * ra_load_coherent(acc + static_cast<int64_t>(s) * D);
    const float o = ra_finish(a, m_all[h], l_all[h], p.sinks, head, v_mul);
    ra_store_model(p.out, c.q_row * p.out_stride_t + static_cast<int64_t>(head) * p.out_stride_h + d, o,
                   p.model_dtype);
  }
}

// After every warp wrote its (acc [GT][D], max, sum) into the merge area and the CTA synced:
// merge the warps and store the output (one split) or the split's partials (then, with merge
// counters, the last split CTA merges the splits).
template <int D, int GT>
RA_DEVICE void merge_and_store(const DecodeParams& p, const DecodeCta& c, const float* m_acc, const float* m_max,
                               const float* m_sum, float v_mul) {
  for (int e = static_cast<int>(ra_tid()); e < c.nh * D; e += static_cast<int>(ra_ntid())) {
    const int h = e / D, d = e % D;
    float mx = RA_NEG_INF;
    for (int w = 0; w < c.num_warps; ++w) mx = mx > m_max[w * GT + h] ? mx : m_max[w * GT + h];
    float a = 0.0f, l = 0.0f;
    if (mx != RA_NEG_INF) {
      for (int w = 0; w < c.num_warps; ++w) {
        const float f = ra_exp2(m_max[w * GT + h] - mx);
        a += f * m_acc[(w * GT + h) * D + d];
        l += f * m_sum[w * GT + h];
      }
    }
    const int head = c.head_base + h;
    if (p.num_splits == 1) {
      const float o = ra_finish(a, mx, l, p.sinks, head, v_mul);
      ra_store_model(p.out, c.q_row * p.out_stride_t + static_cast<int64_t>(head) * p.out_stride_h + d, o,
                     p.model_dtype);
    } else {
      const int64_t row = (static_cast<int64_t>(c.seq) * p.num_heads + head) * p.num_splits + c.split;
      p.part_acc[row * D + d] = a;
      if (d == 0) {
        p.part_ml[row * 2] = mx;
        p.part_ml[row * 2 + 1] = l;
      }
    }
  }
  if (p.num_splits > 1 && p.merge_counters != nullptr) {
    ra_syncthreads();  // every thread is done reading the merge area: it becomes the scratch
    merge_if_last_split<D, GT>(p, c, reinterpret_cast<unsigned char*>(const_cast<float*>(m_acc)), v_mul);
  }
}

// CUDA-core decode: warp-level dot products (see the top of this file).
template <int CK, int D, int GT>
RA_GLOBAL void RA_LAUNCH_BOUNDS(256) paged_decode_kernel(DecodeParams p, DecodeRuntime rt, int stages) {
  using K = CacheKind<CK>;
  constexpr int W = RA_WARP_SIZE;
  constexpr int ESZ = K::kBytes;
  constexpr int X = 16 / ESZ;        // elements per 16-byte packet
  constexpr int NCP = D / X;         // K packets per token
  constexpr int NCR = D / 8;         // 8-element K read groups per token
  static_assert(NCR <= W && W / NCR <= kTile, "head size does not fit the warp mapping");
  constexpr int TPI = W / NCR;       // tokens per K read step
  constexpr int NK = kTile / TPI;    // K read steps per tile
  constexpr int KC = ra_min(NK, ra_max(1, 16 / GT));  // steps per reduction (bounds registers)
  static_assert(NK % KC == 0, "chunking");
  constexpr int NV = 2 * D / W;      // V read groups (8 tokens of one channel) per lane
  static_assert(NV >= 1 && (2 * D) % W == 0, "V mapping");
  constexpr int VC = ra_min(NV, 2);  // V read groups converted at a time
  constexpr int HG = W / kTile;      // head groups of the softmax phase
  constexpr int HPL = (GT + HG - 1) / HG;
  using RS = ReduceScatter<KC * GT, NCR>;

  RA_DYNAMIC_SMEM(smem);
  DecodeCta c;
  c.init<GT>(p, rt);
  if (!c.active) return;  // uniform over the CTA
  const int lane = c.lane;

  const DecodeSmem lay(D, ESZ, GT, c.num_warps, stages);
  unsigned char* ring = smem + c.warp * lay.warp_bytes;
  float* s_buf = reinterpret_cast<float*>(ring + lay.scores);  // [GT][16] raw scores
  float* p_buf = reinterpret_cast<float*>(ring + lay.probs);   // [GT][16] probabilities
  float* a_buf = reinterpret_cast<float*>(ring + lay.alphas);  // [GT] rescale factors

  // Query channels r*8 .. r*8+7 of every head, pre-multiplied.
  const bool softcap = p.logits_soft_cap > 0.0f;
  const float k_mul = K::kFp8 ? p.k_scale[0] * rt.k_factor : 1.0f;
  const float q_mul = p.scale * k_mul * (softcap ? 1.0f / p.logits_soft_cap : RA_LOG2E);
  const float cap_log2 = softcap ? p.logits_soft_cap * RA_LOG2E : 0.0f;
  const int r = lane % NCR;
  const int sub = lane / NCR;
  float q[GT][8];
  {
    // Heads past nh (a partial head chunk) read head 0's row and are zeroed after.
    const int64_t base = c.q_row * p.q_stride_t + static_cast<int64_t>(c.head_base) * p.q_stride_h + r * 8;
    float qv[GT * 8];
    ra_load_model_all(p.query, p.model_dtype, qv, [&](int i) {
      return base + static_cast<int64_t>(i / 8 < c.nh ? i / 8 : 0) * p.q_stride_h + i % 8;
    });
#pragma unroll
    for (int h = 0; h < GT; ++h)
#pragma unroll
      for (int j = 0; j < 8; ++j) q[h][j] = h < c.nh ? qv[h * 8 + j] * q_mul : 0.0f;
  }

  // Softmax-phase state: token st of the tile, heads hg + HG * jh.
  const int st = lane % kTile;
  const int hg = lane / kTile;
  float m_run[HPL], l_run[HPL], slope[HPL];
#pragma unroll
  for (int jh = 0; jh < HPL; ++jh) {
    const int h = hg + HG * jh;
    m_run[jh] = RA_NEG_INF;
    l_run[jh] = 0.0f;
    slope[jh] = (p.alibi_slopes != nullptr && h < c.nh) ? p.alibi_slopes[c.head_base + h] * RA_LOG2E : 0.0f;
  }

  float acc[NV][GT];
#pragma unroll
  for (int i = 0; i < NV; ++i)
#pragma unroll
    for (int h = 0; h < GT; ++h) acc[i][h] = 0.0f;

  tile_loop<CK, D, false>(p, c, ring, lay.tile_bytes, stages, [&](const unsigned char* ks, int ts) {
    const bool full = ts >= c.lo && ts + kTile <= c.hi;
    const unsigned char* vs = ks + lay.tile_bytes;

    // K phase: raw scores of every (token, head) into s_buf.
#pragma unroll
    for (int c0 = 0; c0 < NK; c0 += KC) {
      float v[KC * GT];
#pragma unroll
      for (int i = 0; i < KC; ++i) {
        const int t = sub + TPI * (c0 + i);
        float kf[8];
        ra_load8<CK>(ks + k_slot<NCP>(t, ESZ == 2 ? r : r / 2) * 16 + (ESZ == 2 ? 0 : (r % 2) * 8), kf);
#pragma unroll
        for (int h = 0; h < GT; ++h) {
          float s = 0.0f;
#pragma unroll
          for (int j = 0; j < 8; ++j) s += q[h][j] * kf[j];
          v[i * GT + h] = s;
        }
      }
      const int base = RS::run(v, lane);
      if ((r & RS::kDupMask) == 0) {
#pragma unroll
        for (int j = 0; j < RS::kCount; ++j) {
          const int idx = base + j;
          s_buf[(idx % GT) * kTile + sub + TPI * (c0 + idx / GT)] = v[j];
        }
      }
    }
    ra_syncwarp();

    // Softmax phase.
#pragma unroll
    for (int jh = 0; jh < HPL; ++jh) {
      const int h = hg + HG * jh;
      const bool real = h < GT;
      float sc = real ? s_buf[h * kTile + st] : 0.0f;
      if (softcap) sc = cap_log2 * ra_tanh(sc);
      const int k_pos = ts + st;
      sc += slope[jh] * static_cast<float>(k_pos - c.q_pos);
      if (k_pos < c.lo || k_pos >= c.hi) sc = RA_NEG_INF;
      float mx = sc;
#pragma unroll
      for (int m = kTile / 2; m >= 1; m /= 2) {
        const float o = ra_shfl_xor(mx, m);
        mx = mx > o ? mx : o;
      }
      const float m_new = m_run[jh] > mx ? m_run[jh] : mx;
      const float m_safe = m_new == RA_NEG_INF ? 0.0f : m_new;
      const float alpha = ra_exp2(m_run[jh] - m_safe);
      const float pr = ra_exp2(sc - m_safe);
      float ps = pr;
#pragma unroll
      for (int m = kTile / 2; m >= 1; m /= 2) ps += ra_shfl_xor(ps, m);
      l_run[jh] = l_run[jh] * alpha + ps;
      m_run[jh] = m_new;
      if (real) {
        p_buf[h * kTile + st] = pr;
        if (st == 0) a_buf[h] = alpha;
      }
    }
    ra_syncwarp();

    // V phase: lane's read groups u = lane + W*i: channel u / 2, tokens (u % 2) * 8 .. + 8.
    const int half = lane & 1;
#pragma unroll
    for (int h = 0; h < GT; ++h) {
      const float a = a_buf[h];
#pragma unroll
      for (int i = 0; i < NV; ++i) acc[i][h] *= a;
    }
#pragma unroll
    for (int i0 = 0; i0 < NV; i0 += VC) {
      float vf[VC][8];
#pragma unroll
      for (int i = 0; i < VC; ++i) {
        ra_load8<CK>(vs + (lane + W * (i0 + i)) * 8 * ESZ, vf[i]);
        if (!full) {  // keys outside [lo, hi) may hold anything (NaN): 0 * NaN = NaN
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const int k_pos = ts + half * 8 + j;
            if (k_pos < c.lo || k_pos >= c.hi) vf[i][j] = 0.0f;
          }
        }
      }
#pragma unroll
      for (int h = 0; h < GT; ++h) {
        float pv[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) pv[j] = p_buf[h * kTile + half * 8 + j];
#pragma unroll
        for (int i = 0; i < VC; ++i) {
          float s = acc[i0 + i][h];
#pragma unroll
          for (int j = 0; j < 8; ++j) s += pv[j] * vf[i][j];
          acc[i0 + i][h] = s;
        }
      }
    }
  });

  // Merge the two 8-token halves of each channel, then the warps.
#pragma unroll
  for (int i = 0; i < NV; ++i)
#pragma unroll
    for (int h = 0; h < GT; ++h) acc[i][h] += ra_shfl_xor(acc[i][h], 1);
  ra_syncthreads();  // every warp is done with its ring: the merge area overlaps them
  float* m_acc = reinterpret_cast<float*>(smem);                 // [num_warps][GT][D]
  float* m_max = m_acc + c.num_warps * GT * D;                   // [num_warps][GT]
  float* m_sum = m_max + c.num_warps * GT;                       // [num_warps][GT]
  if (lane % 2 == 0) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int d = (lane + W * i) / 2;
#pragma unroll
      for (int h = 0; h < GT; ++h) m_acc[(c.warp * GT + h) * D + d] = acc[i][h];
    }
  }
  if (st == 0) {
#pragma unroll
    for (int jh = 0; jh < HPL; ++jh) {
      const int h = hg + HG * jh;
      if (h < GT) {
        m_max[c.warp * GT + h] = m_run[jh];
        m_sum[c.warp * GT + h] = l_run[jh];
      }
    }
  }
  ra_syncthreads();
  merge_and_store<D, GT>(p, c, m_acc, m_max, m_sum, K::kFp8 ? p.v_scale[0] * rt.v_factor : 1.0f);
}

// Threads of the split reduction, and its dynamic shared memory (bytes).
constexpr int kReduceThreads = 256;
RA_HOST_DEVICE int reduce_smem_bytes(int num_splits, int head_size) {
  const int groups = kReduceThreads / (head_size / 4);
  return (2 * num_splits + groups * head_size + groups + kReduceThreads / 32) * 4;
}

// Merge the splits of one (sequence, head): grid (num_seqs, num_heads), kReduceThreads
// threads. Everything is laid out so that few global reads wait on one another (a small grid
// has 32-64 splits, and a loop of dependent reads over them waited an L2 round trip each):
//   1. the splits' (max, sum) rows are read in parallel, into shared memory, with a block max;
//   2. thread (q, grp) sums channels 4q .. 4q + 3 over splits grp, grp + G, ... (G groups);
//   3. the G partial sums of each channel are added and the output stored.
RA_GLOBAL void paged_decode_reduce_kernel(DecodeParams p, float v_factor, int is_fp8) {
  const int seq = static_cast<int>(ra_bid_x());
  const int head = static_cast<int>(ra_bid_y());
  const int64_t q_row = ra_load_index(p.query_start_loc, seq, p.query_start_loc_is64);
  if (ra_load_index(p.query_start_loc, seq + 1, p.query_start_loc_is64) - q_row != 1) return;
  const int D = p.head_size, S = p.num_splits;
  const int tid = static_cast<int>(ra_tid()), nt = static_cast<int>(ra_ntid());
  const int nq = D / 4, q = tid % nq, grp = tid / nq, G = nt / nq;
  RA_DYNAMIC_SMEM(smem);
  float* s_max = reinterpret_cast<float*>(smem);  // [S]
  float* s_sum = s_max + S;                       // [S]
  float* part = s_sum + S;                        // [G][D] per-group channel sums
  float* part_l = part + G * D;                   // [G]
  float* warp_max = part_l + G;                   // [nt / warp]
  const int64_t row0 = (static_cast<int64_t>(seq) * p.num_heads + head) * S;
  float mx = RA_NEG_INF;
  for (int s = tid; s < S; s += nt) {
    const float m = p.part_ml[(row0 + s) * 2];
    s_max[s] = m;
    s_sum[s] = p.part_ml[(row0 + s) * 2 + 1];
    mx = mx > m ? mx : m;
  }
#pragma unroll
  for (int m = RA_WARP_SIZE / 2; m >= 1; m /= 2) {
    const float o = ra_shfl_xor(mx, m);
    mx = mx > o ? mx : o;
  }
  if (tid % RA_WARP_SIZE == 0) warp_max[tid / RA_WARP_SIZE] = mx;
  ra_syncthreads();
  for (int w = 0; w < nt / RA_WARP_SIZE; ++w) mx = mx > warp_max[w] ? mx : warp_max[w];
  float a[4] = {0.0f, 0.0f, 0.0f, 0.0f}, l = 0.0f;
  if (mx != RA_NEG_INF) {
#pragma unroll 4
    for (int s = grp; s < S; s += G) {
      const float f = ra_exp2(s_max[s] - mx);  // an empty split (max -inf) weighs 0
      const float* row = p.part_acc + (row0 + s) * D + 4 * q;
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] += f * row[i];
      l += f * s_sum[s];
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) part[grp * D + 4 * q + i] = a[i];
  if (q == 0) part_l[grp] = l;
  ra_syncthreads();
  const float v_mul = is_fp8 ? p.v_scale[0] * v_factor : 1.0f;
  for (int d = tid; d < D; d += nt) {
    float ad = 0.0f, ld = 0.0f;
    for (int g = 0; g < G; ++g) {
      ad += part[g * D + d];
      ld += part_l[g];
    }
    const float o = ra_finish(ad, mx, ld, p.sinks, head, v_mul);
    ra_store_model(p.out, q_row * p.out_stride_t + static_cast<int64_t>(head) * p.out_stride_h + d, o,
                   p.model_dtype);
  }
}

}  // namespace rocm_attn_native
