// What a module sees while it declares its parameters on one rank's shard: the rank's place in
// the mesh, the initialisation's scales, and `add`, which makes a parameter in the model's order
// (the order is its random stream, so every split of the model starts from the same values)
// into the gradient bucket last named. Each module (embedding, attention_block and its query/key
// stages, dense_mlp, the MoE MLP's router and experts, output_loss) declares its own parameters
// through it; ModelShard asks them in the model's order.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/layer_spec.hpp"
#include "weave/graphs/model_shard.hpp"

namespace weave::graphs {

class ParameterDeclarer {
 public:
  ParameterDeclarer(ModelShard& shard, const ModelConfig& model, const Mesh& mesh, int rank);

  const ModelConfig& model;
  const Mesh& mesh;
  const MeshCoordinates at;
  const int tp;
  const double std;      // --init-method-std
  const double out_std;  // a block's output layers: std / sqrt(2 layers), Megatron's scaled init

  // The parameters declared next join bucket `name` ("layers.3.mlp").
  void bucket(std::string name);
  // Whether this stage holds the parameters declared next; parameters it does not hold are
  // counted (their index is their random stream) and `add` returns a placeholder.
  void hold(bool held);
  // The first logical row of this rank's vocabulary shard (word embedding, output layer).
  std::int64_t vocab_start() const;
  // A parameter of local shape `local` whose local row r is logical row row_map[r] and local
  // column c logical column col_offset + c: normal(0, init_std) draws when init_std > 0,
  // otherwise every element `constant`.
  Parameter& add(const std::string& name, const ops::Shape& local, std::int64_t logical_rows,
                 std::int64_t logical_cols, RowMap row_map, std::int64_t col_offset,
                 double init_std, double constant);
  // A state tensor of local shape `local`, zero at the start, that checkpoints keep and the
  // optimizer leaves (ModelState).
  ModelState& state(const std::string& name, const ops::Shape& local);
  // `p` is the same on every tensor-parallel rank; `sees_split_tokens`: each tp rank computed its
  // gradient from other tokens or heads, so the gradients are summed over tp.
  Parameter& replicated(Parameter& p, bool sees_split_tokens) const;
  // A norm's [h] weight or bias, replicated over tp (summed over it under sequence parallelism).
  Parameter* norm(const std::string& name, double value);

 private:
  ModelShard& shard_;
};

}  // namespace weave::graphs
