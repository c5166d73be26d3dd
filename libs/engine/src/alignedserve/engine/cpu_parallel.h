// Work items split across threads for this package's C kernels (included by each kernel source).
//
// The kernels are built with -fopenmp and so link libgomp.so.1. In a process that has loaded torch that
// name resolves to the copy torch loaded (the dynamic loader reuses an already-loaded soname), so a
// kernel's team is torch's own intra-op pool: the threads torch's ops run on, warm, and no second set
// competing for the same cores. (Splitting in Python, on a thread pool that takes the GIL per call, made
// two threads slower than one: ~50 us a call, and a decode step makes ~150 calls.) Built without OpenMP,
// a kernel runs all its items on the calling thread.
#ifndef ALIGNEDSERVE_CPU_PARALLEL_H
#define ALIGNEDSERVE_CPU_PARALLEL_H
#include <stdint.h>

// At most `threads`, each with at least `min_per_thread` of `work` (and one at least): for kernels whose
// whole call can be so small that a second thread's start and join cost more than it saves.
static inline int64_t team_for(int64_t threads, int64_t work, int64_t min_per_thread) {
    const int64_t most = work / min_per_thread;
    return most < 1 ? 1 : most < threads ? most : threads;
}

#ifdef _OPENMP
#include <omp.h>
// The status of CALL over near-equal ranges first .. last - 1 of items 0 .. items - 1, one range per thread
// of a team of at most `threads` (CALL names `first` and `last`). Statuses are 0 or negative errors; the
// lowest is kept.
#define SPLIT_RANGES(items, threads, CALL)                                                  \
    ({                                                                                      \
        const int64_t items_ = (items), team_ = (threads) < items_ ? (threads) : items_;    \
        int worst_ = 0;                                                                     \
        if (team_ <= 1) {                                                                   \
            const int64_t first = 0, last = items_;                                         \
            worst_ = (CALL);                                                                \
        } else {                                                                            \
            _Pragma("omp parallel num_threads(team_) reduction(min : worst_)") {            \
                const int64_t t_ = omp_get_thread_num(), n_ = omp_get_num_threads();        \
                const int64_t first = items_ * t_ / n_, last = items_ * (t_ + 1) / n_;      \
                const int rc_ = (CALL);                                                     \
                worst_ = rc_ < worst_ ? rc_ : worst_;                                       \
            }                                                                               \
        }                                                                                   \
        worst_;                                                                             \
    })
#else
#define SPLIT_RANGES(items, threads, CALL)            \
    ({                                                \
        const int64_t first = 0, last = (items);      \
        (void)(threads);                              \
        (CALL);                                       \
    })
#endif

#endif
