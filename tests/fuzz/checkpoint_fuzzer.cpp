// libFuzzer target: the checkpoint reader (checkpoint_input.hpp). A refusal must be the
// documented std::runtime_error naming what does not match; any other exception, a crash or a
// sanitizer report is a finding.
//
// The seed corpus (tests/fuzz/corpus/checkpoint) holds a whole checkpoint of the tiny model;
// after a change of the model or the format, rewrite it with
//   WEAVE_FUZZ_WRITE_SEED=tests/fuzz/corpus/checkpoint/tiny.ckpt
//   build-fuzz/tests/fuzz/checkpoint_fuzzer
#include <cstdint>
#include <cstdlib>
#include <stdexcept>

#include "checkpoint_input.hpp"
#include "scratch_file.hpp"

namespace {

weave::fuzz::TinyCheckpointStep& tiny_step() {
  static weave::fuzz::TinyCheckpointStep s;
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* seed = std::getenv("WEAVE_FUZZ_WRITE_SEED")) {
    weave::fuzz::TinyCheckpointStep& s = tiny_step();
    weave::graphs::save_checkpoint(seed, s.model, s.plan, s.step,
                                   {.iteration = 7, .consumed_samples = 7});
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static weave::fuzz::ScratchFile file("checkpoint");
  try {
    tiny_step().load(file.write(data, size));
  } catch (const std::runtime_error&) {
  }
  return 0;
}
