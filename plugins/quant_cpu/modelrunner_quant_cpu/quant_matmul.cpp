// Matrix products with weight-quantized linear layers, for CPUs: y = x @ dequantize(W).T without
// materialising the float weight (small batches), or through MKL on dequantized tiles (large ones),
// or llama.cpp-style with activations quantized to int8 per 32-element block ("q8").
//
// Weight format (prepared by the Python side):
//   qweight  bits=4: uint8 [N, K/2], ggml's nibble order per 32-element block: byte j of the block
//            holds element j in its low nibble and element j+16 in its high nibble (q = 0..15);
//            bits=8: int8 [N, K] (q = -128..127).
//   scales   float16 or float32 [N, K/group_size]; mins of the same dtype [N, K/group_size] or absent;
//            w[n, k] = scales[n, k/g] * q[n, k] + mins[n, k/g]. float32 where a GGUF K-quant's scales
//            (an fp16 super-block scale times a 6-bit sub-block scale) do not fit float16 exactly.
//   group_size a multiple of 32, or 16 (Q6_K, Q3_K, Q2_K: two groups per 32-element block, its
//            elements 0..15 and 16..31; the int8-activation kernels, q8, p16 and split, take
//            multiples of 32 only).
// The kernels are templates on the scale type (and, where a 16-group needs other loops, on that):
// float16 scales and groups of 32 or more run the code they ran before either existed.
//
// Registered as torch operators (modelrunner_quant_cpu::...) so that eager code and torch.compile
// graphs call the same kernels. Built with -march=native: the code paths below are chosen by the
// compiler's target (AVX-512 + VNNI, AVX2 + FMA, or portable scalar code).

#include <c10/core/InferenceMode.h>
#include <c10/util/BFloat16.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MRQ_AVX2 1
#endif
#if defined(MRQ_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__)
#define MRQ_AVX512 1
#endif
// 256-bit u8 x s8 dot products in one instruction: AVX-512 VNNI (EVEX, needs VL) or AVX-VNNI (VEX).
#if defined(MRQ_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define MRQ_VNNI 1
#elif defined(MRQ_AVX2) && defined(__AVXVNNI__)
#define MRQ_VNNI 2
#endif

namespace {

constexpr int64_t kBlock = 32;  // elements of one nibble block and of one activation-quantization block

// ---------------------------------------------------------------------------------------------
// The weight, validated.

constexpr int64_t kHalfBlock = 16;  // the one group smaller than a block: half of one

struct QuantWeight {
  const uint8_t* data = nullptr;  // row n starts at data + n * row_bytes
  const void* scales = nullptr;   // at::Half, or float where `wide`
  const void* mins = nullptr;     // the same type; nullptr: no mins
  bool wide = false;              // float32 scales and mins
  int64_t rows = 0, cols = 0, group = 0, groups = 0, bits = 0, row_bytes = 0;

  const uint8_t* row(int64_t n) const { return data + n * row_bytes; }
  template <typename S>
  const S* scales_as() const { return static_cast<const S*>(scales); }
  template <typename S>
  const S* mins_as() const { return static_cast<const S*>(mins); }
  bool half_groups() const { return group == kHalfBlock; }
};

QuantWeight check_weight(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                         int64_t group_size, int64_t bits) {
  TORCH_CHECK_VALUE(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK_VALUE(qweight.dim() == 2, "qweight must be 2-D, [N, K/2] for bits=4 or [N, K] for bits=8, got shape ",
                    qweight.sizes());
  const auto want = bits == 4 ? at::kByte : at::kChar;
  TORCH_CHECK_VALUE(qweight.scalar_type() == want, "qweight must be ", (bits == 4 ? "uint8" : "int8"),
                    " for bits=", bits, ", got ", qweight.scalar_type());
  TORCH_CHECK_VALUE(qweight.device().is_cpu(), "qweight must be a CPU tensor, got device ", qweight.device());
  TORCH_CHECK_VALUE(qweight.is_contiguous(), "qweight must be contiguous (strides ", qweight.strides(), ")");
  QuantWeight w;
  w.bits = bits;
  w.rows = qweight.size(0);
  w.row_bytes = qweight.size(1);
  w.cols = bits == 4 ? 2 * w.row_bytes : w.row_bytes;
  TORCH_CHECK_VALUE(w.cols > 0 && w.cols % kBlock == 0, "K (input features) must be a positive multiple of 32, got K = ",
                    w.cols, " from qweight shape ", qweight.sizes());
  TORCH_CHECK_VALUE(
      group_size > 0 && (group_size % kBlock == 0 || group_size == kHalfBlock) && w.cols % group_size == 0,
      "group_size must be 16 or a positive multiple of 32 that divides K = ", w.cols, ", got ", group_size);
  w.group = group_size;
  w.groups = w.cols / group_size;
  TORCH_CHECK_VALUE(scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat,
                    "scales must be float16 or float32, got ", scales.scalar_type());
  w.wide = scales.scalar_type() == at::kFloat;
  const auto check_grid = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(t.scalar_type() == scales.scalar_type(), name, " must be ", (w.wide ? "float32" : "float16"),
                      " like scales, got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == w.rows && t.size(1) == w.groups, name,
                      " must be [N, K/group_size] = [", w.rows, ", ", w.groups, "], got shape ", t.sizes());
    TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor, got device ", t.device());
    TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous (strides ", t.strides(), ")");
  };
  check_grid(scales, "scales");
  w.data = static_cast<const uint8_t*>(qweight.const_data_ptr());
  w.scales = scales.const_data_ptr();
  if (mins.has_value()) {
    check_grid(*mins, "mins");
    w.mins = mins->const_data_ptr();
  }
  return w;
}

// Calls visit.template operator()<S, kHalf>() for the weight's scale type (at::Half or float) and
// whether its groups are half blocks: each kernel that reads scales itself is instantiated per format.
template <typename F>
void with_format(const QuantWeight& w, F&& visit) {
  if (!w.wide)
    w.half_groups() ? visit.template operator()<at::Half, true>() : visit.template operator()<at::Half, false>();
  else
    w.half_groups() ? visit.template operator()<float, true>() : visit.template operator()<float, false>();
}

// The int8-activation kernels (q8, p16, split) scale whole 32-element blocks of x.
void check_int8_groups(const QuantWeight& w, const char* kernel) {
  TORCH_CHECK_VALUE(!w.half_groups(), "the ", kernel, " kernel takes groups of a multiple of 32, got group_size ",
                    w.group);
}

void check_input(const at::Tensor& x, const QuantWeight& w, at::ScalarType dtype = at::kFloat) {
  TORCH_CHECK_VALUE(x.scalar_type() == dtype, "x must be ", (dtype == at::kFloat ? "float32" : "bfloat16"), ", got ",
                    x.scalar_type());
  TORCH_CHECK_VALUE(x.device().is_cpu(), "x must be a CPU tensor, got device ", x.device());
  TORCH_CHECK_VALUE(x.is_contiguous(), "x must be contiguous (strides ", x.strides(), ")");
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be 2-D [M, K], got shape ", x.sizes());
  TORCH_CHECK_VALUE(x.size(1) == w.cols, "x has ", x.size(1), " features (x.size(1)) but the weight has K = ", w.cols);
}

inline void halves_to_floats(const at::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef MRQ_AVX2
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// n scales or mins of the weight's type from element `at` on, as floats.
inline void grid_to_floats(const QuantWeight& w, const void* grid, int64_t at, float* dst, int64_t n) {
  if (w.wide)
    std::memcpy(dst, static_cast<const float*>(grid) + at, n * sizeof(float));
  else
    halves_to_floats(static_cast<const at::Half*>(grid) + at, dst, n);
}

// Float scales and mins (zeros when absent) of rows [n0, n0 + count), [count][groups] each.
struct RowScales {
  std::vector<float> scales, mins;

  void fetch(const QuantWeight& w, int64_t n0, int64_t count) {
    const size_t size = static_cast<size_t>(count * w.groups);
    if (scales.size() < size) scales.resize(size), mins.resize(size);
    grid_to_floats(w, w.scales, n0 * w.groups, scales.data(), count * w.groups);
    if (w.mins)
      grid_to_floats(w, w.mins, n0 * w.groups, mins.data(), count * w.groups);
    else
      std::fill(mins.begin(), mins.begin() + size, 0.f);
  }
  const float* scale(int64_t i, int64_t groups) const { return scales.data() + i * groups; }
  const float* min(int64_t i, int64_t groups) const { return mins.data() + i * groups; }
};

// ---------------------------------------------------------------------------------------------
// Weights unpacked to floats in registers.

#ifdef MRQ_AVX2
// v as it is, hidden from the compiler's multiply-add contraction (-ffp-contract=fast): a product
// passed through it is rounded before anything is added to it.
template <typename V>
inline V rounded(V v) {
  asm("" : "+x"(v));
  return v;
}
#endif

#ifdef MRQ_AVX512
// 16 float lanes; a 32-element block is two vectors. 4-bit weights are looked up in a 16-entry
// table of the group's dequantized values (scale * i + min): one permute per 16 weights.
struct Exact {
  using V = __m512;
  static constexpr int kVecs = 2, kLanes = 16, kMaxAccumulators = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }

  struct Group {
    V a, b;
  };
  // kMins false: a multiply, no add of 0 (dequantize keeps torch's -0 for negative scales).
  // kRound: the product rounded before the min is added, as torch computes q * s + m (float32
  // scales; with float16 ones the product is exact and a fused multiply-add rounds the same).
  template <int kBits, bool kMins = true, bool kRound = false>
  static Group group(float s, float m) {
    if constexpr (kBits == 4) {
      const V iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      if constexpr (kMins && kRound)
        return {_mm512_add_ps(rounded(_mm512_mul_ps(iota, _mm512_set1_ps(s))), _mm512_set1_ps(m)), V{}};
      return {kMins ? _mm512_fmadd_ps(iota, _mm512_set1_ps(s), _mm512_set1_ps(m)) : _mm512_mul_ps(iota, _mm512_set1_ps(s)),
              V{}};
    } else {
      return {_mm512_set1_ps(s), _mm512_set1_ps(m)};
    }
  }
  template <int kBits, bool kMins = true, bool kRound = false>
  static void unpack(const uint8_t* p, const Group& g, V* w) {
    unpack2<kBits, kMins, kRound>(p, g, g, w);
  }
  // Elements 0..15 of the block with g0, 16..31 with g1 (groups of 16; unpack: one group).
  template <int kBits, bool kMins = true, bool kRound = false>
  static void unpack2(const uint8_t* p, const Group& g0, const Group& g1, V* w) {
    if constexpr (kBits == 4) {
      const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      w[0] = _mm512_permutexvar_ps(bytes, g0.a);  // the permute reads the low 4 bits of each index
      w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), g1.a);
    } else {
      const __m512i q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      const __m512i q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
      if constexpr (kMins && kRound) {
        w[0] = _mm512_add_ps(rounded(_mm512_mul_ps(_mm512_cvtepi32_ps(q0), g0.a)), g0.b);
        w[1] = _mm512_add_ps(rounded(_mm512_mul_ps(_mm512_cvtepi32_ps(q1), g1.a)), g1.b);
      } else if constexpr (kMins) {
        w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), g0.a, g0.b);
        w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), g1.a, g1.b);
      } else {
        w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(q0), g0.a);
        w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(q1), g1.a);
      }
    }
  }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
};
#elif defined(MRQ_AVX2)
// 8 float lanes; a block is four vectors.
struct Exact {
  using V = __m256;
  static constexpr int kVecs = 4, kLanes = 8, kMaxAccumulators = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }

  struct Group {
    V a, b;
  };
  // kRound: see the AVX-512 version.
  template <int kBits, bool kMins = true, bool kRound = false>
  static Group group(float s, float m) {
    return {_mm256_set1_ps(s), _mm256_set1_ps(m)};
  }
  template <int kBits, bool kMins = true, bool kRound = false>
  static void unpack(const uint8_t* p, const Group& g, V* w) {
    unpack2<kBits, kMins, kRound>(p, g, g, w);
  }
  // Elements 0..15 of the block with g0, 16..31 with g1 (groups of 16; unpack: one group).
  template <int kBits, bool kMins = true, bool kRound = false>
  static void unpack2(const uint8_t* p, const Group& g0, const Group& g1, V* w) {
    const auto bytes = [&](int offset) {
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + offset));
      return kBits == 4 ? _mm256_cvtepu8_epi32(raw) : _mm256_cvtepi8_epi32(raw);
    };
    const auto dequant = [&](__m256i q, const Group& g) {
      if constexpr (kMins && kRound) return _mm256_add_ps(rounded(_mm256_mul_ps(_mm256_cvtepi32_ps(q), g.a)), g.b);
      return kMins ? _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), g.a, g.b) : _mm256_mul_ps(_mm256_cvtepi32_ps(q), g.a);
    };
    if constexpr (kBits == 4) {
      const __m256i lo = bytes(0), hi = bytes(8), mask = _mm256_set1_epi32(15);
      w[0] = dequant(_mm256_and_si256(lo, mask), g0);  // elements 0..7
      w[1] = dequant(_mm256_and_si256(hi, mask), g0);  // 8..15
      w[2] = dequant(_mm256_srli_epi32(lo, 4), g1);    // 16..23
      w[3] = dequant(_mm256_srli_epi32(hi, 4), g1);    // 24..31
    } else {
      for (int v = 0; v < 4; ++v) w[v] = dequant(bytes(8 * v), v < 2 ? g0 : g1);
    }
  }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
};
#endif

// ---------------------------------------------------------------------------------------------
// bfloat16 (the bf16 GEMMs below): round_bf16 and store_bf16, shared with ggml_matmul.cpp.
#include "bf16_round.h"

// A vector of dequantized weights stored as floats, or rounded to bfloat16 (uint16_t: its bits).
#ifdef MRQ_AVX2
inline void store_weights(float* p, Exact::V v) { Exact::store(p, v); }
inline void store_weights(uint16_t* p, Exact::V v) { store_bf16(p, round_bf16(v)); }
#endif
// One weight, likewise.
inline void store_weight(float* p, float v) { *p = v; }
inline void store_weight(uint16_t* p, float v) { *p = c10::BFloat16(v).x; }

// ---------------------------------------------------------------------------------------------
// Dequantization. With float16 scales, scales * q is exact in float32 (11-bit fp16 mantissa times an
// integer of at most 8 bits), so a fused or a separate multiply-add rounds the same way; with float32
// scales the product is rounded before the min is added (kRound). Either way these values equal
// torch's `scales.float() * q + mins.float()` bit for bit, whatever the compiler contracts.
// kHalf: groups of 16, two per block.

// Out: float, or uint16_t for the values rounded to bfloat16 (store_weights).
template <int kBits, bool kMins, bool kHalf = false, bool kRound = false, typename Out = float>
void dequantize_row(const uint8_t* q, const float* s, const float* m, int64_t K, int64_t group, Out* out) {
#ifdef MRQ_AVX2
  if constexpr (kHalf) {
    for (int64_t b = 0; b < K / kBlock; ++b) {
      const Exact::Group lo = Exact::group<kBits, kMins, kRound>(s[2 * b], kMins ? m[2 * b] : 0.f);
      const Exact::Group hi = Exact::group<kBits, kMins, kRound>(s[2 * b + 1], kMins ? m[2 * b + 1] : 0.f);
      Exact::V w[Exact::kVecs];
      Exact::unpack2<kBits, kMins, kRound>(q + b * (kBits * kBlock / 8), lo, hi, w);
      for (int v = 0; v < Exact::kVecs; ++v) store_weights(out + b * kBlock + v * Exact::kLanes, w[v]);
    }
    return;
  }
  const int64_t per_group = group / kBlock;
  for (int64_t g = 0, b = 0; g < K / group; ++g) {
    const Exact::Group grp = Exact::group<kBits, kMins, kRound>(s[g], kMins ? m[g] : 0.f);
    for (const int64_t end = b + per_group; b < end; ++b) {
      Exact::V w[Exact::kVecs];
      Exact::unpack<kBits, kMins, kRound>(q + b * (kBits * kBlock / 8), grp, w);
      for (int v = 0; v < Exact::kVecs; ++v) store_weights(out + b * kBlock + v * Exact::kLanes, w[v]);
    }
  }
#else
  // Plain loops (x86-64's baseline has no FMA to contract them into: float32 products stay rounded).
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const int64_t g = b * kBlock / group, g_hi = kHalf ? g + 1 : g;  // elements 0..15, 16..31
    const float sc = s[g], mn = kMins ? m[g] : 0.f, sc_hi = s[g_hi], mn_hi = kMins ? m[g_hi] : 0.f;
    Out* o = out + b * kBlock;
    if constexpr (kBits == 4) {
      const uint8_t* p = q + b * 16;
      for (int j = 0; j < 16; ++j) {
        if constexpr (kMins) {
          store_weight(o + j, sc * static_cast<float>(p[j] & 15) + mn);
          store_weight(o + j + 16, sc_hi * static_cast<float>(p[j] >> 4) + mn_hi);
        } else {
          store_weight(o + j, sc * static_cast<float>(p[j] & 15));
          store_weight(o + j + 16, sc_hi * static_cast<float>(p[j] >> 4));
        }
      }
    } else {
      const int8_t* p = reinterpret_cast<const int8_t*>(q) + b * kBlock;
      for (int j = 0; j < 32; ++j) {
        const float sj = j < 16 ? sc : sc_hi, mj = j < 16 ? mn : mn_hi;
        if constexpr (kMins)
          store_weight(o + j, sj * static_cast<float>(p[j]) + mj);
        else
          store_weight(o + j, sj * static_cast<float>(p[j]));
      }
    }
  }
#endif
}

// Rows [n0, n1) into out ([n1 - n0][K], contiguous): floats, or (Out uint16_t) bfloat16 bits.
template <typename Out = float>
void dequantize_rows(const QuantWeight& w, int64_t n0, int64_t n1, Out* out, RowScales& rs) {
  if (n1 <= n0) return;
  rs.fetch(w, n0, n1 - n0);
  const auto rows = [&]<int kBits, bool kMins, bool kHalf, bool kRound>() {
    for (int64_t n = n0; n < n1; ++n)
      dequantize_row<kBits, kMins, kHalf, kRound, Out>(w.row(n), rs.scale(n - n0, w.groups),
                                                       rs.min(n - n0, w.groups), w.cols, w.group,
                                                       out + (n - n0) * w.cols);
  };
  const auto with_bits = [&]<bool kHalf, bool kRound>() {
    if (w.bits == 4)
      w.mins ? rows.template operator()<4, true, kHalf, kRound>() : rows.template operator()<4, false, kHalf, false>();
    else
      w.mins ? rows.template operator()<8, true, kHalf, kRound>() : rows.template operator()<8, false, kHalf, false>();
  };
  if (!w.half_groups())
    w.wide ? with_bits.template operator()<false, true>() : with_bits.template operator()<false, false>();
  else
    w.wide ? with_bits.template operator()<true, true>() : with_bits.template operator()<true, false>();
}

// Multiply-adds a thread must get before a call is split: waking torch's other threads costs ~35 us
// here when they sleep between parallel regions (OMP_WAIT_POLICY=PASSIVE, as the Makefile sets),
// a few us when they spin. Measured on SmolLM2's layers at one row of x: with sleeping threads,
// 576x576 took 35 us on one thread and 75 us on two.
double min_work_per_thread() {
  static const double work = [] {
    const char* policy = std::getenv("OMP_WAIT_POLICY");
    std::string p = policy ? policy : "";
    std::transform(p.begin(), p.end(), p.begin(), [](unsigned char c) { return std::tolower(c); });
    return p == "passive" ? double(1 << 20) : double(1 << 17);
  }();
  return work;
}

// Splits rows [0, N) into chunks of whole `unit`s among torch's threads, each with at least
// min_work_per_thread() multiply-adds: a small call stays on the calling thread.
template <typename F>
void parallel_rows(int64_t N, int64_t unit, double work_per_row, F&& body) {
  const int64_t units = (N + unit - 1) / unit;
  const double per_unit = std::max(1.0, work_per_row * static_cast<double>(unit));
  const int64_t grain = std::max<int64_t>(1, static_cast<int64_t>(min_work_per_thread() / per_unit));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) { body(u0 * unit, std::min(N, u1 * unit)); });
}

// ---------------------------------------------------------------------------------------------
// "exact": float activations times float weights, unpacked in registers (small M).

#ifdef MRQ_AVX2
// Weight bytes are read once per token: prefetched this far ahead with the non-temporal hint, so that
// streaming them does not evict what the rest of the step uses from the caches (measured on SmolLM2's
// decode: the torch and Python work after the forward ran ~25% faster, decode +10-20%).
constexpr int64_t kStreamAhead = 512;

// MT activation rows times NT weight rows over all of K, each weight block unpacked once for the
// MT rows; acc[r][t] stay in registers. kPerGroup: blocks per group when known at compile time
// (1: groups of 32, one flat loop), 0: w.group / 32, -1: groups of 16 (two per block).
template <int kBits, int kPerGroup, int MT, int NT>
void exact_tile(const QuantWeight& w, const uint8_t* const* rows, const float* const* s, const float* const* m,
                const float* x, float* y, int64_t ldy) {
  using V = Exact::V;
  constexpr int64_t bb = kBits * kBlock / 8;
  const int64_t K = w.cols, per_group = kPerGroup > 0 ? kPerGroup : w.group / kBlock;
  const uint8_t* q[NT];
  const float* sc[NT];
  const float* mn[NT];
#pragma GCC unroll 4
  for (int t = 0; t < NT; ++t) q[t] = rows[t], sc[t] = s[t], mn[t] = m[t];
  V acc[MT][NT];
#pragma GCC unroll 8
  for (int r = 0; r < MT; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) acc[r][t] = Exact::zero();
  // Few x rows: their block is loaded into registers once for the NT weight rows; more rows: read
  // by the multiply-adds from L1 (registers are short).
  constexpr bool kHoist = MT * Exact::kVecs <= 4;
  const auto block = [&](const Exact::Group* grp, const Exact::Group* grp_hi, int64_t b) {
    const float* xb = x + b * kBlock;
    V xv[kHoist ? MT : 1][Exact::kVecs];
    if constexpr (kHoist) {
#pragma GCC unroll 8
      for (int r = 0; r < MT; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < Exact::kVecs; ++v) xv[r][v] = Exact::load(xb + r * K + v * Exact::kLanes);
    }
    const auto x_at = [&](int r, int v) {
      if constexpr (kHoist)
        return xv[r][v];
      else
        return Exact::load(xb + r * K + v * Exact::kLanes);
    };
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      V wv[Exact::kVecs];
      if ((b * bb) % 64 == 0)  // each row's bytes are read once per token: see kStreamAhead
        _mm_prefetch(reinterpret_cast<const char*>(q[t] + b * bb) + kStreamAhead, _MM_HINT_NTA);
      if constexpr (kPerGroup < 0)
        Exact::unpack2<kBits>(q[t] + b * bb, grp[t], grp_hi[t], wv);
      else
        Exact::unpack<kBits>(q[t] + b * bb, grp[t], wv);
#pragma GCC unroll 4
      for (int v = 0; v < Exact::kVecs; ++v)
#pragma GCC unroll 8
        for (int r = 0; r < MT; ++r) acc[r][t] = Exact::fma(x_at(r, v), wv[v], acc[r][t]);
    }
  };
  if constexpr (kPerGroup < 0) {
    for (int64_t b = 0; b < K / kBlock; ++b) {
      Exact::Group lo[NT], hi[NT];
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) {
        lo[t] = Exact::group<kBits>(sc[t][2 * b], mn[t][2 * b]);
        hi[t] = Exact::group<kBits>(sc[t][2 * b + 1], mn[t][2 * b + 1]);
      }
      block(lo, hi, b);
    }
  } else {
    for (int64_t g = 0, b = 0; g < w.groups; ++g) {
      Exact::Group grp[NT];
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) grp[t] = Exact::group<kBits>(sc[t][g], mn[t][g]);
      if constexpr (kPerGroup == 1) {
        block(grp, grp, b++);
      } else {
        for (const int64_t end = b + per_group; b < end; ++b) block(grp, grp, b);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MT; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) y[r * ldy + t] = Exact::sum(acc[r][t]);
}

constexpr int exact_nt(int mt) {
  const int nt = Exact::kMaxAccumulators / mt;
  return nt > 4 ? 4 : nt < 1 ? 1 : nt;
}
#endif

// ---------------------------------------------------------------------------------------------
// "q8": activations quantized per 32-element block to int8 with one float scale (amax / 127),
// integer dot products with the weights' integers, then the scales:
//   sum_k w_k x_k ~= sum_g [ s_g * sum_{b in g} dx_b * (q_b . xq_b) ] + sum_g m_g * (sum_{k in g} x_k)
// The mins' term uses the exact float sums of x (no quantization error there).

struct QuantizedInput {
  std::unique_ptr<int8_t[]> q;   // [M][K]
  std::unique_ptr<float[]> d;    // [M][K/32]
  std::unique_ptr<float[]> sum;  // [M][groups] (only with mins)
  std::unique_ptr<int32_t[]> qsum;  // [M][K/32]: sum of each block's integers (8-bit weights, packed kernel)
};

// pairs: blocks 2p and 2p+1 stored as [2p: 0..15][2p+1: 0..15][2p: 16..31][2p+1: 16..31], the order
// of one 32-byte load of their 4-bit weights split into low and high nibbles (an odd last block
// stays in element order).
void quantize_row(const float* x, int64_t K, int64_t group, bool sums, bool pairs, int8_t* q, float* d,
                  float* gsum, int32_t* qsum) {
  const int64_t blocks = K / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    const float* v = x + b * kBlock;
    int8_t* out = q + b * kBlock;
    float amax = 0.f, total = 0.f;
#ifdef MRQ_AVX2
    const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16),
                 v3 = _mm256_loadu_ps(v + 24);
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                             _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 a4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    a4 = _mm_max_ps(a4, _mm_movehl_ps(a4, a4));
    amax = _mm_cvtss_f32(_mm_max_ss(a4, _mm_movehdup_ps(a4)));
    const float id = amax != 0.f ? 127.f / amax : 0.f;
    const __m256 vid = _mm256_set1_ps(id);
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, vid), kRound));
    const __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, vid), kRound));
    const __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, vid), kRound));
    const __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, vid), kRound));
    // packs work within 128-bit lanes: the permute puts the 32 bytes back in order.
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    const __m256i ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    if (pairs && b < blocks - blocks % 2) {
      int8_t* pair = q + (b - b % 2) * kBlock + (b % 2) * 16;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(pair), _mm256_castsi256_si128(ordered));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(pair + 32), _mm256_extracti128_si256(ordered, 1));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), ordered);
    }
    if (qsum) {
      const __m256i t = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
      __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
      t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
      qsum[b] = _mm_cvtsi128_si32(_mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1)));
    }
    if (sums) {
      const __m256 s = _mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3));
      __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
      s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      total = _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
    }
#else
    for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float id = amax != 0.f ? 127.f / amax : 0.f;
    for (int j = 0; j < kBlock; ++j) out[j] = static_cast<int8_t>(std::nearbyint(v[j] * id));
    if (qsum) {
      qsum[b] = 0;
      for (int j = 0; j < kBlock; ++j) qsum[b] += out[j];
    }
    if (sums)
      for (int j = 0; j < kBlock; ++j) total += v[j];
#endif
    d[b] = amax / 127.f;
    if (sums) {
      const int64_t g = b * kBlock / group;
      gsum[g] = (b * kBlock % group == 0 ? 0.f : gsum[g]) + total;
    }
  }
}

QuantizedInput quantize_input(const float* x, int64_t M, const QuantWeight& w, bool block_sums, bool pairs) {
  QuantizedInput in;
  const int64_t blocks = w.cols / kBlock;
  in.q.reset(new int8_t[std::max<int64_t>(1, M * w.cols)]);
  in.d.reset(new float[std::max<int64_t>(1, M * blocks)]);
  const bool sums = w.mins != nullptr;
  if (sums) in.sum.reset(new float[std::max<int64_t>(1, M * w.groups)]);
  if (block_sums) in.qsum.reset(new int32_t[std::max<int64_t>(1, M * blocks)]);
  at::parallel_for(0, M, std::max<int64_t>(1, (1 << 16) / w.cols), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      quantize_row(x + m * w.cols, w.cols, w.group, sums, pairs, in.q.get() + m * w.cols, in.d.get() + m * blocks,
                   sums ? in.sum.get() + m * w.groups : nullptr, block_sums ? in.qsum.get() + m * blocks : nullptr);
  });
  return in;
}

#ifdef MRQ_AVX2
// 8 int32 lanes, each the sum of 4 adjacent products of unsigned bytes u and signed bytes s.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if MRQ_VNNI == 1
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif MRQ_VNNI == 2
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  // Pairs of products fit int16: at most 2 * 15 * 127 (4-bit) or 2 * 128 * 127 (8-bit, sign trick).
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// One weight block as 32 bytes in element order: unsigned nibbles (4-bit), or |q| (8-bit: u8 x s8
// instructions need one unsigned side; the signs go onto the activations).
template <int kBits>
inline __m256i q8_weights(const uint8_t* p) {
  if constexpr (kBits == 4) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(15));
  } else {
    return _mm256_abs_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

template <int kBits>
inline __m256i q8_dot(__m256i u, const uint8_t* p, __m256i xq) {
  if constexpr (kBits == 4)
    return dot_u8s8(u, xq);
  else
    return dot_u8s8(u, _mm256_sign_epi8(xq, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}

#ifdef MRQ_AVX512
constexpr int kQ8MaxAccumulators = 12;  // two registers each, of 32
constexpr int kQ8MaxRows = 8;
#else
constexpr int kQ8MaxAccumulators = 4;  // of 16: taller tiles would spill
constexpr int kQ8MaxRows = 4;
#endif

constexpr int q8_nt(int mt) {
  const int nt = kQ8MaxAccumulators / mt;
  return nt > 4 ? 4 : nt < 1 ? 1 : nt;
}

template <int kBits, int kPerGroup, int MT, int NT>
void q8_tile(const QuantWeight& w, const uint8_t* const* rows, const float* const* s, const float* const* m,
             const QuantizedInput& in, int64_t m0, float* y, int64_t ldy) {
  constexpr int64_t bb = kBits * kBlock / 8;
  const int64_t K = w.cols, blocks = K / kBlock, per_group = kPerGroup > 0 ? kPerGroup : w.group / kBlock;
  const int8_t* xq = in.q.get() + m0 * K;
  const float* dx = in.d.get() + m0 * blocks;
  const uint8_t* q[NT];
  const float* sc[NT];
#pragma GCC unroll 4
  for (int t = 0; t < NT; ++t) q[t] = rows[t], sc[t] = s[t];
  __m256 acc[MT][NT];
#pragma GCC unroll 8
  for (int r = 0; r < MT; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  if constexpr (kPerGroup == 1) {
    // A scale per block: dx * scale folded into one multiplier per (row, block).
    for (int64_t b = 0; b < blocks; ++b) {
      __m256i u[NT];
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) u[t] = q8_weights<kBits>(q[t] + b * bb);
#pragma GCC unroll 8
      for (int r = 0; r < MT; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + b * kBlock));
        const float d = dx[r * blocks + b];
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t)
          acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q8_dot<kBits>(u[t], q[t] + b * bb, xv)),
                                      _mm256_set1_ps(d * sc[t][b]), acc[r][t]);
      }
    }
  } else {
    for (int64_t g = 0, b = 0; g < w.groups; ++g) {
      __m256 part[MT][NT];
#pragma GCC unroll 8
      for (int r = 0; r < MT; ++r)
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) part[r][t] = _mm256_setzero_ps();
      for (const int64_t end = b + per_group; b < end; ++b) {
        __m256i u[NT];
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) u[t] = q8_weights<kBits>(q[t] + b * bb);
#pragma GCC unroll 8
        for (int r = 0; r < MT; ++r) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + b * kBlock));
          const __m256 d = _mm256_set1_ps(dx[r * blocks + b]);
#pragma GCC unroll 4
          for (int t = 0; t < NT; ++t)
            part[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q8_dot<kBits>(u[t], q[t] + b * bb, xv)), d, part[r][t]);
        }
      }
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) {
        const __m256 scale = _mm256_set1_ps(sc[t][g]);
#pragma GCC unroll 8
        for (int r = 0; r < MT; ++r) acc[r][t] = _mm256_fmadd_ps(part[r][t], scale, acc[r][t]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MT; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      float total = hsum(acc[r][t]);
      if (w.mins) {  // sum_g min_g * sum(x over g): exact sums, off the vector loop
        const float* xs = in.sum.get() + (m0 + r) * w.groups;
        for (int64_t g = 0; g < w.groups; ++g) total += m[t][g] * xs[g];
      }
      y[r * ldy + t] = total;
    }
}

// Two u8 x s8 dot products summed into 8 int32 lanes.
inline __m256i dot2_u8s8(__m256i u1, __m256i s1, __m256i u2, __m256i s2) {
#if MRQ_VNNI == 1
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u1, s1), u2, s2);
#elif MRQ_VNNI == 2
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u1, s1), u2, s2);
#else
  // 4-bit: each int16 pair is at most 2 * 15 * 127, two of them still fit.
  return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u1, s1), _mm256_maddubs_epi16(u2, s2)),
                           _mm256_set1_epi16(1));
#endif
}

// [v[0] x4, v[1] x4]: the multipliers of two consecutive blocks for the lanes that sum them.
inline __m256 two_blocks(const float* v) {
  const __m128 pair = _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v)));
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(pair), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

// Whether the 4-bit q8 kernel takes blocks two at a time: a pair never straddles two groups unless
// groups are single blocks (then each lane half gets its own scale).
bool q8_takes_pairs(const QuantWeight& w) {
  const int64_t per_group = w.group / kBlock;
  return w.bits == 4 && (per_group == 1 || per_group % 2 == 0);
}

#ifdef MRQ_AVX512
constexpr int kPairsMaxAccumulators = 12;
#else
constexpr int kPairsMaxAccumulators = 4;
#endif

constexpr int pairs_nt(int mt) {
  const int nt = kPairsMaxAccumulators / mt;
  return nt > (kPairsMaxAccumulators >= 8 ? 4 : 2) ? (kPairsMaxAccumulators >= 8 ? 4 : 2) : nt < 1 ? 1 : nt;
}

// 4-bit weights, blocks two at a time: one 32-byte load holds blocks b and b+1, its low nibbles
// their elements 0..15 and its high nibbles their elements 16..31 (the activations' pair layout);
// int32 lanes 0-3 sum block b, lanes 4-7 block b+1, scaled by [dx*s of b, dx*s of b+1].
// kPerGroup: 1 (groups of 32) or 0 (an even number of blocks per group).
template <int kPerGroup, int MT, int NT>
void q8_pairs_tile(const QuantWeight& w, const uint8_t* const* rows, const float* const* s, const float* const* m,
                   const QuantizedInput& in, int64_t m0, float* y, int64_t ldy) {
  const int64_t K = w.cols, blocks = K / kBlock, per_group = w.group / kBlock;
  const int8_t* xq = in.q.get() + m0 * K;
  const float* dx = in.d.get() + m0 * blocks;
  const uint8_t* q[NT];
  const float* sc[NT];
#pragma GCC unroll 4
  for (int t = 0; t < NT; ++t) q[t] = rows[t], sc[t] = s[t];
  const __m256i mask = _mm256_set1_epi8(15);
  __m256 acc[MT][NT];
#pragma GCC unroll 8
  for (int r = 0; r < MT; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  const int64_t paired = blocks - blocks % 2;
  for (int64_t b = 0; b < paired; b += 2) {
    __m256i lo[NT], hi[NT];
    __m256 sv[NT];
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[t] + b * 16));
      lo[t] = _mm256_and_si256(raw, mask);
      hi[t] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
      sv[t] = kPerGroup == 1 ? two_blocks(sc[t] + b) : _mm256_set1_ps(sc[t][b / per_group]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MT; ++r) {
      const int8_t* xp = xq + r * K + b * kBlock;
      const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp));
      const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 32));
      const __m256 dv = two_blocks(dx + r * blocks + b);
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t)
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot2_u8s8(lo[t], xlo, hi[t], xhi)), _mm256_mul_ps(dv, sv[t]),
                                    acc[r][t]);
    }
  }
  if (paired < blocks) {  // an odd last block, in element order
    const int64_t b = paired;
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      const __m256i u = q8_weights<4>(q[t] + b * 16);
#pragma GCC unroll 8
      for (int r = 0; r < MT; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + b * kBlock));
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(u, xv)),
                                    _mm256_set1_ps(dx[r * blocks + b] * sc[t][b / per_group]), acc[r][t]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MT; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      float total = hsum(acc[r][t]);
      if (w.mins) {
        const float* xs = in.sum.get() + (m0 + r) * w.groups;
        for (int64_t g = 0; g < w.groups; ++g) total += m[t][g] * xs[g];
      }
      y[r * ldy + t] = total;
    }
}

// ---------------------------------------------------------------------------------------------
// q8 for larger M: tiles of 16 weight rows repacked so that one u8 x s8 instruction multiplies four
// activation bytes (broadcast) by four weights of each of 8 rows: eight of them per block and row of
// x, then one conversion and multiply-add, instead of one conversion per (row, output, block).
// 4-bit weights on any AVX2 CPU; 8-bit ones with VNNI (stored as q + 128, unsigned, the 128 * sum(xq)
// it adds taken off exactly in int32), else the q8_tile kernel serves them.

#if MRQ_VNNI
constexpr bool kPackedInt8 = true;
#else
constexpr bool kPackedInt8 = false;  // q + 128 up to 255 times 127 overflows maddubs' int16 pairs
#endif
constexpr int64_t kPackRows = 16;
#ifdef MRQ_AVX512
constexpr int kPackMaxRows = 4;  // x rows per tile: 16 int32 + 8 float accumulators of 32 registers
#else
constexpr int kPackMaxRows = 2;
#endif

inline __m256i dot_u8s8_add(__m256i acc, __m256i u, __m256i s) {
#if MRQ_VNNI == 1
  return _mm256_dpbusd_epi32(acc, u, s);
#elif MRQ_VNNI == 2
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// r[i] = 8 dwords of row i -> r[j] = dword j of rows 0..7.
inline void transpose8x8_epi32(__m256i* r) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x20);
    r[j + 4] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x31);
  }
}

// Rows [n0, n0 + 16) (zeros past N): data[b][kk][half][row][4] bytes, scales and mins [groups][16].
struct PackedRows {
  std::vector<__m256i> data;
  std::vector<float> scales, mins;

  template <int kBits, typename S>
  void pack(const QuantWeight& w, int64_t n0) {
    const int64_t blocks = w.cols / kBlock, rows = std::min(kPackRows, w.rows - n0);
    data.resize(static_cast<size_t>(blocks * 16));
    scales.assign(static_cast<size_t>(w.groups * kPackRows), 0.f);
    mins.assign(static_cast<size_t>(w.groups * kPackRows), 0.f);
    for (int64_t b = 0; b < blocks; ++b)
      for (int half = 0; half < 2; ++half) {
        __m256i r[8];
        for (int i = 0; i < 8; ++i) {
          const int64_t n = 8 * half + i;
          if (n >= rows) {
            r[i] = _mm256_setzero_si256();
          } else if constexpr (kBits == 4) {
            r[i] = q8_weights<4>(w.row(n0 + n) + b * 16);
          } else {
            const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.row(n0 + n) + b * kBlock));
            r[i] = _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80)));  // q + 128 as unsigned
          }
        }
        transpose8x8_epi32(r);
        for (int kk = 0; kk < 8; ++kk) data[static_cast<size_t>((b * 8 + kk) * 2 + half)] = r[kk];
      }
    const S* ws = w.scales_as<S>();
    const S* wm = w.mins_as<S>();
    for (int64_t n = 0; n < rows; ++n)
      for (int64_t g = 0; g < w.groups; ++g) {
        scales[g * kPackRows + n] = static_cast<float>(ws[(n0 + n) * w.groups + g]);
        if (wm) mins[g * kPackRows + n] = static_cast<float>(wm[(n0 + n) * w.groups + g]);
      }
  }
};

template <int kBits, int MT>
void q8_packed_tile(const QuantWeight& w, const PackedRows& pr, const QuantizedInput& in, int64_t m0, float* y,
                    int64_t ldy, int64_t n0) {
  const int64_t K = w.cols, blocks = K / kBlock, per_group = w.group / kBlock;
  const int8_t* xq = in.q.get() + m0 * K;
  const float* dx = in.d.get() + m0 * blocks;
  __m256 acc[MT][2];
#pragma GCC unroll 8
  for (int r = 0; r < MT; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0, b = 0; g < w.groups; ++g) {
    const __m256 s0 = _mm256_loadu_ps(pr.scales.data() + g * kPackRows);
    const __m256 s1 = _mm256_loadu_ps(pr.scales.data() + g * kPackRows + 8);
    for (const int64_t end = b + per_group; b < end; ++b) {
      __m256i isum[MT][2];
#pragma GCC unroll 8
      for (int r = 0; r < MT; ++r) {
        if constexpr (kBits == 4)
          isum[r][0] = isum[r][1] = _mm256_setzero_si256();
        else
          isum[r][0] = isum[r][1] = _mm256_set1_epi32(-128 * in.qsum[(m0 + r) * blocks + b]);
      }
      const __m256i* wp = pr.data.data() + b * 16;
#pragma GCC unroll 8
      for (int kk = 0; kk < 8; ++kk) {
        const __m256i w0 = wp[2 * kk], w1 = wp[2 * kk + 1];
#pragma GCC unroll 8
        for (int r = 0; r < MT; ++r) {
          int32_t four;
          std::memcpy(&four, xq + r * K + b * kBlock + 4 * kk, 4);
          const __m256i xb = _mm256_set1_epi32(four);
          isum[r][0] = dot_u8s8_add(isum[r][0], w0, xb);
          isum[r][1] = dot_u8s8_add(isum[r][1], w1, xb);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < MT; ++r) {
        const __m256 d = _mm256_set1_ps(dx[r * blocks + b]);
        acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][0]), _mm256_mul_ps(d, s0), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][1]), _mm256_mul_ps(d, s1), acc[r][1]);
      }
    }
    if (w.mins) {
      const __m256 m0v = _mm256_loadu_ps(pr.mins.data() + g * kPackRows);
      const __m256 m1v = _mm256_loadu_ps(pr.mins.data() + g * kPackRows + 8);
#pragma GCC unroll 8
      for (int r = 0; r < MT; ++r) {
        const __m256 xs = _mm256_set1_ps(in.sum[(m0 + r) * w.groups + g]);
        acc[r][0] = _mm256_fmadd_ps(m0v, xs, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(m1v, xs, acc[r][1]);
      }
    }
  }
  const int64_t rows = std::min(kPackRows, w.rows - n0);
#pragma GCC unroll 8
  for (int r = 0; r < MT; ++r) {
    float* out = y + r * ldy + n0;
    if (rows == kPackRows) {
      _mm256_storeu_ps(out, acc[r][0]);
      _mm256_storeu_ps(out + 8, acc[r][1]);
    } else {
      alignas(32) float lanes[16];
      _mm256_store_ps(lanes, acc[r][0]);
      _mm256_store_ps(lanes + 8, acc[r][1]);
      std::copy(lanes, lanes + rows, out);
    }
  }
}
#endif  // MRQ_AVX2

// ---------------------------------------------------------------------------------------------
// Portable fallbacks (no AVX2): the same arithmetic, plain loops.

#ifndef MRQ_AVX2
void exact_rows_scalar(const QuantWeight& w, const float* x, int64_t M, float* y, int64_t n0, int64_t n1) {
  std::vector<float> row(static_cast<size_t>(w.cols));
  RowScales rs;
  for (int64_t n = n0; n < n1; ++n) {
    dequantize_rows(w, n, n + 1, row.data(), rs);
    for (int64_t r = 0; r < M; ++r) {
      const float* xr = x + r * w.cols;
      float part[8] = {};
      for (int64_t k = 0; k < w.cols; k += 8)
        for (int j = 0; j < 8; ++j) part[j] += xr[k + j] * row[k + j];
      y[r * w.rows + n] = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
    }
  }
}

void q8_rows_scalar(const QuantWeight& w, const QuantizedInput& in, int64_t M, float* y, int64_t n0, int64_t n1) {
  const int64_t K = w.cols, blocks = K / kBlock, per_group = w.group / kBlock;
  RowScales rs;
  for (int64_t n = n0; n < n1; ++n) {
    rs.fetch(w, n, 1);
    const uint8_t* q = w.row(n);
    for (int64_t r = 0; r < M; ++r) {
      const int8_t* xq = in.q.get() + r * K;
      float total = 0.f;
      for (int64_t g = 0, b = 0; g < w.groups; ++g) {
        float part = 0.f;
        for (const int64_t end = b + per_group; b < end; ++b) {
          int32_t dot = 0;
          if (w.bits == 4) {
            for (int j = 0; j < 16; ++j)
              dot += (q[b * 16 + j] & 15) * xq[b * kBlock + j] + (q[b * 16 + j] >> 4) * xq[b * kBlock + j + 16];
          } else {
            const int8_t* qs = reinterpret_cast<const int8_t*>(q) + b * kBlock;
            for (int j = 0; j < kBlock; ++j) dot += qs[j] * xq[b * kBlock + j];
          }
          part += static_cast<float>(dot) * in.d[r * blocks + b];
        }
        total += part * rs.scales[g];
        if (w.mins) total += rs.mins[g] * in.sum[r * w.groups + g];
      }
      y[r * w.rows + n] = total;
    }
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// Drivers: rows [n0, n1) of y for every row of x.

// Calls visit.template operator()<MT>() for a run-time mt in 1..8.
template <typename F>
void with_mt(int64_t mt, F&& visit) {
  switch (mt) {
    case 1: visit.template operator()<1>(); break;
    case 2: visit.template operator()<2>(); break;
    case 3: visit.template operator()<3>(); break;
    case 4: visit.template operator()<4>(); break;
    case 5: visit.template operator()<5>(); break;
    case 6: visit.template operator()<6>(); break;
    case 7: visit.template operator()<7>(); break;
    default: visit.template operator()<8>(); break;
  }
}

// Rows [n0, n1) are taken in slices whose weights stay in L2 while every tile of x rows (at most
// max_rows, sizes balanced) passes over them; each weight byte is read from memory once.
template <typename Tiles>
void for_each_tile(const QuantWeight& w, int64_t M, int64_t n0, int64_t n1, int64_t max_rows, Tiles&& tiles) {
  constexpr int64_t kSliceBytes = 128 << 10;
  const int64_t slice = std::max<int64_t>(16, kSliceBytes / std::max<int64_t>(1, w.row_bytes));
  RowScales rs;
  for (int64_t s0 = n0; s0 < n1; s0 += slice) {
    const int64_t s1 = std::min(n1, s0 + slice);
    rs.fetch(w, s0, s1 - s0);
    const int64_t count = (M + max_rows - 1) / max_rows;
    for (int64_t i = 0, m0 = 0; i < count; ++i) {
      const int64_t mt = (M - m0 + (count - i) - 1) / (count - i);
      tiles(rs, s0, s1, m0, mt);
      m0 += mt;
    }
  }
}

// Rows [n, n + NT) of the slice that starts at s0, as the tile functions take them.
template <int NT>
struct TileRows {
  const uint8_t* rows[NT];
  const float* s[NT];
  const float* m[NT];
  TileRows(const QuantWeight& w, const RowScales& rs, int64_t s0, int64_t n) {
    for (int t = 0; t < NT; ++t) {
      rows[t] = w.row(n + t);
      s[t] = rs.scale(n + t - s0, w.groups);
      m[t] = rs.min(n + t - s0, w.groups);
    }
  }
};

template <int kBits>
void exact_rows(const QuantWeight& w, const float* x, int64_t M, float* y, int64_t n0, int64_t n1) {
#ifdef MRQ_AVX2
  if (w.half_groups()) {  // tiles of 8, 4, 2 and 1 rows of x only (fewer instantiations)
    for_each_tile(w, M, n0, n1, 8, [&](const RowScales& rs, int64_t s0, int64_t s1, int64_t m0, int64_t mt) {
      for (int64_t part : {8, 4, 2, 1}) {
        if (!(mt & part)) continue;
        const auto run = [&]<int MT>() {
          constexpr int NT = exact_nt(MT);
          const float* xm = x + m0 * w.cols;
          float* ym = y + m0 * w.rows;
          int64_t n = s0;
          for (; n + NT <= s1; n += NT) {
            const TileRows<NT> tr(w, rs, s0, n);
            exact_tile<kBits, -1, MT, NT>(w, tr.rows, tr.s, tr.m, xm, ym + n, w.rows);
          }
          for (; n < s1; ++n) {
            const TileRows<1> tr(w, rs, s0, n);
            exact_tile<kBits, -1, MT, 1>(w, tr.rows, tr.s, tr.m, xm, ym + n, w.rows);
          }
        };
        part == 8 ? run.template operator()<8>() : part == 4 ? run.template operator()<4>()
                  : part == 2 ? run.template operator()<2>() : run.template operator()<1>();
        m0 += part;
      }
    });
    return;
  }
  for_each_tile(w, M, n0, n1, 8, [&](const RowScales& rs, int64_t s0, int64_t s1, int64_t m0, int64_t mt) {
    with_mt(mt, [&]<int MT>() {
      constexpr int NT = exact_nt(MT);
      const float* xm = x + m0 * w.cols;
      float* ym = y + m0 * w.rows;
      int64_t n = s0;
      for (; n + NT <= s1; n += NT) {
        const TileRows<NT> tr(w, rs, s0, n);
        (w.group == kBlock ? exact_tile<kBits, 1, MT, NT> : exact_tile<kBits, 0, MT, NT>)(w, tr.rows, tr.s, tr.m, xm,
                                                                                          ym + n, w.rows);
      }
      for (; n < s1; ++n) {
        const TileRows<1> tr(w, rs, s0, n);
        (w.group == kBlock ? exact_tile<kBits, 1, MT, 1> : exact_tile<kBits, 0, MT, 1>)(w, tr.rows, tr.s, tr.m, xm,
                                                                                        ym + n, w.rows);
      }
    });
  });
#else
  exact_rows_scalar(w, x, M, y, n0, n1);
#endif
}

template <int kBits>
void q8_rows(const QuantWeight& w, const QuantizedInput& in, int64_t M, float* y, int64_t n0, int64_t n1) {
#ifdef MRQ_AVX2
  if constexpr (kBits == 4) {
    if (q8_takes_pairs(w)) {
      for_each_tile(w, M, n0, n1, kQ8MaxRows, [&](const RowScales& rs, int64_t s0, int64_t s1, int64_t m0, int64_t mt) {
        with_mt(mt, [&]<int MT>() {
          constexpr int NT = pairs_nt(MT);
          float* ym = y + m0 * w.rows;
          int64_t n = s0;
          for (; n + NT <= s1; n += NT) {
            const TileRows<NT> tr(w, rs, s0, n);
            (w.group == kBlock ? q8_pairs_tile<1, MT, NT> : q8_pairs_tile<0, MT, NT>)(w, tr.rows, tr.s, tr.m, in, m0,
                                                                                      ym + n, w.rows);
          }
          for (; n < s1; ++n) {
            const TileRows<1> tr(w, rs, s0, n);
            (w.group == kBlock ? q8_pairs_tile<1, MT, 1> : q8_pairs_tile<0, MT, 1>)(w, tr.rows, tr.s, tr.m, in, m0,
                                                                                    ym + n, w.rows);
          }
        });
      });
      return;
    }
  }
  for_each_tile(w, M, n0, n1, kQ8MaxRows, [&](const RowScales& rs, int64_t s0, int64_t s1, int64_t m0, int64_t mt) {
    with_mt(mt, [&]<int MT>() {
      constexpr int NT = q8_nt(MT);
      float* ym = y + m0 * w.rows;
      int64_t n = s0;
      for (; n + NT <= s1; n += NT) {
        const TileRows<NT> tr(w, rs, s0, n);
        (w.group == kBlock ? q8_tile<kBits, 1, MT, NT> : q8_tile<kBits, 0, MT, NT>)(w, tr.rows, tr.s, tr.m, in, m0,
                                                                                    ym + n, w.rows);
      }
      for (; n < s1; ++n) {
        const TileRows<1> tr(w, rs, s0, n);
        (w.group == kBlock ? q8_tile<kBits, 1, MT, 1> : q8_tile<kBits, 0, MT, 1>)(w, tr.rows, tr.s, tr.m, in, m0,
                                                                                  ym + n, w.rows);
      }
    });
  });
#else
  q8_rows_scalar(w, in, M, y, n0, n1);
#endif
}

// q8 with the packed kernel: each tile of 16 weight rows is repacked once, then every row of x
// passes over it (the repacked tile, 16 * K bytes, stays in L1). S: the scales' type.
template <int kBits, typename S>
void q8_packed_rows(const QuantWeight& w, const QuantizedInput& in, int64_t M, float* y, int64_t n0, int64_t n1) {
#ifdef MRQ_AVX2
  PackedRows pr;
  const int64_t count = (M + kPackMaxRows - 1) / kPackMaxRows;
  for (int64_t n = n0; n < n1; n += kPackRows) {
    pr.pack<kBits, S>(w, n);
    for (int64_t i = 0, m0 = 0; i < count; ++i) {
      const int64_t mt = (M - m0 + (count - i) - 1) / (count - i);
      with_mt(mt, [&]<int MT>() {
        if constexpr (MT <= kPackMaxRows) q8_packed_tile<kBits, MT>(w, pr, in, m0, y + m0 * w.rows, w.rows, n);
      });
      m0 += mt;
    }
  }
#endif
}

// Large M: tiles of rows dequantized into a per-thread float buffer (about 256 KB, so it stays in
// L2, but at least kMinTileRows rows), each multiplied by MKL/oneDNN through at::mm into its
// columns of y. Tiles are whole multiples of 16 rows (but the last). dequantize(n0, n1, out, tile,
// scratch) writes rows [n0, n1) of the weight as floats, [n1 - n0][K]; kTransposed: as columns,
// [K][tile] (the tile's row count rounded up to 16 may be written, the rest left out of the
// product). Scratch is its per-thread state.
template <typename Scratch, bool kTransposed, typename Dequantize>
void gemm_tiles(int64_t N, int64_t K, const at::Tensor& x, at::Tensor& y, Dequantize&& dequantize) {
  constexpr int64_t kTileBytes = 256 << 10;
  // A narrow tile is a narrow GEMM, which MKL runs slowly: 256 KB left SmolLM2's down projection
  // (K = 1,536) 32 columns. Timed on Zen 3 (2 threads, alternating builds, the same outputs bitwise):
  // that projection at 64 rows 884-897 us with 32 columns, 749-757 with this floor; a 256-token
  // prompt through the engine 555 tok/s (median of 5 runs) against 610 (of 7); floors of 128, 160,
  // 224, 256 and 384 rows and 1 MB tiles were no better.
  constexpr int64_t kMinTileRows = 192;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t max_tile = std::max<int64_t>(kMinTileRows, kTileBytes / (4 * K) / 16 * 16);
  int64_t tiles = (N + max_tile - 1) / max_tile;
  tiles = std::min((tiles + threads - 1) / threads * threads, (N + 15) / 16);  // every thread busy
  const int64_t tile = ((N + tiles - 1) / tiles + 15) / 16 * 16;
  tiles = (N + tile - 1) / tile;
  // at::parallel_for does not carry the caller's inference mode into its threads: without it, at::mm_out
  // into a view of an inference tensor y fails there ("inplace update to inference tensor").
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    c10::InferenceMode guard(inference);
    at::Tensor buffer = kTransposed ? at::empty({K, tile}, x.options()) : at::empty({tile, K}, x.options());
    Scratch scratch;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * tile, n1 = std::min(N, n0 + tile);
      dequantize(n0, n1, buffer.data_ptr<float>(), tile, scratch);
      at::Tensor out = y.narrow(1, n0, n1 - n0);
      at::mm_out(out, x, kTransposed ? buffer.narrow(1, 0, n1 - n0) : buffer.narrow(0, 0, n1 - n0).t());
    }
  });
}

void exact_gemm(const QuantWeight& w, const at::Tensor& x, at::Tensor& y) {
  gemm_tiles<RowScales, false>(w.rows, w.cols, x, y, [&](int64_t n0, int64_t n1, float* out, int64_t, RowScales& rs) {
    dequantize_rows(w, n0, n1, out, rs);
  });
}

// ---------------------------------------------------------------------------------------------
// "p16": the q8 arithmetic on weights stored pre-interleaved in tiles of 16 rows, so that one u8 x s8
// instruction multiplies four activation bytes (broadcast) by four weights of each of 16 rows and
// a block's 16 results land in 16 lanes, scaled together. Nothing is repacked per call (the q8
// packed kernel above repacks each tile on every call, which costs more than it saves at one row
// of x), so it serves every M, one row included. Layout, rows padded to a multiple of 16 with zeros:
//   4-bit: data[tile][block][p = 0..3][row 0..15][4 bytes] = bytes 4p..4p+3 of the row's block
//          (low nibbles: elements 4p..4p+3; high nibbles: elements 16+4p..16+4p+3);
//   8-bit: data[tile][block][kk = 0..7][row][4 bytes] = q + 128 (unsigned) of elements 4kk..4kk+3;
//   scales, mins: [tile][group][16], float16 or float32 as the planar ones (groups of 16: two per block).
// The tensors keep the planar shapes ([N16, K*bits/8] and [N16, groups]): the same bytes, reordered.

constexpr int64_t kP16 = 16;

// Word row j of a p16 block, weight e of each dword lane: its column in the block that starts at k0
// (4-bit: nibble e, elements 4j + e/2 in the low nibbles, 16 + 4j + e/2 in the high ones; 8-bit:
// byte e, element 4j + e).
template <int kBits>
constexpr int64_t p16_column(int64_t k0, int j, int e) {
  return kBits == 4 ? k0 + (e & 1 ? 16 : 0) + 4 * j + (e >> 1) : k0 + 4 * j + e;
}

bool p16_supported_bits(int64_t bits) {
#if defined(MRQ_AVX2) && defined(MRQ_VNNI)
  return bits == 4 || bits == 8;
#elif defined(MRQ_AVX2)
  return bits == 4;  // q + 128 up to 255 times 127 overflows maddubs' int16 pairs
#else
  (void)bits;
  return false;
#endif
}

// The pieces of one p16 weight, validated (shapes as the planar ones with rows padded to 16).
struct P16Weight : QuantWeight {
  int64_t valid_rows = 0;  // the real rows (QuantWeight::rows counts the padded ones)
  int64_t tile_bytes = 0;
};

P16Weight check_p16(const at::Tensor& data, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                    int64_t rows, int64_t group_size, int64_t bits) {
  // The planar checks apply to the padded tensors as they are.
  const QuantWeight q = check_weight(data, scales, mins, group_size, bits);
  TORCH_CHECK_VALUE(q.rows % kP16 == 0, "p16 weights have a multiple of 16 rows, got ", q.rows);
  TORCH_CHECK_VALUE(rows > q.rows - kP16 && rows <= q.rows, "rows must be in (", q.rows - kP16, ", ", q.rows,
                    "] for p16 weights of ", q.rows, " padded rows, got ", rows);
  P16Weight w;
  static_cast<QuantWeight&>(w) = q;
  w.valid_rows = rows;
  w.tile_bytes = kP16 * q.row_bytes;
  return w;
}

// A p16 operator's checks (the weight, x, and that this build has the kernel: `built`, else the
// message names the kernel and what it `needs`) and its output [M, rows], not yet written.
std::pair<P16Weight, at::Tensor> p16_operands(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scales,
                                              const std::optional<at::Tensor>& mins, int64_t rows, int64_t group_size,
                                              int64_t bits, bool built, const char* kernel, const char* needs) {
  P16Weight w = check_p16(data, scales, mins, rows, group_size, bits);
  TORCH_CHECK_VALUE(built, "this build of the kernels has no ", kernel, " kernel for ", bits, "-bit weights (", needs,
                    ")");
  check_input(x, w);
  at::Tensor y = at::empty({x.size(0), w.valid_rows}, x.options());
  return {w, y};
}

// Planar [N, ...] -> p16 [N16, ...].
std::vector<at::Tensor> pack_p16(const at::Tensor& qweight, const at::Tensor& scales,
                                 const std::optional<at::Tensor>& mins, int64_t group_size, int64_t bits) {
  const QuantWeight w = check_weight(qweight, scales, mins, group_size, bits);
  const int64_t rows16 = (w.rows + kP16 - 1) / kP16 * kP16, tiles = rows16 / kP16, blocks = w.cols / kBlock;
  at::Tensor data = at::zeros({rows16, w.row_bytes}, qweight.options());
  at::Tensor sc = at::zeros({rows16, w.groups}, scales.options());
  at::Tensor mn = mins.has_value() ? at::zeros({rows16, w.groups}, scales.options()) : at::Tensor();
  uint8_t* out = static_cast<uint8_t*>(data.data_ptr());
  // The grids' elements as bytes (float16 or float32: copied as they are).
  const int64_t size = scales.element_size();
  uint8_t* so = static_cast<uint8_t*>(sc.data_ptr());
  uint8_t* mo = mins.has_value() ? static_cast<uint8_t*>(mn.data_ptr()) : nullptr;
  const uint8_t* si = static_cast<const uint8_t*>(w.scales);
  const uint8_t* mi = static_cast<const uint8_t*>(w.mins);
  const int64_t words = bits == 4 ? 4 : 8;  // 4-byte words per row and block
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      uint8_t* tile = out + t * kP16 * w.row_bytes;
      for (int64_t r = 0; r < kP16; ++r) {
        const int64_t n = t * kP16 + r;
        if (n >= w.rows) {
          if (bits == 8)  // a zero weight is 128 unsigned
            for (int64_t b = 0; b < blocks; ++b)
              for (int64_t j = 0; j < words; ++j) std::memset(tile + ((b * words + j) * kP16 + r) * 4, 0x80, 4);
          continue;
        }
        const uint8_t* src = w.row(n);
        for (int64_t b = 0; b < blocks; ++b)
          for (int64_t j = 0; j < words; ++j) {
            uint8_t* dst = tile + ((b * words + j) * kP16 + r) * 4;
            const uint8_t* from = src + b * words * 4 + j * 4;
            for (int i = 0; i < 4; ++i) dst[i] = bits == 8 ? static_cast<uint8_t>(from[i] ^ 0x80) : from[i];
          }
        for (int64_t g = 0; g < w.groups; ++g) {
          std::memcpy(so + ((t * w.groups + g) * kP16 + r) * size, si + (n * w.groups + g) * size, size);
          if (mo) std::memcpy(mo + ((t * w.groups + g) * kP16 + r) * size, mi + (n * w.groups + g) * size, size);
        }
      }
    }
  });
  return {data, sc, mn};
}

#ifdef MRQ_AVX2
inline int32_t load_word(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Tile t's weight bytes, scales and mins (nullptr without mins), the grids of type S.
template <typename S = at::Half>
inline std::tuple<const uint8_t*, const S*, const S*> p16_tile_parts(const P16Weight& w, int64_t t) {
  return {w.data + t * w.tile_bytes, w.scales_as<S>() + t * w.groups * kP16,
          w.mins ? w.mins_as<S>() + t * w.groups * kP16 : nullptr};
}

// 8 or 16 consecutive scales (or mins) of type S as floats.
template <typename S>
inline __m256 load8(const S* p) {
  if constexpr (std::is_same_v<S, float>)
    return _mm256_loadu_ps(p);
  else
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#ifdef MRQ_AVX512
template <typename S>
inline __m512 load16(const S* p) {
  if constexpr (std::is_same_v<S, float>)
    return _mm512_loadu_ps(p);
  else
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

constexpr int64_t kP16Ahead = 1024;  // see kStreamAhead (a p16 tile is one stream, read faster)

#if defined(MRQ_AVX512) && MRQ_VNNI == 1
constexpr int kP16MaxRows = 4;
// Rows [m0, m0 + MT) of x against tile t: 16 outputs per row of x. D: the digits x is written in
// (1: q8; kSplitDigits: the split kernel, below), each an integer sum per block. S: the scales' type.
template <int kBits, int MT, int D = 1, typename S = at::Half>
void p16_tile(const P16Weight& w, int64_t t, const QuantizedInput* in, int64_t m0, float* y, int64_t ldy) {
  const int64_t K = w.cols, blocks = K / kBlock, per_group = w.group / kBlock;
  const auto [tile, ts, tm] = p16_tile_parts<S>(w, t);
  constexpr int64_t kBlockBytes = kBits * kBlock * kP16 / 8;
  const __m512i low = _mm512_set1_epi8(0x0f);
  __m512 acc[MT];
#pragma GCC unroll 4
  for (int r = 0; r < MT; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0, b = 0; g < w.groups; ++g) {
    const __m512 s = load16(ts + g * kP16);
    for (const int64_t end = b + per_group; b < end; ++b) {
      const uint8_t* p = tile + b * kBlockBytes;
#pragma GCC unroll 8
      for (int64_t line = 0; line < kBlockBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(p) + kP16Ahead + line, _MM_HINT_NTA);
      __m512i isum[MT][D];
#pragma GCC unroll 4
      for (int r = 0; r < MT; ++r)
#pragma GCC unroll 3
        for (int j = 0; j < D; ++j)
          isum[r][j] = kBits == 4 ? _mm512_setzero_si512()
                                  : _mm512_set1_epi32(-128 * in[j].qsum[(m0 + r) * blocks + b]);
      if constexpr (kBits == 4) {
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
          const __m512i bytes = _mm512_loadu_si512(p + k * 64);
          const __m512i lo = _mm512_and_si512(bytes, low), hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
#pragma GCC unroll 4
          for (int r = 0; r < MT; ++r)
#pragma GCC unroll 3
            for (int j = 0; j < D; ++j) {
              const int8_t* xq = in[j].q.get() + (m0 + r) * K + b * kBlock;
              isum[r][j] = _mm512_dpbusd_epi32(isum[r][j], lo, _mm512_set1_epi32(load_word(xq + 4 * k)));
              isum[r][j] = _mm512_dpbusd_epi32(isum[r][j], hi, _mm512_set1_epi32(load_word(xq + 16 + 4 * k)));
            }
        }
      } else {
#pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) {
          const __m512i bytes = _mm512_loadu_si512(p + k * 64);
#pragma GCC unroll 4
          for (int r = 0; r < MT; ++r)
#pragma GCC unroll 3
            for (int j = 0; j < D; ++j) {
              const int8_t* xq = in[j].q.get() + (m0 + r) * K + b * kBlock;
              isum[r][j] = _mm512_dpbusd_epi32(isum[r][j], bytes, _mm512_set1_epi32(load_word(xq + 4 * k)));
            }
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < MT; ++r) {
        const int64_t at = (m0 + r) * blocks + b;
        if constexpr (D == 1) {
          const __m512 scale = _mm512_mul_ps(s, _mm512_set1_ps(in[0].d[at]));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][0]), scale, acc[r]);
          continue;
        }
        // The smallest digit first: the sum adds like magnitudes before the largest.
        __m512 part = _mm512_mul_ps(_mm512_cvtepi32_ps(isum[r][D - 1]), _mm512_set1_ps(in[D - 1].d[at]));
#pragma GCC unroll 3
        for (int j = D - 2; j >= 0; --j)
          part = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][j]), _mm512_set1_ps(in[j].d[at]), part);
        acc[r] = _mm512_fmadd_ps(part, s, acc[r]);
      }
    }
    if (tm) {
      const __m512 mv = load16(tm + g * kP16);
#pragma GCC unroll 4
      for (int r = 0; r < MT; ++r)
        acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(in[0].sum[(m0 + r) * w.groups + g]), acc[r]);
    }
  }
  const int64_t n0 = t * kP16, valid = std::min(kP16, w.valid_rows - n0);
  const __mmask16 mask = valid == kP16 ? __mmask16(0xffff) : __mmask16((1u << valid) - 1);
#pragma GCC unroll 4
  for (int r = 0; r < MT; ++r) _mm512_mask_storeu_ps(y + r * ldy + n0, mask, acc[r]);
}
#else
constexpr int kP16MaxRows = 2;
// The same with 256-bit registers: each 64-byte word row holds rows 0-7, then rows 8-15.
template <int kBits, int MT, int D = 1, typename S = at::Half>
void p16_tile(const P16Weight& w, int64_t t, const QuantizedInput* digits, int64_t m0, float* y, int64_t ldy) {
  static_assert(D == 1, "the split kernel needs AVX-512 VNNI");
  const QuantizedInput& in = digits[0];
  const int64_t K = w.cols, blocks = K / kBlock, per_group = w.group / kBlock;
  const auto [tile, ts, tm] = p16_tile_parts<S>(w, t);
  constexpr int64_t kBlockBytes = kBits * kBlock * kP16 / 8;
  const __m256i low = _mm256_set1_epi8(0x0f);
  __m256 acc[MT][2];
  for (int r = 0; r < MT; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0, b = 0; g < w.groups; ++g) {
    __m256 s[2];
    for (int h = 0; h < 2; ++h)
      s[h] = load8(ts + g * kP16 + 8 * h);
    for (const int64_t end = b + per_group; b < end; ++b) {
      const uint8_t* p = tile + b * kBlockBytes;
      for (int64_t line = 0; line < kBlockBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(p) + kP16Ahead + line, _MM_HINT_NTA);
      __m256i isum[MT][2];
      for (int r = 0; r < MT; ++r)
        isum[r][0] = isum[r][1] =
            kBits == 4 ? _mm256_setzero_si256() : _mm256_set1_epi32(-128 * in.qsum[(m0 + r) * blocks + b]);
      for (int j = 0; j < (kBits == 4 ? 4 : 8); ++j)
        for (int h = 0; h < 2; ++h) {
          const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j * 64 + 32 * h));
          for (int r = 0; r < MT; ++r) {
            const int8_t* xq = in.q.get() + (m0 + r) * K + b * kBlock;
            if constexpr (kBits == 4) {
              const __m256i lo = _mm256_and_si256(bytes, low), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
              isum[r][h] = dot_u8s8_add(isum[r][h], lo, _mm256_set1_epi32(load_word(xq + 4 * j)));
              isum[r][h] = dot_u8s8_add(isum[r][h], hi, _mm256_set1_epi32(load_word(xq + 16 + 4 * j)));
            } else {
              isum[r][h] = dot_u8s8_add(isum[r][h], bytes, _mm256_set1_epi32(load_word(xq + 4 * j)));
            }
          }
        }
      for (int r = 0; r < MT; ++r) {
        const __m256 d = _mm256_set1_ps(in.d[(m0 + r) * blocks + b]);
        for (int h = 0; h < 2; ++h)
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][h]), _mm256_mul_ps(s[h], d), acc[r][h]);
      }
    }
    if (tm) {
      for (int h = 0; h < 2; ++h) {
        const __m256 mv = load8(tm + g * kP16 + 8 * h);
        for (int r = 0; r < MT; ++r)
          acc[r][h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(in.sum[(m0 + r) * w.groups + g]), acc[r][h]);
      }
    }
  }
  const int64_t n0 = t * kP16, valid = std::min(kP16, w.valid_rows - n0);
  for (int r = 0; r < MT; ++r) {
    alignas(32) float lanes[16];
    _mm256_store_ps(lanes, acc[r][0]);
    _mm256_store_ps(lanes + 8, acc[r][1]);
    std::copy(lanes, lanes + valid, y + r * ldy + n0);
  }
}
#endif
#endif  // MRQ_AVX2

// ---------------------------------------------------------------------------------------------
// "p16 exact": float activations on the p16 layout. A 64-byte word row holds 16 rows' words, one
// dword lane per row, so each integer q of 16 rows becomes 16 float lanes with one shift and one
// lookup (4-bit: a permute of the table 0..15 reads the low 4 bits of each lane) or a sign
// extension (8-bit), then one multiply-add with the activation broadcast. Per group:
//   y += s * sum_k x_k q_k + m * sum_k x_k
// with float products and sums (the same value as the float matmul with the dequantized weights, up
// to summation order). No horizontal sums, and a converted weight vector serves every row of x.
// AVX2 takes each tile as two halves of 8 rows (below); from kP16GemmRows rows of x on, it dequantizes
// tiles for MKL instead, as the planar exact kernel does.

bool p16_exact_supported_bits(int64_t bits) {
#ifdef MRQ_AVX2
  return bits == 4 || bits == 8;
#else
  (void)bits;
  return false;
#endif
}

#ifdef MRQ_AVX512

constexpr int p16x_nt(int mt) { return mt == 1 ? 4 : mt <= 4 ? 2 : 1; }

// Rows [m0, m0 + MT) of x against tiles [t0, t0 + NT): 16 outputs per tile and row of x.
// sums: float [M][groups], the exact sums of x per group. S: the scales' type; kHalf: groups of 16.
template <int kBits, bool kMins, int MT, int NT, typename S = at::Half, bool kHalf = false>
void p16x_tile(const P16Weight& w, int64_t t0, const float* x, const float* sums, int64_t m0, float* y, int64_t ldy) {
  const int64_t K = w.cols, per_group = w.group / kBlock;
  constexpr int64_t kBlockBytes = kBits * kBlock * kP16 / 8;
  const uint8_t* tile[NT];
  const S* ts[NT];
  const S* tm[NT];
#pragma GCC unroll 4
  for (int t = 0; t < NT; ++t) std::tie(tile[t], ts[t], tm[t]) = p16_tile_parts<S>(w, t0 + t);
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i flip = _mm512_set1_epi32(static_cast<int32_t>(0x80808080u));
  __m512 acc[MT][NT];
#pragma GCC unroll 8
  for (int r = 0; r < MT; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  const float* xr[MT];
#pragma GCC unroll 8
  for (int r = 0; r < MT; ++r) xr[r] = x + (m0 + r) * K;
  if constexpr (kHalf) {
    // Two groups per block, its elements 0..15 (4-bit: the low nibbles of its word rows; 8-bit: word
    // rows 0..3) and 16..31 (the high nibbles; word rows 4..7): a pass over each, then its scale and
    // min, as the loop below does per group.
    for (int64_t b = 0; b < K / kBlock; ++b) {
      const int64_t k0 = b * kBlock;
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) {
        const uint8_t* p = tile[t] + b * kBlockBytes;
#pragma GCC unroll 8
        for (int64_t line = 0; line < kBlockBytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(p) + kP16Ahead + line, _MM_HINT_NTA);
      }
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        __m512 part[MT][NT];
#pragma GCC unroll 8
        for (int r = 0; r < MT; ++r)
#pragma GCC unroll 4
          for (int t = 0; t < NT; ++t) part[r][t] = _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int jj = 0; jj < 4; ++jj) {
          const int j = kBits == 4 ? jj : 4 * h + jj;
          __m512i v[NT];
#pragma GCC unroll 4
          for (int t = 0; t < NT; ++t) {
            v[t] = _mm512_loadu_si512(tile[t] + b * kBlockBytes + j * 64);
            if constexpr (kBits == 8) v[t] = _mm512_xor_si512(v[t], flip);
          }
#pragma GCC unroll 4
          for (int ii = 0; ii < 4; ++ii) {
            const int i = kBits == 4 ? h + 2 * ii : ii;  // 4-bit: nibble i, element 16h + 4j + ii
            const int64_t k = kBits == 4 ? k0 + 16 * h + 4 * j + ii : k0 + 4 * j + i;
#pragma GCC unroll 4
            for (int t = 0; t < NT; ++t) {
              __m512 q;
              if constexpr (kBits == 4) {
                q = _mm512_permutexvar_ps(i == 0 ? v[t] : _mm512_srli_epi32(v[t], 4 * i), iota);
              } else {
                const __m512i lane = i == 3 ? v[t] : _mm512_slli_epi32(v[t], 24 - 8 * i);
                q = _mm512_cvtepi32_ps(_mm512_srai_epi32(lane, 24));
              }
#pragma GCC unroll 8
              for (int r = 0; r < MT; ++r) part[r][t] = _mm512_fmadd_ps(q, _mm512_set1_ps(xr[r][k]), part[r][t]);
            }
          }
        }
        const int64_t g = 2 * b + h;
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) {
          const __m512 s = load16(ts[t] + g * kP16);
#pragma GCC unroll 8
          for (int r = 0; r < MT; ++r) acc[r][t] = _mm512_fmadd_ps(part[r][t], s, acc[r][t]);
          if constexpr (kMins) {
            const __m512 mv = load16(tm[t] + g * kP16);
#pragma GCC unroll 8
            for (int r = 0; r < MT; ++r)
              acc[r][t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sums[(m0 + r) * w.groups + g]), acc[r][t]);
          }
        }
      }
    }
  } else {
    for (int64_t g = 0, b = 0; g < w.groups; ++g) {
      __m512 part[MT][NT];
#pragma GCC unroll 8
      for (int r = 0; r < MT; ++r)
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) part[r][t] = _mm512_setzero_ps();
      for (const int64_t end = b + per_group; b < end; ++b) {
        const int64_t k0 = b * kBlock;
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) {
          const uint8_t* p = tile[t] + b * kBlockBytes;
#pragma GCC unroll 8
          for (int64_t line = 0; line < kBlockBytes; line += 64)
            _mm_prefetch(reinterpret_cast<const char*>(p) + kP16Ahead + line, _MM_HINT_NTA);
        }
        // Word row j of the block: 4-bit, bytes 4j..4j+3 of each row (low nibbles: elements 4j..4j+3,
        // high nibbles: 16+4j..16+4j+3); 8-bit, elements 4j..4j+3 as q + 128.
#pragma GCC unroll 8
        for (int j = 0; j < (kBits == 4 ? 4 : 8); ++j) {
          __m512i v[NT];
#pragma GCC unroll 4
          for (int t = 0; t < NT; ++t) {
            v[t] = _mm512_loadu_si512(tile[t] + b * kBlockBytes + j * 64);
            if constexpr (kBits == 8) v[t] = _mm512_xor_si512(v[t], flip);  // back to signed q
          }
#pragma GCC unroll 8
          for (int i = 0; i < 8; ++i) {
            if (kBits == 8 && i >= 4) break;
            const int64_t k = kBits == 4 ? k0 + (i & 1 ? 16 : 0) + 4 * j + (i >> 1) : k0 + 4 * j + i;
#pragma GCC unroll 4
            for (int t = 0; t < NT; ++t) {
              __m512 q;
              if constexpr (kBits == 4) {
                q = _mm512_permutexvar_ps(i == 0 ? v[t] : _mm512_srli_epi32(v[t], 4 * i), iota);
              } else {
                const __m512i lane = i == 3 ? v[t] : _mm512_slli_epi32(v[t], 24 - 8 * i);
                q = _mm512_cvtepi32_ps(_mm512_srai_epi32(lane, 24));
              }
#pragma GCC unroll 8
              for (int r = 0; r < MT; ++r) part[r][t] = _mm512_fmadd_ps(q, _mm512_set1_ps(xr[r][k]), part[r][t]);
            }
          }
        }
      }
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) {
        const __m512 s = load16(ts[t] + g * kP16);
#pragma GCC unroll 8
        for (int r = 0; r < MT; ++r) acc[r][t] = _mm512_fmadd_ps(part[r][t], s, acc[r][t]);
        if constexpr (kMins) {
          const __m512 mv = load16(tm[t] + g * kP16);
#pragma GCC unroll 8
          for (int r = 0; r < MT; ++r)
            acc[r][t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sums[(m0 + r) * w.groups + g]), acc[r][t]);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < NT; ++t) {
    const int64_t n0 = (t0 + t) * kP16, valid = std::min(kP16, w.valid_rows - n0);
    const __mmask16 mask = valid == kP16 ? __mmask16(0xffff) : __mmask16((1u << valid) - 1);
#pragma GCC unroll 8
    for (int r = 0; r < MT; ++r) _mm512_mask_storeu_ps(y + r * ldy + n0, mask, acc[r][t]);
  }
}

// Tiles [u0, u1) for every row of x: NT tiles at a time where the row count allows, each group of
// tiles (at most 4 * 16 rows of K weights: in L1/L2) passed over by every tile of x rows. x rows go
// 8 at a time, the rest as 4, 2 and 1 (fewer instantiations to compile than every count up to 8).
template <int kBits, bool kMins, typename S, bool kHalf>
void p16x_rows(const P16Weight& w, const float* x, const float* sums, int64_t M, float* y, int64_t u0, int64_t u1) {
  const int64_t step_max = p16x_nt(static_cast<int>(std::min<int64_t>(M, 2)));
  for (int64_t t = u0; t < u1;) {
    const int64_t step = std::min<int64_t>(u1 - t, step_max);
    for (int64_t m0 = 0; m0 < M;) {
      const int64_t left = M - m0, mt = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
      const auto run = [&]<int MT>() {
        constexpr int NT = p16x_nt(MT);
        // A tile group shorter than NT (the end of the rows) goes one tile at a time.
        for (int64_t s = 0; s < step;) {
          if (step - s >= NT) {
            p16x_tile<kBits, kMins, MT, NT, S, kHalf>(w, t + s, x, sums, m0, y + m0 * w.valid_rows, w.valid_rows);
            s += NT;
          } else {
            p16x_tile<kBits, kMins, MT, 1, S, kHalf>(w, t + s, x, sums, m0, y + m0 * w.valid_rows, w.valid_rows);
            s += 1;
          }
        }
      };
      mt == 8 ? run.template operator()<8>() : mt == 4 ? run.template operator()<4>()
                : mt == 2 ? run.template operator()<2>() : run.template operator()<1>();
      m0 += mt;
    }
    t += step;
  }
}
#elif defined(MRQ_AVX2)

// AVX2 has 8 float lanes: a p16 tile is two halves of 8 rows, the low and the high 32 bytes of each
// 64-byte word row, taken NH halves at a time. A 4-bit weight becomes a float lane with a shift, a
// mask and a conversion (no 16-entry table in one register here); an 8-bit one as on AVX-512.
constexpr int p16x_nh(int mt) { return mt == 1 ? 4 : mt == 2 ? 2 : 1; }

// Weight e of each of 8 dword lanes of v as floats: 4-bit, nibble e (a shift, a mask, a conversion);
// 8-bit, byte e, already flipped back to signed q (a sign extension, a conversion).
template <int kBits>
inline __m256 p16_lanes(__m256i v, int e) {
  if constexpr (kBits == 4) {
    const __m256i lane = e == 0 ? v : _mm256_srli_epi32(v, 4 * e);
    return _mm256_cvtepi32_ps(e == 7 ? lane : _mm256_and_si256(lane, _mm256_set1_epi32(15)));
  } else {
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(e == 3 ? v : _mm256_slli_epi32(v, 24 - 8 * e), 24));
  }
}
// p16_lanes' floats times 16^e, for the exact kernel. 4-bit: nibble e masked in place (one AND where
// p16_lanes shifts and masks; q * 16^e is exact in float and positive in int32 up to e = 6), nibble 7
// shifted down as before. The x it multiplies is scaled by 16^-e (p16_scaled_x), so every product
// and sum is the same float as with p16_lanes. On Zen 3 this kernel is bound by vector operations
// (four a cycle), not memory: one fewer of four per 8 weights made one row 5-10% faster. 8-bit: as
// p16_lanes.
template <int kBits>
inline __m256 p16_scaled_lanes(__m256i v, int e) {
  if constexpr (kBits == 4) {
    return _mm256_cvtepi32_ps(e == 7 ? _mm256_srli_epi32(v, 28) : _mm256_and_si256(v, _mm256_set1_epi32(15 << (4 * e))));
  } else {
    return p16_lanes<kBits>(v, e);
  }
}

// The factor p16_scaled_x gives element t of a block: 16^-e, e the nibble that holds its weight
// (p16_column), and 1 for nibble 7 (shifted down, not masked in place).
constexpr std::array<float, kBlock> p16_x_scales() {
  std::array<float, kBlock> scales{};
  for (int t = 0; t < kBlock; ++t) {
    const int e = 2 * (t % 4) + (t >= 16 ? 1 : 0);
    scales[t] = 1.0f;
    for (int i = 0; e != 7 && i < e; ++i) scales[t] *= 0.0625f;
  }
  return scales;
}
alignas(32) constexpr std::array<float, kBlock> kP16XScale = p16_x_scales();

// x ([M][K]) for p16_scaled_lanes, written to out ([M][K]): 4-bit, each element times
// kP16XScale. Powers of two: exact, short of subnormals (|x| < 2^-102, whose products are below
// 2^-98).
void p16_scaled_x(const float* x, int64_t M, int64_t K, float* out) {
  for (int64_t i = 0; i < M * K; i += kBlock)  // K is a multiple of kBlock
#pragma GCC unroll 4
    for (int64_t v = 0; v < kBlock; v += 8)
      _mm256_storeu_ps(out + i + v, _mm256_mul_ps(_mm256_loadu_ps(x + i + v), _mm256_load_ps(kP16XScale.data() + v)));
}

// Prefetch distance of this kernel: further ahead than kP16Ahead. Timed on Zen 3 (SmolLM2's 4-bit
// layers from memory, one row): 1 KB ahead 9.0 ms a step, 2 KB 7.4, 4 KB 6.7-7.0, 8 KB 6.2-6.4, 16 KB
// 6.6-7.5 (later, in the engine: no clear difference); the T0 and T1 hints no faster than NTA. 8-bit
// weights (twice the bytes per element; SmolLM2's Q8_0 LM head): 16 KB took 1.12-1.39 ms a step in
// the engine against 1.47-1.60 at 8 KB.
template <int kBits>
constexpr int64_t p16x_ahead() {
  return kBits == 8 ? 16384 : 8192;
}

// Rows [m0, m0 + MT) of x against half tiles [h0, h0 + NH) (half h: rows 8h..8h+7 of the weight).
// S: the scales' type; kHalf: groups of 16.
template <int kBits, bool kMins, int MT, int NH, typename S = at::Half, bool kHalf = false>
void p16x_halves(const P16Weight& w, int64_t h0, const float* x, const float* sums, int64_t m0, float* y,
                 int64_t ldy) {
  const int64_t K = w.cols, per_group = w.group / kBlock;
  constexpr int64_t kBlockBytes = kBits * kBlock * kP16 / 8;
  const uint8_t* base[NH];
  const S* hs[NH];
  const S* hm[NH];
#pragma GCC unroll 4
  for (int i = 0; i < NH; ++i) {
    const auto [tile, ts, tm] = p16_tile_parts<S>(w, (h0 + i) / 2);
    const int64_t half = (h0 + i) % 2;
    base[i] = tile + 32 * half;
    hs[i] = ts + 8 * half;
    hm[i] = tm ? tm + 8 * half : nullptr;
  }
  const __m256i flip = _mm256_set1_epi32(static_cast<int32_t>(0x80808080u));
  __m256 acc[MT][NH];
#pragma GCC unroll 4
  for (int r = 0; r < MT; ++r)
#pragma GCC unroll 4
    for (int i = 0; i < NH; ++i) acc[r][i] = _mm256_setzero_ps();
  const float* xr[MT];
#pragma GCC unroll 4
  for (int r = 0; r < MT; ++r) xr[r] = x + (m0 + r) * K;
  if constexpr (kHalf) {
    // Two groups per block, as in the AVX-512 kernel: the low nibbles (4-bit) or word rows 0..3
    // (8-bit) are elements 0..15, then the rest; a pass over each, then its scale and min.
    for (int64_t b = 0; b < K / kBlock; ++b) {
      const int64_t k0 = b * kBlock;
#pragma GCC unroll 4
      for (int i = 0; i < NH; ++i) {
        if ((h0 + i) % 2 == 1 && i > 0) continue;  // the low half prefetched the tile's lines
        const uint8_t* p = base[i] - 32 * ((h0 + i) % 2) + b * kBlockBytes;
#pragma GCC unroll 8
        for (int64_t line = 0; line < kBlockBytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(p) + p16x_ahead<kBits>() + line, _MM_HINT_NTA);
      }
#pragma GCC unroll 2
      for (int gh = 0; gh < 2; ++gh) {
        __m256 part[MT][NH];
#pragma GCC unroll 4
        for (int r = 0; r < MT; ++r)
#pragma GCC unroll 4
          for (int i = 0; i < NH; ++i) part[r][i] = _mm256_setzero_ps();
#pragma GCC unroll 4
        for (int jj = 0; jj < 4; ++jj) {
          const int j = kBits == 4 ? jj : 4 * gh + jj;
          __m256i v[NH];
#pragma GCC unroll 4
          for (int i = 0; i < NH; ++i) {
            v[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base[i] + b * kBlockBytes + j * 64));
            if constexpr (kBits == 8) v[i] = _mm256_xor_si256(v[i], flip);
          }
#pragma GCC unroll 4
          for (int ee = 0; ee < 4; ++ee) {
            const int e = kBits == 4 ? gh + 2 * ee : ee;  // 4-bit: nibble e, in the low or high half
            const int64_t k = p16_column<kBits>(k0, j, e);
#pragma GCC unroll 4
            for (int i = 0; i < NH; ++i) {
              const __m256 q = p16_scaled_lanes<kBits>(v[i], e);
#pragma GCC unroll 4
              for (int r = 0; r < MT; ++r) part[r][i] = _mm256_fmadd_ps(q, _mm256_broadcast_ss(xr[r] + k), part[r][i]);
            }
          }
        }
        const int64_t g = 2 * b + gh;
#pragma GCC unroll 4
        for (int i = 0; i < NH; ++i) {
          const __m256 s = load8(hs[i] + g * kP16);
#pragma GCC unroll 4
          for (int r = 0; r < MT; ++r) acc[r][i] = _mm256_fmadd_ps(part[r][i], s, acc[r][i]);
          if constexpr (kMins) {
            const __m256 mv = load8(hm[i] + g * kP16);
#pragma GCC unroll 4
            for (int r = 0; r < MT; ++r)
              acc[r][i] = _mm256_fmadd_ps(mv, _mm256_set1_ps(sums[(m0 + r) * w.groups + g]), acc[r][i]);
          }
        }
      }
    }
  } else {
    for (int64_t g = 0, b = 0; g < w.groups; ++g) {
      __m256 part[MT][NH];
#pragma GCC unroll 4
      for (int r = 0; r < MT; ++r)
#pragma GCC unroll 4
        for (int i = 0; i < NH; ++i) part[r][i] = _mm256_setzero_ps();
      for (const int64_t end = b + per_group; b < end; ++b) {
        const int64_t k0 = b * kBlock;
#pragma GCC unroll 4
        for (int i = 0; i < NH; ++i) {
          if ((h0 + i) % 2 == 1 && i > 0) continue;  // the low half prefetched the tile's lines
          const uint8_t* p = base[i] - 32 * ((h0 + i) % 2) + b * kBlockBytes;
#pragma GCC unroll 8
          for (int64_t line = 0; line < kBlockBytes; line += 64)
            _mm_prefetch(reinterpret_cast<const char*>(p) + p16x_ahead<kBits>() + line, _MM_HINT_NTA);
        }
#pragma GCC unroll 8
        for (int j = 0; j < (kBits == 4 ? 4 : 8); ++j) {
          __m256i v[NH];
#pragma GCC unroll 4
          for (int i = 0; i < NH; ++i) {
            v[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base[i] + b * kBlockBytes + j * 64));
            if constexpr (kBits == 8) v[i] = _mm256_xor_si256(v[i], flip);  // back to signed q
          }
#pragma GCC unroll 8
          for (int e = 0; e < (kBits == 4 ? 8 : 4); ++e) {
            const int64_t k = p16_column<kBits>(k0, j, e);
#pragma GCC unroll 4
            for (int i = 0; i < NH; ++i) {
              const __m256 q = p16_scaled_lanes<kBits>(v[i], e);
#pragma GCC unroll 4
              for (int r = 0; r < MT; ++r) part[r][i] = _mm256_fmadd_ps(q, _mm256_broadcast_ss(xr[r] + k), part[r][i]);
            }
          }
        }
      }
#pragma GCC unroll 4
      for (int i = 0; i < NH; ++i) {
        const __m256 s = load8(hs[i] + g * kP16);
#pragma GCC unroll 4
        for (int r = 0; r < MT; ++r) acc[r][i] = _mm256_fmadd_ps(part[r][i], s, acc[r][i]);
        if constexpr (kMins) {
          const __m256 mv = load8(hm[i] + g * kP16);
#pragma GCC unroll 4
          for (int r = 0; r < MT; ++r)
            acc[r][i] = _mm256_fmadd_ps(mv, _mm256_set1_ps(sums[(m0 + r) * w.groups + g]), acc[r][i]);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < NH; ++i) {
    const int64_t n0 = (h0 + i) * 8, valid = std::min<int64_t>(8, w.valid_rows - n0);
    if (valid <= 0) continue;  // a half of padding rows
#pragma GCC unroll 4
    for (int r = 0; r < MT; ++r) {
      if (valid == 8) {
        _mm256_storeu_ps(y + r * ldy + n0, acc[r][i]);
      } else {
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, acc[r][i]);
        std::memcpy(y + r * ldy + n0, lanes, valid * sizeof(float));
      }
    }
  }
}

// Tiles [u0, u1) for every row of x, as halves: NH at a time where the row count allows; x rows go
// 4 at a time, the rest as 2 and 1 (more would not fit AVX2's 16 registers).
template <int kBits, bool kMins, typename S, bool kHalf>
void p16x_rows(const P16Weight& w, const float* x, const float* sums, int64_t M, float* y, int64_t u0, int64_t u1) {
  const int64_t step_max = p16x_nh(static_cast<int>(std::min<int64_t>(M, 2)));
  for (int64_t h = 2 * u0; h < 2 * u1;) {
    const int64_t step = std::min<int64_t>(2 * u1 - h, step_max);
    for (int64_t m0 = 0; m0 < M;) {
      const int64_t left = M - m0, mt = left >= 4 ? 4 : left >= 2 ? 2 : 1;
      const auto run = [&]<int MT>() {
        constexpr int NH = p16x_nh(MT);
        for (int64_t s = 0; s < step;) {
          if (step - s >= NH) {
            p16x_halves<kBits, kMins, MT, NH, S, kHalf>(w, h + s, x, sums, m0, y + m0 * w.valid_rows, w.valid_rows);
            s += NH;
          } else {
            p16x_halves<kBits, kMins, MT, 1, S, kHalf>(w, h + s, x, sums, m0, y + m0 * w.valid_rows, w.valid_rows);
            s += 1;
          }
        }
      };
      mt == 4 ? run.template operator()<4>() : mt == 2 ? run.template operator()<2>() : run.template operator()<1>();
      m0 += mt;
    }
    h += step;
  }
}
#endif  // MRQ_AVX512, MRQ_AVX2

#ifdef MRQ_AVX2
// The sums of x per group, written to sums ([M][groups]): the p16 exact kernels' mins term.
void group_sums(const float* x, int64_t M, const QuantWeight& w, float* sums) {
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < w.groups; ++g) {
      const float* xg = x + r * w.cols + g * w.group;
#ifdef MRQ_AVX512
      __m512 s = _mm512_setzero_ps();
      for (int64_t k = 0; k < w.group; k += 16) s = _mm512_add_ps(s, _mm512_loadu_ps(xg + k));
      sums[r * w.groups + g] = _mm512_reduce_add_ps(s);
#else
      __m256 s = _mm256_setzero_ps();
      for (int64_t k = 0; k < w.group; k += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(xg + k));
      sums[r * w.groups + g] = Exact::sum(s);
#endif
    }
}

#ifndef MRQ_AVX512
// Rows [n0, n1) of a p16 weight (n0 a multiple of 16, whole tiles written) as columns of out
// ([K][ld]): 8 rows' weights of one element per vector, each scale * q + min as the planar
// dequantization computes it (the same floats: float32 scales' products rounded before the min is
// added). S: the scales' type; kHalf: groups of 16, two per block (elements 0..15: the low nibbles
// or word rows 0..3; 16..31: the high nibbles or word rows 4..7). Out: float, or uint16_t for the
// values rounded to bfloat16.
template <int kBits, bool kMins, typename S = at::Half, bool kHalf = false, typename Out = float>
void dequantize_p16_columns(const P16Weight& w, int64_t n0, int64_t n1, Out* out, int64_t ld) {
  const int64_t per_group = kHalf ? 1 : w.group / kBlock, steps = kHalf ? w.cols / kBlock : w.groups;
  constexpr int64_t kBlockBytes = kBits * kBlock * kP16 / 8;
  constexpr bool kRound = kMins && std::is_same_v<S, float>;
  const __m256i flip = _mm256_set1_epi32(static_cast<int32_t>(0x80808080u));
  for (int64_t t = n0 / kP16; t < (n1 + kP16 - 1) / kP16; ++t) {
    const auto [tile, ts, tm] = p16_tile_parts<S>(w, t);
    for (int64_t half = 0; half < 2; ++half) {
      Out* col = out + t * kP16 - n0 + 8 * half;
      // A step is a group (of a whole number of blocks) or, with kHalf, one block's two groups.
      for (int64_t g = 0, b = 0; g < steps; ++g) {
        const int64_t g0 = kHalf ? 2 * g : g;
        const __m256 s = load8(ts + g0 * kP16 + 8 * half);
        const __m256 m = kMins ? load8(tm + g0 * kP16 + 8 * half) : _mm256_setzero_ps();
        const __m256 s_hi = kHalf ? load8(ts + (g0 + 1) * kP16 + 8 * half) : s;
        const __m256 m_hi = kHalf && kMins ? load8(tm + (g0 + 1) * kP16 + 8 * half) : m;
        for (const int64_t end = b + per_group; b < end; ++b) {
          const int64_t k0 = b * kBlock;
#pragma GCC unroll 8
          for (int j = 0; j < (kBits == 4 ? 4 : 8); ++j) {
            __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + b * kBlockBytes + j * 64 + 32 * half));
            if constexpr (kBits == 8) v = _mm256_xor_si256(v, flip);
#pragma GCC unroll 8
            for (int e = 0; e < (kBits == 4 ? 8 : 4); ++e) {
              const __m256 q = p16_lanes<kBits>(v, e);
              const bool hi = kHalf && (kBits == 4 ? (e & 1) == 1 : j >= 4);
              const __m256 se = hi ? s_hi : s, me = hi ? m_hi : m;
              Out* out_k = col + p16_column<kBits>(k0, j, e) * ld;
              if constexpr (kRound)
                store_weights(out_k, _mm256_add_ps(rounded(_mm256_mul_ps(q, se)), me));
              else
                store_weights(out_k, kMins ? _mm256_fmadd_ps(q, se, me) : _mm256_mul_ps(q, se));
            }
          }
        }
      }
    }
  }
}
#endif
#endif

#if defined(MRQ_AVX2) && !defined(MRQ_AVX512)
// From this many rows of x, the AVX2 exact p16 kernel dequantizes tiles for MKL, as qlinear does from
// GEMM_ROWS (its register kernel takes 4 rows of x at a time, not 8 as on AVX-512).
constexpr int64_t kP16GemmRows = 48;
#endif

at::Tensor qlinear_p16_exact(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scales,
                             const std::optional<at::Tensor>& mins, int64_t rows, int64_t group_size, int64_t bits) {
  const auto operands = p16_operands(x, data, scales, mins, rows, group_size, bits, p16_exact_supported_bits(bits),
                                     "exact p16", "needs AVX2");
  const P16Weight& w = operands.first;
  at::Tensor y = operands.second;
  const int64_t M = x.size(0);
  if (M == 0 || w.valid_rows == 0) return y;
#ifdef MRQ_AVX2
#ifndef MRQ_AVX512
  if (M >= kP16GemmRows) {
    struct None {};
    gemm_tiles<None, true>(w.valid_rows, w.cols, x, y, [&](int64_t n0, int64_t n1, float* out, int64_t ld, None&) {
      with_format(w, [&]<typename S, bool kHalf>() {
        if (bits == 4)
          w.mins ? dequantize_p16_columns<4, true, S, kHalf>(w, n0, n1, out, ld)
                 : dequantize_p16_columns<4, false, S, kHalf>(w, n0, n1, out, ld);
        else
          w.mins ? dequantize_p16_columns<8, true, S, kHalf>(w, n0, n1, out, ld)
                 : dequantize_p16_columns<8, false, S, kHalf>(w, n0, n1, out, ld);
      });
    });
    return y;
  }
#endif
  const float* xp = x.const_data_ptr<float>();
  // One scratch buffer: the sums of x per group (the mins' term) and, 4-bit on AVX2, x scaled per
  // nibble (which saves the kernel a shift per weight vector).
#ifndef MRQ_AVX512
  const bool scale_x = bits == 4;
#else
  constexpr bool scale_x = false;
#endif
  const int64_t n_sums = w.mins ? M * w.groups : 0;
  std::vector<float> scratch(n_sums + (scale_x ? M * w.cols : 0));
  float* sums = scratch.data();
  if (w.mins) group_sums(xp, M, w, sums);
  const float* xk = xp;
#ifndef MRQ_AVX512
  if (scale_x) {
    p16_scaled_x(xp, M, w.cols, scratch.data() + n_sums);
    xk = scratch.data() + n_sums;
  }
#endif
  float* yp = y.data_ptr<float>();
  with_format(w, [&]<typename S, bool kHalf>() {
    const auto run = [&]<int kBits, bool kMins>(int64_t n0, int64_t n1) {
      p16x_rows<kBits, kMins, S, kHalf>(w, xk, sums, M, yp, n0 / kP16, n1 / kP16);
    };
    parallel_rows(w.rows, kP16, static_cast<double>(w.cols * M), [&](int64_t n0, int64_t n1) {
      if (bits == 4)
        w.mins ? run.template operator()<4, true>(n0, n1) : run.template operator()<4, false>(n0, n1);
      else
        w.mins ? run.template operator()<8, true>(n0, n1) : run.template operator()<8, false>(n0, n1);
    });
  });
#endif
  return y;
}

bool p16_exact_supported(int64_t bits) { return p16_exact_supported_bits(bits); }

#ifdef MRQ_AVX2
// Every tile for every row of x (in D digits), the tiles split among torch's threads.
template <int D, typename S>
void p16_rows(const P16Weight& w, const QuantizedInput* digits, int64_t M, float* yp) {
  const int64_t count = (M + kP16MaxRows - 1) / kP16MaxRows;
  parallel_rows(w.rows, kP16, static_cast<double>(w.cols * M), [&](int64_t n0, int64_t n1) {
    for (int64_t t = n0 / kP16; t < n1 / kP16; ++t)
      for (int64_t i = 0, m0 = 0; i < count; ++i) {
        const int64_t mt = (M - m0 + (count - i) - 1) / (count - i);
        with_mt(mt, [&]<int MT>() {
          if constexpr (MT <= kP16MaxRows)
            w.bits == 4 ? p16_tile<4, MT, D, S>(w, t, digits, m0, yp + m0 * w.valid_rows, w.valid_rows)
                        : p16_tile<8, MT, D, S>(w, t, digits, m0, yp + m0 * w.valid_rows, w.valid_rows);
        });
        m0 += mt;
      }
  });
}

// p16_rows for the weight's scale type.
template <int D>
void p16_rows(const P16Weight& w, const QuantizedInput* digits, int64_t M, float* yp) {
  w.wide ? p16_rows<D, float>(w, digits, M, yp) : p16_rows<D, at::Half>(w, digits, M, yp);
}
#endif

at::Tensor qlinear_p16(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scales,
                       const std::optional<at::Tensor>& mins, int64_t rows, int64_t group_size, int64_t bits) {
  const auto operands = p16_operands(x, data, scales, mins, rows, group_size, bits, p16_supported_bits(bits), "p16",
                                     bits == 8 ? "8-bit needs VNNI" : "needs AVX2");
  const P16Weight& w = operands.first;
  check_int8_groups(w, "p16");
  at::Tensor y = operands.second;
  const int64_t M = x.size(0);
  if (M == 0 || w.valid_rows == 0) return y;
#ifdef MRQ_AVX2
  const QuantizedInput in = quantize_input(x.const_data_ptr<float>(), M, w, bits == 8, false);
  p16_rows<1>(w, &in, M, y.data_ptr<float>());
#endif
  return y;
}

// ---------------------------------------------------------------------------------------------
// "p16 split": exact results through integer dot products. Each 32-element block of x is written as
// three int8 digits, x ~= d1 q1 + d2 q2 + d3 q3: q1 the q8 quantization of x, q2 that of the
// remainder x - d1 q1, q3 that of what is left (each scale the amax of what it quantizes / 127), so
// what is left over is at most amax(x) / 254^3 / 2 (~2e-8 of the block's largest value: below float32's
// rounding of the products it stands for). Then three passes of q8's VNNI arithmetic over one load
// of the weights: y = sum_b s_b * sum_j d_j (q_w . q_j) + m * sum(x), in float32.

constexpr int kSplitDigits = 3;

bool p16_split_supported_bits(int64_t bits) {
#if defined(MRQ_AVX512) && MRQ_VNNI == 1
  return bits == 4 || bits == 8;
#else
  (void)bits;
  return false;
#endif
}

#if defined(MRQ_AVX512) && MRQ_VNNI == 1
// The digits of x (rows [M][K]): digit 0 carries the exact float sums of x per group (mins), each
// the sums of its integers per block (8-bit weights).
std::vector<QuantizedInput> split_input(const float* x, int64_t M, const QuantWeight& w, bool block_sums) {
  std::vector<QuantizedInput> digits;
  const int64_t K = w.cols, blocks = K / kBlock;
  std::vector<float> rest(x, x + M * K);
  QuantWeight plain = w;
  for (int j = 0; j < kSplitDigits; ++j) {
    if (j == 1) plain.mins = nullptr;  // the sums of x: once, from x itself
    digits.push_back(quantize_input(rest.data(), M, plain, block_sums, false));
    if (j + 1 == kSplitDigits) break;
    const QuantizedInput& in = digits.back();
    for (int64_t i = 0; i < M * blocks; ++i) {
      const __m512 d = _mm512_set1_ps(-in.d[i]);
      for (int h = 0; h < 2; ++h) {
        float* r = rest.data() + i * kBlock + 16 * h;
        const __m512 q = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in.q.get() + i * kBlock + 16 * h))));
        _mm512_storeu_ps(r, _mm512_fmadd_ps(d, q, _mm512_loadu_ps(r)));  // one rounding
      }
    }
  }
  return digits;
}

#endif

at::Tensor qlinear_p16_split(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scales,
                             const std::optional<at::Tensor>& mins, int64_t rows, int64_t group_size, int64_t bits) {
  const auto operands = p16_operands(x, data, scales, mins, rows, group_size, bits, p16_split_supported_bits(bits),
                                     "split p16", "needs AVX-512 VNNI");
  const P16Weight& w = operands.first;
  check_int8_groups(w, "split p16");
  at::Tensor y = operands.second;
  const int64_t M = x.size(0);
  if (M == 0 || w.valid_rows == 0) return y;
#if defined(MRQ_AVX512) && MRQ_VNNI == 1
  const std::vector<QuantizedInput> digits = split_input(x.const_data_ptr<float>(), M, w, bits == 8);
  p16_rows<kSplitDigits>(w, digits.data(), M, y.data_ptr<float>());
#endif
  return y;
}

bool p16_split_supported(int64_t bits) { return p16_split_supported_bits(bits); }

// ---------------------------------------------------------------------------------------------
// bfloat16 GEMMs ("bf16", planar; "p16 bf16"): x bfloat16 [M, K] times the weight's values (the
// floats scales * q + mins that dequantize computes) rounded to bfloat16, as
// F.linear(x, dequantize(...).bfloat16()) computes it: float32 sums of exact products, up to
// summation order. Tiles of rows are dequantized straight to bfloat16 into a per-thread buffer and
// multiplied by at::mm, which oneDNN runs on AMX or AVX512-BF16 where the CPU has them; no bfloat16
// copy of the weight is kept. ggml_matmul.cpp's ggml_linear_bf16 does the same for GGUF blocks, and
// its measurements set the tile sizes here. Planar rows go into the buffer as rows ([tile][K], the
// product with its transpose); p16 tiles as columns ([K][tile]), where one vector holds 16 rows'
// values of one element (oneDNN ran both orientations within 10% of each other on SmolLM2's shapes).
// On AMX, p16 weights skip at::mm: blocks of 64 rows are dequantized into brgemm's VNNI layout and
// multiplied by its micro-kernel (p16_brgemm, 2x faster than the tiles; it says what it measured).
// Every build has them (portable scalar code without AVX2).

#ifdef MRQ_AVX512
// Rows [n0, n1) of a p16 weight (n0 a multiple of 16, whole tiles written) as bfloat16 columns of out
// ([K][ld]): 16 rows' weights of one element per vector, each scale * q + min as dequantize computes
// it (float32 scales' products rounded before the min is added), rounded to bfloat16. 4-bit: a
// permute of the table 0..15 reads the low 4 bits of each lane, as in p16x_tile.
template <int kBits, bool kMins, typename S, bool kHalf>
void dequantize_p16_columns_bf16(const P16Weight& w, int64_t n0, int64_t n1, uint16_t* out, int64_t ld) {
  const int64_t per_group = kHalf ? 1 : w.group / kBlock, steps = kHalf ? w.cols / kBlock : w.groups;
  constexpr int64_t kBlockBytes = kBits * kBlock * kP16 / 8;
  constexpr bool kRound = kMins && std::is_same_v<S, float>;
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i flip = _mm512_set1_epi32(static_cast<int32_t>(0x80808080u));
  for (int64_t t = n0 / kP16; t < (n1 + kP16 - 1) / kP16; ++t) {
    const auto [tile, ts, tm] = p16_tile_parts<S>(w, t);
    uint16_t* col = out + t * kP16 - n0;
    // A step is a group (of a whole number of blocks) or, with kHalf, one block's two groups.
    for (int64_t g = 0, b = 0; g < steps; ++g) {
      const int64_t g0 = kHalf ? 2 * g : g;
      const __m512 s = load16(ts + g0 * kP16);
      const __m512 m = kMins ? load16(tm + g0 * kP16) : _mm512_setzero_ps();
      const __m512 s_hi = kHalf ? load16(ts + (g0 + 1) * kP16) : s;
      const __m512 m_hi = kHalf && kMins ? load16(tm + (g0 + 1) * kP16) : m;
      for (const int64_t end = b + per_group; b < end; ++b) {
        const int64_t k0 = b * kBlock;
#pragma GCC unroll 8
        for (int j = 0; j < (kBits == 4 ? 4 : 8); ++j) {
          __m512i v = _mm512_loadu_si512(tile + b * kBlockBytes + j * 64);
          if constexpr (kBits == 8) v = _mm512_xor_si512(v, flip);
#pragma GCC unroll 8
          for (int e = 0; e < (kBits == 4 ? 8 : 4); ++e) {
            __m512 q;
            if constexpr (kBits == 4)
              q = _mm512_permutexvar_ps(e == 0 ? v : _mm512_srli_epi32(v, 4 * e), iota);
            else
              q = _mm512_cvtepi32_ps(_mm512_srai_epi32(e == 3 ? v : _mm512_slli_epi32(v, 24 - 8 * e), 24));
            const bool hi = kHalf && (kBits == 4 ? (e & 1) == 1 : j >= 4);
            const __m512 se = hi ? s_hi : s, me = hi ? m_hi : m;
            __m512 value;
            if constexpr (kRound)
              value = _mm512_add_ps(rounded(_mm512_mul_ps(q, se)), me);
            else
              value = kMins ? _mm512_fmadd_ps(q, se, me) : _mm512_mul_ps(q, se);
            store_bf16(col + p16_column<kBits>(k0, j, e) * ld, round_bf16(value));
          }
        }
      }
    }
  }
}
#endif

#if defined(MRQ_AVX512) && defined(CPUBLAS_BRGEMM_BF16BF16F32)
#define MRQ_BRGEMM 1
// oneDNN's brgemm micro-kernel (at::native::cpublas::brgemm: AMX) takes B in its VNNI layout, element
// pairs (2i, 2i + 1) of a column side by side: [K/2][ld][2], ld at most 64 columns.
constexpr int64_t kVnniCols = 64;
// Rows of x per micro-kernel call. Measured (see p16_brgemm): 16 up to 1.3x slower than 32; 64 the same.
constexpr int64_t kBrgemmRows = 32;

// Tiles [t0, t0 + count) of a p16 weight as bfloat16 columns of out in that layout (ld kVnniCols): each
// element pair of 16 rows one 64-byte store, both values rounded to bfloat16 by one conversion
// (vcvtne2ps2bf16: to nearest even, as torch rounds; it flushes subnormal floats, which dequantized
// weights never are) and interleaved by one permute. 4-bit: nibble e read from a permute of the table
// 0..15, as in dequantize_p16_columns_bf16 (masking the nibble in place and dividing the scale by 16^e
// instead measured the same: not kept). Only called where brgemm runs, on AMX CPUs, which all have
// AVX512-BF16; no build's flags include it, hence the function's target.
template <int kBits, bool kMins, typename S, bool kHalf>
__attribute__((target("avx512bf16"))) void dequantize_p16_vnni(const P16Weight& w, int64_t t0, int64_t count,
                                                               uint16_t* out) {
  const int64_t per_group = kHalf ? 1 : w.group / kBlock, steps = kHalf ? w.cols / kBlock : w.groups;
  constexpr int64_t kBlockBytes = kBits * kBlock * kP16 / 8;
  constexpr bool kRound = kMins && std::is_same_v<S, float>;
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i flip = _mm512_set1_epi32(static_cast<int32_t>(0x80808080u));
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t t = t0; t < t0 + count; ++t) {
    const auto [tile, ts, tm] = p16_tile_parts<S>(w, t);
    uint16_t* col = out + (t - t0) * kP16 * 2;
    // A step is a group (of a whole number of blocks) or, with kHalf, one block's two groups.
    for (int64_t g = 0, b = 0; g < steps; ++g) {
      const int64_t g0 = kHalf ? 2 * g : g;
      const __m512 s = load16(ts + g0 * kP16);
      const __m512 m = kMins ? load16(tm + g0 * kP16) : _mm512_setzero_ps();
      const __m512 s_hi = kHalf ? load16(ts + (g0 + 1) * kP16) : s;
      const __m512 m_hi = kHalf && kMins ? load16(tm + (g0 + 1) * kP16) : m;
      for (const int64_t end = b + per_group; b < end; ++b) {
        const int64_t k0 = b * kBlock;
#pragma GCC unroll 8
        for (int j = 0; j < (kBits == 4 ? 4 : 8); ++j) {
          __m512i v = _mm512_loadu_si512(tile + b * kBlockBytes + j * 64);
          if constexpr (kBits == 8) v = _mm512_xor_si512(v, flip);
          // Weight e of the 16 lanes, scale * q + min as dequantize computes it.
          const auto value = [&](int e) {
            __m512 q;
            if constexpr (kBits == 4)
              q = _mm512_permutexvar_ps(e == 0 ? v : _mm512_srli_epi32(v, 4 * e), iota);
            else
              q = _mm512_cvtepi32_ps(_mm512_srai_epi32(e == 3 ? v : _mm512_slli_epi32(v, 24 - 8 * e), 24));
            const bool hi = kHalf && (kBits == 4 ? (e & 1) == 1 : j >= 4);
            const __m512 se = hi ? s_hi : s, me = hi ? m_hi : m;
            if constexpr (kRound) return _mm512_add_ps(rounded(_mm512_mul_ps(q, se)), me);
            return kMins ? _mm512_fmadd_ps(q, se, me) : _mm512_mul_ps(q, se);
          };
          // Element pairs: 4-bit, nibbles e and e + 2 (elements 4j + e/2 and the next, or 16 more);
          // 8-bit, bytes e and e + 1.
#pragma GCC unroll 4
          for (int i = 0; i < (kBits == 4 ? 4 : 2); ++i) {
            const int e = kBits == 4 ? (i & 1) + 4 * (i >> 1) : 2 * i;
            const int e2 = kBits == 4 ? e + 2 : e + 1;
            const __m512i halves = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(value(e2), value(e)));
            const __m512i pair = _mm512_permutexvar_epi16(interleave, halves);
            _mm512_storeu_si512(col + p16_column<kBits>(k0, j, e) / 2 * kVnniCols * 2, pair);
          }
        }
      }
    }
  }
}

// x (bfloat16 [M, K]) times a p16 weight's rows rounded to bfloat16 through brgemm: the threads share
// out blocks of kVnniCols rows; each block is dequantized into the thread's buffer (K x 64 bfloat16,
// 72 KB at K = 576: L2-resident) and the micro-kernel (compiled once per size and thread, cached by
// torch) runs on it for kBrgemmRows rows of x at a time, float32 sums straight into y or, for a
// bfloat16 y, through a small buffer rounded on the way out.
//
// Measured on Sapphire Rapids (AMX), one thread on a loaded machine, best of 30, SmolLM2's 4-bit
// shapes at 64 and 256 rows of x: within 0.7-1.1x the time of F.linear on a kept bfloat16 copy of the
// weight (960 x 576, 3072 x 576, 576 x 1536), 0.5-0.6x that of gemm_tiles_bf16 (dequantized tiles
// multiplied by at::mm, the path of CPUs without AMX) and 0.1-0.2x that of the exact float32 p16
// kernel; the 8-bit LM head (49152 x 576) 0.6x F.linear's time at 64 rows, about the same at 256.
// Dequantizing 4 blocks before multiplying them (a wider micro-kernel call) measured up to 2x slower.
void p16_brgemm(const P16Weight& w, const at::Tensor& x, at::Tensor& y) {
  const int64_t M = x.size(0), K = w.cols, N = w.valid_rows, blocks = (N + kVnniCols - 1) / kVnniCols;
  const bool direct = y.scalar_type() == at::kFloat;
  const at::BFloat16* xp = x.const_data_ptr<at::BFloat16>();
  float* yf = direct ? y.data_ptr<float>() : nullptr;
  uint16_t* yb = direct ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<at::BFloat16> buffer(K * kVnniCols);
    std::vector<float> product(direct ? 0 : kBrgemmRows * kVnniCols);
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * kVnniCols, n = std::min(kVnniCols, N - n0);
      with_format(w, [&]<typename S, bool kHalf>() {
        uint16_t* out = reinterpret_cast<uint16_t*>(buffer.data());
        const int64_t t0 = n0 / kP16, count = (n + kP16 - 1) / kP16;
        if (w.bits == 4)
          w.mins ? dequantize_p16_vnni<4, true, S, kHalf>(w, t0, count, out)
                 : dequantize_p16_vnni<4, false, S, kHalf>(w, t0, count, out);
        else
          w.mins ? dequantize_p16_vnni<8, true, S, kHalf>(w, t0, count, out)
                 : dequantize_p16_vnni<8, false, S, kHalf>(w, t0, count, out);
      });
      for (int64_t m0 = 0; m0 < M; m0 += kBrgemmRows) {
        const int64_t mb = std::min(kBrgemmRows, M - m0);
        float* c = direct ? yf + m0 * N + n0 : product.data();
        at::native::cpublas::brgemm(mb, n, K, K, kVnniCols, direct ? N : kVnniCols, /*add_C=*/false, xp + m0 * K,
                                    buffer.data(), c, /*is_vnni=*/true);
        if (direct) continue;
        for (int64_t r = 0; r < mb; ++r) {
          const float* pr = product.data() + r * kVnniCols;
          uint16_t* yr = yb + (m0 + r) * N + n0;
          int64_t i = 0;
          for (; i + 16 <= n; i += 16) store_bf16(yr + i, round_bf16(_mm512_loadu_ps(pr + i)));
          for (; i < n; ++i) yr[i] = c10::BFloat16(pr[i]).x;
        }
      }
    }
    at::native::cpublas::brgemm_release();
  });
}
#endif

// The same one weight at a time, in portable code (builds without AVX2). Out: float or bfloat16 bits.
template <typename S, typename Out>
void dequantize_p16_columns_scalar(const P16Weight& w, int64_t n0, int64_t n1, Out* out, int64_t ld) {
  const int64_t words = w.bits == 4 ? 4 : 8, block_bytes = w.bits * kBlock * kP16 / 8, blocks = w.cols / kBlock;
  const S* scales = w.scales_as<S>();
  const S* mins = w.mins_as<S>();
  for (int64_t t = n0 / kP16; t < (n1 + kP16 - 1) / kP16; ++t) {
    const uint8_t* tile = w.data + t * w.tile_bytes;
    const S* ts = scales + t * w.groups * kP16;
    const S* tm = mins ? mins + t * w.groups * kP16 : nullptr;
    for (int64_t r = 0; r < kP16; ++r) {
      Out* col = out + t * kP16 + r - n0;
      const auto put = [&](int64_t k, float q) {
        const int64_t g = k / w.group;
        const float product = static_cast<float>(ts[g * kP16 + r]) * q;
        store_weight(col + k * ld, tm ? product + static_cast<float>(tm[g * kP16 + r]) : product);
      };
      for (int64_t b = 0; b < blocks; ++b)
        for (int64_t j = 0; j < words; ++j) {
          const uint8_t* word = tile + b * block_bytes + (j * kP16 + r) * 4;
          for (int i = 0; i < 4; ++i) {
            if (w.bits == 4) {
              put(b * kBlock + 4 * j + i, static_cast<float>(word[i] & 15));
              put(b * kBlock + 16 + 4 * j + i, static_cast<float>(word[i] >> 4));
            } else {
              put(b * kBlock + 4 * j + i, static_cast<float>(static_cast<int8_t>(word[i] ^ 0x80)));
            }
          }
        }
    }
  }
}

// Rows [n0, n1) of a p16 weight as bfloat16 columns of out ([K][ld]), in this build's code.
void dequantize_p16_bf16(const P16Weight& w, int64_t n0, int64_t n1, uint16_t* out, int64_t ld) {
  with_format(w, [&]<typename S, bool kHalf>() {
#if defined(MRQ_AVX512)
    if (w.bits == 4)
      w.mins ? dequantize_p16_columns_bf16<4, true, S, kHalf>(w, n0, n1, out, ld)
             : dequantize_p16_columns_bf16<4, false, S, kHalf>(w, n0, n1, out, ld);
    else
      w.mins ? dequantize_p16_columns_bf16<8, true, S, kHalf>(w, n0, n1, out, ld)
             : dequantize_p16_columns_bf16<8, false, S, kHalf>(w, n0, n1, out, ld);
#elif defined(MRQ_AVX2)
    if (w.bits == 4)
      w.mins ? dequantize_p16_columns<4, true, S, kHalf, uint16_t>(w, n0, n1, out, ld)
             : dequantize_p16_columns<4, false, S, kHalf, uint16_t>(w, n0, n1, out, ld);
    else
      w.mins ? dequantize_p16_columns<8, true, S, kHalf, uint16_t>(w, n0, n1, out, ld)
             : dequantize_p16_columns<8, false, S, kHalf, uint16_t>(w, n0, n1, out, ld);
#else
    dequantize_p16_columns_scalar<S>(w, n0, n1, out, ld);
#endif
  });
}

// Tiles of a weight's N rows, dequantized to bfloat16 by each thread into a buffer of its own
// (dequantize(n0, n1, out, ld, scratch) writes rows [n0, n1) with n0 a multiple of 32; kColumns: as
// columns of out, [K][ld], up to the next multiple of 16 rows; else as rows, [n1 - n0][K]) and
// multiplied by at::mm into a product buffer, copied into the tile's columns of y (bfloat16 or
// float32). As ggml_matmul.cpp's gemm_rows_bf16, which says what measured this: tiles of at least 256
// rows, about 1 MB; each at::mm single-threaded inside the parallel region; the product buffered,
// because at::mm into y's columns (rows N apart) page-faults in oneDNN where N is large.
template <bool kColumns, typename Dequantize>
void gemm_tiles_bf16(int64_t N, int64_t K, const at::Tensor& x, at::Tensor& y, Dequantize&& dequantize) {
  constexpr int64_t kTileBytes = 1 << 20, kMinTileRows = 256;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t max_tile = std::max<int64_t>(kMinTileRows, kTileBytes / (2 * K) / 32 * 32);
  int64_t tiles = (N + max_tile - 1) / max_tile;
  tiles = std::min((tiles + threads - 1) / threads * threads, (N + 31) / 32);  // every thread busy
  const int64_t tile = ((N + tiles - 1) / tiles + 31) / 32 * 32;
  tiles = (N + tile - 1) / tile;
  const bool inference = c10::InferenceMode::is_enabled();  // see gemm_tiles
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    c10::InferenceMode guard(inference);
    at::Tensor buffer = kColumns ? at::empty({K, tile}, x.options()) : at::empty({tile, K}, x.options());
    at::Tensor product = at::empty({x.size(0), tile}, x.options());
    uint16_t* b = reinterpret_cast<uint16_t*>(buffer.data_ptr<at::BFloat16>());
    RowScales scratch;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * tile, n1 = std::min(N, n0 + tile);
      dequantize(n0, n1, b, tile, scratch);
      at::Tensor out = product.narrow(1, 0, n1 - n0);
      at::mm_out(out, x, kColumns ? buffer.narrow(1, 0, n1 - n0) : buffer.narrow(0, 0, n1 - n0).t());
      y.narrow(1, n0, n1 - n0).copy_(out);
    }
  });
}

// The result's dtype: bfloat16 (the default) or float32 (what the matmul kernels hand back: the
// bfloat16 sums widened, one pass fewer than converting afterwards).
at::ScalarType bf16_output(std::optional<at::ScalarType> out_dtype) {
  const at::ScalarType dtype = out_dtype.value_or(at::kBFloat16);
  TORCH_CHECK_VALUE(dtype == at::kBFloat16 || dtype == at::kFloat, "out_dtype must be bfloat16 or float32, got ",
                    dtype);
  return dtype;
}

// x (bfloat16 [M, K]) times a planar weight's values rounded to bfloat16: [M, N] in out_dtype.
at::Tensor qlinear_bf16(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const std::optional<at::Tensor>& mins, int64_t group_size, int64_t bits,
                        std::optional<at::ScalarType> out_dtype) {
  const QuantWeight w = check_weight(qweight, scales, mins, group_size, bits);
  check_input(x, w, at::kBFloat16);
  at::Tensor y = at::empty({x.size(0), w.rows}, x.options().dtype(bf16_output(out_dtype)));
  if (x.size(0) == 0 || w.rows == 0) return y;
  gemm_tiles_bf16<false>(w.rows, w.cols, x, y, [&](int64_t n0, int64_t n1, uint16_t* out, int64_t, RowScales& rs) {
    dequantize_rows(w, n0, n1, out, rs);
  });
  return y;
}

// The same on a p16 weight: [M, rows] in out_dtype.
at::Tensor qlinear_p16_bf16(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scales,
                            const std::optional<at::Tensor>& mins, int64_t rows, int64_t group_size, int64_t bits,
                            std::optional<at::ScalarType> out_dtype) {
  const P16Weight w = check_p16(data, scales, mins, rows, group_size, bits);
  check_input(x, w, at::kBFloat16);
  at::Tensor y = at::empty({x.size(0), w.valid_rows}, x.options().dtype(bf16_output(out_dtype)));
  if (x.size(0) == 0 || w.valid_rows == 0) return y;
#ifdef MRQ_BRGEMM
  if (at::native::cpublas::could_pack(at::kBFloat16)) {  // AMX: p16_brgemm says what it measured
    p16_brgemm(w, x, y);
    return y;
  }
#endif
  gemm_tiles_bf16<true>(w.valid_rows, w.cols, x, y, [&](int64_t n0, int64_t n1, uint16_t* out, int64_t ld,
                                                        RowScales&) { dequantize_p16_bf16(w, n0, n1, out, ld); });
  return y;
}

// A gated MLP on p16 weights, down(silu(gate(x)) * up(x)), in one operator call (with the p16 kernel
// named: q8, exact or split): the two matmuls and the activation between them (torch's silu and
// mul, as the unfused layers compute it), without the two extra dispatches and the Python between
// them that a decode step pays per layer.
at::Tensor gated_mlp_p16(const at::Tensor& x, const at::Tensor& gu_data, const at::Tensor& gu_scales,
                         const std::optional<at::Tensor>& gu_mins, int64_t gu_rows, int64_t gu_group, int64_t gu_bits,
                         const at::Tensor& down_data, const at::Tensor& down_scales,
                         const std::optional<at::Tensor>& down_mins, int64_t down_rows, int64_t down_group,
                         int64_t down_bits, c10::string_view kernel) {
  TORCH_CHECK_VALUE(gu_rows % 2 == 0, "the gate/up projection must have an even number of rows, got ", gu_rows);
  TORCH_CHECK_VALUE(kernel == "q8" || kernel == "exact" || kernel == "split" || kernel == "bf16",
                    "kernel must be 'q8', 'exact', 'split' or 'bf16', got '", std::string(kernel), "'");
  if (kernel == "bf16") {  // float32 x and result, as the bf16 matmul kernel takes and gives them
    TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat, "x must be float32, got ", x.scalar_type());
    const at::Tensor gate_up = qlinear_p16_bf16(x.to(at::kBFloat16), gu_data, gu_scales, gu_mins, gu_rows, gu_group,
                                                gu_bits, at::kFloat);
    const int64_t inter = gu_rows / 2;
    at::Tensor hidden = at::silu(gate_up.narrow(1, 0, inter));
    hidden.mul_(gate_up.narrow(1, inter, inter));
    return qlinear_p16_bf16(hidden.to(at::kBFloat16), down_data, down_scales, down_mins, down_rows, down_group,
                            down_bits, at::kFloat);
  }
  const auto matmul = kernel == "exact" ? qlinear_p16_exact : kernel == "split" ? qlinear_p16_split : qlinear_p16;
  const at::Tensor gate_up = matmul(x, gu_data, gu_scales, gu_mins, gu_rows, gu_group, gu_bits);
  const int64_t inter = gu_rows / 2;
  at::Tensor hidden = at::silu(gate_up.narrow(1, 0, inter));
  hidden.mul_(gate_up.narrow(1, inter, inter));
  return matmul(hidden, down_data, down_scales, down_mins, down_rows, down_group, down_bits);
}

bool p16_supported(int64_t bits) { return p16_supported_bits(bits); }

// ---------------------------------------------------------------------------------------------
// The operators.

at::Tensor dequantize(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                      int64_t group_size, int64_t bits) {
  const QuantWeight w = check_weight(qweight, scales, mins, group_size, bits);
  at::Tensor out = at::empty({w.rows, w.cols}, qweight.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  parallel_rows(w.rows, 16, static_cast<double>(w.cols), [&](int64_t n0, int64_t n1) {
    RowScales rs;
    dequantize_rows(w, n0, n1, o + n0 * w.cols, rs);
  });
  return out;
}

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                   const std::optional<at::Tensor>& mins, int64_t group_size, int64_t bits, int64_t gemm_rows) {
  const QuantWeight w = check_weight(qweight, scales, mins, group_size, bits);
  check_input(x, w);
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, w.rows}, x.options());
  if (M == 0 || w.rows == 0) return y;
  if (M >= gemm_rows) {
    exact_gemm(w, x, y);
    return y;
  }
  const float* xp = x.const_data_ptr<float>();
  float* yp = y.data_ptr<float>();
  parallel_rows(w.rows, 16, static_cast<double>(w.cols * M), [&](int64_t n0, int64_t n1) {
    bits == 4 ? exact_rows<4>(w, xp, M, yp, n0, n1) : exact_rows<8>(w, xp, M, yp, n0, n1);
  });
  return y;
}

at::Tensor qlinear_q8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const std::optional<at::Tensor>& mins, int64_t group_size, int64_t bits, int64_t packed_rows) {
  const QuantWeight w = check_weight(qweight, scales, mins, group_size, bits);
  check_int8_groups(w, "q8");
  check_input(x, w);
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, w.rows}, x.options());
  if (M == 0 || w.rows == 0) return y;
#ifdef MRQ_AVX2
  const bool packed = M >= packed_rows && (bits == 4 || kPackedInt8);
  const bool pairs = !packed && q8_takes_pairs(w);
#else
  const bool packed = false, pairs = false;
#endif
  const QuantizedInput in = quantize_input(x.const_data_ptr<float>(), M, w, packed && bits == 8, pairs);
  float* yp = y.data_ptr<float>();
  parallel_rows(w.rows, 16, static_cast<double>(w.cols * M), [&](int64_t n0, int64_t n1) {
    if (packed && w.wide)
      bits == 4 ? q8_packed_rows<4, float>(w, in, M, yp, n0, n1) : q8_packed_rows<8, float>(w, in, M, yp, n0, n1);
    else if (packed)
      bits == 4 ? q8_packed_rows<4, at::Half>(w, in, M, yp, n0, n1) : q8_packed_rows<8, at::Half>(w, in, M, yp, n0, n1);
    else
      bits == 4 ? q8_rows<4>(w, in, M, yp, n0, n1) : q8_rows<8>(w, in, M, yp, n0, n1);
  });
  return y;
}

std::string simd() {
#if defined(MRQ_AVX512) && MRQ_VNNI == 1
  return "avx512-vnni";
#elif defined(MRQ_AVX512)
  return "avx512";
#elif MRQ_VNNI == 2
  return "avx2-vnni";
#elif defined(MRQ_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

TORCH_LIBRARY(modelrunner_quant_cpu, m) {
  m.def("dequantize(Tensor qweight, Tensor scales, Tensor? mins, int group_size, int bits) -> Tensor");
  m.def("qlinear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int group_size, int bits, int gemm_rows) "
        "-> Tensor");
  m.def("qlinear_q8(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int group_size, int bits, "
        "int packed_rows) -> Tensor");
  m.def("pack_p16(Tensor qweight, Tensor scales, Tensor? mins, int group_size, int bits) -> Tensor[]");
  m.def("qlinear_p16(Tensor x, Tensor data, Tensor scales, Tensor? mins, int rows, int group_size, int bits) "
        "-> Tensor");
  m.def("gated_mlp_p16(Tensor x, Tensor gu_data, Tensor gu_scales, Tensor? gu_mins, int gu_rows, int gu_group, "
        "int gu_bits, Tensor down_data, Tensor down_scales, Tensor? down_mins, int down_rows, int down_group, "
        "int down_bits, str kernel=\"q8\") -> Tensor");
  m.def("qlinear_p16_exact(Tensor x, Tensor data, Tensor scales, Tensor? mins, int rows, int group_size, int bits) "
        "-> Tensor");
  m.def("p16_supported(int bits) -> bool");
  m.def("p16_exact_supported(int bits) -> bool");
  m.def("qlinear_p16_split(Tensor x, Tensor data, Tensor scales, Tensor? mins, int rows, int group_size, int bits) "
        "-> Tensor");
  m.def("p16_split_supported(int bits) -> bool");
  m.def("qlinear_bf16(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int group_size, int bits, "
        "ScalarType? out_dtype=None) -> Tensor");
  m.def("qlinear_p16_bf16(Tensor x, Tensor data, Tensor scales, Tensor? mins, int rows, int group_size, int bits, "
        "ScalarType? out_dtype=None) -> Tensor");
  m.def("simd() -> str");
}

TORCH_LIBRARY_IMPL(modelrunner_quant_cpu, CPU, m) {
  m.impl("dequantize", &dequantize);
  m.impl("qlinear", &qlinear);
  m.impl("qlinear_q8", &qlinear_q8);
  m.impl("pack_p16", &pack_p16);
  m.impl("qlinear_p16", &qlinear_p16);
  m.impl("qlinear_p16_exact", &qlinear_p16_exact);
  m.impl("qlinear_p16_split", &qlinear_p16_split);
  m.impl("gated_mlp_p16", &gated_mlp_p16);
  m.impl("qlinear_bf16", &qlinear_bf16);
  m.impl("qlinear_p16_bf16", &qlinear_p16_bf16);
}

// simd() takes no tensor, so it has no dispatch key to route by: registered for every backend.
TORCH_LIBRARY_IMPL(modelrunner_quant_cpu, CompositeExplicitAutograd, m) {
  m.impl("simd", &simd);
  m.impl("p16_supported", &p16_supported);
  m.impl("p16_exact_supported", &p16_exact_supported);
  m.impl("p16_split_supported", &p16_split_supported);
}
