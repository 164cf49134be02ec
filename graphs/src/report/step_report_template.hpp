// The report page's HTML, CSS and JavaScript (src/report/step_report.html), compiled in by
// graphs/CMakeLists.txt.
#pragma once

#include <string>

namespace weave::graphs {

// The page with the placeholder kStepReportData where the step's JSON document goes.
std::string step_report_template();

inline constexpr const char* kStepReportData = "/*WEAVE_STEP_REPORT_DATA*/";

}  // namespace weave::graphs
