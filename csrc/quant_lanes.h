// Q8_0 / Q4_0 weights (with AVX2 also Q5_0 / Q4_1 / Q5_1) repacked at load so that one 512-bit
// register holds 16 rows (the "lanes" layout; with AVX2 alone, two 256-bit registers of 8 rows
// each: half_tile below), and y = x W^T over it: the CPU forward's quantized matmul
// (quant_matmul.h and quant_types.h keep the GGUF-layout kernels for blocks as a file stores them).
//
// quant_matmul.h forms each (row, token) block dot in its own register and pays a conversion, a
// scale product and an fma for every 32 multiply-adds; the GEMM was compute-bound at ~8
// multiply-adds an instruction (measured: a 32-row q8_0 decode step of the 135M model 355 ms
// against 206 ms in float32 through oneDNN). Here lane r of a register is weight row r of a group
// of 16: a block's 32 weights of the 16 rows are 8 registers (Q4_0: 4, two nibbles a byte), each
// multiplied by one broadcast group of 4 activation bytes with vpdpbusd. A (token, block) of a
// group costs 8 vpdpbusd, then one conversion and one fma for all 16 rows: 512 multiply-adds in
// ~11 instructions, and the weights, loaded once, serve every token of a tile.
//
// vpdpbusd multiplies unsigned by signed bytes: the weights are the unsigned operand (Q8_0 stored
// as q + 128; Q4_0's nibbles as they are, q + 8), and each (token, block) accumulator starts from
// minus 128 (or 8) times the sum of that block's int8 activations, so the int32 each lane ends
// with is the exact signed dot product. Every output is then
//
//     y[t, n] = fma(float(dot_b), dw[n, b] * dx[t, b], ...)   over blocks b in order, from 0
//
// whatever the tile, the thread or the instruction set (the scalar form below is the same
// operations), so the rows of a GEMM are the gemv's bit for bit and the result is batch-invariant.
//
// Layout: rows in groups of 16 (the last N % 16 rows stay in GGUF's row layout, after the groups);
// a group is nb tiles, one per block, each 16 * block_bytes bytes (the size GGUF gives the same
// blocks, so a packed weight is exactly as large):
//
//     [0, 32)            the 16 rows' fp16 scales, row r at 2 r
//     Q8_0 [32, 544)     8 chunks of 64 bytes; chunk j holds q[r, 4j .. 4j + 4) + 128 at 4 r
//     Q4_0 [32, 288)     4 chunks of 64 bytes; chunk j holds GGUF's bytes 4j .. 4j + 4 of row r
//                        at 4 r: low nibbles q[4j ..], high nibbles q[16 + 4j ..]
//     Q5_0 [32, 288)     Q4_0's chunks of GGUF's qs bytes, then
//          [288, 352)    each row's 32 fifth bits as a u32 at 4 r, in the order q5_bit_at gives
//     Q4_1 [32, 64)      the rows' fp16 mins m after their scales, then Q4_0's chunks at [64, 320)
//     Q5_1 [32, 64)      the same, Q5_0's chunks and fifth bits at [64, 384)
//     (Q5_0, Q4_1, Q5_1: AVX2 builds only; AVX-512 has no kernel for them here and does not pack them)
//
// With a min the formula gains one fma per block: acc = fma(m, dx * sum(qx), acc) after the dot's.
//
// A packed weight is an int8 tensor (GGUF's blocks are uint8): the dtype says the layout.
#pragma once

#include "quant_matmul.h"
#include "quant_types.h"

namespace quant::lanes {

constexpr int64_t kRows = 16;
constexpr int kTokens = 8;     // tokens per tile: 8 register accumulators, the group's weights loaded once

inline bool is_q4(int64_t block_bytes) { return block_bytes == 2 + kBlock / 2; }

// What a block type's packed tile holds, by its GGUF block size (the types of 32 weights: Q8_0 34,
// Q4_0 18, Q5_0 22, Q4_1 20, Q5_1 24 bytes). Weight j of a block is d * (q_j - offset) (Q8_0: q_j
// signed, stored + 128), or d * q_j + m for the types with a min.
struct Fmt {
  bool q8, fifth, min;   // Q8_0; a fifth bit per weight (Q5_0, Q5_1); a min m (Q4_1, Q5_1)
  int offset;            // Q4_0 8, Q5_0 16, else 0
  int64_t qs, qh;        // in a GGUF block: the nibbles' offset, the fifth bits' (a little-endian u32)
  int64_t head;          // in a tile: the 16 rows' fp16 d (then m) before the chunks
};

inline Fmt fmt(int64_t block_bytes) {
  switch (block_bytes) {
    case 2 + kBlock: return {true, false, false, 0, 2, 0, 2 * kRows};
    case 18: return {false, false, false, 8, 2, 0, 2 * kRows};
    case 22: return {false, true, false, 16, 6, 2, 2 * kRows};
    case 20: return {false, false, true, 0, 4, 0, 4 * kRows};
    default: return {false, true, true, 0, 8, 4, 4 * kRows};     // 24: Q5_1
  }
}
inline bool is_q5(int64_t block_bytes) { return block_bytes == 22; }

// The fifth bits in a packed tile: row r's u32 at head + 256 + 4 r holds weight 4j + i's bit (qs
// chunk j's low nibble i) at bit 8i + j and weight 16 + 4j + i's (its high nibble) at 8i + 4 + j,
// so that chunk j's 8 bits of a row sit at bit j and bit 4 + j of each byte, one shift from 0x10
inline int q5_bit_at(int k) { return k < 16 ? 8 * (k % 4) + k / 4 : 8 * ((k - 16) % 4) + 4 + (k - 16) / 4; }

inline uint32_t q5_spread(uint32_t qh) {           // GGUF's qh -> the packed order
  uint32_t out = 0;
  for (int k = 0; k < 32; ++k) out |= ((qh >> k) & 1u) << q5_bit_at(k);
  return out;
}

inline uint32_t q5_gather(uint32_t packed) {       // its inverse
  uint32_t out = 0;
  for (int k = 0; k < 32; ++k) out |= ((packed >> q5_bit_at(k)) & 1u) << k;
  return out;
}

// chunks of 4 bytes of each row in a tile: the 16 nibble bytes, or Q8_0's 32 weights
inline int chunks(const Fmt& f) { return f.q8 ? 8 : 4; }

// A GGUF block's 32 weights as integers (q_j - offset, or Q4_1 / Q5_1's q_j) from its nibble bytes
// `qs` and fifth bits `qh`, or Q8_0's `qs` as stored
inline void weights(const Fmt& f, const uint8_t* qs, uint32_t qh, int8_t* q) {
  if (f.q8) {
    std::memcpy(q, qs, kBlock);
    return;
  }
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int8_t>(((qs[j] & 15) | ((qh >> j) & 1) << 4) - f.offset);
    q[j + 16] = static_cast<int8_t>(((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - f.offset);
  }
}

// Row n's block b as GGUF stores it (packed rows gathered from their tile; the rows after the last
// whole group are in GGUF's layout already)
inline void gguf_block(const uint8_t* w, int64_t N, int64_t nb, int64_t block_bytes, int64_t n, int64_t b,
                       uint8_t* blk) {
  if (n >= N / kRows * kRows) {
    std::memcpy(blk, w + (n * nb + b) * block_bytes, block_bytes);
    return;
  }
  const Fmt f = fmt(block_bytes);
  const uint8_t* tile = w + ((n / kRows) * nb + b) * kRows * block_bytes;
  const int r = static_cast<int>(n % kRows);
  std::memcpy(blk, tile + 2 * r, 2);
  if (f.min) std::memcpy(blk + 2, tile + 2 * kRows + 2 * r, 2);
  for (int j = 0; j < chunks(f); ++j)
    for (int i = 0; i < 4; ++i) {
      const uint8_t v = tile[f.head + 64 * j + 4 * r + i];
      if (f.q8) blk[2 + 4 * j + i] = v ^ 0x80; else blk[f.qs + 4 * j + i] = v;
    }
  if (f.fifth) {
    uint32_t qh;
    std::memcpy(&qh, tile + f.head + 256 + 4 * r, 4);
    qh = q5_gather(qh);
    std::memcpy(blk + f.qh, &qh, 4);
  }
}

// row n's block b as integers, its d (returned) and its m (types with a min)
inline float block_at(const uint8_t* w, int64_t N, int64_t nb, int64_t block_bytes, int64_t n, int64_t b, int8_t* q,
                      float* m = nullptr) {
  const Fmt f = fmt(block_bytes);
  uint8_t blk[2 + kBlock];                         // the largest block: Q8_0's
  gguf_block(w, N, nb, block_bytes, n, b, blk);
  uint32_t qh = 0;
  if (f.fifth) std::memcpy(&qh, blk + f.qh, 4);
  weights(f, blk + f.qs, qh, q);
  if (m != nullptr) *m = f.min ? fp16_to_float(blk + 2) : 0.f;
  return fp16_to_float(blk);
}

// GGUF rows (N, nb * block_bytes) -> the lanes layout (same size); unpack is its exact inverse
inline void pack(const uint8_t* src, uint8_t* dst, int64_t N, int64_t nb, int64_t block_bytes) {
  const Fmt f = fmt(block_bytes);
  const int64_t groups = N / kRows, row_bytes = nb * block_bytes;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* tile = dst + (g * nb + b) * kRows * block_bytes;
      for (int r = 0; r < kRows; ++r) {
        const uint8_t* blk = src + (g * kRows + r) * row_bytes + b * block_bytes;
        std::memcpy(tile + 2 * r, blk, 2);
        if (f.min) std::memcpy(tile + 2 * kRows + 2 * r, blk + 2, 2);
        for (int j = 0; j < chunks(f); ++j)
          for (int i = 0; i < 4; ++i)
            tile[f.head + 64 * j + 4 * r + i] = f.q8 ? blk[2 + 4 * j + i] ^ 0x80 : blk[f.qs + 4 * j + i];
        if (f.fifth) {
          uint32_t qh;
          std::memcpy(&qh, blk + f.qh, 4);
          qh = q5_spread(qh);
          std::memcpy(tile + f.head + 256 + 4 * r, &qh, 4);
        }
      }
    }
  if (N > groups * kRows)
    std::memcpy(dst + groups * kRows * row_bytes, src + groups * kRows * row_bytes, (N - groups * kRows) * row_bytes);
}

inline void unpack(const uint8_t* src, uint8_t* dst, int64_t N, int64_t nb, int64_t block_bytes) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < nb; ++b) gguf_block(src, N, nb, block_bytes, n, b, dst + (n * nb + b) * block_bytes);
}

// One output, in the operations every path uses (see the top of the file): per block in order,
// acc = fma(float(dot), d * dx, acc), then for the types with a min acc = fma(m, sx, acc), sx the
// activations' dx * sum(qx) (llama.cpp's Q8_1 s, in float32)
inline float scalar_output(const uint8_t* w, int64_t N, int64_t nb, int64_t block_bytes, int64_t n, const int8_t* qx,
                           const float* dx, const float* sx) {
  const bool min = fmt(block_bytes).min;
  float acc = 0.f;
  int8_t q[kBlock];
  for (int64_t b = 0; b < nb; ++b) {
    float m;
    const float dw = block_at(w, N, nb, block_bytes, n, b, q, &m);
    int32_t dot = 0;
    for (int j = 0; j < kBlock; ++j) dot += int32_t(q[j]) * int32_t(qx[b * kBlock + j]);
    acc = std::fma(static_cast<float>(dot), dw * dx[b], acc);
    if (min) acc = std::fma(m, sx[b], acc);
  }
  return acc;
}

#if defined(QUANT_Q4_PAIRS)
#define QUANT_LANES 1
constexpr int64_t kLanesTokenBlock = kTokenBlock;     // tokens a group walks at a time (their activations in L2)

// one group (its first tile at `group`) against RT tokens: out[t * ld + r] for the 16 rows r.
// nc: per (token, block) minus 128 (Q8_0) or 8 (Q4_0) times the block's activation sum.
template <int RT>
inline void group_tile(const uint8_t* group, int64_t nb, bool q4, const int8_t* qx, const float* dx,
                       const int32_t* nc, int64_t K, float* out, int64_t ld) {
  const int64_t tile_bytes = kRows * (q4 ? 2 + kBlock / 2 : 2 + kBlock);
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[RT];
  for (int t = 0; t < RT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* tile = group + b * tile_bytes;
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile)));
    __m512i w[8];
    if (q4) {
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(tile + 2 * kRows + 64 * j);
        w[j] = _mm512_and_si512(v, low);
        w[4 + j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    } else {
      for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(tile + 2 * kRows + 64 * j);
    }
    for (int t = 0; t < RT; ++t) {
      const int8_t* x = qx + t * K + b * kBlock;
      __m512i s = _mm512_set1_epi32(nc[t * nb + b]);
      for (int j = 0; j < 8; ++j) {
        int32_t four;
        std::memcpy(&four, x + 4 * j, 4);
        s = _mm512_dpbusd_epi32(s, w[j], _mm512_set1_epi32(four));
      }
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(dx[t * nb + b])), acc[t]);
    }
  }
  for (int t = 0; t < RT; ++t) _mm512_storeu_ps(out + t * ld, acc[t]);
}

// a group against tokens [t0, t1): kTokens at a time, the rest 4, 2, 1 at a time
// the block sizes this kernel takes (Q5_0, Q4_1, Q5_1 have none here: AVX-512 builds keep them in GGUF's layout)
inline bool lanes_kernel(int64_t block_bytes) { return block_bytes == 2 + kBlock || is_q4(block_bytes); }

inline void group_tokens(const uint8_t* group, int64_t nb, int64_t block_bytes, const int8_t* qx, const float* dx,
                         const int32_t* nc, const float* /* sx: no min here */, int64_t K, int64_t t0, int64_t t1,
                         float* out, int64_t ld) {
  const bool q4 = is_q4(block_bytes);
  int64_t t = t0;
  auto run = [&](auto rt) {
    constexpr int RT = decltype(rt)::value;
    group_tile<RT>(group, nb, q4, qx + t * K, dx + t * nb, nc + t * nb, K, out + t * ld, ld);
    t += RT;
  };
  while (t + kTokens <= t1) run(std::integral_constant<int, kTokens>{});
  if (t + 4 <= t1) run(std::integral_constant<int, 4>{});
  if (t + 2 <= t1) run(std::integral_constant<int, 2>{});
  if (t < t1) run(std::integral_constant<int, 1>{});
}
#endif

#if !defined(QUANT_Q4_PAIRS) && defined(__AVX2__)
#define QUANT_LANES 1
// The same layout without AVX-512 (AMD Zen 2 / 3, older Intel): a group's 16 rows as two halves
// of 8, a 256-bit register holding one half's 4 bytes of each row, so that one multiply-add
// instruction serves 8 rows where the GGUF-layout kernels (quant_matmul.h's tile_avx2,
// quant_types.h's tile32) spent one on a row and then paid a conversion, a scale product and an
// fma for every row and block. Each (token, block) lane ends with the scalar form's exact int32
// dot, and from there the float operations are group_tile's (fma(float(dot), dw * dx, acc), blocks
// in order), so every output is the scalar form's and the AVX-512 kernel's bit for bit.
//
//   Q4_0  the nibbles (0..15) times the activations by vpmaddubsw, a block's products summed in
//         int16 (|sum| <= 8 * 2 * 15 * 127 < 2^15), widened by vpmaddwd, then nc (minus 8 times
//         the block's activation sum) added: 20 instructions per 256 multiply-adds of a token
//   Q5_0  Q4_0's, each nibble given its fifth bit (one shift, an and and an or per 32 bytes, from
//         the bits as pack() orders them), summed in int16 two chunks at a time (2 * 2 * 2 * 31 *
//         127 < 2^15), nc minus 16 times the sum
//   Q4_1, Q5_1  Q4_0's / Q5_0's without the offset, then the min's fma (m times the activations'
//         dx * sum), 8 rows' m converted at once
//   Q8_0  stored as q + 128, which vpmaddubsw's int16 pairs cannot take (2 * 255 * 127 > 2^15):
//         the sign trick instead (|q| times x carrying q's sign, |pair| <= 2 * 128 * 127), each
//         chunk widened to int32 before the next is added; nc is not used
constexpr int kTokensAvx2 = 4;
constexpr int64_t kLanesTokenBlock = kTokenBlockAvx2;
inline bool lanes_kernel(int64_t) { return true; }
enum class Lanes { Q8, Q4, Q5, Q41, Q51 };

// halves [h0, h0 + NH) of one group (half h: rows 8h .. 8h + 8) against RT tokens: out[t * ld + r]
// for their rows r. The gemv takes both halves in one pass (each weight line read once, while
// it streams in); the GEMM one half at a time (its accumulators would not fit the registers
// otherwise), the second half's lines in cache from the first's.
template <Lanes Q, int RT, int NH>
inline void half_tile(const uint8_t* group, int64_t nb, int h0, const int8_t* qx, const float* dx, const int32_t* nc,
                      const float* sx, int64_t K, float* out, int64_t ld) {
  constexpr bool fifth = Q == Lanes::Q5 || Q == Lanes::Q51, min = Q == Lanes::Q41 || Q == Lanes::Q51;
  constexpr bool offset = Q == Lanes::Q4 || Q == Lanes::Q5;
  constexpr int64_t block_bytes = Q == Lanes::Q8 ? 34 : Q == Lanes::Q4 ? 18 : Q == Lanes::Q5 ? 22
                                  : Q == Lanes::Q41 ? 20 : 24;
  constexpr int64_t tile_bytes = kRows * block_bytes, head = (min ? 4 : 2) * kRows;
  constexpr int flush = fifth ? 2 : 4;     // chunks summed in int16 before widening
  const __m256i low = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  auto four = [&](int t, int64_t b, int at) {     // token t's activations at + 0..3 of block b, in every lane
    int32_t v;
    std::memcpy(&v, qx + t * K + b * kBlock + at, 4);
    return _mm256_set1_epi32(v);
  };
  __m256 acc[NH][RT];
  for (int h = 0; h < NH; ++h)
    for (int t = 0; t < RT; ++t) acc[h][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* tile = group + b * tile_bytes;
    if constexpr (RT == 1) prefetch_span(tile, tile_bytes);      // the gemv streams the weight once
    for (int h = 0; h < NH; ++h) {
      const uint8_t* body = tile + head + 32 * (h0 + h);
      __m256i dot[RT];
      for (int t = 0; t < RT; ++t) dot[t] = _mm256_setzero_si256();
      if constexpr (Q == Lanes::Q8) {
        for (int j = 0; j < 8; ++j) {
          const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(body + 64 * j)), flip);
          const __m256i w_abs = _mm256_sign_epi8(w, w);
          for (int t = 0; t < RT; ++t)
            dot[t] = _mm256_add_epi32(
                dot[t], _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(four(t, b, 4 * j), w)), ones));
        }
      } else {
        __m256i qh = _mm256_setzero_si256(), sum16[RT];
        if constexpr (fifth) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(body + 256));
        for (int t = 0; t < RT; ++t) sum16[t] = _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(body + 64 * j));
          __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          if constexpr (fifth) {     // chunk j's fifth bits sit at bits j and 4 + j of each byte
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi32(qh, 4 - j), bit4));
            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srli_epi32(qh, j), bit4));
          }
          for (int t = 0; t < RT; ++t) {
            sum16[t] = _mm256_add_epi16(sum16[t], _mm256_add_epi16(_mm256_maddubs_epi16(lo, four(t, b, 4 * j)),
                                                                   _mm256_maddubs_epi16(hi, four(t, b, 16 + 4 * j))));
            if ((j + 1) % flush == 0) {
              dot[t] = _mm256_add_epi32(dot[t], _mm256_madd_epi16(sum16[t], ones));
              sum16[t] = _mm256_setzero_si256();
            }
          }
        }
        if constexpr (offset)
          for (int t = 0; t < RT; ++t) dot[t] = _mm256_add_epi32(dot[t], _mm256_set1_epi32(nc[t * nb + b]));
      }
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + 16 * (h0 + h))));
      [[maybe_unused]] __m256 mw;
      if constexpr (min)
        mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + 2 * kRows + 16 * (h0 + h))));
      for (int t = 0; t < RT; ++t) {
        acc[h][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t]), _mm256_mul_ps(dw, _mm256_set1_ps(dx[t * nb + b])),
                                    acc[h][t]);
        if constexpr (min) acc[h][t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sx[t * nb + b]), acc[h][t]);
      }
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int t = 0; t < RT; ++t) _mm256_storeu_ps(out + t * ld + 8 * (h0 + h), acc[h][t]);
}

// a group against tokens [t0, t1): one token both halves at once; more, each half kTokensAvx2
// tokens at a time, the rest 2, 1 at a time
template <Lanes Q>
inline void group_tokens_of(const uint8_t* group, int64_t nb, const int8_t* qx, const float* dx, const int32_t* nc,
                            const float* sx, int64_t K, int64_t t0, int64_t t1, float* out, int64_t ld) {
  if (t1 - t0 == 1) {
    half_tile<Q, 1, 2>(group, nb, 0, qx + t0 * K, dx + t0 * nb, nc + t0 * nb, sx + t0 * nb, K, out + t0 * ld, ld);
    return;
  }
  for (int h = 0; h < 2; ++h) {
    int64_t t = t0;
    auto run = [&](auto rt) {
      constexpr int RT = decltype(rt)::value;
      half_tile<Q, RT, 1>(group, nb, h, qx + t * K, dx + t * nb, nc + t * nb, sx + t * nb, K, out + t * ld, ld);
      t += RT;
    };
    while (t + kTokensAvx2 <= t1) run(std::integral_constant<int, kTokensAvx2>{});
    if (t + 2 <= t1) run(std::integral_constant<int, 2>{});
    if (t < t1) run(std::integral_constant<int, 1>{});
  }
}

inline void group_tokens(const uint8_t* group, int64_t nb, int64_t block_bytes, const int8_t* qx, const float* dx,
                         const int32_t* nc, const float* sx, int64_t K, int64_t t0, int64_t t1, float* out,
                         int64_t ld) {
  auto run = [&](auto q) { group_tokens_of<decltype(q)::value>(group, nb, qx, dx, nc, sx, K, t0, t1, out, ld); };
  switch (block_bytes) {
    case 18: return run(std::integral_constant<Lanes, Lanes::Q4>{});
    case 22: return run(std::integral_constant<Lanes, Lanes::Q5>{});
    case 20: return run(std::integral_constant<Lanes, Lanes::Q41>{});
    case 24: return run(std::integral_constant<Lanes, Lanes::Q51>{});
    default: return run(std::integral_constant<Lanes, Lanes::Q8>{});
  }
}
#endif

// A chunk of row groups of one call (the last chunk also takes the tail rows), as work::run runs it
// (work_pool.h: on the Pool, in place or into a worker's scratch; on OpenMP's threads, in place)
struct Job {
  const uint8_t* w;
  const int8_t* qx;
  const float* dx;
  const int32_t* nc;
  const float* sx;
  float* out;
  int64_t T, K, N, nb, block_bytes, groups, per_chunk, chunks;

  int64_t row_begin(int64_t c) const { return std::min(groups, c * per_chunk) * kRows; }
  int64_t row_end(int64_t c) const { return c == chunks - 1 ? N : std::min(groups, (c + 1) * per_chunk) * kRows; }

  bool compute(int64_t c, std::vector<float>* scratch, work::Live live) const {
    const int64_t begin = row_begin(c), end = row_end(c);
    const auto [o, ld] = work::destination(out, N, T, begin, end - begin, scratch);
#if defined(QUANT_LANES)
    // the packed kernel's rows (all groups, or none where this build has no kernel for the type)
    const int64_t full_end = lanes_kernel(block_bytes) ? std::min(end, groups * kRows) : begin;
    for (int64_t t0 = 0; t0 < T; t0 += kLanesTokenBlock) {
      const int64_t t1 = std::min(T, t0 + kLanesTokenBlock);
      for (int64_t n = begin; n < full_end; n += kRows) {
        if (!live()) return false;
        group_tokens(w + (n / kRows) * nb * kRows * block_bytes, nb, block_bytes, qx, dx, nc, sx, K, t0, t1,
                     o + (n - begin), ld);
      }
    }
    const int64_t scalar_from = full_end;
#else
    const int64_t scalar_from = begin;
#endif
    for (int64_t n = scalar_from; n < end; ++n) {
      if (!live()) return false;
      for (int64_t t = 0; t < T; ++t)
        o[t * ld + (n - begin)] = scalar_output(w, N, nb, block_bytes, n, qx + t * K, dx + t * nb, sx + t * nb);
    }
    return true;
  }

  void commit(int64_t c, std::vector<float>* scratch) const {
    work::publish(out, N, T, row_begin(c), row_end(c) - row_begin(c), *scratch);
  }
};

// out (T, N) float = x (T, K) @ W^T, W (N, K) packed as above in blocks of `block_bytes`. keep: W's
// tensor (work_pool.h: held until no worker reads it).
inline void matmul(const float* x, const uint8_t* w, float* out, int64_t T, int64_t K, int64_t N, int64_t block_bytes,
                   work::Keep keep) {
  const int64_t nb = K / kBlock;
  work::Pool& pool = work::Pool::get();
  // the activations as the workers read them, in memory this call owns (a late worker may still
  // read them after the caller returns): qx, dx, nc, sx
  const int64_t o_dx = work::lines(T * K), o_nc = o_dx + work::lines(T * nb * 4), o_sx = o_nc + work::lines(T * nb * 4);
  unsigned char* mem = work::owned(keep, o_sx + T * nb * 4);
  int8_t* qx = reinterpret_cast<int8_t*>(mem);
  float* dx = reinterpret_cast<float*>(mem + o_dx);
  int32_t* nc = reinterpret_cast<int32_t*>(mem + o_nc);
  float* sx = reinterpret_cast<float*>(mem + o_sx);
  quantize_rows(x, qx, dx, T, K);
  const Fmt f = fmt(block_bytes);
  const int32_t offset = f.q8 ? 128 : f.offset;     // (Q8_0's for the AVX-512 kernel's unsigned weights)
  for (int64_t i = 0; i < T * nb; ++i) {
    int32_t sum = 0;
    for (int j = 0; j < kBlock; ++j) sum += qx[i * kBlock + j];
    nc[i] = -offset * sum;
    if (f.min) sx[i] = dx[i] * static_cast<float>(sum);     // read only by the types with a min
  }
  const int64_t groups = N / kRows;
  const int64_t reads = nb * block_bytes * N * ((T + kTokens - 1) / kTokens);
  const int64_t chunks = std::max<int64_t>(1, std::min({reads / kInlineBytes, pool.threads() * kChunksPerThread,
                                                        std::max<int64_t>(groups, 1), work::Pool::kMaxChunks}));
  const int64_t per_chunk = (std::max<int64_t>(groups, 1) + chunks - 1) / chunks;
  Job job{w, qx, dx, nc, sx, out, T, K, N, nb, block_bytes, groups, per_chunk, 0};
  job.chunks = (std::max<int64_t>(groups, 1) + per_chunk - 1) / per_chunk;
  work::run(job.chunks, job, T, std::move(keep));
}

}  // namespace quant::lanes

// The tensor entry points (pagedecode._cpu): Q8_0 / Q4_0 blocks are uint8 in GGUF's layout or int8
// packed (lanes), (N, K / 32 * block bytes) either way; every other type (quant_types.h) is uint8
// (N, blocks per row, type size).
namespace quant {

// blocks of quant_types.h's types: their type (checked against K), else nullptr
inline const types::Type* other_type(const at::Tensor& blocks, int64_t K, const char* what) {
  if (blocks.dim() != 3) return nullptr;
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() && blocks.device().is_cpu(), what,
              ": blocks (N, blocks per row, type size) must be contiguous uint8 on the CPU");
  const types::Type* type = types::find_type(K, blocks.size(1), blocks.size(2));
  TORCH_CHECK(type != nullptr, what, ": no GGUF block type has ", blocks.size(1), " blocks of ", blocks.size(2),
              " bytes for ", K, " inputs");
  return type;
}

// Q8_0 / Q4_0 blocks (N, K / 32 * block bytes) in either layout, or Q5_0 / Q4_1 / Q5_1 packed
// (int8; as uint8 only where `any_gguf`: quant_pack's input, GGUF's blocks of those types otherwise
// going to quant_types.h as (N, blocks, type size)): the block size
inline int64_t check_blocks(const at::Tensor& blocks, int64_t K, const char* what, bool any_gguf = false) {
  TORCH_CHECK(blocks.dim() == 2 && (blocks.scalar_type() == at::kByte || blocks.scalar_type() == at::kChar) &&
                  blocks.is_contiguous(), what, ": blocks must be (N, K / 32 * block bytes) uint8 (GGUF's layout) "
                  "or int8 (packed by quant_pack)");
  TORCH_CHECK(blocks.device().is_cpu(), what, ": blocks must be on the CPU");
  TORCH_CHECK(K > 0 && K % kBlock == 0, what, ": K must be a positive multiple of 32");
  const int64_t block_bytes = blocks.size(1) / (K / kBlock);
  const bool packed_only = block_bytes == 22 || block_bytes == 20 || block_bytes == 24;
  const bool known =
      block_bytes == 34 || block_bytes == 18 || (packed_only && (blocks.scalar_type() == at::kChar || any_gguf));
  TORCH_CHECK(known && block_bytes * (K / kBlock) == blocks.size(1), what, ": blocks are neither Q8_0 (34 bytes) nor "
              "Q4_0 (18 bytes) for this K, nor packed Q5_0 / Q4_1 / Q5_1 (22 / 20 / 24)");
  return block_bytes;
}

inline const uint8_t* bytes(const at::Tensor& t) { return static_cast<const uint8_t*>(t.data_ptr()); }

}  // namespace quant

// pagedecode._cpu.quant_linear(x (T, K) float32, blocks, N) -> (T, N) float32; the caller may free
// x and the blocks as soon as it returns (the pool keeps what its late workers read)
inline at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t n_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "quant_linear: x must be (T, K) float32 on the CPU");
  TORCH_CHECK((blocks.dim() == 2 || blocks.dim() == 3) && blocks.size(0) == n_out, "quant_linear: blocks must have N rows");
  const int64_t T = x.size(0), K = x.size(1);
  const quant::types::Type* type = quant::other_type(blocks, K, "quant_linear");
  const int64_t block_bytes = type ? 0 : quant::check_blocks(blocks, K, "quant_linear");
  at::Tensor out = at::empty({T, n_out}, x.options());
  if (T > 0 && n_out > 0) {
    if (type != nullptr)
      quant::types::matmul(*type, x.data_ptr<float>(), quant::bytes(blocks), out.data_ptr<float>(), T, K, n_out,
                           {blocks});
    else if (blocks.scalar_type() == at::kChar)
      quant::lanes::matmul(x.data_ptr<float>(), quant::bytes(blocks), out.data_ptr<float>(), T, K, n_out, block_bytes,
                           {blocks});
    else
      quant::matmul(x.data_ptr<float>(), quant::bytes(blocks), out.data_ptr<float>(), T, K, n_out, block_bytes, {blocks});
  }
  return out;
}

// pagedecode._cpu.quant_pack(blocks uint8, K) -> the same weight packed (int8), and quant_unpack back
inline at::Tensor quant_repack(const at::Tensor& blocks, int64_t K, bool to_lanes) {
  const int64_t block_bytes = quant::check_blocks(blocks, K, to_lanes ? "quant_pack" : "quant_unpack", true);
  TORCH_CHECK(blocks.scalar_type() == (to_lanes ? at::kByte : at::kChar),
              to_lanes ? "quant_pack: blocks must be uint8 (GGUF's layout)" : "quant_unpack: blocks must be int8 (packed)");
  at::Tensor out = at::empty_like(blocks, blocks.options().dtype(to_lanes ? at::kChar : at::kByte));
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  if (to_lanes)
    quant::lanes::pack(quant::bytes(blocks), dst, blocks.size(0), K / quant::kBlock, block_bytes);
  else
    quant::lanes::unpack(quant::bytes(blocks), dst, blocks.size(0), K / quant::kBlock, block_bytes);
  return out;
}

// rows `ids` of an embedding table (V, K) in Q8_0 / Q4_0 blocks (either layout), dequantized: (len(ids), K) float32
inline at::Tensor quant_embedding_rows(const at::Tensor& blocks, const at::Tensor& ids, int64_t K) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "quant_embedding_rows: ids must be 1-D int64");
  if (const quant::types::Type* type = quant::other_type(blocks, K, "quant_embedding_rows")) {
    const at::Tensor id_c = ids.contiguous();
    const int64_t* id = id_c.data_ptr<int64_t>();
    for (int64_t t = 0; t < id_c.size(0); ++t)
      TORCH_CHECK(id[t] >= 0 && id[t] < blocks.size(0), "quant_embedding_rows: token id out of range");
    at::Tensor out = at::empty({id_c.size(0), K}, at::kFloat);
    quant::types::embedding_rows(*type, quant::bytes(blocks), id, id_c.size(0), K, out.data_ptr<float>());
    return out;
  }
  const int64_t block_bytes = quant::check_blocks(blocks, K, "quant_embedding_rows");
  const int64_t nb = K / quant::kBlock, T = ids.size(0), V = blocks.size(0);
  const bool lanes = blocks.scalar_type() == at::kChar;
  const at::Tensor id_c = ids.contiguous();
  at::Tensor out = at::empty({T, K}, at::kFloat);
  const int64_t* id = id_c.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(id[t] >= 0 && id[t] < V, "quant_embedding_rows: token id out of range");
    float* o = out.data_ptr<float>() + t * K;
    int8_t w[quant::kBlock];
    for (int64_t b = 0; b < nb; ++b) {
      float d, m = 0.f;
      if (lanes) {
        d = quant::lanes::block_at(quant::bytes(blocks), V, nb, block_bytes, id[t], b, w, &m);
      } else {
        const uint8_t* blk = quant::bytes(blocks) + id[t] * blocks.size(1) + b * block_bytes;
        quant::unpack_scalar(blk, block_bytes == 18, w);
        d = quant::fp16_to_float(blk);
      }
      // d * q (+ m for Q4_1 / Q5_1: gguf's two roundings, as quant_types.h's dequantize_block)
      const bool min = lanes && quant::lanes::fmt(block_bytes).min;
      for (int j = 0; j < quant::kBlock; ++j)
        o[b * quant::kBlock + j] = min ? quant::types::rounded(d * static_cast<float>(w[j])) + m
                                       : d * static_cast<float>(w[j]);
    }
  }
  return out;
}
