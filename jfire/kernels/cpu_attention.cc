// Attention of a few query tokens per row over the paged KV cache, for XLA:CPU (see
// cpu_attention.py).
//
//   jfire_paged_attention: out[b, t, h, d] = softmax(q k^T / sqrt(d)) v for each query token,
//     over the keys and values of its row's pages in the stacked cache
//     pages [layers, kv_heads, num_pages, page_size, d] at one layer (a device scalar).
//
// XLA's form of this loop gathers each block of pages into a contiguous copy, transposes it,
// and runs a dozen small kernels per block; here every key is read where it lies, once.
//
// The work is split into fixed segments of kSegment positions of one (query token, kv head)
// pair, so a long context keeps both threads busy at batch 1; the segments' partial softmaxes
// are merged in position order. The split depends only on the positions, never on the batch,
// so a row's result is the same bits alone or batched.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kSegment = 256;  // positions per unit of work

// One segment's partial softmax for the g query heads of one kv head: running max m, sum of
// exp(score - m) l, and the exp-weighted sum of values acc [g, d].
struct Partial {
  float* m;
  float* l;
  float* acc;
};

// exp(x) for the softmax's x <= 0: Cephes' expf (x = n ln 2 + r, a degree-6 polynomial in r,
// times 2^n; a few ulp, by its authors' measure), written so the compiler vectorizes it;
// std::exp is a call per element, which took as long as the scores' dot products.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);  // exp(-87) is still a normal float; the weights below it are ~0
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln 2)
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;            // ln 2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

using jfire_cpu::kLanes;
using jfire_cpu::LoadU;
using jfire_cpu::StoreU;
using jfire_cpu::Vec;
constexpr int64_t kAccumulators = 24;  // vector registers the weighted sums may hold

// acc[i] = sum over j of p[i, j] * values[j] for G heads, VD vectors of kLanes floats a value:
// the sums stay in registers and each value is read once for all G heads. The same order of
// fused multiply-adds as one head at a time.
//
// The loads are single instructions and the loops unrolled so that GCC keeps the sums in
// registers: written with memcpy and plain loops, it kept them on the stack, adding to each
// in memory, and copied each value to the stack in halves before loading it whole (a stalled
// load a value). With that, ScoreVectors' loads and MaxOf below (the same sums, the same
// bits), the default model's 30 layers at 2,000 positions took 16.3-16.7 ms for 9 tokens a
// row against 28-30, 4.1-4.5 for one against 5.9-6.6; at 150 positions 1.8-2.2 for 9 against
// 3.2-3.8 (perf: a third of the kernel's time was in those stalls and the scalar max).

template <int64_t G, int64_t VD>
void WeighValues(const float* __restrict p, int64_t n, const float* const* values, float* __restrict acc) {
  Vec a[G][VD];
#pragma GCC unroll 8
  for (int64_t i = 0; i < G; ++i)
#pragma GCC unroll 16
    for (int64_t c = 0; c < VD; ++c) a[i][c] = Vec{};
  for (int64_t j = 0; j < n; ++j) {
    const float* value = values[j];
    Vec v[VD];
#pragma GCC unroll 16
    for (int64_t c = 0; c < VD; ++c) v[c] = LoadU(value + c * kLanes);
#pragma GCC unroll 8
    for (int64_t i = 0; i < G; ++i) {
      const float w = p[i * n + j];
#pragma GCC unroll 16
      for (int64_t c = 0; c < VD; ++c) a[i][c] += w * v[c];
    }
  }
#pragma GCC unroll 8
  for (int64_t i = 0; i < G; ++i)
#pragma GCC unroll 16
    for (int64_t c = 0; c < VD; ++c) StoreU(acc + (i * VD + c) * kLanes, a[i][c]);
}

template <int64_t VD>
void WeighHeads(const float* p, int64_t g, int64_t n, const float* const* values, float* acc) {
  constexpr int64_t per = std::max<int64_t>(1, std::min<int64_t>(6, kAccumulators / VD));
  for (int64_t i0 = 0; i0 < g; i0 += per) {
    const float* pi = p + i0 * n;
    float* ai = acc + i0 * VD * kLanes;
    switch (std::min(per, g - i0)) {
      case 1: WeighValues<1, VD>(pi, n, values, ai); break;
      case 2: if constexpr (per >= 2) WeighValues<2, VD>(pi, n, values, ai); break;
      case 3: if constexpr (per >= 3) WeighValues<3, VD>(pi, n, values, ai); break;
      case 4: if constexpr (per >= 4) WeighValues<4, VD>(pi, n, values, ai); break;
      case 5: if constexpr (per >= 5) WeighValues<5, VD>(pi, n, values, ai); break;
      case 6: if constexpr (per >= 6) WeighValues<6, VD>(pi, n, values, ai); break;
    }
  }
}

// acc [g, d] = p [g, n] weighting values[0..n) of d floats: in registers for the head sizes
// of the models jfire serves, in memory otherwise.
void Weigh(const float* p, int64_t g, int64_t n, int64_t d, const float* const* values, float* acc) {
  if (d == 4 * kLanes) return WeighHeads<4>(p, g, n, values, acc);
  if (d == 8 * kLanes) return WeighHeads<8>(p, g, n, values, acc);
  if (d == 16 * kLanes) return WeighHeads<16>(p, g, n, values, acc);
  for (int64_t i = 0; i < g; ++i) {
    float* a = acc + i * d;
    std::memset(a, 0, d * sizeof(float));
    for (int64_t j = 0; j < n; ++j) {
      const float w = p[i * n + j];
      const float* v = values[j];
#pragma omp simd
      for (int64_t e = 0; e < d; ++e) a[e] += w * v[e];
    }
  }
}

// Lane i of Fold<H>'s halves: pairs of vectors become one, lane groups of H floats from the
// first in the lower half and from the second in the upper; the lower of the two halves takes
// each group's first H lanes, the upper its next H. Indices below kLanes are the first
// vector's lanes, from kLanes up the second's.
constexpr int32_t FoldLane(int64_t h, bool upper, int64_t i) {
  const int64_t half = kLanes / 2, t = i % half;
  return static_cast<int32_t>((i < half ? 0 : kLanes) + (t / h) * 2 * h + t % h + (upper ? h : 0));
}

// The two vectors' lanes FoldLane names. __builtin_shufflevector is clang's, and GCC's from 12
// on (the same machine code as GCC's own __builtin_shuffle, which clang lacks); GCC 11, the
// oldest with __builtin_bit_cast and so the oldest to build these kernels, has only the latter.
template <int64_t H, bool Upper, size_t... I>
inline Vec FoldHalf(Vec a, Vec b, std::index_sequence<I...>) {
#if __has_builtin(__builtin_shufflevector)
  return __builtin_shufflevector(a, b, FoldLane(H, Upper, I)...);
#else
  typedef int32_t Lanes __attribute__((vector_size(sizeof(Vec))));
  return __builtin_shuffle(a, b, Lanes{FoldLane(H, Upper, I)...});
#endif
}

// Sums each of v[0..2H)'s lanes (H = kLanes / 2 at the top) into one vector whose lane j is the
// sum of v[j]: each level adds the two halves of every lane group, halving the vectors and
// the lanes each sum still spans. A vector's sum takes the same path whatever the others hold.
template <int64_t H>
inline Vec Fold(Vec* v) {
  constexpr auto lanes = std::make_index_sequence<kLanes>();
  for (int64_t p = 0; p < H; ++p) {
    v[p] = FoldHalf<H, false>(v[2 * p], v[2 * p + 1], lanes) + FoldHalf<H, true>(v[2 * p], v[2 * p + 1], lanes);
  }
  if constexpr (H > 1) return Fold<H / 2>(v);
  return v[0];
}

// scores[i * n + j] = scale * q_i . key_j for the g heads q [g, d] and `count` keys d floats
// apart: each key's dot product is its own chain of fused multiply-adds over the vectors of d,
// kLanes keys' chains are summed at once by Fold (a horizontal sum per key cost more than
// its products).
template <int64_t VD>
void ScoreVectors(const float* __restrict q, int64_t g, const float* __restrict keys, int64_t count, float scale,
                  float* __restrict scores, int64_t n) {
  constexpr int64_t d = VD * kLanes;
  for (int64_t j0 = 0; j0 < count; j0 += kLanes) {
    const int64_t block = std::min(kLanes, count - j0);
    for (int64_t i = 0; i < g; ++i) {
      // Single loads of q and the keys, the loops unrolled: written with memcpy, GCC copied q
      // to the stack in halves before loading it whole and cleared the sums with a call to
      // memset, a head and 16 keys at a time.
      Vec qv[VD];
#pragma GCC unroll 16
      for (int64_t c = 0; c < VD; ++c) qv[c] = LoadU(q + i * d + c * kLanes);
      Vec acc[kLanes];
#pragma GCC unroll 16
      for (int64_t j = 0; j < kLanes; ++j) {
        Vec sum = Vec{};
        if (j < block) {
          const float* key = keys + (j0 + j) * d;
#pragma GCC unroll 16
          for (int64_t c = 0; c < VD; ++c) sum += qv[c] * LoadU(key + c * kLanes);
        }
        acc[j] = sum;
      }
      const Vec sums = Fold<kLanes / 2>(acc) * scale;
      if (block == kLanes) {
        StoreU(scores + i * n + j0, sums);
      } else {
        std::memcpy(scores + i * n + j0, &sums, block * sizeof(float));
      }
    }
  }
}

void Score(const float* q, int64_t g, int64_t d, const float* keys, int64_t count, float scale, float* scores,
           int64_t n) {
  if (d == 4 * kLanes) return ScoreVectors<4>(q, g, keys, count, scale, scores, n);
  if (d == 8 * kLanes) return ScoreVectors<8>(q, g, keys, count, scale, scores, n);
  for (int64_t j = 0; j < count; ++j) {
    const float* key = keys + j * d;
    for (int64_t i = 0; i < g; ++i) {
      const float* qi = q + i * d;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t e = 0; e < d; ++e) dot += qi[e] * key[e];
      scores[i * n + j] = dot * scale;
    }
  }
}

// The largest of s[0..n) (n >= 1), a register of lanes at a time (the largest whatever the
// order): GCC left the loop of std::max a chain of dependent scalar compares, a score each.
inline float MaxOf(const float* s, int64_t n) {
  float m = s[0];
  int64_t j = 1;
  if (n >= kLanes) {
    Vec top = LoadU(s);
    for (j = kLanes; j + kLanes <= n; j += kLanes) {
      const Vec x = LoadU(s + j);
      top = top < x ? x : top;
    }
    m = top[0];
    for (int64_t l = 1; l < kLanes; ++l) m = std::max(m, top[l]);
  }
  for (; j < n; ++j) m = std::max(m, s[j]);
  return m;
}

// Keys lo..hi (inclusive) of one row's pages for query heads q [g, d]; kp/vp point at this
// layer's and kv head's pages [num_pages, page_size, d]. False if the table names a page
// outside the pool.
bool AttendSegment(const float* __restrict q, int64_t g, int64_t d, const float* __restrict kp,
                   const float* __restrict vp, const int32_t* table, int64_t num_pages, int64_t page_size,
                   int64_t lo, int64_t hi, float scale, Partial out) {
  const int64_t n = hi - lo + 1;
  std::vector<float> scores(g * n);
  std::vector<const float*> values(n);
  for (int64_t index = lo / page_size; index <= hi / page_size; ++index) {  // page by page: no division a key
    const int32_t page = table[index];
    if (page < 0 || page >= num_pages) return false;
    const int64_t first = index * page_size, s0 = std::max(lo, first), s1 = std::min(hi, first + page_size - 1);
    const int64_t base = static_cast<int64_t>(page) * page_size * d;
    for (int64_t s = s0; s <= s1; ++s) values[s - lo] = vp + base + (s - first) * d;
    Score(q, g, d, kp + base + (s0 - first) * d, s1 - s0 + 1, scale, scores.data() + (s0 - lo), n);
  }
  for (int64_t i = 0; i < g; ++i) {
    float* si = scores.data() + i * n;
    const float m = MaxOf(si, n);
    float l = 0.0f;
#pragma omp simd reduction(+ : l)
    for (int64_t j = 0; j < n; ++j) {
      si[j] = ExpNonPositive(si[j] - m);
      l += si[j];
    }
    out.m[i] = m;
    out.l[i] = l;
  }
  Weigh(scores.data(), g, n, d, values.data(), out.acc);
  return true;
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
                          ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> layer_buf,
                          ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> positions,
                          ffi::ResultBuffer<ffi::F32> out, int64_t sliding_window, float scale) {
  const auto qd = q.dimensions(), pd = k_pages.dimensions(), td = page_table.dimensions(),
             posd = positions.dimensions();
  const auto vd = v_pages.dimensions();
  if (qd.size() != 4 || pd.size() != 5 || td.size() != 2 || posd.size() != 2 || vd.size() != 5 ||
      !std::equal(pd.begin(), pd.end(), vd.begin()) ||
      posd[0] != qd[0] || posd[1] != qd[1] || td[0] != qd[0] || pd[4] != qd[3] || qd[2] % pd[1] != 0) {
    return ffi::Error::InvalidArgument("jfire_paged_attention takes q [b, t, h, d], k and v pages [layers, kv_heads, "
                                       "num_pages, page_size, d], layer, page_table [b, w] and positions [b, t]");
  }
  const int64_t b = qd[0], t = qd[1], h = qd[2], d = qd[3];
  const int64_t layers = pd[0], kvh = pd[1], num_pages = pd[2], page_size = pd[3], width = td[1];
  const int64_t g = h / kvh;
  const int32_t layer = layer_buf.typed_data()[0];
  if (layer < 0 || layer >= layers) return ffi::Error::InvalidArgument("jfire_paged_attention: layer out of range");
  const int64_t head_pages = num_pages * page_size * d;  // floats of one layer's one kv head
  const float* kbase = k_pages.typed_data() + static_cast<int64_t>(layer) * kvh * head_pages;
  const float* vbase = v_pages.typed_data() + static_cast<int64_t>(layer) * kvh * head_pages;
  const float* qp = q.typed_data();
  const int32_t* tp = page_table.typed_data();
  const int32_t* pos = positions.typed_data();
  float* op = out->typed_data();

  // The units of work: (query token, kv head, segment); unit c writes partial c.
  struct Unit {
    int64_t token, head, lo, hi;
  };
  struct Pair {  // one (query token, kv head): units [first, first + count), in position order
    int64_t first, count;
  };
  std::vector<Unit> units;
  std::vector<Pair> pairs;
  for (int64_t token = 0; token < b * t; ++token) {
    const int64_t p = pos[token];
    if (p < 0) {  // padding sees nothing: zeros, as the reference gives
      std::memset(op + token * h * d, 0, h * d * sizeof(float));
      continue;
    }
    if (p >= width * page_size) return ffi::Error::InvalidArgument("jfire_paged_attention: a position is past its page table");
    const int64_t lo = sliding_window > 0 ? std::max<int64_t>(0, p - sliding_window + 1) : 0;
    for (int64_t head = 0; head < kvh; ++head) {
      const int64_t first = static_cast<int64_t>(units.size());
      for (int64_t s = lo / kSegment * kSegment; s <= p; s += kSegment) {
        units.push_back({token, head, std::max(s, lo), std::min(p, s + kSegment - 1)});
      }
      pairs.push_back({first, static_cast<int64_t>(units.size()) - first});
    }
  }
  const int64_t stride = g * (d + 2);  // floats of one partial: m [g], l [g], acc [g, d]
  std::vector<float> partials(units.size() * stride);
  std::atomic<bool> bad_page{false};
  const Unit* us = units.data();
  float* parts = partials.data();
  // The units in the order they run: those of a row's tokens that read the same segment of the
  // same kv head one after another on one thread, so its keys and values come from memory once
  // and from cache for the row's other tokens (a verify step's k + 1 tokens a row, which
  // DecodeRows passes as one row: at 2,000 positions the default model's 30 layers took 26.3-26.4
  // ms for 9 tokens against 29.3-30.7 token-major, 43-46 for 17 against 53-54; at 300 positions
  // 4.2 against 4.4-4.5). Each unit's sums are its own, so the order changes no result. Items:
  // such runs, split into parts where there are too few to keep the threads busy.
  const int64_t count = static_cast<int64_t>(units.size());
  const int64_t workers = std::min<int64_t>(pool.num_threads(), count);
  std::vector<int64_t> order(count);
  for (int64_t c = 0; c < count; ++c) order[c] = c;
  auto segment_of = [&](int64_t c) {
    const Unit& u = units[c];
    return std::make_tuple(u.token / t, u.head, u.lo / kSegment);
  };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return segment_of(a) < segment_of(b); });
  std::vector<int64_t> runs;  // start of each run of order sharing a segment, then count
  for (int64_t i = 0; i < count; ++i) {
    if (i == 0 || segment_of(order[i]) != segment_of(order[i - 1])) runs.push_back(i);
  }
  runs.push_back(count);
  const int64_t run_count = static_cast<int64_t>(runs.size()) - 1;
  const int64_t split = run_count > 0 ? std::max<int64_t>(1, (4 * workers + run_count - 1) / run_count) : 1;
  std::vector<int64_t> items;  // item c is order[items[c] .. items[c + 1])
  for (int64_t r = 0; r < run_count; ++r) {
    const int64_t first = runs[r], size = runs[r + 1] - first, n = std::min(split, size);
    for (int64_t p = 0; p < n; ++p) items.push_back(first + p * size / n);
  }
  items.push_back(count);
  const int64_t* ord = order.data();
  const int64_t* its = items.data();
  auto work = [=, &bad_page](int64_t item) {
    for (int64_t i = its[item]; i < its[item + 1]; ++i) {
      const int64_t c = ord[i];
      const Unit& u = us[c];
      const int64_t row = u.token / t;
      float* part = parts + c * stride;
      if (!AttendSegment(qp + (u.token * h + u.head * g) * d, g, d, kbase + u.head * head_pages,
                         vbase + u.head * head_pages, tp + row * width, num_pages, page_size, u.lo, u.hi, scale,
                         {part, part + g, part + 2 * g})) {
        bad_page.store(true, std::memory_order_relaxed);
      }
    }
  };
  const int64_t item_count = static_cast<int64_t>(items.size()) - 1;
  if (item_count > 0) jfire_cpu::RunChunks(pool, item_count, work, std::min<int64_t>(workers, item_count));
  if (bad_page.load()) return ffi::Error::InvalidArgument("jfire_paged_attention: a page table names a page outside the pool");

  // Merge each pair's segments in position order.
  for (const Pair& pr : pairs) {
    const Unit& first_unit = units[pr.first];  // the pair's token and kv head
    for (int64_t i = 0; i < g; ++i) {
      float m = parts[pr.first * stride + i];
      for (int64_t u = 1; u < pr.count; ++u) m = std::max(m, parts[(pr.first + u) * stride + i]);
      float l = 0.0f;
      float* o = op + (first_unit.token * h + first_unit.head * g + i) * d;
      std::memset(o, 0, d * sizeof(float));
      for (int64_t u = 0; u < pr.count; ++u) {
        const float* part = parts + (pr.first + u) * stride;
        const float w = std::exp(part[i] - m);
        l += part[g + i] * w;
        const float* acc = part + 2 * g + i * d;
#pragma omp simd
        for (int64_t e = 0; e < d; ++e) o[e] += acc[e] * w;
      }
      const float inv = 1.0f / l;
#pragma omp simd
      for (int64_t e = 0; e < d; ++e) o[e] *= inv;
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jfire_paged_attention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("scale"));
