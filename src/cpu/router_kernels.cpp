#include "cpu/router_kernels.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "cpu/router_math.h"

// SY_ISA_NS: this file is compiled once per kernel variant (src/cpu/isa.h).
namespace switchyard::cpu::SY_ISA_NS {

namespace {

// Below this many elements a loop runs on the calling thread.
constexpr int64_t kParallelMinWork = 16384;

// Megatron-Core adds this to the sigmoid-family normaliser.
constexpr double kNormEps = 1e-20;

// Top-k of key[0..n) (optionally only where allowed[e]), written to out_id[0..k) in descending key
// order; equal keys keep the lower id first. One pass in id order with a sorted insertion buffer.
template <class S>
void insert_topk(const S* key, int64_t begin, int64_t end, int64_t k, const uint8_t* allowed, S thr,
                 S* top_val, int32_t* out_id, int64_t& cnt) {
  for (int64_t e = begin; e < end; ++e) {
    if (allowed && !allowed[e]) continue;
    const S v = key[e];
    if (v < thr) continue;
    if (cnt == k) {
      if (!(v > top_val[k - 1])) continue;  // ties keep the earlier (lower) id
      cnt = k - 1;
    }
    int64_t j = cnt;
    while (j > 0 && top_val[j - 1] < v) {  // strictly less: equal keys stay in front
      top_val[j] = top_val[j - 1];
      out_id[j] = out_id[j - 1];
      --j;
    }
    top_val[j] = v;
    out_id[j] = static_cast<int32_t>(e);
    ++cnt;
  }
}

#ifdef SY_ROUTER_AVX2
// Compress table: for an 8-bit mask, the lanes of its set bits in order (then zeros).
struct CompressTable {
  alignas(32) int32_t idx[256][8];
  constexpr CompressTable() : idx() {
    for (int m = 0; m < 256; ++m) {
      int c = 0;
      for (int l = 0; l < 8; ++l) {
        if (m & (1 << l)) idx[m][c++] = l;
      }
      for (; c < 8; ++c) idx[m][c] = 0;
    }
  }
};
constexpr CompressTable kCompress{};

// Branch-free top-k (k <= 8) of an fp32 row with n % 8 == 0, same result as insert_topk:
// (1) a lower bound `thr` of the k-th largest key: the k-th largest of 8 disjoint maxima (lanes,
//     or 8-wide blocks for short rows);
// (2) keys >= thr are compressed (in id order) into a short candidate list;
// (3) each candidate enters a sorted 8-lane register (values + ids) by compare/permute/blend, with
//     equal keys kept behind earlier (lower) ids. No data-dependent branches except the loop
//     counts.
struct TopReg {
  __m256 v;
  __m256i id;
};

inline void reg_insert(TopReg& t, __m256 v, __m256i id) {
  const __m256i shift = _mm256_setr_epi32(0, 0, 1, 2, 3, 4, 5, 6);
  const __m256 lane0 = _mm256_castsi256_ps(_mm256_setr_epi32(-1, 0, 0, 0, 0, 0, 0, 0));
  const __m256 ge = _mm256_cmp_ps(t.v, v, _CMP_GE_OQ);  // a prefix: top is sorted descending
  const __m256 ge_prev = _mm256_or_ps(_mm256_permutevar8x32_ps(ge, shift), lane0);
  const __m256 at = _mm256_andnot_ps(ge, ge_prev);  // the insertion lane
  const __m256 sv = _mm256_permutevar8x32_ps(t.v, shift);
  const __m256 sid = _mm256_castsi256_ps(_mm256_permutevar8x32_epi32(t.id, shift));
  t.v = _mm256_blendv_ps(_mm256_blendv_ps(sv, v, at), t.v, ge);
  t.id = _mm256_castps_si256(_mm256_blendv_ps(_mm256_blendv_ps(sid, _mm256_castsi256_ps(id), at),
                                              _mm256_castsi256_ps(t.id), ge));
}


void select_topk_f32x8(const float* key, int64_t n, int64_t k, int32_t* out_id, float* bm,
                       float* cand_v, int32_t* cand_i) {
  const int64_t nb = n / 8;
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  TopReg t{neg_inf, _mm256_setzero_si256()};
  alignas(32) float tv[8];
  float thr_s;
  if (k == 8 || nb >= 8) {
    // Lane maxima: lane l holds the max of the keys e with e % 8 == l, 8 disjoint sets, so their
    // k-th largest is also a lower bound (for k == 8 simply the smallest lane maximum).
    __m256 lm = _mm256_loadu_ps(key);
    for (int64_t b = 1; b < nb; ++b) lm = _mm256_max_ps(lm, _mm256_loadu_ps(key + b * 8));
    if (k == 8) {
      thr_s = simd::hmin8(lm);
    } else {
      alignas(32) float lv[8];
      _mm256_store_ps(lv, lm);
      for (int l = 0; l < 8; ++l) reg_insert(t, _mm256_set1_ps(lv[l]), _mm256_setzero_si256());
      _mm256_store_ps(tv, t.v);
      thr_s = tv[k - 1];
    }
  } else {
    for (int64_t b = 0; b < nb; ++b) bm[b] = simd::hmax8(_mm256_loadu_ps(key + b * 8));
    for (int64_t b = 0; b < nb; ++b) {
      reg_insert(t, _mm256_set1_ps(bm[b]), _mm256_set1_epi32(static_cast<int32_t>(b)));
    }
    _mm256_store_ps(tv, t.v);
    thr_s = tv[k - 1];
  }
  const __m256 thr = _mm256_set1_ps(thr_s);
  int64_t nc = 0;
  const __m256i lane_ids = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t b = 0; b < nb; ++b) {
    const __m256 x = _mm256_loadu_ps(key + b * 8);
    const int m = _mm256_movemask_ps(_mm256_cmp_ps(x, thr, _CMP_GE_OQ));
    const __m256i perm = _mm256_load_si256(reinterpret_cast<const __m256i*>(kCompress.idx[m]));
    _mm256_storeu_ps(cand_v + nc, _mm256_permutevar8x32_ps(x, perm));
    const __m256i ids = _mm256_add_epi32(lane_ids, _mm256_set1_epi32(static_cast<int32_t>(b * 8)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(cand_i + nc),
                        _mm256_permutevar8x32_epi32(ids, perm));
    nc += __builtin_popcount(static_cast<unsigned>(m));
  }
  t = TopReg{neg_inf, _mm256_setzero_si256()};
  for (int64_t c = 0; c < nc; ++c) {
    reg_insert(t, _mm256_set1_ps(cand_v[c]), _mm256_set1_epi32(cand_i[c]));
  }
  alignas(32) int32_t ti[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(ti), t.id);
  for (int64_t j = 0; j < k; ++j) out_id[j] = ti[j];
}
#endif

// Block-threshold top-k: the k-th largest of the 8-wide block maxima is a lower bound of the k-th
// largest key (the k best blocks hold k distinct keys >= it), so only keys >= it are candidates:
// about k + a few out of n, which removes most of the insertion work and its branch misses.
// `bm` is scratch of ceil(n/8) entries.
template <class S>
void select_topk(const S* key, int64_t n, int64_t k, const uint8_t* allowed, S* top_val,
                 int32_t* out_id, S* bm, S* cand_v, int32_t* cand_i) {
#ifdef SY_ROUTER_AVX2
  if constexpr (std::is_same_v<S, float>) {
    if (!allowed && k <= 8 && n % 8 == 0 && n >= 16) {
      select_topk_f32x8(key, n, k, out_id, bm, cand_v, cand_i);
      return;
    }
  }
#else
  (void)cand_v;
  (void)cand_i;
#endif
  int64_t cnt = 0;
  const S lowest = -std::numeric_limits<S>::infinity();
  const int64_t nb = (n + 7) / 8;
  if (allowed || nb < 2 * k) {
    insert_topk(key, 0, n, k, allowed, lowest, top_val, out_id, cnt);
    return;
  }
  for (int64_t b = 0; b < nb; ++b)
    bm[b] = rmath::max_of(key + b * 8, std::min<int64_t>(8, n - b * 8));
  // k-th largest block maximum (ids are irrelevant here; reuse out_id as scratch).
  int64_t c2 = 0;
  insert_topk(bm, 0, nb, k, static_cast<const uint8_t*>(nullptr), lowest, top_val, out_id, c2);
  const S thr = top_val[k - 1];
  for (int64_t b = 0; b < nb; ++b) {
    if (bm[b] < thr) continue;
    insert_topk(key, b * 8, std::min<int64_t>(n, b * 8 + 8), k, allowed, thr, top_val, out_id, cnt);
  }
}

// Scores of the sigmoid family in double, valid over the whole double range: the fp32 kernels
// round these (so s and ds/dz never go through an fp32 exp that clamps or flushes), and the group
// scores are summed from them.
inline double sigmoid_d(double z) {
  if (z >= 0.0) return 1.0 / (1.0 + std::exp(-z));
  const double e = std::exp(z);
  return e / (1.0 + e);
}

// sqrt(softplus(z)), softplus(z) = max(z,0) + log1p(exp(-|z|)). Below -40, exp(z) < 2^-57 and
// sqrt(log1p(exp(z))) = exp(z/2) * (1 - exp(z)/4 + ...) is exp(z/2) to double precision; that
// form stays representable down to z ~ -1490 where exp(z) itself underflows at -745.
inline double sqrt_softplus_d(double z) {
  if (z < -40.0) return std::exp(0.5 * z);
  return std::sqrt(std::max(z, 0.0) + std::log1p(std::exp(-std::fabs(z))));
}

// d sqrt(softplus(z)) / dz = sigmoid(z) / (2 sqrt(softplus(z))); below -40 it is exp(z/2) / 2
// (same expansion as above).
inline double sqrt_softplus_grad_d(double z) {
  if (z < -40.0) return 0.5 * std::exp(0.5 * z);
  return sigmoid_d(z) / (2.0 * sqrt_softplus_d(z));
}

template <class S>
inline S sqrt_softplus(S z) {
  return static_cast<S>(sqrt_softplus_d(static_cast<double>(z)));
}

// d s / d z for the sigmoid family given z and s = f(z).
template <class S>
inline S score_derivative(int score_function, S z, S s) {
  if (score_function == kScoreSigmoid) return s * (S(1) - s);
  return static_cast<S>(sqrt_softplus_grad_d(static_cast<double>(z)));
}

// A score in double from the logit (group scores); lse is log-sum-exp of the row (pre-softmax).
inline double score_d(int score_function, bool pre_softmax, double z, double lse) {
  if (score_function == kScoreSigmoid) return sigmoid_d(z);
  if (score_function == kScoreSqrtSoftplus) return sqrt_softplus_d(z);
  return pre_softmax ? std::exp(z - lse) : z;
}

// Per-thread scratch for one row.
template <class S>
struct RowScratch {
  std::vector<S> ex;          // exp(z - max) (softmax family), or s = f(z) (sigmoid family)
  std::vector<S> key;         // selection key
  std::vector<S> top_val;     // top-k buffer
  std::vector<S> gsc;         // group scores (router dtype, Megatron's)
  std::vector<double> gsd;    // group scores in double (only to break ties of gsc)
  std::vector<S> gz;          // [G, m] each group's top-m logits, descending (ties between groups)
  std::vector<int32_t> gsub;  // [G, m] each group's top-m expert ids
  std::vector<S> masked;      // key with -inf outside the chosen groups
  std::vector<int32_t> gid;
  std::vector<int32_t> aux_id;
  std::vector<S> grow;    // gradient row
  std::vector<S> bm;      // block maxima for select_topk
  std::vector<S> cand_v;  // top-k candidates
  std::vector<int32_t> cand_i;
  explicit RowScratch(const RouteKernelParams& p)
      : ex(p.num_experts),
        key(p.num_experts),
        top_val(std::max<int64_t>(p.num_experts, 1)),
        gsc(std::max<int64_t>(p.num_groups, 1)),
        gsd(std::max<int64_t>(p.num_groups, 1)),
        gz(std::max<int64_t>(p.num_groups, 1) * std::max<int64_t>(p.top_k, 1)),
        gsub(std::max<int64_t>(p.num_groups, 1) * std::max<int64_t>(p.top_k, 1)),
        masked(p.num_experts),
        gid(std::max<int64_t>(p.num_groups, 1)),
        aux_id(std::max<int64_t>(p.top_k, 1)),
        grow(p.num_experts),
        bm((p.num_experts + 7) / 8 + 1),
        cand_v(p.num_experts + 8),
        cand_i(p.num_experts + 8) {}
};

// exp(z - max) into ex; returns the sum (fixed 8-lane order) and sets max.
template <class S>
inline S exp_shifted(const S* z, int64_t E, S* ex, S& zmax) {
  zmax = rmath::max_of(z, E);
  return rmath::exp_shift_sum(z, zmax, E, ex);
}

// s = f(z) for the sigmoid family, over a row.
template <class S>
inline void scores_row(int score_function, const S* z, int64_t E, S* s) {
  if (score_function == kScoreSigmoid) {
    rmath::sigmoid_row(z, E, s);
  } else {
    for (int64_t e = 0; e < E; ++e) s[e] = sqrt_softplus(z[e]);
  }
}

// Selection order (issue 14): key descending, equal keys by the larger logit, then the lower id.
// select_topk orders by (key, id); this re-orders rows where keys tie at or inside the top k.
// ids[0..k) index key/z; `n` keys in all (-inf entries never tie with the finite k-th key).
template <class S>
void break_ties_by_logit(const S* key, const S* z, int64_t n, int64_t k, int32_t* ids) {
  const S vk = key[ids[k - 1]];
  // One branch-free compare per key (it vectorises): exactly k keys >= the k-th means no
  // boundary tie, the usual case.
  int32_t n_ge = 0;
  for (int64_t e = 0; e < n; ++e) n_ge += key[e] >= vk ? 1 : 0;
  bool inner = false;
  for (int64_t j = 1; j < k; ++j) inner = inner || key[ids[j]] == key[ids[j - 1]];
  if (!inner && n_ge == k) return;
  if (n_ge > k) {
    int64_t n_gt = 0;
    for (int64_t e = 0; e < n; ++e) n_gt += key[e] > vk;
    // ids[0..n_gt) hold the keys above vk; the other slots go to the tied experts with the
    // largest logits (equal logits: lower id), by insertion in id order.
    const int64_t need = k - n_gt;
    int32_t* out = ids + n_gt;
    int64_t cnt = 0;
    for (int64_t e = 0; e < n; ++e) {
      if (key[e] != vk) continue;
      if (cnt == need) {
        if (!(z[e] > z[out[need - 1]])) continue;
        cnt = need - 1;
      }
      int64_t j = cnt;
      while (j > 0 && z[out[j - 1]] < z[e]) {
        out[j] = out[j - 1];
        --j;
      }
      out[j] = static_cast<int32_t>(e);
      ++cnt;
    }
  }
  std::sort(ids, ids + k, [&](int32_t a, int32_t b) {
    if (key[a] != key[b]) return key[a] > key[b];
    if (z[a] != z[b]) return z[a] > z[b];
    return a < b;
  });
}

// Top-k of one key row with the selection order above; key == z needs no tie pass (equal logits
// go to the lower id, which select_topk already does).
template <class S>
void select_exact(const S* key, const S* z, int64_t n, int64_t k, RowScratch<S>& sc, int32_t* ids) {
  select_topk(key, n, k, static_cast<const uint8_t*>(nullptr), sc.top_val.data(), ids, sc.bm.data(),
              sc.cand_v.data(), sc.cand_i.data());
  if (key != z) break_ties_by_logit(key, z, n, k, ids);
}

// Native selection of one row into ids[0..K). key: the logits z without expert bias, else
// s + bias in the router dtype. gval: what a group score sums (s + bias, or s without bias).
// Groups are ranked by Megatron's group score (the sum of the group's top m gval, in the router
// dtype); only where that ties at the group_topk boundary (flat fp32 scores) do the tied groups
// go by the same sum in double from double scores of the logits (score_d), then by their top-m
// logits (compared in descending order), then by the lower group id.
template <class S>
void native_select(const S* key, const S* z, const S* gval, const S* bias,
                   const RouteKernelParams& p, RowScratch<S>& sc, int32_t* ids) {
  const int64_t E = p.num_experts, K = p.top_k;
  if (p.num_groups <= 0) {
    select_exact(key, z, E, K, sc, ids);
    return;
  }
  const int64_t G = p.num_groups, per = E / G, m = K / p.group_topk, gt = p.group_topk;
  for (int64_t g = 0; g < G; ++g) {
    int32_t* sub = sc.gsub.data() + g * m;
    select_exact(key + g * per, z + g * per, per, m, sc, sub);
    S gs = 0;
    for (int64_t j = 0; j < m; ++j) {
      sub[j] += static_cast<int32_t>(g * per);
      gs += gval[sub[j]];
    }
    sc.gsc[g] = gs;
  }
  select_topk(static_cast<const S*>(sc.gsc.data()), G, gt, static_cast<const uint8_t*>(nullptr),
              sc.top_val.data(), sc.gid.data(), sc.bm.data(), sc.cand_v.data(), sc.cand_i.data());
  if (gt < G) {
    const S v = sc.gsc[sc.gid[gt - 1]];
    int64_t n_ge = 0;
    for (int64_t g = 0; g < G; ++g) n_ge += sc.gsc[g] >= v;
    if (n_ge > gt) {
      // A tie at the boundary: rank every group by (score, double score, top-m logits, id).
      double lse = 0.0;  // pre-softmax scores exp(z - lse), log-sum-exp in double
      if (p.score_function == kScoreSoftmax && p.pre_softmax) {
        double zm = -std::numeric_limits<double>::infinity(), acc = 0.0;
        for (int64_t e = 0; e < E; ++e) zm = std::max(zm, static_cast<double>(z[e]));
        for (int64_t e = 0; e < E; ++e) acc += std::exp(static_cast<double>(z[e]) - zm);
        lse = zm + std::log(acc);
      }
      for (int64_t g = 0; g < G; ++g) {
        double gs = 0.0;
        S* gz = sc.gz.data() + g * m;
        for (int64_t j = 0; j < m; ++j) {
          const int32_t e = sc.gsub[g * m + j];
          gs += score_d(p.score_function, p.pre_softmax, static_cast<double>(z[e]), lse) +
                (bias ? static_cast<double>(bias[e]) : 0.0);
          gz[j] = z[e];
        }
        // A lambda, not std::greater: no std::sort helper symbol shared by the ISA variants.
        std::sort(gz, gz + m, [](S a, S b) { return a > b; });
        sc.gsd[g] = gs;
        sc.gid[g] = static_cast<int32_t>(g);
      }
      std::sort(sc.gid.begin(), sc.gid.begin() + G, [&](int32_t a, int32_t b) {
        if (sc.gsc[a] != sc.gsc[b]) return sc.gsc[a] > sc.gsc[b];
        if (sc.gsd[a] != sc.gsd[b]) return sc.gsd[a] > sc.gsd[b];
        const S* za = sc.gz.data() + a * m;
        const S* zb = sc.gz.data() + b * m;
        for (int64_t j = 0; j < m; ++j) {
          if (za[j] != zb[j]) return za[j] > zb[j];
        }
        return a < b;
      });
    }
  }
  // Experts outside the chosen groups get -inf (Megatron's masked_fill); at least K experts
  // remain (checked by the front-end), all finite, so no -inf is ever selected.
  S* masked = sc.masked.data();
  std::fill_n(masked, E, -std::numeric_limits<S>::infinity());
  for (int64_t j = 0; j < gt; ++j)
    std::copy_n(key + sc.gid[j] * per, per, masked + sc.gid[j] * per);
  select_topk(static_cast<const S*>(masked), E, K, static_cast<const uint8_t*>(nullptr),
              sc.top_val.data(), ids, sc.bm.data(), sc.cand_v.data(), sc.cand_i.data());
  if (key != z) {
    break_ties_by_logit(static_cast<const S*>(masked), z, E, K, ids);
  }
}

}  // namespace

template <class S>
void route_forward(const S* logits, const S* bias, const uint8_t* row_kind,
                   const int32_t* replay_idx, const RouteKernelParams& p, int32_t* selected_idx,
                   S* weights, double* aux_prob_sum, int64_t* aux_counts, double* z_sum) {
  const int64_t T = p.num_tokens, E = p.num_experts, K = p.top_k;
  const int64_t G = p.aux_groups;
  const int64_t num_chunks = (T + kLossChunk - 1) / kLossChunk;
  const bool softmax = p.score_function == kScoreSoftmax;
  // Per-chunk partial sums, reduced in chunk order afterwards (thread-count independent). A chunk
  // holds one slot per sequence group when G <= kLossChunk, else one slot per token (each token of
  // a chunk is then in a different group), so the scratch never exceeds T x E.
  const int64_t slots = std::min(G, kLossChunk);
  const size_t part_size = p.need_aux ? static_cast<size_t>(num_chunks * slots * E) : 0;
  std::vector<double> part_p(part_size, 0.0);
  std::vector<int64_t> part_c(part_size, 0);
  std::vector<double> part_z(p.need_z ? static_cast<size_t>(num_chunks) : 0, 0.0);

  // Small batches run on the calling thread: a parallel region costs more than they do.
#pragma omp parallel if (num_chunks > 1)
  {
    RowScratch<S> sc(p);
#pragma omp for schedule(static)
    for (int64_t c = 0; c < num_chunks; ++c) {
      const int64_t t_end = std::min(T, (c + 1) * kLossChunk);
      double zacc = 0.0;
      for (int64_t t = c * kLossChunk; t < t_end; ++t) {
        const S* z = logits + t * E;
        int32_t* ids = selected_idx + t * K;
        S* w = weights + t * K;
        if (row_kind[t] == kRowPadded) {
          std::fill_n(ids, K, -1);
          std::fill_n(w, K, S(0));
          continue;
        }
        // Scores over all E when any consumer needs them.
        const bool need_exp = softmax ? (p.pre_softmax || p.need_aux || p.need_z) : p.need_z;
        S zmax = 0, sumex = 1;
        if (need_exp) sumex = exp_shifted(z, E, sc.ex.data(), zmax);
        if (!softmax) scores_row(p.score_function, z, E, sc.key.data());
        // Selection: replayed ids as given, else top-k within the groups of the logits (every
        // score is increasing in them: the exact score order, whatever fp32 underflows), or with
        // expert bias of s + bias (ties by the logit).
        if (row_kind[t] == kRowReplayed) {
          std::copy_n(replay_idx + t * K, K, ids);
        } else {
          const S* key = z;
          if (bias) {
            S* kb = sc.grow.data();
            if (softmax && !p.pre_softmax) {
              for (int64_t e = 0; e < E; ++e) kb[e] = z[e] + bias[e];
            } else if (softmax) {
              for (int64_t e = 0; e < E; ++e) kb[e] = sc.ex[e] / sumex + bias[e];
            } else {
              for (int64_t e = 0; e < E; ++e) kb[e] = sc.key[e] + bias[e];
            }
            key = kb;
          }
          // What a group score sums: s + bias, or s (the probabilities for pre-softmax).
          const S* gval = key;
          if (!bias && p.num_groups > 0) {
            if (softmax && p.pre_softmax) {
              S* pr = sc.grow.data();
              for (int64_t e = 0; e < E; ++e) pr[e] = sc.ex[e] / sumex;
              gval = pr;
            } else if (!softmax) {
              gval = sc.key.data();
            }
          }
          native_select(key, z, gval, bias, p, sc, ids);
        }
        // Weights at the ids, from the live logits.
        if (softmax && !p.pre_softmax) {
          S m = z[ids[0]];
          for (int64_t k = 1; k < K; ++k) m = std::max(m, z[ids[k]]);
          S sum = 0;
          for (int64_t k = 0; k < K; ++k) {
            w[k] = rmath::exp_s(z[ids[k]] - m);
            sum += w[k];
          }
          for (int64_t k = 0; k < K; ++k) w[k] = w[k] / sum * static_cast<S>(p.scaling);
        } else if (softmax) {
          for (int64_t k = 0; k < K; ++k) {
            w[k] = sc.ex[ids[k]] / sumex * static_cast<S>(p.scaling);
          }
        } else {
          S sum = 0;
          for (int64_t k = 0; k < K; ++k) sum += sc.key[ids[k]];
          const S den = sum + static_cast<S>(kNormEps);
          for (int64_t k = 0; k < K; ++k) {
            const S v = K > 1 ? sc.key[ids[k]] / den : sc.key[ids[k]];
            w[k] = v * static_cast<S>(p.scaling);
          }
        }
        // Aux-loss scores P over all E and their own plain top-k (no bias, groups or replay).
        if (p.need_aux) {
          S* P = sc.grow.data();  // the selection key is no longer needed
          if (softmax) {
            for (int64_t e = 0; e < E; ++e) P[e] = sc.ex[e] / sumex;
          } else {
            const S den = rmath::sum_of(sc.key.data(), E) + static_cast<S>(kNormEps);
            for (int64_t e = 0; e < E; ++e) P[e] = sc.key[e] / den;
          }
          // The aux counts need only the top-k set of P, and P is increasing in the logit: the
          // top-k of z (exact where fp32 P underflows), which is the row's ids when they were
          // selected on z alone.
          if (row_kind[t] == kRowNative && !bias && p.num_groups <= 0) {
            std::copy_n(ids, K, sc.aux_id.data());
          } else {
            select_topk(z, E, K, static_cast<const uint8_t*>(nullptr), sc.top_val.data(),
                        sc.aux_id.data(), sc.bm.data(), sc.cand_v.data(), sc.cand_i.data());
          }
          const int64_t slot = G <= kLossChunk ? t % G : t - c * kLossChunk;
          double* pp = part_p.data() + (c * slots + slot) * E;
          int64_t* pc = part_c.data() + (c * slots + slot) * E;
          for (int64_t e = 0; e < E; ++e) pp[e] += static_cast<double>(P[e]);
          for (int64_t k = 0; k < K; ++k) ++pc[sc.aux_id[k]];
        }
        if (p.need_z) {
          const double lse = static_cast<double>(zmax + std::log(sumex));
          zacc += lse * lse;
        }
      }
      if (p.need_z) part_z[c] = zacc;
    }
  }
  if (p.need_aux) {
    std::fill_n(aux_prob_sum, G * E, 0.0);
    std::fill_n(aux_counts, G * E, int64_t{0});
    for (int64_t c = 0; c < num_chunks; ++c) {
      const int64_t used = G <= kLossChunk ? G : std::min(kLossChunk, T - c * kLossChunk);
      for (int64_t slot = 0; slot < used; ++slot) {
        const int64_t g = G <= kLossChunk ? slot : (c * kLossChunk + slot) % G;
        const double* pp = part_p.data() + (c * slots + slot) * E;
        const int64_t* pc = part_c.data() + (c * slots + slot) * E;
        for (int64_t e = 0; e < E; ++e) {
          aux_prob_sum[g * E + e] += pp[e];
          aux_counts[g * E + e] += pc[e];
        }
      }
    }
  }
  if (p.need_z) {
    double s = 0.0;
    for (int64_t c = 0; c < num_chunks; ++c) s += part_z[c];
    *z_sum = s;
  }
}

template <class S>
void route_backward(const S* logits, const int32_t* selected_idx, const int32_t* topk_idx,
                    const uint8_t* row_kind, const S* grad_w, const RouteKernelParams& p,
                    const double* aux_grad, double z_coeff, S* grad_logits) {
  const int64_t T = p.num_tokens, E = p.num_experts, K = p.top_k;
  const int64_t G = p.aux_groups;
  const bool softmax = p.score_function == kScoreSoftmax;
  const S scaling = static_cast<S>(p.scaling);
  std::vector<S> aux_s(aux_grad ? static_cast<size_t>(G * E) : 0);
  for (size_t i = 0; i < aux_s.size(); ++i) aux_s[i] = static_cast<S>(aux_grad[i]);
#pragma omp parallel if (T * E > kParallelMinWork)
  {
    RowScratch<S> sc(p);
    std::vector<S> gw(static_cast<size_t>(std::max<int64_t>(K, 1)));
    std::vector<S> wk(static_cast<size_t>(std::max<int64_t>(K, 1)));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const S* z = logits + t * E;
      S* g = grad_logits + t * E;
      if (row_kind[t] == kRowPadded) {
        std::fill_n(g, E, S(0));
        continue;
      }
      const int32_t* ids = selected_idx + t * K;
      const bool need_exp =
          softmax ? (p.pre_softmax || aux_grad != nullptr || z_coeff != 0.0) : z_coeff != 0.0;
      S zmax = 0, sumex = 1;
      if (need_exp) sumex = exp_shifted(z, E, sc.ex.data(), zmax);
      const bool need_s = !softmax && (grad_w != nullptr || aux_grad != nullptr);
      if (need_s) scores_row(p.score_function, z, E, sc.key.data());
      // Routing weights: only kept slots carry gradient (dropped weights are multiplied by 0).
      if (grad_w) {
        for (int64_t k = 0; k < K; ++k) {
          gw[k] = topk_idx[t * K + k] >= 0 ? grad_w[t * K + k] * scaling : S(0);
        }
      }
      const S* a = aux_grad ? aux_s.data() + (t % G) * E : nullptr;
      const S f = z_coeff != 0.0 ? static_cast<S>(z_coeff) * (zmax + std::log(sumex)) : S(0);
      if (softmax) {
        // Every dense term is P_e * (something): the aux loss P_e (a_e - <P, a>), the z-loss
        // 2 coeff lse P_e / N, and for pre-softmax weights -P_e <P[ids], gw>; one pass writes them.
        if (need_exp) {
          S c = f;
          if (p.pre_softmax && grad_w) {
            S dotw = 0;
            for (int64_t k = 0; k < K; ++k) dotw += sc.ex[ids[k]] / sumex * gw[k];
            c -= dotw;
          }
          if (a) {
            S* P = sc.grow.data();
            for (int64_t e = 0; e < E; ++e) P[e] = sc.ex[e] / sumex;
            c -= rmath::dot_of(P, a, E);
            for (int64_t e = 0; e < E; ++e) g[e] = P[e] * (a[e] + c);
          } else {
            for (int64_t e = 0; e < E; ++e) g[e] = sc.ex[e] / sumex * c;
          }
        } else {
          std::fill_n(g, E, S(0));
        }
        if (grad_w && !p.pre_softmax) {
          S m = z[ids[0]];
          for (int64_t k = 1; k < K; ++k) m = std::max(m, z[ids[k]]);
          S sum = 0;
          for (int64_t k = 0; k < K; ++k) {
            wk[k] = rmath::exp_s(z[ids[k]] - m);
            sum += wk[k];
          }
          S dot = 0;
          for (int64_t k = 0; k < K; ++k) {
            wk[k] = wk[k] / sum;
            dot += wk[k] * gw[k];
          }
          for (int64_t k = 0; k < K; ++k) g[ids[k]] += wk[k] * (gw[k] - dot);
        } else if (grad_w) {
          for (int64_t k = 0; k < K; ++k) g[ids[k]] += sc.ex[ids[k]] / sumex * gw[k];
        }
        continue;
      }
      // Sigmoid family. z-loss first (it lives on softmax(z)), then the aux and weight terms on s.
      if (z_coeff != 0.0) {
        for (int64_t e = 0; e < E; ++e) g[e] = f * (sc.ex[e] / sumex);
      } else {
        std::fill_n(g, E, S(0));
      }
      if (a) {
        // L = sum_e a_e P_e with P = s / (sum s + eps): dL/ds_e = a_e/den - <a, s>/den^2.
        S* dls = sc.grow.data();
        const S den = rmath::sum_of(sc.key.data(), E) + static_cast<S>(kNormEps);
        const S c2 = rmath::dot_of(a, sc.key.data(), E) / den / den;  // den^2 may underflow
        for (int64_t e = 0; e < E; ++e) dls[e] = a[e] / den - c2;
        if (p.score_function == kScoreSigmoid) {
          for (int64_t e = 0; e < E; ++e) g[e] += dls[e] * (sc.key[e] * (S(1) - sc.key[e]));
        } else {
          for (int64_t e = 0; e < E; ++e) {
            g[e] += dls[e] * score_derivative(p.score_function, z[e], sc.key[e]);
          }
        }
      }
      if (grad_w) {
        if (K > 1) {
          S sum = 0;
          for (int64_t k = 0; k < K; ++k) sum += sc.key[ids[k]];
          const S den = sum + static_cast<S>(kNormEps);
          S dot = 0;
          for (int64_t k = 0; k < K; ++k) dot += gw[k] * sc.key[ids[k]];
          for (int64_t k = 0; k < K; ++k) {
            const int32_t e = ids[k];
            const S ds = gw[k] / den - dot / den / den;  // den^2 may underflow
            g[e] += ds * score_derivative(p.score_function, z[e], sc.key[e]);
          }
        } else {
          const int32_t e = ids[0];
          g[e] += gw[0] * score_derivative(p.score_function, z[e], sc.key[e]);
        }
      }
    }
  }
}

template <class S>
void sinkhorn_select(const S* logits, const uint8_t* use_row, int64_t T, int64_t E, int64_t K,
                     double tol, int32_t* ids) {
  std::vector<int64_t> rows;
  for (int64_t t = 0; t < T; ++t) {
    if (use_row[t]) rows.push_back(t);
  }
  const int64_t n = static_cast<int64_t>(rows.size());
  if (n == 0) return;
  double zmax = -std::numeric_limits<double>::infinity();
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t e = 0; e < E; ++e)
      zmax = std::max(zmax, static_cast<double>(logits[rows[r] * E + e]));
  }
  // Megatron's cost is exp(z); a common factor exp(-zmax) is absorbed by d0 (and d1) exactly in
  // exact arithmetic, except against the 1e-8 guards, which it makes relatively larger. Megatron
  // overflows to inf above z = 88 in fp32; we shift only when that would happen in double.
  const double shift = zmax > 700.0 ? zmax : 0.0;
  std::vector<double> cost(static_cast<size_t>(n * E));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t e = 0; e < E; ++e) {
      cost[r * E + e] = std::exp(static_cast<double>(logits[rows[r] * E + e]) - shift);
    }
  }
  constexpr double eps = 1e-8;
  std::vector<double> d0(static_cast<size_t>(n), 1.0), d1(static_cast<size_t>(E), 1.0),
      d1_old(static_cast<size_t>(E), 1.0), colsum(static_cast<size_t>(E));
  double error = 1e9;
  while (error > tol) {
    for (int64_t r = 0; r < n; ++r) {
      double acc = 0.0;
      for (int64_t e = 0; e < E; ++e) acc += d1[e] * cost[r * E + e];
      d0[r] = (1.0 / static_cast<double>(n)) * 1.0 / (acc + eps);
    }
    std::fill(colsum.begin(), colsum.end(), 0.0);
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t e = 0; e < E; ++e) colsum[e] += d0[r] * cost[r * E + e];
    }
    error = 0.0;
    for (int64_t e = 0; e < E; ++e) {
      d1[e] = (1.0 / static_cast<double>(E)) * 1.0 / (colsum[e] + eps);
      error += std::fabs(d1_old[e] - d1[e]);
    }
    error /= static_cast<double>(E);
    d1_old = d1;
  }
  std::vector<double> norm(static_cast<size_t>(E)), top(static_cast<size_t>(E));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t e = 0; e < E; ++e) norm[e] = d1[e] * cost[r * E + e] * d0[r];
    int64_t cnt = 0;
    insert_topk(norm.data(), 0, E, K, static_cast<const uint8_t*>(nullptr),
                -std::numeric_limits<double>::infinity(), top.data(), ids + rows[r] * K, cnt);
  }
}

#define SY_INSTANTIATE(S)                                                                          \
  template void route_forward<S>(const S*, const S*, const uint8_t*, const int32_t*,               \
                                 const RouteKernelParams&, int32_t*, S*, double*, int64_t*,        \
                                 double*);                                                         \
  template void route_backward<S>(const S*, const int32_t*, const int32_t*, const uint8_t*,        \
                                  const S*, const RouteKernelParams&, const double*, double, S*);  \
  template void sinkhorn_select<S>(const S*, const uint8_t*, int64_t, int64_t, int64_t, double,    \
                                   int32_t*);
SY_INSTANTIATE(float)
SY_INSTANTIATE(double)
#undef SY_INSTANTIATE

}  // namespace switchyard::cpu::SY_ISA_NS
