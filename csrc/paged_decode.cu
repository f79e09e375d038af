// Host launcher of the paged decode kernels: picks the instantiation (cache dtype, head size,
// heads per CTA), checks the launch configuration and launches decode (+ split reduction).
#include "launch_util.h"
#include "paged_decode.cuh"
#include "paged_decode_mma.cuh"

namespace rocm_attn_native {

std::string& error_slot() {
  static thread_local std::string slot;
  return slot;
}

const char* last_error() { return error_slot().c_str(); }

int decode_heads_per_cta(int gqa) {
  if (gqa <= 1) return 1;
  if (gqa <= 2) return 2;
  if (gqa <= 4) return 4;
  return 8;
}

size_t decode_smem_bytes(int head_size, int cache_elem_bytes, int heads_per_cta, int num_warps, int stages) {
  return static_cast<size_t>(DecodeSmem(head_size, cache_elem_bytes, heads_per_cta, num_warps, stages).total);
}

namespace {

template <int CK, int D, int GT>
int launch_decode(const DecodeParams& p, const DecodeConfig& cfg, const DecodeRuntime& rt, void* stream) {
  using K = CacheKind<CK>;
  auto* kernel = &paged_decode_kernel<CK, D, GT>;
#if defined(RA_HAS_TENSOR_CORE_KERNEL)
  if (cfg.tensor_cores) {
    if (cfg.warp_size != 32) return fail("paged_decode: the tensor-core kernel needs 32-lane warps");
    kernel = &paged_decode_mma_kernel<CK, D, GT>;
  }
#else
  if (cfg.tensor_cores) return fail("paged_decode: this build has no tensor-core kernel (HIP)");
#endif
  const int smem = static_cast<int>(decode_smem_bytes(D, K::kBytes, GT, cfg.num_warps, cfg.stages));
  if (smem > cfg.max_smem_bytes)
    return fail("paged_decode: %d warps x %d stages need %d bytes of shared memory, the device allows %d",
                cfg.num_warps, cfg.stages, smem, cfg.max_smem_bytes);
  static int allowed[2] = {48 * 1024, 48 * 1024};  // per kernel: raise the opt-in limit once
  int& limit = allowed[cfg.tensor_cores ? 1 : 0];
  if (smem > limit) {
    if (ra_allow_smem(kernel, smem) != 0)
      return fail("paged_decode: could not raise the shared-memory limit to %d bytes", smem);
    limit = smem;
  }
  if (p.num_splits > 1 && p.merge_counters != nullptr &&
      static_cast<int>((4 + GT * (p.num_splits + 2)) * sizeof(float)) > smem)
    return fail("paged_decode: merging %d splits in the last split CTA needs more shared memory than its %d bytes",
                p.num_splits, smem);
  const ra_grid grid = {static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(p.num_kv_heads * rt.head_chunks),
                        static_cast<unsigned>(p.num_splits)};
  ra_launch(kernel, grid, static_cast<unsigned>(cfg.num_warps * cfg.warp_size), static_cast<size_t>(smem), stream,
            p, rt, static_cast<int>(cfg.stages));
  if (const char* e = ra_launch_error()) return fail("paged_decode: launch failed: %s", e);
  if (p.num_splits > 1 && p.merge_counters == nullptr) {
    const ra_grid rgrid = {static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(p.num_heads), 1u};
    ra_launch(&paged_decode_reduce_kernel, rgrid, static_cast<unsigned>(kReduceThreads),
              static_cast<size_t>(reduce_smem_bytes(p.num_splits, D)), stream, p, rt.v_factor,
              static_cast<int>(K::kFp8));
    if (const char* e = ra_launch_error()) return fail("paged_decode: reduce launch failed: %s", e);
  }
  return 0;
}

template <int CK, int D>
int dispatch_gt(const DecodeParams& p, const DecodeConfig& cfg, const DecodeRuntime& rt, int gt, void* stream) {
  switch (gt) {
    case 1: return launch_decode<CK, D, 1>(p, cfg, rt, stream);
    case 2: return launch_decode<CK, D, 2>(p, cfg, rt, stream);
    case 4: return launch_decode<CK, D, 4>(p, cfg, rt, stream);
    default: return launch_decode<CK, D, 8>(p, cfg, rt, stream);
  }
}

template <int CK>
int dispatch_head(const DecodeParams& p, const DecodeConfig& cfg, const DecodeRuntime& rt, int gt, void* stream) {
  switch (p.head_size) {
    case 64: return dispatch_gt<CK, 64>(p, cfg, rt, gt, stream);
    case 128: return dispatch_gt<CK, 128>(p, cfg, rt, gt, stream);
    default: return fail("paged_decode: head_size %d is not supported; supported: 64, 128", p.head_size);
  }
}

}  // namespace

int paged_decode(const DecodeParams& p, const DecodeConfig& cfg, void* stream) {
  if (p.num_seqs == 0) return 0;
  if (cfg.warp_size != 32 && cfg.warp_size != 64)
    return fail("paged_decode: warp size %d is not supported; supported: 32, 64", cfg.warp_size);
  if (cfg.num_warps < 1 || cfg.num_warps * cfg.warp_size > 256)
    return fail("paged_decode: num_warps %d is not supported; supported: 1 .. %d", cfg.num_warps,
                256 / cfg.warp_size);
  if (cfg.stages < 2 || cfg.stages > 4)
    return fail("paged_decode: stages %d is not supported; supported: 2, 3, 4", cfg.stages);
  if (p.block_size <= 0 || p.block_size % kTile != 0)
    return fail("paged_decode: block_size %d is not supported; it must be a multiple of %d", p.block_size, kTile);
  if (p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0)
    return fail("paged_decode: num_heads %d is not a multiple of num_kv_heads %d", p.num_heads, p.num_kv_heads);
  const int gqa = p.num_heads / p.num_kv_heads;
  const int gt = decode_heads_per_cta(gqa);
  DecodeRuntime rt;
  rt.head_chunks = (gqa + gt - 1) / gt;
  rt.k_factor = rt.v_factor = 1.0f;
  switch (static_cast<DType>(p.cache_dtype)) {
    case DType::kBFloat16: return dispatch_head<static_cast<int>(DType::kBFloat16)>(p, cfg, rt, gt, stream);
    case DType::kFloat16: return dispatch_head<static_cast<int>(DType::kFloat16)>(p, cfg, rt, gt, stream);
#define RA_FP8_CASE(E)                                                  \
  case DType::E:                                                        \
    rt.k_factor = rt.v_factor = CacheKind<static_cast<int>(DType::E)>::kDecodeFactor; \
    return dispatch_head<static_cast<int>(DType::E)>(p, cfg, rt, gt, stream);
    RA_FP8_CASE(kFp8E4M3FN)
    RA_FP8_CASE(kFp8E5M2)
#if defined(RA_HIP) || defined(RA_EMULATE)
    RA_FP8_CASE(kFp8E4M3FNUZ)
    RA_FP8_CASE(kFp8E5M2FNUZ)
#endif
#undef RA_FP8_CASE
    default: return fail("paged_decode: cache dtype %d is not supported by this build", p.cache_dtype);
  }
}

}  // namespace rocm_attn_native
