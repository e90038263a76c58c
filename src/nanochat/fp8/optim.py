"""FP8Optim: Adam/AdamW/SGD-momentum with the optimizer state stored in FP8.

    opt = FP8Optim(torch.optim.AdamW(model.param_groups(0.1), lr=3e-4, fused=False), opt_level=2)
    ...loss.backward(); opt.step(); opt.zero_grad()   # schedulers, state_dict: as usual

It *wraps* a constructed torch optimizer instead of re-implementing one. FP8Optim is a
`torch.optim.Optimizer` whose `param_groups` and `state` are the wrapped optimizer's own objects,
so an LR scheduler (or the trainer writing `param_groups[i]["lr"]`) drives both, and hyper-
parameters are read from the groups at every step. Levels:

    0  both moments fp32: the wrapped optimizer steps everything itself (it is the reference)
    1  first moment (Adam exp_avg, SGD momentum_buffer) in FP8 e4m3, second moment fp32
    2  both moments in FP8 (~2.03 bytes/param instead of 8)

Which tensors stay fp32: a parameter goes FP8 only if it has >= `min_numel` (4096, the rule of
bitsandbytes and torchao: below that the state is negligible and the per-call cost dominates)
elements, a multiple of `block_size` (256, see tensor.py) of them, and is contiguous. Those that
stay fp32 are stepped by the wrapped optimizer (their grads are hidden from it while we step the
FP8 ones), so they follow torch's math exactly; a one-time summary says how many and why.

The second moment. Plain absmax-scaled e4m3 storage of v = EMA(g^2) flushes every v below
absmax(block) * 2^-17.8 (448 / smallest subnormal 2^-9) to zero; since v is the *square*, that
is only ~9 binary orders of |g| inside a 256-element block, and an element whose v flushed while
its m survives gets m / (0 + eps), the low-bit optimizer "zero-point problem". We store
r = sqrt(v) instead, in e4m3 with block scales, and never round a positive r to zero (its code is
floored at the smallest subnormal):
- sqrt halves the exponent range: e4m3 covers ~17.8 binary orders of |g| per block;
- precision: 2^-4 relative on sqrt(v) (the quantity the update divides by), the same as v in
  e5m2 (2^-3 on v is 2^-4 on sqrt(v)) with more range than e5m2's (15.9 orders of |g|);
- the floor turns "flushed to zero" into "overestimated": such an element gets a smaller update
  than Adam's instead of m / eps. Measured on 16K elements whose blocks span |g| 1e-8..1e2, 300
  steps: worst update 3.2 * lr (fp32 Adam: 1.4), against 1e4 without the floor, 1e5 for v in
  e5m2 and 7e6 for v in e4m3; median error 0.036 * lr, also the lowest of the four;
- the step needs sqrt(v) anyway for the denominator, so storing it costs no extra math.
The study (`scripts/bench_optim.py --study`, figures in BENCHMARKS.md) runs the four options on
the same gradient streams, two gradient distributions and two beta2.

The step, per FP8 parameter: decode the codes -> fp32 math -> write p, the new codes and scales
in place, with no full-size temporaries. Three implementations of the same formulas:
- native (default for fp32 Adam/AdamW parameters on CPU): a ~60-line C kernel (below), built
  with the system compiler on first use and called through ctypes; one 256-element block at a
  time, so the block stays in L1, auto-vectorized. On CPU it is ~5x faster than the torch.compile
  version, whose uint8 loads/stores go through a memcpy'd stack buffer (BENCHMARKS.md).
- compile: `torch.compile(fullgraph=True, dynamic=False)` of `_adam_step`/`_sgd_step`, one graph
  per parameter size (used on GPU, for SGD, for bf16 parameters, or if the C build fails).
- eager: the same Python function run eagerly (`compile=False`, or when compilation fails).
Hyperparameters go in as one small fp32 tensor, so a schedule changing lr every step does not
recompile. Every fallback is logged once with its reason.

Under FSDP2 (nanochat/distributed.py) a parameter is a DTensor holding this rank's rows. The
step works on the local shard (`_local`: p, its gradient and its states), so the kernels and
their compiled graphs are the single-process ones; states are created for the shard and kept as
DTensors laid out like their parameter (`_like`), which is what `get_optimizer_state_dict` and
DCP need to save each rank's part and to reshard it on load. Which parameters get FP8 state is
decided on the *global* shape (`p.numel()` of a DTensor is the full tensor's), so precision does
not depend on the world size. A shard must also be a whole number of blocks: always true when a
row is (a row of 64*d elements for the presets d4, d8, d12, d20: any world size), else when
rows-per-shard x row length is (d2, d6, d26 split evenly in 2 or 4); otherwise that tensor keeps
fp32 state (on every rank: the rule reads the global shape) and the summary says why.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch

from nanochat.common import format_bytes, logger, warn_once

from .tensor import DEFAULT_BLOCK_SIZE, FP8Tensor, block_scale, decode, encode, fp8_max

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed: no parameter is a DTensor
    DTensor = ()  # isinstance(x, ()) is always False

E4M3 = torch.float8_e4m3fn
MIN_NUMEL = 4096  # bitsandbytes/torchao rule: smaller tensors keep fp32 state
SUPPORTED = "torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD"
_INV_E4M3_MAX = 1.0 / fp8_max(E4M3)

# ---------------------------------------------------------------------------------------------
# Fused per-parameter steps. All tensors are 2-D [n_blocks, B] views (codes as uint8), scales
# [n_blocks]; `h` is a 1-D fp32 tensor of hyperparameters (a tensor so changes don't recompile).
# ---------------------------------------------------------------------------------------------


def _requantize(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, *, floor: bool) -> torch.Tensor:
    """x [n, B] fp32 -> codes (uint8 e4m3) and scale, in place; returns the new scale.
    floor: a positive x never becomes code 0 (the smallest subnormal instead)."""
    amax = x.abs().amax(dim=-1)  # [n]
    new_scale = torch.where(amax > 0, amax * _INV_E4M3_MAX, 1.0)
    inv = torch.where(amax > 0, fp8_max(E4M3) / amax, 1.0)
    q = encode(x * inv[:, None], E4M3)
    if floor:
        q = torch.where((x > 0) & (q == 0), 1, q).to(torch.uint8)
    codes.copy_(q)
    scale.copy_(new_scale)
    return new_scale


def _adam_step(p, g, m_codes, m_scale, v, v_codes, v_scale, h, decoupled: bool, v_fp8: bool):
    """Adam(W) on one parameter; m in FP8; v in FP8 as sqrt(v) (v_fp8) or fp32 in `v`."""
    lr, beta1, beta2, eps, wd, step_size, bc2_sqrt = (h[i] for i in range(7))
    pf = p.float()
    gf = g.float()
    if not decoupled:  # Adam's L2 penalty goes into the gradient (torch: grad.add(param, alpha=wd))
        gf = gf + wd * pf
    m = decode(m_codes, E4M3) * m_scale[:, None]
    m = m.lerp(gf, 1 - beta1)  # torch: exp_avg.lerp_(grad, 1 - beta1)
    if v_fp8:
        r_old = decode(v_codes, E4M3) * v_scale[:, None]  # stored sqrt(v)
        vv = r_old * r_old * beta2 + (1 - beta2) * gf * gf
    else:
        vv = v * beta2 + (1 - beta2) * gf * gf
    r = vv.sqrt()
    m_new_scale = _requantize(m, m_codes, m_scale, floor=False)
    if v_fp8:
        r_new_scale = _requantize(r, v_codes, v_scale, floor=True)
    else:
        v.copy_(vv)
    if decoupled:  # torch: param.mul_(1 - lr * wd)
        pf = pf * (1 - lr * wd)
    upd = step_size * m / (r / bc2_sqrt + eps)  # torch: addcdiv_(exp_avg, denom, -step_size)
    # `+ 0 * scale`: makes the parameter write depend on the per-block absmax, so inductor fuses
    # it into the same loop as the code writes (one pass) instead of a third pass over p through
    # a full-size temporary (measured on 16M params, loaded 2-core box: 768 -> 576 ms a step)
    tie = 0.0 * m_new_scale[:, None]
    if v_fp8:
        tie = tie + 0.0 * r_new_scale[:, None]
    p.copy_(pf - upd + tie)


def _sgd_step(p, g, b_codes, b_scale, h, nesterov: bool):
    """SGD with momentum on one parameter, buffer in FP8. h = lr, momentum, dampening, wd, first."""
    lr, momentum, dampening, wd, first = (h[i] for i in range(5))
    pf = p.float()
    d_p = g.float() + wd * pf
    buf = decode(b_codes, E4M3) * b_scale[:, None]
    # torch: first step buf = clone(d_p); later buf.mul_(momentum).add_(d_p, alpha=1 - dampening)
    buf = torch.where(first > 0, d_p, buf * momentum + (1 - dampening) * d_p)
    new_scale = _requantize(buf, b_codes, b_scale, floor=False)
    d = d_p + momentum * buf if nesterov else buf
    p.copy_(pf - lr * d + 0.0 * new_scale[:, None])  # `+ 0 * scale`: see _adam_step


def _local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: the local shard of a DTensor (FSDP2 parameters, gradients,
    and the states made for them), with torchao's FP8 all-gather weight wrapper
    (WeightWithDynamicFloat8CastTensor, one inner tensor) unwrapped, so kernels see plain tensors."""
    if isinstance(t, DTensor):
        t = t.to_local()
    if type(t) not in (torch.Tensor, torch.nn.Parameter, FP8Tensor) and hasattr(t, "__tensor_flatten__"):
        inner, _ = t.__tensor_flatten__()
        if len(inner) == 1:
            t = getattr(t, inner[0])
    return t


def _shard_problem(p: DTensor, block_size: int) -> str | None:
    """Why the shards of `p` are not whole blocks on every rank, or None. Decided from the global
    shape, so all ranks agree: FSDP2 shards dim 0 like torch.chunk, ceil(rows / ranks) rows per
    rank (the last rank fewer, and whole blocks too when the full tensor and the others are)."""
    from torch.distributed.tensor import Shard

    if tuple(p.placements) != (Shard(0),):
        return f"sharded as {tuple(p.placements)}; FP8 state needs rows split across one mesh dim"
    rows = p.shape[0]
    chunk = -(-rows // p.device_mesh.size())  # ceil
    if chunk * (p.numel() // rows) % block_size:
        return (f"a shard of {chunk} rows x {p.numel() // rows} is not whole {block_size}-element "
                f"blocks at {p.device_mesh.size()} ranks")
    return None


def _like(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A state made for this rank's shard of `p`, as a DTensor laid out like `p` (what DCP saves
    and reshards); unchanged for a plain parameter."""
    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                  run_check=False)
    return local


def quantize_sqrt_v(v: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE) -> FP8Tensor:
    """fp32 second moment v -> FP8Tensor of sqrt(v), positive values never flushed to zero."""
    r = v.detach().float().clamp(min=0).sqrt()
    blocks = r.reshape(-1, block_size)
    scale = block_scale(blocks, E4M3)
    codes = encode(blocks / scale[:, None], E4M3)
    codes = torch.where((blocks > 0) & (codes == 0), 1, codes).to(torch.uint8)
    return FP8Tensor(codes.view(E4M3).view(v.shape), scale, block_size)



# ---------------------------------------------------------------------------------------------
# Native CPU kernel. Inductor's code for the step above runs ~10x fused AdamW on CPU: it loads
# and stores the 1-byte codes 8 at a time through `Vectorized<uint8_t>::loadu(ptr, 8)`, which
# goes through a stack buffer and memcpy (ATen vec256_int.h), and it sweeps each tensor twice.
# The same math written as plain C loops, one 256-element block at a time (the block stays in
# L1: decode, then one loop updates p and collects the absmax, then one encodes) is
# auto-vectorized by the C compiler (-O3 -march=native; -fno-trapping-math lets it if-convert
# the selects); decode and encode are written with F16C intrinsics where the CPU has them
# (the compiler scalarizes a _Float16 conversion): 35.7 -> 24.2 ms for 16.8M parameters on one
# core (BENCHMARKS.md 3(b)); elsewhere the portable loops below run (tested against them). It is
# built on first use with the system C compiler into ~/.cache/nanochat and called through
# ctypes (no torch headers: builds in < 1 s); blocks are split across torch.get_num_threads()
# threads (ctypes releases the GIL). Same formulas and bit tricks as
# `_adam_step`/tensor.py; results agree to fp32 rounding (tests compare the backends).
# ---------------------------------------------------------------------------------------------

_C_SOURCE = r"""
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

#if defined(__F16C__) && defined(__AVX2__)
#include <immintrin.h>
/* e4m3fn codes -> floats * s, 8 at a time: the 7 magnitude bits placed as fp16 bits (exponent
   bias 15 instead of 7, so the value is 2^-8 of the e4m3 one; fp16 subnormals are exactly e4m3's
   subnormals) and converted by F16C's vcvtph2ps; s carries the 2^8. Exact, and ~4x fewer
   instructions than dec() (the compiler does not vectorize a _Float16 conversion by itself). */
static inline void dec_block(const uint8_t *restrict c, float *restrict out, int64_t B, float s) {
    const __m128i m7f = _mm_set1_epi16(0x7F), m80 = _mm_set1_epi16(0x80);
    const __m256 sc = _mm256_set1_ps(s * 256.0f);
    for (int64_t i = 0; i < B; i += 8) {             /* B is a multiple of 8 (FP8Optim checks) */
        __m128i u = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(c + i)));
        __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(u, m7f), 7),
                                 _mm_slli_epi16(_mm_and_si128(u, m80), 8));
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

#define BMAX 1024
/* h = lr, beta1, beta2, eps, wd, step_size, bias_correction2_sqrt. One function per
   (decoupled weight decay, v in FP8) so the inner loops carry no branches. */
#define DEFINE_ADAM(NAME, DEC, VFP8) \
static void NAME(float *restrict p, const float *restrict g, uint8_t *restrict mc, float *restrict ms, \
                 uint8_t *restrict vc, float *restrict vs, float *restrict v32, const float *h, \
                 int64_t b0, int64_t b1, int64_t B) { \
    const float lr = h[0], beta1 = h[1], beta2 = h[2], eps = h[3], wd = h[4], step_size = h[5], bc2 = h[6]; \
    const float w1 = 1.0f - beta1, w2 = 1.0f - beta2, decay = 1.0f - lr * wd, ibc2 = 1.0f / bc2; \
    float mbuf[BMAX], rbuf[BMAX]; \
    for (int64_t b = b0; b < b1; ++b) { \
        float *restrict pp = p + b * B; const float *restrict gg = g + b * B; \
        uint8_t *restrict mcb = mc + b * B; \
        uint8_t *restrict vcb = VFP8 ? vc + b * B : 0; float *restrict vv = VFP8 ? 0 : v32 + b * B; \
        dec_block(mcb, mbuf, B, ms[b]);  /* decoded moments, then updated in place */ \
        if (VFP8) dec_block(vcb, rbuf, B, vs[b]); \
        float am = 0.0f, ar = 0.0f; \
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
        const float ims = am > 0.0f ? 448.0f / am : 1.0f; \
        ms[b] = am > 0.0f ? am * (1.0f / 448.0f) : 1.0f; \
        enc_block(mbuf, ims, mcb, B, 0); \
        if (VFP8) { \
            const float irs = ar > 0.0f ? 448.0f / ar : 1.0f; \
            vs[b] = ar > 0.0f ? ar * (1.0f / 448.0f) : 1.0f; \
            enc_block(rbuf, irs, vcb, B, 1);  /* sqrt(v) > 0 never becomes code 0 */ \
        } \
    } \
}

DEFINE_ADAM(adam_dq, 1, 1)
DEFINE_ADAM(adam_df, 1, 0)
DEFINE_ADAM(adam_lq, 0, 1)
DEFINE_ADAM(adam_lf, 0, 0)

int adam_step(float *p, const float *g, uint8_t *mc, float *ms, uint8_t *vc, float *vs, float *v32,
              const float *h, int64_t b0, int64_t b1, int64_t B, int decoupled, int vfp8) {
    if (B > BMAX) return 1;
    if (decoupled && vfp8) adam_dq(p, g, mc, ms, vc, vs, v32, h, b0, b1, B);
    else if (decoupled) adam_df(p, g, mc, ms, vc, vs, v32, h, b0, b1, B);
    else if (vfp8) adam_lq(p, g, mc, ms, vc, vs, v32, h, b0, b1, B);
    else adam_lf(p, g, mc, ms, vc, vs, v32, h, b0, b1, B);
    return 0;
}
"""

_native: dict[str, Any] = {}


def _native_lib():
    """The compiled kernel (ctypes.CDLL), or raise with the reason it is unavailable."""
    if "lib" in _native:
        return _native["lib"]
    if "error" in _native:
        raise RuntimeError(_native["error"])
    import ctypes
    import hashlib
    import os
    import pathlib
    import platform
    import shutil
    import subprocess
    import tempfile

    try:
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            raise RuntimeError("no C compiler (cc/gcc) on PATH")
        flags = ["-O3", "-march=native", "-fopenmp-simd", "-fno-trapping-math", "-fno-math-errno",
                 "-shared", "-fPIC"]
        cpu = ""
        try:  # -march=native: key the cache on this CPU's feature flags
            cpu = next(l for l in open("/proc/cpuinfo") if l.startswith("flags"))
        except (OSError, StopIteration):
            cpu = platform.processor()
        key = hashlib.sha256((_C_SOURCE + " ".join(flags) + cpu + platform.machine()).encode()).hexdigest()[:16]
        cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "nanochat"
        cache.mkdir(parents=True, exist_ok=True)
        so = cache / f"fp8optim-{key}.so"
        if not so.exists():
            # Build next to the target and os.replace it there: the rename is atomic only on one
            # filesystem, and concurrent processes (torchrun ranks) may dlopen the file meanwhile.
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                src = pathlib.Path(tmp) / "fp8optim.c"
                src.write_text(_C_SOURCE)
                out = pathlib.Path(tmp) / so.name
                subprocess.run([cc, *flags, "-o", str(out), str(src), "-lm"], check=True,
                               capture_output=True, text=True, timeout=120)
                os.replace(out, so)
        lib = ctypes.CDLL(str(so))
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.adam_step.argtypes = [ptr] * 8 + [i64, i64, i64, i32, i32]
        lib.adam_step.restype = i32
    except Exception as e:  # noqa: BLE001 - any build/load failure means "not available"
        detail = e.stderr.strip().splitlines()[-1] if isinstance(e, subprocess.CalledProcessError) and e.stderr else e
        _native["error"] = f"{type(e).__name__}: {detail}"
        raise RuntimeError(_native["error"]) from None
    _native["lib"] = lib
    return lib


_pool: list = []


def _native_adam(p2, g2, mc, ms, v32, vc, vs, h, decoupled: bool, v_fp8: bool, pending: list | None = None) -> None:
    """Run the C kernel over [n_blocks, B] views, blocks split across torch's thread count.

    With `pending` (a list), the thread-pool jobs are appended to it instead of awaited, so the
    jobs of every tensor of a step queue up together and no thread idles at a per-tensor barrier;
    the caller waits for them (each job holds its tensors alive through `args`)."""
    lib = _native_lib()
    n, B = p2.shape
    args = (p2.data_ptr(), g2.data_ptr(), mc.data_ptr(), ms.data_ptr(),
            vc.data_ptr() if v_fp8 else None, vs.data_ptr() if v_fp8 else None,
            None if v_fp8 else v32.data_ptr(), h.data_ptr())
    threads = min(torch.get_num_threads(), max(1, n // 512))  # >= 128K elements per thread
    if threads == 1:
        lib.adam_step(*args, 0, n, B, int(decoupled), int(v_fp8))
        return
    if not _pool or _pool[0]._max_workers < threads:
        from concurrent.futures import ThreadPoolExecutor
        _pool[:] = [ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fp8optim")]
    cuts = [n * i // threads for i in range(threads + 1)]
    keep = (p2, g2, mc, ms, v32, vc, vs, h)  # the pointers' owners stay alive until the job ran
    futures = [_pool[0].submit(_run_kernel, lib, keep, args, cuts[i], cuts[i + 1], B, int(decoupled), int(v_fp8))
               for i in range(threads)]
    if pending is not None:
        pending.extend(futures)
        return
    for f in futures:
        f.result()


def _run_kernel(lib, keep, args, b0, b1, B, decoupled, v_fp8) -> None:
    if lib.adam_step(*args, b0, b1, B, decoupled, v_fp8):
        raise RuntimeError(f"FP8Optim native kernel refused block size {B} (at most 1024)")



class FP8Optim(torch.optim.Optimizer):
    """Takes over the step of a torch AdamW/Adam/SGD and keeps its moments in FP8.

    Args:
        optimizer: a constructed torch.optim.AdamW, Adam or SGD (its param_groups are shared).
        opt_level: 0 fp32 moments; 1 first moment FP8; 2 both moments FP8 (SGD: 1 and 2 agree).
        block_size: elements per scale (256: see tensor.py for the bytes/param arithmetic).
        min_numel: parameters with fewer elements keep fp32 state.
        compile: False forces the eager step (same as backend="eager").
        backend: how the FP8 step runs. "auto": the native C kernel for fp32 Adam(W) parameters
            on CPU, torch.compile otherwise; "native" / "compile" / "eager" force one (a
            backend that cannot run falls back to the next, native -> compile -> eager, logged once).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, opt_level: int = 2, *,
                 block_size: int = DEFAULT_BLOCK_SIZE, min_numel: int = MIN_NUMEL,
                 compile: bool = True, backend: str = "auto") -> None:
        kind = type(optimizer)
        if kind not in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):
            raise TypeError(
                f"FP8Optim wraps {SUPPORTED} (exactly these classes); got {kind.__module__}."
                f"{kind.__qualname__}. Construct one of those and pass it in."
            )
        if opt_level not in (0, 1, 2):
            raise ValueError(f"opt_level must be 0 (fp32 moments), 1 (first moment FP8) or 2 "
                             f"(both moments FP8); got {opt_level!r}")
        if block_size <= 0 or block_size % 8:
            raise ValueError(f"block_size must be a positive multiple of 8, got {block_size}")
        # Optimizer.__init__ installs the hook dicts and step profiling; then share the objects
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.optimizer = optimizer
        self.opt_level = opt_level
        self.block_size = block_size
        self.min_numel = max(min_numel, block_size)
        self.is_sgd = kind is torch.optim.SGD
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        if backend not in ("auto", "native", "compile", "eager"):
            raise ValueError(f"backend must be auto, native, compile or eager; got {backend!r}")
        self._native = compile and backend in ("auto", "native")
        self._pending: list = []  # native kernel jobs queued during a step (see step)
        self._compile = compile and backend != "eager"
        self._compiled: dict[str, Any] = {}
        self._summary_logged = False
        self.fallbacks: list[str] = []
        """Each fallback this optimizer took (native kernel unavailable, compile failed), with its
        reason; the trainer copies them into TrainResult.fallbacks."""
        self._check_groups()

    # ---- configuration checks ----------------------------------------------------------------

    def _check_groups(self) -> None:
        for i, group in enumerate(self.param_groups):
            bad = [k for k in ("amsgrad", "maximize", "capturable", "differentiable")
                   if group.get(k, False)]
            if bad:
                raise ValueError(
                    f"FP8Optim does not support {', '.join(f'{k}=True' for k in bad)} (param group "
                    f"{i}). Supported: {SUPPORTED} with lr/betas/eps/weight_decay (Adam, AdamW), "
                    "momentum/dampening/nesterov/weight_decay (SGD), foreach/fused as you like. "
                    "Turn the option off or use the plain torch optimizer."
                )
            for p in group["params"]:
                if p.is_complex():
                    raise ValueError(f"FP8Optim supports real parameters only; param group {i} has a "
                                     f"complex {tuple(p.shape)} tensor. Use the plain torch optimizer.")
                if p.grad is not None and p.grad.is_sparse:
                    raise ValueError(f"FP8Optim does not support sparse gradients (param group {i}, "
                                     f"shape {tuple(p.shape)}); use dense gradients.")

    def _fp8_reason(self, p: torch.Tensor) -> str | None:
        """None if p's state goes FP8 at this level, else why it stays fp32."""
        if self.opt_level == 0:
            return "opt_level 0"
        if p.numel() < self.min_numel:
            return f"numel < {self.min_numel}"
        if p.numel() % self.block_size:
            return f"numel % {self.block_size} != 0"
        if isinstance(p, DTensor):  # FSDP: every rank's rows must be whole blocks too
            problem = _shard_problem(p, self.block_size)
            if problem:
                return problem
        if not p.is_contiguous():
            return "not contiguous"
        if not p.is_floating_point():
            return "not floating point"
        return None

    def _uses_fp8(self, p: torch.Tensor, group: dict) -> bool:
        if self.is_sgd and group["momentum"] == 0:
            return False  # plain SGD has no state to store
        return self._fp8_reason(p) is None

    # ---- the step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_groups()
        if not self._summary_logged:
            self._summary_logged = True
            logger.info("%s", self.summary())
        hidden: list[tuple[torch.Tensor, torch.Tensor]] = []
        for group in self.param_groups:
            h_group = None
            for p in group["params"]:
                if p.grad is None or not self._uses_fp8(p, group):
                    continue
                if self.is_sgd:
                    self._sgd_param(p, group)
                else:
                    if h_group is None:
                        h_group = self._adam_group_scalars(group)
                    self._adam_param(p, group, h_group)
                hidden.append((p, p.grad))
        for job in self._pending:  # the native kernel jobs _adam_param queued (several threads)
            job.result()
        self._pending = []
        # the fp32-state parameters: the wrapped optimizer steps them, with the FP8 ones hidden
        for p, _ in hidden:
            p.grad = None
        try:
            self.optimizer.step()
        finally:
            for p, g in hidden:
                p.grad = g
        return loss

    def _run(self, name: str, fn, *args, **flags) -> None:
        key = name + repr(sorted(flags.items()))
        if self._compile:
            compiled = self._compiled.get(key)
            if compiled is None:
                compiled = self._compiled[key] = torch.compile(fn, fullgraph=True, dynamic=False)
            try:
                # one graph per parameter size; a model has few sizes, so lift dynamo's limit (8)
                with torch._dynamo.utils.disable_cache_limit():
                    compiled(*args, **flags)
                return
            except Exception as e:  # no C++ compiler, unsupported backend, ...
                self._compile = False
                msg = (f"FP8Optim: torch.compile of the step failed ({type(e).__name__}: "
                       f"{str(e).splitlines()[0] if str(e) else ''}); running the step eagerly "
                       "(correct, several times slower). Pass compile=False to skip the attempt.")
                self.fallbacks.append(msg)
                warn_once("fp8optim-eager", msg)
        fn(*args, **flags)

    def _adam_group_scalars(self, group: dict) -> tuple[float, ...]:
        beta1, beta2 = (float(b) for b in group["betas"])
        return float(group["lr"]), beta1, beta2, float(group["eps"]), float(group["weight_decay"])

    def _adam_param(self, p: torch.Tensor, group: dict, scalars: tuple[float, ...]) -> None:
        state = self.state[p]
        if len(state) == 0:
            self._init_adam_state(p, state)
        lr, beta1, beta2, eps, wd = scalars
        state["step"] += 1
        step = float(state["step"])
        # as torch's single-tensor Adam: bias corrections in float64 on the host
        bias_correction1 = 1 - beta1 ** step
        bias_correction2_sqrt = math.sqrt(1 - beta2 ** step)
        h = torch.tensor([lr, beta1, beta2, eps, wd, lr / bias_correction1, bias_correction2_sqrt],
                         dtype=torch.float32, device=p.device)
        B = self.block_size
        m = _local(state["exp_avg"])
        v_fp8 = "exp_avg_sq_sqrt" in state
        vq = _local(state["exp_avg_sq_sqrt"]) if v_fp8 else None
        v = None if v_fp8 else _local(state["exp_avg_sq"])
        decoupled = bool(group.get("decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW)))
        p, grad = _local(p), _local(p.grad)  # from here on: this rank's shard
        if (self._native and p.device.type == "cpu" and p.dtype == torch.float32
                and grad.dtype == torch.float32 and grad.is_contiguous() and B <= 1024):
            try:
                _native_adam(p.view(-1, B), grad.view(-1, B), m.codes.view(torch.uint8).view(-1, B), m.scale,
                             None if v_fp8 else v.view(-1, B),
                             vq.codes.view(torch.uint8).view(-1, B) if v_fp8 else None,
                             vq.scale if v_fp8 else None, h, decoupled, v_fp8, pending=self._pending)
                return
            except RuntimeError as e:
                self._native = False
                msg = (f"FP8Optim: the native CPU kernel is unavailable ({e}); "
                       "using torch.compile for the step instead (~5x slower on CPU).")
                self.fallbacks.append(msg)
                warn_once("fp8optim-native", msg)
        self._run(
            "adam", _adam_step, p.view(-1, B), grad.reshape(-1, B),
            m.codes.view(torch.uint8).view(-1, B), m.scale,
            None if v_fp8 else v.view(-1, B),
            vq.codes.view(torch.uint8).view(-1, B) if v_fp8 else None,
            vq.scale if v_fp8 else None, h, decoupled=decoupled, v_fp8=v_fp8,
        )

    def _sgd_param(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        first = state.get("momentum_buffer") is None
        if first:
            state["momentum_buffer"] = _like(FP8Tensor.zeros(_local(p).shape, dtype=E4M3,
                                                             block_size=self.block_size, device=p.device), p)
        buf = _local(state["momentum_buffer"])
        h = torch.tensor([float(group["lr"]), float(group["momentum"]), float(group["dampening"]),
                          float(group["weight_decay"]), 1.0 if first else 0.0],
                         dtype=torch.float32, device=p.device)
        B = self.block_size
        self._run("sgd", _sgd_step, _local(p).view(-1, B), _local(p.grad).reshape(-1, B),
                  buf.codes.view(torch.uint8).view(-1, B), buf.scale, h, nesterov=bool(group["nesterov"]))

    def _init_adam_state(self, p: torch.Tensor, state: dict) -> None:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)  # as torch (non-capturable): host float32
        shard = _local(p).shape  # FSDP: this rank's rows; the state is wrapped like p
        state["exp_avg"] = _like(FP8Tensor.zeros(shard, dtype=E4M3, block_size=self.block_size,
                                                 device=p.device), p)
        if self.opt_level >= 2:
            state["exp_avg_sq_sqrt"] = _like(FP8Tensor.zeros(shard, dtype=E4M3, block_size=self.block_size,
                                                             device=p.device), p)
        else:
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)

    # ---- state conversion (loading across levels, from plain torch state) ---------------------

    def _as_fp8(self, x: torch.Tensor) -> FP8Tensor:
        if isinstance(x, FP8Tensor) and x.block_size == self.block_size and x.fp8_dtype == E4M3:
            return x
        x = x.dequantize() if isinstance(x, FP8Tensor) else x
        return FP8Tensor.from_float(x.float(), dtype=E4M3, block_size=self.block_size)

    @staticmethod
    def _as_fp32(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        x = x.dequantize() if isinstance(x, FP8Tensor) else x
        return x.to(device=like.device, dtype=like.dtype if like.is_floating_point() else torch.float32)

    def _convert_state(self) -> None:
        """Bring every parameter's state to the representation this level uses."""
        for group in self.param_groups:
            fp8 = [self._uses_fp8(p, group) for p in group["params"]]
            for p, want_fp8 in zip(group["params"], fp8):
                state = self.state.get(p)
                if not state:
                    continue
                if self.is_sgd:
                    buf = state.get("momentum_buffer")
                    if buf is not None:
                        state["momentum_buffer"] = self._as_fp8(buf.to(p.device)) if want_fp8 else self._as_fp32(buf, p)
                    continue
                state["exp_avg"] = self._as_fp8(state["exp_avg"].to(p.device)) if want_fp8 \
                    else self._as_fp32(state["exp_avg"], p)
                want_sqrt = want_fp8 and self.opt_level >= 2
                r = state.get("exp_avg_sq_sqrt")
                if (want_sqrt and isinstance(r, FP8Tensor) and r.block_size == self.block_size
                        and r.fp8_dtype == E4M3):
                    state["exp_avg_sq_sqrt"] = r.to(p.device)  # already what we store: bit-exact
                else:
                    if r is not None:  # stored sqrt(v): v = r^2
                        r = state.pop("exp_avg_sq_sqrt")
                        r = (r.dequantize() if isinstance(r, FP8Tensor) else r).to(p.device).float()
                        v = r * r
                    else:
                        v = state.pop("exp_avg_sq")
                        v = (v.dequantize() if isinstance(v, FP8Tensor) else v).to(p.device).float()
                    if want_sqrt:
                        state["exp_avg_sq_sqrt"] = quantize_sqrt_v(v, self.block_size)
                    elif want_fp8:  # level 1: our kernel keeps v in fp32 whatever p's dtype
                        state["exp_avg_sq"] = v.to(device=p.device, dtype=torch.float32).contiguous()
                    else:  # stepped by the wrapped optimizer: its own convention (p's dtype)
                        state["exp_avg_sq"] = self._as_fp32(v, p)
                if not torch.is_tensor(state.get("step")):
                    state["step"] = torch.tensor(float(state.get("step", 0)), dtype=torch.float32)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of FP8Optim (any level) or of the plain wrapped optimizer.

        The wrapped optimizer does the loading (param id mapping, group hyperparameters, device);
        then each state is converted to what this level stores (FP8 <-> fp32, v <-> sqrt(v)).
        """
        self.optimizer.load_state_dict(state_dict)
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        # FSDP: convert each rank's shard of the states, then wrap them back like their parameter
        sharded = [p for g in self.param_groups for p in g["params"]
                   if isinstance(p, DTensor) and self.state.get(p)]
        for p in sharded:
            self.state[p] = {k: _local(v) if torch.is_tensor(v) and k != "step" else v
                             for k, v in self.state[p].items()}
        self._convert_state()
        for p in sharded:
            self.state[p] = {k: _like(v, p) if torch.is_tensor(v) and k != "step" else v
                             for k, v in self.state[p].items()}

    def add_param_group(self, param_group: dict) -> None:
        if not hasattr(self, "optimizer"):  # called by Optimizer.__init__ on the shared groups
            return super().add_param_group(param_group)
        self.optimizer.add_param_group(param_group)
        self._summary_logged = False

    # ---- reporting ----------------------------------------------------------------------------

    def _planned_bytes(self, p: torch.Tensor, group: dict) -> int:
        """Bytes of moment state the first step will allocate for p (this level's layout)."""
        moments = 0 if self.is_sgd and group["momentum"] == 0 else (1 if self.is_sgd else 2)
        n = _local(p).numel()  # FSDP: this rank's shard
        if not self._uses_fp8(p, group):
            return moments * n * p.element_size()  # torch keeps state in p's dtype
        fp8 = min(self.opt_level, moments)
        return fp8 * (n + n // self.block_size * 4) + (moments - fp8) * n * 4

    def state_bytes(self) -> int:
        """Bytes of moment state (FP8 codes + scales, or fp32; steps excluded): what is held now,
        plus what the first step will allocate for parameters that have no state yet (so it is
        meaningful right after construction)."""
        total = 0
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    total += self._planned_bytes(p, group)
                    continue
                for key, value in state.items():
                    if key == "step" or not torch.is_tensor(value):
                        continue
                    value = _local(value)  # FSDP: this rank's shard
                    total += value.nbytes_stored() if isinstance(value, FP8Tensor) else value.numel() * value.element_size()
        return total

    def state_bytes_per_param(self) -> float:
        """state_bytes() / number of parameters."""
        n = sum(_local(p).numel() for g in self.param_groups for p in g["params"])
        return self.state_bytes() / n if n else 0.0

    def fp32_states(self) -> dict[str, tuple[int, int]]:
        """Why parameters keep fp32 state: reason -> (tensors, params). Empty when all are FP8."""
        kept: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for group in self.param_groups:
            for p in group["params"]:
                if not self._uses_fp8(p, group):
                    reason = "SGD without momentum (no state)" if self.is_sgd and group["momentum"] == 0 \
                        else self._fp8_reason(p)
                    kept[reason][0] += 1
                    kept[reason][1] += p.numel()
        return {reason: (n, numel) for reason, (n, numel) in kept.items()}

    def summary(self) -> str:
        kind = type(self.optimizer).__name__
        n_fp8 = b_fp8 = 0
        for group in self.param_groups:
            for p in group["params"]:
                if self._uses_fp8(p, group):
                    n_fp8 += 1
                    b_fp8 += p.numel()
        kept = self.fp32_states()
        moments = 1 if self.is_sgd else 2
        fp8_moments = min(self.opt_level, moments)
        per_param = fp8_moments * (1 + 4 / self.block_size) + (moments - fp8_moments) * 4
        lines = [f"FP8Optim({kind}, opt_level={self.opt_level}, block_size={self.block_size}): "
                 f"{n_fp8} tensors / {b_fp8:,} params with FP8 state "
                 f"({per_param:.3f} bytes/param of moments)"]
        for reason, (n, numel) in kept.items():
            lines.append(f"  fp32 state: {n} tensors / {numel:,} params "
                         f"({format_bytes(numel * 4 * moments)}): {reason}")
        return "\n".join(lines)
