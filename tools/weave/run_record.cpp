#include "run_record.hpp"

#include <string_view>
#include <variant>

#include "weave/graphs/config_flags.hpp"

namespace weave::cli {

nlohmann::json run_record(const graphs::TrainerConfig& c, const std::string& data,
                          const std::vector<std::string>& no_effect) {
  nlohmann::json record{{"model", nlohmann::json::object()},
                        {"plan", nlohmann::json::object()},
                        {"optimizer", nlohmann::json::object()},
                        {"learning_rate", nlohmann::json::object()}};
  for (const graphs::DescribedSetting& s : graphs::describe_configuration(c)) {
    const std::string_view section = graphs::described_section_name(s.section);
    nlohmann::json& into = section.empty() ? record : record[std::string(section)];
    std::visit([&](const auto& value) { into[s.key] = value; }, s.value);
  }
  record["data"] = data;
  record["no_effect"] = no_effect;
  return record;
}

nlohmann::json summary_record(const graphs::TrainingSummary& done, std::int64_t iteration) {
  return {{"iterations", done.iterations},
          {"last_iteration", iteration},
          {"first_loss", done.first_loss},
          {"last_loss", done.last_loss},
          {"seconds", done.seconds},
          {"tokens", done.tokens},
          {"tokens_per_second", done.tokens_per_second},
          {"gflops_per_second", done.gflops_per_second},
          {"stopped", done.stopped}};
}

}  // namespace weave::cli
