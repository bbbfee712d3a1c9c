// The deterministic matmul (EngineConfig.deterministic): out (rows, n_out) = x (rows, in) @ w^T (+ b),
// every output summed over k by one fixed sequence of operations whatever `rows`, the row's position,
// the thread count or the tiling: one float accumulator per output, starting at +0, then
//   float32, and bf16 without AVX-512-BF16:  acc = fma(x[k], w[k], acc)          for k = 0, 1, ..., in - 1
//   bf16 with AVX-512-BF16 (vdpbf16ps):      acc = dpbf16(acc, x[k, k+1], w[k, k+1]) for k = 0, 2, ...
//                                            (an odd `in`: the last pair's second element is 0)
// and the bias added last. That is the order of an outer-product kernel (an output per vector lane,
// x broadcast), the one oneDNN's packed kernels use -- without its blocking over k, which it picks by
// the shape. No horizontal sum anywhere, so a tile of MR rows x NV * 16 outputs costs MR + NV loads
// per MR * NV vector FMAs, and a decode row reads each weight once, contiguously.
//
// The weights are packed once (det_pack, at load: LlamaModel keeps the packed copy where the default
// path keeps oneDNN's), in panels of 16 outputs; a panel holds, for each group of kGroup k's, its 16
// outputs' kGroup weights side by side -- one 64-byte vector (float; bf16 pairs), what one k step
// loads:
//
//   packed[p][g][j][e] = w[16 p + j][kGroup g + e]     (0 past n_out or in)
//   p < panels(n_out), g < k_padded(in) / kGroup, j < 16, e < kGroup
//
// Included by cpu_forward.cpp after its to<T>() / f32() helpers and sum16's AVX-512 setup.

#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace det {

constexpr int64_t kLanes = 16;           // outputs per panel: one float vector

// k's per step of an accumulator: 2 for bf16 through vdpbf16ps, else 1
#if defined(__AVX512BF16__)
template <typename T> constexpr int64_t kGroup = std::is_same_v<T, c10::BFloat16> ? 2 : 1;
#else
template <typename T> constexpr int64_t kGroup = 1;
#endif

inline int64_t panels(int64_t n_out) { return (n_out + kLanes - 1) / kLanes; }
template <typename T> int64_t k_padded(int64_t in) { return (in + kGroup<T> - 1) / kGroup<T> * kGroup<T>; }
template <typename T> int64_t packed_numel(int64_t n_out, int64_t in) { return panels(n_out) * k_padded<T>(in) * kLanes; }

// w (n_out, in) row-major -> dst (packed_numel) in the layout above
template <typename T>
void pack(const T* w, int64_t n_out, int64_t in, T* dst) {
  constexpr int64_t G = kGroup<T>;
  const int64_t Kp = k_padded<T>(in);
  at::parallel_for(0, panels(n_out), 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      T* d = dst + p * Kp * kLanes;
      for (int64_t j = 0; j < kLanes; ++j) {
        const int64_t o = p * kLanes + j;
        for (int64_t k = 0; k < Kp; ++k)
          d[(k / G * kLanes + j) * G + k % G] = o < n_out && k < in ? w[o * in + k] : T(0.f);
      }
    }
  });
}

// Rows of a work item, and panels of one (a decode step's few rows: 4 panels, so the threads share a
// small layer's 36 panels; more rows: 8, so an item's weights -- 8 x in x 64 bytes -- stay in L2 while
// its row groups pass over them)
constexpr int64_t kItemRows = 48;
constexpr int64_t kRowGroup = 6;         // rows a register tile holds (6 x 4 vectors: 24 accumulators)
constexpr int64_t kPanelGroup = 4;

// out rows r of the tile: acc (MR x NV * 16 floats, rows NV * 16 apart) + bias, to T, the last
// panel's padding dropped
template <typename T>
inline void put_rows(const float* acc, int MR, int NV, const T* b, T* out, int64_t n_out, int64_t c0) {
  const int64_t n = std::min<int64_t>(NV * kLanes, n_out - c0);
  for (int r = 0; r < MR; ++r) {
    const float* a = acc + r * NV * kLanes;
    T* o = out + r * n_out + c0;
    if (b != nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) o[j] = to<T>(a[j] + f32(b[c0 + j]));
    } else {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) o[j] = to<T>(a[j]);
    }
  }
}

#if defined(__AVX512F__)
// The weights a decode step streams from memory: each panel's lines this far ahead are asked for
// (the hardware prefetcher alone keeps too few lines in flight over 4 streams; cf. gemv's).
constexpr int64_t kPrefetchBytes = 2048;

// acc[r][v] over all of k for MR rows of x (ldx apart) and NV panels (wp, panel_stride apart)
template <typename T, int MR, int NV>
inline void tile(const T* x, int64_t ldx, const T* wp, int64_t panel_stride, int64_t in, float* out) {
  constexpr int64_t G = kGroup<T>;
  constexpr bool kPrefetch = MR <= 2;           // a decode step: the weights come from memory
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  if constexpr (G == 2) {
#if defined(__AVX512BF16__)
    const int64_t pairs = in / 2;
    auto step = [&](int64_t g, const __m512i* xb) {
      for (int v = 0; v < NV; ++v) {
        const T* wg = wp + v * panel_stride + g * 2 * kLanes;
        if constexpr (kPrefetch) _mm_prefetch(reinterpret_cast<const char*>(wg) + kPrefetchBytes, _MM_HINT_T0);
        const __m512bh wv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(wg));
        for (int r = 0; r < MR; ++r) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], reinterpret_cast<__m512bh>(xb[r]), wv);
      }
    };
    for (int64_t g = 0; g < pairs; ++g) {
      __m512i xb[MR];
      for (int r = 0; r < MR; ++r) {
        int32_t two;                               // x[2g], x[2g + 1] as one 32-bit lane
        std::memcpy(&two, x + r * ldx + 2 * g, sizeof two);
        xb[r] = _mm512_set1_epi32(two);
      }
      step(g, xb);
    }
    if (in % 2 != 0) {                             // the last pair: x[in - 1] and 0
      __m512i xb[MR];
      for (int r = 0; r < MR; ++r) {
        uint16_t last;
        std::memcpy(&last, x + r * ldx + in - 1, sizeof last);
        xb[r] = _mm512_set1_epi32(static_cast<int32_t>(last));
      }
      step(pairs, xb);
    }
#endif
  } else {
    for (int64_t k = 0; k < in; ++k) {
      __m512 wv[NV];
      for (int v = 0; v < NV; ++v) {
        const T* wk = wp + v * panel_stride + k * kLanes;
        if constexpr (kPrefetch) {
          if (std::is_same_v<T, float> || k % 2 == 0)
            _mm_prefetch(reinterpret_cast<const char*>(wk) + kPrefetchBytes, _MM_HINT_T0);
        }
        if constexpr (std::is_same_v<T, float>) {
          wv[v] = _mm512_loadu_ps(wk);
        } else {                                   // bf16 widened: exact
          const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk));
          wv[v] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        }
      }
      for (int r = 0; r < MR; ++r) {
        const __m512 xb = _mm512_set1_ps(f32(x[r * ldx + k]));
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(xb, wv[v], acc[r][v]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + (r * NV + v) * kLanes, acc[r][v]);
}
#else
// the portable build: the same order, 16 lanes of plain floats
template <typename T, int MR, int NV>
inline void tile(const T* x, int64_t ldx, const T* wp, int64_t panel_stride, int64_t in, float* out) {
  static_assert(kGroup<T> == 1);
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) {
      float acc[kLanes] = {0.f};
      const T* w = wp + v * panel_stride;
      for (int64_t k = 0; k < in; ++k) {
        const float xk = f32(x[r * ldx + k]);
        for (int64_t j = 0; j < kLanes; ++j) acc[j] = std::fma(xk, f32(w[k * kLanes + j]), acc[j]);
      }
      std::copy(acc, acc + kLanes, out + (r * NV + v) * kLanes);
    }
}
#endif

// MR rows from r0 against panels p0 .. p1: NV = 4 panels a tile, then the rest
template <typename T, int MR>
inline void row_group(const T* x, const T* packed, const T* b, T* out, int64_t r0, int64_t p0, int64_t p1,
                      int64_t in, int64_t n_out) {
  alignas(64) float acc[MR * kPanelGroup * kLanes];
  const int64_t stride = k_padded<T>(in) * kLanes;
  const T* xr = x + r0 * in;
  T* o = out + r0 * n_out;
  int64_t p = p0;
  for (; p + kPanelGroup <= p1; p += kPanelGroup) {
    tile<T, MR, kPanelGroup>(xr, in, packed + p * stride, stride, in, acc);
    put_rows(acc, MR, kPanelGroup, b, o, n_out, p * kLanes);
  }
  switch (p1 - p) {
    case 3: tile<T, MR, 3>(xr, in, packed + p * stride, stride, in, acc); put_rows(acc, MR, 3, b, o, n_out, p * kLanes); break;
    case 2: tile<T, MR, 2>(xr, in, packed + p * stride, stride, in, acc); put_rows(acc, MR, 2, b, o, n_out, p * kLanes); break;
    case 1: tile<T, MR, 1>(xr, in, packed + p * stride, stride, in, acc); put_rows(acc, MR, 1, b, o, n_out, p * kLanes); break;
    default: break;
  }
}

// x (rows, in), packed (det::pack of w (n_out, in)), b (n_out) or null -> out (rows, n_out). Threads
// take work items of rows x panels, an item's panels for every row block in turn (a weight block read
// from memory once, then from L2: an LM head's 113 MB at 64 rows); each output is one tile's, whole.
template <typename T>
void matmul(const T* x, const T* packed, const T* b, T* out, int64_t rows, int64_t in, int64_t n_out) {
  const int64_t P = panels(n_out);
  const int64_t item_panels = rows <= kRowGroup ? kPanelGroup : 2 * kPanelGroup;
  const int64_t row_items = (rows + kItemRows - 1) / kItemRows, panel_items = (P + item_panels - 1) / item_panels;
  // items a thread takes at least: ~64K multiply-adds, as the default gemv's chunks. A small layer's
  // decode row then runs on the calling thread: handing a few microseconds of work to a second
  // thread made a stories260k decode step ~100x slower on the loaded VM (the fork waits for a
  // descheduled thread), where the default's gemv_transposed stays inline.
  // A small layer (64K weights at most) up to 64 rows runs on the calling thread altogether, as the
  // default path's gemv_transposed does: with a second thread a stories260k prefill step of 64 rows
  // took 5x the default's CPU time at 2 threads.
  const int64_t item_work = std::min(rows, kItemRows) * item_panels * kLanes * in;
  const int64_t items = row_items * panel_items;
  const int64_t grain = n_out * in <= (int64_t{1} << 16) && rows <= 64
                            ? items
                            : std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(item_work, 1));
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p0 = (t / row_items) * item_panels, p1 = std::min(P, p0 + item_panels);
      const int64_t r0 = (t % row_items) * kItemRows, r1 = std::min(rows, r0 + kItemRows);
      int64_t r = r0;
      for (; r + kRowGroup <= r1; r += kRowGroup) row_group<T, kRowGroup>(x, packed, b, out, r, p0, p1, in, n_out);
      switch (r1 - r) {
        case 5: row_group<T, 5>(x, packed, b, out, r, p0, p1, in, n_out); break;
        case 4: row_group<T, 4>(x, packed, b, out, r, p0, p1, in, n_out); break;
        case 3: row_group<T, 3>(x, packed, b, out, r, p0, p1, in, n_out); break;
        case 2: row_group<T, 2>(x, packed, b, out, r, p0, p1, in, n_out); break;
        case 1: row_group<T, 1>(x, packed, b, out, r, p0, p1, in, n_out); break;
        default: break;
      }
    }
  });
}

}  // namespace det
