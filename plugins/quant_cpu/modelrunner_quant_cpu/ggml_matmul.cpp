// Matrix products with weights kept as a GGUF file stores them: ggml's blocks, read in place, times
// float32 activations. Reading 4.5 (Q4_K) or 6.6 (Q6_K) bits per weight instead of the planar
// layout's 6 or 10 is what decides the speed of a decode step, which reads every weight once.
//
// Weight: uint8 [N, K / values_per_block * block_bytes], each row the file's blocks unchanged:
//   Q5_0 (6)   22 bytes per 32 values: fp16 d, 32 high bits, 16 bytes of nibbles; w = d (q - 16)
//   Q8_0 (8)   34 bytes per 32 values: fp16 d, 32 int8; w = d q
//   Q4_K (12) 144 bytes per 256 values: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins of eight
//             sub-blocks of 32, 128 bytes of nibbles; w = (d sc) q - (dmin m)
//   Q5_K (13) 176 bytes per 256 values: as Q4_K plus 32 bytes of fifth bits
//   Q6_K (14) 210 bytes per 256 values: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8
//             scales of sub-blocks of 16, fp16 d; w = (d sc) (q - 32)
// (ggml-quants.c, dequantize_row_*).
//
// Each 256 values of a row (one K-quant block, eight of the others) become vectors of floats in
// registers, w = scale * q - min, which are multiplied into up to 4 rows of x at a time. Those floats
// are ggml's dequantized weights bit for bit: a scale (d times a sub-block's integer scale) is exact
// in float32, and where there is a min, scale * q is too (11 + 6 + 5 significant bits at most), so
// scale * q - min is rounded once, as ggml rounds it. The product is the float32 matmul with ggml's
// weights, up to summation order. On AVX-512, Q4_K's nibbles index a table of each sub-block's 16
// weights; otherwise the blocks are unpacked to int8 values first (a Chunk), then converted.
//
// Small M (<= gemm_rows): that, every weight byte read once per call. Larger M: tiles of rows
// dequantized to float32 and multiplied by MKL/oneDNN (at::mm).
//
// ggml_linear_bf16 is the same in bfloat16: x bfloat16, each weight ggml's float32 value rounded to
// bfloat16 (as torch rounds it), the result bfloat16. Small M: the weights rounded in registers and
// multiplied into float32 copies of x's rows (exact products, float32 sums). Larger M: tiles of rows
// dequantized straight to bfloat16 and multiplied by at::mm, which oneDNN runs on AMX or AVX512-BF16
// where the CPU has them (on Sapphire Rapids, 2 threads, 64-256 rows: 2.2-4.3x the float32 tiles).
//
// Registered in the plugin's operator namespace (modelrunner_quant_cpu::ggml_*); built once per
// instruction-set variant like quant_matmul.cpp (AVX-512, AVX2 + FMA + F16C, or portable scalar code).

#include <c10/core/InferenceMode.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MRG_AVX2 1
#endif
#if defined(MRG_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__)
#define MRG_AVX512 1
#endif

namespace {

// ---------------------------------------------------------------------------------------------
// Vectors of floats: 16 lanes (AVX-512), or 8 (AVX2, and portable code).

#if defined(MRG_AVX512)
struct Lanes {
  using V = __m512;
  static constexpr int kWidth = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  // *p in every lane, loaded so: a broadcast of a register would take the shuffle port, which the
  // conversions and permutes of the weights keep busy (the compiler prefers it where it can).
  static V broadcast(const float* p) {
    V v;
    asm("vbroadcastss %1, %0" : "=v"(v) : "m"(*p));
    return v;
  }
  // The kWidth int8 values at q, widened from memory (the compiler would take them from the register
  // that just stored them, one more shuffle each).
  static __m512i widen(const int8_t* q) {
    __m512i v;
    asm("vpmovsxbd %1, %0" : "=v"(v) : "m"(*reinterpret_cast<const __m128i*>(q)));
    return v;
  }
  // *scale * q - *min (rounded once), or *scale * q, for the kWidth int8 values q.
  template <bool kMins>
  static V weights(const int8_t* q, const float* scale, const float* min) {
    const V f = _mm512_cvtepi32_ps(widen(q));
    return kMins ? _mm512_fmsub_ps(f, broadcast(scale), broadcast(min)) : _mm512_mul_ps(f, broadcast(scale));
  }
};
#elif defined(MRG_AVX2)
struct Lanes {
  using V = __m256;
  static constexpr int kWidth = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static V broadcast(const float* p) {  // see the AVX-512 version
    V v;
    asm("vbroadcastss %1, %0" : "=x"(v) : "m"(*p));
    return v;
  }
  static __m256i widen(const int8_t* q) {  // see the AVX-512 version
    __m256i v;
    asm("vpmovsxbd %1, %0" : "=x"(v) : "m"(*reinterpret_cast<const int64_t*>(q)));
    return v;
  }
  template <bool kMins>
  static V weights(const int8_t* q, const float* scale, const float* min) {
    const V f = _mm256_cvtepi32_ps(widen(q));
    return kMins ? _mm256_fmsub_ps(f, broadcast(scale), broadcast(min)) : _mm256_mul_ps(f, broadcast(scale));
  }
};
#else
// Eight floats in plain C++: the compiler puts them in whatever vector registers the target has.
struct Lanes {
  struct V {
    float f[8];
  };
  static constexpr int kWidth = 8;
  static V zero() { return V{}; }
  static V load(const float* p) {
    V v;
    for (int i = 0; i < 8; ++i) v.f[i] = p[i];
    return v;
  }
  static void store(float* p, const V& v) {
    for (int i = 0; i < 8; ++i) p[i] = v.f[i];
  }
  static V add(V a, const V& b) {
    for (int i = 0; i < 8; ++i) a.f[i] += b.f[i];
    return a;
  }
  static V fma(const V& a, const V& b, V c) {
    for (int i = 0; i < 8; ++i) c.f[i] += a.f[i] * b.f[i];
    return c;
  }
  static float sum(const V& v) {
    float s = 0.f;
    for (int i = 0; i < 8; ++i) s += v.f[i];
    return s;
  }
  template <bool kMins>
  static V weights(const int8_t* q, const float* scale, const float* min) {
    V v;
    for (int i = 0; i < 8; ++i)
      v.f[i] = kMins ? *scale * static_cast<float>(q[i]) - *min : *scale * static_cast<float>(q[i]);
    return v;
  }
};
#endif

// ---------------------------------------------------------------------------------------------
// bfloat16 (ggml_linear_bf16): round_bf16 and store_bf16 (bf16_round.h, shared with quant_matmul.cpp);
// the portable build rounds one float at a time.
#include "bf16_round.h"
#if !defined(MRG_AVX2)
inline Lanes::V round_bf16(Lanes::V v) {
  for (int i = 0; i < 8; ++i) v.f[i] = static_cast<float>(c10::BFloat16(v.f[i]));
  return v;
}
inline void store_bf16(uint16_t* p, const Lanes::V& rounded) {
  for (int i = 0; i < 8; ++i) p[i] = c10::BFloat16(rounded.f[i]).x;  // exact: the value is a bfloat16
}
#endif

// ---------------------------------------------------------------------------------------------
// The formats. Each reads up to 256 values of a row at a time (one K-quant block; eight Q8_0 or Q5_0
// blocks) and hands them out as vectors of floats, ggml's dequantized weights: vectors(blocks, count,
// visit) calls visit(i, w) for the values i * Lanes::kWidth onward of `count` blocks.
//
// Most take the portable way (unpacked_vectors): the blocks' integers into a Chunk (int8 values,
// a scale and a min per group of kGroup values), then w = scale * q - min per vector. Their unpack()
// has 256-bit byte operations where the CPU has AVX2 (AVX-512 included) and plain loops elsewhere.

constexpr int64_t kChunk = 256;

struct Chunk {
  alignas(64) int8_t q[kChunk];
  alignas(64) float scale[16];  // per group of F::kGroup values
  alignas(64) float min[16];    // formats with mins only
};

template <typename F, typename Visit>
inline void unpacked_vectors(const uint8_t* b, int64_t count, Visit&& visit) {
  Chunk c;
  F::unpack(b, count, c);
  constexpr int64_t kPerGroup = F::kGroup / Lanes::kWidth;
  const auto at = [&](int64_t i) {
    visit(i, Lanes::template weights<F::kMins>(c.q + i * Lanes::kWidth, c.scale + i / kPerGroup, c.min + i / kPerGroup));
  };
  if (count * F::kValues == kChunk) {  // a constant where the caller passes a whole chunk: i is one too
#pragma GCC unroll 32
    for (int64_t i = 0; i < kChunk / Lanes::kWidth; ++i) at(i);
  } else {
    for (int64_t i = 0; i < count * F::kValues / Lanes::kWidth; ++i) at(i);
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Q4_K's and Q5_K's 12 bytes of six-bit scales and mins (ggml's get_scale_min_k4), as two words of
// scale bytes then two of min bytes (llama.cpp's kmask shuffle of three words).
inline void k_scale_bytes(const uint8_t* packed, uint32_t (&u)[4]) {
  uint64_t low;
  uint32_t c;
  std::memcpy(&low, packed, 8);  // loaded into registers, not through a copy on the stack
  std::memcpy(&c, packed + 8, 4);
  const uint32_t a = static_cast<uint32_t>(low), b = static_cast<uint32_t>(low >> 32);
  u[0] = a & 0x3f3f3f3f;
  u[1] = (c & 0x0f0f0f0f) | (((a >> 6) & 0x03030303) << 4);
  u[2] = b & 0x3f3f3f3f;
  u[3] = ((c >> 4) & 0x0f0f0f0f) | (((b >> 6) & 0x03030303) << 4);
}

// d times the eight sub-blocks' scales, dmin times their mins.
inline void k_scales(const uint8_t* b, Chunk& c) {
  uint32_t u[4];
  k_scale_bytes(b + 4, u);
  const float d = half_at(b), dmin = half_at(b + 2);
#ifdef MRG_AVX2
  const auto floats = [](uint32_t lo, uint32_t hi) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(lo | uint64_t(hi) << 32))));
  };
  _mm256_store_ps(c.scale, _mm256_mul_ps(_mm256_set1_ps(d), floats(u[0], u[1])));
  _mm256_store_ps(c.min, _mm256_mul_ps(_mm256_set1_ps(dmin), floats(u[2], u[3])));
#else
  uint8_t sm[16];
  std::memcpy(sm, u, 16);
  for (int j = 0; j < 8; ++j) c.scale[j] = d * static_cast<float>(sm[j]), c.min[j] = dmin * static_cast<float>(sm[8 + j]);
#endif
}

#ifdef MRG_AVX2
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void store32(int8_t* p, __m256i v) { _mm256_store_si256(reinterpret_cast<__m256i*>(p), v); }
inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
inline __m256i high_nibbles(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
// Bits kFrom .. kFrom + kWidth - 1 of each byte moved to bits kTo .. (others cleared). 16-bit shifts:
// what crosses into the neighbouring byte is masked off.
template <int kFrom, int kTo, int kWidth>
inline __m256i move_bits(__m256i v) {
  const __m256i mask = _mm256_set1_epi8(static_cast<char>(((1 << kWidth) - 1) << kTo));
  if constexpr (kFrom < kTo) return _mm256_and_si256(_mm256_slli_epi16(v, kTo - kFrom), mask);
  if constexpr (kFrom > kTo) return _mm256_and_si256(_mm256_srli_epi16(v, kFrom - kTo), mask);
  return _mm256_and_si256(v, mask);
}
#endif

#ifdef MRG_AVX512
// Q4_K's d, dmin, scales and mins as floats [scale 0, min 0, scale 1, min 1, ...]: the bytes
// interleaved by bit deposits (a port of their own), then one widening and conversion.
inline void k_scales_interleaved(const uint8_t* b, float (&out)[16]) {
  uint32_t u[4];
  k_scale_bytes(b + 4, u);
  const uint64_t scales = u[0] | uint64_t(u[1]) << 32, mins = u[2] | uint64_t(u[3]) << 32;
  constexpr uint64_t kEven = 0x00ff00ff00ff00ffull, kOdd = ~kEven;
  const __m128i bytes = _mm_set_epi64x(static_cast<int64_t>(_pdep_u64(scales >> 32, kEven) | _pdep_u64(mins >> 32, kOdd)),
                                       static_cast<int64_t>(_pdep_u64(scales, kEven) | _pdep_u64(mins, kOdd)));
  uint32_t d_dmin;
  std::memcpy(&d_dmin, b, 4);
  const __m512 factors = _mm512_cvtph_ps(_mm256_set1_epi32(static_cast<int32_t>(d_dmin)));
  _mm512_store_ps(out, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)), factors));
}
#endif

struct Q4K {
  static constexpr int64_t kType = 12, kValues = 256, kBytes = 144, kGroup = 32;
  static constexpr bool kMins = true;
  static constexpr const char* kName = "Q4_K";
  // 32 bytes per 64 values: their low nibbles the first 32 values, high nibbles the other 32.
  static void unpack(const uint8_t* b, int64_t, Chunk& c) {
    k_scales(b, c);
    const uint8_t* qs = b + 16;
    for (int j = 0; j < 4; ++j) {
#ifdef MRG_AVX2
      const __m256i v = load32(qs + 32 * j);
      store32(c.q + 64 * j, low_nibbles(v));
      store32(c.q + 64 * j + 32, high_nibbles(v));
#else
      for (int l = 0; l < 32; ++l) {
        c.q[64 * j + l] = static_cast<int8_t>(qs[32 * j + l] & 15);
        c.q[64 * j + 32 + l] = static_cast<int8_t>(qs[32 * j + l] >> 4);
      }
#endif
    }
  }
  template <typename Visit>
  static void vectors(const uint8_t* b, int64_t count, Visit&& visit) {
#ifdef MRG_AVX512
    table_vectors<false>(b, visit);
#else
    unpacked_vectors<Q4K>(b, count, visit);
#endif
  }
#ifdef MRG_AVX512
  // Each sub-block's 16 possible weights, scale * i - min, in one register: the nibbles index it
  // (a permute reads the low 4 bits of each lane), one instruction per 16 weights. kRoundBF16: the
  // 16 weights rounded to bfloat16 (RoundedBF16<Q4K>), once per sub-block rather than per vector.
  template <bool kRoundBF16, typename Visit>
  static void table_vectors(const uint8_t* b, Visit&& visit) {
    alignas(64) float scale_min[16];
    k_scales_interleaved(b, scale_min);
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const uint8_t* qs = b + 16;
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const float* sm = scale_min + 4 * j;
      __m512 low = _mm512_fmsub_ps(iota, Lanes::broadcast(sm), Lanes::broadcast(sm + 1));
      __m512 high = _mm512_fmsub_ps(iota, Lanes::broadcast(sm + 2), Lanes::broadcast(sm + 3));
      if constexpr (kRoundBF16) low = round_bf16(low), high = round_bf16(high);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m512i bytes =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 32 * j + 16 * h)));
        visit(4 * j + h, _mm512_permutexvar_ps(bytes, low));
        visit(4 * j + 2 + h, _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), high));
      }
    }
  }
#endif
};

struct Q5K {
  static constexpr int64_t kType = 13, kValues = 256, kBytes = 176, kGroup = 32;
  static constexpr bool kMins = true;
  static constexpr const char* kName = "Q5_K";
  // As Q4_K's nibbles, and bit i of qh[l] is the fifth bit of value 32 i + l.
  static void unpack(const uint8_t* b, int64_t, Chunk& c) {
    k_scales(b, c);
    const uint8_t *qh = b + 16, *qs = b + 48;
#ifdef MRG_AVX2
    const __m256i high = load32(qh);
    const auto pair = [&]<int j>() {
      const __m256i v = load32(qs + 32 * j);
      store32(c.q + 64 * j, _mm256_or_si256(low_nibbles(v), move_bits<2 * j, 4, 1>(high)));
      store32(c.q + 64 * j + 32, _mm256_or_si256(high_nibbles(v), move_bits<2 * j + 1, 4, 1>(high)));
    };
    pair.template operator()<0>();
    pair.template operator()<1>();
    pair.template operator()<2>();
    pair.template operator()<3>();
#else
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) {
        c.q[64 * j + l] = static_cast<int8_t>((qs[32 * j + l] & 15) | (((qh[l] >> (2 * j)) & 1) << 4));
        c.q[64 * j + 32 + l] = static_cast<int8_t>((qs[32 * j + l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4));
      }
#endif
  }
  template <typename Visit>
  static void vectors(const uint8_t* b, int64_t count, Visit&& visit) {
    unpacked_vectors<Q5K>(b, count, visit);
  }
};

struct Q6K {
  static constexpr int64_t kType = 14, kValues = 256, kBytes = 210, kGroup = 16;
  static constexpr bool kMins = false;
  static constexpr const char* kName = "Q6_K";
  // Halves of 128 values: 64 bytes of low nibbles (values 0..63 low, 64..127 high) and 32 bytes of
  // 2-bit pairs (bits 2i..2i+1 of byte l: the top bits of value 32 i + l); q - 32.
  static void unpack(const uint8_t* b, int64_t, Chunk& c) {
    const float d = half_at(b + 208);
#ifdef MRG_AVX2
    for (int i = 0; i < 16; i += 8) {
      const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 192 + i)));
      _mm256_store_ps(c.scale + i, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sc)));
    }
    const __m256i offset = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; ++h) {
      const __m256i lo = load32(b + 64 * h), hi = load32(b + 64 * h + 32), pairs = load32(b + 128 + 32 * h);
      int8_t* q = c.q + 128 * h;
      store32(q, _mm256_sub_epi8(_mm256_or_si256(low_nibbles(lo), move_bits<0, 4, 2>(pairs)), offset));
      store32(q + 32, _mm256_sub_epi8(_mm256_or_si256(low_nibbles(hi), move_bits<2, 4, 2>(pairs)), offset));
      store32(q + 64, _mm256_sub_epi8(_mm256_or_si256(high_nibbles(lo), move_bits<4, 4, 2>(pairs)), offset));
      store32(q + 96, _mm256_sub_epi8(_mm256_or_si256(high_nibbles(hi), move_bits<6, 4, 2>(pairs)), offset));
    }
#else
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int i = 0; i < 16; ++i) c.scale[i] = d * static_cast<float>(sc[i]);
    for (int h = 0; h < 2; ++h) {
      const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
      int8_t* q = c.q + 128 * h;
      for (int l = 0; l < 32; ++l) {
        q[l] = static_cast<int8_t>(((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32);
        q[l + 32] = static_cast<int8_t>(((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
        q[l + 64] = static_cast<int8_t>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
        q[l + 96] = static_cast<int8_t>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
      }
    }
#endif
  }
  template <typename Visit>
  static void vectors(const uint8_t* b, int64_t count, Visit&& visit) {
    unpacked_vectors<Q6K>(b, count, visit);
  }
};

struct Q8_0 {
  static constexpr int64_t kType = 8, kValues = 32, kBytes = 34, kGroup = 32;
  static constexpr bool kMins = false;
  static constexpr const char* kName = "Q8_0";
  static void unpack(const uint8_t* b, int64_t count, Chunk& c) {
    for (int64_t i = 0; i < count; ++i, b += kBytes) {
      c.scale[i] = half_at(b);
      std::memcpy(c.q + 32 * i, b + 2, 32);
    }
  }
  template <typename Visit>
  static void vectors(const uint8_t* b, int64_t count, Visit&& visit) {
    unpacked_vectors<Q8_0>(b, count, visit);
  }
};

struct Q5_0 {
  static constexpr int64_t kType = 6, kValues = 32, kBytes = 22, kGroup = 32;
  static constexpr bool kMins = false;
  static constexpr const char* kName = "Q5_0";
  // Value j < 16: the low nibble of qs[j]; j >= 16: the high nibble of qs[j - 16]; fifth bit: bit j
  // of the word qh; q - 16.
  static void unpack(const uint8_t* b, int64_t count, Chunk& c) {
    for (int64_t i = 0; i < count; ++i, b += kBytes) {
      c.scale[i] = half_at(b);
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      const uint8_t* qs = b + 6;
      int8_t* q = c.q + 32 * i;
#ifdef MRG_AVX2
      // Byte j of the word's spread: its byte j / 8 (per 128-bit lane); then bit j % 8 of that.
      const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(qh)),
                                                 _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                   0x0101010101010101, 0));
      const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
      const __m256i fifth =
          _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), low4 = _mm_set1_epi8(15);
      const __m256i nibbles = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low4), _mm_and_si128(v, low4));
      store32(q, _mm256_sub_epi8(_mm256_or_si256(nibbles, fifth), _mm256_set1_epi8(16)));
#else
      for (int j = 0; j < 16; ++j) {
        q[j] = static_cast<int8_t>(((qs[j] & 15) | (((qh >> j) & 1) << 4)) - 16);
        q[j + 16] = static_cast<int8_t>(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
      }
#endif
    }
  }
  template <typename Visit>
  static void vectors(const uint8_t* b, int64_t count, Visit&& visit) {
    unpacked_vectors<Q5_0>(b, count, visit);
  }
};

// Calls visit.template operator()<Format>() for a ggml type id this file runs; false for another.
template <typename F>
bool with_format(int64_t type, F&& visit) {
  switch (type) {
    case Q5_0::kType: visit.template operator()<Q5_0>(); return true;
    case Q8_0::kType: visit.template operator()<Q8_0>(); return true;
    case Q4K::kType: visit.template operator()<Q4K>(); return true;
    case Q5K::kType: visit.template operator()<Q5K>(); return true;
    case Q6K::kType: visit.template operator()<Q6K>(); return true;
    default: return false;
  }
}

constexpr const char* kSupported = "Q5_0 (6), Q8_0 (8), Q4_K (12), Q5_K (13), Q6_K (14)";

inline void prefetch(const uint8_t* p) {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
#else
  __builtin_prefetch(p, 0, 3);
#endif
}

// ---------------------------------------------------------------------------------------------
// The weight, validated.

struct GgmlWeight {
  const uint8_t* data = nullptr;
  int64_t rows = 0, cols = 0, blocks = 0, row_bytes = 0;  // blocks: per row
  const uint8_t* row(int64_t n) const { return data + n * row_bytes; }
};

template <typename F>
GgmlWeight check_blocks(const at::Tensor& blocks) {
  TORCH_CHECK_VALUE(blocks.scalar_type() == at::kByte, "blocks must be uint8 (the file's bytes), got ",
                    blocks.scalar_type());
  TORCH_CHECK_VALUE(blocks.dim() == 2, "blocks must be 2-D [N, bytes per row], got shape ", blocks.sizes());
  TORCH_CHECK_VALUE(blocks.device().is_cpu(), "blocks must be a CPU tensor, got device ", blocks.device());
  TORCH_CHECK_VALUE(blocks.is_contiguous(), "blocks must be contiguous (strides ", blocks.strides(), ")");
  GgmlWeight w;
  w.rows = blocks.size(0);
  w.row_bytes = blocks.size(1);
  TORCH_CHECK_VALUE(w.row_bytes > 0 && w.row_bytes % F::kBytes == 0, "blocks have ", w.row_bytes,
                    " bytes per row, not a positive whole number of ", F::kName, " blocks (", F::kBytes,
                    " bytes each)");
  w.blocks = w.row_bytes / F::kBytes;
  w.cols = w.blocks * F::kValues;
  w.data = static_cast<const uint8_t*>(blocks.const_data_ptr());
  return w;
}

template <typename F>
void check_input(const at::Tensor& x, const GgmlWeight& w, at::ScalarType dtype = at::kFloat) {
  TORCH_CHECK_VALUE(x.scalar_type() == dtype, "x must be ", dtype == at::kFloat ? "float32" : "bfloat16", ", got ",
                    x.scalar_type());
  TORCH_CHECK_VALUE(x.device().is_cpu(), "x must be a CPU tensor, got device ", x.device());
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be 2-D [M, K], got shape ", x.sizes());
  TORCH_CHECK_VALUE(x.is_contiguous(), "x must be contiguous (strides ", x.strides(), ")");
  const int64_t K = x.size(1);
  TORCH_CHECK_VALUE(K % F::kValues == 0, "x has K = ", K, " features, not a multiple of ", F::kValues, " (",
                    F::kName, " blocks hold ", F::kValues, " values)");
  TORCH_CHECK_VALUE(K == w.cols, "x has K = ", K, " features but the blocks hold ", w.cols, " per row (",
                    w.blocks, " ", F::kName, " blocks of ", F::kBytes, " bytes)");
}

void refuse_type(int64_t type) {
  TORCH_CHECK_VALUE(false, "ggml type ", type, " is not one these kernels run; they run ", kSupported);
}

// ---------------------------------------------------------------------------------------------
// Threads. Multiply-adds a thread must get before a call is split (as quant_matmul.cpp measured it:
// waking torch's sleeping threads, OMP_WAIT_POLICY=PASSIVE, costs ~35 us; spinning ones a few).

double min_work_per_thread() {
  static const double work = [] {
    const char* policy = std::getenv("OMP_WAIT_POLICY");
    std::string p = policy ? policy : "";
    std::transform(p.begin(), p.end(), p.begin(), [](unsigned char c) { return std::tolower(c); });
    return p == "passive" ? double(1 << 20) : double(1 << 17);
  }();
  return work;
}

// Rows [0, N) in contiguous ranges among torch's threads, each with at least min_work_per_thread().
template <typename Body>
void parallel_rows(int64_t N, double work_per_row, Body&& body) {
  const int64_t grain = std::max<int64_t>(1, static_cast<int64_t>(min_work_per_thread() / std::max(1.0, work_per_row)));
  at::parallel_for(0, N, grain, body);
}

// ---------------------------------------------------------------------------------------------
// Dequantization: rows [n0, n1) as floats, [n1 - n0][K] from out on.

template <typename F>
void dequantize_rows(const GgmlWeight& w, int64_t n0, int64_t n1, float* out) {
  constexpr int64_t kPerChunk = kChunk / F::kValues;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.row(n);
    for (int64_t b = 0; b < w.blocks; b += kPerChunk) {
      float* o = out + (n - n0) * w.cols + b * F::kValues;
      F::vectors(row + b * F::kBytes, std::min(kPerChunk, w.blocks - b),
                 [&](int64_t i, Lanes::V v) { Lanes::store(o + i * Lanes::kWidth, v); });
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Small M: MT rows of x times one weight row over all of K, in registers. Each chunk of the weight
// row becomes floats once, for the MT rows of x.

constexpr int kMaxRows = 4;  // 8 measured slower at 8 to 48 rows of x (AVX-512): registers run short

// Partial sums per row of x: enough independent multiply-add chains to hide their latency.
constexpr int partial_sums(int mt) { return mt >= 4 ? 1 : 4 / mt; }

// Weight bytes are read once per call, as one stream per thread: prefetched this far ahead (into L1:
// measured on Sapphire Rapids, 2 threads, 12.5 GB/s against 10.3 with 1 KB ahead non-temporally and
// 10.2 with none, where a plain read of the same bytes ran 18).
constexpr int64_t kStreamAhead = 1024;

template <typename F, int MT>
void fused_tile(const GgmlWeight& w, int64_t n, const float* x, float* y, int64_t ldy) {
  using V = Lanes::V;
  constexpr int64_t kPerChunk = kChunk / F::kValues;
  constexpr int P = partial_sums(MT);
  const int64_t K = w.cols, whole = w.blocks / kPerChunk * kPerChunk;
  const uint8_t* row = w.row(n);
  V acc[MT][P];
#pragma GCC unroll 4
  for (int r = 0; r < MT; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) acc[r][p] = Lanes::zero();
  for (int64_t b = 0; b < whole; b += kPerChunk) {
    const uint8_t* blocks = row + b * F::kBytes;
    const float* xb = x + b * F::kValues;
    for (int64_t line = 0; line < kPerChunk * F::kBytes; line += 64) prefetch(blocks + kStreamAhead + line);
    // Vector i goes to partial sum i % P: i is a constant in the unrolled loops, acc stays in registers.
    F::vectors(blocks, kPerChunk, [&](int64_t i, V wv) {
#pragma GCC unroll 4
      for (int r = 0; r < MT; ++r)
        acc[r][i % P] = Lanes::fma(wv, Lanes::load(xb + r * K + i * Lanes::kWidth), acc[r][i % P]);
    });
  }
  if (whole < w.blocks) {  // the last blocks of a Q8_0 or Q5_0 row, fewer than a chunk
    const float* xb = x + whole * F::kValues;
    F::vectors(row + whole * F::kBytes, w.blocks - whole, [&](int64_t i, V wv) {
#pragma GCC unroll 4
      for (int r = 0; r < MT; ++r) acc[r][0] = Lanes::fma(wv, Lanes::load(xb + r * K + i * Lanes::kWidth), acc[r][0]);
    });
  }
#pragma GCC unroll 4
  for (int r = 0; r < MT; ++r) {
    V sum = acc[r][0];
#pragma GCC unroll 4
    for (int p = 1; p < P; ++p) sum = Lanes::add(sum, acc[r][p]);
    y[r * ldy] = Lanes::sum(sum);
  }
}

// Calls visit.template operator()<MT>() for mt in 1..kMaxRows.
template <typename Visit>
void with_rows(int64_t mt, Visit&& visit) {
  switch (mt) {
    case 1: visit.template operator()<1>(); break;
    case 2: visit.template operator()<2>(); break;
    case 3: visit.template operator()<3>(); break;
    default: visit.template operator()<4>(); break;
  }
}

// Rows [n0, n1) of y for all M rows of x. Taken in slices whose blocks stay in L2 while every tile of
// x rows (at most kMaxRows, sizes balanced) passes over them: each byte is read from memory once.
template <typename F>
void fused_rows(const GgmlWeight& w, const float* x, int64_t M, float* y, int64_t n0, int64_t n1) {
  constexpr int64_t kSliceBytes = 128 << 10;
  const int64_t slice = std::max<int64_t>(16, kSliceBytes / w.row_bytes);
  const int64_t tiles = (M + kMaxRows - 1) / kMaxRows;
  for (int64_t s0 = n0; s0 < n1; s0 += slice) {
    const int64_t s1 = std::min(n1, s0 + slice);
    for (int64_t i = 0, m0 = 0; i < tiles; ++i) {
      const int64_t mt = (M - m0 + (tiles - i) - 1) / (tiles - i);
      with_rows(mt, [&]<int MT>() {
        for (int64_t n = s0; n < s1; ++n) fused_tile<F, MT>(w, n, x + m0 * w.cols, y + m0 * w.rows + n, w.rows);
      });
      m0 += mt;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Large M: tiles of rows dequantized into a per-thread buffer (about 256 KB, so it stays in L2, but
// at least 192 rows: narrow GEMMs run slowly), each multiplied into its columns of y by at::mm.
// Tiles are multiples of 16 rows (but the last) and every thread gets some.

template <typename F>
void gemm_rows_dequantized(const GgmlWeight& w, const at::Tensor& x, at::Tensor& y) {
  constexpr int64_t kTileBytes = 256 << 10, kMinTileRows = 192;
  const int64_t N = w.rows, K = w.cols;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t max_tile = std::max<int64_t>(kMinTileRows, kTileBytes / (4 * K) / 16 * 16);
  int64_t tiles = (N + max_tile - 1) / max_tile;
  tiles = std::min((tiles + threads - 1) / threads * threads, (N + 15) / 16);
  const int64_t tile = ((N + tiles - 1) / tiles + 15) / 16 * 16;
  tiles = (N + tile - 1) / tile;
  // at::parallel_for does not carry the caller's inference mode into its threads: without it, mm_out
  // into a view of an inference tensor y fails there ("inplace update to inference tensor").
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    c10::InferenceMode guard(inference);
    at::Tensor buffer = at::empty({tile, K}, x.options());
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * tile, n1 = std::min(N, n0 + tile);
      dequantize_rows<F>(w, n0, n1, buffer.data_ptr<float>());
      at::Tensor out = y.narrow(1, n0, n1 - n0);
      at::mm_out(out, x, buffer.narrow(0, 0, n1 - n0).t());
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Format F with its weights rounded to bfloat16 (as floats): fused_rows<RoundedBF16<F>> on float32
// copies of bfloat16 rows of x is the bfloat16 product, each product of two bfloat16 values exact in
// float32 and summed there, as a bfloat16 GEMM sums them.
template <typename F>
struct RoundedBF16 : F {
  template <typename Visit>
  static void vectors(const uint8_t* b, int64_t count, Visit&& visit) {
    F::vectors(b, count, [&](int64_t i, Lanes::V v) { visit(i, round_bf16(v)); });
  }
};

#ifdef MRG_AVX512
template <>
struct RoundedBF16<Q4K> : Q4K {  // its 16 weights per sub-block rounded, not each vector of them
  template <typename Visit>
  static void vectors(const uint8_t* b, int64_t, Visit&& visit) {
    table_vectors<true>(b, visit);
  }
};
#endif

// Rows [n0, n1) as bfloat16, [n1 - n0][K] from out on.
template <typename F>
void dequantize_rows_bf16(const GgmlWeight& w, int64_t n0, int64_t n1, uint16_t* out) {
  constexpr int64_t kPerChunk = kChunk / F::kValues;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.row(n);
    for (int64_t b = 0; b < w.blocks; b += kPerChunk) {
      uint16_t* o = out + (n - n0) * w.cols + b * F::kValues;
      RoundedBF16<F>::vectors(row + b * F::kBytes, std::min(kPerChunk, w.blocks - b),
                              [&](int64_t i, Lanes::V v) { store_bf16(o + i * Lanes::kWidth, v); });
    }
  }
}

// ggml_linear_bf16's default gemm_rows: the most rows of x that run fused_rows<RoundedBF16<F>>
// (weights rounded in registers, every weight byte read once) rather than the tiles. kernel.py's
// GGML_BF16_GEMM_ROWS, which it passes, says what measured it.
constexpr int64_t kBF16GemmRows = 8;

// Large M in bfloat16: as gemm_rows_dequantized, each thread's tiles dequantized to bfloat16 and
// multiplied by at::mm (oneDNN: AMX or AVX512-BF16 where the CPU has them; each call single-threaded
// inside the parallel region). Tiles of at least 256 rows, about 1 MB where K is small: measured on
// Sapphire Rapids, 2 threads, K = 2048 and 8192, 64 and 256 rows of x, tiles from 128 rows or 512 KB
// to 256 rows or 4 MB ran within a few % of each other, 64-row tiles ~10% slower. Dequantizing each
// tile with every thread, then one multi-threaded at::mm per tile, ran 1.5-5x slower. Each product
// goes to a buffer of the tile's width, then into its columns of y: at::mm straight into those
// columns (rows N apart) page-faulted ~200 times a call where N >= 65536 (oneDNN's temporaries),
// 3x the time of the whole LM head (128256 x 2048) at 64 rows.
template <typename F>
void gemm_rows_bf16(const GgmlWeight& w, const at::Tensor& x, at::Tensor& y) {
  constexpr int64_t kTileBytes = 1 << 20, kMinTileRows = 256;
  const int64_t N = w.rows, K = w.cols;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t max_tile = std::max<int64_t>(kMinTileRows, kTileBytes / (2 * K) / 32 * 32);
  int64_t tiles = (N + max_tile - 1) / max_tile;
  tiles = std::min((tiles + threads - 1) / threads * threads, (N + 31) / 32);
  const int64_t tile = ((N + tiles - 1) / tiles + 31) / 32 * 32;
  tiles = (N + tile - 1) / tile;
  const bool inference = c10::InferenceMode::is_enabled();  // see gemm_rows_dequantized
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    c10::InferenceMode guard(inference);
    at::Tensor buffer = at::empty({tile, K}, x.options()), product = at::empty({x.size(0), tile}, x.options());
    uint16_t* b = reinterpret_cast<uint16_t*>(buffer.data_ptr<at::BFloat16>());
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * tile, n1 = std::min(N, n0 + tile);
      dequantize_rows_bf16<F>(w, n0, n1, b);
      at::Tensor out = product.narrow(1, 0, n1 - n0);
      at::mm_out(out, x, buffer.narrow(0, 0, n1 - n0).t());
      y.narrow(1, n0, n1 - n0).copy_(out);
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Integer dot products (ggml_qlinear_int; AVX-512 VNNI builds, Q4_K and Q6_K): x written per
// 32-value block in int8 digits and multiplied into the weights' unsigned integers by vpdpbusd, 64
// weights at a time, as llama.cpp multiplies K-quants into its int8 activations.
//
// digits = 1: llama.cpp's arithmetic. x ~= d q, d = amax / 127, q = round(x / d): the relative error
//   of an output is about 1e-2.
// digits = 3: exact. x ~= d (q1 + q2 / 128 + q3 / 128^2), each digit the rounding of what the ones
//   before it left (so |q2|, |q3| <= 64), what is left at most d / 2^15: 2.4e-7 of the block's largest
//   value, below float32's rounding of the products it stands for. The digits' integer sums are combined
//   exactly in int32, (s1 * 128 + s2) * 128 + s3 (at most 4 * 63 * 127 * 2^14 < 2^30), then converted once.
// Q4_K's mins and Q6_K's offset of 32 multiply the exact float sums of x's blocks.
//
// Per 64 weights of a row: their integers as 64 unsigned bytes in value order (Q4_K 0..15, Q6_K 0..63);
// vpdpbusd gives 16 int32 lanes, each the sum of 4 products, lanes 0-7 over one 32-value block of x and
// 8-15 over the next; each lane's sum times x's block scale times the weight's group scale, summed in
// float32. Measured against the float kernel (fused_rows) on Sapphire Rapids, 2 threads: see kernel.py.

#if defined(MRG_AVX512) && defined(__AVX512VNNI__)
#define MRG_INT_DOT 1

constexpr int kDigitBase = 128;  // each digit counts what the previous one left, times 128, in steps of d

// Exact (three digits) up to this many rows of x; more take fused_rows, as exact and from here on as
// fast: on Sapphire Rapids (2 threads, Q4_K 2048 x 8192 and 8192 x 2048 from memory) the digits ran
// 1.2-1.35x its speed at one row, the same at 4, 0-10% slower at 8 and 16.
constexpr int64_t kSplitMaxRows = 4;

// How far ahead the weight bytes are prefetched. On Sapphire Rapids (2 threads, every Q4_K and Q6_K
// weight of a Llama-3.1-8B-shaped Q4_K_M file in model order, as a decode step reads them) 1 KB ran a
// step's worth of exact products in 196 ms, 4 KB in 218-227 ms; the same at Llama-3.2-1B's shapes.
constexpr int64_t kIntStreamAhead = 1024;

// x's rows as digits, one record of (digits + 1) * 64 bytes per 64 values: the digits (64 int8 each), then
// the 16 lane scales (float: x's block scale d of the block each lane of a 64-value dot reads) — one
// stream of x for the kernel to read beside the weights'; and the exact float sums of x per 16 and per 32
// values. Every digit is counted in steps of d: the sums come out 128^(digits - 1) times too large and are
// scaled back once per output (powers of two: the same roundings). Steps of d / 128^2 are subnormal for
// blocks of x below about 1e-30 (silu of a large negative gate), and every product with one then took a
// microcode assist: Llama-3.1-8B's random-weight decode ran 25% slower than the float kernel for it.
struct IntRows {
  int64_t K = 0, digits = 1;
  std::vector<int8_t> records;
  std::vector<float> sum16, sum32;
  int64_t record_bytes() const { return (digits + 1) * 64; }
  const int8_t* row(int64_t m) const { return records.data() + m * (K / 64) * record_bytes(); }
};

inline void store_digit(int8_t* out, __m512 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
}

// x's 16 values at p as floats: float32, or bfloat16 widened (exactly).
inline __m512 load_row(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_row(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <typename X>
IntRows int_rows(const X* x, int64_t M, int64_t K, int digits) {
  IntRows r;
  r.K = K, r.digits = digits;
  r.records.resize(static_cast<size_t>(M * (K / 64) * r.record_bytes()));
  r.sum16.resize(static_cast<size_t>(M * K / 16));
  r.sum32.resize(static_cast<size_t>(M * K / 32));
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < K / 32; ++b) {
      const X* v = x + m * K + 32 * b;
      __m512 lo = load_row(v), hi = load_row(v + 16);
      const float s0 = _mm512_reduce_add_ps(lo), s1 = _mm512_reduce_add_ps(hi);
      r.sum16[m * K / 16 + 2 * b] = s0, r.sum16[m * K / 16 + 2 * b + 1] = s1;
      r.sum32[m * K / 32 + b] = s0 + s1;
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
      const float d = amax / 127.f;
      int8_t* record = r.records.data() + (m * (K / 64) + b / 2) * r.record_bytes();
      for (int l = 0; l < 8; ++l) std::memcpy(record + 64 * digits + 4 * (8 * (b % 2) + l), &d, 4);
      const __m512 step = _mm512_set1_ps(d), inverse = _mm512_set1_ps(amax != 0.f ? 127.f / amax : 0.f),
                   base = _mm512_set1_ps(static_cast<float>(kDigitBase));
      for (int j = 0; j < digits; ++j) {
        const __m512 q0 = _mm512_roundscale_ps(_mm512_mul_ps(lo, inverse), _MM_FROUND_TO_NEAREST_INT),
                     q1 = _mm512_roundscale_ps(_mm512_mul_ps(hi, inverse), _MM_FROUND_TO_NEAREST_INT);
        int8_t* out = record + 64 * j + 32 * (b % 2);
        store_digit(out, q0);
        store_digit(out + 16, q1);
        // What is left, rounded once, times 128 (exact): the next digit's steps are d again.
        lo = _mm512_mul_ps(_mm512_fnmadd_ps(q0, step, lo), base);
        hi = _mm512_mul_ps(_mm512_fnmadd_ps(q1, step, hi), base);
      }
    }
  }
  return r;
}

// The 64 integers of values 64 g .. 64 g + 63 of a block, as unsigned bytes in value order; the float
// scale of each lane's group (16 lanes of 4 values); the float corrections of one row of x.
struct IntQ4K {
  using F = Q4K;
  __m512 scale;  // d * sc of the eight sub-blocks in lanes 0-7
  __m256 min;    // dmin * m
  void prepare(const uint8_t* b) {
    uint32_t u[4];
    k_scale_bytes(b + 4, u);
    uint32_t d_dmin;
    std::memcpy(&d_dmin, b, 4);
    const __m128 both = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int32_t>(d_dmin)));  // d, dmin
    const auto floats = [](uint32_t lo, uint32_t hi) {
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(lo | uint64_t(hi) << 32))));
    };
    scale = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_broadcastss_ps(both), floats(u[0], u[1])));
    min = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(both)), floats(u[2], u[3]));
  }
  static __m512i weights(const uint8_t* b, int g) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * g));
    return _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1),
                            _mm512_set1_epi8(15));
  }
  __m512 lane_scales(int g) const {  // sub-block 2g in lanes 0-7, 2g + 1 in 8-15
    const __m512i index = _mm512_set_epi32(2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1,
                                           2 * g + 1, 2 * g, 2 * g, 2 * g, 2 * g, 2 * g, 2 * g, 2 * g, 2 * g);
    return _mm512_permutexvar_ps(index, scale);
  }
  // What the block adds to an output besides the products (subtracted): sum_j dmin m_j sum(x over
  // sub-block j), from the row's sums of 32 values of this block on.
  static constexpr int64_t kSumWidth = 32;
  __m512 correction(const float* sums) const {
    return _mm512_zextps256_ps512(_mm256_mul_ps(min, _mm256_loadu_ps(sums)));
  }
};

struct IntQ6K {
  using F = Q6K;
  __m512 scale;  // d * sc of the sixteen groups of 16
  void prepare(const uint8_t* b) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    uint16_t d;
    std::memcpy(&d, b + 208, 2);
    scale = _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(d)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
  }
  // Values 128 h + 64 p ..: low (p = 0) or high (p = 1) nibbles of the half's 64 bytes ql, and from its 32
  // bytes qh the bit pair 2 (2 p + s) for values 128 h + 64 p + 32 s + l.
  static __m512i weights(const uint8_t* b, int g) {
    const int h = g >> 1, p = g & 1;
    const __m512i ql = _mm512_loadu_si512(b + 64 * h);
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h)));
    const __m512i low4 = _mm512_set1_epi8(15), pair = _mm512_set1_epi8(0x30);
    // words 0-15 (bytes 0-31) and 16-31 (bytes 32-63): the pair for s = 0 and s = 1 moved to bits 4-5
    if (p == 0) {
      const __m512i counts = _mm512_set_epi64(0x0002000200020002, 0x0002000200020002, 0x0002000200020002,
                                              0x0002000200020002, 0x0004000400040004, 0x0004000400040004,
                                              0x0004000400040004, 0x0004000400040004);
      return _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_and_si512(_mm512_sllv_epi16(qh, counts), pair));
    }
    const __m512i counts = _mm512_set_epi64(0x0002000200020002, 0x0002000200020002, 0x0002000200020002,
                                            0x0002000200020002, 0, 0, 0, 0);
    return _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                           _mm512_and_si512(_mm512_srlv_epi16(qh, counts), pair));
  }
  __m512 lane_scales(int g) const {  // groups 4 g .. 4 g + 3, four lanes each
    const __m512i index = _mm512_set_epi32(4 * g + 3, 4 * g + 3, 4 * g + 3, 4 * g + 3, 4 * g + 2, 4 * g + 2, 4 * g + 2,
                                           4 * g + 2, 4 * g + 1, 4 * g + 1, 4 * g + 1, 4 * g + 1, 4 * g, 4 * g, 4 * g, 4 * g);
    return _mm512_permutexvar_ps(index, scale);
  }
  // 32 sum_i d sc_i sum(x over group i), from the row's sums of 16 values of this block on (subtracted).
  static constexpr int64_t kSumWidth = 16;
  __m512 correction(const float* sums) const {
    return _mm512_mul_ps(_mm512_set1_ps(32.f), _mm512_mul_ps(scale, _mm512_loadu_ps(sums)));
  }
};

template <typename Fmt>
struct IntFormat;
template <>
struct IntFormat<Q4K> {
  using T = IntQ4K;
};
template <>
struct IntFormat<Q6K> {
  using T = IntQ6K;
};

// The 16 lanes' integer sums of w times one record's digits, combined exactly ((s1 * 128 + s2) * 128 + s3).
template <int D>
inline __m512i int_dot(__m512i w, const int8_t* record) {
  __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(record));
  for (int j = 1; j < D; ++j)
    s = _mm512_dpbusd_epi32(_mm512_slli_epi32(s, 7), w, _mm512_loadu_si512(record + 64 * j));
  return s;
}

// One weight row times MT rows of x (from row m0), over all of K. Each row's pointers advance with
// the blocks (indexing computed per vector cost as much as the arithmetic).
template <typename Fmt, int D, int MT>
void int_tile(const GgmlWeight& w, int64_t n, const IntRows& r, int64_t m0, float* y, int64_t ldy) {
  using T = typename IntFormat<Fmt>::T;
  constexpr int P = MT >= 2 ? 2 : 4;
  constexpr int64_t kRecord = (D + 1) * 64;
  constexpr float kUnscale = D == 1 ? 1.f : D == 2 ? 1.f / kDigitBase : 1.f / (kDigitBase * kDigitBase);
  static_assert(D <= 3);
  const uint8_t* b = w.row(n);
  const int8_t* xr[MT];
  const float* sums[MT];
  __m512 acc[MT][P], fix[MT];
  for (int i = 0; i < MT; ++i) {
    xr[i] = r.row(m0 + i);
    sums[i] = (T::kSumWidth == 16 ? r.sum16.data() : r.sum32.data()) + (m0 + i) * (r.K / T::kSumWidth);
    fix[i] = _mm512_setzero_ps();
    for (int p = 0; p < P; ++p) acc[i][p] = _mm512_setzero_ps();
  }
  T scales;
  for (int64_t blk = 0; blk < w.blocks; ++blk, b += Fmt::kBytes) {
    prefetch(b + kIntStreamAhead);
    prefetch(b + kIntStreamAhead + 64);
    prefetch(b + kIntStreamAhead + 128);
    if constexpr (Fmt::kBytes > 192) prefetch(b + kIntStreamAhead + 192);
    scales.prepare(b);
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      const __m512i wv = T::weights(b, g);
      const __m512 ws = scales.lane_scales(g);
#pragma GCC unroll 4
      for (int i = 0; i < MT; ++i) {
        const int8_t* record = xr[i] + kRecord * g;
        const __m512 xs = _mm512_loadu_ps(reinterpret_cast<const float*>(record + 64 * D));
        acc[i][g % P] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(int_dot<D>(wv, record)), xs), ws,
                                        acc[i][g % P]);
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MT; ++i) {
      fix[i] = _mm512_add_ps(fix[i], scales.correction(sums[i]));
      xr[i] += 4 * kRecord, sums[i] += 256 / T::kSumWidth;
    }
  }
  for (int i = 0; i < MT; ++i) {
    __m512 sum = acc[i][0];
    for (int p = 1; p < P; ++p) sum = _mm512_add_ps(sum, acc[i][p]);
    y[i * ldy] = _mm512_reduce_add_ps(sum) * kUnscale - _mm512_reduce_add_ps(fix[i]);
  }
}

// Rows [n0, n1) of y for all M rows of x, in slices that stay in L2 while every tile of x rows passes
// (as fused_rows).
template <typename F, int D>
void int_rows_of(const GgmlWeight& w, const IntRows& r, int64_t M, float* y, int64_t n0, int64_t n1) {
  constexpr int64_t kSliceBytes = 128 << 10;
  const int64_t slice = std::max<int64_t>(16, kSliceBytes / w.row_bytes);
  const int64_t tiles = (M + kMaxRows - 1) / kMaxRows;
  for (int64_t s0 = n0; s0 < n1; s0 += slice) {
    const int64_t s1 = std::min(n1, s0 + slice);
    for (int64_t i = 0, m0 = 0; i < tiles; ++i) {
      const int64_t mt = (M - m0 + (tiles - i) - 1) / (tiles - i);
      with_rows(mt, [&]<int MT>() {
        for (int64_t n = s0; n < s1; ++n) int_tile<F, D, MT>(w, n, r, m0, y + m0 * w.rows + n, w.rows);
      });
      m0 += mt;
    }
  }
}

template <typename Visit>
bool with_int_format(int64_t type, Visit&& visit) {
  switch (type) {
    case Q4K::kType: visit.template operator()<Q4K>(); return true;
    case Q6K::kType: visit.template operator()<Q6K>(); return true;
    default: return false;
  }
}
#endif  // MRG_INT_DOT

// ---------------------------------------------------------------------------------------------
// Operators.

at::Tensor ggml_qlinear(const at::Tensor& x, const at::Tensor& blocks, int64_t ggml_type, int64_t gemm_rows) {
  at::Tensor y;
  const bool known = with_format(ggml_type, [&]<typename F>() {
    const GgmlWeight w = check_blocks<F>(blocks);
    check_input<F>(x, w);
    const int64_t M = x.size(0);
    y = at::empty({M, w.rows}, x.options());
    if (M == 0 || w.rows == 0) return;
    if (M > gemm_rows) {
      gemm_rows_dequantized<F>(w, x, y);
      return;
    }
    const float* xp = x.const_data_ptr<float>();
    float* yp = y.data_ptr<float>();
    parallel_rows(w.rows, static_cast<double>(w.cols * M),
                  [&](int64_t n0, int64_t n1) { fused_rows<F>(w, xp, M, yp, n0, n1); });
  });
  if (!known) refuse_type(ggml_type);
  return y;
}

at::Tensor ggml_dequantize(const at::Tensor& blocks, int64_t ggml_type) {
  at::Tensor out;
  const bool known = with_format(ggml_type, [&]<typename F>() {
    const GgmlWeight w = check_blocks<F>(blocks);
    out = at::empty({w.rows, w.cols}, blocks.options().dtype(at::kFloat));
    float* o = out.data_ptr<float>();
    parallel_rows(w.rows, static_cast<double>(w.cols),
                  [&](int64_t n0, int64_t n1) { dequantize_rows<F>(w, n0, n1, o + n0 * w.cols); });
  });
  if (!known) refuse_type(ggml_type);
  return out;
}

// x (bfloat16 [M, K]) times the blocks' weights rounded to bfloat16, in bfloat16 [M, N]; gemm_rows < 0:
// kBF16GemmRows.
at::Tensor ggml_linear_bf16(const at::Tensor& x, const at::Tensor& blocks, int64_t ggml_type, int64_t gemm_rows) {
  at::Tensor y;
  const bool known = with_format(ggml_type, [&]<typename F>() {
    const GgmlWeight w = check_blocks<F>(blocks);
    check_input<F>(x, w, at::kBFloat16);
    const int64_t M = x.size(0);
    if (gemm_rows < 0) gemm_rows = kBF16GemmRows;
    y = at::empty({M, w.rows}, x.options());
    if (M == 0 || w.rows == 0) return;
    if (M > gemm_rows) {
      gemm_rows_bf16<F>(w, x, y);
      return;
    }
    const at::Tensor xf = x.to(at::kFloat);
    at::Tensor yf = at::empty({M, w.rows}, xf.options());
    const float* xp = xf.const_data_ptr<float>();
    float* yp = yf.data_ptr<float>();
    parallel_rows(w.rows, static_cast<double>(w.cols * M),
                  [&](int64_t n0, int64_t n1) { fused_rows<RoundedBF16<F>>(w, xp, M, yp, n0, n1); });
    y.copy_(yf);
  });
  if (!known) refuse_type(ggml_type);
  return y;
}

// x (float32 or bfloat16 [M, K]) times the blocks through integer dot products (the section above):
// digits 1 (llama.cpp's int8 activations) or 3 (exact); the result in x's dtype (bfloat16: the float32
// sums rounded once). More rows than gemm_rows: gemm_rows_dequantized; exact and more than
// kSplitMaxRows: fused_rows (both in float32).
at::Tensor ggml_qlinear_int(const at::Tensor& x, const at::Tensor& blocks, int64_t ggml_type, int64_t digits,
                            int64_t gemm_rows) {
  TORCH_CHECK_VALUE(digits == 1 || digits == 3, "digits must be 1 (int8 activations) or 3 (exact), got ", digits);
  at::Tensor y;
  bool known = false;
#ifdef MRG_INT_DOT
  known = with_int_format(ggml_type, [&]<typename F>() {
    const GgmlWeight w = check_blocks<F>(blocks);
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    check_input<F>(x, w, bf16 ? at::kBFloat16 : at::kFloat);
    const int64_t M = x.size(0);
    at::Tensor yf = at::empty({M, w.rows}, x.options().dtype(at::kFloat));
    if (M > 0 && w.rows > 0 && M > gemm_rows) {
      gemm_rows_dequantized<F>(w, bf16 ? x.to(at::kFloat) : x, yf);
    } else if (M > 0 && w.rows > 0 && digits == 3 && M > kSplitMaxRows) {
      const at::Tensor xf = bf16 ? x.to(at::kFloat) : x;
      const float* xp = xf.const_data_ptr<float>();
      float* yp = yf.data_ptr<float>();
      parallel_rows(w.rows, static_cast<double>(w.cols * M),
                    [&](int64_t n0, int64_t n1) { fused_rows<F>(w, xp, M, yp, n0, n1); });
    } else if (M > 0 && w.rows > 0) {
      const IntRows r = bf16 ? int_rows(x.const_data_ptr<at::BFloat16>(), M, w.cols, static_cast<int>(digits))
                             : int_rows(x.const_data_ptr<float>(), M, w.cols, static_cast<int>(digits));
      float* yp = yf.data_ptr<float>();
      parallel_rows(w.rows, static_cast<double>(w.cols * M), [&](int64_t n0, int64_t n1) {
        digits == 1 ? int_rows_of<F, 1>(w, r, M, yp, n0, n1) : int_rows_of<F, 3>(w, r, M, yp, n0, n1);
      });
    }
    y = bf16 ? yf.to(at::kBFloat16) : yf;
  });
#endif
  TORCH_CHECK_VALUE(known, "ggml type ", ggml_type, " has no integer-dot kernel in this build (the AVX-512 VNNI ",
                    "build runs Q4_K (12) and Q6_K (14))");
  return y;
}

bool ggml_int_supported(int64_t ggml_type) {
#ifdef MRG_INT_DOT
  return with_int_format(ggml_type, []<typename F>() {});
#else
  (void)ggml_type;
  return false;
#endif
}

bool ggml_supported(int64_t ggml_type) {
  return with_format(ggml_type, []<typename F>() {});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(modelrunner_quant_cpu, m) {
  m.def("ggml_qlinear(Tensor x, Tensor blocks, int ggml_type, int gemm_rows) -> Tensor");
  m.def("ggml_dequantize(Tensor blocks, int ggml_type) -> Tensor");
  m.def("ggml_supported(int ggml_type) -> bool");
  m.def("ggml_linear_bf16(Tensor x, Tensor blocks, int ggml_type, int gemm_rows=-1) -> Tensor");
  m.def("ggml_qlinear_int(Tensor x, Tensor blocks, int ggml_type, int digits, int gemm_rows) -> Tensor");
  m.def("ggml_int_supported(int ggml_type) -> bool");
}

TORCH_LIBRARY_IMPL(modelrunner_quant_cpu, CPU, m) {
  m.impl("ggml_qlinear", &ggml_qlinear);
  m.impl("ggml_dequantize", &ggml_dequantize);
  m.impl("ggml_linear_bf16", &ggml_linear_bf16);
  m.impl("ggml_qlinear_int", &ggml_qlinear_int);
}

// ggml_supported takes no tensor, so it has no dispatch key to route by: registered for every backend.
TORCH_LIBRARY_IMPL(modelrunner_quant_cpu, CompositeExplicitAutograd, m) {
  m.impl("ggml_supported", &ggml_supported);
  m.impl("ggml_int_supported", &ggml_int_supported);
}
