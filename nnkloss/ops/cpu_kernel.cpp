// Compiled CPU kernels: the neighbour-kernel loss op (see /CONTRACT.md: the forward contract)
// and, at the end of the file, the exact kNN search's selection (nnk_knn_select,
// nnk_knn_select_sym for a self-search, nnk_knn_pad) and its distance tiles' GEMM
// (nnk_gemm_nt).
//
// No torch headers: nnkloss/ops/cpu.py compiles this file on first use with the system
// compiler (c++ -O3 -march=native -pthread -fopenmp -shared -fPIC where torch's pool is
// libgomp, so that the parallel loops run on torch's OpenMP team; else -fopenmp-simd and own
// std::threads: see run_items), loads it with ctypes and passes tensor data pointers. Every
// array is contiguous.
//
// Types: C is the compute type (float, or double for fp64 embeddings), T the bank element
// type (float, double, bf16 or fp16 stored as uint16_t bits). Integer arrays (neighbours,
// labels, centre labels) are int32 or int64, chosen at run time by a flag. emb is already in
// the compute type (the Python wrapper converts it).
//
// Forward, per row b (rows shared out among threads by run_items; ForwardRow::row's numbered
// steps): pass 1 gathers the K centre rows once, four at a time (one at a time for fp32 / bf16
// rows of D 64, 128 or 256, at a compile-time D), and computes the scaled squared distances
// u_j = sum_d ((c_j[d] - x[d]) / sigma)^2 (times 1/sigma, before squaring); then, from those K
// numbers in cache, the logits (the weights and centre labels gathered), the two maxima, the
// exponentials and the two sums run as SIMD lanes over K (vexp, a vectorisable exp within
// ~1 ulp), and the log-sum-exps follow. grad_x = (1/sigma^2) sum_j (p_j - p^R_j)(c_j - x) with p_j = e_j / s_all,
// p^R_j = e^R_j / s_pos (normalised by the computed sums) is computed (not in the forward-only
// path) in one of two ways: when a row's gathered set (K * D * element bytes) exceeds
// NNK_ONE_PASS_BYTES and its rows are at least ONE_PASS_MIN_ROW_BYTES long, pass 1 folds each row, while it is in L1, into running sums of e_j (c_j - x)
// for all entries and for the class, rescaled whenever the running maximum rises (the online
// log-sum-exp of the Triton kernel), so the rows are read once; below it a second pass re-reads
// the rows from L2 with coefficients computed as SIMD lanes, skipping zero coefficients. The
// loss and log-sum-exps come from the K logits either way (the same bits with and without
// grad_x). The only temporaries are a few K-vectors and one D-vector per thread.
//
// Backward (CPU backend, nnkloss/ops/neighbour_kernel.py _backward): the embedding gradient is
// one scaling of grad_x's rows (scale_rows_impl); when centres, weights or sigma take a
// gradient, their per-entry terms (p_j - p^R_j, from the saved distances) come from one pass
// per row (EntryGrads), and the centres' from the scatter below.
//
// Centre gradient: grad[j] += coef[b,k] * (emb[b] - centres[j]). The threads share out ranges
// of bank rows, so no two threads write the same row and every row is accumulated in the same
// (b, k) order whatever the thread count: the result is deterministic.
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

// ACC = 16 independent partial sums per row (one AVX-512 / two AVX2 fp32 vectors: Lanes below):
// one running sum is a chain of dependent adds (4 cycles each), which for a row already in
// cache is the bottleneck; the partials are then added pairwise (no less accurate than one
// running sum). They are GCC/Clang vector types rather than arrays: as arrays the compiler kept
// them on the stack and added the 16 lanes with scalar adds through memory, which cost as much
// as the distance itself at D = 128 (measured).
constexpr int64_t ACC = 16;

// fp32 / bf16 / fp16 rows of D 64, 128 or 256 of at most this many bytes are read one at a
// time at a compile-time D (row_distances_fixed), longer ones in groups of four (0: never one
// at a time).
// Which is faster depends on the CPU: the fixed rows were measured 1.06-1.16x faster at D 64,
// 128 and 256 on a 2-core AMD EPYC (2026-11-24), but that was against groups whose partial sums
// GCC kept in memory on AVX2 (see Lanes). With the lanes in registers, the 2-core AMD EPYC of
// 2026-11-25 (AVX2, benchmarks/cpu_variants.py -D "" -D NNK_FIXED_ROW_BYTES=0, 3 runs of 5
// rounds, benchmarks/results/cpu_variants_AMD_EPYC.txt) measured the groups 1.25-1.43x faster
// at D 256 fp32 (1 KiB rows), and both within noise of each other at D 64 and 128 fp32 and with
// bf16 rows of D 128 and 256 (256-512 bytes). So: up to 512 bytes without AVX-512, up to
// 1 KiB (every D 64 / 128 / 256, as measured before) with it. Re-measured with AVX-512 on a
// 2-core AMD EPYC family 26 (2026-11-26, cpu_variants.py -D "" -D NNK_FIXED_ROW_BYTES=256,
// 3 rounds, benchmarks/results/cpu_variants_AMD_EPYC_family_26_model_2.txt): one row at a time
// 1.29x faster at D 128 fp32 (forward; 1.17x with grad_x), 1.12x at D 256 (1.03x), equal at
// D 64.
#ifndef NNK_FIXED_ROW_BYTES
#if defined(__AVX512F__)
#define NNK_FIXED_ROW_BYTES 1024
#else
#define NNK_FIXED_ROW_BYTES 512
#endif
#endif


// A forward with grad_x reads the gathered rows once (folding each into the gradient's running
// sums while it is in L1) when a row's gathered set, K * D * sizeof(bank element), exceeds
// NNK_ONE_PASS_BYTES (NNK_ONE_PASS_PREFETCHED_BYTES for rows whose fold takes part of the
// prefetching, NNK_FOLD_PREFETCH below) and its rows are at least NNK_ONE_PASS_MIN_ROW_BYTES
// long; otherwise a second pass reads them again (see ForwardRow::row), from L2 at these sizes
// (1 MiB of it on the machine measured). Since the second pass holds g's columns in registers
// (grad_pass, 2026-11-27), two passes beat one up to 512 KiB sets but for the rows the fold
// prefetches for: with grad_x at one thread (2026-11-27, cpu_variants.py --kernel, 4 rounds,
// log benchmarks/results/cpu_variants_AMD_EPYC_family_26_model_2.txt) two passes took 0.89x
// one pass's time at K 100, D 512 fp32 (200 KiB), 0.93x at K 200, D 512 (400 KiB), 0.86x at
// K 200, D 256 and 0.90x with bf16 rows of K 200, D 512, 0.93x and 0.89x with bf16 rows of
// D 2048 at K 100 and 50; 1.02x at K 400, D 512 (800 KiB) and 0.97x at K 800, D 256; with fp64
// rows 0.97x, 1.00x and 0.94x at 320-400 KiB sets, with fp16 rows 0.91x (ad hoc, 5 rounds).
// For fp32 rows of 4 KiB and more one pass stays faster: two passes took 1.21x its time at
// K 64, D 1024 (256 KiB), 1.18x at K 100, D 1024 and 1.05x at K 40, D 2048 (320 KiB).
#ifndef NNK_ONE_PASS_BYTES
#define NNK_ONE_PASS_BYTES (512 << 10)
#endif
#ifndef NNK_ONE_PASS_PREFETCHED_BYTES
#define NNK_ONE_PASS_PREFETCHED_BYTES (128 << 10)
#endif
// The fold's cost per entry (its logits, exponentials and running-maximum test) is paid per
// row whatever the row's length, and short rows do not repay it: two passes were faster at
// every short-row shape measured, even with gathered sets past L2 (2-core AMD EPYC,
// 2026-11-25, benchmarks/cpu_variants.py --kernel, 5 rounds, forward with grad_x: 1.72x at
// K 1000, D 64 fp32 (250 KB a row), 1.52x at K 2000, D 32, 1.25x at K 4000, D 64 (1 MB), 1.07x
// at K 1000, D 100); one pass stays faster from 512-byte rows on (1.07x at K 1000, D 128, 1.14x
// at K 100, D 512 fp32). Re-measured on the 2-core AMD EPYC family 26 (1 MiB of L2; 2026-11-26,
// cpu_variants.py --kernel with NNK_ONE_PASS_BYTES at 64 KiB, 0 and 1 GiB, 5 rounds, log
// benchmarks/results/cpu_variants_AMD_EPYC_family_26_model_2.txt): no threshold faster at every
// shape. One pass at B 1024, K 32, D 128 (16 KB a row's set) took 0.44 against 0.32 ms; the
// bf16 rows of K 100, D 512 (100 KB) were within the run's noise either way.
#ifndef NNK_ONE_PASS_MIN_ROW_BYTES
#define NNK_ONE_PASS_MIN_ROW_BYTES 512
#endif

// In one pass with fp32 rows of at least NNK_FOLD_PREFETCH_MIN_ROW_BYTES, the prefetches of the
// four rows pf entries ahead are split: two rows' lines are requested during a group's distance
// sweep, two during its fold (0: all four during the distance sweep, as for the other types and
// shorter rows). The fold's sweep reads only L1 and made no request of its own, so memory sat
// idle through it once the outstanding prefetches had landed: with grad_x the kernel took
// 1.13-1.39x its forward-only time at D 1024-2048 fp32, 1.02-1.18x with this. Measured on the
// 2-core AMD EPYC family 26, 2026-11-27 (log benchmarks/results/cpu_variants_
// AMD_EPYC_family_26_model_2.txt): with grad_x at one thread against the kernel before it
// (cpu_variants.py --against 85e7f64 --threads 1, 8 rounds) 1.14x faster at B 64, K 256, D 2048
// (4.26 against 4.85 ms) and 1.21x at B 128, K 128, D 1024, the forward-only calls within 0.3%,
// and the two-pass shapes (B 1024, K 32, D 128; B 128, K 1000, D 64; 10 rounds) within 0.6% in
// both modes; again in the form below (one call of scaled_sqdist4, 8 rounds): 1.10x at D 2048
// (4.48 against 4.94 ms), 1.19x at D 1024, forward-only within 0.9%, the two-pass shapes within
// 0.5%; at two threads against NNK_FOLD_PREFETCH=0 (cpu_variants.py --kernel, four runs of 6-10
// rounds, the last one logged) 1.06-1.13x at D 2048, 1.13-1.20x at D 1024, 1.05-1.12x at D
// 1536. Not for the other types: bf16 rows of D 2048 (4 KiB) 0.96x and 1.01x, fp64 rows 1.10x
// at D 512 and 0.97x at D 1024 (8 rounds, ad hoc), where the fold's arithmetic, not the wait
// for memory, is what the kernel spends its time on; nor for fp32 rows of D 512 (0.84x in the
// first run; with the gate at 2 KiB, at one thread, 8 rounds, ad hoc: 0.92x at K 100, 0.93x at
// K 200, 1.80 against 1.95 ms and 3.78 against 4.06; those banks sit in or near L3). The same
// bits either way (a prefetch changes no arithmetic). The mechanism takes every row type (two
// lines a step for fp64), so that the gate alone is the policy.
#ifndef NNK_FOLD_PREFETCH
#define NNK_FOLD_PREFETCH 1
#endif
#ifndef NNK_FOLD_PREFETCH_MIN_ROW_BYTES
#define NNK_FOLD_PREFETCH_MIN_ROW_BYTES 4096
#endif

// The ACC lanes live in the CPU's own vector registers: NATIVE_BYTES wide (64 with AVX-512, 32
// with AVX, else 16), so a set of lanes is P = ACC / (NATIVE_BYTES / sizeof(C)) native vectors
// (fp32: one AVX-512 / two AVX2 registers; fp64: two / four). As one 64- or 128-byte GCC vector
// on a CPU whose registers are narrower, GCC 12 kept the lanes in memory: the four-row distance
// loop moved its partial sums through the stack and general registers (vmovq / vpinsrq) at every
// step, and `s * v` was built from ACC scalar stores and wider reloads (a store-forwarding stall
// per row). Lane i of the set is lane i % L of native vector i / L, so every operation is the
// same per lane and tree_sum adds the lanes in the same order (the same bits as before, but for
// the last bit of fp64 rows with a ragged tail, where the compiler's FMA contraction of the tail
// loop changed). Measured on the 2-core AMD EPYC (AVX2, 2026-11-25, benchmarks/cpu_variants.py
// --against, 5 rounds): kernel forward 1.44x at B 256, K 100, D 512, 1.45x at D 2048, 1.85x
// with the bf16 bank, with grad_x 1.40-1.64x; D 128 (row_distances_fixed) within noise. With
// AVX-512 a set is one register (compiled for Sapphire Rapids, the four-row loop is the same
// instructions as before).
#if defined(__AVX512F__)
constexpr int NATIVE_BYTES = 64;
#elif defined(__AVX__)
constexpr int NATIVE_BYTES = 32;
#else
constexpr int NATIVE_BYTES = 16;
#endif

// The lanes' helpers and the distance are always inlined: as a set of native vectors the
// inliner's estimate of them grew, and scaled_sqdist became a call per gathered row.
#define NNK_INLINE inline __attribute__((always_inline))

template <typename C>
struct Lanes {
    typedef C Native __attribute__((vector_size(NATIVE_BYTES)));
    static constexpr int L = NATIVE_BYTES / (int)sizeof(C);  // lanes per native vector
    static constexpr int P = (int)ACC / L;                   // native vectors per set
    static_assert(P >= 1 && P * L == ACC, "ACC must be a whole number of native vectors");
    Native n[P];
};

template <typename C>
NNK_INLINE Lanes<C> operator+(const Lanes<C>& a, const Lanes<C>& b) {
    Lanes<C> r;
    for (int q = 0; q < Lanes<C>::P; ++q) r.n[q] = a.n[q] + b.n[q];
    return r;
}
template <typename C>
NNK_INLINE Lanes<C> operator-(const Lanes<C>& a, const Lanes<C>& b) {
    Lanes<C> r;
    for (int q = 0; q < Lanes<C>::P; ++q) r.n[q] = a.n[q] - b.n[q];
    return r;
}
template <typename C>
NNK_INLINE Lanes<C> operator*(const Lanes<C>& a, const Lanes<C>& b) {
    Lanes<C> r;
    for (int q = 0; q < Lanes<C>::P; ++q) r.n[q] = a.n[q] * b.n[q];
    return r;
}
template <typename C>
NNK_INLINE Lanes<C>& operator+=(Lanes<C>& a, const Lanes<C>& b) {
    for (int q = 0; q < Lanes<C>::P; ++q) a.n[q] += b.n[q];
    return a;
}

// ACC consecutive elements of a row, converted to the compute type.
template <typename C, typename T>
NNK_INLINE Lanes<C> load_lanes(const T* __restrict p) {
    Lanes<C> v;
    for (int q = 0; q < Lanes<C>::P; ++q)
        for (int i = 0; i < Lanes<C>::L; ++i) v.n[q][i] = load<C>(p, q * Lanes<C>::L + i);
    return v;
}
// Rows of the compute type: one unaligned load per native vector (a memcpy of the whole set
// went through the stack: four 16-byte stores and 32-byte reloads, which do not forward).
template <typename C>
NNK_INLINE Lanes<C> load_native(const C* __restrict p) {
    Lanes<C> v;
    for (int q = 0; q < Lanes<C>::P; ++q) std::memcpy(&v.n[q], p + q * Lanes<C>::L, NATIVE_BYTES);
    return v;
}
template <>
NNK_INLINE Lanes<float> load_lanes<float, float>(const float* __restrict p) {
    return load_native(p);
}
// bf16 -> fp32 is the 16 bits shifted into the top half: written as whole-vector operations
// (widen, shift, reinterpret), one native vector at a time, rather than whatever the compiler
// makes of 16 scalar conversions. With AVX-512 the widening is spelled out as one vpmovzxwd from
// memory: GCC 12 compiles __builtin_convertvector(u16 x 16 -> u32 x 16) as two 256-bit
// widenings plus an extract and an insert (four shuffle-port operations instead of one per 16
// elements), which made the bf16 gradient pass half as fast per element as the fp32 one (2-core
// Intel Xeon, 2026-11-25, one thread, B 256, K 100, D 512: 12.4 against 26.3 G elements/s).
// With AVX2 likewise, one vpmovzxwd ymm from memory per register: the generic form had become
// two 128-bit widenings, a byte shift and an insert (2-core AMD EPYC, 2026-11-25, 5 rounds:
// forward 1.39x at B 256, K 100, D 512, 1.24x at B 512, K 64, D 256, with grad_x 1.08-1.28x;
// benchmarks/results/cpu_variants_AMD_EPYC.txt).
// NNK_GENERIC_BF16_WIDEN=1 keeps the generic form (for A/B on another compiler or CPU).
// One instruction instead of two, tried on the 2-core AMD EPYC family 26 (AVX-512 VBMI2,
// 2026-11-27, cpu_variants.py --kernel, not kept): vpexpandw from memory into the odd words
// took 1.45x the forward's time and 2.8x with grad_x (microcoded there); from a register 1.14x
// and 1.24x; vpermw with a zeroing mask into the odd words 0.96-0.99x the forward and
// 0.95-1.02x with grad_x at four bf16 shapes, where a second build of the unchanged source
// moved 0.99-1.07x (6 rounds, benchmarks/results/cpu_variants_AMD_EPYC_family_26_model_2.txt):
// the widening is not what the bf16 passes wait on. Nor is the second pass's reading of rows
// from L2: prefetching them 4 or 8 entries ahead took 1.08x with grad_x (7 rounds, ad hoc).
template <>
NNK_INLINE Lanes<float> load_lanes<float, bf16>(const bf16* __restrict p) {
    Lanes<float> v;
#if defined(__AVX512F__) && !NNK_GENERIC_BF16_WIDEN
    const __m512i w = _mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
    std::memcpy(&v, &w, sizeof v);
#elif defined(__AVX2__) && !NNK_GENERIC_BF16_WIDEN
    for (int q = 0; q < Lanes<float>::P; ++q) {  // one vpmovzxwd ymm from memory per register
        const __m256i w = _mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 8 * q))), 16);
        std::memcpy(&v.n[q], &w, sizeof w);
    }
#else
    constexpr int L = Lanes<float>::L;
    typedef uint16_t U16 __attribute__((vector_size(L * 2)));
    typedef uint32_t U32 __attribute__((vector_size(L * 4)));
    for (int q = 0; q < Lanes<float>::P; ++q) {
        U16 h;
        std::memcpy(&h, p + q * L, sizeof h);
        const U32 w = __builtin_convertvector(h, U32) << 16;
        std::memcpy(&v.n[q], &w, sizeof w);
    }
#endif
    return v;
}
// fp16 -> fp32 with the CPU's own conversion (F16C's vcvtph2ps, 8 or 16 at a time), exact as
// the scalar one is (every fp16 value is an fp32 value), so fp16 rows take the same vector
// loops as the other types (distances, folds, both gradient passes). Without F16C the generic
// form above, one element at a time. Until 2026-11-27 fp16 rows had loops of their own that
// converted a row 256 elements at a time into a buffer and ran the fp32 loops on it; against
// those (cpu_variants.py --kernel, one thread, 5 rounds, log benchmarks/results/cpu_variants_
// AMD_EPYC_family_26_model_2.txt) the kernel's forward is 2.6x faster at B 1024, K 32, D 128,
// 3.8x at K 1000, D 64, 2.9x at K 100, D 512 and 4.5x at K 256, D 2048 (with grad_x 2.1-3.7x).
// The distances of rows longer than 256 are no longer summed a block at a time: their last
// bits moved (the tests hold them to the fp64 contract, as before).
#if defined(__F16C__)
template <>
NNK_INLINE Lanes<float> load_lanes<float, fp16>(const fp16* __restrict p) {
    Lanes<float> v;
#if defined(__AVX512F__)
    const __m512 w = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
    std::memcpy(&v, &w, sizeof v);
#else
    for (int q = 0; q < Lanes<float>::P; ++q) {
        const __m256 w = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8 * q)));
        std::memcpy(&v.n[q], &w, sizeof w);
    }
#endif
    return v;
}
#endif
template <>
NNK_INLINE Lanes<double> load_lanes<double, double>(const double* __restrict p) {
    return load_native(p);
}

// A set of lanes all equal to s, for every product of a scalar with lanes: one broadcast
// register (an initializer of L equal elements, which GCC 12 makes one vbroadcastss both with
// AVX2 and AVX-512; `s * v` on a vector wider than the registers went through the stack, see
// Lanes, and a lane-by-lane fill became 16 masked moves per use with AVX-512). The products are
// the same IEEE operations.
template <typename N, typename C, std::size_t... I>
NNK_INLINE N broadcast_native(C s, std::index_sequence<I...>) {
    return N{((void)I, s)...};
}

template <typename V, typename C>
NNK_INLINE V splat(C s) {
    const typename V::Native b =
        broadcast_native<typename V::Native>(s, std::make_index_sequence<V::L>{});
    V v;
    for (int q = 0; q < V::P; ++q) v.n[q] = b;
    return v;
}

// The 16 lanes added pairwise: lane i + lane i+8, then i + i+4, i + i+2, 0 + 1. Across native
// vectors first (vector q + vector q + P/2 is lane i + lane i + P L / 2), then within the last
// one.
template <typename N>
NNK_INLINE auto native_tree(const N& h) {
    constexpr int L = (int)(sizeof(N) / sizeof(h[0]));
    if constexpr (L == 16) {
        return native_tree(__builtin_shufflevector(h, h, 0, 1, 2, 3, 4, 5, 6, 7) +
                           __builtin_shufflevector(h, h, 8, 9, 10, 11, 12, 13, 14, 15));
    } else if constexpr (L == 8) {
        return native_tree(__builtin_shufflevector(h, h, 0, 1, 2, 3) +
                           __builtin_shufflevector(h, h, 4, 5, 6, 7));
    } else if constexpr (L == 4) {
        return native_tree(__builtin_shufflevector(h, h, 0, 1) +
                           __builtin_shufflevector(h, h, 2, 3));
    } else {
        static_assert(L == 2, "native vectors of 2 to 16 lanes");
        return h[0] + h[1];
    }
}

template <typename C>
NNK_INLINE C tree_sum(const Lanes<C>& p) {
    typedef typename Lanes<C>::Native N;
    N h[Lanes<C>::P];
    for (int q = 0; q < Lanes<C>::P; ++q) h[q] = p.n[q];
    for (int w = Lanes<C>::P / 2; w >= 1; w /= 2)
        for (int q = 0; q < w; ++q) h[q] = h[q] + h[q + w];
    return native_tree(h[0]);
}

// Prefetches the lines that the vector step at element d of a row reads: one line (ACC
// elements of fp32, or fewer bytes), two for fp64 rows (ACC * 8 = 128 bytes). Used to spread a
// future row's prefetches over the steps of a sweep over other rows (scaled_sqdist4, and the
// fold's sweep in axpy_diff_rows) rather than issue them in a burst that fills the miss
// buffers.
template <typename T>
NNK_INLINE void prefetch_step(const T* row, int64_t d) {
    const char* p = (const char*)row + d * (int64_t)sizeof(T);
    __builtin_prefetch(p, 0, NNK_PREFETCH_LOCALITY);
    if (ACC * (int64_t)sizeof(T) > 64) __builtin_prefetch(p + 64, 0, NNK_PREFETCH_LOCALITY);
}

// Each difference is scaled before it is squared (docs/MATHS.md, rule 1): one multiply an
// element more than ||c - x||^2 / sigma^2. What the rule costs, measured on the 2-core AMD EPYC
// family 26 (2026-11-27, cpu_variants.py --kernel, 6 rounds, a variant that squared the
// unscaled differences and scaled each row's sum): the unscaled form took 0.98-1.00x the
// forward's time at the three fp32 grid shapes, 0.94x with the bf16 bank, and 0.95-1.01x with
// grad_x (benchmarks/results/cpu_variants_AMD_EPYC_family_26_model_2.txt). The banks come
// from L3 or memory there, so the arithmetic hides behind the reading; only a bank in L1 showed
// the rule's 1.17x. Not worth an overflow / underflow fallback: the rule stays.
template <typename C, typename T>
NNK_INLINE C scaled_sqdist(const T* __restrict c, const C* __restrict x, C inv_s, int64_t D) {
    typedef Lanes<C> V;
    const V vs = splat<V>(inv_s);
    V part = {};
    int64_t d = 0;
    for (; d + ACC <= D; d += ACC) {
        V z = (load_lanes<C>(c + d) - load_lanes<C>(x + d)) * vs;
        part += z * z;
    }
    C tail = 0;
    if (D % ACC != 0) {  // d == D otherwise: said outright for a compile-time D (no tail code)
        for (; d < D; ++d) {
            C z = (load<C>(c, d) - x[d]) * inv_s;
            tail += z * z;
        }
    }
    return tree_sum(part) + tail;
}

// The distances of four gathered rows at once: per row the same operations in the same order
// as scaled_sqdist (so the same bits: a row's distance does not depend on whether it was
// computed in a group), but x is loaded once per four rows, the four rows' dependent add
// chains interleave (one chain per row keeps an FMA unit waiting for its own latency), and
// four rows stream from memory at once (measured: 1.4x faster at D = 2048).
//
// fut: four rows to prefetch (the group `pf` entries ahead; pass the current rows when there
// is none), one cache line of each per ACC elements read, so that the prefetches are spread
// over the computation instead of issued in a burst that fills the miss buffers and stalls.
template <typename C, typename T>
inline void scaled_sqdist4(const T* __restrict c0, const T* __restrict c1,
                           const T* __restrict c2, const T* __restrict c3,
                           const C* __restrict x, C inv_s, int64_t D, C* out,
                           const T* const* fut) {
    typedef Lanes<C> V;
    const V vs = splat<V>(inv_s);
    V p0 = {}, p1 = {}, p2 = {}, p3 = {};
    const char* f0 = (const char*)fut[0];
    const char* f1 = (const char*)fut[1];
    const char* f2 = (const char*)fut[2];
    const char* f3 = (const char*)fut[3];
    int64_t d = 0;
    for (; d + ACC <= D; d += ACC) {
        for (int i = 0; i < 4; ++i) prefetch_step(fut[i], d);
        const V xd = load_lanes<C>(x + d);
        V z0 = (load_lanes<C>(c0 + d) - xd) * vs;
        V z1 = (load_lanes<C>(c1 + d) - xd) * vs;
        V z2 = (load_lanes<C>(c2 + d) - xd) * vs;
        V z3 = (load_lanes<C>(c3 + d) - xd) * vs;
        p0 += z0 * z0;
        p1 += z1 * z1;
        p2 += z2 * z2;
        p3 += z3 * z3;
    }
    if (d < D) {  // the lines of a ragged end
        const int64_t o = d * (int64_t)sizeof(T);
        const int64_t e = D * (int64_t)sizeof(T) - 1;
        __builtin_prefetch(f0 + o, 0, NNK_PREFETCH_LOCALITY);
        __builtin_prefetch(f1 + o, 0, NNK_PREFETCH_LOCALITY);
        __builtin_prefetch(f2 + o, 0, NNK_PREFETCH_LOCALITY);
        __builtin_prefetch(f3 + o, 0, NNK_PREFETCH_LOCALITY);
        __builtin_prefetch(f0 + e, 0, NNK_PREFETCH_LOCALITY);
        __builtin_prefetch(f1 + e, 0, NNK_PREFETCH_LOCALITY);
        __builtin_prefetch(f2 + e, 0, NNK_PREFETCH_LOCALITY);
        __builtin_prefetch(f3 + e, 0, NNK_PREFETCH_LOCALITY);
    }
    C t0 = 0, t1 = 0, t2 = 0, t3 = 0;
    for (; d < D; ++d) {
        const C xd = x[d];
        C z0 = (load<C>(c0, d) - xd) * inv_s;
        C z1 = (load<C>(c1, d) - xd) * inv_s;
        C z2 = (load<C>(c2, d) - xd) * inv_s;
        C z3 = (load<C>(c3, d) - xd) * inv_s;
        t0 += z0 * z0;
        t1 += z1 * z1;
        t2 += z2 * z2;
        t3 += z3 * z3;
    }
    out[0] = tree_sum(p0) + t0;
    out[1] = tree_sum(p1) + t1;
    out[2] = tree_sum(p2) + t2;
    out[3] = tree_sum(p3) + t3;
}

// Pass 1 of a row at a compile-time D (fp32 / bf16 / fp16 rows of 64, 128 or 256 elements, at
// most NNK_FIXED_ROW_BYTES long) when no gradient is folded in: one gathered row at a time (same
// bits as in a group of four), the row pf entries ahead prefetched whole, the distances into
// ub; the logits follow in one SIMD sweep (ForwardRow::logits). For small rows this beat the
// groups of four with their per-group bookkeeping on the 2-core AMD machine of 2026-11-24
// (2 threads, A/B in one process, L3-resident banks of 50,000 rows: forward 1.16x at B 1024,
// K 32, D 128 fp32, 1.09x bf16, 1.14x at D 64, 1.16x at D 256 (1.06x bf16); with grad_x
// 1.07-1.12x; rows of 70 elements (runtime D) within noise), before the groups' partial sums
// were kept in registers on AVX2: see NNK_FIXED_ROW_BYTES for what holds since. At D 512 the
// groups of four stay: one at a time was 0.87-0.93x there (2 KB rows from memory, where four
// streams at once win). The loop unrolls whole at the
// compile-time D, and as a function of its own its pointers keep their registers (inlined
// into row(), GCC had kept the prefetch pointers in vector registers). Groups of four at the
// compile-time D (scaled_sqdist4 with D a constant, its prefetching; the same bits) were
// slower on the AMD EPYC family 26 (2026-11-27, kernel forward, the builds alternating in
// one process, 5 rounds, ad hoc): 0.90x at B 1024, K 32, D 128, 0.95x at D 64 and D 256,
// 0.88x with bf16 rows; the classifier's pass, with more arithmetic a row, gained from the
// same change (rel_sqdist_rows).
template <int64_t DC, typename C, typename T>
__attribute__((noinline)) void row_distances_fixed(const T* bank, int64_t n_rows,
                                                   const void* nbl, int l64, int64_t k0,
                                                   int64_t K, int64_t end, int64_t pf,
                                                   const C* x, C inv_s, C* ub) {
    const C nan = std::numeric_limits<C>::quiet_NaN();
    for (int64_t k = 0; k < K; ++k) {
        const int64_t f = k0 + k + pf;
        if (pf > 0 && f < end) {
            const int64_t jn = load_index(nbl, l64, f);
            if (jn >= 0 && jn < n_rows) prefetch_row(bank + jn * DC, DC);
        }
        const int64_t j = load_index(nbl, l64, k0 + k);
        ub[k] = j >= 0 && j < n_rows ? scaled_sqdist(bank + j * DC, x, inv_s, DC)
                                     : (j < 0 ? (C)0 : nan);
    }
}

// exp(x) for the row's softmax, vectorisable: the K exponentials of a row run as SIMD lanes
// (a call to the C library's exp per entry cost as much as the entry's 128-wide distance).
// fp32: Cody-Waite range reduction x = n ln2 + r (|r| <= ln2 / 2 up to rounding, ln2 split in
// two so n ln2 is exact), a degree-7 polynomial for e^r (Cephes' expf coefficients: within 1 ulp of exp on
// [-ln2/2, ln2/2]) and 2^n applied as two exact power-of-two factors so that results down to
// the subnormal range round once. x = -inf (an invalid entry) gives 0, x <= -104 gives 0 (exp
// underflows there in fp32 too), NaN stays NaN. fp64 keeps the C library's exp.
// always_inline: a call inside the omp simd loop would make it scalar again. Its compares and
// selects vectorise without AVX-512's masks (AVX2) only under -fno-trapping-math, which
// nnkloss/ops/cpu.py builds with: GCC 12 left the loop scalar otherwise ("control flow in
// loop"), the same bits either way.
__attribute__((always_inline)) inline float vexp(float x) {
    const float lo = -104.0f, hi = 88.72283935546875f;
    float xc = x < lo ? lo : (x > hi ? hi : x);
    // n = round(x / ln2) by the 1.5 * 2^23 trick (exact for |x / ln2| < 2^22; floorf would
    // keep the loop scalar without -fno-trapping-math)
    const float magic = 12582912.0f;
    float n = (xc * 1.44269504088896341f + magic) - magic;
    float r = std::fma(n, -0.693359375f, xc);
    r = std::fma(n, 2.12194440e-4f, r);
    float z = r * r;
    float p = 1.9875691500e-4f;
    p = std::fma(p, r, 1.3981999507e-3f);
    p = std::fma(p, r, 8.3334519073e-3f);
    p = std::fma(p, r, 4.1665795894e-2f);
    p = std::fma(p, r, 1.6666665459e-1f);
    p = std::fma(p, r, 5.0000001201e-1f);
    p = std::fma(p, z, r) + 1.0f;
    // 2^n as two factors 2^n1 2^n2 (n in [-150, 128]: each half in [-75, 64], a normal
    // float), built from exponent bits; the bit casts are unions' job in C, memcpy's in C++,
    // but only the builtin lets the loop vectorise.
    int32_t ni = (int32_t)n;
    int32_t n1 = ni >> 1, n2 = ni - n1;
    float s1 = __builtin_bit_cast(float, (n1 + 127) << 23);
    float s2 = __builtin_bit_cast(float, (n2 + 127) << 23);
    float e = (p * s1) * s2;
    e = x < lo ? 0.0f : e;  // -inf and deep underflow: exactly 0
    e = x > hi ? std::numeric_limits<float>::infinity() : e;
    return x != x ? x : e;  // NaN propagates
}
inline double vexp(double x) { return std::exp(x); }

// g += sum_i a_i (c_i - x) over a row for N gathered rows c_i, in the order i = 0..N-1: ACC
// elements at a time as vector types (load_lanes converts bf16 rows with whole-vector
// operations), the ragged end one element at a time; per element the same operations in the
// same order either way, so the bits do not depend on N or on where the row ends. g and x are
// loaded, and g stored, once per N rows. Against the `omp simd` loops over scalar loads that
// this replaced (kept under a macro for the A/B, then removed): forward+backward 1.03-1.07x
// faster at the four bench_loss CPU shapes, forward 1.00-1.04x (2-core Intel Xeon, 2026-11-24,
// 3 rounds, benchmarks/results/cpu_variants_Intel_Xeon.txt).
template <typename C>
NNK_INLINE void store_lanes(C* __restrict p, const Lanes<C>& v) {
    for (int q = 0; q < Lanes<C>::P; ++q) std::memcpy(p + q * Lanes<C>::L, &v.n[q], NATIVE_BYTES);
}

// Always inlined: as a call from the second pass (the row's g and x reloaded, the four
// coefficients splat again per group) the forward with grad_x at K 1000, D 64 measured
// 0.85-0.92x in three runs, which is what GCC chose once row()'s inlining budget moved
// (2026-11-26, when the logits became a shared function).
template <int N, typename C, typename T>
NNK_INLINE void axpy_diff_rows(C* __restrict g, const T* const* c, const C* __restrict x,
                               const C* a, int64_t D, const T* const* pf = nullptr) {
    typedef Lanes<C> V;
    V va[N];
    for (int i = 0; i < N; ++i) va[i] = splat<V>(a[i]);
    int64_t d = 0;
    for (; d + ACC <= D; d += ACC) {
        if (pf) {  // two rows to prefetch, a step of each per step (see NNK_FOLD_PREFETCH)
            prefetch_step(pf[0], d);
            prefetch_step(pf[1], d);
        }
        V acc = load_lanes<C>(g + d);
        const V xd = load_lanes<C>(x + d);
        for (int i = 0; i < N; ++i) acc += va[i] * (load_lanes<C>(c[i] + d) - xd);
        store_lanes(g + d, acc);
    }
    for (; d < D; ++d) {
        const C xd = x[d];
        C acc = g[d];
        for (int i = 0; i < N; ++i) acc += a[i] * (load<C>(c[i], d) - xd);
        g[d] = acc;
    }
}

template <typename C, typename T>
NNK_INLINE void axpy_diff(C* __restrict g, const T* __restrict c, const C* __restrict x, C a,
                          int64_t D) {
    const T* const rows[1] = {c};
    axpy_diff_rows<1>(g, rows, x, &a, D);
}

template <typename C, typename T>
NNK_INLINE void axpy_diff4(C* __restrict g, const T* __restrict c0, const T* __restrict c1,
                           const T* __restrict c2, const T* __restrict c3,
                           const C* __restrict x, const C* a, int64_t D,
                           const T* const* pf = nullptr) {
    const T* const c[4] = {c0, c1, c2, c3};
    axpy_diff_rows<4>(g, c, x, a, D, pf);
}

// The gradient's second pass over a row's gathered set: g += sum_i a_i (c_i - x) over the n
// entries that carry a coefficient (rows[i], a[i]), a block of NB sets of lanes (NB * ACC
// columns) at a time: the block's sums stay in registers while every entry adds its part, are
// stored once, and the next block starts. The pass before it (until 2026-11-27; the variant
// NNK_GRAD_BLOCKS=0 of the logs, since removed) went through axpy_diff4, which loads and stores
// g once per four entries, and took 30-45% of the kernel's time with grad_x
// at the two-pass shapes (a probe that skipped it, 2026-11-27). Per element the operations are
// axpy_diff_rows' in the same order (g, then a_0 (c_0 - x), a_1 (c_1 - x), ...), so the bits
// are the same (checked against it at 30 shapes and the four types, with AVX-512 and AVX2
// builds; fp16 rows are widened by F16C, load_lanes<float, fp16>, exactly as the old pass's
// blocks were). Blocks of NB, then NB / 2, ... 1 sets, then the ragged end. NB is what the
// registers hold beside x's block and a temporary: 16 native vectors with AVX-512 (32
// registers), 8 with fewer (fp32: 256 columns with AVX-512, 64 with AVX2).
//
// x's term cancels in exact arithmetic (the a_i of a row sum to 0), but c_i - x is what keeps
// the sum exact when embeddings and centres sit far from the origin (docs/MATHS.md section 4,
// rule 4): sum a_i c_i - (sum a_i) x would cancel terms of the size of the coordinates.
//
// Measured on the 2-core AMD EPYC family 26 (AVX-512), 2026-11-27, the kernel with grad_x at
// one thread against a0fc271 (cpu_variants.py --against, 8 rounds; log benchmarks/results/
// cpu_variants_AMD_EPYC_family_26_model_2.txt): 1.14x at B 1024, K 32, D 128 (0.549 against
// 0.624 ms), 1.19x at B 128, K 1000, D 64, 1.14x at B 256, K 100, D 256 and 1.06x with the bf16
// bank of B 256, K 100, D 512; the one-pass shape (D 512 fp32) and the forward-only calls
// within the run's noise. Built for x86-64-v3 (AVX2, blocks of 64 columns), against
// NNK_GRAD_BLOCKS=0 built the same way (two runs of 5 rounds, the second logged): 1.04x and
// 1.07x at D 128, 1.10x and 1.10x at K 1000, D 64, 1.01x and 0.97x with the bf16 bank. fp16
// rows (widened by F16C), against the old pass for them (on 40d989b, one thread, 5 rounds,
// logged): 1.29x at B 1024, K 32, D 128, 1.37x at K 1000, D 64, 1.26x and 1.18x at K 100 and
// 200, D 512.
constexpr int GRAD_BLOCK_NATIVE = NATIVE_BYTES == 64 ? 16 : 8;

template <int NB, typename C, typename T>
NNK_INLINE void grad_columns(C* __restrict g, const T* const* rows, const C* a, int64_t n,
                             const C* __restrict x, int64_t D, int64_t d) {
    typedef Lanes<C> V;
    for (; d + NB * ACC <= D; d += NB * ACC) {
        V acc[NB];
        for (int q = 0; q < NB; ++q) acc[q] = load_lanes<C>(g + d + q * ACC);
        for (int64_t i = 0; i < n; ++i) {
            const V va = splat<V>(a[i]);
            const T* __restrict r = rows[i] + d;
            for (int q = 0; q < NB; ++q)
                acc[q] += va * (load_lanes<C>(r + q * ACC) - load_lanes<C>(x + d + q * ACC));
        }
        for (int q = 0; q < NB; ++q) store_lanes(g + d + q * ACC, acc[q]);
    }
    if constexpr (NB > 1) {
        grad_columns<NB / 2>(g, rows, a, n, x, D, d);
    } else {
        // The ragged end entry by entry, a plain loop over its elements: as a loop over the
        // entries per element, GCC vectorised it as an in-order reduction, products first and
        // then the adds, which rounds differently from the contracted a (c - x) + g of every
        // other element (and of axpy_diff_rows).
        for (int64_t i = 0; i < n; ++i) {
            const C ai = a[i];
            const T* r = rows[i];
            for (int64_t e = d; e < D; ++e) g[e] += ai * (load<C>(r, e) - x[e]);
        }
    }
}

// The second pass of row k0 / K: its entries with a nonzero coefficient a[i] (their rows into
// `rows`, their coefficients moved to the front of `a`, in entry order), then the blocks. Not
// inlined: inside row() its loops made the forward-only calls, which never reach it, slower.
template <typename C, typename T>
__attribute__((noinline)) void grad_pass(C* __restrict g, const T* bank, const void* nbl,
                                         int l64, int64_t k0, int64_t K, C* __restrict a,
                                         const T** __restrict rows, const C* __restrict x,
                                         int64_t D) {
    int64_t n = 0;
    for (int64_t i = 0; i < K; ++i) {
        if (a[i] == (C)0) continue;
        rows[n] = bank + load_index(nbl, l64, k0 + i) * D;
        a[n++] = a[i];  // in place: n <= i
    }
    constexpr int NB = GRAD_BLOCK_NATIVE / Lanes<C>::P;
    static_assert(NB >= 1, "a block holds at least one set of lanes");
    grad_columns<NB>(g, rows, a, n, x, D, 0);
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

// 1b. The logits of list entries [a, e) of the row whose entries start at k0 (its label R),
//     from their distances u[a..e), as SIMD lanes over the entries (the weights and centre
//     labels gathered): logit_j = log w_j - u_j / 2, -inf for padding, out-of-range entries and
//     zero weights; the same-class logit (-inf for other classes) into lpos; and the non-finite
//     rule (CONTRACT.md 6): true when an entry's distance is NaN/inf or its index is past the
//     bank. I, L: the list and centre-label integer types; W: the weight type (void: none, all
//     ones; wtype 1 fp32, 2 fp64), converted to C before the log as the torch path does
//     (weights[idx].to(compute dtype)). Called at the run-time types by Lists::logits.
//     log w is taken only for the rare entries with w != 1 (a non-unit, negative or
//     non-finite weight), by a scalar pass afterwards: log(1) is exactly 0, and a log per
//     entry cost ~13% of the forward at K = 32, D = 128.
// Whether v is inf or NaN, from its exponent bits (all ones): an integer test, which a SIMD
// loop can combine with its other integer masks (see list_logits_of).
template <typename C>
NNK_INLINE bool nonfinite_bits(C v) {
    typedef typename std::conditional<sizeof(C) == 4, uint32_t, uint64_t>::type U;
    U b;
    std::memcpy(&b, &v, sizeof b);
    constexpr U e = sizeof(C) == 4 ? (U)0x7f800000u : (U)0x7ff0000000000000ull;
    return (b & e) == e;
}

template <typename C, typename I, typename L, typename W>
bool list_logits_of(const void* nbrs, const void* clabels, const void* weights, int64_t n_rows,
                    int64_t k0, int64_t a, int64_t e, int64_t R, const C* __restrict u,
                    C* __restrict lg, C* __restrict lpos) {
    // Entries outside the bank read row 0's weight and label (unused: such an entry is not
    // valid); an empty bank has no row 0, so they read a zero of 8 bytes instead.
    static const int64_t zero8 = 0;
    const I* __restrict nb = (const I*)nbrs + k0;
    const L* __restrict cls = (const L*)(n_rows > 0 ? clabels : (const void*)&zero8);
    const void* const wts = n_rows > 0 ? weights : (const void*)&zero8;
    const C ninf = -std::numeric_limits<C>::infinity();
    int bad = 0, odd = 0;  // ints: a bool reduction kept the loop scalar
    // Written so that GCC 12 vectorises it at every type and tuning (tests/
    // test_cpu_kernel_codegen.py): the weights and centre labels are gathered first, a block of
    // up to 64 entries at a time, into two small buffers (in a loop of its own, which the
    // compiler vectorises with gather instructions where its tuning uses them and leaves
    // scalar where not), and the SIMD loop then reads them in order; it works in the lists' own
    // integer type (the last bank row an entry may name as an I: n_rows - 1, or I's largest
    // value where the bank has more rows than I can name, -1 for an empty bank; R as an L: a
    // label L cannot hold matches no centre); an entry outside the bank is a zero weight; a
    // non-finite distance is read from its exponent bits (nonfinite_bits), an integer test
    // like `in`. Before (int64 indices, the gathers in the SIMD loop, `in & (w != 0)` and
    // `in & !(|u| <= max)`: integer masks beside float compares) GCC found "no vector type"
    // for the weighted builds and, under generic tuning, for all: they ran one entry at a
    // time, the logits ~10% of the kernel's forward at B 1024, K 32, D 128 (perf). Measured
    // against that (2026-11-27, cpu_variants.py --against, 8 rounds, the kernel's forward /
    // with grad_x): 1.11x / 1.07x at B 1024, K 32, D 128 fp32, 1.12x / 1.09x with bf16 rows,
    // 1.20x / 1.13x at B 128, K 1000, D 64 (the Fashion-MNIST step), 0.99-1.03x at D 2048 and
    // with the bf16 bank of D 512; at D 512 fp32 0.95x / 0.98x, and 1.02x / 0.98x in a run of
    // 20 rounds (the rounds' own spread: 0.95-1.03). The gathers inside the SIMD loop
    // (vectorised under this CPU's tuning only) measured the same within 2% but for 1.06x at
    // K 1000; the gather loop kept scalar (a compiler barrier in it) against its vector
    // gathers: 1.00-1.04x (14 rounds), not kept. perf at B 1024, K 32, D 128 (the op's
    // forward-only calls, steady state, at a95cee9): the distances 49% of the samples, this
    // function 13% (most of it the gathers), the rest of the row 11%, GOMP's waits 11%,
    // Python 7%.
    // Log: benchmarks/results/cpu_variants_AMD_EPYC_family_26_model_2.txt.
    const I last = n_rows - 1 > (int64_t)std::numeric_limits<I>::max()
                       ? std::numeric_limits<I>::max() : (I)(n_rows - 1);
    const bool r_fits = (int64_t)(L)R == R;
    const L rl = (L)R;
    // One entry's logits (into lg and lpos) from its list entry j, weight w and centre label
    // c (read from row 0 where j is outside the bank: unused), and its two flags: bit 0 bad
    // (past the bank, or a non-finite distance), bit 1 a weight other than 0 and 1.
    auto entry = [=](int64_t k, I j, C w, L c) -> int {
        const bool in = (j >= 0) & (j <= last);
        const C uk = u[k];
        const C wv = in ? w : (C)0;  // 0 outside the bank: not valid
        const bool valid = wv != (C)0;
        const C l = valid ? (C)0 - uk * (C)0.5 : ninf;
        lg[k] = l;
        lpos[k] = valid & r_fits & (c == rl) ? l : ninf;
        return (int)((j > last) | (in & nonfinite_bits(uk)))
               | ((int)((wv != (C)0) & (wv != (C)1)) << 1);
    };
    auto weight = [=](I js) -> C {
        if constexpr (std::is_void<W>::value) return (C)1;
        else return (C)((const W*)wts)[js];
    };
    auto stand_in = [=](I j) -> I { return (j >= 0) & (j <= last) ? j : (I)0; };
    // The one-pass fold's groups of four entries one at a time: the buffered SIMD pass below
    // took 1.01-1.02x their time at B 256, K 100, D 512 fp32 with grad_x (2026-11-27, 10 and
    // 14 rounds).
    if (e - a <= 4) {
        for (int64_t k = a; k < e; ++k) {
            const I js = stand_in(nb[k]);
            const int f = entry(k, nb[k], weight(js), cls[js]);
            bad |= f & 1;
            odd |= f >> 1;
        }
    } else {
        constexpr int64_t CH = 64;
        C wb[CH];
        L cb[CH];
        for (int64_t b0 = a; b0 < e; b0 += CH) {
            const int64_t n = e - b0 < CH ? e - b0 : CH;
            for (int64_t t = 0; t < n; ++t) {  // the gathers (vector gathers where tuned for)
                const I js = stand_in(nb[b0 + t]);
                wb[t] = weight(js);
                cb[t] = cls[js];
            }
#pragma omp simd reduction(| : bad, odd)
            for (int64_t t = 0; t < n; ++t) {
                const int f = entry(b0 + t, nb[b0 + t], wb[t], cb[t]);
                bad |= f & 1;
                odd |= f >> 1;
            }
        }
    }
    if constexpr (!std::is_void<W>::value) {
        if (!odd) return bad;
        for (int64_t k = a; k < e; ++k) {  // the entries whose weight is not 1
            const int64_t j = (int64_t)nb[k];
            if (j < 0 || j >= n_rows) continue;
            const C w = (C)((const W*)wts)[j];
            if (w == (C)0 || w == (C)1) continue;
            const C lw = std::log(w);
            bad |= (int)!std::isfinite(lw);
            const C l = lw - u[k] * (C)0.5;
            lg[k] = l;
            lpos[k] = (int64_t)cls[j] == R ? l : ninf;
        }
    }
    return bad != 0;
}

// A batch's lists and what the kernels read through them besides the centre rows: the (B, K)
// bank indices, the rows' labels, and the centres' labels and weights, with their run-time
// types (nb64, lab64, cl64: int64 when 1, else int32; wtype: 0 none, 1 fp32, 2 fp64) and the
// bank's row count N. The forward (ForwardRow) and the backward's per-entry terms (EntryGrads)
// both read them here, so both see the same logits.
struct Lists {
    const void* nbrs;
    int nb64;
    const void* labels;
    int lab64;
    const void* clabels;
    int cl64;
    const void* weights;
    int wtype;
    int64_t N;

    int64_t index(int64_t f) const { return load_index(nbrs, nb64, f); }
    int64_t label(int64_t b) const { return load_index(labels, lab64, b); }
    int64_t centre_label(int64_t j) const { return load_index(clabels, cl64, j); }
    template <typename C>
    C weight(int64_t j) const {
        return wtype == 1 ? (C)((const float*)weights)[j]
                          : wtype == 2 ? (C)((const double*)weights)[j] : (C)1;
    }
    // 1b of the forward (list_logits_of) for entries [a, e) of the row whose entries start at
    // k0, its label R, at the run-time types.
    template <typename C>
    bool logits(int64_t k0, int64_t a, int64_t e, int64_t R, const C* u, C* lg,
                C* lpos) const {
        auto by_weight = [&](auto i_tag, auto l_tag) {
            typedef decltype(i_tag) I;
            typedef decltype(l_tag) L;
            if (wtype == 1)
                return list_logits_of<C, I, L, float>(nbrs, clabels, weights, N, k0, a, e, R,
                                                      u, lg, lpos);
            if (wtype == 2)
                return list_logits_of<C, I, L, double>(nbrs, clabels, weights, N, k0, a, e,
                                                       R, u, lg, lpos);
            return list_logits_of<C, I, L, void>(nbrs, clabels, weights, N, k0, a, e, R, u,
                                                 lg, lpos);
        };
        if (nb64)
            return cl64 ? by_weight(int64_t(), int64_t()) : by_weight(int64_t(), int32_t());
        return cl64 ? by_weight(int32_t(), int64_t()) : by_weight(int32_t(), int32_t());
    }
};

// Step 2 of a row, from its K logits (lg: every valid entry; lpos_er: the row's class, -inf
// elsewhere): the two maxima, e_j = exp(lg_j - m_all) into ea, e^R_j = exp(lpos_j - m_pos) in
// place of the same-class logits, and the two sums, as SIMD lanes over K (plain loops, each of
// which the compiler vectorises; vexp: no library call per entry). Invalid entries, and other
// classes in lpos, are -inf, so exp gives them exactly 0; a row with no valid (same-class)
// entry has that maximum -inf, its exponentials (taken against 0) 0 and its sum 0. The
// forward's loss and log-sum-exps, and the backward's probabilities e_j / s (EntryGrads), come
// from here.
template <typename C>
struct RowSums {
    C m_all, m_pos, s_all, s_pos;
};

template <typename C>
NNK_INLINE RowSums<C> row_exp_sums(int64_t K, const C* __restrict lg, C* __restrict ea,
                                   C* lpos_er) {
    const C ninf = -std::numeric_limits<C>::infinity();
    C m_all = ninf, m_pos = ninf;
#pragma omp simd reduction(max : m_all, m_pos)
    for (int64_t i = 0; i < K; ++i) {
        m_all = lg[i] > m_all ? lg[i] : m_all;
        m_pos = lpos_er[i] > m_pos ? lpos_er[i] : m_pos;
    }
    const C ma = m_all == ninf ? (C)0 : m_all, mp = m_pos == ninf ? (C)0 : m_pos;
#pragma omp simd
    for (int64_t i = 0; i < K; ++i) ea[i] = vexp(lg[i] - ma);
#pragma omp simd
    for (int64_t i = 0; i < K; ++i) lpos_er[i] = vexp(lpos_er[i] - mp);
    C s_all = 0, s_pos = 0;
#pragma omp simd reduction(+ : s_all, s_pos)
    for (int64_t i = 0; i < K; ++i) {
        s_all += ea[i];
        s_pos += lpos_er[i];
    }
    return {m_all, m_pos, s_all, s_pos};
}

// One row of the forward (see the top of the file); a copy per thread (own scratch).
template <typename C, typename T>
struct ForwardRow {
    const C* emb;
    const T* centres;
    Lists lists;
    C sigma;
    int64_t K, D;
    int store_dist;
    C *loss, *lse_all, *lse_pos, *grad_x, *dist;
    std::vector<C> logit, coef, epos, acc_pos, udist;
    std::vector<const T*> grows;
    int64_t B = 0, chunk = 1;  // rows per work item
    int64_t pf_end = 0;        // flat (b * K + k) end of this item's entries: prefetch bound

    // A work item is `chunk` consecutive rows: the prefetch stream runs on from one row's
    // last neighbours into the next row's first ones (no cold start at every row).
    void operator()(int64_t item) {
        const int64_t r0 = item * chunk, r1 = std::min(B, r0 + chunk);
        pf_end = r1 * K;
        const int64_t pf = prefetch_rows(D * (int64_t)sizeof(T));
        for (int64_t f = r0 * K; f < std::min(pf_end, r0 * K + pf); ++f) {
            int64_t jn = lists.index(f);
            if (jn >= 0 && jn < lists.N) prefetch_row(centres + jn * D, D);
        }
        for (int64_t b = r0; b < r1; ++b) row(b, pf);
    }

    // The gradient's running state of one row (the online form of step 3, see row()): the
    // running maxima and sums of the all-entries and same-class exponentials; the weighted
    // sums of (c_j - x) live in grad_x's row (all entries) and in `acc_pos` (same class).
    struct Online {
        C m, s;
    };

    // Folds n (1 to 4) entries k.., whose rows are `rows` and logits lg[k..], lp[k..] (-inf:
    // not counted), into the running sums: if an entry raises the running maximum, the sums so
    // far are rescaled by exp(old max - new max) first, then acc += e_j (c_j - x) with
    // e_j = exp(logit_j - max). The rows were just read by pass 1, so they come from L1.
    // pf: two rows whose prefetching is left to this fold (NNK_FOLD_PREFETCH), or null.
    void fold(Online& o, C* __restrict acc, const C* l, const T* const* rows, int n,
              const C* x, const T* const* pf = nullptr) {
        const C ninf = -std::numeric_limits<C>::infinity();
        C mg = ninf;
        for (int t = 0; t < n; ++t) mg = l[t] > mg ? l[t] : mg;
        if (mg == ninf) return;  // none of them counts
        if (mg > o.m) {
            if (o.m != ninf) {
                const C sc = vexp(o.m - mg);
                o.s *= sc;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) acc[d] *= sc;
            }
            o.m = mg;
        }
        C e[4];
        for (int t = 0; t < n; ++t) {
            e[t] = vexp(l[t] - o.m);  // -inf (not counted): exactly 0
            o.s += e[t];
        }
        // Four rows in one sweep of acc when all four count (the common case for the
        // all-entries sums); otherwise only the rows that do (usually one for the class).
        if (n == 4 && e[0] != (C)0 && e[1] != (C)0 && e[2] != (C)0 && e[3] != (C)0) {
            axpy_diff4(acc, rows[0], rows[1], rows[2], rows[3], x, e, D, pf);
            pf = nullptr;
        } else {
            for (int t = 0; t < n; ++t)
                if (e[t] != (C)0) axpy_diff(acc, rows[t], x, e[t], D);
        }
        if (pf) {  // the prefetches left to this fold, when it did not sweep four rows
            prefetch_row(pf[0], D);
            prefetch_row(pf[1], D);
        }
    }

    // 1b. The logits of entries [a, e) of row b (k0 = b * K): Lists::logits.
    bool logits(int64_t k0, int64_t a, int64_t e, int64_t R, const C* u, C* lg,
                C* lpos) const {
        return lists.logits<C>(k0, a, e, R, u, lg, lpos);
    }

    void row(int64_t b, int64_t pf) {
        const C inv_s = (C)1 / sigma;
        const C inv_s2 = inv_s * inv_s;
        const C ninf = -std::numeric_limits<C>::infinity();
        const C nan = std::numeric_limits<C>::quiet_NaN();
        if ((int64_t)logit.size() < K) {
            udist.resize(K);
            logit.resize(K);
            coef.resize(K);
            epos.resize(K);
        }
        const C* x = emb + b * D;
        const int64_t R = lists.label(b);
        // Members are copied to locals first: the stores below could alias them as far as the
        // compiler knows, which made it reload each one per entry.
        const void* const nbl = lists.nbrs;
        const int l64 = lists.nb64;
        const T* const bank = centres;
        const int64_t n_rows = lists.N, k0 = b * K, end = pf_end;
        C* __restrict lg = logit.data();
        C* __restrict lpos = epos.data();  // same-class logits, then e^R (step 2)
        C* const drow = store_dist ? dist + k0 : nullptr;
        C* g = grad_x ? grad_x + b * D : nullptr;  // null: the forward-only path
        C* gpos = nullptr;
        Online all{ninf, 0}, pos{ninf, 0};
        // With a gradient: one pass (fold, step 1) when the row's gathered set is too big to
        // stay in L2 until a second pass and its rows are long enough to repay the fold, else
        // a second pass over the rows (step 3), whose coefficients are computed as SIMD lanes
        // (the sizes: NNK_ONE_PASS_BYTES; short rows: NNK_ONE_PASS_MIN_ROW_BYTES). fp32 rows of
        // 4 KiB and more split their prefetches with the fold (NNK_FOLD_PREFETCH), which makes
        // one pass pay from smaller sets on.
        const bool fold_prefetch = NNK_FOLD_PREFETCH && std::is_same<T, float>::value
                                   && D * (int64_t)sizeof(T) >= NNK_FOLD_PREFETCH_MIN_ROW_BYTES;
        const int64_t one_pass_above = fold_prefetch ? NNK_ONE_PASS_PREFETCHED_BYTES
                                                     : NNK_ONE_PASS_BYTES;
        const bool one_pass = g && K * D * (int64_t)sizeof(T) > one_pass_above
                              && D * (int64_t)sizeof(T) >= NNK_ONE_PASS_MIN_ROW_BYTES;
        if (g)  // rows that return early (no valid entry, no positive) keep a zero gradient
            for (int64_t d = 0; d < D; ++d) g[d] = 0;
        if (one_pass) {
            if ((int64_t)acc_pos.size() < D) acc_pos.resize(D);
            gpos = acc_pos.data();
            for (int64_t d = 0; d < D; ++d) gpos[d] = 0;
        }
        // The K distances: dist's row when it is stored, else scratch.
        C* __restrict ub = drow ? drow : udist.data();
        bool nonfinite = false;
        // 1. Pass 1, per group of four entries (row_distances_fixed: one entry at a time):
        //    their distances u (reading the gathered centre rows once); with a gradient to
        //    compute in one pass, the group's logits (1b) and its fold into the gradient's
        //    running sums while the rows are in L1, so the rows are read once in both modes.
        //    Otherwise the K logits follow in one SIMD sweep (1b) after the distances.
        // Bytes it must move per row b: K * D * sizeof(T) (the gathered rows: the op's whole
        // cost, what bench_loss's "% of read" counts) + K * (index + label [+ weight]) + the
        // D * sizeof(C) embedding (cache-resident after the first row touches it).
        auto fold_both = [&](int64_t k, const T* const* rows, int n,
                             const T* const* pf = nullptr) {
            nonfinite |= logits(k0, k, k + n, R, ub, lg, lpos);
            fold(all, g, lg + k, rows, n, x, pf);
            fold(pos, gpos, lpos + k, rows, n, x);
        };
        auto ahead = [&](int64_t k) -> const T* {  // the row pf entries ahead, or null
            const int64_t f = k0 + k + pf;
            if (pf <= 0 || f >= end) return nullptr;
            const int64_t jn = load_index(nbl, l64, f);
            return jn >= 0 && jn < n_rows ? bank + jn * D : nullptr;
        };
        auto single = [&](int64_t k, int64_t j) {
            if (const T* r = ahead(k)) prefetch_row(r, D);
            // Padding stores distance 0, an index past the bank NaN (its logit is -inf and
            // it poisons the row: 1b); neither row is read, nor folded (logit -inf).
            const bool in = j >= 0 && j < n_rows;
            const T* r = in ? bank + j * D : nullptr;
            ub[k] = in ? scaled_sqdist(r, x, inv_s, D) : (j < 0 ? (C)0 : nan);
            if (one_pass) fold_both(k, &r, 1);
        };
        int64_t k = 0;
        // Small fp32 / bf16 / fp16 rows without a fold: one entry at a time
        // (row_distances_fixed; fp16 since 2026-11-27: with grad_x at one thread 1.14x faster
        // at B 1024, K 32, D 128, 1.07x at K 1000, D 64, 1.06x at K 100, D 256; forward
        // 1.12-1.17x; the bf16 calls unchanged; 5 rounds, ad hoc).
        constexpr bool fixed = !std::is_same<T, double>::value;  // fp32, bf16, fp16
        if (fixed && !one_pass && (D == 128 || D == 64 || D == 256)
            && D * (int64_t)sizeof(T) <= NNK_FIXED_ROW_BYTES) {
            if (D == 256)
                row_distances_fixed<256>(bank, n_rows, nbl, l64, k0, K, end, pf, x, inv_s, ub);
            else if (D == 128)
                row_distances_fixed<128>(bank, n_rows, nbl, l64, k0, K, end, pf, x, inv_s, ub);
            else
                row_distances_fixed<64>(bank, n_rows, nbl, l64, k0, K, end, pf, x, inv_s, ub);
            k = K;
        }
        // Otherwise four consecutive entries that all gather a row go through scaled_sqdist4
        // (same bits as one at a time), which streams them together and prefetches the group
        // pf entries ahead while it computes (past the item's end, the current rows stand in).
        for (; k + 4 <= K; k += 4) {
            int64_t j[4];
            bool every = true;
            for (int t = 0; t < 4; ++t) {
                j[t] = load_index(nbl, l64, k0 + k + t);
                every &= j[t] >= 0 && j[t] < n_rows;
            }
            if (!every) {
                for (int t = 0; t < 4; ++t) single(k + t, j[t]);
                continue;
            }
            const T* rows[4];
            const T* fut[4];
            for (int t = 0; t < 4; ++t) {
                rows[t] = bank + j[t] * D;
                const T* a = ahead(k + t);
                fut[t] = a ? a : rows[t];
            }
            // With a fold (NNK_FOLD_PREFETCH), two of the four future rows are prefetched by
            // the distance sweep (each named twice: its two slots request the same lines) and
            // two by the fold's, so that requests to memory go on during the fold. One call
            // of scaled_sqdist4 either way: a second call site let GCC stop inlining it
            // (tests/test_cpu_kernel_codegen.py reads the loop inside row()).
            const bool split = one_pass && fold_prefetch;
            const T* const fa[4] = {fut[0], fut[1], split ? fut[0] : fut[2],
                                    split ? fut[1] : fut[3]};
            scaled_sqdist4(rows[0], rows[1], rows[2], rows[3], x, inv_s, D, ub + k, fa);
            if (one_pass) fold_both(k, rows, 4, split ? fut + 2 : nullptr);
        }
        for (; k < K; ++k) single(k, load_index(nbl, l64, k0 + k));
        if (!one_pass) nonfinite |= logits(k0, 0, K, R, ub, lg, lpos);
        if (nonfinite) {
            loss[b] = lse_all[b] = lse_pos[b] = nan;
            if (g)
                for (int64_t d = 0; d < D; ++d) g[d] = nan;
            return;
        }
        // 2. The two maxima, the exponentials (e_j into coef, e^R_j into epos over the
        //    same-class logits) and the two sums (row_exp_sums). The loss and the log-sum-exps
        //    come from these, never from the running sums of step 1, so they are bit for bit
        //    the same with and without a gradient (CONTRACT.md 8).
        C* __restrict ea = coef.data();
        C* const er = epos.data();
        const RowSums<C> rs = row_exp_sums<C>(K, lg, ea, er);
        const C m_all = rs.m_all, m_pos = rs.m_pos, s_all = rs.s_all, s_pos = rs.s_pos;
        if (m_all == ninf) {  // no valid entry (all padding / zero weight, or N = 0): g = 0
            loss[b] = 0;
            lse_all[b] = lse_pos[b] = ninf;
            return;
        }
        const C la = m_all + std::log(s_all);
        lse_all[b] = la;
        if (m_pos == ninf) {  // no same-class entry: zero loss and gradient
            loss[b] = 0;
            lse_pos[b] = ninf;
            if (g)
                for (int64_t d = 0; d < D; ++d) g[d] = 0;
            return;
        }
        const C lp = m_pos + std::log(s_pos);
        lse_pos[b] = lp;
        loss[b] = la - lp;
        if (!g) return;  // forward only: no gradient terms
        // 3. grad_x = (1/sigma^2) sum_j (p_j - p^R_j)(c_j - x) with p_j = e_j / s_all and
        //    p^R_j = e^R_j / s_pos normalised by the computed sums (CONTRACT.md 5).
        if (one_pass) {
            // The running sums of step 1 hold sum_j e_j (c_j - x) and s_all (all entries),
            // and the same for the class, each relative to its own final maximum (rescaled
            // whenever the maximum rose: the online log-sum-exp of the Triton kernel).
            const C sa = all.s, sp = pos.s;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) g[d] = (g[d] / sa - gpos[d] / sp) * inv_s2;
            return;
        }
        // Two passes: the coefficients as SIMD lanes, then the rows again, from L1 or L2 (the
        // row's gathered set is at most NNK_ONE_PASS_BYTES, or its rows are short), skipping rows
        // with a zero coefficient: a block of g's columns in registers at a time (grad_pass).
#pragma omp simd
        for (int64_t i = 0; i < K; ++i) ea[i] = (ea[i] / s_all - er[i] / s_pos) * inv_s2;
        if ((int64_t)grows.size() < K) grows.resize(K);
        grad_pass(g, bank, nbl, l64, k0, K, ea, grows.data(), x, D);
    }
};

template <typename C, typename T>
void forward_impl(const C* emb, const void* labels, int lab64, const T* centres,
                  const void* clabels, int cl64, const void* nbrs, int nb64, const void* weights, int wtype,
                  C sigma, int64_t B, int64_t K, int64_t D, int64_t N, int store_dist,
                  C* loss, C* lse_all, C* lse_pos, C* grad_x, C* dist, int nthreads) {
    // rows per work item: up to 16, and at least 8 items per thread (load balance)
    const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(
        16, B / (8 * (int64_t)std::max(1, nthreads))));
    ForwardRow<C, T> row{emb, centres,
                         Lists{nbrs, nb64, labels, lab64, clabels, cl64, weights, wtype, N},
                         sigma, K, D, store_dist, loss, lse_all, lse_pos, grad_x, dist,
                         {}, {}, {}, {}, {}, {}, B, chunk, 0};
    run_items((B + chunk - 1) / chunk, nthreads, row);
}

// Centre gradient: a work item is a range of bank rows; its thread scans every (b, k) and adds
// the entries that fall in its range, whole rows at a time (contiguous, prefetch-friendly). No
// two threads write the same row, and each row is accumulated in (b, k) order whatever the
// thread count, so the result is deterministic. g += a (x - c) is computed as
// g += (-a)(c - x), which is the same number.
template <typename C, typename T>
void centre_grad_impl(const C* emb, const T* centres, const void* nbrs, int nb64,
                      const C* coef, int64_t B, int64_t K, int64_t D, int64_t N, C* grad,
                      int nthreads) {
    const int64_t ranges = std::min<int64_t>(N, 4 * (int64_t)std::max(1, nthreads));
    auto range = [=](int64_t r) {
        const int64_t lo = N * r / ranges, hi = N * (r + 1) / ranges;
        for (int64_t i = 0; i < B * K; ++i) {
            const C a = coef[i];
            if (a == (C)0) continue;
            const int64_t j = load_index(nbrs, nb64, i);
            if (j < lo || j >= hi) continue;
            axpy_diff(grad + j * D, centres + j * D, emb + (i / K) * D, -a, D);
        }
    };
    run_items(ranges, nthreads, range);
}

// out[b, :] = g[b] * grad_x[b, :] (the backward's only (B, D) operation), rows shared out
// like the forward's; g is read with stride gs (0: one value for every row, the gradient of a
// reduced loss as autograd hands it over). A row takes no gradient, and passes none on (NaN or
// not), where g[b] == 0 or, when lse_pos is given, where lse_pos[b] == -inf (no same-class
// neighbour): the backward's row rule in the same pass, with no (B,) mask built first.
template <typename C>
void scale_rows_impl(const C* grad_x, const C* g, int64_t gs, const C* lse_pos, int64_t B,
                     int64_t D, C* out, int nthreads) {
    auto row = [=](int64_t b) {
        const bool counted = !lse_pos || lse_pos[b] != -std::numeric_limits<C>::infinity();
        const C a = counted ? g[b * gs] : C(0);
        const C* __restrict src = grad_x + b * D;
        C* __restrict dst = out + b * D;
        if (a == C(0)) {
            for (int64_t d = 0; d < D; ++d) dst[d] = C(0);
            return;
        }
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) dst[d] = a * src[d];
    };
    run_items(B, nthreads, row);
}

// The backward's per-entry terms for the centre, weight and sigma gradients (the CPU backend's;
// nnkloss/ops/neighbour_kernel.py _backward holds the torch form, which every other backend
// runs), from the forward's saved distances u (B, K) and log-sum-exps. For row b with incoming
// gradient g_b (read with stride gs: 0 for a reduced loss's expanded scalar):
//   p_j, p^R_j: the row's softmax over its valid / same-class logits (Lists::logits; -inf: 0)
//   dl_j = (p_j - p^R_j) g_b
//   coef[b, j] = dl_j / sigma^2      (the centre gradient's coefficients, centre_grad_impl)
//   q[b, j]    = dl_j / w_j, or at a zero weight its one-sided derivative times g_b:
//                -exp(-u_j/2 - lse_pos + log(1 - exp(lse_pos - lse_all))) for the row's class,
//                exp(-u_j/2 - lse_all) for the others; 0 for padding
//   srow[b]    = sum_j dl_j (u_j - u_ref) over the valid entries, u_ref the distance of the
//                largest logit's entry (sum_j dl_j = 0: huge distances no longer cancel)
// The torch form's row rules: a row with no same-class entry (lse_pos -inf) or g_b == 0 takes
// no gradient and passes none on, NaN or not (zeros); a non-finite row (lse_pos NaN) that takes
// one gives NaN to every entry (q: to its non-padding entries) and to srow.
// p is e_j / s with e_j = exp(logit_j - row max) and s their sum, as in the forward and the
// torch form's row softmax, not exp(logit - lse): far from every centre (distances ~1e3,
// sigma 10, fp32) lse's rounding scales every p alike, and the centre gradient, a sum of
// (p_j - p^R_j)(x - c_j) whose terms cancel, came out 2% off (tests/test_numerics.py). The
// exponentials run as SIMD lanes (vexp). Bytes per row: K * (u + index + label [+ weight])
// read, up to 2 K written.
template <typename C>
struct EntryGrads {
    const C* u;
    Lists lists;
    const C *lse_all, *lse_pos, *g;
    int64_t gs, K;
    C inv_s2;
    C *coef, *q, *srow;
    std::vector<C> lg, lpos, dl;

    void operator()(int64_t b) {
        const C ninf = -std::numeric_limits<C>::infinity();
        const C nan = std::numeric_limits<C>::quiet_NaN();
        if ((int64_t)lg.size() < K) {
            lg.resize(K);
            lpos.resize(K);
            dl.resize(K);
        }
        const int64_t k0 = b * K;
        const C la = lse_all[b], lp = lse_pos[b];
        const C gb = lp != ninf ? g[b * gs] : (C)0;
        C* const cr = coef ? coef + k0 : nullptr;
        C* const qr = q ? q + k0 : nullptr;
        // 1. The rows that take no gradient, and the non-finite rows that do.
        if (gb == (C)0 || lp != lp) {
            const bool none = gb == (C)0;
            for (int64_t k = 0; k < K; ++k) {
                if (cr) cr[k] = none ? (C)0 : nan;
                if (qr) qr[k] = none || lists.index(k0 + k) < 0 ? (C)0 : nan;
            }
            if (srow) srow[b] = none ? (C)0 : nan;
            return;
        }
        // 2. The logits (the forward's), then dl_j as SIMD lanes.
        const int64_t R = lists.label(b);
        C* __restrict l = lg.data();
        C* __restrict lr = lpos.data();
        C* __restrict d = dl.data();
        const C* __restrict ur = u + k0;
        lists.logits<C>(k0, 0, K, R, ur, l, lr);
        const RowSums<C> rs = row_exp_sums<C>(K, l, d, lr);
        const C s_all = rs.s_all, s_pos = rs.s_pos;
#pragma omp simd
        for (int64_t k = 0; k < K; ++k) d[k] = (d[k] / s_all - lr[k] / s_pos) * gb;
        // 3. The outputs each gradient asked for.
        if (cr) {
#pragma omp simd
            for (int64_t k = 0; k < K; ++k) cr[k] = d[k] * inv_s2;
        }
        if (srow) {
            int64_t ref = -1;  // the first largest logit, as torch's argmax
            for (int64_t k = 0; k < K; ++k)
                if (l[k] != ninf && (ref < 0 || l[k] > l[ref])) ref = k;
            C acc = 0;
            if (ref >= 0) {
                const C uref = ur[ref];
                for (int64_t k = 0; k < K; ++k)
                    if (l[k] != ninf) acc += d[k] * (ur[k] - uref);
            }
            srow[b] = acc;
        }
        if (qr) {
            for (int64_t k = 0; k < K; ++k) {
                const int64_t j = lists.index(k0 + k);
                if (j < 0 || j >= lists.N) {  // padding (an index past the bank made the row NaN)
                    qr[k] = 0;
                    continue;
                }
                const C w = lists.weight<C>(j);
                if (w != (C)0) {
                    qr[k] = d[k] / w;
                    continue;
                }
                const C base = ur[k] * (C)-0.5;
                const bool same = lists.centre_label(j) == R;
                qr[k] = (same ? -std::exp(base - lp + std::log(-std::expm1(lp - la)))
                              : std::exp(base - la)) * gb;
            }
        }
    }
};

// One query's classifier distances (rel_sqdist_impl, step 2): o[j] for the K rows row[j] of
// the bank, the reference row r and x_q. DC > 0 is D known at compile time (fp32 / bf16 rows
// of 64, 128 or 256 elements, at most NNK_FIXED_ROW_BYTES long): the element loop unrolls
// whole and the ragged ends compile away; DC = 0 reads D at run time. The same operations per
// element and the same tree per row either way, so the same bits. Rows four at a time: four
// independent sums in flight (the same bits as one at a time); the rows pf entries ahead
// prefetched. Four at a time against one at a time, at run-time D, on the 2-core AMD EPYC
// (2026-11-26, the builds alternating in one process, 7 calls each, twice): 1.43x and 1.48x
// at Q 2000, k 1000, D 64; 1.07x and 1.29x at Q 8192, k 100, D 128; 1.04x and 1.07x at Q 512,
// k 256, D 512. (Items of ~4,096 entries, carrying the prefetch stream across queries, added
// nothing to it: 0.95-1.03x.) The compile-time D against the run-time D on the 2-core AMD EPYC
// family 26 (AVX-512; 2026-11-27, benchmarks/cpu_variants.py --classifier --against 3d371d2,
// 5 rounds, at b9f2fef, log benchmarks/results/cpu_variants_AMD_EPYC_family_26_model_2.txt):
// 1.40x at Q 2000, k 1000, D 64, 1.13x at D 128, 1.01x at D 512 (not affected), bit-equal; in
// ad hoc A/Bs before it 1.08x at D 256, 1.21x with bf16 rows of D 64, and built without
// AVX-512 1.15x and 1.05x at D 64 and 128. The run-time D's loop had reloaded r and x_q at
// every step of every group. One row at a time at the compile-time D was 1.23x and 1.06x;
// eight rows at a time at the run-time D 1.02-1.04x; neither kept.
template <int64_t DC, typename C, typename T>
__attribute__((noinline)) void rel_sqdist_rows(const C* __restrict xq, const T* __restrict r,
                                               const T* centres, const int64_t* row,
                                               int64_t K, int64_t D, int64_t pf,
                                               C* __restrict o) {
    typedef Lanes<C> V;
    const int64_t Dn = DC > 0 ? DC : D;
    // One row's entry: (c - r) . ((c + r) - (x + x)), the lanes summed as a tree.
    auto one = [&](const T* __restrict c) {
        V acc = {};
        int64_t d = 0;
        for (; d + ACC <= Dn; d += ACC) {
            const V cv = load_lanes<C>(c + d), rv = load_lanes<C>(r + d);
            const V xv = load_lanes<C>(xq + d);
            acc += (cv - rv) * ((cv + rv) - (xv + xv));
        }
        C tail = 0;
        if (DC == 0 || DC % ACC != 0) {  // a compile-time D of whole lanes has no tail (said
            for (; d < Dn; ++d) {        // outright: GCC 12 warned of the dead loop's bounds)
                const C cd = load<C>(c, d), rd = load<C>(r, d);
                tail += (cd - rd) * ((cd + rd) - (xq[d] + xq[d]));
            }
        }
        return tree_sum(acc) + tail;
    };
    int64_t j = 0;
    for (; j + 4 <= K; j += 4) {
        for (int t = 0; t < 4; ++t)
            if (j + t + pf < K) prefetch_row(centres + row[j + t + pf] * Dn, Dn);
        const T* __restrict c0 = centres + row[j] * Dn;
        const T* __restrict c1 = centres + row[j + 1] * Dn;
        const T* __restrict c2 = centres + row[j + 2] * Dn;
        const T* __restrict c3 = centres + row[j + 3] * Dn;
        V a0 = {}, a1 = {}, a2 = {}, a3 = {};
        int64_t d = 0;
        for (; d + ACC <= Dn; d += ACC) {
            const V rv = load_lanes<C>(r + d), xv = load_lanes<C>(xq + d);
            const V x2 = xv + xv;
            const V v0 = load_lanes<C>(c0 + d), v1 = load_lanes<C>(c1 + d);
            const V v2 = load_lanes<C>(c2 + d), v3 = load_lanes<C>(c3 + d);
            a0 += (v0 - rv) * ((v0 + rv) - x2);
            a1 += (v1 - rv) * ((v1 + rv) - x2);
            a2 += (v2 - rv) * ((v2 + rv) - x2);
            a3 += (v3 - rv) * ((v3 + rv) - x2);
        }
        C t0 = 0, t1 = 0, t2 = 0, t3 = 0;
        if (DC == 0 || DC % ACC != 0) {  // no tail at a whole-lane DC (as in `one`)
            for (; d < Dn; ++d) {
                const C rd = load<C>(r, d), x2d = xq[d] + xq[d];
                const C e0 = load<C>(c0, d), e1 = load<C>(c1, d);
                const C e2 = load<C>(c2, d), e3 = load<C>(c3, d);
                t0 += (e0 - rd) * ((e0 + rd) - x2d);
                t1 += (e1 - rd) * ((e1 + rd) - x2d);
                t2 += (e2 - rd) * ((e2 + rd) - x2d);
                t3 += (e3 - rd) * ((e3 + rd) - x2d);
            }
        }
        o[j] = tree_sum(a0) + t0;
        o[j + 1] = tree_sum(a1) + t1;
        o[j + 2] = tree_sum(a2) + t2;
        o[j + 3] = tree_sum(a3) + t3;
    }
    for (; j < K; ++j) {
        if (j + pf < K) prefetch_row(centres + row[j + pf] * Dn, Dn);
        o[j] = one(centres + row[j] * Dn);
    }
}

// The classifier's distances (nnkloss/evaluation/classifier.py, _sq_dist_minus_ref):
// out[q, j] = ||x_q - c_i||^2 - ||x_q - c_r||^2 for i = idx[q, j], r = ref[q], in the product
// form (c_i - c_r) . ((c_i + c_r) - 2 x_q), which keeps their difference to full relative
// precision for a query far from every centre (the operations of the torch form, per element;
// the sum in lanes). One pass over the gathered rows, the next rows prefetched, no (Q, K, D)
// intermediate. Returns 3 if an index is outside [0, N) (nothing is read through it).
// Bytes it must move per query: K * D * sizeof(T) (the gathered rows) + the reference row and
// x_q (D elements each) + K indices and K outputs.
template <typename C, typename T>
int rel_sqdist_impl(const C* x, const T* centres, int64_t N, const int64_t* idx,
                    const int64_t* ref, int64_t Q, int64_t K, int64_t D, C* out,
                    int nthreads) {
    const int64_t pf = prefetch_rows(D * (int64_t)sizeof(T));
    constexpr bool fixed_type = std::is_same<T, float>::value || std::is_same<T, bf16>::value;
    const int64_t fixed_d = fixed_type && (D == 64 || D == 128 || D == 256)
                            && D * (int64_t)sizeof(T) <= NNK_FIXED_ROW_BYTES ? D : 0;
    std::atomic<int> bad{0};
    auto query = [=, &bad](int64_t q) {
        const int64_t* row = idx + q * K;
        // 1. This query's indices, checked where they are read (nothing is read through a bad
        //    one; the caller raises, out is left partly written).
        bool ok = ref[q] >= 0 && ref[q] < N;
        for (int64_t j = 0; j < K; ++j) ok &= row[j] >= 0 && row[j] < N;
        if (!ok) {
            bad.store(1, std::memory_order_relaxed);
            return;
        }
        // 2. The rows (rel_sqdist_rows), at a compile-time D where it is one of the fixed ones.
        const C* xq = x + q * D;
        const T* r = centres + ref[q] * D;
        C* o = out + q * K;
        if (fixed_d == 64)
            rel_sqdist_rows<64>(xq, r, centres, row, K, D, pf, o);
        else if (fixed_d == 128)
            rel_sqdist_rows<128>(xq, r, centres, row, K, D, pf, o);
        else if (fixed_d == 256)
            rel_sqdist_rows<256>(xq, r, centres, row, K, D, pf, o);
        else
            rel_sqdist_rows<0>(xq, r, centres, row, K, D, pf, o);
    };
    run_items(Q, nthreads, query);
    return bad.load() ? 3 : 0;
}

// A batch's lists in one pass: the CPU twin of kernels/batch_lists.py, with its contract
// (losses/base.BankLoss's lists of a batch; CentreBank.neighbours_for with labels null).
// out[b, :] = table[idx[b], :], the entries equal to idx[b] (the row's own centre) set to -1
// (padding) when exclude_self. A row whose idx is outside [0, N), or, labels given, whose label
// is not its bank row's (clabels[idx[b]] != labels[b]), is dropped: its list all -1, nothing
// of the table read for it. counts[0] = rows dropped, counts[1] = those of them outside
// [0, N). I: the table's index type; idx, labels and clabels int32 or int64 (the *64 flags).
// One pass in place of two (the gather with its exclusion, then the label count), and the
// CPU's lists take the GPU's route and contract. Not measurably faster in a module's call: on
// caches the forward's kernel has swept, this pass took 54-63 us at B 1024, K 33 (the table's
// rows are cache and TLB misses; prefetching 16 rows ahead gained nothing), a call of 8 rows
// 12 us (2-core Intel Xeon, 2026-11-28).
template <typename I>
int64_t batch_lists_impl(const I* table, int64_t N, int64_t K, const void* idx, int idx64,
                      const void* labels, int lab64, const void* clabels, int cl64, int64_t B,
                      int exclude_self, I* out, int64_t* counts) {
    int64_t dropped = 0, outside = 0;
    for (int64_t b = 0; b < B; ++b) {
        const int64_t r = load_index(idx, idx64, b);
        I* __restrict dst = out + b * K;
        const bool in_bank = r >= 0 && r < N;
        if (!in_bank ||
            (labels != nullptr && load_index(clabels, cl64, r) != load_index(labels, lab64, b))) {
            std::fill(dst, dst + K, (I)-1);
            ++dropped;
            outside += !in_bank;
            continue;
        }
        const I* __restrict src = table + r * K;
        if (!exclude_self) {
            std::memcpy(dst, src, (size_t)K * sizeof(I));
            continue;
        }
        const I own = (I)r;
#pragma omp simd
        for (int64_t k = 0; k < K; ++k) dst[k] = src[k] == own ? (I)-1 : src[k];
    }
    counts[0] = dropped;
    counts[1] = outside;
    return dropped;
}

// The losses' mean over their counted rows (ops/neighbour_kernel.reduce_rows, "mean"):
// *mean = sum of the B per-row losses / *divisor, *divisor = max(count, 1), count the rows
// whose flag is set; both in the rows' type T. The sum runs in double over eight lanes in a
// fixed order (the same bits on every run), then is rounded to T and divided in T, as torch's
// form divides its sum by the count. A NaN or inf row reaches the mean. One call in place of
// torch's sum, count_nonzero, clamp_min and div: after the forward's kernel has swept the
// caches, the counted mask and those four took 41-44 us of a forward-only call at B 1024,
// the mask and this call 25 (2-core Intel Xeon, 2026-11-27).
template <class T>
void counted_mean_impl(const T* rows, const uint8_t* counted, int64_t B, T* mean,
                       T* divisor) {
    double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t b = 0;
    for (; b + 8 <= B; b += 8)
        for (int l = 0; l < 8; ++l) lane[l] += (double)rows[b + l];
    for (int l = 0; b < B; ++b, ++l) lane[l] += (double)rows[b];
    int64_t count = 0;
    for (int64_t i = 0; i < B; ++i) count += counted[i] != 0;
    const double total = ((lane[0] + lane[1]) + (lane[2] + lane[3])) +
                         ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    const T d = (T)(count > 0 ? count : 1);
    *mean = (T)total / d;
    *divisor = d;
}

// Whether each of the N lists holds a centre of its own row's label (bank/search/lists.py,
// has_same_label): out[i] = 1 when some entry j >= 0 of row i has clabels[j] == clabels[i].
// A row is read only up to its first such entry, which in a list sorted nearest first is
// usually the first: about N label reads instead of the N x K gather of torch's form (0.32 s
// at N 20,000, K 1000). Every entry read is checked: 3 when one is outside [-1, N).
int has_same_label_impl(const void* nbrs, int nb64, int64_t N, int64_t K, const void* clabels,
                        int cl64, uint8_t* out) {
    for (int64_t i = 0; i < N; ++i) {
        const int64_t own = load_index(clabels, cl64, i);
        uint8_t found = 0;
        for (int64_t k = 0; k < K; ++k) {
            const int64_t j = load_index(nbrs, nb64, i * K + k);
            if (j < -1 || j >= N) return 3;
            if (j >= 0 && load_index(clabels, cl64, j) == own) {
                found = 1;
                break;
            }
        }
        out[i] = found;
    }
    return 0;
}

// How many entries of each new list its old list also holds (bank/refresh.py, a refresh's
// overlap statistic): out[i] = #{k : nw[i, k] >= 0 and nw[i, k] is some old[i, k']}, each
// occurrence of a repeated new entry counted, and valid[i] = #{k : nw[i, k] >= 0} (the
// statistic's denominator, in the same read). Per row, the old entries' bits are set in a
// bitmap of M bits (M: the rows the lists index), the new entries tested, the bits cleared:
// O(K) a row, where torch's form sorts every old list and binary-searches every new entry
// (2.2 s at N 20,000, K 1000, one thread, 2026-11-27). 3 when an entry is outside [-1, M),
// 2 when M < 0, 4 when the bitmap cannot be allocated: an exception must not cross the C
// interface (it would terminate the process; a negative M had cast to a huge size_t).
int list_overlap_impl(const void* nw, int nw64, int64_t kn, const void* old, int old64,
                      int64_t ko, int64_t rows, int64_t M, int64_t* out, int64_t* valid) {
    if (M < 0) return 2;
    std::vector<uint64_t> bits;
    try {
        bits.assign((size_t)(M / 64 + 1), 0);
    } catch (const std::exception&) {
        return 4;
    }
    uint64_t* const b = bits.data();
    for (int64_t i = 0; i < rows; ++i) {
        for (int64_t k = 0; k < ko; ++k) {
            const int64_t j = load_index(old, old64, i * ko + k);
            if (j < -1 || j >= M) return 3;
            if (j >= 0) b[j >> 6] |= (uint64_t)1 << (j & 63);
        }
        int64_t shared = 0, listed = 0;
        for (int64_t k = 0; k < kn; ++k) {
            const int64_t j = load_index(nw, nw64, i * kn + k);
            if (j < -1 || j >= M) return 3;
            if (j >= 0) {
                shared += (int64_t)((b[j >> 6] >> (j & 63)) & 1);
                ++listed;
            }
        }
        out[i] = shared;
        valid[i] = listed;
        for (int64_t k = 0; k < ko; ++k) {
            const int64_t j = load_index(old, old64, i * ko + k);
            if (j >= 0) b[j >> 6] = 0;
        }
    }
    return 0;
}

// The op's value checks on CPU tensors (nnkloss/validation.check_values), each array read
// once by one thread, in one call instead of a dozen torch reductions and comparisons (their
// dispatch, not their reads, was most of a checked call's extra cost at B 1024, K 32, D 128).
// Non-finite is an all-ones exponent, tested on the bits so that bf16 / fp16 need no
// conversion; a weight is bad when it is negative, NaN or infinite.
template <typename I>
void index_range(const I* __restrict p, int64_t n, int64_t* lo, int64_t* hi) {
    I a = std::numeric_limits<I>::max(), b = std::numeric_limits<I>::min();
#pragma omp simd reduction(min : a) reduction(max : b)
    for (int64_t i = 0; i < n; ++i) {
        a = p[i] < a ? p[i] : a;
        b = p[i] > b ? p[i] : b;
    }
    *lo = (int64_t)a;
    *hi = (int64_t)b;
}

// A float type's bits: the unsigned integer of its width, its sign bit and its exponent field.
template <typename T> struct FloatBits;
template <> struct FloatBits<float> {
    typedef uint32_t U;
    static constexpr U sign = 0x80000000u, exponent = 0x7f800000u;
};
template <> struct FloatBits<double> {
    typedef uint64_t U;
    static constexpr U sign = 0x8000000000000000ull, exponent = 0x7ff0000000000000ull;
};
template <> struct FloatBits<bf16> {
    typedef uint16_t U;
    static constexpr U sign = 0x8000u, exponent = 0x7f80u;
};
template <> struct FloatBits<fp16> {
    typedef uint16_t U;
    static constexpr U sign = 0x8000u, exponent = 0x7c00u;
};

// 1 when one of the n values of type T is NaN or infinite (an all-ones exponent) or, with
// `negative`, negative (a set sign on a nonzero value: -0.0 is a zero, allowed).
template <typename T>
int any_bad_value(const void* p, int64_t n, bool negative) {
    typedef typename FloatBits<T>::U U;
    const U* __restrict q = (const U*)p;
    const U m = FloatBits<T>::exponent, s = negative ? FloatBits<T>::sign : U(0);
    int bad = 0;
#pragma omp simd reduction(| : bad)
    for (int64_t i = 0; i < n; ++i)
        bad |= (int)(((q[i] & m) == m) | (((q[i] & s) != 0) & ((q[i] & (U)~s) != 0)));
    return bad;
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

// XOR of a row's bytes from `o` to its end (`e`), beyond its whole lines: its 8-byte words, then
// its last bytes one at a time (rows whose size is not a multiple of 64).
inline uint64_t xor_rest(const char* r, int64_t o, int64_t e) {
    uint64_t x = 0;
    for (; o + 8 <= e; o += 8) {
        uint64_t v;
        std::memcpy(&v, r + o, 8);
        x ^= v;
    }
    for (; o < e; ++o) x ^= (uint64_t)(unsigned char)r[o];
    return x;
}

// The gather limit of a machine, for the benchmarks (benchmarks/common.gather_gbps): reads the
// bank rows that n list entries name (-1: padding, skipped), in the lists' order, as the
// forward's groups of four read them (scaled_sqdist4: four rows streamed at once, a line of each
// of the four rows NNK_PREFETCH_BYTES ahead prefetched per line read), and computes nothing but
// an XOR of the rows' 8-byte words (returned, so that the reads stay). Bytes read per second is
// what the machine gives a random row gather of that shape, where the bank lives, without the
// op's arithmetic. Entries are shared out in items of 512; the XOR does not depend on the
// thread count. Measured against the same loop written in C in one process (2-core AMD EPYC,
// 2026-11-25): equal at D 128, 512 and 2048 on one and two threads; copying each line into a
// local array first (through the stack) had made it 1.4-2x slower.
template <typename I>
uint64_t gather_read_items(const char* bank, int64_t n_rows, int64_t row_bytes, const I* nb,
                           int64_t n, int nthreads) {
    const int64_t per = 512, items = (n + per - 1) / per;
    std::vector<uint64_t> part(std::max<int64_t>(items, 1), 0);
    const int64_t pf = prefetch_rows(row_bytes);
    uint64_t* const out = part.data();
    auto work = [bank, n_rows, row_bytes, nb, n, pf, out](int64_t it) {
        const int64_t a = it * per, e = std::min(n, a + per);
        auto row_at = [&](int64_t f, int64_t end) -> const char* {  // null: padding, or past end
            if (f >= end) return nullptr;
            const int64_t j = (int64_t)nb[f];
            return j >= 0 && j < n_rows ? bank + j * row_bytes : nullptr;
        };
        uint64_t acc = 0;
        for (int64_t f = a; f < e; f += 4) {
            // the rows pf entries ahead, the next item's too (its thread may be this one)
            const char* rows[4];
            const char* fut[4];
            for (int t = 0; t < 4; ++t) {
                rows[t] = row_at(f + t, e);
                fut[t] = row_at(f + t + pf, n);
            }
            int64_t o = 0;
            for (; o + 64 <= row_bytes; o += 64) {  // whole lines, a line of each row in turn
#pragma GCC unroll 4
                for (int t = 0; t < 4; ++t) {
                    if (fut[t]) __builtin_prefetch(fut[t] + o, 0, NNK_PREFETCH_LOCALITY);
                    if (!rows[t]) continue;
#pragma GCC unroll 8
                    for (int w = 0; w < 64; w += 8) {  // 8-byte loads straight from the row
                        uint64_t v;
                        std::memcpy(&v, rows[t] + o + w, 8);
                        acc ^= v;
                    }
                }
            }
            if (o < row_bytes) {
                for (int t = 0; t < 4; ++t) {
                    if (fut[t]) __builtin_prefetch(fut[t] + o, 0, NNK_PREFETCH_LOCALITY);
                    if (rows[t]) acc ^= xor_rest(rows[t], o, row_bytes);
                }
            }
        }
        out[it] = acc;
    };
    run_items(items, nthreads, work);
    uint64_t all = 0;
    for (int64_t it = 0; it < items; ++it) all ^= part[it];
    return all;
}

// Whether every bank row that the n list entries name is finite (validation's read of the
// gathered centres: the CCML loss's check before it, the op's explanation of a NaN row): each
// listed row tested with any_bad_value, the rows pf entries ahead prefetched. Padding (-1)
// and entries outside [0, N) are not rows: skipped, nothing is read through them (the value
// checks refuse such an index themselves, naming it). 0: all finite, 1: a NaN or inf. Items
// of 512 entries over the threads; one pass, no gathered copy (torch's form wrote 16-MiB
// blocks of rows).
template <typename T, typename I>
int gathered_finite_items(const char* bank, int64_t N, int64_t D, const I* nb, int64_t n,
                          int nthreads) {
    const int64_t per = 512, items = (n + per - 1) / per;
    const int64_t row_bytes = D * (int64_t)sizeof(T);
    const int64_t pf = prefetch_rows(row_bytes);
    std::atomic<int> result{0};
    auto work = [=, &result](int64_t it) {
        const int64_t a = it * per, e = std::min(n, a + per);
        int bad = 0;
        for (int64_t f = a; f < e; ++f) {
            if (f + pf < n) {  // every line of the row pf entries ahead
                const int64_t jf = (int64_t)nb[f + pf];
                if (jf >= 0 && jf < N)
                    for (int64_t o = 0; o < row_bytes; o += 64)
                        __builtin_prefetch(bank + jf * row_bytes + o, 0, NNK_PREFETCH_LOCALITY);
            }
            const int64_t j = (int64_t)nb[f];
            if (j < 0 || j >= N) continue;
            bad |= any_bad_value<T>(bank + j * row_bytes, D, false);
        }
        if (bad) result.store(1, std::memory_order_relaxed);
    };
    run_items(items, nthreads, work);
    return result.load();
}

}  // namespace

extern "C" {

int nnk_abi_version() { return 1; }

int nnk_threaded() { return 1; }

// 1: run_items uses an OpenMP team (built with -fopenmp: torch's libgomp); 0: own std::threads.
int nnk_openmp() {
#if defined(_OPENMP) && !defined(NNK_OWN_THREADS)
    return 1;
#else
    return 0;
#endif
}

// Every entry point returns 0 on success, 1 on an unknown type code. nnk_forward with
// grad_x == NULL is the forward-only path: one pass over the gathered rows, no gradient terms.
int nnk_forward(int ctype, int btype, const void* emb, const void* labels, int lab64,
                const void* centres, const void* clabels, int cl64, const void* nbrs, int nb64,
                const void* weights, int wtype, double sigma, int64_t B, int64_t K, int64_t D,
                int64_t N, int store_dist, void* loss, void* lse_all, void* lse_pos,
                void* grad_x, void* dist, int nthreads) {
    int rc = 0;
    int known = with_compute_type(ctype, [&](auto c) {
        using C = decltype(c);
        rc = with_bank_type(btype, [&](auto t) {
            using T = decltype(t);
            forward_impl<C, T>((const C*)emb, labels, lab64, (const T*)centres, clabels, cl64,
                               nbrs, nb64, weights, wtype, (C)sigma, B, K, D, N, store_dist,
                               (C*)loss, (C*)lse_all, (C*)lse_pos, (C*)grad_x, (C*)dist,
                               nthreads);
        });
    });
    return known | rc;
}

int nnk_centre_grad(int ctype, int btype, const void* emb, const void* centres,
                    const void* nbrs, int nb64, const void* coef, int64_t B, int64_t K,
                    int64_t D, int64_t N, void* grad, int nthreads) {
    int rc = 0;
    int known = with_compute_type(ctype, [&](auto c) {
        using C = decltype(c);
        rc = with_bank_type(btype, [&](auto t) {
            using T = decltype(t);
            centre_grad_impl<C, T>((const C*)emb, (const T*)centres, nbrs, nb64,
                                   (const C*)coef, B, K, D, N, (C*)grad, nthreads);
        });
    });
    return known | rc;
}

// out (Q, K) in the compute type: the classifier's distances (rel_sqdist_impl); 3 if an index
// is outside the bank.
int nnk_rel_sqdist(int ctype, int btype, const void* x, const void* centres, int64_t N,
                   const int64_t* idx, const int64_t* ref, int64_t Q, int64_t K, int64_t D,
                   void* out, int nthreads) {
    int unknown = 0, rc = 0;
    unknown |= with_compute_type(ctype, [&](auto c) {
        using C = decltype(c);
        unknown |= with_bank_type(btype, [&](auto t) {
            using T = decltype(t);
            rc = rel_sqdist_impl<C, T>((const C*)x, (const T*)centres, N, idx, ref, Q, K, D,
                                       (C*)out, nthreads);
        });
    });
    return unknown ? 1 : rc;
}

// out[i] = the forward's exp(x[i]) (vexp), fp32: for tests of its accuracy.
int nnk_vexp(const float* x, float* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = vexp(x[i]);
    return 0;
}

// out[b, :] = g[b * gs] * grad_x[b, :], zero rows where that is 0 or lse_pos[b] is -inf
// (lse_pos may be null: g alone decides)
int nnk_scale_rows(int ctype, const void* grad_x, const void* g, int64_t gs,
                   const void* lse_pos, int64_t B, int64_t D, void* out, int nthreads) {
    return with_compute_type(ctype, [&](auto c) {
        using C = decltype(c);
        scale_rows_impl<C>((const C*)grad_x, (const C*)g, gs, (const C*)lse_pos, B, D, (C*)out,
                           nthreads);
    });
}

// The backward's per-entry terms (EntryGrads): coef, q (B, K) and srow (B,) in the compute
// type, each null when not wanted; u, lse_all, lse_pos and g (stride gs) in the compute type,
// weights fp32 (wtype 1), fp64 (2) or null (0).
int nnk_entry_grads(int ctype, const void* u, const void* nbrs, int nb64, const void* labels,
                    int lab64, const void* clabels, int cl64, const void* weights, int wtype,
                    const void* lse_all, const void* lse_pos, const void* g, int64_t gs,
                    int64_t B, int64_t K, int64_t N, double inv_s2, void* coef, void* q,
                    void* srow, int nthreads) {
    return with_compute_type(ctype, [&](auto c) {
        using C = decltype(c);
        EntryGrads<C> row{(const C*)u,
                          Lists{nbrs, nb64, labels, lab64, clabels, cl64, weights, wtype, N},
                          (const C*)lse_all, (const C*)lse_pos, (const C*)g, gs, K, (C)inv_s2,
                          (C*)coef, (C*)q, (C*)srow, {}, {}, {}};
        run_items(B, nthreads, row);
    });
}

// out (B, K) = the lists of bank rows idx (B,) from table (N, K) and counts (2,) int64
// (batch_lists_impl; labels null: no label comparison); returns counts[0], the rows dropped.
// tab64 / idx64 / lab64 / cl64: int64 (1) or int32 (0) elements.
int64_t nnk_batch_lists(const void* table, int tab64, int64_t N, int64_t K, const void* idx,
                    int idx64, const void* labels, int lab64, const void* clabels, int cl64,
                    int64_t B, int exclude_self, void* out, void* counts) {
    if (tab64)
        return batch_lists_impl((const int64_t*)table, N, K, idx, idx64, labels, lab64, clabels,
                                cl64, B, exclude_self, (int64_t*)out, (int64_t*)counts);
    return batch_lists_impl((const int32_t*)table, N, K, idx, idx64, labels, lab64, clabels,
                            cl64, B, exclude_self, (int32_t*)out, (int64_t*)counts);
}

// counted_mean_impl: fp32 (0) / fp64 (1) rows, mean and divisor; bool (one byte) flags.
int nnk_counted_mean(int ctype, const void* rows, const void* counted, int64_t B, void* mean,
                     void* divisor) {
    return with_compute_type(ctype, [&](auto c) {
        using C = decltype(c);
        counted_mean_impl<C>((const C*)rows, (const uint8_t*)counted, B, (C*)mean,
                             (C*)divisor);
    });
}

// has_same_label_impl: int32 (0) / int64 (1) lists and centre labels.
int nnk_has_same_label(const void* nbrs, int nb64, int64_t N, int64_t K, const void* clabels,
                       int cl64, void* out) {
    return has_same_label_impl(nbrs, nb64, N, K, clabels, cl64, (uint8_t*)out);
}

// list_overlap_impl: int32 (0) / int64 (1) lists, new (rows, kn) and old (rows, ko).
int nnk_list_overlap(const void* nw, int nw64, int64_t kn, const void* old, int old64,
                     int64_t ko, int64_t rows, int64_t M, void* out, void* valid) {
    return list_overlap_impl(nw, nw64, kn, old, old64, ko, rows, M, (int64_t*)out,
                             (int64_t*)valid);
}

// gather_read_items: the benchmarks' gather limit (int32 (0) / int64 (1) list entries).
uint64_t nnk_gather_read(const void* bank, int64_t N, int64_t row_bytes, const void* nbrs,
                         int nb64, int64_t n, int nthreads) {
    const char* b = (const char*)bank;
    return nb64 ? gather_read_items(b, N, row_bytes, (const int64_t*)nbrs, n, nthreads)
                : gather_read_items(b, N, row_bytes, (const int32_t*)nbrs, n, nthreads);
}

// gathered_finite_items: bank type codes as the forward's, int32 (0) / int64 (1) entries;
// 2 for an unknown bank type.
int nnk_gathered_finite(const void* bank, int btype, int64_t N, int64_t D, const void* nbrs,
                        int nb64, int64_t n, int nthreads) {
    const char* b = (const char*)bank;
    int rc = 0;
    if (with_bank_type(btype, [&](auto t) {
            using T = decltype(t);
            rc = nb64 ? gathered_finite_items<T>(b, N, D, (const int64_t*)nbrs, n, nthreads)
                      : gathered_finite_items<T>(b, N, D, (const int32_t*)nbrs, n, nthreads);
        }))
        return 2;
    return rc;
}

// The value checks (validation.check_values): out[0] / out[1] the smallest / largest of the
// n_idx list entries (unset when n_idx is 0), out[2] 1 when emb's n_emb values hold a NaN or
// inf, out[3] 1 when the n_w weights hold a negative value, NaN or inf (0 when w is null).
// Float type codes as the bank's (0 fp32, 1 fp64, 2 bf16, 3 fp16). 1 for an unknown code.
int nnk_check_values(const void* nbrs, int nb64, int64_t n_idx, const void* emb, int etype,
                     int64_t n_emb, const void* w, int wtype, int64_t n_w, int64_t* out) {
    if (n_idx > 0) {
        if (nb64) index_range((const int64_t*)nbrs, n_idx, &out[0], &out[1]);
        else index_range((const int32_t*)nbrs, n_idx, &out[0], &out[1]);
    }
    int e = 0, b = 0;
    if (with_bank_type(etype, [&](auto t) { e = any_bad_value<decltype(t)>(emb, n_emb, false); }))
        return 1;
    if (w && with_bank_type(wtype, [&](auto t) { b = any_bad_value<decltype(t)>(w, n_w, true); }))
        return 1;
    out[2] = e;
    out[3] = b;
    return 0;
}
}  // extern "C"

// ---------------------------------------------------------------------------------------------
// Exact k-nearest-neighbour selection for nnkloss/bank/search/torch_search.py (its module
// docstring is the spec). torch computes a (rows, cols) tile of fp32 squared distances by one
// GEMM of augmented rows; nnk_knn_select folds the tile into a running per-row selection kept
// across the base tiles, and its rows are sorted at the end (nnk_knn_pad, then numpy's sort in
// KnnSelection.finish). Keys are uint64
// (float bits of the clamped distance << 32) | base index: non-negative floats order as their
// bits, so keys order as (distance, index) and are unique. Per row, a buffer of `cap` > k keys
// holds every candidate below `worst`, a key that at least k held keys are at or below
// (UINT64_MAX before the first compaction): when the buffer is full, KnnRow::compact drops the
// keys above a new `worst` (a sampled pivot, else the k-th key by nth_element). A key >= worst
// cannot be among the k smallest (k keys <= worst are already held), so nothing the exact
// result needs is ever dropped. Base columns arrive in
// ascending index order, so a new key is below worst iff its distance is below worst's
// distance: the prefilter compares 16 raw distances at a time with that float and only chunks
// holding a candidate go on to the keys (KnnRow::scan). A self-search (queries = base) can compute
// each pair once: nnk_knn_select_sym folds a tile into its rows' selections and, transposed
// (a column scan, no copy), into its columns'.
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr uint64_t kNoKey = ~(uint64_t)0;

inline uint64_t knn_key(float d, int64_t index) {
    uint32_t u;
    std::memcpy(&u, &d, sizeof u);
    if (u >> 31) u = 0;  // clamp at 0: negatives (cancellation) and -0.0 become +0.0
    return ((uint64_t)u << 32) | (uint64_t)index;
}

inline float knn_key_dist(uint64_t key) { return bits_to_float((uint32_t)(key >> 32)); }

struct KnnRow {
    uint64_t* keys;
    int64_t* count;
    uint64_t* worst;
    int64_t k, cap;
    float thr;  // distance of *worst; +inf before the first compaction (takes every finite d)

    void push(float d, int64_t index) {
        uint64_t key = knn_key(d, index);
        if (key >= *worst) return;
        keys[(*count)++] = key;
        if (*count == cap) compact();
    }

    // The key of rank j (0-based) among the n distinct keys s[0..n) (a scratch array: other
    // builds reorder it): the one with exactly j keys below it. With AVX-512 (n a multiple of
    // 8) each key's rank is counted eight keys a step until the one sought: ~0.3 against
    // ~0.9 us for nth_element over the 128-key sample of a compaction (perf, N 20,000,
    // k 1,000, where the selection of the sample had become 10% of the search).
    static uint64_t key_of_rank(uint64_t* s, int64_t n, int64_t j) {
#if defined(__AVX512F__)
        if (n % 8 == 0) {
            for (int64_t i = 0; i < n; ++i) {
                const __m512i x = _mm512_set1_epi64((long long)s[i]);
                int64_t below = 0;
                for (int64_t b = 0; b < n; b += 8)
                    below += __builtin_popcount(
                        (unsigned)_mm512_cmplt_epu64_mask(_mm512_loadu_si512(s + b), x));
                if (below == j) return s[i];
            }
        }
#endif
        std::nth_element(s, s + j, s + n);
        return s[j];
    }

    // How many of the full buffer's keys are at or below piv.
    int64_t count_at_most(uint64_t piv) const {
        int64_t i = 0, m = 0;
#if defined(__AVX512F__)
        const __m512i p = _mm512_set1_epi64((long long)piv);
        for (; i + 8 <= cap; i += 8)
            m += __builtin_popcount(
                (unsigned)_mm512_cmple_epu64_mask(_mm512_loadu_si512(keys + i), p));
#endif
        for (; i < cap; ++i) m += keys[i] <= piv;
        return m;
    }

    // Moves the full buffer's keys at or below piv to its front, in their order (the slots
    // past them are left stale: the count says where the buffer ends). With AVX-512 eight
    // keys at a time: compressed in a register and stored whole, the store ending at most
    // where the keys just loaded end, so it never overwrites a key not yet read.
    void keep_at_most(uint64_t piv) {
        int64_t i = 0, w = 0;
#if defined(__AVX512F__)
        const __m512i p = _mm512_set1_epi64((long long)piv);
        for (; i + 8 <= cap; i += 8) {
            const __m512i v = _mm512_loadu_si512(keys + i);
            const __mmask8 keep = _mm512_cmple_epu64_mask(v, p);
            _mm512_storeu_si512(keys + w, _mm512_maskz_compress_epi64(keep, v));
            w += __builtin_popcount((unsigned)keep);
        }
#endif
        for (; i < cap; ++i) {
            const uint64_t v = keys[i];
            keys[w] = v;
            w += v <= piv;
        }
    }

    // The new state once the m keys at or below piv are kept (piv the new worst key).
    void drop_above(uint64_t piv, int64_t m) {
        keep_at_most(piv);
        *worst = piv;
        *count = m;
        thr = knn_key_dist(piv);
    }

    // The buffer is full: drop every key above a new `worst` that at least k kept keys are at
    // or below (a dropped key then has k smaller ones held: it cannot be among the k smallest,
    // now or later). First try a pivot from a sample: the keys at kKnnSample evenly spaced
    // positions, the one a little above rank k / cap (key_of_rank: no sort of the sample),
    // then one counting pass and one partition that keep the keys at or below it (AVX-512:
    // eight keys a step). That is several times cheaper than nth_element over the buffer
    // (19 us for 2,002 keys on the 2-core AMD EPYC): the k-th key is not needed, only a
    // threshold with k keys under it. Where fewer than k keys are at or below the pivot (2% of
    // the compactions at N 20,000, k 1,000), once more with the sample's key 16 ranks higher;
    // where that misleads too, or too few slots would be freed, nth_element. Buffers under
    // 1,024 keys (k under 512) are too small for the sample: with AVX-512 the keys at 16
    // spaced positions are each counted in the whole buffer instead, and the pivot is the one
    // with the fewest keys at or below it, at least k (on average ~cap / 17 above k). perf had
    // put nth_element over the 202-key buffers of a k 101 graph at 28% of the search; with
    // the counted keys (one thread, 2026-11-27, ad hoc, two rounds against the commit before):
    // the graph of N 30,000 at D 128 0.97-1.03 against 1.17-1.25 s, k 300 queries 0.36
    // against 0.48 s; at two threads, N 1e5, 4.41-4.55 against 4.97-4.99 s.
    void compact() {
        constexpr int64_t kKnnSample = 128;
        if (cap >= 8 * kKnnSample) {
            uint64_t sample[kKnnSample];
            for (int64_t i = 0; i < kKnnSample; ++i) sample[i] = keys[i * cap / kKnnSample];
            const int64_t j0 = std::min<int64_t>(kKnnSample - 2,
                                                 (k * kKnnSample + cap - 1) / cap + 10);
            for (const int64_t j : {j0, std::min<int64_t>(kKnnSample - 2, j0 + 16)}) {
                const uint64_t piv = key_of_rank(sample, kKnnSample, j);
                const int64_t m = count_at_most(piv);
                if (m > k + (cap - k) / 2) break;
                if (m >= k) return drop_above(piv, m);
            }
        }
#if defined(__AVX512F__)
        else {
            // Smaller buffers: the keys at kKnnProbe evenly spaced positions, each counted in
            // the whole buffer (eight keys a step); the pivot is the one with the fewest keys
            // at or below it, at least k.
            constexpr int64_t kKnnProbe = 16;
            uint64_t piv = kNoKey;
            int64_t best = cap + 1;
            for (int64_t p = 0; p < kKnnProbe; ++p) {
                const uint64_t c = keys[p * cap / kKnnProbe];
                const int64_t m = count_at_most(c);
                if (m >= k && m < best) {
                    best = m;
                    piv = c;
                }
            }
            if (best <= k + (cap - k) / 2) return drop_above(piv, best);
        }
#endif
        std::nth_element(keys, keys + (k - 1), keys + cap);
        *worst = keys[k - 1];
        *count = k;
        thr = knn_key_dist(*worst);
    }

    // The row's count, worst key and threshold live in locals for the scan, written back
    // around each compaction and at the end: as members reached through pointers, every key
    // stored could alias them (uint64_t / int64_t) as far as the compiler knows, and it reloaded
    // them at each push (evaluation-like clusters, N 20,000, k 1,000, one thread: the scan
    // with its pushes was ~40% of the search).
    void scan(const float* __restrict d, int64_t cols, int64_t col0) {
        uint64_t* const kb = keys;
        const int64_t full = cap;
        int64_t n = *count;
        uint64_t w = *worst;
        float t = w == kNoKey ? std::numeric_limits<float>::infinity() : knn_key_dist(w);
        auto compact_full = [&]() {
            *count = n;
            compact();  // sets *count, *worst and thr
            n = *count;
            w = *worst;
            t = thr;
        };
        auto put = [&](float v, int64_t index) __attribute__((always_inline)) {
            const uint64_t key = knn_key(v, index);
            if (key >= w) return;
            kb[n++] = key;
            if (n == full) compact_full();
        };
        int64_t j = 0;
        // Until the first compaction every column is a candidate (the buffer fills).
        for (; j < cols && w == kNoKey; ++j) put(d[j], col0 + j);
#if defined(__AVX512F__)
        const __m512i lane = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
        // Eight candidates' keys at once: (clamped distance bits << 32) | index, those of the
        // lanes in `pass` below the worst key compress-stored in column order at the count.
        auto put8 = [&](__m256i bits, __mmask8 pass, int64_t index0)
                        __attribute__((always_inline)) {
            const __m512i key = _mm512_or_si512(
                _mm512_slli_epi64(_mm512_cvtepu32_epi64(bits), 32),
                _mm512_add_epi64(_mm512_set1_epi64(index0), lane));
            const __mmask8 keep =
                pass & _mm512_cmplt_epu64_mask(key, _mm512_set1_epi64((long long)w));
            _mm512_storeu_si512(kb + n, _mm512_maskz_compress_epi64(keep, key));
            n += __builtin_popcount((unsigned)keep);
        };
        // With room for all sixteen, the keys of a vector's candidates are built and stored as
        // vectors whatever their number: one at a time only where the buffer may fill within
        // the vector. Against one at a time for every candidate (one thread, clustered data,
        // N 20,000, D 64, two rounds, ad hoc): the k 1,000 searches 1.1x faster; vectors only
        // from 4 (8) candidates of 16 up, 1.0x (1.0x); evaluation at 150K 1.03x, k 300 and
        // the k 100 graph within noise.
        for (; j + 16 <= cols; j += 16) {
            const __m512 v = _mm512_loadu_ps(d + j);
            __mmask16 m = _mm512_cmp_ps_mask(v, _mm512_set1_ps(t), _CMP_LT_OQ);
            if (!m) continue;
            if (n + 16 <= full) {
                // Sign bit set (negative, -0.0): distance 0, as knn_key clamps.
                const __m512i bits = _mm512_maskz_mov_epi32(
                    _mm512_cmpge_epi32_mask(_mm512_castps_si512(v), _mm512_setzero_si512()),
                    _mm512_castps_si512(v));
                put8(_mm512_castsi512_si256(bits), (__mmask8)m, col0 + j);
                put8(_mm512_extracti64x4_epi64(bits, 1), (__mmask8)(m >> 8), col0 + j + 8);
                if (n == full) compact_full();
                continue;
            }
            while (m) {
                int i = __builtin_ctz((unsigned)m);
                m &= (__mmask16)(m - 1);
                put(d[j + i], col0 + j + i);
            }
        }
#elif defined(__AVX2__)
        for (; j + 8 <= cols; j += 8) {
            unsigned m = (unsigned)_mm256_movemask_ps(
                _mm256_cmp_ps(_mm256_loadu_ps(d + j), _mm256_set1_ps(t), _CMP_LT_OQ));
            while (m) {
                int i = __builtin_ctz(m);
                m &= m - 1;
                put(d[j + i], col0 + j + i);
            }
        }
#else
        for (; j + 16 <= cols; j += 16) {
            bool any = false;
            for (int i = 0; i < 16; ++i) any |= d[j + i] < t;
            if (!any) continue;
            for (int i = 0; i < 16; ++i)
                if (d[j + i] < t) put(d[j + i], col0 + j + i);
        }
#endif
        for (; j < cols; ++j)
            if (d[j] < t) put(d[j], col0 + j);
        *count = n;
        thr = t;
    }
};

// Items of about this many distances (whole rows) are shared out to the threads.
constexpr int64_t kKnnItemElems = 1 << 14;

// Column side of a symmetric self-search tile (nnk_knn_select_sym): the tile's rows are
// candidates for its columns' selections. Lanes per vector compare (16 with AVX-512, 8 with
// AVX2, 16 scalar) and vectors per row: an item is kKnnColGroup contiguous columns, walked
// down the tile's rows (each row a contiguous read of the group's floats, no transposed copy),
// with a software prefetch NNK_KNN_COL_PREFETCH rows ahead: consecutive reads are a row stride
// apart, a page or more for the search's tiles, which the hardware prefetchers do not follow.
// Measured on the 2-core AMD EPYC (AVX-512), one thread, column side of a 2048 x 2048 tile of
// a k = 101 search: 1 vector per row (16 columns), no prefetch 1.5 ms; 4 vectors 1.2 ms; 4 with
// prefetch 8 rows ahead 1.0 ms; 8 with prefetch 0.85 ms (the row side of the same tile 0.68
// ms). Prefetch with 1 vector per row was slower (1.7 ms): one line used per prefetch.
#if defined(__AVX512F__)
constexpr int kKnnLanes = 16;
#elif defined(__AVX2__)
constexpr int kKnnLanes = 8;
#else
constexpr int kKnnLanes = 16;
#endif
#ifndef NNK_KNN_COL_VECTORS
#define NNK_KNN_COL_VECTORS 8
#endif
constexpr int kKnnColVectors = NNK_KNN_COL_VECTORS;
#ifndef NNK_KNN_COL_PREFETCH
#define NNK_KNN_COL_PREFETCH 8
#endif
constexpr int kKnnColGroup = kKnnLanes * kKnnColVectors;

// Columns c of `d` (rows x ncols, row stride ld; ncols <= kKnnColGroup) fold candidates
// (d[r * ld + c], index row0 + r), r ascending, into lane[c]. A lane whose selection has not
// compacted yet (worst = UINT64_MAX) takes every value, as KnnRow::scan does; afterwards only
// distances below its threshold, the distance of its worst key, reach the key path: exact for
// the same reason as the row side (the caller passes candidate indices above every index the
// lane holds). The thresholds live in a small array, refreshed for the one lane that compacts.
void knn_scan_columns(const float* __restrict d, int64_t rows, int64_t ld, int64_t row0,
                      int ncols, KnnRow* lane) {
    alignas(64) float thr[kKnnColGroup];
    uint32_t open[kKnnColVectors] = {};
    for (int c = 0; c < kKnnColGroup; ++c) {
        thr[c] = -std::numeric_limits<float>::infinity();  // padding lanes take nothing
        if (c >= ncols) continue;
        lane[c].thr = *lane[c].worst == kNoKey ? std::numeric_limits<float>::infinity()
                                               : knn_key_dist(*lane[c].worst);
        thr[c] = lane[c].thr;
        if (*lane[c].worst == kNoKey) open[c / kKnnLanes] |= 1u << (c % kKnnLanes);
    }
    auto hit = [&](int c, float v, int64_t index) {
        lane[c].push(v, index);
        thr[c] = lane[c].thr;
        if (*lane[c].worst != kNoKey) open[c / kKnnLanes] &= ~(1u << (c % kKnnLanes));
    };
    if (ncols < kKnnColGroup) {  // the tile's last, partial group: scalar
        for (int64_t r = 0; r < rows; ++r) {
            const float* p = d + r * ld;
            for (int c = 0; c < ncols; ++c)
                if (p[c] < thr[c] || ((open[c / kKnnLanes] >> (c % kKnnLanes)) & 1u))
                    hit(c, p[c], row0 + r);
        }
        return;
    }
    for (int64_t r = 0; r < rows; ++r) {
        const float* p = d + r * ld;
#if NNK_KNN_COL_PREFETCH > 0
        if (r + NNK_KNN_COL_PREFETCH < rows)
            for (int v = 0; v < kKnnColVectors; ++v)
                __builtin_prefetch(p + NNK_KNN_COL_PREFETCH * ld + v * kKnnLanes);
#endif
        for (int v = 0; v < kKnnColVectors; ++v) {
            const float* pv = p + v * kKnnLanes;
#if defined(__AVX512F__)
            uint32_t m = (uint32_t)_mm512_cmp_ps_mask(_mm512_loadu_ps(pv),
                                                      _mm512_load_ps(thr + v * kKnnLanes),
                                                      _CMP_LT_OQ);
#elif defined(__AVX2__)
            uint32_t m = (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(
                _mm256_loadu_ps(pv), _mm256_load_ps(thr + v * kKnnLanes), _CMP_LT_OQ));
#else
            uint32_t m = 0;
            for (int t = 0; t < kKnnLanes; ++t) m |= (uint32_t)(pv[t] < thr[v * kKnnLanes + t]) << t;
#endif
            m |= open[v];
            while (m) {
                int t = __builtin_ctz(m);
                m &= m - 1;
                hit(v * kKnnLanes + t, pv[t], row0 + r);
            }
        }
    }
}

// Rows a thread claims at a time in nnk_knn_pad and nnk_knn_unkey (64 rows of the evaluation's
// 3,000-key buffers: 1.5 MB).
constexpr int64_t kKnnFinishRows = 64;

// row(r) for every r in [0, rows), in chunks of kKnnFinishRows on up to nthreads threads.
template <typename Row>
void run_row_chunks(int64_t rows, int nthreads, const Row& row) {
    run_items((rows + kKnnFinishRows - 1) / kKnnFinishRows, nthreads, [=](int64_t i) {
        for (int64_t r = i * kKnnFinishRows; r < std::min(rows, (i + 1) * kKnnFinishRows); ++r)
            row(r);
    });
}

}  // namespace

extern "C" {

// Folds the (rows, cols) fp32 tile `dist` (row stride ld) of base columns col0 .. col0+cols-1
// into the per-row selection state: keys (rows, cap), count (rows,), worst (rows,); a fresh
// state has count 0 and worst UINT64_MAX. Tiles must come in ascending col0. 0 on success,
// 2 on bad sizes (k < 1, cap <= k, or an index that does not fit 32 bits).
int nnk_knn_select(const float* dist, int64_t rows, int64_t cols, int64_t ld, int64_t col0,
                   int64_t k, int64_t cap, uint64_t* keys, int64_t* count, uint64_t* worst,
                   int nthreads) {
    if (k < 1 || cap <= k || col0 < 0 || cols < 0 || col0 + cols > ((int64_t)1 << 32)) return 2;
    if (rows <= 0 || cols == 0) return 0;
    int64_t per = std::max<int64_t>(1, kKnnItemElems / cols);
    int64_t items = (rows + per - 1) / per;
    run_items(items, nthreads, [=](int64_t it) {
        int64_t r1 = std::min(rows, (it + 1) * per);
        for (int64_t r = it * per; r < r1; ++r) {
            KnnRow row{keys + r * cap, count + r, worst + r, k, cap, 0.0f};
            row.scan(dist + r * ld, cols, col0);
        }
    });
    return 0;
}

// Symmetric self-search (torch_search._iter_knn_symmetric): `dist` is the (rows, cols) tile
// (row stride ld) of distances between points row0 .. row0+rows-1 (query side) and points
// col0 .. col0+cols-1 (base side) of ONE point set, and the state (keys (N, cap), count (N,),
// worst (N,)) has one row per point, indexed by the point. Row side: point row0 + r takes the
// tile's row r as candidates col0 + c (KnnRow::scan, as nnk_knn_select). Column side, only off
// the diagonal (col0 >= row0 + rows): point col0 + c takes the tile's column c as candidates
// row0 + r, r ascending (knn_scan_columns; the distance of pair (col0+c, row0+r) is the one
// computed with row0+r on the query side). A diagonal tile (row0 == col0, rows == cols) is
// fed to its rows only: it holds both orders of each pair. The two sides touch disjoint state
// rows, so their items run together. As for nnk_knn_select, every point must receive its
// candidates in ascending index order across calls: tiles (I, J), J >= I, with I outer and J
// inner give point p of block P the blocks 0 .. P-1 through column sides, P on the diagonal,
// then P+1 .. through row sides. 0 on success, 2 on bad sizes or overlapping blocks.
int nnk_knn_select_sym(const float* dist, int64_t rows, int64_t cols, int64_t ld, int64_t row0,
                       int64_t col0, int64_t k, int64_t cap, uint64_t* keys, int64_t* count,
                       uint64_t* worst, int nthreads) {
    if (k < 1 || cap <= k || row0 < 0 || col0 < 0 || rows < 0 || cols < 0 || ld < cols ||
        row0 + rows > ((int64_t)1 << 32) || col0 + cols > ((int64_t)1 << 32))
        return 2;
    bool diagonal = row0 == col0 && rows == cols;
    if (!diagonal && col0 < row0 + rows) return 2;
    if (rows == 0 || cols == 0) return 0;
    int64_t per = std::max<int64_t>(1, kKnnItemElems / cols);
    int64_t row_items = (rows + per - 1) / per;
    int64_t col_items = diagonal ? 0 : (cols + kKnnColGroup - 1) / kKnnColGroup;
    run_items(row_items + col_items, nthreads, [=](int64_t it) {
        if (it < row_items) {
            int64_t r1 = std::min(rows, (it + 1) * per);
            for (int64_t r = it * per; r < r1; ++r) {
                int64_t p = row0 + r;
                KnnRow row{keys + p * cap, count + p, worst + p, k, cap, 0.0f};
                row.scan(dist + r * ld, cols, col0);
            }
            return;
        }
        int64_t c0 = (it - row_items) * kKnnColGroup;
        int n = (int)std::min<int64_t>(kKnnColGroup, cols - c0);
        KnnRow lane[kKnnColGroup];
        for (int c = 0; c < n; ++c) {
            int64_t p = col0 + c0 + c;
            lane[c] = KnnRow{keys + p * cap, count + p, worst + p, k, cap, 0.0f};
        }
        knn_scan_columns(dist + c0, rows, ld, row0, n, lane);
    });
    return 0;
}

// The end of a selection (KnnSelection.finish in nnkloss/ops/cpu.py): every slot past a row's
// count is set to kNoKey, so that a sort of the rows' whole buffers puts their k smallest keys
// first (the sort is numpy's, SIMD where numpy has it: 4-8x std::sort here, see finish). 0 on
// success, 2 when a row holds fewer than k keys (nothing written). On up to nthreads threads.
int nnk_knn_pad(int64_t rows, int64_t k, int64_t cap, uint64_t* keys, const int64_t* count,
                int nthreads) {
    for (int64_t r = 0; r < rows; ++r)
        if (count[r] < k || count[r] > cap) return 2;
    run_row_chunks(rows, nthreads, [=](int64_t r) {
        std::fill(keys + r * cap + count[r], keys + (r + 1) * cap, kNoKey);
    });
    return 0;
}

// Runs fn(i) for every i in [0, n) on the kernel's threads (run_items): for Python work that
// releases the GIL, a ctypes callback (sort_rows in nnkloss/ops/cpu.py: numpy's sort of a
// share of the rows). Run by torch's OpenMP team rather than Python threads beside it, whose
// workers spin for milliseconds after each parallel region (the search's GEMM and selection)
// and take the cores from the Python threads: measured, two Python threads sorting straight
// after a GEMM were no faster than one. 0 when every item ran.
int nnk_run_items(int64_t n, int nthreads, void (*fn)(int64_t)) {
    if (fn == nullptr) return 2;
    run_items(n, nthreads, [fn](int64_t i) { fn(i); });
    return 0;
}

// After the sort: the first k keys of each row (row stride cap) as out_dist (rows, k) fp32
// distances (from the key bits) and out_index (rows, k) int64, written in place of the
// (rows, k) temporaries that torch's shifts and masks would take. With self0 >= 0, row r is
// point self0 + r of a self-search that selected k + 1 keys, and its own index leaves the list
// here, as exclusion.py's drop_self takes it out afterwards elsewhere, with the same result:
// the first k of its k + 1 keys that are not its own, or, where its own index is not among
// them (more than k exact duplicates tie ahead of it), its first k. That spares drop_self's
// compare over the (rows, k + 1) block, its argmax and its two wheres (0.39 s of evaluation's
// 22.5 at 150,000 points, k 1,500, 2026-11-27). On up to nthreads threads (serial, it took
// 2 ms of each 2048-row block's 9 at two threads, 2026-11-27). 0 on success, 2 on bad sizes.
int nnk_knn_unkey(int64_t rows, int64_t k, int64_t cap, const uint64_t* keys, float* out_dist,
                  int64_t* out_index, int64_t self0, int nthreads) {
    if (k < 0 || cap < k + (self0 >= 0 ? 1 : 0)) return 2;
    run_row_chunks(rows, nthreads, [=](int64_t r) {
        const uint64_t* row = keys + r * cap;
        // no index matches when there is no self (indices are below 2**32)
        const uint64_t own = self0 >= 0 ? (uint64_t)(self0 + r) : ~(uint64_t)0;
        int64_t j = 0;
        for (int64_t o = 0; o < k; ++o, ++j) {
            if ((row[j] & 0xffffffffu) == own) ++j;  // an index appears at most once in a row
            out_dist[r * k + o] = knn_key_dist(row[j]);
            out_index[r * k + o] = (int64_t)(row[j] & 0xffffffffu);
        }
    });
    return 0;
}

}  // extern "C"

// ---------------------------------------------------------------------------------------------
// The exact search's distance tiles (nnkloss/bank/search/torch_search.py, distance_tile):
// C (m, n) = A (m, k) B (n, k)^T in fp32, A and B row-major (the augmented query and base
// rows), every element ONE dot product of its two rows summed over p = 0 .. k-1 in that order
// with fused multiply-adds from +0. So its bits depend on its two rows alone: not on the tile's
// shape, the element's place in it or the thread count (a BLAS blocks and orders the sum as it
// likes), and every path of the search that uses it computes the same distance for a pair.
// AVX-512 builds only (nnk_gemm_nt returns 1 elsewhere and the search keeps torch.mm).
//
// Why: torch.mm (MKL 2024) on the 2-core AMD EPYC family 26 runs its AVX2 code, ~180 GFLOP/s
// for the search's tiles (2048 x 4096 x 136), where this AVX-512 loop runs ~475 (2026-11-27,
// ad hoc); the tiles' GEMM is most of the search's time at evaluation's k
// (the figures: docs/PERFORMANCE.md, "The kNN graph" and "Evaluation at scale").
//
// How (the GotoBLAS layout, without k blocking: k is D + 2 rounded to 8, a few hundred):
//   1. A is packed once into panels of GEMM_MR rows, element (row i, column p) of a panel at
//      [p * GEMM_MR + i] (rows past m are zeros), so the micro-kernel broadcasts consecutive
//      floats;
//   2. each work item takes GEMM_GROUP panels of 32 B rows in turn, packs one ([p * 32 + j],
//      rows past n zeros: 32 * k floats, in L1 at k <= 256) and runs the micro-kernel over
//      every panel of A: GEMM_MR x 32 accumulators in 16 zmm registers, per p two loads of B,
//      GEMM_MR broadcasts of A and 2 * GEMM_MR fused multiply-adds; the finished block is
//      stored to C (the rows and columns that exist).
// Memory traffic per call: A and B read once to pack; A's panels read again per 32 columns of
// C (from L2 / L3: m * k * 4 bytes, 1.1 MB at m 2048, k 136); C written once (m * n * 4).
#if defined(__AVX512F__)
namespace {

constexpr int64_t GEMM_MR = 8;
constexpr int64_t GEMM_NR = 32;
constexpr int64_t GEMM_GROUP = 4;

void gemm_pack_a(const float* a, int64_t lda, int64_t m, int64_t k, int64_t panel,
                 float* __restrict out) {
    const int64_t i0 = panel * GEMM_MR;
    for (int64_t p = 0; p < k; ++p)
        for (int64_t i = 0; i < GEMM_MR; ++i)
            out[p * GEMM_MR + i] = i0 + i < m ? a[(i0 + i) * lda + p] : 0.0f;
}

void gemm_pack_b(const float* b, int64_t ldb, int64_t n, int64_t k, int64_t panel,
                 float* __restrict out) {
    const int64_t j0 = panel * GEMM_NR;
    const int64_t nn = std::min<int64_t>(GEMM_NR, n - j0);
    for (int64_t j = 0; j < GEMM_NR; ++j) {  // row by row (contiguous reads), scattered writes
        if (j < nn) {
            const float* row = b + (j0 + j) * ldb;
            for (int64_t p = 0; p < k; ++p) out[p * GEMM_NR + j] = row[p];
        } else {
            for (int64_t p = 0; p < k; ++p) out[p * GEMM_NR + j] = 0.0f;
        }
    }
}

// The GEMM_MR x 32 block of C at (i0, j0) from a packed panel of A and one of B; mm x nn of it
// exist.
NNK_INLINE void gemm_block(const float* __restrict ap, const float* __restrict bp, int64_t k,
                           float* c, int64_t ldc, int64_t mm, int64_t nn) {
    __m512 acc[GEMM_MR][2];
    for (int i = 0; i < GEMM_MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < k; ++p) {
        const __m512 b0 = _mm512_loadu_ps(bp + p * GEMM_NR);
        const __m512 b1 = _mm512_loadu_ps(bp + p * GEMM_NR + 16);
#pragma GCC unroll 8
        for (int i = 0; i < GEMM_MR; ++i) {
            const __m512 av = _mm512_set1_ps(ap[p * GEMM_MR + i]);
            acc[i][0] = _mm512_fmadd_ps(av, b0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(av, b1, acc[i][1]);
        }
    }
    // Stores at compile-time indices (unrolled; `i < mm` a test): a loop to mm would index acc
    // at run time, and GCC then kept acc in memory, storing all 16 registers on every p
    // (2.4x slower).
    // Whole blocks by plain stores: masked stores of every block (full masks) held the GEMM to
    // 297-318 GFLOP/s at 2048 x 4096 x 136 on the 2-core AMD EPYC family 26, plain ones run
    // 476-478 (2026-11-27, ad hoc); the last columns only by masked stores.
    if (nn == GEMM_NR) {
#pragma GCC unroll 8
        for (int i = 0; i < GEMM_MR; ++i) {
            if (i < mm) {
                _mm512_storeu_ps(c + i * ldc, acc[i][0]);
                _mm512_storeu_ps(c + i * ldc + 16, acc[i][1]);
            }
        }
        return;
    }
    // the last columns (nn of 1 to 31): the lanes of the two 16-column halves that hold one
    const __mmask16 k0 = (__mmask16)(nn >= 16 ? 0xffff : (1u << nn) - 1);
    const __mmask16 k1 = (__mmask16)(nn <= 16 ? 0 : (1u << (nn - 16)) - 1);
#pragma GCC unroll 8
    for (int i = 0; i < GEMM_MR; ++i) {
        if (i < mm) {
            _mm512_mask_storeu_ps(c + i * ldc, k0, acc[i][0]);
            _mm512_mask_storeu_ps(c + i * ldc + 16, k1, acc[i][1]);
        }
    }
}

}  // namespace
#endif

extern "C" {

// C (m, n) = A (m, k) B (n, k)^T, fp32, row strides lda, ldb, ldc (unit column strides); C
// must not overlap A or B. 0 on success, 1 where this build has no AVX-512 (nothing written),
// 2 on bad sizes.
int nnk_gemm_nt(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
                int64_t m, int64_t n, int64_t k, int nthreads) {
#if defined(__AVX512F__)
    if (m < 0 || n < 0 || k < 0 || (m > 0 && lda < k) || (n > 0 && ldb < k) ||
        (m > 0 && ldc < n))
        return 2;
    if (m == 0 || n == 0) return 0;
    const int64_t a_panels = (m + GEMM_MR - 1) / GEMM_MR;
    const int64_t b_panels = (n + GEMM_NR - 1) / GEMM_NR;
    std::vector<float> apack((size_t)(a_panels * GEMM_MR * k));
    float* const ap = apack.data();
    run_items(a_panels, nthreads, [=](int64_t i) {
        gemm_pack_a(a, lda, m, k, i, ap + i * GEMM_MR * k);
    });
    const int64_t items = (b_panels + GEMM_GROUP - 1) / GEMM_GROUP;
    run_items(items, nthreads, [=](int64_t it) {
        std::vector<float> bpack((size_t)(GEMM_NR * k));
        for (int64_t jp = it * GEMM_GROUP; jp < std::min(b_panels, (it + 1) * GEMM_GROUP); ++jp) {
            gemm_pack_b(b, ldb, n, k, jp, bpack.data());
            const int64_t nn = std::min<int64_t>(GEMM_NR, n - jp * GEMM_NR);
            for (int64_t i = 0; i < a_panels; ++i)
                gemm_block(ap + i * GEMM_MR * k, bpack.data(), k,
                           c + i * GEMM_MR * ldc + jp * GEMM_NR, ldc,
                           std::min<int64_t>(GEMM_MR, m - i * GEMM_MR), nn);
        }
    });
    return 0;
#else
    (void)a, (void)lda, (void)b, (void)ldb, (void)c, (void)ldc, (void)m, (void)n, (void)k,
        (void)nthreads;
    return 1;
#endif
}

}  // extern "C"
