// y = x W^T over weights in GGUF's other block types, kept as the file stores them
// (pagedecode/kernels/quant_types.py draws every layout): Q4_1, Q5_0, Q5_1 (blocks of 32) and
// the K-quants Q4_K, Q5_K, Q6_K (super-blocks of 256). quant_matmul.h / quant_lanes.h hold Q8_0
// and Q4_0.
//
// A weight arrives as (N, blocks per row, type size) uint8: the pair (K / blocks, type size) names
// the type (Q4_K's 144 bytes per 256 inputs are Q4_0's 18 per 32, so the row size alone cannot).
//
// Activations are quantized as llama.cpp quantizes them for each type's dot product:
//   Q5_0                  Q8_0: per 32, d = max |x| / 127, q = round(x / d)
//   Q4_1, Q5_1            Q8_1: Q8_0's q and d, and the block's sum of q (for the weights' min m)
//   Q4_K, Q5_K, Q6_K      Q8_K: per 256, d = -max / 127 for the x of largest |x|, q = round(x / d)
//                         capped at 127, and the sum of q of each 32 (for the mins)
// (llama.cpp rounds Q8_0 / Q8_1's d and d * sum to float16; here they stay float32.) Each block's
// weights times the activations' q is then an exact integer dot product:
//
//   Q4_1 / Q5_1  y += dw * dx * sum_j q_j qx_j  +  m * (dx * sum_j qx_j)
//   Q5_0         y += dw * dx * sum_j (q_j - 16) qx_j
//   Q4_K / Q5_K  y += d * dx * sum_s sc_s sum_j q_sj qx_sj  -  dmin * dx * sum_s m_s sum_j qx_sj
//   Q6_K         y += d * dx * sum_s sc_s sum_j (q_sj - 32) qx_sj       (16 sub-blocks of 16)
//
// so the only error against the dequantized weights times the float activations is the
// activations' rounding: at most half a step (the block's max |x| / 127 / 2) per input, times the
// weight's |w| (tests/model/test_quant_types.py holds each type to that bound).
//
// The integer dots are AVX2 (vpmaddubsw: unsigned weights times signed activations; Q5_0's
// offset, -16, comes in as int32 terms made from the activations' sums, which leaves the same exact
// integer totals; Q6_K's q - 32 as q times x less 32 times x's int16 pair sums), with AVX-512 VNNI's vpdpbusd for a block's plain sum
// where the build has it, else a scalar loop. Every output (row n, token t) accumulates its
// blocks in order into its own float registers, whatever the number of tokens, the token block or
// the thread that computes its row: the GEMM's rows are the GEMV's bit for bit, at any thread count.
#pragma once

#include "quant_matmul.h"

namespace quant::types {

enum class Kind { Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K };

struct Type {
  Kind kind;
  int64_t block, bytes;
  const char* name;
};

inline constexpr Type kTypes[] = {{Kind::Q4_1, 32, 20, "q4_1"},   {Kind::Q5_0, 32, 22, "q5_0"},
                                  {Kind::Q5_1, 32, 24, "q5_1"},   {Kind::Q4_K, 256, 144, "q4_k"},
                                  {Kind::Q5_K, 256, 176, "q5_k"}, {Kind::Q6_K, 256, 210, "q6_k"}};
constexpr int64_t kSuper = 256;

inline bool is_k(Kind k) { return k == Kind::Q4_K || k == Kind::Q5_K || k == Kind::Q6_K; }
inline bool has_min(Kind k) { return k == Kind::Q4_1 || k == Kind::Q5_1; }

// blocks (N, blocks per row, type size) for rows of K inputs -> the type, or nullptr
inline const Type* find_type(int64_t K, int64_t blocks_per_row, int64_t type_size) {
  for (const Type& t : kTypes)
    if (t.bytes == type_size && blocks_per_row > 0 && K == blocks_per_row * t.block) return &t;
  return nullptr;
}

// a product rounded to float before it is added (GCC would otherwise fuse a * b + c as it likes):
// the dequantization must be gguf's two roundings
inline float rounded(float p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("" : "+x"(p));
#else
  volatile float v = p;
  p = v;
#endif
  return p;
}

// -- the weights, block by block ----------------------------------------------------------------

// Q4_K / Q5_K's 12 scale bytes -> 8 six-bit scales and mins
inline void k_scales(const uint8_t* s, int32_t* sc, int32_t* m) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    m[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 6) << 4);
    m[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

// One block (32 or 256 inputs) as integers: q[j] (Q4_1 / Q5_1 / Q4_K / Q5_K unsigned, Q5_0 / Q6_K
// minus their offset), the scale of each sub-block of `sub` inputs as sc (blocks of 32: one, 1),
// and the float factors: value j = d * sc[j / sub] * q[j] - dmin * m[j / sub] (blocks of 32: + m)
struct Block {
  int8_t q[kSuper];
  int32_t sc[16], m[8];
  float d, dmin;   // blocks of 32 with a min: dmin is m (added, not subtracted)
  int sub;
};

inline void decode(Kind kind, const uint8_t* b, Block& out) {
  out.d = out.dmin = 0.f;
  switch (kind) {
    case Kind::Q4_1:
    case Kind::Q5_0:
    case Kind::Q5_1: {
      const bool min = kind != Kind::Q5_0;
      const uint8_t* qs = b + (kind == Kind::Q4_1 ? 4 : kind == Kind::Q5_0 ? 6 : 8);
      uint32_t qh = 0;
      if (kind != Kind::Q4_1) std::memcpy(&qh, b + (min ? 4 : 2), 4);
      for (int j = 0; j < 16; ++j) {
        int lo = qs[j] & 15, hi = qs[j] >> 4;
        if (kind != Kind::Q4_1) {
          lo |= ((qh >> j) & 1) << 4;
          hi |= ((qh >> (j + 16)) & 1) << 4;
        }
        out.q[j] = static_cast<int8_t>(kind == Kind::Q5_0 ? lo - 16 : lo);
        out.q[j + 16] = static_cast<int8_t>(kind == Kind::Q5_0 ? hi - 16 : hi);
      }
      out.d = fp16_to_float(b);
      out.dmin = min ? fp16_to_float(b + 2) : 0.f;
      out.sc[0] = 1;
      out.m[0] = 1;
      out.sub = 32;
      return;
    }
    case Kind::Q4_K:
    case Kind::Q5_K: {
      const bool five = kind == Kind::Q5_K;
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (five ? 48 : 16);
      for (int s = 0; s < 8; ++s)
        for (int l = 0; l < 32; ++l) {
          int v = (s % 2 == 0) ? (qs[32 * (s / 2) + l] & 15) : (qs[32 * (s / 2) + l] >> 4);
          if (five) v |= ((qh[l] >> s) & 1) << 4;
          out.q[32 * s + l] = static_cast<int8_t>(v);
        }
      k_scales(b + 4, out.sc, out.m);
      out.d = fp16_to_float(b);
      out.dmin = fp16_to_float(b + 2);
      out.sub = 32;
      return;
    }
    case Kind::Q6_K: {
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 4; ++i)
          for (int l = 0; l < 32; ++l) {
            const uint8_t low = b[64 * h + 32 * (i & 1) + l];
            const int v = ((i >> 1) ? low >> 4 : low & 15) | (((b[128 + 32 * h + l] >> (2 * i)) & 3) << 4);
            out.q[128 * h + 32 * i + l] = static_cast<int8_t>(v - 32);
          }
      for (int s = 0; s < 16; ++s) out.sc[s] = static_cast<int8_t>(b[192 + s]);
      out.d = fp16_to_float(b + 208);
      out.dmin = 0.f;
      out.sub = 16;
      return;
    }
  }
}

// a block's values as gguf.quants.dequantize computes them (float32, each product rounded)
inline void dequantize_block(Kind kind, const uint8_t* b, float* out) {
  Block blk;
  decode(kind, b, blk);
  if (!is_k(kind)) {
    for (int j = 0; j < 32; ++j) {
      if (kind == Kind::Q5_0)
        out[j] = blk.d * static_cast<float>(blk.q[j]);
      else
        out[j] = rounded(blk.d * static_cast<float>(blk.q[j])) + blk.dmin;
    }
    return;
  }
  for (int s = 0; s < kSuper / blk.sub; ++s) {
    const float ds = blk.d * static_cast<float>(blk.sc[s]);
    const float ms = kind == Kind::Q6_K ? 0.f : blk.dmin * static_cast<float>(blk.m[s]);
    for (int j = 0; j < blk.sub; ++j) {
      const float v = rounded(ds * static_cast<float>(blk.q[blk.sub * s + j]));
      out[blk.sub * s + j] = kind == Kind::Q6_K ? v : v - ms;
    }
  }
}

// -- the activations --------------------------------------------------------------------------------

// x (T, K) -> q (T, K) int8, d one float per activation block (32 or, for the K-quants, 256) and
// the sum of q of every 32 inputs (T, K / 32)
// The activations as the workers read them, in memory the call owns (work::owned: a late worker
// may still read them after the caller returns): int8 values, scales (per block of 32, or per
// super-block of 256 for Q8_K) and each block of 32's sum
struct Acts {
  int8_t* q;
  float* d;
  int32_t* sum;
  float* sx;       // blocks of 32 with a min (Q8_1's s): d * sum per block (T, K / 32), and the same
  float* sx_t;     // transposed (K / 32, T) for the GEMM's mins, 8 tokens to a register (T >= 2)
  int32_t* corr;   // Q5_0: -16 times each 4 inputs' sum of q (T, K / 32, 8): tile32's offset, in int32 lanes
};

// llama.cpp's quantize_row_q8_K: the scale from the signed input of largest magnitude
inline void quantize_q8k(const float* x, int8_t* q, float* d, int64_t n_super) {
  for (int64_t i = 0; i < n_super; ++i) {
    const float* v = x + i * kSuper;
    float amax = 0.f, max = 0.f;
    for (int j = 0; j < kSuper; ++j)
      if (std::fabs(v[j]) > amax) {
        amax = std::fabs(v[j]);
        max = v[j];
      }
    if (amax == 0.f) {
      d[i] = 0.f;
      std::memset(q + i * kSuper, 0, kSuper);
      continue;
    }
    const float iscale = -127.f / max;
    for (int j = 0; j < kSuper; ++j)
      q[i * kSuper + j] = static_cast<int8_t>(std::min(127, static_cast<int>(std::nearbyint(iscale * v[j]))));
    d[i] = 1.f / iscale;
  }
}

inline void quantize_acts(Kind kind, const float* x, int64_t T, int64_t K, const Acts& a) {
  if (is_k(kind))
    quantize_q8k(x, a.q, a.d, T * K / kSuper);
  else
    quantize_rows(x, a.q, a.d, T, K);     // Q8_0's rounding (quant_matmul.h)
  for (int64_t i = 0; i < T * K / kBlock; ++i) {
    int32_t s = 0;
    for (int j = 0; j < kBlock; ++j) s += a.q[i * kBlock + j];
    a.sum[i] = s;
  }
  if (kind == Kind::Q5_0)
    for (int64_t l = 0; l < T * K / 4; ++l)
      a.corr[l] = -16 * (int32_t(a.q[4 * l]) + a.q[4 * l + 1] + a.q[4 * l + 2] + a.q[4 * l + 3]);
  if (!has_min(kind)) return;
  const int64_t per32 = K / kBlock;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < per32; ++b) {
      const int64_t i = t * per32 + b;
      a.sx[i] = a.d[i] * static_cast<float>(a.sum[i]);       // rounded once, as the fma's operand was
      if (T >= 2) a.sx_t[b * T + t] = a.sx[i];
    }
}

// -- the dot products -------------------------------------------------------------------------------

#if defined(__AVX2__)
// 32 signed / unsigned weights of one block (or sub-block), in registers
inline __m256i nibbles_avx2(const uint8_t* qs16) {      // 16 bytes -> low nibbles, then high
  return nibbles32(qs16);                                // quant_matmul.h
}

// bit j of qh (a little-endian u32) -> byte j: 16 if set, else 0
inline __m256i high_bits_avx2(const uint8_t* qh4) {
  // broadcast from memory (a load, no shuffle: the set1 of a loaded int went through a register)
  const __m256i qh = _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(qh4)));
  const __m256i spread = _mm256_shuffle_epi8(
      qh,
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

// the 32 weights of a 32-block as unsigned bytes (Q5_0's q, not q - 16: tile32 adds the -16)
inline __m256i block32_avx2(Kind kind, const uint8_t* b) {
  switch (kind) {
    case Kind::Q4_1: return nibbles_avx2(b + 4);
    case Kind::Q5_0: return _mm256_or_si256(nibbles_avx2(b + 6), high_bits_avx2(b + 2));
    default: return _mm256_or_si256(nibbles_avx2(b + 8), high_bits_avx2(b + 4));
  }
}

// sub-block s (32 inputs) of a K-quant super-block, unsigned: Q4_K / Q5_K's q, Q6_K's q (0..63,
// not q - 32: tile_k takes the offset off the activations' pair sums)
inline __m256i sub32_avx2(Kind kind, const uint8_t* b, int s) {
  const __m256i low = _mm256_set1_epi8(15);
  if (kind == Kind::Q6_K) {
    const int h = s / 4, i = s % 4;
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * (i & 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const __m256i lo = (i >> 1) ? _mm256_and_si256(_mm256_srli_epi16(ql, 4), low) : _mm256_and_si256(ql, low);
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * i)), _mm256_set1_epi8(3));
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
  }
  const uint8_t* qs = b + (kind == Kind::Q5_K ? 48 : 16) + 32 * (s / 2);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
  __m256i q = (s % 2 == 0) ? _mm256_and_si256(v, low) : _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
  if (kind == Kind::Q5_K) {
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    q = _mm256_or_si256(q, _mm256_slli_epi16(
        _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(s)), _mm256_set1_epi8(1)), 4));
  }
  return q;
}

// 16 int16: the products of 32 weights (unsigned, or signed when `sign`) and activations, in pairs
inline __m256i pair_products(__m256i w, __m256i x, bool sign) {
  if (!sign) return _mm256_maddubs_epi16(w, x);
  return _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

// 8 int32 summing to the plain dot of 32 weights and activations
inline __m256i dot32(__m256i w, __m256i x, bool sign) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  if (!sign) return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
#else
  return _mm256_madd_epi16(pair_products(w, x, sign), _mm256_set1_epi16(1));
#endif
}
#endif

// Per token accumulators of a tile of tokens for the scalar row_dot (a scalar, and the mins)
struct Accs {
  std::vector<float> scalar, mins;
  void reset(int64_t n) {
    scalar.assign(n, 0.f);
    mins.assign(n, 0.f);
  }
};

constexpr int64_t kTokenTile = 64;     // tokens whose accumulators live at once (the block decoded once for them)

#if defined(__AVX2__)
// The blocks of 32 (Q4_1, Q5_0, Q5_1) in register tiles: RM weight rows x RN tokens, each (row,
// token) with its own float lanes and min in registers, through the float operations row_dot's
// scalar form names (per block in order: the 8 int32 lanes of the exact dot converted and fma'd
// with dw * dx; the min's fma of m and the activations' d * sum; then hsum(lanes) + min). Tiled
// because one row at a time kept a single fma chain in flight, its accumulators in memory: a
// decode step's gemv waited on their latency (~18 cycles a block) and a prefill's GEMM re-read each
// token's block per row. The gemv takes RM rows at once (RM independent chains); the GEMM decodes
// each weight block once per RN tokens and loads each token's block once per RM rows, its mins
// first into `out` by mins32 (MINS_HERE false).
constexpr int kRowsGemv = 4, kRowsGemm = 2, kTokensGemm = 4;

template <Kind KIND>
constexpr int64_t kBytes32 = KIND == Kind::Q4_1 ? 20 : KIND == Kind::Q5_0 ? 22 : 24;

// rows[0, RM) x tokens [t, t + RN) (t: the first token's index): out[j * ld + r] for token t + j.
// Q5_0's lanes are its signed dot's exactly (each lane sums the same 4 products), formed as the
// unsigned q times x plus -16 times those 4 inputs' sum (corr, once per token): an add per (row,
// token) block instead of the sign trick's two vpsignb.
template <Kind KIND, int RM, int RN, bool MINS_HERE>
inline void tile32(const uint8_t* const* rows, const Acts& a, int64_t nb, int64_t t, float* out, int64_t ld) {
  constexpr bool sign = KIND == Kind::Q5_0;
  const int64_t K = nb * kBlock;
  [[maybe_unused]] const float* f16 = fp16_table();
  __m256 acc[RM][RN];
  float mins[RM];
  for (int r = 0; r < RM; ++r) {
    mins[r] = 0.f;
    for (int j = 0; j < RN; ++j) acc[r][j] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    __m256i w[RM];
    __m256 dw[RM];
    if constexpr (RN == 1) prefetch_span(rows[0] + b * RM * kBytes32<KIND>, RM * kBytes32<KIND>);   // the gemv
    for (int r = 0; r < RM; ++r) {
      const uint8_t* blk = rows[r] + b * kBytes32<KIND>;
      w[r] = block32_avx2(KIND, blk);
      if constexpr (KIND == Kind::Q5_0) {
        dw[r] = _mm256_broadcast_ss(fp16_at(f16, blk));      // (quant_matmul.h's table)
      } else {                 // d and m side by side: one conversion for both
        const __m128 dm = fp16_pair(blk);
        dw[r] = _mm256_broadcastss_ps(dm);
        if constexpr (MINS_HERE) mins[r] = std::fma(_mm_cvtss_f32(_mm_movehdup_ps(dm)), a.sx[t * nb + b], mins[r]);
      }
    }
    for (int j = 0; j < RN; ++j) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + (t + j) * K + b * kBlock));
      const __m256 dx = _mm256_broadcast_ss(a.d + (t + j) * nb + b);     // dw * dx below: the scalar product's bits
      __m256i c = _mm256_setzero_si256();
      if constexpr (sign) c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.corr + ((t + j) * nb + b) * 8));
      for (int r = 0; r < RM; ++r) {
        const __m256i lanes = sign ? _mm256_add_epi32(dot32(w[r], x, false), c) : dot32(w[r], x, false);
        acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_mul_ps(dw[r], dx), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < RM; ++r)
    for (int j = 0; j < RN; ++j) {
      const float m = KIND == Kind::Q5_0 ? 0.f : MINS_HERE ? mins[r] : out[j * ld + r];
      out[j * ld + r] = hsum(acc[r][j]) + m;
    }
}

// The mins of one Q4_1 / Q5_1 row for tokens [t0, t1) into out[(t - t0) * ld]: each token's fma
// chain over the blocks in order (tile32's), 8 tokens to a register (the activations' sx_t) and up
// to kTokenTile / 8 registers' chains in flight at once (one at a time waited on the fma's latency)
template <Kind KIND>
inline void mins32(const uint8_t* row, const Acts& a, int64_t nb, int64_t T, int64_t t0, int64_t t1, float* out,
                   int64_t ld) {
  constexpr int kRegs = kTokenTile / 8;
  const int regs = static_cast<int>((t1 - t0) / 8);
  __m256 m[kRegs];
  for (int g = 0; g < kRegs; ++g) m[g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256 mw = _mm256_set1_ps(fp16_to_float(row + b * kBytes32<KIND> + 2));
    const float* sx = a.sx_t + b * T + t0;
    for (int g = 0; g < regs; ++g) m[g] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(sx + 8 * g), m[g]);
  }
  for (int g = 0; g < regs; ++g) {
    alignas(32) float v[8];
    _mm256_store_ps(v, m[g]);
    for (int j = 0; j < 8; ++j) out[(8 * g + j) * ld] = v[j];
  }
  for (int64_t t = t0 + 8 * regs; t < t1; ++t) {
    float s = 0.f;
    for (int64_t b = 0; b < nb; ++b) s = std::fma(fp16_to_float(row + b * kBytes32<KIND> + 2), a.sx_t[b * T + t], s);
    out[(t - t0) * ld] = s;
  }
}

// The K-quants (Q4_K, Q5_K, Q6_K) in register tiles, as tile32 the blocks of 32: RM weight rows x
// RN tokens, each (row, token) with its own integer lanes for a super-block's 8 sub-blocks and its
// own float lanes and min across super-blocks. Each output's float operations are the scalar
// row_dot's, in its order (per super-block: the exact integer dot fma'd with d * dx; the mins' fma
// of dmin * dx and the exact sum_s m_s sum(qx_s); then hsum(lanes) - mins), so the gemv's rows are
// the GEMM's bit for bit. Tiled for tile32's reasons: one row at a time kept one fma chain in
// flight with its accumulators in memory, and the gemv's rows waited on memory (4 rows, their
// lines prefetched 4 KB ahead: 576x1536, one thread, from L2 100 -> 62 us for Q4_K); the GEMM
// decodes each sub-block once per RN tokens and loads each token's once per RM rows.
template <Kind KIND>
constexpr int64_t kBytesK = KIND == Kind::Q4_K ? 144 : KIND == Kind::Q5_K ? 176 : 210;
// the GEMM's tile: Q6_K one row x 8 tokens, else 2 rows x 4 tokens (kRowsGemm x kTokensGemm)
// (576x1536 x 64 tokens, one thread: Q6_K 2 x 4 0.8x the 1 x 8 tile, with the sign trick and with
// tile_k's pair sums alike)
template <Kind KIND>
constexpr int kRowsGemmK = KIND == Kind::Q6_K ? 1 : kRowsGemm;
template <Kind KIND>
constexpr int kTokensGemmK = KIND == Kind::Q6_K ? 8 : kTokensGemm;

// the sum of 8 int32 lanes
inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// A Q6_K row's sub-blocks for its GEMM (tile_k's PRE): per 32 inputs the sign trick's q - 32 and
// its magnitude, decoded once per row and token tile instead of once per kTokensGemmK tokens (4
// integer operations per sub-block and token where decoding for each 8 tokens cost ~6, counted)
inline void decode_q6k_row(const uint8_t* row, int64_t nsb, __m256i* out) {
  for (int64_t b = 0; b < nsb; ++b)
    for (int s = 0; s < 8; ++s) {
      const __m256i w = _mm256_sub_epi8(sub32_avx2(Kind::Q6_K, row + b * kBytesK<Kind::Q6_K>, s), _mm256_set1_epi8(32));
      out[2 * (b * 8 + s)] = w;
      out[2 * (b * 8 + s) + 1] = _mm256_sign_epi8(w, w);
    }
}

// rows[0, RM) x tokens [t, t + RN) over nsb super-blocks: out[j * ld + r] for token t + j.
// pre (Q6_K's GEMM, RM = 1): the row's sub-blocks as decode_q6k_row left them, read in place of
// decoding them again for every RN tokens
template <Kind KIND, int RM, int RN, bool PRE = false>
inline void tile_k(const uint8_t* const* rows, const Acts& a, int64_t nsb, int64_t t, float* out, int64_t ld,
                   const __m256i* pre = nullptr) {
  constexpr bool six = KIND == Kind::Q6_K;
  static_assert(!PRE || (six && RM == 1 && RN > 1));
  const int64_t K = nsb * kSuper, per32 = nsb * 8;
  __m256 acc[RM][RN];
  float mins[RM][RN];
  for (int r = 0; r < RM; ++r)
    for (int j = 0; j < RN; ++j) {
      acc[r][j] = _mm256_setzero_ps();
      mins[r][j] = 0.f;
    }
  for (int64_t b = 0; b < nsb; ++b) {
    if constexpr (RN == 1) prefetch_span(rows[0] + b * RM * kBytesK<KIND>, RM * kBytesK<KIND>);  // rows end to end
    const uint8_t* blk[RM];
    int32_t sc[RM][8], m[RM][8];
    __m256i lanes[RM][RN];
    for (int r = 0; r < RM; ++r) {
      blk[r] = rows[r] + b * kBytesK<KIND>;
      if constexpr (!six) k_scales(blk[r] + 4, sc[r], m[r]);
      for (int j = 0; j < RN; ++j) lanes[r][j] = _mm256_setzero_si256();
    }
    for (int s = 0; s < 8; ++s) {
      __m256i w[RM], scale[RM], abs_w[RM];
      for (int r = 0; r < RM; ++r) {
        if constexpr (PRE) {
          w[r] = pre[2 * (b * 8 + s)];
          abs_w[r] = pre[2 * (b * 8 + s) + 1];
        } else {
          w[r] = sub32_avx2(KIND, blk[r], s);
        }
        if constexpr (six && RN > 1 && !PRE) w[r] = _mm256_sub_epi8(w[r], _mm256_set1_epi8(32));    // the sign trick's q - 32
        scale[r] = six ? _mm256_set_m128i(_mm_set1_epi16(static_cast<int8_t>(blk[r][192 + 2 * s + 1])),
                                          _mm_set1_epi16(static_cast<int8_t>(blk[r][192 + 2 * s])))
                       : _mm256_set1_epi16(static_cast<int16_t>(sc[r][s]));
      }
      for (int j = 0; j < RN; ++j) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + (t + j) * K + b * kSuper + 32 * s));
        // Q6_K's gemv: the pair sums of (q - 32) x as those of q x less 32 times x's pair sums, an
        // operation per token for all RM rows against the sign trick's |w| and x signed by w per
        // row (and the decode's - 32). Each is exact in int16 (|q x pair| <= 63 * 128 * 2, |32 x
        // pair| <= 8192) and so is the difference (|(q - 32) x pair| <= 8192, the wrapping
        // subtraction lands on it): the int16 pairs, and so the int32 lanes and every float after
        // them, are the sign trick's (exact too: Q8_K's q is never -128, which vpsignb cannot
        // negate; quantize_q8k rounds into -127 .. 127). The GEMM's tile (one row, 8 tokens) keeps the sign trick,
        // whose |w| serves its 8 tokens (there x32 per token cost more: 576x1536 x 64, 0.9x): with
        // the row decoded once (PRE, tiles of 16 tokens and more) or decoded here (fewer).
        if constexpr (six && RN == 1) {
          const __m256i x32 = _mm256_maddubs_epi16(_mm256_set1_epi8(32), x);
          for (int r = 0; r < RM; ++r)
            lanes[r][j] = _mm256_add_epi32(
                lanes[r][j], _mm256_madd_epi16(_mm256_sub_epi16(_mm256_maddubs_epi16(w[r], x), x32), scale[r]));
        } else if constexpr (PRE) {          // pair_products' sign trick with |w| decoded once
          lanes[0][j] = _mm256_add_epi32(
              lanes[0][j], _mm256_madd_epi16(_mm256_maddubs_epi16(abs_w[0], _mm256_sign_epi8(x, w[0])), scale[0]));
        } else {
          for (int r = 0; r < RM; ++r)
            lanes[r][j] = _mm256_add_epi32(lanes[r][j], _mm256_madd_epi16(pair_products(w[r], x, six), scale[r]));
        }
      }
    }
    for (int r = 0; r < RM; ++r) {
      const float d = fp16_to_float(blk[r] + (six ? 208 : 0));
      for (int j = 0; j < RN; ++j) {
        const float dx = a.d[(t + j) * nsb + b];
        acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes[r][j]), _mm256_set1_ps(d * dx), acc[r][j]);
        if constexpr (!six) {
          const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.sum + (t + j) * per32 + b * 8));
          const int32_t summ = hsum_epi32(_mm256_mullo_epi32(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m[r])), sums));
          mins[r][j] = std::fma(fp16_to_float(blk[r] + 2) * dx, static_cast<float>(summ), mins[r][j]);
        }
      }
    }
  }
  for (int r = 0; r < RM; ++r)
    for (int j = 0; j < RN; ++j) out[j * ld + r] = hsum(acc[r][j]) - mins[r][j];
}

// f(std::integral_constant<int, n>) for a runtime n in [1, N]
template <int N, typename F>
inline void by_count(int n, F&& f) {
  if constexpr (N >= 1) {
    if (n == N) return f(std::integral_constant<int, N>{});
    by_count<N - 1>(n, f);
  }
}
#endif

// One weight row against tokens [t0, t1): out[(t - t0) * ld], in scalar code (builds without AVX2:
// tile32 and tile_k otherwise)
inline void row_dot(const Type& type, const uint8_t* row, const Acts& a, int64_t K, int64_t t0, int64_t t1,
                    float* out, int64_t ld, Accs& acc) {
  const Kind kind = type.kind;
  const int64_t nblocks = K / type.block, n = t1 - t0, per32 = K / kBlock;
  acc.reset(n);
  Block blk;
  for (int64_t b = 0; b < nblocks; ++b) {
    decode(kind, row + b * type.bytes, blk);
    const int64_t nsub = type.block / blk.sub;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t tok = t0 + t;
      const int8_t* xq = a.q + tok * K + b * type.block;
      int32_t sumi = 0;
      for (int64_t s = 0; s < nsub; ++s) {
        int32_t dot = 0;
        for (int j = 0; j < blk.sub; ++j) dot += int32_t(blk.q[blk.sub * s + j]) * xq[blk.sub * s + j];
        sumi += blk.sc[s] * dot;
      }
      const float dx = a.d[tok * nblocks + b];
      acc.scalar[t] = std::fma(static_cast<float>(sumi), blk.d * dx, acc.scalar[t]);
      if (has_min(kind)) {
        acc.mins[t] = std::fma(blk.dmin, dx * static_cast<float>(a.sum[tok * per32 + b]), acc.mins[t]);
      } else if (kind != Kind::Q5_0 && kind != Kind::Q6_K) {
        int32_t summ = 0;
        for (int s = 0; s < 8; ++s) summ += blk.m[s] * a.sum[tok * per32 + b * 8 + s];
        acc.mins[t] = std::fma(blk.dmin * dx, static_cast<float>(summ), acc.mins[t]);
      }
    }
  }
  for (int64_t t = 0; t < n; ++t) out[t * ld] = is_k(kind) ? acc.scalar[t] - acc.mins[t] : acc.scalar[t] + acc.mins[t];
}

// A chunk of rows of one call, as work::run runs it (quant_matmul.h's MatmulJob, for these types)
struct Job {
  const Type* type;
  const uint8_t* w;
  Acts acts;
  float* out;
  int64_t T, K, N, row_bytes, per_chunk;

  bool compute(int64_t c, std::vector<float>* scratch, work::Live live) const {
    const int64_t begin = c * per_chunk, end = std::min(N, begin + per_chunk);
    const auto [o, ld] = work::destination(out, N, T, begin, end - begin, scratch);
#if defined(__AVX2__)
    switch (type->kind) {
      case Kind::Q4_1: return rows32<Kind::Q4_1>(begin, end, o, ld, live);
      case Kind::Q5_0: return rows32<Kind::Q5_0>(begin, end, o, ld, live);
      case Kind::Q5_1: return rows32<Kind::Q5_1>(begin, end, o, ld, live);
      case Kind::Q4_K: return rows_k<Kind::Q4_K>(begin, end, o, ld, live);
      case Kind::Q5_K: return rows_k<Kind::Q5_K>(begin, end, o, ld, live);
      case Kind::Q6_K: return rows_k<Kind::Q6_K>(begin, end, o, ld, live);
    }
#endif
    thread_local Accs acc;       // the scalar row_dot, without AVX2

    for (int64_t t0 = 0; t0 < T; t0 += kTokenTile) {
      const int64_t t1 = std::min(T, t0 + kTokenTile);
      for (int64_t n = begin; n < end; ++n) {
        if (!live()) return false;
        row_dot(*type, w + n * row_bytes, acts, K, t0, t1, o + t0 * ld + (n - begin), ld, acc);
      }
    }
    return true;
  }

#if defined(__AVX2__)
  // rows [begin, end) of a 32-block type by tile32: a lone token kRowsGemv rows at a time, more
  // tokens (per tile of kTokenTile) their mins first, then kRowsGemm rows x kTokensGemm tokens
  template <Kind KIND>
  bool rows32(int64_t begin, int64_t end, float* o, int64_t ld, work::Live live) const {
    const int64_t nb = K / kBlock;
    for (int64_t t0 = 0; t0 < T; t0 += kTokenTile) {
      const int64_t t1 = std::min(T, t0 + kTokenTile);
      const int64_t step = T == 1 ? kRowsGemv : kRowsGemm;
      for (int64_t n = begin; n < end; n += step) {
        if (!live()) return false;
        const int rm = static_cast<int>(std::min(step, end - n));
        const uint8_t* rows[kRowsGemv];
        for (int r = 0; r < rm; ++r) rows[r] = w + (n + r) * row_bytes;
        float* on = o + (n - begin);
        if (T == 1) {
          by_count<kRowsGemv>(rm, [&](auto RM) { tile32<KIND, RM.value, 1, true>(rows, acts, nb, 0, on, ld); });
          continue;
        }
        if constexpr (KIND != Kind::Q5_0)
          for (int r = 0; r < rm; ++r) mins32<KIND>(rows[r], acts, nb, T, t0, t1, on + t0 * ld + r, ld);
        by_count<kRowsGemm>(rm, [&](auto RM) {
          int64_t t = t0;
          for (; t + kTokensGemm <= t1; t += kTokensGemm)
            tile32<KIND, RM.value, kTokensGemm, false>(rows, acts, nb, t, on + t * ld, ld);
          if (t < t1)
            by_count<kTokensGemm - 1>(static_cast<int>(t1 - t), [&](auto RN) {
              tile32<KIND, RM.value, RN.value, false>(rows, acts, nb, t, on + t * ld, ld);
            });
        });
      }
    }
    return true;
  }

  // rows [begin, end) of a K-quant by tile_k, per tile of kTokenTile tokens: a lone token kRowsGemv
  // rows at a time, more tokens kRowsGemmK x kTokensGemmK
  template <Kind KIND>
  bool rows_k(int64_t begin, int64_t end, float* o, int64_t ld, work::Live live) const {
    const int64_t nsb = K / kSuper;
    for (int64_t t0 = 0; t0 < T; t0 += kTokenTile) {
      const int64_t t1 = std::min(T, t0 + kTokenTile);
      const int64_t step = T == 1 ? kRowsGemv : kRowsGemmK<KIND>;
      for (int64_t n = begin; n < end; n += step) {
        if (!live()) return false;
        const int rm = static_cast<int>(std::min(step, end - n));
        const uint8_t* rows[kRowsGemv];
        for (int r = 0; r < rm; ++r) rows[r] = w + (n + r) * row_bytes;
        float* on = o + (n - begin);
        if (T == 1) {
          by_count<kRowsGemv>(rm, [&](auto RM) { tile_k<KIND, RM.value, 1>(rows, acts, nsb, 0, on, ld); });
          continue;
        }
        // Q6_K: the row decoded once for a tile of 16 tokens and more, not again for every 8
        const __m256i* pre = nullptr;
        if constexpr (KIND == Kind::Q6_K) {
          if (t1 - t0 >= 2 * kTokensGemmK<KIND>) {
            thread_local std::vector<__m256i> decoded;
            decoded.resize(2 * nsb * 8);
            decode_q6k_row(rows[0], nsb, decoded.data());
            pre = decoded.data();
          }
        }
        by_count<kRowsGemmK<KIND>>(rm, [&](auto RM) {
          auto tile = [&](auto RN, int64_t t) {
            constexpr int rows_n = decltype(RM)::value, tokens_n = decltype(RN)::value;
            if constexpr (KIND == Kind::Q6_K && rows_n == 1 && tokens_n > 1)
              if (pre) return tile_k<KIND, 1, tokens_n, true>(rows, acts, nsb, t, on + t * ld, ld, pre);
            tile_k<KIND, rows_n, tokens_n>(rows, acts, nsb, t, on + t * ld, ld);
          };
          int64_t t = t0;
          for (; t + kTokensGemmK<KIND> <= t1; t += kTokensGemmK<KIND>)
            tile(std::integral_constant<int, kTokensGemmK<KIND>>(), t);
          if (t < t1) by_count<kTokensGemmK<KIND> - 1>(static_cast<int>(t1 - t), [&](auto RN) { tile(RN, t); });
        });
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

// out (T, N) float = x (T, K) @ W^T, W (N, K) in `type`'s blocks. keep: W's tensor (work_pool.h:
// held, with the activations this call owns, until no worker reads them).
inline void matmul(const Type& type, const float* x, const uint8_t* w, float* out, int64_t T, int64_t K, int64_t N,
                   work::Keep keep) {
  work::Pool& pool = work::Pool::get();
  const int64_t nd = is_k(type.kind) ? T * K / kSuper : T * K / kBlock;
  const int64_t n32 = T * K / kBlock;
  const int64_t o_d = work::lines(T * K), o_sum = o_d + work::lines(nd * 4), o_sx = o_sum + work::lines(n32 * 4);
  const int64_t o_sx_t = o_sx + work::lines(n32 * 4), o_corr = o_sx_t + work::lines(n32 * 4);
  unsigned char* mem = work::owned(keep, type.kind == Kind::Q5_0 ? o_corr + n32 * 32 : o_corr);
  const Acts acts{reinterpret_cast<int8_t*>(mem), reinterpret_cast<float*>(mem + o_d),
                  reinterpret_cast<int32_t*>(mem + o_sum), reinterpret_cast<float*>(mem + o_sx),
                  reinterpret_cast<float*>(mem + o_sx_t), reinterpret_cast<int32_t*>(mem + o_corr)};
  quantize_acts(type.kind, x, T, K, acts);
  const int64_t row_bytes = K / type.block * type.bytes;
  const int64_t reads = row_bytes * N * ((T + kTokenTile - 1) / kTokenTile);
  const int64_t chunks = std::max<int64_t>(
      1, std::min({reads / kInlineBytes, pool.threads() * kChunksPerThread, N, work::Pool::kMaxChunks}));
  Job job{&type, w, acts, out, T, K, N, row_bytes, (N + chunks - 1) / chunks};
  work::run((N + job.per_chunk - 1) / job.per_chunk, job, T, std::move(keep));
}

// rows `ids` (T) of a table (V, K) in `type`'s blocks, dequantized as gguf does: out (T, K)
inline void embedding_rows(const Type& type, const uint8_t* w, const int64_t* ids, int64_t T, int64_t K, float* out) {
  const int64_t row_bytes = K / type.block * type.bytes;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < K / type.block; ++b)
      dequantize_block(type.kind, w + ids[t] * row_bytes + b * type.bytes, out + t * K + b * type.block);
}

}  // namespace quant::types
