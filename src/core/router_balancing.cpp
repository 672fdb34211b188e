// Balancing by selection: sinkhorn routing and quantile balancing (the native rows' ids come from
// a batch-level rule and then route like replayed rows), and the aux-loss-free expert-bias update.
#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "check.h"
#include "router_internal.h"
#include "switchyard/router.h"

namespace switchyard {
namespace detail {

Tensor sinkhorn_rows(const Tensor& logits, const Tensor& replay, const uint8_t* kind, int64_t T,
                     int64_t E, int64_t K, uint8_t* kernel_kind) {
  Tensor sink = Tensor::empty({T, K}, DType::int32, logits.device());
  const backend::Context ctx = backend::context_of(logits, kRouteOp);
  const int32_t* rp = replay.defined() ? replay.data<int32_t>() : nullptr;
  if (logits.dtype() == DType::fp64) {
    backend::sinkhorn_rows(ctx, logits.data<double>(), rp, kind, T, E, K, 1e-4,
                           sink.data<int32_t>(), kernel_kind);
  } else {
    backend::sinkhorn_rows(ctx, logits.data<float>(), rp, kind, T, E, K, 1e-4, sink.data<int32_t>(),
                           kernel_kind);
  }
  return sink;
}

Tensor quantile_balancing_rows(const Tensor& logits, const Tensor& qb_beta, const Tensor& replay,
                               const uint8_t* kind, int64_t T, int64_t E, int64_t K, bool training,
                               uint8_t* kernel_kind, RouteResult& r) {
  // Megatron's qb_dual_update on the fp32 logits (the kernel: cpu/routing_kernels.h).
  std::vector<float> beta(static_cast<size_t>(E), 0.0f);
  if (qb_beta.defined()) std::copy_n(qb_beta.data<float>(), E, beta.data());
  const Tensor z32 = logits.dtype() == DType::fp64 ? logits.to(DType::fp32) : logits;
  Tensor sel = Tensor::empty({T, K}, DType::int32, logits.device());
  float* beta_local = nullptr;
  if (training && T > 0) {
    r.qb_beta_local = Tensor::empty({E}, DType::fp32, logits.device());
    beta_local = r.qb_beta_local.data<float>();
  }
  backend::quantile_balancing_rows(backend::context_of(logits, kRouteOp), z32.data<float>(),
                                   beta.data(), replay.defined() ? replay.data<int32_t>() : nullptr,
                                   kind, T, E, K, sel.data<int32_t>(), kernel_kind, beta_local);
  return sel;
}

}  // namespace detail

namespace {

// Validates, returns the counts as doubles.
std::vector<double> expert_bias_counts(const Tensor& expert_bias,
                                       const Tensor& num_tokens_per_expert, double rate) {
  constexpr const char* op = "update_expert_bias";
  detail::check_dtype(expert_bias, op, "expert_bias", {DType::fp32});
  detail::check_dim(expert_bias, op, "expert_bias", 1);
  const int64_t E = expert_bias.size(0);
  detail::check_dtype(num_tokens_per_expert, op, "num_tokens_per_expert",
                      {DType::int64, DType::int32, DType::fp32, DType::fp64});
  detail::check_shape(num_tokens_per_expert, op, "num_tokens_per_expert", {E});
  if (!std::isfinite(rate)) detail::fail_arg(op, "rate must be finite, got ", rate);
  return num_tokens_per_expert.to_double_vector();
}

Tensor expert_bias_step(const Tensor& expert_bias, const std::vector<double>& c, double rate) {
  const int64_t E = expert_bias.size(0);
  double sum = 0.0;
  for (double v : c) sum += v;
  Tensor out = Tensor::empty({E}, DType::fp32);
  const float* b = expert_bias.data<float>();
  float* o = out.data<float>();
  const float rate_f = static_cast<float>(rate);
  for (int64_t e = 0; e < E; ++e) {
    // sign(mean - c) compared as sum vs E*c, exact for integer counts below 2^53.
    const double lhs = sum, rhs = static_cast<double>(E) * c[e];
    const float sgn = lhs > rhs ? 1.0f : (lhs < rhs ? -1.0f : 0.0f);
    o[e] = b[e] + sgn * rate_f;
  }
  return out;
}

}  // namespace

Tensor update_expert_bias(const Tensor& expert_bias, const Tensor& num_tokens_per_expert,
                          double rate) {
  return expert_bias_step(expert_bias, expert_bias_counts(expert_bias, num_tokens_per_expert, rate),
                          rate);
}

namespace {

/// The agreement of a collective update over `comm`: runs `local` (the local checks, returning
/// the per-expert values), then one small exchange of {error, number of experts}; every rank
/// throws the same std::invalid_argument when any rank failed or the expert counts differ, before
/// the values are reduced (an allgather of different lengths would fail on one rank only).
template <class Local>
std::vector<double> agreed_values(const char* op, dist::Communicator& comm, Local local) {
  std::vector<double> v;
  std::string err;
  try {
    v = local();
  } catch (const std::invalid_argument& e) {
    err = e.what();
  }
  const std::string e = dist::detail::agreed_error(
      op, "comm", err, false, {{"num_experts", static_cast<int64_t>(v.size())}}, comm);
  if (!e.empty()) throw std::invalid_argument(e);
  return v;
}

}  // namespace

Tensor update_expert_bias(const Tensor& expert_bias, const Tensor& num_tokens_per_expert,
                          double rate, dist::Communicator& comm) {
  std::vector<double> c = agreed_values("update_expert_bias", comm, [&] {
    return expert_bias_counts(expert_bias, num_tokens_per_expert, rate);
  });
  // Counts are integers (exact in double below 2^53): the sum does not depend on the order.
  detail::sum_over_ranks(comm, c.data(), static_cast<int64_t>(c.size()));
  return expert_bias_step(expert_bias, c, rate);
}

namespace {

constexpr const char* kQbOp = "update_qb_beta";

// Validates; returns this rank's mean quantile avg = accum / max(count, 1), in double.
std::vector<double> qb_local_average(const Tensor& qb_beta, const Tensor& accum, int64_t count,
                                     double ema) {
  detail::check_dtype(qb_beta, kQbOp, "qb_beta", {DType::fp32});
  detail::check_dim(qb_beta, kQbOp, "qb_beta", 1);
  const int64_t E = qb_beta.size(0);
  detail::check_dtype(accum, kQbOp, "qb_beta_accum", {DType::fp32});
  detail::check_shape(accum, kQbOp, "qb_beta_accum", {E});
  if (count < 0) detail::fail_arg(kQbOp, "count must be >= 0, got count=", count);
  if (!std::isfinite(ema) || ema < 0.0 || ema > 1.0) {
    detail::fail_arg(kQbOp, "ema must be in [0, 1], got ema=", ema);
  }
  std::vector<double> avg(static_cast<size_t>(E));
  // Megatron: accum / count.clamp(min=1) in fp32; the fp32 quotient, then double.
  const float n = static_cast<float>(std::max<int64_t>(count, 1));
  for (int64_t e = 0; e < E; ++e) avg[e] = static_cast<double>(accum.data<float>()[e] / n);
  return avg;
}

Tensor qb_blend(const Tensor& qb_beta, const std::vector<double>& avg, double ema) {
  const int64_t E = qb_beta.size(0);
  std::vector<double> nb(static_cast<size_t>(E));
  double mean = 0.0;
  for (int64_t e = 0; e < E; ++e) {
    nb[e] = ema * static_cast<double>(qb_beta.data<float>()[e]) + (1.0 - ema) * avg[e];
    mean += nb[e];
  }
  mean /= static_cast<double>(std::max<int64_t>(E, 1));
  Tensor out = Tensor::empty({E}, DType::fp32);
  for (int64_t e = 0; e < E; ++e) out.data<float>()[e] = static_cast<float>(nb[e] - mean);
  return out;
}

}  // namespace

Tensor update_qb_beta(const Tensor& qb_beta, const Tensor& qb_beta_accum, int64_t count,
                      double ema) {
  return qb_blend(qb_beta, qb_local_average(qb_beta, qb_beta_accum, count, ema), ema);
}

Tensor update_qb_beta(const Tensor& qb_beta, const Tensor& qb_beta_accum, int64_t count,
                      double ema, dist::Communicator& comm) {
  std::vector<double> avg = agreed_values(
      kQbOp, comm, [&] { return qb_local_average(qb_beta, qb_beta_accum, count, ema); });
  const int64_t E = static_cast<int64_t>(avg.size());
  // Mean over the ranks, summed in rank order (deterministic whatever MPI would do).
  detail::sum_over_ranks(comm, avg.data(), E);
  for (double& a : avg) a /= static_cast<double>(comm.size());
  return qb_blend(qb_beta, avg, ema);
}

void fail_router_collective(RouterCollective op, const std::string& message,
                            const RouteComms& comms) {
  const std::string err = message.empty() ? std::string("failed before the call") : message;
  if (op == RouterCollective::topk_route) {
    detail::agree_route(comms, err, {});  // throws: this rank failed
  } else if (comms.loss) {
    const char* name = op == RouterCollective::update_expert_bias ? "update_expert_bias" : kQbOp;
    agreed_values(name, *comms.loss, [&]() -> std::vector<double> {
      throw std::invalid_argument(err);  // this rank's failure, into the agreement
    });
  }
  throw std::invalid_argument(err);
}

}  // namespace switchyard
