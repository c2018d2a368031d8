// Float32 matrix products for XLA:CPU that read their weights where they lie (see cpu_matmul.py).
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

#include <algorithm>
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

void AccumulateRows(const float* __restrict x, const float* __restrict w, float* __restrict y, int64_t m,
                    int64_t k, int64_t n, int64_t k0, int64_t k1, int64_t c_begin, int64_t c_end) {
  const int64_t tile = std::max<int64_t>(64, (24 * 1024 / 4) / m / 16 * 16);
  for (int64_t c0 = c_begin; c0 < c_end; c0 += tile) {
    const int64_t len = std::min(tile, c_end - c0);
    for (int64_t r = 0; r < m; ++r) std::memset(y + r * n + c0, 0, len * sizeof(float));
    int64_t kk = k0;
    for (; kk + kStreamRows <= k1; kk += kStreamRows) {
      const float* w0 = w + kk * n + c0;
      for (int64_t r = 0; r < m; ++r) {
        const float* xr = x + r * k + kk;
        float* yr = y + r * n + c0;
        // One fused multiply-add per row of w, in order: the summation order of the register
        // blocks, so a row's result does not depend on how many rows share the call.
        for (int64_t j = 0; j < len; ++j) {
          float acc = yr[j];
#pragma GCC unroll 8
          for (int64_t i = 0; i < kStreamRows; ++i) acc += xr[i] * w0[i * n + j];
          yr[j] = acc;
        }
      }
    }
    for (; kk < k1; ++kk) {
      const float* w0 = w + kk * n + c0;
      for (int64_t r = 0; r < m; ++r) {
        const float a0 = x[r * k + kk];
        float* yr = y + r * n + c0;
        for (int64_t j = 0; j < len; ++j) yr[j] += a0 * w0[j];
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

// y[0:R, 0:kBlockCols] = x[0:R, k0:k1] @ w[k0:k1, 0:kBlockCols], the accumulators held in
// registers: per row of w, kBlockVecs loads feed R * kBlockVecs fused multiply-adds (the
// few-rows form reloads its accumulators for every row of w, which bounds it at 8-64 rows).
template <int64_t R>
void Block(const float* __restrict x, int64_t k, const float* __restrict w, int64_t n, float* __restrict y,
           int64_t k0, int64_t k1) {
  Vec acc[R][kBlockVecs] = {};
  for (int64_t kk = k0; kk < k1; ++kk) {
    Vec wv[kBlockVecs];
    for (int64_t c = 0; c < kBlockVecs; ++c) std::memcpy(&wv[c], w + kk * n + c * kLanes, sizeof(Vec));
    for (int64_t r = 0; r < R; ++r) {
      const float a = x[r * k + kk];
      for (int64_t c = 0; c < kBlockVecs; ++c) acc[r][c] += a * wv[c];
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < kBlockVecs; ++c) std::memcpy(y + r * n + c * kLanes, &acc[r][c], sizeof(Vec));
}

// y = x[:, k0:k1] @ w[k0:k1, :] for x [m, k], w [k, n]. One or two rows stream w with the
// few-rows form; more go through register blocks (the last block taking the rows left),
// and the few-rows form takes the columns past the last whole block.
void MultiplyRows(const float* __restrict x, const float* __restrict w, float* __restrict y, int64_t m, int64_t k,
                  int64_t n, int64_t k0, int64_t k1) {
  const int64_t block_cols = n / kBlockCols * kBlockCols;
  if (m <= 2 || block_cols == 0) {
    AccumulateRows(x, w, y, m, k, n, k0, k1, 0, n);
    return;
  }
  // Column strips outside, row blocks inside: a strip of w (k1 - k0 rows of kBlockCols floats)
  // is read from memory once and stays in cache for the row blocks after the first; with the
  // rows outside, every row block streamed the whole of w from memory again.
  for (int64_t c0 = 0; c0 < block_cols; c0 += kBlockCols) {
    for (int64_t r0 = 0; r0 < m; r0 += kBlockRows) {
      const float* xr = x + r0 * k;
      float* yr = y + r0 * n + c0;
      switch (std::min(kBlockRows, m - r0)) {
        case 1: Block<1>(xr, k, w + c0, n, yr, k0, k1); break;
        case 2: Block<2>(xr, k, w + c0, n, yr, k0, k1); break;
        case 3: Block<3>(xr, k, w + c0, n, yr, k0, k1); break;
        case 4: Block<4>(xr, k, w + c0, n, yr, k0, k1); break;
#if !defined(__AVX512F__)
        case 5: Block<5>(xr, k, w + c0, n, yr, k0, k1); break;
        case 6: Block<6>(xr, k, w + c0, n, yr, k0, k1); break;
#endif
      }
    }
  }
  if (block_cols < n) AccumulateRows(x, w, y, m, k, n, k0, k1, block_cols, n);
}

// y[r, n0:n1] = x[r, :] . w[n0:n1, :] for r < m; w is [n, k] row-major.
void DotRows(const float* __restrict x, const float* __restrict w, float* __restrict y, int64_t m, int64_t k,
             int64_t n, int64_t n0, int64_t n1) {
  for (int64_t j = n0; j < n1; ++j) {
    const float* wj = w + j * k;
    for (int64_t r = 0; r < m; ++r) {
      const float* xr = x + r * k;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t i = 0; i < k; ++i) acc += xr[i] * wj[i];
      y[r * n + j] = acc;
    }
  }
}

int64_t Threads(ffi::ThreadPool& pool, int64_t work_rows) {
  return std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), work_rows / 64));
}

// y_i = x @ w_i[layer] for every stack w_i [layers, k, n_i] given (one or more, all with the
// same k and layer count): the products of one input (a layer's q, k and v, or its gate and
// up) share one pass over the pool, so its threads are woken once for all of them.
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
  // Each product: its layer of w, its output, its width, and where its partials start.
  struct Product {
    const float* w;
    float* y;
    int64_t n, offset;
  };
  std::vector<Product> products(count);
  int64_t total = 0;  // floats of output over all products
  for (int64_t i = 0; i < count; ++i) {
    auto w = stack_args.get<ffi::Buffer<ffi::F32>>(i);
    auto y = out_rets.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value()) return ffi::Error::InvalidArgument("jfire_stacked_matmul: float32 only");
    const auto wd = w->dimensions();
    if (wd.size() != 3 || wd[1] != k) return ffi::Error::InvalidArgument("jfire_stacked_matmul: a stack is not [layers, k, n]");
    if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("jfire_stacked_matmul: layer index out of range");
    const int64_t n = wd[2];
    products[i] = {w->typed_data() + static_cast<int64_t>(l) * k * n, (*y)->typed_data(), n, total};
    total += m * n;
  }
  const float* xp = x.typed_data();
  const int64_t chunks = Threads(pool, k);
  if (chunks == 1) {
    for (const Product& p : products) MultiplyRows(xp, p.w, p.y, m, k, p.n, 0, k);
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
      MultiplyRows(xp, p.w, c == 0 ? p.y : parts + (c - 1) * total + p.offset, m, k, p.n, k0, k1);
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

ffi::Error MatmulNT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                    ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("jfire_matmul_nt takes x [m, k] and w [n, k]");
  }
  const int64_t m = xd[0], k = xd[1], n = wd[0];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t chunks = Threads(pool, n);
  const int64_t per = (n + chunks - 1) / chunks;
  RunChunks(pool, chunks, [=](int64_t c) {
    const int64_t n0 = c * per, n1 = std::min(n, n0 + per);
    DotRows(xp, wp, yp, m, k, n, n0, std::max(n0, n1));
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
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
