// The FLOP cost hints of the step's compute tasks, for the virtual clock.
#include "training_step_impl.hpp"

namespace weave::graphs {

double TrainingStep::Impl::flops_of(const std::string& name) const {
  // Names are "kind", "L<layer>.kind", for an Ampipe chunk "L<layer>.c<chunk>.kind", and for a
  // pipe-experts item "L<layer>[.c<chunk>].i<item>.kind".
  std::string kind = name;
  if (kind.size() > 1 && kind[0] == 'L' && kind.find('.') != std::string::npos)
    kind = kind.substr(kind.find('.') + 1);
  // Strips a "<letter><number>." prefix, returning the number (or -1).
  auto strip = [&kind](char letter) {
    if (kind.size() < 2 || kind[0] != letter ||
        !std::isdigit(static_cast<unsigned char>(kind[1])) || kind.find('.') == std::string::npos)
      return -1;
    const int index = std::stoi(kind.substr(1, kind.find('.') - 1));
    kind = kind.substr(kind.find('.') + 1);
    return index;
  };
  const int chunk_index = strip('c');
  if (strip('i') >= 0) {
    // One item: its share of its slot's expert work (balanced routing).
    const double items = static_cast<double>(m.num_experts / ep() * plan.pipe_experts_slices());
    const double k = m.moe_router_topk, hd = static_cast<double>(h);
    const double f1 = m.activation == Activation::swiglu ? 2.0 * f : f;
    const double experts = 2 * static_cast<double>(T) * k * hd * (f1 + f) / ampipe() / items;
    if (kind == "experts") return experts;
    if (kind == "experts_backward") return 2 * experts;
    return 0;
  }
  if (chunk_index >= 0) {
    // One Ampipe chunk: 1/N of the per-token work; a piece of q queries from row `first`
    // sees q (2 first + q) / Sc^2 of the causal attention's keys ((2c+1)/N^2 of them for a
    // chunk in one piece).
    const double N = ampipe();
    double causal = 0;
    for (int j = 0; j < t_sp; ++j) {
      const double q = static_cast<double>(piece_rows());
      const double first = static_cast<double>(piece_start(chunk_index, j));
      causal += q * (2 * first + q) / (static_cast<double>(Sc) * static_cast<double>(Sc));
    }
    const double share = 1.0 / N;
    const double rows = static_cast<double>(Sc * B), hd = static_cast<double>(h);
    const double proj = 2 * rows * Hl * d * hd;
    // This rank's causal attention: its Sc queries against half of the S keys on average.
    const double attention =
        2 * 2 * static_cast<double>(B * Hl * Sc) * static_cast<double>(S) * d * 0.5;
    if (cp > 1) {
      // Under CP a chunk is one of the two balanced halves: a half against one block is
      // 1/(2 cp) of the attention; chunk 1 attends to all cp blocks in one task.
      const double per_block = attention / (2.0 * cp);
      const double blocks = chunk_index == 1 ? cp : 1;
      if (kind == "attention_step") return per_block;
      if (kind == "attention") return blocks * per_block + proj / 2;
      if (kind == "attention_backward") return 2.5 * attention / 2 + proj;
    }
    const double k = m.moe_router_topk;
    const double f1 = m.activation == Activation::swiglu ? 2.0 * f : f;
    const double experts = 2 * static_cast<double>(T) * k * hd * (f1 + f);
    const double router = 2 * static_cast<double>(T) * hd * m.num_experts;
    if (kind == "attention") return causal * attention + share * proj;
    if (kind == "router") return share * router;
    if (kind == "experts") return share * experts;
    if (kind == "attention_backward") return 2.5 * causal * attention + 2 * share * proj;
    if (kind == "experts_backward") return (split_ ? 1 : 2) * share * experts;
    if (kind == "experts_weight_grad") return share * experts;
    if (kind == "router_backward") return 2 * share * router;
    return 0;
  }
  const double rows = static_cast<double>(Sc * B), hd = static_cast<double>(h);
  const double qkv = 2 * rows * hd * 3 * Hl * d, proj = 2 * rows * Hl * d * hd;
  // Causal attention: half of the (local queries x all keys) scores, two products.
  const double attention =
      2 * 2 * static_cast<double>(B * Hl * Sc) * static_cast<double>(S / cp * cp) * d * 0.5;
  const double mlp = 2 * rows * hd * (f1l + fl);
  const double logits = 2 * rows * hd * Vl;
  const double k = m.moe_router_topk;
  const double f1 = m.activation == Activation::swiglu ? 2.0 * f : f;
  const double experts = 2 * static_cast<double>(T) * k * hd * (f1 + f);
  if (kind == "qkv") return qkv;
  if (kind == "attention") return attention / cp + proj;
  if (kind == "attention_step") return attention / cp;
  if (kind == "attention_backward_step") return 2.5 * attention / cp;
  if (kind == "mlp") return mlp;
  if (kind == "logits") return logits;
  if (kind == "experts") return experts;
  if (kind == "router") return 2 * static_cast<double>(T) * hd * m.num_experts;
  // A split backward (split_) moves the out-projection's and fc2's weight GEMMs to W.
  const double fc2_weight = 2 * rows * hd * fl;
  if (kind == "attention_backward")
    return (split_ ? 1 : 2) * proj + (cp == 1 ? 2.5 * attention : 0);
  if (kind == "attention_weight_grad") return proj;
  if (kind == "qkv_backward" || kind == "qkv_weight_grad") return qkv;
  if (kind == "mlp_backward") return (split_ ? 1 : 2) * fc2_weight + 2 * rows * hd * f1l;
  if (kind == "mlp_weight_grad") return 2 * rows * hd * f1l + (split_ ? fc2_weight : 0);
  if (kind == "loss_backward" || kind == "logits_weight_grad") return logits;
  if (kind == "experts_backward") return (split_ ? 1 : 2) * experts;
  if (kind == "experts_weight_grad") return experts;
  if (kind == "router_backward") return 4 * static_cast<double>(T) * hd * m.num_experts;
  return 0;
}

}  // namespace weave::graphs
