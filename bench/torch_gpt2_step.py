#!/usr/bin/python3
"""PyTorch (CPU) GPT-2 training step, the same model and step as Tessera's train_gpt2:
pre-norm blocks, GELU (tanh), tied classifier, mean cross-entropy, global-norm clipping (1.0)
and AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), on random tokens.

usage: torch_gpt2_step.py --layers L --channels C --heads H --vocab V --seq-len T --batch B
                          [--steps N] [--threads N]
prints: torch <version> params=<n> step_ms_median=<ms> tokens_per_s=<n> final_loss=<x>
"""
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.fc, self.fcproj = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = [z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v)]
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.fcproj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers, c, heads, vocab, t):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, c), nn.Embedding(t, c)
        self.blocks = nn.ModuleList([Block(c, heads) for _ in range(layers)])
        self.lnf = nn.LayerNorm(c)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.lnf(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("layers", "channels", "heads", "vocab", "seq-len", "batch"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = GPT(a.layers, a.channels, a.heads, a.vocab, a.seq_len)
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-3, betas=(0.9, 0.95))
    idx = torch.randint(0, a.vocab, (a.batch, a.seq_len))
    targets = torch.randint(0, a.vocab, (a.batch, a.seq_len))
    times = []
    for _ in range(a.steps):
        start = time.perf_counter()
        loss = model(idx, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        times.append(time.perf_counter() - start)
    steady = sorted(times[1:] if len(times) > 1 else times)
    median = steady[len(steady) // 2]
    params = sum(p.numel() for p in model.parameters())
    print(f"torch {torch.__version__} params={params} step_ms_median={median * 1e3:.1f} "
          f"tokens_per_s={a.batch * a.seq_len / median:.0f} final_loss={loss.item():.4f}")


if __name__ == "__main__":
    main()
