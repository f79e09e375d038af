// Host helpers shared by the launchers (torch-free): the error channel of native_api.h.
#pragma once

#include <stdio.h>

#include <string>

namespace rocm_attn_native {

std::string& error_slot();

// Record an error for last_error() and return the non-zero status the launchers report.
template <typename... Args>
inline int fail(const char* fmt, Args... args) {
  char buf[512];
  snprintf(buf, sizeof(buf), fmt, args...);
  error_slot() = buf;
  return 1;
}

}  // namespace rocm_attn_native
