/* Fused int8 blockwise absmax quantisation and its inverse, the nibble split of int8 codes, the
 * parameter checksum's mixing (geodiloco.params.Checksum), the coordinator's per-span round
 * arithmetic (int8 codes folded into the round's sum, the Nesterov step with the downlink's error
 * feedback, and θ += the decoded update with its checksum and norm), and secure aggregation's ring
 * packing, each one pass over memory.
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
    return PyModule_Create(&module);
}
