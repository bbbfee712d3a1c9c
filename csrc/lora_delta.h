// LoRA adapters in the compiled forward: the resident adapters' stacked weights (LoraStack, built
// by pagedecode/lora/stacks.py through model/cpu_forward.py, names shared by lora_projections()),
// the batch's segments (runs of rows under one adapter slot, kernels/lora.py's layout) and the
// delta added after a projection: out[rows of g, col : col + N] += scaling[s] (x A[s]^T) B[s]^T.
// kernels/lora.py's lora_delta_reference is the definition; tests hold this file to it. A decode
// step's short segments (and, in deterministic mode, every segment) take the batched path: each
// shrunk value and each delta summed in one order whatever the rows around it, so a row's delta
// does not depend on its batch. Included by cpu_forward.cpp inside its namespace (Tensor, f32,
// to<T>, work::).
#pragma once

enum LoraProj : int { kLoraQ, kLoraK, kLoraV, kLoraO, kLoraGate, kLoraUp, kLoraDown, kLoraProjs };
const char* const kLoraProjNames[kLoraProjs] = {"q_proj", "k_proj", "v_proj", "o_proj",
                                                "gate_proj", "up_proj", "down_proj"};

// per layer and projection: A (S, R, K), B^T (S, R, N) of the model's dtype (or bfloat16, a
// quantized base's: pagedecode/lora/stacks.py) and scaling (S,) float32;
// all three empty where no resident adapter targets the projection (the forward skips it). ranks
// (S,) int32: each slot's adapter's rank r <= R (A[s, r:] and B^T[s, r:] are zero: not read).
// B is held transposed so that the expand reads each of a rank's N values along the output's
// columns: held as (S, N, R), every call transposed its tiles first, a scalar copy of each value
// read, more instructions than a decode step's few rows then spent multiplying (counted, not timed
// apart; the whole change: docs/lora.md).
struct LoraStack {
  std::vector<std::vector<Tensor>> a, b, scaling;   // [layer][LoraProj]; b: B^T
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
      TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(1) == b.size(1) &&
                      a.is_contiguous() && b.is_contiguous() && a.scalar_type() == b.scalar_type() &&
                      s.dim() == 1 && s.size(0) == a.size(0) && s.scalar_type() == at::kFloat && s.is_contiguous(),
                  "pagedecode._cpu.LoraStack: layer ", i, " ", kLoraProjNames[p],
                  ": A (S, R, K), B^T (S, R, N) contiguous of one dtype, scaling (S,) float32; got ", a.sizes(), " ",
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
      TORCH_CHECK(a.size(2) == n_in[p] && l.b[i][p].size(2) == n_out[p] &&
                      (a.scalar_type() == m.final_norm.scalar_type() || a.scalar_type() == at::kBFloat16),
                  "pagedecode._cpu.forward: layer ", i, " ", kLoraProjNames[p], " LoRA A ", a.sizes(), " / B^T ",
                  l.b[i][p].sizes(), " do not fit the model's (", n_out[p], ", ", n_in[p],
                  ") projection, or are neither of its dtype nor bfloat16");
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

// The projections one add_lora call serves: those that read the same rows x (q | k | v; gate |
// up; o; down), each with the column of `out` its delta starts at. Their shrinks share one pass
// over x's rows and their expands one call on the work pool.
struct LoraTarget {
  int proj;
  int64_t col;
};
constexpr int kLoraMaxTargets = 3;

// A segment the batched path serves: rows lo .. hi of x / out, at `packed` in the call's own copy
// of x's rows and in `shrunk`.
struct LoraPlanSeg {
  int64_t lo, hi, packed;
  int32_t slot, rank;
};

// The dot products x[i] . w[j] of `rows` rows of x and the weight rows [begin, end) (each `in`
// long): float_gemv.h's tiles where built with AVX2 (each output one accumulator in one order,
// whatever the rows beside it), else in order. put(row, j, value).
template <typename AB, typename Put>
bool lora_dots(const float* x, const AB* w, int64_t rows, int64_t in, int64_t begin, int64_t end, work::Live live,
               Put put) {
#if defined(__AVX2__) && defined(__FMA__)
  return fgemv::dots(x, w, rows, in, begin, end, live, put);
#else
  for (int64_t j = begin; j < end; ++j) {
    if (!live()) return false;
    for (int64_t i = 0; i < rows; ++i) {
      float acc = 0.f;
      for (int64_t k = 0; k < in; ++k) acc += x[i * in + k] * f32(w[j * in + k]);
      put(i, j, acc);
    }
  }
  return true;
#endif
}

// shrunk[row, t R + j] = scaling_t[slot] * x[row] . A_t[slot, j] (j < the slot's rank; 0 past it)
// for the columns [c per, (c + 1) per) of P R, every planned row: per segment, its rows against
// A's rows as a gemv's (lora_dots: A read once per segment).
template <typename AB>
struct LoraShrinkJob {
  const float* x;                          // (rows, K): the planned rows, packed, in float
  const AB* a[kLoraMaxTargets];             // (S, R, K)
  const float* scaling[kLoraMaxTargets];   // (S,)
  const LoraPlanSeg* segs;
  float* shrunk;                           // (rows, P R)
  int64_t nsegs, rows, K, R, P, per_chunk;

  bool compute(int64_t c, std::vector<float>* scratch, work::Live live) const {
    const int64_t W = P * R, begin = c * per_chunk, end = std::min(W, begin + per_chunk);
    const auto [o, ld] = work::destination(shrunk, W, rows, begin, end - begin, scratch);
    for (int64_t g = 0; g < nsegs; ++g) {
      const LoraPlanSeg& s = segs[g];
      const int64_t n = s.hi - s.lo;
      for (int64_t t = begin / R; t * R < end; ++t) {
        const int64_t j0 = std::max(begin, t * R) - t * R, j1 = std::min(end, (t + 1) * R) - t * R;
        const int64_t jr = std::min<int64_t>(j1, std::max<int64_t>(j0, s.rank));    // [jr, j1): past the rank
        auto at = [&](int64_t i, int64_t j) -> float& { return o[(s.packed + i) * ld + (t * R + j - begin)]; };
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = jr; j < j1; ++j) at(i, j) = 0.f;
        const float scale = scaling[t][s.slot];
        if (jr > j0 && !lora_dots(x + s.packed * K, a[t] + s.slot * R * K, n, K, j0, jr, live,
                                  [&](int64_t i, int64_t j, float d) { at(i, j) = scale * d; }))
          return false;
      }
    }
    return true;
  }
  void commit(int64_t c, std::vector<float>* scratch) const {
    const int64_t begin = c * per_chunk;
    work::publish(shrunk, P * R, rows, begin, std::min(P * R, begin + per_chunk) - begin, *scratch);
  }
};

// out[row, col_t + n] += sum_j shrunk[row, t R + j] B^T_t[slot, j, n] (j < rank, in order from 0)
// for one chunk of `per` columns of one target: per row, 8 columns at a time in a register, a
// multiply-add per rank along B^T's rows. A chunk's deltas go to a buffer (rows, columns) first:
// a worker's scratch (added by commit) or the caller's own. T: the rows' type; AB: A's and B's.
template <typename T, typename AB>
struct LoraExpandJob {
  const float* shrunk;                     // (rows, P R)
  const AB* b[kLoraMaxTargets];             // B^T (S, R, N_t)
  int64_t n[kLoraMaxTargets], col[kLoraMaxTargets], first_chunk[kLoraMaxTargets + 1];
  const LoraPlanSeg* segs;
  T* out;
  int64_t ldo, nsegs, rows, R, P, per;

  int target(int64_t c) const {
    int t = 0;
    while (c >= first_chunk[t + 1]) ++t;
    return t;
  }
  std::pair<int64_t, int64_t> columns(int t, int64_t c) const {      // (first, count)
    const int64_t n0 = (c - first_chunk[t]) * per;
    return {n0, std::min(n[t], n0 + per) - n0};
  }
  bool compute(int64_t c, std::vector<float>* scratch, work::Live live) const {
    thread_local std::vector<float> own;
    std::vector<float>& d = scratch != nullptr ? *scratch : own;
    const int t = target(c);
    const auto [n0, cols] = columns(t, c);
    d.resize(rows * cols);
    for (int64_t g = 0; g < nsegs; ++g) {
      if (!live()) return false;
      const LoraPlanSeg& s = segs[g];
      const AB* bs = b[t] + s.slot * R * n[t] + n0;          // rank j's columns: bs + j n_t
      for (int64_t i = s.packed; i < s.packed + s.hi - s.lo; ++i) {
        const float* sr = shrunk + i * P * R + t * R;
        float* di = d.data() + i * cols;
        int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
        for (; k + 8 <= cols; k += 8) {
          __m256 acc = _mm256_setzero_ps();
          for (int64_t j = 0; j < s.rank; ++j)
            acc = _mm256_fmadd_ps(_mm256_set1_ps(sr[j]), fgemv::load8(bs + j * n[t] + k), acc);
          _mm256_storeu_ps(di + k, acc);
        }
#endif
        for (; k < cols; ++k) {
          float acc = 0.f;
          for (int64_t j = 0; j < s.rank; ++j) acc = std::fma(sr[j], f32(bs[j * n[t] + k]), acc);
          di[k] = acc;
        }
      }
    }
    if (scratch == nullptr) add(c, d);
    return true;
  }
  void commit(int64_t c, std::vector<float>* scratch) const { add(c, *scratch); }
  void add(int64_t c, const std::vector<float>& d) const {
    const int t = target(c);
    const auto [n0, cols] = columns(t, c);
    for (int64_t g = 0; g < nsegs; ++g)
      for (int64_t i = 0; i < segs[g].hi - segs[g].lo; ++i) {
        T* op = out + (segs[g].lo + i) * ldo + col[t] + n0;
        const float* di = d.data() + (segs[g].packed + i) * cols;
        for (int64_t k = 0; k < cols; ++k) op[k] = to<T>(f32(op[k]) + di[k]);
      }
  }
};

// segments of at most this many rows take the batched path (outside deterministic mode, where
// every segment does); longer ones (a prefill's) at::mm, shrink then expand
constexpr int64_t kLoraRowsLoop = 16;

// out[:, col_t : col_t + N_t] += the delta of each target projection of `layer` for x's rows
// (segments `segs`); x and out contiguous rows. The batched path: the planned segments' rows
// copied once (float, memory this call owns: work_pool.h), every target's shrink in one pool call
// (A read once per segment, not once per row), then every target's expand in one. T: x's and
// out's type; AB: the stack's (T, or bfloat16 under a quantized base: half the bytes a step reads).
template <typename T, typename AB>
void add_lora_as(Tensor& out, const Tensor& x, const LoraStack& l, int64_t layer,
              std::initializer_list<LoraTarget> targets, const std::vector<LoraSegment>& segs, bool det, bool pool) {
  std::vector<LoraTarget> live;
  for (const LoraTarget& t : targets)
    if (l.a[layer][t.proj].defined()) live.push_back(t);
  if (live.empty()) return;
  TORCH_CHECK(live.size() <= kLoraMaxTargets && x.stride(1) == 1 && out.stride(1) == 1,
              "pagedecode._cpu.forward: LoRA rows");
  const int32_t* ranks = l.ranks.data_ptr<int32_t>();
  const Tensor& a0 = l.a[layer][live[0].proj];
  const int64_t R = a0.size(1), K = a0.size(2), ldx = x.stride(0), ldo = out.stride(0);
  TORCH_CHECK(x.size(1) == K, "pagedecode._cpu.forward: LoRA rows of ", x.size(1), " inputs, A of ", K);
  std::vector<LoraPlanSeg> plan;
  int64_t packed = 0;
  for (const LoraSegment& s : segs) {
    const int64_t rows = s.hi - s.lo, r = s.slot < 0 ? 0 : std::min<int64_t>(ranks[s.slot], R);
    if (rows == 0 || r <= 0) continue;
    if (det || rows <= kLoraRowsLoop) {
      plan.push_back({s.lo, s.hi, packed, s.slot, static_cast<int32_t>(r)});
      packed += rows;
      continue;
    }
    const Tensor xs = x.narrow(0, s.lo, rows);
    for (const LoraTarget& t : live) {
      const Tensor& bt = l.b[layer][t.proj];                                                // B^T (S, R, N)
      const Tensor a = l.a[layer][t.proj][s.slot].narrow(0, 0, r).to(xs.scalar_type());
      const Tensor shrunk = at::mm(xs, a.t());                                              // (rows, r)
      const Tensor delta = at::mm(shrunk, bt[s.slot].narrow(0, 0, r).to(xs.scalar_type()));     // (rows, N)
      const float scale = l.scaling[layer][t.proj].data_ptr<float>()[s.slot];
      out.narrow(0, s.lo, rows).narrow(1, t.col, bt.size(2)).add_(delta, scale);
    }
  }
  if (plan.empty()) return;
  const int64_t P = static_cast<int64_t>(live.size()), W = P * R, rows = packed;
  work::Keep keep{x, out};
  for (const LoraTarget& t : live) {
    keep.push_back(l.a[layer][t.proj]);
    keep.push_back(l.b[layer][t.proj]);
    keep.push_back(l.scaling[layer][t.proj]);
  }
  const int64_t o_shrunk = work::lines(rows * K * 4), o_plan = o_shrunk + work::lines(rows * W * 4);
  unsigned char* mem = work::owned(keep, o_plan + static_cast<int64_t>(plan.size() * sizeof(LoraPlanSeg)));
  float* xf = reinterpret_cast<float*>(mem);
  float* shrunk = reinterpret_cast<float*>(mem + o_shrunk);
  LoraPlanSeg* segp = reinterpret_cast<LoraPlanSeg*>(mem + o_plan);
  std::memcpy(segp, plan.data(), plan.size() * sizeof(LoraPlanSeg));
  const T* xp = x.data_ptr<T>();
  for (const LoraPlanSeg& s : plan)
    for (int64_t i = 0; i < s.hi - s.lo; ++i)
      for (int64_t k = 0; k < K; ++k) xf[(s.packed + i) * K + k] = f32(xp[(s.lo + i) * ldx + k]);

  const int64_t threads = work::Pool::get().threads();
  LoraShrinkJob<AB> shrink{xf, {}, {}, segp, shrunk, static_cast<int64_t>(plan.size()), rows, K, R, P, 1};
  LoraExpandJob<T, AB> expand{shrunk, {}, {}, {}, {}, segp, out.data_ptr<T>(), ldo, static_cast<int64_t>(plan.size()),
                          rows, R, P, 64};
  int64_t reads = 0;
  for (int64_t t = 0; t < P; ++t) {
    const int p = live[t].proj;
    shrink.a[t] = l.a[layer][p].data_ptr<AB>();
    shrink.scaling[t] = l.scaling[layer][p].data_ptr<float>();
    expand.b[t] = l.b[layer][p].data_ptr<AB>();
    expand.n[t] = l.b[layer][p].size(2);
    expand.col[t] = live[t].col;
    reads += (K + expand.n[t]) * R * static_cast<int64_t>(plan.size()) * static_cast<int64_t>(sizeof(AB));
  }
  // expand chunks of 64 columns, wider where a model's widths would make more than ~128
  int64_t n_all = 0;
  for (int64_t t = 0; t < P; ++t) n_all += (expand.n[t] + 63) / 64;
  expand.per = 64 * ((n_all + 127) / 128);
  for (int64_t t = 0; t < P; ++t)
    expand.first_chunk[t + 1] = expand.first_chunk[t] + (expand.n[t] + expand.per - 1) / expand.per;
  // On the Pool (work_pool.h: the caller never waits on a descheduled worker) where the layer's
  // matmuls run there (pool: a gemv's few rows, a float model's up to kGemvRowsUnpacked), ~4
  // chunks a thread; on the caller alone for a call of few bytes (the hand-off costs more) and
  // where the base matmuls run on OpenMP's threads (from work::kOpenMPRows rows): these calls are
  // tens of microseconds, 2 per add_lora, and a fork-join each would wait on any descheduled
  // thread (or a second pool would spin beside OpenMP's: work_pool.h). Measured on 2 loaded cores
  // (load ~15), 16 requests over 4 adapters, one run: 2.6x the base's time with OpenMP here. On
  // the caller alone beside a float model's pooled matmuls, the same batch cost +28% over the base.
  if (reads < (32 << 10) || (rows >= work::kOpenMPRows && !pool)) {
    for (int64_t c = 0; c < W; ++c) shrink.compute(c, nullptr, work::Live{nullptr, 0});
    for (int64_t c = 0; c < expand.first_chunk[P]; ++c) expand.compute(c, nullptr, work::Live{nullptr, 0});
    return;
  }
  shrink.per_chunk = std::max<int64_t>(1, (W + 4 * threads - 1) / (4 * threads));
  work::Pool::get().run((W + shrink.per_chunk - 1) / shrink.per_chunk, shrink, keep);
  work::Pool::get().run(expand.first_chunk[P], expand, std::move(keep));
}

template <typename T>
void add_lora(Tensor& out, const Tensor& x, const LoraStack& l, int64_t layer,
              std::initializer_list<LoraTarget> targets, const std::vector<LoraSegment>& segs, bool det,
              bool pool) {
  for (const LoraTarget& t : targets) {
    const Tensor& a = l.a[layer][t.proj];
    if (!a.defined()) continue;                    // the stack's projections share one dtype
    if constexpr (!std::is_same_v<T, c10::BFloat16>)
      if (a.scalar_type() == at::kBFloat16)
        return add_lora_as<T, c10::BFloat16>(out, x, l, layer, targets, segs, det, pool);
    return add_lora_as<T, T>(out, x, l, layer, targets, segs, det, pool);
  }
}
