// LoRA adapters in the compiled forward: the resident adapters' stacked weights (LoraStack, built
// by pagedecode/lora/stacks.py through model/cpu_forward.py, names shared by lora_projections()),
// the batch's segments (runs of rows under one adapter slot, kernels/lora.py's layout) and the
// delta added after a projection: out[rows of g, col : col + N] += scaling[s] (x A[s]^T) B[s]^T.
// kernels/lora.py's lora_delta_reference is the definition; tests hold this file to it. In
// deterministic mode shrink and expand go through det_linear (one order per output whatever the
// rows around them). Included by cpu_forward.cpp inside its namespace (for det_linear, Tensor).
#pragma once

enum LoraProj : int { kLoraQ, kLoraK, kLoraV, kLoraO, kLoraGate, kLoraUp, kLoraDown, kLoraProjs };
const char* const kLoraProjNames[kLoraProjs] = {"q_proj", "k_proj", "v_proj", "o_proj",
                                                "gate_proj", "up_proj", "down_proj"};

// per layer and projection: A (S, R, K), B (S, N, R) of the model's dtype and scaling (S,) float32;
// all three empty where no resident adapter targets the projection (the forward skips it). ranks
// (S,) int32: each slot's adapter's rank r <= R (A[s, r:] and B[s, :, r:] are zero: not read).
struct LoraStack {
  std::vector<std::vector<Tensor>> a, b, scaling;   // [layer][LoraProj]
  Tensor ranks;
  int64_t slots = 0;
};

// each layer as a list of [A, B, scaling] per projection, in kLoraProjNames' order
LoraStack make_lora_stack(const std::vector<std::vector<Tensor>>& layers, const Tensor& ranks) {
  LoraStack out;
  out.ranks = ranks;
  for (size_t i = 0; i < layers.size(); ++i) {
    const std::vector<Tensor>& L = layers[i];
    TORCH_CHECK(L.size() == 3 * kLoraProjs, "pagedecode._cpu.LoraStack: layer ", i, " holds ", L.size(),
                " tensors, expected A, B, scaling for each of ", static_cast<int>(kLoraProjs), " projections");
    out.a.emplace_back(kLoraProjs);
    out.b.emplace_back(kLoraProjs);
    out.scaling.emplace_back(kLoraProjs);
    for (int p = 0; p < kLoraProjs; ++p) {
      const Tensor &a = L[3 * p], &b = L[3 * p + 1], &s = L[3 * p + 2];
      if (a.numel() == 0) continue;
      TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(1) == b.size(2) &&
                      a.is_contiguous() && b.is_contiguous() && a.scalar_type() == b.scalar_type() &&
                      s.dim() == 1 && s.size(0) == a.size(0) && s.scalar_type() == at::kFloat && s.is_contiguous(),
                  "pagedecode._cpu.LoraStack: layer ", i, " ", kLoraProjNames[p],
                  ": A (S, R, K), B (S, N, R) contiguous of one dtype, scaling (S,) float32; got ", a.sizes(), " ",
                  b.sizes(), " ", s.sizes());
      TORCH_CHECK(out.slots == 0 || out.slots == a.size(0), "pagedecode._cpu.LoraStack: slot counts differ");
      out.slots = a.size(0);
      TORCH_CHECK(ranks.dim() == 1 && ranks.size(0) == out.slots && ranks.scalar_type() == at::kInt &&
                      ranks.is_contiguous() && ranks.device().is_cpu(),
                  "pagedecode._cpu.LoraStack: ranks must be (", out.slots, ",) int32 on the host");
      out.a[i][p] = a;
      out.b[i][p] = b;
      out.scaling[i][p] = s;
    }
  }
  return out;
}

// every targeted projection's A and B against the model's shapes and dtype
void check_lora_stack(const Stack& m, const LoraStack& l) {
  TORCH_CHECK(static_cast<int64_t>(l.a.size()) == static_cast<int64_t>(m.layers.size()),
              "pagedecode._cpu.forward: the LoraStack holds ", l.a.size(), " layers, the model ", m.layers.size());
  const int64_t q = m.H * m.D, kv = m.Hkv * m.D;
  const int64_t n_out[kLoraProjs] = {q, kv, kv, m.hidden, m.inter, m.inter, m.hidden};
  const int64_t n_in[kLoraProjs] = {m.hidden, m.hidden, m.hidden, q, m.hidden, m.hidden, m.inter};
  for (size_t i = 0; i < l.a.size(); ++i)
    for (int p = 0; p < kLoraProjs; ++p) {
      const Tensor& a = l.a[i][p];
      if (!a.defined()) continue;
      TORCH_CHECK(a.size(2) == n_in[p] && l.b[i][p].size(1) == n_out[p] &&
                      a.scalar_type() == m.final_norm.scalar_type(),
                  "pagedecode._cpu.forward: layer ", i, " ", kLoraProjNames[p], " LoRA A ", a.sizes(), " / B ",
                  l.b[i][p].sizes(), " do not fit the model's (", n_out[p], ", ", n_in[p], ") projection or dtype");
    }
}

struct LoraSegment {
  int64_t lo, hi;
  int32_t slot;                // -1: rows without an adapter
};

// kernels/lora.py's segments, checked: they tile rows 0 .. rows in order, each slot in [-1, slots)
std::vector<LoraSegment> lora_segments(const Tensor& seg_starts, const Tensor& seg_slots, int64_t rows, int64_t slots) {
  TORCH_CHECK(seg_starts.dtype() == at::kInt && seg_slots.dtype() == at::kInt && seg_starts.dim() == 1 &&
                  seg_slots.dim() == 1 && seg_starts.numel() == seg_slots.numel() + 1,
              "pagedecode._cpu.forward: seg_starts (G + 1,) and seg_slots (G,) int32");
  const Tensor starts = seg_starts.contiguous(), slot_of = seg_slots.contiguous();
  const int32_t* st = starts.data_ptr<int32_t>();
  const int32_t* sl = slot_of.data_ptr<int32_t>();
  const int64_t G = slot_of.numel();
  TORCH_CHECK(st[0] == 0 && st[G] == rows, "pagedecode._cpu.forward: LoRA segments must run from row 0 to ", rows);
  std::vector<LoraSegment> out;
  for (int64_t g = 0; g < G; ++g) {
    TORCH_CHECK(st[g + 1] >= st[g] && sl[g] >= -1 && sl[g] < slots, "pagedecode._cpu.forward: LoRA segment ", g,
                " (rows ", st[g], "..", st[g + 1], ", slot ", sl[g], ") is out of order or names no slot of ", slots);
    out.push_back({st[g], st[g + 1], sl[g]});
  }
  return out;
}

// the segments of the rows `picked` (last_rows_only's logits rows, in order): runs of equal slot
std::vector<LoraSegment> lora_segments_of_rows(const std::vector<LoraSegment>& segs, const Tensor& picked) {
  const int64_t* r = picked.data_ptr<int64_t>();
  std::vector<LoraSegment> out;
  for (int64_t i = 0; i < picked.numel(); ++i) {
    int32_t slot = -1;
    for (const LoraSegment& s : segs)
      if (r[i] >= s.lo && r[i] < s.hi) slot = s.slot;
    if (!out.empty() && out.back().slot == slot) out.back().hi = i + 1;
    else out.push_back({i, i + 1, slot});
  }
  return out;
}

// What one forward applies: the stack, and the segments of all rows and of last_rows_only's rows.
struct LoraRun {
  const LoraStack* stack = nullptr;
  std::vector<LoraSegment> all, last;
};

// One row's delta as plain loops: shrunk[j] = scale * x . A[j] for j < r (each a dot over K, in
// float), then out[n] += shrunk . B[n, :r]. Each row alone, in one order whatever the rows around
// it: deterministic mode's delta, and the default's for short segments (a decode step's), where
// ATen's per-call cost (views, dispatch) exceeded the arithmetic several times over.
template <typename T>
void lora_row(const T* x, const T* a, const T* b, int64_t r, int64_t R, int64_t K, int64_t N, float scale,
              T* out, float* shrunk) {
  for (int64_t j = 0; j < r; ++j) {
    const T* aj = a + j * K;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t k = 0; k < K; ++k) acc += f32(x[k]) * f32(aj[k]);
    shrunk[j] = scale * acc;
  }
  for (int64_t n = 0; n < N; ++n) {
    const T* bn = b + n * R;
    float acc = 0.f;
    for (int64_t j = 0; j < r; ++j) acc += shrunk[j] * f32(bn[j]);
    out[n] = to<T>(f32(out[n]) + acc);
  }
}

// segments of at most this many rows take lora_row (outside deterministic mode); longer ones at::mm
constexpr int64_t kLoraRowsLoop = 16;

// out[:, col : col + N] += the delta of projection p of `layer` for x's rows (segments `segs`);
// x and out contiguous rows
template <typename T>
void add_lora(Tensor& out, int64_t col, const Tensor& x, const LoraStack& l, int64_t layer, int p,
              const std::vector<LoraSegment>& segs, bool det) {
  const Tensor& a = l.a[layer][p];
  if (!a.defined()) return;
  const Tensor& b = l.b[layer][p];
  const float* scaling = l.scaling[layer][p].data_ptr<float>();
  const int32_t* ranks = l.ranks.data_ptr<int32_t>();
  const int64_t R = a.size(1), K = a.size(2), N = b.size(1), ldx = x.stride(0), ldo = out.stride(0);
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && x.size(1) == K, "pagedecode._cpu.forward: LoRA rows");
  for (const LoraSegment& s : segs) {
    const int64_t rows = s.hi - s.lo, r = s.slot < 0 ? 0 : std::min<int64_t>(ranks[s.slot], R);
    if (rows == 0 || r <= 0) continue;
    const T* as = a.data_ptr<T>() + s.slot * R * K;                        // (R, K)
    const T* bs = b.data_ptr<T>() + s.slot * N * R;                        // (N, R)
    const float scale = scaling[s.slot];
    if (det || rows <= kLoraRowsLoop) {
      const T* xp = x.data_ptr<T>() + s.lo * ldx;
      T* op = out.data_ptr<T>() + s.lo * ldo + col;
      at::parallel_for(0, rows, det ? 8 : kLoraRowsLoop, [&](int64_t lo, int64_t hi) {
        std::vector<float> shrunk(r);
        for (int64_t i = lo; i < hi; ++i) lora_row(xp + i * ldx, as, bs, r, R, K, N, scale, op + i * ldo, shrunk.data());
      });
      continue;
    }
    const Tensor xs = x.narrow(0, s.lo, rows);
    const Tensor shrunk = at::mm(xs, a[s.slot].narrow(0, 0, r).t());                 // (rows, r)
    const Tensor delta = at::mm(shrunk, b[s.slot].narrow(1, 0, r).t());              // (rows, N)
    out.narrow(0, s.lo, rows).narrow(1, col, N).add_(delta, scale);
  }
}
