// Decode attention over bit-packed keys and values on CPU (kvpolicy's "cpu" backend).
//
// Storage, for keys and for values independently, one of three schemes:
// - min-max (the "torch" backend's PackedTensor), x = s * code + z. Keys grouped per channel: codes
//   (B, H, n/GK, D, GK*KB/8), scales/minimums (B, H, n/GK, D); values grouped per token: codes
//   (B, H, n, DV/GV, GV*VB/8), scales/minimums (B, H, n, DV/GV).
// - codebook (CodebookTensor), x[t, d] = s_t * C[code_{t,d}]: codes per token (B, H, n, D*bits/8), one
//   scale per token (B, H, n), and the codebook C (2^bits float32 centroids, a small table).
// - lattice (LatticeTensor), x[t, 4g:4g+4] = s_t * P[i_{t,g}]: per token and sub-vector g of four channels the
//   index i of a point of the table P ((2^(4 bits), 4) float32: 256 points at 2 bits, 4096 at 3), packed as
//   4 * bits bits (2 bits: one byte per sub-vector; 3 bits: two sub-vectors per three bytes, a little-endian
//   24-bit word, the first in its low 12 bits); one scale per token (B, H, n). A 2-d table marks the scheme.
// Any key scheme goes with any value scheme. Codes are packed 8/bits per byte, lowest bits first (3 bits:
// eight codes per three bytes, a little-endian bit stream); widths 2, 3 and 4 bits; metadata is float16,
// bfloat16 or float32, each role its own; codebook and lattice scales may instead be one-byte log-scale codes
// (uint8, norm_bits=8) with one int16 base per (batch, head), decoded through a 256-entry table built per
// (batch, head) as kvpolicy/formats/scale_codes.py decodes them: a table of 2^(j/64) times an exact power of 2. Each (batch, head) slice must be contiguous; batch and
// head strides are free.
//
// One work item = one (batch, head, token split). It walks the tiles of its split: one key group of GK
// tokens for min-max keys, `tile` tokens for codebook keys (the last tile may be shorter). Scores of the
// tile: min-max keys (q*s)·codes + q·z, with AVX2 and FMA at 2 and 4 bits in registers (key_block: the
// tokens of eight bytes of every channel's row, summed over all channels before one store), else channel by
// channel across the tile's tokens; codebook keys s_t * (q·C[codes_t]), eight tokens at a time with AVX2 and
// FMA (dot8), else token by token. An online softmax (exp eight at a time with AVX2: exp_shifted_sum), then
// the values of the tile: min-max values accumulate (p*s)·codes with p·z kept per value group (with AVX2 at 2
// and 4 bits in registers, value_block: eight bytes of each token's group over all the tile's tokens);
// codebook values (p*s_t)·C[codes_t], the row one group and no zero term. Codes are decoded in
// planar order (see expand): centred (code - MID) for min-max, looked up in C for the codebook; lattice rows
// are decoded in their natural order, four table coordinates per index, and take the codebook's paths
// (scores s_t * (q·P[codes_t]), values (p*s_t)·P[codes_t]); nothing is dequantized into memory.
// Partial results of the splits of one (batch, head) are merged through their log-sum-exp.
// Accumulation is float32 throughout.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

enum Scheme { kMinMax, kCodebook, kLattice };

// What a code decodes to. Min-max: centred, code - MID with MID = (2^BITS - 1) / 2 (exact in float32);
// a group's values are then s * (code - MID) + (z + s * MID): the per-group constant sits near the
// group's middle instead of its minimum, so the folded sums p·z and q·z cancel far less. Codebook: the
// centroid C[code], looked up eight codes at a time with a register permute where there is AVX2.
template <Scheme S, int BITS>
struct Decode {
  static constexpr float MID = ((1 << BITS) - 1) * 0.5f;
  static constexpr uint32_t MASK = (1u << BITS) - 1;
  static constexpr bool kLookup = S == kCodebook;
  static constexpr bool kPoints = S == kLattice;
  float table[16] = {};  // the codebook's 2^BITS centroids, zero-padded to 16 (codebook only)
  const float* points = nullptr;  // the lattice table P, (2^(4 BITS), 4) (lattice only)
#if defined(__AVX2__)
  __m256 lo, hi;  // table[0..8), table[8..16)
#endif

  explicit Decode(const float* centroids) {
    if constexpr (S == kCodebook) std::copy(centroids, centroids + (1 << BITS), table);
    if constexpr (S == kLattice) points = centroids;
#if defined(__AVX2__)
    lo = _mm256_loadu_ps(table);
    hi = _mm256_loadu_ps(table + 8);
#endif
  }

  float operator()(uint32_t code) const {
    if constexpr (S == kCodebook) {
      return table[code];
    } else {
      return static_cast<float>(static_cast<int>(code)) - MID;
    }
  }

  // dst[i] = the code at bit `shift` of w[i], decoded, for i < 8
  void eight(const uint32_t* __restrict w, int shift, float* __restrict dst) const {
#if defined(__AVX2__)
    if constexpr (S == kCodebook) {
      const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
      const __m256i c = _mm256_and_si256(_mm256_srli_epi32(words, shift), _mm256_set1_epi32(MASK));
      __m256 v = _mm256_permutevar8x32_ps(lo, c);  // table[c & 7]
      if constexpr (BITS == 4)  // codes 8..15: table[8 + (c & 7)], chosen by bit 3 (shifted to the sign bit)
        v = _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(hi, c), _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));
      _mm256_storeu_ps(dst, v);
      return;
    }
#endif
    for (int i = 0; i < 8; ++i) dst[i] = (*this)((w[i] >> shift) & MASK);
  }
};

// 3 bits: the little-endian 24-bit word of a run of three bytes (eight codes, code k at bits 3k .. 3k + 2)
inline uint32_t word3(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16);
}

// A lattice row of nb bytes decoded in natural order: dst[4g + j] = P[i_g][j] (see the header)
template <int BITS>
inline void expand_points(const uint8_t* __restrict src, int nb, float* __restrict dst, const float* __restrict P) {
  if constexpr (BITS == 2) {
    for (int g = 0; g < nb; ++g) std::memcpy(dst + 4 * g, P + 4 * static_cast<int64_t>(src[g]), 4 * sizeof(float));
  } else {
    static_assert(BITS == 3, "lattice rows are 2 or 3 bits per coordinate");
    for (int c = 0; c < nb / 3; ++c) {
      const uint32_t w = word3(src + 3 * c);
      std::memcpy(dst + 8 * c, P + 4 * static_cast<int64_t>(w & 0xFFFu), 4 * sizeof(float));
      std::memcpy(dst + 8 * c + 4, P + 4 * static_cast<int64_t>((w >> 12) & 0xFFFu), 4 * sizeof(float));
    }
  }
}

// The decoded codes of a row of nb bytes in *planar* order (lattice rows: natural order, expand_points). 2 and 4 bits: dst[k * nb + j] = code k of
// byte j, i.e. element PER * j + k of the row lands at k * nb + j; blocks of 16 bytes, one shift-and-mask
// per plane, which the compiler vectorises. 3 bits: code k of run c (three bytes) lands at k * R + c
// (R = nb / 3 runs); blocks of eight runs, their words first, then per plane one fixed-width
// shift-and-mask. Scalar tails for the last bytes or runs. Rows are accumulated in this order and put
// back in place at the end (see planar).
template <int BITS, class Dec>
inline void expand(const uint8_t* __restrict src, int nb, float* __restrict dst, const Dec& dec) {
  if constexpr (Dec::kPoints) {
    if constexpr (BITS == 2 || BITS == 3) expand_points<BITS>(src, nb, dst, dec.points);
  } else if constexpr (BITS == 3) {
    const int R = nb / 3;
    int c0 = 0;
    for (; c0 + 8 <= R; c0 += 8) {
      uint32_t w[8];
      for (int c = 0; c < 8; ++c) w[c] = word3(src + 3 * (c0 + c));
      for (int k = 0; k < 8; ++k) dec.eight(w, 3 * k, dst + k * R + c0);
    }
    for (; c0 < R; ++c0) {
      const uint32_t w = word3(src + 3 * c0);
      for (int k = 0; k < 8; ++k) dst[k * R + c0] = dec((w >> (3 * k)) & 7u);
    }
  } else {
    constexpr int PER = 8 / BITS;
    int j0 = 0;
    for (; j0 + 16 <= nb; j0 += 16) {
      if constexpr (Dec::kLookup) {  // the table lookup eight codes at a time
        uint32_t w[16];
        for (int j = 0; j < 16; ++j) w[j] = src[j0 + j];
        for (int k = 0; k < PER; ++k) {
          dec.eight(w, BITS * k, dst + k * nb + j0);
          dec.eight(w + 8, BITS * k, dst + k * nb + j0 + 8);
        }
      } else {  // one vector per plane straight from the bytes
        for (int k = 0; k < PER; ++k)
          for (int j = 0; j < 16; ++j) dst[k * nb + j0 + j] = dec((src[j0 + j] >> (BITS * k)) & Dec::MASK);
      }
    }
    for (int k = 0; k < PER; ++k)
      for (int j = j0; j < nb; ++j) dst[k * nb + j] = dec((src[j] >> (BITS * k)) & Dec::MASK);
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

// where element e of a row of nb bytes of scheme S lands when decoded (lattice: in place)
template <Scheme S, int BITS>
inline int64_t row_order(int64_t e, int64_t nb) {
  if constexpr (S == kLattice) {
    return e;
  } else {
    return planar<BITS>(e, nb);
  }
}

// acc[e] += w * x[e]
inline void axpy(float* __restrict acc, const float* __restrict x, float w, int len) {
  for (int e = 0; e < len; ++e) acc[e] += w * x[e];
}

// a · b: sixteen running partial sums (vectorised without reassociating one float sum), added up pairwise
inline float dot(const float* __restrict a, const float* __restrict b, int len) {
  constexpr int L = 16;
  float part[L] = {};
  int e0 = 0;
  for (; e0 + L <= len; e0 += L)
    for (int e = 0; e < L; ++e) part[e] += a[e0 + e] * b[e0 + e];
  for (int e = e0; e < len; ++e) part[e - e0] += a[e] * b[e];
  for (int w = L / 2; w >= 1; w /= 2)
    for (int e = 0; e < w; ++e) part[e] += part[e + w];
  return part[0];
}

#if defined(__AVX2__) && defined(__FMA__)
// out[u] = s[u] * (a · x_u) for the eight rows x_u = x + u * len, len a multiple of 8: eight running
// vector sums, then one transposing horizontal add for all eight (codebook keys, eight tokens at a time)
inline void dot8(const float* __restrict a, const float* __restrict x, int64_t len, const float* __restrict s,
                 float* __restrict out) {
  __m256 acc[8];
  for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
  for (int64_t e = 0; e < len; e += 8) {
    const __m256 av = _mm256_loadu_ps(a + e);
    for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(av, _mm256_loadu_ps(x + u * len + e), acc[u]);
  }
  // per 128-bit lane: s0123 = [sum_0, sum_1, sum_2, sum_3] of each lane's half of rows 0..3 (likewise 4..7)
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  const __m256 sums =
      _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
  _mm256_storeu_ps(out, _mm256_mul_ps(sums, _mm256_loadu_ps(s)));
}
#endif

// p[t] = exp(p[t] - m) for t < len, m >= every p[t] (the running maximum of an online softmax); returns the
// sum of the results. With AVX2 and FMA eight at a time: exp(x) = 2^n * P(r), n = round(x / ln 2), r = x - n ln 2
// (ln 2 in two parts), P the degree-7 polynomial of Cephes' expf (about 1 ulp on the reduced range); x below
// -87.3 (where float32's exp underflows) gives 0, NaN stays NaN. The rest, and builds without AVX2, std::exp.
inline float exp_shifted_sum(float* __restrict p, int64_t len, float m) {
  int64_t t = 0;
  float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 vm = _mm256_set1_ps(m), lo = _mm256_set1_ps(-87.33654f), log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 c1 = _mm256_set1_ps(0.693359375f), c2 = _mm256_set1_ps(-2.12194440e-4f), one = _mm256_set1_ps(1.f);
  __m256 acc = _mm256_setzero_ps();
  for (; t + 8 <= len; t += 8) {
    const __m256 x0 = _mm256_sub_ps(_mm256_loadu_ps(p + t), vm);
    const __m256 under = _mm256_cmp_ps(x0, lo, _CMP_LT_OQ);
    const __m256 x = _mm256_max_ps(lo, x0);  // NaN (second operand) stays NaN
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, log2e, _mm256_set1_ps(0.5f)));
    const __m256 r = _mm256_fnmadd_ps(n, c2, _mm256_fnmadd_ps(n, c1, x));
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, one));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    y = _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
    _mm256_storeu_ps(p + t, y);
    acc = _mm256_add_ps(acc, y);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, acc);
  for (int u = 0; u < 8; ++u) sum += lanes[u];
#endif
  for (; t < len; ++t) {
    p[t] = std::exp(p[t] - m);
    sum += p[t];
  }
  return sum;
}

#if defined(__AVX2__) && defined(__FMA__)
// The eight bytes at p, widened to 32-bit lanes (one byte per lane)
inline __m256i eight_bytes(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// Plane k of eight_bytes: the codes at bits BITS * k of each byte, centred (code - MID) as float32
template <int BITS>
inline __m256 centred_plane(__m256i bytes, int k) {
  const __m256i code = _mm256_and_si256(_mm256_srl_epi32(bytes, _mm_cvtsi32_si128(BITS * k)),
                                        _mm256_set1_epi32((1 << BITS) - 1));
  return _mm256_sub_ps(_mm256_cvtepi32_ps(code), _mm256_set1_ps(Decode<kMinMax, BITS>::MID));
}

// Min-max key scores in registers (2 and 4 bits): the NQ queries' scores of the 8 * PER tokens whose codes lie at
// bytes [j0, j0 + 8) of every channel's row, summed over all D channels before one store. acc[i][k] is plane k
// (tokens PER * j + k, j in [j0, j0 + 8)), added to sc[i * T + k * krow + j0] (which holds the bias): the planar
// order of expand, so the rest of run_item reads the scores as it does from the channel-by-channel loop.
template <int BITS, int NQ>
inline void key_block(const uint8_t* __restrict rows, int64_t krow, int64_t D, int64_t j0, const float* __restrict qs,
                      int64_t D_stride, float* __restrict sc, int64_t T) {
  constexpr int PER = 8 / BITS;
  __m256 acc[NQ][PER];
  for (int i = 0; i < NQ; ++i)
    for (int k = 0; k < PER; ++k) acc[i][k] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256i b = eight_bytes(rows + d * krow + j0);
    for (int k = 0; k < PER; ++k) {
      const __m256 c = centred_plane<BITS>(b, k);
      for (int i = 0; i < NQ; ++i) acc[i][k] = _mm256_fmadd_ps(_mm256_broadcast_ss(qs + i * D_stride + d), c, acc[i][k]);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int k = 0; k < PER; ++k) {
      float* dst = sc + i * T + k * krow + j0;
      _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_loadu_ps(dst), acc[i][k]));
    }
}

// Min-max values in registers (2 and 4 bits): for the NQ queries, acc[i][k] += sum over the len tokens of
// w[i * T + t] * (code - MID), plane k of the codes at bytes [0, 8) of each token's group (codes + t * tstride),
// then added to out[i * DV + k * vgb] (the planar order of expand within the group).
template <int BITS, int NQ>
inline void value_block(const uint8_t* __restrict codes, int64_t tstride, int64_t len, const float* __restrict w,
                        int64_t T, float* __restrict out, int64_t DV, int64_t vgb) {
  constexpr int PER = 8 / BITS;
  __m256 acc[NQ][PER];
  for (int i = 0; i < NQ; ++i)
    for (int k = 0; k < PER; ++k) acc[i][k] = _mm256_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    const __m256i b = eight_bytes(codes + t * tstride);
    for (int k = 0; k < PER; ++k) {
      const __m256 c = centred_plane<BITS>(b, k);
      for (int i = 0; i < NQ; ++i) acc[i][k] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + i * T + t), c, acc[i][k]);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int k = 0; k < PER; ++k) {
      float* dst = out + i * DV + k * vgb;
      _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_loadu_ps(dst), acc[i][k]));
    }
}

// key_block over a whole key group: every 8-byte column block, the queries three (4 bits) or two (2 bits) at a
// time, so that the accumulators stay within the 16 vector registers
template <int BITS>
inline void key_group_scores(const uint8_t* rows, int64_t krow, int64_t D, const float* qs, int64_t nq, float* sc,
                             int64_t T) {
  constexpr int NB = BITS == 4 ? 3 : 2;
  for (int64_t j0 = 0; j0 < krow; j0 += 8) {
    int64_t i = 0;
    for (; i + NB <= nq; i += NB) key_block<BITS, NB>(rows, krow, D, j0, qs + i * D, D, sc + i * T, T);
    for (; i < nq; ++i) key_block<BITS, 1>(rows, krow, D, j0, qs + i * D, D, sc + i * T, T);
  }
}
#endif

template <typename T>
inline void to_float(const T* __restrict src, int64_t count, float* __restrict dst) {
  for (int64_t i = 0; i < count; ++i) dst[i] = static_cast<float>(src[i]);
}

// floor(a / b) for b > 0
inline int32_t floor_div(int32_t a, int32_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// The 256 scales one-byte codes decode to around the base beta of one (batch, head) (scale_codes.py):
// code 0 is 0; codes >= 64 are grid index beta + c; codes 1..63 the multiples of 4 below, from the largest
// multiple of 4 under beta + 64; index k decodes to steps[k mod 64] * 2^floor(k / 64), an exact power of two
// (ldexp), so every entry is the float32 product the Python decoder computes.
inline void scale_table(int32_t beta, const float* steps, float* out) {
  constexpr int32_t STEPS = 64, FINE_LOW = 64, COARSE = 4;
  const int32_t anchor = floor_div(beta + FINE_LOW - 1, COARSE) * COARSE;
  out[0] = 0.f;
  for (int32_t c = 1; c < 256; ++c) {
    const int32_t k = c >= FINE_LOW ? beta + c : anchor - COARSE * (FINE_LOW - 1 - c);
    const int32_t octave = floor_div(k, STEPS);
    out[c] = steps[k - octave * STEPS] * std::ldexp(1.0f, octave);
  }
}

// Metadata (scales, minimums) in its stored dtype, read as float32 a tile at a time. The dtype is switched
// at run time, once per tile, not a template parameter: a third as many kernels to compile. One-byte scale
// codes (uint8) read through `table`, their (batch, head)'s 256 decoded scales.
struct Meta {
  const void* base;
  at::ScalarType dtype;
  const float* table = nullptr;
  // dst[i] = element start + i, i < count
  void read(int64_t start, int64_t count, float* dst) const {
    switch (dtype) {
      case at::kByte: {
        const uint8_t* c = static_cast<const uint8_t*>(base) + start;
        for (int64_t i = 0; i < count; ++i) dst[i] = table[c[i]];
        return;
      }
      case at::kHalf:
        return to_float(static_cast<const c10::Half*>(base) + start, count, dst);
      case at::kBFloat16:
        return to_float(static_cast<const c10::BFloat16*>(base) + start, count, dst);
      default:
        return to_float(static_cast<const float*>(base) + start, count, dst);
    }
  }
};

// One role's storage (see the header); zeros: min-max only; table: the codebook's or the lattice's.
struct Packed {
  const uint8_t* codes;
  const void* scales;
  const void* zeros;
  const float* table;
  at::ScalarType meta;     // dtype of scales and zeros (uint8: one-byte scale codes)
  int64_t c0, c1, m0, m1;  // batch and head strides (elements) of codes and of metadata
  const int16_t* base = nullptr;  // one-byte scale codes: the base of each (batch, head), strides s0, s1
  int64_t s0 = 0, s1 = 0;
  const float* steps = nullptr;  // one-byte scale codes: 2^(j/64), j < 64

  // the metadata `base` (scales or zeros) of one (batch, head)
  Meta slice(const void* base, int64_t b, int64_t h) const {
    if (base == nullptr) return {nullptr, meta};
    return {static_cast<const char*>(base) + (b * m0 + h * m1) * static_cast<int64_t>(c10::elementSize(meta)), meta};
  }
};

// tile: tokens per tile (min-max keys: the key group GK); gv: value group (codebook and lattice values: DV)
struct Shape {
  int64_t heads, nq, d, dv, n, tile, gv;
  // an additive score per query and token, (B, H, nq, n) float32 already scaled, or nullptr
  const float* bias;
};

template <Scheme KS, int KB, Scheme VS, int VB>
void run_item(const float* q, const Packed& K, const Packed& V, const Shape& s, int64_t b, int64_t h,
              int64_t tile0, int64_t tile1, float* out, float* lse) {
  const int64_t nq = s.nq, D = s.d, DV = s.dv, T = s.tile, GV = s.gv, J = DV / GV;
  // bytes per row of key codes (min-max: one channel of a group; codebook: one token) and of a value group
  const int krow = static_cast<int>((KS == kMinMax ? T : D) * KB / 8), vgb = static_cast<int>(GV * VB / 8);
  const Decode<KS, KB> kdec(K.table);
  const Decode<VS, VB> vdec(V.table);
  const uint8_t* kc = K.codes + b * K.c0 + h * K.c1;
  Meta ks = K.slice(K.scales, b, h);
  const Meta kz = K.slice(K.zeros, b, h);
  const uint8_t* vc = V.codes + b * V.c0 + h * V.c1;
  Meta vs = V.slice(V.scales, b, h);
  const Meta vz = V.slice(V.zeros, b, h);  // zeros: min-max only
  float ktab[256], vtab[256];  // decoded one-byte scales of this (batch, head), where a role holds them
  if (K.base != nullptr) {
    scale_table(K.base[b * K.s0 + h * K.s1], K.steps, ktab);
    ks.table = ktab;
  }
  if (V.base != nullptr) {
    scale_table(V.base[b * V.s0 + h * V.s1], V.steps, vtab);
    vs.table = vtab;
  }

  std::vector<float> qs(nq * D), sc(nq * T), cf(std::max({T, D, GV})), c8(KS != kMinMax ? 8 * D : 0);
  // metadata of a tile: keys' scales and minimums (min-max: per channel; codebook: scales per token), values'
  std::vector<float> sd(std::max(D, T)), zd(D), sv(T * J), zv(T * J);
  std::vector<float> m(nq, kNegInf), l(nq, 0.f), acc(nq * DV, 0.f), zacc(nq * J, 0.f), wv(nq * T);
  if constexpr (KS != kMinMax) {  // the query in the order of a decoded key row, once
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t e = 0; e < D; ++e) qs[i * D + row_order<KS, KB>(e, krow)] = q[i * D + e];
  }

  for (int64_t tile = tile0; tile < tile1; ++tile) {
    const int64_t tok0 = tile * T, len = std::min(T, s.n - tok0);
    if constexpr (KS == kMinMax) {  // scores of the GK tokens of this key group, channel by channel
      ks.read(tile * D, D, sd.data());
      kz.read(tile * D, D, zd.data());
      for (int64_t d = 0; d < D; ++d) zd[d] += sd[d] * Decode<KS, KB>::MID;
      for (int64_t i = 0; i < nq; ++i) {
        float bias = 0.f;
        for (int64_t d = 0; d < D; ++d) {
          qs[i * D + d] = q[i * D + d] * sd[d];
          bias += q[i * D + d] * zd[d];
        }
        std::fill(sc.begin() + i * T, sc.begin() + (i + 1) * T, bias);
      }
      const uint8_t* row = kc + tile * D * krow;
#if defined(__AVX2__) && defined(__FMA__)
      if (KB != 3 && krow % 8 == 0) {
        if constexpr (KB != 3) key_group_scores<KB>(row, krow, D, qs.data(), nq, sc.data(), T);
      } else
#endif
        for (int64_t d = 0; d < D; ++d) {
          expand<KB>(row + d * krow, krow, cf.data(), kdec);
          for (int64_t i = 0; i < nq; ++i) axpy(&sc[i * T], cf.data(), qs[i * D + d], static_cast<int>(T));
        }
    } else {  // scores s_t * (q · C[codes_t]) (lattice: q · P[codes_t]): eight tokens at a time, then one by one
      ks.read(tok0, len, sd.data());
      int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
      if (D % 8 == 0) {  // eight tokens at a time
        for (; t + 8 <= len; t += 8) {
          for (int u = 0; u < 8; ++u) expand<KB>(kc + (tok0 + t + u) * krow, krow, c8.data() + u * D, kdec);
          for (int64_t i = 0; i < nq; ++i) dot8(&qs[i * D], c8.data(), D, &sd[t], &sc[i * T + t]);
        }
      }
#endif
      for (; t < len; ++t) {
        expand<KB>(kc + (tok0 + t) * krow, krow, cf.data(), kdec);
        for (int64_t i = 0; i < nq; ++i) sc[i * T + t] = sd[t] * dot(&qs[i * D], cf.data(), static_cast<int>(D));
      }
    }
    if (s.bias != nullptr) {  // the caller's additive scores of these tokens (min-max scores: planar order)
      const float* bx = s.bias + ((b * s.heads + h) * nq) * s.n + tok0;
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t t = 0; t < len; ++t) sc[i * T + (KS == kMinMax ? planar<KB>(t, krow) : t)] += bx[i * s.n + t];
    }
    // online softmax: rescale what was accumulated, turn scores into unnormalised probabilities
    for (int64_t i = 0; i < nq; ++i) {
      float* si = &sc[i * T];
      float mt = *std::max_element(si, si + len);
      float mn = std::max(m[i], mt);
      if (mn == kNegInf) {  // every score -inf so far: nothing to add
        std::fill(si, si + len, 0.f);
        continue;
      }
      float corr = m[i] == kNegInf ? 0.f : std::exp(m[i] - mn);
      if (corr != 1.f) {
        for (int64_t e = 0; e < DV; ++e) acc[i * DV + e] *= corr;
        for (int64_t j = 0; j < J; ++j) zacc[i * J + j] *= corr;
        l[i] *= corr;
      }
      l[i] += exp_shifted_sum(si, len, mn);
      m[i] = mn;
    }
    // values of the tile: acc += (p * s) * decoded codes; min-max values also zacc += p * z
    vs.read(tok0 * J, len * J, sv.data());
    if constexpr (VS == kMinMax) vz.read(tok0 * J, len * J, zv.data());
#if defined(__AVX2__) && defined(__FMA__)
    if constexpr (VS == kMinMax && VB != 3) {
      if (vgb % 8 == 0) {  // per value group: the weights p * s of its tokens, then the codes in registers
        constexpr int NB = VB == 4 ? 3 : 2;
        for (int64_t j = 0; j < J; ++j) {
          for (int64_t i = 0; i < nq; ++i) {
            for (int64_t t = 0; t < len; ++t) {
              const float p = sc[i * T + (KS == kMinMax ? planar<KB>(t, krow) : t)];
              const float s_v = sv[t * J + j];
              wv[i * T + t] = p * s_v;
              zacc[i * J + j] += p * (zv[t * J + j] + s_v * Decode<VS, VB>::MID);
            }
          }
          const uint8_t* g = vc + (tok0 * J + j) * vgb;
          for (int64_t j0 = 0; j0 < vgb; j0 += 8) {
            float* o = acc.data() + j * GV + j0;
            int64_t i = 0;
            for (; i + NB <= nq; i += NB) value_block<VB, NB>(g + j0, J * vgb, len, wv.data() + i * T, T, o + i * DV, DV, vgb);
            for (; i < nq; ++i) value_block<VB, 1>(g + j0, J * vgb, len, wv.data() + i * T, T, o + i * DV, DV, vgb);
          }
        }
        continue;
      }
    }
#endif
    for (int64_t t = 0; t < len; ++t) {
      const int64_t tok = tok0 + t;
      const int64_t pt = KS == kMinMax ? planar<KB>(t, krow) : t;  // min-max scores are in planar token order
      for (int64_t j = 0; j < J; ++j) {
        const float s_v = sv[t * J + j];
        const float z_v = VS == kMinMax ? zv[t * J + j] + s_v * Decode<VS, VB>::MID : 0.f;
        expand<VB>(vc + (tok * J + j) * vgb, vgb, cf.data(), vdec);
        for (int64_t i = 0; i < nq; ++i) {
          const float p = sc[i * T + pt];
          if constexpr (VS == kMinMax) zacc[i * J + j] += p * z_v;
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
        out[i * DV + j * GV + e] = (acc[i * DV + j * GV + row_order<VS, VB>(e, vgb)] + zacc[i * J + j]) * inv;
    lse[i] = m[i] + std::log(l[i]);
  }
}

template <Scheme KS, int KB, Scheme VS, int VB>
void run_all(const float* q, const Packed& K, const Packed& V, const Shape& s, int64_t bh, int64_t n_tiles,
             int64_t per, int64_t splits, float* part_out, float* part_lse) {
  at::parallel_for(0, bh * splits, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t x = item / splits, sp = item % splits;
      const int64_t b = x / s.heads, h = x % s.heads;
      const int64_t t0 = sp * per, t1 = std::min(n_tiles, t0 + per);
      run_item<KS, KB, VS, VB>(q + x * s.nq * s.d, K, V, s, b, h, t0, t1, part_out + item * s.nq * s.dv,
                                  part_lse + item * s.nq);
    }
  });
}

struct Args {
  const float* q;
  Packed K, V;
  Shape s;
  int64_t bh, n_tiles, per, splits;
  float *po, *pl;
};

// lattice roles come at 2 and 3 bits only: no kernel is compiled for 4-bit lattice rows
template <Scheme S, int BITS>
constexpr bool served = S != kLattice || BITS != 4;

template <Scheme KS, Scheme VS>
void dispatch_bits(int64_t kb, int64_t vb, const Args& a) {
#define KVPOLICY_PAIR(K_, V_)                                                                          \
  if constexpr (served<KS, K_> && served<VS, V_>) {                                                    \
    if (kb == K_ && vb == V_)                                                                          \
      return run_all<KS, K_, VS, V_>(a.q, a.K, a.V, a.s, a.bh, a.n_tiles, a.per, a.splits, a.po, a.pl); \
  }
  KVPOLICY_PAIR(2, 2) KVPOLICY_PAIR(2, 3) KVPOLICY_PAIR(2, 4)
  KVPOLICY_PAIR(3, 2) KVPOLICY_PAIR(3, 3) KVPOLICY_PAIR(3, 4)
  KVPOLICY_PAIR(4, 2) KVPOLICY_PAIR(4, 3) KVPOLICY_PAIR(4, 4)
#undef KVPOLICY_PAIR
  TORCH_CHECK(false, "cpu_attention: bits must be 2, 3 or 4 (lattice: 2 or 3); got key bits ", kb, ", value bits ",
              vb);
}

template <Scheme KS>
void dispatch_values(Scheme vs, int64_t kb, int64_t vb, const Args& a) {
  if (vs == kMinMax) return dispatch_bits<KS, kMinMax>(kb, vb, a);
  if (vs == kCodebook) return dispatch_bits<KS, kCodebook>(kb, vb, a);
  return dispatch_bits<KS, kLattice>(kb, vb, a);
}

void dispatch(Scheme ks, Scheme vs, int64_t kb, int64_t vb, const Args& a) {
  if (ks == kMinMax) return dispatch_values<kMinMax>(vs, kb, vb, a);
  if (ks == kCodebook) return dispatch_values<kCodebook>(vs, kb, vb, a);
  return dispatch_values<kLattice>(vs, kb, vb, a);
}

// whether each (batch, head) slice of t (dims 2 and up) is one contiguous block
bool inner_contiguous(const at::Tensor& t) {
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 2; --d) {
    if (t.size(d) != 1 && t.stride(d) != expected) return false;
    expected *= t.size(d);
  }
  return true;
}

// One role's block as the kernel reads it. Min-max when `zeros` is given, codebook when `table` is a 1-d
// table of centroids, lattice when it is a 2-d table of points.
struct Block {
  Packed p;
  Scheme scheme;
  int64_t tokens, width;  // n, and D (keys) or DV (values)
};

Block read_block(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                 const c10::optional<at::Tensor>& table, int64_t bits, int64_t group, bool keys,
                 const c10::optional<at::Tensor>& base, const c10::optional<at::Tensor>& steps) {
  const char* what = keys ? "keys" : "values";
  TORCH_CHECK(zeros.has_value() != table.has_value(), what,
              ": give minimums (min-max) or a table (codebook, lattice), not both or neither");
  TORCH_CHECK(bits >= 2 && bits <= 4, what, ": bits must be 2, 3 or 4; got ", bits);
  const bool cb = table.has_value();
  const bool lat = cb && table->dim() == 2;
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kByte && codes.dim() == (cb ? 4 : 5), what,
              ": codes must be a ", cb ? 4 : 5, "-d uint8 CPU tensor");
  TORCH_CHECK(inner_contiguous(codes) && inner_contiguous(scales), what,
              ": each (batch, head) slice of codes and scales must be contiguous");
  const at::ScalarType meta = scales.scalar_type();
  const bool coded = meta == at::kByte;
  TORCH_CHECK(meta == at::kHalf || meta == at::kBFloat16 || meta == at::kFloat || (coded && cb), what,
              ": metadata must be float16, bfloat16 or float32 (codebook and lattice scales: or uint8 codes)");
  TORCH_CHECK(base.has_value() == coded, what, ": one-byte scale codes (uint8 scales) come with their base, ",
              "and only they");
  Block blk{{codes.data_ptr<uint8_t>(), scales.data_ptr(), nullptr, nullptr, meta, codes.stride(0),
             codes.stride(1), scales.stride(0), scales.stride(1)},
            lat ? kLattice : (cb ? kCodebook : kMinMax), 0, 0};
  if (coded) {
    const at::Tensor& bt = *base;
    TORCH_CHECK(bt.scalar_type() == at::kShort && bt.dim() == 3 && bt.size(0) == codes.size(0) &&
                    bt.size(1) == codes.size(1) && bt.size(2) == 1,
                what, ": the base of one-byte scales must be int16 (batch, heads, 1)");
    TORCH_CHECK(steps.has_value() && steps->scalar_type() == at::kFloat && steps->is_contiguous() &&
                    steps->dim() == 1 && steps->size(0) == 64,
                what, ": one-byte scales need the 64 float32 steps 2^(j/64)");
    blk.p.base = bt.data_ptr<int16_t>();
    blk.p.s0 = bt.stride(0);
    blk.p.s1 = bt.stride(1);
    blk.p.steps = steps->data_ptr<float>();
  }
  if (lat) {
    const at::Tensor& c = *table;
    TORCH_CHECK(bits == 2 || bits == 3, what, ": lattice rows are 2 or 3 bits per coordinate; got ", bits);
    TORCH_CHECK(c.scalar_type() == at::kFloat && c.is_contiguous() && c.size(0) == (int64_t{1} << (4 * bits)) &&
                    c.size(1) == 4,
                what, ": the lattice table must be (", int64_t{1} << (4 * bits), ", 4) contiguous float32 points");
    TORCH_CHECK(scales.dim() == 3 && scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1) &&
                    scales.size(2) == codes.size(2),
                what, ": lattice scales must be (batch, heads, tokens) like the codes");
    TORCH_CHECK((codes.size(3) * 8) % (4 * bits) == 0 && (bits != 3 || codes.size(3) % 3 == 0), what, ": ",
                codes.size(3), " bytes per token do not hold whole sub-vectors of four ", bits, "-bit coordinates");
    blk.p.table = c.data_ptr<float>();
    blk.tokens = codes.size(2);
    blk.width = codes.size(3) * 8 / bits;
  } else if (cb) {
    const at::Tensor& c = *table;
    TORCH_CHECK(c.scalar_type() == at::kFloat && c.is_contiguous() && c.dim() == 1 && c.numel() == (1 << bits),
                what, ": the codebook table must be ", 1 << bits, " contiguous float32 centroids");
    TORCH_CHECK(scales.dim() == 3 && scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1) &&
                    scales.size(2) == codes.size(2),
                what, ": codebook scales must be (batch, heads, tokens) like the codes");
    TORCH_CHECK((codes.size(3) * 8) % bits == 0 && (bits != 3 || codes.size(3) % 3 == 0), what, ": ",
                codes.size(3), " bytes per token do not hold whole ", bits, "-bit codes");
    blk.p.table = c.data_ptr<float>();
    blk.tokens = codes.size(2);
    blk.width = codes.size(3) * 8 / bits;
  } else {
    const at::Tensor& z = *zeros;
    TORCH_CHECK(scales.dim() == 4 && z.sizes() == scales.sizes() && z.strides() == scales.strides() &&
                    scales.scalar_type() == z.scalar_type(),
                what, ": scales and minimums must be 4-d with equal shapes and strides");
    TORCH_CHECK(group >= 1 && codes.size(4) * 8 == group * bits, what, ": groups of ", group, " at ", bits,
                " bits do not take ", codes.size(4), " bytes");
    blk.p.zeros = z.data_ptr();
    blk.tokens = keys ? codes.size(2) * group : codes.size(2);
    blk.width = keys ? codes.size(3) : codes.size(3) * group;
  }
  return blk;
}

}  // namespace

// q: (B, H, nq, D) float32 contiguous, already multiplied by the score scale. Per role: codes, scales, and
// either minimums (min-max) or the table (codebook: 1-d centroids; lattice: 2-d points), the width and:
// keys, the tokens per tile (min-max: the key group GK; codebook, lattice: any tile size >= 1); values, the
// value group GV (min-max; a codebook or lattice row is one group). One-byte scale codes (uint8 scales)
// come with their base (kbase, vbase: int16 (B, H, 1)) and the 64 float32 steps 2^(j/64).
// bias: an optional (B, H, nq, n) float32 added to the scaled scores before the softmax.
// Returns {out (B, H, nq, DV) float32, lse (B, H, nq) float32}.
std::vector<at::Tensor> attend(at::Tensor q, at::Tensor kc, at::Tensor ks, c10::optional<at::Tensor> kz,
                               c10::optional<at::Tensor> ktable, int64_t kbits, int64_t ktile, at::Tensor vc,
                               at::Tensor vs, c10::optional<at::Tensor> vz, c10::optional<at::Tensor> vtable,
                               int64_t vbits, int64_t gv, int64_t splits, c10::optional<at::Tensor> kbase,
                               c10::optional<at::Tensor> vbase, c10::optional<at::Tensor> steps,
                               c10::optional<at::Tensor> bias) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 4, "q must be contiguous float32 4-d");
  TORCH_CHECK(ktile >= 1, "keys: tokens per tile must be >= 1; got ", ktile);
  const Block K = read_block(kc, ks, kz, ktable, kbits, ktile, true, kbase, steps);
  const Block V = read_block(vc, vs, vz, vtable, vbits, gv, false, vbase, steps);
  const int64_t B = q.size(0), H = q.size(1), nq = q.size(2), D = q.size(3);
  const int64_t n = K.tokens, DV = V.width;
  TORCH_CHECK(kc.size(0) == B && kc.size(1) == H && K.width == D, "keys do not match q");
  TORCH_CHECK(vc.size(0) == B && vc.size(1) == H && V.tokens == n, "values do not hold the tokens of keys");
  if (V.scheme != kMinMax) gv = DV;
  TORCH_CHECK(gv >= 1 && DV % gv == 0, "values: the value group must divide the value width");
  const float* bp = nullptr;
  if (bias.has_value()) {
    const at::Tensor& bt = *bias;
    TORCH_CHECK(bt.scalar_type() == at::kFloat && bt.is_contiguous() && bt.dim() == 4 && bt.size(0) == B &&
                    bt.size(1) == H && bt.size(2) == nq && bt.size(3) == n,
                "bias must be contiguous float32 (B, H, nq, n) = (", B, ", ", H, ", ", nq, ", ", n, ")");
    bp = bt.data_ptr<float>();
  }
  Args a{q.data_ptr<float>(), K.p, V.p, Shape{H, nq, D, DV, n, ktile, gv, bp}, B * H, (n + ktile - 1) / ktile, 0, 0,
         nullptr, nullptr};
  int64_t& n_tiles = a.n_tiles;
  splits = std::max<int64_t>(1, std::min(splits, std::max<int64_t>(n_tiles, 1)));
  a.per = n_tiles ? (n_tiles + splits - 1) / splits : 0;
  if (n_tiles) splits = (n_tiles + a.per - 1) / a.per;
  a.splits = splits;
  const int64_t bh = a.bh;
  auto opts = q.options();
  at::Tensor part_out = at::empty({bh, splits, nq, DV}, opts);
  at::Tensor part_lse = at::empty({bh, splits, nq}, opts);
  float* po = a.po = part_out.data_ptr<float>();
  float* pl = a.pl = part_lse.data_ptr<float>();
  dispatch(K.scheme, V.scheme, kbits, vbits, a);
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
