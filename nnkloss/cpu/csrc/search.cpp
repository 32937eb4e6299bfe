// The exact search's compiled parts: the top-k selection folded into each distance tile, the
// selection's finish, the refresh's list overlap and the tiles' GEMM.
#include "common.h"

// Exact k-nearest-neighbour selection for nnkloss/bank/search/torch_search.py (its module
// docstring is the spec). torch computes a (rows, cols) tile of fp32 squared distances by one
// GEMM of augmented rows; nnk_knn_select folds the tile into a running per-row selection kept
// across the base tiles, and its rows are sorted at the end (nnk_knn_pad, then numpy's sort in
// KnnSelection.finish). Keys are uint64 (float bits of the clamped distance << 32) | base index: non-negative floats order as their
// bits, so keys order as (distance, index) and are unique. Per row, a buffer of `cap` > k keys
// holds every candidate below `worst`, a key that at least k held keys are at or below
// (UINT64_MAX before the first compaction): when the buffer is full, KnnRow::compact drops the
// keys above a new `worst` (a sampled pivot, else the k-th key by nth_element). A key >= worst
// cannot be among the k smallest (k keys <= worst are already held), so nothing the exact
// result needs is ever dropped. Base columns arrive in ascending index order, so a new key is
// below worst iff its distance is below worst's distance: the prefilter compares 16 raw
// distances at a time with that float and only chunks holding a candidate go on to the keys
// (KnnRow::scan). A self-search (queries = base) can compute each pair once: nnk_knn_select_sym folds a tile into its rows' selections and, transposed
// (a column scan, no copy), into its columns'.
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// How many entries of each new list its old list also holds (bank/refresh.py, a refresh's
// overlap statistic): out[i] = #{k : nw[i, k] >= 0 and nw[i, k] is some old[i, k']}, each
// occurrence of a repeated new entry counted, and valid[i] = #{k : nw[i, k] >= 0} (the
// statistic's denominator, in the same read). Per row, the old entries' bits are set in a
// bitmap of M bits (M: the rows the lists index), the new entries tested, the bits cleared:
// O(K) a row, where torch's form sorts every old list and binary-searches every new entry.
// 3 when an entry is outside [-1, M),
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
    // 8) each key's rank is counted eight keys a step until the one sought, cheaper than
    // nth_element over the sample of a compaction.
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
    // eight keys a step). That is several times cheaper than nth_element over the buffer: the
    // k-th key is not needed, only a threshold with k keys under it. Where fewer than k keys
    // are at or below the pivot (rare), once more with the sample's key 16 ranks higher;
    // where that misleads too, or too few slots would be freed, nth_element. Buffers under
    // 1,024 keys (k under 512) are too small for the sample: with AVX-512 the keys at 16
    // spaced positions are each counted in the whole buffer instead, and the pivot is the one
    // with the fewest keys at or below it, at least k (on average ~cap / 17 above k).
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
    // them at each push.
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
        // the vector.
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
// apart, a page or more for the search's tiles, which the hardware prefetchers do not follow;
// 8 vectors a row make each prefetched line serve 8 lanes.
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

// The end of a selection (KnnSelection.finish in nnkloss/cpu/search.py): every slot past a
// row's count is set to kNoKey, so that a sort of the rows' whole buffers puts their k smallest
// keys first (the sort is numpy's, SIMD where numpy has it). 0 on
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
// releases the GIL, a ctypes callback (sort_rows in nnkloss/cpu/search.py: numpy's sort of a
// share of the rows). Run by torch's OpenMP team rather than Python threads beside it, whose
// workers spin for milliseconds after each parallel region (the search's GEMM and selection)
// and would take the cores from the Python threads. 0 when every item ran.
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
// compare over the (rows, k + 1) block, its argmax and its two wheres. On up to nthreads
// threads. 0 on success, 2 on bad sizes.
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


// list_overlap_impl: int32 (0) / int64 (1) lists, new (rows, kn) and old (rows, ko).
int nnk_list_overlap(const void* nw, int nw64, int64_t kn, const void* old, int old64,
                     int64_t ko, int64_t rows, int64_t M, void* out, void* valid) {
    return list_overlap_impl(nw, nw64, kn, old, old64, ko, rows, M, (int64_t*)out,
                             (int64_t*)valid);
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
// Why: where torch.mm's BLAS runs narrower code than the CPU has (MKL's AVX2 path on AMD), this
// AVX-512 loop is the faster, and the tiles' GEMM is most of the search's time at evaluation's
// k (docs/PERFORMANCE.md, "The CPU library's build-time choices").
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
    // at run time, and GCC then kept acc in memory, storing all 16 registers on every p.
    // Whole blocks by plain stores (masked stores of every block were much slower); the last
    // columns only by masked stores.
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

