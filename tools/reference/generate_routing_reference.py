#!/usr/bin/python3
"""Routing reference for weave's MoE gates, written from the semantics of MindSpeed's deepspeed_moe
gate (core_r0.8.0 mindspeed/moe/gate.py: top1gating, top2gating, _capacity) and Megatron-Core's
TopKRouter (megatron/core/transformer/moe/router.py and moe_utils.py: softmax, sigmoid or
sqrtsoftplus top-k, group-limited top-k, expert bias, top-k scaling factor, switch load-balancing loss, z-loss,
capacity with drop policy probs or position), with and without Ampipe chunks.

Each case's logits [tokens, experts] come from a hash of (case name, token, expert) that
tests/ops/routing_reference_test.cpp computes too, so only the configuration and the outcome are
committed: each token's picked experts, whether each pick is dropped, its weight, the aux loss and
the z loss, per gate call (chunk) and in total. The arithmetic is float64 on the float32 logits.

Run: /usr/bin/python3 tools/reference/generate_routing_reference.py (or tools/dev reference).
"""
import json
import math
import os

import torch

from hashed_values import fnv1a64, uniform


def hashed(name, rows, cols, scale, skew=0.0):
    """[rows, cols] float32: scale * v (+ skew on column 0), v uniform in [-1, 1) from a hash of
    (name, row, col), as generate_training_reference.py's init_value."""
    key = fnv1a64(name)
    out = []
    for r in range(rows):
        for c in range(cols):
            v = uniform(key, r, c)
            out.append(scale * v + (skew if c == 0 else 0.0))
    return torch.tensor(out, dtype=torch.float32).reshape(rows, cols)


# ---- MindSpeed's deepspeed_moe gate (one call on the tokens it is given) ----


def gate_capacity(tokens, experts, k, factor, min_capacity=4):
    # _capacity: ceil(S / E * factor), top-2 passing factor * 2; at least min_capacity, else at
    # most S. The product is a float32 tensor in the gate (torch.tensor(factor)).
    c = math.ceil(float(torch.tensor(tokens / experts, dtype=torch.float32)
                        * torch.tensor(k * factor, dtype=torch.float32)))
    if c < min_capacity:
        return min_capacity
    return min(c, tokens)


def deepspeed_gate(logits, k, factor, aux_coef):
    S, E = logits.shape
    p = torch.softmax(logits.double(), dim=1)
    capacity = gate_capacity(S, E, k, factor)
    # Choices: highest probability first (no ties in these inputs).
    order = torch.argsort(p, dim=1, descending=True)[:, :k]
    first = order[:, 0]
    first_mask = torch.nn.functional.one_hot(first, E)
    # Buffer locations: the running count of each expert's first choices; second choices after
    # all of the expert's first choices. Top-1: MindSpeed's parser leaves random token selection
    # off (--no-use-rts is store_false onto a default of False), and an expert over capacity then
    # keeps the tokens torch.topk of its 0/1 column returns, an order among equal values PyTorch
    # leaves unspecified (torch 1.13 on CPU keeps neither the earliest nor the latest). The
    # reference keeps the earliest, the order the gate's own buffer locations count in.
    loc1 = (torch.cumsum(first_mask, 0) - 1).gather(1, first[:, None])[:, 0]
    kept1 = loc1 < capacity
    me = p.mean(0)
    ce = first_mask.double().mean(0)
    if k == 1:
        # top1gating's l_aux: sum(me * ce) * E, without the coefficient.
        aux = float((me * ce).sum() * E)
        w = torch.where(kept1, p.gather(1, first[:, None])[:, 0], torch.zeros(S, dtype=p.dtype))
        return capacity, order, kept1[:, None], w[:, None], aux
    second = order[:, 1]
    second_mask = torch.nn.functional.one_hot(second, E)
    loc2 = (torch.cumsum(second_mask, 0) - 1 + first_mask.sum(0, keepdim=True)).gather(
        1, second[:, None])[:, 0]
    kept2 = loc2 < capacity
    # top2gating's l_aux: mean_e(me * ce) * E * E, times the coefficient when it is > 0.
    aux = float((me * ce).mean() * E * E) * (aux_coef if aux_coef > 0 else 1.0)
    w1 = torch.where(kept1, p.gather(1, first[:, None])[:, 0], torch.zeros(S, dtype=p.dtype))
    w2 = torch.where(kept2, p.gather(1, second[:, None])[:, 0], torch.zeros(S, dtype=p.dtype))
    denominator = torch.clamp(w1 + w2, min=torch.finfo(torch.float32).eps)
    w = torch.stack([w1 / denominator, w2 / denominator], 1)
    return capacity, order, torch.stack([kept1, kept2], 1), w, aux


# ---- Megatron-Core's TopKRouter ----


def megatron_router(logits, c, bias):
    T, E = logits.shape
    k = c["top_k"]
    x = logits.double()
    if c["score"] == "softmax":
        # Not pre-softmax: top-k of the logits, then the softmax over the k picked.
        top_logits, index = torch.topk(x, k, dim=1)
        weight = torch.softmax(top_logits, dim=1)
        aux_scores = torch.softmax(x, dim=1)
    else:
        # sigmoid, or sqrtsoftplus: the square root of softplus (PyTorch's: beta 1, threshold 20);
        # both routed alike from there.
        if c["score"] == "sigmoid":
            scores = torch.sigmoid(x)
        else:
            scores = torch.nn.functional.softplus(x).sqrt()
        routing = scores + bias.double() if bias is not None else scores
        if c["group_topk"]:
            G = c["num_groups"]
            group_scores = routing.view(T, G, -1).topk(k // c["group_topk"], dim=-1)[0].sum(-1)
            group_index = torch.topk(group_scores, c["group_topk"], dim=-1)[1]
            group_mask = torch.zeros_like(group_scores).scatter(1, group_index, 1)
            mask = group_mask[:, :, None].expand(T, G, E // G).reshape(T, E)
            routing = routing.masked_fill(mask == 0, float("-inf"))
        index = torch.topk(routing, k, dim=1)[1]
        weight = scores.gather(1, index)
        if k > 1:
            weight = weight / (weight.sum(-1, keepdim=True) + 1e-20)
        aux_scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
    weight = weight * c.get("scaling_factor", 1.0)
    # The load-balancing loss takes the plain top-k of the scores (no groups, no bias).
    plain = torch.topk(aux_scores, k, dim=1)[1]
    counts = torch.zeros(E, dtype=torch.float64).scatter_add(
        0, plain.reshape(-1), torch.ones(T * k, dtype=torch.float64))
    # Statistics: counts, probability sums, sum of squared log-sum-exps, tokens: the parts of a
    # batch routed in chunks add them before the losses.
    return index, weight, counts, aux_scores.sum(0), float((torch.logsumexp(x, 1) ** 2).sum())


def megatron_drops(index, weight, E, factor, policy):
    """Capacity ceil(T k / E * factor); over it an expert keeps its picks of the highest weight
    (probs) or its earliest tokens (position); no drop when the capacity exceeds T."""
    T, k = index.shape
    kept = torch.ones(T, k, dtype=torch.bool)
    if factor <= 0:
        return kept
    capacity = math.ceil((T * k / E) * factor)
    if capacity > T:
        return kept
    for e in range(E):
        picks = [(t, s) for t in range(T) for s in range(k) if int(index[t, s]) == e]
        if policy == "probs":
            # Highest weight first; ties to the earlier token.
            picks.sort(key=lambda ts: (-float(weight[ts]), ts[0]))
        for t, s in picks[capacity:]:
            kept[t, s] = False
    return kept


def run(case):
    T, E, n = case["tokens"], case["experts"], case.get("chunks", 1)
    logits = hashed(case["name"], T, E, case["scale"], case.get("skew", 0.0))
    calls, index, kept, weight = [], [], [], []
    size = T // n
    if case["gate"] == "deepspeed":
        aux_total = 0.0
        for i in range(n):
            cap, idx, kp, w, aux = deepspeed_gate(logits[i * size:(i + 1) * size], case["top_k"],
                                                  case["capacity_factor"], case["aux_loss_coeff"])
            calls.append({"capacity": cap, "aux_loss": aux})
            aux_total += aux
            index.append(idx), kept.append(kp), weight.append(w)
        z_total = 0.0
    else:
        bias = hashed(case["name"] + ".bias", 1, E, 0.1)[0] if case.get("expert_bias") else None
        counts = probability = 0
        squared_lse = 0.0
        for i in range(n):
            idx, w, cnt, prob, sq = megatron_router(logits[i * size:(i + 1) * size], case, bias)
            kp = megatron_drops(idx, w, E, case.get("capacity_factor", 0), case.get("drop_policy"))
            w = torch.where(kp, w, torch.zeros_like(w))
            counts, probability, squared_lse = counts + cnt, probability + prob, squared_lse + sq
            index.append(idx), kept.append(kp), weight.append(w)
        k = case["top_k"]
        aux_total = float(case["aux_loss_coeff"] * E * (counts / (T * k) * probability / T).sum())
        z_total = case["z_loss_coeff"] * squared_lse / T
    index, kept, weight = torch.cat(index), torch.cat(kept), torch.cat(weight)
    return {
        "case": case,
        "experts": index.tolist(),
        "dropped": (~kept).tolist(),
        "weights": weight.tolist(),
        "calls": calls,
        "aux_loss": aux_total,
        "z_loss": z_total,
    }


def cases():
    ds = dict(gate="deepspeed", tokens=32, experts=8, scale=2.0, aux_loss_coeff=0.01)
    mc = dict(gate="megatron", tokens=32, experts=8, scale=2.0, aux_loss_coeff=0.01,
              z_loss_coeff=0.001, score="softmax", num_groups=0, group_topk=0)
    return [
        dict(ds, name="deepspeed_top1_drops", top_k=1, capacity_factor=1.0, skew=1.5),
        dict(ds, name="deepspeed_top1_no_drop", top_k=1, capacity_factor=4.0),
        dict(ds, name="deepspeed_top2_drops", top_k=2, capacity_factor=1.0, skew=1.5),
        dict(ds, name="deepspeed_top2_no_drop", top_k=2, capacity_factor=4.0),
        dict(ds, name="deepspeed_top1_drops_ampipe2", top_k=1, capacity_factor=1.0, skew=1.0,
             chunks=2),
        dict(ds, name="deepspeed_top2_drops_ampipe2", top_k=2, capacity_factor=1.0, skew=1.0,
             chunks=2),
        dict(ds, name="deepspeed_top2_no_drop_ampipe4", top_k=2, capacity_factor=4.0, chunks=4),
        dict(mc, name="megatron_softmax_top2_dropless", top_k=2, capacity_factor=0),
        dict(mc, name="megatron_softmax_top2_drop_probs", top_k=2, capacity_factor=1.0,
             drop_policy="probs", skew=1.5),
        dict(mc, name="megatron_softmax_top2_drop_position", top_k=2, capacity_factor=1.0,
             drop_policy="position", skew=1.5),
        dict(mc, name="megatron_softmax_top1_drop_position", top_k=1, capacity_factor=1.0,
             drop_policy="position", skew=1.5),
        dict(mc, name="megatron_softmax_top2_capacity_no_drop", top_k=2, capacity_factor=4.0,
             drop_policy="probs", skew=1.5),
        dict(mc, name="megatron_sigmoid_top2_groups_bias_scaling", top_k=2, score="sigmoid",
             num_groups=4, group_topk=2, expert_bias=True, scaling_factor=2.5),
        dict(mc, name="megatron_sigmoid_top1", top_k=1, score="sigmoid"),
        dict(mc, name="megatron_softmax_top2_ampipe2", top_k=2, chunks=2),
        dict(mc, name="megatron_softmax_top2_drop_probs_ampipe2", top_k=2, capacity_factor=1.0,
             drop_policy="probs", skew=1.5, chunks=2),
        dict(mc, name="megatron_sigmoid_top2_groups_bias_ampipe4", top_k=2, score="sigmoid",
             num_groups=4, group_topk=2, expert_bias=True, chunks=4),
        dict(mc, name="megatron_sqrtsoftplus_top2_groups_bias_scaling", top_k=2,
             score="sqrtsoftplus", num_groups=4, group_topk=2, expert_bias=True,
             scaling_factor=2.5),
        dict(mc, name="megatron_sqrtsoftplus_top1_groups_bias", top_k=1, score="sqrtsoftplus",
             num_groups=4, group_topk=1, expert_bias=True),
        dict(mc, name="megatron_sqrtsoftplus_top2_drop_probs_ampipe2", top_k=2,
             score="sqrtsoftplus", capacity_factor=1.0, drop_policy="probs", skew=1.5, chunks=2),
    ]


def main():
    torch.set_num_threads(1)
    data = {
        "generator": "tools/reference/generate_routing_reference.py, torch " + torch.__version__,
        "cases": [run(c) for c in cases()],
    }
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "tests", "data", "routing_reference.json")
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print("wrote", path)
    for c in data["cases"]:
        drops = sum(sum(r) for r in c["dropped"])
        print(f"{c['case']['name']:45s} dropped {drops:3d} aux {c['aux_loss']:.7f} "
              f"z {c['z_loss']:.7f}")


if __name__ == "__main__":
    main()
