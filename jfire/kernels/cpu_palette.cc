// Matrix products for XLA:CPU whose bfloat16 weights stay palette-coded in memory
// (jfire/kernels/cpu_palette.py builds the form from the weights and calls these):
//
//   jfire_palette_matmul: y_i[m, n_i] = x[m, k] @ w_i[layer] for one or more coded stacks w_i,
//     each value rebuilt from its code right before its multiply-add;
//   jfire_palette_decode: w[layer] as bfloat16 [k, n] (for products too long for the above);
//   jfire_palette_matmul_nt: y[m, n] = x[m, k] @ w[n, k]^T for a coded table (the tied
//     embedding as the output head), in jfire_matmul_nt's order of sums;
//   jfire_palette_rows: rows of a coded table as bfloat16 (the embedding's lookups).
//
// Decode reads every weight once a step, so on a CPU it is bound by the bytes it reads. A coded
// weight is 0.754 of bfloat16's bytes (plus its exceptions), and rebuilding a value costs a few
// register instructions, which run while the memory streams the next values in.
//
// The form, per layer of a stack [k, n] (k a multiple of 32, n of 64): blocks of 32 rows x 64
// columns, row block by row block, each block's columns left to right, each block
//   palette  u8 [16]       the block's 16 commonest exponents;
//   codes    u32 [4][64]   each value's 4-bit index into the palette: row j of column c at bits
//                          4 * (j % 8) of word [j / 8][c];
//   raw      u8 [32][64]   sign << 7 | mantissa, as the checkpoint codecs keep them;
// then, apart, the exceptions (values whose exponent is not in their block's palette, their
// code 0): per layer exc_start u32 [blocks + 1] (block b's are exc[exc_start[b] ..
// exc_start[b + 1]]) and exc u32 entries (row * 64 + column) << 8 | exponent.
//
// A product equals jfire_stacked_matmul's on the decoded bfloat16 weight bit for bit: the same
// split of k over threads, every y[r, j] summed over k from its chunk's first row up, one fused
// multiply-add at a time from 0, and the chunks' partials added in the same order.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX512VBMI__)
// GCC 12's AVX-512 intrinsics pass an "undefined" register as their unused merge source, and
// it warns about that inside its own headers once they are inlined (GCC bug 105593).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#endif

#include "cpu_kernels.h"
#include "cpu_panels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jfire_cpu::DotRowBlocks;
using jfire_cpu::kDotCols;
using jfire_cpu::kPanelRows;
using jfire_cpu::LaneSums;
using jfire_cpu::PanelColumns;
using jfire_cpu::PrefetchLines;
using jfire_cpu::RunChunks;
using jfire_cpu::Threads;

constexpr int64_t kBlockRows = 32, kBlockCols = 64;
constexpr int64_t kPaletteBytes = 16, kCodeBytes = 4 * kBlockCols * 4, kRawBytes = kBlockRows * kBlockCols;
constexpr int64_t kBlockBytes = kPaletteBytes + kCodeBytes + kRawBytes;

// A value's float32 bits from its raw byte and exponent (a bfloat16 widened: low half zero).
inline uint32_t ValueBits(uint32_t raw, uint32_t exponent) {
  return (raw & 0x80u) << 24 | exponent << 23 | (raw & 0x7fu) << 16;
}

inline uint32_t CodeWord(const uint8_t* block, int64_t word, int64_t col) {
  uint32_t w;
  std::memcpy(&w, block + kPaletteBytes + (word * kBlockCols + col) * 4, sizeof w);
  return w;
}

// One stack's layer: its blocks and exceptions, and its shape.
struct Coded {
  const uint8_t* blocks;
  const uint32_t* exc_start;
  const uint32_t* exc;
  int64_t n;
  float* y;
  int64_t offset;  // where its partials start among a chunk's
};

#if defined(__AVX512VBMI__)
// The rebuilding of 16 values of a block row with AVX-512 VBMI: the codes shifted into each
// lane's low 4 bits pick the exponent with one permute (vpermd reads only those bits), one
// byte permute places each raw byte at bits 16..31 of its lane, and one ternary-logic
// instruction keeps the sign and mantissa bits and adds the exponent.
struct Rebuild {
  __m512i spread, keep, table;

  explicit Rebuild(const uint8_t* palette) {
    alignas(64) uint8_t index[64];
    for (int l = 0; l < 16; ++l) index[4 * l] = index[4 * l + 1] = 0, index[4 * l + 2] = index[4 * l + 3] = l;
    spread = _mm512_load_si512(index);
    keep = _mm512_set1_epi32(static_cast<int>(0x807F0000u));
    table = _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(palette))), 23);
  }

  // Row j's columns 16v .. 16v + 15 of the block.
  template <int64_t J>
  inline __m512i Row(const uint8_t* block, int64_t v) const {
    const uint8_t* words = block + kPaletteBytes + ((J / 8) * kBlockCols + 16 * v) * 4;
    const __m512i codes = _mm512_srli_epi32(_mm512_loadu_si512(words), 4 * (J % 8));
    const __m512i exponent = _mm512_permutexvar_epi32(codes, table);
    const uint8_t* raw = block + kPaletteBytes + kCodeBytes + J * kBlockCols + 16 * v;
    const __m512i bytes = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(raw)));
    return _mm512_ternarylogic_epi32(_mm512_permutexvar_epi8(spread, bytes), keep, exponent, 0xEA);  // (b & keep) | e
  }
};

template <int64_t... J>
inline void DecodeRows(const Rebuild& rebuild, const uint8_t* block, float* out, int64_t ld,
                       std::integer_sequence<int64_t, J...>) {
  auto row = [&](auto j) {
    for (int64_t v = 0; v < 4; ++v) _mm512_storeu_si512(out + j * ld + 16 * v, rebuild.Row<j>(block, v));
  };
  (row(std::integral_constant<int64_t, J>{}), ...);
}

// One row of x by one whole block without exceptions, the values never leaving registers: y's
// 64 columns start at 0 (first) or from y, and take the block's 32 rows in order.
template <int64_t... J>
inline void MultiplyBlockRow(const Rebuild& rebuild, const uint8_t* block, const float* x, float* y, bool first,
                             const uint8_t* next, std::integer_sequence<int64_t, J...>) {
  typedef float V16 __attribute__((vector_size(64)));
  V16 acc[4];
  for (int64_t v = 0; v < 4; ++v) acc[v] = first ? V16{} : reinterpret_cast<V16>(_mm512_loadu_ps(y + 16 * v));
  auto row = [&](auto j) {
    if (next != nullptr) {
      __builtin_prefetch(next + 64 * j);
      if (64 * (j + 32) < kBlockBytes) __builtin_prefetch(next + 64 * (j + 32));
    }
    const float a = x[j];
#pragma GCC unroll 4
    for (int64_t v = 0; v < 4; ++v) acc[v] += a * reinterpret_cast<V16>(rebuild.Row<j>(block, v));
  };
  (row(std::integral_constant<int64_t, J>{}), ...);
  for (int64_t v = 0; v < 4; ++v) _mm512_storeu_ps(y + 16 * v, reinterpret_cast<__m512>(acc[v]));
}
#endif


// Block `block`'s values as float32 into out [32][64] (rows `ld` floats apart), its exceptions
// patched in.
void DecodeBlock(const uint8_t* block, const uint32_t* exc, uint32_t e0, uint32_t e1, float* out,
                 int64_t ld = kBlockCols) {
#if defined(__AVX512VBMI__)
  DecodeRows(Rebuild(block), block, out, ld, std::make_integer_sequence<int64_t, kBlockRows>{});
#else
  const uint8_t* raw = block + kPaletteBytes + kCodeBytes;
  for (int64_t j = 0; j < kBlockRows; ++j) {
    for (int64_t c = 0; c < kBlockCols; ++c) {
      const uint32_t code = (CodeWord(block, j / 8, c) >> (4 * (j % 8))) & 15u;
      const uint32_t bits = ValueBits(raw[j * kBlockCols + c], block[code]);
      std::memcpy(out + j * ld + c, &bits, sizeof bits);
    }
  }
#endif
  for (uint32_t e = e0; e < e1; ++e) {
    const uint32_t pos = exc[e] >> 8, exponent = exc[e] & 0xffu;
    float* value = out + (pos / kBlockCols) * ld + pos % kBlockCols;
    uint32_t bits;
    std::memcpy(&bits, value, sizeof bits);
    bits = (bits & 0x807FFFFFu) | exponent << 23;
    std::memcpy(value, &bits, sizeof bits);
  }
}

// y[0:m, :] = x[:, k0:k1] @ w[k0:k1, :] for one coded layer (rows k0..k1 of its k).
void MultiplyCoded(const float* x, const Coded& w, float* y, int64_t m, int64_t k, int64_t k0, int64_t k1) {
  const int64_t n = w.n, col_blocks = n / kBlockCols;
  if (k1 <= k0) {
    std::memset(y, 0, m * n * sizeof(float));
    return;
  }
  alignas(64) float buf[kBlockRows * kBlockCols];
  const int64_t panels = (m + kPanelRows - 1) / kPanelRows;
  for (int64_t rb = k0 / kBlockRows; rb * kBlockRows < k1; ++rb) {
    const int64_t lo = std::max(k0, rb * kBlockRows), hi = std::min(k1, (rb + 1) * kBlockRows);
    const bool first = lo == k0;
    for (int64_t cb = 0; cb < col_blocks; ++cb) {
      const int64_t b = rb * col_blocks + cb;
      const uint8_t* block = w.blocks + b * kBlockBytes;
      // The first block's lines are asked for at once: more of them in flight than the hardware's
      // own prefetching keeps (one row of a default-model stack: 9.0 ms without, 7.9 with). At
      // one row of x each next block's lines are asked for a line or two a row while this block
      // is summed (MultiplyBlockRow), so they arrive as it ends without ever holding more misses
      // than the core keeps in flight; asking for a whole block ahead at once stalled instead
      // (every product 7-10% slower), and streaming took the 30 layers' gate and up from 1.07x to
      // 1.10-1.14x bfloat16's speed.
      const bool streamed = b != (k0 / kBlockRows) * col_blocks && m == 1;  // asked for by the block before
      if (!streamed) PrefetchLines(block, 0, kBlockBytes);
      const uint32_t e0 = w.exc_start[b], e1 = w.exc_start[b + 1];
      float* yb = y + cb * kBlockCols;
      const bool last = (rb + 1) * kBlockRows >= k1 && cb + 1 == col_blocks;
#if defined(__AVX512VBMI__)
      if (m == 1 && hi - lo == kBlockRows && e0 == e1) {
        MultiplyBlockRow(Rebuild(block), block, x + lo, yb, first, last ? nullptr : block + kBlockBytes,
                         std::make_integer_sequence<int64_t, kBlockRows>{});
        continue;
      }
#endif
      if (m == 1 && !last) PrefetchLines(block + kBlockBytes, 0, kBlockBytes);
      DecodeBlock(block, w.exc, e0, e1, buf);
      const float* wb = buf + (lo - rb * kBlockRows) * kBlockCols;
      for (int64_t p = 0, r0 = 0; p < panels; ++p) {
        const int64_t rows = (m - r0) / (panels - p);
        const float* xr = x + r0 * k + lo;
        float* yr = yb + r0 * n;
        switch (rows) {
#define JFIRE_PANEL(R) \
  case R: PanelColumns<R>(xr, k, wb, kBlockCols, yr, n, hi - lo, first, kBlockCols, false); break;
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

// A coded stack's arrays at `layer` into `coded`, after checking their shapes against k and n.
ffi::Error CodedLayer(ffi::AnyBuffer blocks, ffi::AnyBuffer exc_start, ffi::AnyBuffer exc, int32_t layer, int64_t k,
                      int64_t n, Coded& coded) {
  const auto bd = blocks.dimensions(), sd = exc_start.dimensions(), ed = exc.dimensions();
  if (blocks.element_type() != ffi::U8 || exc_start.element_type() != ffi::U32 || exc.element_type() != ffi::U32 ||
      bd.size() != 2 || sd.size() != 2 || ed.size() != 2) {
    return ffi::Error::InvalidArgument("jfire_palette: a coded stack is blocks u8 [layers, bytes], exc_start u32 "
                                       "[layers, blocks + 1], exc u32 [layers, entries]");
  }
  if (k % kBlockRows || n % kBlockCols) {
    return ffi::Error::InvalidArgument("jfire_palette: k must be a multiple of 32 and n of 64");
  }
  const int64_t count = (k / kBlockRows) * (n / kBlockCols);
  if (bd[1] != count * kBlockBytes || sd[1] != count + 1 || sd[0] != bd[0] || ed[0] != bd[0]) {
    return ffi::Error::InvalidArgument("jfire_palette: a coded stack's arrays do not match its [k, n]");
  }
  if (layer < 0 || layer >= bd[0]) return ffi::Error::InvalidArgument("jfire_palette: layer index out of range");
  coded = Coded{static_cast<const uint8_t*>(blocks.untyped_data()) + layer * bd[1],
                static_cast<const uint32_t*>(exc_start.untyped_data()) + layer * sd[1],
                static_cast<const uint32_t*>(exc.untyped_data()) + layer * ed[1], n, nullptr, 0};
  return ffi::Error::Success();
}

// y_i = x @ w_i[layer] for every coded stack given as (blocks, exc_start, exc), sharing one
// pass over the pool (SplitContraction: jfire_stacked_matmul's split of k and order of partials).
ffi::Error PaletteMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                         ffi::RemainingArgs args, ffi::RemainingRets rets) {
  const auto xd = x.dimensions();
  const int64_t count = static_cast<int64_t>(rets.size());
  if (xd.size() != 2 || count == 0 || static_cast<int64_t>(args.size()) != 3 * count) {
    return ffi::Error::InvalidArgument("jfire_palette_matmul takes x [m, k], layer, and (blocks, exc_start, exc) "
                                       "per coded stack, and returns one [m, n_i] per stack");
  }
  const int64_t m = xd[0], k = xd[1];
  std::vector<Coded> products;
  int64_t total = 0;
  for (int64_t i = 0; i < count; ++i) {
    auto blocks = args.get<ffi::AnyBuffer>(3 * i);
    auto exc_start = args.get<ffi::AnyBuffer>(3 * i + 1);
    auto exc = args.get<ffi::AnyBuffer>(3 * i + 2);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(i);
    if (!blocks.has_value() || !exc_start.has_value() || !exc.has_value() || !y.has_value()) {
      return ffi::Error::InvalidArgument("jfire_palette_matmul: bad operands");
    }
    const auto yd = (*y)->dimensions();
    if (yd.size() != 2 || yd[0] != m) return ffi::Error::InvalidArgument("jfire_palette_matmul: outputs are [m, n_i]");
    Coded c;
    if (ffi::Error e = CodedLayer(*blocks, *exc_start, *exc, layer.typed_data()[0], k, yd[1], c); e.failure()) return e;
    c.y = (*y)->typed_data();
    c.offset = total;
    products.push_back(c);
    total += m * c.n;
  }
  const float* xp = x.typed_data();
  if (m == 0) return ffi::Error::Success();
  jfire_cpu::SplitContraction(pool, m, k, products, total, [=](const Coded& p, float* out, int64_t k0, int64_t k1) {
    MultiplyCoded(xp, p, out, m, k, k0, k1);
  });
  return ffi::Error::Success();
}

// w[layer] as bfloat16 [k, n]: each block decoded and its rows' high halves stored.
ffi::Error PaletteDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer blocks,
                         ffi::AnyBuffer exc_start, ffi::AnyBuffer exc, ffi::Result<ffi::AnyBuffer> out) {
  const auto od = out->dimensions();
  if (od.size() != 2 || out->element_type() != ffi::BF16) {
    return ffi::Error::InvalidArgument("jfire_palette_decode returns bfloat16 [k, n]");
  }
  const int64_t k = od[0], n = od[1];
  Coded w;
  if (ffi::Error e = CodedLayer(blocks, exc_start, exc, layer.typed_data()[0], k, n, w); e.failure()) return e;
  uint16_t* o = static_cast<uint16_t*>(out->untyped_data());
  const int64_t row_blocks = k / kBlockRows, col_blocks = n / kBlockCols;
  RunChunks(pool, std::min<int64_t>(pool.num_threads(), row_blocks), [=](int64_t c) {
    alignas(64) float buf[kBlockRows * kBlockCols];
    const int64_t chunks = std::min<int64_t>(pool.num_threads(), row_blocks);
    for (int64_t rb = c; rb < row_blocks; rb += chunks) {
      for (int64_t cb = 0; cb < col_blocks; ++cb) {
        const int64_t b = rb * col_blocks + cb;
        DecodeBlock(w.blocks + b * kBlockBytes, w.exc, w.exc_start[b], w.exc_start[b + 1], buf);
        for (int64_t j = 0; j < kBlockRows; ++j) {
          for (int64_t i = 0; i < kBlockCols; ++i) {
            uint32_t bits;
            std::memcpy(&bits, buf + j * kBlockCols + i, sizeof bits);
            o[(rb * kBlockRows + j) * n + cb * kBlockCols + i] = static_cast<uint16_t>(bits >> 16);
          }
        }
      }
    }
  });
  return ffi::Error::Success();
}

// y[:, n0:n1] = x @ w[n0:n1, :]^T for a coded table w [n, k] (its rows in blocks of 32): each
// strip of 32 rows of w decoded into a float32 buffer [32][k], then dotted with x by jfire_matmul_nt's
// dot blocks, which sum every y[r, j] in the same order whatever rows of w go with it.
#if defined(__AVX512VBMI__)
// One row of x dotted with a whole strip of 32 rows of w whose blocks have no exceptions, the
// values never leaving registers: row j's 64 values in block cb are the 4 registers the dot
// block's accumulators take at i = 64 cb, in the same order.
template <int64_t... J>
inline void DotStripRow(const uint8_t* strip, int64_t col_blocks, const float* x, float* y, LaneSums& sums,
                        const uint8_t* next, std::integer_sequence<int64_t, J...>) {
  typedef float V16 __attribute__((vector_size(64)));
  const int64_t lines = (col_blocks * kBlockBytes + 63) / 64, per_row = (lines + kBlockRows - 1) / kBlockRows;
  auto row = [&](auto j) {
    if (next != nullptr) {  // the next strip's lines, a few a row: never more in flight than the core keeps
      PrefetchLines(next, 64 * j * per_row, 64 * std::min(lines, (j + 1) * per_row));
    }
    V16 acc[4] = {};
    for (int64_t cb = 0; cb < col_blocks; ++cb) {
      const uint8_t* block = strip + cb * kBlockBytes;
      const Rebuild rebuild(block);
#pragma GCC unroll 4
      for (int64_t v = 0; v < 4; ++v) {
        acc[v] += reinterpret_cast<V16>(_mm512_loadu_ps(x + cb * kBlockCols + 16 * v)) *
                  reinterpret_cast<V16>(rebuild.Row<j>(block, v));
      }
    }
    acc[0] += acc[2];
    acc[1] += acc[3];
    acc[0] += acc[1];
    sums.Add(reinterpret_cast<jfire_cpu::Vec&>(acc[0]), y + j);
  };
  (row(std::integral_constant<int64_t, J>{}), ...);
}
#endif

void DotCoded(const float* x, const Coded& w, float* y, int64_t m, int64_t k, int64_t n, int64_t n0, int64_t n1) {
  thread_local std::vector<float> strip;
  strip.resize(kBlockRows * k);
  const int64_t col_blocks = k / kBlockCols;
  LaneSums sums;
  for (int64_t s = n0 / kBlockRows; s * kBlockRows < n1; ++s) {
    const int64_t lo = std::max(n0, s * kBlockRows), hi = std::min(n1, (s + 1) * kBlockRows);
    const uint8_t* blocks = w.blocks + s * col_blocks * kBlockBytes;
    const bool streamed = m == 1 && s != n0 / kBlockRows;  // asked for while the strip before was summed
    if (!streamed) PrefetchLines(blocks, 0, col_blocks * kBlockBytes);
    const bool last = (s + 1) * kBlockRows >= n1;
#if defined(__AVX512VBMI__)
    if (m == 1 && hi - lo == kBlockRows && w.exc_start[s * col_blocks] == w.exc_start[(s + 1) * col_blocks]) {
      DotStripRow(blocks, col_blocks, x, y + lo, sums, last ? nullptr : blocks + col_blocks * kBlockBytes,
                  std::make_integer_sequence<int64_t, kBlockRows>{});
      continue;
    }
#endif
    if (m == 1 && !last) PrefetchLines(blocks + col_blocks * kBlockBytes, 0, col_blocks * kBlockBytes);
    for (int64_t cb = 0; cb < col_blocks; ++cb) {
      const int64_t b = s * col_blocks + cb;
      DecodeBlock(w.blocks + b * kBlockBytes, w.exc, w.exc_start[b], w.exc_start[b + 1], strip.data() + cb * kBlockCols, k);
    }
    auto row = [&](int64_t j) { return strip.data() + (j - s * kBlockRows) * k; };  // row j of w
    int64_t j = lo;
    for (; j + kDotCols <= hi; j += kDotCols) DotRowBlocks<kDotCols>(x, row(j), y + j, m, k, n, sums);
    for (; j < hi; ++j) DotRowBlocks<1>(x, row(j), y + j, m, k, n, sums);
  }
  sums.Flush();
}

ffi::Error PaletteMatmulNT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer blocks,
                           ffi::AnyBuffer exc_start, ffi::AnyBuffer exc, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || xd[0] != yd[0]) {
    return ffi::Error::InvalidArgument("jfire_palette_matmul_nt takes x [m, k] and returns [m, n]");
  }
  const int64_t m = xd[0], k = xd[1], n = yd[1];
  Coded w;
  if (ffi::Error e = CodedLayer(blocks, exc_start, exc, 0, n, k, w); e.failure()) return e;
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  const int64_t chunks = Threads(pool, n);
  const int64_t per = (n + chunks - 1) / chunks;
  RunChunks(pool, chunks, [=](int64_t c) {
    const int64_t n0 = c * per, n1 = std::max(n0, std::min(n, n0 + per));
    DotCoded(xp, w, yp, m, k, n, n0, n1);
  });
  return ffi::Error::Success();
}

// Rows `ids` of a coded table [n, k] as bfloat16 [t, k] (an id out of range: numpy's rule for
// negative ones, then clamped, as XLA's gather clamps).
ffi::Error PaletteRows(ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer blocks, ffi::AnyBuffer exc_start, ffi::AnyBuffer exc,
                       ffi::Result<ffi::AnyBuffer> out) {
  const auto od = out->dimensions();
  const int64_t t = static_cast<int64_t>(ids.element_count());
  if (od.size() != 2 || od[0] != t || out->element_type() != ffi::BF16) {
    return ffi::Error::InvalidArgument("jfire_palette_rows returns bfloat16 [ids, k]");
  }
  const int64_t k = od[1], rows_total = blocks.dimensions().size() == 2 ? blocks.dimensions()[1] : 0;
  const int64_t col_blocks = k / kBlockCols;
  const int64_t n = col_blocks ? rows_total / (col_blocks * kBlockBytes) * kBlockRows : 0;
  Coded w;
  if (ffi::Error e = CodedLayer(blocks, exc_start, exc, 0, n, k, w); e.failure()) return e;
  uint16_t* o = static_cast<uint16_t*>(out->untyped_data());
  for (int64_t r = 0; r < t; ++r) {
    int64_t id = ids.typed_data()[r];
    id = std::clamp<int64_t>(id < 0 ? id + n : id, 0, n - 1);
    const int64_t s = id / kBlockRows, j = id % kBlockRows;
    for (int64_t cb = 0; cb < col_blocks; ++cb) {
      const int64_t b = s * col_blocks + cb;
      const uint8_t* block = w.blocks + b * kBlockBytes;
      const uint8_t* raw = block + kPaletteBytes + kCodeBytes + j * kBlockCols;
      uint16_t* row = o + r * k + cb * kBlockCols;
      for (int64_t c = 0; c < kBlockCols; ++c) {
        const uint32_t code = (CodeWord(block, j / 8, c) >> (4 * (j % 8))) & 15u;
        row[c] = static_cast<uint16_t>(ValueBits(raw[c], block[code]) >> 16);
      }
      for (uint32_t e = w.exc_start[b]; e < w.exc_start[b + 1]; ++e) {
        const uint32_t pos = w.exc[e] >> 8;
        if (static_cast<int64_t>(pos) / kBlockCols != j) continue;
        const int64_t c = pos % kBlockCols;
        row[c] = static_cast<uint16_t>((row[c] & 0x807Fu) | (w.exc[e] & 0xffu) << 7);
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

// The coded form of one layer [k, n] of bfloat16 bits (encode in cpu_palette.py; its numpy
// form is the reference the tests hold this to): writes blocks (k/32 * n/64 * kBlockBytes
// bytes), exc_start (blocks + 1) and the exceptions (at most k * n), and returns how many.
// A block's palette: its 16 commonest exponents, ties to the smaller exponent.
extern "C" int64_t jfire_palette_encode(const uint16_t* bits, int64_t k, int64_t n, uint8_t* blocks,
                                        uint32_t* exc_start, uint32_t* exc) {
  const int64_t row_blocks = k / kBlockRows, col_blocks = n / kBlockCols;
  int64_t count = 0;
  exc_start[0] = 0;
  for (int64_t rb = 0; rb < row_blocks; ++rb) {
    for (int64_t cb = 0; cb < col_blocks; ++cb) {
      const int64_t b = rb * col_blocks + cb;
      uint8_t* block = blocks + b * kBlockBytes;
      const uint16_t* w = bits + rb * kBlockRows * n + cb * kBlockCols;
      uint32_t hist[256] = {};
      for (int64_t j = 0; j < kBlockRows; ++j)
        for (int64_t c = 0; c < kBlockCols; ++c) ++hist[(w[j * n + c] >> 7) & 0xff];
      uint8_t order[256];
      for (int i = 0; i < 256; ++i) order[i] = static_cast<uint8_t>(i);
      std::stable_sort(order, order + 256, [&](uint8_t a, uint8_t b2) { return hist[a] > hist[b2]; });
      uint8_t code_of[256];
      std::memset(code_of, 0xff, sizeof code_of);
      for (int i = 0; i < 16; ++i) code_of[order[i]] = static_cast<uint8_t>(i), block[i] = order[i];
      uint32_t words[4][kBlockCols] = {};
      uint8_t* raw = block + kPaletteBytes + kCodeBytes;
      for (int64_t j = 0; j < kBlockRows; ++j) {
        for (int64_t c = 0; c < kBlockCols; ++c) {
          const uint16_t v = w[j * n + c];
          const uint32_t exponent = (v >> 7) & 0xff;
          uint32_t code = code_of[exponent];
          if (code == 0xff) {
            exc[count++] = static_cast<uint32_t>(j * kBlockCols + c) << 8 | exponent;
            code = 0;
          }
          words[j / 8][c] |= code << (4 * (j % 8));
          raw[j * kBlockCols + c] = static_cast<uint8_t>(((v >> 8) & 0x80) | (v & 0x7f));
        }
      }
      std::memcpy(block + kPaletteBytes, words, sizeof words);
      exc_start[b + 1] = static_cast<uint32_t>(count);
    }
  }
  return count;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(jfire_palette_matmul, PaletteMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jfire_palette_matmul_nt, PaletteMatmulNT,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jfire_palette_rows, PaletteRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jfire_palette_decode, PaletteDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

#if defined(__AVX512VBMI__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
