// The neighbour-kernel loss op on the CPU (nnkloss/ops/CONTRACT.md), its backward terms and the
// classifier's distances. Forward, per row (ForwardRow::row): pass 1 gathers the K centre rows
// once for their distances; the logits, exponentials and sums run as SIMD lanes over K; grad_x
// is folded in during pass 1 or computed by a second pass. Backward: scale_rows_impl,
// EntryGrads (per-entry terms) and centre_grad_impl (their scatter).
#include "common.h"

namespace {

// 16 independent partial sums per row, added pairwise at the end: one running sum would be a
// chain of dependent adds.
constexpr int64_t ACC = 16;

// fp32 / bf16 / fp16 rows of D 64, 128 or 256 of at most this many bytes are read one at a
// time at a compile-time D (row_distances_fixed), longer ones in groups of four
// (docs/PERFORMANCE.md, "The CPU library's build-time choices").
#ifndef NNK_FIXED_ROW_BYTES
#if defined(__AVX512F__)
#define NNK_FIXED_ROW_BYTES 1024
#else
#define NNK_FIXED_ROW_BYTES 512
#endif
#endif

// A forward with grad_x folds each gathered row into the gradient while it is in L1 when the
// row's gathered set exceeds NNK_ONE_PASS_BYTES (..._PREFETCHED_BYTES with NNK_FOLD_PREFETCH)
// and its rows are at least NNK_ONE_PASS_MIN_ROW_BYTES long; else a second pass reads them.
#ifndef NNK_ONE_PASS_BYTES
#define NNK_ONE_PASS_BYTES (512 << 10)
#endif
#ifndef NNK_ONE_PASS_PREFETCHED_BYTES
#define NNK_ONE_PASS_PREFETCHED_BYTES (128 << 10)
#endif
#ifndef NNK_ONE_PASS_MIN_ROW_BYTES
#define NNK_ONE_PASS_MIN_ROW_BYTES 512
#endif

// In one pass with fp32 rows of at least NNK_FOLD_PREFETCH_MIN_ROW_BYTES, two of the four future
// rows are prefetched during the fold, which would otherwise leave memory idle.
#ifndef NNK_FOLD_PREFETCH
#define NNK_FOLD_PREFETCH 1
#endif
#ifndef NNK_FOLD_PREFETCH_MIN_ROW_BYTES
#define NNK_FOLD_PREFETCH_MIN_ROW_BYTES 4096
#endif

// The ACC lanes as P native vectors of the CPU's width: as one 64-byte GCC vector on narrower
// registers, GCC kept the partial sums in memory.
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

// ACC consecutive elements of a row in the compute type; rows of that type by one unaligned
// load per native vector (a memcpy of the whole set went through the stack).
template <typename C, typename T>
NNK_INLINE Lanes<C> load_lanes(const T* __restrict p) {
    Lanes<C> v;
    for (int q = 0; q < Lanes<C>::P; ++q) {
        if constexpr (std::is_same<C, T>::value)
            std::memcpy(&v.n[q], p + q * Lanes<C>::L, NATIVE_BYTES);
        else
            for (int i = 0; i < Lanes<C>::L; ++i) v.n[q][i] = load<C>(p, q * Lanes<C>::L + i);
    }
    return v;
}
// bf16 -> fp32: the 16 bits shifted into the top half. With AVX-512 / AVX2 one vpmovzxwd from
// memory per register (GCC's generic form took two widenings plus shuffles).
template <>
NNK_INLINE Lanes<float> load_lanes<float, bf16>(const bf16* __restrict p) {
    Lanes<float> v;
#if defined(__AVX512F__)
    const __m512i w = _mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
    std::memcpy(&v, &w, sizeof v);
#elif defined(__AVX2__)
    for (int q = 0; q < Lanes<float>::P; ++q) {
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
// fp16 -> fp32 by F16C's vcvtph2ps (exact); without F16C the generic load_lanes.
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

// A set of lanes all equal to s: one broadcast register (an initializer of L equal elements
// compiles to one vbroadcastss; `s * v` went through the stack).
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

// The 16 lanes added pairwise in a fixed order (i + i+8, i + i+4, i + i+2, 0 + 1): across
// native vectors first, then within the last one.
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

// Prefetches the lines the vector step at element d of a row reads (two for fp64): a future
// row's prefetches spread over a sweep, not a burst that fills the miss buffers.
template <typename T>
NNK_INLINE void prefetch_step(const T* row, int64_t d) {
    const char* p = (const char*)row + d * (int64_t)sizeof(T);
    __builtin_prefetch(p, 0, NNK_PREFETCH_LOCALITY);
    if (ACC * (int64_t)sizeof(T) > 64) __builtin_prefetch(p + 64, 0, NNK_PREFETCH_LOCALITY);
}

// Each difference is scaled before it is squared (docs/MATHS.md, rule 1).
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

// The distances of four gathered rows at once, the same bits as scaled_sqdist: x loaded once,
// four add chains interleaved, four rows streamed together. fut: four rows to prefetch (the
// group pf entries ahead, else the current rows), spread over the sweep.
template <typename C, typename T>
inline void scaled_sqdist4(const T* __restrict c0, const T* __restrict c1,
                           const T* __restrict c2, const T* __restrict c3,
                           const C* __restrict x, C inv_s, int64_t D, C* out,
                           const T* const* fut) {
    typedef Lanes<C> V;
    const V vs = splat<V>(inv_s);
    V p0 = {}, p1 = {}, p2 = {}, p3 = {};
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
        for (int i = 0; i < 4; ++i)
            __builtin_prefetch((const char*)fut[i] + o, 0, NNK_PREFETCH_LOCALITY);
        for (int i = 0; i < 4; ++i)
            __builtin_prefetch((const char*)fut[i] + e, 0, NNK_PREFETCH_LOCALITY);
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

// Pass 1 of a row at a compile-time D (short rows, NNK_FIXED_ROW_BYTES) without a fold: one
// gathered row at a time (the same bits as in a group of four), the row pf entries ahead
// prefetched whole. Not inlined: as a function of its own its pointers keep their registers.
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

// exp(x) for the row's softmax as SIMD lanes. fp32: Cody-Waite reduction x = n ln2 + r, Cephes'
// expf polynomial for e^r (within 1 ulp) and 2^n as two exact power-of-two factors. -inf and
// x <= -104 give 0, NaN stays NaN. fp64 keeps libm's exp. always_inline: a call would keep the
// omp simd loop scalar.
__attribute__((always_inline)) inline float vexp(float x) {
    const float lo = -104.0f, hi = 88.72283935546875f;
    float xc = x < lo ? lo : (x > hi ? hi : x);
    // n = round(x / ln2) by the 1.5 * 2^23 trick (floorf would keep the loop scalar)
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
    // 2^n as two normal factors from exponent bits (only the builtin cast vectorises)
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

template <typename C>
NNK_INLINE void store_lanes(C* __restrict p, const Lanes<C>& v) {
    for (int q = 0; q < Lanes<C>::P; ++q) std::memcpy(p + q * Lanes<C>::L, &v.n[q], NATIVE_BYTES);
}

// g += sum_i a_i (c_i - x) over N gathered rows, in the order i = 0..N-1: per element the same
// operations whatever N and the row's end, so the same bits. Always inlined (as a call the
// forward with grad_x was slower).
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

// The gradient's second pass: g += sum_i a_i (c_i - x) over the n entries with a coefficient,
// a block of NB * ACC columns at a time held in registers (NB, then NB / 2, ... 1, then the
// ragged end); per element axpy_diff_rows' operations, so the same bits. c_i - x, not
// sum a_i c_i - (sum a_i) x, keeps far-off rows exact (docs/MATHS.md, rule 4).
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
        // The ragged end entry by entry: per element, GCC's in-order reduction rounded
        // differently from the contracted a (c - x) + g of the other elements.
        for (int64_t i = 0; i < n; ++i) {
            const C ai = a[i];
            const T* r = rows[i];
            for (int64_t e = d; e < D; ++e) g[e] += ai * (load<C>(r, e) - x[e]);
        }
    }
}

// The second pass of row k0 / K: the entries with a nonzero coefficient moved to the front, in
// order, then the blocks. Not inlined: inside row() it slowed the forward-only path.
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

// Whether v is inf or NaN, from its exponent bits: an integer test, which a SIMD loop can
// combine with its other integer masks.
template <typename C>
NNK_INLINE bool nonfinite_bits(C v) {
    typedef typename std::conditional<sizeof(C) == 4, uint32_t, uint64_t>::type U;
    U b;
    std::memcpy(&b, &v, sizeof b);
    constexpr U e = sizeof(C) == 4 ? (U)0x7f800000u : (U)0x7ff0000000000000ull;
    return (b & e) == e;
}

// 1b. The logits of list entries [a, e) of the row starting at k0 (label R) from their
//     distances u: logit_j = log w_j - u_j / 2, -inf for padding, out-of-range entries and zero
//     weights; the same-class logits (-inf elsewhere) into lpos. Returns the non-finite rule
//     (CONTRACT.md 6): an entry's distance NaN/inf or its index past the bank. I, L: the list
//     and centre-label types; W: the weight type (void: none). log w is taken only for the
//     rare weights other than 0 and 1, by a scalar pass afterwards.
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
    // Written so that GCC vectorises it (tests/test_cpu_csrc_codegen.py): weights and labels
    // gathered into buffers first; every test in the lists' integer types (mixed integer and
    // float masks had left the loop scalar).
    const I last = n_rows - 1 > (int64_t)std::numeric_limits<I>::max()
                       ? std::numeric_limits<I>::max() : (I)(n_rows - 1);
    const bool r_fits = (int64_t)(L)R == R;
    const L rl = (L)R;
    // One entry's logits from its list entry j, weight w and centre label c; its flags: bit 0
    // bad (past the bank, or a non-finite distance), bit 1 a weight other than 0 and 1.
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
    if (e - a <= 4) {  // the one-pass fold's groups of four: not buffered
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

// A batch's lists, labels, centre labels and weights with their run-time types (*64: int64 when
// 1; wtype: 0 none, 1 fp32, 2 fp64): the forward and EntryGrads both see the same logits.
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
    // list_logits_of at the run-time types.
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

// Step 2 of a row from its K logits (lg; lpos_er: the row's class, -inf elsewhere): the maxima,
// e_j = exp(lg_j - m_all) into ea, e^R_j in place of lpos_er, and the sums, as SIMD lanes
// (-inf gives exactly 0). The forward and EntryGrads both take their probabilities here.
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

    // A work item is `chunk` consecutive rows: the prefetch stream runs on across rows.
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

    // The online gradient's running maximum and sum (the weighted sums of c_j - x live in
    // grad_x's row and in acc_pos).
    struct Online {
        C m, s;
    };

    // Folds n (1 to 4) entries (rows, logits l; -inf: not counted) into the running sums,
    // rescaled first when the maximum rises; the rows come from L1. pf: two rows whose
    // prefetching is left to this fold (NNK_FOLD_PREFETCH), or null.
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
        // Four rows in one sweep when all four count, else only those that do.
        if (n == 4 && e[0] != (C)0 && e[1] != (C)0 && e[2] != (C)0 && e[3] != (C)0) {
            const T* const c[4] = {rows[0], rows[1], rows[2], rows[3]};
            axpy_diff_rows<4>(acc, c, x, e, D, pf);
            pf = nullptr;
        } else {
            for (int t = 0; t < n; ++t)
                if (e[t] != (C)0) axpy_diff(acc, rows[t], x, e[t], D);
        }
        if (pf) {  // the prefetches left to this fold, when it swept fewer rows
            prefetch_row(pf[0], D);
            prefetch_row(pf[1], D);
        }
    }

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
        // Members copied to locals: the stores below could alias them for the compiler.
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
        // With a gradient: one pass (the fold in step 1) or two (step 3): NNK_ONE_PASS_BYTES.
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
        // 1. Pass 1, per group of four entries: their distances; in one pass also the group's
        //    logits (1b) and its fold while the rows are in L1. Otherwise the K logits follow
        //    in one SIMD sweep (1b).
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
            // Padding stores distance 0, an index past the bank NaN (it poisons the row: 1b).
            const bool in = j >= 0 && j < n_rows;
            const T* r = in ? bank + j * D : nullptr;
            ub[k] = in ? scaled_sqdist(r, x, inv_s, D) : (j < 0 ? (C)0 : nan);
            if (one_pass) fold_both(k, &r, 1);
        };
        int64_t k = 0;
        // Short fp32 / bf16 / fp16 rows without a fold: row_distances_fixed.
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
        // Otherwise groups of four entries that all gather a row go through scaled_sqdist4.
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
            // With NNK_FOLD_PREFETCH two future rows are prefetched by this sweep (each named
            // twice) and two by the fold's. One call site: a second let GCC stop inlining it
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
        // 2. Maxima, exponentials and sums (row_exp_sums): the loss and log-sum-exps never come
        //    from step 1's running sums, so they are the same bits with and without a gradient.
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
        // 3. grad_x = (1/sigma^2) sum_j (p_j - p^R_j)(c_j - x) (CONTRACT.md 5): from step 1's
        //    running sums, or from a second pass over the rows with nonzero coefficients.
        if (one_pass) {
            const C sa = all.s, sp = pos.s;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) g[d] = (g[d] / sa - gpos[d] / sp) * inv_s2;
            return;
        }
#pragma omp simd
        for (int64_t i = 0; i < K; ++i) ea[i] = (ea[i] / s_all - er[i] / s_pos) * inv_s2;
        if ((int64_t)grows.size() < K) grows.resize(K);
        grad_pass(g, bank, nbl, l64, k0, K, ea, grows.data(), x, D);
    }
};

// The rows' mean over their counted rows: the sum in double over eight lanes in a fixed order
// (the same bits every run), rounded to T and divided by max(count, 1) in T, as torch's form.
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

template <typename C, typename T>
void forward_impl(const C* emb, const void* labels, int lab64, const T* centres,
                  const void* clabels, int cl64, const void* nbrs, int nb64, const void* weights,
                  int wtype,
                  C sigma, int64_t B, int64_t K, int64_t D, int64_t N, int store_dist,
                  C* loss, C* lse_all, C* lse_pos, C* grad_x, C* dist, int nthreads) {
    // rows per work item: up to 16, at least 8 items per thread
    const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(
        16, B / (8 * (int64_t)std::max(1, nthreads))));
    ForwardRow<C, T> row{emb, centres,
                         Lists{nbrs, nb64, labels, lab64, clabels, cl64, weights, wtype, N},
                         sigma, K, D, store_dist, loss, lse_all, lse_pos, grad_x, dist,
                         {}, {}, {}, {}, {}, {}, B, chunk, 0};
    run_items((B + chunk - 1) / chunk, nthreads, row);
}

// Centre gradient: a work item is a range of bank rows; its thread adds the (b, k) entries in
// its range in (b, k) order, so the result does not depend on the thread count.
// g += a (x - c) is computed as g += (-a)(c - x), the same number.
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

// out[b, :] = g[b * gs] * grad_x[b, :] (gs 0: a reduced loss's expanded scalar), divided by
// *divisor when given. A row takes no gradient, and passes none on (NaN or not), where that is
// 0 or lse_pos[b] == -inf (lse_pos may be null): the backward's row rule, no mask built first.
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
// nnkloss/ops/reference.py's), from the forward's saved distances u (B, K) and log-sum-exps.
// For row b with incoming gradient g_b (stride gs):
//   p_j, p^R_j: the row's softmax over its valid / same-class logits (Lists::logits; -inf: 0)
//   dl_j = (p_j - p^R_j) g_b
//   coef[b, j] = dl_j / sigma^2      (the centre gradient's coefficients, centre_grad_impl)
//   q[b, j]    = dl_j / w_j, or at a zero weight its one-sided derivative times g_b:
//                -exp(-u_j/2 - lse_pos + log(1 - exp(lse_pos - lse_all))) for the row's class,
//                exp(-u_j/2 - lse_all) for the others; 0 for padding
//   srow[b]    = sum_j dl_j (u_j - u_ref) over the valid entries, u_ref the distance of the
//                largest logit's entry (sum_j dl_j = 0: huge distances no longer cancel)
// Row rules: no same-class entry or g_b == 0: zeros; a NaN row that takes a gradient: NaN. p is
// e_j / s as in the forward (exp(logit - lse) rounded badly far from every centre).
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

// One query's classifier distances: o[j] for the bank rows row[j], the reference row r and x_q.
// DC > 0: D known at compile time (the loop unrolls whole), DC = 0: at run time; the same bits
// either way. Rows four at a time (the same bits as one at a time), pf entries ahead
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
        if (DC == 0 || DC % ACC != 0) {  // said outright: GCC warned of a dead loop's bounds
            for (; d < Dn; ++d) {
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

// The classifier's distances (evaluation/classifier.py, _sq_dist_minus_ref): out[q, j] =
// ||x_q - c_i||^2 - ||x_q - c_r||^2 for i = idx[q, j], r = ref[q], in the product form
// (c_i - c_r) . ((c_i + c_r) - 2 x_q), exact to full relative precision far from every centre.
// 3 if an index is outside [0, N) (nothing is read through it).
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
        bool ok = ref[q] >= 0 && ref[q] < N;
        for (int64_t j = 0; j < K; ++j) ok &= row[j] >= 0 && row[j] < N;
        if (!ok) {
            bad.store(1, std::memory_order_relaxed);
            return;
        }
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
#if defined(_OPENMP)
    return 1;
#else
    return 0;
#endif
}

// Every entry point returns 0 on success, 1 on an unknown type code. grad_x == NULL: the
// forward-only path; lse_all == NULL: not kept. With counted (B bytes) it flags the rows a
// mean counts (lse_pos not -inf), and with mean and divisor writes their counted mean: the
// op's whole forward in one call.
int nnk_forward(int ctype, int btype, const void* emb, const void* labels, int lab64,
                const void* centres, const void* clabels, int cl64, const void* nbrs, int nb64,
                const void* weights, int wtype, double sigma, int64_t B, int64_t K, int64_t D,
                int64_t N, int store_dist, void* loss, void* lse_all, void* lse_pos,
                void* grad_x, void* dist, void* counted, void* mean, void* divisor,
                int nthreads) {
    return with_types(ctype, btype, [&](auto c, auto t) {
        using C = decltype(c);
        using T = decltype(t);
        std::vector<C> scratch(lse_all ? 0 : B);
        forward_impl<C, T>((const C*)emb, labels, lab64, (const T*)centres, clabels, cl64, nbrs,
                           nb64, weights, wtype, (C)sigma, B, K, D, N, store_dist, (C*)loss,
                           lse_all ? (C*)lse_all : scratch.data(), (C*)lse_pos, (C*)grad_x,
                           (C*)dist, nthreads);
        uint8_t* flags = (uint8_t*)counted;  // null for B == 0 (an empty tensor's pointer)
        for (int64_t b = 0; flags && b < B; ++b)
            flags[b] = ((const C*)lse_pos)[b] != -std::numeric_limits<C>::infinity();
        if (mean) counted_mean_impl<C>((const C*)loss, flags, B, (C*)mean, (C*)divisor);
    });
}

int nnk_centre_grad(int ctype, int btype, const void* emb, const void* centres,
                    const void* nbrs, int nb64, const void* coef, int64_t B, int64_t K,
                    int64_t D, int64_t N, void* grad, int nthreads) {
    return with_types(ctype, btype, [&](auto c, auto t) {
        using C = decltype(c);
        using T = decltype(t);
        centre_grad_impl<C, T>((const C*)emb, (const T*)centres, nbrs, nb64, (const C*)coef, B,
                               K, D, N, (C*)grad, nthreads);
    });
}

// out (Q, K) in the compute type: the classifier's distances (rel_sqdist_impl); 3 if an index
// is outside the bank.
int nnk_rel_sqdist(int ctype, int btype, const void* x, const void* centres, int64_t N,
                   const int64_t* idx, const int64_t* ref, int64_t Q, int64_t K, int64_t D,
                   void* out, int nthreads) {
    int rc = 0;
    const int unknown = with_types(ctype, btype, [&](auto c, auto t) {
        using C = decltype(c);
        using T = decltype(t);
        rc = rel_sqdist_impl<C, T>((const C*)x, (const T*)centres, N, idx, ref, Q, K, D, (C*)out,
                                   nthreads);
    });
    return unknown ? 1 : rc;
}

// out[i] = the forward's exp(x[i]) (vexp), fp32: for tests of its accuracy.
int nnk_vexp(const float* x, float* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = vexp(x[i]);
    return 0;
}

// scale_rows_impl.
int nnk_scale_rows(int ctype, const void* grad_x, const void* g, int64_t gs,
                   const void* divisor, const void* lse_pos, int64_t B, int64_t D, void* out,
                   int nthreads) {
    return with_compute_type(ctype, [&](auto c) {
        using C = decltype(c);
        scale_rows_impl<C>((const C*)grad_x, (const C*)g, gs, (const C*)divisor,
                           (const C*)lse_pos, B, D, (C*)out, nthreads);
    });
}

// EntryGrads: coef, q (B, K) and srow (B,), each null when not wanted; weights fp32 (wtype 1),
// fp64 (2) or null (0); the rest in the compute type.
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
