// The exact search's compiled parts (nnkloss/bank/search/torch_search.py: its docstring is the
// spec): the top-k selection folded into each distance tile, the selection's finish, the
// refresh's list overlap and the tiles' GEMM.
//
// Keys are uint64 (bits of the distance clamped at 0) << 32 | base index: they order as
// (distance, index) and are unique. Per row a buffer of cap > k keys holds every candidate
// below `worst`, a key with at least k held keys at or below it (UINT64_MAX before the first
// compaction): such a key cannot be among the k smallest, so nothing the result needs is
// dropped. Columns arrive in ascending index order, so the prefilter compares raw distances
// with worst's. A self-search folds each tile into its rows' selections and, by a column scan,
// into its columns'.
#include "common.h"

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

    // The key of rank j among the n distinct keys s[0..n) (scratch: may be reordered). With
    // AVX-512, ranks counted eight keys a step (cheaper than nth_element over a sample).
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

    // Moves the full buffer's keys at or below piv to its front, in order. With AVX-512 eight
    // at a time, compress-stored: the store never passes the keys just loaded.
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

    // The buffer is full: drop every key above a new worst with at least k keys at or below
    // it. A pivot a little above rank k / cap in a sample, one count and one partition (far
    // cheaper than nth_element); else 16 ranks higher; else nth_element. Small buffers with
    // AVX-512: of 16 spaced keys, the one with the fewest (at least k) keys below.
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

    // The count, worst key and threshold live in locals for the scan (through pointers every
    // key stored could alias them, and the compiler reloaded them at each push).
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
        // Eight candidates' keys at once; those in `pass` below worst compress-stored in order.
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
        // As vectors while there is room for all sixteen; one at a time where the buffer may
        // fill within the vector.
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

// Column side of a symmetric tile: an item is kKnnColGroup contiguous columns walked down the
// tile's rows (no transposed copy), prefetched kKnnColPrefetch rows ahead (a row stride apart,
// which the hardware prefetchers do not follow).
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int kKnnLanes = 8;
#else
constexpr int kKnnLanes = 16;
#endif
constexpr int kKnnColVectors = 8;
constexpr int kKnnColPrefetch = 8;
constexpr int kKnnColGroup = kKnnLanes * kKnnColVectors;

// Columns c of `d` (row stride ld; ncols <= kKnnColGroup) fold candidates (d[r * ld + c],
// row0 + r), r ascending, into lane[c]: every value until the lane's first compaction (open),
// then only distances below its threshold, as KnnRow::scan.
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
        if (r + kKnnColPrefetch < rows)
            for (int v = 0; v < kKnnColVectors; ++v)
                __builtin_prefetch(p + kKnnColPrefetch * ld + v * kKnnLanes);
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
            for (int t = 0; t < kKnnLanes; ++t)
                m |= (uint32_t)(pv[t] < thr[v * kKnnLanes + t]) << t;
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

// row(r) for every r in [0, rows), in chunks of kKnnFinishRows on up to nthreads threads.
constexpr int64_t kKnnFinishRows = 64;

template <typename Row>
void run_row_chunks(int64_t rows, int nthreads, const Row& row) {
    run_items((rows + kKnnFinishRows - 1) / kKnnFinishRows, nthreads, [=](int64_t i) {
        for (int64_t r = i * kKnnFinishRows; r < std::min(rows, (i + 1) * kKnnFinishRows); ++r)
            row(r);
    });
}

}  // namespace

extern "C" {

// Folds the (rows, cols) tile `dist` (row stride ld) of base columns col0.. into the state:
// keys (rows, cap), count (rows,), worst (rows,) (fresh: 0 and UINT64_MAX). Tiles in ascending
// col0. 0 on success, 2 on bad sizes.
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

// Symmetric self-search (torch_search._iter_knn_compiled, symmetric), one state row per
// point: point row0 + r takes tile row r and, unless the tile is diagonal (row0 == col0,
// rows == cols), point col0 + c takes column c. 0 on success, 2 on bad sizes or overlapping blocks.
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

// The end of a selection (KnnSelection.finish): every slot past a row's count set to kNoKey,
// so that a sort of the whole buffers puts the k smallest keys first. 2 when a row holds fewer
// than k keys (nothing written).
int nnk_knn_pad(int64_t rows, int64_t k, int64_t cap, uint64_t* keys, const int64_t* count,
                int nthreads) {
    for (int64_t r = 0; r < rows; ++r)
        if (count[r] < k || count[r] > cap) return 2;
    run_row_chunks(rows, nthreads, [=](int64_t r) {
        std::fill(keys + r * cap + count[r], keys + (r + 1) * cap, kNoKey);
    });
    return 0;
}

// fn(i) for every i in [0, n) on run_items' threads: a ctypes callback that releases the GIL
// (search.sort_rows), run by torch's team rather than by Python threads beside its spinning
// workers.
int nnk_run_items(int64_t n, int nthreads, void (*fn)(int64_t)) {
    if (fn == nullptr) return 2;
    run_items(n, nthreads, [fn](int64_t i) { fn(i); });
    return 0;
}

// After the sort: the first k keys of each row decoded into out_dist (rows, k) fp32 and
// out_index (rows, k) int64. With self0 >= 0, row r is point self0 + r of a self-search that
// selected k + 1 keys: its own index leaves the list, as drop_self would take it out (where it
// is not among them, the first k). 0 on success, 2 on bad sizes.
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

// How many entries of each new list its old list also holds (bank/refresh.py): out[i] =
// #{k : nw[i, k] >= 0 is some old[i, k']}, valid[i] = #{k : nw[i, k] >= 0}, by a bitmap of
// the M rows the lists index (O(K) a row). 3 when an entry is outside [-1, M), 2 when M < 0,
// 4 when the bitmap cannot be allocated (no exception may cross the C interface).
int nnk_list_overlap(const void* nw, int nw64, int64_t kn, const void* old, int old64,
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

}  // extern "C"

// The search's distance tiles: C (m, n) = A (m, k) B (n, k)^T in fp32, every element one dot
// product summed over p = 0 .. k-1 in order with fused multiply-adds, so its bits depend on its
// two rows alone (not on shapes or threads, as a BLAS's would). AVX-512 builds only (1
// elsewhere: the search keeps torch.mm); faster than narrower BLAS code (docs/PERFORMANCE.md).
// GotoBLAS layout without k blocking: A packed once into panels of GEMM_MR rows; each work
// item packs GEMM_GROUP panels of 32 B rows in turn and runs the GEMM_MR x 32 micro-kernel
// (16 zmm accumulators) over every panel of A.
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
    for (int64_t j = 0; j < GEMM_NR; ++j) {  // contiguous reads, scattered writes
        if (j < nn) {
            const float* row = b + (j0 + j) * ldb;
            for (int64_t p = 0; p < k; ++p) out[p * GEMM_NR + j] = row[p];
        } else {
            for (int64_t p = 0; p < k; ++p) out[p * GEMM_NR + j] = 0.0f;
        }
    }
}

// The GEMM_MR x 32 block of C from packed panels of A and B; mm x nn of it exist.
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
    // Stores at compile-time indices (a loop to mm kept acc in memory); masked stores only for
    // the last columns (masked stores everywhere were much slower).
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

// Row strides lda, ldb, ldc; C must not overlap A or B. 0 on success, 1 without AVX-512
// (nothing written), 2 on bad sizes.
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

