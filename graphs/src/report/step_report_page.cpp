// The step's JSON document inlined into the page's template: the file a person opens.
#include <fmt/format.h>

#include <fstream>
#include <stdexcept>
#include <string_view>

#include "report/step_report_template.hpp"
#include "weave/graphs/step_report.hpp"

namespace weave::graphs {

std::string step_report_page(const std::string& json) {
  // Inside <script>, "</" could close the element: JSON allows "<\/" for it.
  std::string safe;
  safe.reserve(json.size());
  for (std::size_t i = 0; i < json.size(); ++i) {
    safe += json[i];
    if (json[i] == '<' && i + 1 < json.size() && json[i + 1] == '/') safe += '\\';
  }
  std::string page = step_report_template();
  const std::size_t at = page.find(kStepReportData);
  if (at == std::string::npos)
    throw std::logic_error("the report template has no place for the step's data");
  page.replace(at, std::string_view(kStepReportData).size(), safe);
  return page;
}

std::size_t write_step_report(const std::string& path, const rt::Graph& graph,
                              const rt::Trace& trace, const StepReportInput& input) {
  const std::string page = step_report_page(step_report_json(graph, trace, input));
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << page;
  out.close();
  if (!out)
    throw std::runtime_error(
        fmt::format("--report: writing '{}' failed: check the folder "
                    "exists and is writable",
                    path));
  return page.size();
}

}  // namespace weave::graphs
