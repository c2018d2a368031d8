// The register panels and dot blocks of jfire's CPU matrix products (cpu_matmul.cc, and
// cpu_palette.cc on the weights it rebuilds): y = x @ w and y = x @ w^T for a few rows of x, each
// row's sums in one order whatever the rows beside it. See cpu_matmul.cc for how they came to be
// and what they cost.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"

namespace jfire_cpu {

// A weight element as float32: itself, or a bfloat16 (its bits, uint16_t) widened exactly.
inline float Widen(float w) { return w; }
inline float Widen(uint16_t w) {
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// kLanes weight elements from p as one register of float32s.
inline Vec LoadVec(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline Vec LoadVec(const uint16_t* p) {
  typedef uint16_t Halves __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  typedef uint32_t Words __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  Halves h;
  std::memcpy(&h, p, sizeof h);
  const Words bits = __builtin_convertvector(h, Words) << 16;
  Vec v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}


// y = x[:, k0:k1] @ w[k0:k1, :] (x [m, k], w [k, n], row-major) in register panels: R rows by V
// registers of columns of y held in registers while kPanelChunk rows of w go past, each
// register of w loaded once for all R rows (one load per R fused multiply-adds). Every y[r, j]
// is summed over kk from k0 up, one fused multiply-add at a time, from 0: the order of one row
// alone, so a row's result does not depend on the rows beside it.
//
// One form for every row count. It took over from a form that reloaded each row's
// accumulators (and its 8 registers of w) from L1 for every 8 rows of w, and from 4 x 4
// register blocks that read w as strips of 64 columns, n floats apart: at 9 rows the default
// model's 30 layers' products (one core) took 37 ms against 54 before and 30 at one row
// (1.25x, was 1.8x), at 36 rows 77 against 113 (figures at the top of the file).
#if defined(__AVX512F__)
constexpr int64_t kPanelRows = 9, kPanelVecs = 3;  // 27 accumulators, 3 of w, 1 of x: of 32
#else
constexpr int64_t kPanelRows = 6, kPanelVecs = 2;  // 12, 2 and 1 of AVX2's 16
#endif
// Rows of w per pass over the columns (the accumulators go through y once per 16 rows of w):
// the layers' products at 36 rows took 76 ms against 85 with 8 (one core); 1 and 9 rows the
// same.
constexpr int64_t kPanelChunk = 16;
// Columns per pass: y's rows across all n columns stay in L2 for every shape here. Tiles that
// kept them in L1 (24 KiB, 672 columns at 9 rows) read w as short strips n floats apart, and 9
// rows took 37 ms against 34.5 with whole rows of w.
constexpr int64_t kPanelTileBytes = 256 * 1024;

// y[0:R, 0:V*kLanes] (ldy floats apart) over kc rows of w (ldw apart) and columns of x (ldx
// apart): started at 0 where first, else from y. With `prefetch`, each row of w asks for the
// same columns kPanelChunk rows further on (read on the next pass). Where the multiply-adds
// take a while (several rows), the hardware's prefetchers alone left the memory idle while
// they ran: 9 rows' layers took 29.7 ms against 21.4 with these (2 threads; one core 51 against
// 35); so did bfloat16's widening at one row (28.3 against 16.3 ms, one core). A float32 row
// alone streams as fast without them (28 against 28.9 ms with), so it goes without. Asking
// two passes ahead instead of one was no faster. The lines are asked for into L2, not L1
// (locality 1; 2 measured alike): on an Intel Xeon (AVX-512) the 30 layers' products took
// 20.9 ms against 22.3 at 9 rows, 49.7 against 52.9 at 36, bfloat16 at one row 9.8 against
// 10.0 (one float32 row does not ask; as non-temporal, locality 0, 9 rows took 50.8 ms); on
// the AMD EPYC before it, L2 was no faster than L1.
template <int64_t R, int64_t V, typename W>
inline void Panel(const float* __restrict x, int64_t ldx, const W* __restrict w, int64_t ldw, float* __restrict y,
           int64_t ldy, int64_t kc, bool first, bool prefetch) {
  Vec acc[R][V];
  // (The unroll pragmas keep GCC's accumulators in registers: without them it kept the
  // array on the stack and copied it in and out of registers around the loop.)
#pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int64_t v = 0; v < V; ++v) acc[r][v] = first ? Vec{} : LoadU(y + r * ldy + v * kLanes);
  for (int64_t i = 0; i < kc; ++i) {
    if (prefetch) {
      for (int64_t b = 0; b < V * kLanes * static_cast<int64_t>(sizeof(W)); b += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(w + (i + kPanelChunk) * ldw) + b, 0, 1);
    }
    Vec wv[V];
#pragma GCC unroll 4
    for (int64_t v = 0; v < V; ++v) wv[v] = LoadVec(w + i * ldw + v * kLanes);
#pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r) {
      const float a = x[r * ldx + i];
#pragma GCC unroll 4
      for (int64_t v = 0; v < V; ++v) acc[r][v] += a * wv[v];
    }
  }
#pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int64_t v = 0; v < V; ++v) StoreU(y + r * ldy + v * kLanes, acc[r][v]);
}

// The columns past the last whole register, one at a time (the same order).
template <typename W>
inline void PanelTail(const float* __restrict x, int64_t ldx, const W* __restrict w, int64_t ldw, float* __restrict y,
               int64_t ldy, int64_t rows, int64_t cols, int64_t kc, bool first) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < cols; ++j) {
      // std::fma written out: written as acc += x * w, GCC's AVX2 build did not round this
      // loop alike for a float32 and a bfloat16 weight (1-ulp differences in the last columns).
      float acc = first ? 0.0f : y[r * ldy + j];
      for (int64_t i = 0; i < kc; ++i) acc = std::fma(x[r * ldx + i], Widen(w[i * ldw + j]), acc);
      y[r * ldy + j] = acc;
    }
  }
}

// R rows over `len` columns: panels of kPanelVecs registers, then of one, then the tail.
template <int64_t R, typename W>
inline void PanelColumns(const float* __restrict x, int64_t ldx, const W* __restrict w, int64_t ldw, float* __restrict y,
                  int64_t ldy, int64_t kc, bool first, int64_t len, bool prefetch) {
  constexpr int64_t kWide = kPanelVecs * kLanes;
  int64_t c = 0;
  for (; c + kWide <= len; c += kWide) Panel<R, kPanelVecs>(x, ldx, w + c, ldw, y + c, ldy, kc, first, prefetch);
  for (; c + kLanes <= len; c += kLanes) Panel<R, 1>(x, ldx, w + c, ldw, y + c, ldy, kc, first, prefetch);
  if (c < len) PanelTail(x, ldx, w + c, ldw, y + c, ldy, R, len - c, kc, first);
}

// y[r, n0:n1] = x[r, :] . w[n0:n1, :] for r < m; w is [n, k] row-major. Each dot product
// sums kDotVecs registers of lanes side by side (acc[v] takes x[i + v * kLanes + l] *
// w[i + v * kLanes + l] for i = 0, kDotVecs * kLanes, ..., in order), then adds them pairwise
// ((acc0 + acc2) + (acc1 + acc3)), then their lanes in order from 0, then the tail one element
// at a time: one order, written out, so that a float32 and a bfloat16 weight sum alike (a
// compiler's own vectorized reduction picks its width by the element type), and whatever the
// rows beside it.
constexpr int64_t kDotVecs = 4;

// The lane sums of many dot products (k a multiple of kDotVecs * kLanes: no tail), each in
// order from 0. One at a time that is a chain of kLanes dependent scalar adds (and lane
// extractions) a dot product; with AVX-512, 16 dot products' registers are transposed so that
// one vector add per lane sums all 16 in the same order. The head (2 threads) at 9 rows took
// 5.3 ms against 5.9 summing one at a time, at 36 rows 14.1 against 16.7, at one row 3.1
// against 3.3.
struct LaneSums {
  Vec pending[kLanes];
  float* out[kLanes];
  int64_t count = 0;

  void Add(const Vec& a, float* y) {
    pending[count] = a;
    out[count] = y;
    if (++count == kLanes) Flush();
  }

  void Flush() {
#if defined(__AVX512F__)
    if (count == kLanes) {
      // A 16 x 16 transpose in three rounds of two-register shuffles (unpack, then within
      // 128-bit blocks, then of 128-bit blocks): col[l] holds lane l of every pending register.
#define JFIRE_LO(q) 4 * q, 16 + 4 * q, 4 * q + 1, 17 + 4 * q
#define JFIRE_HI(q) 4 * q + 2, 18 + 4 * q, 4 * q + 3, 19 + 4 * q
#define JFIRE_PAIRS_LO(q) 4 * q, 4 * q + 1, 16 + 4 * q, 17 + 4 * q
#define JFIRE_PAIRS_HI(q) 4 * q + 2, 4 * q + 3, 18 + 4 * q, 19 + 4 * q
      const Vec* r = pending;
      Vec t[16], u[16], col[16];
      for (int i = 0; i < 8; ++i) {
        t[2 * i] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], JFIRE_LO(0), JFIRE_LO(1), JFIRE_LO(2), JFIRE_LO(3));
        t[2 * i + 1] =
            __builtin_shufflevector(r[2 * i], r[2 * i + 1], JFIRE_HI(0), JFIRE_HI(1), JFIRE_HI(2), JFIRE_HI(3));
      }
      // u[4i + j], 128-bit block q: element 4q + j of registers 4i .. 4i + 3.
      for (int i = 0; i < 4; ++i) {
        const Vec &a = t[4 * i], &b = t[4 * i + 1], &c = t[4 * i + 2], &d = t[4 * i + 3];
        u[4 * i] = __builtin_shufflevector(a, c, JFIRE_PAIRS_LO(0), JFIRE_PAIRS_LO(1), JFIRE_PAIRS_LO(2),
                                           JFIRE_PAIRS_LO(3));
        u[4 * i + 1] = __builtin_shufflevector(a, c, JFIRE_PAIRS_HI(0), JFIRE_PAIRS_HI(1), JFIRE_PAIRS_HI(2),
                                               JFIRE_PAIRS_HI(3));
        u[4 * i + 2] = __builtin_shufflevector(b, d, JFIRE_PAIRS_LO(0), JFIRE_PAIRS_LO(1), JFIRE_PAIRS_LO(2),
                                               JFIRE_PAIRS_LO(3));
        u[4 * i + 3] = __builtin_shufflevector(b, d, JFIRE_PAIRS_HI(0), JFIRE_PAIRS_HI(1), JFIRE_PAIRS_HI(2),
                                               JFIRE_PAIRS_HI(3));
      }
#undef JFIRE_LO
#undef JFIRE_HI
#undef JFIRE_PAIRS_LO
#undef JFIRE_PAIRS_HI
#define JFIRE_EVEN 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define JFIRE_ODD 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
      for (int j = 0; j < 4; ++j) {
        const Vec v0 = __builtin_shufflevector(u[j], u[4 + j], JFIRE_EVEN);
        const Vec v1 = __builtin_shufflevector(u[j], u[4 + j], JFIRE_ODD);
        const Vec v2 = __builtin_shufflevector(u[8 + j], u[12 + j], JFIRE_EVEN);
        const Vec v3 = __builtin_shufflevector(u[8 + j], u[12 + j], JFIRE_ODD);
        col[j] = __builtin_shufflevector(v0, v2, JFIRE_EVEN);
        col[8 + j] = __builtin_shufflevector(v0, v2, JFIRE_ODD);
        col[4 + j] = __builtin_shufflevector(v1, v3, JFIRE_EVEN);
        col[12 + j] = __builtin_shufflevector(v1, v3, JFIRE_ODD);
      }
#undef JFIRE_EVEN
#undef JFIRE_ODD
      Vec sum = {};
      for (int l = 0; l < 16; ++l) sum += col[l];
      for (int d = 0; d < 16; ++d) *out[d] = sum[d];
      count = 0;
      return;
    }
#endif
    for (int64_t d = 0; d < count; ++d) {
      float sum = 0.0f;
      for (int64_t l = 0; l < kLanes; ++l) sum += pending[d][l];
      *out[d] = sum;
    }
    count = 0;
  }
};

// y[r, j] for R rows of x and J rows of w at once, in that order: each register of w (or x)
// loaded once feeds R (or J) of the R x J x kDotVecs accumulators. One row at a time, w was
// read once a row but each multiply-add took a load of x and of w: at 36 rows (4 sequences'
// verify steps) the head took 42-44 ms on one core, against 33-34 now.
//
// `ahead` (or nullptr): `ahead_bytes` of w further on (J rows of it, or a row block's share of
// them), asked for from memory a step's share of their lines at a time as this block's steps
// run, so they arrive while it sums. Asked for all at
// once as the block began, the bfloat16 head at one row left whole calls waiting on memory
// (the default model's bfloat16 decode 1.51-1.56x float32's, against 1.54-1.67x spread;
// scripts/bench_resident.py, three runs against one on an Intel Xeon with AVX-512).
template <int64_t R, int64_t J, typename W>
inline void DotBlock(const float* __restrict x, const W* __restrict w, float* __restrict y, int64_t k, int64_t ldy,
              LaneSums& sums, const char* ahead = nullptr, int64_t ahead_bytes = 0) {
  const int64_t step = kDotVecs * kLanes, whole = k / step * step;
  const int64_t per_step = (ahead_bytes + whole / step - 1) / std::max<int64_t>(1, whole / step);  // bytes a step asks for
  Vec acc[R][J][kDotVecs];
#pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int64_t j = 0; j < J; ++j)
#pragma GCC unroll 4
      for (int64_t v = 0; v < kDotVecs; ++v) acc[r][j][v] = Vec{};
  for (int64_t i = 0; i < whole; i += step) {
    if (ahead != nullptr) PrefetchLines(ahead, i / step * per_step, std::min(ahead_bytes, (i / step + 1) * per_step));
#pragma GCC unroll 4
    for (int64_t v = 0; v < kDotVecs; ++v) {
      Vec wv[J];
#pragma GCC unroll 8
      for (int64_t j = 0; j < J; ++j) wv[j] = LoadVec(w + j * k + i + v * kLanes);
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) {
        const Vec xv = LoadU(x + r * k + i + v * kLanes);
#pragma GCC unroll 8
        for (int64_t j = 0; j < J; ++j) acc[r][j][v] += xv * wv[j];
      }
    }
  }
  // What the steps did not reach (k not a multiple of a step).
  if (ahead != nullptr) PrefetchLines(ahead, whole / step * per_step, ahead_bytes);
#pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int64_t j = 0; j < J; ++j) {
      Vec* a = acc[r][j];
#pragma GCC unroll 4
      for (int64_t half = kDotVecs / 2; half > 0; half /= 2) {
#pragma GCC unroll 4
        for (int64_t v = 0; v < half; ++v) a[v] += a[v + half];
      }
      if (whole == k) {
        sums.Add(a[0], y + r * ldy + j);
      } else {
        float sum = 0.0f;
        for (int64_t l = 0; l < kLanes; ++l) sum += a[0][l];
        for (int64_t i = whole; i < k; ++i) sum = std::fma(x[r * k + i], Widen(w[j * k + i]), sum);
        y[r * ldy + j] = sum;
      }
    }
  }
}

// Rows of x in blocks of kDotRows, rows of w in blocks of kDotCols: 2 x 3 x 4 = 24
// accumulators of the 32 AVX-512 registers (3 x 2 took as long at 9 rows and 10% longer at 36,
// in cache on one core), 1 x 2 x 4 of AVX2's 16.
#if defined(__AVX512F__)
constexpr int64_t kDotRows = 2, kDotCols = 3;
#else
constexpr int64_t kDotRows = 1, kDotCols = 2;
#endif

template <int64_t J, typename W>
inline void DotRowBlocks(const float* __restrict x, const W* __restrict w, float* __restrict y, int64_t m, int64_t k,
                  int64_t n, LaneSums& sums, const char* ahead = nullptr) {
  // Each row block asks for its share of `ahead`'s J rows (one row of x: all of them), in whole
  // lines, the last block what is left.
  const int64_t total = J * k * static_cast<int64_t>(sizeof(W)), blocks = (m + kDotRows - 1) / kDotRows;
  const int64_t share = (total / blocks + 63) / 64 * 64;
  auto from = [&](int64_t b) { return ahead != nullptr ? ahead + b * share : nullptr; };
  auto bytes = [&](int64_t b) { return std::max<int64_t>(0, std::min(share, total - b * share)); };
  int64_t r = 0, b = 0;
  for (; r + kDotRows <= m; r += kDotRows, ++b)
    DotBlock<kDotRows, J>(x + r * k, w, y + r * n, k, n, sums, from(b), bytes(b));
  if constexpr (kDotRows > 1) {
    if (r < m) DotBlock<1, J>(x + r * k, w, y + r * n, k, n, sums, from(b), bytes(b));
  }
  static_assert(kDotRows <= 2, "the rows past the last whole block are taken as one block of 1 row");
}

// Threads a product over `work_rows` rows of its weight takes: each at least 64 rows.
inline int64_t Threads(xla::ffi::ThreadPool& pool, int64_t work_rows) {
  return std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), work_rows / 64));
}

// Products y = x[m, k] @ w sharing one pass over the pool, their contraction k split into one
// chunk per thread: `multiply(p, out, k0, k1)` sums rows k0..k1 of product p into out; chunk 0
// sums into p.y, the others into partials, added to p.y after, chunk by chunk. A product has
// p.y, its width p.n, and p.offset (where its partials start; `total` floats for all). One
// split and one order of partials for every kind of weight: jfire_stacked_matmul's and
// jfire_palette_matmul's products equal each other's bits on the same values.
template <typename Product, typename Multiply>
void SplitContraction(xla::ffi::ThreadPool& pool, int64_t m, int64_t k, const std::vector<Product>& products,
                      int64_t total, Multiply multiply) {
  const int64_t chunks = Threads(pool, k);
  if (chunks == 1) {
    for (const Product& p : products) multiply(p, p.y, 0, k);
    return;
  }
  // Chunks split k, so each reads whole rows of every w.
  const int64_t per = (k + chunks - 1) / chunks;
  std::vector<float> partial((chunks - 1) * total);
  float* parts = partial.data();
  const Product* ps = products.data();
  const int64_t count = static_cast<int64_t>(products.size());
  RunChunks(pool, chunks, [=](int64_t c) {
    const int64_t k0 = c * per, k1 = std::max(k0, std::min(k, k0 + per));
    for (int64_t i = 0; i < count; ++i) multiply(ps[i], c == 0 ? ps[i].y : parts + (c - 1) * total + ps[i].offset, k0, k1);
  });
  for (const Product& p : products) {
    for (int64_t c = 1; c < chunks; ++c) {
      const float* part = parts + (c - 1) * total + p.offset;
      for (int64_t j = 0; j < m * p.n; ++j) p.y[j] += part[j];
    }
  }
}

}  // namespace jfire_cpu
