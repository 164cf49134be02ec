#include "moe/moe_expert_bias.hpp"

#include <fmt/format.h>

#include "step/rank_program.hpp"
#include "step/step_costs.hpp"
#include "weave/ops/router.hpp"

namespace weave::graphs {

bool uses_expert_bias(const ModelConfig& m) {
  return m.num_experts > 0 && m.moe_gate == MoeGate::megatron && m.moe_router_enable_expert_bias;
}

void count_expert_loads(RankProgram& P, int layer, const ops::DispatchPlan& plan) {
  const auto loads = P.state.expert_loads.find(layer);
  if (loads == P.state.expert_loads.end()) return;
  float* n = loads->second.data();
  for (std::int64_t e = 0; e < plan.experts; ++e)
    n[e] += static_cast<float>(plan.expert_begin[e + 1] - plan.expert_begin[e]);
}

void build_expert_bias_update(RankProgram& P) {
  RankProgram* p = &P;
  const StepShape& z = P.shape;
  const rt::TaskTags tags{.phase = rt::Phase::weight};
  const double experts = z.model.num_experts;
  for (auto& entry : P.state.expert_loads) {
    const int layer = entry.first;
    const std::string at = fmt::format("L{}.", layer);
    // Last on the compute stream, so after every forward that counted; it marks the point.
    TaskId ready = P.compute(at + "expert_loads", tags, cost::streamed(z, experts), [] {});
    // Summed over the stage: the tensor-parallel group, then the data x context one (which holds
    // the expert-parallel ranks).
    for (const GroupHandle* group : {&P.tensor, &P.data}) {
      const TaskId summed = group->all_reduce(ready, all_of(entry.second), devices::ReduceOp::sum,
                                              at + "expert_loads." + group->stream(), tags);
      if (summed != rt::kNoTask) ready = summed;
    }
    const TaskId update =
        P.compute(at + "expert_bias_update", tags, cost::streamed(z, 3 * experts), [p, layer] {
          // An evaluation's step (TrainingStep::set_update_parameters(false)) leaves the bias,
          // as Megatron-Core updates it only when it trains.
          if (!p->inputs.update) return;
          const auto e = static_cast<std::size_t>(p->shape.model.num_experts);
          ops::update_expert_bias({p->state.expert_loads.at(layer).data(), e},
                                  {p->moe_parameters(layer).router.expert_bias->value.data(), e},
                                  p->shape.model.moe_router_bias_update_rate);
        });
    P.after(ready, update);
  }
}

}  // namespace weave::graphs
