// Paged attention over the cache for the compiled CPU forward (csrc/cpu_forward.cpp): decode rows
// and prefill chunks read each sequence's pages in place; chunks of kMatmulRows rows or more gather
// their context once for ATen's fused attention. Rows, sequences and positions as in
// cpu_forward.cpp's layout comment.
//
// Included by cpu_forward.cpp inside its namespace, after its f32() / to<T>(), exp_f, row_max,
// exp_shifted_sum(_fixed), sum16 and load_bf16; work::Pool from work_pool.h (through quant_lanes.h).

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <numeric>
#include <type_traits>
#include <vector>

// Paged attention over the cache, reading the pages in place. A work item is a block of up to
// kRowBlock consecutive rows of one sequence (a decode row is a block of one); it walks the
// sequence's pages once for all its query heads, so each page (every kv head of page_size
// positions, contiguous) is loaded once and stays in L1 while the G query heads of each kv head use
// it; with AVX-512 or AVX2 (a head size of whole 16s) each key / value row is widened in registers
// once for up to 3 of them (qk_group, pv_group), and the next page is asked for while this one is
// used. Per item: scores of every query against the positions it sees (row i of a chunk sees
// 0 .. cached + i), softmax in float, the weighted sum of V rows. kD > 0 fixes the head size at
// compile time (the inner loops then unroll into whole vectors); kD == 0 reads it at run time.
constexpr int64_t kRowBlock = 8;

// A sequence with at least this many new rows (a long prefill chunk) attends through ATen's fused
// scaled_dot_product_attention instead (prefill_attention below): its scores are a matmul, and the
// gather of its context is paid once for many rows. Measured on a 135M model in bf16 (2 threads):
// the paged kernel is faster up to ~512-row prompts (256: 8-10% of the whole prefill), the fused
// one from ~1024 rows (2000: 20%).
constexpr int64_t kMatmulRows = 768;


// s[o] = q . k_o for the m key rows k_o = k + o * stride (head size D). With AVX-512 and a head
// size of whole vectors: q stays in registers, 16 rows' dot products run side by side, and their
// sums come out of one sum16.
template <int64_t kD>
inline void qk_scores(const float* q, const float* k, int64_t stride, int64_t m, int64_t D, float* s) {
  int64_t o = 0;
#if defined(__AVX512F__)
  if constexpr (kD > 0 && kD % 16 == 0) {
    constexpr int64_t V = kD / 16;
    __m512 qv[V];
    for (int64_t v = 0; v < V; ++v) qv[v] = _mm512_loadu_ps(q + 16 * v);
    for (; o + 16 <= m; o += 16) {
      __m512 dots[16];
      for (int64_t i = 0; i < 16; ++i) {
        const float* kr = k + (o + i) * stride;
        __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
        for (int64_t v = 1; v < V; ++v) a = _mm512_fmadd_ps(qv[v], _mm512_loadu_ps(kr + 16 * v), a);
        dots[i] = a;
      }
      _mm512_storeu_ps(s + o, sum16(dots));
    }
  }
#endif
  for (; o < m; ++o) {
    const float* kr = k + o * stride;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += q[d] * kr[d];
    s[o] = dot;
  }
}

#if defined(__AVX512BF16__)

// The same for bf16 queries and keys where the CPU has AVX-512-BF16: vdpbf16ps takes 32 pairs per
// instruction straight from the cache page (exact products, float sums), so a page of keys is not
// widened to float first; s[o] = scale * (q . k_o).
template <int64_t kD>
inline void qk_scores_bf16(const c10::BFloat16* q, const c10::BFloat16* k, int64_t stride, int64_t m, float scale,
                           float* s) {
  static_assert(kD % 32 == 0);
  constexpr int64_t V = kD / 32;
  __m512bh qv[V];
  for (int64_t v = 0; v < V; ++v) qv[v] = load_bf16(q + 32 * v);
  const __m512 sc = _mm512_set1_ps(scale);
  int64_t o = 0;
  for (; o + 16 <= m; o += 16) {
    __m512 dots[16];
    for (int64_t i = 0; i < 16; ++i) {
      const c10::BFloat16* kr = k + (o + i) * stride;
      __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], load_bf16(kr));
      for (int64_t v = 1; v < V; ++v) a = _mm512_dpbf16_ps(a, qv[v], load_bf16(kr + 32 * v));
      dots[i] = a;
    }
    _mm512_storeu_ps(s + o, _mm512_mul_ps(sum16(dots), sc));
  }
  for (; o < m; ++o) {
    const c10::BFloat16* kr = k + o * stride;
    float dot = 0.f;
    for (int64_t d = 0; d < kD; ++d) dot += f32(q[d]) * f32(kr[d]);
    s[o] = dot * scale;
  }
}
#endif

// acc += sum over o < m of w[o] * v_o, v_o = v + o * stride. With AVX-512: acc in registers, two
// positions per iteration into separate accumulators (so consecutive FMAs do not wait on each other).
template <int64_t kD>
inline void pv_accumulate(const float* w, const float* v, int64_t stride, int64_t m, int64_t D, float* acc) {
#if defined(__AVX512F__)
  if constexpr (kD > 0 && kD % 16 == 0) {
    constexpr int64_t V = kD / 16;
    __m512 a[V], b[V];
    for (int64_t i = 0; i < V; ++i) {
      a[i] = _mm512_loadu_ps(acc + 16 * i);
      b[i] = _mm512_setzero_ps();
    }
    int64_t o = 0;
    for (; o + 2 <= m; o += 2) {
      const __m512 w0 = _mm512_set1_ps(w[o]), w1 = _mm512_set1_ps(w[o + 1]);
      const float* v0 = v + o * stride;
      const float* v1 = v0 + stride;
      for (int64_t i = 0; i < V; ++i) {
        a[i] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(v0 + 16 * i), a[i]);
        b[i] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(v1 + 16 * i), b[i]);
      }
    }
    if (o < m) {
      const __m512 w0 = _mm512_set1_ps(w[o]);
      for (int64_t i = 0; i < V; ++i) a[i] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(v + o * stride + 16 * i), a[i]);
    }
    for (int64_t i = 0; i < V; ++i) _mm512_storeu_ps(acc + 16 * i, _mm512_add_ps(a[i], b[i]));
    return;
  }
#endif
  for (int64_t o = 0; o < m; ++o) {
    const float wo = w[o];
    const float* vr = v + o * stride;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] += wo * vr[d];
  }
}

// Work items to `bins` threads. Items differ in work (a mixed batch holds 16- and 700-token
// sequences), so contiguous equal-count shares left a thread waiting on the other: each item goes,
// longest first, to the least-loaded bin. Out: order (the items bin by bin, each bin in batch order)
// and bin_start (bin t holds order[bin_start[t] .. bin_start[t + 1])).
void balance(const std::vector<int64_t>& work, int64_t bins, std::vector<int64_t>& order,
             std::vector<int64_t>& bin_start) {
  const int64_t items = static_cast<int64_t>(work.size());
  order.resize(items);
  std::iota(order.begin(), order.end(), 0);
  bin_start.assign(bins + 1, 0);
  if (bins == 1 || bins == items) {          // nothing to balance: one bin, or an item per bin
    for (int64_t t = 0; t <= bins; ++t) bin_start[t] = bins == 1 ? (t == 0 ? 0 : items) : t;
    return;
  }
  std::vector<int64_t> bin_of(items), load(bins, 0), by_work(order);
  std::stable_sort(by_work.begin(), by_work.end(), [&](int64_t a, int64_t b) { return work[a] > work[b]; });
  for (int64_t it : by_work) {
    bin_of[it] = std::min_element(load.begin(), load.end()) - load.begin();
    load[bin_of[it]] += work[it];
    ++bin_start[bin_of[it] + 1];
  }
  for (int64_t t = 0; t < bins; ++t) bin_start[t + 1] += bin_start[t];
  std::vector<int64_t> fill(bin_start.begin(), bin_start.end() - 1);
  for (int64_t it = 0; it < items; ++it) order[fill[bin_of[it]]++] = it;
}

#if defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
#define PAGEDECODE_E4M3_VIA_FLOAT16 1    // widen() and load16x() read fp8 through e4m3_to_float16x
#endif

#if defined(PAGEDECODE_E4M3_VIA_FLOAT16)
// 16 float8_e4m3fn bytes -> their float values times 2^-8 (lo: the first 8, hi: the next), exactly,
// through float16: a byte sign-extended to 16 bits and shifted left by 7 holds the sign in bits 15
// and 14 and e4m3's exponent and mantissa below; with bit 14 cleared it is the float16 whose
// exponent field is e4m3's and whose top mantissa bits are its three, subnormals included. Float16's
// exponent bias (15) is e4m3's (7) plus 8, so that float16 is the e4m3 value times 2^-8, which
// vcvtph2ps widens exactly (float16 subnormals whatever DAZ says); the 2^8 goes into the row's scale
// (kFp8Unit: a power of two, so every product and sum is the same bits times 2^-8 and the scaled
// result the same bits, unless a product or weight falls below float's normal range, ~1e-38, where
// the two orders may round a denormal differently). 0x7f / 0xff (NaN) land on 0x3f80 / 0xbf80, the
// only codes with those 7 bits set, and become float16's NaN. 9 operations per 16 values (widening
// through int32 took 26; counted from the code).
inline void e4m3_to_float16x(__m128i bytes, __m256& lo, __m256& hi) {
  __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7),
                               _mm256_set1_epi16(static_cast<int16_t>(0xbfff)));
  const __m256i top = _mm256_set1_epi16(0x3f80);
  h = _mm256_or_si256(h, _mm256_cmpeq_epi16(_mm256_and_si256(h, top), top));
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}
// what an fp8 row's scale is multiplied by before it meets the widened values: 2^8 where they come
// from e4m3_to_float16x, else 1 (AVX-512's exact table, c10's conversion without F16C)
template <typename C>
constexpr float kFp8Unit = std::is_same_v<C, c10::Float8_e4m3fn> ? 256.f : 1.f;
#else
template <typename C>
constexpr float kFp8Unit = 1.f;
#endif

// dst[0, n) = src[0, n) as float: a page of a 16-bit or 8-bit cache (8-bit: unscaled, fp8 times
// 1 / kFp8Unit; attend_block applies each row's scale to its scores)
template <typename C>
inline void widen(const C* src, int64_t n, float* dst) {
  int64_t e = 0;
#if defined(__AVX512F__)
  for (; sizeof(C) == 2 && e + 16 <= n; e += 16) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + e));
    if constexpr (std::is_same_v<C, c10::Half>)
      _mm512_storeu_ps(dst + e, _mm512_cvtph_ps(x));
    else
      _mm512_storeu_ps(dst + e, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16)));
  }
#elif defined(PAGEDECODE_E4M3_VIA_FLOAT16)
  // 8 at a time (the scalar loop converted one value per vpinsrw + vcvtph2ps: on SmolLM2's decode
  // with a float16 cache, 80% of attend_block's time); every conversion is exact, so the same floats
  for (; sizeof(C) == 2 && e + 8 <= n; e += 8) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + e));
    if constexpr (std::is_same_v<C, c10::Half>)
      _mm256_storeu_ps(dst + e, _mm256_cvtph_ps(x));
    else
      _mm256_storeu_ps(dst + e, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16)));
  }
  // 8-bit rows, 8 or 16 at a time (the scalar loop left an fp8 cache's decode at 4k context 5x
  // slower than a float16 cache's: c10's e4m3 conversion is a branchy function call per value)
  if constexpr (std::is_same_v<C, int8_t>) {
    for (; e + 8 <= n; e += 8) {
      const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + e));
      _mm256_storeu_ps(dst + e, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x)));
    }
  } else if constexpr (std::is_same_v<C, c10::Float8_e4m3fn>) {
    for (; e + 16 <= n; e += 16) {
      __m256 lo, hi;
      e4m3_to_float16x(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + e)), lo, hi);
      _mm256_storeu_ps(dst + e, lo);
      _mm256_storeu_ps(dst + e + 8, hi);
    }
  }
#endif
  for (; e < n; ++e) dst[e] = f32(src[e]) / kFp8Unit<C>;      // exact: a power of two
}

// every float8_e4m3fn value as float, by its byte (AVX-512 has no e4m3 conversion: a gather reads it)
inline const float* fp8_e4m3_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int b = 0; b < 256; ++b) t[b] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table.data();
}

#if defined(__AVX512F__)
// 16 cache values as float, widened in registers (exactly, for every cache type)
template <typename C>
inline __m512 load16(const C* p) {
  if constexpr (std::is_same_v<C, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<C, int8_t>) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  } else if constexpr (std::is_same_v<C, c10::Float8_e4m3fn>) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_i32gather_ps(bytes, fp8_e4m3_table(), 4);
  } else {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (std::is_same_v<C, c10::Half>)
      return _mm512_cvtph_ps(x);
    else
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
  }
}

// For NG query heads of one row that share a kv head: each key / value row is read from the cache
// page (and widened) once for all of them, where qk_scores / pv_accumulate read a page widened
// into a buffer once per query head. Measured on the 135M model's decode step (38 rows, context
// 100-620, float16 cache, 2 threads), with the prefetch below: attention 24 -> 15 ms with each
// sequence's pages in order, 30 -> 20 ms with them shuffled.

// s[g * s_stride + o] = q_g . k_o for the m key rows k_o = k + o * stride, q_g = q + g * kD: 16 rows'
// products side by side, summed by one sum16 per query; a last partial block one row at a time.
template <int64_t kD, int NG, typename C>
inline void qk_group(const float* q, const C* k, int64_t stride, int64_t m, float* s, int64_t s_stride) {
  static_assert(kD > 0 && kD % 16 == 0);
  constexpr int64_t V = kD / 16;
  auto dot = [&](int g, const __m512* x) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q + g * kD), x[0]);
    for (int64_t v = 1; v < V; ++v) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * kD + 16 * v), x[v], acc);
    return acc;
  };
  int64_t o = 0;
  for (; o + 16 <= m; o += 16) {
    __m512 dots[NG][16];
    for (int64_t i = 0; i < 16; ++i) {
      __m512 x[V];
      for (int64_t v = 0; v < V; ++v) x[v] = load16(k + (o + i) * stride + 16 * v);
      for (int g = 0; g < NG; ++g) dots[g][i] = dot(g, x);
    }
    for (int g = 0; g < NG; ++g) _mm512_storeu_ps(s + g * s_stride + o, sum16(dots[g]));
  }
  for (; o < m; ++o) {
    __m512 x[V];
    for (int64_t v = 0; v < V; ++v) x[v] = load16(k + o * stride + 16 * v);
    for (int g = 0; g < NG; ++g) s[g * s_stride + o] = _mm512_reduce_add_ps(dot(g, x));
  }
}

// acc_g += sum over o < m of w_g[o] * v_o (w_g = w + g * w_stride, acc_g = acc + g * kD, v_o = v +
// o * stride); per query pv_accumulate's operations in its order (even positions into one set of
// accumulators, odd into another, added at the end), so the bits are the same.
template <int64_t kD, int NG, typename C>
inline void pv_group(const float* w, int64_t w_stride, const C* v, int64_t stride, int64_t m, float* acc) {
  static_assert(kD > 0 && kD % 16 == 0);
  constexpr int64_t V = kD / 16;
  __m512 a[NG][V], b[NG][V];
  for (int g = 0; g < NG; ++g)
    for (int64_t i = 0; i < V; ++i) {
      a[g][i] = _mm512_loadu_ps(acc + g * kD + 16 * i);
      b[g][i] = _mm512_setzero_ps();
    }
  auto add_row = [&](int64_t o, __m512 (&into)[NG][V]) {
    __m512 x[V];
    for (int64_t i = 0; i < V; ++i) x[i] = load16(v + o * stride + 16 * i);
    for (int g = 0; g < NG; ++g) {
      const __m512 wg = _mm512_set1_ps(w[g * w_stride + o]);
      for (int64_t i = 0; i < V; ++i) into[g][i] = _mm512_fmadd_ps(wg, x[i], into[g][i]);
    }
  };
  int64_t o = 0;
  for (; o + 2 <= m; o += 2) {
    add_row(o, a);
    add_row(o + 1, b);
  }
  if (o < m) add_row(o, a);
  for (int g = 0; g < NG; ++g)
    for (int64_t i = 0; i < V; ++i) _mm512_storeu_ps(acc + g * kD + 16 * i, _mm512_add_ps(a[g][i], b[g][i]));
}

#define PAGEDECODE_GROUPED_ATTENTION 1

#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
// The same grouping with AVX2's 8 lanes: each key / value row widened in registers once for up to
// 3 query heads, instead of a page widened into a float buffer and then read once per query head
// by qk_scores / pv_accumulate's one-row-at-a-time loops, whose per-position horizontal sums kept
// SmolLM2's decode at 4k context compute-bound (attention ~40% of a step in a profile; the step at
// 4k context 27 -> 24 ms at batch 1, 66 -> 54 ms at batch 4, float16 cache, 2 Zen 3 cores).

// values [p, p + 16) of a cache row as float (lo: the first 8), widened in registers, exactly
template <typename C>
inline void load16x(const C* p, __m256& lo, __m256& hi) {
  if constexpr (std::is_same_v<C, float>) {
    lo = _mm256_loadu_ps(p);
    hi = _mm256_loadu_ps(p + 8);
  } else if constexpr (std::is_same_v<C, int8_t>) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
  } else if constexpr (std::is_same_v<C, c10::Float8_e4m3fn>) {
    e4m3_to_float16x(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), lo, hi);
  } else {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m128i x0 = _mm256_castsi256_si128(x), x1 = _mm256_extracti128_si256(x, 1);
    if constexpr (std::is_same_v<C, c10::Half>) {
      lo = _mm256_cvtph_ps(x0);
      hi = _mm256_cvtph_ps(x1);
    } else {                                  // bfloat16: the high half of a float
      lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x0), 16));
      hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x1), 16));
    }
  }
}

// lane i = the sum of d[i]'s 8 lanes, by one tree that reads d[i] alone: so a position's score has
// the same bits whichever other positions (or zero fillers) share its block
inline __m256 sum8(const __m256* d) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(d[0], d[1]), _mm256_hadd_ps(d[2], d[3]));
  const __m256 ce = _mm256_hadd_ps(_mm256_hadd_ps(d[4], d[5]), _mm256_hadd_ps(d[6], d[7]));
  // ab: d0..d3's sums of lanes 0-3, then of lanes 4-7; ce: d4..d7's
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, ce, 0x20), _mm256_permute2f128_ps(ab, ce, 0x31));
}

// s[g * s_stride + o] = q_g . k_o for the m key rows k_o = k + o * stride, q_g = q + g * kD: 8 rows'
// products side by side, summed by one sum8 per query (a last partial block filled with zeros)
template <int64_t kD, int NG, typename C>
inline void qk_group(const float* q, const C* k, int64_t stride, int64_t m, float* s, int64_t s_stride) {
  static_assert(kD > 0 && kD % 16 == 0);
  constexpr int64_t V = kD / 8;
  for (int64_t o = 0; o < m; o += 8) {
    const int64_t rows = std::min<int64_t>(8, m - o);
    __m256 dots[NG][8];
    for (int64_t i = 0; i < 8; ++i) {
      if (i >= rows) {
        for (int g = 0; g < NG; ++g) dots[g][i] = _mm256_setzero_ps();
        continue;
      }
      __m256 x[V];
      for (int64_t v = 0; v < V; v += 2) load16x(k + (o + i) * stride + 8 * v, x[v], x[v + 1]);
      for (int g = 0; g < NG; ++g) {
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q + g * kD), x[0]);
        for (int64_t v = 1; v < V; ++v) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * kD + 8 * v), x[v], acc);
        dots[g][i] = acc;
      }
    }
    for (int g = 0; g < NG; ++g) {
      const __m256 sums = sum8(dots[g]);
      if (rows == 8) {
        _mm256_storeu_ps(s + g * s_stride + o, sums);
      } else {
        alignas(32) float t[8];
        _mm256_store_ps(t, sums);
        std::copy(t, t + rows, s + g * s_stride + o);
      }
    }
  }
}

// acc_g += sum over o < m of w_g[o] * v_o (w_g = w + g * w_stride, acc_g = acc + g * kD, v_o = v +
// o * stride), 16 values of the head at a time, each in position order: 3 x 2 accumulators, the
// row's 2 vectors and a weight fit the 16 registers with room for fp8's constants, where 32 values
// at a time (3 x 4 accumulators) made GCC keep an accumulator on the stack
template <int64_t kD, int NG, typename C>
inline void pv_group(const float* w, int64_t w_stride, const C* v, int64_t stride, int64_t m, float* acc) {
  static_assert(kD > 0 && kD % 16 == 0);
  for (int64_t c = 0; c < kD; c += 16) {
    __m256 lo[NG], hi[NG];
    for (int g = 0; g < NG; ++g) {
      lo[g] = _mm256_loadu_ps(acc + g * kD + c);
      hi[g] = _mm256_loadu_ps(acc + g * kD + c + 8);
    }
    for (int64_t o = 0; o < m; ++o) {
      __m256 x0, x1;
      load16x(v + o * stride + c, x0, x1);
      for (int g = 0; g < NG; ++g) {
        const __m256 wg = _mm256_set1_ps(w[g * w_stride + o]);
        lo[g] = _mm256_fmadd_ps(wg, x0, lo[g]);
        hi[g] = _mm256_fmadd_ps(wg, x1, hi[g]);
      }
    }
    for (int g = 0; g < NG; ++g) {
      _mm256_storeu_ps(acc + g * kD + c, lo[g]);
      _mm256_storeu_ps(acc + g * kD + c + 8, hi[g]);
    }
  }
}

#define PAGEDECODE_GROUPED_ATTENTION 1
#endif

#if defined(PAGEDECODE_GROUPED_ATTENTION)
// f(std::integral_constant<int, g>) for a group of g = 1 .. 3 query heads
template <typename F>
inline void with_group_size(int64_t g, F&& f) {
  if (g == 3) f(std::integral_constant<int, 3>());
  else if (g == 2) f(std::integral_constant<int, 2>());
  else f(std::integral_constant<int, 1>());
}

// Asks for the page an item reads next while it computes on this one: into L2 (_MM_HINT_T1). In the
// measurement above (pages in order, AVX-512), without it 19-20 ms, into L1 (T0) 24, into L2 17.
inline void prefetch_page(const void* page, int64_t bytes) {
  const char* p = static_cast<const char*>(page);
  for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch(p + l, _MM_HINT_T1);
}
#endif

// The inputs of one attention call, as a work item reads them: T the queries' type, C the cache's
template <typename T, typename C>
struct AttendArgs {
  const T* qkv;
  int64_t q_stride;
  const C* kc;
  const C* vc;
  const int32_t* pt;
  int64_t pt_stride;
  const int32_t* lens;
  const int32_t* cu;
  int64_t S, rows, num_pages, page_size, H, Hkv, D;
  float scale;
  bool det;
  bool pool;      // on the spinning pool: the step's matmuls run there or on the caller, never on OpenMP
  // an 8-bit cache's scales, one per (slot, kv head) at slot * Hkv + head; nullptr for a float cache
  const KvScale* ks = nullptr;
  const KvScale* vs = nullptr;
};

// scores[j * width + p] *= scale of position p's row (kv head kvh(j)), p < vis[j]: an 8-bit cache's
// K scale on q . k, or its V scale folded into the softmax weights before they multiply V
// (sum p_o s_o v_o), so no page is ever dequantized element by element
// (page by page: a page's scales of one kv head, Hkv apart, converted once for the query heads
// that share it, which then multiply in vector registers; each product as before, so the same bits)
template <typename C, typename KvHead>
inline void scale_scores(float* scores, int64_t width, int64_t nq, const int64_t* vis, const int32_t* pages,
                         int64_t page_size, int64_t Hkv, const KvScale* sc, KvHead kvh) {
  thread_local std::vector<float> as_float;     // (Hkv, page_size): this page's scales of the kv heads read
  thread_local std::vector<int64_t> page_of;    // the page each kv head's row holds (-1: none yet)
  as_float.resize(Hkv * page_size);
  page_of.assign(Hkv, -1);
  int64_t most = 0;
  for (int64_t j = 0; j < nq; ++j) most = std::max(most, vis[j]);
  for (int64_t p0 = 0; p0 < most; p0 += page_size) {
    const int64_t pi = p0 / page_size, in_page = std::min(page_size, most - p0);
    for (int64_t j = 0; j < nq; ++j) {
      const int64_t n = std::min(page_size, vis[j] - p0), h = kvh(j);
      if (n <= 0) continue;
      float* f = as_float.data() + h * page_size;
      if (page_of[h] != pi) {
        const KvScale* page = sc + static_cast<int64_t>(pages[pi]) * page_size * Hkv + h;
        for (int64_t o = 0; o < in_page; ++o) f[o] = static_cast<float>(page[o * Hkv]) * kFp8Unit<C>;
        page_of[h] = pi;
      }
      float* sj = scores + j * width + p0;
      for (int64_t o = 0; o < n; ++o) sj[o] *= f[o];
    }
  }
}

// A value a late pool worker may see rewritten under it (see decode_attention): read once, so that
// what was checked is what is used
template <typename V> inline V load_once(const V* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }

// One work item: query heads [h0, h0 + nh) of the rows [r0, r0 + kRowBlock) of sequence s that it
// holds; the output of row r0 + i, head h0 + k at o + i * ld + k * D (converted to O). Returns
// false, computing nothing, if the inputs do not describe such an item: only a pool worker late
// for a call the caller already finished can see that (it reads the caller's copies of the small
// inputs while the next call rewrites them; see decode_attention), and its result is discarded.
template <typename T, typename C, int64_t kD, typename O>
bool attend_block(const AttendArgs<T, C>& a, int64_t s, int64_t r0, int64_t h0, int64_t nh, O* o, int64_t ld) {
  const int64_t D = kD > 0 ? kD : a.D, H = a.H, G = H / a.Hkv, page_size = a.page_size;
  const int64_t page_elems = page_size * a.Hkv * D;
#if defined(__AVX512BF16__)
  // bf16 scores straight from the pages (qk_scores_bf16); the V pages are still widened once each
  constexpr bool kDotBf16 = std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16> && kD > 0 &&
                            kD % 32 == 0;
#else
  constexpr bool kDotBf16 = false;
#endif
  if (s < 0 || s >= a.S || h0 < 0 || nh <= 0 || h0 + nh > H) return false;
  const int64_t begin = load_once(a.cu + s), end = load_once(a.cu + s + 1);
  if (begin < 0 || r0 < begin || r0 >= end || end > a.rows) return false;
  const int64_t r1 = std::min<int64_t>(r0 + kRowBlock, end), nq = (r1 - r0) * nh;
  const int64_t cached = load_once(a.lens + s) - (end - begin);
  const int64_t width = cached + (r1 - begin);                 // positions the block's last row sees
  if (cached < 0 || width > a.pt_stride * page_size) return false;
  // scratch kept per thread across calls (resize only grows it): no allocation per layer
  thread_local std::vector<float> q, scores, acc, denom, kf, vf;
  thread_local std::vector<int64_t> vis;
  thread_local std::vector<int32_t> pages;                     // the sequence's page ids, checked
  pages.resize((width + page_size - 1) / page_size);
  for (size_t p = 0; p < pages.size(); ++p) {
    pages[p] = load_once(a.pt + s * a.pt_stride + p);
    if (pages[p] < 0 || pages[p] >= a.num_pages) return false;
  }
#if defined(PAGEDECODE_GROUPED_ATTENTION)
  // each key / value row read in registers once for up to 3 query heads (qk_group, pv_group)
  constexpr bool kGrouped = kD > 0 && kD % 16 == 0;
#else
  constexpr bool kGrouped = false;
#endif
  if constexpr (!std::is_same_v<C, float> && !kGrouped) {      // the per-head path's widened pages
    kf.resize(page_elems);
    vf.resize(page_elems);
  }
  // one page as float: the cache itself for float, else converted once into buf (at the same
  // places). Only the kv heads [kh0, kh1) this item's query heads read: a single decode row's heads
  // are split into an item per thread, and each widened every head's K and V pages before.
  const int64_t kh0 = h0 / G, kh1 = (h0 + nh - 1) / G + 1;
  auto page_as_float = [&](const C* cache, int32_t page, int64_t n, std::vector<float>& buf) -> const float* {
    const C* src = cache + static_cast<int64_t>(page) * page_elems;
    if constexpr (std::is_same_v<C, float>) {
      return src;
    } else {
      if (kh1 - kh0 == a.Hkv) {
        widen(src, n * a.Hkv * D, buf.data());
      } else {
        for (int64_t o = 0; o < n; ++o) {
          const int64_t at = (o * a.Hkv + kh0) * D;
          widen(src + at, (kh1 - kh0) * D, buf.data() + at);
        }
      }
      return buf.data();
    }
  };
  auto q_row = [&](int64_t j) { return a.qkv + (r0 + j / nh) * a.q_stride + (h0 + j % nh) * D; };
  auto kv_head = [&](int64_t j) { return ((h0 + j % nh) / G) * D; };
  q.resize(nq * D);
  vis.resize(nq);
  for (int64_t j = 0; j < nq; ++j) {                        // query j: row r0 + j / nh, head h0 + j % nh
    vis[j] = cached + (r0 + j / nh - begin) + 1;
    if constexpr (kDotBf16) continue;                      // read in place instead
    const T* src = q_row(j);
    for (int64_t d = 0; d < D; ++d) q[j * D + d] = f32(src[d]) * a.scale;
  }
  scores.resize(nq * width);
  [[maybe_unused]] const int64_t page_bytes = page_elems * static_cast<int64_t>(sizeof(C)), np = static_cast<int64_t>(pages.size());
  // (j, g): queries j .. j + g - 1, one row's heads on one kv head, at most 3
  thread_local std::vector<std::pair<int64_t, int64_t>> groups;
  groups.clear();
  for (int64_t j = 0; kGrouped && j < nq;) {
    int64_t g = 1;
    while (g < 3 && j + g < nq && (j + g) / nh == j / nh && kv_head(j + g) == kv_head(j)) ++g;
    groups.emplace_back(j, g);
    j += g;
  }
  for (int64_t p0 = 0; p0 < width; p0 += page_size) {
    const int64_t n = std::min(page_size, width - p0);
#if defined(PAGEDECODE_GROUPED_ATTENTION)
    const int64_t pi = p0 / page_size;
    if constexpr (kGrouped)
      prefetch_page(pi + 1 < np ? a.kc + static_cast<int64_t>(pages[pi + 1]) * page_elems   // then the first V page
                                : a.vc + static_cast<int64_t>(pages[0]) * page_elems, page_bytes);
    if constexpr (kGrouped && !kDotBf16) {
      const C* k = a.kc + static_cast<int64_t>(pages[pi]) * page_elems;
      for (const auto& group : groups)
        with_group_size(group.second, [&, j = group.first](auto ng) {
          qk_group<kD, decltype(ng)::value>(q.data() + j * D, k + kv_head(j), a.Hkv * D, std::min(n, vis[j] - p0),
                                            scores.data() + j * width + p0, width);
        });
      continue;
    }
#endif
    if constexpr (kDotBf16) {
#if defined(__AVX512BF16__)
      const C* k = a.kc + static_cast<int64_t>(pages[p0 / page_size]) * page_elems;
      for (int64_t j = 0; j < nq; ++j)
        qk_scores_bf16<kD>(q_row(j), k + kv_head(j), a.Hkv * D, std::min(n, vis[j] - p0), a.scale,
                           scores.data() + j * width + p0);
#endif
      continue;
    }
    const float* k = page_as_float(a.kc, pages[p0 / page_size], n, kf);
    for (int64_t j = 0; j < nq; ++j)
      qk_scores<kD>(q.data() + j * D, k + kv_head(j), a.Hkv * D, std::min(n, vis[j] - p0), D,
                    scores.data() + j * width + p0);
  }
  [[maybe_unused]] auto kv_index = [&](int64_t j) { return (h0 + j % nh) / G; };
  if constexpr (kQuantCache<C>)
    scale_scores<C>(scores.data(), width, nq, vis.data(), pages.data(), page_size, a.Hkv, a.ks, kv_index);
  denom.resize(nq);
  for (int64_t j = 0; j < nq; ++j) {
    float* sj = scores.data() + j * width;
    const float shift = row_max(sj, vis[j]);
    denom[j] = a.det ? exp_shifted_sum_fixed(sj, vis[j], shift) : exp_shifted_sum(sj, vis[j], shift);
  }
  if constexpr (kQuantCache<C>)
    scale_scores<C>(scores.data(), width, nq, vis.data(), pages.data(), page_size, a.Hkv, a.vs, kv_index);
  acc.assign(nq * D, 0.f);
  for (int64_t p0 = 0; p0 < width; p0 += page_size) {
    const int64_t n = std::min(page_size, width - p0);
#if defined(PAGEDECODE_GROUPED_ATTENTION)
    if constexpr (kGrouped) {
      const int64_t pi = p0 / page_size;
      if (pi + 1 < np) prefetch_page(a.vc + static_cast<int64_t>(pages[pi + 1]) * page_elems, page_bytes);
      const C* v = a.vc + static_cast<int64_t>(pages[pi]) * page_elems;
      for (const auto& group : groups)
        with_group_size(group.second, [&, j = group.first](auto ng) {
          pv_group<kD, decltype(ng)::value>(scores.data() + j * width + p0, width, v + kv_head(j), a.Hkv * D,
                                            std::min(n, vis[j] - p0), acc.data() + j * D);
        });
      continue;
    }
#endif
    const float* v = page_as_float(a.vc, pages[p0 / page_size], n, vf);
    for (int64_t j = 0; j < nq; ++j)
      pv_accumulate<kD>(scores.data() + j * width + p0, v + kv_head(j), a.Hkv * D, std::min(n, vis[j] - p0), D,
                        acc.data() + j * D);
  }
  for (int64_t j = 0; j < nq; ++j) {
    const float inv = 1.f / denom[j];
    O* out = o + (j / nh) * ld + (j % nh) * D;
    for (int64_t d = 0; d < D; ++d) out[d] = to<O>(acc[j * D + d] * inv);
  }
  if (scores.capacity() > (size_t{1} << 22)) {     // a long context's scores: not kept past 16 MB
    scores.clear();
    scores.shrink_to_fit();
  }
  return true;
}

// A decode step's items on the spinning pool (work_pool.h), whose workers take a chunk within a
// microsecond: at::parallel_for's OpenMP threads, woken for ~60 such calls a step, fought the
// pool's spinning workers for the cores (a 135M q4_0 model's single-stream step 5 ms -> 11 ms).
// A worker computes its item into its scratch (float), which commit() converts into place.
template <typename T, typename C, int64_t kD>
struct DecodeAttention {
  AttendArgs<T, C> a;
  const int64_t* items;      // (s, r0, h0, nh) per item
  T* out;

  bool compute(int64_t c, std::vector<float>* scratch, work::Live) const {
    const int64_t s = load_once(items + 4 * c), r0 = load_once(items + 4 * c + 1);
    const int64_t h0 = load_once(items + 4 * c + 2), nh = load_once(items + 4 * c + 3);
    const int64_t row = a.H * a.D;
    if (scratch == nullptr) return attend_block<T, C, kD, T>(a, s, r0, h0, nh, out + r0 * row + h0 * a.D, row);
    if (nh <= 0 || nh > a.H) return false;
    scratch->resize(kRowBlock * nh * a.D);
    return attend_block<T, C, kD, float>(a, s, r0, h0, nh, scratch->data(), nh * a.D);
  }

  void commit(int64_t c, std::vector<float>* scratch) const {   // the caller is inside run(): inputs intact
    const int64_t* it = items + 4 * c;
    const int64_t r0 = it[1], nh = it[3], r1 = std::min<int64_t>(r0 + kRowBlock, a.cu[it[0] + 1]);
    for (int64_t r = r0; r < r1; ++r) {
      T* o = out + r * a.H * a.D + it[2] * a.D;
      const float* src = scratch->data() + (r - r0) * nh * a.D;
      for (int64_t e = 0; e < nh * a.D; ++e) o[e] = to<T>(src[e]);
    }
  }
};

// items (s, r0, h0, nh) on the pool. A worker whose item the caller took back may still be
// reading after the caller returned (work_pool.h): the small inputs it reads (queries, page table
// rows, lengths, the items) are copied into memory this call owns, `caches` (the K / V tensors)
// are held with the call, and attend_block refuses what is out of range.
template <typename T, typename C, int64_t kD>
void decode_attention(const AttendArgs<T, C>& a, const std::vector<int64_t>& items, T* out, work::Keep caches) {
  const int64_t n_qkv = a.rows * a.q_stride, n_pt = a.S * a.pt_stride, n_items = static_cast<int64_t>(items.size());
  const int64_t o_pt = work::lines(n_qkv * sizeof(T)), o_lens = o_pt + work::lines(n_pt * 4);
  const int64_t o_cu = o_lens + work::lines(a.S * 4), o_items = o_cu + work::lines((a.S + 1) * 4);
  unsigned char* mem = work::owned(caches, o_items + n_items * 8);
  AttendArgs<T, C> c = a;
  c.qkv = static_cast<const T*>(std::memcpy(mem, a.qkv, n_qkv * sizeof(T)));
  c.pt = static_cast<const int32_t*>(std::memcpy(mem + o_pt, a.pt, n_pt * 4));
  c.lens = static_cast<const int32_t*>(std::memcpy(mem + o_lens, a.lens, a.S * 4));
  c.cu = static_cast<const int32_t*>(std::memcpy(mem + o_cu, a.cu, (a.S + 1) * 4));
  const auto* it = static_cast<const int64_t*>(std::memcpy(mem + o_items, items.data(), n_items * 8));
  work::Pool::get().run(n_items / 4, DecodeAttention<T, C, kD>{c, it, out}, std::move(caches));
}

// caches: the K / V tensors kc and vc point into (held by the pool for a late worker)
// multiply-adds (rows x heads x context x head_dim) below which an attention runs on one thread
constexpr int64_t kParallelWork = int64_t{1} << 17;

template <typename T, typename C, int64_t kD>
void paged_attention(const AttendArgs<T, C>& a, T* out, const work::Keep& caches) {
  std::vector<int64_t> block_seq, block_row;
  for (int64_t s = 0; s < a.S; ++s) {
    if (!a.det && a.cu[s + 1] - a.cu[s] >= kMatmulRows) continue;  // prefill_attention takes it
    for (int64_t r = a.cu[s]; r < a.cu[s + 1]; r += kRowBlock) {
      block_seq.push_back(s);
      block_row.push_back(r);
    }
  }
  // Fewer blocks than threads (one sequence decoding): each block's query heads split into parts,
  // an item each, so that every thread has one. An output's arithmetic is the same whichever item,
  // thread or path computes it.
  const int64_t threads = at::get_num_threads(), blocks = static_cast<int64_t>(block_seq.size());
  const int64_t parts = blocks > 0 && blocks < threads ? std::min(a.H, (threads + blocks - 1) / blocks) : 1;
  const int64_t items = blocks * parts;
  std::vector<int64_t> item(4 * items);                      // (s, r0, h0, nh)
  for (int64_t it = 0; it < items; ++it) {
    const int64_t h0 = (it % parts) * a.H / parts, h1 = (it % parts + 1) * a.H / parts;
    item[4 * it] = block_seq[it / parts];
    item[4 * it + 1] = block_row[it / parts];
    item[4 * it + 2] = h0;
    item[4 * it + 3] = h1 - h0;
  }
  // kept across calls (no allocation a layer); named through references, which the workers'
  // lambda below captures (a thread_local named inside it would be the worker's own)
  thread_local std::vector<int64_t> work_, order_, bin_start_;
  std::vector<int64_t>&work = work_, &order = order_, &bin_start = bin_start_;
  work.resize(items);
  int64_t total = 0;
  for (int64_t it = 0; it < items; ++it) {
    const int64_t s = item[4 * it], r0 = item[4 * it + 1], r1 = std::min<int64_t>(r0 + kRowBlock, a.cu[s + 1]);
    work[it] = (r1 - r0) * item[4 * it + 3] * (a.lens[s] - (a.cu[s + 1] - r1));   // rows x heads x context
    total += work[it];
  }
  // Too little work for a second thread (a small model's decode: stories260k's layer is a few
  // thousand multiply-adds) runs on the caller alone: no fork or join, so no wait on a thread the
  // OS has descheduled (beside one busy neighbour, 2 threads ran such a step at a fraction of 1's speed).
  if (total * a.D < kParallelWork || threads == 1) {
    for (int64_t k = 0; k < items; ++k) {
      const int64_t* it = item.data() + 4 * k;
      attend_block<T, C, kD, T>(a, it[0], it[1], it[2], it[3], out + it[1] * a.H * a.D + it[2] * a.D, a.H * a.D);
    }
    return;
  }
  if (a.pool && items > 1 && items <= work::Pool::kMaxChunks && !at::in_parallel_region()) {
    decode_attention<T, C, kD>(a, item, out, caches);
    return;
  }
  const int64_t bins = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  balance(work, bins, order, bin_start);
  at::parallel_for(0, bins, 1, [&](int64_t bin_begin, int64_t bin_end) {
    for (int64_t k = bin_start[bin_begin]; k < bin_start[bin_end]; ++k) {
      const int64_t* it = item.data() + 4 * order[k];
      attend_block<T, C, kD, T>(a, it[0], it[1], it[2], it[3], out + it[1] * a.H * a.D + it[2] * a.D, a.H * a.D);
    }
  });
}

template <typename T, typename C>
void attention(const T* qkv, int64_t q_stride, const C* kc, const C* vc, int64_t num_pages, const int32_t* pt,
               int64_t pt_stride, const int32_t* lens, const int32_t* cu, int64_t S, int64_t page_size, int64_t H,
               int64_t Hkv, int64_t D, float scale, T* out, bool det, bool pool, const work::Keep& caches,
               const KvScale* ks = nullptr, const KvScale* vs = nullptr) {
  const AttendArgs<T, C> a{qkv, q_stride, kc, vc, pt, pt_stride, lens, cu, S, S > 0 ? cu[S] : 0, num_pages,
                        page_size, H, Hkv, D, scale, det, pool, ks, vs};
  auto run = [&](auto fixed) { paged_attention<T, C, decltype(fixed)::value>(a, out, caches); };
  switch (D) {
    case 8: run(std::integral_constant<int64_t, 8>()); break;
    case 16: run(std::integral_constant<int64_t, 16>()); break;
    case 32: run(std::integral_constant<int64_t, 32>()); break;
    case 64: run(std::integral_constant<int64_t, 64>()); break;
    case 128: run(std::integral_constant<int64_t, 128>()); break;
    default: run(std::integral_constant<int64_t, 0>());
  }
}

// The sequences with kMatmulRows or more new rows: each one's context gathered from its pages
// (cache rows `rows`, built once per forward), then causal attention in float with ATen's fused
// CPU kernel (grouped heads, parallel over heads and query blocks). Query i of n new rows sits at
// position cached + i and sees 0 .. cached + i.
struct Chunk {
  int64_t seq, row0, n, cached;
  Tensor rows;   // (cached + n,) int64 cache rows (slot numbers) of the sequence's context
  Tensor mask;   // (n, cached + n) bool when cached > 0, else undefined (plain causal)
};

std::vector<Chunk> matmul_chunks(const int32_t* pt, int64_t pt_stride, const int32_t* lens, const int32_t* cu,
                                 int64_t S, int64_t page_size, bool det) {
  std::vector<Chunk> out;
  if (det) return out;          // deterministic: every row through the paged kernel, one order per query
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = cu[s + 1] - cu[s];
    if (n < kMatmulRows) continue;
    const int64_t width = lens[s], cached = width - n;
    Tensor rows = at::empty({width}, at::kLong);
    int64_t* r = rows.data_ptr<int64_t>();
    for (int64_t p = 0; p < width; ++p) r[p] = int64_t{pt[s * pt_stride + p / page_size]} * page_size + p % page_size;
    Tensor mask;
    if (cached > 0) mask = at::arange(width).unsqueeze(0) <= at::arange(cached, width).unsqueeze(1);
    out.push_back({s, cu[s], n, cached, rows, mask});
  }
  return out;
}

// cache rows `rows` of a (slots, Hkv, D) layer as float: an 8-bit one's through its bytes (index_select
// has no float8 kernel) and times its scales (slots, Hkv, 1)
inline Tensor rows_as_float(const Tensor& flat, const Tensor& scale, const Tensor& rows) {
  if (!scale.defined()) return flat.index_select(0, rows).to(at::kFloat);
  const Tensor bytes = flat.view(at::kByte).index_select(0, rows).view(flat.scalar_type());
  return bytes.to(at::kFloat) * scale.index_select(0, rows).to(at::kFloat);
}

void prefill_attention(const std::vector<Chunk>& chunks, const Tensor& qkv, const Tensor& k_layer,
                       const Tensor& v_layer, int64_t H, int64_t Hkv, int64_t D, double scale, Tensor& attn,
                       const Tensor& ks_layer = Tensor(), const Tensor& vs_layer = Tensor()) {
  const Tensor kf = k_layer.view({-1, Hkv, D}), vf = v_layer.view({-1, Hkv, D});
  const Tensor ksf = ks_layer.defined() ? ks_layer.view({-1, Hkv, 1}) : Tensor();
  const Tensor vsf = vs_layer.defined() ? vs_layer.view({-1, Hkv, 1}) : Tensor();
  for (const Chunk& c : chunks) {
    Tensor q = qkv.narrow(0, c.row0, c.n).narrow(1, 0, H * D).view({c.n, H, D}).transpose(0, 1).to(at::kFloat);
    // (H, width, D): each kv head repeated for its G query heads. enable_gqa would avoid the copy but
    // sends the CPU to SDPA's unfused math path (several times slower than its fused kernel).
    Tensor k = rows_as_float(kf, ksf, c.rows).repeat_interleave(H / Hkv, 1).transpose(0, 1);
    Tensor v = rows_as_float(vf, vsf, c.rows).repeat_interleave(H / Hkv, 1).transpose(0, 1);
    // 4-D (batch of one): the fused kernel takes nothing else
    Tensor o = at::scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                                c.mask.defined() ? std::optional<Tensor>(c.mask)
                                                                 : std::optional<Tensor>(),
                                                0.0, !c.mask.defined(), scale);
    attn.narrow(0, c.row0, c.n).view({c.n, H, D}).copy_(o[0].transpose(0, 1));
  }
}
