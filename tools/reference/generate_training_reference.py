#!/usr/bin/python3
"""Writes tests/data/training_reference.json: the loss curve of a small GPT trained by PyTorch, in
fp32 and in bf16 mixed precision, for weave's one-device training to be checked against.

Run with Debian's PyTorch (python3-torch; `tools/dev reference` installs it and runs this). Tests
read the JSON and never need PyTorch.

The model is written here from its definition, not from weave's code: GPT-2's decoder (pre-norm
blocks of LayerNorm, causal attention of H heads, LayerNorm, a GELU-tanh MLP; learned positions; a
final LayerNorm; the output layer tied to the word embedding), no dropout, the mean token cross
entropy; AdamW (decoupled weight decay on every parameter) after clipping the gradients' global
2-norm to 1. Parameters use Megatron-LM's layouts: a linear weight is [out, in]; the fused QKV
weight's rows are every query head, then every key head, then every value head, head_dim rows each.

Initial values and tokens are pure functions both sides compute (init_value, token below; the
test has its own), so only the configuration, the parameters' names and shapes and the losses are
stored.

bf16 mixed precision, as Megatron-LM's Float16Module with fp32 main parameters runs it: the model
computes with bf16 copies of the fp32 parameters (rounded to nearest even before each step), the
optimizer updates the fp32 ones. Each product takes bf16 operands and sums in fp32 (products of
bf16 values are exact in fp32, so the sum is computed here in fp32 on the widened values) and its
result is rounded once to bf16. Rounded to bf16 are: the embedding's output (the bf16 copies'
word and position rows, summed, rounded once), the norms' outputs (computed in fp32 with the bf16
weights widened), the products' outputs (QKV and fc1 with their bias inside the product), the
GELU's output; the attention's probabilities as an operand of P V (unnormalised, divided by the
fp32 row sum after) and its output; and the residual stream, bf16 as Megatron-LM keeps it under
--bf16 by default: each residual end (the stream plus the product's output and its bias, as its
fused bias-dropout-add computes them) is summed in fp32 and rounded once. The softmax, the norms
and the loss are fp32. Backward, each product takes its output's gradient rounded to bf16 and
rounds the input gradient it returns; the stream's gradient, summed over the stream value's
readers (the next residual end and the norm), is rounded once, as autograd sums the bf16
gradients of a bf16 tensor; weight gradients are summed in fp32 into the fp32 main gradients. The
attention's backward is flash-attention's: P from the saved log-sum-exp, D = rowsum(dO O),
dS = P (dP - D); P and dS rounded as operands, dQ rounded, dK and dV in fp32.
torch.autocast("cpu", dtype=torch.bfloat16) rounds elsewhere (under torch 1.13 the softmax runs
in bf16 on the bf16 scores, and the weight gradients are bf16 products, rounded before they are
widened into the fp32 parameters' gradients), so the casts are explicit.

The bf16_fp32_residual curves are the same bf16 model with Megatron-LM's
--fp32-residual-connection: the residual stream and its gradient stay fp32 (nothing rounded at
the residual ends).

Keys:
  generator   string: this script and the torch version that ran it
  config      num_layers, hidden_size, num_attention_heads, ffn_hidden_size, seq_length,
              vocab_size, micro_batch_size, lr, beta1, beta2, eps, weight_decay, clip_grad,
              layernorm_epsilon
  parameters  [[name, logical rows, logical cols], ...] (a vector is [n, 1])
  steps       the number of steps
  fp32, bf16  the loss of each step (before its update), `steps` values
  bf16_other_sums
              two more bf16 curves, the same roundings with the linear products' fp32 sums taken
              in other orders (in float64; in two halves of the inner dimension): how far the
              order of fp32 sums alone moves the bf16 curve
  bf16_fp32_residual, bf16_fp32_residual_other_sums
              the same two for the bf16 model with an fp32 residual stream
"""

import json
import math
import os

import torch
import torch.nn.functional as F

from hashed_values import MASK64, fnv1a64, uniform

CONFIG = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "ffn_hidden_size": 128,
    "seq_length": 16,
    "vocab_size": 64,
    "micro_batch_size": 4,
    "lr": 1e-2,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-8,
    "weight_decay": 0.1,
    "clip_grad": 1.0,
    "layernorm_epsilon": 1e-5,
}
STEPS = 20


def init_value(name, rows, cols):
    """[rows, cols] float32: a + s v with v = 2 u - 1 uniform in [-1, 1) from a hash of (name,
    row, col); norm weights 1 + 0.1 v, biases 0.05 v, the rest 0.1 v."""
    key = fnv1a64(name)
    a, s = 0.0, 0.1
    if name.endswith("norm.weight"):
        a = 1.0
    elif name.endswith("bias"):
        s = 0.05
    out = []
    for r in range(rows):
        for c in range(cols):
            v = uniform(key, r, c)
            out.append(a + s * v)
    return torch.tensor(out, dtype=torch.float32).reshape(rows, cols)


def token(sample, position, vocab):
    x = (sample * 1009 + position * 7919 + 17) & MASK64
    x ^= x >> 13
    x = (x * 0x9E3779B97F4A7C15) & MASK64
    return (x >> 33) % vocab


def parameter_shapes(c):
    h, f, v, s = c["hidden_size"], c["ffn_hidden_size"], c["vocab_size"], c["seq_length"]
    shapes = [("embedding.word", v, h), ("embedding.position", s, h)]
    for l in range(c["num_layers"]):
        p = f"layers.{l}."
        shapes += [(p + "input_norm.weight", h, 1), (p + "input_norm.bias", h, 1),
                   (p + "attention.qkv.weight", 3 * h, h), (p + "attention.qkv.bias", 3 * h, 1),
                   (p + "attention.proj.weight", h, h), (p + "attention.proj.bias", h, 1),
                   (p + "mlp_norm.weight", h, 1), (p + "mlp_norm.bias", h, 1),
                   (p + "mlp.fc1.weight", f, h), (p + "mlp.fc1.bias", f, 1),
                   (p + "mlp.fc2.weight", h, f), (p + "mlp.fc2.bias", h, 1)]
    shapes += [("final_norm.weight", h, 1), ("final_norm.bias", h, 1)]
    return shapes


def round16(x):
    return x.to(torch.bfloat16).to(torch.float32)


class RoundValue(torch.autograd.Function):
    """Forward: the value rounded to bf16 (kept in fp32). Backward: the gradient as it is."""

    @staticmethod
    def forward(ctx, x):
        return round16(x)

    @staticmethod
    def backward(ctx, g):
        return g


class RoundGradient(torch.autograd.Function):
    """Forward: the value as it is. Backward: the gradient rounded to bf16."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return round16(g)


class FlashAttentionBf16(torch.autograd.Function):
    """Causal attention of bf16 q, k, v [B, H, S, d]: fp32 scores and softmax, the unnormalised
    probabilities rounded as P V's operand, the output rounded; flash-attention's backward."""

    @staticmethod
    def forward(ctx, q, k, v):
        scale = 1.0 / math.sqrt(q.shape[-1])
        s = scale * (q @ k.transpose(-1, -2))
        mask = torch.ones(s.shape[-2:], dtype=torch.bool).triu(1)
        s = s.masked_fill(mask, float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        e = torch.exp(s - m)
        l = e.sum(dim=-1, keepdim=True)
        o = round16((round16(e) @ v) / l)
        ctx.save_for_backward(q, k, v, o, m + torch.log(l))
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        scale = 1.0 / math.sqrt(q.shape[-1])
        s = scale * (q @ k.transpose(-1, -2))
        mask = torch.ones(s.shape[-2:], dtype=torch.bool).triu(1)
        p = torch.exp(s.masked_fill(mask, float("-inf")) - lse)
        d = (do * o).sum(dim=-1, keepdim=True)
        ds = round16(p * (do @ v.transpose(-1, -2) - d))
        dv = round16(p).transpose(-1, -2) @ do
        dk = scale * (ds.transpose(-1, -2) @ q)
        dq = round16(scale * (ds @ k))
        return dq, dk, dv


def product(x, w, b, sums):
    """x w^T (+ b) in fp32, its sums over the inner dimension taken in one of three orders:
    "fp32" (PyTorch's), "fp64" (in float64, rounded to fp32 once) or "halves" (each half of the
    inner dimension summed alone, then the two added)."""
    if sums == "fp64":
        return F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    if sums == "halves":
        k = x.shape[-1] // 2
        y = F.linear(x[..., :k], w[:, :k]) + F.linear(x[..., k:], w[:, k:])
        return y if b is None else y + b
    return F.linear(x, w, b)


class Model:
    def __init__(self, c, bf16, sums="fp32", fp32_residual=False):
        self.c, self.bf16, self.sums = c, bf16, sums
        self.residual16 = bf16 and not fp32_residual
        self.params = {}
        for name, rows, cols in parameter_shapes(c):
            value = init_value(name, rows, cols)
            self.params[name] = (value if cols > 1 else value.reshape(rows)).requires_grad_()

    def r(self, x):  # a value the bf16 model holds in bf16
        return RoundValue.apply(x) if self.bf16 else x

    def w(self, name):  # the parameter the model computes with: the bf16 copy in bf16
        return self.r(self.params[name])

    def linear(self, x, name, bias=None):
        """A product: bf16 operands, fp32 sum, rounded once; backward rounds both gradients."""
        if not self.bf16:
            return F.linear(x, self.params[name], None if bias is None else self.params[bias])
        y = product(RoundGradient.apply(x), self.w(name), None if bias is None else self.w(bias),
                    self.sums)
        return RoundGradient.apply(self.r(y))

    def stream(self, x):
        """A value of the residual stream: with a bf16 stream, a bf16 tensor (rounded) whose
        gradient, summed over its readers, is a bf16 tensor too (rounded once)."""
        return RoundGradient.apply(RoundValue.apply(x)) if self.residual16 else x

    def residual(self, x, y, bias):
        """A residual end: x + (y + b) in fp32, a value of the stream."""
        return self.stream(x + (y + self.w(bias)))

    def norm(self, x, prefix):
        h = self.c["hidden_size"]
        y = F.layer_norm(x, (h,), self.w(prefix + ".weight"), self.w(prefix + ".bias"),
                         eps=self.c["layernorm_epsilon"])
        return self.r(y)

    def attention(self, qkv):
        b, s, _ = qkv.shape
        h, heads = self.c["hidden_size"], self.c["num_attention_heads"]
        q, k, v = (t.reshape(b, s, heads, h // heads).transpose(1, 2) for t in qkv.split(h, -1))
        if self.bf16:
            o = FlashAttentionBf16.apply(q, k, v)
        else:
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(h // heads)
            mask = torch.ones(s, s, dtype=torch.bool).triu(1)
            o = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v
        return o.transpose(1, 2).reshape(b, s, h)

    def loss(self, tokens, targets):
        P = self.params
        words, positions = self.w("embedding.word"), self.w("embedding.position")
        x = self.stream(self.r(words[tokens] + positions[: tokens.shape[1]]))
        for l in range(self.c["num_layers"]):
            p = f"layers.{l}."
            qkv = self.linear(self.norm(x, p + "input_norm"), p + "attention.qkv.weight",
                              p + "attention.qkv.bias")
            y = self.linear(self.attention(qkv), p + "attention.proj.weight")
            x = self.residual(x, y, p + "attention.proj.bias")
            a = self.linear(self.norm(x, p + "mlp_norm"), p + "mlp.fc1.weight", p + "mlp.fc1.bias")
            y = self.linear(self.r(F.gelu(a, approximate="tanh")), p + "mlp.fc2.weight")
            x = self.residual(x, y, p + "mlp.fc2.bias")
        logits = self.linear(self.norm(x, "final_norm"), "embedding.word")
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def losses(c, bf16, sums="fp32", fp32_residual=False):
    model = Model(c, bf16, sums, fp32_residual)
    params = list(model.params.values())
    opt = torch.optim.AdamW(params, lr=c["lr"], betas=(c["beta1"], c["beta2"]), eps=c["eps"],
                            weight_decay=c["weight_decay"])
    B, S, V = c["micro_batch_size"], c["seq_length"], c["vocab_size"]
    # The same batch every step: the model must learn it.
    tokens = torch.tensor([[token(b, s, V) for s in range(S)] for b in range(B)])
    targets = torch.tensor([[token(b, s + 1, V) for s in range(S)] for b in range(B)])
    out = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = model.loss(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, c["clip_grad"])
        opt.step()
        out.append(loss.item())
    return out


def main():
    torch.set_num_threads(1)
    data = {
        "generator": "tools/reference/generate_training_reference.py, torch " + torch.__version__,
        "config": CONFIG,
        "parameters": [list(s) for s in parameter_shapes(CONFIG)],
        "steps": STEPS,
        "fp32": losses(CONFIG, False),
        "bf16": losses(CONFIG, True),
        "bf16_other_sums": [losses(CONFIG, True, sums) for sums in ("fp64", "halves")],
        "bf16_fp32_residual": losses(CONFIG, True, fp32_residual=True),
        "bf16_fp32_residual_other_sums": [
            losses(CONFIG, True, sums, fp32_residual=True) for sums in ("fp64", "halves")
        ],
    }
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "tests", "data", "training_reference.json")
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print("wrote", path)
    for i, (a, b) in enumerate(zip(data["fp32"], data["bf16"])):
        print(f"step {i + 1:2d}: fp32 {a:.7f} bf16 {b:.7f}")


if __name__ == "__main__":
    main()
