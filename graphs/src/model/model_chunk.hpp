// A model chunk's forward and backward for one micro-batch: its layers, with the embedding in
// front of the first chunk and the loss behind the last; between chunks the activations and
// their gradients wait in the set's x_in, d_recv and d_send for the pipeline's transfers.
#pragma once

#include "step/rank_program.hpp"
#include "step/weight_halves.hpp"

namespace weave::graphs {

class ModelChunk {
 public:
  ModelChunk(RankProgram& rank, int chunk) : P(&rank), k(chunk) {}

  // `ready`: its input is there. Returns the task after which its output (or loss) is.
  TaskId forward(const BuildPosition& pos, TaskId ready) const;
  // From the loss (the last chunk) or from the gradient of its output in the set's d_recv
  // (after `ready`); leaves the gradient of its input in d_send, or ends with the embedding.
  // `last`: the chunk's last backward of the step, after which its buckets are reduced and
  // `word_grad_done` names the task after which the word embedding's gradient is complete.
  // `d_send_read`: the send that last read the set's d_send, which this backward rewrites.
  TaskId backward(const BuildPosition& pos, TaskId ready, WeightHalves& halves, bool last,
                  TaskId& word_grad_done, TaskId d_send_read = rt::kNoTask) const;
  // The W action: the weight halves the chunk's I left, after which the set is free; after the
  // chunk's last W its buckets are reduced.
  TaskId weight_gradients(std::vector<LayerWeightHalf> halves, bool last,
                          TaskId& word_grad_done) const;

 private:
  RankProgram* P;
  int k;
};

}  // namespace weave::graphs
