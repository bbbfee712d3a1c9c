// y = x W^T over weights in GGUF's Q8_0 / Q4_0 blocks (pagedecode/model/quant.py has the layout):
// the gemv of a decode step and the gemm of a prefill chunk, one loop nest for both.
//
// Activations are quantized per block of 32 to int8 with one float scale, as llama.cpp does
// (d = max |x| / 127, q = round(x / d)), so that each block is an integer dot product:
//
//     y[t, n] = sum over blocks b of  dw[n, b] * dx[t, b] * sum_j qw[n, b, j] * qx[t, b, j]
//
// The int8 dot of a block is one vpdpbusd with AVX-512 VNNI (vpdpbusd multiplies unsigned by
// signed bytes: |qw| times qx carrying qw's sign, llama.cpp's trick), vpmaddubsw + vpmaddwd with
// AVX2, a plain loop otherwise. Q4_0's nibbles are unpacked to q - 8 in registers first (the
// AVX2 tiles: used as stored, the -8 a per-token offset). Lanes accumulate in float (scale
// products broadcast); one horizontal sum per output.
//
// Work: rows of W are split over threads (chunks of output columns); each thread walks its rows in
// register tiles of several rows x several tokens (a weight block decoded once serves the tile's
// tokens, a token's block loaded once serves its rows), so a row's blocks are read from memory
// once per call and stay in L1 across the tokens.

#pragma once

#include "work_pool.h"

namespace quant {

constexpr int64_t kBlock = 32;

// The tiles below read several weight rows at once, a few bytes of each in turn: the hardware
// prefetcher, which follows one stream well, left them waiting on memory (a decode step's matmuls of
// SmolLM2 Q4_1 from memory: 29 ms with 4-row tiles, 12 ms asking for the lines 4 KB ahead, as
// cpu_forward.cpp's gemv does). A prefetch past the end is a hint, never a fault.
constexpr int64_t kPrefetchAhead = 4096;

// the lines of `bytes` read next, kPrefetchAhead on from p
inline void prefetch_span(const uint8_t* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchAhead + off), _MM_HINT_T0);
}

// f(std::integral_constant<int, n>) for a runtime n in [1, N]
template <int N, typename F>
inline void by_count(int n, F&& f) {
  if constexpr (N >= 1) {
    if (n == N) return f(std::integral_constant<int, N>{});
    by_count<N - 1>(n, f);
  }
}

inline float fp16_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// Every float16 bit pattern as float (fp16_to_float's values: the same floats), 256 KB: a block's
// scale is then a 2-byte load and a broadcast from the table, where F16C took the load, a move to
// a vector register, the conversion and the broadcast (tile_avx2's gemv pays one a row and block;
// a model's scales span few exponents, so the lines it reads stay few and cached)
inline const float* fp16_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t h = 0; h < 65536; ++h) {
      const uint16_t bits = static_cast<uint16_t>(h);
      t[h] = fp16_to_float(reinterpret_cast<const uint8_t*>(&bits));
    }
    return t;
  }();
  return table.data();
}

// the float16 at p through the table
inline const float* fp16_at(const float* table, const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return table + h;
}

// x (T, K) float -> qx (T, K) int8 and dx (T, K / 32) float, on the caller alone: at::parallel_for
// (OpenMP's fork-join) waited for a descheduled OpenMP thread on a loaded machine, measured 10 ms a
// call at 8-64 tokens (a 7 MMAC matmul: 1 GOP/s), while this takes ~1% of the matmul it feeds
inline void quantize_rows(const float* x, int8_t* qx, float* dx, int64_t T, int64_t K) {
  const int64_t nb = K / kBlock;
  {
    const int64_t begin = 0, end = T * nb;
    for (int64_t i = begin; i < end; ++i) {
      const float* v = x + i * kBlock;
#if defined(__AVX512F__)
      const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
      const float amax_v = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float d_v = amax_v / 127.f;
      const __m512 inv_v = _mm512_set1_ps(d_v > 0.f ? 1.f / d_v : 0.f);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + i * kBlock), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv_v))));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + i * kBlock + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv_v))));
      dx[i] = d_v;
      continue;
#elif defined(__AVX2__)
      // the scalar loop's values: max |x| exactly, q = x * inv rounded to nearest even (the
      // conversion's default rounding, as nearbyint's), |q| <= 127 so the packs never saturate
      const __m256 sign = _mm256_set1_ps(-0.f);
      const __m256 a0 = _mm256_loadu_ps(v), a1 = _mm256_loadu_ps(v + 8), a2 = _mm256_loadu_ps(v + 16),
                   a3 = _mm256_loadu_ps(v + 24);
      const __m256 m8 = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a0), _mm256_andnot_ps(sign, a1)),
                                      _mm256_max_ps(_mm256_andnot_ps(sign, a2), _mm256_andnot_ps(sign, a3)));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float d_v = _mm_cvtss_f32(m4) / 127.f;
      const __m256 inv_v = _mm256_set1_ps(d_v > 0.f ? 1.f / d_v : 0.f);
      const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(a0, inv_v)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(a1, inv_v));
      const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(a2, inv_v)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(a3, inv_v));
      // packs interleave the 128-bit halves: bytes come out as 0-3 8-11 4-7 12-15 (in 4-int groups)
      const __m256i q = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qx + i * kBlock),
                          _mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      dx[i] = d_v;
      continue;
#endif
      float amax = 0.f;
      for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
      const float d = amax / 127.f;
      const float inv = d > 0.f ? 1.f / d : 0.f;
      for (int j = 0; j < kBlock; ++j) qx[i * kBlock + j] = static_cast<int8_t>(std::nearbyint(v[j] * inv));
      dx[i] = d;
    }
  }
}

// the 32 signed weights of block `blk` (Q8_0: as stored; Q4_0: nibble - 8), scalar form
inline void unpack_scalar(const uint8_t* blk, bool q4, int8_t* w) {
  if (!q4) {
    std::memcpy(w, blk + 2, kBlock);
    return;
  }
  for (int j = 0; j < 16; ++j) {
    w[j] = static_cast<int8_t>((blk[2 + j] & 15) - 8);
    w[j + 16] = static_cast<int8_t>((blk[2 + j] >> 4) - 8);
  }
}

#if defined(__AVX2__)
// 16 bytes -> their 32 nibbles as bytes: the low nibbles, then the high ones (the bytes loaded
// once into both halves, the upper half shifted by 4: 3 operations against 5 with a shift, two
// ands and an insert)
inline __m256i nibbles32(const uint8_t* qs16) {
  const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs16)));
  return _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(15));
}

// two adjacent float16 (a block's d and m) -> lanes 0 and 1
inline __m128 fp16_pair(const uint8_t* p) {
#if defined(__F16C__)
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(v));
#else
  return _mm_setr_ps(fp16_to_float(p), fp16_to_float(p + 2), 0.f, 0.f);
#endif
}

inline __m256i unpack_avx2(const uint8_t* blk, bool q4) {
  if (!q4) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
  const __m128i low = _mm_set1_epi8(15);
  const __m256i nibbles = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low), _mm_and_si128(packed, low));
  return _mm256_sub_epi8(nibbles, _mm256_set1_epi8(8));
}

// 8 int32 lanes summing to the dot product of 32 signed bytes w and x, given w_abs = |w|
inline __m256i dot_block(__m256i w, __m256i w_abs, __m256i x) {
  const __m256i x_signed = _mm256_sign_epi8(x, w);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w_abs, x_signed);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, x_signed), _mm256_set1_epi16(1));
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// RM weight rows against one token: per output, per block in order, acc = fma(float(lanes), dw * dx,
// acc), then hsum(acc) (the AVX-512 GEMM's tile_q8 the same); RM fma chains in flight instead of one (a decode step's gemv, the LM head's 49152 rows above all, waited on the
// chain's latency): out[r] for rows[r]
template <int RM>
inline void rows_tile(const uint8_t* const* rows, int64_t nb, int64_t block_bytes, bool q4, const int8_t* qx,
                      const float* dx, float* out) {
  __m256 acc[RM];
  for (int r = 0; r < RM; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + b * kBlock));
    const float dxb = dx[b];
    prefetch_span(rows[0] + b * RM * block_bytes, RM * block_bytes);
    for (int r = 0; r < RM; ++r) {
      const uint8_t* blk = rows[r] + b * block_bytes;
      const __m256i w = unpack_avx2(blk, q4);
      const __m256i lanes = dot_block(w, _mm256_sign_epi8(w, w), xb);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(fp16_to_float(blk) * dxb), acc[r]);
    }
  }
  for (int r = 0; r < RM; ++r) out[r] = hsum(acc[r]);
}
constexpr int kGemvTileRows = 4;
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__F16C__)
#define QUANT_Q4_PAIRS 1
// Q4_0, two blocks per 512-bit step. The nibbles go to vpdpbusd as stored (0..15, its unsigned
// operand) and the -8 is folded in: each int32 lane starts from -8 times the sum of the four
// activations it multiplies (corr, made once per call with the activations), so a pair of blocks
// costs a shift, an and and one vpdpbusd, against an unpack, a subtraction and two vpsignb per
// block above (which left Q4_0 compute-bound at half Q8_0's bytes per second). The activations of
// blocks b, b + 1 are laid out as the unpacked nibbles come: b[0:16], b+1[0:16], b[16:32],
// b+1[16:32] (an odd last block stays in order, for the 256-bit step).

// qx (T, K) int8 in block order -> xp in pair order, corr (T, K / 4) int32
inline void pair_layout(const int8_t* qx, int8_t* xp, int32_t* corr, int64_t T, int64_t K) {
  const int64_t nb = K / kBlock;
  for (int64_t t = 0; t < T; ++t) {
    const int8_t* src = qx + t * K;
    int8_t* dst = xp + t * K;
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
      const int8_t* x0 = src + b * kBlock;
      int8_t* d = dst + b * kBlock;
      std::memcpy(d, x0, 16);
      std::memcpy(d + 16, x0 + 32, 16);
      std::memcpy(d + 32, x0 + 16, 16);
      std::memcpy(d + 48, x0 + 48, 16);
    }
    if (b < nb) std::memcpy(dst + b * kBlock, src + b * kBlock, kBlock);
    int32_t* c = corr + t * (K / 4);
    for (int64_t l = 0; l < K / 4; ++l)
      c[l] = -8 * (int32_t(dst[4 * l]) + dst[4 * l + 1] + dst[4 * l + 2] + dst[4 * l + 3]);
  }
}

template <int R>
inline void row_tile_q4(const uint8_t* row, int64_t nb, const int8_t* xp, const int32_t* corr, const float* dx,
                        int64_t K, float* out, int64_t N) {
  constexpr int64_t kBytes = 2 + kBlock / 2;
  const __m512i low = _mm512_set1_epi8(15);
  // lanes 0-3 and 8-11 belong to block b (scale 0), lanes 4-7 and 12-15 to block b + 1 (scale 1)
  const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    const uint8_t* blk = row + b * kBytes;
    const __m256i p = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kBytes + 2)), 1);
    const __m512i nib = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(p), _mm256_srli_epi16(p, 4), 1), low);
    uint16_t h0, h1;
    std::memcpy(&h0, blk, 2);
    std::memcpy(&h1, blk + kBytes, 2);
    const __m128 dw = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(h0 | uint32_t(h1) << 16)));
    for (int r = 0; r < R; ++r) {
      const __m128 dx2 = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(dx + r * nb + b)));
      const __m512 scale = _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(_mm_mul_ps(dw, dx2)));
      const __m512i lanes = _mm512_dpbusd_epi32(_mm512_loadu_si512(corr + r * (K / 4) + b * 8), nib,
                                                _mm512_loadu_si512(xp + r * K + b * kBlock));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), scale, acc[r]);
    }
  }
  // the odd last block joins the sum in one explicit fma (GCC contracts a * b + c as it likes,
  // differently per inlined copy: the GEMM below must be able to repeat it bit for bit)
  if (b < nb) {
    const uint8_t* blk = row + b * kBytes;
    const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(p, 4), p), _mm256_set1_epi8(15));
    const float dw = fp16_to_float(blk);
    for (int r = 0; r < R; ++r) {
      const __m256i lanes = _mm256_dpbusd_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(corr + r * (K / 4) + b * 8)), nib,
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + r * K + b * kBlock)));
      out[r * N] = std::fma(dw * dx[r * nb + b], hsum(_mm256_cvtepi32_ps(lanes)), _mm512_reduce_add_ps(acc[r]));
    }
    return;
  }
  for (int r = 0; r < R; ++r) out[r * N] = _mm512_reduce_add_ps(acc[r]);
}
#endif

constexpr int kTile = 4;        // tokens per weight-block load (rows_gemm's tails: 1 to 3)

// One row of W against every token: out[t * ld] for t < T.
inline void one_row(const uint8_t* row, int64_t nb, int64_t block_bytes, bool q4, const int8_t* qx, const int8_t* xp,
                    const int32_t* corr, const float* dx, int64_t T, int64_t K, float* out, int64_t ld) {
#if defined(QUANT_Q4_PAIRS)
  if (q4) {
    int64_t t = 0;
    for (; t + kTile <= T; t += kTile)
      row_tile_q4<kTile>(row, nb, xp + t * K, corr + t * (K / 4), dx + t * nb, K, out + t * ld, ld);
    for (; t < T; ++t) row_tile_q4<1>(row, nb, xp + t * K, corr + t * (K / 4), dx + t * nb, K, out + t * ld, ld);
    return;
  }
#endif
  (void)xp;
  (void)corr;
#if !defined(__AVX2__)   // (AVX2: MatmulJob::tiles, or the AVX-512 GEMM)
  for (int64_t t = 0; t < T; ++t) {
    const int8_t* xq = qx + t * K;
    const float* xd = dx + t * nb;
    float acc = 0.f;
    int8_t wq[kBlock];
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * block_bytes;
      unpack_scalar(blk, q4, wq);
      int32_t dot = 0;
      for (int j = 0; j < kBlock; ++j) dot += int32_t(wq[j]) * int32_t(xq[b * kBlock + j]);
      acc += fp16_to_float(blk) * xd[b] * static_cast<float>(dot);
    }
    out[t * ld] = acc;
  }
#else
  (void)row, (void)nb, (void)block_bytes, (void)q4, (void)qx, (void)dx, (void)T, (void)K, (void)out, (void)ld;
#endif
}

#if defined(QUANT_Q4_PAIRS)
// The GEMM of several tokens (T >= 2): a tile of up to kTileRows weight rows x kTile tokens, each
// (row, token) with its own accumulators, the weight blocks of the tile's rows decoded once per
// token block (kTokenBlock tokens, whose activations stay in L2) and reused by every token of it.
// Every (row, token) output goes through exactly the float operations of the gemv above (the same
// lanes, the same fma order, the same final sums), so the GEMM equals the gemv bit for bit, whatever
// the tile a token falls in: only how each block's exact int32 dot is formed differs. The gemv
// forms it with llama.cpp's sign trick (|w| times x carrying w's sign: two vpsignb per (row,
// token) and block); here the activations go to vpdpbusd's unsigned operand as x + 128 and the
// accumulator starts from -128 times the sum of the weights each lane multiplies (made once per row
// and block with the decode), so a (row, token) block costs vpdpbusd, a conversion, the scale
// product and an fma. Q4_0 keeps row_tile_q4's form (nibbles unsigned, -8 folded into the
// activations' correction), with the nibbles of a pair of blocks unpacked once per tile row.
constexpr int kTileRows = 4;
constexpr int64_t kTokenBlock = 128;

// The decoded rows of a tile: Q8_0: per block the correction (8 int32) and the scale; Q4_0: per
// pair of blocks the nibbles (64 bytes) and the 16 lane scales, and the odd last block's.
struct Panel {
  std::vector<int32_t> corr;      // Q8_0 (rows, nb, 8)
  std::vector<float> dw;          // Q8_0 (rows, nb); Q4_0 (rows, pairs, 16)
  std::vector<uint8_t> nib;       // Q4_0 (rows, nb, 32): pairs of blocks, then the odd last block
  std::vector<float> dw_tail;     // Q4_0 (rows)
};

inline __m512i pair_pick() { return _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0); }

inline void decode_q8(const uint8_t* const* rows, int rm, int64_t nb, Panel& p) {
  p.corr.resize(rm * nb * 8);
  p.dw.resize(rm * nb);
  const __m256i ones = _mm256_set1_epi8(1);
  for (int r = 0; r < rm; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = rows[r] + b * 34;
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      const __m256i sum = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, w);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.corr.data() + (r * nb + b) * 8),
                          _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sum, 7)));
      p.dw[r * nb + b] = fp16_to_float(blk);
    }
}

// RM rows x RN tokens of Q8_0: xu the activations + 128 (token t at xu + t * K), dx their scales
template <int RM, int RN>
inline void tile_q8(const uint8_t* const* rows, const Panel& p, int64_t nb, const uint8_t* xu, const float* dx,
                    int64_t K, float* out, int64_t ld) {
  __m256 acc[RM][RN];
  for (int r = 0; r < RM; ++r)
    for (int t = 0; t < RN; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i w[RM];
    for (int r = 0; r < RM; ++r) w[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[r] + b * 34 + 2));
    __m256i x[RN];
    for (int t = 0; t < RN; ++t) x[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xu + t * K + b * kBlock));
    for (int r = 0; r < RM; ++r) {
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.corr.data() + (r * nb + b) * 8));
      const float dw = p.dw[r * nb + b];
      for (int t = 0; t < RN; ++t) {
        const __m256i lanes = _mm256_dpbusd_epi32(c, x[t], w[r]);
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(dw * dx[t * nb + b]), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < RM; ++r)
    for (int t = 0; t < RN; ++t) out[t * ld + r] = hsum(acc[r][t]);
}

inline void decode_q4(const uint8_t* const* rows, int rm, int64_t nb, Panel& p) {
  constexpr int64_t kBytes = 2 + kBlock / 2;
  const int64_t pairs = nb / 2;
  p.nib.resize(rm * nb * 32);
  p.dw.resize(rm * pairs * 16);
  p.dw_tail.resize(rm);
  const __m512i low = _mm512_set1_epi8(15);
  for (int r = 0; r < rm; ++r) {
    uint8_t* nib = p.nib.data() + r * nb * 32;
    for (int64_t q = 0; q < pairs; ++q) {
      const uint8_t* blk = rows[r] + 2 * q * kBytes;
      const __m256i v = _mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2))),
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kBytes + 2)), 1);
      _mm512_storeu_si512(nib + q * 64,
                          _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1), low));
      uint16_t h0, h1;
      std::memcpy(&h0, blk, 2);
      std::memcpy(&h1, blk + kBytes, 2);
      const __m128 dw = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(h0 | uint32_t(h1) << 16)));
      _mm512_storeu_ps(p.dw.data() + (r * pairs + q) * 16, _mm512_permutexvar_ps(pair_pick(), _mm512_castps128_ps512(dw)));
    }
    if (nb % 2 != 0) {
      const uint8_t* blk = rows[r] + (nb - 1) * kBytes;
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(nib + pairs * 64),
                          _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(15)));
      p.dw_tail[r] = fp16_to_float(blk);
    }
  }
}

// RM rows x RN tokens of Q4_0, activations as pair_layout leaves them (xp, corr) and dx
template <int RM, int RN>
inline void tile_q4(const Panel& p, int64_t nb, const int8_t* xp, const int32_t* corr, const float* dx, int64_t K,
                    float* out, int64_t ld) {
  const int64_t pairs = nb / 2;
  __m512 acc[RM][RN];
  for (int r = 0; r < RM; ++r)
    for (int t = 0; t < RN; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t q = 0; q < pairs; ++q) {
    __m512 sx[RN];
    for (int t = 0; t < RN; ++t)
      sx[t] = _mm512_permutexvar_ps(pair_pick(), _mm512_castps128_ps512(_mm_castpd_ps(
                                                      _mm_load_sd(reinterpret_cast<const double*>(dx + t * nb + 2 * q)))));
    for (int r = 0; r < RM; ++r) {
      const __m512i nib = _mm512_loadu_si512(p.nib.data() + r * nb * 32 + q * 64);
      const __m512 sw = _mm512_loadu_ps(p.dw.data() + (r * pairs + q) * 16);
      for (int t = 0; t < RN; ++t) {
        const __m512i lanes = _mm512_dpbusd_epi32(_mm512_loadu_si512(corr + t * (K / 4) + q * 16), nib,
                                                  _mm512_loadu_si512(xp + t * K + q * 64));
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), _mm512_mul_ps(sw, sx[t]), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < RM; ++r)
    for (int t = 0; t < RN; ++t) {
      const float sum = _mm512_reduce_add_ps(acc[r][t]);
      if (nb % 2 == 0) {
        out[t * ld + r] = sum;
      } else {
        const int64_t b = nb - 1;
        const __m256i lanes = _mm256_dpbusd_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(corr + t * (K / 4) + b * 8)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.nib.data() + r * nb * 32 + pairs * 64)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + t * K + b * kBlock)));
        out[t * ld + r] = std::fma(p.dw_tail[r] * dx[t * nb + b], hsum(_mm256_cvtepi32_ps(lanes)), sum);
      }
    }
}

// RM rows (rows[]) against tokens [t0, t1), kTile at a time, the last few one tile of fewer
template <int RM>
inline void rows_gemm(const uint8_t* const* rows, const Panel& p, bool q4, int64_t nb, const uint8_t* xu,
                      const int8_t* xp, const int32_t* corr, const float* dx, int64_t t0, int64_t t1, int64_t K,
                      float* out, int64_t ld) {
  auto run = [&](auto rn, int64_t t) {
    constexpr int RN = decltype(rn)::value;
    if (q4)
      tile_q4<RM, RN>(p, nb, xp + t * K, corr + t * (K / 4), dx + t * nb, K, out + t * ld, ld);
    else
      tile_q8<RM, RN>(rows, p, nb, xu + t * K, dx + t * nb, K, out + t * ld, ld);
  };
  int64_t t = t0;
  for (; t + kTile <= t1; t += kTile) run(std::integral_constant<int, kTile>{}, t);
  switch (t1 - t) {
    case 3: run(std::integral_constant<int, 3>{}, t); break;
    case 2: run(std::integral_constant<int, 2>{}, t); break;
    case 1: run(std::integral_constant<int, 1>{}, t); break;
    default: break;
  }
}
#endif

#if defined(__AVX2__) && !defined(QUANT_Q4_PAIRS)
#define QUANT_AVX2_TILES 1
// The matmul without AVX-512 (AMD Zen 2 / 3, older Intel): register tiles of RM weight rows x RN
// tokens, each (row, token) output with its own 8 float lanes, through the gemv's float operations
// (rows_tile's: per block in order, acc = fma(float(lanes), dw * dx, acc), then hsum), so a GEMM
// row is the gemv's bit for bit whatever tile, token block or thread computes it. A weight block is
// decoded once per RN tokens and a token's block loaded once per RM rows; dw and dx are broadcast
// once a block and multiplied in a register (the product rounded as the scalar one is). One row x 4
// tokens at a time (row_tile, the tile before) formed ~26-30 GMAC/s a core on SmolLM2's shapes.
//
// Q4_0's nibbles go to vpmaddubsw as stored (0..15, the unsigned operand) and the -8 comes in as a
// per-token int32 offset, -8 times each 4 inputs' sum (corr, made once a call): the same exact
// int32 lanes as the sign trick's (each lane sums the same 4 products), without the unpack's
// subtraction and two vpsignb per block. Q8_0 keeps the sign trick (|w| times x carrying w's sign:
// unsigned x + 128 would overflow vpmaddubsw's int16 pairs).
constexpr int kGemvRows = 4, kGemmRows = 2, kGemmTokens = 4;
constexpr int64_t kTokenBlockAvx2 = 64;     // tokens whose activations a row tile walks (in L2)

// 8 int32 lanes, lane i the dot of bytes 4i .. 4i + 4 of w (unsigned) and x (signed)
inline __m256i udot(__m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}

// qx (T, K) -> corr (T, K / 4): -8 times each 4 inputs' sum, in block order
inline void q4_offsets(const int8_t* qx, int32_t* corr, int64_t T, int64_t K) {
  for (int64_t l = 0; l < T * K / 4; ++l)
    corr[l] = -8 * (int32_t(qx[4 * l]) + qx[4 * l + 1] + qx[4 * l + 2] + qx[4 * l + 3]);
}

// rows[0, RM) x tokens j < RN (token j's activations at qx + j K, scales dx + j nb, Q4_0 offsets
// corr + j K / 4): out[j * ld + r]
template <bool Q4, int RM, int RN>
inline void tile_avx2(const uint8_t* const* rows, int64_t nb, const int8_t* qx, const float* dx, const int32_t* corr,
                      int64_t K, float* out, int64_t ld) {
  constexpr int64_t kBytes = Q4 ? 2 + kBlock / 2 : 2 + kBlock;
  const float* f16 = fp16_table();
  __m256 acc[RM][RN];
  for (int r = 0; r < RM; ++r)
    for (int j = 0; j < RN; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (RN == 1) prefetch_span(rows[0] + b * RM * kBytes, RM * kBytes);    // the gemv (rows_tile's)
    __m256i w[RM], w_abs[RM];
    __m256 dw[RM];
    for (int r = 0; r < RM; ++r) {
      const uint8_t* blk = rows[r] + b * kBytes;
      if constexpr (Q4) {
        w[r] = nibbles32(blk + 2);
      } else {
        w[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
        w_abs[r] = _mm256_sign_epi8(w[r], w[r]);
      }
      dw[r] = _mm256_broadcast_ss(fp16_at(f16, blk));
    }
    for (int j = 0; j < RN; ++j) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + j * K + b * kBlock));
      const __m256 dxb = _mm256_broadcast_ss(dx + j * nb + b);
      __m256i c = _mm256_setzero_si256();
      if constexpr (Q4) c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(corr + j * (K / 4) + b * 8));
      for (int r = 0; r < RM; ++r) {
        const __m256i lanes = Q4 ? _mm256_add_epi32(udot(w[r], x), c) : udot(w_abs[r], _mm256_sign_epi8(x, w[r]));
        acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_mul_ps(dw[r], dxb), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < RM; ++r)
    for (int j = 0; j < RN; ++j) out[j * ld + r] = hsum(acc[r][j]);
}
#endif

// A chunk of rows of one call, as work::Pool runs it: in place on the caller, or into a worker's
// scratch (T, rows) and then copied out.
struct MatmulJob {
  const uint8_t* w;
  const int8_t* qx;
  const uint8_t* xu;     // qx + 128 (Q8_0, T >= 2: the GEMM's unsigned operand)
  const int8_t* xp;
  const int32_t* corr;
  const float* dx;
  float* out;
  int64_t T, K, N, nb, block_bytes, per_chunk;
  bool q4;

  bool compute(int64_t c, std::vector<float>* scratch, work::Live live) const {
    const int64_t begin = c * per_chunk, end = std::min(N, begin + per_chunk);
    const auto [o, ld] = work::destination(out, N, T, begin, end - begin, scratch);
#if defined(QUANT_AVX2_TILES)
    return q4 ? tiles<true>(begin, end, o, ld, live) : tiles<false>(begin, end, o, ld, live);
#endif
#if defined(QUANT_Q4_PAIRS)
    if (T >= 2) return gemm(begin, end, o, ld, live);
    const bool pairs = q4;            // Q4_0's gemv is row_tile_q4
#else
    const bool pairs = false;
#endif
#if defined(__AVX2__)
    if (T < kTile && !pairs) {        // row_tile<1>'s tokens (one_row's tail), kGemvTileRows rows at a time
      for (int64_t n = begin; n < end; n += kGemvTileRows) {
        if (!live()) return false;
        const int64_t rm = std::min<int64_t>(kGemvTileRows, end - n);
        const uint8_t* rows[kGemvTileRows];
        for (int64_t r = 0; r < rm; ++r) rows[r] = w + (n + r) * nb * block_bytes;
        for (int64_t t = 0; t < T; ++t) {
          float tile[kGemvTileRows];
          switch (rm) {
            case 4: rows_tile<4>(rows, nb, block_bytes, q4, qx + t * K, dx + t * nb, tile); break;
            case 3: rows_tile<3>(rows, nb, block_bytes, q4, qx + t * K, dx + t * nb, tile); break;
            case 2: rows_tile<2>(rows, nb, block_bytes, q4, qx + t * K, dx + t * nb, tile); break;
            default: rows_tile<1>(rows, nb, block_bytes, q4, qx + t * K, dx + t * nb, tile); break;
          }
          for (int64_t r = 0; r < rm; ++r) o[t * ld + (n - begin) + r] = tile[r];
        }
      }
      return true;
    }
#endif
    (void)pairs;
    for (int64_t n = begin; n < end; ++n) {
      if (!live()) return false;
      one_row(w + n * nb * block_bytes, nb, block_bytes, q4, qx, xp, corr, dx, T, K, o + (n - begin), ld);
    }
    return true;
  }

#if defined(QUANT_AVX2_TILES)
  // rows [begin, end) by tile_avx2: a lone token kGemvRows rows at a time; more tokens, per block
  // of kTokenBlockAvx2, kGemmRows rows x kGemmTokens tokens (the last few tokens one tile of fewer)
  template <bool Q4>
  bool tiles(int64_t begin, int64_t end, float* o, int64_t ld, work::Live live) const {
    const int64_t step = T == 1 ? kGemvRows : kGemmRows;
    for (int64_t t0 = 0; t0 < T; t0 += kTokenBlockAvx2) {
      const int64_t t1 = std::min(T, t0 + kTokenBlockAvx2);
      for (int64_t n = begin; n < end; n += step) {
        if (!live()) return false;
        const int rm = static_cast<int>(std::min(step, end - n));
        const uint8_t* rows[kGemvRows];
        for (int r = 0; r < rm; ++r) rows[r] = w + (n + r) * nb * block_bytes;
        float* on = o + (n - begin);
        if (T == 1) {
          by_count<kGemvRows>(rm, [&](auto RM) { tile_avx2<Q4, RM.value, 1>(rows, nb, qx, dx, corr, K, on, ld); });
          continue;
        }
        by_count<kGemmRows>(rm, [&](auto RM) {
          auto run = [&](auto RN, int64_t t) {
            tile_avx2<Q4, RM.value, RN.value>(rows, nb, qx + t * K, dx + t * nb, Q4 ? corr + t * (K / 4) : nullptr, K,
                                              on + t * ld, ld);
          };
          int64_t t = t0;
          for (; t + kGemmTokens <= t1; t += kGemmTokens) run(std::integral_constant<int, kGemmTokens>{}, t);
          if (t < t1) by_count<kGemmTokens - 1>(static_cast<int>(t1 - t), [&](auto RN) { run(RN, t); });
        });
      }
    }
    return true;
  }
#endif

#if defined(QUANT_Q4_PAIRS)
  // rows [begin, end) against every token: per block of kTokenBlock tokens, each tile of rows
  // decoded once, then its tokens kTile at a time
  bool gemm(int64_t begin, int64_t end, float* o, int64_t ld, work::Live live) const {
    thread_local Panel panel;
    for (int64_t t0 = 0; t0 < T; t0 += kTokenBlock) {
      const int64_t t1 = std::min(T, t0 + kTokenBlock);
      for (int64_t n = begin; n < end; n += kTileRows) {
        if (!live()) return false;
        const int rm = static_cast<int>(std::min<int64_t>(kTileRows, end - n));
        const uint8_t* rows[kTileRows];
        for (int r = 0; r < rm; ++r) rows[r] = w + (n + r) * nb * block_bytes;
        if (q4)
          decode_q4(rows, rm, nb, panel);
        else
          decode_q8(rows, rm, nb, panel);
        float* on = o + (n - begin);
        switch (rm) {
          case 4: rows_gemm<4>(rows, panel, q4, nb, xu, xp, corr, dx, t0, t1, K, on, ld); break;
          case 3: rows_gemm<3>(rows, panel, q4, nb, xu, xp, corr, dx, t0, t1, K, on, ld); break;
          case 2: rows_gemm<2>(rows, panel, q4, nb, xu, xp, corr, dx, t0, t1, K, on, ld); break;
          default: rows_gemm<1>(rows, panel, q4, nb, xu, xp, corr, dx, t0, t1, K, on, ld); break;
        }
      }
    }
    return true;
  }
#endif

  void commit(int64_t c, std::vector<float>* scratch) const {
    const int64_t begin = c * per_chunk;
    work::publish(out, N, T, begin, std::min(N, begin + per_chunk) - begin, *scratch);
  }
};

// out (T, N) float = x (T, K) @ W^T, W (N, K) in blocks of `block_bytes` (34: Q8_0, 18: Q4_0).
// Rows go out in chunks through work::run (work_pool.h: the Pool, or OpenMP from 8 rows): several per thread, so that a thread
// the OS has descheduled costs the call nothing; a call of under kInlineBytes of weight reads runs
// on the caller alone. keep: W's tensor (work_pool.h: held until no worker reads it).
constexpr int64_t kInlineBytes = 32 << 10;
constexpr int64_t kChunksPerThread = 8;

inline void matmul(const float* x, const uint8_t* w, float* out, int64_t T, int64_t K, int64_t N,
                   int64_t block_bytes, work::Keep keep) {
  const int64_t nb = K / kBlock;
  const bool q4 = block_bytes == 2 + kBlock / 2;
  work::Pool& pool = work::Pool::get();
  // the activations as the workers read them, in memory this call owns (a late worker may still
  // read them after the caller returns): qx, dx, then xu (Q8_0, 2+ rows) or xp and corr (Q4_0)
  const bool pairs_q8 = !q4 && T >= 2;
  const int64_t o_dx = work::lines(T * K), o_xu = o_dx + work::lines(T * nb * 4);
  const int64_t o_corr = o_xu + work::lines(T * K);
  unsigned char* mem = work::owned(keep, o_corr + (q4 ? T * K : 0));
  int8_t* qx = reinterpret_cast<int8_t*>(mem);
  float* dx = reinterpret_cast<float*>(mem + o_dx);
  quantize_rows(x, qx, dx, T, K);
  MatmulJob job{w, qx, nullptr, nullptr, nullptr, dx, out, T, K, N, nb, block_bytes, N, q4};
#if defined(QUANT_Q4_PAIRS)
  if (pairs_q8) {
    uint8_t* xu = mem + o_xu;
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    int64_t i = 0;
    for (; i + 64 <= T * K; i += 64)
      _mm512_storeu_si512(xu + i, _mm512_xor_si512(_mm512_loadu_si512(qx + i), bias));
    for (; i < T * K; ++i) xu[i] = static_cast<uint8_t>(qx[i]) ^ 0x80;
    job.xu = xu;
  }
  if (q4) {
    int8_t* xp = reinterpret_cast<int8_t*>(mem + o_xu);
    int32_t* corr = reinterpret_cast<int32_t*>(mem + o_corr);
    pair_layout(qx, xp, corr, T, K);
    job.xp = xp;
    job.corr = corr;
  }
#else
  (void)pairs_q8;
#endif
#if defined(QUANT_AVX2_TILES)
  if (q4) {
    int32_t* corr = reinterpret_cast<int32_t*>(mem + o_corr);
    q4_offsets(qx, corr, T, K);
    job.corr = corr;
  }
#endif
  const int64_t reads = nb * block_bytes * N * ((T + kTile - 1) / kTile);
  const int64_t chunks = std::max<int64_t>(
      1, std::min({reads / kInlineBytes, pool.threads() * kChunksPerThread, N, work::Pool::kMaxChunks}));
  job.per_chunk = (N + chunks - 1) / chunks;
  work::run((N + job.per_chunk - 1) / job.per_chunk, job, T, std::move(keep));
}

}  // namespace quant
