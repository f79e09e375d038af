// Torch glue of the native kernels: plain pybind11 functions taking at::Tensor.
//
// The kernels are called from inside the project's own custom ops (rocm_attn::*), which
// already carry schemas and fake kernels; registering them again with TORCH_LIBRARY would
// add a dispatcher hop and a second schema to keep in sync, for nothing. Argument checks
// that users can trip live in the Python wrapper (inductor_rocm_attn/kernels/native.py,
// testable without a GPU); the TORCH_CHECKs here guard the C++ entry points themselves.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <optional>

#include "native_api.h"

namespace {

using rocm_attn_native::DType;

DType dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kFloat: return DType::kFloat32;
    case at::kFloat8_e4m3fn: return DType::kFp8E4M3FN;
    case at::kFloat8_e4m3fnuz: return DType::kFp8E4M3FNUZ;
    case at::kFloat8_e5m2: return DType::kFp8E5M2;
    case at::kFloat8_e5m2fnuz: return DType::kFp8E5M2FNUZ;
    default: TORCH_CHECK(false, "rocm_attn native: dtype ", t, " is not supported");
  }
}

int32_t is64(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, "rocm_attn native: index tensor dtype ",
              t.scalar_type(), " is not supported; supported: int32, int64");
  return t.scalar_type() == at::kLong ? 1 : 0;
}

const float* f32_or_null(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "rocm_attn native: expected contiguous fp32");
  return t->data_ptr<float>();
}

// K and V interiors of a logical [num_blocks, 2, block_size, num_kv_heads * head_size] cache.
void cache_bases(const at::Tensor& kv_cache, const void** k, const void** v, int64_t* block_stride) {
  auto* base = static_cast<const char*>(kv_cache.data_ptr());
  *k = base;
  *v = base + kv_cache.stride(1) * kv_cache.element_size();
  *block_stride = kv_cache.stride(0);
}

void paged_decode(at::Tensor out, at::Tensor query, at::Tensor kv_cache, at::Tensor query_start_loc,
                  at::Tensor seq_lens, at::Tensor block_table, double scale, at::Tensor k_scale, at::Tensor v_scale,
                  int64_t sliding_window, std::optional<at::Tensor> alibi_slopes, std::optional<at::Tensor> sinks,
                  double logits_soft_cap, bool interleaved_v, int64_t num_kv_heads, int64_t num_splits,
                  int64_t num_warps, int64_t stages, int64_t warp_size, int64_t max_smem, bool tensor_cores,
                  std::optional<at::Tensor> merge_counters) {
  const c10::cuda::CUDAGuard guard(query.device());
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "rocm_attn native: query/output channels must be contiguous");
  rocm_attn_native::DecodeParams p{};
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t num_heads = query.size(1), head_size = query.size(2);
  at::Tensor part_acc, part_ml;
  if (num_splits > 1) {
    auto f = query.options().dtype(at::kFloat);
    part_acc = at::empty({num_seqs, num_heads, num_splits, head_size}, f);
    part_ml = at::empty({num_seqs, num_heads, num_splits, 2}, f);
    p.part_acc = part_acc.data_ptr<float>();
    p.part_ml = part_ml.data_ptr<float>();
    if (merge_counters.has_value()) {
      TORCH_CHECK(merge_counters->scalar_type() == at::kInt && merge_counters->is_contiguous() &&
                      merge_counters->device() == query.device(),
                  "rocm_attn native: merge_counters must be contiguous int32 on the query's device");
      p.merge_counters = merge_counters->data_ptr<int32_t>();
    }
  }
  p.out = out.data_ptr();
  p.out_stride_t = out.stride(0);
  p.out_stride_h = out.stride(1);
  p.query = query.data_ptr();
  p.q_stride_t = query.stride(0);
  p.q_stride_h = query.stride(1);
  cache_bases(kv_cache, &p.k_cache, &p.v_cache, &p.cache_block_stride);
  p.block_table = block_table.data_ptr();
  p.block_table_stride = block_table.stride(0);
  p.seq_lens = seq_lens.data_ptr();
  p.query_start_loc = query_start_loc.data_ptr();
  p.k_scale = k_scale.data_ptr<float>();
  p.v_scale = v_scale.data_ptr<float>();
  p.alibi_slopes = f32_or_null(alibi_slopes);
  p.sinks = f32_or_null(sinks);
  p.scale = static_cast<float>(scale);
  p.logits_soft_cap = static_cast<float>(logits_soft_cap);
  p.sliding_window = static_cast<int32_t>(sliding_window);
  p.num_seqs = static_cast<int32_t>(num_seqs);
  p.num_heads = static_cast<int32_t>(num_heads);
  p.num_kv_heads = static_cast<int32_t>(num_kv_heads);
  p.head_size = static_cast<int32_t>(head_size);
  p.block_size = static_cast<int32_t>(kv_cache.size(2));
  p.num_splits = static_cast<int32_t>(num_splits);
  p.model_dtype = static_cast<int32_t>(dtype_code(query.scalar_type()));
  p.cache_dtype = static_cast<int32_t>(dtype_code(kv_cache.scalar_type()));
  p.block_table_is64 = is64(block_table);
  p.seq_lens_is64 = is64(seq_lens);
  p.query_start_loc_is64 = is64(query_start_loc);
  p.interleaved_v = interleaved_v ? 1 : 0;
  rocm_attn_native::DecodeConfig cfg{static_cast<int32_t>(num_warps), static_cast<int32_t>(stages),
                                     static_cast<int32_t>(warp_size), static_cast<int32_t>(max_smem),
                                     tensor_cores ? 1 : 0};
  const int rc = rocm_attn_native::paged_decode(p, cfg, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(rc == 0, "rocm_attn native ", rocm_attn_native::last_error());
}

void reshape_and_cache(at::Tensor key, at::Tensor value, at::Tensor kv_cache, at::Tensor slot_mapping,
                       at::Tensor k_scale, at::Tensor v_scale, bool interleaved_v, int64_t variant) {
  const c10::cuda::CUDAGuard guard(key.device());
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "rocm_attn native: key/value channels must be contiguous");
  rocm_attn_native::CacheWriteParams p{};
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.key_stride_t = key.stride(0);
  p.key_stride_h = key.stride(1);
  p.value_stride_t = value.stride(0);
  p.value_stride_h = value.stride(1);
  const void* k;
  const void* v;
  cache_bases(kv_cache, &k, &v, &p.cache_block_stride);
  p.k_cache = const_cast<void*>(k);
  p.v_cache = const_cast<void*>(v);
  p.slot_mapping = slot_mapping.data_ptr();
  p.slot_mapping_is64 = is64(slot_mapping);
  p.k_scale = k_scale.data_ptr<float>();
  p.v_scale = v_scale.data_ptr<float>();
  p.num_tokens = static_cast<int32_t>(slot_mapping.size(0));
  p.num_kv_heads = static_cast<int32_t>(key.size(1));
  p.head_size = static_cast<int32_t>(key.size(2));
  p.block_size = static_cast<int32_t>(kv_cache.size(2));
  p.input_dtype = static_cast<int32_t>(dtype_code(key.scalar_type()));
  p.cache_dtype = static_cast<int32_t>(dtype_code(kv_cache.scalar_type()));
  p.interleaved_v = interleaved_v ? 1 : 0;
  const int64_t eb = key.element_size();
  auto aligned = [eb](const at::Tensor& t) {
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && (t.stride(0) * eb) % 16 == 0 &&
           (t.stride(1) * eb) % 16 == 0;
  };
  p.vector_loads = aligned(key) && aligned(value) ? 1 : 0;
  p.variant = static_cast<int32_t>(variant);  // WriterVariant; 0: the launcher's rule
  const int rc = rocm_attn_native::reshape_and_cache(p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(rc == 0, "rocm_attn native ", rocm_attn_native::last_error());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "inductor_rocm_attn native kernels (csrc/)";
  m.def("paged_decode", &paged_decode, "paged decode over the KV cache (query_len == 1)");
  m.def("reshape_and_cache", &reshape_and_cache, "K/V -> paged KV cache");
}
