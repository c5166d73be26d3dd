// The element-wise steps of a Llama-family layer in bfloat16, one call each instead of torch's chains of
// small ops (4-5 calls each, most of their time per-call overhead). Built and loaded by cpu_kernels.py;
// used by cpu_ops.py. Every step rounds to bfloat16 where the torch formulation does (model.py), and the
// RMS adds its squares in the order ATen's sum does, so the residual add, the RMSNorm and the rotary
// positions are torch's bit for bit; only the gated SiLU's expf may differ from torch's by an ulp. Rows are
// independent: each step splits them across `threads` (cpu_parallel.h), with the same bits on any count.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "cpu_parallel.h"

// Elements a thread takes at least (team_for): below that a second thread's start and join cost more than
// it saves (an RMSNorm of 16 x 576: 9.6 us on one thread, 11.1 on two).
enum { MIN_SPLIT = 8192 };

static inline __m512 load16(const uint16_t *p) {  // 16 bfloat16 -> float32
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline void store16(uint16_t *p, __m512 v) {  // round to nearest even (vcvtneps2bf16)
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v));
}

static inline __m512 round16(__m512 v) {  // to the nearest bfloat16, kept as float32
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// ATen's CPU sum of a contiguous float32 row, in its order of additions (SumKernel.cpp:
// vectorized_inner_sum -> row_sum -> multi_row_sum) for vectors of `lanes` floats (8 where the kernel
// is built for AVX2, 16 for AVX512: which one torch runs is found by comparing, cpu_ops.aten_sum_lanes;
// `n` a multiple of it): four interleaved vector accumulators, cascaded every 16 groups of four vectors,
// then the vectors left over, then the four added up, then the lanes one by one. Every addition is an
// explicitly rounded intrinsic, which -ffast-math may not reassociate.
enum { ILP = 4, LEVELS = 4 };
#define EXACT (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

static int64_t ceil_log2(int64_t x) {  // c10's CeilLog2
    return x <= 2 ? 1 : 64 - __builtin_clzll((uint64_t)(x - 1));
}

static float aten_row_sum(const float *x, int64_t n, int64_t lanes) {
    const __mmask16 live = (__mmask16)((1u << lanes) - 1);
    const int64_t vectors = n / lanes, groups = vectors / ILP;
    const int64_t scaled = ceil_log2(groups) / LEVELS, power = scaled > 4 ? scaled : 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    __m512 acc[LEVELS][ILP];
    for (int j = 0; j < LEVELS; j++)
        for (int k = 0; k < ILP; k++) acc[j][k] = _mm512_setzero_ps();
#define ADD_VECTOR(a, v) (a) = _mm512_add_round_ps((a), _mm512_maskz_loadu_ps(live, x + (v) * lanes), EXACT)
    int64_t i = 0;
    for (; i + step <= groups;) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < ILP; k++) ADD_VECTOR(acc[0][k], i * ILP + k);
        for (int j = 1; j < LEVELS; j++) {
            for (int k = 0; k < ILP; k++) {
                acc[j][k] = _mm512_add_round_ps(acc[j][k], acc[j - 1][k], EXACT);
                acc[j - 1][k] = _mm512_setzero_ps();
            }
            if (i & (mask << (j * power))) break;
        }
    }
    for (; i < groups; i++)
        for (int k = 0; k < ILP; k++) ADD_VECTOR(acc[0][k], i * ILP + k);
    for (int j = 1; j < LEVELS; j++)
        for (int k = 0; k < ILP; k++) acc[0][k] = _mm512_add_round_ps(acc[0][k], acc[j][k], EXACT);
    for (int64_t v = groups * ILP; v < vectors; v++) ADD_VECTOR(acc[0][0], v);
    for (int k = 1; k < ILP; k++) acc[0][0] = _mm512_add_round_ps(acc[0][0], acc[0][k], EXACT);
#undef ADD_VECTOR
    float partial[16];
    _mm512_storeu_ps(partial, acc[0][0]);
    __m128 total = _mm_setzero_ps();
    for (int64_t l = 0; l < lanes; l++) total = _mm_add_round_ss(total, _mm_set_ss(partial[l]), EXACT);
    return _mm_cvtss_f32(total);
}

// out[r] = the sum of row r of x ([rows, n], contiguous), added as aten_row_sum adds: to find which
// vector width torch's sum runs here (cpu_ops.aten_sum_lanes).
int aten_sum_rows(const float *x, int64_t rows, int64_t n, int64_t lanes, float *out) {
    if (n % lanes || (lanes != 8 && lanes != 16)) return -1;
    for (int64_t r = 0; r < rows; r++) out[r] = aten_row_sum(x + r * n, n, lanes);
    return 0;
}

// 1 / sqrt(sum / n + eps), each step correctly rounded, as torch's mean, add and rsqrt (1 / sqrt) compute it.
static float rms_scale(float sum, int64_t n, float eps) {
    const __m128 mean = _mm_div_round_ss(_mm_set_ss(sum), _mm_set_ss((float)n), EXACT);
    const __m128 root = _mm_sqrt_round_ss(mean, _mm_add_round_ss(mean, _mm_set_ss(eps), EXACT), EXACT);
    return _mm_cvtss_f32(_mm_div_round_ss(_mm_set_ss(1.0f), root, EXACT));
}

// Rows of `hidden` elements (a multiple of 16, at most MAX_HIDDEN). If delta: h += delta (rounded to
// bfloat16, as `h + delta`). Then out = weight * bfloat16(h * rsqrt(mean(h^2) + eps)): transformers'
// RMSNorm as model.rms_norm computes it, with the squares summed in ATen's order for `lanes`.
enum { MAX_HIDDEN = 16384 };

static int norm_rows(uint16_t *h, int64_t ld_h, const uint16_t *delta, int64_t ld_delta, const uint16_t *weight,
                     uint16_t *out, int64_t ld_out, int64_t hidden, float eps, int64_t lanes, int64_t first,
                     int64_t last) {
    float squares[MAX_HIDDEN];
    for (int64_t r = first; r < last; r++) {
        uint16_t *x = h + r * ld_h;
        for (int64_t i = 0; i < hidden; i += 16) {
            __m512 v = load16(x + i);
            if (delta) {
                v = round16(_mm512_add_ps(v, load16(delta + r * ld_delta + i)));  // as torch holds h + delta
                store16(x + i, v);
            }
            _mm512_storeu_ps(squares + i, _mm512_mul_ps(v, v));  // exact: a bfloat16's square fits float32
        }
        const __m512 scale = _mm512_set1_ps(rms_scale(aten_row_sum(squares, hidden, lanes), hidden, eps));
        for (int64_t i = 0; i < hidden; i += 16) {
            const __m512 normed = round16(_mm512_mul_ps(load16(x + i), scale));  // .to(bfloat16)
            store16(out + r * ld_out + i, _mm512_mul_ps(load16(weight + i), normed));
        }
    }
    return 0;
}

int add_rms_norm_bf16(uint16_t *h, int64_t ld_h, const uint16_t *delta, int64_t ld_delta, const uint16_t *weight,
                      uint16_t *out, int64_t ld_out, int64_t rows, int64_t hidden, float eps, int64_t lanes,
                      int64_t threads) {
    if (hidden % 16 || hidden > MAX_HIDDEN || (lanes != 8 && lanes != 16)) return -1;
    return SPLIT_RANGES(rows, team_for(threads, rows * hidden, MIN_SPLIT),
                        norm_rows(h, ld_h, delta, ld_delta, weight, out, ld_out, hidden, eps, lanes, first, last));
}

// q and k of every row at their positions: x * cos + rotate_half(x) * sin, each product and the sum
// rounded to bfloat16 as torch's three bfloat16 ops do. qk: rows of `vectors` head vectors of `dim`
// (row stride ld_qk), rotated into out ([rows, vectors, dim], contiguous); cos, sin: [rows, dim] bfloat16,
// sin already signed (model.signed_sin: -sin on the first half).
static int rotary_rows(const uint16_t *qk, int64_t ld_qk, const uint16_t *cos, const uint16_t *sin, uint16_t *out,
                       int64_t vectors, int64_t dim, int64_t first, int64_t last) {
    const int64_t half = dim / 2;
    for (int64_t r = first; r < last; r++)
        for (int64_t v = 0; v < vectors; v++) {
            const uint16_t *x = qk + r * ld_qk + v * dim;
            uint16_t *o = out + (r * vectors + v) * dim;
            for (int64_t i = 0; i < dim; i += 16) {
                const int64_t swapped = i < half ? i + half : i - half;  // roll by half
                const __m512 a = round16(_mm512_mul_ps(load16(x + i), load16(cos + r * dim + i)));
                const __m512 b = round16(_mm512_mul_ps(load16(x + swapped), load16(sin + r * dim + i)));
                store16(o + i, _mm512_add_ps(a, b));
            }
        }
    return 0;
}

int rotary_bf16(const uint16_t *qk, int64_t ld_qk, const uint16_t *cos, const uint16_t *sin, uint16_t *out,
                int64_t rows, int64_t vectors, int64_t dim, int64_t threads) {
    if (dim % 32) return -1;  // halves of whole 16-lane vectors
    return SPLIT_RANGES(rows, team_for(threads, rows * vectors * dim, MIN_SPLIT),
                        rotary_rows(qk, ld_qk, cos, sin, out, vectors, dim, first, last));
}

// out = bfloat16(silu(gate)) * up, rounded once more: torch's act_fn(gate) * up. gate, up: [rows, n]
// (row strides ld_gate, ld_up; n a multiple of 16); out: [rows, n] contiguous.
enum { SILU_CHUNK = 512 };

static int silu_rows(const uint16_t *gate, int64_t ld_gate, const uint16_t *up, int64_t ld_up, uint16_t *out,
                     int64_t n, int64_t first, int64_t last) {
    float g[SILU_CHUNK], e[SILU_CHUNK];
    for (int64_t r = first; r < last; r++)
        for (int64_t c = 0; c < n; c += SILU_CHUNK) {
            const int64_t m = n - c < SILU_CHUNK ? n - c : SILU_CHUNK;
            for (int64_t i = 0; i < m; i += 16) _mm512_storeu_ps(g + i, load16(gate + r * ld_gate + c + i));
            for (int64_t j = 0; j < m; j++) e[j] = expf(-g[j]);  // a loop the compiler maps to libmvec's expf
            for (int64_t i = 0; i < m; i += 16) {
                const __m512 one_plus = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_loadu_ps(e + i));
                const __m512 silu = round16(_mm512_div_ps(_mm512_loadu_ps(g + i), one_plus));
                store16(out + r * n + c + i, _mm512_mul_ps(silu, load16(up + r * ld_up + c + i)));
            }
        }
    return 0;
}

int silu_mul_bf16(const uint16_t *gate, int64_t ld_gate, const uint16_t *up, int64_t ld_up, uint16_t *out,
                  int64_t rows, int64_t n, int64_t threads) {
    if (n % 16) return -1;
    return SPLIT_RANGES(rows, team_for(threads, rows * n, MIN_SPLIT),
                        silu_rows(gate, ld_gate, up, ld_up, out, n, first, last));
}
