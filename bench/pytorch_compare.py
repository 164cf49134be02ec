#!/usr/bin/python3
"""Tokens/s of `weave train` on one device against the same model trained by PyTorch (CPU).

The model: a GPT decoder with learned positions, pre-LayerNorm blocks (causal attention, then a
GELU-tanh MLP), a final LayerNorm and an output projection tied to the byte embedding (vocab
256); AdamW, gradient clipping 1.0, no dropout. Both run on the same cores one after the other;
PyTorch with torch.set_num_threads(cores) and OMP_WAIT_POLICY=PASSIVE (its best setting here:
Debian's PyTorch calls OpenBLAS, whose threads otherwise spin against torch's own).

Each in fp32 and in bf16 mixed precision, side by side: weave with --bf16 (bf16 products and kept
activations, fp32 main parameters, norms, softmax and loss); PyTorch under
torch.autocast("cpu", dtype=torch.bfloat16) (its CPU bf16 autocast: linear layers and matrix
products in bf16, the softmax and GELU left on their bf16 outputs in bf16, as torch 1.13's autocast
leaves them; the parameters, AdamW, the residual stream, LayerNorm and the loss in fp32).
--precisions fp32 or bf16 runs one of them.

usage: bench/pytorch_compare.py WEAVE_BINARY [--layers 4 --hidden 256 ...]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time


def weave_tokens_per_second(binary, a, precision):
    cmd = [binary, "train", "--mock-data", "--devices", "1",
           "--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
           "--num-attention-heads", str(a.heads), "--ffn-hidden-size", str(a.ffn),
           "--seq-length", str(a.seq), "--micro-batch-size", str(a.batch),
           "--train-iters", str(a.warmup + a.iters), "--log-interval", "1000",
           "--lr", "1e-3", "--lr-warmup-iters", "0", "--log-json", "/dev/stdout"]
    if precision == "bf16":
        cmd.append("--bf16")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rates = [json.loads(line)["tokens_per_second"] for line in out.splitlines()
             if line.startswith("{") and "tokens_per_second" in line]
    timed = rates[a.warmup:]
    # Harmonic mean of per-iteration rates = total tokens / total time.
    return len(timed) / sum(1.0 / r for r in timed)


def torch_tokens_per_second(a, precision):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(a.hidden)
            self.qkv = nn.Linear(a.hidden, 3 * a.hidden)
            self.proj = nn.Linear(a.hidden, a.hidden)
            self.ln2 = nn.LayerNorm(a.hidden)
            self.fc1 = nn.Linear(a.hidden, a.ffn)
            self.fc2 = nn.Linear(a.ffn, a.hidden)

        def forward(self, x):
            b, s, h = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
            shape = (b, s, a.heads, h // a.heads)
            q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True) \
                if hasattr(F, "scaled_dot_product_attention") else self.attention(q, k, v)
            x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))

        @staticmethod
        def attention(q, k, v):
            s = q.shape[-2]
            scores = q @ k.transpose(-1, -2) / (q.shape[-1] ** 0.5)
            mask = torch.ones(s, s, dtype=torch.bool).triu(1)
            return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(256, a.hidden)
            self.pos = nn.Embedding(a.seq, a.hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(a.layers))
            self.ln = nn.LayerNorm(a.hidden)

        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            for blk in self.blocks:
                x = blk(x)
            return self.ln(x) @ self.tok.weight.t()

    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    idx = torch.randint(0, 256, (a.batch, a.seq + 1))
    elapsed = 0.0
    for it in range(a.warmup + a.iters):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, 256), idx[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if it >= a.warmup:
            elapsed += time.perf_counter() - t0
    return a.iters * a.batch * a.seq / elapsed, torch.__version__


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("weave")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--precisions", default="fp32,bf16",
                   help="comma-separated: fp32, bf16 (default both)")
    a = p.parse_args()
    precisions = a.precisions.split(",")
    for precision in precisions:
        if precision not in ("fp32", "bf16"):
            p.error(f"--precisions takes fp32 and bf16, got {precision!r}")
    rates = {}
    for precision in precisions:
        w = weave_tokens_per_second(a.weave, a, precision)
        t, version = torch_tokens_per_second(a, precision)
        rates[precision] = (w, t)
    print(f"model: {a.layers} layers, hidden {a.hidden}, {a.heads} heads, ffn {a.ffn}, "
          f"seq {a.seq}, batch {a.batch}; {a.threads} threads; "
          f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}")
    print(f"{'':9} {'weave':>12} {'PyTorch ' + version:>16} {'weave / PyTorch':>16}")
    for precision, (w, t) in rates.items():
        print(f"{precision:9} {w:8.0f} tok/s {t:12.0f} tok/s {w / t:15.2f}x")
    if len(rates) == 2:
        (w32, t32), (w16, t16) = rates["fp32"], rates["bf16"]
        print(f"bf16 / fp32: weave {w16 / w32:.2f}x, PyTorch {t16 / t32:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
