/*
 * CPU kernels of the engine's decode and prefill steps: fused small ops, weight-only
 * int8 / int4 matrix-vector products, and paged attention that reads the KV cache in
 * place. Built by engine/cpu/build.py (gcc -O3, -mavx2 -mfma -mf16c where the CPU has
 * them, AVX-512 VNNI on 256-bit vectors where it has that too, OpenMP from the libgomp that torch has already loaded) and called through
 * ctypes by engine/cpu/ops.py, which checks shapes, dtypes and contiguity first:
 * nothing here validates its arguments.
 *
 * Conventions: activations are float32, row-major, rows of `ld` floats; sizes are
 * element counts; KV caches are [num_slots, num_kv_heads, head_dim] in float32 or
 * bfloat16 (kv_bf16 = 1), slot = block_table[i / block_size] * block_size + i % block_size.
 * `nt` is the number of OpenMP threads a kernel may use (torch's thread count).
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime (the per-op timers) under -std=c11 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CS_AVX2 1
#else
#define CS_AVX2 0
#endif
/* AVX-512 VNNI on 256-bit registers (with AVX512VL): vpdpwssd multiplies int16 pairs and
 * adds them into int32 lanes in one instruction, where AVX2 needs vpmaddwd + vpaddd. The
 * integer sums are the same, so results are bit-identical to the AVX2 path. */
#if CS_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define CS_VNNI 1
#else
#define CS_VNNI 0
#endif

#define CS_EXPORT __attribute__((visibility("default")))

/* ---------------------------------------------------------------- helpers ---- */

/* bfloat16 <-> float32. Round to nearest even, as torch's .to(torch.bfloat16); NaN kept NaN. */
#if CS_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
/* vpdpbusd / vpdpwssd with the 4-byte second operand broadcast from memory inside the
 * instruction ({1toN}): what _mm256_dpbusd_epi32(acc, u, _mm256_set1_epi32(*a)) computes,
 * without a separate broadcast instruction (gcc 12 does not fold it). On the Zen 4 EPYC
 * (512-bit ops as two 256-bit halves) the separate broadcasts, one per product instruction
 * in the 4-bit and int8 tiles, were a large part of their time (docs/benchmarks.md). */
static inline __m256i cs_dpbusd_b(__m256i acc, __m256i u, const void *a) {
    __asm__("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)a));
    return acc;
}
static inline __m512i cs_dpbusd_b512(__m512i acc, __m512i u, const void *a) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)a));
    return acc;
}
static inline __m256i cs_dpwssd_b(__m256i acc, __m256i w, const void *a) {
    __asm__("vpdpwssd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)a));
    return acc;
}
#endif

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* IEEE float16 bits -> float32 (subnormals included; the portable path's scales). */
static inline float half_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    float f;
    if (exp == 0) {
        f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    const uint32_t u = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112u) << 23) | (man << 13));
    memcpy(&f, &u, 4);
    return f;
}

#if CS_AVX2
static inline float hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* 8 bfloat16 at p -> 8 float32. */
static inline __m256 load_bf16x8(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* 8 int8 at p -> 8 float32. */
static inline __m256 load_i8x8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* exp(x) for 8 floats: Cephes' expf polynomial after a base-2 range reduction
 * (relative error about 2e-7 on [-87, 88]); inputs below -87.3 give 0. */
static inline __m256 exp256(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365478515625f);
    __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(underflow, y);
}
#endif

static inline float dot_f32(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float s = 0.f;
#if CS_AVX2
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    s = hsum256(_mm256_add_ps(acc0, acc1));
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* y[i] += a * x[i] */
static inline void axpy_f32(float *y, float a, const float *x, int64_t n) {
    int64_t i = 0;
#if CS_AVX2
    __m256 va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] += a * x[i];
}

static inline void scale_f32(float *y, float a, int64_t n) {
    int64_t i = 0;
#if CS_AVX2
    __m256 va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(va, _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] *= a;
}

/* n elements of a KV row (float32 or bfloat16) -> float32 dst. */
static inline void kv_row_to_f32(float *dst, const void *src, int bf16, int64_t n) {
    if (!bf16) {
        memcpy(dst, src, (size_t)n * 4);
        return;
    }
    const uint16_t *s = (const uint16_t *)src;
    int64_t i = 0;
#if CS_AVX2
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_bf16x8(s + i));
#endif
    for (; i < n; i++) dst[i] = bf16_to_f32(s[i]);
}

static inline void f32_to_kv_row(void *dst, const float *src, int bf16, int64_t n) {
    if (!bf16) {
        memcpy(dst, src, (size_t)n * 4);
        return;
    }
    uint16_t *d = (uint16_t *)dst;
    for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
}

/* 3: AVX2 + FMA + AVX-512 VNNI, 2: AVX2 + FMA, 0: portable C */
CS_EXPORT int cs_simd_level(void) { return CS_VNNI ? 3 : CS_AVX2 ? 2 : 0; }

/* ------------------------------------------------------- elementwise, norms ---- */

/* Residual add and RMSNorm (Zhang & Sennrich 2019), per row of T rows of H floats:
 *   if delta: x += delta (x is the residual stream, updated in place)
 *   out = w * x / sqrt(mean(x^2) + eps)
 * out may not alias x. */
CS_EXPORT void cs_add_rms_norm(float *x, const float *delta, const float *w, float eps, int64_t T, int64_t H,
                               float *out, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (T >= 8)
    for (int64_t t = 0; t < T; t++) {
        float *xr = x + t * H, *o = out + t * H;
        if (delta) axpy_f32(xr, 1.0f, delta + t * H, H);
        float ss = dot_f32(xr, xr, H);
        float r = 1.0f / sqrtf(ss / (float)H + eps);
        for (int64_t i = 0; i < H; i++) o[i] = w[i] * (xr[i] * r);
    }
}

/* SwiGLU's gating: gu is [T, 2I] (gate then up); out[t, i] = silu(gate) * up, [T, I]. */
CS_EXPORT void cs_silu_mul(const float *gu, int64_t T, int64_t I, float *out, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (T >= 8)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int64_t i = 0;
#if CS_AVX2
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* Rotary embeddings (Su et al. 2021, rotate-half layout), in place, on the first
 * `heads` heads of each of T rows (the Q and K heads of fused QKV rows, `ld` floats
 * apart; each head D floats). rope [max_len, 2, D/2] float32: cos then sin at each
 * position; positions [T] int64. D <= 1024. */
CS_EXPORT void cs_rope(float *qkv, int64_t ld, int64_t T, int64_t heads, int64_t D, const float *rope,
                       const int64_t *positions, int nt) {
    const int64_t half = D / 2;
#pragma omp parallel for num_threads(nt) schedule(static) if (T >= 8)
    for (int64_t t = 0; t < T; t++) {
        const float *cs = rope + positions[t] * D, *sn = cs + half;
        for (int64_t h = 0; h < heads; h++) {
            float *x = qkv + t * ld + h * D;
            int64_t i = 0;
#if CS_AVX2
            for (; i + 8 <= half; i += 8) {
                __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + i + half);
                __m256 c = _mm256_loadu_ps(cs + i), s = _mm256_loadu_ps(sn + i);
                _mm256_storeu_ps(x + i, _mm256_fmsub_ps(x1, c, _mm256_mul_ps(x2, s)));
                _mm256_storeu_ps(x + i + half, _mm256_fmadd_ps(x2, c, _mm256_mul_ps(x1, s)));
            }
#endif
            for (; i < half; i++) {
                float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * cs[i] - x2 * sn[i];
                x[i + half] = x2 * cs[i] + x1 * sn[i];
            }
        }
    }
}

/* Write T tokens' K and V rows ([Hkv, D] each, rows ldk / ldv floats apart) to the
 * cache slots slots[t] (caches [num_slots, Hkv, D], float32 or bfloat16). */
static void store_kv(const float *k, int64_t ldk, const float *v, int64_t ldv, const int64_t *slots, int64_t T,
                     int64_t Hkv, int64_t D, void *k_cache, void *v_cache, int kv_bf16, int nt) {
    const int64_t esz = kv_bf16 ? 2 : 4, row = Hkv * D;
#pragma omp parallel for num_threads(nt) schedule(static) if (T >= 64)
    for (int64_t t = 0; t < T; t++) {
        f32_to_kv_row((char *)k_cache + slots[t] * row * esz, k + t * ldk, kv_bf16, row);
        f32_to_kv_row((char *)v_cache + slots[t] * row * esz, v + t * ldv, kv_bf16, row);
    }
}

/* ------------------------------------------------- weight-only int8 linear ---- */

#if CS_AVX2
/* MR activation rows x 4 weight rows, K a multiple of 8: sums[i][j] = x[i] . w[j]. With MR a
 * constant after inlining, the 4 * MR accumulators live in registers. */
static inline __attribute__((always_inline)) void tile_i8(const float *x, int64_t ldx, const int MR,
                                                          const int8_t *w, int64_t K, float sums[4][4]) {
    __m256 a[4][4];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < 4; j++) a[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 w0 = load_i8x8(w + k), w1 = load_i8x8(w + K + k);
        __m256 w2 = load_i8x8(w + 2 * K + k), w3 = load_i8x8(w + 3 * K + k);
        for (int i = 0; i < MR; i++) {
            __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
            a[i][0] = _mm256_fmadd_ps(w0, xv, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(w1, xv, a[i][1]);
            a[i][2] = _mm256_fmadd_ps(w2, xv, a[i][2]);
            a[i][3] = _mm256_fmadd_ps(w3, xv, a[i][3]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < 4; j++) sums[i][j] = hsum256(a[i][j]);
}
#endif

/* y[m, n] = scale[n] * sum_k x[m, k] q[n, k] (+ bias[n]) for M rows of x (ldx floats apart)
 * and N output features; y rows are ldy floats apart. Weights int8 [N, K], one scale per
 * output row (weight-only, as in LLM.int8()'s vector-wise weights; Dettmers et al. 2022).
 * Each weight is read once per call: tiles of 4 weight rows are converted to float32 in
 * registers once and multiplied into up to 3 activation rows at a time. */
CS_EXPORT void cs_linear_i8(const float *x, int64_t ldx, int64_t M, int64_t K, const int8_t *q, const float *scale,
                            const float *bias, int64_t N, float *y, int64_t ldy, int nt) {
    const int64_t NR = 4, ntiles = (N + NR - 1) / NR;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t tile = 0; tile < ntiles; tile++) {
        const int64_t n0 = tile * NR, nn = (N - n0) < NR ? (N - n0) : NR;
        const int8_t *w = q + n0 * K;
        for (int64_t m0 = 0; m0 < M; m0 += 3) {
            const int64_t mm = (M - m0) < 3 ? (M - m0) : 3;
            const float *xm = x + m0 * ldx;
            float sums[4][4] = {{0}};
            int fast = 0;
#if CS_AVX2
            if (nn == NR && K % 8 == 0) {
                fast = 1;
                if (mm == 1) tile_i8(xm, ldx, 1, w, K, sums);
                else if (mm == 2) tile_i8(xm, ldx, 2, w, K, sums);
                else tile_i8(xm, ldx, 3, w, K, sums);
            }
#endif
            for (int64_t i = 0; i < mm; i++) {
                for (int64_t j = 0; j < nn; j++) {
                    float s = sums[i][j];
                    if (!fast) {
                        const float *xr = xm + i * ldx;
                        const int8_t *wr = w + j * K;
                        for (int64_t kk = 0; kk < K; kk++) s += xr[kk] * (float)wr[kk];
                    }
                    float v = s * scale[n0 + j];
                    y[(m0 + i) * ldy + n0 + j] = bias ? v + bias[n0 + j] : v;
                }
            }
        }
    }
}

/* Activations quantized to int16 in blocks of 32 (one float32 scale a block):
 * xq[m, k] = round(x[m, k] / d), d = max |x| over the block / 32767. */
static void quantize_rows_q16(const float *x, int64_t ldx, int64_t M, int64_t K, int16_t *xq, float *xd) {
    const int64_t nb = K / 32;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *src = x + m * ldx + b * 32;
            int16_t *dst = xq + m * K + b * 32;
            float amax = 0.f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(src[i]));
            const float d = amax / 32767.f, id = d > 0.f ? 1.f / d : 0.f;
            xd[m * nb + b] = d;
#if CS_AVX2
            for (int i = 0; i < 32; i += 16) {
                __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + i), _mm256_set1_ps(id)));
                __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + i + 8), _mm256_set1_ps(id)));
                __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, c), 0xD8);
                _mm256_storeu_si256((__m256i *)(dst + i), packed);
            }
#else
            for (int i = 0; i < 32; i++) dst[i] = (int16_t)lrintf(src[i] * id);
#endif
        }
    }
}

/* Int8 weights packed by cs_pack_i8x8: tiles of 8 rows, one record of 256 bytes per tile
 * and block of 32 along K, in which bytes 16 p + 2 j + t hold row j's weight at k = 2 p + t
 * (p in 0..15, t in 0..1). So 16 bytes widened to int16 give, in 32-bit lane j, row j's pair
 * (k = 2p, 2p + 1), and one broadcast pair of int16 activations serves all 8 rows: vpdpwssd
 * (or madd on AVX2) adds each row's two products into its own lane, and the 8 rows' block
 * sums come out in the 8 lanes of one register, scaled by the block's activation scale with
 * one multiply-add for all of them. (Until 2026-12-02: tiles of 4 rows, one register per row
 * and weight row, a conversion and multiply-add per row, weight row and block, and a
 * horizontal sum at the end; the LM head at 16 rows ran at about 150 GFLOP/s on the Zen 4
 * EPYC.) */
#define CS_I8_REC 256
#ifndef CS_I8_AHEAD
#define CS_I8_AHEAD 8 /* records prefetched ahead (a decode step's weights come from memory) */
#endif
#if CS_AVX2 && defined(__AVX512VL__)
#define CS_I8_MR 8 /* activation rows per register tile: an int and a float sum each */
#else
#define CS_I8_MR 6
#endif

#if CS_AVX2
/* MR int16 activation rows x one tile of 8 weight rows: acc[i] lane j = sum over blocks b,
 * in order, of xd[i, b] * S[i, j, b] (one multiply-add), S the block's exact int32 sum of
 * products (|x| <= 32767, |w| <= 127, 32 products: far inside int32). The integer sums do
 * not depend on their order and the float steps are the same on every build (AVX2 madd,
 * VNNI vpdpwssd): bit-identical results. MR is a constant after inlining. */
static inline __attribute__((always_inline)) void tile_i8x8(const int16_t *xq, const float *xd, int64_t K,
                                                            const int MR, const int8_t *w, __m256 acc[CS_I8_MR]) {
    const int64_t nb = K / 32;
    const int NC = MR == 1 ? 4 : MR == 2 ? 2 : 1; /* independent int sums per row */
    for (int i = 0; i < MR; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *wb = w + b * CS_I8_REC;
        for (int o = 0; o < CS_I8_REC; o += 64) _mm_prefetch((const char *)(wb + CS_I8_AHEAD * CS_I8_REC + o), _MM_HINT_T0);
        __m256i s[CS_I8_MR][4];
        for (int p = 0; p < 16; p++) {
            const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wb + 16 * p)));
            const int c = p % NC;
            for (int i = 0; i < MR; i++) {
#if CS_VNNI
                s[i][c] = cs_dpwssd_b(p < NC ? _mm256_setzero_si256() : s[i][c], wv, xq + i * K + b * 32 + 2 * p);
#else
                int32_t a;
                memcpy(&a, xq + i * K + b * 32 + 2 * p, 4);
                const __m256i t = _mm256_madd_epi16(wv, _mm256_set1_epi32(a));
                s[i][c] = p < NC ? t : _mm256_add_epi32(s[i][c], t);
#endif
            }
        }
        for (int i = 0; i < MR; i++) {
            __m256i si = s[i][0];
            for (int c = 1; c < NC; c++) si = _mm256_add_epi32(si, s[i][c]);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), _mm256_set1_ps(xd[i * nb + b]), acc[i]);
        }
    }
}
#endif

/* y[m, n] = scale[n] * sum_k x[m, k] q[n, k] (+ bias[n]), as cs_linear_i8, over a weight
 * packed by cs_pack_i8x8, with the activations first quantized to int16 in blocks of 32
 * (one float32 scale a block: 15 bits of each block's range, a relative error near 2e-5
 * against 5e-3 for int8 activations as in llama.cpp's Q8_0) so that the products run on
 * integer instructions. Scratch xq [M, K] int16 and xd [M, K / 32] float32 come from the
 * caller; K is a multiple of 32. Each thread takes whole tiles of 8 output rows and runs the
 * activation rows through them CS_I8_MR at a time. Every row is computed alone: its result
 * does not depend on M. */
CS_EXPORT void cs_linear_i8_packed(const float *x, int64_t ldx, int64_t M, int64_t K, const int8_t *q,
                                const float *scale, const float *bias, int64_t N, float *y, int64_t ldy, int16_t *xq,
                                float *xd, int nt) {
    quantize_rows_q16(x, ldx, M, K, xq, xd);
    const int64_t ntiles = (N + 7) / 8, nb = K / 32;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t tile = 0; tile < ntiles; tile++) {
        const int64_t n0 = tile * 8, nn = (N - n0) < 8 ? (N - n0) : 8;
        const int8_t *w = q + tile * nb * CS_I8_REC;
        float sc[8] = {0}, bb[8] = {0};
        memcpy(sc, scale + n0, (size_t)nn * 4);
        if (bias) memcpy(bb, bias + n0, (size_t)nn * 4);
        for (int64_t m0 = 0; m0 < M; m0 += CS_I8_MR) {
            const int64_t mm = (M - m0) < CS_I8_MR ? (M - m0) : CS_I8_MR;
            const int16_t *xm = xq + m0 * K;
            const float *dm = xd + m0 * nb;
#if CS_AVX2
            __m256 acc[CS_I8_MR];
            switch (mm) {
            case 1: tile_i8x8(xm, dm, K, 1, w, acc); break;
            case 2: tile_i8x8(xm, dm, K, 2, w, acc); break;
            case 3: tile_i8x8(xm, dm, K, 3, w, acc); break;
            case 4: tile_i8x8(xm, dm, K, 4, w, acc); break;
            case 5: tile_i8x8(xm, dm, K, 5, w, acc); break;
#if CS_I8_MR == 8
            case 6: tile_i8x8(xm, dm, K, 6, w, acc); break;
            case 7: tile_i8x8(xm, dm, K, 7, w, acc); break;
#endif
            default: tile_i8x8(xm, dm, K, CS_I8_MR, w, acc); break;
            }
            for (int64_t i = 0; i < mm; i++) {
                float out[8];
                __m256 v = _mm256_mul_ps(acc[i], _mm256_loadu_ps(sc));
                if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bb));
                _mm256_storeu_ps(out, v);
                memcpy(y + (m0 + i) * ldy + n0, out, (size_t)nn * 4);
            }
#else
            for (int64_t i = 0; i < mm; i++)
                for (int64_t j = 0; j < nn; j++) {
                    float sum = 0.f;
                    for (int64_t b = 0; b < nb; b++) {
                        const int16_t *xr = xm + i * K + b * 32;
                        const int8_t *wb = w + b * CS_I8_REC;
                        int32_t dot = 0;
                        for (int kk = 0; kk < 32; kk++) dot += (int32_t)xr[kk] * (int32_t)wb[16 * (kk / 2) + 2 * j + kk % 2];
                        sum += (float)dot * dm[i * nb + b];
                    }
                    float v = sum * sc[j];
                    y[(m0 + i) * ldy + n0 + j] = bias ? v + bb[j] : v;
                }
#endif
        }
    }
}

/* Pack an int8 weight [N, K] (K a multiple of 32) for cs_linear_i8_packed: out [ceil(N / 8)]
 * [K / 32][256] (the record layout above); rows past N are zero. */
CS_EXPORT void cs_pack_i8x8(const int8_t *q, int64_t N, int64_t K, int8_t *out) {
    const int64_t nb = K / 32, ntiles = (N + 7) / 8;
    memset(out, 0, (size_t)(ntiles * nb * CS_I8_REC));
    for (int64_t t = 0; t < ntiles; t++)
        for (int64_t b = 0; b < nb; b++)
            for (int64_t j = 0; j < 8 && t * 8 + j < N; j++)
                for (int k = 0; k < 32; k++)
                    out[(t * nb + b) * CS_I8_REC + 16 * (k / 2) + 2 * j + k % 2] = q[(t * 8 + j) * K + b * 32 + k];
}

/* Embedding rows of an int8 table: out[t] = q[ids[t]] * scale[ids[t]], [T, K]. */
CS_EXPORT void cs_embed_i8(const int8_t *q, const float *scale, const int64_t *ids, int64_t T, int64_t K, float *out,
                           int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (T >= 64)
    for (int64_t t = 0; t < T; t++) {
        const int8_t *w = q + ids[t] * K;
        const float s = scale[ids[t]];
        for (int64_t k = 0; k < K; k++) out[t * K + k] = (float)w[k] * s;
    }
}

/* ------------------------------------- 4-bit weights, int8 activations ---- */

/* Weights in groups of 32 along K, as ggml's Q4_0 / Q4_1 (llama.cpp):
 *   w[n, k] = d[n, g] * u[n, k] + m[n, g]      g = k / 32, codes u in 0..15
 * with the scale d and the offset m in float16; the symmetric variant stores no m
 * (m = -8 d). cs_pack_q4x8 repacks them at load into tiles of 8 rows, one record per
 * tile and group: 128 bytes of codes, then the 8 rows' d (16 bytes), then their m (16
 * bytes, with offsets). In the codes, byte 32 p + 4 j + i holds row j's code for
 * k = 4 p + i in its low nibble and for k = 16 + 4 p + i in its high nibble (p, i in 0..3).
 * So 32-bit lane j of a 32-byte load holds 4 codes of row j, and one broadcast of 4
 * activations serves all 8 rows: the 8 rows' sums come out in the 8 lanes of one
 * register, ready for their 8 scales (the interleaving of llama.cpp's Q4_0x8 repack).
 *
 * Activations are quantized per row to int8 in blocks of 32 (ggml's Q8_0): a = round(x /
 * e), e = max |x| / 127, and s = e * sum(a) per block. Then, exactly in int32 per block,
 *   sum_k w x ~= sum_g d e (u . a) + m s.
 * The code-activation products run as unsigned x signed bytes: vpdpbusd (AVX-512 VNNI or
 * AVX-VNNI) or _mm256_maddubs_epi16 + _mm256_madd_epi16 (AVX2; eight pair sums of
 * |15 * 127 * 2| stay below 2^15, so they add in int16 before one widening). */
#define CS_Q4_TILE 8
/* Weight records prefetched ahead of the one in use: CS_Q4_AHEAD in the 256-bit tiles (each
 * thread streams one tile at a time), CS_Q4_AHEAD2 in the 512-bit one (two tiles' streams).
 * A decode step's weights come from memory (on the Zen 4 EPYC, 32 MiB of L3 for 95 MB of
 * weights); 8 and 4 records, with one cache line of the 512-bit tile's three, left a batch-16
 * step's projections waiting on it (docs/benchmarks.md). */
#ifndef CS_Q4_AHEAD
#define CS_Q4_AHEAD 16
#endif
#ifndef CS_Q4_AHEAD2
#define CS_Q4_AHEAD2 8
#endif
#define CS_Q4_NC 4 /* most independent int sums per activation row (one or two rows) */
#define CS_Q4_MB 48 /* activation rows per cache block (a multiple of every CS_Q4_MR) */
#define CS_Q4_REC(has_min) ((has_min) ? 160 : 144)

#if CS_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define CS_DPBUSD(acc, u, a) cs_dpbusd_b((acc), (u), (a)) /* a: 4 activation bytes in memory */
#define CS_Q4_DOT 1
#elif CS_AVX2 && defined(__AVXVNNI__)
static inline __m256i cs_dpbusd_avx(__m256i acc, __m256i u, const int8_t *a) {
    int32_t v;
    memcpy(&v, a, 4);
    return _mm256_dpbusd_avx_epi32(acc, u, _mm256_set1_epi32(v));
}
#define CS_DPBUSD(acc, u, a) cs_dpbusd_avx((acc), (u), (a))
#define CS_Q4_DOT 1
#else
#define CS_Q4_DOT 0
#endif
/* activation rows per register tile: each needs an int and a float accumulator (32 ymm
 * registers with AVX-512VL; 16 otherwise: 6 rows on AVX2, whose tile keeps the rest to
 * 4 registers, 4 with AVX-VNNI) */
#if CS_AVX2 && defined(__AVX512VL__)
#define CS_Q4_MR 8
#elif CS_AVX2 && !CS_Q4_DOT
#define CS_Q4_MR 6
#else
#define CS_Q4_MR 4
#endif

/* 2: VNNI byte products (AVX-512 VNNI or AVX-VNNI), 1: AVX2 maddubs, 0: portable C */
CS_EXPORT int cs_q4_level(void) { return CS_Q4_DOT ? 2 : CS_AVX2 ? 1 : 0; }

/* Row-wise int8 quantization of row m of x (K floats, K a multiple of 32), see above:
 * xq [M, K] int8, xd [M, K / 32] scales e, xs [M, K / 32] e * sum(a). */
static void quantize_row_q8(const float *x, int64_t ldx, int64_t m, int64_t K, int8_t *xq, float *xd, float *xs) {
    const int64_t nb = K / 32;
    for (int64_t b = 0; b < nb; b++) {
        const float *src = x + m * ldx + b * 32;
        int8_t *dst = xq + m * K + b * 32;
        float amax = 0.f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(src[i]));
        const float e = amax / 127.f, ie = e > 0.f ? 1.f / e : 0.f;
        int sum = 0;
#if CS_AVX2
        __m256i v[4];
        for (int i = 0; i < 4; i++) v[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + 8 * i),
                                                                           _mm256_set1_ps(ie)));
        __m256i s4 = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
        sum = _mm_cvtsi128_si32(s);
        /* int32 -> int16 -> int8, then undo the lane interleaving of the packs */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)dst, p);
#else
        for (int i = 0; i < 32; i++) {
            dst[i] = (int8_t)lrintf(src[i] * ie);
            sum += dst[i];
        }
#endif
        xd[m * nb + b] = e;
        xs[m * nb + b] = e * (float)sum;
    }
}

#if CS_AVX2 && !CS_Q4_DOT
/* Keep v in a register at this point. Without it gcc regroups a row's int16 sums into a
 * tree (integer adds reassociate), computes all 32 products of a record first and spills
 * most of them to the stack: stores, not arithmetic, then bound the AVX2 tile. */
#define CS_PIN(v) __asm__("" : "+x"(v))
/* MR (up to 6) activation rows x one tile of 8 weight rows on AVX2: acc[i] lane j = sum
 * over k of w[j, k] x[i, k] (before the bias). Registers: MR int16 sums, MR float sums,
 * the codes' two nibble vectors, the nibble mask and one broadcast activation word. The
 * integer sums are exact (their order does not matter) and the float steps are those of
 * every other build, so the results are bit-identical to them. MR and HAS_MIN are
 * constants after inlining. */
static inline __attribute__((always_inline)) void tile_q4(const int8_t *xq, const float *xd, const float *xs,
                                                          int64_t K, const int MR, const uint8_t *w,
                                                          const int HAS_MIN, __m256 out[CS_Q4_MR]) {
    const int64_t nb = K / 32, rec = CS_Q4_REC(HAS_MIN);
    const int NC = MR == 1 ? 4 : MR == 2 ? 2 : 1; /* independent int sums per row */
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[CS_Q4_MR];
    for (int i = 0; i < MR; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = w + b * rec;
        _mm_prefetch((const char *)(wb + CS_Q4_AHEAD * rec), _MM_HINT_T0);
        _mm_prefetch((const char *)(wb + CS_Q4_AHEAD * rec + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(wb + CS_Q4_AHEAD * rec + 128), _MM_HINT_T0);
        __m256i s[CS_Q4_MR][CS_Q4_NC];
        for (int p = 0; p < 4; p++) {
            const __m256i r = _mm256_loadu_si256((const __m256i *)(wb + 32 * p));
            __m256i lo = _mm256_and_si256(r, low4), hi = _mm256_and_si256(_mm256_srli_epi16(r, 4), low4);
            CS_PIN(lo);
            CS_PIN(hi);
            for (int i = 0; i < MR; i++) {
                const int8_t *a = xq + i * K + b * 32 + 4 * p;
                int32_t a0, a1;
                memcpy(&a0, a, 4);
                memcpy(&a1, a + 16, 4);
                const int c0 = (2 * p) % NC, c1 = (2 * p + 1) % NC;
                /* |15 * 127 * 2| per pair, 8 pairs a group: below 2^15 */
                const __m256i t0 = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a0));
                s[i][c0] = 2 * p < NC ? t0 : _mm256_add_epi16(s[i][c0], t0);
                CS_PIN(s[i][c0]);
                const __m256i t1 = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(a1));
                s[i][c1] = 2 * p + 1 < NC ? t1 : _mm256_add_epi16(s[i][c1], t1);
                CS_PIN(s[i][c1]);
            }
        }
        const __m256i ones = _mm256_set1_epi16(1);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + 128)));
        const __m256 mw = HAS_MIN ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + 144)))
                                  : _mm256_mul_ps(dw, _mm256_set1_ps(-8.f));
        for (int i = 0; i < MR; i++) {
            __m256i si = _mm256_madd_epi16(s[i][0], ones);
            for (int c = 1; c < NC; c++) si = _mm256_add_epi32(si, _mm256_madd_epi16(s[i][c], ones));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), _mm256_mul_ps(dw, _mm256_set1_ps(xd[i * nb + b])),
                                     acc[i]);
            acc[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs[i * nb + b]), acc[i]);
        }
    }
    for (int i = 0; i < MR; i++) out[i] = acc[i];
}
#elif CS_AVX2
/* The VNNI builds' tile (AVX-512 VNNI or AVX-VNNI): MR activation rows x one tile of 8
 * weight rows, vpdpbusd accumulating in int32: acc[i] lane j = sum over k of w[j, k] x[i, k]
 * (before the bias). MR and HAS_MIN are constants after inlining. */
static inline __attribute__((always_inline)) void tile_q4(const int8_t *xq, const float *xd, const float *xs,
                                                          int64_t K, const int MR, const uint8_t *w,
                                                          const int HAS_MIN, __m256 acc[CS_Q4_MR]) {
    const int64_t nb = K / 32, rec = CS_Q4_REC(HAS_MIN);
    const int NC = MR == 1 ? 4 : MR == 2 ? 2 : 1; /* independent int sums per row */
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int i = 0; i < MR; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = w + b * rec;
        _mm_prefetch((const char *)(wb + CS_Q4_AHEAD * rec), _MM_HINT_T0);
        _mm_prefetch((const char *)(wb + CS_Q4_AHEAD * rec + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(wb + CS_Q4_AHEAD * rec + 128), _MM_HINT_T0);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + 128)));
        const __m256 mw = HAS_MIN ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + 144)))
                                  : _mm256_mul_ps(dw, _mm256_set1_ps(-8.f));
        /* NC independent sums per row: with one or two rows, a single chain of 8 dependent
         * vpdpbusd per group would wait on their latency (the block's sum is the same) */
        __m256i s[CS_Q4_MR][CS_Q4_NC];
        for (int i = 0; i < MR; i++)
            for (int c = 0; c < NC; c++) s[i][c] = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) {
            const __m256i r = _mm256_loadu_si256((const __m256i *)(wb + 32 * p));
            const __m256i lo = _mm256_and_si256(r, low4), hi = _mm256_and_si256(_mm256_srli_epi16(r, 4), low4);
            for (int i = 0; i < MR; i++) {
                const int8_t *a = xq + i * K + b * 32 + 4 * p;
                const int c0 = (2 * p) % NC, c1 = (2 * p + 1) % NC;
                s[i][c0] = CS_DPBUSD(s[i][c0], lo, a);
                s[i][c1] = CS_DPBUSD(s[i][c1], hi, a + 16);
            }
        }
        for (int i = 0; i < MR; i++) {
            __m256i si = s[i][0];
            for (int c = 1; c < NC; c++) si = _mm256_add_epi32(si, s[i][c]);
            /* the same float steps whatever MR: a row's result does not depend on its group */
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), _mm256_mul_ps(dw, _mm256_set1_ps(xd[i * nb + b])),
                                     acc[i]);
            acc[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs[i * nb + b]), acc[i]);
        }
    }
}

#endif

#if CS_AVX2
static void q4_rows(const int8_t *xq, const float *xd, const float *xs, int64_t K, int64_t mm, const uint8_t *w,
                    int has_min, __m256 acc[CS_Q4_MR]) {
#define CS_Q4_CASE(R)                                                 \
    case R:                                                           \
        if (has_min) tile_q4(xq, xd, xs, K, R, w, 1, acc);            \
        else tile_q4(xq, xd, xs, K, R, w, 0, acc);                    \
        break;
    switch (mm) {
        CS_Q4_CASE(1)
        CS_Q4_CASE(2)
        CS_Q4_CASE(3)
#if CS_Q4_MR >= 6
        CS_Q4_CASE(4)
        CS_Q4_CASE(5)
#endif
#if CS_Q4_MR == 8
        CS_Q4_CASE(6)
        CS_Q4_CASE(7)
#endif
    default: /* CS_Q4_MR rows */
        if (has_min) tile_q4(xq, xd, xs, K, CS_Q4_MR, w, 1, acc);
        else tile_q4(xq, xd, xs, K, CS_Q4_MR, w, 0, acc);
        break;
    }
#undef CS_Q4_CASE
}

/* Store one activation row's 8 outputs of a tile (bias added; nn < 8 at the last tile). */
static inline void q4_store8(float *yr, __m256 v, const float *bias, int64_t n0, int64_t nn) {
    if (bias) {
        float bb[CS_Q4_TILE] = {0};
        memcpy(bb, bias + n0, (size_t)nn * 4);
        v = _mm256_add_ps(v, _mm256_loadu_ps(bb));
    }
    if (nn == CS_Q4_TILE) {
        _mm256_storeu_ps(yr, v);
    } else {
        float out[CS_Q4_TILE];
        _mm256_storeu_ps(out, v);
        memcpy(yr, out, (size_t)nn * 4);
    }
}
#endif

/* AVX-512 (F, BW, VNNI): two adjacent tiles (16 weight rows) in the 16 lanes of zmm registers,
 * for full groups of CS_Q4_MR activation rows (prefill): half the instructions per product
 * of the 256-bit path. Lane by lane the same integer sums and the same float steps as
 * tile_q4, so the results are bit-identical to it. */
#if CS_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && CS_Q4_MR == 8
#define CS_Q4_ZMM 1
static inline __attribute__((always_inline)) void tile_q4x16(const int8_t *xq, const float *xd, const float *xs,
                                                             int64_t K, const uint8_t *w0, const uint8_t *w1,
                                                             const int HAS_MIN, __m512 acc[8]) {
    const int64_t nb = K / 32, rec = CS_Q4_REC(HAS_MIN);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int i = 0; i < 8; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wa = w0 + b * rec, *wc = w1 + b * rec;
        for (int64_t o = 0; o < rec; o += 64) {
            _mm_prefetch((const char *)(wa + CS_Q4_AHEAD2 * rec + o), _MM_HINT_T0);
            _mm_prefetch((const char *)(wc + CS_Q4_AHEAD2 * rec + o), _MM_HINT_T0);
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(wa + 128))),
            _mm_loadu_si128((const __m128i *)(wc + 128)), 1));
        const __m512 mw = HAS_MIN ? _mm512_cvtph_ps(_mm256_inserti128_si256(
                                        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(wa + 144))),
                                        _mm_loadu_si128((const __m128i *)(wc + 144)), 1))
                                  : _mm512_mul_ps(dw, _mm512_set1_ps(-8.f));
        __m512i s[8];
        for (int i = 0; i < 8; i++) s[i] = _mm512_setzero_si512();
        for (int p = 0; p < 4; p++) {
            const __m512i r = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(wa + 32 * p))),
                _mm256_loadu_si256((const __m256i *)(wc + 32 * p)), 1);
            const __m512i lo = _mm512_and_si512(r, low4), hi = _mm512_and_si512(_mm512_srli_epi16(r, 4), low4);
            for (int i = 0; i < 8; i++) {
                const int8_t *a = xq + i * K + b * 32 + 4 * p;
                s[i] = cs_dpbusd_b512(s[i], lo, a);
                s[i] = cs_dpbusd_b512(s[i], hi, a + 16);
            }
        }
        for (int i = 0; i < 8; i++) {
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), _mm512_mul_ps(dw, _mm512_set1_ps(xd[i * nb + b])),
                                     acc[i]);
            acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[i * nb + b]), acc[i]);
        }
    }
}
#else
#define CS_Q4_ZMM 0
#endif

/* y[m, n] = sum_k w[n, k] x[m, k] (+ bias[n]) over a 4-bit weight packed by cs_pack_q4x8
 * (has_min: with offsets), x quantized first to int8 blocks into the caller's scratch xq
 * [M, K] int8, xd and xs [M, K / 32] float32. K a multiple of 32; M rows of x ldx floats
 * apart, of y ldy apart. Each thread takes whole tiles of 8 output rows and runs the
 * activation rows through them CS_Q4_MR at a time, so each weight record is loaded and
 * unpacked once per CS_Q4_MR rows (a tile of K = 1536 is 7.5 KB: it stays in L1 while the
 * rows go by), one block of CS_Q4_MB rows after another (a block's int8 rows, at most 72 KB,
 * stay in L2 while the thread's tiles go by). Every row is computed alone: its result does
 * not depend on M. */
CS_EXPORT void cs_linear_q4(const float *x, int64_t ldx, int64_t M, int64_t K, const uint8_t *packed, int has_min,
                            const float *bias, int64_t N, float *y, int64_t ldy, int8_t *xq, float *xd, float *xs,
                            int nt) {
    const int64_t nb = K / 32, ntiles = (N + CS_Q4_TILE - 1) / CS_Q4_TILE, rec = CS_Q4_REC(has_min);
#if CS_AVX2
    /* work items: pairs of tiles (the AVX-512 path runs both at once on full row groups) */
    const int64_t npairs = (ntiles + 1) / 2;
    /* One parallel region: the rows are quantized, then (after the barrier) each thread
     * runs its tiles over blocks of CS_Q4_MB rows, the block's int8 rows staying in L1/L2
     * while the thread's tiles go by (the same static split for every block). */
#pragma omp parallel num_threads(nt)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) quantize_row_q8(x, ldx, m, K, xq, xd, xs);
        for (int64_t mb = 0; mb < M; mb += CS_Q4_MB) {
            const int64_t me = (M - mb) < CS_Q4_MB ? M : mb + CS_Q4_MB;
#pragma omp for schedule(static) nowait
            for (int64_t pair = 0; pair < npairs; pair++) {
                const int64_t t0 = 2 * pair, t1 = t0 + 1 < ntiles ? t0 + 1 : t0;
                for (int64_t m0 = mb; m0 < me; m0 += CS_Q4_MR) {
                    const int64_t mm = (me - m0) < CS_Q4_MR ? (me - m0) : CS_Q4_MR;
#if CS_Q4_ZMM
                    if (mm == CS_Q4_MR && t1 != t0) {
                        __m512 acc[8];
                        const uint8_t *w0 = packed + t0 * nb * rec, *w1 = packed + t1 * nb * rec;
                        if (has_min) tile_q4x16(xq + m0 * K, xd + m0 * nb, xs + m0 * nb, K, w0, w1, 1, acc);
                        else tile_q4x16(xq + m0 * K, xd + m0 * nb, xs + m0 * nb, K, w0, w1, 0, acc);
                        const int64_t n0 = t0 * CS_Q4_TILE, n1 = t1 * CS_Q4_TILE;
                        const int64_t nn1 = (N - n1) < CS_Q4_TILE ? (N - n1) : CS_Q4_TILE;
                        for (int64_t i = 0; i < mm; i++) {
                            float *yr = y + (m0 + i) * ldy;
                            q4_store8(yr + n0, _mm512_castps512_ps256(acc[i]), bias, n0, CS_Q4_TILE);
                            q4_store8(yr + n1, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[i]), 1)),
                                      bias, n1, nn1);
                        }
                        continue;
                    }
#endif
                    for (int64_t tile = t0; tile <= t1; tile++) {
                        const int64_t n0 = tile * CS_Q4_TILE, nn = (N - n0) < CS_Q4_TILE ? (N - n0) : CS_Q4_TILE;
                        __m256 acc[CS_Q4_MR];
                        q4_rows(xq + m0 * K, xd + m0 * nb, xs + m0 * nb, K, mm, packed + tile * nb * rec, has_min,
                                acc);
                        for (int64_t i = 0; i < mm; i++) q4_store8(y + (m0 + i) * ldy + n0, acc[i], bias, n0, nn);
                    }
                }
            }
        }
    }
#else
    for (int64_t m = 0; m < M; m++) quantize_row_q8(x, ldx, m, K, xq, xd, xs);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t tile = 0; tile < ntiles; tile++) {
        const int64_t n0 = tile * CS_Q4_TILE, nn = (N - n0) < CS_Q4_TILE ? (N - n0) : CS_Q4_TILE;
        const uint8_t *w = packed + tile * nb * rec;
        for (int64_t m = 0; m < M; m++) {
            float acc[CS_Q4_TILE] = {0};
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *wb = w + b * rec;
                const int8_t *a = xq + m * K + b * 32;
                const uint16_t *dh = (const uint16_t *)(wb + 128), *mh = (const uint16_t *)(wb + 144);
                for (int j = 0; j < CS_Q4_TILE; j++) {
                    int32_t dot = 0;
                    for (int p = 0; p < 4; p++)
                        for (int i = 0; i < 4; i++) {
                            const uint8_t c = wb[32 * p + 4 * j + i];
                            dot += (c & 15) * a[4 * p + i] + (c >> 4) * a[16 + 4 * p + i];
                        }
                    const float d = half_to_f32(dh[j]), mn = has_min ? half_to_f32(mh[j]) : -8.f * d;
                    acc[j] += (float)dot * (d * xd[m * nb + b]) + mn * xs[m * nb + b];
                }
            }
            for (int64_t j = 0; j < nn; j++) y[m * ldy + n0 + j] = bias ? acc[j] + bias[n0 + j] : acc[j];
        }
    }
#endif
}

/* Repack a 4-bit weight for cs_linear_q4: codes [N, K] (one 0..15 code a byte, K a
 * multiple of 32), d and m [N, K / 32] float16 bits (m NULL: symmetric) -> out, ceil(N / 8)
 * tiles of K / 32 records of CS_Q4_REC bytes (layout above); rows past N are zero. */
CS_EXPORT void cs_pack_q4x8(const uint8_t *codes, const uint16_t *d, const uint16_t *m, int64_t N, int64_t K,
                            uint8_t *out) {
    const int64_t nb = K / 32, ntiles = (N + CS_Q4_TILE - 1) / CS_Q4_TILE, rec = CS_Q4_REC(m != NULL);
    memset(out, 0, (size_t)(ntiles * nb * rec));
    for (int64_t t = 0; t < ntiles; t++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *r = out + (t * nb + b) * rec;
            uint16_t *dh = (uint16_t *)(r + 128), *mh = (uint16_t *)(r + 144);
            for (int64_t j = 0; j < CS_Q4_TILE && t * CS_Q4_TILE + j < N; j++) {
                const int64_t n = t * CS_Q4_TILE + j;
                const uint8_t *c = codes + n * K + b * 32;
                for (int p = 0; p < 4; p++)
                    for (int i = 0; i < 4; i++)
                        r[32 * p + 4 * j + i] = (uint8_t)((c[4 * p + i] & 15) | ((c[16 + 4 * p + i] & 15) << 4));
                dh[j] = d[n * nb + b];
                if (m) mh[j] = m[n * nb + b];
            }
        }
}

/* -------------------------------------------------------- paged attention ---- */

#define CS_KEYS 32   /* keys converted to float32 at a time */
#define CS_CHUNK 256 /* keys per partial softmax (a multiple of CS_KEYS) */
#define CS_QT 16     /* prefill query tokens per work unit */

typedef struct {
    const float *q;
    int64_t ldq;
    const void *k_cache, *v_cache;
    int kv_bf16;
    const int32_t *block_tables;
    int64_t max_blocks;
    const int32_t *seq_lens, *query_start;
    int64_t H, Hkv, D, block_size;
    float scale;
} cs_attn_args;

static inline const char *kv_row(const void *cache, int64_t slot, int64_t g, const cs_attn_args *a) {
    int64_t esz = a->kv_bf16 ? 2 : 4;
    return (const char *)cache + ((slot * a->Hkv + g) * a->D) * esz;
}

/* Each 32-key block is loaded once per work unit: keys transposed to float32 kT [D][CS_KEYS]
 * (key j in lane j, so a row's scores come out eight keys to a register, with no horizontal
 * sums), values as float32 rows vf [CS_KEYS][D]. Rows then go through three small products,
 * each a register tile that shares its loads across rows (FlashAttention-2, Dao 2023:
 * blocks of queries against blocks of keys, an online softmax in between, the output kept
 * unnormalised until the end). Every row's arithmetic is the same whichever rows share its
 * tile (lane j of a score is one chain of FMAs over d in order; lane d of an output one chain
 * over keys in order), so a row's result does not depend on how a step was split. */

#if CS_AVX2
/* 8x8 transpose: r[i] lane j <- r[j] lane i. */
static inline void transpose8(__m256 r[8]) {
    __m256 t[8], s[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
    }
}

static inline float hmax256(__m256 v) {
    __m128 lo = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_max_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}
#endif

/* The vector path needs D a multiple of 8; other head sizes take the scalar one (the same
 * path for every row of a step, so the invariance above holds on both). */
static inline int attn_vec(int64_t D) {
    return CS_AVX2 && D % 8 == 0;
}

/* Load keys and values at slots[0..n) of KV head g: kT [D][CS_KEYS] (lanes >= n zero) and
 * vf [n][D], both float32. */
static void load_kv_block(const cs_attn_args *a, int64_t g, const int64_t *slots, int64_t n, float *kT, float *vf) {
    const int64_t D = a->D;
    for (int64_t j = 0; j < n; j++) kv_row_to_f32(vf + j * D, kv_row(a->v_cache, slots[j], g, a), a->kv_bf16, D);
#if CS_AVX2
    if (attn_vec(D)) {
        for (int64_t j8 = 0; j8 < CS_KEYS; j8 += 8) {
            if (j8 >= n) { /* all-zero lanes: no stale scratch (NaN, denormals) in the products */
                for (int64_t d = 0; d < D; d++) _mm256_storeu_ps(kT + d * CS_KEYS + j8, _mm256_setzero_ps());
                continue;
            }
            const char *src[8];
            for (int i = 0; i < 8; i++) src[i] = j8 + i < n ? kv_row(a->k_cache, slots[j8 + i], g, a) : NULL;
            if (a->kv_bf16 && D % 16 == 0) {
                /* transpose pairs of bfloat16 as 32-bit units, then split each pair: half the
                 * shuffles of converting first */
                const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
                for (int64_t d = 0; d < D; d += 16) {
                    __m256 r[8];
                    for (int i = 0; i < 8; i++)
                        r[i] = !src[i] ? _mm256_setzero_ps() : _mm256_loadu_ps((const float *)((const uint16_t *)src[i] + d));
                    transpose8(r);
                    for (int p = 0; p < 8; p++) {
                        const __m256i u = _mm256_castps_si256(r[p]);
                        _mm256_storeu_ps(kT + (d + 2 * p) * CS_KEYS + j8, _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)));
                        _mm256_storeu_ps(kT + (d + 2 * p + 1) * CS_KEYS + j8, _mm256_castsi256_ps(_mm256_and_si256(u, hi)));
                    }
                }
                continue;
            }
            for (int64_t d = 0; d < D; d += 8) {
                __m256 r[8];
                for (int i = 0; i < 8; i++)
                    r[i] = !src[i]       ? _mm256_setzero_ps()
                           : a->kv_bf16 ? load_bf16x8((const uint16_t *)src[i] + d)
                                        : _mm256_loadu_ps((const float *)src[i] + d);
                transpose8(r);
                for (int i = 0; i < 8; i++) _mm256_storeu_ps(kT + (d + i) * CS_KEYS + j8, r[i]);
            }
        }
        return;
    }
#endif
    for (int64_t j = 0; j < CS_KEYS; j++) {
        const char *src = j < n ? kv_row(a->k_cache, slots[j], g, a) : NULL;
        for (int64_t d = 0; d < D; d++)
            kT[d * CS_KEYS + j] = !src ? 0.f
                                  : a->kv_bf16 ? bf16_to_f32(((const uint16_t *)src)[d])
                                               : ((const float *)src)[d];
    }
}

#if CS_AVX2
/* s[r * CS_KEYS + j0 + j] = qp[r] . key j0 + j (unscaled) for NR (up to 6) rows and 16 keys:
 * each loaded key vector serves NR rows, each broadcast query value 16 keys. Six rows take
 * 12 accumulators, two key vectors and a broadcast: 15 of the 16 ymm registers. */
static inline __attribute__((always_inline)) void qk_tile(const float *const *qp, const int NR, const float *kT,
                                                          int64_t j0, int64_t D, float *s) {
    __m256 a0[6], a1[6];
    for (int r = 0; r < NR; r++) a0[r] = a1[r] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m256 k0 = _mm256_loadu_ps(kT + d * CS_KEYS + j0), k1 = _mm256_loadu_ps(kT + d * CS_KEYS + j0 + 8);
        for (int r = 0; r < NR; r++) {
            const __m256 q = _mm256_broadcast_ss(qp[r] + d);
            a0[r] = _mm256_fmadd_ps(q, k0, a0[r]);
            a1[r] = _mm256_fmadd_ps(q, k1, a1[r]);
        }
    }
    for (int r = 0; r < NR; r++) {
        _mm256_storeu_ps(s + r * CS_KEYS + j0, a0[r]);
        _mm256_storeu_ps(s + r * CS_KEYS + j0 + 8, a1[r]);
    }
}

/* acc[r][d0..d0+32) = acc * corr[r] + sum_{j < n} p[r][j] v[j] for NR rows: each loaded value
 * vector serves NR rows. */
static inline __attribute__((always_inline)) void pv_tile(float *const *acc, const float *corr, const float *const *p,
                                                          const int NR, const float *vf, int64_t n, int64_t D,
                                                          int64_t d0) {
    __m256 o[2][4];
    for (int r = 0; r < NR; r++) {
        const __m256 c = _mm256_set1_ps(corr[r]);
        for (int i = 0; i < 4; i++) o[r][i] = _mm256_mul_ps(_mm256_loadu_ps(acc[r] + d0 + 8 * i), c);
    }
    for (int64_t j = 0; j < n; j++) {
        const float *v = vf + j * D + d0;
        const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16),
                     v3 = _mm256_loadu_ps(v + 24);
        for (int r = 0; r < NR; r++) {
            const __m256 pj = _mm256_set1_ps(p[r][j]);
            o[r][0] = _mm256_fmadd_ps(pj, v0, o[r][0]);
            o[r][1] = _mm256_fmadd_ps(pj, v1, o[r][1]);
            o[r][2] = _mm256_fmadd_ps(pj, v2, o[r][2]);
            o[r][3] = _mm256_fmadd_ps(pj, v3, o[r][3]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(acc[r] + d0 + 8 * i, o[r][i]);
}

/* pv_tile for NR (up to 6) rows and 16 dims [d0, d0 + 16): 12 accumulators, two value
 * vectors and a broadcast, so each loaded value vector serves up to 6 rows (pv_tile's 32
 * dims leave room for 2). */
static inline __attribute__((always_inline)) void pv_tile16(float *const *acc, const float *corr,
                                                            const float *const *p, const int NR, const float *vf,
                                                            int64_t n, int64_t D, int64_t d0) {
    __m256 o[6][2];
    for (int r = 0; r < NR; r++) {
        const __m256 c = _mm256_set1_ps(corr[r]);
        for (int i = 0; i < 2; i++) o[r][i] = _mm256_mul_ps(_mm256_loadu_ps(acc[r] + d0 + 8 * i), c);
    }
    for (int64_t j = 0; j < n; j++) {
        const float *v = vf + j * D + d0;
        const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
        for (int r = 0; r < NR; r++) {
            const __m256 pj = _mm256_broadcast_ss(p[r] + j);
            o[r][0] = _mm256_fmadd_ps(pj, v0, o[r][0]);
            o[r][1] = _mm256_fmadd_ps(pj, v1, o[r][1]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < 2; i++) _mm256_storeu_ps(acc[r] + d0 + 8 * i, o[r][i]);
}

/* pv_tile for one row and 8 dims (head sizes not a multiple of 32). */
static inline void pv_one8(float *acc, float corr, const float *p, const float *vf, int64_t n, int64_t D,
                           int64_t d0) {
    __m256 o = _mm256_mul_ps(_mm256_loadu_ps(acc + d0), _mm256_set1_ps(corr));
    for (int64_t j = 0; j < n; j++) o = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(vf + j * D + d0), o);
    _mm256_storeu_ps(acc + d0, o);
}
#endif

#if CS_AVX2 && defined(__AVX512F__)
/* The AVX-512 build's tiles: the same per-lane arithmetic as qk_tile and pv_tile (so the
 * same bits), on 16-lane registers, with more rows a tile (32 registers). */
#define CS_ATTN512 1
/* qk_tile over all CS_KEYS keys for NR (up to 6) rows. */
static inline __attribute__((always_inline)) void qk_tile512(const float *const *qp, const int NR, const float *kT,
                                                             int64_t D, float *s) {
    __m512 a0[6], a1[6];
    for (int r = 0; r < NR; r++) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m512 k0 = _mm512_loadu_ps(kT + d * CS_KEYS), k1 = _mm512_loadu_ps(kT + d * CS_KEYS + 16);
        for (int r = 0; r < NR; r++) {
            const __m512 q = _mm512_set1_ps(qp[r][d]);
            a0[r] = _mm512_fmadd_ps(q, k0, a0[r]);
            a1[r] = _mm512_fmadd_ps(q, k1, a1[r]);
        }
    }
    for (int r = 0; r < NR; r++) {
        _mm512_storeu_ps(s + r * CS_KEYS, a0[r]);
        _mm512_storeu_ps(s + r * CS_KEYS + 16, a1[r]);
    }
}

/* pv_tile for NR (up to 4) rows and dims [d0, d0 + 64). */
static inline __attribute__((always_inline)) void pv_tile512(float *const *acc, const float *corr,
                                                             const float *const *p, const int NR, const float *vf,
                                                             int64_t n, int64_t D, int64_t d0) {
    __m512 o[4][4];
    for (int r = 0; r < NR; r++) {
        const __m512 c = _mm512_set1_ps(corr[r]);
        for (int i = 0; i < 4; i++) o[r][i] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + d0 + 16 * i), c);
    }
    for (int64_t j = 0; j < n; j++) {
        const float *v = vf + j * D + d0;
        const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16), v2 = _mm512_loadu_ps(v + 32),
                     v3 = _mm512_loadu_ps(v + 48);
        for (int r = 0; r < NR; r++) {
            const __m512 pj = _mm512_set1_ps(p[r][j]);
            o[r][0] = _mm512_fmadd_ps(pj, v0, o[r][0]);
            o[r][1] = _mm512_fmadd_ps(pj, v1, o[r][1]);
            o[r][2] = _mm512_fmadd_ps(pj, v2, o[r][2]);
            o[r][3] = _mm512_fmadd_ps(pj, v3, o[r][3]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(acc[r] + d0 + 16 * i, o[r][i]);
}
#else
#define CS_ATTN512 0
#endif
/* most rows that share a weighted-values tile: pv_tile512's 4, or pv_tile16's 6 */
#define CS_PV_ROWS (CS_ATTN512 ? 4 : 6)


/* One row's online-softmax step over a block of n keys (Milakov & Gimelshein 2018): sr
 * holds the row's n raw scores, of which the first `visible` count; they become exp(score *
 * scale - new max) (0 past `visible`), the row's (max, sum) in ml2 move to the new max, and
 * corr gets the factor its running output must be scaled by. One function for every path,
 * so a row's arithmetic is the same whichever path computed its scores. */
static inline void softmax_row(float *sr, int64_t visible, int64_t n, float scale, int vec, float *ml2,
                               float *corr) {
    float mx = -INFINITY, sum = 0.f;
    const float m = ml2[0];
#if CS_AVX2
    if (vec) {
        const __m256 ninf = _mm256_set1_ps(-INFINITY), sc = _mm256_set1_ps(scale);
        const __m256i lim = _mm256_set1_epi32((int)visible);
        __m256 v[4], vm = ninf;
        for (int i = 0; i < 4; i++) {
            const __m256i idx = _mm256_setr_epi32(8 * i, 8 * i + 1, 8 * i + 2, 8 * i + 3, 8 * i + 4, 8 * i + 5,
                                                  8 * i + 6, 8 * i + 7);
            const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lim, idx));
            v[i] = _mm256_blendv_ps(ninf, _mm256_mul_ps(_mm256_loadu_ps(sr + 8 * i), sc), keep);
            vm = _mm256_max_ps(vm, v[i]);
        }
        mx = hmax256(vm);
        const __m256 mn = _mm256_set1_ps(mx > m ? mx : m);
        __m256 vs = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            const __m256 e = exp256(_mm256_sub_ps(v[i], mn));
            _mm256_storeu_ps(sr + 8 * i, e);
            vs = _mm256_add_ps(vs, e);
        }
        sum = hsum256(vs);
    }
#endif
    if (!vec) {
        for (int64_t j = 0; j < visible; j++) {
            sr[j] *= scale;
            mx = sr[j] > mx ? sr[j] : mx;
        }
        const float mn = mx > m ? mx : m;
        for (int64_t j = 0; j < visible; j++) sum += (sr[j] = expf(sr[j] - mn));
        for (int64_t j = visible; j < n; j++) sr[j] = 0.f;
    }
    const float mnew = mx > m ? mx : m;
    *corr = expf(m - mnew); /* 0 on the first keys (m = -inf) */
    ml2[1] = ml2[1] * *corr + sum;
    ml2[0] = mnew;
}

#define CS_DEC_R 4 /* most rows (query heads of one KV head) the one-token path takes */

/* Where key positions j0..j0+n-1 of request b's table sit in the cache: slots[0..n). */
static inline void block_slots(const int32_t *table, int64_t bs, int64_t j0, int64_t n, int64_t *slots) {
    for (int64_t j = 0; j < n;) { /* one table lookup (and division) per block, not per key */
        const int64_t pos = j0 + j, off = pos % bs, run = (bs - off) < (n - j) ? (bs - off) : (n - j);
        const int64_t slot = (int64_t)table[pos / bs] * bs + off;
        for (int64_t i = 0; i < run; i++, j++) slots[j] = slot + i;
    }
}

/* Fetch the key and value rows of positions [p0, p1) of KV heads g0..g0+ng-1 while other
 * work runs: a decode step's cache rows come from memory (the weights streamed through the
 * caches since the last step), and a block's pages are too short and scattered for the
 * hardware prefetchers. (A slot's rows of consecutive heads are contiguous.) */
static inline void prefetch_kv(const cs_attn_args *a, const int32_t *table, int64_t g0, int64_t ng, int64_t p0,
                               int64_t p1) {
    const int64_t bs = a->block_size, bytes = ng * a->D * (a->kv_bf16 ? 2 : 4);
    for (int64_t pos = p0; pos < p1; pos++) {
        const int64_t slot = (int64_t)table[pos / bs] * bs + pos % bs;
        const char *kr = kv_row(a->k_cache, slot, g0, a), *vr = kv_row(a->v_cache, slot, g0, a);
        for (int64_t o = 0; o < bytes; o += 64) {
            __builtin_prefetch(kr + o, 0, 3);
            __builtin_prefetch(vr + o, 0, 3);
        }
    }
}

/* Key blocks of CS_KEYS prefetched ahead of the one in use: a block's compute is shorter
 * than the memory's latency for its scattered pages (one block ahead, until 2026-12-02, left
 * decode attention at half the read bandwidth on the Zen 4 EPYC: docs/benchmarks.md). */
#ifndef CS_KV_AHEAD
#define CS_KV_AHEAD 3
#endif
/* At key block j0 of a unit that runs over [k0, kend): prefetch the block CS_KV_AHEAD
 * blocks ahead (and, at the unit's first block, every block up to it). */
static inline void prefetch_ahead(const cs_attn_args *a, const int32_t *table, int64_t g0, int64_t ng, int64_t k0,
                                  int64_t j0, int64_t kend) {
    const int64_t p0 = j0 == k0 ? j0 : j0 + CS_KV_AHEAD * CS_KEYS, p1 = j0 + (CS_KV_AHEAD + 1) * CS_KEYS;
    if (p0 < kend) prefetch_kv(a, table, g0, ng, p0, kend < p1 ? kend : p1);
}

#if CS_AVX2
/* The dimension order of a one-token path's running output: each group of CS_DEC_W
 * dimensions is kept as its even dimensions, then its odd ones (what the bfloat16 value
 * rows give without a shuffle). 16 lanes in the AVX-512 build, 8 otherwise. */
#if CS_ATTN512
#define CS_DEC_W 32
#else
#define CS_DEC_W 16
#endif

/* attn_partial for one query token (every row sees every key of the chunk, up to its
 * own position) over a bfloat16 cache, at KV heads g0..g0+ng-1 (head g's R rows: acc
 * [R, D] at acc + (g - g0) * pstride * R * D, ml [R, 2] at ml + (g - g0) * pstride * R * 2),
 * for R <= CS_DEC_R rows a head and D a multiple of CS_DEC_W: the same per-lane arithmetic
 * as attn_partial's tiles, and so the same bits (a score lane is one chain of FMAs over d in
 * order from zero; an output lane one chain over the keys in order after the scaling by
 * corr), without the float32 scratch. Keys are transposed in registers (bfloat16 pairs as
 * 32-bit units, then split) straight into the score products; value rows are widened in
 * registers inside the weighted sum, their even and odd dimensions in separate lanes (acc is
 * kept so until the chunk's end, then put back in order). Decode does little work per key
 * (R rows), so the scratch stores and reloads of attn_partial were most of its cost. The
 * heads of a block go one after the other while its rows are in cache: a slot's rows of all
 * KV heads are contiguous, so the unit reads the cache pages in order. Scratch: s [R *
 * CS_KEYS], corr [R]. */
static inline __attribute__((always_inline)) void one_token_bf16(const cs_attn_args *a, const int R, int64_t b,
                                                                 int64_t g0, int64_t ng, int64_t pstride,
                                                                 int64_t q0, int64_t k0, int64_t k1, float *acc0,
                                                                 float *ml0, float *s, float *corr) {
    const int64_t G = a->H / a->Hkv, D = a->D, bs = a->block_size;
    const int64_t qs = a->query_start[b], qlen = a->query_start[b + 1] - qs;
    const int64_t prefix = a->seq_lens[b] - qlen;
    const int32_t *table = a->block_tables + b * a->max_blocks;
    for (int64_t gi = 0; gi < ng; gi++) {
        float *ml = ml0 + gi * pstride * R * 2;
        for (int64_t r = 0; r < R; r++) {
            ml[2 * r] = -INFINITY;
            ml[2 * r + 1] = 0.f;
        }
        memset(acc0 + gi * pstride * R * D, 0, (size_t)(R * D) * 4);
    }
    int64_t kend = prefix + q0 + 1;
    if (kend > k1) kend = k1;
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    int64_t slots[CS_KEYS];
    for (int64_t j0 = k0; j0 < kend; j0 += CS_KEYS) {
        const int64_t n = (kend - j0) < CS_KEYS ? (kend - j0) : CS_KEYS;
        block_slots(table, bs, j0, n, slots);
        prefetch_ahead(a, table, g0, ng, k0, j0, kend);
        for (int64_t gi = 0; gi < ng; gi++) {
            const int64_t g = g0 + gi;
            float *acc = acc0 + gi * pstride * R * D, *ml = ml0 + gi * pstride * R * 2;
            const float *qp[CS_DEC_R];
            for (int r = 0; r < R; r++) qp[r] = a->q + (qs + q0) * a->ldq + (g * G + r) * D;
            /* scores, 8 keys at a time */
            for (int64_t j8 = 0; j8 < n; j8 += 8) {
                const uint16_t *src[8];
                for (int i = 0; i < 8; i++)
                    src[i] = j8 + i < n ? (const uint16_t *)kv_row(a->k_cache, slots[j8 + i], g, a) : NULL;
                __m256 sc[CS_DEC_R];
                for (int r = 0; r < R; r++) sc[r] = _mm256_setzero_ps();
                for (int64_t d = 0; d < D; d += 16) {
                    __m256 t[8];
                    for (int i = 0; i < 8; i++)
                        t[i] = src[i] ? _mm256_loadu_ps((const float *)(src[i] + d)) : _mm256_setzero_ps();
                    transpose8(t);
                    for (int p = 0; p < 8; p++) {
                        const __m256i u = _mm256_castps_si256(t[p]);
                        const __m256 ke = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)),
                                     ko = _mm256_castsi256_ps(_mm256_and_si256(u, hi));
                        for (int r = 0; r < R; r++) {
                            sc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(qp[r] + d + 2 * p), ke, sc[r]);
                            sc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(qp[r] + d + 2 * p + 1), ko, sc[r]);
                        }
                    }
                }
                for (int r = 0; r < R; r++) _mm256_storeu_ps(s + r * CS_KEYS + j8, sc[r]);
            }
            for (int64_t j8 = (n + 7) / 8 * 8; j8 < CS_KEYS; j8 += 8) /* no stale scratch in masked lanes */
                for (int r = 0; r < R; r++) _mm256_storeu_ps(s + r * CS_KEYS + j8, _mm256_setzero_ps());
            for (int r = 0; r < R; r++) softmax_row(s + r * CS_KEYS, n, n, a->scale, 1, ml + 2 * r, corr + r);
            /* acc = acc * corr + p V, CS_DEC_W dimensions at a time */
            const uint16_t *vr[CS_KEYS];
            for (int64_t j = 0; j < n; j++) vr[j] = (const uint16_t *)kv_row(a->v_cache, slots[j], g, a);
            for (int64_t d0 = 0; d0 < D; d0 += CS_DEC_W) {
#if CS_ATTN512
                const __m512i hi16 = _mm512_set1_epi32((int)0xffff0000u);
                __m512 oe[CS_DEC_R], oo[CS_DEC_R];
                for (int r = 0; r < R; r++) {
                    const __m512 c = _mm512_set1_ps(corr[r]);
                    oe[r] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d0), c);
                    oo[r] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d0 + 16), c);
                }
                for (int64_t j = 0; j < n; j++) {
                    const __m512i u = _mm512_loadu_si512((const void *)(vr[j] + d0));
                    const __m512 ve = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16)),
                                 vo = _mm512_castsi512_ps(_mm512_and_si512(u, hi16));
                    for (int r = 0; r < R; r++) {
                        const __m512 pj = _mm512_set1_ps(s[r * CS_KEYS + j]);
                        oe[r] = _mm512_fmadd_ps(pj, ve, oe[r]);
                        oo[r] = _mm512_fmadd_ps(pj, vo, oo[r]);
                    }
                }
                for (int r = 0; r < R; r++) {
                    _mm512_storeu_ps(acc + r * D + d0, oe[r]);
                    _mm512_storeu_ps(acc + r * D + d0 + 16, oo[r]);
                }
#else
                __m256 oe[CS_DEC_R], oo[CS_DEC_R];
                for (int r = 0; r < R; r++) {
                    const __m256 c = _mm256_set1_ps(corr[r]);
                    oe[r] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + d0), c);
                    oo[r] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + d0 + 8), c);
                }
                for (int64_t j = 0; j < n; j++) {
                    const __m256i u = _mm256_loadu_si256((const __m256i *)(vr[j] + d0));
                    const __m256 ve = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)),
                                 vo = _mm256_castsi256_ps(_mm256_and_si256(u, hi));
                    for (int r = 0; r < R; r++) {
                        const __m256 pj = _mm256_set1_ps(s[r * CS_KEYS + j]);
                        oe[r] = _mm256_fmadd_ps(pj, ve, oe[r]);
                        oo[r] = _mm256_fmadd_ps(pj, vo, oo[r]);
                    }
                }
                for (int r = 0; r < R; r++) {
                    _mm256_storeu_ps(acc + r * D + d0, oe[r]);
                    _mm256_storeu_ps(acc + r * D + d0 + 8, oo[r]);
                }
#endif
            }
        }
    }
    /* back to dimension order: a group's even dimensions, then its odd ones -> interleaved */
    for (int64_t gi = 0; gi < ng; gi++)
        for (int64_t r = 0; r < R; r++)
            for (int64_t d0 = 0; d0 < D; d0 += CS_DEC_W) {
                float tmp[CS_DEC_W], *x = acc0 + gi * pstride * R * D + r * D + d0;
                for (int i = 0; i < CS_DEC_W / 2; i++) {
                    tmp[2 * i] = x[i];
                    tmp[2 * i + 1] = x[CS_DEC_W / 2 + i];
                }
                memcpy(x, tmp, sizeof(tmp));
            }
}

/* one_token_bf16 with R = G = H / Hkv (at most CS_DEC_R). */
static void attn_one_token_bf16(const cs_attn_args *a, int64_t b, int64_t g0, int64_t ng, int64_t pstride,
                                int64_t q0, int64_t k0, int64_t k1, float *acc, float *ml, float *s, float *corr) {
    switch (a->H / a->Hkv) {
    case 1: one_token_bf16(a, 1, b, g0, ng, pstride, q0, k0, k1, acc, ml, s, corr); break;
    case 2: one_token_bf16(a, 2, b, g0, ng, pstride, q0, k0, k1, acc, ml, s, corr); break;
    case 3: one_token_bf16(a, 3, b, g0, ng, pstride, q0, k0, k1, acc, ml, s, corr); break;
    default: one_token_bf16(a, 4, b, g0, ng, pstride, q0, k0, k1, acc, ml, s, corr); break;
    }
}

/* Whether attn_one_token_bf16 takes a one-token unit's rows. */
static inline int one_token_path(const cs_attn_args *a) {
    return attn_vec(a->D) && a->kv_bf16 && a->D % CS_DEC_W == 0 && a->H / a->Hkv <= CS_DEC_R;
}
#else
static inline int one_token_path(const cs_attn_args *a) {
    (void)a;
    return 0;
}
#endif

/* The softmax-weighted sum over keys [k0, k1) of one chunk for the rows of query tokens
 * q0..q0+nq-1 of request b at KV head g (row r: token q0 + r / G, head g * G + r % G),
 * with an online softmax over CS_KEYS keys at a time (Milakov & Gimelshein 2018; the
 * FlashAttention recurrence, Dao et al. 2022, tiled as in FlashAttention-2, Dao 2023). Each
 * row sees key positions up to its own (causal). Writes, per row r, the unnormalised sum to
 * acc + r * D and (max score, sum of exponentials) to ml + 2 r: m = -inf and l = 0 when the
 * row sees no key here. Scratch: kT and vf [CS_KEYS * D], s [R * CS_KEYS], qp [R], corr [R]. */
static void attn_partial(const cs_attn_args *a, int64_t b, int64_t g, int64_t q0, int64_t nq, int64_t k0,
                         int64_t k1, float *acc, float *ml, float *kT, float *vf, float *s, const float **qp,
                         float *corr) {
    const int64_t G = a->H / a->Hkv, D = a->D, R = nq * G, bs = a->block_size;
    const int64_t qs = a->query_start[b], qlen = a->query_start[b + 1] - qs;
    const int64_t prefix = a->seq_lens[b] - qlen;
    const int32_t *table = a->block_tables + b * a->max_blocks;
    const int vec = attn_vec(D);
#if CS_AVX2
    if (nq == 1 && one_token_path(a)) {
        attn_one_token_bf16(a, b, g, 1, 1, q0, k0, k1, acc, ml, s, corr);
        return;
    }
#endif
    for (int64_t r = 0; r < R; r++) {
        ml[2 * r] = -INFINITY;
        ml[2 * r + 1] = 0.f;
        qp[r] = a->q + (qs + q0 + r / G) * a->ldq + (g * G + r % G) * D;
    }
    memset(acc, 0, (size_t)(R * D) * 4);
    int64_t kend = prefix + q0 + nq; /* past the last key any row here may see */
    if (kend > k1) kend = k1;
    int64_t slots[CS_KEYS];
    for (int64_t j0 = k0; j0 < kend; j0 += CS_KEYS) {
        const int64_t n = (kend - j0) < CS_KEYS ? (kend - j0) : CS_KEYS;
        block_slots(table, bs, j0, n, slots);
        prefetch_ahead(a, table, g, 1, k0, j0, kend);
        load_kv_block(a, g, slots, n, kT, vf);
        /* rows of tokens that see none of these keys come first (rows go by token) */
        int64_t r0 = 0;
        while (r0 < R && prefix + q0 + r0 / G + 1 - j0 <= 0) r0++;
        /* scores */
        int64_t r = r0;
#if CS_AVX2
        if (vec) {
#if CS_ATTN512
            if (n > 16) {
                for (r = r0; r + 6 <= R; r += 6) qk_tile512(qp + r, 6, kT, D, s + r * CS_KEYS);
                switch (R - r) {
                case 5: qk_tile512(qp + r, 5, kT, D, s + r * CS_KEYS); break;
                case 4: qk_tile512(qp + r, 4, kT, D, s + r * CS_KEYS); break;
                case 3: qk_tile512(qp + r, 3, kT, D, s + r * CS_KEYS); break;
                case 2: qk_tile512(qp + r, 2, kT, D, s + r * CS_KEYS); break;
                case 1: qk_tile512(qp + r, 1, kT, D, s + r * CS_KEYS); break;
                }
            } else
#endif
            for (int64_t j16 = 0; j16 < n; j16 += 16) {
#if !CS_ATTN512
                /* the AVX2-only build: 6 rows a tile (the AVX-512 build keeps 4 for short blocks) */
                for (r = r0; r + 6 <= R; r += 6) qk_tile(qp + r, 6, kT, j16, D, s + r * CS_KEYS);
                if (R - r == 5) qk_tile(qp + r, 5, kT, j16, D, s + r * CS_KEYS);
                else if (R - r == 4) qk_tile(qp + r, 4, kT, j16, D, s + r * CS_KEYS);
                else
#else
                for (r = r0; r + 4 <= R; r += 4) qk_tile(qp + r, 4, kT, j16, D, s + r * CS_KEYS);
#endif
                if (R - r == 3) qk_tile(qp + r, 3, kT, j16, D, s + r * CS_KEYS);
                else if (R - r == 2) qk_tile(qp + r, 2, kT, j16, D, s + r * CS_KEYS);
                else if (R - r == 1) qk_tile(qp + r, 1, kT, j16, D, s + r * CS_KEYS);
            }
        }
#endif
        if (!vec)
            for (r = r0; r < R; r++)
                for (int64_t j = 0; j < n; j++) {
                    float dot = 0.f;
                    for (int64_t d = 0; d < D; d++) dot += qp[r][d] * kT[d * CS_KEYS + j];
                    s[r * CS_KEYS + j] = dot;
                }
        /* online softmax: s becomes exp(score - new max) (0 for keys a row does not see) */
        for (r = r0; r < R; r++) {
            int64_t visible = prefix + q0 + r / G + 1 - j0; /* keys j < visible are causal for this row */
            softmax_row(s + r * CS_KEYS, visible > n ? n : visible, n, a->scale, vec, ml + 2 * r, corr + r);
        }
        /* acc = acc * corr + p V, over the keys each row sees (p is 0 past them, but a row's
         * sum stops at its own last key so its arithmetic does not depend on its neighbours) */
        for (r = r0; r < R;) {
            int64_t vis = prefix + q0 + r / G + 1 - j0;
            if (vis > n) vis = n;
#if CS_AVX2
            /* rows that see the same keys (all of them but on the causal diagonal) share a tile */
            int nr = 1;
            for (; nr < CS_PV_ROWS && r + nr < R; nr++) {
                const int64_t v2 = prefix + q0 + (r + nr) / G + 1 - j0;
                if ((v2 < n ? v2 : n) != vis) break;
            }
            float *accp[CS_PV_ROWS];
            const float *pp[CS_PV_ROWS];
            for (int i = 0; i < nr; i++) {
                accp[i] = acc + (r + i) * D;
                pp[i] = s + (r + i) * CS_KEYS;
            }
#if CS_ATTN512
            if (vec && D % 64 == 0) {
                for (int64_t d0 = 0; d0 < D; d0 += 64) {
                    if (nr == 4) pv_tile512(accp, corr + r, pp, 4, vf, vis, D, d0);
                    else if (nr == 3) pv_tile512(accp, corr + r, pp, 3, vf, vis, D, d0);
                    else if (nr == 2) pv_tile512(accp, corr + r, pp, 2, vf, vis, D, d0);
                    else pv_tile512(accp, corr + r, pp, 1, vf, vis, D, d0);
                }
                r += nr;
                continue;
            }
#endif
#if !CS_ATTN512
            if (vec && D % 16 == 0 && nr >= 3) { /* the AVX2-only build: 3-6 rows by 16 dims */
                for (int64_t d0 = 0; d0 < D; d0 += 16) {
                    if (nr == 6) pv_tile16(accp, corr + r, pp, 6, vf, vis, D, d0);
                    else if (nr == 5) pv_tile16(accp, corr + r, pp, 5, vf, vis, D, d0);
                    else if (nr == 4) pv_tile16(accp, corr + r, pp, 4, vf, vis, D, d0);
                    else pv_tile16(accp, corr + r, pp, 3, vf, vis, D, d0);
                }
                r += nr;
                continue;
            }
#endif
            if (vec && D % 32 == 0) {
                nr = nr < 2 ? nr : 2;
                for (int64_t d0 = 0; d0 < D; d0 += 32) {
                    if (nr == 2) pv_tile(accp, corr + r, pp, 2, vf, vis, D, d0);
                    else pv_tile(accp, corr + r, pp, 1, vf, vis, D, d0);
                }
                r += nr;
                continue;
            }
            if (vec) {
                for (int64_t d0 = 0; d0 < D; d0 += 8) pv_one8(acc + r * D, corr[r], s + r * CS_KEYS, vf, vis, D, d0);
                r++;
                continue;
            }
#endif
            float *ar = acc + r * D;
            const float *pr = s + r * CS_KEYS;
            for (int64_t d = 0; d < D; d++) {
                float o = ar[d] * corr[r];
                for (int64_t j = 0; j < vis; j++) o += pr[j] * vf[j * D + d];
                ar[d] = o;
            }
            r++;
        }
    }
}

/* out[0..D) = the attention output of one row from its S chunk partials (acc s at
 * acc + s * acc_stride, (m, l) at ml + s * ml_stride): a log-sum-exp weighted average,
 * summed in chunk order. Every row goes through this one merge, whether its chunks were
 * computed by one work unit or several, so its result does not depend on how the step
 * was split: the same token gets the same output in a decode step or in a prefill chunk,
 * alone or in a batch. */
static void merge_partials(int64_t S, const float *acc, int64_t acc_stride, const float *ml, int64_t ml_stride,
                           int64_t D, float *out) {
    float M = -INFINITY, L = 0.f;
    for (int64_t s = 0; s < S; s++) M = ml[s * ml_stride] > M ? ml[s * ml_stride] : M;
    memset(out, 0, (size_t)D * 4);
    for (int64_t s = 0; s < S; s++) {
        const float m = ml[s * ml_stride];
        if (m == -INFINITY) continue; /* a chunk this row sees no key of */
        const float w = expf(m - M);
        L += w * ml[s * ml_stride + 1];
        axpy_f32(out, w, acc + s * acc_stride, D);
    }
    scale_f32(out, L > 0.f ? 1.0f / L : 0.f, D);
}

/* A grow-only scratch buffer per thread and purpose (`which` < 4), kept between calls:
 * attention runs once a layer, 30 times a step, and a malloc, a free and the first touch of
 * fresh pages each time cost about what a short decode context's work does. The threads
 * (torch's OpenMP pool, the engine's) live as long as the process; a buffer above
 * CS_SCRATCH_KEEP bytes is given back after the call that needed it (thread_scratch_trim),
 * so a rare huge step does not hold its memory. Returns NULL when memory runs out. */
#define CS_SCRATCH_KEEP ((size_t)8 << 20)
static _Thread_local void *cs_scratch_buf[4];
static _Thread_local size_t cs_scratch_cap[4];
static void *thread_scratch(int which, size_t bytes) {
    if (bytes > cs_scratch_cap[which]) {
        free(cs_scratch_buf[which]);
        cs_scratch_buf[which] = malloc(bytes);
        cs_scratch_cap[which] = cs_scratch_buf[which] ? bytes : 0;
    }
    return cs_scratch_buf[which];
}
static void thread_scratch_trim(int which) {
    if (cs_scratch_cap[which] > CS_SCRATCH_KEEP) {
        free(cs_scratch_buf[which]);
        cs_scratch_buf[which] = NULL;
        cs_scratch_cap[which] = 0;
    }
}

/* Below this many (query row, key) pairs in a step, attention runs on one thread. */
#define CS_ATTN_SERIAL 2048

/* One unit of attention work: decode rows (one token) of request b at KV head g over key
 * chunk `chunk`, or (chunk < 0) a prefill tile of nq tokens over all its chunks. */
typedef struct {
    int64_t b, g, q0, nq, chunk, part; /* part: first partial slot of a decode unit */
    int64_t ng;                        /* decode: KV heads g..g+ng-1 (their parts `chunks` apart) */
} cs_unit;

/* Paged attention over a flat varlen batch (decode rows and prefill chunks together).
 * First the step's new keys and values (k_new, v_new: [T, Hkv, D] float32, rows ldk /
 * ldv floats apart) are written to the cache at slots [T]; then
 *   q [T, H, D] float32, token rows ldq floats apart (a view into the fused QKV rows)
 *   block_tables [B, max_blocks] int32, seq_lens [B] int32 (keys after this step),
 *   query_start [B + 1] int32 (offsets of each request's query tokens in T)
 *   out [T, H, D] float32, contiguous.
 * Query token i of request b sits at position seq_len - qlen + i and sees keys 0..that
 * position; query head h reads KV head h / (H / Hkv). Keys are taken in fixed chunks of
 * CS_CHUNK positions, each with its own softmax partial, merged by merge_partials: decode
 * chunks are separate work units (flash-decoding, so one long request keeps every core
 * busy), prefill tiles of CS_QT tokens run their chunks in turn. Returns 0, or -1 if
 * scratch memory could not be allocated. */
CS_EXPORT int cs_paged_attention(const float *q, int64_t ldq, const float *k_new, int64_t ldk, const float *v_new,
                                 int64_t ldv, const int64_t *slots, int64_t T, void *k_cache, void *v_cache,
                                 int kv_bf16, const int32_t *block_tables, int64_t max_blocks, const int32_t *seq_lens,
                                 const int32_t *query_start, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                                 int64_t block_size, float scale, float *out, int nt) {
    const int64_t G = H / Hkv;
    if (nt < 1) nt = 1;
    store_kv(k_new, ldk, v_new, ldv, slots, T, Hkv, D, k_cache, v_cache, kv_bf16, nt);
    int64_t nunits = 0, nparts = 0, max_chunks = 1, work = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t qlen = query_start[b + 1] - query_start[b], len = seq_lens[b];
        const int64_t chunks = (len + CS_CHUNK - 1) / CS_CHUNK;
        max_chunks = chunks > max_chunks ? chunks : max_chunks;
        nunits += Hkv * (qlen == 1 ? chunks : (qlen + CS_QT - 1) / CS_QT);
        nparts += qlen == 1 ? Hkv * chunks : 0;
        work += Hkv * G * qlen * len;
    }
    const size_t unit_bytes = sizeof(cs_unit) * (size_t)(nunits ? nunits : 1);
    const size_t acc_floats = (size_t)(nparts * G * D + 1), ml_floats = (size_t)(nparts * G * 2 + 1);
    char *mem = (char *)thread_scratch(2, unit_bytes + 4 * (acc_floats + ml_floats) + 64);
    if (!mem) return -1;
    cs_unit *units = (cs_unit *)mem;
    float *part_acc = (float *)(mem + (unit_bytes + 63) / 64 * 64), *part_ml = part_acc + acc_floats;
    const cs_attn_args a = {q, ldq, k_cache, v_cache, kv_bf16, block_tables, max_blocks, seq_lens, query_start,
                            H, Hkv, D, block_size, scale};
    /* A small step (short contexts, few requests) runs on one thread: forking costs more. */
    const int threads = work < CS_ATTN_SERIAL ? 1 : nt;
    /* A decode unit takes a chunk of every KV head (one pass over the chunk's cache pages, in
     * order) where there are enough of them to keep the threads busy, else of one head. */
    int64_t dchunks = 0;
    for (int64_t b = 0; b < B; b++)
        if (query_start[b + 1] - query_start[b] == 1) dchunks += (seq_lens[b] + CS_CHUNK - 1) / CS_CHUNK;
    const int64_t ng = one_token_path(&a) && dchunks >= 4 * threads ? Hkv : 1;
    /* Work units, the longest first so that the dynamic schedule ends balanced: prefill
     * tiles, then decode chunks of CS_CHUNK keys, then each decode request's shorter last
     * chunk. */
    int64_t u = 0;
    for (int pass = 0; pass < 3; pass++)
        for (int64_t b = 0, p0 = 0; b < B; b++) {
            const int64_t qlen = query_start[b + 1] - query_start[b], len = seq_lens[b];
            if (qlen != 1) {
                for (int64_t g = 0; g < Hkv && pass == 0; g++)
                    for (int64_t q0 = 0; q0 < qlen; q0 += CS_QT)
                        units[u++] = (cs_unit){b, g, q0, (qlen - q0) < CS_QT ? (qlen - q0) : CS_QT, -1, -1, 1};
                continue;
            }
            const int64_t chunks = (len + CS_CHUNK - 1) / CS_CHUNK;
            for (int64_t c = 0; c < chunks; c++) {
                const int full = (c + 1) * CS_CHUNK <= len;
                if ((pass == 1 && full) || (pass == 2 && !full))
                    for (int64_t g = 0; g < Hkv; g += ng) units[u++] = (cs_unit){b, g, 0, 1, c, p0 + g * chunks + c, ng};
            }
            p0 += Hkv * chunks;
        }
    nunits = u;
    const int64_t maxR = CS_QT * G;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        /* per thread: kT, vf, s, corr, and a prefill tile's chunk partials; qp */
        const size_t floats = (size_t)(2 * CS_KEYS * D + maxR * (CS_KEYS + 1) + max_chunks * maxR * (D + 2));
        float *scratch = (float *)thread_scratch(0, sizeof(float) * floats);
        const float **qp = (const float **)thread_scratch(1, sizeof(float *) * (size_t)maxR);
        const int ok = scratch != NULL && qp != NULL;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        /* every thread reaches each loop (and its barrier), working only if it has scratch */
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < nunits; i++) {
            if (!ok) continue;
            float *kT = scratch, *vf = kT + CS_KEYS * D, *s = vf + CS_KEYS * D, *corr = s + maxR * CS_KEYS;
            float *pacc = corr + maxR;
            const cs_unit *un = &units[i];
            const int64_t R = un->nq * G, qs = query_start[un->b];
            if (un->chunk >= 0) { /* decode: one chunk, merged after the loop */
                const int64_t k0 = un->chunk * CS_CHUNK;
#if CS_AVX2
                if (un->ng > 1) {
                    const int64_t pstride = (seq_lens[un->b] + CS_CHUNK - 1) / CS_CHUNK;
                    attn_one_token_bf16(&a, un->b, un->g, un->ng, pstride, 0, k0, k0 + CS_CHUNK,
                                        part_acc + un->part * G * D, part_ml + un->part * G * 2, s, corr);
                    continue;
                }
#endif
                attn_partial(&a, un->b, un->g, 0, 1, k0, k0 + CS_CHUNK, part_acc + un->part * G * D,
                             part_ml + un->part * G * 2, kT, vf, s, qp, corr);
                continue;
            }
            const int64_t qlen = query_start[un->b + 1] - qs, prefix = seq_lens[un->b] - qlen;
            const int64_t S = (prefix + un->q0 + un->nq + CS_CHUNK - 1) / CS_CHUNK;
            float *pml = pacc + S * R * D;
            for (int64_t c = 0; c < S; c++)
                attn_partial(&a, un->b, un->g, un->q0, un->nq, c * CS_CHUNK, (c + 1) * CS_CHUNK, pacc + c * R * D,
                             pml + c * R * 2, kT, vf, s, qp, corr);
            for (int64_t r = 0; r < R; r++)
                merge_partials(S, pacc + r * D, R * D, pml + 2 * r, R * 2, D,
                               out + ((qs + un->q0 + r / G) * H + un->g * G + r % G) * D);
        }
        /* merge each decode request's chunks, one (request, KV head) at a time */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < nunits; i++) {
            const cs_unit *un = &units[i];
            if (!ok || un->chunk != 0) continue; /* the first chunk's unit stands for its row group */
            const int64_t S = (seq_lens[un->b] + CS_CHUNK - 1) / CS_CHUNK, qs = query_start[un->b];
            for (int64_t gi = 0; gi < un->ng; gi++) {
                const int64_t part = un->part + gi * S;
                for (int64_t r = 0; r < G; r++)
                    merge_partials(S, part_acc + (part * G + r) * D, G * D, part_ml + (part * G + r) * 2, G * 2, D,
                                   out + (qs * H + (un->g + gi) * G + r) * D);
            }
        }
        thread_scratch_trim(0);
    }
    thread_scratch_trim(2);
    return failed ? -1 : 0;
}

/* ------------------------------------------------------ one decoder layer ---- */

/* What one Llama-family decoder layer holds (engine/models/llama.py), with its weights
 * packed for cs_linear_i8_packed (cs_pack_i8x8). Built once at load time by engine/cpu/fused.py. */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    float eps, scale;
    const float *attn_norm, *mlp_norm;        /* [hidden] */
    const void *qkv_w, *o_w, *gate_up_w, *down_w; /* packed (wfmt) */
    const float *qkv_s, *o_s, *gate_up_s, *down_s;  /* per-row scales */
    const float *qkv_b;                        /* NULL or [(heads + 2 kv_heads) head_dim] */
    void *k_cache, *v_cache;                   /* this layer's [num_slots, kv_heads, head_dim] */
    int wfmt; /* the projections' format: 0 int8 (cs_pack_i8x8), 1 4-bit symmetric, 2 4-bit with
               * offsets (cs_pack_q4x8; the *_s scales are then unused) */
} cs_layer;

/* One step's batch and buffers, shared by every layer (engine/forward_batch.py's fields). */
typedef struct {
    int64_t T, B, max_blocks, block_size;
    int kv_bf16, nt, first; /* first: residual not set yet (the embeddings are in x) */
    const float *rope;      /* [max_len, 2, head_dim / 2] */
    const int64_t *positions, *slots;
    const int32_t *block_tables, *seq_lens, *query_start;
    float *x;        /* [T, hidden] in: the previous sublayer's output; out: this layer's MLP output */
    float *residual; /* [T, hidden] the residual stream */
    float *normed;   /* [T, hidden] scratch */
    float *qkv;      /* [T, (heads + 2 kv_heads) head_dim] scratch */
    float *attn;     /* [T, heads head_dim] scratch */
    float *gate_up;  /* [T, 2 inter] scratch */
    float *act;      /* [T, inter] scratch */
    int16_t *xq;     /* [T, max(hidden, inter, heads head_dim)] scratch */
    float *xd;       /* [T, that / 32] scratch */
    float *xs;       /* [T, that / 32] scratch (4-bit weights' activation sums) */
} cs_step;

/* One projection of a layer in its format: y = x W^T (+ bias), x [T, K], y [T, N]. */
static void layer_linear(const cs_layer *L, const cs_step *S, const float *x, int64_t K, const void *w,
                         const float *scale, const float *bias, int64_t N, float *y) {
    if (L->wfmt == 0)
        cs_linear_i8_packed(x, K, S->T, K, (const int8_t *)w, scale, bias, N, y, N, S->xq, S->xd, S->nt);
    else
        cs_linear_q4(x, K, S->T, K, (const uint8_t *)w, L->wfmt == 2, bias, N, y, N, (int8_t *)S->xq, S->xd, S->xs,
                     S->nt);
}

/* Per-op wall time of cs_decoder_layer, for bench/decode_step.py --ops: off unless
 * cs_op_times_enable(1); then each op's nanoseconds add up in cs_op_ns (the order of
 * CS_OP_NAMES in engine/cpu/ops.py) until cs_op_times_enable(0) reads and clears them.
 * Not thread-safe: one engine step at a time, as the engine runs them. */
#define CS_NOPS 9
static int cs_op_on = 0;
static int64_t cs_op_ns[CS_NOPS];
static inline int64_t cs_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}
/* Turn the counters on (1) or off (0); copies the totals so far into out[CS_NOPS] (if not
 * NULL) and clears them. Returns CS_NOPS. */
CS_EXPORT int cs_op_times_enable(int on, int64_t *out) {
    if (out) memcpy(out, cs_op_ns, sizeof(cs_op_ns));
    memset(cs_op_ns, 0, sizeof(cs_op_ns));
    cs_op_on = on;
    return CS_NOPS;
}
#define CS_TICK(i)                                       \
    do {                                                 \
        if (cs_op_on) {                                  \
            const int64_t t_ = cs_now_ns();              \
            cs_op_ns[(i)] += t_ - t_prev;                \
            t_prev = t_;                                 \
        }                                                \
    } while (0)

/* One decoder layer, the same equations as engine/models/llama.py's DecoderLayer:
 *   residual += x;  n = RMSNorm(residual)
 *   q, k, v = RoPE(W_qkv n)            (K and V stored in the cache)
 *   x = W_o Attn(q, k, v);  residual += x;  n = RMSNorm(residual)
 *   x = W_down (SiLU(W_gate n) * W_up n)
 * Returns 0, or -1 when attention could not allocate its scratch memory. */
CS_EXPORT int cs_decoder_layer(const cs_layer *L, cs_step *S) {
    const int64_t T = S->T, hid = L->hidden, qd = L->heads * L->head_dim, kvd = L->kv_heads * L->head_dim;
    const int64_t qkv_n = qd + 2 * kvd;
    int64_t t_prev = cs_op_on ? cs_now_ns() : 0;
    if (S->first) {
        memcpy(S->residual, S->x, (size_t)(T * hid) * 4);
        cs_add_rms_norm(S->residual, NULL, L->attn_norm, L->eps, T, hid, S->normed, S->nt);
        S->first = 0;
    } else {
        cs_add_rms_norm(S->residual, S->x, L->attn_norm, L->eps, T, hid, S->normed, S->nt);
    }
    CS_TICK(0);
    layer_linear(L, S, S->normed, hid, L->qkv_w, L->qkv_s, L->qkv_b, qkv_n, S->qkv);
    CS_TICK(1);
    cs_rope(S->qkv, qkv_n, T, L->heads + L->kv_heads, L->head_dim, S->rope, S->positions, S->nt);
    CS_TICK(2);
    int rc = cs_paged_attention(S->qkv, qkv_n, S->qkv + qd, qkv_n, S->qkv + qd + kvd, qkv_n, S->slots, T,
                                L->k_cache, L->v_cache, S->kv_bf16, S->block_tables, S->max_blocks, S->seq_lens,
                                S->query_start, S->B, L->heads, L->kv_heads, L->head_dim, S->block_size, L->scale,
                                S->attn, S->nt);
    if (rc != 0) return rc;
    CS_TICK(3);
    layer_linear(L, S, S->attn, qd, L->o_w, L->o_s, NULL, hid, S->x);
    CS_TICK(4);
    cs_add_rms_norm(S->residual, S->x, L->mlp_norm, L->eps, T, hid, S->normed, S->nt);
    CS_TICK(5);
    layer_linear(L, S, S->normed, hid, L->gate_up_w, L->gate_up_s, NULL, 2 * L->inter, S->gate_up);
    CS_TICK(6);
    cs_silu_mul(S->gate_up, T, L->inter, S->act, S->nt);
    CS_TICK(7);
    layer_linear(L, S, S->act, L->inter, L->down_w, L->down_s, NULL, hid, S->x);
    CS_TICK(8);
    return 0;
}
