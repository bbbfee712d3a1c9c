// The CPU forward pass of a Llama layer stack in one call (pagedecode._cpu).
//
// What it replaces: on the torch path one decode step of a small model is ~18 torch ops per
// layer, each a few microseconds of Python and dispatch, plus a per-step gather of every decode
// sequence's context into a contiguous tensor. Here the matmuls stay with ATen (MKL / oneDNN,
// bf16 on AVX-512-BF16 / AMX where the machine has it), and everything between them -- RMSNorm,
// RoPE, the KV write, paged attention reading the pages in place, SiLU x up, the residual adds --
// is a plain loop. The torch path in pagedecode/model/llama.py stays the oracle: tests hold this
// file to it.
//
// Layout (see pagedecode/model/batch.py): T packed token rows, sequences own cu_q[s]:cu_q[s+1],
// a sequence with n new rows and seq_len tokens after the write has cached = seq_len - n, and its
// row i sits at position cached + i and attends positions 0 .. cached + i.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using at::Tensor;

template <typename T> inline float f32(T x) { return static_cast<float>(x); }

// out = rmsnorm(x) * w, per row of width n, computed in float like HF (x.float(), then cast).
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * n;
    float ss = 0.f;
    for (int64_t j = 0; j < n; ++j) ss += f32(xr[j]) * f32(xr[j]);
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    T* o = out + r * n;
    for (int64_t j = 0; j < n; ++j) o[j] = static_cast<T>(f32(w[j]) * static_cast<T>(f32(xr[j]) * inv));
  }
}

// In place on the (T, (H + 2 Hkv) D) qkv rows: rotate q and k heads ("rotate half", with the
// signed-sin table of kernels/rope.py), then write k and v to their cache slots.
template <typename T>
void rope_and_write(T* qkv, int64_t rows, int64_t H, int64_t Hkv, int64_t D, const float* cos,
                    const float* sin, const int64_t* pos, const int64_t* slots, T* kc, T* vc) {
  const int64_t width = (H + 2 * Hkv) * D, half = D / 2;
  std::vector<float> tmp(D);
  for (int64_t r = 0; r < rows; ++r) {
    T* row = qkv + r * width;
    const float* c = cos + pos[r] * D;
    const float* s = sin + pos[r] * D;
    for (int64_t h = 0; h < H + Hkv; ++h) {
      T* x = row + h * D;
      for (int64_t d = 0; d < D; ++d) tmp[d] = f32(x[d]) * c[d] + f32(x[(d + half) % D]) * s[d];
      for (int64_t d = 0; d < D; ++d) x[d] = static_cast<T>(tmp[d]);
    }
    const int64_t slot = slots[r];
    std::copy(row + H * D, row + (H + Hkv) * D, kc + slot * Hkv * D);
    std::copy(row + (H + Hkv) * D, row + width, vc + slot * Hkv * D);
  }
}

// Paged attention over the cache, in place: every (row, kv head) pair walks its sequence's
// pages once for the G query heads that share that kv head. Scores and softmax in float.
template <typename T>
void paged_attention(const T* qkv, int64_t q_stride, const T* kc, const T* vc, const int32_t* pt,
                     int64_t pt_stride, const int32_t* lens, const int32_t* cu, int64_t S,
                     int64_t page_size, int64_t H, int64_t Hkv, int64_t D, float scale, T* out) {
  const int64_t G = H / Hkv;
  std::vector<int64_t> row_seq(cu[S]);
  for (int64_t s = 0; s < S; ++s)
    for (int64_t r = cu[s]; r < cu[s + 1]; ++r) row_seq[r] = s;
  const int64_t items = static_cast<int64_t>(cu[S]) * Hkv;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(G * D), qf(G * D);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t r = it / Hkv, kvh = it % Hkv, s = row_seq[r];
      const int64_t n_new = cu[s + 1] - cu[s];
      const int64_t visible = lens[s] - n_new + (r - cu[s]) + 1;       // positions 0 .. cached + i
      scores.resize(G * visible);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = f32(qkv[r * q_stride + (kvh * G + g) * D + d]) * scale;
      const int32_t* pages = pt + s * pt_stride;
      std::vector<float> mx(G, -std::numeric_limits<float>::infinity());
      for (int64_t p = 0; p < visible; ++p) {
        const T* k = kc + ((static_cast<int64_t>(pages[p / page_size]) * page_size + p % page_size) * Hkv + kvh) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * f32(k[d]);
          scores[g * visible + p] = dot;
          mx[g] = std::max(mx[g], dot);
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::vector<float> denom(G, 0.f);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t p = 0; p < visible; ++p) {
          const float e = std::exp(scores[g * visible + p] - mx[g]);
          scores[g * visible + p] = e;
          denom[g] += e;
        }
      for (int64_t p = 0; p < visible; ++p) {
        const T* v = vc + ((static_cast<int64_t>(pages[p / page_size]) * page_size + p % page_size) * Hkv + kvh) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float w = scores[g * visible + p];
          float* a = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) a[d] += w * f32(v[d]);
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          out[r * H * D + (kvh * G + g) * D + d] = static_cast<T>(acc[g * D + d] / denom[g]);
    }
  });
}

// h += x (the residual add), then out = rmsnorm(h) * w: one pass over the rows.
template <typename T>
void add_then_norm(T* h, const T* x, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  for (int64_t i = 0; i < rows * n; ++i) h[i] = static_cast<T>(f32(h[i]) + f32(x[i]));
  if (w != nullptr) rms_norm_rows(h, w, out, rows, n, eps);
}

template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t I) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * 2 * I;
    const T* u = g + I;
    for (int64_t j = 0; j < I; ++j) {
      const float x = f32(g[j]);
      // F.silu rounds to T before the multiply, as the torch path does
      out[r * I + j] = static_cast<T>(f32(static_cast<T>(x / (1.f + std::exp(-x)))) * f32(u[j]));
    }
  }
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "pagedecode._cpu.forward: ", what); }

// Rows at most this many go through gemv below: for a decode step of a few sequences a dot product
// per output beats the BLAS call's setup on small layers, and reads a large layer's weights at
// memory speed (for bf16, half the bytes of float32, converted in registers).
constexpr int64_t kGemvRows = 4;

template <typename T>
void gemv(const T* x, const T* w, const T* b, T* out, int64_t rows, int64_t in, int64_t n_out) {
  const int64_t grain = std::max<int64_t>(16, (int64_t{1} << 16) / std::max<int64_t>(in, 1));
  at::parallel_for(0, n_out, grain, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const T* wj = w + j * in;
      for (int64_t r = 0; r < rows; ++r) {
        const T* xr = x + r * in;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t k = 0; k < in; ++k) dot += f32(xr[k]) * f32(wj[k]);
        out[r * n_out + j] = static_cast<T>(b != nullptr ? dot + f32(b[j]) : dot);
      }
    }
  });
}

template <typename T>
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b) {
  const bool bias = b.defined() && b.numel() > 0;
  if (x.size(0) <= kGemvRows && x.is_contiguous()) {
    Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
    gemv(x.data_ptr<T>(), w.data_ptr<T>(), bias ? b.data_ptr<T>() : nullptr, out.data_ptr<T>(), x.size(0),
         x.size(1), w.size(0));
    return out;
  }
  return bias ? at::addmm(b, x, w.t()) : at::mm(x, w.t());
}

// layers: for each layer, in order: ln1, qkv_w, qkv_b, o_w, o_b, ln2, gate_up_w, down_w
// (an absent bias is an empty tensor). k_cache, v_cache: (layers, pages, page_size, Hkv, D).
template <typename T>
Tensor forward_impl(const Tensor& ids, const Tensor& positions, const Tensor& slot_mapping,
                    const Tensor& page_table, const Tensor& seq_lens, const Tensor& cu_q,
                    const Tensor& logits_indices, const Tensor& embed, const Tensor& final_norm,
                    const Tensor& lm_head, const Tensor& cos, const Tensor& sin,
                    const std::vector<Tensor>& layers, const Tensor& k_cache, const Tensor& v_cache,
                    int64_t H, int64_t Hkv, int64_t D, double eps_d, double scale_d) {
  const float eps = static_cast<float>(eps_d), scale = static_cast<float>(scale_d);
  const int64_t T_ = ids.size(0), hidden = embed.size(1), S = seq_lens.size(0);
  const int64_t page_size = k_cache.size(2), per_layer = k_cache[0].numel();
  const auto opts = embed.options();
  Tensor h = embed.index_select(0, ids);                                  // (T, hidden)
  Tensor x = at::empty({T_, hidden}, opts);
  Tensor attn = at::empty({T_, H * D}, opts);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  T* hp = h.data_ptr<T>();
  const int64_t n_layers = static_cast<int64_t>(layers.size() / 8);
  rms_norm_rows(hp, layers[0].data_ptr<T>(), x.data_ptr<T>(), T_, hidden, eps);
  for (int64_t i = 0; i < n_layers; ++i) {
    const Tensor* L = layers.data() + 8 * i;
    Tensor qkv = linear<T>(x, L[1], L[2]).contiguous();                     // (T, (H + 2 Hkv) D)
    T* kc = k_cache.data_ptr<T>() + i * per_layer;
    T* vc = v_cache.data_ptr<T>() + i * per_layer;
    rope_and_write(qkv.data_ptr<T>(), T_, H, Hkv, D, cos.data_ptr<float>(), sin.data_ptr<float>(), pos,
                   slots, kc, vc);
    paged_attention(qkv.data_ptr<T>(), qkv.size(1), kc, vc, page_table.data_ptr<int32_t>(), page_table.size(1),
                    seq_lens.data_ptr<int32_t>(), cu_q.data_ptr<int32_t>(), S, page_size, H, Hkv, D, scale,
                    attn.data_ptr<T>());
    Tensor o = linear<T>(attn, L[3], L[4]);
    add_then_norm(hp, o.data_ptr<T>(), L[5].data_ptr<T>(), x.data_ptr<T>(), T_, hidden, eps);
    Tensor gate_up = linear<T>(x, L[6], Tensor());                               // (T, 2 I)
    const int64_t I = L[7].size(1);
    Tensor act = at::empty({T_, I}, opts);
    silu_mul(gate_up.data_ptr<T>(), act.data_ptr<T>(), T_, I);
    Tensor down = linear<T>(act, L[7], Tensor());
    const T* next_ln = i + 1 < n_layers ? layers[8 * (i + 1)].data_ptr<T>() : nullptr;
    add_then_norm(hp, down.data_ptr<T>(), next_ln, x.data_ptr<T>(), T_, hidden, eps);
  }
  Tensor last = h.index_select(0, logits_indices);
  Tensor normed = at::empty_like(last);
  rms_norm_rows(last.data_ptr<T>(), final_norm.data_ptr<T>(), normed.data_ptr<T>(), last.size(0), hidden, eps);
  return linear<T>(normed, lm_head, Tensor()).to(at::kFloat);
}

Tensor forward(Tensor ids, Tensor positions, Tensor slot_mapping, Tensor page_table, Tensor seq_lens,
               Tensor cu_q, Tensor logits_indices, Tensor embed, Tensor final_norm, Tensor lm_head,
               Tensor cos, Tensor sin, std::vector<Tensor> layers, Tensor k_cache, Tensor v_cache,
               int64_t H, int64_t Hkv, int64_t D, double eps, double scale) {
  check(layers.size() % 8 == 0 && !layers.empty(), "layers must hold 8 tensors per layer");
  check(ids.dtype() == at::kLong && positions.dtype() == at::kLong && slot_mapping.dtype() == at::kLong &&
            logits_indices.dtype() == at::kLong, "ids, positions, slot_mapping, logits_indices must be int64");
  check(page_table.dtype() == at::kInt && seq_lens.dtype() == at::kInt && cu_q.dtype() == at::kInt,
        "page_table, seq_lens, cu_q must be int32");
  check(cos.dtype() == at::kFloat && sin.dtype() == at::kFloat, "rope tables must be float32");
  check(k_cache.is_contiguous() && v_cache.is_contiguous() && page_table.is_contiguous(), "caches must be contiguous");
  check(k_cache.dtype() == embed.dtype(), "cache and weights must share a dtype");
  check(D % 2 == 0 && H % Hkv == 0, "head_dim must be even and heads a multiple of kv heads");
  for (const auto& t : layers) check(t.numel() == 0 || t.is_contiguous(), "weights must be contiguous");
  if (embed.scalar_type() == at::kFloat)
    return forward_impl<float>(ids, positions, slot_mapping, page_table, seq_lens, cu_q, logits_indices, embed,
                               final_norm, lm_head, cos, sin, layers, k_cache, v_cache, H, Hkv, D, eps, scale);
  check(embed.scalar_type() == at::kBFloat16, "weights must be float32 or bfloat16");
  return forward_impl<at::BFloat16>(ids, positions, slot_mapping, page_table, seq_lens, cu_q, logits_indices,
                                    embed, final_norm, lm_head, cos, sin, layers, k_cache, v_cache, H, Hkv, D,
                                    eps, scale);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "Llama forward over the paged KV cache, CPU (see csrc/cpu_forward.cpp)");
}
