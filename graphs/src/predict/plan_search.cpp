#include "weave/graphs/plan_search.hpp"

#include <fmt/format.h>

#include <tbb/task_arena.h>

#include <algorithm>
#include <cctype>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <utility>

#include "weave/graphs/config_flags.hpp"
#include "weave/graphs/pipeline_layout.hpp"
#include "weave/runtime/parallel_for.hpp"

namespace weave::graphs {

namespace {

// Admits predictions to run side by side while their estimated memory fits the budget, in the
// order they ask (a large candidate is not overtaken for ever by small ones); one prediction runs
// alone whatever its estimate, so every candidate is predicted.
class MemoryBudget {
 public:
  explicit MemoryBudget(std::int64_t budget) : budget_(budget) {}

  void acquire(std::int64_t bytes) {
    std::unique_lock lock(mutex_);
    const std::uint64_t ticket = next_ticket_++;
    admitted_.wait(lock, [&] {
      return ticket == serving_ && (running_ == 0 || budget_ <= 0 || used_ + bytes <= budget_);
    });
    ++serving_;
    used_ += bytes;
    ++running_;
    most_running_ = std::max(most_running_, running_);
    most_used_ = std::max(most_used_, used_);
    admitted_.notify_all();  // the next ticket may fit beside this one
  }

  void release(std::int64_t bytes) {
    {
      const std::lock_guard lock(mutex_);
      used_ -= bytes;
      --running_;
    }
    admitted_.notify_all();
  }

  // Holds `bytes` of the budget from construction to destruction.
  class Held {
   public:
    Held(MemoryBudget& budget, std::int64_t bytes) : budget_(budget), bytes_(bytes) {
      budget_.acquire(bytes_);
    }
    ~Held() { budget_.release(bytes_); }
    Held(const Held&) = delete;
    Held& operator=(const Held&) = delete;

   private:
    MemoryBudget& budget_;
    const std::int64_t bytes_;
  };

  int most_running() const { return most_running_; }
  std::int64_t most_used() const { return most_used_; }

 private:
  std::mutex mutex_;
  std::condition_variable admitted_;
  const std::int64_t budget_;
  std::int64_t used_ = 0, most_used_ = 0;
  int running_ = 0, most_running_ = 0;
  std::uint64_t next_ticket_ = 0, serving_ = 0;
};

std::vector<int> divisors(int n) {
  std::vector<int> out;
  for (int d = 1; d <= n; ++d)
    if (n % d == 0) out.push_back(d);
  return out;
}

// A refusal's message with every number as N: candidates refused by the same rule at other
// sizes count as one reason.
std::string reason_of(const std::string& message) {
  std::string out;
  for (std::size_t i = 0; i < message.size(); ++i) {
    if (std::isdigit(static_cast<unsigned char>(message[i]))) {
      out += 'N';
      while (i + 1 < message.size() &&
             (std::isdigit(static_cast<unsigned char>(message[i + 1])) || message[i + 1] == '.'))
        ++i;
    } else {
      out += message[i];
    }
  }
  return out;
}

void count_refusal(std::vector<RefusalCount>& refused, const std::string& message) {
  const std::string reason = reason_of(message);
  auto at = std::find_if(refused.begin(), refused.end(),
                         [&](const RefusalCount& r) { return r.reason == reason; });
  if (at == refused.end()) at = refused.insert(refused.end(), {reason, 0});
  ++at->candidates;
}

void sort_by_count(std::vector<RefusalCount>& refused) {
  std::stable_sort(
      refused.begin(), refused.end(),
      [](const RefusalCount& a, const RefusalCount& b) { return a.candidates > b.candidates; });
}

}  // namespace

int PlanCandidates::refused_total() const {
  int total = 0;
  for (const RefusalCount& r : refused)
    total += r.candidates;
  return total;
}

namespace {

// The sizes of one way to lay the devices out.
struct MeshSizes {
  int tp, pp, cp, dp;
};

// The pipeline schedules tried at pp stages: name and chunks per rank.
std::vector<std::pair<std::string, int>> schedules_to_try(const ModelConfig& m, int pp) {
  std::vector<std::pair<std::string, int>> schedules;
  if (pp == 1) {
    schedules.emplace_back("", 1);
    return schedules;
  }
  schedules.emplace_back("1f1b", 1);
  if (m.num_layers % (2 * pp) == 0) schedules.emplace_back("interleaved", 2);
  schedules.emplace_back("zb-h1", 1);
  return schedules;
}

// The base configuration laid out over `sizes`, with the given expert parallelism, schedule,
// Ampipe degree and recomputation; every other layout flag reset.
TrainerConfig candidate(const TrainerConfig& base, MeshSizes sizes, int ep,
                        const std::string& scheduler, int chunks, int ampipe, bool full) {
  TrainerConfig c = base;
  ParallelPlan& p = c.plan;
  p.tensor_parallel = sizes.tp;
  p.sequence_parallel = sizes.tp > 1;
  p.context_parallel = sizes.cp;
  p.expert_parallel = ep;
  p.data_parallel = sizes.dp;
  p.pipeline_parallel = sizes.pp;
  p.pipeline_scheduler = scheduler;
  p.virtual_pipeline = chunks;
  p.layers_per_virtual_stage = 0;
  p.microbatch_group_size = 0;
  p.first_stage_layers = 0;
  p.last_stage_layers = 0;
  p.ampipe_degree = ampipe;
  // Experts split over the tensor-parallel group stay split at every tp.
  if (p.expert_tensor_parallel > 1) p.expert_tensor_parallel = sizes.tp;
  c.model.recompute = full ? Recompute{.granularity = RecomputeGranularity::full,
                                       .method = RecomputeMethod::uniform,
                                       .num_layers = 1}
                           : Recompute{};
  return c;
}

// Every candidate of one layout: each expert-parallel size, schedule, Ampipe degree and
// recomputation, kept when it validates and counted by its refusal when not.
void add_candidates(const TrainerConfig& base, MeshSizes sizes,
                    const std::vector<std::string>& flags_without_effect, PlanCandidates& out) {
  const ModelConfig& m = base.model;
  const bool moe = m.num_experts > 0;
  const std::vector<int> expert_sizes = moe ? divisors(m.num_experts) : std::vector<int>{1};
  const std::vector<int> ampipe_degrees = moe ? std::vector<int>{1, 2} : std::vector<int>{1};
  // Asked for ZeRO stage 2 or 3, the advice weighs it against the stages below it down to 1 at
  // each layout (stage 1 being also what the layouts stages 2 and 3 are not built with can run).
  const int asked = base.plan.shard_parameters ? 3 : base.plan.shard_gradients ? 2 : 1;
  std::vector<int> zero_stages{1};
  for (int stage = 2; stage <= asked; ++stage)
    zero_stages.push_back(stage);
  for (const int ep : expert_sizes)
    for (const auto& [scheduler, chunks] : schedules_to_try(m, sizes.pp))
      for (const int ampipe : ampipe_degrees)
        for (const bool full : {false, true})
          for (const int stage : zero_stages) {
            TrainerConfig c = candidate(base, sizes, ep, scheduler, chunks, ampipe, full);
            if (c.plan.distributed_optimizer) {
              c.plan.shard_gradients = stage >= 2;
              c.plan.shard_parameters = stage == 3;
              // The units in flight asked for are stage 3's; the stages below hold none.
              if (stage != 3) c.plan.zero_units_in_flight = 2;
            }
            try {
              validate(c);
              check_flag_rules(c.plan, flags_without_effect);
            } catch (const ConfigError& e) {
              count_refusal(out.refused, e.what());
              continue;
            }
            out.configs.push_back(std::move(c));
          }
}

}  // namespace

PlanCandidates enumerate_plans(const TrainerConfig& base, const PlanSearchOptions& options) {
  const ModelConfig& m = base.model;
  const ParallelPlan& given = base.plan;
  const int devices = given.devices();
  PlanCandidates out;
  for (const int tp : divisors(devices)) {
    if (m.num_attention_heads % tp != 0 || m.query_groups() % tp != 0) continue;
    if (options.max_tensor_parallel > 0 && tp > options.max_tensor_parallel) continue;
    for (const int pp : divisors(devices / tp)) {
      if (m.num_layers % pp != 0) continue;
      for (const int cp : divisors(devices / (tp * pp))) {
        if (cp > 1 && m.seq_length % (2 * cp) != 0) continue;
        const int dp = devices / (tp * pp * cp);
        if (given.global_batch_size % (given.micro_batch_size * dp) != 0) {
          ++out.skipped_global_batch;
          continue;
        }
        add_candidates(base, {.tp = tp, .pp = pp, .cp = cp, .dp = dp}, options.flags_without_effect,
                       out);
      }
    }
  }
  // A folded prediction builds pp ranks (data-parallel replicas, tensor- and context-parallel
  // peers folded, ep carved out of them): the cheap ones first, so a candidate limit cuts the
  // costly tail.
  std::stable_sort(out.configs.begin(), out.configs.end(),
                   [](const TrainerConfig& a, const TrainerConfig& b) {
                     return a.plan.pipeline_parallel < b.plan.pipeline_parallel;
                   });
  sort_by_count(out.refused);
  return out;
}

std::string plan_flags(const TrainerConfig& config) {
  const ParallelPlan& p = config.plan;
  std::string flags = fmt::format(
      "--devices {} --tensor-model-parallel-size {}{} --context-parallel-size {} "
      "--pipeline-model-parallel-size {}",
      p.devices(), p.tensor_parallel, p.sequence_parallel ? " --sequence-parallel" : "",
      p.context_parallel, p.pipeline_parallel);
  if (config.model.num_experts > 0) {
    flags += fmt::format(" --expert-model-parallel-size {}", p.expert_parallel);
    if (p.expert_tensor_parallel > 1 && p.moe_model_type != "deepspeed_moe")
      flags += fmt::format(" --expert-tensor-parallel-size {}", p.expert_tensor_parallel);
  }
  if (!p.pipeline_scheduler.empty()) {
    flags += fmt::format(" --pipeline-scheduler {}", p.pipeline_scheduler);
    if (p.virtual_pipeline > 1 && pipeline_schedule_kind(p) != ScheduleKind::ZeroBubbleV)
      flags += fmt::format(" --virtual-pipeline-model-parallel-size {}", p.virtual_pipeline);
  }
  if (p.ampipe_degree > 1) flags += fmt::format(" --ampipe-degree {}", p.ampipe_degree);
  const Recompute& r = config.model.recompute;
  if (r.granularity == RecomputeGranularity::selective)
    flags += " --recompute-granularity selective";
  if (r.full())
    flags +=
        fmt::format(" --recompute-granularity full --recompute-method {} --recompute-num-layers {}",
                    r.method == RecomputeMethod::uniform ? "uniform" : "block", r.num_layers);
  // The stage the advice chose (stages 2 and 3 are weighed against those below): named whenever the
  // optimizer state is sharded, agreeing with --use-distributed-optimizer if that is given too.
  if (p.distributed_optimizer)
    flags += fmt::format(" --zero-stage {}", p.shard_parameters ? 3 : p.shard_gradients ? 2 : 1);
  if (p.shard_parameters && p.zero_units_in_flight != 2)
    flags += fmt::format(" --zero-units-in-flight {}", p.zero_units_in_flight);
  flags += fmt::format(" --global-batch-size {}", p.global_batch_size);
  return flags;
}

PlanOutcome outcome_of(const TrainerConfig& config, const Prediction& prediction,
                       std::int64_t device_memory_bytes) {
  PlanOutcome o{.config = config,
                .step_ms = prediction.step_ms,
                .tokens_per_second = prediction.tokens_per_second,
                .mfu = prediction.mfu,
                .bubble = prediction.bubble,
                .tasks_built = prediction.tasks_built};
  for (const std::int64_t bytes : prediction.memory_total)
    o.memory_per_device = std::max(o.memory_per_device, bytes);
  o.fits = o.memory_per_device <= device_memory_bytes;
  return o;
}

PlanRanking rank_plans(const std::vector<TrainerConfig>& candidates,
                       const PlanRankingOptions& options) {
  PlanRanking ranking;
  const int total = static_cast<int>(candidates.size());
  const int to_predict =
      options.max_predictions > 0 ? std::min(total, options.max_predictions) : total;
  ranking.not_predicted = total - to_predict;
  // Each candidate's outcome or refusal in its own slot, gathered in candidate order below so the
  // ranking does not depend on which prediction finished first.
  std::vector<std::optional<PlanOutcome>> outcomes(static_cast<std::size_t>(to_predict));
  std::vector<std::string> refusals(static_cast<std::size_t>(to_predict));
  std::mutex progress_mutex;
  int done = 0;
  MemoryBudget budget(options.memory_budget_bytes);
  auto predict_one = [&](std::size_t i) {
    const TrainerConfig& c = candidates[i];
    std::int64_t estimate = 0;
    try {
      estimate = prediction_memory_bound(c, options.prediction);
    } catch (const ConfigError& e) {
      refusals[i] = e.what();
    }
    if (refusals[i].empty()) {
      // Released however the prediction ends: a prediction that throws (out of memory, say)
      // must not leave the others waiting for ever.
      const MemoryBudget::Held held(budget, estimate);
      // Isolated: waiting inside its own parallel loops, this thread must not take up another
      // candidate's prediction, which could wait on the budget this one holds.
      tbb::this_task_arena::isolate([&] {
        try {
          outcomes[i] =
              outcome_of(c, predict_step(c, options.prediction), options.device_memory_bytes);
        } catch (const ConfigError& e) {
          refusals[i] = e.what();
        }
      });
    }
    const std::lock_guard lock(progress_mutex);
    ++done;
    if (options.progress) options.progress(done, to_predict);
  };
  // At most the cores TBB may use: an arena asking for more workers than that only draws a
  // warning from TBB.
  const int cores = tbb::this_task_arena::max_concurrency();
  const int concurrency =
      options.concurrent_predictions > 0 ? std::min(options.concurrent_predictions, cores) : cores;
  tbb::task_arena arena(concurrency);
  arena.execute([&] { rt::parallel_for(std::size_t{0}, outcomes.size(), predict_one); });
  ranking.most_side_by_side = budget.most_running();
  ranking.most_estimated_bytes = budget.most_used();
  for (std::size_t i = 0; i < outcomes.size(); ++i) {
    if (!outcomes[i]) {
      count_refusal(ranking.refused, refusals[i]);
      continue;
    }
    ++ranking.predicted;
    if (outcomes[i]->fits)
      ranking.fitting.push_back(std::move(*outcomes[i]));
    else
      ++ranking.too_large;
  }
  sort_by_count(ranking.refused);
  // Stable: among equal times the cheaper candidate (enumerated first) stays ahead.
  std::stable_sort(
      ranking.fitting.begin(), ranking.fitting.end(),
      [](const PlanOutcome& a, const PlanOutcome& b) { return a.step_ms < b.step_ms; });
  return ranking;
}

}  // namespace weave::graphs
