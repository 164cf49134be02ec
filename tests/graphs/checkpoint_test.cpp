// Checkpoints: a resumed run continues with bitwise the same losses; damaged or mismatched
// files are refused and change nothing.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "tiny_model.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/checkpoint.hpp"
#include "weave/graphs/learning_rate.hpp"
#include "weave/graphs/moe_layer_freq.hpp"

namespace weave::graphs {
namespace {

class Trainer {
 public:
  Trainer(const ModelConfig& m, ParallelPlan p)
      : m_(m),
        plan_((validate(m, p), p)),
        set_(plan_.devices(), {.pin = false}),
        step_(m_, plan_, {}, set_, comm_) {}
  double train(std::int64_t iteration) {
    fill_batches(step_, m_, plan_, iteration * plan_.global_batch_size);
    step_.prepare(
        iteration,
        LearningRateSchedule{.lr = 1e-2, .warmup_iters = 2, .decay_iters = 10}.at(iteration));
    set_.executor().run(step_.graph());
    return step_.result().loss;
  }
  TrainingStep& step() { return step_; }
  const ModelConfig& model() const { return m_; }
  const ParallelPlan& plan() const { return plan_; }

 private:
  ModelConfig m_;
  ParallelPlan plan_;
  devices::DeviceSet set_;
  devices::SharedMemoryCommunicator comm_;
  TrainingStep step_;
};

std::string temp_path(const char* name) {
  return (std::filesystem::temp_directory_path() / fmt::format("weave-{}-{}", ::getpid(), name))
      .string();
}

TEST(Checkpoint, ResumedRunContinuesWithIdenticalLosses) {
  const ParallelPlan plan{.tensor_parallel = 2,
                          .sequence_parallel = true,
                          .micro_batch_size = 2,
                          .global_batch_size = 4};
  const std::string path = temp_path("resume.ckpt");
  Trainer a(tiny(4), plan);
  for (int it = 1; it <= 3; ++it)
    a.train(it);
  save_checkpoint(path, a.model(), a.plan(), a.step(), {.iteration = 3, .consumed_samples = 12});
  const double a4 = a.train(4), a5 = a.train(5);

  Trainer b(tiny(4), plan);
  const CheckpointState state = load_checkpoint(path, b.model(), b.plan(), b.step());
  EXPECT_EQ(state.iteration, 3);
  EXPECT_EQ(state.consumed_samples, 12u);
  EXPECT_EQ(b.train(4), a4);
  EXPECT_EQ(b.train(5), a5);
  std::filesystem::remove(path);
}

// ZeRO stage 3 saves the whole parameters, assembled from the replicas' shards, and each
// replica's shard of the moments, as stage 1 does: resumed, it continues bitwise; its checkpoint
// loads under plain data parallelism (every replica's whole moments from the shards) and back.
TEST(Checkpoint, StageThreeSavesWholeParametersAndLoadsUnderPlainDataParallelism) {
  const ParallelPlan plain{.data_parallel = 2, .micro_batch_size = 1, .global_batch_size = 4};
  ParallelPlan stage3 = plain;
  stage3.distributed_optimizer = stage3.shard_gradients = stage3.shard_parameters = true;
  const std::string path = temp_path("stage3.ckpt"), back = temp_path("stage3-back.ckpt");
  Trainer a(tiny(4), stage3);
  for (int it = 1; it <= 3; ++it)
    a.train(it);
  save_checkpoint(path, a.model(), a.plan(), a.step(), {.iteration = 3});
  const double a4 = a.train(4), a5 = a.train(5);

  Trainer b(tiny(4), stage3);
  load_checkpoint(path, b.model(), b.plan(), b.step());
  EXPECT_EQ(b.train(4), a4);
  EXPECT_EQ(b.train(5), a5);

  // Under plain data parallelism each replica holds the values and moments whole: those of the
  // stage-3 replicas' shards put end to end (a sharded bucket of a layer, dense and expert).
  Trainer c(tiny(4), plain);
  load_checkpoint(path, c.model(), c.plan(), c.step());
  Trainer saved(tiny(4), stage3);
  load_checkpoint(path, saved.model(), saved.plan(), saved.step());
  int compared = 0;
  for (int r = 0; r < 2; ++r)
    for (std::size_t i = 0; i < c.step().shard(r).buckets().size(); ++i) {
      const GradientBucket& whole = c.step().shard(r).buckets()[i];
      for (int owner = 0; owner < 2; ++owner) {
        const GradientBucket& shard = saved.step().shard(owner).buckets()[i];
        ASSERT_EQ(shard.name, whole.name);
        if (!shard.values_staged) continue;
        ++compared;
        EXPECT_EQ(whole.values.slice(0, shard.shard_begin, shard.shard_size).to_vector(),
                  shard.value_shard.to_vector())
            << whole.name;
        EXPECT_EQ(whole.exp_avg_sq.slice(0, shard.shard_begin, shard.shard_size).to_vector(),
                  shard.exp_avg_sq.to_vector())
            << whole.name;
      }
    }
  EXPECT_GE(compared, 8);  // two layers' halves, each kept by two replicas
  // Saved again under plain data parallelism and loaded under stage 3: the run continues
  // bitwise as the uninterrupted one; trained on under plain data parallelism, within its
  // reductions' rounding.
  save_checkpoint(back, c.model(), c.plan(), c.step(), {.iteration = 3});
  Trainer d(tiny(4), stage3);
  load_checkpoint(back, d.model(), d.plan(), d.step());
  EXPECT_EQ(d.train(4), a4);
  EXPECT_EQ(d.train(5), a5);
  EXPECT_NEAR(c.train(4), a4, 1e-5 * a4);
  EXPECT_NEAR(c.train(5), a5, 1e-5 * a5);
  std::filesystem::remove(path);
  std::filesystem::remove(back);
}

TEST(Checkpoint, DamagedOrMismatchedFilesAreRefusedAndChangeNothing) {
  const ParallelPlan plan{.micro_batch_size = 2, .global_batch_size = 4};
  const std::string path = temp_path("damaged.ckpt");
  Trainer a(tiny(0), plan);
  a.train(1);
  save_checkpoint(path, a.model(), a.plan(), a.step(), {.iteration = 1});
  EXPECT_FALSE(std::filesystem::exists(path + ".partial"));

  Trainer b(tiny(0), plan);
  const std::vector<float> before = b.step().shard(0).embedding().value.to_vector();
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-100, std::ios::end);
    f.put('\x7f');
  }
  try {
    load_checkpoint(path, b.model(), b.plan(), b.step());
    FAIL() << "a damaged checkpoint was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("checksum"), std::string::npos) << e.what();
  }
  EXPECT_EQ(b.step().shard(0).embedding().value.to_vector(), before);

  save_checkpoint(path, a.model(), a.plan(), a.step(), {.iteration = 1});
  ModelConfig wider = tiny(0);
  wider.hidden_size = 64;
  Trainer c(wider, plan);
  try {
    load_checkpoint(path, c.model(), c.plan(), c.step());
    FAIL() << "a checkpoint of another model was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("hidden_size is 32 in the checkpoint but 64 now"),
              std::string::npos)
        << e.what();
  }
  std::ofstream(path) << "not a checkpoint";
  EXPECT_THROW(load_checkpoint(path, b.model(), b.plan(), b.step()), std::runtime_error);
  EXPECT_THROW(load_checkpoint(path + ".missing", b.model(), b.plan(), b.step()),
               std::runtime_error);
  std::filesystem::remove(path);
}

// The experts' width and the MoE layers' pattern are part of the model a checkpoint holds: a run
// whose experts are another width, or whose pattern picks other layers, is refused naming the
// setting; the same pattern spelt as --moe-layer-freq N loads.
TEST(Checkpoint, ExpertWidthAndMoeLayersMustMatch) {
  const ParallelPlan plan{.micro_batch_size = 2, .global_batch_size = 2};
  const std::string path = temp_path("moe-shape.ckpt");
  ModelConfig narrow = tiny(4);
  narrow.num_layers = 4;
  narrow.moe_ffn_hidden_size = 32;
  set_moe_layer_freq(narrow, "[1,0,1,0]");
  Trainer a(narrow, plan);
  save_checkpoint(path, a.model(), a.plan(), a.step(), {.iteration = 1});
  const SavedConfiguration saved = read_checkpoint_config(path);
  EXPECT_EQ(saved.model.expert_ffn_hidden_size(), 32);
  EXPECT_EQ(saved.model.moe_layer_freq, 2);  // [1,0,1,0] is every second layer
  ModelConfig every_second = narrow;
  set_moe_layer_freq(every_second, "2");
  Trainer same(every_second, plan);
  EXPECT_NO_THROW(load_checkpoint(path, same.model(), same.plan(), same.step()));
  const std::pair<std::string, std::string> changes[] = {
      {"moe_ffn_hidden_size", "moe_ffn_hidden_size is 32 in the checkpoint but 64 now"},
      {"pattern", "moe_layer_freq is 2 in the checkpoint but \"[0,1,1,0]\" now"}};
  for (const auto& [change, message] : changes) {
    ModelConfig other = narrow;
    if (change == "pattern")
      set_moe_layer_freq(other, "[0]+[1]*2+[0]");
    else
      other.moe_ffn_hidden_size = 0;  // --ffn-hidden-size wide
    Trainer b(other, plan);
    try {
      load_checkpoint(path, b.model(), b.plan(), b.step());
      ADD_FAILURE() << change << ": a checkpoint of another model was accepted";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  }
  std::filesystem::remove(path);
}

// The modern decoder's choices are part of the model a checkpoint holds: a run resumes bitwise
// with them, and loading under another choice is refused, naming it.
TEST(Checkpoint, RecordsTheDecodersArchitecture) {
  ModelConfig llama = tiny(4);
  llama.position_embedding = PositionEmbedding::rope;
  llama.normalization = Normalization::rms_norm;
  llama.num_query_groups = 2;
  llama.untie_embeddings_and_output_weights = true;
  llama.add_bias_linear = false;
  const ParallelPlan plan{.pipeline_parallel = 2, .micro_batch_size = 1, .global_batch_size = 4};
  const std::string path = temp_path("llama.ckpt");
  Trainer a(llama, plan);
  a.train(1);
  save_checkpoint(path, a.model(), a.plan(), a.step(), {.iteration = 1, .consumed_samples = 4});
  const double a2 = a.train(2);
  Trainer b(llama, plan);
  load_checkpoint(path, b.model(), b.plan(), b.step());
  EXPECT_EQ(b.train(2), a2);
  const std::pair<const char*, void (*)(ModelConfig&)> others[] = {
      {"normalization is \"RMSNorm\" in the checkpoint but \"LayerNorm\" now",
       [](ModelConfig& m) { m.normalization = Normalization::layer_norm; }},
      {"position_embedding_type is \"rope\" in the checkpoint but \"learned_absolute\" now",
       [](ModelConfig& m) { m.position_embedding = PositionEmbedding::learned_absolute; }},
      {"num_query_groups is 2 in the checkpoint but 4 now",
       [](ModelConfig& m) { m.num_query_groups = 0; }},
      {"untie_embeddings_and_output_weights is true in the checkpoint but false now",
       [](ModelConfig& m) { m.untie_embeddings_and_output_weights = false; }},
  };
  for (const auto& [message, change] : others) {
    ModelConfig other = llama;
    change(other);
    Trainer c(other, plan);
    try {
      load_checkpoint(path, c.model(), c.plan(), c.step());
      ADD_FAILURE() << "loaded under another architecture: " << message;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  }
  std::filesystem::remove(path);
}

// A checkpoint saved before the settings added since existed (RoPE, the norms, query groups,
// biases, the heads' width, virtual and uneven pipeline stages): its header lacks them, and they
// read as their defaults.
TEST(Checkpoint, AHeaderSavedBeforeLaterSettingsReadsThemAsTheirDefaults) {
  const std::string header = R"({"model": {"num_layers": 4, "hidden_size": 32,
      "num_attention_heads": 4, "ffn_hidden_size": 64, "seq_length": 16,
      "max_position_embeddings": 16, "vocab_size": 256, "make_vocab_size_divisible_by": 128,
      "swiglu": true, "num_experts": 0, "moe_layer_freq": 1},
    "plan": {"tensor_model_parallel_size": 2, "sequence_parallel": true,
      "context_parallel_size": 1, "expert_model_parallel_size": 1,
      "expert_tensor_parallel_size": 1, "data_parallel_size": 3,
      "pipeline_model_parallel_size": 1, "use_distributed_optimizer": false},
    "iteration": 3, "consumed_samples": 6, "tensors": []})";
  const std::string path = temp_path("old-header.ckpt");
  {
    std::ofstream out(path, std::ios::binary);
    const std::uint64_t size = header.size();
    out << "WEAVE-CHECKPOINT-1\n";
    out.write(reinterpret_cast<const char*>(&size), sizeof size);
    out << header;
  }
  const SavedConfiguration saved = read_checkpoint_config(path);
  std::filesystem::remove(path);
  const ModelConfig defaults;
  const ModelConfig& m = saved.model;
  EXPECT_EQ(m.num_layers, 4);
  EXPECT_EQ(m.activation, Activation::swiglu);
  EXPECT_EQ(m.position_embedding, defaults.position_embedding);
  EXPECT_EQ(m.rotary_percent, defaults.rotary_percent);
  EXPECT_EQ(m.rotary_base, defaults.rotary_base);
  EXPECT_EQ(m.normalization, defaults.normalization);
  EXPECT_EQ(m.num_query_groups, 0);
  EXPECT_EQ(m.kv_channels, 0);  // before --kv-channels: hidden / heads, read back as unset
  EXPECT_EQ(m.untie_embeddings_and_output_weights, false);
  EXPECT_EQ(m.add_bias_linear, true);
  EXPECT_EQ(m.moe_router_topk, defaults.moe_router_topk);
  EXPECT_EQ(m.expert_ffn_hidden_size(), 64);  // before --moe-ffn-hidden-size: --ffn-hidden-size
  EXPECT_EQ(m.moe_ffn_hidden_size, 0);        // unset, as a dense model must have it
  EXPECT_EQ(m.layernorm_epsilon, defaults.layernorm_epsilon);
  EXPECT_EQ(m.moe_load_balancing, MoeLoadBalancing::aux_loss);
  EXPECT_EQ(saved.plan.tensor_parallel, 2);
  EXPECT_TRUE(saved.plan.sequence_parallel);
  EXPECT_EQ(saved.plan.data_parallel, 3);
  EXPECT_EQ(saved.plan.virtual_pipeline, 1);
  EXPECT_EQ(saved.plan.first_stage_layers, 0);
  EXPECT_EQ(saved.plan.last_stage_layers, 0);
  EXPECT_EQ(saved.state.iteration, 3);
}

TEST(LearningRate, WarmupThenCosineToTheMinimum) {
  const LearningRateSchedule s{.lr = 1.0, .min_lr = 0.1, .warmup_iters = 4, .decay_iters = 14};
  EXPECT_DOUBLE_EQ(s.at(1), 0.25);
  EXPECT_DOUBLE_EQ(s.at(4), 1.0);
  EXPECT_NEAR(s.at(9), 0.55, 1e-12);  // halfway through the decay
  EXPECT_DOUBLE_EQ(s.at(14), 0.1);
  EXPECT_DOUBLE_EQ(s.at(100), 0.1);
  EXPECT_THROW((LearningRateSchedule{.style = "step"}.at(5)), std::invalid_argument);
}

}  // namespace
}  // namespace weave::graphs
