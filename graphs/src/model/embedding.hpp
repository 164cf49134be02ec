// The input embedding: word embeddings looked up in each tensor-parallel rank's vocabulary shard
// and summed over the group (reduce-scattered under SP), plus learned positions and dropout.
// Shapes on a rank: tokens [Sc B] -> partial sums [Sc, B, h] -> (reduce) x_in [Sl, B, h].
#pragma once

#include "model/embedding_parameters.hpp"
#include "model/parameter_declarer.hpp"
#include "step/rank_program.hpp"

namespace weave::graphs {

class Embedding {
 public:
  explicit Embedding(RankProgram& rank) : P(&rank) {}

  // Into the set's x_in (after `ready`); returns the task after which it is there.
  TaskId forward(const BuildPosition& pos, TaskId ready) const;
  // From x_in's gradient in the workspace's d_x: the positions' and the word embedding's
  // gradients. Returns the task after which the word embedding's is complete.
  TaskId backward(const BuildPosition& pos, TaskId ready) const;

  // Declares the word embedding (this rank's vocabulary shard) and the learned positions into
  // the embedding bucket, held as `contents` says: the word embedding by the first stage and,
  // tied, by the last.
  static void declare_parameters(ParameterDeclarer& declare, const StageContents& contents,
                                 EmbeddingParameters& E);

 private:
  RankProgram* P;
};

}  // namespace weave::graphs
