// The batch's passes outside the op's kernels: its lists (batch_lists, the CPU twin of
// kernels/batch_lists.py), the value checks' reads and the benchmarks' gather limit.
#include "common.h"

namespace {

// A batch's lists in one pass, the contract of kernels/batch_lists.py: out[b, :] =
// table[idx[b], :], entries equal to idx[b] set to -1 when exclude_self. A row whose idx is
// outside [0, N), or (labels given) whose label is not clabels[idx[b]], is dropped: all -1.
// counts[0] = rows dropped, counts[1] = those of them outside [0, N).
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

// The value checks (validation.check_values) in one call instead of a dozen torch reductions.
// Non-finite is an all-ones exponent, tested on the bits (bf16 / fp16 need no conversion).
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
template <typename Uint, Uint Exponent> struct Bits {
    typedef Uint U;
    static constexpr U sign = (U)((U)1 << (8 * sizeof(U) - 1)), exponent = Exponent;
};
template <typename T> struct FloatBits;
template <> struct FloatBits<float> : Bits<uint32_t, 0x7f800000u> {};
template <> struct FloatBits<double> : Bits<uint64_t, 0x7ff0000000000000ull> {};
template <> struct FloatBits<bf16> : Bits<uint16_t, 0x7f80u> {};
template <> struct FloatBits<fp16> : Bits<uint16_t, 0x7c00u> {};

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

// XOR of a row's bytes from `o` to its end `e`: 8-byte words, then single bytes.
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

// The machine's gather limit, for the benchmarks (benchmarks/common.gather_gbps): reads the
// rows the n list entries name (-1: skipped) as the forward's groups of four do, prefetches
// included, and returns only the XOR of their 8-byte words (so the reads stay), whatever the
// thread count.
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

// Whether every bank row the n list entries name is finite (validation's read of the gathered
// centres), in one pass without a gathered copy; entries outside [0, N) are skipped (the value
// checks name them). 0: all finite, 1: a NaN or inf.
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

// batch_lists_impl (labels null: no label comparison); returns counts[0].
int64_t nnk_batch_lists(const void* table, int tab64, int64_t N, int64_t K, const void* idx,
                    int idx64, const void* labels, int lab64, const void* clabels, int cl64,
                    int64_t B, int exclude_self, void* out, void* counts) {
    if (tab64)
        return batch_lists_impl((const int64_t*)table, N, K, idx, idx64, labels, lab64, clabels,
                                cl64, B, exclude_self, (int64_t*)out, (int64_t*)counts);
    return batch_lists_impl((const int32_t*)table, N, K, idx, idx64, labels, lab64, clabels,
                            cl64, B, exclude_self, (int32_t*)out, (int64_t*)counts);
}

// out[i] = 1 when some entry j >= 0 of list i has clabels[j] == clabels[i] (search/lists.py),
// each row read up to its first such entry (in a nearest-first list usually the first).
// 3 when an entry read is outside [-1, N).
int nnk_has_same_label(const void* nbrs, int nb64, int64_t N, int64_t K, const void* clabels,
                       int cl64, void* flags) {
    uint8_t* const out = (uint8_t*)flags;
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

// gather_read_items: the benchmarks' gather limit (int32 (0) / int64 (1) list entries).
uint64_t nnk_gather_read(const void* bank, int64_t N, int64_t row_bytes, const void* nbrs,
                         int nb64, int64_t n, int nthreads) {
    const char* b = (const char*)bank;
    return nb64 ? gather_read_items(b, N, row_bytes, (const int64_t*)nbrs, n, nthreads)
                : gather_read_items(b, N, row_bytes, (const int32_t*)nbrs, n, nthreads);
}

// gathered_finite_items; 2 for an unknown bank type.
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

// out[0] / out[1]: the smallest / largest list entry (unset when n_idx is 0); out[2]: emb holds
// a NaN or inf; out[3]: the weights hold a negative value, NaN or inf. 1 for an unknown code.
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
