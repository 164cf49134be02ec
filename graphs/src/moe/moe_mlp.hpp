// A Mixture-of-Experts layer's MLP, made of the parts Megatron-Core's MoELayer is made of: the
// router (moe_router.cpp), the token dispatcher (moe_token_dispatcher.cpp: permutation and the
// expert-parallel all-to-alls, with explicit phases) and the experts (moe_experts.cpp, and split
// over tp moe_split_experts.cpp and moe_split_items.cpp). The layer's spec names the dispatcher
// and the experts it runs (LayerSpec::moe_mlp); each part's parameters and state are structs of its
// own (moe_parameters.hpp, moe_activations.hpp). This class composes them: its work is cut into
// slots (all of a rank's tokens, or one Ampipe chunk of them) and each slot's forward into three
// phases so that Ampipe can interleave slots:
//   route:   router, dispatch plan, permutation; the dispatch all-to-all launched
//   experts: the local experts; the combine all-to-all launched
//   combine: the weighted combine into the slot's output rows
// and its backward into the mirrored three (combine, experts, router). With --use-pipe-experts a
// slot's expert work is further cut into items (local expert x capacity slice), each with its
// own all-to-alls.
//
// Shapes on a rank: a slot routes n = T / degree tokens [n, h]; it sends n k rows (top-k picks)
// grouped by destination, and receives at most slot_capacity() rows for its local experts.
#pragma once

#include <string>
#include <vector>

#include "model/parameter_declarer.hpp"
#include "moe/moe_parameters.hpp"
#include "step/rank_program.hpp"
#include "step/weight_halves.hpp"

namespace weave::graphs {

// What one phase of a slot leaves for the next: the task after which its data is there, and
// under pipe experts each item's last exchange.
struct SlotProgress {
  TaskId task = rt::kNoTask;
  std::vector<TaskId> items;
};

class MoeMlp {
 public:
  MoeMlp(RankProgram& rank, int layer) : P(&rank), l(layer) {}

  // The whole MLP of a MoE layer at Ampipe degree 1, from the norm in ln2 (after `ready`); its
  // output in mlp_out.
  TaskId forward(const BuildPosition& pos, TaskId ready) const;
  // From the output's gradient in d_mlp; the input's gradient in d_norm.
  TaskId backward(const BuildPosition& pos, TaskId ready, WeightHalves& halves) const;

  // The phases of slot c.
  SlotProgress route(const BuildPosition& pos, int c, TaskId ready) const;
  // route's first task: the router's scores, the dispatch plan and the permutation.
  TaskId router(const BuildPosition& pos, int c, TaskId ready) const;
  // The dispatcher's launch of slot c's dispatch all-to-all(s) once the slot is permuted (none
  // without expert parallelism, none yet when the item pipeline chains them).
  SlotProgress dispatch(const BuildPosition& pos, int c, TaskId permuted) const;
  SlotProgress experts(const BuildPosition& pos, int c, const SlotProgress& routed) const;
  TaskId combine(const BuildPosition& pos, int c, const SlotProgress& computed) const;
  // The router's losses from the whole micro-batch's statistics: the slots' summed (Ampipe),
  // and over the tensor- and context-parallel ranks that hold parts of the same sequences.
  TaskId statistics(const BuildPosition& pos, TaskId ready) const;

  SlotProgress combine_backward(const BuildPosition& pos, int c, TaskId ready) const;
  SlotProgress experts_backward(const BuildPosition& pos, int c, const SlotProgress& arrived,
                                WeightHalves& halves) const;
  // Leaves the slot's input gradient in its d_moe_in.
  TaskId router_backward(const BuildPosition& pos, int c, const SlotProgress& home) const;

  // Split experts as items (moe_split_items.cpp): each item's rows all-gathered over tp, fc1,
  // fc2 and the partial sums reduce-scattered back, pipelined over the items of `slots` in
  // order (slot by slot, each slot's items in order): item k+1's gather is issued before fc1 of
  // item k and item k-1's combine after its reduce-scatter, so both run under item k's GEMMs
  // (MindSpeed's --ampipe-tp-sp-comm-overlap and pipe experts). With --pipe-experts-multi-stream
  // every item collective is chained in one strict order, so expert- and tensor-parallel
  // traffic never share the links at once (MindSpeed chains them so without Ampipe only). `routed`
  // / `arrived`: per slot, the items' dispatches or combine gradients. `gathered`: item 0's gather,
  // if already issued (Ampipe issues it after the last chunk's projection). Returns per slot the
  // items' combines (dispatch gradients).
  std::vector<SlotProgress> split_item_pipeline(const BuildPosition& pos,
                                                const std::vector<int>& slots,
                                                const std::vector<SlotProgress>& routed,
                                                TaskId gathered = rt::kNoTask) const;
  std::vector<SlotProgress> split_item_pipeline_backward(const BuildPosition& pos,
                                                         const std::vector<int>& slots,
                                                         const std::vector<SlotProgress>& arrived,
                                                         WeightHalves& halves) const;
  // Item i of slot c: its rows unpacked from its dispatch and their all-gather over tp issued.
  TaskId gather_item(const BuildPosition& pos, int c, int i, TaskId dispatched) const;

  // Lays out what the MLP keeps for one micro-batch: its output, the router's statistics and a
  // slot per Ampipe chunk (moe_buffers.cpp); with --recompute-modules moe, views of the rank's
  // working set.
  void allocate(LayerActivations& A) const;

  // Declares the router and this rank's experts of layer `layer` into `L`.
  static void declare_parameters(ParameterDeclarer& declare, const LayerSpec& spec, int layer,
                                 MoeMlpParameters& L);

  // Task names of slot c: "L<l>." or, for an Ampipe chunk, "L<l>.c<c>.".
  std::string slot_prefix(int c) const;
  // Slot c's Ampipe chunk for its tasks' tags: c, or -1 without Ampipe (one slot, no chunks).
  int slot_chunk(int c) const { return P->shape.ampipe > 1 ? c : -1; }

 private:
  // allocate's layout, into `A` (the layer's, or the rank's working set).
  void allocate_state(LayerActivations& A) const;
  SlotProgress experts_items(const BuildPosition& pos, int c, const SlotProgress& routed) const;
  // Experts split over the tensor-parallel group (moe_split_experts.cpp): the received rows
  // gathered over tp around the experts and the results reduce-scattered back, forward and
  // backward.
  SlotProgress split_experts(const BuildPosition& pos, int c, const SlotProgress& routed) const;
  SlotProgress split_experts_backward(const BuildPosition& pos, int c, const SlotProgress& arrived,
                                      WeightHalves& halves) const;
  SlotProgress experts_backward_items(const BuildPosition& pos, int c,
                                      const SlotProgress& arrived) const;
  // The expert-parallel all-to-all of a slot's rows: outbound (to the experts' ranks: the slot's
  // send_rows leave `from`, recv_rows arrive in `into`) or back (the counts reversed).
  TaskId slot_exchange(const BuildPosition& pos, int c, TaskId ready,
                       Tensor MoeDispatchState::*from, Tensor MoeDispatchState::*into,
                       bool outbound, const std::string& name, bool framed, rt::Phase phase) const;
  // Item i's all-to-all: outbound or back, framed or not; on a stream of its own per direction
  // (ep_dispatch, ep_combine) with --pipe-experts-separate-streams.
  TaskId item_exchange(const BuildPosition& pos, int c, int i, TaskId ready,
                       Tensor ExpertItem::*from, Tensor ExpertItem::*into, bool outbound,
                       bool framed, const std::string& name, rt::Phase phase) const;
  RankProgram* P;
  int l;
};

// This rank's tokens of MoE slot c: [n, h] rows of the layer's [Sl or Sc, B, h] activations
// (its SP shard, or its 1/tp slice of a replicated sequence under Megatron-Core's router, the
// whole sequence under MindSpeed's gate, and within that the Ampipe chunk).
Tensor slot_tokens(const RankProgram& P, int c, const Tensor& sbh);

}  // namespace weave::graphs
