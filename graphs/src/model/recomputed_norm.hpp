// The tail of a norm recomputed by selective recomputation (--recompute-modules layernorm): under
// sequence parallelism the product after the norm reads its output gathered over the tp group,
// so the recomputation gathers it again, and a 16-bit run rounds the gathered values into the
// product's kept input, as the forward's task does.
#pragma once

#include <string>

#include "step/rank_program.hpp"

namespace weave::graphs {

// After `norm`, the recomputed norm's task: `out` gathered into `full` in fp32 (the task
// `gather_name`), or in a 16-bit run the workspace the norm wrote into gathered and rounded into
// `kept16` (`round_name`). Returns the last task; `norm` itself without sequence parallelism.
TaskId gather_recomputed_norm(RankProgram& P, TaskId norm, rt::TaskTags tags,
                              const std::string& gather_name, const std::string& round_name,
                              const Tensor& out, const Tensor& full, const ops::Bf16Tensor& kept16);

}  // namespace weave::graphs
