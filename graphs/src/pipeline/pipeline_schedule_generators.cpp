#include "weave/graphs/pipeline_schedule_generators.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <deque>

#include "weave/runtime/closest_match.hpp"

namespace weave::graphs {

namespace {

template <typename... Args>
[[noreturn]] void refuse(fmt::format_string<Args...> format, Args&&... args) {
  throw ScheduleError(fmt::format(format, std::forward<Args>(args)...));
}

Action forward(int mb, int chunk = 0) {
  return {ActionType::Forward, mb, chunk};
}
Action backward(int mb, int chunk = 0) {
  return {ActionType::Backward, mb, chunk};
}
Action input(int mb, int chunk = 0) {
  return {ActionType::BackwardInput, mb, chunk};
}
Action weight(int mb, int chunk = 0) {
  return {ActionType::BackwardWeight, mb, chunk};
}

PipelineSchedule empty_schedule(ScheduleKind kind, const ScheduleParams& p) {
  PipelineSchedule s;
  s.name = std::string(schedule_name(kind));
  s.ranks = p.ranks;
  s.micro_batches = p.micro_batches;
  s.chunks = p.chunks;
  s.layout = kind == ScheduleKind::ZeroBubbleV ? StageLayout::V : StageLayout::Interleaved;
  s.actions.resize(static_cast<std::size_t>(p.ranks));
  return s;
}

int group_size_or_default(const ScheduleParams& p) {
  return p.group_size > 0 ? p.group_size : p.ranks;
}

// Checks the parameters against the schedule's rules; throws ScheduleError for the first one
// broken.
void check_params(ScheduleKind kind, const ScheduleParams& p) {
  const std::string_view name = schedule_name(kind);
  if (p.ranks < 1)
    refuse("the pipeline needs at least 1 rank (--pipeline-model-parallel-size, got {})", p.ranks);
  if (p.micro_batches < 1)
    refuse("a step needs at least 1 micro-batch (--num-micro-batches, got {})", p.micro_batches);
  if (p.chunks < 1)
    refuse("each rank holds at least 1 chunk (--virtual-pipeline-size, got {})", p.chunks);
  if (p.group_size < 0)
    refuse(
        "the micro-batch group size must be at least 1, or 0 for the default p "
        "(--microbatch-group-size-per-virtual-pipeline-stage, got {})",
        p.group_size);
  if (p.group_size != 0 && kind != ScheduleKind::Interleaved)
    refuse(
        "--microbatch-group-size-per-virtual-pipeline-stage ({}) applies to the interleaved "
        "schedule only, not {}; leave it out",
        p.group_size, name);
  switch (kind) {
    case ScheduleKind::GPipe:
      return;
    case ScheduleKind::OneFOneB:
    case ScheduleKind::ZeroBubbleH1:
      if (p.chunks != 1)
        refuse(
            "{} runs one chunk per rank (got --virtual-pipeline-size {}); use interleaved, "
            "interleaved-mem or zb-v for several",
            name, p.chunks);
      // Rank r defers r weight gradients behind a full pipeline of forwards.
      if (kind == ScheduleKind::ZeroBubbleH1 && p.micro_batches < p.ranks)
        refuse("zb-h1 needs at least p micro-batches (got m = {}, p = {}); use 1f1b for fewer",
               p.micro_batches, p.ranks);
      return;
    case ScheduleKind::ZeroBubbleV:
      if (p.chunks != 2)
        refuse("zb-v places exactly 2 chunks per rank in a V (got --virtual-pipeline-size {})",
               p.chunks);
      return;
    case ScheduleKind::Interleaved: {
      if (p.chunks < 2)
        refuse(
            "{} needs at least 2 chunks per rank (got --virtual-pipeline-size {}); use 1f1b for "
            "one",
            name, p.chunks);
      const int n = group_size_or_default(p);
      if (n < p.ranks || n > p.micro_batches)
        refuse(
            "the interleaved schedule needs p <= N <= m for the micro-batch group size N "
            "(got p = {}, N = {}, m = {}): set --microbatch-group-size-per-virtual-pipeline-stage "
            "between p and m, or run at least p micro-batches",
            p.ranks, n, p.micro_batches);
      const auto fits = [&](int size) {
        return p.micro_batches % size == 0 || p.micro_batches % size >= p.ranks;
      };
      if (!fits(n)) {
        int suggestion = n;
        while (!fits(suggestion))
          ++suggestion;  // ends at m at the latest
        refuse(
            "the interleaved schedule needs m mod N = 0 or >= p, else the last group is too "
            "small to fill the pipeline (got m = {}, N = {}, m mod N = {}, p = {}); set "
            "--microbatch-group-size-per-virtual-pipeline-stage to {}, or m to a multiple of {}",
            p.micro_batches, n, p.micro_batches % n, p.ranks, suggestion, n);
      }
      return;
    }
    case ScheduleKind::InterleavedMem:
      if (p.chunks < 2)
        refuse(
            "{} needs at least 2 chunks per rank (got --virtual-pipeline-size {}); use 1f1b for "
            "one",
            name, p.chunks);
      if (p.micro_batches < p.ranks)
        refuse(
            "{} needs at least p micro-batches, one per rank in its first round (got m = {}, "
            "p = {})",
            name, p.micro_batches, p.ranks);
      return;
  }
}

PipelineSchedule gpipe(const ScheduleParams& p) {
  PipelineSchedule s = empty_schedule(ScheduleKind::GPipe, p);
  for (auto& rank : s.actions) {
    for (int c = 0; c < p.chunks; ++c)
      for (int mb = 0; mb < p.micro_batches; ++mb)
        rank.push_back(forward(mb, c));
    for (int c = p.chunks - 1; c >= 0; --c)
      for (int mb = 0; mb < p.micro_batches; ++mb)
        rank.push_back(backward(mb, c));
  }
  return s;
}

// Warm-up forwards, then (next forward, oldest backward) pairs over the step table, then the
// remaining backwards: the shape shared by 1F1B and both interleaved schedules.
void one_forward_one_backward(std::vector<Action>& out,
                              const std::vector<std::pair<int, int>>& table, int chunks,
                              int warmup) {
  const int steps = static_cast<int>(table.size());
  warmup = std::min(warmup, steps);
  const auto f = [&](int k) { return forward(table[k].first, table[k].second); };
  const auto b = [&](int k) { return backward(table[k].first, chunks - 1 - table[k].second); };
  for (int k = 0; k < warmup; ++k)
    out.push_back(f(k));
  for (int k = 0; k + warmup < steps; ++k) {
    out.push_back(f(k + warmup));
    out.push_back(b(k));
  }
  for (int k = steps - warmup; k < steps; ++k)
    out.push_back(b(k));
}

PipelineSchedule one_f_one_b(const ScheduleParams& p) {
  PipelineSchedule s = empty_schedule(ScheduleKind::OneFOneB, p);
  const auto table = interleaved_step_table(p.micro_batches, 1, p.micro_batches);
  for (int r = 0; r < p.ranks; ++r)
    one_forward_one_backward(s.actions[r], table, 1, p.ranks - r - 1);
  return s;
}

PipelineSchedule interleaved(const ScheduleParams& p) {
  PipelineSchedule s = empty_schedule(ScheduleKind::Interleaved, p);
  const int n = group_size_or_default(p);
  const auto table = interleaved_step_table(p.micro_batches, p.chunks, n);
  // Twice the distance to the last rank: enough forwards in flight that, in the steady state,
  // each rank's next forward input has arrived by the time it finishes a backward.
  for (int r = 0; r < p.ranks; ++r)
    one_forward_one_backward(s.actions[r], table, p.chunks,
                             2 * (p.ranks - r - 1) + (p.chunks - 1) * n);
  return s;
}

PipelineSchedule interleaved_memory_optimised(const ScheduleParams& p) {
  PipelineSchedule s = empty_schedule(ScheduleKind::InterleavedMem, p);
  const int o = p.micro_batches % p.ranks;
  // Rounds of p micro-batches, the first taking the remainder o: the step table with groups of
  // p + o followed by groups of p.
  std::vector<std::pair<int, int>> table;
  for (int first = 0; first < p.micro_batches;) {
    const int size = first == 0 ? p.ranks + o : p.ranks;
    for (int c = 0; c < p.chunks; ++c)
      for (int mb = first; mb < first + size; ++mb)
        table.emplace_back(mb, c);
    first += size;
  }
  // One forward less per remaining rank than Megatron's warm-up: the first backward starts as
  // soon as its gradient can arrive, so rank 0 holds p micro-batches' activations, not ~1.5 p.
  for (int r = 0; r < p.ranks; ++r)
    one_forward_one_backward(s.actions[r], table, p.chunks,
                             (p.ranks + o) * (p.chunks - 1) + (p.ranks - r - 1));
  return s;
}

PipelineSchedule zero_bubble_h1(const ScheduleParams& p) {
  PipelineSchedule s = empty_schedule(ScheduleKind::ZeroBubbleH1, p);
  const int m = p.micro_batches;
  for (int r = 0; r < p.ranks; ++r) {
    auto& out = s.actions[r];
    const int warmup = std::min(p.ranks - 1 - r, m);
    int next_forward = 0, next_input = 0, next_weight = 0;
    for (; next_forward < warmup; ++next_forward)
      out.push_back(forward(next_forward));
    // Rank r keeps r weight gradients deferred: they fill the gaps the split backward opens
    // while its input gradient travels on towards rank 0.
    for (int step = 0; next_input < m; ++step) {
      if (next_forward < m) out.push_back(forward(next_forward++));
      out.push_back(input(next_input++));
      if (step >= r) out.push_back(weight(next_weight++));
    }
    while (next_weight < m)
      out.push_back(weight(next_weight++));
  }
  return s;
}

// PyTorch's ZB-V order, which needs m >= 2p - 1: it is built for max(m, 2p - 1) micro-batches
// and the padding ones are dropped afterwards, which keeps every dependency satisfied.
PipelineSchedule zero_bubble_v(const ScheduleParams& p) {
  PipelineSchedule s = empty_schedule(ScheduleKind::ZeroBubbleV, p);
  const int padded = std::max(p.micro_batches, 2 * p.ranks - 1);
  for (int r = 0; r < p.ranks; ++r) {
    std::vector<Action> out;
    int next_f[2] = {0, 0}, next_i[2] = {0, 0}, next_w[2] = {0, 0};
    const auto f = [&](int c) { out.push_back(forward(next_f[c]++, c)); };
    const auto i = [&](int c) { out.push_back(input(next_i[c]++, c)); };
    const auto w = [&](int c) { out.push_back(weight(next_w[c]++, c)); };
    // Fill the V: the first chunk runs ahead so that the second chunk, which is the way back,
    // gets its inputs without waiting.
    for (int k = 0; k < 2 * (p.ranks - r) - 1; ++k)
      f(0);
    for (int k = 0; k < r; ++k) {
      f(1);
      f(0);
    }
    for (int k = 0; k < p.ranks - r; ++k) {
      f(1);
      i(1);
      w(1);
    }
    while (next_f[1] < padded) {
      if (next_f[0] < padded) f(0);
      i(0);
      w(0);
      f(1);
      i(1);
      w(1);
    }
    // Drain: input gradients first (they unblock the ranks towards rank 0), weights last.
    for (int k = 0; k < r; ++k) {
      i(0);
      i(1);
    }
    for (int k = 0; k < p.ranks - r; ++k) {
      i(0);
      w(0);
    }
    while (next_w[1] < padded)
      w(1);
    while (next_w[0] < padded)
      w(0);
    for (const Action& a : out)
      if (a.micro_batch < p.micro_batches) s.actions[r].push_back(a);
  }
  return s;
}

}  // namespace

const std::vector<std::string>& schedule_names() {
  static const std::vector<std::string> names = {"gpipe",           "1f1b",  "interleaved",
                                                 "interleaved-mem", "zb-h1", "zb-v"};
  return names;
}

std::string_view schedule_name(ScheduleKind kind) {
  return schedule_names().at(static_cast<std::size_t>(kind));
}

ScheduleKind schedule_kind(std::string_view name) {
  const auto& names = schedule_names();
  for (std::size_t i = 0; i < names.size(); ++i)
    if (names[i] == name) return static_cast<ScheduleKind>(i);
  const std::string closest = rt::closest_match(name, names);
  refuse("unknown pipeline schedule '{}'{}; the schedules are: {}", name,
         closest.empty() ? "" : fmt::format(" (did you mean '{}'?)", closest),
         fmt::join(names, ", "));
}

std::vector<std::pair<int, int>> interleaved_step_table(int micro_batches, int chunks,
                                                        int group_size) {
  if (group_size < 1) refuse("the micro-batch group size must be at least 1 (got {})", group_size);
  std::vector<std::pair<int, int>> table;
  for (int first = 0; first < micro_batches; first += group_size) {
    const int end = std::min(first + group_size, micro_batches);  // the last takes what is left
    for (int c = 0; c < chunks; ++c)
      for (int mb = first; mb < end; ++mb)
        table.emplace_back(mb, c);
  }
  return table;
}

PipelineSchedule make_schedule(ScheduleKind kind, const ScheduleParams& params) {
  check_params(kind, params);
  switch (kind) {
    case ScheduleKind::GPipe:
      return gpipe(params);
    case ScheduleKind::OneFOneB:
      return one_f_one_b(params);
    case ScheduleKind::Interleaved:
      return interleaved(params);
    case ScheduleKind::InterleavedMem:
      return interleaved_memory_optimised(params);
    case ScheduleKind::ZeroBubbleH1:
      return zero_bubble_h1(params);
    case ScheduleKind::ZeroBubbleV:
      return zero_bubble_v(params);
  }
  refuse("unknown schedule kind {}", static_cast<int>(kind));
}

ScheduleTheory schedule_theory(ScheduleKind kind, const ScheduleParams& params, double forward_time,
                               double backward_input_time, double backward_weight_time) {
  check_params(kind, params);
  const int p = params.ranks, m = params.micro_batches, v = params.chunks;
  const double mv = static_cast<double>(m) * v;
  ScheduleTheory t;
  const auto peaks = [&](auto chunks_in_flight) {
    for (int r = 0; r < p; ++r)
      t.peak_activations.push_back(std::min<double>(chunks_in_flight(r), mv) / v);
  };
  switch (kind) {
    case ScheduleKind::GPipe:
      t.bubble_formula = v == 1 ? "(p-1)/m" : "(p-1)/(vm)";
      t.bubble_over_ideal = (p - 1) / mv;
      peaks([&](int) { return mv; });
      if (v > 1 && m < p)
        t.caveat = fmt::format(
            "with chunks the formula assumes m >= p = {}: fewer micro-batches leave each "
            "chunk's first stage waiting for the previous chunk's last",
            p);
      break;
    case ScheduleKind::OneFOneB:
      t.bubble_formula = "(p-1)/m";
      t.bubble_over_ideal = static_cast<double>(p - 1) / m;
      peaks([&](int r) { return p - r; });
      break;
    case ScheduleKind::Interleaved: {
      t.bubble_formula = "(p-1)/(vm)";
      t.bubble_over_ideal = (p - 1) / mv;
      const int n = group_size_or_default(params);
      peaks([&](int r) { return 2 * (p - r - 1) + (v - 1) * n + 1; });
      break;
    }
    case ScheduleKind::InterleavedMem: {
      t.bubble_formula = "(p-1)/(vm)";
      t.bubble_over_ideal = (p - 1) / mv;
      const int o = m % p;
      peaks([&](int r) { return (p + o) * (v - 1) + p - r; });
      break;
    }
    case ScheduleKind::ZeroBubbleH1: {
      const double per_mb = forward_time + backward_input_time + backward_weight_time;
      t.bubble_formula = "(p-1)(t_F+t_I-t_W)/(m(t_F+t_I+t_W))";
      t.bubble_over_ideal =
          std::max(0.0, (p - 1) * (forward_time + backward_input_time - backward_weight_time)) /
          (m * per_mb);
      peaks([&](int) { return p; });
      // A longer W than F or I no longer fits the gaps it is deferred into.
      if (backward_weight_time > std::min(forward_time, backward_input_time))
        t.caveat = fmt::format(
            "the ZB-H1 formula assumes t_W <= t_F and t_W <= t_I (got t_F = {:g}, t_I = {:g}, "
            "t_W = {:g})",
            forward_time, backward_input_time, backward_weight_time);
      break;
    }
    case ScheduleKind::ZeroBubbleV: {
      const double per_mb = forward_time + backward_input_time + backward_weight_time;
      t.bubble_formula = "(p-1)t_F/(2m(t_F+t_I+t_W)), the start skew";
      t.bubble_over_ideal = (p - 1) * forward_time / (mv * per_mb);
      peaks([&](int) { return 2 * p; });
      if (m < 2 * p - 1)
        t.caveat = fmt::format(
            "the ZB-V figures assume m >= 2p-1 = {}; with fewer micro-batches the V does not "
            "fill",
            2 * p - 1);
      break;
    }
  }
  return t;
}

}  // namespace weave::graphs
