// Philox4x32-10's first output word for many (seed, index, token) at once: the counter-based
// random numbers of seeded sampling (pagedecode/kernels/philox.py holds the definition, its torch
// form and the Triton port; this is the same arithmetic in 32-bit words, bit for bit).
//
// The torch form needs 16-bit halves for each 32 x 32 -> 64-bit product (torch has no uint64):
// 20 products and ~100 tensor passes a call. Over a 49,152-token vocabulary sampled at a high
// temperature (most tokens within reach of the Gumbel noise) that was most of a SmolLM2 step.
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace philox {

inline uint32_t c0(uint64_t seed, uint32_t index, uint32_t token, uint32_t stream) {
  constexpr uint32_t kDomain = 0x53414D50;   // "SAMP" (philox.py's DOMAIN)
  uint32_t c[4] = {token, index, kDomain, stream};
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t a = uint64_t{0xD2511F53} * c[0], b = uint64_t{0xCD9E8D57} * c[2];
    const uint32_t n0 = static_cast<uint32_t>(b >> 32) ^ c[1] ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(a >> 32) ^ c[3] ^ k1;
    c[0] = n0, c[1] = static_cast<uint32_t>(b), c[2] = n2, c[3] = static_cast<uint32_t>(a);
    k0 += 0x9E3779B9, k1 += 0xBB67AE85;
  }
  return c[0];
}

// seed, index, token: int64 tensors of one shape (the caller broadcasts); returns int64 in [0, 2**32)
inline torch::Tensor c0_op(const torch::Tensor& seed, const torch::Tensor& index, const torch::Tensor& token,
                           int64_t stream) {
  TORCH_CHECK(seed.sizes() == index.sizes() && seed.sizes() == token.sizes(), "philox_c0: one shape for all inputs");
  for (const auto* t : {&seed, &index, &token})
    TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->device().is_cpu(), "philox_c0: int64 CPU tensors");
  const auto s = seed.contiguous(), i = index.contiguous(), t = token.contiguous();
  auto out = torch::empty(seed.sizes(), seed.options());
  const int64_t *ps = s.data_ptr<int64_t>(), *pi = i.data_ptr<int64_t>(), *pt = t.data_ptr<int64_t>();
  int64_t* po = out.data_ptr<int64_t>();
  const auto st = static_cast<uint32_t>(stream);
  for (int64_t n = 0, end = out.numel(); n < end; ++n)
    po[n] = c0(static_cast<uint64_t>(ps[n]), static_cast<uint32_t>(pi[n]), static_cast<uint32_t>(pt[n]), st);
  return out;
}

}  // namespace philox
