// The native kernels compiled for the CPU emulation (tests only): a C ABI for ctypes.
#define RA_EMULATE 1
#include "../paged_decode.cu"
#include "../reshape_and_cache.cu"

extern "C" {

int ra_emu_warp_size() { return RA_WARP_SIZE; }
size_t ra_emu_sizeof_decode_params() { return sizeof(rocm_attn_native::DecodeParams); }
size_t ra_emu_sizeof_write_params() { return sizeof(rocm_attn_native::CacheWriteParams); }
size_t ra_emu_decode_smem_bytes(int head_size, int elem_bytes, int gt, int num_warps, int stages) {
  return rocm_attn_native::decode_smem_bytes(head_size, elem_bytes, gt, num_warps, stages);
}

int ra_emu_paged_decode(const rocm_attn_native::DecodeParams* p, const rocm_attn_native::DecodeConfig* cfg) {
  ra_emu::error_text().clear();
  int rc = rocm_attn_native::paged_decode(*p, *cfg, nullptr);
  return rc;
}

int ra_emu_reshape_and_cache(const rocm_attn_native::CacheWriteParams* p) {
  ra_emu::error_text().clear();
  return rocm_attn_native::reshape_and_cache(*p, nullptr);
}

const char* ra_emu_last_error() { return rocm_attn_native::last_error(); }

// The scatter writer's unit -> (token, head, packet) split, 32- or 64-bit (the 64-bit one
// serves more than 2^32 units: too many for an emulated launch).
void ra_emu_split_unit(uint64_t u, int ncp, int heads, int wide, int64_t* tok, int* head, int* c) {
  if (wide) rocm_attn_native::split_unit<uint64_t>(u, ncp, heads, *tok, *head, *c);
  else rocm_attn_native::split_unit<uint32_t>(static_cast<uint32_t>(u), ncp, heads, *tok, *head, *c);
}
}
