/* The Adam(W) step over e4m3 moments on CPU (built on first use with the system C compiler,
   -O3 -march=native, by backends.py's load_native; called by adam.py through ctypes). The
   formulas are adam.py's adam_step with E4M3Blocks' read and write (the codec: moments/e4m3.h);
   results agree to fp32 rounding.

   One 256-element block at a time, so the block stays in L1: decode both moments, one loop
   updates p and the moments and collects the absmax, then encode. The loops are
   auto-vectorized (-fno-trapping-math lets the compiler if-convert the selects); with AVX-512
   the decode is fused into the update loop (update16). No torch headers, so it builds quickly.

   Parameters and gradients are fp32, or bf16 with a bf16 master-weight mode (master.py: round
   to nearest even, stochastic rounding with its counter-based bits, or the fp32 master split
   into the bf16 p and an int16 remainder): the fp32 master is read, stepped by the same fp32
   code and written back per mode, so only the write differs. A per-tensor guard byte, read
   here at step time, can leave a tensor untouched (p, remainder, moments and scales). */

#include "e4m3.h"

#if E4M3_AVX512
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
        ms[b] = am > 0.0f ? am / 448.0f : 1.0f;  /* as fp8.py: quantize_blocks */ \
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

/* The interface adam.py calls (through ctypes), and checks when it loads this library:
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
