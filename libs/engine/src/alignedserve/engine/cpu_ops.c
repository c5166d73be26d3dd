// The element-wise steps of a Llama-family layer in bfloat16, one call each instead of torch's chains of
// small ops (4-5 calls each, most of their time per-call overhead at decode's few rows). Built and loaded
// by cpu_kernels.py; used by cpu_ops.py. Every step rounds to bfloat16 where the torch formulation
// does (model.py), so only float32 sums (the RMS) and expf may differ from it, by an ulp.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

static inline __m512 load16(const uint16_t *p) {  // 16 bfloat16 -> float32
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline void store16(uint16_t *p, __m512 v) {  // round to nearest even (vcvtneps2bf16)
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v));
}

static inline __m512 round16(__m512 v) {  // to the nearest bfloat16, kept as float32
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// Rows of `hidden` elements (a multiple of 16). If delta: h += delta (rounded to bfloat16, as `h + delta`).
// Then out = weight * bfloat16(h * rsqrt(mean(h^2) + eps)): transformers' RMSNorm (model.rms_norm).
int add_rms_norm_bf16(uint16_t *h, int64_t ld_h, const uint16_t *delta, int64_t ld_delta, const uint16_t *weight,
                      uint16_t *out, int64_t ld_out, int64_t rows, int64_t hidden, float eps) {
    if (hidden % 16) return -1;
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *x = h + r * ld_h;
        __m512 squares = _mm512_setzero_ps();
        for (int64_t i = 0; i < hidden; i += 16) {
            __m512 v = load16(x + i);
            if (delta) {
                v = round16(_mm512_add_ps(v, load16(delta + r * ld_delta + i)));  // as torch holds h + delta
                store16(x + i, v);
            }
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        const __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)hidden + eps));
        for (int64_t i = 0; i < hidden; i += 16) {
            const __m512 normed = round16(_mm512_mul_ps(load16(x + i), scale));  // .to(bfloat16)
            store16(out + r * ld_out + i, _mm512_mul_ps(load16(weight + i), normed));
        }
    }
    return 0;
}

// q and k of every row at their positions: x * cos + rotate_half(x) * sin, each product and the sum
// rounded to bfloat16 as torch's three bfloat16 ops do. qk: rows of `vectors` head vectors of `dim`
// (row stride ld_qk), rotated into out ([rows, vectors, dim], contiguous); cos, sin: [rows, dim] bfloat16,
// sin already signed (model.signed_sin: -sin on the first half).
int rotary_bf16(const uint16_t *qk, int64_t ld_qk, const uint16_t *cos, const uint16_t *sin, uint16_t *out,
                int64_t rows, int64_t vectors, int64_t dim) {
    if (dim % 32) return -1;  // halves of whole 16-lane vectors
    const int64_t half = dim / 2;
    for (int64_t r = 0; r < rows; r++)
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

// out = bfloat16(silu(gate)) * up, rounded once more: torch's act_fn(gate) * up. gate, up: [rows, n]
// (row strides ld_gate, ld_up; n a multiple of 16); out: [rows, n] contiguous.
int silu_mul_bf16(const uint16_t *gate, int64_t ld_gate, const uint16_t *up, int64_t ld_up, uint16_t *out,
                  int64_t rows, int64_t n) {
    enum { CHUNK = 512 };
    if (n % 16) return -1;
    float g[CHUNK], e[CHUNK];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < n; c += CHUNK) {
            const int64_t m = n - c < CHUNK ? n - c : CHUNK;
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
