// Attention over the paged KV cache on a CPU with AVX-512 BF16, K/V read in place through block tables.
// Built and loaded by cpu_attention.py. Two kernels:
//
// paged_decode_bf16: one new token per row, every row at its own length (no padding, no groups); must
// match decode_backend.paged_decode_reference. Work item = (row, KV head): its `group` query heads (GQA)
// against the row's `len` keys, in three passes:
//   scores = q . k * scale      (bf16 pairs multiplied and summed in float32: vdpbf16ps)
//   probs  = softmax(scores)    (float32)
//   out    = sum probs * v      (float32, rounded to bfloat16 once at the end)
//
// paged_prefill_bf16: one request's chunk of query positions against its cached prefix and itself,
// causal; must match SDPA with the bottom-right causal mask (attention.prefill_attention). Flash style:
// tiles of query vectors against tiles of keys with an online softmax, both products as small GEMMs on
// vdpbf16ps (K and V repacked once per KV head into the pair layout the instruction reads).
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_parallel.h"

// The floor of a running maximum and the score of a masked key. Finite: -ffast-math lets the compiler
// assume no infinities. exp(LOWEST - any real score) is 0, and masked keys get probability 0 explicitly.
#define LOWEST (-3.0e38f)

#define MAX_GROUP 16  // query heads per KV head
#define MAX_DIM 256   // head_dim, a multiple of 32
// Blocks are scattered, so the hardware prefetcher restarts at each one: the kernel prefetches the next
// blocks itself, into L2 (_MM_HINT_T1). Into L1 (T0) the misses in flight are capped by L1's few fill
// buffers: on the 2-core AVX-512 BF16 host, decode over the engine's 30 layers (K/V from memory, 13 rows x
// 256 keys) took 434 us a layer with T0 and 2 blocks ahead, 209 with T1 and 4 (docs/benchmarks.md).
#define PREFETCH_BLOCKS 4

static inline uint16_t bf16_round(float f) {  // round to nearest even, as torch's float -> bfloat16
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);  // NaN stays NaN
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

// v[i]: 16 partial sums of token i -> lane i holds the total of v[i] (a transpose-and-add tree).
static inline __m512 lane_totals(const __m512 *v) {
    __m512 halves[8], quarters[4];
    for (int i = 0; i < 8; i++)  // 128-bit chunks: [a0+a2, a1+a3, b0+b2, b1+b3]
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                                  _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int j = 0; j < 4; j++)  // chunk c: 4 partial sums of token 4j + c
        quarters[j] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * j], halves[2 * j + 1], 0x88),
                                    _mm512_shuffle_f32x4(halves[2 * j], halves[2 * j + 1], 0xDD));
    __m512 w0 = _mm512_add_ps(_mm512_unpacklo_ps(quarters[0], quarters[1]), _mm512_unpackhi_ps(quarters[0], quarters[1]));
    __m512 w1 = _mm512_add_ps(_mm512_unpacklo_ps(quarters[2], quarters[3]), _mm512_unpackhi_ps(quarters[2], quarters[3]));
    __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(w0, w1, 0x44), _mm512_shuffle_ps(w0, w1, 0xEE));
    // lane 4c + j now holds token 4j + c
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, sums);
}

// Always inlined: a call inside the token loops would make the compiler keep the accumulators in memory
// (every vector register is caller-saved), at half the speed.
static inline __attribute__((always_inline)) void prefetch_block(const uint16_t *first_token, int64_t block_size, int64_t token_stride, int64_t dim) {
    for (int64_t slot = 0; slot < block_size; slot++)
        for (int64_t byte = 0; byte < dim * 2; byte += 64)
            _mm_prefetch((const char *)(first_token + slot * token_stride) + byte, _MM_HINT_T1);
}

static inline void softmax_rows(float *scores, int64_t group, int64_t len) {
    for (int64_t g = 0; g < group; g++) {
        float *row = scores + g * len, top = LOWEST, sum = 0.f;
        for (int64_t t = 0; t < len; t++) top = row[t] > top ? row[t] : top;
        for (int64_t t = 0; t < len; t++) {
            row[t] = expf(row[t] - top);
            sum += row[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; t++) row[t] *= inv;
    }
}

// One work item. keys, values: this KV head's first element of block 0; stride: elements from one token to
// the next within a block; scores: [group, len] scratch. Inlined with constant group and dim where a
// specialization calls it, so that the accumulators live in registers (2.3x faster at 3 x 64).
static inline __attribute__((always_inline)) void attend(const uint16_t *q, const uint16_t *keys,
                                                         const uint16_t *values, const int32_t *table, int64_t len,
                                                         int64_t bs, int64_t stride, int64_t group, int64_t dim,
                                                         float scale, float *scores, uint16_t *out) {
    const int64_t pairs = dim / 32, chunks = dim / 16, mask = bs - 1;
    const int shift = __builtin_ctzll((unsigned long long)bs);
#define TOKEN(base, t) ((base) + ((int64_t)table[(t) >> shift] * bs + ((t) & mask)) * stride)
    __m512bh qv[MAX_GROUP][MAX_DIM / 32];
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < pairs; c++) qv[g][c] = (__m512bh)_mm512_loadu_si512(q + g * dim + c * 32);
    for (int64_t b = 0; b < PREFETCH_BLOCKS && b * bs < len; b++) {
        prefetch_block(TOKEN(keys, b * bs), bs, stride, dim);
        prefetch_block(TOKEN(values, b * bs), bs, stride, dim);
    }
    __m512 partial[MAX_GROUP][16];
    for (int64_t t = 0; t < len; t++) {
        const uint16_t *k = TOKEN(keys, t);
        if ((t & mask) == 0 && t + PREFETCH_BLOCKS * bs < len)
            prefetch_block(TOKEN(keys, t + PREFETCH_BLOCKS * bs), bs, stride, dim);
        __m512bh kv[MAX_DIM / 32];
        for (int64_t c = 0; c < pairs; c++) kv[c] = (__m512bh)_mm512_loadu_si512(k + c * 32);
        for (int64_t g = 0; g < group; g++) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t c = 0; c < pairs; c++) acc = _mm512_dpbf16_ps(acc, qv[g][c], kv[c]);
            partial[g][t & 15] = acc;
        }
        if ((t & 15) == 15)
            for (int64_t g = 0; g < group; g++)
                _mm512_storeu_ps(scores + g * len + t - 15, _mm512_mul_ps(lane_totals(partial[g]), _mm512_set1_ps(scale)));
    }
    for (int64_t t = len & ~(int64_t)15; t < len; t++)
        for (int64_t g = 0; g < group; g++) scores[g * len + t] = _mm512_reduce_add_ps(partial[g][t & 15]) * scale;
    softmax_rows(scores, group, len);
    __m512 acc[MAX_GROUP][MAX_DIM / 16];
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < chunks; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t++) {
        const uint16_t *v = TOKEN(values, t);
        if ((t & mask) == 0 && t + PREFETCH_BLOCKS * bs < len)
            prefetch_block(TOKEN(values, t + PREFETCH_BLOCKS * bs), bs, stride, dim);
        __m512 vf[MAX_DIM / 16];
        for (int64_t c = 0; c < chunks; c++)  // bfloat16 -> float32: its 16 bits become the high half
            vf[c] = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v + c * 16))), 16));
        for (int64_t g = 0; g < group; g++) {
            const __m512 p = _mm512_set1_ps(scores[g * len + t]);
            for (int64_t c = 0; c < chunks; c++) acc[g][c] = _mm512_fmadd_ps(p, vf[c], acc[g][c]);
        }
    }
#undef TOKEN
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < chunks; c++) {
            float lanes[16];
            _mm512_storeu_ps(lanes, acc[g][c]);
            for (int j = 0; j < 16; j++) out[g * dim + c * 16 + j] = bf16_round(lanes[j]);
        }
}

#define ATTEND_ARGS                                                                                          \
    const uint16_t *q, const uint16_t *keys, const uint16_t *values, const int32_t *table, int64_t len, \
        int64_t bs, int64_t stride, int64_t group, int64_t dim, float scale, float *scores, uint16_t *out
typedef void (*AttendFn)(ATTEND_ARGS);

static void attend_any(ATTEND_ARGS) { attend(q, keys, values, table, len, bs, stride, group, dim, scale, scores, out); }

#define SPECIALIZED(G, D)                                                                \
    static void attend_##G##_##D(ATTEND_ARGS) {                                          \
        (void)group, (void)dim;                                                          \
        attend(q, keys, values, table, len, bs, stride, G, D, scale, scores, out);       \
    }
#define FOR_DIMS(G) SPECIALIZED(G, 64) SPECIALIZED(G, 128)
FOR_DIMS(1) FOR_DIMS(2) FOR_DIMS(3) FOR_DIMS(4) FOR_DIMS(5) FOR_DIMS(6) FOR_DIMS(7) FOR_DIMS(8)

static AttendFn specialized(int64_t group, int64_t dim) {
    static const AttendFn d64[] = {attend_1_64, attend_2_64, attend_3_64, attend_4_64,
                                   attend_5_64, attend_6_64, attend_7_64, attend_8_64};
    static const AttendFn d128[] = {attend_1_128, attend_2_128, attend_3_128, attend_4_128,
                                    attend_5_128, attend_6_128, attend_7_128, attend_8_128};
    if (group >= 1 && group <= 8 && dim == 64) return d64[group - 1];
    if (group >= 1 && group <= 8 && dim == 128) return d128[group - 1];
    return attend_any;
}

// Work items first .. last - 1 of paged_decode_bf16's B * kv_heads (row, KV head).
static int decode_items(const uint16_t *query, const uint16_t *keys, const uint16_t *values, const int32_t *tables,
                        const int32_t *lens, uint16_t *out, int64_t heads, int64_t kv_heads, int64_t dim,
                        int64_t block_size, int64_t table_width, int64_t max_len, float scale, int64_t first,
                        int64_t last) {
    const int64_t group = heads / kv_heads;
    if (group < 1 || group > MAX_GROUP || heads % kv_heads || dim % 32 || dim > MAX_DIM || block_size < 1 ||
        (block_size & (block_size - 1)))
        return -1;
    float *scores = malloc(sizeof(float) * (size_t)(group * max_len));
    if (!scores) return -2;
    const AttendFn fn = specialized(group, dim);
    for (int64_t item = first; item < last; item++) {
        const int64_t b = item / kv_heads, kvh = item % kv_heads, offset = (b * heads + kvh * group) * dim;
        fn(query + offset, keys + kvh * dim, values + kvh * dim, tables + b * table_width, lens[b], block_size,
           kv_heads * dim, group, dim, scale, scores, out + offset);
    }
    free(scores);
    return 0;
}

// query, out: [B, heads, dim] bfloat16, contiguous; keys, values: [num_blocks, block_size, kv_heads, dim];
// tables: [B, table_width] int32; lens: [B] int32, each >= 1. The B * kv_heads work items (row, KV head) split
// across `threads` (cpu_parallel.h). Returns 0, -1 for a shape it does not take, -2 out of memory.
int paged_decode_bf16(const uint16_t *query, const uint16_t *keys, const uint16_t *values, const int32_t *tables,
                      const int32_t *lens, uint16_t *out, int64_t heads, int64_t kv_heads, int64_t dim,
                      int64_t block_size, int64_t table_width, int64_t max_len, float scale, int64_t rows,
                      int64_t threads) {
    return SPLIT_RANGES(rows * kv_heads, threads, decode_items(query, keys, values, tables, lens, out, heads, kv_heads, dim,
                                                     block_size, table_width, max_len, scale, first, last));
}

// ---- prefill ----

#define KEY_TILE 64  // keys per tile
#define ROW_TILE 48  // query vectors (position, head) per tile
#define ROW_BLOCK 4  // query vectors whose accumulators the inner loops hold in registers

// One KV head. kp: [tiles][dim/2][KEY_TILE] uint32 (pairs of d); vp: [tiles][KEY_TILE/2][dim] uint32 (pairs of keys).
static inline __attribute__((always_inline)) void pack_head(const uint16_t *keys, const uint16_t *values,
                                                            const int64_t *table, int64_t total, int64_t bs,
                                                            int64_t stride, int64_t dim, uint32_t *kp, uint32_t *vp) {
    const int64_t tiles = (total + KEY_TILE - 1) / KEY_TILE, pairs = dim / 2;
    memset(kp, 0, sizeof(uint32_t) * tiles * pairs * KEY_TILE);
    memset(vp, 0, sizeof(uint32_t) * tiles * KEY_TILE / 2 * dim);
    for (int64_t t = 0; t < total; t++) {
        const int64_t slot = ((int64_t)table[t / bs] * bs + t % bs) * stride;
        const uint32_t *k = (const uint32_t *)(keys + slot);
        const uint16_t *v = values + slot;
        const int64_t tile = t / KEY_TILE, n = t % KEY_TILE;
        uint32_t *kt = kp + tile * pairs * KEY_TILE;
        for (int64_t p = 0; p < pairs; p++) kt[p * KEY_TILE + n] = k[p];
        uint16_t *vt = (uint16_t *)(vp + tile * (KEY_TILE / 2) * dim + (n / 2) * dim);
        for (int64_t d = 0; d < dim; d++) vt[2 * d + (n & 1)] = v[d];
    }
}

// One tile of `rows` query vectors (rows a multiple of ROW_BLOCK; q: [rows][dim] bf16, limit[r]: the last key
// row r sees) against every key tile it needs.
static inline __attribute__((always_inline)) void attend_tile(const uint16_t *q, const int64_t *limit, int64_t rows,
                                                              const uint32_t *kp, const uint32_t *vp, int64_t dim,
                                                              float scale, float *o, float *s, uint32_t *pp,
                                                              float *m, float *l) {
    const int64_t pairs = dim / 2, chunks = dim / 16;
    int64_t last = 0;
    for (int64_t r = 0; r < rows; r++) {
        m[r] = LOWEST;
        l[r] = 0.f;
        last = limit[r] > last ? limit[r] : last;
    }
    memset(o, 0, sizeof(float) * rows * dim);
    const int64_t tiles = last / KEY_TILE + 1;
    for (int64_t tile = 0; tile < tiles; tile++) {
        const uint32_t *kt = kp + tile * pairs * KEY_TILE;
        const uint32_t *vt = vp + tile * (KEY_TILE / 2) * dim;
        // scores: s[r][n] = q_r . k_n
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
            __m512 acc[ROW_BLOCK][KEY_TILE / 16];
            for (int i = 0; i < ROW_BLOCK; i++)
                for (int c = 0; c < KEY_TILE / 16; c++) acc[i][c] = _mm512_setzero_ps();
            const uint32_t *qw = (const uint32_t *)(q + r0 * dim);
            for (int64_t p = 0; p < pairs; p++) {
                __m512bh kv[KEY_TILE / 16];
                for (int c = 0; c < KEY_TILE / 16; c++) kv[c] = (__m512bh)_mm512_loadu_si512(kt + p * KEY_TILE + c * 16);
                for (int i = 0; i < ROW_BLOCK; i++) {
                    const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)qw[i * pairs + p]);
                    for (int c = 0; c < KEY_TILE / 16; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], qb, kv[c]);
                }
            }
            for (int i = 0; i < ROW_BLOCK; i++)
                for (int c = 0; c < KEY_TILE / 16; c++)
                    _mm512_storeu_ps(s + (r0 + i) * KEY_TILE + c * 16, _mm512_mul_ps(acc[i][c], _mm512_set1_ps(scale)));
        }
        // online softmax, row by row; probabilities as bf16 pairs of keys
        for (int64_t r = 0; r < rows; r++) {
            float *row = s + r * KEY_TILE, top = m[r];
            const int64_t visible = limit[r] - tile * KEY_TILE + 1;  // keys of this tile row r sees
            for (int64_t n = 0; n < KEY_TILE; n++) {
                if (n >= visible) row[n] = LOWEST;
                top = row[n] > top ? row[n] : top;
            }
            const float rescale = expf(m[r] - top);
            float sum = 0.f;
            for (int64_t n = 0; n < KEY_TILE; n++) {
                row[n] = n < visible ? expf(row[n] - top) : 0.f;
                sum += row[n];
            }
            l[r] = l[r] * rescale + sum;
            m[r] = top;
            for (int64_t d = 0; d < dim; d++) o[r * dim + d] *= rescale;
            uint16_t *pr = (uint16_t *)(pp + r * (KEY_TILE / 2));
            for (int64_t n = 0; n < KEY_TILE; n++) pr[n] = bf16_round(row[n]);
        }
        // o[r] += p[r] . v
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
            __m512 acc[ROW_BLOCK][256 / 16];
            for (int i = 0; i < ROW_BLOCK; i++)
                for (int64_t c = 0; c < chunks; c++) acc[i][c] = _mm512_loadu_ps(o + (r0 + i) * dim + c * 16);
            for (int64_t p = 0; p < KEY_TILE / 2; p++) {
                __m512bh vv[256 / 16];
                for (int64_t c = 0; c < chunks; c++) vv[c] = (__m512bh)_mm512_loadu_si512(vt + p * dim + c * 16);
                for (int i = 0; i < ROW_BLOCK; i++) {
                    const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pp[(r0 + i) * (KEY_TILE / 2) + p]);
                    for (int64_t c = 0; c < chunks; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], pb, vv[c]);
                }
            }
            for (int i = 0; i < ROW_BLOCK; i++)
                for (int64_t c = 0; c < chunks; c++) _mm512_storeu_ps(o + (r0 + i) * dim + c * 16, acc[i][c]);
        }
    }
}

// The tile with a constant head size where it is a common one (accumulators in registers).
static void attend_tile_any(const uint16_t *q, const int64_t *limit, int64_t rows, const uint32_t *kp,
                            const uint32_t *vp, int64_t dim, float scale, float *o, float *s, uint32_t *pp,
                            float *m, float *l) {
    if (dim == 64)
        attend_tile(q, limit, rows, kp, vp, 64, scale, o, s, pp, m, l);
    else if (dim == 128)
        attend_tile(q, limit, rows, kp, vp, 128, scale, o, s, pp, m, l);
    else
        attend_tile(q, limit, rows, kp, vp, dim, scale, o, s, pp, m, l);
}

// KV heads first .. last - 1 of paged_prefill_bf16's.
static int prefill_heads(const uint16_t *query, const uint16_t *keys, const uint16_t *values, const int64_t *table,
                         uint16_t *out, int64_t q_len, int64_t cached, int64_t heads, int64_t kv_heads, int64_t dim,
                         int64_t block_size, float scale, int64_t first, int64_t last) {
    const int64_t group = heads / kv_heads, total = cached + q_len;
    if (heads % kv_heads || dim % 32 || dim > 256 || group > ROW_TILE) return -1;
    const int64_t tiles = (total + KEY_TILE - 1) / KEY_TILE, positions = ROW_TILE / group;
    const int64_t rows_cap = ((positions * group + ROW_BLOCK - 1) / ROW_BLOCK) * ROW_BLOCK;
    uint32_t *kp = malloc(sizeof(uint32_t) * tiles * KEY_TILE * dim / 2);
    uint32_t *vp = malloc(sizeof(uint32_t) * tiles * KEY_TILE * dim / 2);
    uint16_t *qt = malloc(sizeof(uint16_t) * rows_cap * dim);
    float *o = malloc(sizeof(float) * rows_cap * dim), *s = malloc(sizeof(float) * rows_cap * KEY_TILE);
    uint32_t *pp = malloc(sizeof(uint32_t) * rows_cap * KEY_TILE / 2);
    float *m = malloc(sizeof(float) * rows_cap), *l = malloc(sizeof(float) * rows_cap);
    int64_t *limit = malloc(sizeof(int64_t) * rows_cap);
    int rc = (kp && vp && qt && o && s && pp && m && l && limit) ? 0 : -2;
    for (int64_t h = first; rc == 0 && h < last; h++) {
        pack_head(keys + h * dim, values + h * dim, table, total, block_size, kv_heads * dim, dim, kp, vp);
        for (int64_t i0 = 0; i0 < q_len; i0 += positions) {
            const int64_t i1 = i0 + positions < q_len ? i0 + positions : q_len;
            const int64_t rows = (i1 - i0) * group, padded = ((rows + ROW_BLOCK - 1) / ROW_BLOCK) * ROW_BLOCK;
            for (int64_t r = 0; r < padded; r++) {
                const int64_t i = r < rows ? i0 + r / group : i0, g = r < rows ? r % group : 0;
                memcpy(qt + r * dim, query + (i * heads + h * group + g) * dim, sizeof(uint16_t) * dim);
                limit[r] = cached + i;
            }
            attend_tile_any(qt, limit, padded, kp, vp, dim, scale, o, s, pp, m, l);
            for (int64_t r = 0; r < rows; r++) {
                const int64_t i = i0 + r / group, g = r % group;
                uint16_t *dst = out + (i * heads + h * group + g) * dim;
                const float inv = 1.f / l[r];
                for (int64_t d = 0; d < dim; d++) dst[d] = bf16_round(o[r * dim + d] * inv);
            }
        }
    }
    free(kp), free(vp), free(qt), free(o), free(s), free(pp), free(m), free(l), free(limit);
    return rc;
}

// query, out: [q_len, heads, dim] (positions cached .. cached + q_len - 1); keys, values: the paged cache
// [num_blocks, block_size, kv_heads, dim] holding all cached + q_len tokens; table: the request's blocks.
// The KV heads split across `threads` (cpu_parallel.h). Returns 0, -1 for a shape it does not take, -2 out
// of memory.
int paged_prefill_bf16(const uint16_t *query, const uint16_t *keys, const uint16_t *values, const int64_t *table,
                       uint16_t *out, int64_t q_len, int64_t cached, int64_t heads, int64_t kv_heads, int64_t dim,
                       int64_t block_size, float scale, int64_t threads) {
    return SPLIT_RANGES(kv_heads, threads, prefill_heads(query, keys, values, table, out, q_len, cached, heads,
                                                         kv_heads, dim, block_size, scale, first, last));
}
