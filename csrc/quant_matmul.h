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
// AVX2, a plain loop otherwise. Q4_0's nibbles are unpacked to q - 8 in registers first. Lanes
// accumulate in float (scale products broadcast); one horizontal sum per output.
//
// Work: rows of W are split over threads; each thread walks its rows and, for each row, the
// tokens four at a time (a block unpacked once serves four), so a row's blocks are read from
// memory once per call and stay in L1 across the tokens.

#pragma once

#include "work_pool.h"

namespace quant {

constexpr int64_t kBlock = 32;

inline float fp16_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// x (T, K) float -> qx (T, K) int8 and dx (T, K / 32) float
inline void quantize_rows(const float* x, int8_t* qx, float* dx, int64_t T, int64_t K) {
  const int64_t nb = K / kBlock;
  at::parallel_for(0, T * nb, 64, [&](int64_t begin, int64_t end) {
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
#endif
      float amax = 0.f;
      for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
      const float d = amax / 127.f;
      const float inv = d > 0.f ? 1.f / d : 0.f;
      for (int j = 0; j < kBlock; ++j) qx[i * kBlock + j] = static_cast<int8_t>(std::nearbyint(v[j] * inv));
      dx[i] = d;
    }
  });
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

// out[r * N] for R tokens (qx, dx at the first, rows K / nb apart) against one weight row: each
// block is unpacked once and used for all R tokens, each token keeping its own accumulator
template <int R>
inline void row_tile(const uint8_t* row, int64_t nb, int64_t block_bytes, bool q4, const int8_t* qx,
                     const float* dx, int64_t K, float* out, int64_t N) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * block_bytes;
    const __m256i w = unpack_avx2(blk, q4);
    const __m256i w_abs = _mm256_sign_epi8(w, w);
    const float dw = fp16_to_float(blk);
    for (int r = 0; r < R; ++r) {
      const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * K + b * kBlock));
      const __m256i lanes = dot_block(w, w_abs, xb);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(dw * dx[r * nb + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * N] = hsum(acc[r]);
}
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
  float tail[R] = {};
  if (b < nb) {
    const uint8_t* blk = row + b * kBytes;
    const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(p, 4), p), _mm256_set1_epi8(15));
    const float dw = fp16_to_float(blk);
    for (int r = 0; r < R; ++r) {
      const __m256i lanes = _mm256_dpbusd_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(corr + r * (K / 4) + b * 8)), nib,
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + r * K + b * kBlock)));
      tail[r] = dw * dx[r * nb + b] * hsum(_mm256_cvtepi32_ps(lanes));
    }
  }
  for (int r = 0; r < R; ++r) out[r * N] = _mm512_reduce_add_ps(acc[r]) + tail[r];
}
#endif

constexpr int kTile = 4;        // tokens per weight-block load

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
#if defined(__AVX2__)
  int64_t t = 0;
  for (; t + kTile <= T; t += kTile)
    row_tile<kTile>(row, nb, block_bytes, q4, qx + t * K, dx + t * nb, K, out + t * ld, ld);
  for (; t < T; ++t) row_tile<1>(row, nb, block_bytes, q4, qx + t * K, dx + t * nb, K, out + t * ld, ld);
#else
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
#endif
}

// A chunk of rows of one call, as work::Pool runs it: in place on the caller, or into a worker's
// scratch (T, rows) and then copied out.
struct MatmulJob {
  const uint8_t* w;
  const int8_t* qx;
  const int8_t* xp;
  const int32_t* corr;
  const float* dx;
  float* out;
  int64_t T, K, N, nb, block_bytes, per_chunk;
  bool q4;

  bool compute(int64_t c, std::vector<float>* scratch, work::Live live) const {
    const int64_t begin = c * per_chunk, end = std::min(N, begin + per_chunk), rows = end - begin;
    float* o = out + begin;
    int64_t ld = N;
    if (scratch != nullptr) {
      scratch->resize(T * rows);
      o = scratch->data();
      ld = rows;
    }
    for (int64_t n = begin; n < end; ++n) {
      if (!live()) return false;
      one_row(w + n * nb * block_bytes, nb, block_bytes, q4, qx, xp, corr, dx, T, K, o + (n - begin), ld);
    }
    return true;
  }

  void commit(int64_t c, std::vector<float>* scratch) const {
    const int64_t begin = c * per_chunk, rows = std::min(N, begin + per_chunk) - begin;
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(out + t * N + begin, scratch->data() + t * rows, rows * sizeof(float));
  }
};

// out (T, N) float = x (T, K) @ W^T, W (N, K) in blocks of `block_bytes` (34: Q8_0, 18: Q4_0).
// Rows go out in chunks through work::Pool (work_pool.h): several per thread, so that a thread
// the OS has descheduled costs the call nothing; a call of under kInlineBytes of weight reads runs
// on the caller alone. W must stay allocated until work::Pool::get().quiesce() (work_pool.h).
constexpr int64_t kInlineBytes = 32 << 10;
constexpr int64_t kChunksPerThread = 8;

inline void matmul(const float* x, const uint8_t* w, float* out, int64_t T, int64_t K, int64_t N,
                   int64_t block_bytes) {
  const int64_t nb = K / kBlock;
  const bool q4 = block_bytes == 2 + kBlock / 2;
  work::Pool& pool = work::Pool::get();
  // the activations, per thread, kept across calls: a worker left behind by an earlier call may
  // still read them, so they are only reallocated (grown) once no worker is inside a chunk
  thread_local std::vector<int8_t> qx_buf, xp_buf;
  thread_local std::vector<float> dx_buf;
  thread_local std::vector<int32_t> corr_buf;
  if (static_cast<size_t>(T * K) > qx_buf.capacity() || static_cast<size_t>(T * nb) > dx_buf.capacity() ||
      (q4 && (static_cast<size_t>(T * K) > xp_buf.capacity() || static_cast<size_t>(T * K / 4) > corr_buf.capacity())))
    pool.quiesce();
  qx_buf.resize(T * K);
  dx_buf.resize(T * nb);
  quantize_rows(x, qx_buf.data(), dx_buf.data(), T, K);
  MatmulJob job{w, qx_buf.data(), nullptr, nullptr, dx_buf.data(), out, T, K, N, nb, block_bytes, N, q4};
#if defined(QUANT_Q4_PAIRS)
  if (q4) {
    xp_buf.resize(T * K);
    corr_buf.resize(T * K / 4);
    pair_layout(qx_buf.data(), xp_buf.data(), corr_buf.data(), T, K);
    job.xp = xp_buf.data();
    job.corr = corr_buf.data();
  }
#endif
  const int64_t reads = nb * block_bytes * N * ((T + kTile - 1) / kTile);
  const int64_t chunks = std::max<int64_t>(1, std::min({reads / kInlineBytes, pool.threads() * kChunksPerThread, N}));
  job.per_chunk = (N + chunks - 1) / chunks;
  pool.run((N + job.per_chunk - 1) / job.per_chunk, job);
}

}  // namespace quant

// pagedecode._cpu.quant_linear(x (T, K) float32, blocks (N, K / 32 * block bytes) uint8, N) -> (T, N) float32
// quiesce=false: the caller keeps the blocks allocated until it calls work::Pool::get().quiesce()
inline at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t n_out, bool quiesce = true) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "quant_linear: x must be (T, K) float32");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() && blocks.size(0) == n_out,
              "quant_linear: blocks must be (N, K / 32 * block bytes) uint8");
  const int64_t T = x.size(0), K = x.size(1);
  TORCH_CHECK(K % quant::kBlock == 0, "quant_linear: K must be a multiple of 32");
  const int64_t block_bytes = blocks.size(1) / (K / quant::kBlock);
  TORCH_CHECK((block_bytes == 34 || block_bytes == 18) && block_bytes * (K / quant::kBlock) == blocks.size(1),
              "quant_linear: blocks are neither Q8_0 (34 bytes) nor Q4_0 (18 bytes) for this K");
  at::Tensor out = at::empty({T, n_out}, x.options());
  if (T > 0 && n_out > 0)
    quant::matmul(x.data_ptr<float>(), blocks.data_ptr<uint8_t>(), out.data_ptr<float>(), T, K, n_out, block_bytes);
  if (quiesce) work::Pool::get().quiesce();     // the caller may free the blocks once this returns
  return out;
}

// rows `ids` of an embedding table (V, K) in Q8_0 / Q4_0 blocks, dequantized: (len(ids), K) float32
inline at::Tensor quant_embedding_rows(const at::Tensor& blocks, const at::Tensor& ids, int64_t K) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() && K % quant::kBlock == 0 &&
                  ids.scalar_type() == at::kLong, "quant_embedding_rows: uint8 blocks, int64 ids, K a multiple of 32");
  const int64_t nb = K / quant::kBlock, block_bytes = blocks.size(1) / nb, T = ids.size(0), V = blocks.size(0);
  TORCH_CHECK(block_bytes == 34 || block_bytes == 18, "quant_embedding_rows: neither Q8_0 nor Q4_0 blocks");
  at::Tensor out = at::empty({T, K}, at::kFloat);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(id[t] >= 0 && id[t] < V, "quant_embedding_rows: token id out of range");
    const uint8_t* row = blocks.data_ptr<uint8_t>() + id[t] * blocks.size(1);
    float* o = out.data_ptr<float>() + t * K;
    int8_t w[quant::kBlock];
    for (int64_t b = 0; b < nb; ++b) {
      quant::unpack_scalar(row + b * block_bytes, block_bytes == 18, w);
      const float d = quant::fp16_to_float(row + b * block_bytes);
      for (int j = 0; j < quant::kBlock; ++j) o[b * quant::kBlock + j] = d * static_cast<float>(w[j]);
    }
  }
  return out;
}
