#include "model/recomputed_norm.hpp"

#include "model/half_precision.hpp"
#include "model/sequence_parallel.hpp"
#include "step/step_costs.hpp"

namespace weave::graphs {

TaskId gather_recomputed_norm(RankProgram& P, TaskId norm, rt::TaskTags tags,
                              const std::string& gather_name, const std::string& round_name,
                              const Tensor& out, const Tensor& full,
                              const ops::Bf16Tensor& kept16) {
  const StepShape& z = P.shape;
  if (!z.sp()) return norm;
  if (!P.half()) return sp_gather(P, norm, out, full, gather_name, tags);
  // Read 1, write 1 at the gathered size.
  RankProgram* p = &P;
  const TaskId gathered =
      sp_gather(P, norm, P.ws().half.norm_out, P.ws().half.gathered, gather_name, tags);
  const TaskId kept =
      P.compute(round_name, tags, cost::streamed(z, 2.0 * static_cast<double>(z.Sc * z.B * z.h)),
                [p, kept16] { round_to_half(p->precision(), p->ws().half.gathered, kept16); });
  P.after(gathered, kept);
  return kept;
}

}  // namespace weave::graphs
