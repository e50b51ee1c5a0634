/* Fused int8 blockwise absmax quantisation and its inverse, the nibble split of int8 codes, the
 * parameter checksum's mixing (geodiloco.params.Checksum), the coordinator's per-span round
 * arithmetic (int8 codes folded into the round's sum, the Nesterov step with the downlink's error
 * feedback, and θ += the decoded update with its checksum and norm), and secure aggregation's ring
 * packing, each one pass over memory.
 * Below one bit (the section of that name): per-block top-k, Elias-Fano index sets, the sign
 * code, and top-k's error-feedback residual.
 *
 * Eager torch needs five passes over the input to quantise (amax, amin, scale, round, cast);
 * here each block of `block` floats is read twice while it sits in L1 (absmax, then codes), so
 * the input streams from memory once. The arithmetic is the same IEEE fp32 sequence as the torch
 * path in quantize.py (step = absmax / 127, inv = 1 / step, code = round-half-even(x * inv)), so
 * both give identical bytes; tests/compression/test_kernels.py checks that they do.
 *
 * Build flags keep it exact: no -ffast-math, and -ffp-contract=off so that no multiply-add is
 * fused. Absolute values are compared as integers (the bit patterns of non-negative floats
 * order like the floats, and an integer max vectorises without -ffast-math); a pattern at or
 * above that of +Inf is an Inf or a NaN, so the same maximum detects non-finite input.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define ABS_MASK 0x7fffffffu
#define INF_BITS 0x7f800000u
#define ROUNDER 12582912.0f /* 1.5 * 2^23: x + R - R rounds |x| < 2^22 to nearest, ties to even */

/* One clone per instruction set, picked at load time: the same C vectorises 3.6x wider with
 * AVX2 and 6.6x with AVX-512 than with the x86-64 baseline (SSE2). Results are identical. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define WIDEST_SIMD __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define WIDEST_SIMD
#endif

static inline uint32_t block_absmax_bits(const float *x, Py_ssize_t n)
{
    uint32_t m = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, &x[i], sizeof bits);
        bits &= ABS_MASK;
        m = bits > m ? bits : m;
    }
    return m;
}

static inline void block_codes(const float *x, Py_ssize_t n, float inv, int8_t *codes)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        float y = x[i] * inv;
        y = (y + ROUNDER) - ROUNDER;
        codes[i] = (int8_t)(int32_t)y;
    }
}

/* 1 when every element is finite (outputs written), 0 at the first block holding a NaN or Inf. */
WIDEST_SIMD
static int quantize_blocks(const float *src, Py_ssize_t numel, Py_ssize_t block, float *step, int8_t *dst)
{
    Py_ssize_t nblocks = (numel + block - 1) / block;
    for (Py_ssize_t b = 0; b < nblocks; b++) {
        Py_ssize_t start = b * block, n = numel - start < block ? numel - start : block;
        uint32_t bits = block_absmax_bits(src + start, n);
        if (bits >= INF_BITS)
            return 0;
        float absmax;
        memcpy(&absmax, &bits, sizeof absmax);
        float s = absmax / 127.0f;
        step[b] = s;
        block_codes(src + start, n, s > 0.0f ? 1.0f / s : 0.0f, dst + start);
    }
    return 1;
}

/* 1 when every code is on the grid (out written), 0 when one is -128. */
WIDEST_SIMD
static int dequantize_blocks(const float *step, const int8_t *codes, Py_ssize_t numel, Py_ssize_t block,
                             float *out)
{
    int8_t low = 0;
    for (Py_ssize_t start = 0, b = 0; start < numel; start += block, b++) {
        Py_ssize_t n = numel - start < block ? numel - start : block;
        const int8_t *c = codes + start;
        float s = step[b];
        for (Py_ssize_t i = 0; i < n; i++) {
            low = c[i] < low ? c[i] : low;
            out[start + i] = (float)c[i] * s;
        }
    }
    return low > -128;
}

#define SQUARES_RUN 65536 /* codes whose Σ code² (at most 128² each) an int32 holds exactly */

/* Σ (step_b · code_i)² in double: Σ code² per block is an exact integer (at most 127² a code),
 * times step_b² once a block, so the norm of a q8 chunk needs no fp32 copy of its values. The
 * integer sums run in int32 over at most SQUARES_RUN codes at a time, which vectorises as
 * 16-bit multiply-adds (an int64 sum per code did not: 0.30 against 0.18 ns a code).
 * 1 when every code is on the grid (out written), 0 when one is -128. */
WIDEST_SIMD
static int sumsq_blocks(const float *step, const int8_t *codes, Py_ssize_t numel, Py_ssize_t block,
                        double *out)
{
    int8_t low = 0;
    double total = 0.0;
    for (Py_ssize_t start = 0, b = 0; start < numel; start += block, b++) {
        Py_ssize_t n = numel - start < block ? numel - start : block;
        const int8_t *c = codes + start;
        int64_t squares = 0;
        for (Py_ssize_t at = 0; at < n; at += SQUARES_RUN) {
            Py_ssize_t m = n - at < SQUARES_RUN ? n - at : SQUARES_RUN;
            int32_t run = 0;
            for (Py_ssize_t i = at; i < at + m; i++) {
                low = c[i] < low ? c[i] : low;
                run += (int16_t)c[i] * (int16_t)c[i];
            }
            squares += run;
        }
        double s = (double)step[b];
        total += s * s * (double)squares;
    }
    *out = total;
    return low > -128;
}

/* Split n bytes into their high and their low nibbles, two per byte: byte j of `hi` holds the
 * high nibbles of u[2j] (low half) and u[2j+1] (high half), `lo` likewise; an odd last byte
 * pairs with zero. Gaussian-like int8 codes keep almost all of their redundancy in the high
 * nibbles, so an entropy coder given only those does half the work for ~the same size. */
WIDEST_SIMD
static void split_nibbles(const uint8_t *u, Py_ssize_t n, uint8_t *hi, uint8_t *lo)
{
    Py_ssize_t pairs = n / 2;
    for (Py_ssize_t j = 0; j < pairs; j++) {
        uint8_t a = u[2 * j], b = u[2 * j + 1];
        hi[j] = (uint8_t)((a >> 4) | (b & 0xF0));
        lo[j] = (uint8_t)((a & 0x0F) | (b << 4));
    }
    if (n & 1) {
        hi[pairs] = (uint8_t)(u[n - 1] >> 4);
        lo[pairs] = (uint8_t)(u[n - 1] & 0x0F);
    }
}

WIDEST_SIMD
static void join_nibbles(const uint8_t *hi, const uint8_t *lo, Py_ssize_t n, uint8_t *u)
{
    Py_ssize_t pairs = n / 2;
    for (Py_ssize_t j = 0; j < pairs; j++) {
        u[2 * j] = (uint8_t)((lo[j] & 0x0F) | (hi[j] << 4));
        u[2 * j + 1] = (uint8_t)((lo[j] >> 4) | (hi[j] & 0xF0));
    }
    if (n & 1)
        u[n - 1] = (uint8_t)((lo[pairs] & 0x0F) | (hi[pairs] << 4));
}

/* The parameter checksum (geodiloco.params.Checksum): element i of a run starting at canonical
 * index `first` contributes splitmix64's finaliser of (first + i) * GOLDEN + (its fp32 bits) to
 * two sums, of the low and of the high 32 bits. Unsigned 64-bit arithmetic wraps exactly as
 * numpy's uint64 does in the Python path, so both give the same sums; the caller keeps a run
 * under 2^32 elements so that neither sum can wrap.
 *
 * The loops below carry (first + i) * GOLDEN as a running key advanced by GOLDEN per element
 * (the same value, modulo 2^64): without AVX-512 a 64-bit vector multiply is three 32-bit ones,
 * and this drops one of the hash's three (checksum_range 1.18 to 0.84 ms per Mi elements). */
#define GOLDEN 0x9E3779B97F4A7C15ull

static inline uint64_t splitmix_finish(uint64_t x)
{
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static inline uint64_t mix_keyed(uint64_t key, float value)
{
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return splitmix_finish(key + bits);
}

WIDEST_SIMD
static void checksum_mix(const float *values, Py_ssize_t n, uint64_t first, uint64_t *low, uint64_t *high)
{
    uint64_t lo = 0, hi = 0, key = first * GOLDEN;
    for (Py_ssize_t i = 0; i < n; i++, key += GOLDEN) {
        uint64_t x = mix_keyed(key, values[i]);
        lo += x & 0xFFFFFFFFull;
        hi += x >> 32;
    }
    *low = lo;
    *high = hi;
}

/* total = w · (code · step), or total += w · (code · step) when `accumulate`: the q8 values of
 * `numel` codes (one step per `block` of them) scattered into rows of `row_len` elements placed
 * `stride` apart in `out`. The arithmetic is torch's for the same two steps (dequantize, then
 * mul or add with alpha, whose vector path is one fused multiply-add), so both paths agree
 * bit for bit. 1 when every code is on the grid, 0 when one is -128 (`out` then undefined). */
static inline int fold_row(const float *step, const int8_t *codes, Py_ssize_t k, Py_ssize_t n, Py_ssize_t block,
                           float w, int accumulate, float *out)
{
    int8_t low = 0;
    for (Py_ssize_t done = 0; done < n;) {
        Py_ssize_t b = (k + done) / block, run = (b + 1) * block - (k + done);
        run = run < n - done ? run : n - done;
        const int8_t *c = codes + k + done;
        float s = step[b], *o = out + done;
        if (accumulate)
            for (Py_ssize_t i = 0; i < run; i++) {
                low = c[i] < low ? c[i] : low;
                o[i] = fmaf((float)c[i] * s, w, o[i]);
            }
        else
            for (Py_ssize_t i = 0; i < run; i++) {
                low = c[i] < low ? c[i] : low;
                o[i] = ((float)c[i] * s) * w;
            }
        done += run;
    }
    return low > -128;
}

WIDEST_SIMD
static int fold_blocks(const float *step, const int8_t *codes, Py_ssize_t numel, Py_ssize_t block, Py_ssize_t row_len,
                       Py_ssize_t stride, float w, int accumulate, float *out)
{
    int valid = 1;
    for (Py_ssize_t k = 0, r = 0; k < numel; k += row_len, r++)
        valid &= fold_row(step, codes, k, row_len, block, w, accumulate, out + r * stride);
    return valid;
}

/* One span of the coordinator's round close with Nesterov momentum and downlink error feedback:
 * avg = total / divisor; m = μ·m + avg; change = -lr · (avg + μ·m); send = change + decay·send
 * (send holds the residual before, the value to encode after). The same IEEE operations as the
 * torch path in coordinator/outer_optimizer.py (whose add with alpha is a fused multiply-add). */
WIDEST_SIMD
static void nesterov_send_span(const float *total, float *momentum, float *send, Py_ssize_t n, float divisor,
                               float mu, float neg_lr, float decay)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        float avg = total[i] / divisor;
        float m = momentum[i] * mu + avg;
        momentum[i] = m;
        send[i] = fmaf(send[i], decay, fmaf(m, mu, avg) * neg_lr);
    }
}

#define SQUARE_LANES 16 /* independent double accumulators: the sum vectorises, its order fixed */

/* θ += decoded (and residual -= decoded, where given), and of the new θ: the checksum sums (as
 * checksum_mix, `key` the element's (index * GOLDEN)) and Σ θ² in double, in one pass. */
static inline void add_hash_one(float *theta, const float *decoded, float *residual, Py_ssize_t i, uint64_t key,
                                double *square, uint64_t *lo, uint64_t *hi)
{
    float t = theta[i] + decoded[i];
    theta[i] = t;
    if (residual)
        residual[i] = residual[i] - decoded[i];
    *square += (double)t * (double)t;
    uint64_t x = mix_keyed(key, t);
    *lo += x & 0xFFFFFFFFull;
    *hi += x >> 32;
}

/* add_hash_one over n elements, into running sums: element i's square goes to lane
 * i % SQUARE_LANES, so a span cut into runs whose lengths are multiples of SQUARE_LANES sums
 * exactly as the whole. The checksum's sums are kept per lane as well (integer sums: any order
 * gives the same result), so no horizontal add runs every SQUARE_LANES elements; with the
 * running key, apply_q8 went from 1.62 to 1.28 ms per Mi elements. */
static inline void add_hash_run(float *theta, const float *decoded, float *residual, Py_ssize_t n, uint64_t first,
                                double lanes[SQUARE_LANES], uint64_t *low, uint64_t *high)
{
    uint64_t lo[SQUARE_LANES] = {0}, hi[SQUARE_LANES] = {0}, key = first * GOLDEN;
    Py_ssize_t full = n - n % SQUARE_LANES;
    for (Py_ssize_t a = 0; a < full; a += SQUARE_LANES, key += SQUARE_LANES * GOLDEN)
        for (int j = 0; j < SQUARE_LANES; j++)
            add_hash_one(theta, decoded, residual, a + j, key + (uint64_t)j * GOLDEN, &lanes[j], &lo[j], &hi[j]);
    for (Py_ssize_t i = full; i < n; i++, key += GOLDEN)
        add_hash_one(theta, decoded, residual, i, key, &lanes[i - full], &lo[0], &hi[0]);
    for (int j = 0; j < SQUARE_LANES; j++) {
        *low += lo[j];
        *high += hi[j];
    }
}

static inline double lane_total(const double lanes[SQUARE_LANES])
{
    double total = 0.0;
    for (int j = 0; j < SQUARE_LANES; j++)
        total += lanes[j];
    return total;
}

WIDEST_SIMD
static void add_hash_span(float *theta, const float *decoded, float *residual, Py_ssize_t n, uint64_t first,
                          double *sumsq, uint64_t *low, uint64_t *high)
{
    double lanes[SQUARE_LANES] = {0};
    *low = *high = 0;
    if (residual) /* two copies of the loop, each without a branch in it */
        add_hash_run(theta, decoded, residual, n, first, lanes, low, high);
    else
        add_hash_run(theta, decoded, NULL, n, first, lanes, low, high);
    *sumsq = lane_total(lanes);
}

#define APPLY_TILE 4096 /* decoded values staged in L1 between the codes and add_hash_run */

/* add_hash_span with decoded = the q8 values of (step, codes): each tile of codes is decoded as
 * dequantize_blocks does into a buffer that stays in cache, then added, so the update's fp32
 * values never cross memory. The same θ, residual, sums and Σ θ² as dequantize_q8 followed by
 * add_and_hash. 1 when every code is on the grid, 0 (nothing written) when one is -128. */
WIDEST_SIMD
static int apply_q8_span(float *theta, const float *step, const int8_t *codes, Py_ssize_t block, float *residual,
                         Py_ssize_t n, uint64_t first, double *sumsq, uint64_t *low, uint64_t *high)
{
    float tile[APPLY_TILE];
    double lanes[SQUARE_LANES] = {0};
    int8_t least = 0;
    *low = *high = 0;
    for (Py_ssize_t k = 0; k < n; k++) /* all codes first: a refused chunk writes nothing */
        least = codes[k] < least ? codes[k] : least;
    if (least == -128)
        return 0;
    for (Py_ssize_t at = 0; at < n; at += APPLY_TILE) {
        Py_ssize_t m = n - at < APPLY_TILE ? n - at : APPLY_TILE;
        for (Py_ssize_t i = at; i < at + m;) { /* the tile's pieces of blocks */
            Py_ssize_t b = i / block, end = (b + 1) * block < at + m ? (b + 1) * block : at + m;
            float s = step[b];
            for (Py_ssize_t k = i; k < end; k++)
                tile[k - at] = (float)codes[k] * s;
            i = end;
        }
        if (residual)
            add_hash_run(theta + at, tile, residual + at, m, first + (uint64_t)at, lanes, low, high);
        else
            add_hash_run(theta + at, tile, NULL, m, first + (uint64_t)at, lanes, low, high);
    }
    *sumsq = lane_total(lanes);
    return 1;
}

/* ---- Below one bit: per-block top-k, Elias-Fano index sets and the sign code ----------------
 *
 * Top-k keeps, in each block of `block` elements (the last may be shorter), the k largest
 * magnitudes, and of the elements equal to the k-th largest those at the lowest positions: the
 * rule of the torch path in sparsify.py, which tests hold these kernels to bit for bit. A
 * magnitude is compared as the integer of its bit pattern with the sign cleared, which orders
 * like the float (denormals and ±0 included) and vectorises without -ffast-math. There is no
 * sort. Counting passes over the block (which vectorise, the block sitting in L1) bracket the
 * k-th largest magnitude until at most 2k + TOPK_SPARE elements lie at or above the bracket's
 * lower end; those magnitudes are gathered, and counting passes over them alone narrow the
 * bracket until exactly k lie at or above its lower end, or it holds one value (ties); one last
 * pass emits the kept positions and values in order. A block starts its search just below the
 * previous block's threshold, which in a pseudo-gradient is usually one count away. Where the
 * CPU has AVX-512, the gather and the emitting pass use its compress instructions (16 elements
 * at a time, no branch); elsewhere they are scalar and branch-free. */

#if defined(__GNUC__)
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#else
#define ALWAYS_INLINE static inline
#endif

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define HAVE_AVX512_PATH 1
#endif

#define TOPK_SPARE 32
#define PROBE (1 << 21) /* a step in the bit pattern of about 19% in magnitude */
#define TOPK_MAX_BLOCK 0x7fffffffLL /* positions within a block are int32 */
#define LANES 16                    /* fp32 lanes of an AVX-512 vector: the scratch's slack */

ALWAYS_INLINE int32_t magnitude(float v)
{
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return (int32_t)(bits & ABS_MASK);
}

ALWAYS_INLINE Py_ssize_t count_at_least(const float *x, Py_ssize_t n, int32_t t)
{
    int32_t count = 0; /* n < 2^31 */
    for (Py_ssize_t i = 0; i < n; i++)
        count += magnitude(x[i]) >= t;
    return count;
}

ALWAYS_INLINE Py_ssize_t count_mags_at_least(const int32_t *mag, Py_ssize_t n, int32_t t)
{
    int32_t count = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        count += mag[i] >= t;
    return count;
}

/* at_lo = count(magnitude >= lo) >= k > at_hi = count(magnitude >= hi). The kept elements are
 * those >= hi and the first k - at_hi (in position) of those in [lo, hi): once at_lo == k that
 * is all of them, and once hi == lo + 1 they are the ties at the k-th largest. */
typedef struct {
    int64_t lo, hi;
    Py_ssize_t at_lo, at_hi;
} Bracket;

/* Narrow the bracket b of a block's n magnitudes by counting passes until at most 2k + TOPK_SPARE
 * are >= lo or the bracket is final: steps (doubling) away from the end that a count has set, or
 * from `first` before any, then bisection once both ends are counted. */
ALWAYS_INLINE Bracket bracket(const float *x, Py_ssize_t n, Py_ssize_t k, Bracket b, int64_t first)
{
    int64_t step = 1 << 21;
    while (b.at_lo > 2 * k + TOPK_SPARE && b.hi - b.lo > 1) {
        int lo_seen = b.lo > 0, hi_seen = b.at_hi > 0; /* a count of 0 never sets hi: top counts */
        int64_t g = lo_seen && hi_seen ? b.lo + (b.hi - b.lo) / 2
                    : hi_seen          ? b.hi - step
                    : lo_seen          ? b.lo + step
                                       : first;
        if (g <= b.lo || g >= b.hi)
            g = b.lo + (b.hi - b.lo) / 2;
        Py_ssize_t c = count_at_least(x, n, (int32_t)g);
        if (c >= k)
            b.lo = g, b.at_lo = c;
        else
            b.hi = g, b.at_hi = c;
        step = step < (1 << 29) ? step * 2 : step;
    }
    return b;
}

/* Narrow the bracket by counting over the c gathered magnitudes (those >= lo) until it is final:
 * the count falls about linearly in the bit pattern across a narrow bracket, so each step
 * interpolates for k, and every other step bisects, which bounds the steps at twice bisection's. */
ALWAYS_INLINE Bracket narrow(const int32_t *mag, Py_ssize_t c, Py_ssize_t k, Bracket b)
{
    for (int bisect = 0; b.at_lo != k && b.hi - b.lo > 1; bisect = !bisect) {
        int64_t g = b.lo + (b.hi - b.lo) / 2;
        if (!bisect) {
            double share = ((double)(b.at_lo - k) + 0.5) / (double)(b.at_lo - b.at_hi);
            g = b.lo + (int64_t)(share * (double)(b.hi - b.lo));
            g = g <= b.lo ? b.lo + 1 : g >= b.hi ? b.hi - 1 : g;
        }
        Py_ssize_t at = count_mags_at_least(mag, c, (int32_t)g);
        if (at >= k)
            b.lo = g, b.at_lo = at;
        else
            b.hi = g, b.at_hi = at;
    }
    return b;
}

/* The portable path: gather positions and magnitudes >= lo (pos and mag hold n + 1 entries:
 * every element is written, and kept by advancing the count), narrow, then walk the gathered
 * positions and emit the kept ones, stopping at the k-th. */
static Bracket keep_portable(const float *x, Py_ssize_t n, Py_ssize_t k, Bracket b, int64_t base, int32_t *pos,
                             int32_t *mag, int64_t *idx, float *val)
{
    Py_ssize_t c = 0;
    int32_t lo = (int32_t)b.lo;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t m = magnitude(x[i]);
        pos[c] = (int32_t)i;
        mag[c] = m;
        c += m >= lo;
    }
    b = narrow(mag, c, k, b);
    lo = (int32_t)b.lo;
    int32_t hi = (int32_t)b.hi;
    Py_ssize_t ties = k - b.at_hi, o = 0;
    for (Py_ssize_t j = 0; j < c && o < k; j++) {
        float v = x[pos[j]];
        int32_t m = magnitude(v);
        int between = (m >= lo) & (m < hi), keep = (m >= hi) | (between & (ties > 0));
        ties -= between & keep;
        idx[o] = base + pos[j];
        val[o] = v;
        o += keep;
    }
    return b;
}

#ifdef HAVE_AVX512_PATH
/* Kept lanes of one vector of 16 magnitudes m (lanes outside `in` masked off): those >= hi, and
 * of those in [lo, hi) the first `*ties` (in position), counted off. */
__attribute__((target("avx512f"))) static inline __mmask16 kept_lanes(__m512i m, __mmask16 in, __m512i lo, __m512i hi,
                                                                      Py_ssize_t *ties)
{
    __mmask16 above = _mm512_mask_cmpge_epi32_mask(in, m, hi);
    __mmask16 between = _mm512_mask_cmpge_epi32_mask(in, m, lo) & (__mmask16)~above;
    Py_ssize_t taken = __builtin_popcount(between);
    if (taken > *ties) { /* the last ties of the block: keep the first */
        __mmask16 first = 0;
        for (Py_ssize_t t = 0; t < *ties; t++, between &= (__mmask16)(between - 1))
            first |= (__mmask16)(between & -between);
        between = first;
        taken = *ties;
    }
    *ties -= taken;
    return above | between;
}

/* The same with AVX-512 compress, the whole block: its first pass takes the largest magnitude,
 * counts those >= the guess (the previous block's threshold, lowered a little) and gathers them,
 * so that where that count is between k and 2k + TOPK_SPARE (usually) no other pass over the
 * block is needed before the emitting one; elsewhere counting passes bracket and gather again.
 * The emitting pass writes the kept elements' positions in the block 16 at a time (where every
 * element in [lo, hi) is kept, the usual case, one comparison a vector decides); a last pass
 * over those k writes their indices (base + position) to idx and gathers their values to val.
 * mag and pos have LANES entries of slack past what they keep (a compressed vector is stored
 * whole). 0 when the block holds a NaN or an Inf; else 1, with *guess set for the next block. */
__attribute__((target("avx512f"))) static int block_avx512(const float *x, Py_ssize_t n, Py_ssize_t k, int64_t *guess,
                                                          int32_t *mag, int32_t *pos, int64_t base, int64_t *idx,
                                                          float *val)
{
    const __m512i abs_mask = _mm512_set1_epi32((int)ABS_MASK);
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i step = _mm512_set1_epi32(LANES);
    Py_ssize_t full = n - n % LANES, c = 0;
    int32_t g = *guess > 0 ? (int32_t)*guess : INT32_MAX;
    __m512i lo = _mm512_set1_epi32(g), most = _mm512_setzero_si512();
    for (Py_ssize_t i = 0; i < full; i += LANES) {
        __m512i m = _mm512_and_si512(_mm512_loadu_si512(x + i), abs_mask);
        most = _mm512_max_epi32(most, m);
        __mmask16 at = _mm512_cmpge_epi32_mask(m, lo);
        _mm512_storeu_si512(mag + c, _mm512_maskz_compress_epi32(at, m));
        c += __builtin_popcount(at);
    }
    int32_t top = _mm512_reduce_max_epi32(most);
    for (Py_ssize_t i = full; i < n; i++) {
        mag[c] = magnitude(x[i]);
        top = mag[c] > top ? mag[c] : top;
        c += mag[c] >= g;
    }
    if ((uint32_t)top >= INF_BITS)
        return 0;
    Bracket b = {0, (int64_t)top + 1, n, 0};
    if (g <= top) {
        if (c >= k)
            b.lo = g, b.at_lo = c;
        else
            b.hi = g, b.at_hi = c;
    }
    if (b.lo != g || c > 2 * k + TOPK_SPARE) { /* the gathered ones will not do */
        b = bracket(x, n, k, b, (int64_t)top - (1 << 23));
        lo = _mm512_set1_epi32((int32_t)b.lo);
        c = 0;
        for (Py_ssize_t i = 0; i < full; i += LANES) {
            __m512i m = _mm512_and_si512(_mm512_loadu_si512(x + i), abs_mask);
            __mmask16 at = _mm512_cmpge_epi32_mask(m, lo);
            _mm512_storeu_si512(mag + c, _mm512_maskz_compress_epi32(at, m));
            c += __builtin_popcount(at);
        }
        for (Py_ssize_t i = full; i < n; i++) {
            mag[c] = magnitude(x[i]);
            c += mag[c] >= (int32_t)b.lo;
        }
    }
    if (b.hi - b.lo > 2 * PROBE) { /* hi is the maximum: a count a little above lo brackets tighter */
        Py_ssize_t above = count_mags_at_least(mag, c, (int32_t)(b.lo + PROBE));
        if (above >= k)
            b.lo += PROBE, b.at_lo = above;
        else
            b.hi = b.lo + PROBE, b.at_hi = above;
    }
    /* Keep only the gathered ones in [lo, hi): the counts to come are at_hi plus theirs. */
    Py_ssize_t inside = 0;
    __m512i lo_now = _mm512_set1_epi32((int32_t)b.lo), hi_now = _mm512_set1_epi32((int32_t)b.hi);
    for (Py_ssize_t j = 0; j < c; j += LANES) {
        __mmask16 in = j + LANES <= c ? 0xFFFF : (__mmask16)((1u << (c - j)) - 1);
        __m512i m = _mm512_maskz_loadu_epi32(in, mag + j);
        __mmask16 keep = _mm512_mask_cmpge_epi32_mask(in, m, lo_now) & _mm512_mask_cmplt_epi32_mask(in, m, hi_now);
        _mm512_storeu_si512(mag + inside, _mm512_maskz_compress_epi32(keep, m)); /* inside <= j */
        inside += __builtin_popcount(keep);
    }
    Bracket within = {b.lo, b.hi, b.at_lo - b.at_hi, 0};
    within = narrow(mag, inside, k - b.at_hi, within);
    b.lo = within.lo, b.hi = within.hi;
    b.at_lo = within.at_lo + b.at_hi, b.at_hi = within.at_hi + b.at_hi;
    lo = _mm512_set1_epi32((int32_t)b.lo);
    __m512i hi = _mm512_set1_epi32((int32_t)b.hi), at = lanes;
    Py_ssize_t ties = k - b.at_hi, o = 0, i = 0;
    if (b.at_lo == k) /* every element >= lo is kept */
        for (; i < full; i += LANES, at = _mm512_add_epi32(at, step)) {
            __m512 v = _mm512_loadu_ps(x + i);
            __mmask16 keep = _mm512_cmpge_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), abs_mask), lo);
            _mm512_storeu_si512(pos + o, _mm512_maskz_compress_epi32(keep, at));
            o += __builtin_popcount(keep);
        }
    else
        for (; i < full; i += LANES, at = _mm512_add_epi32(at, step)) {
            __m512 v = _mm512_loadu_ps(x + i);
            __mmask16 keep =
                kept_lanes(_mm512_and_si512(_mm512_castps_si512(v), abs_mask), 0xFFFF, lo, hi, &ties);
            _mm512_storeu_si512(pos + o, _mm512_maskz_compress_epi32(keep, at));
            o += __builtin_popcount(keep);
        }
    if (i < n) { /* the block's last n % 16 */
        __mmask16 in = (__mmask16)((1u << (n - i)) - 1);
        __m512 v = _mm512_maskz_loadu_ps(in, x + i);
        __mmask16 keep = kept_lanes(_mm512_and_si512(_mm512_castps_si512(v), abs_mask), in, lo, hi, &ties);
        _mm512_storeu_si512(pos + o, _mm512_maskz_compress_epi32(keep, at));
    }
    /* The kept positions widened to global int64 indices, and their values gathered. */
    __m512i first = _mm512_set1_epi64(base);
    for (Py_ssize_t j = 0; j < k; j += LANES) {
        __mmask16 in = j + LANES <= k ? 0xFFFF : (__mmask16)((1u << (k - j)) - 1);
        __m512i p = _mm512_maskz_loadu_epi32(in, pos + j);
        _mm512_mask_storeu_ps(val + j, in, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), in, p, x, 4));
        _mm512_mask_storeu_epi64(idx + j, (__mmask8)in,
                                 _mm512_add_epi64(first, _mm512_cvtepi32_epi64(_mm512_castsi512_si256(p))));
        _mm512_mask_storeu_epi64(idx + j + 8, (__mmask8)(in >> 8),
                                 _mm512_add_epi64(first, _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(p, 1))));
    }
    *guess = b.lo - (1 << 20);
    return 1;
}

static int avx512_ready = -1; /* whether this CPU runs block_avx512 (set at module load) */
#endif

/* The magnitudes' largest pattern, and how many are >= t, in one pass. */
ALWAYS_INLINE Py_ssize_t top_and_count(const float *x, Py_ssize_t n, int32_t t, uint32_t *top)
{
    uint32_t m = 0;
    int32_t count = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t bits = (uint32_t)magnitude(x[i]);
        m = bits > m ? bits : m;
        count += (int32_t)bits >= t;
    }
    *top = m;
    return count;
}

/* The kept elements of x (numel of them, blocks of `block`, k kept of each or all of a shorter
 * one): global positions into idx, values into val, in order; `portable` keeps to the portable
 * path on any CPU (tests compare the two). pos and mag are scratch of block + LANES entries.
 * 1, or 0 when x holds a NaN or an Inf (outputs undefined). */
WIDEST_SIMD
static int topk_blocks(const float *x, Py_ssize_t numel, Py_ssize_t block, Py_ssize_t k, int portable,
                       int32_t *pos, int32_t *mag, int64_t *idx, float *val)
{
    int64_t guess = -1;
    Py_ssize_t out = 0;
    for (Py_ssize_t start = 0; start < numel; start += block) {
        Py_ssize_t n = numel - start < block ? numel - start : block;
        const float *b = x + start;
        if (k >= n) {
            if (block_absmax_bits(b, n) >= INF_BITS)
                return 0;
            for (Py_ssize_t i = 0; i < n; i++) {
                idx[out + i] = start + i;
                val[out + i] = b[i];
            }
            out += n;
            continue;
        }
#ifdef HAVE_AVX512_PATH
        if (avx512_ready && !portable) {
            if (!block_avx512(b, n, k, &guess, mag, pos, start, idx + out, val + out))
                return 0;
            out += k;
            continue;
        }
#endif
        uint32_t top;
        Py_ssize_t at_guess = top_and_count(b, n, guess > 0 ? (int32_t)guess : INT32_MAX, &top);
        if (top >= INF_BITS)
            return 0;
        Bracket br = {0, (int64_t)top + 1, n, 0};
        if (guess > 0 && guess <= (int64_t)top) { /* the first count, made with the maximum */
            if (at_guess >= k)
                br.lo = guess, br.at_lo = at_guess;
            else
                br.hi = guess, br.at_hi = at_guess;
        }
        br = bracket(b, n, k, br, (int64_t)top - (1 << 23));
        br = keep_portable(b, n, k, br, start, pos, mag, idx + out, val + out);
        out += k;
        guess = br.lo - (1 << 20);
    }
    return 1;
}

/* Elias-Fano (indices.py): `low` low bits of each index packed LSB first, then the high parts in
 * unary, index i setting bit (index >> low) + i of the high part (out is zeroed first; flags is
 * scratch of high_bits bytes). 1, or 0 when the indices are not strictly increasing within
 * [0, universe). */
ALWAYS_INLINE void store_word(uint8_t *at, uint64_t word, Py_ssize_t room)
{
    if (room >= 8) /* little-endian, as the packed bytes; a fixed size is one store */
        memcpy(at, &word, 8);
    else
        for (Py_ssize_t b = 0; b < room; b++)
            at[b] = (uint8_t)(word >> (8 * b));
}

static int elias_fano_encode_all(const int64_t *idx, Py_ssize_t count, int64_t universe, int low,
                                 uint8_t *out_low, Py_ssize_t low_bytes, uint8_t *out_high, Py_ssize_t high_bits,
                                 uint8_t *flags)
{
    uint64_t mask = (1ull << low) - 1;
    int increasing = count && idx[0] >= 0 && idx[count - 1] < universe;
    for (Py_ssize_t j = 1; j < count; j++) /* first: an index past the universe would write past the high part */
        increasing &= idx[j] > idx[j - 1];
    if (!increasing)
        return 0;
    /* The high part: a byte per bit (flags, high_bits of them) set at each index, then packed
     * eight to a byte by one multiply (flag t of 8 lands in bit 56 + t, no two products overlap). */
    memset(flags, 0, (size_t)high_bits);
    for (Py_ssize_t i = 0; i < count; i++)
        flags[(Py_ssize_t)(idx[i] >> low) + i] = 1;
    Py_ssize_t b = 0;
    for (; b + 8 <= high_bits; b += 8) {
        uint64_t eight;
        memcpy(&eight, flags + b, 8);
        out_high[b / 8] = (uint8_t)((eight * 0x0102040810204080ull) >> 56);
    }
    for (; b < high_bits; b++)
        out_high[b / 8] |= (uint8_t)(flags[b] << (b % 8));
    /* The low parts: eight of up to 8 bits fill `low` whole bytes, stored as one word while a
     * whole word fits before the high part (it spills only zeros, which the high part, written
     * above, must not receive: the spill stays inside the low part); the rest bit by bit. */
    Py_ssize_t i = 0, at = 0;
    if (low && low <= 8)
        for (; i + 8 <= count && at + 8 <= low_bytes; i += 8, at += low) {
            uint64_t group = 0;
            for (int t = 0; t < 8; t++)
                group |= ((uint64_t)idx[i + t] & mask) << (t * low);
            memcpy(out_low + at, &group, 8);
        }
    uint64_t acc = 0;
    int held = 0;
    for (; i < count; i++)
        for (int bit = 0; bit < low; bit++) {
            acc |= ((uint64_t)idx[i] >> bit & 1) << held;
            if (++held == 64) {
                store_word(out_low + at, acc, low_bytes - at);
                at += 8, acc = 0, held = 0;
            }
        }
    if (held)
        store_word(out_low + at, acc, low_bytes - at);
    return 1;
}

ALWAYS_INLINE uint64_t load_bits64(const uint8_t *p, Py_ssize_t available)
{
    uint64_t v = 0;
    if (available >= 8) /* little-endian: the packed order */
        memcpy(&v, p, 8);
    else
        for (Py_ssize_t b = 0; b < available; b++)
            v |= (uint64_t)p[b] << (8 * b);
    return v;
}

/* ±s as the sign code decodes it, (bit ? 1 : -1) · s, without a branch: for a finite s >= 0
 * the product is s with its sign bit cleared or set, so the same bits. */
ALWAYS_INLINE float signed_scale(unsigned bit, float s)
{
    uint32_t u;
    memcpy(&u, &s, sizeof u);
    u ^= (uint32_t)(~bit & 1u) << 31;
    memcpy(&s, &u, sizeof s);
    return s;
}

/* The inverse: 0 with count indices in idx; 1 when the first high_bits bits of the high part
 * do not hold exactly count ones (*detail: how many they hold); 2 when the indices are not
 * strictly increasing; 3 when the last is at or past universe (*detail: it). Three simple
 * passes over idx (high parts from the set bits, low parts eight at a time where they are 8
 * bits or fewer, then the checks) run faster than one that does all three per index. */
static int elias_fano_decode_all(const uint8_t *raw_low, Py_ssize_t low_bytes, const uint8_t *raw_high,
                                 Py_ssize_t high_bits, Py_ssize_t count, int64_t universe, int low, int64_t *idx,
                                 int64_t *detail)
{
    Py_ssize_t ones = 0, high_bytes = (high_bits + 7) / 8;
    for (Py_ssize_t w = 0; w * 64 < high_bits; w++) {
        uint64_t word = load_bits64(raw_high + 8 * w, high_bytes - 8 * w);
        if (high_bits - w * 64 < 64)
            word &= (1ull << (high_bits - w * 64)) - 1;
        Py_ssize_t here = __builtin_popcountll(word);
        if (ones + here > count) { /* too many ones: count them all, decode nothing more */
            ones += here;
            continue;
        }
        for (; word; word &= word - 1, ones++)
            idx[ones] = (int64_t)(w * 64 + __builtin_ctzll(word) - ones) << low;
    }
    if (ones != count) {
        *detail = ones;
        return 1;
    }
    uint64_t mask = (1ull << low) - 1;
    Py_ssize_t i = 0, at = 0; /* at: the byte of index i's low bits, while groups fill bytes */
    if (low && low <= 8)
        for (; i + 8 <= count && at + 8 <= low_bytes; i += 8, at += low) {
            uint64_t group;
            memcpy(&group, raw_low + at, 8);
            for (int t = 0; t < 8; t++)
                idx[i + t] |= (int64_t)(group >> (t * low) & mask);
        }
    for (; low && i < count; i++) {
        Py_ssize_t bit = i * low;
        idx[i] |= (int64_t)(load_bits64(raw_low + bit / 8, low_bytes - bit / 8) >> (bit % 8) & mask);
    }
    int increasing = 1;
    for (Py_ssize_t j = 1; j < count; j++)
        increasing &= idx[j] > idx[j - 1];
    if (!increasing)
        return 2;
    if (count && idx[count - 1] >= universe) {
        *detail = idx[count - 1];
        return 3;
    }
    return 0;
}

/* Σ |v| of m values in double, summed as the binary tree of levels.py's torch path (neighbours
 * in pairs, then pairs of pairs, over `width` leaves, a power of two >= m, the missing ones zero):
 * a sum whose order is fixed, so both paths give the same bits. Adding a zero is exact, so the
 * tree over any width >= m gives the same sum. */
#define TREE_LEAVES 4096

static double tree_abs_sum(const float *v, Py_ssize_t m, Py_ssize_t width)
{
    if (m <= 0)
        return 0.0;
    if (width > TREE_LEAVES) {
        Py_ssize_t half = width / 2;
        double left = tree_abs_sum(v, m < half ? m : half, half);
        return m <= half ? left : left + tree_abs_sum(v + half, m - half, half);
    }
    if (width == 1)
        return fabs((double)v[0]);
    double s[TREE_LEAVES / 2];
    Py_ssize_t pairs = width / 2, full = m / 2;
    for (Py_ssize_t i = 0; i < full; i++)
        s[i] = fabs((double)v[2 * i]) + fabs((double)v[2 * i + 1]);
    for (Py_ssize_t i = full; i < pairs; i++)
        s[i] = 0.0;
    if (m & 1)
        s[full] = fabs((double)v[m - 1]);
    for (Py_ssize_t w = pairs; w > 1; w /= 2)
        for (Py_ssize_t i = 0; i < w / 2; i++)
            s[i] = s[2 * i] + s[2 * i + 1];
    return s[0];
}

static Py_ssize_t pow2_at_least(Py_ssize_t n)
{
    Py_ssize_t p = 1;
    while (p < n)
        p *= 2;
    return p;
}

#ifdef HAVE_AVX512_PATH
/* The sign bits of v[0..m) (v · inv > 0) into bits, from bit 0 of its first byte, 16 at a time:
 * whole bytes, the last one completed with zeros. */
__attribute__((target("avx512f"))) static void sign_bits_avx512(const float *v, Py_ssize_t m, float inv,
                                                               uint8_t *bits)
{
    __m512 scale = _mm512_set1_ps(inv), zero = _mm512_setzero_ps();
    Py_ssize_t i = 0;
    for (; i + LANES <= m; i += LANES) {
        uint16_t mask = _mm512_cmp_ps_mask(_mm512_mul_ps(_mm512_loadu_ps(v + i), scale), zero, _CMP_GT_OQ);
        memcpy(bits + i / 8, &mask, sizeof mask);
    }
    if (i < m) {
        __mmask16 in = (__mmask16)((1u << (m - i)) - 1);
        __mmask16 mask =
            _mm512_mask_cmp_ps_mask(in, _mm512_mul_ps(_mm512_maskz_loadu_ps(in, v + i), scale), zero, _CMP_GT_OQ);
        bits[i / 8] = (uint8_t)mask;
        if (m - i > 8)
            bits[i / 8 + 1] = (uint8_t)(mask >> 8);
    }
}
#endif

/* The sign code (levels.py, "sign"): per block of `block` values its mean magnitude s (fp32 of
 * the double mean), and per value one bit, set when v · (1 / s) > 0 (all clear when s is 0),
 * packed LSB first after the scales: 64 bits at a time, or with AVX-512 16 at a time where
 * blocks start on a 16-bit boundary. 1, or 0 when v holds a NaN or an Inf. */
WIDEST_SIMD
static int sign_encode_all(const float *v, Py_ssize_t count, Py_ssize_t block, float *scales, uint8_t *bits)
{
    Py_ssize_t width = pow2_at_least(block), bytes = (count + 7) / 8;
    if (block_absmax_bits(v, count) >= INF_BITS)
        return 0;
#ifdef HAVE_AVX512_PATH
    int wide = avx512_ready && block % LANES == 0;
#endif
    uint64_t word = 0;
    for (Py_ssize_t start = 0, b = 0; start < count; start += block, b++) {
        Py_ssize_t m = count - start < block ? count - start : block;
        float s = (float)(tree_abs_sum(v + start, m, width) / (double)m);
        float inv = s > 0.0f ? 1.0f / s : 0.0f;
        scales[b] = s;
#ifdef HAVE_AVX512_PATH
        if (wide) {
            sign_bits_avx512(v + start, m, inv, bits + start / 8);
            continue;
        }
#endif
        for (Py_ssize_t i = start; i < start + m; i++) {
            word |= (uint64_t)(v[i] * inv > 0.0f) << (i & 63);
            if ((i & 63) == 63) {
                store_word(bits + i / 64 * 8, word, 8);
                word = 0;
            }
        }
    }
#ifdef HAVE_AVX512_PATH
    if (wide)
        return 1;
#endif
    if (count & 63)
        store_word(bits + count / 64 * 8, word, bytes - count / 64 * 8);
    return 1;
}

#define SCATTER_TILE 8192 /* elements zeroed (or copied) and then written while in L1 */

/* The sign code's count values, ±s of their block: into out[i] (n == count), or, where idx is
 * given (increasing, each below n), into out[idx[i]] with every other element of out zeroed,
 * tile by tile so that each line is written while in cache. 1, or 0 when a scale is negative or
 * not finite, or the indices are not increasing within [0, n) (out then undefined). */
WIDEST_SIMD
static int sign_decode_all(const float *scales, const uint8_t *bits, Py_ssize_t count, Py_ssize_t block,
                           const int64_t *idx, float *out, Py_ssize_t n)
{
    Py_ssize_t nb = (count + block - 1) / block;
    for (Py_ssize_t b = 0; b < nb; b++)
        if (!(scales[b] >= 0.0f && scales[b] <= 3.40282346638528859812e+38f))
            return 0;
    if (!idx) {
        for (Py_ssize_t start = 0, b = 0; start < count; start += block, b++) {
            Py_ssize_t end = count - start < block ? count : start + block;
            for (Py_ssize_t i = start; i < end; i++)
                out[i] = signed_scale(bits[i >> 3] >> (i & 7), scales[b]);
        }
        return 1;
    }
    Py_ssize_t j = 0, b = 0, left = block; /* value j, its block, values left in that block */
    int64_t last = -1;
    for (Py_ssize_t start = 0; start < n; start += SCATTER_TILE) {
        Py_ssize_t end = n - start < SCATTER_TILE ? n : start + SCATTER_TILE;
        memset(out + start, 0, (size_t)(end - start) * sizeof *out);
        for (; j < count && idx[j] < end; j++) {
            if (idx[j] <= last)
                return 0;
            last = idx[j];
            out[last] = signed_scale(bits[j >> 3] >> (j & 7), scales[b]);
            if (!--left)
                b++, left = block;
        }
    }
    return j == count;
}

/* residual = x - decoded, for decoded zero but dec[i] at idx[i] (increasing, each below n): x
 * copied (unless residual is x) and the kept elements set to x - dec, tile by tile; the same bits
 * as the dense subtraction (x - 0 is x). 1, or 0 when the indices are not increasing in [0, n)
 * (residual then undefined). */
static int sparse_residual_all(const float *x, Py_ssize_t n, const int64_t *idx, const float *dec, Py_ssize_t count,
                               float *residual)
{
    Py_ssize_t j = 0;
    int64_t last = -1;
    for (Py_ssize_t start = 0; start < n; start += SCATTER_TILE) {
        Py_ssize_t end = n - start < SCATTER_TILE ? n : start + SCATTER_TILE;
        if (residual != x)
            memcpy(residual + start, x + start, (size_t)(end - start) * sizeof *x);
        for (; j < count && idx[j] < end; j++) {
            if (idx[j] <= last)
                return 0;
            last = idx[j];
            residual[last] = x[last] - dec[j];
        }
    }
    return j == count;
}

/* add_hash_span with decoded = the sign code's count values at idx (increasing, each below n)
 * and zero elsewhere: each tile of APPLY_TILE is zeroed, given its kept values and added while in
 * L1, as apply_q8_span does, so the same θ, residual, sums and Σ θ² as decoding first (θ + 0
 * included). 1, or 0 with nothing written when a scale is negative or not finite, or the indices
 * are not increasing within [0, n). */
WIDEST_SIMD
static int apply_sign_span(float *theta, const float *scales, const uint8_t *bits, Py_ssize_t count, Py_ssize_t block,
                           const int64_t *idx, float *residual, Py_ssize_t n, uint64_t first, double *sumsq,
                           uint64_t *low, uint64_t *high)
{
    float tile[APPLY_TILE];
    double lanes[SQUARE_LANES] = {0};
    *low = *high = 0;
    for (Py_ssize_t b = 0; b < (count + block - 1) / block; b++) /* all checks first: a refusal writes nothing */
        if (!(scales[b] >= 0.0f && scales[b] <= 3.40282346638528859812e+38f))
            return 0;
    for (Py_ssize_t j = 0; j < count; j++)
        if (idx[j] >= n || idx[j] <= (j ? idx[j - 1] : -1))
            return 0;
    Py_ssize_t j = 0, b = 0, left = block;
    for (Py_ssize_t at = 0; at < n; at += APPLY_TILE) {
        Py_ssize_t m = n - at < APPLY_TILE ? n - at : APPLY_TILE;
        memset(tile, 0, (size_t)m * sizeof *tile);
        for (; j < count && idx[j] < at + m; j++) {
            tile[idx[j] - at] = signed_scale(bits[j >> 3] >> (j & 7), scales[b]);
            if (!--left)
                b++, left = block;
        }
        if (residual)
            add_hash_run(theta + at, tile, residual + at, m, first + (uint64_t)at, lanes, low, high);
        else
            add_hash_run(theta + at, tile, NULL, m, first + (uint64_t)at, lanes, low, high);
    }
    *sumsq = lane_total(lanes);
    return 1;
}

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what)
{
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous%s buffer", what, writable ? " writable" : "");
        return -1;
    }
    return 0;
}

/* The first `n` buffers of a kernel call (bit i of `writable`: the i-th must be writable). On
 * failure nothing stays held and a Python error is set. */
static int get_buffers(int n, PyObject *const objs[], const char *const names[], int writable, Py_buffer views[])
{
    for (int i = 0; i < n; i++) {
        if (get_buffer(objs[i], &views[i], writable >> i & 1, names[i]) < 0) {
            while (i-- > 0)
                PyBuffer_Release(&views[i]);
            return -1;
        }
    }
    return 0;
}

static int check_block(Py_ssize_t block)
{
    if (block < 1) {
        PyErr_SetString(PyExc_ValueError, "block must be >= 1");
        return -1;
    }
    return 0;
}

/* The three buffers of a codec kernel call. */
static int get_arguments(PyObject *const objs[3], const char *const names[3], int writable, Py_buffer views[3])
{
    return get_buffers(3, objs, names, writable, views);
}

static void release_buffers(int n, Py_buffer views[])
{
    for (int i = 0; i < n; i++)
        PyBuffer_Release(&views[i]);
}

/* Release the buffers; NULL (the kernel's error, already set) when result < 0, else the bool. */
static PyObject *finish(Py_buffer views[3], int result)
{
    release_buffers(3, views);
    return result < 0 ? NULL : PyBool_FromLong(result);
}

PyDoc_STRVAR(quantize_q8_doc,
             "quantize_q8(x, block, steps, codes) -> bool\n\n"
             "Blockwise absmax int8 quantisation of the fp32 buffer x into steps (one fp32 per\n"
             "block) and codes (one int8 per element). Returns False, leaving the outputs\n"
             "undefined, when x holds a NaN or an Inf.");

static PyObject *quantize_q8(PyObject *self, PyObject *args)
{
    PyObject *objs[3];
    Py_ssize_t block;
    Py_buffer views[3]; /* x, steps, codes */
    if (!PyArg_ParseTuple(args, "OnOO", &objs[0], &block, &objs[1], &objs[2]))
        return NULL;
    if (check_block(block) < 0 || get_arguments(objs, (const char *const[]){"x", "steps", "codes"}, 0x6, views) < 0)
        return NULL;
    Py_ssize_t numel = views[0].len / (Py_ssize_t)sizeof(float);
    Py_ssize_t nblocks = (numel + block - 1) / block;
    if (views[0].len % (Py_ssize_t)sizeof(float) || views[2].len != numel ||
        views[1].len != nblocks * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "quantize_q8: buffer sizes do not match");
        return finish(views, -1);
    }
    int finite;
    Py_BEGIN_ALLOW_THREADS
    finite = quantize_blocks((const float *)views[0].buf, numel, block, (float *)views[1].buf,
                             (int8_t *)views[2].buf);
    Py_END_ALLOW_THREADS
    return finish(views, finite);
}

PyDoc_STRVAR(dequantize_q8_doc,
             "dequantize_q8(steps, codes, block, out) -> bool\n\n"
             "The inverse of quantize_q8 into the fp32 buffer out. Returns False, leaving out\n"
             "undefined, when a code is -128 (off the symmetric grid).");

static PyObject *dequantize_q8(PyObject *self, PyObject *args)
{
    PyObject *objs[3];
    Py_ssize_t block;
    Py_buffer views[3]; /* steps, codes, out */
    if (!PyArg_ParseTuple(args, "OOnO", &objs[0], &objs[1], &block, &objs[2]))
        return NULL;
    if (check_block(block) < 0 || get_arguments(objs, (const char *const[]){"steps", "codes", "out"}, 0x4, views) < 0)
        return NULL;
    Py_ssize_t numel = views[1].len;
    if (views[2].len != numel * (Py_ssize_t)sizeof(float) ||
        views[0].len != (numel + block - 1) / block * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "dequantize_q8: buffer sizes do not match");
        return finish(views, -1);
    }
    int valid;
    Py_BEGIN_ALLOW_THREADS
    valid = dequantize_blocks((const float *)views[0].buf, (const int8_t *)views[1].buf, numel, block,
                              (float *)views[2].buf);
    Py_END_ALLOW_THREADS
    return finish(views, valid);
}

PyDoc_STRVAR(sumsq_q8_doc,
             "sumsq_q8(steps, codes, block) -> float | None\n\n"
             "The sum of squares of the values dequantize_q8 would give (in double), or None\n"
             "when a code is -128 (off the symmetric grid).");

static PyObject *sumsq_q8(PyObject *self, PyObject *args)
{
    PyObject *objs[3];
    Py_ssize_t block;
    Py_buffer views[3]; /* steps, codes (the third is unused: codes again, read only) */
    if (!PyArg_ParseTuple(args, "OOn", &objs[0], &objs[1], &block))
        return NULL;
    objs[2] = objs[1];
    if (check_block(block) < 0 || get_arguments(objs, (const char *const[]){"steps", "codes", "codes"}, 0, views) < 0)
        return NULL;
    Py_ssize_t numel = views[1].len;
    if (views[0].len != (numel + block - 1) / block * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "sumsq_q8: buffer sizes do not match");
        return finish(views, -1);
    }
    double total;
    int valid;
    Py_BEGIN_ALLOW_THREADS
    valid = sumsq_blocks((const float *)views[0].buf, (const int8_t *)views[1].buf, numel, block, &total);
    Py_END_ALLOW_THREADS
    release_buffers(3, views);
    if (!valid)
        Py_RETURN_NONE;
    return PyFloat_FromDouble(total);
}

/* split_nibbles and join_nibbles: the same buffers (codes of n bytes, hi and lo of (n + 1) / 2
 * each), written in one direction or the other. */
static PyObject *nibbles(PyObject *args, int join)
{
    PyObject *objs[3];
    Py_buffer views[3]; /* codes, hi, lo */
    if (!PyArg_ParseTuple(args, "OOO", &objs[0], &objs[1], &objs[2]))
        return NULL;
    if (get_arguments(objs, (const char *const[]){"codes", "hi", "lo"}, join ? 0x1 : 0x6, views) < 0)
        return NULL;
    Py_ssize_t n = views[0].len, half = (n + 1) / 2;
    if (views[1].len != half || views[2].len != half) {
        PyErr_SetString(PyExc_ValueError, "nibbles: hi and lo must hold (len(codes) + 1) // 2 bytes each");
        return finish(views, -1);
    }
    uint8_t *codes = views[0].buf, *hi = views[1].buf, *lo = views[2].buf;
    Py_BEGIN_ALLOW_THREADS
    if (join)
        join_nibbles(hi, lo, n, codes);
    else
        split_nibbles(codes, n, hi, lo);
    Py_END_ALLOW_THREADS
    return finish(views, 1);
}

PyDoc_STRVAR(split_nibbles_doc,
             "split_nibbles(codes, hi, lo) -> bool\n\n"
             "Write the high nibbles of the bytes of codes into hi and the low ones into lo, two\n"
             "per byte (byte j: elements 2j and 2j+1); an odd last element pairs with zero.");

static PyObject *split_nibbles_py(PyObject *self, PyObject *args)
{
    return nibbles(args, 0);
}

PyDoc_STRVAR(join_nibbles_doc,
             "join_nibbles(codes, hi, lo) -> bool\n\n"
             "The inverse of split_nibbles: write the bytes whose nibbles are hi and lo into codes.");

static PyObject *join_nibbles_py(PyObject *self, PyObject *args)
{
    return nibbles(args, 1);
}

PyDoc_STRVAR(checksum_range_doc,
             "checksum_range(values, first) -> (low, high)\n\n"
             "The checksum sums of the fp32 buffer values (fewer than 2^32 elements) whose first\n"
             "element sits at canonical index first (see geodiloco.params.Checksum).");

static PyObject *checksum_range(PyObject *self, PyObject *args)
{
    PyObject *obj;
    unsigned long long first;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "OK", &obj, &first))
        return NULL;
    if (get_buffer(obj, &view, 0, "values") < 0)
        return NULL;
    Py_ssize_t n = view.len / (Py_ssize_t)sizeof(float);
    if (view.len % (Py_ssize_t)sizeof(float) || (unsigned long long)n >= (1ull << 32)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "checksum_range: values must be fp32, fewer than 2^32 of them");
        return NULL;
    }
    uint64_t low, high;
    Py_BEGIN_ALLOW_THREADS
    checksum_mix((const float *)view.buf, n, (uint64_t)first, &low, &high);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return Py_BuildValue("(KK)", (unsigned long long)low, (unsigned long long)high);
}

PyDoc_STRVAR(checksum_rows_doc,
             "checksum_rows(values, row_len, first, stride) -> (low, high)\n\n"
             "checksum_range over each row of row_len elements of the fp32 buffer values (fewer than\n"
             "2^32 elements), row r sitting at canonical index first + r * stride: the rows of a\n"
             "shard of a matrix, hashed in one call.");

static PyObject *checksum_rows(PyObject *self, PyObject *args)
{
    PyObject *obj;
    Py_ssize_t row_len;
    unsigned long long first, stride;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "OnKK", &obj, &row_len, &first, &stride))
        return NULL;
    if (get_buffer(obj, &view, 0, "values") < 0)
        return NULL;
    Py_ssize_t n = view.len / (Py_ssize_t)sizeof(float);
    if (view.len % (Py_ssize_t)sizeof(float) || (unsigned long long)n >= (1ull << 32) || row_len < 1 ||
        n % row_len) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError,
                        "checksum_rows: values must be fp32, fewer than 2^32 of them, whole rows of row_len >= 1");
        return NULL;
    }
    uint64_t low = 0, high = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < n / row_len; r++) {
        uint64_t lo, hi;
        checksum_mix((const float *)view.buf + r * row_len, row_len, (uint64_t)first + (uint64_t)r * stride, &lo,
                     &hi);
        low += lo;
        high += hi;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return Py_BuildValue("(KK)", (unsigned long long)low, (unsigned long long)high);
}

PyDoc_STRVAR(fold_q8_doc,
             "fold_q8(steps, codes, block, out, row_len, stride, weight, accumulate) -> bool\n\n"
             "out = weight * dequantize_q8(...) (out += ... when accumulate), the values laid in\n"
             "rows of row_len elements placed stride apart in the fp32 buffer out. Returns False,\n"
             "leaving out undefined, when a code is -128.");

static PyObject *fold_q8(PyObject *self, PyObject *args)
{
    PyObject *objs[3];
    Py_ssize_t block, row_len, stride;
    float weight;
    int accumulate;
    Py_buffer views[3]; /* steps, codes, out */
    if (!PyArg_ParseTuple(args, "OOnOnnfp", &objs[0], &objs[1], &block, &objs[2], &row_len, &stride, &weight,
                          &accumulate))
        return NULL;
    if (check_block(block) < 0 || get_arguments(objs, (const char *const[]){"steps", "codes", "out"}, 0x4, views) < 0)
        return NULL;
    Py_ssize_t numel = views[1].len, rows = row_len > 0 ? numel / row_len : 0;
    if (row_len < 1 || numel % row_len || !rows || stride < row_len ||
        views[2].len != ((rows - 1) * stride + row_len) * (Py_ssize_t)sizeof(float) ||
        views[0].len != (numel + block - 1) / block * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "fold_q8: buffer sizes or row layout do not match");
        return finish(views, -1);
    }
    int valid;
    Py_BEGIN_ALLOW_THREADS
    valid = fold_blocks((const float *)views[0].buf, (const int8_t *)views[1].buf, numel, block, row_len, stride,
                        weight, accumulate, (float *)views[2].buf);
    Py_END_ALLOW_THREADS
    return finish(views, valid);
}

PyDoc_STRVAR(nesterov_send_doc,
             "nesterov_send(total, momentum, send, divisor, mu, lr, decay) -> bool\n\n"
             "For fp32 buffers of one length: avg = total / divisor; momentum = mu * momentum + avg;\n"
             "send = -lr * (avg + mu * momentum) + decay * send, in place.");

static PyObject *nesterov_send(PyObject *self, PyObject *args)
{
    PyObject *objs[3];
    float divisor, mu, lr, decay;
    Py_buffer views[3]; /* total, momentum, send */
    if (!PyArg_ParseTuple(args, "OOOffff", &objs[0], &objs[1], &objs[2], &divisor, &mu, &lr, &decay))
        return NULL;
    if (get_arguments(objs, (const char *const[]){"total", "momentum", "send"}, 0x6, views) < 0)
        return NULL;
    Py_ssize_t n = views[0].len / (Py_ssize_t)sizeof(float);
    if (views[0].len % (Py_ssize_t)sizeof(float) || views[1].len != views[0].len || views[2].len != views[0].len) {
        PyErr_SetString(PyExc_ValueError, "nesterov_send: total, momentum and send must be fp32 of one length");
        return finish(views, -1);
    }
    Py_BEGIN_ALLOW_THREADS
    nesterov_send_span((const float *)views[0].buf, (float *)views[1].buf, (float *)views[2].buf, n, divisor, mu,
                       -lr, decay);
    Py_END_ALLOW_THREADS
    return finish(views, 1);
}

PyDoc_STRVAR(add_and_hash_doc,
             "add_and_hash(theta, decoded, residual, first) -> (sumsq, low, high)\n\n"
             "theta += decoded, and residual -= decoded unless residual is None (fp32 buffers of\n"
             "one length, fewer than 2^32 elements); returns the new theta's sum of squares (in\n"
             "double) and its checksum sums as checksum_range(theta, first) would.");

static PyObject *add_and_hash(PyObject *self, PyObject *args)
{
    PyObject *objs[3];
    unsigned long long first;
    Py_buffer views[3]; /* theta, decoded, residual */
    if (!PyArg_ParseTuple(args, "OOOK", &objs[0], &objs[1], &objs[2], &first))
        return NULL;
    int with_residual = objs[2] != Py_None;
    if (get_buffers(2 + with_residual, objs, (const char *const[]){"theta", "decoded", "residual"},
                    0x1 | (with_residual << 2), views) < 0)
        return NULL;
    Py_ssize_t n = views[0].len / (Py_ssize_t)sizeof(float);
    if (views[0].len % (Py_ssize_t)sizeof(float) || views[1].len != views[0].len ||
        (with_residual && views[2].len != views[0].len) || (unsigned long long)n >= (1ull << 32)) {
        release_buffers(2 + with_residual, views);
        PyErr_SetString(PyExc_ValueError,
                        "add_and_hash: theta, decoded and residual must be fp32 of one length, under 2^32");
        return NULL;
    }
    double sumsq;
    uint64_t low, high;
    Py_BEGIN_ALLOW_THREADS
    add_hash_span((float *)views[0].buf, (const float *)views[1].buf, with_residual ? (float *)views[2].buf : NULL,
                  n, (uint64_t)first, &sumsq, &low, &high);
    Py_END_ALLOW_THREADS
    release_buffers(2 + with_residual, views);
    return Py_BuildValue("(dKK)", sumsq, (unsigned long long)low, (unsigned long long)high);
}

PyDoc_STRVAR(apply_q8_doc,
             "apply_q8(theta, steps, codes, block, residual, first) -> (sumsq, low, high) | None\n\n"
             "add_and_hash(theta, dequantize_q8(steps, codes, block), residual, first) in one pass,\n"
             "the decoded values never written out: the same theta, residual and results. None, with\n"
             "nothing written, when a code is -128.");

static PyObject *apply_q8(PyObject *self, PyObject *args)
{
    PyObject *objs[4];
    Py_ssize_t block;
    unsigned long long first;
    Py_buffer views[4]; /* theta, steps, codes, residual */
    if (!PyArg_ParseTuple(args, "OOOnOK", &objs[0], &objs[1], &objs[2], &block, &objs[3], &first))
        return NULL;
    if (check_block(block) < 0)
        return NULL;
    int with_residual = objs[3] != Py_None;
    if (get_buffers(3 + with_residual, objs, (const char *const[]){"theta", "steps", "codes", "residual"},
                    0x1 | (with_residual << 3), views) < 0)
        return NULL;
    Py_ssize_t n = views[0].len / (Py_ssize_t)sizeof(float);
    if (views[0].len % (Py_ssize_t)sizeof(float) || views[2].len != n ||
        views[1].len != (n + block - 1) / block * (Py_ssize_t)sizeof(float) ||
        (with_residual && views[3].len != views[0].len) || (unsigned long long)n >= (1ull << 32)) {
        release_buffers(3 + with_residual, views);
        PyErr_SetString(PyExc_ValueError,
                        "apply_q8: theta and residual must be fp32 of one length n under 2^32, codes n bytes "
                        "and steps one fp32 per block");
        return NULL;
    }
    double sumsq = 0.0;
    uint64_t low = 0, high = 0;
    int valid;
    Py_BEGIN_ALLOW_THREADS
    valid = apply_q8_span((float *)views[0].buf, (const float *)views[1].buf, (const int8_t *)views[2].buf, block,
                          with_residual ? (float *)views[3].buf : NULL, n, (uint64_t)first, &sumsq, &low, &high);
    Py_END_ALLOW_THREADS
    release_buffers(3 + with_residual, views);
    if (!valid)
        Py_RETURN_NONE;
    return Py_BuildValue("(dKK)", sumsq, (unsigned long long)low, (unsigned long long)high);
}

/* Kept per full block, and in all, for topk_blocks with `numel` elements. */
static Py_ssize_t topk_count(Py_ssize_t numel, Py_ssize_t block, Py_ssize_t k)
{
    Py_ssize_t tail = numel % block;
    return numel / block * (k < block ? k : block) + (k < tail ? k : tail);
}

PyDoc_STRVAR(topk_doc,
             "topk(x, block, k, indices, values, portable=False) -> bool\n\n"
             "Per block of block elements of the fp32 buffer x (the last may be shorter), the k\n"
             "largest magnitudes (all of a block of k or fewer), ties at the k-th going to the\n"
             "lowest positions: their positions in x into the int64 buffer indices and their values\n"
             "into the fp32 buffer values, in order. False, outputs undefined, when x holds a NaN\n"
             "or an Inf. portable: without AVX-512 even where the CPU has it (the same result).");

static PyObject *topk(PyObject *self, PyObject *args)
{
    PyObject *objs[3];
    Py_ssize_t block, k;
    int portable = 0;
    Py_buffer views[3]; /* x, indices, values */
    if (!PyArg_ParseTuple(args, "OnnOO|p", &objs[0], &block, &k, &objs[1], &objs[2], &portable))
        return NULL;
    if (block < 1 || block > TOPK_MAX_BLOCK || k < 1) {
        PyErr_SetString(PyExc_ValueError, "topk: block must be in [1, 2^31) and k >= 1");
        return NULL;
    }
    if (get_arguments(objs, (const char *const[]){"x", "indices", "values"}, 0x6, views) < 0)
        return NULL;
    Py_ssize_t numel = views[0].len / (Py_ssize_t)sizeof(float), count = topk_count(numel, block, k);
    if (views[0].len % (Py_ssize_t)sizeof(float) || views[1].len != count * (Py_ssize_t)sizeof(int64_t) ||
        views[2].len != count * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "topk: indices and values must hold the kept count (int64, fp32)");
        return finish(views, -1);
    }
    Py_ssize_t scratch = (block < numel ? block : numel) + LANES;
    int32_t *pos = PyMem_RawMalloc((size_t)scratch * sizeof(int32_t));
    int32_t *mag = PyMem_RawMalloc((size_t)scratch * sizeof(int32_t));
    int finite = -1;
    if (pos && mag) {
        Py_BEGIN_ALLOW_THREADS
        finite = topk_blocks((const float *)views[0].buf, numel, block, k, portable, pos, mag,
                             (int64_t *)views[1].buf, (float *)views[2].buf);
        Py_END_ALLOW_THREADS
    } else {
        PyErr_NoMemory();
    }
    PyMem_RawFree(pos);
    PyMem_RawFree(mag);
    return finish(views, finite);
}

/* Elias-Fano's layout for count indices below universe (indices.py): low bits per index, bytes
 * of the low part and bits of the high part. -1 with a Python error where the kernels do not
 * apply (universe over 2^56, or not above the count). */
static int elias_fano_layout(int64_t universe, Py_ssize_t count, int *low, Py_ssize_t *low_bytes,
                             Py_ssize_t *high_bits)
{
    if (count < 1 || universe < count || universe >= (1LL << 56)) {
        PyErr_SetString(PyExc_ValueError, "elias_fano: need 1 <= count <= universe < 2^56");
        return -1;
    }
    int bits = 0;
    for (int64_t q = universe / count; q > 1; q >>= 1)
        bits++;
    *low = bits;
    *low_bytes = (count * bits + 7) / 8;
    *high_bits = count + ((universe - 1) >> bits) + 1;
    return 0;
}

PyDoc_STRVAR(elias_fano_encode_doc,
             "elias_fano_encode(indices, universe, out) -> bool\n\n"
             "Elias-Fano code (geodiloco.compression.indices) of the int64 buffer indices into the\n"
             "uint8 buffer out, of exactly the encoded size. False, out undefined, when the indices\n"
             "are not strictly increasing within [0, universe).");

static PyObject *elias_fano_encode(PyObject *self, PyObject *args)
{
    PyObject *objs[3];
    long long universe;
    Py_buffer views[3]; /* indices, out (twice: the third is unused) */
    if (!PyArg_ParseTuple(args, "OLO", &objs[0], &universe, &objs[1]))
        return NULL;
    objs[2] = objs[1];
    if (get_arguments(objs, (const char *const[]){"indices", "out", "out"}, 0x6, views) < 0)
        return NULL;
    Py_ssize_t count = views[0].len / (Py_ssize_t)sizeof(int64_t), low_bytes, high_bits;
    int low;
    if (elias_fano_layout(universe, count, &low, &low_bytes, &high_bits) < 0)
        return finish(views, -1);
    if (views[0].len % (Py_ssize_t)sizeof(int64_t) || views[1].len != low_bytes + (high_bits + 7) / 8) {
        PyErr_SetString(PyExc_ValueError, "elias_fano_encode: out must hold exactly the encoded size");
        return finish(views, -1);
    }
    uint8_t *out = views[1].buf, *flags = PyMem_RawMalloc((size_t)high_bits);
    int valid = -1;
    if (flags) {
        Py_BEGIN_ALLOW_THREADS
        memset(out, 0, (size_t)views[1].len);
        valid = elias_fano_encode_all((const int64_t *)views[0].buf, count, universe, low, out, low_bytes,
                                      out + low_bytes, high_bits, flags);
        Py_END_ALLOW_THREADS
    } else {
        PyErr_NoMemory();
    }
    PyMem_RawFree(flags);
    return finish(views, valid);
}

PyDoc_STRVAR(elias_fano_decode_doc,
             "elias_fano_decode(raw, universe, indices) -> (status, detail)\n\n"
             "The inverse of elias_fano_encode into the int64 buffer indices (its length the count).\n"
             "status 0: decoded; 1: the high part holds detail ones, not count; 2: the indices\n"
             "are not strictly increasing; 3: index detail is at or past universe.");

static PyObject *elias_fano_decode(PyObject *self, PyObject *args)
{
    PyObject *objs[3];
    long long universe;
    Py_buffer views[3]; /* raw, indices (twice: the third is unused) */
    if (!PyArg_ParseTuple(args, "OLO", &objs[0], &universe, &objs[1]))
        return NULL;
    objs[2] = objs[1];
    if (get_arguments(objs, (const char *const[]){"raw", "indices", "indices"}, 0x6, views) < 0)
        return NULL;
    Py_ssize_t count = views[1].len / (Py_ssize_t)sizeof(int64_t), low_bytes, high_bits;
    int low;
    if (elias_fano_layout(universe, count, &low, &low_bytes, &high_bits) < 0)
        return finish(views, -1);
    if (views[1].len % (Py_ssize_t)sizeof(int64_t) || views[0].len != low_bytes + (high_bits + 7) / 8) {
        PyErr_SetString(PyExc_ValueError, "elias_fano_decode: raw must hold exactly the encoded size");
        return finish(views, -1);
    }
    const uint8_t *raw = views[0].buf;
    int64_t detail = 0;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = elias_fano_decode_all(raw, low_bytes, raw + low_bytes, high_bits, count, universe, low,
                                   (int64_t *)views[1].buf, &detail);
    Py_END_ALLOW_THREADS
    release_buffers(3, views);
    return Py_BuildValue("(iL)", status, (long long)detail);
}

PyDoc_STRVAR(sign_encode_doc,
             "sign_encode(values, block, out) -> bool\n\n"
             "The sign code of the fp32 buffer values into the uint8 buffer out: one fp32 mean\n"
             "magnitude per block, then one bit per value (set: positive). False, out undefined,\n"
             "when values hold a NaN or an Inf.");

static PyObject *sign_encode(PyObject *self, PyObject *args)
{
    PyObject *objs[3];
    Py_ssize_t block;
    Py_buffer views[3]; /* values, out (twice: the third is unused) */
    if (!PyArg_ParseTuple(args, "OnO", &objs[0], &block, &objs[1]))
        return NULL;
    objs[2] = objs[1];
    if (check_block(block) < 0 || get_arguments(objs, (const char *const[]){"values", "out", "out"}, 0x6, views) < 0)
        return NULL;
    Py_ssize_t count = views[0].len / (Py_ssize_t)sizeof(float), head = (count + block - 1) / block * 4;
    if (views[0].len % (Py_ssize_t)sizeof(float) || views[1].len != head + (count + 7) / 8) {
        PyErr_SetString(PyExc_ValueError, "sign_encode: out must hold one fp32 per block and one bit per value");
        return finish(views, -1);
    }
    uint8_t *out = views[1].buf;
    float *scales = PyMem_RawMalloc((size_t)head + 1);
    int finite = -1;
    if (scales) {
        Py_BEGIN_ALLOW_THREADS
        finite = sign_encode_all((const float *)views[0].buf, count, block, scales, out + head);
        memcpy(out, scales, (size_t)head); /* out's scales need not be aligned */
        Py_END_ALLOW_THREADS
    } else {
        PyErr_NoMemory();
    }
    PyMem_RawFree(scales);
    return finish(views, finite);
}

PyDoc_STRVAR(sign_decode_doc,
             "sign_decode(raw, count, block, out, indices) -> bool\n\n"
             "The count values of the sign code raw (sign_encode's layout) into the fp32 buffer out:\n"
             "value i at out[i], or, where the int64 buffer indices is given, at out[indices[i]] and\n"
             "zero elsewhere. False, out undefined, when a scale is negative or not finite, or the\n"
             "indices are not strictly increasing within out.");

static PyObject *sign_decode(PyObject *self, PyObject *args)
{
    PyObject *objs[4];
    Py_ssize_t count, block;
    Py_buffer views[4]; /* raw, out, indices */
    if (!PyArg_ParseTuple(args, "OnnOO", &objs[0], &count, &block, &objs[1], &objs[2]))
        return NULL;
    if (check_block(block) < 0 || count < 0)
        return NULL;
    int with_indices = objs[2] != Py_None;
    if (get_buffers(2 + with_indices, objs, (const char *const[]){"raw", "out", "indices"}, 0x2, views) < 0)
        return NULL;
    Py_ssize_t head = (count + block - 1) / block * 4, n = views[1].len / (Py_ssize_t)sizeof(float);
    if (views[0].len != head + (count + 7) / 8 || views[1].len % (Py_ssize_t)sizeof(float) ||
        (with_indices ? views[2].len != count * (Py_ssize_t)sizeof(int64_t) : n != count)) {
        release_buffers(2 + with_indices, views);
        PyErr_SetString(PyExc_ValueError,
                        "sign_decode: raw must be the code of count values, out hold them (or indices name them)");
        return NULL;
    }
    const uint8_t *raw = views[0].buf;
    float *scales = PyMem_RawMalloc((size_t)head + 1);
    int valid = -1;
    if (scales) {
        Py_BEGIN_ALLOW_THREADS
        memcpy(scales, raw, (size_t)head);
        valid = sign_decode_all(scales, raw + head, count, block, with_indices ? (const int64_t *)views[2].buf : NULL,
                                (float *)views[1].buf, n);
        Py_END_ALLOW_THREADS
    } else {
        PyErr_NoMemory();
    }
    PyMem_RawFree(scales);
    release_buffers(2 + with_indices, views);
    return valid < 0 ? NULL : PyBool_FromLong(valid);
}

PyDoc_STRVAR(sparse_residual_doc,
             "sparse_residual(x, indices, decoded, residual) -> bool\n\n"
             "residual = x - (zeros but decoded at indices), for fp32 x and residual of one length\n"
             "(residual may be x itself), int64 indices (strictly increasing) and fp32 decoded of one\n"
             "length. False, residual undefined, when the indices are not increasing within x.");

static PyObject *sparse_residual(PyObject *self, PyObject *args)
{
    PyObject *objs[4];
    Py_buffer views[4]; /* x, indices, decoded, residual */
    if (!PyArg_ParseTuple(args, "OOOO", &objs[0], &objs[1], &objs[2], &objs[3]))
        return NULL;
    if (get_buffers(4, objs, (const char *const[]){"x", "indices", "decoded", "residual"}, 0x8, views) < 0)
        return NULL;
    Py_ssize_t n = views[0].len / (Py_ssize_t)sizeof(float), count = views[1].len / (Py_ssize_t)sizeof(int64_t);
    if (views[0].len % (Py_ssize_t)sizeof(float) || views[3].len != views[0].len ||
        views[1].len % (Py_ssize_t)sizeof(int64_t) || views[2].len != count * (Py_ssize_t)sizeof(float)) {
        release_buffers(4, views);
        PyErr_SetString(PyExc_ValueError,
                        "sparse_residual: x and residual must be fp32 of one length, decoded one fp32 per index");
        return NULL;
    }
    int valid;
    Py_BEGIN_ALLOW_THREADS
    valid = sparse_residual_all((const float *)views[0].buf, n, (const int64_t *)views[1].buf,
                                (const float *)views[2].buf, count, (float *)views[3].buf);
    Py_END_ALLOW_THREADS
    release_buffers(4, views);
    return PyBool_FromLong(valid);
}

PyDoc_STRVAR(apply_sign_doc,
             "apply_sign(theta, raw, count, block, indices, residual, first) -> (sumsq, low, high) | None\n\n"
             "add_and_hash(theta, decoded, residual, first) where decoded is zero but the count values\n"
             "of the sign code raw at the int64 indices (strictly increasing), in one pass that never\n"
             "writes decoded out: the same theta, residual and results. None, with nothing written,\n"
             "when a scale is negative or not finite, or an index is out of order or outside theta.");

static PyObject *apply_sign(PyObject *self, PyObject *args)
{
    PyObject *objs[4];
    Py_ssize_t count, block;
    unsigned long long first;
    Py_buffer views[4]; /* theta, raw, indices, residual */
    if (!PyArg_ParseTuple(args, "OOnnOOK", &objs[0], &objs[1], &count, &block, &objs[2], &objs[3], &first))
        return NULL;
    if (check_block(block) < 0 || count < 0)
        return NULL;
    int with_residual = objs[3] != Py_None;
    if (get_buffers(3 + with_residual, objs, (const char *const[]){"theta", "raw", "indices", "residual"},
                    0x1 | (with_residual << 3), views) < 0)
        return NULL;
    Py_ssize_t n = views[0].len / (Py_ssize_t)sizeof(float), head = (count + block - 1) / block * 4;
    if (views[0].len % (Py_ssize_t)sizeof(float) || views[1].len != head + (count + 7) / 8 ||
        views[2].len != count * (Py_ssize_t)sizeof(int64_t) || (with_residual && views[3].len != views[0].len) ||
        (unsigned long long)n >= (1ull << 32)) {
        release_buffers(3 + with_residual, views);
        PyErr_SetString(PyExc_ValueError,
                        "apply_sign: theta and residual must be fp32 of one length n under 2^32, raw the sign code "
                        "of count values and indices count int64");
        return NULL;
    }
    const uint8_t *raw = views[1].buf;
    float *scales = PyMem_RawMalloc((size_t)head + 1);
    if (!scales) {
        release_buffers(3 + with_residual, views);
        return PyErr_NoMemory();
    }
    double sumsq = 0.0;
    uint64_t low = 0, high = 0;
    int valid;
    Py_BEGIN_ALLOW_THREADS
    memcpy(scales, raw, (size_t)head);
    valid = apply_sign_span((float *)views[0].buf, scales, raw + head, count, block, (const int64_t *)views[2].buf,
                            with_residual ? (float *)views[3].buf : NULL, n, (uint64_t)first, &sumsq, &low, &high);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(scales);
    release_buffers(3 + with_residual, views);
    if (!valid)
        Py_RETURN_NONE;
    return Py_BuildValue("(dKK)", sumsq, (unsigned long long)low, (unsigned long long)high);
}

/* Ring packing for secure aggregation (security/secagg/ring.py): a span of n masked codes of
 * `bits` = 8 + h bits (h in 0..8) travels as its n low bytes, then the high h bits split into
 * planes of 8, 4, 2 and 1 bits (those in h, widest first, lowest bits first). A plane of width w
 * packs 8/w elements to a byte, strided: with m = ceil(n * w / 8), byte k holds elements k, k + m,
 * k + 2m, ... (element k + s*m at bit s*w). Every pass reads and writes contiguous memory, so
 * the loops vectorise (a bit stream of 10- or 11-bit fields does not). */
static int ring_planes(int bits, int widths[4])
{
    int h = bits - 8, k = 0;
    if (h < 0 || h > 8)
        return -1;
    for (int w = 8; w >= 1; w >>= 1)
        if (h & w)
            widths[k++] = w;
    return k;
}

static Py_ssize_t ring_size(Py_ssize_t n, int bits)
{
    int widths[4], planes = ring_planes(bits, widths);
    Py_ssize_t size = n;
    for (int p = 0; p < planes; p++)
        size += (n * widths[p] + 7) / 8;
    return size;
}

/* The first (widest) plane's passes also write the low bytes: together its strided passes visit
 * every element once, so the codes and the mask are read once for it (twice only at 11, 13, 14
 * and 15 bits, whose second and third planes take a pass each). */
WIDEST_SIMD
static void ring_pack_span(const uint16_t *mask, const int8_t *codes, Py_ssize_t n, int bits, uint8_t *out)
{
    int widths[4], planes = ring_planes(bits, widths), low = 8;
    if (planes == 0)
        for (Py_ssize_t i = 0; i < n; i++)
            out[i] = (uint8_t)(mask[i] + (uint16_t)(int16_t)codes[i]);
    uint8_t *hi = out + n;
    for (int p = 0; p < planes; p++) {
        int w = widths[p], per = 8 / w;
        Py_ssize_t m = (n * w + 7) / 8;
        uint16_t keep = (uint16_t)((1u << w) - 1u);
        memset(hi, 0, (size_t)m);
        for (int s = 0; s < per; s++) {
            Py_ssize_t base = s * m, count = n - base < m ? n - base : m;
            int shift = s * w;
            /* restrict: the low bytes and the plane are disjoint parts of one buffer */
            const uint16_t *restrict src = mask + base;
            const int8_t *restrict code = codes + base;
            uint8_t *restrict lo = out + base, *restrict plane = hi;
            if (p == 0) {
                for (Py_ssize_t k = 0; k < count; k++) {
                    uint16_t v = (uint16_t)(src[k] + (uint16_t)(int16_t)code[k]);
                    lo[k] = (uint8_t)v;
                    plane[k] = (uint8_t)(plane[k] | ((v >> low) & keep) << shift);
                }
            } else {
                for (Py_ssize_t k = 0; k < count; k++) {
                    uint16_t v = (uint16_t)(src[k] + (uint16_t)(int16_t)code[k]);
                    plane[k] = (uint8_t)(plane[k] | ((v >> low) & keep) << shift);
                }
            }
        }
        hi += m;
        low += w;
    }
}

WIDEST_SIMD
static void ring_add_span(const uint8_t *packed, Py_ssize_t n, int bits, uint16_t *acc)
{
    int widths[4], planes = ring_planes(bits, widths), low = 8;
    if (planes == 0)
        for (Py_ssize_t i = 0; i < n; i++)
            acc[i] = (uint16_t)(acc[i] + packed[i]);
    const uint8_t *hi = packed + n;
    for (int p = 0; p < planes; p++) {
        int w = widths[p], per = 8 / w;
        Py_ssize_t m = (n * w + 7) / 8;
        uint16_t keep = (uint16_t)((1u << w) - 1u);
        for (int s = 0; s < per; s++) {
            Py_ssize_t base = s * m, count = n - base < m ? n - base : m;
            int shift = s * w;
            const uint8_t *restrict lo = packed + base, *restrict plane = hi;
            uint16_t *restrict dst = acc + base;
            if (p == 0)
                for (Py_ssize_t k = 0; k < count; k++)
                    dst[k] = (uint16_t)(dst[k] + (uint16_t)(lo[k] | ((plane[k] >> shift) & keep) << low));
            else
                for (Py_ssize_t k = 0; k < count; k++)
                    dst[k] = (uint16_t)(dst[k] + (uint16_t)(((plane[k] >> shift) & keep) << low));
        }
        hi += m;
        low += w;
    }
}

/* ring_add_span for several pushes of one span, in tiles: the first plane's passes (which carry
 * the low bytes) run tile by tile over every push, so the tile of the sum stays in cache while
 * all pushes are added to it instead of streaming the whole sum through memory once per push. */
#define RING_TILE 8192
WIDEST_SIMD
static void ring_add_pushes(const uint8_t *const *packed, Py_ssize_t count, Py_ssize_t n, int bits, uint16_t *acc,
                            int assign)
{
    int widths[4], planes = ring_planes(bits, widths);
    int w = planes ? widths[0] : 8, per = planes ? 8 / w : 1;
    Py_ssize_t m = planes ? (n * w + 7) / 8 : n;
    uint16_t keep = (uint16_t)((1u << w) - 1u);
    for (Py_ssize_t k0 = 0; k0 < m; k0 += RING_TILE) {
        for (Py_ssize_t j = 0; j < count; j++) {
            for (int s = 0; s < per; s++) {
                Py_ssize_t base = s * m, cnt = n - base < m ? n - base : m;
                Py_ssize_t k1 = k0 + RING_TILE < cnt ? k0 + RING_TILE : cnt;
                const uint8_t *restrict lo = packed[j] + base, *restrict plane = packed[j] + n;
                uint16_t *restrict dst = acc + base;
                int shift = s * w;
                if (assign && j == 0) /* the first push sets the sum: no zeroing pass */
                    for (Py_ssize_t k = k0; k < k1; k++)
                        dst[k] = (uint16_t)(lo[k] | (planes ? ((plane[k] >> shift) & keep) << 8 : 0));
                else if (planes)
                    for (Py_ssize_t k = k0; k < k1; k++)
                        dst[k] = (uint16_t)(dst[k] + (uint16_t)(lo[k] | ((plane[k] >> shift) & keep) << 8));
                else
                    for (Py_ssize_t k = k0; k < k1; k++)
                        dst[k] = (uint16_t)(dst[k] + lo[k]);
            }
        }
    }
    /* the narrower planes (11, 13, 14, 15 bits), tiled the same way, each over every push */
    Py_ssize_t offset = n + m;
    int low = 8 + w;
    for (int p = 1; p < planes; p++) {
        int wp = widths[p], perp = 8 / wp;
        Py_ssize_t mp = (n * wp + 7) / 8;
        uint16_t keepp = (uint16_t)((1u << wp) - 1u);
        for (Py_ssize_t k0 = 0; k0 < mp; k0 += RING_TILE) {
            for (Py_ssize_t j = 0; j < count; j++) {
                for (int s = 0; s < perp; s++) {
                    Py_ssize_t base = s * mp, cnt = n - base < mp ? n - base : mp;
                    Py_ssize_t k1 = k0 + RING_TILE < cnt ? k0 + RING_TILE : cnt;
                    const uint8_t *restrict plane = packed[j] + offset;
                    uint16_t *restrict dst = acc + base;
                    int shift = s * wp;
                    for (Py_ssize_t k = k0; k < k1; k++)
                        dst[k] = (uint16_t)(dst[k] + (uint16_t)(((plane[k] >> shift) & keepp) << low));
                }
            }
        }
        offset += mp;
        low += wp;
    }
}

static int check_ring(int bits, Py_ssize_t n, Py_ssize_t packed_len)
{
    int widths[4];
    if (ring_planes(bits, widths) < 0) {
        PyErr_SetString(PyExc_ValueError, "ring bits must be in [8, 16]");
        return -1;
    }
    if (packed_len != ring_size(n, bits)) {
        PyErr_SetString(PyExc_ValueError, "packed buffer size does not match the element count");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(ring_pack_doc,
             "ring_pack(mask, codes, bits, out) -> bool\n\n"
             "out = (uint16 mask + int8 code) mod 2^bits per element, at `bits` per element\n"
             "(the low bytes, then the high bits in strided planes; ring.py).");

static PyObject *ring_pack(PyObject *self, PyObject *args)
{
    PyObject *objs[3];
    int bits;
    Py_buffer views[3]; /* mask, codes, out */
    if (!PyArg_ParseTuple(args, "OOiO", &objs[0], &objs[1], &bits, &objs[2]))
        return NULL;
    if (get_arguments(objs, (const char *const[]){"mask", "codes", "out"}, 0x4, views) < 0)
        return NULL;
    Py_ssize_t n = views[1].len;
    if (views[0].len != 2 * n) {
        PyErr_SetString(PyExc_ValueError, "ring_pack: mask and codes differ in length");
        return finish(views, -1);
    }
    if (check_ring(bits, n, views[2].len) < 0)
        return finish(views, -1);
    Py_BEGIN_ALLOW_THREADS
    ring_pack_span((const uint16_t *)views[0].buf, (const int8_t *)views[1].buf, n, bits, (uint8_t *)views[2].buf);
    Py_END_ALLOW_THREADS
    return finish(views, 1);
}

PyDoc_STRVAR(ring_add_doc,
             "ring_add(packed, bits, acc) -> bool\n\n"
             "acc += the ring elements of packed (ring_pack's layout), mod 2^16.");

static PyObject *ring_add(PyObject *self, PyObject *args)
{
    PyObject *objs[3];
    int bits;
    Py_buffer views[3]; /* packed, acc, acc */
    if (!PyArg_ParseTuple(args, "OiO", &objs[0], &bits, &objs[1]))
        return NULL;
    objs[2] = objs[1];
    if (get_arguments(objs, (const char *const[]){"packed", "acc", "acc"}, 0x6, views) < 0)
        return NULL;
    Py_ssize_t n = views[1].len / 2;
    if (views[1].len % 2 || check_ring(bits, n, views[0].len) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "ring_add: acc must hold uint16 elements");
        return finish(views, -1);
    }
    Py_BEGIN_ALLOW_THREADS
    ring_add_span((const uint8_t *)views[0].buf, n, bits, (uint16_t *)views[1].buf);
    Py_END_ALLOW_THREADS
    return finish(views, 1);
}

WIDEST_SIMD
static int32_t ring_signed_span(uint16_t *acc, Py_ssize_t n, int bits)
{
    int shift = 16 - bits;
    int32_t low = 0, high = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int16_t v = (int16_t)(int16_t)(uint16_t)(acc[i] << shift) >> shift;
        acc[i] = (uint16_t)v;
        low = v < low ? v : low;
        high = v > high ? v : high;
    }
    return -low > high ? -low : high;
}

PyDoc_STRVAR(ring_signed_doc,
             "ring_signed(acc, bits) -> int\n\n"
             "In place: each uint16 of acc, a ring element mod 2^bits, becomes the int16 in\n"
             "[-2^(bits-1), 2^(bits-1)) it stands for. Returns the largest magnitude.");

static PyObject *ring_signed(PyObject *self, PyObject *args)
{
    PyObject *obj;
    int bits;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "Oi", &obj, &bits))
        return NULL;
    if (get_buffer(obj, &view, 1, "acc") < 0)
        return NULL;
    if (bits < 8 || bits > 16 || view.len % 2) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "ring_signed: uint16 elements and bits in [8, 16]");
        return NULL;
    }
    int32_t largest;
    Py_BEGIN_ALLOW_THREADS
    largest = ring_signed_span((uint16_t *)view.buf, view.len / 2, bits);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromLong(largest);
}

PyDoc_STRVAR(ring_add_all_doc,
             "ring_add_all(payloads, bits, acc, assign) -> bool\n\n"
             "acc += the ring elements of every payload (ring_pack's layout, each of len(acc)\n"
             "elements), mod 2^16: ring_add for each, tiled so that acc stays in cache. With assign,\n"
             "acc = their sum (its old contents are not read).");

static PyObject *ring_add_all(PyObject *self, PyObject *args)
{
    PyObject *seq_obj, *acc_obj;
    int bits, assign;
    if (!PyArg_ParseTuple(args, "OiOp", &seq_obj, &bits, &acc_obj, &assign))
        return NULL;
    PyObject *seq = PySequence_Fast(seq_obj, "payloads must be a sequence of buffers");
    if (!seq)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq), held = 0;
    Py_buffer acc, *views = PyMem_Calloc((size_t)count + 1, sizeof(Py_buffer));
    const uint8_t **bufs = PyMem_Calloc((size_t)count + 1, sizeof(uint8_t *));
    int ok = 0, have_acc = 0;
    if (!views || !bufs)
        PyErr_NoMemory();
    else if (get_buffer(acc_obj, &acc, 1, "acc") == 0) {
        have_acc = 1;
        ok = acc.len % 2 == 0;
        if (!ok)
            PyErr_SetString(PyExc_ValueError, "ring_add_all: acc must hold uint16 elements");
    }
    Py_ssize_t n = ok ? acc.len / 2 : 0;
    while (ok && held < count) {
        if (get_buffer(PySequence_Fast_GET_ITEM(seq, held), &views[held], 0, "payload") < 0) {
            ok = 0;
            break;
        }
        bufs[held] = (const uint8_t *)views[held].buf;
        held++;
        if (check_ring(bits, n, views[held - 1].len) < 0)
            ok = 0;
    }
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        ring_add_pushes(bufs, count, n, bits, (uint16_t *)acc.buf, assign && count > 0);
        Py_END_ALLOW_THREADS
    }
    for (Py_ssize_t j = 0; j < held; j++)
        PyBuffer_Release(&views[j]);
    if (have_acc)
        PyBuffer_Release(&acc);
    PyMem_Free(views);
    PyMem_Free(bufs);
    Py_DECREF(seq);
    return ok ? PyBool_FromLong(1) : NULL;
}

static PyMethodDef methods[] = {
    {"quantize_q8", quantize_q8, METH_VARARGS, quantize_q8_doc},
    {"dequantize_q8", dequantize_q8, METH_VARARGS, dequantize_q8_doc},
    {"sumsq_q8", sumsq_q8, METH_VARARGS, sumsq_q8_doc},
    {"split_nibbles", split_nibbles_py, METH_VARARGS, split_nibbles_doc},
    {"join_nibbles", join_nibbles_py, METH_VARARGS, join_nibbles_doc},
    {"checksum_range", checksum_range, METH_VARARGS, checksum_range_doc},
    {"checksum_rows", checksum_rows, METH_VARARGS, checksum_rows_doc},
    {"fold_q8", fold_q8, METH_VARARGS, fold_q8_doc},
    {"nesterov_send", nesterov_send, METH_VARARGS, nesterov_send_doc},
    {"add_and_hash", add_and_hash, METH_VARARGS, add_and_hash_doc},
    {"apply_q8", apply_q8, METH_VARARGS, apply_q8_doc},
    {"topk", topk, METH_VARARGS, topk_doc},
    {"elias_fano_encode", elias_fano_encode, METH_VARARGS, elias_fano_encode_doc},
    {"elias_fano_decode", elias_fano_decode, METH_VARARGS, elias_fano_decode_doc},
    {"sign_encode", sign_encode, METH_VARARGS, sign_encode_doc},
    {"sign_decode", sign_decode, METH_VARARGS, sign_decode_doc},
    {"sparse_residual", sparse_residual, METH_VARARGS, sparse_residual_doc},
    {"apply_sign", apply_sign, METH_VARARGS, apply_sign_doc},
    {"ring_pack", ring_pack, METH_VARARGS, ring_pack_doc},
    {"ring_add", ring_add, METH_VARARGS, ring_add_doc},
    {"ring_signed", ring_signed, METH_VARARGS, ring_signed_doc},
    {"ring_add_all", ring_add_all, METH_VARARGS, ring_add_all_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernels", "Fused kernels (see _kernels.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__kernels(void)
{
#ifdef HAVE_AVX512_PATH
    __builtin_cpu_init();
    avx512_ready = __builtin_cpu_supports("avx512f");
#endif
    return PyModule_Create(&module);
}
