// bfloat16 rounding shared by the plugin's libraries (quant_matmul.cpp, ggml_matmul.cpp); include it after
// <immintrin.h>. round_bf16 rounds each float to bfloat16's 8 significant bits, to nearest, ties to even,
// as torch rounds (c10::BFloat16), and leaves it a float. No build's flags include AVX512-BF16 (whose
// vcvtneps2bf16 would do it), so it rounds in float arithmetic: adding m = ±2^(e + 16), e the exponent of
// v and the sign its own, leaves in the sum v's bits down to 2^(e - 7), bfloat16's last one, rounded to
// nearest even by the addition itself; subtracting m is exact. Five instructions with the sign of a zero
// put back, where the integer way (add 0x7fff and the last bit kept) takes seven with its test for NaN;
// NaN and infinity pass through. Exact for every normal float below 2^112 (m stays finite): dequantized
// weights, products of float16 or small float32 scales and small integers (plus mins), are.
// store_bf16 stores the bfloat16 bits of rounded floats (their high halves).
#pragma once

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512 round_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v), sign = _mm512_set1_epi32(static_cast<int>(0x80000000));
  const __m512i exponent = _mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xff800000)));
  const __m512 m = _mm512_castsi512_ps(_mm512_add_epi32(exponent, _mm512_set1_epi32(16 << 23)));
  const __m512i rounded = _mm512_castps_si512(_mm512_sub_ps(_mm512_add_ps(v, m), m));
  return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(rounded, bits, sign, 0xf8));  // rounded | (bits & sign)
}
// One word permute (vpmovdw would take two shuffles, and a shift before them).
inline void store_bf16(uint16_t* p, __m512 rounded) {
  const __m512i high = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27,
                                        25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  const __m512i words = _mm512_permutexvar_epi16(high, _mm512_castps_si512(rounded));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_castsi512_si256(words));
}
#endif
#if defined(__AVX2__)
inline __m256 round_bf16(__m256 v) {
  const __m256i exponent = _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(static_cast<int>(0xff800000)));
  const __m256 m = _mm256_castsi256_ps(_mm256_add_epi32(exponent, _mm256_set1_epi32(16 << 23)));
  return _mm256_or_ps(_mm256_sub_ps(_mm256_add_ps(v, m), m), _mm256_and_ps(v, _mm256_set1_ps(-0.f)));
}
inline void store_bf16(uint16_t* p, __m256 rounded) {
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
  // packus packs within 128-bit lanes, words [0..3, 0..3 | 4..7, 4..7]: quadwords 0 and 2 are in order.
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(words));
}
#endif
