#include "weave/graphs/parallel_plan.hpp"

#include <utility>

#include "config/plan_derivation.hpp"
#include "config/plan_rules.hpp"

namespace weave::graphs {

const char* position_embedding_name(PositionEmbedding p) {
  switch (p) {
    case PositionEmbedding::learned_absolute:
      return "learned_absolute";
    case PositionEmbedding::rope:
      return "rope";
    case PositionEmbedding::none:
      break;
  }
  return "none";
}

const char* attention_backend_name(AttentionBackend b) {
  switch (b) {
    case AttentionBackend::flash:
      return "flash";
    case AttentionBackend::fused:
      return "fused";
    case AttentionBackend::unfused:
      return "unfused";
    case AttentionBackend::local:
      return "local";
    case AttentionBackend::automatic:
      break;
  }
  return "auto";
}

const char* cross_entropy_fusion_name(CrossEntropyFusion f) {
  switch (f) {
    case CrossEntropyFusion::native:
      return "native";
    case CrossEntropyFusion::te:
      return "te";
    case CrossEntropyFusion::unfused:
      break;
  }
  return "unfused";
}

const char* precision_name(Precision p) {
  switch (p) {
    case Precision::bf16:
      return "bf16";
    case Precision::fp16:
      return "fp16";
    case Precision::fp32:
      break;
  }
  return "fp32";
}

ParameterBytes parameter_bytes(Precision p) {
  switch (p) {
    case Precision::bf16:  // bf16 weights, fp32 gradients; fp32 master weights and moments
      return {.parameter = 2, .gradient = 4, .optimizer_state = 12};
    case Precision::fp16:  // as bf16: fp32 gradients (--accumulate-allreduce-grads-in-fp32)
      return {.parameter = 2, .gradient = 4, .optimizer_state = 12};
    case Precision::fp32:
      break;
  }
  return {.parameter = 4, .gradient = 4, .optimizer_state = 8};
}

int ModelConfig::padded_vocab_size(int tensor_parallel) const {
  const int multiple = make_vocab_size_divisible_by * tensor_parallel;
  return (vocab_size + multiple - 1) / multiple * multiple;
}

std::vector<std::string> validate(const ModelConfig& m, ParallelPlan& plan) {
  ParallelPlan derived = plan;
  std::vector<std::string> warnings = derive_plan(m, derived);
  check_plan_rules(m, plan, derived);
  plan = std::move(derived);
  return warnings;
}

}  // namespace weave::graphs
