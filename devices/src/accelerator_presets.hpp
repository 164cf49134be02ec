// The accelerator presets' JSON text by name (generated from devices/accelerators/).
#pragma once

#include <string_view>
#include <utility>
#include <vector>

namespace weave::devices::detail {

const std::vector<std::pair<std::string_view, std::string_view>>& accelerator_presets();

}  // namespace weave::devices::detail
