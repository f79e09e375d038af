// Host helpers shared by the launchers (torch-free): the error channel of native_api.h.
#pragma once

#include <stdarg.h>
#include <stdio.h>

#include <string>

namespace rocm_attn_native {

std::string& error_slot();

// Record an error for last_error() and return the non-zero status the launchers report.
#if defined(__GNUC__) || defined(__clang__)
__attribute__((format(printf, 1, 2)))
#endif
inline int fail(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  error_slot() = buf;
  return 1;
}

}  // namespace rocm_attn_native
