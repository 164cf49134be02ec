// Optimizer steps against closed-form single-element updates; clipping by global norm.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "weave/ops/optimizer.hpp"

namespace weave::ops {
namespace {

using TensorD = BasicTensor<double>;

TEST(AdamW, FirstStepMovesByLearningRateTimesSignOfGradient) {
  // Step 1: m_hat = g, v_hat = g^2, so the update is lr * g / (|g| + eps) after the decay.
  const TensorD p = TensorD::from(std::vector<double>{1.0, -2.0}, {2});
  const TensorD g = TensorD::from(std::vector<double>{0.5, -3.0}, {2});
  const TensorD m = TensorD::zeros({2}), v = TensorD::zeros({2});
  const AdamWOptions opt{.lr = 0.1, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
  adamw_step(opt, 1, p, g, m, v);
  EXPECT_NEAR(p.data()[0], 1.0 * (1 - 0.01) - 0.1 * 0.5 / (0.5 + 1e-8), 1e-14);
  EXPECT_NEAR(p.data()[1], -2.0 * (1 - 0.01) + 0.1 * 3.0 / (3.0 + 1e-8), 1e-14);
  EXPECT_NEAR(m.data()[0], 0.05, 1e-15);
  EXPECT_NEAR(v.data()[1], 0.05 * 9.0, 1e-14);
  EXPECT_THROW(adamw_step(opt, 0, p, g, m, v), std::invalid_argument);
}

TEST(Sgd, MomentumFollowsPyTorchsRecurrence) {
  const TensorD p = TensorD::from(std::vector<double>{1.0}, {1});
  const TensorD buf = TensorD::zeros({1});
  const SgdOptions opt{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01};
  double ref_p = 1.0, ref_b = 0;
  for (int step = 1; step <= 3; ++step) {
    const double grad = 0.5 * step;
    const TensorD g = TensorD::from(std::vector<double>{grad}, {1});
    sgd_step(opt, step, p, g, buf);
    const double d = grad + 0.01 * ref_p;
    ref_b = step == 1 ? d : 0.9 * ref_b + d;
    ref_p -= 0.1 * ref_b;
    EXPECT_NEAR(p.data()[0], ref_p, 1e-15) << "step " << step;
  }
}

TEST(ClipGradNorm, ScalesOnlyAboveTheMaximum) {
  std::vector<TensorD> grads{TensorD::from(std::vector<double>{3.0, 0.0}, {2}),
                             TensorD::from(std::vector<double>{4.0}, {1})};
  EXPECT_NEAR(clip_grad_norm<double>(grads, 10.0), 5.0, 1e-15);
  EXPECT_EQ(grads[0].data()[0], 3.0);  // below the maximum: untouched
  EXPECT_NEAR(clip_grad_norm<double>(grads, 1.0), 5.0, 1e-15);
  EXPECT_NEAR(grads[0].data()[0], 3.0 / (5.0 + 1e-6), 1e-15);
  EXPECT_NEAR(grads[1].data()[0], 4.0 / (5.0 + 1e-6), 1e-15);
  EXPECT_THROW(clip_grad_norm<double>(grads, 0.0), std::invalid_argument);
}

}  // namespace
}  // namespace weave::ops
