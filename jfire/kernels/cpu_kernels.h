// What jfire's CPU kernels (cpu_matmul.cc, cpu_attention.cc) share: one vector register's type,
// and the split of a kernel's work over XLA's intra-op thread pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace jfire_cpu {

// One vector register of floats on the CPU the library is built for (-march: native, or a
// smaller ISA such as x86-64-v3, AVX2 without AVX-512, as tests/kernels/conftest.py builds).
#if defined(__AVX512F__)
typedef float Vec __attribute__((vector_size(64)));
#else
typedef float Vec __attribute__((vector_size(32)));
#endif
constexpr int64_t kLanes = sizeof(Vec) / sizeof(float);

// A register's worth of floats at any float's address, loaded or stored as one instruction (a
// memcpy of a register array went through the stack in halves with GCC, and so did one
// register's: cpu_attention.cc).
typedef float VecU __attribute__((vector_size(sizeof(Vec)), aligned(alignof(float)), may_alias));
inline Vec LoadU(const float* p) { return *reinterpret_cast<const VecU*>(p); }
inline void StoreU(float* p, Vec v) { *reinterpret_cast<VecU*>(p) = v; }

// Asks for the cache lines of bytes [from, to) of p from memory (into L1), a line at a time:
// weights a kernel reads next, asked for while it sums what it holds.
inline void PrefetchLines(const void* p, int64_t from, int64_t to) {
  const char* bytes = static_cast<const char*>(p);
  for (int64_t at = from; at < to; at += 64) __builtin_prefetch(bytes + at);
}

// Runs work(c) for every c < chunks on `workers` threads (the calling thread and workers - 1
// others), each claiming the next unclaimed chunk until none is left; returns when all are
// done. The others are tasks on XLA's pool; the calling thread claims chunks too and waits only
// for chunks another thread has already claimed, so a call never waits on a task queued behind
// a busy pool (XLA runs independent thunks concurrently on that same pool).
template <typename Work>
void RunChunks(xla::ffi::ThreadPool& pool, int64_t chunks, Work work, int64_t workers) {
  if (workers <= 1 || chunks <= 1) {
    for (int64_t c = 0; c < chunks; ++c) work(c);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  auto claim = [state, chunks, work]() {
    for (int64_t c; (c = state->next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      work(c);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < std::min(workers, chunks); ++t) pool.Schedule(decltype(claim)(claim));
  claim();
  while (state->done.load(std::memory_order_acquire) < chunks) {
  }
}

// One chunk per worker.
template <typename Work>
void RunChunks(xla::ffi::ThreadPool& pool, int64_t chunks, Work work) {
  RunChunks(pool, chunks, work, chunks);
}

}  // namespace jfire_cpu
