// Routes 4 tokens through an installed switchyard: bf16 gate into fp32 logits, top-2 of 8 experts.
// Exits 0 only when the result is what the maths says (expert ids and weights summing to 1).
#include <cmath>
#include <cstdio>

#include "switchyard/cpu.h"
#include "switchyard/gate.h"
#include "switchyard/router.h"

int main() {
  namespace sy = switchyard;
  const int64_t T = 4, H = 16, E = 8, K = 2;
  sy::Tensor x = sy::Tensor::zeros({T, H}, sy::DType::fp32);
  sy::Tensor w = sy::Tensor::zeros({E, H}, sy::DType::fp32);
  for (int64_t t = 0; t < T; ++t) x.data<float>()[t * H + t] = 1.0f;       // token t = unit vector t
  for (int64_t e = 0; e < E; ++e) w.data<float>()[e * H + e % T] = float(e);  // expert e sees h=e%4
  const sy::Tensor logits = sy::router_gating_linear(x.to(sy::DType::bf16), w.to(sy::DType::bf16),
                                                     sy::Tensor());
  sy::RouterConfig cfg;
  cfg.num_experts = E;
  cfg.top_k = K;
  const sy::RouteResult r = sy::topk_route(logits, sy::RouteInputs{}, cfg);
  int bad = 0;
  for (int64_t t = 0; t < T; ++t) {
    const int32_t* idx = r.topk_idx.data<int32_t>() + t * K;
    const float* wt = r.topk_weights.data<float>() + t * K;
    // Token t has logit e for experts e = t and e = t + 4 (0 elsewhere): top-2 is {t+4, t}.
    if (idx[0] != t + 4 || idx[1] != t || std::fabs(wt[0] + wt[1] - 1.0f) > 1e-6f) ++bad;
    std::printf("token %lld -> experts %d %d weights %.4f %.4f\n", static_cast<long long>(t),
                idx[0], idx[1], wt[0], wt[1]);
  }
  std::printf("switchyard consumer (%s kernels): %s\n", sy::cpu_isa_name(sy::cpu_isa()),
              bad ? "WRONG" : "ok");
  return bad ? 1 : 0;
}
