#!/usr/bin/python3
"""Writes tests/data/reference.json: reference values from PyTorch for weave's kernels.

Run with Debian's PyTorch (python3-torch; `tools/dev reference` installs it and runs this).
Tests read the JSON and never need PyTorch.

Inputs are drawn as float32 (the values weave's float kernels receive) and stored; expected
values are computed in float64 from exactly those values. Every tensor is stored as
{"shape": [...], "data": [row-major values]}; integer lists are plain lists.

Cases:
  layer_norm   x [4, 16], weight [16], bias [16], eps, dy [4, 16] -> y, dx, dweight, dbias
  attention    q, k, v, do [B=2, S=12, H=2, D=8] (batch, sequence, head, head dim), causal,
               scale 1/sqrt(D) -> o [B, S, H, D], lse [B, H, S] (natural log), dq, dk, dv
  attention_chunk
               the queries of positions 5..11 only (q_offset 5) against the same k and v, with
               do_chunk [B, 7, H, D] -> o [B, 7, H, D] (rows 5..11 of the full output), lse,
               dq, and this chunk's contributions dk, dv
  cross_entropy
               logits [6, 11], targets [6] (one is the ignore index -100), mean over the other
               rows, label_smoothing 0 and 0.1 -> loss, dlogits (of the mean loss), per key
               "plain" and "smoothed"
  router       logits [10, 4], top_k 2, aux_coeff 0.01, z_coeff 0.001, g [10, 2];
               probs = softmax(logits); top-k indices (largest first) and weights, renormalised
               ("renormalized") or not ("raw"); aux = aux_coeff * E * sum_e f_e * P_e with
               f_e = picks of e / (T * k), P_e = mean_t probs[t, e]; z = z_coeff *
               mean_t logsumexp(logits_t)^2; objective L = sum(weights * g) + aux + z;
               dlogits = dL/dlogits with f_e held constant
  adamw        torch.optim.AdamW(lr 1e-2, betas (0.9, 0.95), eps 1e-8, weight_decay 0.1) on
               params p0 [3, 5], p1 [7] with grads for two steps -> params after each step,
               exp_avg and exp_avg_sq after step 2
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
            "y": tensor(y), "dx": tensor(x.grad), "dweight": tensor(w.grad), "dbias": tensor(b.grad)}


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


def main():
    full, chunk = attention()
    data = {
        "generator": "tools/reference/generate_reference.py, torch " + torch.__version__,
        "layer_norm": layer_norm(),
        "attention": full,
        "attention_chunk": chunk,
        "cross_entropy": cross_entropy(),
        "router": router(),
        "adamw": adamw(),
    }
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "tests", "data", "reference.json")
    with open(path, "w") as f:
        json.dump(data, f, separators=(",", ":"))
        f.write("\n")
    print("wrote", path, os.path.getsize(path), "bytes")


if __name__ == "__main__":
    main()
