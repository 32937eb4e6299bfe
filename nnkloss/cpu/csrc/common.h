// Shared by the library's translation units (op.cpp, batch.cpp, search.cpp): element types and
// loads, the prefetch distance, the thread runner and the type-code dispatch. No torch headers:
// nnkloss/cpu/build.py compiles the units into one library and loads it with ctypes; every
// array is contiguous. C is the compute type (float, or double for fp64 embeddings), T the
// bank element type (float, double, bf16 or fp16 stored as uint16_t bits); integer arrays are
// int32 or int64, chosen at run time by a flag.
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

#ifndef NNK_GENERIC_BF16_WIDEN
#define NNK_GENERIC_BF16_WIDEN 0
#endif

// How many bytes of gathered centre rows pass 1 prefetches ahead of the rows it reads (0: no
// software prefetch): the distance in rows is this over the row's size, 4 to 16 rows. A random
// gather defeats the hardware prefetcher, within a row too: prefetching only every second or
// fourth line of a row measured 1.2-1.7x slower than every line (AMD EPYC, 2026-11-23).
#ifndef NNK_PREFETCH_BYTES
#define NNK_PREFETCH_BYTES 8192
#endif
// Their locality hint: 3 (prefetcht0, into every level). The non-temporal hint 0 (prefetchnta)
// was measured 1.02-1.05x faster on the 2-core AMD EPYC machine (2026-11-24, forward at B 1024,
// K 32, D 128, other shapes within noise) but 2.2-4.7x slower (forward) on a 2-core Intel Xeon
// with AMX (2026-11-24, 3 interleaved rounds, banks resident in its last-level cache: 5.55
// against 1.19 ms at B 256, K 100, D 512; benchmarks/results/cpu_variants_Intel_Xeon.txt):
// what a CPU does with an NTA hint is its own choice, and a cliff on one vendor outweighs a few
// percent on the other.
// On that Xeon, hints 1 and 2 (into L2 / L3 only) were 1.03-1.2x slower than 3 (within noise at
// D 2048), and distances of 4, 8 and 16 KiB within noise of each other. On a 2-core AMD EPYC
// family 26 with AVX-512 (2026-11-26, cpu_variants.py --kernel, 3 rounds, forward, against the
// defaults; benchmarks/results/cpu_variants_AMD_EPYC_family_26_model_2.txt): 16 KiB 0.90x at
// D 512 fp32, 0.98-1.02x at D 128 and 2048, 1.14x with bf16 rows; 32 KiB (32 rows) 0.81-0.97x
// but bf16 1.10x; 2 and 4 KiB 0.80-1.02x; hint 2 0.81-0.99x. None faster at every shape.
// Hints 0 and 1 again there (5 rounds, the op's whole calls, at ef6e8be), to see whether rows
// that leave the caches less swept make the Python after the kernel faster (a backward timed
// after a 64 MiB read of other memory took 192 against 68 us at B 1024, K 32, D 128): hint 0
// took 1.01, 0.98 and 1.01 times the default's forward+backward time (D 512, D 128, bf16
// D 512): within noise; hint 1 1.17 and 1.13 times (0.98 with bf16).
#ifndef NNK_PREFETCH_LOCALITY
#define NNK_PREFETCH_LOCALITY 3
#endif

// The most rows it runs ahead, however small they are. On the 2-core Intel Xeon (2026-11-24,
// benchmarks/cpu_variants.py, 3 rounds) 16 KiB / 32 rows and 32 KiB / 64 rows were within noise
// of 8 KiB / 16 rows at the four bench_loss CPU shapes, or slower (bf16: 1.04-1.08x).
#ifndef NNK_PREFETCH_MAX_ROWS
#define NNK_PREFETCH_MAX_ROWS 16
#endif

// Pass 1 reads rows in groups of four, so the distance is rounded up to whole groups (at least
// the next group).
inline int64_t prefetch_rows(int64_t row_bytes) {
    if (NNK_PREFETCH_BYTES <= 0) return 0;
    int64_t rows = NNK_PREFETCH_BYTES / std::max<int64_t>(row_bytes, 1);
    return std::max<int64_t>(4, std::min<int64_t>(NNK_PREFETCH_MAX_ROWS, (rows + 3) / 4 * 4));
}
// Hot helpers are always inlined: as sets of native vectors the inliner's estimate of them
// grew, and the distance became a call per gathered row.
#define NNK_INLINE inline __attribute__((always_inline))

namespace {

struct bf16 { uint16_t bits; };
struct fp16 { uint16_t bits; };

inline float bits_to_float(uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

// IEEE half -> float without relying on compiler support for _Float16 (exact for every input,
// subnormals, inf and NaN included). Branch-free enough to vectorise.
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
#if defined(__FLT16_MAX__) && !defined(NNK_NO_FLOAT16)
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


// Runs work(i) for every i in [0, n) on up to `nthreads` threads, each claiming items from a
// shared counter (so a thread that starts late simply does fewer items); each thread works on
// its own copy of `work` (its scratch buffers). Returns once every item is done.
//
// Whose threads (issue 21): built with -fopenmp (cpu.py does so where torch's intra-op pool is
// the libgomp loaded in the process), the threads are an OpenMP team of that same libgomp:
// torch's own worker threads, so torch's ops and this kernel share one pool and never spin
// against each other. Measured on the 2-core machine, idle, forward+backward of the op at 2
// threads vs 1: 1.6-1.9x faster this way; with the kernel's own std::threads beside torch's
// spinning OpenMP workers it was 0.3-1.0x (slower than one thread). The price: the team's
// closing barrier waits for every thread, and beside another busy process a descheduled one can
// stall the call for a time slice; cpu.py's ThreadGovernor measures that and drops to one
// thread when it is faster (nthreads <= 1 runs inline, no parallel region at all).
//
// Without OpenMP (another runtime in torch, or a compiler without -fopenmp): the caller and
// nthreads - 1 detached helper std::threads; the caller never waits for a helper that has not
// claimed an item (a late helper finds nothing left and exits), and everything a late helper
// touches is kept alive by a shared_ptr.
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
#if defined(_OPENMP) && !defined(NNK_OWN_THREADS)
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

// Type codes (the Python side uses the same). Compute: 0 fp32, 1 fp64. Bank element: 0 fp32,
// 1 fp64, 2 bf16, 3 fp16. f is called with a value of the type; 1 is returned for an unknown
// code, 0 otherwise.
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

}  // namespace
