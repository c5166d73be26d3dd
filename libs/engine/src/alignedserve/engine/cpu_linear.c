// Linear layers (out = x @ w^T) in bfloat16 on a CPU with AVX-512 BF16. Built and loaded by cpu_kernels.py.
//
// The weight is packed once at load into the pair layout vdpbf16ps reads: [N / 16][K / 2][16][2], so that
// one 64-byte load holds 16 output columns x 2 consecutive k. A tile of `rows` rows x `blocks` column
// blocks keeps rows x blocks float32 accumulators in registers; each k pair costs `blocks` weight loads,
// one broadcast per row and rows x blocks vdpbf16ps. Every output is one float32 sum over k in order,
// rounded to bfloat16 once (round to nearest even, as torch).
#include <immintrin.h>
#include <stdint.h>

#include "cpu_parallel.h"

#define COLUMN_BLOCK 16  // output columns per packed block: one zmm of float32
#define MAX_TILE_ROWS 12  // 12 rows x 2 blocks = 24 of the 32 vector registers as accumulators
#define NARROW_ROWS 6     // up to 6 rows, 4 blocks per tile (more columns in flight for few rows)

// w: [n, k] row-major -> packed: [n / 16][k / 2][16][2]. Returns 0, or -1 unless n % 16 == 0 and k % 2 == 0.
int pack_weight_bf16(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k) {
    if (n % COLUMN_BLOCK || k % 2) return -1;
    for (int64_t nb = 0; nb < n / COLUMN_BLOCK; nb++)
        for (int64_t kk = 0; kk < k / 2; kk++)
            for (int64_t j = 0; j < COLUMN_BLOCK; j++) {
                const uint16_t *src = w + (nb * COLUMN_BLOCK + j) * k + 2 * kk;
                uint16_t *dst = packed + ((nb * (k / 2) + kk) * COLUMN_BLOCK + j) * 2;
                dst[0] = src[0];
                dst[1] = src[1];
            }
    return 0;
}

// Always inlined into the specializations below, so that `rows` and `blocks` are constants and the
// accumulators live in registers.
static inline __attribute__((always_inline)) void tile(const uint16_t *x, int64_t ldx, const uint16_t *w,
                                                       int64_t k, uint16_t *out, int64_t ldo, const int rows,
                                                       const int blocks) {
    __m512 acc[MAX_TILE_ROWS][4];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < blocks; j++) acc[m][j] = _mm512_setzero_ps();
    const int64_t block_stride = k * COLUMN_BLOCK;  // elements from one packed block to the next
    for (int64_t kk = 0; kk < k / 2; kk++) {
        __m512bh b[4];
        for (int j = 0; j < blocks; j++) b[j] = (__m512bh)_mm512_loadu_si512(w + j * block_stride + kk * 32);
        // the next tile's columns into L2 while this one computes: at 8-13 rows 1.3-1.5x faster than the
        // hardware prefetcher alone (its streams restart at every block)
        for (int j = 0; j < blocks; j++)
            _mm_prefetch((const char *)(w + (blocks + j) * block_stride + kk * 32), _MM_HINT_T1);
        for (int m = 0; m < rows; m++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(x + m * ldx + 2 * kk));
            for (int j = 0; j < blocks; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], a, b[j]);
        }
    }
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < blocks; j++)
            _mm256_storeu_si256((__m256i *)(out + m * ldo + j * COLUMN_BLOCK), (__m256i)_mm512_cvtneps_pbh(acc[m][j]));
}

typedef void (*TileFn)(const uint16_t *, int64_t, const uint16_t *, int64_t, uint16_t *, int64_t);
#define TILE(R, B)                                                                                        \
    static void tile_##R##_##B(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t k, uint16_t *out, \
                               int64_t ldo) {                                                             \
        tile(x, ldx, w, k, out, ldo, R, B);                                                               \
    }
#define NARROW(R) TILE(R, 1) TILE(R, 2) TILE(R, 4)
#define WIDE(R) TILE(R, 1) TILE(R, 2)
NARROW(1) NARROW(2) NARROW(3) NARROW(4) NARROW(5) NARROW(6)
WIDE(7) WIDE(8) WIDE(9) WIDE(10) WIDE(11) WIDE(12)

// [rows][blocks == 1, 2, 4]
static const TileFn TILES[MAX_TILE_ROWS + 1][3] = {
    {0, 0, 0},
    {tile_1_1, tile_1_2, tile_1_4},
    {tile_2_1, tile_2_2, tile_2_4},
    {tile_3_1, tile_3_2, tile_3_4},
    {tile_4_1, tile_4_2, tile_4_4},
    {tile_5_1, tile_5_2, tile_5_4},
    {tile_6_1, tile_6_2, tile_6_4},
    {tile_7_1, tile_7_2, 0},
    {tile_8_1, tile_8_2, 0},
    {tile_9_1, tile_9_2, 0},
    {tile_10_1, tile_10_2, 0},
    {tile_11_1, tile_11_2, 0},
    {tile_12_1, tile_12_2, 0},
};

// Column blocks first .. last - 1 of linear_bf16's output. The rows are cut into near-equal tiles of at most
// 12 (13 rows: 7 + 6, not 12 + 1), each over the same columns while they are in cache.
static int linear_columns(const uint16_t *x, int64_t ldx, const uint16_t *packed, uint16_t *out, int64_t ldo,
                          int64_t rows, int64_t k, int64_t first, int64_t last) {
    if (rows < 1 || k < 2 || k % 2) return -1;
    const int64_t tiles = (rows + MAX_TILE_ROWS - 1) / MAX_TILE_ROWS;
    const int wide = rows <= NARROW_ROWS ? 4 : 2;
    for (int64_t nb = first; nb < last;) {
        const int64_t left = last - nb;
        const int blocks = left >= wide ? wide : (left >= 2 ? 2 : 1);
        const int which = blocks == 4 ? 2 : blocks - 1;
        const uint16_t *w = packed + nb * k * COLUMN_BLOCK;
        for (int64_t t = 0, m = 0; t < tiles; t++) {
            const int64_t r = (rows - m) / (tiles - t);  // near-equal tiles, the larger ones last
            TILES[r][which](x + m * ldx, ldx, w, k, out + m * ldo + nb * COLUMN_BLOCK, ldo);
            m += r;
        }
        nb += blocks;
    }
    return 0;
}

// out[rows, n] (row stride ldo) = x[rows, k] (row stride ldx) @ w^T, w packed by pack_weight_bf16; its n / 16
// column blocks split across `threads` (cpu_parallel.h). Returns 0, or -1 for a shape it does not take.
int linear_bf16(const uint16_t *x, int64_t ldx, const uint16_t *packed, uint16_t *out, int64_t ldo, int64_t rows,
                int64_t k, int64_t n, int64_t threads) {
    if (n % COLUMN_BLOCK) return -1;
    return SPLIT_RANGES(n / COLUMN_BLOCK, threads, linear_columns(x, ldx, packed, out, ldo, rows, k, first, last));
}
