/* FP8Optim's Adam(W) step on CPU (kernel.py builds it with the system C compiler, -O3
   -march=native, and calls it through ctypes). The formulas and bit tricks are those of
   nanochat/optim/step.py's adam_step with optim.py's E4M3Blocks, and of tensor.py's
   encode/decode; results agree to fp32 rounding.

   One 256-element block at a time, so the block stays in L1: decode both moments, one loop
   updates p and the moments and collects the absmax, then encode. The loops are
   auto-vectorized (-fno-trapping-math lets the compiler if-convert the selects); decode and
   encode are written with intrinsics where the CPU has AVX-512 or AVX2+F16C (the compiler
   scalarizes a _Float16 conversion), and as portable loops elsewhere (tested against each
   other). No torch headers, so it builds quickly.

   Parameters and gradients are fp32, or bf16 with a bf16 master-weight mode
   (nanochat/optim/master.py: round to nearest even, stochastic rounding with its counter-based
   bits, or the fp32 master split into the bf16 p and an int16 remainder): the fp32 master is
   read, stepped by the same fp32 code and written back per mode, so only the write differs. A per-tensor guard byte, read
   here at step time, can leave a tensor untouched (p, remainder, moments and scales). */

#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float dec(uint32_t u) {            /* e4m3fn bits -> float (tensor.py: decode) */
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
       rounding of tensor.py's encode on every finite float, checked exhaustively) */
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

/* The block loop of DEFINE_ADAM below with the decode inside it (no decoded copy of the moments
   written and read back), 16 elements a step; B % 16 == 0. Same operations in the same order. */
#define HAVE_UPDATE16 1
static inline __attribute__((always_inline)) void update16(
        float *restrict pp, const float *restrict gg, const uint8_t *restrict mcb, float msb,
        const uint8_t *restrict vcb, float vsb, float *restrict vv, float *restrict mbuf, float *restrict rbuf,
        int64_t B, const float *h, float ibc2, int dec_wd, int vfp8, float *am_out, float *ar_out) {
    const __m512 beta2 = _mm512_set1_ps(h[2]), eps = _mm512_set1_ps(h[3]), wd = _mm512_set1_ps(h[4]);
    const __m512 step_size = _mm512_set1_ps(h[5]), w1 = _mm512_set1_ps(h[7]), w2 = _mm512_set1_ps(h[8]);
    const __m512 decay = _mm512_set1_ps(h[9]), ib = _mm512_set1_ps(ibc2);
    const __m512 msc = _mm512_set1_ps(msb * 256.0f), vsc = _mm512_set1_ps(vsb * 256.0f);
    __m512 am = _mm512_setzero_ps(), ar = _mm512_setzero_ps();
    for (int64_t i = 0; i < B; i += 16) {
        __m512 pi = _mm512_loadu_ps(pp + i), gi = _mm512_loadu_ps(gg + i);
        if (!dec_wd) gi = _mm512_fmadd_ps(wd, pi, gi);
        __m512 mi = dec16(mcb + i, msc);
        mi = _mm512_fmadd_ps(w1, _mm512_sub_ps(gi, mi), mi);
        __m512 g2 = _mm512_mul_ps(w2, _mm512_mul_ps(gi, gi)), v;
        if (vfp8) {
            __m512 r0 = dec16(vcb + i, vsc);
            v = _mm512_fmadd_ps(_mm512_mul_ps(r0, r0), beta2, g2);
        } else {
            v = _mm512_fmadd_ps(_mm512_loadu_ps(vv + i), beta2, g2);
            _mm512_storeu_ps(vv + i, v);
        }
        __m512 ri = _mm512_sqrt_ps(v);
        if (dec_wd) pi = _mm512_mul_ps(pi, decay);
        __m512 upd = _mm512_div_ps(_mm512_mul_ps(step_size, mi), _mm512_fmadd_ps(ri, ib, eps));
        _mm512_storeu_ps(pp + i, _mm512_sub_ps(pi, upd));
        _mm512_storeu_ps(mbuf + i, mi);
        am = _mm512_max_ps(_mm512_abs_ps(mi), am);  /* a NaN keeps am, as the scalar loop */
        if (vfp8) {
            _mm512_storeu_ps(rbuf + i, ri);
            ar = _mm512_max_ps(ri, ar);
        }
    }
    *am_out = _mm512_reduce_max_ps(am);
    *ar_out = vfp8 ? _mm512_reduce_max_ps(ar) : 0.0f;
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
    for (int64_t i = 0; i < B; i += 8) {             /* B is a multiple of 8 (FP8Optim checks) */
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

#ifndef HAVE_UPDATE16
#define HAVE_UPDATE16 0
static inline void update16(float *pp, const float *gg, const uint8_t *mcb, float msb, const uint8_t *vcb,
                            float vsb, float *vv, float *mbuf, float *rbuf, int64_t B, const float *h,
                            float ibc2, int dec_wd, int vfp8, float *am_out, float *ar_out) {}
#endif

/* bf16 master weights (master.py). The parameter and its gradient are bf16; the fp32 master is
   the bf16 bits << 16 (bf16_split: | the int16 remainder `lo`), the update is the fp32 one
   above, and only the write differs: round to nearest even, stochastic rounding with
   master.py's counter-based bits (sr_bits), or the top half to p and the bottom half to lo. */
enum { M_FP32, M_BF16, M_SR, M_SPLIT };

static inline uint32_t mix32(uint32_t x) {       /* master.py: mix32 (arithmetic mod 2^32) */
    x = (x ^ (x >> 16)) * 0x45D9F3Bu;
    x = (x ^ (x >> 16)) * 0x45D9F3Bu;
    return x ^ (x >> 16);
}

static inline float from_bf16(uint16_t hi, uint16_t lo) {
    uint32_t u = ((uint32_t)hi << 16) | lo;
    float f; memcpy(&f, &u, 4);
    return f;
}

/* fp32 -> bf16 bits: the top half after adding `add` (0x7FFF + the kept lsb for round to
   nearest even, 16 random bits for stochastic rounding; master.py: round_sr); a NaN stays a
   (quiet) NaN instead of carrying into the exponent or the sign */
static inline uint16_t to_bf16(uint32_t u, uint32_t add) {
    uint32_t r = (u + add) >> 16;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? (u >> 16) | 0x40u : r);
}

#define BMAX 1024
/* h = lr, beta1, beta2, eps, wd, step_size, bias_correction2_sqrt, 1 - beta1, 1 - beta2,
   1 - lr * wd, step (NH values; the differences computed in double by the caller, as torch does
   in Python, since 1 - (float)0.999 is 1.3e-5 off; the step, after this step's increment, only
   keys the stochastic rounding). One function per (decoupled weight decay, v in FP8, master
   mode) so the inner loops carry no branches; `key` = mix32(salt + step) under bf16_sr. The
   bf16 modes widen the block's p and g into fp32 buffers, step them with the fp32 code
   (update16 included) and narrow p back: three short loops over L1, measured faster than
   converting inside the update loop (which then no longer fits the registers as well). */
#define NH 11
#define DEFINE_ADAM(NAME, DEC, VFP8, MODE) \
static void NAME(void *p, const void *g, uint8_t *restrict mc, float *restrict ms, \
                 uint8_t *restrict vc, float *restrict vs, float *restrict v32, uint16_t *lo, \
                 const float *h, uint32_t key, int64_t b0, int64_t b1, int64_t B) { \
    const float lr = h[0], beta1 = h[1], beta2 = h[2], eps = h[3], wd = h[4], step_size = h[5], bc2 = h[6]; \
    const float w1 = h[7], w2 = h[8], decay = h[9], ibc2 = 1.0f / bc2; (void)lr; (void)beta1; (void)key; \
    float mbuf[BMAX], rbuf[BMAX], pbuf[MODE == M_FP32 ? 1 : BMAX], gbuf[MODE == M_FP32 ? 1 : BMAX]; \
    for (int64_t b = b0; b < b1; ++b) { \
        uint16_t *restrict ph = MODE != M_FP32 ? (uint16_t *)p + b * B : 0; \
        const uint16_t *restrict gh = MODE != M_FP32 ? (const uint16_t *)g + b * B : 0; \
        uint16_t *restrict ll = MODE == M_SPLIT ? lo + b * B : 0; \
        /* bf16 modes: the block's fp32 master and gradient into L1 buffers, stepped by the fp32 \
           code below (the same operations: bf16_split is the fp32 step bit for bit) */ \
        float *restrict pp = MODE == M_FP32 ? (float *)p + b * B : pbuf; \
        const float *restrict gg = MODE == M_FP32 ? (const float *)g + b * B : gbuf; \
        if (MODE != M_FP32) { \
            _Pragma("omp simd") \
            for (int64_t i = 0; i < B; ++i) { \
                pbuf[i] = from_bf16(ph[i], MODE == M_SPLIT ? ll[i] : 0); gbuf[i] = from_bf16(gh[i], 0); \
            } \
        } \
        uint8_t *restrict mcb = mc + b * B; \
        uint8_t *restrict vcb = VFP8 ? vc + b * B : 0; float *restrict vv = VFP8 ? 0 : v32 + b * B; \
        float am = 0.0f, ar = 0.0f; \
        if (HAVE_UPDATE16 && B % 16 == 0) \
            update16(pp, gg, mcb, ms[b], vcb, VFP8 ? vs[b] : 0.0f, vv, mbuf, rbuf, B, h, ibc2, DEC, VFP8, &am, &ar); \
        else { \
        dec_block(mcb, mbuf, B, ms[b]);  /* decoded moments, then updated in place */ \
        if (VFP8) dec_block(vcb, rbuf, B, vs[b]); \
        _Pragma("omp simd reduction(max:am, ar)") \
        for (int64_t i = 0; i < B; ++i) { \
            float pi = pp[i], gi = gg[i]; \
            if (!DEC) gi = gi + wd * pi; \
            float mi = mbuf[i]; \
            mi = mi + w1 * (gi - mi); \
            float v; \
            if (VFP8) { float r0 = rbuf[i]; v = r0 * r0 * beta2 + w2 * gi * gi; } \
            else { v = vv[i] * beta2 + w2 * gi * gi; vv[i] = v; } \
            float ri = sqrtf(v); \
            if (DEC) pi = pi * decay; \
            pp[i] = pi - step_size * mi / (ri * ibc2 + eps);  /* one division */ \
            mbuf[i] = mi; rbuf[i] = ri; \
            float a = fabsf(mi); \
            am = a > am ? a : am; ar = ri > ar ? ri : ar; \
        } \
        } \
        if (MODE != M_FP32) { \
            const uint32_t i0 = (uint32_t)(b * B);  /* the flat index of the block's first element */ \
            _Pragma("omp simd") \
            for (int64_t i = 0; i < B; ++i) { \
                uint32_t u; memcpy(&u, &pbuf[i], 4); \
                if (MODE == M_BF16) ph[i] = to_bf16(u, 0x7FFFu + ((u >> 16) & 1u)); \
                if (MODE == M_SR) ph[i] = to_bf16(u, mix32(i0 + (uint32_t)i + key) & 0xFFFFu); \
                if (MODE == M_SPLIT) { ph[i] = (uint16_t)(u >> 16); ll[i] = (uint16_t)u; } \
            } \
        } \
        const float ims = am > 0.0f ? 448.0f / am : 1.0f; \
        ms[b] = am > 0.0f ? am / 448.0f : 1.0f;  /* as tensor.py: quantize_blocks */ \
        enc_block(mbuf, ims, mcb, B, 0); \
        if (VFP8) { \
            const float irs = ar > 0.0f ? 448.0f / ar : 1.0f; \
            vs[b] = ar > 0.0f ? ar / 448.0f : 1.0f; \
            enc_block(rbuf, irs, vcb, B, 1);  /* sqrt(v) > 0 never becomes code 0 */ \
        } \
    } \
}

#define DEFINE_MODE(SUFFIX, MODE) \
    DEFINE_ADAM(adam_dq##SUFFIX, 1, 1, MODE) DEFINE_ADAM(adam_df##SUFFIX, 1, 0, MODE) \
    DEFINE_ADAM(adam_lq##SUFFIX, 0, 1, MODE) DEFINE_ADAM(adam_lf##SUFFIX, 0, 0, MODE)
DEFINE_MODE(_f32, M_FP32)
DEFINE_MODE(_bf16, M_BF16)
DEFINE_MODE(_sr, M_SR)
DEFINE_MODE(_split, M_SPLIT)

typedef void (*adam_fn)(void *, const void *, uint8_t *, float *, uint8_t *, float *, float *, uint16_t *,
                        const float *, uint32_t, int64_t, int64_t, int64_t);
static const adam_fn ADAM[4][2][2] = {  /* [mode][decoupled][vfp8] */
    {{adam_lf_f32, adam_lq_f32}, {adam_df_f32, adam_dq_f32}},
    {{adam_lf_bf16, adam_lq_bf16}, {adam_df_bf16, adam_dq_bf16}},
    {{adam_lf_sr, adam_lq_sr}, {adam_df_sr, adam_dq_sr}},
    {{adam_lf_split, adam_lq_split}, {adam_df_split, adam_dq_split}},
};

/* The interface optim.py calls (through ctypes), and checks when it loads this library:
   nanochat_optim_abi reports the row width NP, the hyperparameter width NH and ABI_VERSION
   (raise it whenever an exported signature or the meaning of a row changes).

   A step's tensors come as a table of NP pointers per tensor, ptr[NP t + k] for buffer k of
   tensor t (the unused ones NULL), and beside it bytes[NP t + k]: how many bytes that pointer
   may touch (the caller reads it from the tensor's allocation). Tensor t has nb[t] blocks of B
   elements. Every entry point checks each buffer against nb[t] and B before any block is
   stepped, so a table that does not describe the memory behind it is refused and changes
   nothing; nothing past a checked size is ever read or written. */
#define ABI_VERSION 2
enum {
    P, G,        /* parameter and gradient: fp32, or bf16 in the bf16 master modes */
    MC, MS,      /* first moment: e4m3 codes (a byte per element), fp32 scale per block */
    V32,         /* second moment in fp32 (level 1), or */
    VC, VS,      /* sqrt of the second moment, codes and scales (level 2) */
    LO,          /* bf16_split's int16 low halves of the fp32 master */
    OK,          /* guard byte, read at step time (no host sync): 0 leaves the tensor as it
                    is, e.g. after a non-finite gradient; NULL: always stepped */
    HP,          /* the tensor's NH hyperparameters (fp32) */
    SALT,        /* its uint32 stochastic-rounding salt (bf16_sr) */
    NP
};
enum { REFUSED = 1, BAD_BUFFER = 2 };  /* return codes: see check() */

void nanochat_optim_abi(int *nargs, int *width, int *version) {
    *nargs = NP;
    *width = NH;
    *version = ABI_VERSION;
}

/* Bytes buffer k of a tensor of nb blocks is read or written over (0: not used). */
static int64_t needed(int k, int64_t nb, int64_t B, int vfp8, int mode) {
    const int64_t n = nb * B;
    switch (k) {
    case P: case G: return n * (mode == M_FP32 ? 4 : 2);
    case MC: return n;
    case MS: return nb * 4;
    case V32: return vfp8 ? 0 : n * 4;
    case VC: return vfp8 ? n : 0;
    case VS: return vfp8 ? nb * 4 : 0;
    case LO: return mode == M_SPLIT ? n * 2 : 0;
    case HP: return NH * 4;
    case SALT: return mode == M_SR ? 4 : 0;
    default: return 0;
    }
}

/* 0 when a step may run: else REFUSED for a block size or mode this library does not do (the
   caller may use another backend), or BAD_BUFFER + NP t + k for the first buffer k of tensor t
   that is missing or smaller than its nb[t] blocks need (a bug or corrupt state: not retried).
   B is a multiple of 8 because the AVX2 decode takes 8 codes a step with no tail loop. */
static int64_t check(int64_t n, void *const *ptr, const int64_t *bytes, const int64_t *nb, int64_t B,
                     int vfp8, int mode) {
    if (n < 0 || B <= 0 || B > BMAX || B % 8 || mode < M_FP32 || mode > M_SPLIT) return REFUSED;
    for (int64_t t = 0; t < n; ++t) {
        if (nb[t] < 0 || nb[t] > INT64_MAX / 4 / B) return BAD_BUFFER + NP * t + P;
        for (int k = 0; k < NP; ++k) {
            const int64_t want = k == OK ? (ptr[NP * t + k] ? 1 : 0) : needed(k, nb[t], B, vfp8, mode);
            if (want && (!ptr[NP * t + k] || bytes[NP * t + k] < want)) return BAD_BUFFER + NP * t + k;
        }
    }
    return 0;
}

/* A float step count as the uint32 that keys bf16_sr's bits; converting a NaN, a negative or a
   too large float to an integer is undefined in C, so those key as step 0 */
static inline uint32_t step_key(float s) { return s >= 0.0f && s < 4294967296.0f ? (uint32_t)s : 0u; }

/* Blocks [b0, b1) of the numbering that concatenates every tensor's blocks (0..sum(nb)), so
   threads split a step by cutting one range; the table has been checked. */
static void step_range(int64_t n, void *const *ptr, const int64_t *nb, int64_t b0, int64_t b1, int64_t B,
                       adam_fn fn, int mode) {
    int64_t start = 0;
    for (int64_t t = 0; t < n && start < b1; start += nb[t], ++t) {
        int64_t lo = b0 > start ? b0 - start : 0, hi = b1 - start < nb[t] ? b1 - start : nb[t];
        if (lo >= hi) continue;
        void *const *q = ptr + NP * t;
        if (q[OK] && !*(const uint8_t *)q[OK]) continue;
        const float *ht = (const float *)q[HP];
        const uint32_t key = mode == M_SR ? mix32(*(const uint32_t *)q[SALT] + step_key(ht[10])) : 0;
        fn(q[P], q[G], (uint8_t *)q[MC], (float *)q[MS], (uint8_t *)q[VC], (float *)q[VS], (float *)q[V32],
           (uint16_t *)q[LO], ht, key, lo, hi, B);
    }
}

/* Every thread that calls this takes the next `chunk` blocks from the shared counter *next
   until none of the `total` are left. A thread that starts late (its core busy, e.g. with
   OpenMP threads still spinning after torch's last parallel region) leaves its share to the
   others instead of holding them at a barrier. Blocks are independent, so the result does not
   depend on who stepped which. */
static void step_shared(int64_t n, void *const *ptr, const int64_t *nb, int64_t total, int64_t chunk,
                        int64_t *next, int64_t B, adam_fn fn, int mode) {
    for (;;) {
        int64_t b0 = __atomic_fetch_add(next, chunk, __ATOMIC_RELAXED);
        if (b0 >= total) break;
        step_range(n, ptr, nb, b0, b0 + chunk < total ? b0 + chunk : total, B, fn, mode);
    }
}

/* Entry point for a pool of the caller's threads, each calling it with the same arguments and
   the same counter *next (0 at the start). Returns check()'s code. mode: 0 fp32, 1 bf16,
   2 bf16_sr, 3 bf16_split (master.py). */
int64_t adam_dynamic(int64_t n, void *const *ptr, const int64_t *bytes, const int64_t *nb, int64_t total,
                     int64_t chunk, int64_t *next, int64_t B, int decoupled, int vfp8, int mode) {
    const int64_t bad = check(n, ptr, bytes, nb, B, vfp8, mode);
    if (bad) return bad;
    step_shared(n, ptr, nb, total, chunk > 0 ? chunk : 1, next, B, ADAM[mode][!!decoupled][!!vfp8], mode);
    return 0;
}

#ifdef _OPENMP
#include <omp.h>
/* The same on an OpenMP team of `threads`. Built with -fopenmp, this library needs libgomp.so.1,
   which the dynamic loader resolves to the one torch has already loaded: the team is torch's
   own intra-op thread pool, whose threads are still spinning right after torch's last parallel
   region (a backward pass, a fused optimizer), so they start at once instead of keeping a core
   from a thread of ours for the length of their spin. */
int64_t adam_parallel(int64_t n, void *const *ptr, const int64_t *bytes, const int64_t *nb, int64_t total,
                      int64_t chunk, int64_t B, int decoupled, int vfp8, int mode, int threads) {
    const int64_t bad = check(n, ptr, bytes, nb, B, vfp8, mode);
    if (bad) return bad;
    const adam_fn fn = ADAM[mode][!!decoupled][!!vfp8];
    int64_t next = 0;
    chunk = chunk > 0 ? chunk : 1;
    #pragma omp parallel num_threads(threads > 0 ? threads : 1)
    step_shared(n, ptr, nb, total, chunk, &next, B, fn, mode);
    return 0;
}
#endif
