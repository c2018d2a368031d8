// Matrix products for XLA:CPU that read their weights where they lie (see cpu_matmul.py):
// float32 inputs and outputs, weights in float32 or bfloat16.
//
//   jfire_stacked_matmul: y_i[m, n_i] = x[m, k] @ w_i[layer, k, n_i] for one or more stacks w_i,
//     layer a device scalar. Inside the models' layer scan the weights stay one stacked array;
//     XLA:CPU would copy each layer's slice out of it before its dot, which costs more than the
//     product itself.
//   jfire_matmul_nt: y[m, n] = x[m, k] @ w[n, k]^T (the tied embedding as the output head).
//
// A row's result is the same whatever the number of rows in the call (every path sums the
// contraction in the same order, with fused multiply-adds), so a sequence decodes the same
// tokens alone or batched. Both split their work into one chunk per thread of XLA's intra-op
// pool (cpu_kernels.h). Chunks of w are read front to back, once.
//
// A bfloat16 weight is widened to float32 in registers as it is read (its 16 bits are a
// float32's high half, exactly), and every sum runs in the same order as for float32: the
// product equals the float32 kernel's on the widened weight, bit for bit, while half the bytes
// stream from memory (decode reads every weight once a step, so it is bound by those bytes).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jfire_cpu::kLanes;
using jfire_cpu::RunChunks;
using jfire_cpu::Vec;

// y[r, c0:c1] = sum over k0 <= kk < k1 of x[r, kk] * w[kk, c0:c1], for r < m; x is [m, k] and
// w [k, n], row-major. Columns are tiled so the m rows of accumulators stay in L1 while w
// streams past: the form for one or a few rows, where reading w is all the work. kStreamRows
// rows of w are read side by side: with 8 streams the 30 layers' products of the default model
// reached 25-27 GB/s at one row against 22-26 with 4 (alternating runs, the same bits).
constexpr int64_t kStreamRows = 8;

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

template <typename W>
void AccumulateRows(const float* __restrict x, const W* __restrict w, float* __restrict y, int64_t m,
                    int64_t k, int64_t n, int64_t k0, int64_t k1, int64_t c_begin, int64_t c_end) {
  const int64_t tile = std::max<int64_t>(64, (24 * 1024 / 4) / m / 16 * 16);
  for (int64_t c0 = c_begin; c0 < c_end; c0 += tile) {
    const int64_t len = std::min(tile, c_end - c0);
    for (int64_t r = 0; r < m; ++r) std::memset(y + r * n + c0, 0, len * sizeof(float));
    int64_t kk = k0;
    for (; kk + kStreamRows <= k1; kk += kStreamRows) {
      const W* w0 = w + kk * n + c0;
      for (int64_t r = 0; r < m; ++r) {
        const float* xr = x + r * k + kk;
        float* yr = y + r * n + c0;
        // One fused multiply-add per row of w, in order: the summation order of the register
        // blocks, so a row's result does not depend on how many rows share the call.
        if constexpr (sizeof(W) == sizeof(float)) {
          for (int64_t j = 0; j < len; ++j) {
            float acc = yr[j];
#pragma GCC unroll 8
            for (int64_t i = 0; i < kStreamRows; ++i) acc += xr[i] * Widen(w0[i * n + j]);
            yr[j] = acc;
          }
        } else {
          // bfloat16 takes several instructions a value where float32 takes one, so fewer of w's
          // cache lines are in flight at once and reading from memory stalled at half float32's
          // bytes per second (the same values per second). Each line of the next block's rows is
          // asked for while this block's same columns are summed: 1.5x the bytes per second
          // from memory on one core here (8 -> 12-13 GB/s; float32 gains nothing from it).
          constexpr int64_t kLine = 64 / sizeof(W);
          for (int64_t j0 = 0; j0 < len; j0 += kLine) {
            if (r == 0) {
              for (int64_t i = 0; i < kStreamRows; ++i) __builtin_prefetch(w0 + (kStreamRows + i) * n + j0);
            }
            const int64_t j1 = std::min(len, j0 + kLine);
            for (int64_t j = j0; j < j1; ++j) {
              float acc = yr[j];
#pragma GCC unroll 8
              for (int64_t i = 0; i < kStreamRows; ++i) acc += xr[i] * Widen(w0[i * n + j]);
              yr[j] = acc;
            }
          }
        }
      }
    }
    for (; kk < k1; ++kk) {
      const W* w0 = w + kk * n + c0;
      for (int64_t r = 0; r < m; ++r) {
        const float a0 = x[r * k + kk];
        float* yr = y + r * n + c0;
        for (int64_t j = 0; j < len; ++j) yr[j] += a0 * Widen(w0[j]);
      }
    }
  }
}

// The register block of rows x vectors of columns that keeps its accumulators in registers: 4 x 4 of the 32 AVX-512 registers, 6 x 2 of the 16
// AVX2 ones (two registers for w and one for the broadcast x are left over).
#if defined(__AVX512F__)
constexpr int64_t kBlockRows = 4, kBlockVecs = 4;
#else
constexpr int64_t kBlockRows = 6, kBlockVecs = 2;
#endif
constexpr int64_t kBlockCols = kLanes * kBlockVecs;
// Up to this many rows stream w with the few-rows form (the same sums in the same order as the
// blocks): the default model's decode at 4 rows took 36 ms against 40 through the blocks, at
// 8 rows 49 against 54, and a speculative verify step of 9 tokens (1 + 8 drafts) 47 against
// 56; at 16 rows the blocks are as fast or faster (74-77 ms either way).
constexpr int64_t kFewRows = 12;

// y[0:R, 0:kBlockCols] = x[0:R, k0:k1] @ w[0:k1-k0, 0:kBlockCols] (w: rows k0..k1 of a strip,
// ldw floats apart; y: ldy apart), the accumulators held in registers: per row of w,
// kBlockVecs loads feed R * kBlockVecs fused multiply-adds (the few-rows form reloads its
// accumulators for every row of w, which bounds it at 8-64 rows).
template <int64_t R>
void Block(const float* __restrict x, int64_t k, const float* __restrict w, int64_t ldw, float* __restrict y,
           int64_t ldy, int64_t k0, int64_t k1) {
  Vec acc[R][kBlockVecs] = {};
  for (int64_t kk = k0; kk < k1; ++kk) {
    Vec wv[kBlockVecs];
    for (int64_t c = 0; c < kBlockVecs; ++c) wv[c] = LoadVec(w + (kk - k0) * ldw + c * kLanes);
    for (int64_t r = 0; r < R; ++r) {
      const float a = x[r * k + kk];
      for (int64_t c = 0; c < kBlockVecs; ++c) acc[r][c] += a * wv[c];
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < kBlockVecs; ++c) std::memcpy(y + r * ldy + c * kLanes, &acc[r][c], sizeof(Vec));
}

// y = x[:, k0:k1] @ w[k0:k1, :] for x [m, k], w [k, n]. Up to kFewRows rows stream w with the
// few-rows form; more go through register blocks (the last block taking the rows left),
// and the few-rows form takes the columns past the last whole block.
template <typename W>
void MultiplyRows(const float* __restrict x, const W* __restrict w, float* __restrict y, int64_t m, int64_t k,
                  int64_t n, int64_t k0, int64_t k1) {
  const int64_t block_cols = n / kBlockCols * kBlockCols;
  if (m <= kFewRows || block_cols == 0) {
    AccumulateRows(x, w, y, m, k, n, k0, k1, 0, n);
    return;
  }
  // A bfloat16 strip is widened once into this thread's buffer, which every row block then
  // reads as float32: widened in the blocks, each value was widened once per row block (4
  // times at 16 rows), which made 16 rows a third slower than float32.
  thread_local std::vector<float> widened;
  if constexpr (sizeof(W) != sizeof(float)) widened.resize((k1 - k0) * kBlockCols);
  // Column strips outside, row blocks inside: a strip of w (k1 - k0 rows of kBlockCols floats)
  // is read from memory once and stays in cache for the row blocks after the first; with the
  // rows outside, every row block streamed the whole of w from memory again.
  for (int64_t c0 = 0; c0 < block_cols; c0 += kBlockCols) {
    const float* strip;
    int64_t ldw;
    if constexpr (sizeof(W) == sizeof(float)) {
      strip = w + k0 * n + c0;
      ldw = n;
    } else {
      for (int64_t kk = k0; kk < k1; ++kk) {
        for (int64_t c = 0; c < kBlockVecs; ++c) {
          const Vec v = LoadVec(w + kk * n + c0 + c * kLanes);
          std::memcpy(widened.data() + (kk - k0) * kBlockCols + c * kLanes, &v, sizeof v);
        }
      }
      strip = widened.data();
      ldw = kBlockCols;
    }
    for (int64_t r0 = 0; r0 < m; r0 += kBlockRows) {
      const float* xr = x + r0 * k;
      float* yr = y + r0 * n + c0;
      switch (std::min(kBlockRows, m - r0)) {
        case 1: Block<1>(xr, k, strip, ldw, yr, n, k0, k1); break;
        case 2: Block<2>(xr, k, strip, ldw, yr, n, k0, k1); break;
        case 3: Block<3>(xr, k, strip, ldw, yr, n, k0, k1); break;
        case 4: Block<4>(xr, k, strip, ldw, yr, n, k0, k1); break;
#if !defined(__AVX512F__)
        case 5: Block<5>(xr, k, strip, ldw, yr, n, k0, k1); break;
        case 6: Block<6>(xr, k, strip, ldw, yr, n, k0, k1); break;
#endif
      }
    }
  }
  if (block_cols < n) AccumulateRows(x, w, y, m, k, n, k0, k1, block_cols, n);
}

// y[r, n0:n1] = x[r, :] . w[n0:n1, :] for r < m; w is [n, k] row-major. Each dot product
// sums kDotVecs registers of lanes side by side (enough to hide the multiply-add latency), then
// adds them pairwise and their lanes in order, then the tail: one order, written out, so that a
// float32 and a bfloat16 weight sum alike (a compiler's own vectorized reduction picks its width
// by the element type).
constexpr int64_t kDotVecs = 4;

template <typename W>
float Dot(const float* __restrict x, const W* __restrict w, int64_t k) {
  const int64_t step = kDotVecs * kLanes, whole = k / step * step;
  Vec acc[kDotVecs] = {};
  for (int64_t i = 0; i < whole; i += step) {
    for (int64_t v = 0; v < kDotVecs; ++v) acc[v] += LoadVec(x + i + v * kLanes) * LoadVec(w + i + v * kLanes);
  }
  for (int64_t half = kDotVecs / 2; half > 0; half /= 2) {
    for (int64_t v = 0; v < half; ++v) acc[v] += acc[v + half];
  }
  float sum = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) sum += acc[0][l];
  for (int64_t i = whole; i < k; ++i) sum = std::fma(x[i], Widen(w[i]), sum);
  return sum;
}

template <typename W>
void DotRows(const float* __restrict x, const W* __restrict w, float* __restrict y, int64_t m, int64_t k,
             int64_t n, int64_t n0, int64_t n1) {
  // With several rows, a bfloat16 row of w is widened once into this buffer and each row of x
  // dotted with that (the same values in the same order): widened for every row of x, 16 rows
  // took twice float32's time.
  thread_local std::vector<float> widened;
  if (sizeof(W) != sizeof(float) && m > 1) widened.resize(k);
  for (int64_t j = n0; j < n1; ++j) {
    const W* wj = w + j * k;
    if (sizeof(W) != sizeof(float) && m > 1) {
      for (int64_t i = 0; i < k; ++i) widened[i] = Widen(wj[i]);
      for (int64_t r = 0; r < m; ++r) y[r * n + j] = Dot(x + r * k, widened.data(), k);
    } else {
      for (int64_t r = 0; r < m; ++r) y[r * n + j] = Dot(x + r * k, wj, k);
    }
  }
}

// A weight's float32 or bfloat16 elements, or nullptr where it is of another type.
template <typename W>
const W* WeightData(const ffi::AnyBuffer& w);
template <>
const float* WeightData<float>(const ffi::AnyBuffer& w) {
  return w.element_type() == ffi::F32 ? static_cast<const float*>(w.untyped_data()) : nullptr;
}
template <>
const uint16_t* WeightData<uint16_t>(const ffi::AnyBuffer& w) {
  return w.element_type() == ffi::BF16 ? static_cast<const uint16_t*>(w.untyped_data()) : nullptr;
}

// y = x[:, k0:k1] @ w[k0:k1, :] for a weight of either type (bf16: bfloat16 bits).
void MultiplyAny(const float* x, const void* w, bool bf16, float* y, int64_t m, int64_t k, int64_t n, int64_t k0,
                 int64_t k1) {
  if (bf16) {
    MultiplyRows(x, static_cast<const uint16_t*>(w), y, m, k, n, k0, k1);
  } else {
    MultiplyRows(x, static_cast<const float*>(w), y, m, k, n, k0, k1);
  }
}

int64_t Threads(ffi::ThreadPool& pool, int64_t work_rows) {
  return std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), work_rows / 64));
}

// y_i = x @ w_i[layer] for every stack w_i [layers, k, n_i] given (one or more, all with the
// same k and layer count, each float32 or bfloat16): the products of one input (a layer's q, k
// and v, or its gate and up) share one pass over the pool, so its threads are woken once for
// all of them.
ffi::Error StackedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                         ffi::RemainingArgs stack_args, ffi::RemainingRets out_rets) {
  const auto xd = x.dimensions();
  const int64_t count = static_cast<int64_t>(stack_args.size());
  if (xd.size() != 2 || count == 0 || static_cast<int64_t>(out_rets.size()) != count) {
    return ffi::Error::InvalidArgument("jfire_stacked_matmul takes x [m, k], layer, stacks [layers, k, n_i] and "
                                       "returns one [m, n_i] per stack");
  }
  const int64_t m = xd[0], k = xd[1];
  const int32_t l = layer.typed_data()[0];
  // Each product: its layer of w (and whether bfloat16), its output, its width, and where its
  // partials start.
  struct Product {
    const void* w;
    bool bf16;
    float* y;
    int64_t n, offset;
  };
  std::vector<Product> products(count);
  int64_t total = 0;  // floats of output over all products
  for (int64_t i = 0; i < count; ++i) {
    auto w = stack_args.get<ffi::AnyBuffer>(i);
    auto y = out_rets.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value()) return ffi::Error::InvalidArgument("jfire_stacked_matmul: bad operands");
    const bool bf16 = WeightData<uint16_t>(*w) != nullptr;
    if (!bf16 && WeightData<float>(*w) == nullptr) {
      return ffi::Error::InvalidArgument("jfire_stacked_matmul: a stack is neither float32 nor bfloat16");
    }
    const auto wd = w->dimensions();
    if (wd.size() != 3 || wd[1] != k) return ffi::Error::InvalidArgument("jfire_stacked_matmul: a stack is not [layers, k, n]");
    if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("jfire_stacked_matmul: layer index out of range");
    const int64_t n = wd[2];
    const int64_t at = static_cast<int64_t>(l) * k * n * (bf16 ? 2 : 4);  // bytes to the layer
    products[i] = {static_cast<const char*>(w->untyped_data()) + at, bf16, (*y)->typed_data(), n, total};
    total += m * n;
  }
  const float* xp = x.typed_data();
  const int64_t chunks = Threads(pool, k);
  if (chunks == 1) {
    for (const Product& p : products) MultiplyAny(xp, p.w, p.bf16, p.y, m, k, p.n, 0, k);
    return ffi::Error::Success();
  }
  // Chunks split k, so each reads whole rows of every w; chunk 0 sums into the outputs, the
  // others into partials.
  const int64_t per = (k + chunks - 1) / chunks;
  std::vector<float> partial((chunks - 1) * total);
  float* parts = partial.data();
  const Product* ps = products.data();
  RunChunks(pool, chunks, [=](int64_t c) {
    const int64_t k0 = c * per, k1 = std::max(k0, std::min(k, k0 + per));
    for (int64_t i = 0; i < count; ++i) {
      const Product& p = ps[i];
      MultiplyAny(xp, p.w, p.bf16, c == 0 ? p.y : parts + (c - 1) * total + p.offset, m, k, p.n, k0, k1);
    }
  });
  for (const Product& p : products) {
    for (int64_t c = 1; c < chunks; ++c) {
      const float* part = parts + (c - 1) * total + p.offset;
      for (int64_t j = 0; j < m * p.n; ++j) p.y[j] += part[j];
    }
  }
  return ffi::Error::Success();
}

ffi::Error MatmulNT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("jfire_matmul_nt takes x [m, k] and w [n, k]");
  }
  const float* w32 = WeightData<float>(w);
  const uint16_t* w16 = WeightData<uint16_t>(w);
  if (w32 == nullptr && w16 == nullptr) return ffi::Error::InvalidArgument("jfire_matmul_nt: w is neither float32 nor bfloat16");
  const int64_t m = xd[0], k = xd[1], n = wd[0];
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  const int64_t chunks = Threads(pool, n);
  const int64_t per = (n + chunks - 1) / chunks;
  RunChunks(pool, chunks, [=](int64_t c) {
    const int64_t n0 = c * per, n1 = std::max(n0, std::min(n, n0 + per));
    if (w16 != nullptr) {
      DotRows(xp, w16, yp, m, k, n, n0, n1);
    } else {
      DotRows(xp, w32, yp, m, k, n, n0, n1);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jfire_stacked_matmul, StackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jfire_matmul_nt, MatmulNT,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
