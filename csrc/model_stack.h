// The model as the compiled forward reads it: a layer's tensors by named slot (shared with
// model/cpu_forward.py through layer_slots()), the Stack of a model's weights with every shape
// checked once where it is built, and the checks of a batch's indices before any kernel reads
// through them. Included by cpu_forward.cpp inside its namespace (for Tensor and quant_blocks).
#pragma once

// One layer's tensors by slot: forward() takes each layer as a list in this order, which
// model/cpu_forward.py builds by these names (layer_slots(), compared with its own at import).
enum Slot : int {
  kLn1, kQkvW, kQkvB, kOW, kOB, kLn2, kGateUpW, kDownW,   // the layer (weights float or Q8_0 / Q4_0 blocks)
  kQkvT, kOT, kGateUpT, kDownT,                             // a small layer's weights transposed (gemv_transposed)
  kQkvPacked, kOPacked, kGateUpPacked, kDownPacked,         // packed for the mode's matmul (oneDNN's or det::pack's)
  kQW, kKW, kVW, kGateW, kUpW,                              // a stacked projection's parts, each in its own block type
  kSlots                                                    // also "no such slot" (gate_up and down have no bias)
};
const char* const kSlotNames[kSlots] = {"ln1", "qkv_w", "qkv_b", "o_w", "o_b", "ln2", "gate_up_w", "down_w",
                                        "qkv_t", "o_t", "gate_up_t", "down_t",
                                        "qkv_packed", "o_packed", "gate_up_packed", "down_packed",
                                        "q_w", "k_w", "v_w", "gate_w", "up_w"};

// a projection's slots: weight, bias, transposed and packed copies, and the parts of a stacked one
// (q | k | v, gate | up: kSlots where it has fewer). A K-quant mix (llama.cpp's Q4_K_M gives attn_v
// more bits than attn_q / attn_k) cannot stack its parts into one block type: its w is then empty
// and each part, quantized in its own type, is multiplied on its own into its columns (linear_parts).
struct Proj {
  Slot w, b, t, packed;
  Slot parts[3];
};
constexpr Proj kQkv{kQkvW, kQkvB, kQkvT, kQkvPacked, {kQW, kKW, kVW}}, kO{kOW, kOB, kOT, kOPacked, {kSlots, kSlots, kSlots}};
constexpr Proj kGateUp{kGateUpW, kSlots, kGateUpT, kGateUpPacked, {kGateW, kUpW, kSlots}},
    kDown{kDownW, kSlots, kDownT, kDownPacked, {kSlots, kSlots, kSlots}};

// whether a layer holds projection p as its parts (an empty w; make_stack checked the parts)
inline bool in_parts(const std::vector<Tensor>& L, const Proj& p) {
  return p.parts[0] != kSlots && L[p.w].numel() == 0;
}

// The weights and shapes of a model, as forward() reads them: built once per packing
// (model/cpu_forward.py) and checked here, so a tensor that disagrees with the shapes is refused
// with its name before anything indexes it. An empty tensor: an absent bias, transposed or packed copy.
struct Stack {
  std::vector<std::vector<Tensor>> layers;   // per layer, by Slot
  Tensor embed, final_norm, lm_head, lm_head_t, lm_head_packed;
  Tensor cos, sin;                           // (positions, D) float32
  int64_t H, Hkv, D, hidden, inter, vocab;
  double eps, scale;
};

std::string slot_name(int64_t layer, int slot) { return "layer " + std::to_string(layer) + " " + kSlotNames[slot]; }

// w (n_out, in): the model's dtype, contiguous, or Q8_0 / Q4_0 blocks for `in` inputs
void check_weight(const Tensor& w, int64_t n_out, int64_t in, at::ScalarType t, const std::string& what) {
  if (quant_blocks(w)) {
    if (quant::other_type(w, in, what.c_str()) == nullptr)   // (N, blocks, type size): Q4_1 ... Q6_K
      quant::check_blocks(w, in, what.c_str());
    TORCH_CHECK(w.size(0) == n_out, "pagedecode._cpu.Stack: ", what, " holds ", w.size(0), " rows, expected ", n_out);
    return;
  }
  TORCH_CHECK(w.dim() == 2 && w.size(0) == n_out && w.size(1) == in && w.scalar_type() == t && w.is_contiguous(),
              "pagedecode._cpu.Stack: ", what, " must be (", n_out, ", ", in, ") ", t, " contiguous, got ", w.sizes(),
              " ", w.scalar_type());
}

// an optional vector (n,) of the model's dtype (biases, norms when required)
void check_vector(const Tensor& v, int64_t n, at::ScalarType t, bool required, const std::string& what) {
  if (!required && v.numel() == 0) return;
  TORCH_CHECK(v.dim() == 1 && v.size(0) == n && v.scalar_type() == t && v.is_contiguous(),
              "pagedecode._cpu.Stack: ", what, " must be (", n, ",) ", t, ", got ", v.sizes(), " ", v.scalar_type());
}

// a weight's optional copies: transposed (in, n_out), packed by oneDNN (opaque: its sizes) or det::pack
void check_copies(const Tensor& w, const Tensor& wt, const Tensor& packed, int64_t n_out, int64_t in,
                  const std::string& what) {
  TORCH_CHECK(wt.numel() == 0 || (!quant_blocks(w) && wt.dim() == 2 && wt.size(0) == in && wt.size(1) == n_out &&
                                  wt.scalar_type() == w.scalar_type() && wt.is_contiguous()),
              "pagedecode._cpu.Stack: ", what, " transposed must be (", in, ", ", n_out, "), got ", wt.sizes());
  TORCH_CHECK(!packed.is_mkldnn() || (packed.dim() == 2 && packed.size(0) == n_out && packed.size(1) == in),
              "pagedecode._cpu.Stack: ", what, " packed by oneDNN must be (", n_out, ", ", in, "), got ", packed.sizes());
}

// a stacked projection held as its parts (in_parts): each part quantized, (rows[j], in) in its own block
// type; no transposed or packed copy of the whole (those are float weights')
void check_parts(const std::vector<Tensor>& L, const Proj& p, const std::vector<int64_t>& rows, int64_t in,
                 at::ScalarType t, int64_t layer) {
  TORCH_CHECK(L[p.t].numel() == 0 && L[p.packed].numel() == 0, "pagedecode._cpu.Stack: ",
              slot_name(layer, p.w), " held as its parts takes no transposed or packed copy");
  for (size_t j = 0; j < rows.size(); ++j) {
    const Tensor& w = L[p.parts[j]];
    TORCH_CHECK(w.numel() > 0 && quant_blocks(w), "pagedecode._cpu.Stack: ", slot_name(layer, p.parts[j]),
                " must hold quantized blocks when ", kSlotNames[p.w], " is empty, got ", w.sizes(), " ",
                w.scalar_type());
    check_weight(w, rows[j], in, t, slot_name(layer, p.parts[j]));
  }
}

Stack make_stack(std::vector<std::vector<Tensor>> layers, Tensor embed, Tensor final_norm, Tensor lm_head,
                 Tensor lm_head_t, Tensor lm_head_packed, Tensor cos, Tensor sin, int64_t H, int64_t Hkv, int64_t D,
                 double eps, double scale) {
  TORCH_CHECK(!layers.empty(), "pagedecode._cpu.Stack: no layers");
  TORCH_CHECK(H > 0 && Hkv > 0 && D > 0 && H % Hkv == 0 && D % 2 == 0,
              "pagedecode._cpu.Stack: heads (", H, ") must be a positive multiple of kv heads (", Hkv,
              ") and head_dim (", D, ") positive and even");
  TORCH_CHECK(final_norm.dim() == 1 && final_norm.size(0) > 0 &&
                  (final_norm.scalar_type() == at::kFloat || final_norm.scalar_type() == at::kBFloat16),
              "pagedecode._cpu.Stack: final_norm must be (hidden,) float32 or bfloat16");
  const at::ScalarType t = final_norm.scalar_type();
  const int64_t hidden = final_norm.size(0);
  const int64_t vocab = embed.dim() >= 2 ? embed.size(0) : 0;
  check_weight(embed, vocab, hidden, t, "embed");
  check_weight(lm_head, vocab, hidden, t, "lm_head");
  check_copies(lm_head, lm_head_t, lm_head_packed, vocab, hidden, "lm_head");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D && cos.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.sizes() == cos.sizes() && sin.scalar_type() == at::kFloat && sin.is_contiguous(),
              "pagedecode._cpu.Stack: rope tables must be (positions, ", D, ") float32, got ", cos.sizes());
  TORCH_CHECK(layers[0].size() == kSlots, "pagedecode._cpu.Stack: layer 0 holds ", layers[0].size(),
              " tensors, expected ", static_cast<int>(kSlots), " (layer_slots())");
  // the intermediate size: gate_up's rows / 2, or its gate part's rows
  const bool gate_parts = in_parts(layers[0], kGateUp);
  const Tensor& gate_up = layers[0][gate_parts ? kGateW : kGateUpW];
  TORCH_CHECK(gate_up.dim() == 2 || (quant_blocks(gate_up) && gate_up.dim() == 3),
              "pagedecode._cpu.Stack: layer 0 gate_up_w must be (2 intermediate, hidden), or its parts gate_w, up_w");
  TORCH_CHECK(gate_parts || gate_up.size(0) % 2 == 0,
              "pagedecode._cpu.Stack: layer 0 gate_up_w must be (2 intermediate, hidden)");
  const int64_t inter = gate_parts ? gate_up.size(0) : gate_up.size(0) / 2, qkv = (H + 2 * Hkv) * D;
  for (int64_t i = 0; i < static_cast<int64_t>(layers.size()); ++i) {
    const std::vector<Tensor>& L = layers[i];
    TORCH_CHECK(L.size() == kSlots, "pagedecode._cpu.Stack: layer ", i, " holds ", L.size(), " tensors, expected ",
                static_cast<int>(kSlots), " (layer_slots())");
    check_vector(L[kLn1], hidden, t, true, slot_name(i, kLn1));
    check_vector(L[kLn2], hidden, t, true, slot_name(i, kLn2));
    for (const auto& [p, n_out, in] : {std::tuple{kQkv, qkv, hidden}, std::tuple{kO, hidden, H * D},
                                       std::tuple{kGateUp, 2 * inter, hidden}, std::tuple{kDown, hidden, inter}}) {
      if (p.b != kSlots) check_vector(L[p.b], n_out, t, false, slot_name(i, p.b));
      if (in_parts(L, p)) {
        const std::vector<int64_t> rows = p.parts[2] == kSlots ? std::vector<int64_t>{inter, inter}
                                                               : std::vector<int64_t>{H * D, Hkv * D, Hkv * D};
        check_parts(L, p, rows, in, t, i);
        continue;
      }
      check_weight(L[p.w], n_out, in, t, slot_name(i, p.w));
      check_copies(L[p.w], L[p.t], L[p.packed], n_out, in, slot_name(i, p.w));
      for (Slot s : p.parts)
        TORCH_CHECK(s == kSlots || L[s].numel() == 0, "pagedecode._cpu.Stack: ", slot_name(i, s),
                    " must be empty beside a stacked ", kSlotNames[p.w]);
    }
  }
  return Stack{std::move(layers), embed, final_norm, lm_head, lm_head_t, lm_head_packed, cos, sin,
               H, Hkv, D, hidden, inter, vocab, eps, scale};
}

// The batch's tables against what they index (model/batch.py's layout): cu_q runs from 0 to the
// rows, each sequence's length covers its new rows and fits its pages, every page it reads is in
// the cache. Checked before any kernel reads through them.
void check_tables(const Tensor& page_table, const Tensor& seq_lens, const Tensor& cu_q, int64_t rows,
                  int64_t num_pages, int64_t page_size, const char* what) {
  const int64_t S = seq_lens.size(0);
  TORCH_CHECK(seq_lens.dim() == 1 && cu_q.dim() == 1 && cu_q.numel() == S + 1 && page_table.dim() == 2 &&
                  page_table.size(0) >= S,
              "pagedecode._cpu.", what, ": cu_q (S + 1,), seq_lens (S,), page_table (>= S, max_pages)");
  const int32_t* cp = cu_q.data_ptr<int32_t>();
  const int32_t* lp = seq_lens.data_ptr<int32_t>();
  const int32_t* pt = page_table.data_ptr<int32_t>();
  TORCH_CHECK(cp[0] == 0 && cp[S] == rows, "pagedecode._cpu.", what, ": cu_q must run from 0 to the batch's rows");
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(cp[s + 1] >= cp[s] && lp[s] >= cp[s + 1] - cp[s] && lp[s] <= page_table.size(1) * page_size,
                "pagedecode._cpu.", what, ": sequence ", s, ": lengths must cover its rows and fit its pages");
    for (int64_t p = 0; p * page_size < lp[s]; ++p) {
      const int32_t id = pt[s * page_table.size(1) + p];
      TORCH_CHECK(id >= 0 && id < num_pages, "pagedecode._cpu.", what, ": sequence ", s, " page ", p, " is ", id,
                  ", outside the cache");
    }
  }
}

// every value of the int64 vector x in [0, bound)
void check_range(const Tensor& x, int64_t bound, const char* what) {
  const int64_t* p = x.data_ptr<int64_t>();
  for (int64_t i = 0; i < x.numel(); ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] < bound, "pagedecode._cpu.forward: ", what, " ", p[i], " at row ", i,
                " is outside [0, ", bound, ")");
}

