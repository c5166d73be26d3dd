// Linear layers (out = x @ w^T) in bfloat16 on AMX tiles, for CPUs that have them. Built and loaded by
// cpu_kernels.py, called by cpu_linear.py in place of cpu_linear.c's linear_bf16 (same arguments, same
// packed weight).
//
// The packed layout of cpu_linear.c, [N / 16][K / 2][16][2], is the one tdpbf16ps reads for B: one
// column block's k pairs kk .. kk + 15 are one 16 x 64-byte tile, 1 KiB contiguous. A tile of up to 16
// rows x 4 column blocks keeps four 16 x 16 float32 accumulators in tiles 0-3; each step of 32 k loads
// the rows' 32 k (tile 4) once and each block's weight tile (tiles 5-7, reused) once. Every output is one
// float32 sum over k, rounded to bfloat16 once (round to nearest even, as torch).
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cpu_parallel.h"

#define ARCH_REQ_XCOMP_PERM 0x1023  // Linux: a process asks once before its threads use tile data
#define XFEATURE_XTILEDATA 18
#define COLUMN_BLOCK 16  // output columns per packed block: one row of a float32 accumulator tile
#define TILE_ROWS 16     // rows per tile
#define TILE_K 32        // k per step: 64 bytes of bfloat16 per row

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} TileConfig;

// 0, or -1 where the kernel refuses the process tile data (then the caller keeps other kernels).
int amx_permit(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) ? -1 : 0; }

// Tiles 0-3: accumulators (rows x 16 float32); 4: the rows' 32 k; 5-7: weight tiles (16 k pairs x 16 x 2).
static void configure(int rows) {
    TileConfig config = {0};
    config.palette = 1;
    for (int t = 0; t < 5; t++) {
        config.rows[t] = rows;
        config.bytes_per_row[t] = 64;
    }
    for (int t = 5; t < 8; t++) {
        config.rows[t] = TILE_K / 2;
        config.bytes_per_row[t] = 64;
    }
    _tile_loadconfig(&config);
}

static inline void store_rows(const float *acc, int rows, uint16_t *out, int64_t ldo) {
    for (int m = 0; m < rows; m++)
        _mm256_storeu_si256((__m256i *)(out + m * ldo), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(acc + m * 16)));
}

// Four column blocks: w points at the first one's packed weight, the others follow k * 16 elements apart.
static void four_blocks(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t k, uint16_t *out,
                        int64_t ldo, int rows) {
    const int64_t next = k * COLUMN_BLOCK;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kk = 0; kk < k; kk += TILE_K) {
        const uint16_t *b = w + kk * COLUMN_BLOCK;
        _tile_loadd(4, x + kk, ldx * 2);
        _tile_loadd(5, b, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, b + next, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, b + 2 * next, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, b + 3 * next, 64);
        _tile_dpbf16ps(3, 4, 5);
    }
    float acc[TILE_ROWS * 16] __attribute__((aligned(64)));
    _tile_stored(0, acc, 64);
    store_rows(acc, rows, out, ldo);
    _tile_stored(1, acc, 64);
    store_rows(acc, rows, out + COLUMN_BLOCK, ldo);
    _tile_stored(2, acc, 64);
    store_rows(acc, rows, out + 2 * COLUMN_BLOCK, ldo);
    _tile_stored(3, acc, 64);
    store_rows(acc, rows, out + 3 * COLUMN_BLOCK, ldo);
}

static void one_block(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t k, uint16_t *out, int64_t ldo,
                      int rows) {
    _tile_zero(0);
    for (int64_t kk = 0; kk < k; kk += TILE_K) {
        _tile_loadd(4, x + kk, ldx * 2);
        _tile_loadd(5, w + kk * COLUMN_BLOCK, 64);
        _tile_dpbf16ps(0, 4, 5);
    }
    float acc[TILE_ROWS * 16] __attribute__((aligned(64)));
    _tile_stored(0, acc, 64);
    store_rows(acc, rows, out, ldo);
}

// Column blocks first .. last - 1 of n / 16, every row, on the calling thread's tiles (each thread configures
// its own). Rows beyond 16 run as further tiles over the same four blocks while their weights are in cache.
static int amx_columns(const uint16_t *x, int64_t ldx, const uint16_t *packed, uint16_t *out, int64_t ldo,
                       int64_t rows, int64_t k, int64_t first, int64_t last) {
    if (rows < 1 || k < TILE_K || k % TILE_K) return -1;
    int configured = 0;
    for (int64_t nb = first; nb < last;) {
        const int blocks = last - nb >= 4 ? 4 : 1;
        const uint16_t *w = packed + nb * k * COLUMN_BLOCK;
        for (int64_t m = 0; m < rows; m += TILE_ROWS) {
            const int tile_rows = rows - m < TILE_ROWS ? (int)(rows - m) : TILE_ROWS;
            if (tile_rows != configured) {
                configure(tile_rows);
                configured = tile_rows;
            }
            (blocks == 4 ? four_blocks : one_block)(x + m * ldx, ldx, w, k, out + m * ldo + nb * COLUMN_BLOCK, ldo,
                                                    tile_rows);
        }
        nb += blocks;
    }
    _tile_release();  // no tile state left for the OS to save at a switch
    return 0;
}

// As cpu_linear.c's linear_bf16 (same arguments, same packed weight). Returns 0, or -1 for a shape it does not
// take (k not a multiple of 32).
int linear_amx_bf16(const uint16_t *x, int64_t ldx, const uint16_t *packed, uint16_t *out, int64_t ldo,
                    int64_t rows, int64_t k, int64_t n, int64_t threads) {
    if (n % COLUMN_BLOCK) return -1;
    return SPLIT_RANGES(n / COLUMN_BLOCK, threads, amx_columns(x, ldx, packed, out, ldo, rows, k, first, last));
}
