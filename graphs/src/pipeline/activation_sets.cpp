#include "pipeline/activation_sets.hpp"

#include <set>

namespace weave::graphs {

ActivationSetPlan plan_activation_sets(const ModelConfig& m, const PipelineLayout& layout) {
  ActivationSetPlan plan;
  const PipelineSchedule& schedule = layout.schedule;
  const int K = layout.chunks();
  for (int k = 0; k < K; ++k)
    for (int l = layout.first_layer(k); l < layout.end_layer(k); ++l)
      plan.chunk_of_layer.push_back(k);
  // Chunks with the same layers, position by position, can share sets.
  auto same_layers = [&](int a, int b) {
    if (layout.end_layer(a) - layout.first_layer(a) != layout.end_layer(b) - layout.first_layer(b))
      return false;
    for (int i = 0; i < layout.end_layer(a) - layout.first_layer(a); ++i)
      if (m.is_moe_layer(layout.first_layer(a) + i) != m.is_moe_layer(layout.first_layer(b) + i))
        return false;
    return true;
  };
  for (const auto& list : schedule.actions)
    for (const Action& a : list)
      plan.splits_backward = plan.splits_backward || a.type == ActionType::BackwardInput;
  plan.set_chunks.assign(static_cast<std::size_t>(schedule.ranks), {});
  plan.output_sets.assign(static_cast<std::size_t>(schedule.ranks), 0);
  for (int pp = 0; pp < schedule.ranks; ++pp) {
    std::vector<int> held;
    for (int k = 0; k < K; ++k)
      if (layout.rank_of(k) == pp) held.push_back(k);
    bool shared = true;
    for (int k : held)
      shared = shared && same_layers(held.front(), k);
    // A set frees up after the micro-batch's last backward action on the chunk: its W when the
    // backward is split (the weight gradients read the activations), its B otherwise.
    std::map<int, std::set<int>> free;  // by pool (one, or one per chunk): free sets, lowest first
    std::set<int> free_outputs;
    for (const Action& a : schedule.actions[static_cast<std::size_t>(pp)]) {
      if (a.type == ActionType::Idle) continue;
      const int k = schedule.stage(pp, a.chunk);
      const auto key = std::make_tuple(pp, k, a.micro_batch);
      std::set<int>& pool = free[shared ? 0 : k];
      if (a.type == ActionType::Forward) {
        if (pool.empty()) {
          pool.insert(static_cast<int>(plan.set_chunks[pp].size()));
          plan.set_chunks[pp].push_back(k);
        }
        plan.set_index[key] = *pool.begin();
        pool.erase(pool.begin());
        if (k == K - 1) {
          if (free_outputs.empty()) free_outputs.insert(plan.output_sets[pp]++);
          plan.output_index[a.micro_batch] = *free_outputs.begin();
          free_outputs.erase(free_outputs.begin());
        }
      } else if (a.type == ActionType::Backward || a.type == ActionType::BackwardWeight) {
        pool.insert(plan.set_index.at(key));
        if (k == K - 1) free_outputs.insert(plan.output_index.at(a.micro_batch));
      }
    }
  }
  return plan;
}

}  // namespace weave::graphs
