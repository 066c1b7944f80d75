// Decode attention over bit-packed keys and values on CPU (kvpolicy's "cpu" backend).
//
// Storage: the "torch" backend's PackedTensor. Keys grouped per channel: codes (B, H, n/GK, D, GK*KB/8),
// scales/minimums (B, H, n/GK, D); values grouped per token: codes (B, H, n, DV/GV, GV*VB/8),
// scales/minimums (B, H, n, DV/GV). Codes are packed 8/bits per byte, lowest bits first (3 bits: eight
// codes per three bytes, a little-endian bit stream); metadata is
// float16, bfloat16 or float32 (keys and values alike). Each (batch, head) slice must be contiguous;
// batch and head strides are free.
//
// One work item = one (batch, head, token split). It walks the key groups of its split (a tile of GK
// tokens each): scores (q*s)·codes + q·z from the codes, an online softmax, then the values of the
// tile accumulated as (p*s)·codes with p·z kept per value group (codes centred and unpacked in planar
// order, see expand); nothing is dequantized into memory.
// Partial results of the splits of one (batch, head) are merged through their log-sum-exp.
// Accumulation is float32 throughout.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Codes are unpacked centred: code - MID with MID = (2^BITS - 1) / 2 (exact in float32). A group's
// values are then s * (code - MID) + (z + s * MID): the per-group constant sits near the group's middle
// instead of its minimum, so the folded sums p·z and q·z cancel far less.
template <int BITS>
struct Centre {
  static constexpr float MID = ((1 << BITS) - 1) * 0.5f;
};

// The codes of nb bytes in *planar* order: dst[k * nb + j] = (code k of byte j) - MID, i.e. element
// PER * j + k of the row lands at k * nb + j. One shift-and-mask per plane over consecutive bytes,
// which the compiler vectorises; rows are accumulated in this order and put back in place at the end.
template <int BITS>
inline void expand(const uint8_t* __restrict src, int nb, float* __restrict dst) {
  constexpr int PER = 8 / BITS;
  constexpr int MASK = (1 << BITS) - 1;
  int j0 = 0;
  for (; j0 + 16 <= nb; j0 += 16) {  // fixed-width blocks: one vector per plane
    for (int k = 0; k < PER; ++k)
      for (int j = 0; j < 16; ++j)
        dst[k * nb + j0 + j] = static_cast<float>((src[j0 + j] >> (BITS * k)) & MASK) - Centre<BITS>::MID;
  }
  for (int k = 0; k < PER; ++k)
    for (int j = j0; j < nb; ++j)
      dst[k * nb + j] = static_cast<float>((src[j] >> (BITS * k)) & MASK) - Centre<BITS>::MID;
}

// 3 bits: each run of three bytes holds eight codes (code k at bits 3k .. 3k + 2 of the little-endian
// 24-bit word). Planar order too, by run: code k of run c lands at k * R + c (R = nb / 3 runs). Blocks
// of eight runs: their words first, then per plane one fixed-width shift-and-mask the compiler
// unrolls and vectorises; a scalar tail for the last runs.
inline uint32_t word3(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16);
}

template <>
inline void expand<3>(const uint8_t* __restrict src, int nb, float* __restrict dst) {
  const int R = nb / 3;
  int c0 = 0;
  for (; c0 + 8 <= R; c0 += 8) {
    uint32_t w[8];
    for (int c = 0; c < 8; ++c) w[c] = word3(src + 3 * (c0 + c));
    for (int k = 0; k < 8; ++k)
      for (int c = 0; c < 8; ++c)
        dst[k * R + c0 + c] = static_cast<float>((w[c] >> (3 * k)) & 7u) - Centre<3>::MID;
  }
  for (; c0 < R; ++c0) {
    const uint32_t w = word3(src + 3 * c0);
    for (int k = 0; k < 8; ++k) dst[k * R + c0] = static_cast<float>((w >> (3 * k)) & 7u) - Centre<3>::MID;
  }
}

// position of element e of a row of nb bytes in planar order
template <int BITS>
inline int64_t planar(int64_t e, int64_t nb) {
  if constexpr (BITS == 3) {
    return (e % 8) * (nb / 3) + e / 8;
  } else {
    constexpr int PER = 8 / BITS;
    return (e % PER) * nb + e / PER;
  }
}

// acc[e] += w * x[e]
inline void axpy(float* __restrict acc, const float* __restrict x, float w, int len) {
  for (int e = 0; e < len; ++e) acc[e] += w * x[e];
}

struct Packed {
  const uint8_t* codes;
  const void* scales;
  const void* zeros;
  int64_t c0, c1, m0, m1;  // batch and head strides (elements) of codes and of metadata
};

struct Shape {
  int64_t heads, nq, d, dv, gk, gv;
};

template <int KB, int VB, typename M>
void run_item(const float* q, const Packed& K, const Packed& V, const Shape& s, int64_t b, int64_t h,
              int64_t tile0, int64_t tile1, float* out, float* lse) {
  const int64_t nq = s.nq, D = s.d, DV = s.dv, GK = s.gk, GV = s.gv, J = DV / GV;
  const int kgb = static_cast<int>(GK * KB / 8), vgb = static_cast<int>(GV * VB / 8);  // bytes per group
  const uint8_t* kc = K.codes + b * K.c0 + h * K.c1;
  const M* ks = static_cast<const M*>(K.scales) + b * K.m0 + h * K.m1;
  const M* kz = static_cast<const M*>(K.zeros) + b * K.m0 + h * K.m1;
  const uint8_t* vc = V.codes + b * V.c0 + h * V.c1;
  const M* vs = static_cast<const M*>(V.scales) + b * V.m0 + h * V.m1;
  const M* vz = static_cast<const M*>(V.zeros) + b * V.m0 + h * V.m1;

  std::vector<float> qs(nq * D), sc(nq * GK), cf(std::max(GK, GV)), sd(D), zd(D);
  std::vector<float> m(nq, kNegInf), l(nq, 0.f), acc(nq * DV, 0.f), zacc(nq * J, 0.f);

  for (int64_t tile = tile0; tile < tile1; ++tile) {
    // scores of the GK tokens of this key group
    for (int64_t d = 0; d < D; ++d) {
      sd[d] = static_cast<float>(ks[tile * D + d]);
      zd[d] = static_cast<float>(kz[tile * D + d]) + sd[d] * Centre<KB>::MID;
    }
    for (int64_t i = 0; i < nq; ++i) {
      float bias = 0.f;
      for (int64_t d = 0; d < D; ++d) {
        qs[i * D + d] = q[i * D + d] * sd[d];
        bias += q[i * D + d] * zd[d];
      }
      std::fill(sc.begin() + i * GK, sc.begin() + (i + 1) * GK, bias);
    }
    const uint8_t* row = kc + tile * D * kgb;
    for (int64_t d = 0; d < D; ++d) {
      expand<KB>(row + d * kgb, kgb, cf.data());
      for (int64_t i = 0; i < nq; ++i) axpy(&sc[i * GK], cf.data(), qs[i * D + d], static_cast<int>(GK));
    }
    // online softmax: rescale what was accumulated, turn scores into unnormalised probabilities
    for (int64_t i = 0; i < nq; ++i) {
      float* si = &sc[i * GK];
      float mt = *std::max_element(si, si + GK);
      float mn = std::max(m[i], mt);
      if (mn == kNegInf) {  // every score -inf so far: nothing to add
        std::fill(si, si + GK, 0.f);
        continue;
      }
      float corr = m[i] == kNegInf ? 0.f : std::exp(m[i] - mn);
      if (corr != 1.f) {
        for (int64_t e = 0; e < DV; ++e) acc[i * DV + e] *= corr;
        for (int64_t j = 0; j < J; ++j) zacc[i * J + j] *= corr;
        l[i] *= corr;
      }
      float sum = 0.f;
      for (int64_t t = 0; t < GK; ++t) {
        si[t] = std::exp(si[t] - mn);
        sum += si[t];
      }
      l[i] += sum;
      m[i] = mn;
    }
    // values of the tile: acc += (p * s) * codes, zacc += p * z
    for (int64_t t = 0; t < GK; ++t) {
      const int64_t tok = tile * GK + t;
      const int64_t pt = planar<KB>(t, kgb);  // scores are in planar token order
      for (int64_t j = 0; j < J; ++j) {
        const float s_v = static_cast<float>(vs[tok * J + j]);
        const float z_v = static_cast<float>(vz[tok * J + j]) + s_v * Centre<VB>::MID;
        expand<VB>(vc + (tok * J + j) * vgb, vgb, cf.data());
        for (int64_t i = 0; i < nq; ++i) {
          const float p = sc[i * GK + pt];
          zacc[i * J + j] += p * z_v;
          axpy(&acc[i * DV + j * GV], cf.data(), p * s_v, static_cast<int>(GV));
        }
      }
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    if (l[i] == 0.f) {
      std::fill(out + i * DV, out + (i + 1) * DV, 0.f);
      lse[i] = kNegInf;
      continue;
    }
    const float inv = 1.f / l[i];
    for (int64_t j = 0; j < J; ++j)
      for (int64_t e = 0; e < GV; ++e)
        out[i * DV + j * GV + e] = (acc[i * DV + j * GV + planar<VB>(e, vgb)] + zacc[i * J + j]) * inv;
    lse[i] = m[i] + std::log(l[i]);
  }
}

template <int KB, int VB, typename M>
void run_all(const float* q, const Packed& K, const Packed& V, const Shape& s, int64_t bh, int64_t n_tiles,
             int64_t per, int64_t splits, float* part_out, float* part_lse) {
  at::parallel_for(0, bh * splits, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t x = item / splits, sp = item % splits;
      const int64_t b = x / s.heads, h = x % s.heads;
      const int64_t t0 = sp * per, t1 = std::min(n_tiles, t0 + per);
      run_item<KB, VB, M>(q + x * s.nq * s.d, K, V, s, b, h, t0, t1, part_out + item * s.nq * s.dv,
                          part_lse + item * s.nq);
    }
  });
}

template <typename M>
void dispatch_bits(int64_t kb, int64_t vb, const float* q, const Packed& K, const Packed& V, const Shape& s,
                   int64_t bh, int64_t n_tiles, int64_t per, int64_t splits, float* po, float* pl) {
#define KVPOLICY_PAIR(K_, V_) \
  if (kb == K_ && vb == V_) return run_all<K_, V_, M>(q, K, V, s, bh, n_tiles, per, splits, po, pl);
  KVPOLICY_PAIR(2, 2) KVPOLICY_PAIR(2, 3) KVPOLICY_PAIR(2, 4)
  KVPOLICY_PAIR(3, 2) KVPOLICY_PAIR(3, 3) KVPOLICY_PAIR(3, 4)
  KVPOLICY_PAIR(4, 2) KVPOLICY_PAIR(4, 3) KVPOLICY_PAIR(4, 4)
#undef KVPOLICY_PAIR
  TORCH_CHECK(false, "cpu_attention: bits must be 2, 3 or 4; got key bits ", kb, ", value bits ", vb);
}

void check_packed(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros, const char* what) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kByte && codes.dim() == 5, what,
              ": codes must be a 5-d uint8 CPU tensor");
  TORCH_CHECK(scales.dim() == 4 && zeros.sizes() == scales.sizes() && zeros.strides() == scales.strides() &&
                  scales.scalar_type() == zeros.scalar_type(),
              what, ": scales and minimums must be 4-d with equal shapes and strides");
}

}  // namespace

// q: (B, H, nq, D) float32 contiguous, already multiplied by the score scale.
// Returns {out (B, H, nq, DV) float32, lse (B, H, nq) float32}.
std::vector<at::Tensor> attend(at::Tensor q, at::Tensor kc, at::Tensor ks, at::Tensor kz, int64_t kbits, int64_t gk,
                               at::Tensor vc, at::Tensor vs, at::Tensor vz, int64_t vbits, int64_t gv, int64_t splits) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 4, "q must be contiguous float32 4-d");
  check_packed(kc, ks, kz, "keys");
  check_packed(vc, vs, vz, "values");
  TORCH_CHECK(ks.scalar_type() == vs.scalar_type(), "keys and values must have the same metadata dtype");
  const int64_t B = q.size(0), H = q.size(1), nq = q.size(2), D = q.size(3);
  const int64_t n_tiles = kc.size(2), DV = vc.size(3) * gv;
  TORCH_CHECK(kc.size(0) == B && kc.size(1) == H && kc.size(3) == D && kc.size(4) * 8 == gk * kbits,
              "keys do not match q");
  TORCH_CHECK(vc.size(0) == B && vc.size(1) == H && vc.size(2) == n_tiles * gk && vc.size(4) * 8 == gv * vbits,
              "values do not hold the tokens of keys");
  Shape s{H, nq, D, DV, gk, gv};
  Packed K{kc.data_ptr<uint8_t>(), ks.data_ptr(), kz.data_ptr(), kc.stride(0), kc.stride(1), ks.stride(0),
           ks.stride(1)};
  Packed V{vc.data_ptr<uint8_t>(), vs.data_ptr(), vz.data_ptr(), vc.stride(0), vc.stride(1), vs.stride(0),
           vs.stride(1)};
  const int64_t bh = B * H;
  splits = std::max<int64_t>(1, std::min(splits, std::max<int64_t>(n_tiles, 1)));
  const int64_t per = n_tiles ? (n_tiles + splits - 1) / splits : 0;
  if (n_tiles) splits = (n_tiles + per - 1) / per;
  auto opts = q.options();
  at::Tensor part_out = at::empty({bh, splits, nq, DV}, opts);
  at::Tensor part_lse = at::empty({bh, splits, nq}, opts);
  const float* qp = q.data_ptr<float>();
  float* po = part_out.data_ptr<float>();
  float* pl = part_lse.data_ptr<float>();
  if (ks.scalar_type() == at::kHalf) {
    dispatch_bits<c10::Half>(kbits, vbits, qp, K, V, s, bh, n_tiles, per, splits, po, pl);
  } else if (ks.scalar_type() == at::kBFloat16) {
    dispatch_bits<c10::BFloat16>(kbits, vbits, qp, K, V, s, bh, n_tiles, per, splits, po, pl);
  } else {
    TORCH_CHECK(ks.scalar_type() == at::kFloat, "metadata must be float16, bfloat16 or float32");
    dispatch_bits<float>(kbits, vbits, qp, K, V, s, bh, n_tiles, per, splits, po, pl);
  }
  if (splits == 1) return {part_out.view({B, H, nq, DV}), part_lse.view({B, H, nq})};
  at::Tensor out = at::empty({B, H, nq, DV}, opts);
  at::Tensor lse = at::empty({B, H, nq}, opts);
  float* o = out.data_ptr<float>();
  float* ls = lse.data_ptr<float>();
  for (int64_t x = 0; x < bh; ++x) {
    for (int64_t i = 0; i < nq; ++i) {
      float mx = kNegInf;
      for (int64_t sp = 0; sp < splits; ++sp) mx = std::max(mx, pl[(x * splits + sp) * nq + i]);
      float* oi = o + (x * nq + i) * DV;
      std::fill(oi, oi + DV, 0.f);
      if (mx == kNegInf) {
        ls[x * nq + i] = kNegInf;
        continue;
      }
      float total = 0.f;
      for (int64_t sp = 0; sp < splits; ++sp) total += std::exp(pl[(x * splits + sp) * nq + i] - mx);
      const float lt = mx + std::log(total);
      for (int64_t sp = 0; sp < splits; ++sp) {
        const float w = std::exp(pl[(x * splits + sp) * nq + i] - lt);
        axpy(oi, po + ((x * splits + sp) * nq + i) * DV, w, static_cast<int>(DV));
      }
      ls[x * nq + i] = lt;
    }
  }
  return {out, lse};
}
