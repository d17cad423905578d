/* Native CPU loops of the codecs whose compiled torch form is compute-bound: QSGD, TernGrad,
 * natural compression, and the candidate scan of the sparsifiers.
 *
 * Each function computes the operations of its codec's torch function (quant.py, sparse.py)
 * in the same order and in the same IEEE single precision: the library is built with
 * -ffp-contract=off and without fast-math, so the bytes equal those of the eager torch run
 * (tests/test_native.py compares them). Codes are written in the word layout of fused.fold:
 * a row of G elements is cut into P column slices of W = G / P columns, and word j of an
 * output's piece holds the codes of its slices at column j, the first in the lowest bits.
 *
 * The loops take 8 columns at a time in GCC/Clang vector types (one AVX2 register, two SSE
 * ones): a chunk reads column j..j+7 of every slice and writes words j..j+7 of every piece.
 * QSGD's columns left over at the end of a row (W not a multiple of 8) go through the same
 * chunk function on a zero-padded copy; TernGrad's and natural compression's rows (G = 8192)
 * always hold whole chunks.
 */
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#define LANES 8

typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(32)));

#define SPLAT(T, a) ((T){(a), (a), (a), (a), (a), (a), (a), (a)})

static const vu IOTA = {0, 1, 2, 3, 4, 5, 6, 7};

INLINE vf load_f(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE vu load_u(const uint32_t *p) {
    vu v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE void store_f(float *p, vf v) { memcpy(p, &v, sizeof v); }
INLINE void store_u(uint32_t *p, vu v) { memcpy(p, &v, sizeof v); }

#if defined(__AVX__)
#include <immintrin.h>
/* where mask (all ones or zeros per lane) take a, else b */
INLINE vf select_f(vi mask, vf a, vf b) { return (vf)_mm256_blendv_ps((__m256)b, (__m256)a, (__m256)mask); }
/* one bit per lane of a comparison result */
INLINE uint32_t lane_bits(vi mask) { return (uint32_t)_mm256_movemask_ps((__m256)mask); }
#else
INLINE vf select_f(vi mask, vf a, vf b) { return (vf)(((vu)mask & (vu)a) | (~(vu)mask & (vu)b)); }
INLINE uint32_t lane_bits(vi mask) {
    uint32_t out = 0;
    for (int l = 0; l < LANES; l++) out |= (uint32_t)(mask[l] != 0) << l;
    return out;
}
#endif

INLINE vf abs_f(vf v) { return (vf)((vu)v & SPLAT(vu, 0x7FFFFFFFu)); }

/* dither.hashed_dither: lowbias32 of position + key_low with key_high mixed in, high 16 bits. */
INLINE vu dither16(vu position, uint32_t key_low, uint32_t key_high) {
    vu h = position + SPLAT(vu, key_low);
    h ^= h >> 16;
    h = (h * SPLAT(vu, 0x7FEB352Du)) ^ SPLAT(vu, key_high);
    h ^= h >> 15;
    h *= SPLAT(vu, 0x846CA68Bu);
    return h >> 16;
}

/* dither + 0.5 as floats, as the quantizers add it */
INLINE vf dither_f(vu position, uint32_t key_low, uint32_t key_high) {
    return __builtin_convertvector((vi)dither16(position, key_low, key_high), vf) + SPLAT(vf, 0.5f);
}

/* max |x| over n floats, NaN if any is NaN (torch's amax). Four running maxima, so that the
 * loop is not bound by the latency of one compare-and-select chain. */
static float abs_max(const float *x, int64_t n) {
    vf top[4] = {SPLAT(vf, 0.0f), SPLAT(vf, 0.0f), SPLAT(vf, 0.0f), SPLAT(vf, 0.0f)};
    vi nan = SPLAT(vi, 0);
    int64_t i = 0;
    for (; i + 4 * LANES <= n; i += 4 * LANES) {
        for (int k = 0; k < 4; k++) {
            const vf a = abs_f(load_f(x + i + k * LANES));
            top[k] = select_f(a > top[k], a, top[k]);
            nan |= a != a;
        }
    }
    for (; i + LANES <= n; i += LANES) {
        const vf a = abs_f(load_f(x + i));
        top[0] = select_f(a > top[0], a, top[0]);
        nan |= a != a;
    }
    float best = 0.0f;
    int any_nan = 0;
    for (int k = 0; k < 4; k++) {
        for (int l = 0; l < LANES; l++) best = top[k][l] > best ? top[k][l] : best;
    }
    for (int l = 0; l < LANES; l++) any_nan |= nan[l] != 0;
    for (; i < n; i++) {
        const float a = x[i] < 0.0f ? -x[i] : x[i];
        best = a > best ? a : best;
        any_nan |= a != a;
    }
    return any_nan ? __builtin_nanf("") : best;
}

/* max |x| of n floats, exported (TernGrad without clipping) */
float gz_abs_max(const float *x, int64_t n) { return abs_max(x, n); }

/* ---- QSGD, norm=max (qsgd._qsgd_params, _qsgd_encoder, _qsgd_decoder) ---------------------- */

/* 32 slices of W = G / 32 columns; signs one piece, levels `bits` pieces. */
INLINE void qsgd_chunk(const float *x, int64_t stride, vu position, uint32_t slice_span, float inverse, float L,
                       const int bits, uint32_t key_low, uint32_t key_high, uint32_t *signs, uint32_t *codes,
                       int64_t out_stride) {
    vu negative = SPLAT(vu, 0);
    vu piece[8];
    for (int p = 0; p < 8; p++) piece[p] = SPLAT(vu, 0);
#pragma GCC unroll 32
    for (int s = 0; s < 32; s++) {
        const vf v = load_f(x + s * stride);
        negative |= ((vu)(v < SPLAT(vf, 0.0f)) & SPLAT(vu, 1u)) << s;
        const vf dither = dither_f(position + SPLAT(vu, (uint32_t)s * slice_span), key_low, key_high);
        const vf units = abs_f(v) * SPLAT(vf, inverse) + dither;
        vf level = units * SPLAT(vf, 1.0f / 65536.0f);
        level = select_f(level > SPLAT(vf, L), SPLAT(vf, L), level);
        piece[s % bits] |= (vu)__builtin_convertvector(level, vi) << ((s / bits) * bits);
    }
    store_u(signs, negative);
    for (int p = 0; p < bits; p++) store_u(codes + p * out_stride, piece[p]);
}

INLINE void qsgd_encode_rows(const float *restrict x, int64_t rows, int64_t G, int32_t levels, const int bits,
                             uint32_t first, uint32_t key_low, uint32_t key_high, uint32_t *restrict signs,
                             uint32_t *restrict codes, float *restrict scales) {
    const int64_t W = G / 32;
    const float L = (float)levels;
    const float tiny = 1.1754943508222875e-38f * 1024.0f;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * G;
        const float scale = abs_max(xr, G);
        scales[r] = scale;
        /* torch computes a number over a tensor as the reciprocal times the number */
        float inverse = scale >= tiny ? (1.0f / (scale > tiny ? scale : tiny)) * L : 0.0f;
        inverse = inverse * 65536.0f;
        const vu base = SPLAT(vu, first + (uint32_t)(r * G)) + IOTA;
        uint32_t *sr = signs + r * W;
        uint32_t *cr = codes + r * W * bits;
        int64_t j = 0;
        for (; j + LANES <= W; j += LANES)
            qsgd_chunk(xr + j, W, base + SPLAT(vu, (uint32_t)j), (uint32_t)W, inverse, L, bits, key_low, key_high,
                       sr + j, cr + j, W);
        if (j < W) {
            float tx[32 * LANES] = {0};
            uint32_t ts[LANES], tc[8 * LANES];
            const int64_t rem = W - j;
            for (int s = 0; s < 32; s++) memcpy(tx + s * LANES, xr + s * W + j, rem * sizeof(float));
            qsgd_chunk(tx, LANES, base + SPLAT(vu, (uint32_t)j), (uint32_t)W, inverse, L, bits, key_low, key_high, ts,
                       tc, LANES);
            memcpy(sr + j, ts, rem * sizeof(uint32_t));
            for (int p = 0; p < bits; p++) memcpy(cr + p * W + j, tc + p * LANES, rem * sizeof(uint32_t));
        }
    }
}

void gz_qsgd_encode(const float *x, int64_t rows, int64_t G, int32_t levels, int32_t bits, uint32_t first,
                    uint32_t key_low, uint32_t key_high, uint32_t *signs, uint32_t *codes, float *scales) {
    switch (bits) {
    case 1: qsgd_encode_rows(x, rows, G, levels, 1, first, key_low, key_high, signs, codes, scales); break;
    case 2: qsgd_encode_rows(x, rows, G, levels, 2, first, key_low, key_high, signs, codes, scales); break;
    case 4: qsgd_encode_rows(x, rows, G, levels, 4, first, key_low, key_high, signs, codes, scales); break;
    default: qsgd_encode_rows(x, rows, G, levels, 8, first, key_low, key_high, signs, codes, scales); break;
    }
}

INLINE void qsgd_decode_chunk(const uint32_t *signs, const uint32_t *codes, int64_t code_stride, float step,
                              float scale, const int bits, float *out, int64_t out_stride) {
    const vu negative = load_u(signs);
    const vu mask = SPLAT(vu, (1u << bits) - 1u);
#pragma GCC unroll 32
    for (int s = 0; s < 32; s++) {
        const vu level = (load_u(codes + (s % bits) * code_stride) >> ((s / bits) * bits)) & mask;
        const vf m = __builtin_convertvector((vi)level, vf) * SPLAT(vf, step);
        const vi is_negative = (vi)((negative >> s) & SPLAT(vu, 1u)) != SPLAT(vi, 0);
        store_f(out + s * out_stride, select_f(is_negative, -m, m) * SPLAT(vf, scale));
    }
}

INLINE void qsgd_decode_rows(const uint32_t *restrict signs, const uint32_t *restrict codes,
                             const float *restrict scales, int64_t rows, int64_t G, int32_t levels, const int bits,
                             float *restrict out) {
    const int64_t W = G / 32;
    const float step = (float)(1.0 / (double)levels);
    for (int64_t r = 0; r < rows; r++) {
        const uint32_t *sr = signs + r * W;
        const uint32_t *cr = codes + r * W * bits;
        float *orow = out + r * G;
        int64_t j = 0;
        for (; j + LANES <= W; j += LANES) qsgd_decode_chunk(sr + j, cr + j, W, step, scales[r], bits, orow + j, W);
        if (j < W) {
            uint32_t ts[LANES] = {0}, tc[8 * LANES] = {0};
            float to[32 * LANES];
            const int64_t rem = W - j;
            memcpy(ts, sr + j, rem * sizeof(uint32_t));
            for (int p = 0; p < bits; p++) memcpy(tc + p * LANES, cr + p * W + j, rem * sizeof(uint32_t));
            qsgd_decode_chunk(ts, tc, LANES, step, scales[r], bits, to, LANES);
            for (int s = 0; s < 32; s++) memcpy(orow + s * W + j, to + s * LANES, rem * sizeof(float));
        }
    }
}

void gz_qsgd_decode(const uint32_t *signs, const uint32_t *codes, const float *scales, int64_t rows, int64_t G,
                    int32_t levels, int32_t bits, float *out) {
    switch (bits) {
    case 1: qsgd_decode_rows(signs, codes, scales, rows, G, levels, 1, out); break;
    case 2: qsgd_decode_rows(signs, codes, scales, rows, G, levels, 2, out); break;
    case 4: qsgd_decode_rows(signs, codes, scales, rows, G, levels, 4, out); break;
    default: qsgd_decode_rows(signs, codes, scales, rows, G, levels, 8, out); break;
    }
}

/* ---- TernGrad (terngrad._terngrad_encoder, _terngrad_decoder): 2-bit codes, 16 slices ---------- */

void gz_terngrad_encode(const float *restrict x, int64_t rows, int64_t G, float factor, float bound, uint32_t first,
                        uint32_t key_low, uint32_t key_high, uint32_t *restrict codes, float *restrict row_max) {
    const int64_t W = G / 16;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * G;
        vf top = SPLAT(vf, 0.0f);
        vi nan = SPLAT(vi, 0);
        uint32_t *cr = codes + r * W;
        const vu base = SPLAT(vu, first + (uint32_t)(r * G)) + IOTA;
        /* slice by slice: the input is read in order, the row's words stay in cache */
#pragma GCC unroll 16
        for (int s = 0; s < 16; s++) {
            for (int64_t j = 0; j + LANES <= W; j += LANES) {
                const vf v = load_f(xr + s * W + j);
                const vf a = abs_f(v);
                top = select_f(a > top, a, top);
                nan |= a != a;
                /* torch.minimum(|g|, bound): NaN stays NaN */
                const vf m = select_f(a > SPLAT(vf, bound), SPLAT(vf, bound), a);
                const vf dither = dither_f(base + SPLAT(vu, (uint32_t)(s * W + j)), key_low, key_high);
                const vu keep = (vu)(dither < m * SPLAT(vf, factor)) & SPLAT(vu, 1u);
                const vu negative = (vu)(v < SPLAT(vf, 0.0f)) & SPLAT(vu, 1u);
                const vu code = (keep << negative) << (2 * s);
                store_u(cr + j, s ? load_u(cr + j) | code : code);
            }
        }
        if (row_max) {
            float best = 0.0f;
            int any_nan = 0;
            for (int l = 0; l < LANES; l++) {
                best = top[l] > best ? top[l] : best;
                any_nan |= nan[l] != 0;
            }
            row_max[r] = any_nan ? __builtin_nanf("") : best;
        }
    }
}

void gz_terngrad_decode(const uint32_t *restrict codes, int64_t rows, int64_t G, float scaler, float *restrict out) {
    const int64_t W = G / 16;
    for (int64_t r = 0; r < rows; r++) {
#pragma GCC unroll 16
        for (int s = 0; s < 16; s++) {
            for (int64_t j = 0; j + LANES <= W; j += LANES) {
                const vu code = (load_u(codes + r * W + j) >> (2 * s)) & SPLAT(vu, 3u);
                const vf value = select_f((vi)(code == SPLAT(vu, 1u)), SPLAT(vf, scaler),
                                          select_f((vi)(code == SPLAT(vu, 2u)), SPLAT(vf, -scaler), SPLAT(vf, 0.0f)));
                store_f(out + r * G + s * W + j, value);
            }
        }
    }
}

/* ---- natural compression, fp32 (natural._natural_encoder, _natural_decoder) ------------------- */
/* Signs 1 bit (32 slices, one piece), exponents 8 bits (8 pieces of 4 lanes). */

void gz_natural_encode(const float *restrict x, int64_t rows, int64_t G, uint32_t first, uint32_t key_low,
                       uint32_t key_high, uint32_t *restrict signs, uint32_t *restrict exponents) {
    const int64_t W = G / 32;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * G;
        uint32_t *sr = signs + r * W;
        uint32_t *er = exponents + r * W * 8;
        const vu base = SPLAT(vu, first + (uint32_t)(r * G)) + IOTA;
        /* slice by slice: the input is read in order, the row's words stay in cache */
#pragma GCC unroll 32
        for (int s = 0; s < 32; s++) {
            for (int64_t j = 0; j + LANES <= W; j += LANES) {
                const vu bits = (vu)load_f(xr + s * W + j);
                const vu position = base + SPLAT(vu, (uint32_t)(s * W + j));
                const vu offset = (dither16(position, key_low, key_high) << 7) + SPLAT(vu, 64u);
                /* as in torch: magnitude bits clamped to inf's (NaN's would overflow the sum), an
                 * arithmetic shift, at most 254 */
                vu magnitude = bits & SPLAT(vu, 0x7FFFFFFFu);
                magnitude = (vu)select_f(magnitude > SPLAT(vu, 0x7F800000u), (vf)SPLAT(vu, 0x7F800000u), (vf)magnitude);
                vi exponent = (vi)(magnitude + offset) >> 23;
                exponent = (vi)select_f(exponent > SPLAT(vi, 254), (vf)SPLAT(vi, 254), (vf)exponent);
                const vu negative = (bits >> 31) << s;
                const vu code = (vu)exponent << ((s / 8) * 8);
                uint32_t *piece = er + (s % 8) * W + j;
                store_u(sr + j, s ? load_u(sr + j) | negative : negative);
                store_u(piece, s < 8 ? code : load_u(piece) | code);
            }
        }
    }
}

void gz_natural_decode(const uint32_t *restrict signs, const uint32_t *restrict exponents, int64_t rows, int64_t G,
                       uint32_t *restrict out) {
    const int64_t W = G / 32;
    for (int64_t r = 0; r < rows; r++) {
        /* slice by slice: the output is written in order, the row's codes stay in cache */
#pragma GCC unroll 32
        for (int s = 0; s < 32; s++) {
            for (int64_t j = 0; j + LANES <= W; j += LANES) {
                const vu negative = load_u(signs + r * W + j);
                const vu exponent = (load_u(exponents + r * W * 8 + (s % 8) * W + j) >> ((s / 8) * 8)) & SPLAT(vu, 0xFFu);
                store_u(out + r * G + s * W + j, (exponent << 23) | (((negative >> s) & SPLAT(vu, 1u)) << 31));
            }
        }
    }
}

/* ---- the sparsifiers' candidate scan (sparse.candidates_at_least) ---------------------------- */

/* Writes the positions of the elements with |x| >= threshold (NaN excluded), ascending, and
 * their values into positions and values while there is room (capacity), and returns how
 * many there are. */
int64_t gz_at_least(const float *restrict x, int64_t n, float threshold, int64_t *restrict positions,
                    float *restrict values, int64_t capacity) {
    int64_t count = 0;
    int64_t i = 0;
    const vf t = SPLAT(vf, threshold);
    for (; i + LANES <= n; i += LANES) {
        uint32_t hits = lane_bits(abs_f(load_f(x + i)) >= t);
        while (hits) {
            const int64_t at = i + __builtin_ctz(hits);
            if (count < capacity) {
                positions[count] = at;
                values[count] = x[at];
            }
            count++;
            hits &= hits - 1;
        }
    }
    for (; i < n; i++) {
        const float a = x[i] < 0.0f ? -x[i] : x[i];
        if (a >= threshold) {
            if (count < capacity) {
                positions[count] = i;
                values[count] = x[i];
            }
            count++;
        }
    }
    return count;
}

/* ---- sums in the defined order of sums.py --------------------------------------------------- */

typedef double vd __attribute__((vector_size(32)));
typedef uint64_t vq __attribute__((vector_size(32)));

/* floats p[0..3] as doubles: the values (kind 0), magnitudes (1) or squares (2, exact) */
typedef float vf4 __attribute__((vector_size(16)));

INLINE vd wide4(const float *p, const int kind) {
    vf4 f;
    memcpy(&f, p, sizeof f);
    vd v = __builtin_convertvector(f, vd);
    if (kind == 1) v = (vd)((vq)v & (vq){0x7FFFFFFFFFFFFFFFull, 0x7FFFFFFFFFFFFFFFull, 0x7FFFFFFFFFFFFFFFull, 0x7FFFFFFFFFFFFFFFull});
    if (kind == 2) v = v * v;
    return v;
}

/* Pairwise halves of a row of G floats (G a power of two, >= 64): element i plus element
 * i + G / 2, then i plus i + G / 4, ... The first three levels are added in registers from 8
 * columns of the row G / 8 apart (for column i: y[m] = x[i + m G / 8], then y[m] + y[m + 4],
 * + [m + 2], + [m + 1], the same pairs), the rest in `buffer` (G / 8 doubles). */
INLINE double row_pairwise(const float *restrict x, int64_t G, const int kind, double *restrict buffer) {
    const int64_t span = G / 8;
    for (int64_t i = 0; i + 4 <= span; i += 4) {
        const vd a0 = wide4(x + i, kind) + wide4(x + i + 4 * span, kind);
        const vd a1 = wide4(x + i + span, kind) + wide4(x + i + 5 * span, kind);
        const vd a2 = wide4(x + i + 2 * span, kind) + wide4(x + i + 6 * span, kind);
        const vd a3 = wide4(x + i + 3 * span, kind) + wide4(x + i + 7 * span, kind);
        const vd d = (a0 + a2) + (a1 + a3);
        memcpy(buffer + i, &d, sizeof d);
    }
    for (int64_t half = span / 2; half >= 1; half /= 2) {
        for (int64_t i = 0; i < half; i++) buffer[i] = buffer[i] + buffer[i + half];
    }
    return buffer[0];
}

/* The values' and squares' pairwise sums of rows of G floats in single precision (the same
 * pairs as row_pairwise, 8 lanes wide: sums.py with wide=float32); scratch holds G / 4 floats */
void gz_row_moments_f32(const float *restrict x, int64_t rows, int64_t G, float *restrict sums,
                        float *restrict squares, float *restrict scratch) {
    const int64_t span = G / 8;
    float *first = scratch, *second = scratch + span;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * G;
        for (int64_t i = 0; i + LANES <= span; i += LANES) {
            vf y[8];
            for (int m = 0; m < 8; m++) y[m] = load_f(xr + i + m * span);
            const vf d = ((y[0] + y[4]) + (y[2] + y[6])) + ((y[1] + y[5]) + (y[3] + y[7]));
            const vf e = ((y[0] * y[0] + y[4] * y[4]) + (y[2] * y[2] + y[6] * y[6])) +
                         ((y[1] * y[1] + y[5] * y[5]) + (y[3] * y[3] + y[7] * y[7]));
            store_f(first + i, d);
            store_f(second + i, e);
        }
        for (int64_t half = span / 2; half >= 1; half /= 2) {
            for (int64_t i = 0; i < half; i++) {
                first[i] = first[i] + first[i + half];
                second[i] = second[i] + second[i + half];
            }
        }
        sums[r] = first[0];
        squares[r] = second[0];
    }
}

/* Each row's pairwise sum of kind 0 (values), 1 (magnitudes) or 2 (squares), in double.
 * scratch holds G / 8 doubles. */
void gz_row_sums(const float *restrict x, int64_t rows, int64_t G, int32_t kind, double *restrict sums,
                 double *restrict scratch) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * G;
        switch (kind) {
        case 1: sums[r] = row_pairwise(xr, G, 1, scratch); break;
        case 2: sums[r] = row_pairwise(xr, G, 2, scratch); break;
        default: sums[r] = row_pairwise(xr, G, 0, scratch); break;
        }
    }
}

/* ---- the uniform quantizer (uniform.Uniform: _min_max, _frame_statistics, _uniform_params,
 * _uniform_encoder, _uniform_decode_params, _uniform_decoder) ----------------------------------- */

/* lane-wise minimum and maximum reduced across the 8 lanes (torch's amin/amax for non-NaN) */
INLINE float lanes_min(vf v) {
    v = select_f(__builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3) < v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3), v);
    v = select_f(__builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5) < v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5), v);
    return v[1] < v[0] ? v[1] : v[0];
}

INLINE float lanes_max(vf v) {
    v = select_f(__builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3) > v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3), v);
    v = select_f(__builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5) > v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5), v);
    return v[1] > v[0] ? v[1] : v[0];
}

/* the minimum and maximum of n floats (n a multiple of 16), NaN for both if any is NaN */
INLINE void extremes(const float *restrict x, int64_t n, float *lo_out, float *hi_out) {
    vf lo0 = load_f(x), hi0 = lo0, lo1 = load_f(x + LANES), hi1 = lo1;
    vi odd = (lo0 != lo0) | (lo1 != lo1);
    for (int64_t i = 2 * LANES; i < n; i += 2 * LANES) {
        const vf a = load_f(x + i), b = load_f(x + i + LANES);
        lo0 = select_f(a < lo0, a, lo0);
        hi0 = select_f(a > hi0, a, hi0);
        lo1 = select_f(b < lo1, b, lo1);
        hi1 = select_f(b > hi1, b, hi1);
        odd |= (a != a) | (b != b);
    }
    const int nan = lane_bits(odd) != 0;
    *lo_out = nan ? __builtin_nanf("") : lanes_min(select_f(lo1 < lo0, lo1, lo0));
    *hi_out = nan ? __builtin_nanf("") : lanes_max(select_f(hi1 > hi0, hi1, hi0));
}

/* Per group of G consecutive floats (the last may be shorter): minimum and maximum (zeros as
 * +0.0), both NaN for a group holding a NaN. Groups of whole vectors reduce in two running minima and maxima,
 * then across lanes. */
void gz_min_max(const float *restrict x, int64_t n, int64_t G, float *restrict low, float *restrict high) {
    for (int64_t start = 0, g = 0; start < n; start += G, g++) {
        const int64_t size = n - start < G ? n - start : G;
        const float *xr = x + start;
        float lo, hi;
        int nan = 0;
        if (size % (2 * LANES) == 0) {
            extremes(xr, size, &lo, &hi);
        } else {
            lo = hi = xr[0];
            for (int64_t i = 0; i < size; i++) {
                const float v = xr[i];
                nan |= v != v;
                lo = v < lo ? v : lo;
                hi = v > hi ? v : hi;
            }
        }
        /* zeros as +0.0 (fused._min_max): which zero a tie gives depends on the order */
        low[g] = nan ? __builtin_nanf("") : (lo == 0.0f ? 0.0f : lo);
        high[g] = nan ? __builtin_nanf("") : (hi == 0.0f ? 0.0f : hi);
    }
}

/* _frame_statistics: max(|low|, |high|), then the largest and the smallest nonzero spread
 * high - low in double (inf if none is nonzero); NaN propagates into the maxima. */
void gz_frame(const float *restrict low, const float *restrict high, int64_t n, double *restrict out) {
    double top = 0.0, spread_top = 0.0, spread_bottom = __builtin_inf();
    int nan_top = 0, nan_spread = 0;
    for (int64_t i = 0; i < n; i++) {
        const double lo = low[i], hi = high[i];
        const double a = lo < 0 ? -lo : lo, b = hi < 0 ? -hi : hi;
        nan_top |= a != a || b != b;
        top = a > top ? a : top;
        top = b > top ? b : top;
        double spread = hi - lo;
        spread = spread < 0 ? -spread : spread;
        nan_spread |= spread != spread;
        spread_top = spread > spread_top ? spread : spread_top;
        if (spread > 0 && spread < spread_bottom) spread_bottom = spread;
    }
    out[0] = nan_top ? __builtin_nan("") : top;
    out[1] = nan_spread ? __builtin_nan("") : spread_top;
    out[2] = spread_bottom;
}

/* _uniform_params in fp32: per group, the offset and the inverse step (in units of 1 / unit) */
void gz_uniform_params(const float *restrict low, const float *restrict high, int64_t n, float prescale, int32_t steps,
                       float unit, int32_t nearest, float *restrict offset, float *restrict inverse) {
    const float tiny = 1.1754943508222875e-38f * 1024.0f;
    for (int64_t i = 0; i < n; i++) {
        const float low_w = low[i] * prescale, high_w = high[i] * prescale;
        const float spread = high_w - low_w;
        /* torch computes a number over a tensor as the reciprocal times the number */
        float inv = spread >= tiny ? (1.0f / (spread > tiny ? spread : tiny)) * (float)steps : 0.0f;
        inv = inv * unit;
        float off = -low_w * inv;
        if (nearest) off = off + 0.5f;
        offset[i] = off;
        inverse[i] = inv;
    }
}

/* _uniform_decode_params in fp32: per group, the prescaled minimum, step and maximum */
void gz_uniform_decode_params(const float *restrict low, const float *restrict high, int64_t n, float prescale,
                              int32_t steps, float *restrict low_w, float *restrict step, float *restrict high_w) {
    for (int64_t i = 0; i < n; i++) {
        const float lo = low[i] * prescale, hi = high[i] * prescale;
        low_w[i] = lo;
        step[i] = (hi - lo) / (float)steps;
        high_w[i] = hi;
    }
}

/* _uniform_encoder: rows of G elements, `bits`-bit codes in one output of 32 / bits lanes
 * (W = G * bits / 32 columns per lane, a multiple of 8). */
INLINE void uniform_encode_rows(const float *restrict x, int64_t rows, int64_t G, float prescale,
                                const float *restrict offset, const float *restrict inverse, int32_t steps,
                                const int bits, const int stochastic, uint32_t first, uint32_t key_low,
                                uint32_t key_high, uint32_t *restrict codes) {
    const int lanes = 32 / bits;
    const int64_t W = G / lanes;
    const float unit = stochastic ? 65536.0f : 1.0f;
    const vf top = SPLAT(vf, (float)((double)(steps + 1) * (double)unit - 1.0));
    const vf scale = SPLAT(vf, stochastic ? 1.0f / 65536.0f : 1.0f);
    const vf zero = SPLAT(vf, 0.0f);
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * G;
        uint32_t *cr = codes + r * W;
        const vf pre = SPLAT(vf, prescale), inv = SPLAT(vf, inverse[r]), off = SPLAT(vf, offset[r]);
        const vu base = SPLAT(vu, first + (uint32_t)(r * G)) + IOTA;
        for (int64_t j = 0; j + LANES <= W; j += LANES) {
            vu word = SPLAT(vu, 0);
#pragma GCC unroll 32
            for (int l = 0; l < lanes; l++) {
                vf units = (load_f(xr + l * W + j) * pre) * inv + off;
                if (stochastic) units = units + dither_f(base + SPLAT(vu, (uint32_t)(l * W + j)), key_low, key_high);
                /* clamp(0, top): NaN stays NaN */
                units = select_f(units < zero, zero, units);
                units = select_f(units > top, top, units);
                word |= (vu)__builtin_convertvector(units * scale, vi) << (l * bits);
            }
            store_u(cr + j, word);
        }
    }
}

void gz_uniform_encode(const float *x, int64_t rows, int64_t G, float prescale, const float *offset,
                       const float *inverse, int32_t steps, int32_t bits, int32_t stochastic, uint32_t first,
                       uint32_t key_low, uint32_t key_high, uint32_t *codes) {
#define UNIFORM_ENCODE(B, S) \
    uniform_encode_rows(x, rows, G, prescale, offset, inverse, steps, B, S, first, key_low, key_high, codes)
    switch (bits * 2 + (stochastic != 0)) {
    case 2: UNIFORM_ENCODE(1, 0); break;
    case 3: UNIFORM_ENCODE(1, 1); break;
    case 4: UNIFORM_ENCODE(2, 0); break;
    case 5: UNIFORM_ENCODE(2, 1); break;
    case 8: UNIFORM_ENCODE(4, 0); break;
    case 9: UNIFORM_ENCODE(4, 1); break;
    case 16: UNIFORM_ENCODE(8, 0); break;
    default: UNIFORM_ENCODE(8, 1); break;
    }
#undef UNIFORM_ENCODE
}

/* _uniform_decoder. The fp32 path runs only for finite group extremes (the frame check), so
 * the clamp to [min, max] meets no NaN and a plain compare-and-select is torch's
 * maximum/minimum. */
INLINE void uniform_decode_rows(const uint32_t *restrict codes, int64_t rows, int64_t G, const float *restrict low_w,
                                const float *restrict step, const float *restrict high_w, float unscale,
                                const int bits, float *restrict out) {
    const int lanes = 32 / bits;
    const int64_t W = G / lanes;
    const vu mask = SPLAT(vu, (1u << bits) - 1u);
    for (int64_t r = 0; r < rows; r++) {
        const uint32_t *cr = codes + r * W;
        float *orow = out + r * G;
        const vf lo = SPLAT(vf, low_w[r]), hi = SPLAT(vf, high_w[r]), st = SPLAT(vf, step[r]), un = SPLAT(vf, unscale);
        for (int64_t j = 0; j + LANES <= W; j += LANES) {
            const vu word = load_u(cr + j);
#pragma GCC unroll 32
            for (int l = 0; l < lanes; l++) {
                const vu code = (word >> (l * bits)) & mask;
                vf v = __builtin_convertvector((vi)code, vf) * st + lo;
                v = select_f(v > lo, v, lo);
                v = select_f(v < hi, v, hi);
                store_f(orow + l * W + j, v * un);
            }
        }
    }
}

void gz_uniform_decode(const uint32_t *codes, int64_t rows, int64_t G, const float *low_w, const float *step,
                       const float *high_w, float unscale, int32_t bits, float *out) {
    switch (bits) {
    case 1: uniform_decode_rows(codes, rows, G, low_w, step, high_w, unscale, 1, out); break;
    case 2: uniform_decode_rows(codes, rows, G, low_w, step, high_w, unscale, 2, out); break;
    case 4: uniform_decode_rows(codes, rows, G, low_w, step, high_w, unscale, 4, out); break;
    default: uniform_decode_rows(codes, rows, G, low_w, step, high_w, unscale, 8, out); break;
    }
}

/* ---- the sign codecs with one scale (sign._nonnegative, sign._signed_scale, mean_magnitude) --- */

/* Sign bits (x >= 0: 1, below zero and NaN: 0) of rows of G elements in 32 slices of W = G / 32
 * columns, one piece; and each row's sum of |x| in the order of sums.py (the row read from
 * cache the second time). scratch holds G / 8 doubles. */
void gz_sign_encode(const float *restrict x, int64_t rows, int64_t G, uint32_t *restrict signs,
                    double *restrict row_sums, double *restrict scratch) {
    const int64_t W = G / 32;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * G;
        uint32_t *sr = signs + r * W;
#pragma GCC unroll 32
        for (int s = 0; s < 32; s++) {
            for (int64_t j = 0; j + LANES <= W; j += LANES) {
                const vu bit = ((vu)(load_f(xr + s * W + j) >= SPLAT(vf, 0.0f)) & SPLAT(vu, 1u)) << s;
                store_u(sr + j, s ? load_u(sr + j) | bit : bit);
            }
        }
        row_sums[r] = row_pairwise(xr, G, 1, scratch);
    }
}

/* (2 b - 1) * scale for the sign bits of rows of G elements */
void gz_sign_decode(const uint32_t *restrict signs, int64_t rows, int64_t G, float scale, float *restrict out) {
    const int64_t W = G / 32;
    for (int64_t r = 0; r < rows; r++) {
#pragma GCC unroll 32
        for (int s = 0; s < 32; s++) {
            for (int64_t j = 0; j + LANES <= W; j += LANES) {
                const vu bit = (load_u(signs + r * W + j) >> s) & SPLAT(vu, 1u);
                const vf unit = __builtin_convertvector((vi)bit, vf) * SPLAT(vf, 2.0f) - SPLAT(vf, 1.0f);
                store_f(out + r * G + s * W + j, unit * SPLAT(vf, scale));
            }
        }
    }
}

/* Peeling of a count sketch, round by round as gradzip.compressors.countsketch.peel does it in
   torch, and bit-identical to it: a round reads every open coordinate's cells (counts as they
   were at the round's start), takes the first row whose cell holds that coordinate alone,
   reads every peeled value from the remainders as they were at the round's start, then takes
   the peeled values out of their cells row by row, each row in the order of the coordinates
   (the order of torch's index_add_ over the rows x peeled cells), with the same double
   arithmetic: rest + (-(sign * value)).
   cells, signs: rows x n (flat cell ids, +-1.0); rest, counts: the table's cells (changed);
   values: n (written where peeled); open: n (in: ignored; out: the coordinates left open, in
   ascending order); pick, row: n each, scratch. Returns how many coordinates are left open. */
int64_t gz_peel(const int64_t *restrict cells, const double *restrict signs, int64_t rows, int64_t n,
                double *restrict rest, int32_t *restrict counts, double *restrict values,
                int64_t *restrict open, int64_t *restrict pick, int64_t *restrict row) {
    for (int64_t c = 0; c < n; c++) open[c] = c;
    int64_t left = n;
    while (left > 0) {
        int64_t picked = 0, kept = 0;
        for (int64_t j = 0; j < left; j++) {
            const int64_t c = open[j];
            int64_t first = -1;
            for (int64_t r = 0; r < rows; r++) {
                if (counts[cells[r * n + c]] == 1) { first = r; break; }
            }
            if (first >= 0) { pick[picked] = c; row[picked] = first; picked++; }
            else open[kept++] = c;  /* kept <= j: the list compacts in place, order kept */
        }
        if (picked == 0) break;
        for (int64_t j = 0; j < picked; j++) {
            const int64_t c = pick[j], r = row[j];
            values[c] = signs[r * n + c] * rest[cells[r * n + c]];
        }
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t j = 0; j < picked; j++) {
                const int64_t c = pick[j], cell = cells[r * n + c];
                rest[cell] = rest[cell] + (-(signs[r * n + c] * values[c]));
                counts[cell] -= 1;
            }
        }
        left = kept;
    }
    return left;
}

/* The count sketch's hashes (gradzip.compressors.countsketch.Hashes.cells), the same integers:
   for each row r, the degree-3 polynomials of coeffs[r][0..3] (the column) and coeffs[r][4..7]
   (the sign) at i = index mod p by Horner, reduced mod p = 2^31 - 1 after every step (each
   product stays below 2^62); column = value mod ncols, sign = +1.0f for an odd value, -1.0f
   for an even one. index: n non-negative coordinates; cols: rows x n; signs: rows x n. */
void gz_hash_cells(const int64_t *restrict coeffs, int64_t rows, const int64_t *restrict index, int64_t n,
                   int64_t ncols, int64_t *restrict cols, float *restrict signs) {
    const int64_t p = 2147483647;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t *c = coeffs + 8 * r;
        for (int64_t j = 0; j < n; j++) {
            const int64_t i = index[j] % p;
            int64_t h = c[0], g = c[4];
            for (int t = 1; t < 4; t++) {
                h = (h * i + c[t]) % p;
                g = (g * i + c[4 + t]) % p;
            }
            cols[r * n + j] = h % ncols;
            signs[r * n + j] = (g & 1) ? 1.0f : -1.0f;
        }
    }
}
