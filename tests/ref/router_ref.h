// Double-precision reference of the router, written from the formulas (DESIGN.md "Semantics" and
// Megatron-Core moe_utils.py / router.py) with plain loops and full sorts; it shares no code with
// the kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

#include "switchyard/router.h"

namespace switchyard::ref {

struct RefRouteInputs {
  std::vector<double> bias;        // [E] or empty
  std::vector<uint8_t> padded;     // [T] or empty (1 = padded)
  std::vector<int32_t> replay;     // [T,K] or empty; only fully valid rows are replayed
  int64_t seq_length = 0;          // seq_aux_loss
  std::vector<double> global_acc;  // global_aux_loss: accumulated counts before this call
  int64_t global_steps = 0;
};

struct RefRoute {
  std::vector<int32_t> selected;  // [T,K] before capacity
  std::vector<int32_t> idx;       // [T,K] after capacity
  std::vector<double> w;          // [T,K]
  std::vector<int64_t> counts;    // [E]
  int64_t num_dropped = 0;
  int64_t capacity = -1;
  double aux_loss = 0.0;
  double z_loss = 0.0;
  int64_t replayed = 0, native = 0, padded = 0;
};

/// Ids of the k largest keys (ties: lower id), among `allowed` when given; by a full sort.
/// With `tie` given, equal keys are ordered by the larger tie value first (the logit), then id.
inline std::vector<int32_t> topk_ids(const std::vector<double>& key, int64_t k,
                                     const std::vector<bool>* allowed = nullptr,
                                     const std::vector<double>* tie = nullptr) {
  std::vector<int32_t> ids;
  for (size_t e = 0; e < key.size(); ++e) {
    if (!allowed || (*allowed)[e]) ids.push_back(static_cast<int32_t>(e));
  }
  std::sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) {
    if (key[a] != key[b]) return key[a] > key[b];
    if (tie && (*tie)[a] != (*tie)[b]) return (*tie)[a] > (*tie)[b];
    return a < b;
  });
  ids.resize(static_cast<size_t>(k));
  return ids;
}

inline double sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }
inline double softplus(double z) {
  return z > 0 ? z + std::log1p(std::exp(-z)) : std::log1p(std::exp(z));
}

/// Scores s = f(z) for the sigmoid family.
inline double score_of(ScoreFunction f, double z) {
  return f == ScoreFunction::sigmoid ? sigmoid(z) : std::sqrt(softplus(z));
}

inline std::vector<double> softmax(const std::vector<double>& z) {
  double m = -INFINITY;
  for (double v : z) m = std::max(m, v);
  double s = 0;
  for (double v : z) s += std::exp(v - m);
  std::vector<double> p(z.size());
  for (size_t i = 0; i < z.size(); ++i) p[i] = std::exp(z[i] - m) / s;
  return p;
}

inline bool valid_replay_row(const int32_t* row, int64_t K, int64_t E) {
  std::vector<bool> seen(static_cast<size_t>(E), false);
  for (int64_t k = 0; k < K; ++k) {
    if (row[k] < 0 || row[k] >= E || seen[row[k]]) return false;
    seen[row[k]] = true;
  }
  return true;
}

/// Full routing of T tokens from logits z [T,E] in double.
inline RefRoute route(const std::vector<double>& z, int64_t T, const RouterConfig& c,
                      const RefRouteInputs& in) {
  const int64_t E = c.num_experts, K = c.top_k;
  RefRoute r;
  r.selected.assign(static_cast<size_t>(T * K), -1);
  r.w.assign(static_cast<size_t>(T * K), 0.0);
  std::vector<double> aux_p, aux_c;  // [G,E]
  const bool aux = c.aux_loss_type != AuxLossType::none && c.aux_loss_coeff > 0;
  const int64_t G = (aux && c.aux_loss_type == AuxLossType::seq_aux_loss)
                        ? std::max<int64_t>(T / in.seq_length, 1)
                        : 1;
  aux_p.assign(static_cast<size_t>(G * E), 0.0);
  aux_c.assign(static_cast<size_t>(G * E), 0.0);
  double zsum = 0;
  int64_t nvalid = 0;
  for (int64_t t = 0; t < T; ++t) {
    if (!in.padded.empty() && in.padded[t]) {
      ++r.padded;
      continue;
    }
    ++nvalid;
    std::vector<double> zt(z.begin() + t * E, z.begin() + (t + 1) * E);
    // Scores used for selection and weights.
    std::vector<double> s(static_cast<size_t>(E));
    const bool sm = c.score_function == ScoreFunction::softmax;
    if (sm && c.pre_softmax) {
      s = softmax(zt);
    } else if (sm) {
      s = zt;
    } else {
      for (int64_t e = 0; e < E; ++e) s[e] = score_of(c.score_function, zt[e]);
    }
    std::vector<int32_t> ids;
    const int32_t* rrow = in.replay.empty() ? nullptr : in.replay.data() + t * K;
    bool all_none = true;
    if (rrow) {
      for (int64_t k = 0; k < K; ++k) all_none = all_none && rrow[k] == -1;
    }
    if (rrow && !all_none && valid_replay_row(rrow, K, E)) {
      ids.assign(rrow, rrow + K);
      ++r.replayed;
    } else {
      ++r.native;
      // Selection order (issue 14): every score is increasing in the logit, so without bias the
      // order is the logit order; with bias it is s + bias, equal keys by the logit, then id.
      std::vector<double> key = s;
      if (!in.bias.empty()) {
        for (int64_t e = 0; e < E; ++e) key[e] += in.bias[e];
      }
      const std::vector<double>& sel = in.bias.empty() ? zt : key;
      if (c.num_groups > 0) {
        // Group score: sum of the group's top m keys (s + bias); equal scores go to the group
        // whose top-m logits are larger (compared in descending order), then the lower group.
        const int64_t per = E / c.num_groups, m = K / c.group_topk;
        std::vector<double> gs(static_cast<size_t>(c.num_groups));
        std::vector<std::vector<double>> gz(static_cast<size_t>(c.num_groups));
        for (int64_t g = 0; g < c.num_groups; ++g) {
          std::vector<double> sub_sel(sel.begin() + g * per, sel.begin() + (g + 1) * per);
          std::vector<double> sub_z(zt.begin() + g * per, zt.begin() + (g + 1) * per);
          gs[g] = 0;
          for (int32_t j : topk_ids(sub_sel, m, nullptr, &sub_z)) {
            gs[g] += key[g * per + j];
            gz[g].push_back(sub_z[j]);
          }
        }
        std::vector<int32_t> order(static_cast<size_t>(c.num_groups));
        std::iota(order.begin(), order.end(), 0);
        std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
          if (gs[a] != gs[b]) return gs[a] > gs[b];
          if (gz[a] != gz[b]) return gz[a] > gz[b];  // lexicographic, descending
          return a < b;
        });
        std::vector<bool> allowed(static_cast<size_t>(E), false);
        for (int64_t j = 0; j < c.group_topk; ++j) {
          for (int64_t i = 0; i < per; ++i) allowed[order[j] * per + i] = true;
        }
        ids = topk_ids(sel, K, &allowed, &zt);
      } else {
        ids = topk_ids(sel, K, nullptr, &zt);
      }
    }
    // Weights at ids.
    std::vector<double> w(static_cast<size_t>(K));
    if (sm && !c.pre_softmax) {
      std::vector<double> zs(static_cast<size_t>(K));
      for (int64_t k = 0; k < K; ++k) zs[k] = zt[ids[k]];
      w = softmax(zs);
    } else if (sm) {
      for (int64_t k = 0; k < K; ++k) w[k] = s[ids[k]];
    } else {
      double sum = 0;
      for (int64_t k = 0; k < K; ++k) sum += s[ids[k]];
      for (int64_t k = 0; k < K; ++k) w[k] = K > 1 ? s[ids[k]] / (sum + 1e-20) : s[ids[k]];
    }
    for (int64_t k = 0; k < K; ++k) {
      r.selected[t * K + k] = ids[k];
      r.w[t * K + k] = w[k] * c.topk_scaling_factor;
    }
    if (aux) {
      std::vector<double> P;
      if (sm) {
        P = softmax(zt);
      } else {
        P.resize(static_cast<size_t>(E));
        double sum = 0;
        for (int64_t e = 0; e < E; ++e) sum += score_of(c.score_function, zt[e]);
        for (int64_t e = 0; e < E; ++e) P[e] = score_of(c.score_function, zt[e]) / (sum + 1e-20);
      }
      const int64_t g = t % G;
      for (int64_t e = 0; e < E; ++e) aux_p[g * E + e] += P[e];
      for (int32_t e : topk_ids(zt, K)) aux_c[g * E + e] += 1;  // P is increasing in z
    }
    if (c.z_loss_coeff > 0) {
      double m = -INFINITY;
      for (double v : zt) m = std::max(m, v);
      double s2 = 0;
      for (double v : zt) s2 += std::exp(v - m);
      const double lse = m + std::log(s2);
      zsum += lse * lse;
    }
  }
  // Capacity.
  r.idx = r.selected;
  r.counts.assign(static_cast<size_t>(E), 0);
  if (c.capacity_factor) {
    // Megatron: C = ceil(T*K/E * factor); when C > T nothing is dropped and padding fills T rows.
    r.capacity = std::min<int64_t>(
        T, static_cast<int64_t>(std::ceil(static_cast<double>(T * K) / E * *c.capacity_factor)));
    for (int64_t e = 0; e < E; ++e) {
      std::vector<int64_t> slots;  // in token order
      for (int64_t i = 0; i < T * K; ++i) {
        if (r.selected[i] == e) slots.push_back(i);
      }
      if (static_cast<int64_t>(slots.size()) <= r.capacity) continue;
      std::vector<int64_t> order = slots;
      if (c.token_drop_policy == TokenDropPolicy::probs) {
        std::sort(order.begin(), order.end(),
                  [&](int64_t a, int64_t b) { return r.w[a] != r.w[b] ? r.w[a] > r.w[b] : a < b; });
      }
      for (size_t j = static_cast<size_t>(r.capacity); j < order.size(); ++j) {
        r.idx[order[j]] = -1;
        r.w[order[j]] = 0;
        ++r.num_dropped;
      }
    }
  }
  for (int32_t e : r.idx) {
    if (e >= 0) ++r.counts[e];
  }
  // Losses (Megatron-Core switch_load_balancing_loss_func, seq and global variants, z_loss_func).
  if (aux) {
    double N = static_cast<double>(nvalid), div = 1.0;
    std::vector<double> cnt = aux_c;
    if (c.aux_loss_type == AuxLossType::seq_aux_loss) {
      N = static_cast<double>(nvalid) / G;
      div = static_cast<double>(G);
    } else if (c.aux_loss_type == AuxLossType::global_aux_loss) {
      for (int64_t e = 0; e < E; ++e) {
        const double acc = (in.global_acc.empty() ? 0.0 : in.global_acc[e]) + aux_c[e];
        cnt[e] = acc / static_cast<double>(in.global_steps + 1);
      }
    }
    if (N > 0) {
      double sum = 0;
      for (int64_t i = 0; i < G * E; ++i) sum += aux_p[i] * cnt[i];
      r.aux_loss = sum * c.aux_loss_coeff * E / (K * N * N) / div;
    }
  }
  if (c.z_loss_coeff > 0) r.z_loss = c.z_loss_coeff * zsum / std::max<int64_t>(nvalid, 1);
  return r;
}

}  // namespace switchyard::ref
