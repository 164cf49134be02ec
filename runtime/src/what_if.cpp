#include "weave/runtime/what_if.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <stdexcept>

namespace weave::rt {

namespace {

constexpr const char* kForms =
    "write <stream>=free, <stream>*<factor>, compute*<factor> or attention*<factor> (e.g. "
    "ep=free,attention*0.5), changes joined by commas";

double parse_factor(std::string_view item, std::string_view text) {
  const std::string s(text);
  char* end = nullptr;
  const double f = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(f) || f < 0)
    throw std::invalid_argument(
        fmt::format("what-if '{}': '{}' is not a factor from 0 (a number such as 2 or 0.5): {}",
                    item, text, kForms));
  return f;
}

CostChange parse_change(std::string_view item) {
  CostChange c;
  std::string_view target;
  if (const std::size_t eq = item.find('='); eq != std::string_view::npos) {
    if (item.substr(eq + 1) != "free")
      throw std::invalid_argument(
          fmt::format("what-if '{}': only '=free' follows '=': {}", item, kForms));
    target = item.substr(0, eq);
    c.factor = 0;
  } else {
    std::size_t op = item.find('*');
    std::size_t width = 1;
    if (op == std::string_view::npos) {
      op = item.find("\u00d7");
      width = 2;
    }
    if (op == std::string_view::npos)
      throw std::invalid_argument(fmt::format("what-if '{}' changes nothing: {}", item, kForms));
    target = item.substr(0, op);
    c.factor = parse_factor(item, item.substr(op + width));
  }
  if (target.empty())
    throw std::invalid_argument(
        fmt::format("what-if '{}' names nothing to change: {}", item, kForms));
  if (target == "compute") {
    c.target = CostChange::Target::compute;
  } else if (target == "attention") {
    c.target = CostChange::Target::attention;
  } else {
    c.stream = std::string(target);
  }
  return c;
}

}  // namespace

std::string CostChange::describe() const {
  const std::string what = target == Target::compute     ? "compute"
                           : target == Target::attention ? "attention"
                                                         : stream;
  return factor == 0 ? what + "=free" : fmt::format("{}*{}", what, factor);
}

std::vector<CostChange> parse_cost_changes(std::string_view spec) {
  std::vector<CostChange> changes;
  while (true) {
    const std::size_t comma = spec.find(',');
    changes.push_back(parse_change(spec.substr(0, comma)));
    if (comma == std::string_view::npos) break;
    spec = spec.substr(comma + 1);
  }
  return changes;
}

CostHint changed_cost(const TaskTable& tasks, TaskId task, CostHint cost,
                      const std::vector<CostChange>& changes) {
  const TaskInfo& info = tasks[task];
  const bool moves_data = info.kind == TaskKind::comm || info.kind == TaskKind::copy;
  for (const CostChange& c : changes) {
    switch (c.target) {
      case CostChange::Target::stream:
        if (!moves_data || tasks.stream_name(info.stream) != c.stream) break;
        cost.bytes *= c.factor;
        if (c.factor == 0) cost.messages = 0;
        break;
      case CostChange::Target::compute:
        if (info.kind == TaskKind::compute) cost = c.factor * cost;
        break;
      case CostChange::Target::attention:
        if (info.kind != TaskKind::compute) break;
        cost.flops -= (1 - c.factor) * cost.attention_flops;
        cost.attention_flops = static_cast<float>(cost.attention_flops * c.factor);
        break;
    }
  }
  return cost;
}

WhatIfCostModel::WhatIfCostModel(const CostModel& base, std::vector<CostChange> changes)
    : base_(base), changes_(std::move(changes)) {}

Nanos WhatIfCostModel::duration(const TaskTable& tasks, TaskId task, const CostHint& cost) const {
  // Free is free whatever the base model prices beside bytes and messages (a cluster model
  // prices a collective's latency by its group and pattern).
  const TaskInfo& info = tasks[task];
  if (info.kind == TaskKind::comm || info.kind == TaskKind::copy)
    for (const CostChange& c : changes_)
      if (c.target == CostChange::Target::stream && c.factor == 0 &&
          tasks.stream_name(info.stream) == c.stream)
        return 0;
  return base_.duration(tasks, task, changed_cost(tasks, task, cost, changes_));
}

}  // namespace weave::rt
