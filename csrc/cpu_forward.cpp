// The CPU forward pass of a Llama layer stack in one call (pagedecode._cpu).
//
// What it replaces: on the torch path one decode step of a small model is ~18 torch ops per
// layer, each a few microseconds of Python and dispatch, plus a per-step gather of every decode
// sequence's context into a contiguous tensor. Here the matmuls go to oneDNN (its kernels for
// the instructions present: AVX-512, AVX-512-BF16, AMX; at::mm where torch has no oneDNN) or, for
// a decode step of a few rows, to a dot-product gemv (vdpbf16ps for bf16 where the CPU has it);
// attention reads the pages in place (decode rows and prefill chunks alike; only long chunks go to
// ATen's fused attention); everything else -- RMSNorm, RoPE, the KV write, SiLU x up, the
// residual adds -- is a plain loop the compiler vectorises. The torch path
// in pagedecode/model/llama.py stays the oracle: tests hold this file to it.
//
// Layout (see pagedecode/model/batch.py): T packed token rows, sequences own cu_q[s]:cu_q[s+1],
// a sequence with n new rows and seq_len tokens after the write has cached = seq_len - n, and its
// row i sits at position cached + i and attends positions 0 .. cached + i.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <numeric>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <limits>
#include <vector>

#include "philox.h"
#include "quant_lanes.h"
#include "float_gemv.h"

namespace {


using at::Tensor;

// Q8_0 / Q4_0 blocks: uint8 in GGUF's layout, int8 packed (csrc/quant_lanes.h)
inline bool quant_blocks(const Tensor& w) { return w.scalar_type() == at::kByte || w.scalar_type() == at::kChar; }

template <typename T> inline float f32(T x) { return static_cast<float>(x); }

// float -> T, rounding to nearest even as c10::BFloat16 does (NaN -> 0x7fc0), but branch-free so
// that `omp simd` loops vectorise it: c10's own conversion tests for NaN with a branch, which left
// every bf16 elementwise loop scalar.
template <typename T> inline T to(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, c10::Half>) {       // a float16 KV cache's writes
#if defined(__F16C__)
    return T(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT), T::from_bits());
#else
    return T(x);
#endif
  } else {
    const uint32_t u = __builtin_bit_cast(uint32_t, x);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return T(static_cast<uint16_t>(x != x ? 0x7fc0u : rounded), T::from_bits());
  }
}

// exp(x) in float, written so that `omp simd` loops vectorise it (std::exp does not): Cody-Waite
// range reduction x = n ln2 + r, |r| <= ln2 / 2, and Cephes' degree-6 polynomial for exp(r) (about
// 1 ulp). x is clamped to [-87.34, 88.72] first: exp(-inf) comes out as 1e-38, not 0 (callers pass
// no -inf), and NaN stays NaN. GCC 12 vectorises the loops calling it only as written: no
// std::floor / min / max, no reassigned parameter, and -fno-trapping-math (setup.py), as torch
// itself is built.
inline float exp_f(float x_in) {
  const float lo = x_in < -87.33654f ? -87.33654f : x_in;
  const float x = lo > 88.72283f ? 88.72283f : lo;
  const float t = x * 1.44269504f + 0.5f;
  const int32_t ti = static_cast<int32_t>(t);                        // truncates; floor below
  const float n = static_cast<float>(ti - (t < static_cast<float>(ti) ? 1 : 0));
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.f;
  // 2^n in two halves: n reaches 128 at the top of the range, past float's largest exponent
  const int32_t n1 = static_cast<int32_t>(n) / 2, n2 = static_cast<int32_t>(n) - n1;
  return y * __builtin_bit_cast(float, (n1 + 127) << 23) * __builtin_bit_cast(float, (n2 + 127) << 23);
}

// max of x[0, n) (n >= 1), and x[p] = exp(x[p] - max) in place returning their sum: softmax's two
// passes, each one vector loop.
inline float row_max(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t p = 0; p < n; ++p) m = x[p] > m ? x[p] : m;
  return m;
}

inline float exp_shifted_sum(float* x, int64_t n, float shift) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t p = 0; p < n; ++p) {
    const float e = exp_f(x[p] - shift);
    x[p] = e;
    sum += e;
  }
  return sum;
}

#if defined(__AVX512F__)
// r[i] = the sum of x[i]'s 16 lanes, for 16 vectors at once: a tree of unpacks and lane shuffles
// (45 instructions, against ~8 per vector for a horizontal sum each).
inline __m512 sum16(const __m512* x) {
  __m512 pair[8], quad[4], half[2];
  for (int i = 0; i < 8; ++i)           // per 128-bit lane: x2i, x2i+1 interleaved, half-summed
    pair[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]), _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {         // per lane: the four vectors 4i .. 4i+3, each summed over it
    const __m512d a = _mm512_castps_pd(pair[2 * i]), b = _mm512_castps_pd(pair[2 * i + 1]);
    quad[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)           // lanes 0+2 and 1+3 of two quads
    half[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quad[2 * i], quad[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_f32x4(quad[2 * i], quad[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(half[0], half[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(half[0], half[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

#if defined(__AVX512BF16__)
// 32 bf16 values as vdpbf16ps takes them
inline __m512bh load_bf16(const c10::BFloat16* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p)); }
#endif

// -- fixed-order reductions (deterministic mode, EngineConfig.deterministic) ----------------------
// In deterministic mode every sum has one order, whatever the batch around it: a sum over n
// elements goes into 16 lanes (element p into lane p % 16, in order; the last partial step masked
// or padded), then the lanes are added by one tree -- sum16's: lanes (4L, 4L+2), (4L+1, 4L+3), their
// two sums, then the four 128-bit groups as (0 + 2) + (1 + 3). Nothing depends on the address of
// the data (the compiler's vectorised reductions may peel a few elements to align a loop), on the
// number of rows, or on the thread. Float addition commutes exactly, so sum16 gives each of its 16
// inputs that same tree whichever slot it sits in.
inline float lanes_total(const float* l) {
  float g[4];
  for (int i = 0; i < 4; ++i) g[i] = (l[4 * i] + l[4 * i + 2]) + (l[4 * i + 1] + l[4 * i + 3]);
  return (g[0] + g[2]) + (g[1] + g[3]);
}

// sum of x[j]^2 over j < n, in float, in the fixed order
template <typename T>
inline float sum_squares_fixed(const T* x, int64_t n) {
  float lanes[16] = {0.f};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
#pragma omp simd
    for (int l = 0; l < 16; ++l) lanes[l] += f32(x[j + l]) * f32(x[j + l]);
  }
  for (int l = 0; j + l < n; ++l) lanes[l] += f32(x[j + l]) * f32(x[j + l]);
  return lanes_total(lanes);
}

// exp_shifted_sum in the fixed order: the last partial block padded through the same 16-wide loop
// (so every element's exp is the vector one), its padding left out of the sum.
inline float exp_shifted_sum_fixed(float* x, int64_t n, float shift) {
  float lanes[16] = {0.f};
  int64_t p = 0;
  for (; p + 16 <= n; p += 16) {
#pragma omp simd
    for (int l = 0; l < 16; ++l) {
      const float e = exp_f(x[p + l] - shift);
      x[p + l] = e;
      lanes[l] += e;
    }
  }
  if (p < n) {
    float tail[16];
    const int rem = static_cast<int>(n - p);
    for (int l = 0; l < 16; ++l) tail[l] = l < rem ? x[p + l] : shift;
#pragma omp simd
    for (int l = 0; l < 16; ++l) tail[l] = exp_f(tail[l] - shift);
    for (int l = 0; l < rem; ++l) {
      x[p + l] = tail[l];
      lanes[l] += tail[l];
    }
  }
  return lanes_total(lanes);
}

// Rows per parallel_for chunk such that a chunk is ~`work` elements: a decode step's few rows run
// on the calling thread, a prefill chunk's thousands are split across the pool.
inline int64_t grain_rows(int64_t row_width, int64_t work = 1 << 15) {
  return std::max<int64_t>(1, work / std::max<int64_t>(row_width, 1));
}

// out = rmsnorm(x) * w, per row of width n, computed in float like HF (x.float(), then cast).
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t n, float eps, bool det = false) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      float ss = 0.f;
      if (det) {
        ss = sum_squares_fixed(xr, n);
      } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < n; ++j) ss += f32(xr[j]) * f32(xr[j]);
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      T* o = out + r * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) o[j] = to<T>(f32(w[j]) * f32(to<T>(f32(xr[j]) * inv)));
    }
  });
}

// -- 8-bit KV caches (kernels/kv_quant.py): int8 / float8_e4m3fn rows, a float32 scale per (token, KV head)
template <typename C>
constexpr bool kQuantCache = std::is_same_v<C, int8_t> || std::is_same_v<C, c10::Float8_e4m3fn>;
template <typename C>
constexpr float kQuantMax = std::is_same_v<C, int8_t> ? 127.f : 448.f;
// an 8-bit cache's per-row scale as stored (kv_quant.SCALE_DTYPE)
using KvScale = c10::BFloat16;

// kv_quant.stored_scale: float s -> the bfloat16 value the cache stores for it (nearest even), as
// float: the value a row is quantized against
inline float stored_scale(float s) { return static_cast<float>(KvScale(s)); }

// kv_quant.e4m3_round: float y, |y| <= 448 -> the nearest e4m3 value (ties to even), in float
// arithmetic: the step 2^(e - 3) from y's exponent bits (at least 2^-9: the subnormals')
inline float e4m3_round(float y) {
  uint32_t bits;
  std::memcpy(&bits, &y, 4);
  const uint32_t e = std::max<uint32_t>((bits >> 23) & 0xFF, 127 - 6);
  const uint32_t up_bits = (257 - e) << 23, step_bits = (e - 3) << 23;
  float up, step;
  std::memcpy(&up, &up_bits, 4);
  std::memcpy(&step, &step_bits, 4);
  return ((y * up + 12582912.f) - 12582912.f) * step;
}

constexpr int kFp8Steps = 16;       // kv_quant.FP8_STEPS: the scales an fp8 row tries

// One head's row x[0, D) -> q[0, D); returns its scale, a bfloat16 value (kv_quant.quantize_rows,
// bit for bit: the same float32 divisions, and half-to-even rounding by adding 1.5 * 2^23; fp8: of
// bf16(amax / 448 times 1 + j / 16), the scale whose row reads back with the least squared error,
// summed in double)
template <typename C>
inline float quantize_row(const float* x, int64_t D, C* q) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::fabs(x[d]) > amax ? std::fabs(x[d]) : amax;
  const float base = amax / kQuantMax<C>;
  if constexpr (std::is_same_v<C, int8_t>) {
    const float scale = stored_scale(base), safe = scale > 0.f ? scale : 1.f;
    for (int64_t d = 0; d < D; ++d) {
      float y = x[d] / safe;
      y = y < -127.f ? -127.f : (y > 127.f ? 127.f : y);
      q[d] = static_cast<int8_t>((y + 12582912.f) - 12582912.f);    // kv_quant.ROUNDER (no -ffast-math here)
    }
    return scale;
  } else {
    thread_local std::vector<float> row, best;
    row.resize(D);
    best.resize(D);
    float best_s = base;
    double best_e = std::numeric_limits<double>::infinity();
    for (int j = 0; j < kFp8Steps; ++j) {
      const float s = stored_scale(base * (1.f + static_cast<float>(j) / kFp8Steps)), safe = s > 0.f ? s : 1.f;
      double err = 0.0;
      for (int64_t d = 0; d < D; ++d) {
        float y = x[d] / safe;
        y = y < -448.f ? -448.f : (y > 448.f ? 448.f : y);
        row[d] = e4m3_round(y);
        const double diff = static_cast<double>(row[d]) * static_cast<double>(s) - static_cast<double>(x[d]);
        err += diff * diff;
      }
      if (err < best_e) {                 // the first j on a tie, as the reference
        best_e = err;
        best_s = s;
        std::swap(row, best);
      }
    }
    for (int64_t d = 0; d < D; ++d) q[d] = C(best[d]);                  // exact: best holds e4m3 values
    return best_s;
  }
}

// In place on the (T, (H + 2 Hkv) D) qkv rows: rotate q and k heads ("rotate half", with the
// signed-sin table of kernels/rope.py), then write k and v to their cache slots (an 8-bit cache:
// quantized, each head's scale into ks / vs at slot * Hkv + head).
template <typename T, typename C>
void rope_and_write(T* qkv, int64_t rows, int64_t H, int64_t Hkv, int64_t D, const float* cos,
                    const float* sin, const int64_t* pos, const int64_t* slots, C* kc, C* vc,
                    KvScale* ks = nullptr, KvScale* vs = nullptr) {
  const int64_t width = (H + 2 * Hkv) * D, half = D / 2;
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(D);
    for (int64_t r = begin; r < end; ++r) {
      T* row = qkv + r * width;
      const float* c = cos + pos[r] * D;
      const float* s = sin + pos[r] * D;
      for (int64_t h = 0; h < H + Hkv; ++h) {
        T* x = row + h * D;
        for (int64_t d = 0; d < half; ++d) tmp[d] = f32(x[d]) * c[d] + f32(x[d + half]) * s[d];
        for (int64_t d = half; d < D; ++d) tmp[d] = f32(x[d]) * c[d] + f32(x[d - half]) * s[d];
        for (int64_t d = 0; d < D; ++d) x[d] = to<T>(tmp[d]);
      }
      const int64_t slot = slots[r];
      if constexpr (kQuantCache<C>) {
        for (int64_t h = 0; h < Hkv; ++h) {
          for (int64_t d = 0; d < D; ++d) tmp[d] = f32(row[(H + h) * D + d]);
          ks[slot * Hkv + h] = KvScale(quantize_row(tmp.data(), D, kc + (slot * Hkv + h) * D));   // exact
          for (int64_t d = 0; d < D; ++d) tmp[d] = f32(row[(H + Hkv + h) * D + d]);
          vs[slot * Hkv + h] = KvScale(quantize_row(tmp.data(), D, vc + (slot * Hkv + h) * D));
        }
      } else if constexpr (std::is_same_v<T, C>) {
        std::copy(row + H * D, row + (H + Hkv) * D, kc + slot * Hkv * D);
        std::copy(row + (H + Hkv) * D, row + width, vc + slot * Hkv * D);
      } else {                                  // a narrower cache: rounded to nearest even
        for (int64_t e = 0; e < Hkv * D; ++e) {
          kc[slot * Hkv * D + e] = to<C>(f32(row[H * D + e]));
          vc[slot * Hkv * D + e] = to<C>(f32(row[(H + Hkv) * D + e]));
        }
      }
    }
  });
}

// -- paged attention: csrc/paged_attention.h --------------------------------------------------------
// Included here, inside this file's namespace, for the helpers above.
#include "paged_attention.h"

// h += x (the residual add), then out = rmsnorm(h) * w: one pass over the rows.
template <typename T>
void add_then_norm(T* h, const T* x, const T* w, T* out, int64_t rows, int64_t n, float eps, bool det) {
  at::parallel_for(0, rows * n, grain_rows(1), [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) h[i] = to<T>(f32(h[i]) + f32(x[i]));
  });
  if (w != nullptr) rms_norm_rows(h, w, out, rows, n, eps, det);
}

// A chunk of ~64K outputs: a verify's rows (up to kGemvRowsUnpacked of a 1536-wide layer) stay on
// the caller, off OpenMP, when the step's matmuls run on the pool (off_openmp).
template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t I) {
  at::parallel_for(0, rows, grain_rows(I, 1 << 16), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * I;
      const T* u = g + I;
      T* o = out + r * I;
#pragma omp simd
      for (int64_t j = 0; j < I; ++j) {
        const float x = f32(g[j]);
        // F.silu rounds to T before the multiply, as the torch path does
        o[j] = to<T>(f32(to<T>(x / (1.f + exp_f(-x)))) * f32(u[j]));
      }
    }
  });
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "pagedecode._cpu.forward: ", what); }

// Rows at most this many go through gemv below: for a decode step of a few sequences a dot product
// per output beats the BLAS call's setup on small layers, and reads a large layer's weights at
// memory speed (for bf16, half the bytes of float32, converted in registers). Measured against
// oneDNN on packed weights (a 135M model's decode step): bf16 gemv as fast or faster up to 4 rows;
// float32 up to 2, while at 4 rows oneDNN took 14.1 ms to the gemv's 19.7.
template <typename T>
constexpr int64_t kGemvRows = std::is_same_v<T, float> ? 2 : 4;
// The gemv's dot products come from float_gemv.h's tiles (AVX2 with FMA; bfloat16 on AVX-512-BF16
// machines keeps vdpbf16ps, one row at a time, below).
template <typename T>
#if defined(__AVX2__) && defined(__FMA__) && defined(__AVX512BF16__)
constexpr bool kTiledGemv = std::is_same_v<T, float>;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr bool kTiledGemv = true;
#else
constexpr bool kTiledGemv = false;
#endif
// Without the packed copy (EngineConfig.cpu_pack_weights off, the default) oneDNN re-blocks the
// weight on every call, and the gemv wins further: each weight row is read from memory once and
// stays in L1 for the step's other rows, so a few more rows cost their arithmetic only. Measured
// on SmolLM2-135M float32 with AVX2 (2 threads), tokens/s of a decode batch, oneDNN -> gemv one
// row at a time: 4 rows 77 -> 147, 8 rows 134 -> 193, 12 rows 176 -> 181, 16 rows 196 -> 181.
// The tiles take each weight vector once for 4 rows: on one thread, SmolLM2-135M's layers (float32,
// random weights), at::mm -> tiles: 17 rows 94 -> 79 ms, 24 rows 108 -> 105, 32 rows 128 -> 137.
template <typename T>
constexpr int64_t kGemvRowsUnpacked = kTiledGemv<T> ? 24 : 12;
// A small layer (its weight also transposed: SMALL_LAYER in model/llama.py) goes through
// gemv_transposed up to this many rows: oneDNN's call costs more than the whole product there
// (stories260k, float32: a 3-row forward 334 us to a 1-row one's 106, a speculative verify of 5
// rows 385). Each row's result is the one a 1-row call gives, bit for bit.
constexpr int64_t kSmallGemvRows = 64;

#if defined(__AVX512F__) || defined(__AVX2__)
// The AVX-512-BF16 dot below streams weights from memory; asking for the lines 4 KB ahead of the
// loads made a single-stream decode step of a 135M model 8% (float32) to 15% (bf16) faster (when
// every gemv was such a dot): the hardware prefetcher alone kept too few lines in flight. A
// prefetch past the end is a hint, never a fault.
constexpr int64_t kPrefetchBytes = 4096;

inline void prefetch_ahead(const void* p) {       // the 4 lines at p + kPrefetchBytes
  const char* a = static_cast<const char*>(p) + kPrefetchBytes;
  for (int64_t l = 0; l < 256; l += 64) _mm_prefetch(a + l, _MM_HINT_T0);
}
#endif

// sum x[k] * w[k], k < n, in float, in order: builds without AVX2 (float_gemv.h's tiles otherwise)
template <typename T>
inline float dot_row(const float* x, const T* w, int64_t n) {
  float d = 0.f;
  for (int64_t k = 0; k < n; ++k) d += x[k] * f32(w[k]);
  return d;
}

#if defined(__AVX512BF16__)
// The same for bf16 rows and weights where the CPU has AVX-512-BF16: vdpbf16ps multiplies 32 pairs
// (exactly, in float) and adds them into 16 float lanes in one instruction, so nothing is widened
// (the widening path above is instruction-bound well below memory speed on one core).
inline float dot_row_bf16(const c10::BFloat16* x, const c10::BFloat16* w, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 128 <= n; k += 128) {
    prefetch_ahead(w + k);
    a0 = _mm512_dpbf16_ps(a0, load_bf16(x + k), load_bf16(w + k));
    a1 = _mm512_dpbf16_ps(a1, load_bf16(x + k + 32), load_bf16(w + k + 32));
    a2 = _mm512_dpbf16_ps(a2, load_bf16(x + k + 64), load_bf16(w + k + 64));
    a3 = _mm512_dpbf16_ps(a3, load_bf16(x + k + 96), load_bf16(w + k + 96));
  }
  for (; k + 32 <= n; k += 32) a0 = _mm512_dpbf16_ps(a0, load_bf16(x + k), load_bf16(w + k));
  float d = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  for (; k < n; ++k) d += f32(x[k]) * f32(w[k]);
  return d;
}
#endif

// The gemv's outputs in chunks on work::Pool (work_pool.h), as the quantized matmuls run: a chunk
// is claimed by whichever thread is running, so a step whose second thread the OS has descheduled
// (another process on its core) finishes on the caller instead of waiting for that thread's next
// time slice. at::parallel_for's static shares waited there: beside builds and tests (load ~16 on
// 2 cores) a float32 decode step of a 135M model took 6.9 s. Each output is the same dot product
// whoever computes it, so the result does not depend on the scheduling.
template <typename T>
struct GemvJob {
  const T* x;            // the rows as given, in memory the call owns (a late worker may read it)
  const float* xf;       // the same rows in float (== x for float32)
  const T* w;
  const T* b;
  T* out;
  int64_t rows, in, n_out, per_chunk;

  float dot(int64_t r, const T* wj) const {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) return dot_row_bf16(x + r * in, wj, in);
#endif
    return dot_row(xf + r * in, wj, in);
  }

  bool compute(int64_t c, std::vector<float>* scratch, work::Live live) const {
    const int64_t begin = c * per_chunk, end = std::min(n_out, begin + per_chunk), cols = end - begin;
    if (scratch != nullptr) scratch->resize(rows * cols);
    auto put = [&](int64_t r, int64_t j, float d) {
      const float v = b != nullptr ? d + f32(b[j]) : d;
      if (scratch != nullptr) (*scratch)[r * cols + (j - begin)] = v;
      else out[r * n_out + j] = to<T>(v);
    };
#if defined(__AVX2__) && defined(__FMA__)
    if constexpr (kTiledGemv<T>) return fgemv::dots(xf, w, rows, in, begin, end, live, put);
#endif
    for (int64_t j = begin; j < end; ++j) {
      if (!live()) return false;
      for (int64_t r = 0; r < rows; ++r) put(r, j, dot(r, w + j * in));
    }
    return true;
  }

  void commit(int64_t c, std::vector<float>* scratch) const {
    const int64_t begin = c * per_chunk, cols = std::min(n_out, begin + per_chunk) - begin;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < cols; ++j) out[r * n_out + begin + j] = to<T>((*scratch)[r * cols + j]);
  }
};

// out (rows, n_out) = x (rows, in) @ w^T + b by GemvJob; keep: w's and b's tensors (held while a
// worker may read them). A call of under kGemvInlineBytes of weights runs on the caller alone.
constexpr int64_t kGemvInlineBytes = 32 << 10;
constexpr int64_t kGemvChunksPerThread = 8;

template <typename T>
void gemv(const T* x, const T* w, const T* b, T* out, int64_t rows, int64_t in, int64_t n_out, work::Keep keep) {
  const bool wide = !std::is_same_v<T, float>;
  unsigned char* mem = work::owned(keep, work::lines(rows * in * sizeof(T)) + (wide ? rows * in * 4 : 0));
  T* xc = reinterpret_cast<T*>(mem);
  std::memcpy(xc, x, rows * in * sizeof(T));
  const float* xf = reinterpret_cast<const float*>(xc);
  if (wide) {
    float* f = reinterpret_cast<float*>(mem + work::lines(rows * in * sizeof(T)));
    for (int64_t i = 0; i < rows * in; ++i) f[i] = f32(x[i]);
    xf = f;
  }
  work::Pool& pool = work::Pool::get();
  const int64_t reads = n_out * in * static_cast<int64_t>(sizeof(T));
  const int64_t chunks = std::max<int64_t>(
      1, std::min({reads / kGemvInlineBytes, pool.threads() * kGemvChunksPerThread, n_out, work::Pool::kMaxChunks}));
  GemvJob<T> job{xc, xf, w, b, out, rows, in, n_out, (n_out + chunks - 1) / chunks};
  // On the pool at every row count it takes (up to kGemvRowsUnpacked): a speculative verify's 8-24
  // rows on OpenMP's threads waited at each join for a thread a busy neighbour had descheduled
  // (SmolLM2 float32 beside another 2-thread process: a 17-row forward 1.2 s, a 7-row one 75 ms).
  pool.run((n_out + job.per_chunk - 1) / job.per_chunk, job, std::move(keep));
}

// Larger matmuls: oneDNN's linear (mkldnn::_linear_pointwise, the op torch.compile's CPU backend
// calls) where torch was built with it, else at::mm. In float32 torch's at::mm goes to MKL, which
// on non-Intel x86 runs its AVX2 kernels; oneDNN picks its kernels by the instructions present
// (AVX-512, AVX-512-BF16, AMX) -- measured 2.2-2.5x at::mm's float32 throughput on an AVX-512 AMD
// EPYC at 12 to 2048 rows. forward's `onednn` false (EngineConfig.cpu_matmul "aten") forces at::mm.
using LinearOp = c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&,
                                                 c10::string_view, c10::List<std::optional<c10::Scalar>>,
                                                 std::optional<c10::string_view>)>;

const LinearOp* onednn_linear() {
  static const std::optional<LinearOp> op = []() -> std::optional<LinearOp> {
    if (!at::hasMKLDNN()) return std::nullopt;
    auto handle = c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
    if (!handle.has_value()) return std::nullopt;
    return handle->typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&, c10::string_view,
                                c10::List<std::optional<c10::Scalar>>, std::optional<c10::string_view>)>();
  }();
  return op.has_value() ? &*op : nullptr;
}

// The same for a small layer whose weight also comes transposed, wt (in, n_out): each input
// element scales a whole row of wt into float accumulators, so the loop runs over outputs in
// whole vectors with no horizontal sum per output (on a 64-wide layer, the dot products above
// spend most of their time in those sums).
#if defined(__AVX512F__)
// float32 with AVX-512: up to 4 rows at once, 64 outputs at a time, the 4 x 4 accumulators in
// registers and each vector of wt loaded once for the rows (a speculative verify's 5 rows of
// stories260k: 191 us a forward with one row at a time, see kSmallGemvRows). Every output is
// the same sequence of operations whatever NR is (bias or 0, then one fma per k in order), so a
// row's result does not depend on the rows beside it (deterministic mode relies on that).
template <int NR>
void gemv_transposed_f32(const float* x, const float* wt, const float* b, float* out, int64_t in, int64_t n_out) {
  for (int64_t j0 = 0; j0 < n_out; j0 += 64) {
    __mmask16 m[4];
    __m512 acc[NR][4];
    for (int c = 0; c < 4; ++c) {
      const int64_t left = std::clamp<int64_t>(n_out - j0 - 16 * c, 0, 16);
      m[c] = static_cast<__mmask16>((1u << left) - 1u);
      const __m512 init = b != nullptr ? _mm512_maskz_loadu_ps(m[c], b + j0 + 16 * c) : _mm512_setzero_ps();
      for (int r = 0; r < NR; ++r) acc[r][c] = init;
    }
    for (int64_t k = 0; k < in; ++k) {
      const float* wk = wt + k * n_out + j0;
      __m512 w[4];
      for (int c = 0; c < 4; ++c) w[c] = _mm512_maskz_loadu_ps(m[c], wk + 16 * c);
      for (int r = 0; r < NR; ++r) {
        const __m512 xr = _mm512_set1_ps(x[r * in + k]);
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_fmadd_ps(xr, w[c], acc[r][c]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < 4; ++c) _mm512_mask_storeu_ps(out + r * n_out + j0 + 16 * c, m[c], acc[r][c]);
  }
}
#endif

template <typename T>
void gemv_transposed(const T* x, const T* wt, const T* b, T* out, int64_t rows, int64_t in, int64_t n_out) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) gemv_transposed_f32<4>(x + r * in, wt, b, out + r * n_out, in, n_out);
    switch (rows - r) {
      case 3: gemv_transposed_f32<3>(x + r * in, wt, b, out + r * n_out, in, n_out); break;
      case 2: gemv_transposed_f32<2>(x + r * in, wt, b, out + r * n_out, in, n_out); break;
      case 1: gemv_transposed_f32<1>(x + r * in, wt, b, out + r * n_out, in, n_out); break;
      default: break;
    }
    return;
  }
#endif
  thread_local std::vector<float> acc;
  acc.resize(n_out);
  float* a = acc.data();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < n_out; ++j) a[j] = b != nullptr ? f32(b[j]) : 0.f;
    for (int64_t k = 0; k < in; ++k) {
      const float xk = f32(x[r * in + k]);
      const T* wk = wt + k * n_out;
#pragma omp simd
      for (int64_t j = 0; j < n_out; ++j) a[j] += xk * f32(wk[j]);
    }
    for (int64_t j = 0; j < n_out; ++j) out[r * n_out + j] = to<T>(a[j]);
  }
}

// x (rows, in) @ w (n_out, in)^T + b; wt: w transposed for a small layer, else empty; packed: w in
// oneDNN's blocked layout (torch.ops.mkldnn._reorder_linear_weight), else empty. The gemv paths
// write into buf (allocated on first use, then reused by every layer: a decode step of a small
// model would otherwise spend a good part of its time allocating). oneDNN given a plain weight
// re-blocks it on every call: the packed copy made 8-52-row matmuls of a 135M model 1.3-2.5x
// faster (the same results, bit for bit), 300- and 2048-row ones 3-12%.
template <typename T>
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& wt, const Tensor& packed,
              Tensor& buf, bool onednn) {
  const bool bias = b.defined() && b.numel() > 0;
  if (quant_blocks(w)) {        // Q8_0 / Q4_0 blocks: quant_lanes.h / quant_matmul.h, in float
    Tensor y = quant_linear(x.to(at::kFloat).contiguous(), w, w.size(0));
    if (bias) y.add_(b.to(at::kFloat));
    return std::is_same_v<T, float> ? y : y.to(x.scalar_type());
  }
  const int64_t rows = x.size(0), n_out = w.size(0);
  const bool small = wt.numel() > 0 && rows <= kSmallGemvRows;
  const int64_t gemv_rows = packed.defined() && packed.is_mkldnn() ? kGemvRows<T> : kGemvRowsUnpacked<T>;
  if ((rows <= gemv_rows || small) && x.is_contiguous()) {
    if (!buf.defined()) buf = at::empty({rows, n_out}, x.options());
    T* out = buf.data_ptr<T>();
    const T* bp = bias ? b.data_ptr<T>() : nullptr;
    if (wt.numel() > 0) gemv_transposed(x.data_ptr<T>(), wt.data_ptr<T>(), bp, out, rows, x.size(1), n_out);
    else gemv(x.data_ptr<T>(), w.data_ptr<T>(), bp, out, rows, x.size(1), n_out, work::Keep{w, b});
    return buf;
  }
  if (const LinearOp* op = onednn ? onednn_linear() : nullptr)
    return op->call(x.contiguous(), packed.is_mkldnn() ? packed : w,
                    bias ? std::optional<Tensor>(b) : std::nullopt, "none",
                    c10::List<std::optional<c10::Scalar>>(), std::nullopt);
  return bias ? at::addmm(b, x, w.t()) : at::mm(x, w.t());
}

// -- the deterministic matmul (EngineConfig.deterministic): csrc/det_matmul.h ---------------------
// Included here, inside this file's namespace, for to<T>() and f32() above.
#include "det_matmul.h"

// w as det::matmul takes it: `packed` when it is w's det::pack (LlamaModel keeps one in deterministic
// mode, in the slot the default path gives oneDNN's copy), else packed now into `scratch`
template <typename T>
const T* det_packed(const Tensor& w, const Tensor& packed, Tensor& scratch) {
  const int64_t n = det::packed_numel<T>(w.size(0), w.size(1));
  if (packed.defined() && !packed.is_mkldnn() && packed.scalar_type() == w.scalar_type() && packed.numel() == n &&
      packed.dim() == 3)
    return packed.data_ptr<T>();
  scratch = at::empty({n}, w.options());
  det::pack(w.data_ptr<T>(), w.size(0), w.size(1), scratch.data_ptr<T>());
  return scratch.data_ptr<T>();
}

// (n_out, in) -> det::pack's layout, (panels, k_padded / kGroup, 16 kGroup)
Tensor det_pack_op(const Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "pagedecode._cpu.det_pack: w (N, K) contiguous float32 or bfloat16");
  auto shaped = [&](auto tag) {
    using T = decltype(tag);
    const int64_t G = det::kGroup<T>;
    Tensor out = at::empty({det::panels(w.size(0)), det::k_padded<T>(w.size(1)) / G, det::kLanes * G}, w.options());
    det::pack(w.data_ptr<T>(), w.size(0), w.size(1), out.data_ptr<T>());
    return out;
  };
  return w.scalar_type() == at::kFloat ? shaped(float{}) : shaped(at::BFloat16{});
}

// linear() in deterministic mode: every float layer, small ones too, through det::matmul (on
// `packed`, or w packed for the call; a small layer's gemv_transposed, its 1-64-row kernel in the
// default path, took 1.3x the default's time on a 256-row bf16 prefill of stories260k where
// det::matmul takes 0.9x); quantized blocks through quant_linear (quant_lanes.h), whose per-token accumulators
// are already the same for any number of rows. buf: as linear()'s, the output reused by every
// layer of one forward (allocated on first use).
template <typename T>
Tensor det_linear(const Tensor& x_in, const Tensor& w, const Tensor& b, const Tensor& packed, Tensor* buf = nullptr) {
  const bool bias = b.defined() && b.numel() > 0;
  if (quant_blocks(w)) {
    Tensor y = quant_linear(x_in.to(at::kFloat).contiguous(), w, w.size(0));
    if (bias) y.add_(b.to(at::kFloat));
    return std::is_same_v<T, float> ? y : y.to(x_in.scalar_type());
  }
  const Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), in = x.size(1), n_out = w.size(0);
  if (buf != nullptr && !(buf->defined() && buf->size(0) == rows && buf->size(1) == n_out))
    *buf = at::empty({rows, n_out}, x.options());
  Tensor out = buf != nullptr ? *buf : at::empty({rows, n_out}, x.options());
  const T* bp = bias ? b.data_ptr<T>() : nullptr;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  Tensor scratch;
  det::matmul(xp, det_packed<T>(w, packed, scratch), bp, op, rows, in, n_out);
  return out;
}

// When the rows whose logits are asked for are each the last row of its own sequence (a prefill
// chunk's last row, a decode row; in order) and fewer than all rows, the last layer's attention,
// o_proj and MLP are needed only there: every row's K/V is still written, and those rows' outputs
// are what the full layer gives them (in deterministic mode the same bits). cu_last: per sequence
// 0 or 1 of those rows. Measured on the 135M model (30 layers): the mixed workload's prefill (64
// prompts in 2048-row steps) 20.3 -> 19.7 s.
bool last_rows_only(const Tensor& logits_indices, const int32_t* cu, int64_t S, int64_t rows,
                    std::vector<int32_t>& cu_last) {
  const int64_t n = logits_indices.size(0);
  if (n == 0 || n >= rows) return false;
  const int64_t* li = logits_indices.data_ptr<int64_t>();
  cu_last.assign(S + 1, 0);
  int64_t k = 0;
  for (int64_t s = 0; s < S; ++s) {
    const bool has = k < n && cu[s + 1] > cu[s] && li[k] == cu[s + 1] - 1;
    cu_last[s + 1] = cu_last[s] + (has ? 1 : 0);
    k += has ? 1 : 0;
  }
  return k == n;
}

// -- the model as forward() reads it: csrc/model_stack.h -----------------------------------------
// Included here, inside this file's namespace, for quant_blocks() above.
#include "model_stack.h"

// Whether every matmul of a layer over `rows` rows stays off OpenMP's threads: on the caller
// (a small layer's gemv_transposed) or on work::Pool (the float gemv, and the quantized matmuls
// under work::kOpenMPRows rows). Then the step's attention runs on the pool too (paged_attention):
// OpenMP's threads, woken for it alone, spin at the join for a thread the OS has descheduled and
// after it, burning the time slice that thread needs (stories260k's 64-request decode steps beside
// a busy neighbour: most of a step). Deterministic mode keeps its matmuls (det::matmul) as they are.
template <typename T>
bool off_openmp(const std::vector<Tensor>& L, int64_t rows, bool det) {
  for (const Proj& p : {kQkv, kO, kGateUp, kDown}) {
    const Tensor& w = L[p.w];
    if (quant_blocks(w) || in_parts(L, p)) {
      if (rows >= work::kOpenMPRows) return false;
      continue;
    }
    if (det) return false;
    if (L[p.t].numel() > 0 && rows <= kSmallGemvRows) continue;
    const bool packed = L[p.packed].defined() && L[p.packed].is_mkldnn();
    if (rows > (packed ? kGemvRows<T> : kGemvRowsUnpacked<T>)) return false;   // the gemv: on the pool
  }
  return true;
}

// A projection held as its parts (in_parts: a K-quant mix's q, k, v or gate, up, each in its own
// block type): each part's quant_linear, the same call the torch path makes per part (model/quant.py
// linear over a RowStack), side by side in the output's columns, then the bias and the model's dtype
// as linear() gives them for a stacked weight.
template <typename T>
Tensor linear_parts(const Tensor& x, const std::vector<Tensor>& L, const Proj& p, const Tensor& b) {
  const Tensor xf = x.to(at::kFloat).contiguous();
  std::vector<Tensor> ys;
  for (Slot s : p.parts)
    if (s != kSlots) ys.push_back(quant_linear(xf, L[s], L[s].size(0)));
  Tensor y = at::cat(ys, 1);
  if (b.defined() && b.numel() > 0) y.add_(b.to(at::kFloat));
  return std::is_same_v<T, float> ? y : y.to(x.scalar_type());
}

// -- LoRA adapters: csrc/lora_delta.h ---------------------------------------------------------------
#include "lora_delta.h"

// k_cache, v_cache: (layers, pages, page_size, Hkv, D), of type C; an 8-bit C's scales k_scale,
// v_scale (layers, pages, page_size, Hkv, 1) float32 (undefined otherwise).
template <typename T, typename C>
Tensor forward_impl(const Stack& m, const Tensor& ids, const Tensor& positions, const Tensor& slot_mapping,
                    const Tensor& page_table, const Tensor& seq_lens, const Tensor& cu_q,
                    const Tensor& logits_indices, const Tensor& k_cache, const Tensor& v_cache, bool onednn, bool det,
                    const LoraRun& lora, const Tensor& k_scale = Tensor(), const Tensor& v_scale = Tensor()) {
  const float eps = static_cast<float>(m.eps), scale = static_cast<float>(m.scale);
  const int64_t H = m.H, Hkv = m.Hkv, D = m.D, hidden = m.hidden, I = m.inter;
  const int64_t T_ = ids.size(0), S = seq_lens.size(0);
  const int64_t page_size = k_cache.size(2), per_layer = k_cache[0].numel();
  const auto opts = m.final_norm.options();
  Tensor h = quant_blocks(m.embed)                             // (T, hidden)
                 ? quant_embedding_rows(m.embed, ids, hidden).to(m.final_norm.scalar_type())
                 : m.embed.index_select(0, ids);
  Tensor x = at::empty({T_, hidden}, opts);
  Tensor attn = at::empty({T_, H * D}, opts);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  T* hp = h.data_ptr<T>();
  const int64_t n_layers = static_cast<int64_t>(m.layers.size());
  const std::vector<Chunk> chunks = matmul_chunks(page_table.data_ptr<int32_t>(), page_table.size(1),
                                                  seq_lens.data_ptr<int32_t>(), cu_q.data_ptr<int32_t>(), S,
                                                  page_size, det);
  Tensor act = at::empty({T_, I}, opts);
  Tensor buf_qkv, buf_o, buf_gate_up, buf_down, buf_logits;            // the gemv outputs, per forward
  // deterministic: every matmul through det_linear (one order per output, whatever the rows)
  auto mm = [&](const Tensor& in, const Proj& p, const std::vector<Tensor>& L, Tensor& buf) -> Tensor {
    const Tensor none;
    const Tensor& b = p.b == kSlots ? none : L[p.b];
    if (in_parts(L, p)) return linear_parts<T>(in, L, p, b);     // per row as quant_linear: det's order too
    return det ? det_linear<T>(in, L[p.w], b, L[p.packed], &buf)
               : linear<T>(in, L[p.w], b, L[p.t], L[p.packed], buf, onednn);
  };
  work::Keep caches{k_cache, v_cache};               // what a late attention worker reads (work_pool.h)
  const bool quant = k_scale.defined();
  if (quant) {
    caches.push_back(k_scale);
    caches.push_back(v_scale);
  }
  const int64_t scales_per_layer = per_layer / D;
  std::vector<int32_t> cu_last;
  const bool trim = last_rows_only(logits_indices, cu_q.data_ptr<int32_t>(), S, T_, cu_last);
  int64_t rows = T_;                                   // the rows the layer's outputs are kept for
  rms_norm_rows(hp, m.layers[0][kLn1].data_ptr<T>(), x.data_ptr<T>(), T_, hidden, eps, det);
  for (int64_t i = 0; i < n_layers; ++i) {
    const std::vector<Tensor>& L = m.layers[i];
    Tensor qkv = mm(x, kQkv, L, buf_qkv).contiguous();                           // (T, (H + 2 Hkv) D)
    if (lora.stack != nullptr)                         // LoRA on q | k | v, before RoPE (all T rows)
      add_lora<T>(qkv, x, *lora.stack, i, {{kLoraQ, 0}, {kLoraK, H * D}, {kLoraV, (H + Hkv) * D}}, lora.all, det,
                  off_openmp<T>(L, T_, det));
    C* kc = k_cache.data_ptr<C>() + i * per_layer;
    C* vc = v_cache.data_ptr<C>() + i * per_layer;
    KvScale* ks = quant ? k_scale.data_ptr<KvScale>() + i * scales_per_layer : nullptr;
    KvScale* vs = quant ? v_scale.data_ptr<KvScale>() + i * scales_per_layer : nullptr;
    rope_and_write(qkv.data_ptr<T>(), T_, H, Hkv, D, m.cos.data_ptr<float>(), m.sin.data_ptr<float>(), pos,
                   slots, kc, vc, ks, vs);
    const int32_t* cu = cu_q.data_ptr<int32_t>();
    if (trim && i + 1 == n_layers) {                   // last_rows_only: from here on the logits' rows
      rows = logits_indices.size(0);
      qkv = qkv.index_select(0, logits_indices);
      h = h.index_select(0, logits_indices);
      hp = h.data_ptr<T>();
      attn = attn.narrow(0, 0, rows);
      x = x.narrow(0, 0, rows);
      act = act.narrow(0, 0, rows);
      cu = cu_last.data();
    }
    const bool pool = off_openmp<T>(L, rows, det);     // the layer's matmuls over its kept rows: on work::Pool
    attention(qkv.data_ptr<T>(), qkv.size(1), kc, vc, k_cache.size(1), page_table.data_ptr<int32_t>(), page_table.size(1),
              seq_lens.data_ptr<int32_t>(), cu, S, page_size, H, Hkv, D, scale, attn.data_ptr<T>(), det, pool, caches,
              ks, vs);
    if (!chunks.empty() && rows == T_)
      prefill_attention(chunks, qkv, k_cache[i], v_cache[i], H, Hkv, D, m.scale, attn,
                        quant ? k_scale[i] : Tensor(), quant ? v_scale[i] : Tensor());
    const std::vector<LoraSegment>& segs = rows < T_ ? lora.last : lora.all;      // the rows kept from here on
    Tensor o = mm(attn, kO, L, buf_o);
    if (lora.stack != nullptr) add_lora<T>(o, attn, *lora.stack, i, {{kLoraO, 0}}, segs, det, pool);
    add_then_norm(hp, o.data_ptr<T>(), L[kLn2].data_ptr<T>(), x.data_ptr<T>(), rows, hidden, eps, det);
    Tensor gate_up = mm(x, kGateUp, L, buf_gate_up);                             // (rows, 2 I)
    if (lora.stack != nullptr) add_lora<T>(gate_up, x, *lora.stack, i, {{kLoraGate, 0}, {kLoraUp, I}}, segs, det, pool);
    silu_mul(gate_up.data_ptr<T>(), act.data_ptr<T>(), rows, I);
    Tensor down = mm(act, kDown, L, buf_down);
    if (lora.stack != nullptr) add_lora<T>(down, act, *lora.stack, i, {{kLoraDown, 0}}, segs, det, pool);
    const T* next_ln = i + 1 < n_layers ? m.layers[i + 1][kLn1].data_ptr<T>() : nullptr;
    add_then_norm(hp, down.data_ptr<T>(), next_ln, x.data_ptr<T>(), rows, hidden, eps, det);
  }
  Tensor last = rows < T_ ? h : h.index_select(0, logits_indices);
  Tensor normed = at::empty_like(last);
  rms_norm_rows(last.data_ptr<T>(), m.final_norm.data_ptr<T>(), normed.data_ptr<T>(), last.size(0), hidden, eps, det);
  if (det) return det_linear<T>(normed, m.lm_head, Tensor(), m.lm_head_packed, &buf_logits).to(at::kFloat);
  return linear<T>(normed, m.lm_head, Tensor(), m.lm_head_t, m.lm_head_packed, buf_logits, onednn).to(at::kFloat);
}

// f(T{}, C{}) for activations of dtype t over a KV cache of dtype c: a float32 model's cache is
// float32, bfloat16, float16, int8 or float8_e4m3fn (kv_cache_dtype), a bfloat16 model's its own dtype
template <typename F>
auto by_cache_dtype(at::ScalarType t, at::ScalarType c, const char* what, F&& f) {
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16, "pagedecode._cpu.", what, ": float32 or bfloat16 only");
  if (t == at::kBFloat16) {
    TORCH_CHECK(c == at::kBFloat16, "pagedecode._cpu.", what, ": a bfloat16 model's KV cache must be bfloat16");
    return f(at::BFloat16{}, at::BFloat16{});
  }
  if (c == at::kBFloat16) return f(float{}, at::BFloat16{});
  if (c == at::kHalf) return f(float{}, at::Half{});
  if (c == at::kChar) return f(float{}, int8_t{});
  if (c == at::kFloat8_e4m3fn) return f(float{}, c10::Float8_e4m3fn{});
  TORCH_CHECK(c == at::kFloat, "pagedecode._cpu.", what,
              ": a float32 model's KV cache must be float32, bfloat16, float16, int8 or float8_e4m3fn");
  return f(float{}, float{});
}

// An 8-bit cache's scales: given exactly when the cache is 8-bit, shaped as its rows with a last
// dimension of 1, bfloat16 (KvScale) and contiguous
void check_scales(const Tensor& cache, const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale,
                  const char* what) {
  const bool quant = cache.scalar_type() == at::kChar || cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(quant == k_scale.has_value() && quant == v_scale.has_value(), "pagedecode._cpu.", what,
              ": an int8 / float8_e4m3fn cache needs k_scale and v_scale, and only it takes them");
  if (!quant) return;
  std::vector<int64_t> shape(cache.sizes().begin(), cache.sizes().end());
  shape.back() = 1;
  for (const Tensor* t : {&*k_scale, &*v_scale})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->sizes() == at::IntArrayRef(shape),
                "pagedecode._cpu.", what, ": scales must be bfloat16, contiguous, ", at::IntArrayRef(shape), ", got ",
                t->scalar_type(), " ", t->sizes());
}

// The batch (model/batch.py) through the model: every index checked against what it indexes first.
Tensor forward(const Stack& m, Tensor ids, Tensor positions, Tensor slot_mapping, Tensor page_table, Tensor seq_lens,
               Tensor cu_q, Tensor logits_indices, Tensor k_cache, Tensor v_cache, bool onednn, bool deterministic,
               const LoraStack* lora_stack, const std::optional<Tensor>& seg_starts,
               const std::optional<Tensor>& seg_slots, const std::optional<Tensor>& k_scale,
               const std::optional<Tensor>& v_scale) {
  check(ids.dtype() == at::kLong && positions.dtype() == at::kLong && slot_mapping.dtype() == at::kLong &&
            logits_indices.dtype() == at::kLong, "ids, positions, slot_mapping, logits_indices must be int64");
  check(page_table.dtype() == at::kInt && seq_lens.dtype() == at::kInt && cu_q.dtype() == at::kInt,
        "page_table, seq_lens, cu_q must be int32");
  check(k_cache.is_contiguous() && v_cache.is_contiguous() && page_table.is_contiguous(), "caches must be contiguous");
  const int64_t T_ = ids.size(0);
  check(ids.dim() == 1 && positions.dim() == 1 && slot_mapping.dim() == 1 && logits_indices.dim() == 1 &&
            positions.size(0) == T_ && slot_mapping.size(0) == T_, "ids, positions, slot_mapping: one per row");
  const int64_t n_layers = static_cast<int64_t>(m.layers.size());
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.size(0) == n_layers && k_cache.size(3) == m.Hkv && k_cache.size(4) == m.D &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.dtype() == k_cache.dtype(),
              "pagedecode._cpu.forward: K and V caches must be (", n_layers, ", pages, page_size, ", m.Hkv, ", ", m.D,
              "), got ", k_cache.sizes(), " and ", v_cache.sizes());
  // the index tensors are read through their data pointers: a strided view (a slice with a step)
  // is copied to the layout they assume (no copy when it already has it)
  ids = ids.contiguous();
  positions = positions.contiguous();
  slot_mapping = slot_mapping.contiguous();
  seq_lens = seq_lens.contiguous();
  cu_q = cu_q.contiguous();
  logits_indices = logits_indices.contiguous();
  check_range(ids, m.vocab, "token id");
  check_range(positions, m.cos.size(0), "position");
  check_range(slot_mapping, k_cache.size(1) * k_cache.size(2), "cache slot");
  check_range(logits_indices, T_, "logits row");
  check_tables(page_table, seq_lens, cu_q, T_, k_cache.size(1), k_cache.size(2), "forward");
  LoraRun lora;                                        // adapters: csrc/lora_delta.h
  if (lora_stack != nullptr && lora_stack->slots > 0) {     // (no slots: no projection is targeted)
    check(seg_starts.has_value() && seg_slots.has_value(), "a LoraStack needs seg_starts and seg_slots");
    check_lora_stack(m, *lora_stack);
    lora.stack = lora_stack;
    lora.all = lora_segments(*seg_starts, *seg_slots, T_, lora_stack->slots);
    lora.last = lora_segments_of_rows(lora.all, logits_indices);
  }
  check_scales(k_cache, k_scale, v_scale, "forward");
  const Tensor ks = k_scale.value_or(Tensor()), vs = v_scale.value_or(Tensor());
  return by_cache_dtype(m.final_norm.scalar_type(), k_cache.scalar_type(), "forward", [&](auto t, auto c) {
    return forward_impl<decltype(t), decltype(c)>(m, ids, positions, slot_mapping, page_table, seq_lens, cu_q,
                                                  logits_indices, k_cache, v_cache, onednn, deterministic, lora,
                                                  ks, vs);
  });
}

// The deterministic kernels one at a time, for the torch path in deterministic mode (a
// tensor-parallel shard runs it: its collectives sit between the layers' ops). The same kernels
// as forward(deterministic=True) uses, so each gives one order per output.
template <typename F>
auto by_dtype(const Tensor& t, const char* what, F&& f) {
  if (t.scalar_type() == at::kFloat) return f(float{});
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, "pagedecode._cpu.", what, ": float32 or bfloat16 only");
  return f(at::BFloat16{});
}

Tensor det_linear_op(const Tensor& x, const Tensor& w, const std::optional<Tensor>& b,
                     const std::optional<Tensor>& packed) {
  TORCH_CHECK(x.dim() == 2 && (w.dim() == 2 || quant_blocks(w)) && w.is_contiguous() &&
                  (quant_blocks(w) || (x.size(1) == w.size(1) && w.scalar_type() == x.scalar_type())),
              "pagedecode._cpu.det_linear: x (T, K), w (N, K) contiguous, one dtype (or Q8_0 / Q4_0 blocks, "
              "which quant_linear checks)");
  const Tensor bias = b.has_value() ? b->contiguous() : Tensor();
  const Tensor pk = packed.has_value() ? *packed : Tensor();
  return by_dtype(x, "det_linear", [&](auto tag) { return det_linear<decltype(tag)>(x, w, bias, pk); });
}

// The forward's float gemv alone (tests: a row's outputs are its 1-row call's bits at any row count)
Tensor gemv_op(const Tensor& x, const Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && w.scalar_type() == x.scalar_type(),
              "pagedecode._cpu.gemv: x (T, K), w (N, K), one dtype");
  const Tensor xc = x.contiguous(), wc = w.contiguous();
  Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  return by_dtype(x, "gemv", [&](auto tag) {
    using T = decltype(tag);
    gemv(xc.data_ptr<T>(), wc.data_ptr<T>(), static_cast<const T*>(nullptr), out.data_ptr<T>(), x.size(0), x.size(1),
         w.size(0), work::Keep{wc});
    return out;
  });
}

Tensor det_rms_norm_op(const Tensor& x, const Tensor& w, double eps) {
  const int64_t n = w.numel();
  TORCH_CHECK(x.size(-1) == n && w.scalar_type() == x.scalar_type(), "pagedecode._cpu.det_rms_norm: x (..., n), w (n,)");
  const Tensor xc = x.contiguous(), wc = w.contiguous();
  Tensor out = at::empty_like(xc);
  by_dtype(x, "det_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_rows(xc.data_ptr<T>(), wc.data_ptr<T>(), out.data_ptr<T>(), xc.numel() / n, n, static_cast<float>(eps), true);
    return 0;
  });
  return out;
}

Tensor silu_mul_op(const Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "pagedecode._cpu.silu_mul: gate_up (T, 2 I)");
  const Tensor g = gate_up.contiguous();
  const int64_t I = g.size(1) / 2;
  Tensor out = at::empty({g.size(0), I}, g.options());
  by_dtype(g, "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    silu_mul(g.data_ptr<T>(), out.data_ptr<T>(), g.size(0), I);
    return 0;
  });
  return out;
}

// q (T, H, D) against the paged cache of one layer (pages, page_size, Hkv, D): every row through the
// paged kernel in its fixed order (decode rows and chunks alike) -> (T, H, D)
Tensor det_attention_op(const Tensor& q, const Tensor& k_layer, const Tensor& v_layer, const Tensor& page_table,
                        const Tensor& seq_lens, const Tensor& cu_q, double scale, bool pool,
                        const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale) {
  TORCH_CHECK(q.dim() == 3 && k_layer.dim() == 4 && k_layer.is_contiguous() && v_layer.is_contiguous() &&
                  v_layer.scalar_type() == k_layer.scalar_type() && page_table.is_contiguous() &&
                  page_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  cu_q.scalar_type() == at::kInt,
              "pagedecode._cpu.det_attention: q (T, H, D), caches (pages, page_size, Hkv, D), int32 tables");
  const Tensor qc = q.contiguous(), lens = seq_lens.contiguous(), cu = cu_q.contiguous();
  const int64_t H = q.size(1), D = q.size(2), Hkv = k_layer.size(2);
  TORCH_CHECK(H % Hkv == 0 && k_layer.size(3) == D && v_layer.sizes() == k_layer.sizes(),
              "pagedecode._cpu.det_attention: heads and head size");
  // the layout every item relies on (the kernel computes nothing for an item that breaks it)
  check_tables(page_table, lens, cu, q.size(0), k_layer.size(0), k_layer.size(1), "det_attention");
  check_scales(k_layer, k_scale, v_scale, "det_attention");
  work::Keep keep{k_layer, v_layer};
  const KvScale* ks = k_scale.has_value() ? k_scale->data_ptr<KvScale>() : nullptr;
  const KvScale* vs = v_scale.has_value() ? v_scale->data_ptr<KvScale>() : nullptr;
  if (ks != nullptr) {
    keep.push_back(*k_scale);
    keep.push_back(*v_scale);
  }
  Tensor out = at::empty_like(qc);
  by_cache_dtype(q.scalar_type(), k_layer.scalar_type(), "det_attention", [&](auto t, auto c) {
    using T = decltype(t);
    using C = decltype(c);
    attention(qc.data_ptr<T>(), H * D, k_layer.data_ptr<C>(), v_layer.data_ptr<C>(), k_layer.size(0),
              page_table.data_ptr<int32_t>(),
              page_table.size(1), lens.data_ptr<int32_t>(), cu.data_ptr<int32_t>(), lens.size(0), k_layer.size(1),
              H, Hkv, D, static_cast<float>(scale), out.data_ptr<T>(), true, pool, keep, ks, vs);
    return 0;
  });
  return out;
}

// glibc's malloc hands blocks over its mmap threshold back to the kernel on free, and trims the
// heap's free top, so every forward's activations and oneDNN outputs (a few MB at a decode batch
// of 64, tens at a 2048-row prefill) came back as fresh pages the kernel zeroes: measured 8.4 s of
// system time in a 28 s mixed workload on a 135M model, 2.6 s with blocks kept for reuse. Fixed
// thresholds (the largest mmap threshold glibc takes, 32 MB; 1 GB of free heap kept) keep what a
// step frees for the next step: the process holds its peak heap instead of returning it. Returns
// whether glibc took both settings (false elsewhere).
bool keep_freed_memory() {
#if defined(__GLIBC__)
  static const bool done = mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 && mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1;
  return done;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Stack>(m, "Stack", "a model's weights and shapes as forward() reads them, checked once here")
      .def(py::init(&make_stack), py::arg("layers"), py::arg("embed"), py::arg("final_norm"), py::arg("lm_head"),
           py::arg("lm_head_t"), py::arg("lm_head_packed"), py::arg("cos"), py::arg("sin"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("scale"));
  py::class_<LoraStack>(m, "LoraStack", "the resident LoRA adapters' stacked weights (csrc/lora_delta.h)")
      .def(py::init(&make_lora_stack), py::arg("layers"), py::arg("ranks"));
  m.def("lora_projections", [] { return std::vector<std::string>(kLoraProjNames, kLoraProjNames + kLoraProjs); },
        "the projections' names, in the order LoraStack takes each layer's [A, B, scaling] triples");
  m.def("layer_slots", [] { return std::vector<std::string>(kSlotNames, kSlotNames + kSlots); },
        "the names of a layer's tensors, in the order Stack takes each layer's list");
  m.def("forward", &forward, "Llama forward over the paged KV cache, CPU (see csrc/cpu_forward.cpp)",
        py::arg("stack"), py::arg("ids"), py::arg("positions"), py::arg("slot_mapping"), py::arg("page_table"),
        py::arg("seq_lens"), py::arg("cu_q"), py::arg("logits_indices"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("onednn"), py::arg("deterministic"), py::arg("lora") = static_cast<LoraStack*>(nullptr),
        py::arg("seg_starts") = py::none(), py::arg("seg_slots") = py::none(), py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none());
  m.def("det_linear", &det_linear_op, "x @ w^T (+ b), each output in one fixed order whatever the rows (deterministic mode)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("b") = pybind11::none(),
        pybind11::arg("packed") = pybind11::none());
  m.def("gemv", &gemv_op, "x (T, K) @ w (N, K)^T by the forward's float gemv (float32 / bfloat16, on the pool), each row's "
        "outputs the bits of its 1-row call");
  m.def("det_pack", &det_pack_op, "w (N, K) in det_linear's packed layout (csrc/det_matmul.h), made once at load");
  m.def("det_rms_norm", &det_rms_norm_op, "RMSNorm over the last dim, each row's sum in one fixed order");
  m.def("silu_mul", &silu_mul_op, "silu(gate) * up of (T, 2 I) gate_up rows");
  m.def("det_attention", &det_attention_op, "causal attention over the paged cache, one order per query position "
        "(pool: under 8 rows on the spinning pool, as the forward of a quantized model runs it)",
        py::arg("q"), py::arg("k_layer"), py::arg("v_layer"), py::arg("page_table"), py::arg("seq_lens"),
        py::arg("cu_q"), py::arg("scale"), py::arg("pool") = false, py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none());
  m.def("philox_c0", &philox::c0_op, "Philox4x32-10's first word for key seed, counter (token, index, DOMAIN, "
        "stream): pagedecode/kernels/philox.py's philox_c0, bit for bit (csrc/philox.h)",
        py::arg("seed"), py::arg("index"), py::arg("token"), py::arg("stream") = 0);
  m.def("keep_freed_memory", &keep_freed_memory,
        "glibc malloc: keep freed blocks for reuse instead of returning them to the kernel (idempotent)");
  m.def("drain_pool", [] { work::Pool::drain_current(); },
        "wait until no pool worker is inside a call and drop the inputs the pool holds (csrc/work_pool.h; tests)");
  m.def("quant_embedding_rows", &quant_embedding_rows,
        "rows of an embedding table in Q8_0 / Q4_0 blocks (either layout), dequantized to float32 (csrc/quant_lanes.h)");
  m.attr("quant_block_kinds") = py::make_tuple("q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k");   // csrc/quant_types.h
  m.def("quant_linear", [](const Tensor& x, const Tensor& blocks, int64_t n) { return quant_linear(x, blocks, n); },
        "x (T, K) float32 @ W^T, W (N, K) in Q8_0 / Q4_0 blocks (uint8: GGUF's layout, csrc/quant_matmul.h; int8: "
        "packed, csrc/quant_lanes.h), activations int8 per block");
  m.def("quant_pack", [](const Tensor& blocks, int64_t k) { return quant_repack(blocks, k, true); },
        "GGUF Q8_0 / Q4_0 / Q5_0 / Q4_1 / Q5_1 blocks (N, K / 32 * block bytes) uint8 -> the same weight in csrc/quant_lanes.h's layout (int8)");
  m.def("quant_unpack", [](const Tensor& blocks, int64_t k) { return quant_repack(blocks, k, false); },
        "quant_pack's inverse: packed (int8) -> GGUF's blocks (uint8), bit for bit");
  // the block types whose packed layout has this build's fast kernel (the others' packed rows would
  // go through the scalar form): what the compiled forward packs at load
#if defined(QUANT_LANES)
  m.attr("quant_packed_is_fast") = true;    // the packed layout's AVX-512 VNNI or AVX2 kernel (else a scalar loop)
  m.attr("quant_packed_kinds") = quant::lanes::lanes_kernel(22)
                                     ? std::vector<std::string>{"q8_0", "q4_0", "q5_0", "q4_1", "q5_1"}
                                     : std::vector<std::string>{"q8_0", "q4_0"};
#else
  m.attr("quant_packed_is_fast") = false;
  m.attr("quant_packed_kinds") = std::vector<std::string>{};
#endif
}
