// CPU emulation of the few GPU primitives the native kernels use (tests only).
//
// Compiled with RA_EMULATE, the kernel sources build with a host C++ compiler. A launch runs
// the CTAs one after another; the threads of a CTA are fibers (ucontext) on one OS thread,
// switched at every barrier, so warp shuffles and __syncthreads behave as on a GPU with
// lockstep warps. A barrier reached by only part of a warp (or of a CTA), or by lanes at
// different barrier counts, is reported as an error instead of hanging.
// RA_EMU_WARP_SIZE (default 32) selects the emulated warp width (64: the AMD CDNA mapping).
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <ucontext.h>

#include <functional>
#include <string>
#include <vector>

#ifndef RA_EMU_WARP_SIZE
#define RA_EMU_WARP_SIZE 32
#endif
#define RA_WARP_SIZE RA_EMU_WARP_SIZE

namespace ra_emu {

enum State { kReady, kAtWarp, kAtBlock, kDone };

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  State state = kReady;
  long warp_syncs = 0, block_syncs = 0;
};

struct Cta {
  unsigned bx = 0, by = 0, bz = 0, nthreads = 0;
  int current = 0;
  ucontext_t scheduler;
  std::vector<Fiber> fibers;
  std::vector<unsigned char> smem;
  std::vector<uint64_t> exchange;
  std::vector<uint32_t> words;
  const std::function<void()>* body = nullptr;
};

inline Cta*& cta() {
  static Cta* c = nullptr;
  return c;
}
inline std::string& error_text() {
  static std::string e;
  return e;
}
inline const char* error() { return error_text().empty() ? nullptr : error_text().c_str(); }

inline void yield(State s) {
  Cta* c = cta();
  Fiber& f = c->fibers[c->current];
  f.state = s;
  if (s == kAtWarp) ++f.warp_syncs;
  if (s == kAtBlock) ++f.block_syncs;
  swapcontext(&f.ctx, &c->scheduler);
}

inline void sync_warp() { yield(kAtWarp); }
inline void sync_block() { yield(kAtBlock); }
inline unsigned char* dynamic_smem() { return cta()->smem.data(); }

template <typename T>
T shfl_xor(T v, int mask) {
  static_assert(sizeof(T) <= 8, "shuffle of at most 8 bytes");
  Cta* c = cta();
  const unsigned me = static_cast<unsigned>(c->current);
  uint64_t x = 0;
  memcpy(&x, &v, sizeof(T));
  c->exchange[me] = x;
  sync_warp();
  const uint64_t y = c->exchange[me ^ static_cast<unsigned>(mask)];
  sync_warp();
  T r;
  memcpy(&r, &y, sizeof(T));
  return r;
}

// Every lane of the calling warp publishes N words; all[lane] receives lane's words.
template <int N>
void warp_gather(const uint32_t (&mine)[N], uint32_t (*all)[N]) {
  static_assert(N <= 8, "at most 8 words a lane");
  Cta* c = cta();
  const unsigned me = static_cast<unsigned>(c->current), w0 = me - me % RA_WARP_SIZE;
  for (int i = 0; i < N; ++i) c->words[me * 8 + i] = mine[i];
  sync_warp();
  for (unsigned l = 0; l < RA_WARP_SIZE; ++l)
    for (int i = 0; i < N; ++i) all[l][i] = c->words[(w0 + l) * 8 + i];
  sync_warp();
}

inline void trampoline() {
  Cta* c = cta();
  (*c->body)();
  c->fibers[c->current].state = kDone;
  swapcontext(&c->fibers[c->current].ctx, &c->scheduler);
}

// Run one CTA to completion; false (with error_text set) on a barrier mismatch.
inline bool run_cta(Cta& c) {
  const unsigned n = c.nthreads, w = RA_WARP_SIZE;
  for (unsigned t = 0; t < n; ++t) {
    Fiber& f = c.fibers[t];
    f.state = kReady;
    f.warp_syncs = f.block_syncs = 0;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, trampoline, 0);
  }
  for (;;) {
    bool ran = false;
    for (unsigned t = 0; t < n; ++t) {
      if (c.fibers[t].state != kReady) continue;
      c.current = static_cast<int>(t);
      swapcontext(&c.scheduler, &c.fibers[t].ctx);
      ran = true;
    }
    bool released = false, all_done = true, any_block = false, all_block_or_done = true;
    for (unsigned w0 = 0; w0 < n; w0 += w) {
      unsigned at_warp = 0, done = 0;
      for (unsigned t = w0; t < w0 + w; ++t) {
        at_warp += c.fibers[t].state == kAtWarp;
        done += c.fibers[t].state == kDone;
      }
      if (at_warp == w) {
        for (unsigned t = w0; t < w0 + w; ++t) {
          if (c.fibers[t].warp_syncs != c.fibers[w0].warp_syncs) {
            error_text() = "lanes of warp " + std::to_string(w0 / w) + " met at different warp barriers";
            return false;
          }
          c.fibers[t].state = kReady;
        }
        released = true;
      } else if (at_warp > 0 && at_warp + done == w) {
        error_text() = "warp barrier reached by part of warp " + std::to_string(w0 / w) + " (others exited)";
        return false;
      }
    }
    for (unsigned t = 0; t < n; ++t) {
      const State s = c.fibers[t].state;
      all_done = all_done && s == kDone;
      any_block = any_block || s == kAtBlock;
      all_block_or_done = all_block_or_done && (s == kAtBlock || s == kDone);
    }
    if (all_done) return true;
    if (!released && any_block && all_block_or_done) {
      long count = -1;
      for (unsigned t = 0; t < n; ++t) {
        if (c.fibers[t].state != kAtBlock) continue;
        if (count >= 0 && c.fibers[t].block_syncs != count) {
          error_text() = "threads met at different block barriers";
          return false;
        }
        count = c.fibers[t].block_syncs;
        c.fibers[t].state = kReady;
      }
      released = true;
    }
    if (!released && !ran) {
      error_text() = "deadlock: threads wait at barriers that cannot complete";
      return false;
    }
  }
}

template <typename F>
void launch(unsigned gx, unsigned gy, unsigned gz, unsigned block, size_t smem, F body_fn) {
  if (error()) return;
  if (block % RA_WARP_SIZE != 0) {
    error_text() = "block size is not a multiple of the warp size";
    return;
  }
  const std::function<void()> body = body_fn;
  Cta c;
  c.nthreads = block;
  c.fibers.resize(block);
  for (auto& f : c.fibers) f.stack.resize(256 * 1024);
  c.smem.assign(smem + 16, 0xA5);  // garbage, as on a GPU
  c.exchange.assign(block, 0);
  c.words.assign(static_cast<size_t>(block) * 8, 0);
  c.body = &body;
  Cta* saved = cta();
  cta() = &c;
  for (unsigned z = 0; z < gz; ++z)
    for (unsigned y = 0; y < gy; ++y)
      for (unsigned x = 0; x < gx; ++x) {
        c.bx = x;
        c.by = y;
        c.bz = z;
        if (!run_cta(c)) {
          cta() = saved;
          return;
        }
      }
  cta() = saved;
}

}  // namespace ra_emu

inline unsigned ra_tid() { return static_cast<unsigned>(ra_emu::cta()->current); }
inline unsigned ra_ntid() { return ra_emu::cta()->nthreads; }
inline unsigned ra_bid_x() { return ra_emu::cta()->bx; }
inline unsigned ra_bid_y() { return ra_emu::cta()->by; }
inline unsigned ra_bid_z() { return ra_emu::cta()->bz; }
