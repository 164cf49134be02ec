#include "run_record.hpp"

#include "weave/graphs/pipeline_layout.hpp"
#include "weave/graphs/pipeline_schedule_generators.hpp"

namespace weave::cli {

nlohmann::json run_record(const graphs::TrainerConfig& c, const std::string& data,
                          const std::vector<std::string>& no_effect) {
  const graphs::ModelConfig& m = c.model;
  const graphs::ParallelPlan& p = c.plan;
  const nlohmann::json model{
      {"num_layers", m.num_layers},
      {"hidden_size", m.hidden_size},
      {"num_attention_heads", m.num_attention_heads},
      {"ffn_hidden_size", m.ffn_hidden_size},
      {"seq_length", m.seq_length},
      {"max_position_embeddings", m.positions()},
      {"vocab_size", m.vocab_size},
      {"padded_vocab_size", m.padded_vocab_size(p.tensor_parallel)},
      {"swiglu", m.activation == graphs::Activation::swiglu},
      {"position_embedding_type", graphs::position_embedding_name(m.position_embedding)},
      {"rotary_percent", m.rotary_percent},
      {"rotary_base", m.rotary_base},
      {"normalization",
       m.normalization == graphs::Normalization::rms_norm ? "RMSNorm" : "LayerNorm"},
      {"norm_epsilon", m.layernorm_epsilon},
      {"num_query_groups", m.query_groups()},
      {"qk_layernorm", m.qk_layernorm},
      {"untie_embeddings_and_output_weights", m.untie_embeddings_and_output_weights},
      {"add_bias_linear", m.add_bias_linear},
      {"attention_dropout", m.attention_dropout},
      {"hidden_dropout", m.hidden_dropout},
      {"init_method_std", m.init_method_std},
      {"num_experts", m.num_experts},
      {"moe_layer_freq", m.moe_layer_freq},
      {"moe_router_topk", m.moe_router_topk},
      {"moe_aux_loss_coeff", m.moe_aux_loss_coeff},
      {"moe_z_loss_coeff", m.moe_z_loss_coeff},
      {"moe_expert_capacity_factor", m.moe_expert_capacity_factor},
      {"seed", m.seed}};
  const nlohmann::json plan{
      {"devices", p.devices()},
      {"tensor_model_parallel_size", p.tensor_parallel},
      {"sequence_parallel", p.sequence_parallel},
      {"context_parallel_size", p.context_parallel},
      {"expert_model_parallel_size", p.expert_parallel},
      {"expert_tensor_parallel_size", p.expert_tensor_parallel},
      {"moe_model_type", p.moe_model_type},
      {"data_parallel_size", p.data_parallel},
      {"pipeline_model_parallel_size", p.pipeline_parallel},
      {"pipeline_scheduler", p.pipeline_parallel > 1 ? std::string(graphs::schedule_name(
                                                           graphs::pipeline_schedule_kind(p)))
                                                     : std::string()},
      {"virtual_pipeline_model_parallel_size", p.virtual_pipeline},
      {"microbatch_group_size_per_virtual_pipeline_stage", p.microbatch_group_size},
      {"decoder_first_pipeline_num_layers", p.first_stage_layers},
      {"decoder_last_pipeline_num_layers", p.last_stage_layers},
      {"micro_batch_size", p.micro_batch_size},
      {"global_batch_size", p.global_batch_size},
      {"micro_batches", p.micro_batches()},
      {"use_distributed_optimizer", p.distributed_optimizer},
      {"ampipe_degree", p.ampipe_degree},
      {"ampipe_tp_sp_comm_overlap", p.ampipe_tp_sp_comm_overlap},
      {"ampipe_cp_resend_kv", p.ampipe_cp_resend_kv},
      {"use_pipe_experts", p.pipe_experts},
      {"pipe_experts_multi_stream", p.pipe_experts_multi_stream},
      {"pipe_experts_separate_streams", p.pipe_experts_separate_streams},
      {"pipe_experts_multi_data", p.pipe_experts_multi_data}};
  const graphs::LearningRateSchedule& lr = c.learning_rate;
  return {{"model", model},
          {"plan", plan},
          {"optimizer",
           {{"adam_beta1", c.optimizer.adamw.beta1},
            {"adam_beta2", c.optimizer.adamw.beta2},
            {"adam_eps", c.optimizer.adamw.eps},
            {"weight_decay", c.optimizer.adamw.weight_decay},
            {"clip_grad", c.optimizer.clip_grad}}},
          {"learning_rate",
           {{"lr", lr.lr},
            {"min_lr", lr.min_lr},
            {"lr_warmup_iters", lr.warmup_iters},
            {"lr_decay_iters", lr.decay_iters},
            {"lr_decay_style", lr.style}}},
          {"train_iters", c.train_iters},
          {"eval_interval", c.eval_interval},
          {"eval_iters", c.eval_iters},
          {"save", c.save_path},
          {"save_interval", c.save_interval},
          {"load", c.load_path},
          {"log_interval", c.metrics_interval},
          {"trace", c.trace_path},
          {"trace_iteration", c.trace_iteration},
          {"timing", c.timing == graphs::Timing::virtual_clock ? "model" : "wall"},
          {"device_flops", c.machine.device_flops},
          {"link", c.machine.link},
          {"data", data},
          {"no_effect", no_effect}};
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
