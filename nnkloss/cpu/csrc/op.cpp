// The neighbour-kernel loss op on the CPU (nnkloss/ops/CONTRACT.md: the forward contract), its
// backward terms and the classifier's distances.
//
// Forward, per row b (ForwardRow::row's numbered steps): pass 1 gathers the K centre rows once,
// four at a time (one at a time for short rows at a compile-time D), and computes the scaled
// squared distances u_j = sum_d ((c_j[d] - x[d]) / sigma)^2; from those K numbers in cache the
// logits, the two maxima, the exponentials (vexp) and the two sums run as SIMD lanes over K,
// and the log-sum-exps follow. grad_x = (1/sigma^2) sum_j (p_j - p^R_j)(c_j - x) (not in the
// forward-only path) is computed in one of two ways: for a large gathered set of long rows
// (NNK_ONE_PASS_BYTES) pass 1 folds each row, while it is in L1, into running sums rescaled
// when the running maximum rises (the online log-sum-exp of the Triton kernel); otherwise a
// second pass re-reads the rows from L2, skipping zero coefficients. The loss and
// log-sum-exps come from the K logits either way (the same bits with and without grad_x).
//
// Backward (nnkloss/ops/neighbour_kernel.py): the embedding gradient is one scaling of grad_x's
// rows (scale_rows_impl); the centres', weights' and sigma's per-entry terms come from one pass
// per row (EntryGrads), the centres' then from the scatter (centre_grad_impl), whose threads
// own ranges of bank rows: every row is summed in the same (b, k) order whatever the thread
// count.
#include "common.h"

#ifndef NNK_GENERIC_BF16_WIDEN
#define NNK_GENERIC_BF16_WIDEN 0
#endif

namespace {

// ACC = 16 independent partial sums per row (one AVX-512 / two AVX2 fp32 vectors: Lanes): one
// running sum is a chain of dependent adds, the bottleneck for a row in cache; the partials are
// then added pairwise (no less accurate than one running sum).
constexpr int64_t ACC = 16;

// fp32 / bf16 / fp16 rows of D 64, 128 or 256 of at most this many bytes are read one at a
// time at a compile-time D (row_distances_fixed), longer ones in groups of four (0: never one
// at a time). Which is faster depends on the vector width: docs/PERFORMANCE.md, "The CPU
// library's build-time choices".
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
// prefetching, NNK_FOLD_PREFETCH) and its rows are at least NNK_ONE_PASS_MIN_ROW_BYTES long;
// otherwise a second pass reads them again from L2, which holds g's columns in registers and
// is the faster up to such sets.
#ifndef NNK_ONE_PASS_BYTES
#define NNK_ONE_PASS_BYTES (512 << 10)
#endif
#ifndef NNK_ONE_PASS_PREFETCHED_BYTES
#define NNK_ONE_PASS_PREFETCHED_BYTES (128 << 10)
#endif
// The fold's cost per entry (its logits, exponentials and running-maximum test) is paid per
// row whatever the row's length: short rows do not repay it, even with sets past L2.
#ifndef NNK_ONE_PASS_MIN_ROW_BYTES
#define NNK_ONE_PASS_MIN_ROW_BYTES 512
#endif

// In one pass with fp32 rows of at least NNK_FOLD_PREFETCH_MIN_ROW_BYTES, the prefetches of the
// four rows pf entries ahead are split: two rows' lines are requested during a group's distance
// sweep, two during its fold (0: all four during the distance sweep, as for the other types and
// shorter rows). The fold's sweep reads only L1, so memory would sit idle through it. Where the
// fold's arithmetic, not memory, is the wait (other types, shorter rows) it does not pay. The
// same bits either way (a prefetch changes no arithmetic).
#ifndef NNK_FOLD_PREFETCH
#define NNK_FOLD_PREFETCH 1
#endif
#ifndef NNK_FOLD_PREFETCH_MIN_ROW_BYTES
#define NNK_FOLD_PREFETCH_MIN_ROW_BYTES 4096
#endif

// The ACC lanes live in the CPU's own vector registers: NATIVE_BYTES wide (64 with AVX-512, 32
// with AVX, else 16), so a set of lanes is P = ACC / (NATIVE_BYTES / sizeof(C)) native vectors.
// As one 64-byte GCC vector on a CPU whose registers are narrower, GCC kept the lanes in memory
// (the partial sums through the stack at every step). Lane i of the set is lane i % L of native
// vector i / L, so every operation is the same per lane and tree_sum adds the lanes in a fixed
// order.
#if defined(__AVX512F__)
constexpr int NATIVE_BYTES = 64;
#elif defined(__AVX__)
constexpr int NATIVE_BYTES = 32;
#else
constexpr int NATIVE_BYTES = 16;
#endif


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
// bf16 -> fp32 is the 16 bits shifted into the top half, as whole-vector operations (widen,
// shift, reinterpret), one native vector at a time. With AVX-512 / AVX2 the widening is spelled
// out as one vpmovzxwd from memory per register: GCC's generic form took two widenings plus
// shuffles, which halved the bf16 passes' speed. NNK_GENERIC_BF16_WIDEN=1 keeps the generic
// form (for an A/B on another compiler or CPU).
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
// the scalar one is, so fp16 rows take the same vector loops as the other types. Without F16C
// the generic form above, one element at a time.
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
// register (an initializer of L equal elements: one vbroadcastss with AVX2 and AVX-512, where
// `s * v` on a vector wider than the registers went through the stack).
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
// element more than ||c - x||^2 / sigma^2, hidden behind the reading of the rows.
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
// as scaled_sqdist (the same bits), but x is loaded once per four rows, the four rows' add
// chains interleave, and four rows stream from memory at once.
//
// fut: four rows to prefetch (the group `pf` entries ahead; the current rows when there is
// none), one line of each per ACC elements read, spread over the computation instead of a
// burst that fills the miss buffers.
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

// Pass 1 of a row at a compile-time D (short fp32 / bf16 / fp16 rows, NNK_FIXED_ROW_BYTES) when
// no gradient is folded in: one gathered row at a time (the same bits as in a group of four),
// the row pf entries ahead prefetched whole, the distances into ub; the logits follow in one
// SIMD sweep. The loop unrolls whole at the compile-time D, and as a function of its own its
// pointers keep their registers.
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

// exp(x) for the row's softmax, vectorisable: the K exponentials of a row run as SIMD lanes (a
// call to the C library's exp per entry cost as much as the entry's distance). fp32:
// Cody-Waite range reduction x = n ln2 + r (ln2 split in two so n ln2 is exact), a degree-7
// polynomial for e^r (Cephes' expf coefficients: within 1 ulp of exp on [-ln2/2, ln2/2]) and 2^n
// applied as two exact power-of-two factors so that results down to the subnormal range round
// once. x = -inf (an invalid entry) gives 0, x <= -104 gives 0, NaN stays NaN. fp64 keeps the C
// library's exp. always_inline: a call inside the omp simd loop would make it scalar; its
// compares and selects vectorise without AVX-512's masks only under -fno-trapping-math.
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
// elements at a time as vector types, the ragged end one element at a time; per element the
// same operations in the same order either way, so the bits do not depend on N or on where the
// row ends. g and x are loaded, and g stored, once per N rows.
template <typename C>
NNK_INLINE void store_lanes(C* __restrict p, const Lanes<C>& v) {
    for (int q = 0; q < Lanes<C>::P; ++q) std::memcpy(p + q * Lanes<C>::L, &v.n[q], NATIVE_BYTES);
}

// Always inlined: as a call from the second pass (g and x reloaded, the coefficients splat
// again per group) the forward with grad_x was slower.
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
// stored once, and the next block starts. Per element the operations are axpy_diff_rows' in
// the same order, so the bits are the same. Blocks of NB, then NB / 2, ... 1 sets, then the
// ragged end; NB is what the registers hold beside x's block and a temporary (16 native
// vectors with AVX-512, 8 with fewer).
//
// x's term cancels in exact arithmetic (the a_i of a row sum to 0), but c_i - x is what keeps
// the sum exact when embeddings and centres sit far from the origin (docs/MATHS.md section 4,
// rule 4): sum a_i c_i - (sum a_i) x would cancel terms of the size of the coordinates.
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

// 1b. The logits of list entries [a, e) of the row whose entries start at k0 (its label R),
//     from their distances u[a..e), as SIMD lanes over the entries (the weights and centre
//     labels gathered): logit_j = log w_j - u_j / 2, -inf for padding, out-of-range entries and
//     zero weights; the same-class logit (-inf for other classes) into lpos; and the non-finite
//     rule (CONTRACT.md 6): true when an entry's distance is NaN/inf or its index is past the
//     bank. I, L: the list and centre-label integer types; W: the weight type (void: none;
//     wtype 1 fp32, 2 fp64), converted to C before the log as the torch path does. log w is
//     taken only for the rare entries with w != 1, by a scalar pass afterwards (log(1) is 0).
// Whether v is inf or NaN, from its exponent bits (all ones): an integer test, which a SIMD
// loop can combine with its other integer masks.
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
    // Written so that GCC vectorises it at every type and tuning (tests/test_cpu_csrc_codegen.py):
    // the weights and centre labels are gathered first, up to 64 entries at a time, into two
    // small buffers (a loop of its own, with gather instructions where the tuning uses them),
    // and the SIMD loop then reads them in order. It works in the lists' own integer type (the
    // last bank row an entry may name as an I: n_rows - 1, or I's largest value where the bank
    // has more rows than I can name, -1 for an empty bank; R as an L: a label L cannot hold
    // matches no centre); an entry outside the bank is a zero weight; a non-finite distance is
    // read from its exponent bits (nonfinite_bits), an integer test like `in`. Mixed integer
    // and float masks had left the loop scalar.
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
    // The one-pass fold's groups of four entries one at a time (the buffered pass gains
    // nothing there).
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
        // (row_distances_fixed).
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
            // (tests/test_cpu_csrc_codegen.py reads the loop inside row()).
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
void scale_rows_impl(const C* grad_x, const C* g, int64_t gs, const C* divisor,
                     const C* lse_pos, int64_t B, int64_t D, C* out, int nthreads) {
    auto row = [=](int64_t b) {
        const bool counted = !lse_pos || lse_pos[b] != -std::numeric_limits<C>::infinity();
        const C a = !counted ? C(0) : divisor ? g[b * gs] / *divisor : g[b * gs];
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

// The backward's per-entry terms for the centre, weight and sigma gradients (the torch form is
// nnkloss/ops/neighbour_kernel.py's), from the forward's saved distances u (B, K) and
// log-sum-exps. For row b with incoming gradient g_b (read with stride gs: 0 for a reduced
// loss's expanded scalar):
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
// p is e_j / s with e_j = exp(logit_j - row max) and s their sum, as in the forward, not
// exp(logit - lse): far from every centre lse's rounding scales every p alike, and the centre
// gradient, a sum of terms that cancel, came out visibly off (tests/test_numerics.py).
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
// prefetched.
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
// the sum in lanes). One pass over the gathered rows, no (Q, K, D) intermediate. Returns 3 if
// an index is outside [0, N) (nothing is read through it).
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

}  // namespace

extern "C" {

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
// With counted (B bytes) it also flags the rows a mean counts (lse_pos not -inf: NaN counts),
// and with mean and divisor it writes their counted mean (counted_mean_impl): the op's whole
// forward in one call.
int nnk_forward(int ctype, int btype, const void* emb, const void* labels, int lab64,
                const void* centres, const void* clabels, int cl64, const void* nbrs, int nb64,
                const void* weights, int wtype, double sigma, int64_t B, int64_t K, int64_t D,
                int64_t N, int store_dist, void* loss, void* lse_all, void* lse_pos,
                void* grad_x, void* dist, void* counted, void* mean, void* divisor,
                int nthreads) {
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
        if (rc) return;
        uint8_t* flags = (uint8_t*)counted;  // null for B == 0 (an empty tensor's pointer)
        for (int64_t b = 0; flags && b < B; ++b)
            flags[b] = ((const C*)lse_pos)[b] != -std::numeric_limits<C>::infinity();
        if (mean) counted_mean_impl<C>((const C*)loss, flags, B, (C*)mean, (C*)divisor);
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

// out[b, :] = g[b * gs] * grad_x[b, :] (g[b * gs] / *divisor with a divisor: a mean's
// gradient), zero rows where that is 0 or lse_pos[b] is -inf (lse_pos may be null: g alone
// decides)
int nnk_scale_rows(int ctype, const void* grad_x, const void* g, int64_t gs,
                   const void* divisor, const void* lse_pos, int64_t B, int64_t D, void* out,
                   int nthreads) {
    return with_compute_type(ctype, [&](auto c) {
        using C = decltype(c);
        scale_rows_impl<C>((const C*)grad_x, (const C*)g, gs, (const C*)divisor,
                           (const C*)lse_pos, B, D, (C*)out, nthreads);
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

}  // extern "C"
