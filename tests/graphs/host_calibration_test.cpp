// weave calibrate's attention table: each measured shape is priced at its own measured rate, a run
// at the row of its head width and the sequence its kernel calls see, and the table survives the
// preset file.
#include <gtest/gtest.h>

#include <string>

#include "weave/devices/accelerator.hpp"
#include "weave/graphs/host_calibration.hpp"

namespace weave::graphs {
namespace {

TEST(HostCalibration, AttentionIsPricedByTheRateMeasuredAtItsHeadWidthAndSequence) {
  const HostCalibration c = calibrate_host({.devices = 1, .seconds_per_measurement = 0.001});
  const devices::Accelerator& a = c.preset;
  ASSERT_EQ(a.attention_kernels.size(), 2u);
  EXPECT_EQ(a.attention_kernels[0].first, "flash");
  EXPECT_EQ(a.attention_kernels[1].first, "fused");
  EXPECT_EQ(a.attention_auto, "flash");
  const devices::AttentionRateTable& table = a.attention_kernels[0].second;
  ASSERT_EQ(table.forward.size(), 4u);
  ASSERT_EQ(table.backward.size(), 4u);
  for (const auto& row : table.forward)
    EXPECT_EQ(row.points.size(), 4u) << row.head_dim;
  // Every measured shape is one of the table's points: the preset prices it as it ran.
  int attention = 0;
  for (const KernelMeasurement& m : c.measurements) {
    if (m.kernel != "attention") continue;
    ++attention;
    EXPECT_NEAR(m.modelled_seconds, m.seconds, 1e-9 * m.seconds) << m.shape;
  }
  EXPECT_EQ(attention, 32);
  // A run's rate is its row's: heads of 32 at 256 positions, whichever backend runs the kernel.
  const double row = table.rate(32, 256, false);
  EXPECT_GT(row, 0);
  EXPECT_DOUBLE_EQ(a.sustained_attention_flops("flash", 32, 256, false), row);
  EXPECT_DOUBLE_EQ(a.sustained_attention_flops("auto", 32, 256, false), row);
  EXPECT_DOUBLE_EQ(a.sustained_attention_flops("fused", 32, 256, true), table.rate(32, 256, true));
  // Written and read back, the table prices the same.
  const devices::Accelerator back = devices::Accelerator::parse(a.to_json(), "calibrated");
  for (double d : {16.0, 32.0, 64.0, 128.0})
    for (double s : {128.0, 256.0, 512.0, 1024.0}) {
      EXPECT_NEAR(back.sustained_attention_flops("flash", d, s, false), table.rate(d, s, false),
                  1e-9 * table.rate(d, s, false));
      EXPECT_NEAR(back.sustained_attention_flops("auto", d, s, true), table.rate(d, s, true),
                  1e-9 * table.rate(d, s, true));
    }
}

}  // namespace
}  // namespace weave::graphs
