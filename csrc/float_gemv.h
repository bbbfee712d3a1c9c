// The float gemv's dot products (cpu_forward.cpp's GemvJob): out[t][j] = sum_k x[t][k] * w[j][k]
// for the few rows of a decode step or a speculative verify, float32 or bfloat16 weights, in float.
//
// Every output is one 8-lane float accumulator, fma'd over k in steps of 8 in order, its lanes
// summed by quant::hsum, then k's tail (k past the last multiple of 8) added in order: the same
// float operations whatever tile computes it. So a row's outputs are the same bits alone (a
// decode step) as beside 16 others (a verify): speculation verifies exactly what decoding computes.
//
// The tiles (AVX2, 16 registers): one row, kGemvTile weight rows at once (that many fma chains in
// flight, each weight read once from memory); several rows, 3 weight rows x 4 rows, the 12
// accumulators, 3 weight vectors and a row's 8 values in registers: each weight vector is loaded
// (and a bfloat16 one widened) once for 4 rows, each activation vector once for 3 weights. Before,
// each (row, output) was its own dot product, re-reading and re-widening the weights per row: on
// SmolLM2-135M float32 a 7-row verify cost 1.5 one-row forwards.

#pragma once

#if defined(__AVX2__) && defined(__FMA__)
namespace fgemv {

constexpr int kOneRowTile = 8;              // weight rows at once for a single row
constexpr int kTileW = 3, kTileT = 4;       // weight rows x rows at once for several rows

template <typename T>
inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {                                  // bfloat16: the high half of a float
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// RW weight rows w[0..RW) (each `in` long) against RT rows of x (stride `in`): d[t * RW + r].
// With `ahead` > 0 asks for the next tile's lines (`ahead` bytes on) as this one's are read: with
// 8 rows of ~20 lines each the hardware prefetcher keeps too few in flight. float32 by row,
// bfloat16 in address order (whichever measured faster for a SmolLM2 decode step, one thread:
// ~10% either way). The tiles of further rows over the same weights pass 0: the lines are asked for.
template <int RW, int RT, typename T>
inline void tile(const float* x, const T* const* w, int64_t in, int64_t ahead, float* d) {
  __m256 acc[RT][RW];
  for (int t = 0; t < RT; ++t)
    for (int r = 0; r < RW; ++r) acc[t][r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= in; k += 8) {
    if (ahead > 0) {
      if constexpr (std::is_same_v<T, float>) {     // each weight row's next tile row, a line a row
        if (k % 16 == 0)
          for (int r = 0; r < RW; ++r) _mm_prefetch(reinterpret_cast<const char*>(w[r] + k) + ahead, _MM_HINT_T0);
      } else {                                      // the next tile's bytes in order, as they are used
        constexpr int64_t lines = (RW * 16 + 63) / 64;  // a k step reads RW x 16 bytes
        const char* next = reinterpret_cast<const char*>(w[0]) + ahead + k / 8 * lines * 64;
        for (int64_t l = 0; l < lines; ++l) _mm_prefetch(next + l * 64, _MM_HINT_T0);
      }
    }
    if constexpr (RT == 1) {                // each weight used once: widened into the fma, no array
      const __m256 xv = _mm256_loadu_ps(x + k);
      for (int r = 0; r < RW; ++r) acc[0][r] = _mm256_fmadd_ps(xv, load8(w[r] + k), acc[0][r]);
    } else {
      __m256 wv[RW];
      for (int r = 0; r < RW; ++r) wv[r] = load8(w[r] + k);
      for (int t = 0; t < RT; ++t) {
        const __m256 xv = _mm256_loadu_ps(x + t * in + k);
        for (int r = 0; r < RW; ++r) acc[t][r] = _mm256_fmadd_ps(xv, wv[r], acc[t][r]);
      }
    }
  }
  for (int t = 0; t < RT; ++t)
    for (int r = 0; r < RW; ++r) {
      float s = quant::hsum(acc[t][r]);
      for (int64_t i = k; i < in; ++i) s = std::fma(x[t * in + i], static_cast<float>(w[r][i]), s);
      d[t * RW + r] = s;
    }
}

// Outputs [begin, end) of `rows` rows: put(row, output, value). live() is asked between tiles
// (work_pool.h: a chunk another thread took over is abandoned); false when it said no.
template <typename T, typename Live, typename Put>
bool dots(const float* x, const T* w, int64_t rows, int64_t in, int64_t begin, int64_t end, Live live, Put put) {
  const int step = rows == 1 ? kOneRowTile : kTileW;
  for (int64_t j = begin; j < end; j += step) {
    if (!live()) return false;
    const int rw = static_cast<int>(std::min<int64_t>(step, end - j));
    const T* wr[kOneRowTile];
    for (int r = 0; r < rw; ++r) wr[r] = w + (j + r) * in;
    const int64_t ahead = static_cast<int64_t>(rw) * in * static_cast<int64_t>(sizeof(T));   // the next tile
    float d[kTileT * kOneRowTile];
    if (rows == 1) {
      quant::types::by_count<kOneRowTile>(rw, [&](auto RW) { tile<RW.value, 1>(x, wr, in, ahead, d); });
      for (int r = 0; r < rw; ++r) put(0, j + r, d[r]);
      continue;
    }
    quant::types::by_count<kTileW>(rw, [&](auto RW) {
      for (int64_t t = 0; t < rows; t += kTileT) {
        const int rt = static_cast<int>(std::min<int64_t>(kTileT, rows - t));
        quant::types::by_count<kTileT>(rt, [&](auto RT) {
          tile<RW.value, RT.value>(x + t * in, wr, in, t == 0 ? ahead : 0, d);
        });
        for (int u = 0; u < rt; ++u)
          for (int r = 0; r < RW.value; ++r) put(t + u, j + r, d[u * RW.value + r]);
      }
    });
  }
  return true;
}

}  // namespace fgemv
#endif
