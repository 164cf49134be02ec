#!/usr/bin/python3
"""Writes tests/data/reference.json: reference values from PyTorch for weave's kernels.

Run with Debian's PyTorch (python3-torch; `tools/dev reference` installs it and runs this).
Tests read the JSON and never need PyTorch.

Inputs are drawn as float32 (the values weave's float kernels receive) with a fixed
torch.manual_seed and stored; expected values are computed in float64 from exactly those values,
gradients by autograd. Values are written with 12 significant digits, so an input parsed as a
double and rounded to float gives back the drawn float32 exactly.

Layout: every tensor is {"shape": [...], "data": [...]}, data flat in row-major order (last
index fastest). Integer lists (targets, top-k indices) are plain flat lists. Scalars are plain
numbers. Cases draw their inputs in the order of main(): new cases go at the end, so the values
of the earlier ones do not change.

Keys (tensor shapes in brackets):
  generator    string: this script and the torch version that ran it
  layer_norm   eps 1e-5, x [4, 16], weight [16], bias [16], dy [4, 16]; normalised over the last
               dim (biased variance) -> y [4, 16], dx [4, 16], dweight [16], dbias [16]
  attention    causal scaled dot-product attention, scale 1/sqrt(D), no dropout.
               q, k, v, do [B=2, S=12, H=2, D=8] (batch, sequence, head, head dim); query s sees
               keys 0..s -> o [B, S, H, D], lse [B, H, S] (natural-log logsumexp over the keys of
               the masked, scaled scores), dq, dk, dv [B, S, H, D] (gradients for upstream do)
  attention_chunk
               the queries of positions 5..11 only against the same k and v (attention.k,
               attention.v, not repeated here): q_offset 5, q [B, 7, H, D] (= attention.q rows
               5..11), do [B, 7, H, D] (drawn anew); chunk row i is global position 5 + i and sees
               keys 0..5+i -> o [B, 7, H, D] (= rows 5..11 of the full output), lse [B, H, 7],
               dq [B, 7, H, D], and this chunk's contributions dk, dv [B, S=12, H, D]
  cross_entropy
               logits [6, 11], targets (6 ints; one is the ignore index), ignore_index -100;
               loss = mean over the non-ignored rows of torch.nn.functional.cross_entropy
               (reduction "mean"); under "plain" (label_smoothing 0) and "smoothed"
               (label_smoothing 0.1), each: label_smoothing, loss (scalar), dlogits [6, 11]
               (d loss / d logits; the ignored row is zero)
  router       logits [10, 4] (tokens T x experts E), top_k 2, aux_coeff 0.01, z_coeff 0.001,
               g [10, 2]; under "renormalized" and "raw", each:
                 probs [T, E] = softmax(logits) over experts
                 index (T*k ints): row-major [T, k], each row's experts by descending probability
                 weights [T, k]: the top-k probs, divided by their row sum under "renormalized"
                 aux_loss = aux_coeff * E * sum_e f_e * P_e with f_e = (number of the T*k picks
                   of e) / (T * k) and P_e = mean_t probs[t, e] (Megatron-LM's Switch form)
                 z_loss = z_coeff * mean_t logsumexp(logits[t])^2
                 dlogits [T, E] = dL/dlogits of L = sum(weights * g) + aux_loss + z_loss, with
                   the counts f_e held constant
  adamw        torch.optim.AdamW(lr 1e-2, betas (0.9, 0.95), eps 1e-8, weight_decay 0.1), all in
               float64: lr, betas [2], eps, weight_decay; params [p0 [3, 5], p1 [7]] (initial);
               grads [step][param] (2 steps); after [step][param] (params after steps 1 and 2);
               exp_avg [param], exp_avg_sq [param] after step 2
  rms_norm     eps 1e-6, x [4, 16], weight [16], dy [4, 16];
               y = x / sqrt(mean(x^2 over the last dim) + eps) * weight -> y [4, 16], dx [4, 16],
               dweight [16]
  softmax      x [3, 7], dy [3, 7]; softmax over the last dim -> y [3, 7], dx [3, 7]
  gelu         x [32], sorted, spanning about -6..6; under "tanh" (approximate="tanh":
               0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))) and "none" (exact, erf), each:
               y [32] and dydx [32] (the elementwise derivative dy/dx at x)
  sgd_momentum torch.optim.SGD(lr 0.1, momentum 0.9, dampening 0, weight_decay 0.01 (L2, added
               to the gradient), nesterov false), float64: lr, momentum, dampening,
               weight_decay, nesterov; params, grads, after as in adamw; momentum_buffer [param]
               after step 2 (step 1 sets it to the gradient plus weight decay)
  clip_grad_norm
               torch.nn.utils.clip_grad_norm_(max_norm 1.0, norm_type 2) over two gradients:
               max_norm, norm_type; grads [g0 [3, 5], g1 [7]] (before); total_norm (scalar:
               the 2-norm of all elements together, before clipping); clipped [g0, g1] =
               grads * min(1, max_norm / (total_norm + 1e-6))
  rotary       Megatron-LM's rotary embedding (halves (i, i + dims/2) rotated together):
               head_dim 8, rotary_dims 4, base 10000, positions (5 ints, one per row);
               x, dy [S=5, B=2, N=3, D=8] -> y [S, B, N, D] (the first 4 dims of each head
               rotated by position x base^(-2i/4), the rest as they were), dx [S, B, N, D]
  grouped_query_attention
               causal attention, scale 1/sqrt(D), of H=4 query heads on G=2 key/value heads
               (query head h reads group h // 2): q, do [B=2, S=10, H=4, D=8], k, v
               [B, S, G, D] -> o [B, S, H, D], lse [B, H, S], dq [B, S, H, D], dk, dv
               [B, S, G, D]
"""

import json
import math
import os

import torch

torch.manual_seed(20261122)
torch.set_default_dtype(torch.float64)


def draw(*shape, scale=1.0):
    """Float32 values, returned as float64 holding exactly those values."""
    return (torch.randn(*shape, dtype=torch.float32) * scale).to(torch.float64)


def tensor(t):
    t = t.detach().to(torch.float64).contiguous()
    return {"shape": list(t.shape), "data": [float("%.12g" % v) for v in t.flatten().tolist()]}


def layer_norm():
    x, w, b, dy = draw(4, 16), draw(16), draw(16), draw(4, 16)
    x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    y = torch.nn.functional.layer_norm(x, (16,), w, b, eps=1e-5)
    y.backward(dy)
    return {"eps": 1e-5, "x": tensor(x), "weight": tensor(w), "bias": tensor(b), "dy": tensor(dy),
            "y": tensor(y), "dx": tensor(x.grad), "dweight": tensor(w.grad),
            "dbias": tensor(b.grad)}


def causal_attention(q, k, v, q_offset):
    """q [B, Sq, H, D], k, v [B, Sk, H, D]; query i is position q_offset + i."""
    qh, kh, vh = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    scores = qh @ kh.transpose(-1, -2) / math.sqrt(q.shape[-1])
    sq, sk = q.shape[1], k.shape[1]
    rows = torch.arange(sq).unsqueeze(1) + q_offset
    cols = torch.arange(sk).unsqueeze(0)
    scores = scores.masked_fill(cols > rows, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    o = torch.softmax(scores, dim=-1) @ vh
    return o.permute(0, 2, 1, 3), lse


def attention():
    B, S, H, D = 2, 12, 2, 8
    q, k, v, do = draw(B, S, H, D), draw(B, S, H, D), draw(B, S, H, D), draw(B, S, H, D)
    for t in (q, k, v):
        t.requires_grad_()
    o, lse = causal_attention(q, k, v, 0)
    o.backward(do)
    full = {"q": tensor(q), "k": tensor(k), "v": tensor(v), "do": tensor(do), "o": tensor(o),
            "lse": tensor(lse), "dq": tensor(q.grad), "dk": tensor(k.grad), "dv": tensor(v.grad)}
    offset = 5
    qc = q.detach()[:, offset:].clone().requires_grad_()
    kc, vc = k.detach().clone().requires_grad_(), v.detach().clone().requires_grad_()
    doc = draw(B, S - offset, H, D)
    oc, lsec = causal_attention(qc, kc, vc, offset)
    oc.backward(doc)
    chunk = {"q_offset": offset, "q": tensor(qc), "do": tensor(doc), "o": tensor(oc),
             "lse": tensor(lsec), "dq": tensor(qc.grad), "dk": tensor(kc.grad),
             "dv": tensor(vc.grad)}
    return full, chunk


def cross_entropy():
    logits = draw(6, 11, scale=2.0)
    targets = [3, 10, -100, 0, 7, 7]
    out = {"logits": tensor(logits), "targets": targets, "ignore_index": -100}
    for key, smoothing in (("plain", 0.0), ("smoothed", 0.1)):
        x = logits.clone().requires_grad_()
        loss = torch.nn.functional.cross_entropy(x, torch.tensor(targets), ignore_index=-100,
                                                 label_smoothing=smoothing)
        loss.backward()
        out[key] = {"label_smoothing": smoothing, "loss": loss.item(), "dlogits": tensor(x.grad)}
    return out


def router():
    T, E, k = 10, 4, 2
    aux_coeff, z_coeff = 0.01, 0.001
    logits, g = draw(T, E), draw(T, k)
    out = {"logits": tensor(logits), "g": tensor(g), "top_k": k, "aux_coeff": aux_coeff,
           "z_coeff": z_coeff}
    for key, renorm in (("renormalized", True), ("raw", False)):
        x = logits.clone().requires_grad_()
        probs = torch.softmax(x, dim=-1)
        weights, index = torch.topk(probs, k, dim=-1)
        if renorm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        picks = torch.zeros(E)
        for e in index.flatten().tolist():
            picks[e] += 1
        f = picks / (T * k)
        aux = aux_coeff * E * torch.sum(f * probs.mean(dim=0))
        z = z_coeff * torch.mean(torch.logsumexp(x, dim=-1) ** 2)
        objective = torch.sum(weights * g) + aux + z
        objective.backward()
        out[key] = {"probs": tensor(probs), "index": index.flatten().tolist(),
                    "weights": tensor(weights), "aux_loss": aux.item(), "z_loss": z.item(),
                    "dlogits": tensor(x.grad)}
    return out


def adamw():
    p0, p1 = draw(3, 5), draw(7)
    grads = [(draw(3, 5), draw(7)), (draw(3, 5), draw(7))]
    out = {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
           "params": [tensor(p0), tensor(p1)], "grads": [[tensor(a), tensor(b)] for a, b in grads]}
    params = [p0.clone().requires_grad_(), p1.clone().requires_grad_()]
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    out["after"] = []
    for step_grads in grads:
        for p, gr in zip(params, step_grads):
            p.grad = gr.clone()
        opt.step()
        out["after"].append([tensor(p) for p in params])
    out["exp_avg"] = [tensor(opt.state[p]["exp_avg"]) for p in params]
    out["exp_avg_sq"] = [tensor(opt.state[p]["exp_avg_sq"]) for p in params]
    return out


def rms_norm():
    eps = 1e-6
    x, w, dy = draw(4, 16), draw(16), draw(4, 16)
    x.requires_grad_(), w.requires_grad_()
    y = x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * w
    y.backward(dy)
    return {"eps": eps, "x": tensor(x), "weight": tensor(w), "dy": tensor(dy), "y": tensor(y),
            "dx": tensor(x.grad), "dweight": tensor(w.grad)}


def softmax():
    x, dy = draw(3, 7, scale=2.0), draw(3, 7)
    x.requires_grad_()
    y = torch.softmax(x, dim=-1)
    y.backward(dy)
    return {"x": tensor(x), "dy": tensor(dy), "y": tensor(y), "dx": tensor(x.grad)}


def gelu():
    # Evenly spread over -6..6, each point moved by up to +-0.15 so none sits on a round value.
    grid = torch.linspace(-6.0, 6.0, 32, dtype=torch.float32)
    jitter = (torch.rand(32, dtype=torch.float32) - 0.5) * 0.3
    x = (grid + jitter).to(torch.float64)
    out = {"x": tensor(x)}
    for approximate in ("tanh", "none"):
        xg = x.clone().requires_grad_()
        y = torch.nn.functional.gelu(xg, approximate=approximate)
        (dydx,) = torch.autograd.grad(y.sum(), xg)
        out[approximate] = {"y": tensor(y), "dydx": tensor(dydx)}
    return out


def sgd_momentum():
    lr, momentum, weight_decay = 0.1, 0.9, 0.01
    p0, p1 = draw(3, 5), draw(7)
    grads = [(draw(3, 5), draw(7)), (draw(3, 5), draw(7))]
    out = {"lr": lr, "momentum": momentum, "dampening": 0.0, "weight_decay": weight_decay,
           "nesterov": False, "params": [tensor(p0), tensor(p1)],
           "grads": [[tensor(a), tensor(b)] for a, b in grads]}
    params = [p0.clone().requires_grad_(), p1.clone().requires_grad_()]
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum, dampening=0.0,
                          weight_decay=weight_decay, nesterov=False)
    out["after"] = []
    for step_grads in grads:
        for p, gr in zip(params, step_grads):
            p.grad = gr.clone()
        opt.step()
        out["after"].append([tensor(p) for p in params])
    out["momentum_buffer"] = [tensor(opt.state[p]["momentum_buffer"]) for p in params]
    return out


def clip_grad_norm():
    max_norm = 1.0
    g0, g1 = draw(3, 5), draw(7)
    params = [torch.zeros(3, 5, requires_grad=True), torch.zeros(7, requires_grad=True)]
    params[0].grad, params[1].grad = g0.clone(), g1.clone()
    total_norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=2.0)
    assert total_norm.item() > max_norm, "the drawn gradients must be clipped"
    return {"max_norm": max_norm, "norm_type": 2.0, "grads": [tensor(g0), tensor(g1)],
            "total_norm": total_norm.item(), "clipped": [tensor(p.grad) for p in params]}


def rotary():
    """Megatron-LM's rotary embedding (non-interleaved halves) of t [S, B, N, D] at per-row
    positions, on the first `dims` of each head."""
    S, B, N, D, dims, base = 5, 2, 3, 8, 4, 10000.0
    positions = [3, 0, 17, 4, 100]
    x, dy = draw(S, B, N, D), draw(S, B, N, D)
    x.requires_grad_()
    inv_freq = 1.0 / (base ** (torch.arange(0, dims, 2) / dims))
    freqs = torch.outer(torch.tensor(positions, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
    rot, rest = x[..., :dims], x[..., dims:]
    first, second = rot[..., : dims // 2], rot[..., dims // 2:]
    half = torch.cat((-second, first), dim=-1)
    y = torch.cat((rot * emb.cos() + half * emb.sin(), rest), dim=-1)
    y.backward(dy)
    return {"head_dim": D, "rotary_dims": dims, "base": base, "positions": positions,
            "x": tensor(x), "dy": tensor(dy), "y": tensor(y), "dx": tensor(x.grad)}


def grouped_query_attention():
    """Causal attention of H query heads on G key/value heads: query head h reads group
    h // (H / G) (the layout [B, S, G, (H / G) D] of q is [B, S, H, D] in memory)."""
    B, S, H, G, D = 2, 10, 4, 2, 8
    q, do = draw(B, S, H, D), draw(B, S, H, D)
    k, v = draw(B, S, G, D), draw(B, S, G, D)
    for t in (q, k, v):
        t.requires_grad_()
    repeat = H // G
    o, lse = causal_attention(q, k.repeat_interleave(repeat, dim=2),
                              v.repeat_interleave(repeat, dim=2), 0)
    o.backward(do)
    return {"groups": G, "q": tensor(q), "k": tensor(k), "v": tensor(v), "do": tensor(do),
            "o": tensor(o), "lse": tensor(lse), "dq": tensor(q.grad), "dk": tensor(k.grad),
            "dv": tensor(v.grad)}


def main():
    # Cases draw from one generator in this order (the dict is built left to right): add new
    # cases at the end so the inputs and values of the others stay as they are.
    full, chunk = attention()
    data = {
        "generator": "tools/reference/generate_reference.py, torch " + torch.__version__,
        "layer_norm": layer_norm(),
        "attention": full,
        "attention_chunk": chunk,
        "cross_entropy": cross_entropy(),
        "router": router(),
        "adamw": adamw(),
        "rms_norm": rms_norm(),
        "softmax": softmax(),
        "gelu": gelu(),
        "sgd_momentum": sgd_momentum(),
        "clip_grad_norm": clip_grad_norm(),
        "rotary": rotary(),
        "grouped_query_attention": grouped_query_attention(),
    }
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "tests", "data", "reference.json")
    with open(path, "w") as f:
        json.dump(data, f, separators=(",", ":"))
        f.write("\n")
    print("wrote", path, os.path.getsize(path), "bytes")


if __name__ == "__main__":
    main()
