/* e^x on VL float32 lanes in plain vector arithmetic (GCC vector extensions): Cephes' expf
 * polynomial on r = x - n ln 2, scaled by 2^n; relative error ~2e-7 (a couple of float32 ulps,
 * where libm's expf and torch's vectorised exp are within one). x below -87 gives e^-87
 * (~1.6e-38: nothing a softmax weight or 1 + e^x can tell from 0), x above ln(FLT_MAX) gives
 * +inf, NaN stays NaN. Both kernels use it: softmax weights (x <= 0) and SiLU. */
#ifndef PODIUM_FAST_EXP_H
#define PODIUM_FAST_EXP_H

#include <stdint.h>
#include <string.h>

#include "bf16.h"

#if VL == 16
#include <immintrin.h>
/* a * b + c rounded once: explicit, so the polynomial gets FMAs where -ffp-contract=off forbids them */
#define FMAV(a, b, c) ((vf)_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(c)))
#else
#define FMAV(a, b, c) ((a) * (b) + (c))
#endif

typedef int32_t vi __attribute__((vector_size(4 * VL)));

#define EXP_LO (-87.f)
#define EXP_HI 88.72283935546875f /* ln(FLT_MAX) */

/* lanes of a where mask is set (all ones), else lanes of b */
static inline vf selectv(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }

/* min / max where a NaN in a gives b (vminps / vmaxps, one instruction each with AVX-512) */
#if VL == 16
static inline vf minv(vf a, vf b) { return (vf)_mm512_min_ps((__m512)a, (__m512)b); }
static inline vf maxv(vf a, vf b) { return (vf)_mm512_max_ps((__m512)a, (__m512)b); }
#else
static inline vf minv(vf a, vf b) { return selectv(a < b, a, b); }
static inline vf maxv(vf a, vf b) { return selectv(a > b, a, b); }
#endif

static inline vf expv(vf x) {
    const vf zero = {0};
    const vf xc = maxv(minv(x, zero + EXP_HI), zero + EXP_LO); /* NaN -> EXP_HI, fixed below */
    /* n = round(xc / ln 2): adding then subtracting 1.5 * 2^23 rounds to an integer (|xc / ln 2| < 2^22) */
    const vf magic = zero + 12582912.f;
    const vf n = FMAV(xc, zero + 1.44269504088896341f, magic) - magic;
    const vf r = FMAV(n, zero + 2.12194440e-4f, FMAV(n, zero - 0.693359375f, xc)); /* xc - n ln 2, two parts */
    vf p = zero + 1.9875691500e-4f;
    p = FMAV(p, r, zero + 1.3981999507e-3f);
    p = FMAV(p, r, zero + 8.3334519073e-3f);
    p = FMAV(p, r, zero + 4.1665795894e-2f);
    p = FMAV(p, r, zero + 1.6666665459e-1f);
    p = FMAV(p, r, zero + 5.0000001201e-1f);
    p = FMAV(p * r, r, r) + 1.f;
#if VL == 16
    /* p 2^n in one instruction (vscalefps: the exact product, rounded once, as the two factors below) */
    const vf result = (vf)_mm512_scalef_ps((__m512)p, (__m512)n);
#else
    /* 2^n as two normal factors: n runs from -126 to 128, past the float exponent range at the top */
    const vi ni = __builtin_convertvector(n, vi), n1 = ni >> 1, n2 = ni - n1;
    const vi b1 = (n1 + 127) << 23, b2 = (n2 + 127) << 23;
    const vf result = p * (vf)b1 * (vf)b2;
#endif
    /* above EXP_HI: x * inf = inf; NaN: x * inf = NaN */
    return selectv(~(x <= zero + EXP_HI), x * __builtin_inff(), result);
}

#endif
