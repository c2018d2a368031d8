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
//
// Speculative decoding's verify step runs 1 + drafts rows (2, 5, 9; up to 4 sequences x 9 =
// 36) through the same kernels as decode's one row, and its rows must equal decode's bit for
// bit: so each form keeps one row's order of sums whatever the rows beside it, and is built to
// keep several rows' cost near one row's (reading the weights once). The default model
// (float32; scripts/bench_verify_rows.py, 2 threads on this 2-core machine, medians of 15, ms,
// old: the forms before register panels and dot blocks, alternating in one run; two runs
// agreed within 5%):
//
//   rows                        1     2     5     9    16    36
//   30 layers' products  old  16.7  19.6  24.2  30.5  42.9  66.2
//                        new  16.0  16.4  18.0  21.3  28.7  52.4   (9 rows: 1.33x one row)
//   head (49152 x 576)   old   4.5*  5.1   7.2   9.2  10.7  22.2
//                        new   4.1   4.7   5.9   6.7   9.2  15.4
//   (* its fastest call: about half the old head's one-row calls took 8 ms)
//
// What 9 rows add to one row's time is about the multiply-adds' own (2.4 GFLOP with the head,
// some 6 ms a thread at full rate): with both threads streaming the weights, little of it
// hides under the reading (on one core more does: 9 rows' layers 1.25x one row's).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_panels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jfire_cpu::kLanes;
using jfire_cpu::DotRowBlocks;
using jfire_cpu::kDotCols;
using jfire_cpu::kDotRows;
using jfire_cpu::kPanelChunk;
using jfire_cpu::kPanelRows;
using jfire_cpu::kPanelTileBytes;
using jfire_cpu::kPanelVecs;
using jfire_cpu::LoadU;
using jfire_cpu::LaneSums;
using jfire_cpu::LoadVec;
using jfire_cpu::PanelColumns;
using jfire_cpu::PrefetchLines;
using jfire_cpu::RunChunks;
using jfire_cpu::Threads;
using jfire_cpu::Vec;
using jfire_cpu::Widen;

template <typename W>
void MultiplyRows(const float* __restrict x, const W* __restrict w, float* __restrict y, int64_t m, int64_t k,
                  int64_t n, int64_t k0, int64_t k1) {
  if (m == 0) return;
  if (k1 <= k0) {
    for (int64_t r = 0; r < m; ++r) std::memset(y + r * n, 0, n * sizeof(float));
    return;
  }
  constexpr int64_t kWide = kPanelVecs * kLanes;
  // The rows in as few panels as hold them, of sizes differing by at most one (16 rows: 8 and 8).
  const int64_t panels = (m + kPanelRows - 1) / kPanelRows;
  const int64_t tile_floats = kPanelTileBytes / static_cast<int64_t>(sizeof(float));
  const int64_t tile = std::max<int64_t>(kWide, tile_floats / m / kWide * kWide);
  for (int64_t c0 = 0; c0 < n; c0 += tile) {
    const int64_t len = std::min(tile, n - c0);
    for (int64_t kk = k0; kk < k1; kk += kPanelChunk) {
      const int64_t kc = std::min(kPanelChunk, k1 - kk);
      const bool first = kk == k0, prefetch = (m > 1 || sizeof(W) != sizeof(float)) && kk + 2 * kPanelChunk <= k1;
      const W* wk = w + kk * n + c0;
      for (int64_t p = 0, r0 = 0; p < panels; ++p) {
        const int64_t rows = (m - r0) / (panels - p);
        const float* xr = x + r0 * k + kk;
        float* yr = y + r0 * n + c0;
        const bool ask = prefetch && p == 0;  // the first panel reads w from memory, the others from cache
        switch (rows) {
#define JFIRE_PANEL(R) \
  case R: PanelColumns<R>(xr, k, wk, n, yr, n, kc, first, len, ask); break;
          JFIRE_PANEL(1) JFIRE_PANEL(2) JFIRE_PANEL(3) JFIRE_PANEL(4) JFIRE_PANEL(5) JFIRE_PANEL(6)
#if defined(__AVX512F__)
          JFIRE_PANEL(7) JFIRE_PANEL(8) JFIRE_PANEL(9)
#endif
#undef JFIRE_PANEL
        }
        r0 += rows;
      }
    }
  }
}

// A bfloat16 w's blocks this many blocks ahead are asked for from memory while a block is summed
// (as the register panels do, bfloat16's widening left too few of w's lines in flight): the
// head at one row took 5.7 ms against 7.1 without (one core, the layers' products between
// calls); 6.5 in the form before the dot blocks, which read one row of w at a time. The asking
// is spread over the block's steps (DotBlock's `ahead`), over all its row blocks where there
// are several. A float32 w at one row streams as fast without; at several rows, where each
// block's sums take several passes over it from cache, its first pass waited on memory (a
// profile put a fifth of the head's time on one load of w): asked for ahead, the float32 head
// took 6.6-6.8 ms at 9 rows against 7.5-7.7, 8.0 at 16 against 10.1, 14.2 at 36 against 16.7
// (scripts/bench_verify_rows.py, alternating builds, the same outputs).
constexpr int64_t kDotAhead = 4;

template <typename W>
void DotRows(const float* __restrict x, const W* __restrict w, float* __restrict y, int64_t m, int64_t k,
             int64_t n, int64_t n0, int64_t n1) {
  // With several row blocks, a bfloat16 block of w is widened once into this buffer and each
  // block of x dotted with that (the same values in the same order): widened for every row of
  // x, 16 rows took twice float32's time.
  thread_local std::vector<float> widened;
  const bool widen = sizeof(W) != sizeof(float) && m > kDotRows;
  if (widen) widened.resize(kDotCols * k);
  LaneSums sums;
  int64_t j = n0;
  for (; j + kDotCols <= n1; j += kDotCols) {
    const W* wj = w + j * k;
    const char* ahead = nullptr;
    if ((sizeof(W) != sizeof(float) || m > 1) && j + (kDotAhead + 1) * kDotCols <= n1) {
      ahead = reinterpret_cast<const char*>(wj + kDotAhead * kDotCols * k);
    }
    if (widen) {
      // Asked for at once here, then widened from cache.
      if (ahead != nullptr) PrefetchLines(ahead, 0, kDotCols * k * static_cast<int64_t>(sizeof(W)));
      for (int64_t i = 0; i < kDotCols * k; ++i) widened[i] = Widen(wj[i]);
      DotRowBlocks<kDotCols>(x, widened.data(), y + j, m, k, n, sums);
    } else {
      DotRowBlocks<kDotCols>(x, wj, y + j, m, k, n, sums, ahead);
    }
  }
  for (; j < n1; ++j) DotRowBlocks<1>(x, w + j * k, y + j, m, k, n, sums);
  sums.Flush();
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
  jfire_cpu::SplitContraction(pool, m, k, products, total, [=](const Product& p, float* out, int64_t k0, int64_t k1) {
    MultiplyAny(xp, p.w, p.bf16, out, m, k, p.n, k0, k1);
  });
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
