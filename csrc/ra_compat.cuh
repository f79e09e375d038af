// Compatibility layer of the native kernels: one source for CUDA, HIP and a CPU emulation.
//
// Kernel sources include only this header (never torch). It provides
// - qualifiers and thread indices (RA_DEVICE, RA_GLOBAL, ra_tid(), ra_bid_x() ...);
// - RA_WARP_SIZE, a macro of the device pass: 32 on NVIDIA, the wavefront size of the target
//   on AMD (64 on gfx9 / CDNA, 32 on RDNA). Since ROCm 7 `warpSize` is no compile-time
//   constant, so kernels never use it; host code asks the runtime (ra_device_warp_size());
// - warp shuffles, warp and block barriers, 16-byte global->shared copies (cp.async on
//   sm_80+, a plain copy elsewhere);
// - bit-exact conversions: bf16 / fp16 <-> fp32 and the fp8 formats e4m3fn, e4m3fnuz (MI300),
//   e5m2, e5m2fnuz (CacheKind selects one at compile time).
// With RA_EMULATE (tests only) the kernels compile with a host C++ compiler and run on the
// CPU, one fiber per GPU thread (emulate/cpu_emulation.h).
#pragma once

#include <stdint.h>

#include "native_api.h"

#if defined(RA_EMULATE)
#include "emulate/cpu_emulation.h"
#elif defined(__HIP__) || defined(__HIP_PLATFORM_AMD__) || defined(__HIP_PLATFORM_HCC__)
#define RA_HIP 1
#include <hip/hip_runtime.h>
#else
#define RA_CUDA 1
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#endif

// ---- qualifiers, indices, warp size ---------------------------------------------------------
#if defined(RA_EMULATE)
#define RA_DEVICE inline
#define RA_HOST_DEVICE inline
#define RA_GLOBAL
#define RA_LAUNCH_BOUNDS(n)
#define RA_RESTRICT
#else
#define RA_DEVICE __device__ __forceinline__
#define RA_HOST_DEVICE __host__ __device__ __forceinline__
#define RA_GLOBAL __global__
#define RA_LAUNCH_BOUNDS(n) __launch_bounds__(n)
#define RA_RESTRICT __restrict__
RA_DEVICE unsigned ra_tid() { return threadIdx.x; }
RA_DEVICE unsigned ra_ntid() { return blockDim.x; }
RA_DEVICE unsigned ra_bid_x() { return blockIdx.x; }
RA_DEVICE unsigned ra_bid_y() { return blockIdx.y; }
RA_DEVICE unsigned ra_bid_z() { return blockIdx.z; }
#endif

#if defined(RA_CUDA)
#define RA_WARP_SIZE 32
#elif defined(RA_HIP)
#if defined(__AMDGCN_WAVEFRONT_SIZE__)
#define RA_WARP_SIZE __AMDGCN_WAVEFRONT_SIZE__
#elif defined(__AMDGCN_WAVEFRONT_SIZE)
#define RA_WARP_SIZE __AMDGCN_WAVEFRONT_SIZE
#elif defined(__GFX10__) || defined(__GFX11__) || defined(__GFX12__)
#define RA_WARP_SIZE 32
#else  // gfx9 (CDNA) and the host pass, where kernels are parsed but not generated
#define RA_WARP_SIZE 64
#endif
#endif

// The dynamic shared memory of a kernel, 16-byte aligned.
#if defined(RA_EMULATE)
#define RA_DYNAMIC_SMEM(name) unsigned char* name = ra_emu::dynamic_smem()
#else
#define RA_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

// ---- barriers and shuffles -----------------------------------------------------------------
#if defined(RA_CUDA)
RA_DEVICE void ra_syncwarp() { __syncwarp(); }
RA_DEVICE void ra_syncthreads() { __syncthreads(); }
template <typename T>
RA_DEVICE T ra_shfl_xor(T v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
#elif defined(RA_HIP)
// A wavefront runs in lockstep; the fences keep the compiler from moving LDS accesses across.
RA_DEVICE void ra_syncwarp() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
}
RA_DEVICE void ra_syncthreads() { __syncthreads(); }
template <typename T>
RA_DEVICE T ra_shfl_xor(T v, int mask) { return __shfl_xor(v, mask); }
#else
RA_DEVICE void ra_syncwarp() { ra_emu::sync_warp(); }
RA_DEVICE void ra_syncthreads() { ra_emu::sync_block(); }
template <typename T>
RA_DEVICE T ra_shfl_xor(T v, int mask) { return ra_emu::shfl_xor(v, mask); }
#endif

// ---- device-wide ordering (the last split program's merge) -----------------------------------
#if defined(RA_EMULATE)  // CTAs run one after another: program order is enough
RA_DEVICE void ra_threadfence() {}
RA_DEVICE int ra_atomic_add(int* p, int v) {
  const int old = *p;
  *p = old + v;
  return old;
}
#else
RA_DEVICE void ra_threadfence() { __threadfence(); }
RA_DEVICE int ra_atomic_add(int* p, int v) { return atomicAdd(p, v); }
#endif
// A read that goes to the device-coherent level (L2), never a stale L1 line: another CTA
// wrote the value.
template <typename T>
RA_DEVICE T ra_load_coherent(const T* p) { return *static_cast<const volatile T*>(p); }

// ---- bit casts and 16-byte vectors --------------------------------------------------------
#if defined(RA_EMULATE)
RA_DEVICE float ra_bits_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
RA_DEVICE uint32_t ra_float_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
struct ra_u128 { uint32_t x, y, z, w; };
struct ra_u64 { uint32_t x, y; };
#else
RA_DEVICE float ra_bits_float(uint32_t u) { return __uint_as_float(u); }
RA_DEVICE uint32_t ra_float_bits(float f) { return __float_as_uint(f); }
typedef uint4 ra_u128;
typedef uint2 ra_u64;
#endif

// ---- asynchronous 16-byte copies global -> shared -------------------------------------------
#if defined(RA_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define RA_HAS_CP_ASYNC 1
#endif

RA_DEVICE void ra_copy16_async(void* smem, const void* gmem) {
#if defined(RA_HAS_CP_ASYNC)
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
#else
  *reinterpret_cast<ra_u128*>(smem) = *reinterpret_cast<const ra_u128*>(gmem);
#endif
}

RA_DEVICE void ra_copy_commit() {
#if defined(RA_HAS_CP_ASYNC)
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Wait until at most `pending` committed groups of this thread are still in flight.
RA_DEVICE void ra_copy_wait(int pending) {
#if defined(RA_HAS_CP_ASYNC)
  switch (pending) {
    case 0: asm volatile("cp.async.wait_group 0;\n" ::); break;
    case 1: asm volatile("cp.async.wait_group 1;\n" ::); break;
    case 2: asm volatile("cp.async.wait_group 2;\n" ::); break;
    default: asm volatile("cp.async.wait_group 3;\n" ::); break;
  }
#else
  (void)pending;
#endif
}

// ---- math ------------------------------------------------------------------------------------
#if defined(RA_EMULATE)
RA_DEVICE float ra_exp2(float x) { return exp2f(x); }
RA_DEVICE float ra_tanh(float x) { return tanhf(x); }
#else
RA_DEVICE float ra_exp2(float x) { return exp2f(x); }
RA_DEVICE float ra_tanh(float x) { return tanhf(x); }
#endif
constexpr float RA_LOG2E = 1.4426950408889634f;

// log2 of a power of two (> 0).
#if defined(RA_EMULATE)
RA_DEVICE int ra_log2_pow2(int x) { return __builtin_ctz(static_cast<unsigned>(x)); }
#else
RA_DEVICE int ra_log2_pow2(int x) { return __ffs(x) - 1; }
#endif
#define RA_NEG_INF (-__builtin_huge_valf())

// ---- 16-bit floats -------------------------------------------------------------------------
RA_DEVICE float ra_bf16_to_float(uint16_t b) { return ra_bits_float(static_cast<uint32_t>(b) << 16); }

// Round to nearest even, NaN stays NaN (as torch's float -> bfloat16).
RA_DEVICE uint16_t ra_float_to_bf16(float f) {
  uint32_t u = ra_float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7fc0u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

#if defined(RA_CUDA)
RA_DEVICE float ra_fp16_to_float(uint16_t h) { return __half2float(__ushort_as_half(h)); }
RA_DEVICE uint16_t ra_float_to_fp16(float f) { return __half_as_ushort(__float2half_rn(f)); }
#elif defined(RA_HIP)
RA_DEVICE float ra_fp16_to_float(uint16_t h) { return static_cast<float>(__builtin_bit_cast(_Float16, h)); }
RA_DEVICE uint16_t ra_float_to_fp16(float f) { return __builtin_bit_cast(uint16_t, static_cast<_Float16>(f)); }
#else
// Software IEEE half, exact (the emulation has no half type).
RA_DEVICE float ra_fp16_to_float(uint16_t h) {
  uint32_t s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return ra_bits_float(s | 0x7f800000u | (m << 13));
  if (e == 0) return (s ? -1.0f : 1.0f) * static_cast<float>(m) * 5.9604644775390625e-08f;  // m * 2^-24
  return ra_bits_float(s | ((e + 112u) << 23) | (m << 13));
}
RA_DEVICE uint16_t ra_float_to_fp16(float f) {
  uint32_t u = ra_float_bits(f), s = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(s | 0x7e00u);
  if (a >= 0x477ff000u) return static_cast<uint16_t>(s | 0x7c00u);  // rounds to >= 65520: inf
  if (a < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal, quantum 2^-24
    float q = ra_bits_float(a) * 16777216.0f;  // exact: a power-of-two scaling
    return static_cast<uint16_t>(s | static_cast<uint32_t>(nearbyintf(q)));
  }
  a += 0xfffu + ((a >> 13) & 1u);
  return static_cast<uint16_t>(s | ((a - (112u << 23)) >> 13));
}
#endif

// ---- fp8 -------------------------------------------------------------------------------------
// Decoding goes through the bits of a half: for e4m3 the 7 low bits move into the half's
// exponent and mantissa, so half(bits) = value * 2^-8 (fn, bias 7) or 2^-7 (fnuz, bias 8);
// for e5m2 the byte is the top byte of a half (bias 15; fnuz: bias 16, half = 2 * value).
// kDecodeFactor undoes the power of two; kernels fold it into k_scale / v_scale.
template <int CK>
struct CacheKind;

template <>
struct CacheKind<static_cast<int>(rocm_attn_native::DType::kBFloat16)> {
  static constexpr int kBytes = 2;
  static constexpr bool kFp8 = false;
  static constexpr float kDecodeFactor = 1.0f;
  RA_DEVICE static float to_float(uint32_t raw) { return ra_bf16_to_float(static_cast<uint16_t>(raw)); }
  RA_DEVICE static uint32_t from_float(float f) { return ra_float_to_bf16(f); }
};

template <>
struct CacheKind<static_cast<int>(rocm_attn_native::DType::kFloat16)> {
  static constexpr int kBytes = 2;
  static constexpr bool kFp8 = false;
  static constexpr float kDecodeFactor = 1.0f;
  RA_DEVICE static float to_float(uint32_t raw) { return ra_fp16_to_float(static_cast<uint16_t>(raw)); }
  RA_DEVICE static uint32_t from_float(float f) { return ra_float_to_fp16(f); }
};

// Round-to-nearest-even encoding of a finite, already saturated value (or NaN) into an fp8
// format with EB exponent bits, MB mantissa bits and bias BIAS. FNUZ formats have no negative
// zero and one NaN (0x80); the others keep the sign of zero and encode NaN as all ones.
template <int EB, int MB, int BIAS, bool FNUZ>
RA_DEVICE uint32_t ra_float_to_fp8(float f) {
  uint32_t u = ra_float_bits(f);
  uint32_t sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return FNUZ ? 0x80u : (sign | 0x7fu);
  uint32_t code;
  if (a < static_cast<uint32_t>(128 - BIAS) << 23) {  // below the smallest normal: 2^(1-BIAS)
    // subnormal (or zero): quantum 2^(1-BIAS-MB); the scaling is exact, rint rounds to even
    float q = ra_bits_float(a) * ra_bits_float(static_cast<uint32_t>(127 + BIAS + MB - 1) << 23);
    code = static_cast<uint32_t>(rintf(q));  // may round up into the first normal: same bits
  } else {
    constexpr int shift = 23 - MB;
    a += (1u << (shift - 1)) - 1u + ((a >> shift) & 1u);
    code = (a >> shift) - (static_cast<uint32_t>(127 - BIAS) << MB);
  }
  if (FNUZ && code == 0) return 0u;
  return sign | code;
}

#define RA_FP8_KIND(ENUM, EB, MB, BIAS, FNUZ, HALF_BITS, FACTOR)                                  \
  template <>                                                                                     \
  struct CacheKind<static_cast<int>(rocm_attn_native::DType::ENUM)> {                              \
    static constexpr int kBytes = 1;                                                              \
    static constexpr bool kFp8 = true;                                                            \
    static constexpr float kDecodeFactor = FACTOR;                                                \
    RA_DEVICE static uint16_t to_half_bits(uint32_t b) { return HALF_BITS; }                       \
    RA_DEVICE static float to_float(uint32_t b) { return ra_fp16_to_float(HALF_BITS); }           \
    RA_DEVICE static uint32_t from_float(float f) { return ra_float_to_fp8<EB, MB, BIAS, FNUZ>(f); } \
  };

RA_FP8_KIND(kFp8E4M3FN, 4, 3, 7, false, static_cast<uint16_t>(((b & 0x80u) << 8) | ((b & 0x7fu) << 7)), 256.0f)
RA_FP8_KIND(kFp8E4M3FNUZ, 4, 3, 8, true, static_cast<uint16_t>(((b & 0x80u) << 8) | ((b & 0x7fu) << 7)), 128.0f)
RA_FP8_KIND(kFp8E5M2, 5, 2, 15, false, static_cast<uint16_t>(b << 8), 1.0f)
RA_FP8_KIND(kFp8E5M2FNUZ, 5, 2, 16, true, static_cast<uint16_t>(b << 8), 0.5f)
#undef RA_FP8_KIND

// Eight cache elements from shared memory (16 bytes of a 16-bit type, 8 bytes of fp8) as
// floats (fp8: times 1 / kDecodeFactor).
template <int CK>
RA_DEVICE void ra_load8(const unsigned char* p, float out[8]) {
  using K = CacheKind<CK>;
  if constexpr (K::kBytes == 2) {
    ra_u128 v = *reinterpret_cast<const ra_u128*>(p);
    uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = K::to_float(w[i] & 0xffffu);
      out[2 * i + 1] = K::to_float(w[i] >> 16);
    }
  } else {
    ra_u64 v = *reinterpret_cast<const ra_u64*>(p);
    uint32_t w[2] = {v.x, v.y};
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = K::to_float((w[i / 4] >> (8 * (i % 4))) & 0xffu);
  }
}

// Model-dtype scalars (query, output, writer input), chosen at run time: they are touched
// once per row, not per cache element.
//
// ra_load_model_all: N values x[index(0)], .. x[index(N - 1)] of the model dtype as floats, with the dtype branch
// around all the loads: with a branch per load the compiler did not issue them together, and
// each waited a global round trip for the one before (Nsight Compute, the decode's 32 query
// loads a lane: about 8 round trips before the first tile).
template <int N, typename Index>
RA_DEVICE void ra_load_model_all(const void* x, int dtype, float (&v)[N], Index index) {
  using rocm_attn_native::DType;
  if (dtype == static_cast<int>(DType::kBFloat16) || dtype == static_cast<int>(DType::kFloat16)) {
    uint16_t r[N];
#pragma unroll
    for (int i = 0; i < N; ++i) r[i] = static_cast<const uint16_t*>(x)[index(i)];
    const bool bf16 = dtype == static_cast<int>(DType::kBFloat16);
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = bf16 ? ra_bf16_to_float(r[i]) : ra_fp16_to_float(r[i]);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = static_cast<const float*>(x)[index(i)];
  }
}

RA_DEVICE void ra_store_model(void* p, int64_t i, float v, int dtype) {
  using rocm_attn_native::DType;
  if (dtype == static_cast<int>(DType::kBFloat16)) static_cast<uint16_t*>(p)[i] = ra_float_to_bf16(v);
  else if (dtype == static_cast<int>(DType::kFloat16)) static_cast<uint16_t*>(p)[i] = ra_float_to_fp16(v);
  else static_cast<float*>(p)[i] = v;
}

// Index tensors (seq_lens, query_start_loc, block_table, slot_mapping) are int32 or int64.
RA_DEVICE int64_t ra_load_index(const void* p, int64_t i, int is64) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

// ---- tensor cores (NVIDIA sm_80+; emulated for the tests) ------------------------------------
// ldmatrix .x4: lane L gives the address of row L % 8 of 8x8 matrix L / 8 (16 bytes of 16-bit
// values); r[m] receives row lane / 4, elements 2 * (lane % 4) .. + 1 of matrix m.
// mma m16n8k16 (row.col, fp32 accumulate), with g = lane / 4, t = lane % 4:
//   A 16x16: a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
//   B 16x8:  b0 (2t..2t+1, g), b1 (2t+8.., g);  C/D 16x8: d0,d1 (g, 2t..2t+1), d2,d3 (g+8, 2t..)
// (two 16-bit values per register, the lower index in the low half).
#if defined(RA_CUDA) || defined(RA_EMULATE)
#define RA_HAS_TENSOR_CORE_KERNEL 1
#endif

#if defined(RA_CUDA)
RA_DEVICE void ra_ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
#else
  (void)row;
  r[0] = r[1] = r[2] = r[3] = 0u;
  __trap();
#endif
}

template <bool BF16>
RA_DEVICE void ra_mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (BF16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#else
  (void)d;
  (void)a;
  (void)b0;
  (void)b1;
  __trap();
#endif
}
#elif defined(RA_EMULATE)
RA_DEVICE void ra_ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  uint32_t mine[2];
  const uint64_t a = reinterpret_cast<uint64_t>(row);
  mine[0] = static_cast<uint32_t>(a);
  mine[1] = static_cast<uint32_t>(a >> 32);
  uint32_t all[32][2];
  ra_emu::warp_gather<2>(mine, all);
  const int lane = static_cast<int>(ra_emu::cta()->current) % 32;
  for (int m = 0; m < 4; ++m) {
    const int src = 8 * m + lane / 4;
    const uint64_t addr = static_cast<uint64_t>(all[src][0]) | (static_cast<uint64_t>(all[src][1]) << 32);
    memcpy(&r[m], reinterpret_cast<const unsigned char*>(addr) + 4 * (lane % 4), 4);
  }
}

template <bool BF16>
RA_DEVICE float ra_emu_half(uint32_t w, int hi) {
  const uint16_t h = static_cast<uint16_t>(hi ? w >> 16 : w & 0xffffu);
  return BF16 ? ra_bf16_to_float(h) : ra_fp16_to_float(h);
}

template <bool BF16>
RA_DEVICE void ra_mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
  uint32_t all[32][6];
  ra_emu::warp_gather<6>(mine, all);
  float A[16][16], B[16][8];
  for (int L = 0; L < 32; ++L) {
    const int g = L / 4, t = L % 4;
    for (int e = 0; e < 2; ++e) {
      A[g][2 * t + e] = ra_emu_half<BF16>(all[L][0], e);
      A[g + 8][2 * t + e] = ra_emu_half<BF16>(all[L][1], e);
      A[g][2 * t + 8 + e] = ra_emu_half<BF16>(all[L][2], e);
      A[g + 8][2 * t + 8 + e] = ra_emu_half<BF16>(all[L][3], e);
      B[2 * t + e][g] = ra_emu_half<BF16>(all[L][4], e);
      B[2 * t + 8 + e][g] = ra_emu_half<BF16>(all[L][5], e);
    }
  }
  const int lane = static_cast<int>(ra_emu::cta()->current) % 32;
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
    float s = d[i];
    for (int k = 0; k < 16; ++k) s += A[row][k] * B[k][col];
    d[i] = s;
  }
}
#endif

// Two floats as the 16-bit pair of an mma operand (round to nearest even).
template <bool BF16>
RA_DEVICE uint32_t ra_pack2(float lo, float hi) {
  if constexpr (BF16) return static_cast<uint32_t>(ra_float_to_bf16(lo)) | (static_cast<uint32_t>(ra_float_to_bf16(hi)) << 16);
  else return static_cast<uint32_t>(ra_float_to_fp16(lo)) | (static_cast<uint32_t>(ra_float_to_fp16(hi)) << 16);
}

// ---- host side: launches, kernel attributes, device queries --------------------------------
struct ra_grid {
  unsigned x, y, z;
};

#if defined(RA_EMULATE)
template <typename... KArgs, typename... Args>
inline void ra_launch(void (*kernel)(KArgs...), ra_grid grid, unsigned block, size_t smem, void*,
                      Args... args) {
  ra_emu::launch(grid.x, grid.y, grid.z, block, smem, [=]() { kernel(args...); });
}
inline const char* ra_launch_error() { return ra_emu::error(); }
template <typename... KArgs>
inline int ra_allow_smem(void (*)(KArgs...), int) { return 0; }
#elif defined(RA_CUDA)
template <typename... KArgs, typename... Args>
inline void ra_launch(void (*kernel)(KArgs...), ra_grid grid, unsigned block, size_t smem, void* stream,
                      Args... args) {
  kernel<<<dim3(grid.x, grid.y, grid.z), dim3(block), smem, static_cast<cudaStream_t>(stream)>>>(args...);
}
inline const char* ra_launch_error() {
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}
template <typename... KArgs>
inline int ra_allow_smem(void (*kernel)(KArgs...), int bytes) {
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), cudaFuncAttributeMaxDynamicSharedMemorySize,
                              bytes) == cudaSuccess ? 0 : 1;
}
#else
template <typename... KArgs, typename... Args>
inline void ra_launch(void (*kernel)(KArgs...), ra_grid grid, unsigned block, size_t smem, void* stream,
                      Args... args) {
  kernel<<<dim3(grid.x, grid.y, grid.z), dim3(block), smem, static_cast<hipStream_t>(stream)>>>(args...);
}
inline const char* ra_launch_error() {
  hipError_t e = hipGetLastError();
  return e == hipSuccess ? nullptr : hipGetErrorString(e);
}
template <typename... KArgs>
inline int ra_allow_smem(void (*kernel)(KArgs...), int bytes) {
  return hipFuncSetAttribute(reinterpret_cast<const void*>(kernel), hipFuncAttributeMaxDynamicSharedMemorySize,
                             bytes) == hipSuccess ? 0 : 1;
}
#endif
