// The router's losses (Megatron-Core moe_utils / router.py): cross-rank sums in rank order, the
// error and settings agreement before them, the loss values and gradient coefficients, and the
// write into the caller's GlobalAuxLossState. Everything is summed in a fixed order
// (deterministic).
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "check.h"
#include "router_internal.h"
#include "switchyard/router.h"

namespace switchyard::detail {

template <class T>
void sum_over_ranks(dist::Communicator& c, T* v, int64_t n) {
  if (c.size() == 1 || n == 0) return;
  std::vector<T> all(static_cast<size_t>(n * c.size()));
  c.allgather(v, all.data(), n, sizeof(T));
  for (int64_t i = 0; i < n; ++i) {
    T s = 0;
    for (int r = 0; r < c.size(); ++r) s += all[static_cast<size_t>(r * n + i)];
    v[i] = s;
  }
}

std::vector<dist::detail::Setting> route_settings(const RouterConfig& config, int64_t groups,
                                                  bool training, const RouteComms& comms) {
  const LbCoeffs lb = lb_coeffs(config);
  return {{"num_experts", config.num_experts},
          {"top_k", config.top_k},
          {"training", training ? 1 : 0, true},  // eval computes no loss: no reduction at all
          {"aux_loss", lb.aux > 0.0 ? 1 : 0, true},
          {"seq_aux_loss", lb.seq > 0.0 ? 1 : 0, true},
          {"global_aux_loss", lb.global > 0.0 ? 1 : 0, true},
          {"num_sequences (num_tokens / seq_length)", lb.seq > 0.0 ? groups : 1},
          {"loss_comm given", comms.loss ? 1 : 0, true},
          {"global_aux_loss_comm given", comms.global_aux_loss ? 1 : 0, true}};
}

void agree_route(const RouteComms& comms, const std::string& local_error,
                 std::vector<dist::detail::Setting> settings) {
  if (!local_error.empty()) {
    // Values are not read when a rank failed (its config may not even be valid); the count must
    // still match everywhere.
    settings.assign(route_settings(RouterConfig{}, 1, true, comms).size(), {"", 0});
  }
  // Both exchanges run before anything is thrown: a rank of the global group outside this loss
  // group must hear of its failure too (a disagreement on loss_comm travels as an agreed error).
  std::string e;
  if (comms.loss) {
    e = dist::detail::agreed_error(kRouteOp, "loss_comm", local_error, false, settings,
                                   *comms.loss);
  }
  if (comms.global_aux_loss) {
    const bool agreed = !e.empty();
    e = dist::detail::agreed_error(kRouteOp, "global_aux_loss_comm", agreed ? e : local_error,
                                   agreed, settings, *comms.global_aux_loss);
  }
  if (!e.empty()) throw std::invalid_argument(e);
}

template void sum_over_ranks<int64_t>(dist::Communicator&, int64_t*, int64_t);
template void sum_over_ranks<double>(dist::Communicator&, double*, int64_t);

void finish_losses(const RouterConfig& config, LossSums& sums, dist::Communicator* loss_comm,
                   dist::Communicator* global_comm, GlobalAuxLossState* state,
                   GlobalAuxLossUpdate update, RouteResult& r, RouteSaved& saved) {
  const int64_t T = sums.num_tokens, E = config.num_experts, K = config.top_k;
  const int64_t G = sums.groups;
  const LbCoeffs lb = lb_coeffs(config);
  const bool need_aux = lb.any();
  const int64_t num_valid_local = T - r.num_padded_rows;
  // Megatron sums the per-expert counts and the token counts over tp_cp (aux, seq) and tp_dp_cp
  // (global); the score sums stay local.
  int64_t num_valid = num_valid_local, num_valid_global = num_valid_local;
  std::vector<int64_t> cnt_global_local;  // this rank's counts over all groups, for global_comm
  if (need_aux && lb.global > 0.0) {
    cnt_global_local.assign(static_cast<size_t>(E), 0);
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t e = 0; e < E; ++e) cnt_global_local[e] += sums.aux_cnt[g * E + e];
    }
  }
  if (loss_comm) {
    sum_over_ranks(*loss_comm, &num_valid, 1);
    if (need_aux) sum_over_ranks(*loss_comm, sums.aux_cnt.data(), G * E);
  }
  if (global_comm) {
    sum_over_ranks(*global_comm, &num_valid_global, 1);
    if (need_aux && lb.global > 0.0) sum_over_ranks(*global_comm, cnt_global_local.data(), E);
  } else if (loss_comm) {
    num_valid_global = num_valid;  // no separate group: the loss group's totals
    if (need_aux && lb.global > 0.0) sum_over_ranks(*loss_comm, cnt_global_local.data(), E);
  }
  const double loss_comm_size = loss_comm ? static_cast<double>(loss_comm->size()) : 1.0;
  // Megatron's calculate_per_token_loss attaches loss * num_local_tokens (valid tokens) to the
  // gradient and logs the loss itself; an MTP layer run mtp_num_layers times divides its
  // load-balancing losses by that count (value and gradient) and its z-loss in the log only (the
  // value here, not the gradient).
  const double per_token =
      config.calculate_per_token_loss ? static_cast<double>(num_valid_local) * loss_comm_size : 1.0;
  const double mtp =
      (config.is_mtp_layer && config.mtp_use_repeated_layer && config.mtp_num_layers > 0)
          ? 1.0 / static_cast<double>(config.mtp_num_layers)
          : 1.0;
  if (need_aux) {
    saved.aux_groups = G;
    saved.aux_grad = Tensor::zeros({G, E}, DType::fp64);
    double* ag = saved.aux_grad.data<double>();
    // Batch counts and score sums over all sequence groups (aux_loss, global_aux_loss), added in
    // group order (a single group when there is no seq_aux_loss: the values themselves).
    std::vector<double> cnt1(static_cast<size_t>(E), 0.0), psum1(static_cast<size_t>(E), 0.0);
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t e = 0; e < E; ++e) {
        cnt1[e] += static_cast<double>(sums.aux_cnt[g * E + e]);
        psum1[e] += sums.aux_psum[g * E + e];
      }
    }
    const double n = static_cast<double>(num_valid);
    auto coeff_f = [&](double coeff, double n_tokens, double div) {
      return coeff * static_cast<double>(E) / (static_cast<double>(K) * n_tokens * n_tokens) / div *
             mtp;
    };
    // aux_loss: switch_load_balancing_loss_func on this batch's counts.
    if (lb.aux > 0.0 && n > 0.0) {
      const double f = coeff_f(lb.aux, n, 1.0);
      double loss = 0.0;
      for (int64_t e = 0; e < E; ++e) loss += f * cnt1[e] * psum1[e];
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t e = 0; e < E; ++e) ag[g * E + e] += f * cnt1[e];
      }
      r.aux_loss_parts.aux_loss = loss;
    }
    // seq_aux_loss: per sequence group, N = tokens per sequence, divided by the sequence count.
    if (lb.seq > 0.0 && n > 0.0) {
      const double f = coeff_f(lb.seq, n / static_cast<double>(G), static_cast<double>(G));
      double loss = 0.0;
      for (int64_t i = 0; i < G * E; ++i) {
        loss += f * static_cast<double>(sums.aux_cnt[i]) * sums.aux_psum[i];
        ag[i] += f * static_cast<double>(sums.aux_cnt[i]);
      }
      r.aux_loss_parts.seq_aux_loss = loss;
    }
    // global_aux_loss: the running mean of the counts. The loss always sees the state plus this
    // batch; only an accumulating call keeps it.
    if (lb.global > 0.0) {
      std::vector<double> acc(static_cast<size_t>(E), 0.0);
      if (state->num_tokens_per_expert.defined())
        acc = state->num_tokens_per_expert.to_double_vector();
      for (int64_t e = 0; e < E; ++e) acc[e] += static_cast<double>(cnt_global_local[e]);
      const int64_t steps = state->steps + 1;
      if (update == GlobalAuxLossUpdate::accumulate) {
        if (!state->num_tokens_per_expert.defined()) {
          state->num_tokens_per_expert = Tensor::zeros({E}, DType::fp64);
        }
        std::copy(acc.begin(), acc.end(), state->num_tokens_per_expert.data<double>());
        state->steps = steps;
      }
      const double ng = static_cast<double>(num_valid_global);
      if (ng > 0.0) {
        const double f = coeff_f(lb.global, ng, 1.0);
        double loss = 0.0;
        for (int64_t e = 0; e < E; ++e) {
          const double c = acc[e] / static_cast<double>(steps);
          loss += f * c * psum1[e];
          for (int64_t g = 0; g < G; ++g) ag[g * E + e] += f * c;
        }
        r.aux_loss_parts.global_aux_loss = loss;
      }
    }
    r.aux_loss = r.aux_loss_parts.aux_loss + r.aux_loss_parts.seq_aux_loss +
                 r.aux_loss_parts.global_aux_loss;
    if (per_token != 1.0) {
      for (int64_t i = 0; i < G * E; ++i) ag[i] *= per_token;
    }
  }
  if (config.z_loss_coeff > 0.0) {
    // Megatron: the mean over this rank's tokens with coefficient / tp_cp size.
    const double nz = static_cast<double>(std::max<int64_t>(num_valid_local, 1));
    const double zc = config.z_loss_coeff / loss_comm_size;
    r.z_loss = zc * sums.z_sum / nz * mtp;
    saved.z_grad_coeff = 2.0 * zc / nz * per_token;
  }
}

}  // namespace switchyard::detail
