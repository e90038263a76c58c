/* The e4m3 block codec in C, for native optimizer kernels over FP8 moments (fp8.py: C_CODEC;
   adam_kernel.c includes it). The formulas are fp8.py's encode/decode and quantize_blocks, bit
   for bit: dec/enc one code at a time, dec_block/enc_block a block of B codes with one fp32
   scale. Written with intrinsics where the CPU has AVX-512 (E4M3_AVX512, which also gives dec16
   to a kernel that fuses the decode into its own loop) or AVX2+F16C (the compiler scalarizes a
   _Float16 conversion), and as portable loops elsewhere (tested against each other). B is a
   multiple of 8: the AVX2 decode takes 8 codes a step with no tail loop. */

#ifndef NANOCHAT_E4M3_H
#define NANOCHAT_E4M3_H

#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float dec(uint32_t u) {            /* e4m3fn bits -> float (fp8.py: decode) */
    uint32_t mag = u & 0x7Fu;
    uint32_t bits = ((mag << 20) + (120u << 23)) | ((u & 0x80u) << 24);
    float normal; memcpy(&normal, &bits, 4);
    float sub = (float)mag * 0.001953125f;        /* subnormal: mantissa * 2^-9 */
    sub = (u & 0x80u) ? -sub : sub;
    return mag < 8u ? sub : normal;
}

static inline uint32_t enc(float y) {             /* float -> e4m3fn bits, RNE, saturating (encode) */
    uint32_t bits; memcpy(&bits, &y, 4);
    uint32_t sign = (bits >> 24) & 0x80u;
    uint32_t a = bits & 0x7FFFFFFFu;
    a = a < 0x43E00000u ? a : 0x43E00000u;          /* |y| <= 448 (saturate) */
    /* round to 3 mantissa bits by the FPU: adding c = 2^(e+20) leaves ulp 2^(e-3), and for
       |y| < 2^-6 c = 2^14 leaves e4m3's subnormal step 2^-9 (bit-identical to the integer
       rounding of fp8.py's encode on every finite float, checked exhaustively) */
    uint32_t cb = (a & 0x7F800000u) + (20u << 23);
    cb = cb > (141u << 23) ? cb : (141u << 23);
    float ay, c; memcpy(&ay, &a, 4); memcpy(&c, &cb, 4);
    float r = (ay + c) - c;
    uint32_t rb; memcpy(&rb, &r, 4);
    int32_t normal = (int32_t)(rb >> 20) - (120 << 3);
    int32_t sub = (int32_t)(r * 512.0f);              /* r < 2^-6: exactly k * 2^-9, k < 8 */
    int32_t mag = rb < (121u << 23) ? sub : normal;
    return (uint32_t)mag | sign;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define E4M3_AVX512 1
/* AVX-512, 16 elements a step. Decode as the F16C version below (the codes' magnitude bits
   placed as fp16 bits, converted by vcvtph2ps). Encode by integer rounding of the float bits,
   which mask registers make cheap here: 3 mantissa bits kept with round-to-nearest-even
   (a + 0x7FFFF + lsb, then >> 20), the exponent rebiased from 127 to 7; below 2^-6 the
   subnormal code is round(|y| * 2^9) by vcvtps2dq; saturating at 448 (0x43E00000). Equal to
   enc() on every float (checked exhaustively); a tail of B % 16 elements goes through enc(). */
static inline __m512 dec16(const uint8_t *restrict c, __m512 sc256) {  /* sc256 = scale * 2^8 */
    const __m256i m80 = _mm256_set1_epi16(0x80);
    __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)c));
    /* (u + (u & 0x80)) << 7 = (magnitude << 7) | (sign << 15): adding the sign bit to itself
       carries it one place up, where fp16 keeps its sign */
    __m256i h = _mm256_slli_epi16(_mm256_add_epi16(u, _mm256_and_si256(u, m80)), 7);
    return _mm512_mul_ps(_mm512_cvtph_ps(h), sc256);
}

static inline void dec_block(const uint8_t *restrict c, float *restrict out, int64_t B, float s) {
    const __m512 sc = _mm512_set1_ps(s * 256.0f);
    int64_t i = 0;
    for (; i + 16 <= B; i += 16) _mm512_storeu_ps(out + i, dec16(c + i, sc));
    for (; i < B; ++i) out[i] = dec(c[i]) * s;
}

static inline void enc_block(const float *restrict in, float s, uint8_t *restrict out, int64_t B, int floor1) {
    const __m512 sc = _mm512_set1_ps(s), k512 = _mm512_set1_ps(512.0f), zero = _mm512_setzero_ps();
    const __m512i absm = _mm512_set1_epi32(0x7FFFFFFF), lim = _mm512_set1_epi32(0x43E00000);
    /* rounding offset 0x7FFFF with the exponent rebias folded in: (a + this + lsb) >> 20 is the
       normal code directly (the subnormal lanes, where it is garbage, are blended away) */
    const __m512i half = _mm512_set1_epi32(0x7FFFF - (120 << 23)), one = _mm512_set1_epi32(1);
    const __m512i min_normal = _mm512_set1_epi32(121 << 23), m80 = _mm512_set1_epi32(0x80);
    int64_t i = 0;
    for (; i + 16 <= B; i += 16) {
        __m512 x = _mm512_loadu_ps(in + i);
        __m512i yb = _mm512_castps_si512(_mm512_mul_ps(x, sc));
        __m512i a = _mm512_min_epu32(_mm512_and_si512(yb, absm), lim);
        __m512i t = _mm512_add_epi32(_mm512_add_epi32(a, half), _mm512_and_si512(_mm512_srli_epi32(a, 20), one));
        __m512i normal = _mm512_srli_epi32(t, 20);
        __m512i sub = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(a), k512));
        __m512i mag = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(a, min_normal), normal, sub);
        if (floor1) mag = _mm512_mask_max_epu32(mag, _mm512_cmp_ps_mask(x, zero, _CMP_GT_OQ), mag, one);
        /* code = mag | ((yb >> 24) & 0x80) in one ternary-logic op (A | (B & C): 0xF8) */
        __m512i code = _mm512_ternarylogic_epi32(mag, _mm512_srli_epi32(yb, 24), m80, 0xF8);
        _mm_storeu_si128((__m128i *)(out + i), _mm512_cvtepi32_epi8(code));
    }
    for (; i < B; ++i) {
        uint32_t q = enc(in[i] * s);
        out[i] = (uint8_t)((floor1 && in[i] > 0.0f && q == 0u) ? 1u : q);
    }
}
#elif defined(__F16C__) && defined(__AVX2__)
#include <immintrin.h>
/* e4m3fn codes -> floats * s, 8 at a time: the 7 magnitude bits placed as fp16 bits (exponent
   bias 15 instead of 7, so the value is 2^-8 of the e4m3 one; fp16 subnormals are exactly e4m3's
   subnormals) and converted by F16C's vcvtph2ps; s carries the 2^8. Exact, and ~4x fewer
   instructions than dec() (the compiler does not vectorize a _Float16 conversion by itself). */
static inline void dec_block(const uint8_t *restrict c, float *restrict out, int64_t B, float s) {
    const __m128i m80 = _mm_set1_epi16(0x80);
    const __m256 sc = _mm256_set1_ps(s * 256.0f);
    for (int64_t i = 0; i < B; i += 8) {             /* B is a multiple of 8 (E4M3Blocks checks) */
        __m128i u = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(c + i)));
        /* (u + (u & 0x80)) << 7 = (magnitude << 7) | (sign << 15), as dec16 above */
        __m128i h = _mm_slli_epi16(_mm_add_epi16(u, _mm_and_si128(u, m80)), 7);
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtph_ps(h), sc));
    }
}
/* floats * s -> e4m3fn codes, 16 at a time: |y| saturated at 448 and rounded to 3 mantissa
   bits by enc()'s FPU trick, the sign put back, scaled by 2^-8 and converted to fp16 by
   vcvtps2ph (exact: at most 3 mantissa bits, and e4m3's range scaled lands inside fp16's); the
   fp16 bits shifted right by 7 are the e4m3 magnitude bits, subnormals included. floor1: a
   positive input never becomes code 0 (the second moment's rule). Equal to enc() on every
   finite float (checked exhaustively); a tail of B % 16 elements goes through enc(). */
static inline void enc_block(const float *restrict in, float s, uint8_t *restrict out, int64_t B, int floor1) {
    const __m256 sc = _mm256_set1_ps(s), lim = _mm256_set1_ps(448.0f), down = _mm256_set1_ps(0.00390625f);
    const __m256 tiny = _mm256_set1_ps(0.001953125f), zero = _mm256_setzero_ps();
    const __m256i expm = _mm256_set1_epi32(0x7F800000), add20 = _mm256_set1_epi32(20 << 23);
    const __m256i c14 = _mm256_set1_epi32(141 << 23), absm = _mm256_set1_epi32(0x7FFFFFFF);
    const __m128i m7f = _mm_set1_epi16(0x7F), m80 = _mm_set1_epi16(0x80);
    int64_t i = 0;
    for (; i + 16 <= B; i += 16) {
        __m128i q[2];
        for (int k = 0; k < 2; ++k) {
            __m256 x = _mm256_loadu_ps(in + i + 8 * k), y = _mm256_mul_ps(x, sc);
            __m256i yb = _mm256_castps_si256(y);
            __m256 a = _mm256_min_ps(_mm256_castsi256_ps(_mm256_and_si256(yb, absm)), lim);
            __m256i cb = _mm256_max_epi32(_mm256_add_epi32(_mm256_and_si256(_mm256_castps_si256(a), expm), add20), c14);
            __m256 c = _mm256_castsi256_ps(cb);
            __m256 r = _mm256_sub_ps(_mm256_add_ps(a, c), c);
            if (floor1) r = _mm256_blendv_ps(r, _mm256_max_ps(r, tiny), _mm256_cmp_ps(x, zero, _CMP_GT_OQ));
            r = _mm256_or_ps(r, _mm256_castsi256_ps(_mm256_andnot_si256(absm, yb)));  /* sign back */
            __m128i h = _mm256_cvtps_ph(_mm256_mul_ps(r, down), _MM_FROUND_TO_NEAREST_INT);
            q[k] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(h, 7), m7f), _mm_and_si128(_mm_srli_epi16(h, 8), m80));
        }
        _mm_storeu_si128((__m128i *)(out + i), _mm_packus_epi16(q[0], q[1]));
    }
    for (; i < B; ++i) {
        uint32_t q = enc(in[i] * s);
        out[i] = (uint8_t)((floor1 && in[i] > 0.0f && q == 0u) ? 1u : q);
    }
}
#else
static inline void dec_block(const uint8_t *restrict c, float *restrict out, int64_t B, float s) {
    for (int64_t i = 0; i < B; ++i) out[i] = dec(c[i]) * s;
}

static inline void enc_block(const float *restrict in, float s, uint8_t *restrict out, int64_t B, int floor1) {
    _Pragma("omp simd")
    for (int64_t i = 0; i < B; ++i) {
        uint32_t q = enc(in[i] * s);
        out[i] = (uint8_t)((floor1 && in[i] > 0.0f && q == 0u) ? 1u : q);
    }
}
#endif

#ifndef E4M3_AVX512
#define E4M3_AVX512 0
#endif

#endif
