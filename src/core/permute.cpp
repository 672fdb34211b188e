// Front-end of permute / unpermute: validate, allocate, pick the kernel by dtype; the kernels run
// through the backend seam (src/backend/backend.h). No math here.
#include "switchyard/permute.h"

#include "backend/backend.h"
#include "check.h"

namespace switchyard {

namespace {

void check_plan(const RoutingPlan& plan, const char* op) {
  if (!plan.row_token.defined() || !plan.token_offsets.defined() || !plan.slot_row.defined()) {
    detail::fail_arg(op, "plan must come from build_routing_plan, got an empty plan");
  }
}

// The kernels read the plan's maps and the rows on one device (the rows' device).
void check_plan_device(const RoutingPlan& plan, const char* op, const Device& device) {
  detail::check_device(plan.row_token, op, "plan.row_token", device);
}

void check_rows(const Tensor& t, const char* op, const char* name, int64_t rows) {
  detail::check_defined(t, op, name);
  detail::check_dim(t, op, name, 2);
  detail::check_dtype(t, op, name, {DType::fp32, DType::bf16});
  if (t.size(0) != rows) {
    detail::fail_arg(op, name, " must have ", rows, " rows (from the routing plan), got shape ",
                     shape_str(t.shape()));
  }
}

void check_out(const Tensor& out, const char* op, const Shape& shape, DType dtype,
               const Device& device) {
  detail::check_defined(out, op, "out");
  detail::check_device(out, op, "out", device);
  detail::check_dtype(out, op, "out", {dtype});
  detail::check_shape(out, op, "out", shape);
}

}  // namespace

Tensor permute(const Tensor& x, const RoutingPlan& plan) {
  check_plan(plan, "permute");
  check_rows(x, "permute", "x", plan.num_tokens);
  Tensor out = Tensor::empty({plan.num_rows, x.size(1)}, x.dtype(), x.device());
  permute_into(x, out, plan);
  return out;
}

void permute_into(const Tensor& x, Tensor& out, const RoutingPlan& plan) {
  check_plan(plan, "permute");
  check_rows(x, "permute", "x", plan.num_tokens);
  const int64_t H = x.size(1);
  check_out(out, "permute", {plan.num_rows, H}, x.dtype(), x.device());
  check_plan_device(plan, "permute", x.device());
  backend::gather_rows(backend::context_of(x, "permute"), x.raw(), plan.row_token.data<int64_t>(),
                       plan.num_rows, H * static_cast<int64_t>(dtype_size(x.dtype())), out.raw());
}

Tensor permute_backward(const Tensor& grad_permuted, const RoutingPlan& plan) {
  return unpermute(grad_permuted, plan, UnpermuteOptions{WeightMode::skip});
}

Tensor unpermute(const Tensor& permuted, const RoutingPlan& plan, const UnpermuteOptions& options) {
  check_plan(plan, "unpermute");
  check_rows(permuted, "unpermute", "permuted", plan.num_rows);
  Tensor out =
      Tensor::empty({plan.num_tokens, permuted.size(1)}, permuted.dtype(), permuted.device());
  unpermute_into(permuted, out, plan, options);
  return out;
}

void unpermute_into(const Tensor& permuted, Tensor& out, const RoutingPlan& plan,
                    const UnpermuteOptions& options) {
  check_plan(plan, "unpermute");
  check_rows(permuted, "unpermute", "permuted", plan.num_rows);
  const int64_t H = permuted.size(1);
  check_out(out, "unpermute", {plan.num_tokens, H}, permuted.dtype(), permuted.device());
  check_plan_device(plan, "unpermute", permuted.device());
  const float* w = options.weights == WeightMode::apply ? plan.row_weight.data<float>() : nullptr;
  backend::by_row_dtype(permuted.dtype(), [&](auto tag) {
    using X = decltype(tag);
    backend::combine_rows<X>(backend::context_of(permuted, "unpermute"),
                             static_cast<const X*>(permuted.raw()), w,
                             plan.token_offsets.data<int64_t>(), plan.token_rows.data<int64_t>(),
                             plan.num_tokens, H, static_cast<X*>(out.raw()));
  });
}

Tensor rows_to_slots(const Tensor& row_values, const RoutingPlan& plan) {
  check_plan(plan, "rows_to_slots");
  detail::check_defined(row_values, "rows_to_slots", "row_values");
  detail::check_dtype(row_values, "rows_to_slots", "row_values", {DType::fp32});
  detail::check_shape(row_values, "rows_to_slots", "row_values", {plan.num_rows});
  Tensor out = Tensor::empty({plan.num_tokens, plan.top_k}, DType::fp32);
  backend::rows_to_slots(backend::context_of(row_values, "rows_to_slots"), row_values.data<float>(),
                         plan.slot_row.data<int64_t>(), plan.num_tokens * plan.top_k,
                         out.data<float>());
  return out;
}

UnpermuteGrads unpermute_backward(const Tensor& grad_y, const Tensor& permuted,
                                  const RoutingPlan& plan, const UnpermuteOptions& options) {
  check_plan(plan, "unpermute_backward");
  check_rows(grad_y, "unpermute_backward", "grad_y", plan.num_tokens);
  const int64_t H = grad_y.size(1);
  const bool apply = options.weights == WeightMode::apply;
  check_plan_device(plan, "unpermute_backward", grad_y.device());
  if (apply) {
    check_rows(permuted, "unpermute_backward", "permuted", plan.num_rows);
    detail::check_device(permuted, "unpermute_backward", "permuted", grad_y.device());
    detail::check_shape(permuted, "unpermute_backward", "permuted", {plan.num_rows, H});
    if (permuted.dtype() != grad_y.dtype()) {
      detail::fail_arg("unpermute_backward", "permuted must have grad_y's dtype ",
                       dtype_name(grad_y.dtype()), ", got ", dtype_name(permuted.dtype()));
    }
  }
  UnpermuteGrads g;
  g.grad_permuted = Tensor::empty({plan.num_rows, H}, grad_y.dtype(), grad_y.device());
  const int64_t* rt = plan.row_token.data<int64_t>();
  const backend::Context ctx = backend::context_of(grad_y, "unpermute_backward");
  Tensor dots;
  backend::by_row_dtype(grad_y.dtype(), [&](auto tag) {
    using X = decltype(tag);
    const X* gy = static_cast<const X*>(grad_y.raw());
    backend::gather_scale_rows<X>(ctx, gy, apply ? plan.row_weight.data<float>() : nullptr, rt,
                                  plan.num_rows, H, static_cast<X*>(g.grad_permuted.raw()));
    if (apply) {
      dots = Tensor::empty({plan.num_rows}, DType::fp32);
      backend::row_dots<X>(ctx, static_cast<const X*>(permuted.raw()), gy, rt, plan.num_rows, H,
                           dots.data<float>());
    }
  });
  g.grad_topk_weights =
      apply ? rows_to_slots(dots, plan) : Tensor::zeros({plan.num_tokens, plan.top_k}, DType::fp32);
  return g;
}

}  // namespace switchyard
