// Host API of the native kernels: plain C++ (no torch, no CUDA/HIP headers).
//
// bindings.cpp (the only file that sees torch) fills these structs from tensors and calls
// the launchers; the kernel translation units implement them. Pointers are device
// pointers; strides are in elements; `stream` is a cudaStream_t / hipStream_t.
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace rocm_attn_native {

enum class DType : int32_t {
  kFloat16 = 0,
  kBFloat16 = 1,
  kFloat32 = 2,
  kFp8E4M3FN = 3,
  kFp8E4M3FNUZ = 4,
  kFp8E5M2 = 5,
  kFp8E5M2FNUZ = 6,
};

// Paged decode: one query token per sequence (query_len == 1), the token at position
// seq_len - 1, every key (its own included) read from the cache.
struct DecodeParams {
  void* out;                   // [num_tokens, num_heads, head_size] model dtype
  int64_t out_stride_t, out_stride_h;
  const void* query;           // [num_tokens, num_heads, head_size] model dtype
  int64_t q_stride_t, q_stride_h;
  const void* k_cache;         // K interior [num_blocks, num_kv_heads, head_size/x, block_size, x]
  const void* v_cache;         // V interior: standard [.., head_size, block_size] or
                               // interleaved [.., block_size/x, head_size, x]
  int64_t cache_block_stride;  // elements from one block to the next (K and V alike)
  const void* block_table;     // [num_seqs, block_table_stride] int32/int64
  int64_t block_table_stride;
  const void* seq_lens;        // [num_seqs] int32/int64
  const void* query_start_loc; // [num_seqs + 1] int32/int64
  const float* k_scale;        // [1] fp32, read for fp8 caches only
  const float* v_scale;
  const float* alibi_slopes;   // [num_heads] fp32 or null
  const float* sinks;          // [num_heads] fp32 or null (natural-log logits)
  float* part_acc;             // [num_seqs, num_heads, num_splits, head_size] when num_splits > 1
  float* part_ml;              // [num_seqs, num_heads, num_splits, 2] (max in log2 units, sum)
  int32_t* merge_counters;     // null: a second kernel merges the splits; else one zeroed counter
                               // per (sequence, KV head, head chunk), and the last split CTA of
                               // each merges them and sets its counter back to 0
  float scale;
  float logits_soft_cap;       // <= 0: off
  int32_t sliding_window;      // <= 0: off; else keys with q_pos - k_pos < sliding_window
  int32_t num_seqs, num_heads, num_kv_heads, head_size, block_size, num_splits;
  int32_t model_dtype, cache_dtype;  // DType
  int32_t block_table_is64, seq_lens_is64, query_start_loc_is64;
  int32_t interleaved_v;
};

struct DecodeConfig {
  int32_t num_warps;       // warps per CTA; each warp streams its own tiles of 16 keys
  int32_t stages;          // tiles in flight per warp (2..4)
  int32_t warp_size;       // of the device (32 NVIDIA, 64 CDNA)
  int32_t max_smem_bytes;  // dynamic shared memory a CTA may use on this device
  int32_t tensor_cores;    // 1: the mma kernel (NVIDIA sm_80+ builds only), 0: CUDA-core dot products
};

// Query heads of one KV head that one CTA handles (1, 2, 4 or 8); GQA ratios above 8 take
// ceil(gqa / 8) CTAs per KV head.
int decode_heads_per_cta(int gqa);
// Dynamic shared memory of one decode CTA.
size_t decode_smem_bytes(int head_size, int cache_elem_bytes, int heads_per_cta, int num_warps,
                         int stages);
// Launches the decode kernel (and the split reduction when num_splits > 1). Returns 0, or
// non-zero with last_error() describing the problem.
int paged_decode(const DecodeParams& p, const DecodeConfig& cfg, void* stream);

// Cache-writer kernels (CacheWriteParams::variant). kAuto: writer_variant_for(num_tokens).
//   kScatter: no shared memory, no barrier; a thread owns one packet (x channels) of one
//     (token, head): K stored as one 16-byte packet, V as x element stores (decode batches).
//   kTile8 / kTile16 / kTile32: a CTA writes that many tokens of one KV head; V transposed
//     through shared memory so consecutive slots become 16-byte stores (prefill).
enum class WriterVariant : int32_t {
  kAuto = 0,
  kScatter = 1,
  kTile8 = 2,
  kTile16 = 3,
  kTile32 = 4,
};

struct CacheWriteParams {
  const void* key;    // [num_tokens, num_kv_heads, head_size], last dim contiguous
  const void* value;
  int64_t key_stride_t, key_stride_h, value_stride_t, value_stride_h;
  void* k_cache;      // interiors as in DecodeParams
  void* v_cache;
  int64_t cache_block_stride;
  const void* slot_mapping;  // [num_tokens] int32/int64; < 0: padding, skipped
  const float* k_scale;      // [1] fp32, fp8 caches: stored = value / scale, saturated
  const float* v_scale;
  int32_t num_tokens, num_kv_heads, head_size, block_size;
  int32_t input_dtype, cache_dtype;  // DType
  int32_t slot_mapping_is64;
  int32_t interleaved_v;
  int32_t vector_loads;  // key and value rows are 16-byte aligned (bases and strides)
  int32_t variant;       // WriterVariant
};

// The kernel kAuto launches for num_tokens tokens.
WriterVariant writer_variant_for(int32_t num_tokens);
int reshape_and_cache(const CacheWriteParams& p, void* stream);

const char* last_error();

}  // namespace rocm_attn_native
