#!/usr/bin/python3
"""Writes gpt2_tiny_reference.bin: a tiny GPT-2 checked by PyTorch, for tests/unit/gpt2_reference_test.cc.

Run with Debian's PyTorch (apt-get install python3-torch):
    /usr/bin/python3 tests/reference/make_gpt2_reference.py [out.bin]

The model is written out parameter by parameter with the names Tessera uses (wte, wpe,
h.<l>.ln1_w, ..., lnf_w, lnf_b), so the C++ test can load it without any mapping. Contents:
  config   i32 [L, C, NH, V, max_T, B, T]
  hparams  f32 [lr, beta1, beta2, eps, weight_decay, max_grad_norm]
  tokens, targets                        i32 [B, T]
  <parameter>                            initial values
  logits   f32 [B, T, V]   loss f32 [1]  (forward of the initial model)
  grad.<parameter>                       gradients of that loss (before clipping)
  losses   f32 [10]        the loss at each of 10 AdamW steps on the same batch
  losses_f64 f32 [10]      the same ten steps computed in float64 (the exact answer's proxy)

File format (little-endian): b"TSRF", u32 version (1), u32 count, then per tensor:
u32 name length, name (utf-8), u8 dtype (0 = f32, 1 = i32), u8 rank, i64 dims[rank], data.
"""
import math
import struct
import sys

import torch
import torch.nn.functional as F

L, C, NH, V, MAX_T, B, T = 2, 32, 4, 67, 12, 3, 8
# lr 1e-3 keeps the ten steps well conditioned: PyTorch's fp32 and fp64 runs agree to ~3e-7
# (checked below). At lr 1e-2 they differ by 2e-5 after four steps, so no fp32 implementation
# could be held to 1e-5 there.
LR, BETA1, BETA2, EPS, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0
STEPS = 10
CONDITIONING_LIMIT = 2e-6  # max relative fp32-vs-fp64 loss difference accepted

BLOCK_PARAMS = [  # name, shape, kind: "w" matrix, "g" layernorm gain, "b" bias
    ("ln1_w", (C,), "g"), ("ln1_b", (C,), "b"),
    ("qkv_w", (3 * C, C), "w"), ("qkv_b", (3 * C,), "b"),
    ("proj_w", (C, C), "w"), ("proj_b", (C,), "b"),
    ("ln2_w", (C,), "g"), ("ln2_b", (C,), "b"),
    ("fc_w", (4 * C, C), "w"), ("fc_b", (4 * C,), "b"),
    ("fcproj_w", (C, 4 * C), "w"), ("fcproj_b", (C,), "b"),
]


def make_parameters(gen):
    """Name -> tensor, in Tessera's model order. Gains and biases are perturbed so every
    parameter's gradient path is exercised."""
    specs = [("wte", (V, C), "w"), ("wpe", (MAX_T, C), "w")]
    for l in range(L):
        specs += [(f"h.{l}.{n}", s, k) for n, s, k in BLOCK_PARAMS]
    specs += [("lnf_w", (C,), "g"), ("lnf_b", (C,), "b")]
    params = {}
    for name, shape, kind in specs:
        if kind == "w":
            value = torch.randn(shape, generator=gen) * 0.08
        elif kind == "g":
            value = 1.0 + torch.randn(shape, generator=gen) * 0.1
        else:
            value = torch.randn(shape, generator=gen) * 0.05
        params[name] = value.float().requires_grad_(True)
    return params


def forward(p, idx):
    b, t = idx.shape
    hs = C // NH
    x = p["wte"][idx] + p["wpe"][:t]
    mask = torch.ones(t, t, dtype=torch.bool).triu(1)
    for l in range(L):
        q = lambda n: p[f"h.{l}.{n}"]
        h = F.layer_norm(x, (C,), q("ln1_w"), q("ln1_b"), 1e-5)
        qkv = h @ q("qkv_w").t() + q("qkv_b")
        qq, kk, vv = [z.view(b, t, NH, hs).transpose(1, 2) for z in qkv.split(C, dim=2)]
        att = (qq @ kk.transpose(-2, -1)) / math.sqrt(hs)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ vv).transpose(1, 2).reshape(b, t, C)
        x = x + y @ q("proj_w").t() + q("proj_b")
        h = F.layer_norm(x, (C,), q("ln2_w"), q("ln2_b"), 1e-5)
        h = F.gelu(h @ q("fc_w").t() + q("fc_b"), approximate="tanh")
        x = x + h @ q("fcproj_w").t() + q("fcproj_b")
    x = F.layer_norm(x, (C,), p["lnf_w"], p["lnf_b"], 1e-5)
    return x @ p["wte"].t()


def loss_of(logits, targets):
    return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


def train(initial, idx, targets, dtype):
    """Ten AdamW steps on the same batch from copies of `initial` in `dtype`, decaying matrices
    only, with global-norm clipping. Returns the loss before each step."""
    params = {name: value.detach().to(dtype).clone().requires_grad_(True)
              for name, value in initial.items()}
    decay = [v for v in params.values() if v.dim() == 2]
    no_decay = [v for v in params.values() if v.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR, betas=(BETA1, BETA2), eps=EPS)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        step_loss = loss_of(forward(params, idx), targets)
        losses.append(step_loss.item())
        step_loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), MAX_GRAD_NORM)
        optimizer.step()
    return losses


def write(path, tensors):
    out = bytearray(b"TSRF") + struct.pack("<II", 1, len(tensors))
    for name, tensor in tensors:
        tensor = tensor.detach().contiguous()
        dtype = {torch.float32: 0, torch.int32: 1}[tensor.dtype]
        encoded = name.encode()
        out += struct.pack("<I", len(encoded)) + encoded
        out += struct.pack("<BB", dtype, tensor.dim())
        out += struct.pack(f"<{tensor.dim()}q", *tensor.shape)
        out += tensor.numpy().tobytes()
    with open(path, "wb") as f:
        f.write(out)


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "tests/reference/gpt2_tiny_reference.bin"
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(20261121)
    params = make_parameters(gen)
    idx = torch.randint(0, V, (B, T), generator=gen, dtype=torch.int64)
    targets = torch.randint(0, V, (B, T), generator=gen, dtype=torch.int64)

    tensors = [
        ("config", torch.tensor([L, C, NH, V, MAX_T, B, T], dtype=torch.int32)),
        ("hparams", torch.tensor([LR, BETA1, BETA2, EPS, WEIGHT_DECAY, MAX_GRAD_NORM])),
        ("tokens", idx.int()),
        ("targets", targets.int()),
    ]
    tensors += [(name, value.clone()) for name, value in params.items()]

    logits = forward(params, idx)
    loss = loss_of(logits, targets)
    loss.backward()
    tensors += [("logits", logits), ("loss", loss.reshape(1))]
    tensors += [(f"grad.{name}", value.grad.clone()) for name, value in params.items()]

    losses = train(params, idx, targets, torch.float32)
    losses_f64 = train(params, idx, targets, torch.float64)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, losses_f64))
    if worst > CONDITIONING_LIMIT:
        raise SystemExit(f"reference is ill-conditioned: fp32 and fp64 losses differ by {worst:.2e}")
    tensors.append(("losses_f64", torch.tensor(losses_f64, dtype=torch.float32)))
    tensors.append(("losses", torch.tensor(losses)))
    write(path, tensors)
    print(f"wrote {path}: {len(tensors)} tensors; loss {loss.item():.6f}; "
          f"losses {' '.join(f'{x:.6f}' for x in losses)}; fp32 vs fp64 {worst:.1e}")


if __name__ == "__main__":
    main()
