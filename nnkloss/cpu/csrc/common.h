// Shared by op.cpp, batch.cpp and search.cpp: element types and loads, the prefetch distance,
// the thread runner and the type-code dispatch. No torch headers; every array is contiguous.
// C is the compute type (float or double), T the bank element type (float, double, bf16 or
// fp16 as uint16_t bits); integer arrays are int32 or int64, chosen at run time by a flag.
#pragma once
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

// How many bytes of gathered rows are prefetched ahead (0: none): a random gather defeats the
// hardware prefetcher. Locality 3 (prefetcht0): docs/PERFORMANCE.md, "The CPU library's
// build-time choices".
#ifndef NNK_PREFETCH_BYTES
#define NNK_PREFETCH_BYTES 8192
#endif
#ifndef NNK_PREFETCH_LOCALITY
#define NNK_PREFETCH_LOCALITY 3
#endif

// The distance in rows: whole groups of four (pass 1's groups), 4 to 16.
inline int64_t prefetch_rows(int64_t row_bytes) {
    if (NNK_PREFETCH_BYTES <= 0) return 0;
    int64_t rows = NNK_PREFETCH_BYTES / std::max<int64_t>(row_bytes, 1);
    return std::max<int64_t>(4, std::min<int64_t>(16, (rows + 3) / 4 * 4));
}
// Hot helpers are always inlined: otherwise the distance became a call per gathered row.
#define NNK_INLINE inline __attribute__((always_inline))

namespace {

struct bf16 { uint16_t bits; };
struct fp16 { uint16_t bits; };

inline float bits_to_float(uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

// IEEE half -> float without _Float16 (exact for every input), branch-free.
inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    // normal: rebias the exponent (15 -> 127); inf/nan: exponent all ones
    uint32_t normal = ((exp + 112u) << 23) | (man << 13);
    uint32_t infnan = 0x7f800000u | (man << 13);
    // subnormal: man * 2^-24, exactly representable in float
    float sub = (float)man * 5.9604644775390625e-08f;
    uint32_t subbits;
    std::memcpy(&subbits, &sub, sizeof subbits);
    uint32_t r = exp == 0 ? subbits : (exp == 31 ? infnan : normal);
    return bits_to_float(r | sign);
}

template <typename T>
inline void prefetch_row(const T* p, int64_t D) {
    const char* b = (const char*)p;
    int64_t bytes = D * (int64_t)sizeof(T);
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(b + o, 0, NNK_PREFETCH_LOCALITY);
}

template <typename C> inline C load(const float* p, int64_t i) { return (C)p[i]; }
template <typename C> inline C load(const double* p, int64_t i) { return (C)p[i]; }
template <typename C> inline C load(const bf16* p, int64_t i) {
    return (C)bits_to_float((uint32_t)p[i].bits << 16);
}
#if defined(__FLT16_MAX__)
template <typename C> inline C load(const fp16* p, int64_t i) {
    _Float16 h;
    std::memcpy(&h, &p[i].bits, sizeof h);
    return (C)(float)h;
}
#else
template <typename C> inline C load(const fp16* p, int64_t i) {
    return (C)half_to_float(p[i].bits);
}
#endif

inline int64_t load_index(const void* p, int is64, int64_t i) {
    return is64 ? ((const int64_t*)p)[i] : (int64_t)((const int32_t*)p)[i];
}

// Runs work(i) for every i in [0, n) on up to `nthreads` threads claiming items from a shared
// counter, each with its own copy of `work` (its scratch); nthreads <= 1 runs inline. Built
// with -fopenmp the threads are torch's own OpenMP team (one pool, never two spinning against
// each other); otherwise the caller and detached std::threads, whose state a shared_ptr keeps
// alive for a late helper.
struct Progress {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
};

template <typename Work>
void run_items(int64_t n, int nthreads, const Work& work) {
    if (n <= 0) return;
    if ((int64_t)nthreads > n) nthreads = (int)n;
    if (nthreads <= 1) {
        Work w = work;
        for (int64_t i = 0; i < n; ++i) w(i);
        return;
    }
#if defined(_OPENMP)
    std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(nthreads)
    {
        Work w = work;
        int64_t i;
        while ((i = next.fetch_add(1, std::memory_order_relaxed)) < n) w(i);
    }
#else
    auto progress = std::make_shared<Progress>();
    auto loop = [progress, n, w = work]() mutable {
        int64_t i;
        while ((i = progress->next.fetch_add(1, std::memory_order_relaxed)) < n) {
            w(i);
            progress->done.fetch_add(1, std::memory_order_release);
        }
    };
    for (int t = 1; t < nthreads; ++t) {
        try {
            std::thread(loop).detach();
        } catch (...) {  // no more threads: the caller does the rest
            break;
        }
    }
    loop();
    while (progress->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
#endif
}

// Type codes (build.py's). Compute: 0 fp32, 1 fp64. Bank element: 0 fp32, 1 fp64, 2 bf16,
// 3 fp16. f is called with a value of the type; 1 for an unknown code.
template <typename F>
int with_compute_type(int ctype, F&& f) {
    switch (ctype) {
        case 0: f(float{}); return 0;
        case 1: f(double{}); return 0;
    }
    return 1;
}

template <typename F>
int with_bank_type(int btype, F&& f) {
    switch (btype) {
        case 0: f(float{}); return 0;
        case 1: f(double{}); return 0;
        case 2: f(bf16{}); return 0;
        case 3: f(fp16{}); return 0;
    }
    return 1;
}

// f(C{}, T{}) for compute code ctype and bank code btype; 1 for an unknown code.
template <typename F>
int with_types(int ctype, int btype, F&& f) {
    int unknown = 0;
    unknown |= with_compute_type(ctype, [&](auto c) {
        unknown |= with_bank_type(btype, [&](auto t) { f(c, t); });
    });
    return unknown;
}

}  // namespace
