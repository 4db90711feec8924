/* A 16 x 16 transpose of 32-bit words in AVX-512 registers: v[i] lane j <- v[j] lane i. 32-bit
 * interleaves, then 64-bit ones, then two rounds of 128-bit lane shuffles: 64 shuffles for 1 KiB,
 * where gathering the columns (vpgatherdd) or scattering the rows costs a load or store a word. */
#ifndef PODIUM_TRANSPOSE_H
#define PODIUM_TRANSPOSE_H

#ifdef __AVX512F__
#include <immintrin.h>

static inline void transpose16_words(__m512i v[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* b[4i + c], lane l: word 4l + c of rows 4i .. 4i + 3 */
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) { /* word 4l + c: lane l of b[c], b[4 + c], b[8 + c], b[12 + c] */
        const __m512i e0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44), e1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xEE);
        const __m512i f0 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44);
        const __m512i f1 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xEE);
        v[c] = _mm512_shuffle_i32x4(e0, f0, 0x88);
        v[4 + c] = _mm512_shuffle_i32x4(e0, f0, 0xDD);
        v[8 + c] = _mm512_shuffle_i32x4(e1, f1, 0x88);
        v[12 + c] = _mm512_shuffle_i32x4(e1, f1, 0xDD);
    }
}
#endif

#endif
