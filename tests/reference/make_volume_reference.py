#!/usr/bin/python3
"""Writes volume_reference.bin: PyTorch's answers for the 3D U-Net ops, for
tests/unit/volume_reference_test.cc.

Run with Debian's PyTorch (apt-get install python3-torch):
    /usr/bin/python3 tests/reference/make_volume_reference.py [out.bin]

Each case draws f32 inputs (fixed seed) and an upstream gradient `dy`, then evaluates the op and
its input gradients in float64 from those same f32 values (the exact answer's proxy, rounded to
f32 once when written), and checks that PyTorch's own float32 run agrees with it to 2e-6 of each
tensor's scale. Tensors are named `<case>.<name>`; `<case>.attrs` (i32, absent when the op has
none) holds the op's integer attributes in the order the C++ test reads them.

  conv_s1p1      conv3d, stride 1, padding 1              x w b dy -> y dx dw db
  conv_s2        conv3d, stride 2, padding 0, kernel 3x2x3 x w b dy -> y dx dw db
  convt_k2s2     conv_transpose3d, kernel 2, stride 2     x w b dy -> y dx dw db
  convt_k3s2p1   conv_transpose3d, kernel 3, stride 2, padding 1
  upsample       upsample_nearest3d, scale 2              x dy -> y dx
  maxpool        max_pool3d, kernel 2 (floor mode: W=7)   x dy -> y indices dx
  groupnorm      group_norm, 3 groups of 2 channels       x w b dy -> y mean rstd dx dw db
  silu, relu                                              x dy -> y dx
  voxel_ce       cross-entropy over voxels, grad_scale 0.5 logits targets -> loss dlogits
  dice           hard Dice over classes 1..C-1 (on voxel_ce's logits and targets) -> score
  deep_sup       deep supervision's loss on two levels: targets sampled down by
                 interpolate(mode="nearest-exact") at 1/2 -> coarse; weights 2/3 and 1/3 of the
                 two levels' cross-entropies: logits0 logits1 targets -> coarse loss dlogits0 dlogits1

File format as make_gpt2_reference.py (little-endian): b"TSRF", u32 version (1), u32 count, then
per tensor: u32 name length, name (utf-8), u8 dtype (0 = f32, 1 = i32), u8 rank, i64 dims[rank],
data.
"""
import struct
import sys
import zlib

import torch
import torch.nn.functional as F

AGREEMENT_LIMIT = 2e-6  # max fp32-vs-fp64 difference accepted, relative to the tensor's scale


def scaled_error(actual, expected):
    return ((actual.double() - expected.double()).abs().max() /
            expected.double().abs().max().clamp_min(1e-12)).item()


def run_case(name, fn, inputs, grad_inputs, attrs):
    """fn(*inputs) -> tuple of outputs (the first is differentiated against `dy`).
    inputs: name -> f32 tensor; grad_inputs: the names whose gradients are written as d<name>."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    results = {}
    for dtype in (torch.float32, torch.float64):
        args = {k: (v.to(dtype) if v.is_floating_point() else v).clone() for k, v in inputs.items()}
        for k in grad_inputs:
            args[k].requires_grad_(True)
        outputs = fn(**args)
        if dtype is torch.float32:
            dy = torch.empty(outputs[0].shape).uniform_(-1, 1, generator=gen)
        outputs[0].backward(dy.to(dtype))
        results[dtype] = (outputs, {k: args[k].grad for k in grad_inputs})
    (out32, grad32), (out64, grad64) = results[torch.float32], results[torch.float64]
    for a, b in list(zip(out32, out64)) + [(grad32[k], grad64[k]) for k in grad_inputs]:
        if not a.is_floating_point():
            if not torch.equal(a, b):
                raise SystemExit(f"{name}: PyTorch fp32 and fp64 disagree on an integer output")
        else:
            error = scaled_error(a, b)
            if error > AGREEMENT_LIMIT:
                raise SystemExit(f"{name}: PyTorch fp32 and fp64 differ by {error:.2e}")
    # (No empty tensors: the C++ reader hands memcpy a null pointer for them.)
    tensors = [(f"{name}.attrs", torch.tensor(attrs, dtype=torch.int32))] if attrs else []
    tensors += [(f"{name}.{k}", v) for k, v in inputs.items()]
    tensors.append((f"{name}.dy", dy))
    return tensors, out64, grad64


def f32(x):
    return x.detach().float() if x.is_floating_point() else x.detach().int()


def uniform(gen, *shape, scale=1.0):
    return torch.empty(shape).uniform_(-scale, scale, generator=gen)


def conv_case(gen, name, x_shape, w_shape, stride, padding, transposed):
    x = uniform(gen, *x_shape)
    w = uniform(gen, *w_shape, scale=0.5)
    b = uniform(gen, w_shape[1] if transposed else w_shape[0], scale=0.5)
    op = F.conv_transpose3d if transposed else F.conv3d
    tensors, out, grads = run_case(
        name, lambda x, w, b: (op(x, w, b, stride=stride, padding=padding),),
        {"x": x, "w": w, "b": b}, ["x", "w", "b"], [stride, padding])
    return tensors + [(f"{name}.y", f32(out[0]))] + [(f"{name}.d{k}", f32(v))
                                                    for k, v in grads.items()]


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "tests/reference/volume_reference.bin"
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(20261124)
    tensors = []
    tensors += conv_case(gen, "conv_s1p1", (2, 3, 5, 5, 5), (4, 3, 3, 3, 3), 1, 1, False)
    tensors += conv_case(gen, "conv_s2", (2, 3, 7, 6, 5), (5, 3, 3, 2, 3), 2, 0, False)
    tensors += conv_case(gen, "convt_k2s2", (2, 4, 3, 3, 3), (4, 3, 2, 2, 2), 2, 0, True)
    tensors += conv_case(gen, "convt_k3s2p1", (2, 3, 3, 4, 3), (3, 2, 3, 3, 3), 2, 1, True)

    t, out, grads = run_case(
        "upsample", lambda x: (F.interpolate(x, scale_factor=2, mode="nearest"),),
        {"x": uniform(gen, 2, 3, 2, 3, 2)}, ["x"], [2])
    tensors += t + [("upsample.y", f32(out[0])), ("upsample.dx", f32(grads["x"]))]

    # A permutation of spaced values: no ties, so the maxima are unambiguous.
    x = (torch.randperm(2 * 3 * 6 * 5 * 7, generator=gen).float() * 0.01 - 3.0).reshape(2, 3, 6, 5, 7)
    t, out, grads = run_case(
        "maxpool", lambda x: F.max_pool3d(x, 2, 2, return_indices=True), {"x": x}, ["x"], [2])
    tensors += t + [("maxpool.y", f32(out[0])), ("maxpool.indices", out[1].int()),
                    ("maxpool.dx", f32(grads["x"]))]

    def group_norm(x, w, b):
        n, c = x.shape[:2]
        y, mean, rstd = torch.ops.aten.native_group_norm(x, w, b, n, c, x[0, 0].numel(), 3, 1e-5)
        return y, mean, rstd
    t, out, grads = run_case(
        "groupnorm", group_norm,
        {"x": uniform(gen, 2, 6, 3, 4, 5, scale=2.0) + 0.5, "w": 1.0 + uniform(gen, 6, scale=0.3),
         "b": uniform(gen, 6, scale=0.3)}, ["x", "w", "b"], [3])
    tensors += t + [("groupnorm.y", f32(out[0])), ("groupnorm.mean", f32(out[1])),
                    ("groupnorm.rstd", f32(out[2]))]
    tensors += [(f"groupnorm.d{k}", f32(v)) for k, v in grads.items()]

    for name, fn in (("silu", F.silu), ("relu", F.relu)):
        t, out, grads = run_case(name, lambda x: (fn(x),), {"x": uniform(gen, 3, 40, scale=4.0)},
                                 ["x"], [])
        tensors += t + [(f"{name}.y", f32(out[0])), (f"{name}.dx", f32(grads["x"]))]

    logits = uniform(gen, 2, 4, 3, 4, 5, scale=3.0)
    targets = torch.randint(0, 4, (2, 3, 4, 5), generator=gen)
    grad_scale = 0.5
    loss64 = None
    for dtype in (torch.float32, torch.float64):
        l = logits.to(dtype).clone().requires_grad_(True)
        loss = F.cross_entropy(l, targets)
        (loss * grad_scale).backward()
        if dtype is torch.float32:
            loss32, grad32 = loss.detach(), l.grad
        else:
            loss64, grad64 = loss.detach(), l.grad
    if scaled_error(loss32, loss64) > AGREEMENT_LIMIT or scaled_error(grad32, grad64) > AGREEMENT_LIMIT:
        raise SystemExit("voxel_ce: PyTorch fp32 and fp64 differ")
    tensors += [("voxel_ce.logits", logits), ("voxel_ce.targets", targets.int()),
                ("voxel_ce.grad_scale", torch.tensor([grad_scale])),
                ("voxel_ce.loss", f32(loss64).reshape(1)), ("voxel_ce.dlogits", f32(grad64))]

    # Hard Dice: argmax over classes (first maximum), per foreground class over the whole batch.
    predicted = logits.argmax(dim=1)
    scores = []
    for c in range(1, logits.shape[1]):
        p, t = predicted == c, targets == c
        total = p.sum().item() + t.sum().item()
        scores.append(1.0 if total == 0 else 2.0 * (p & t).sum().item() / total)
    tensors += [("dice.score", torch.tensor([sum(scores) / len(scores)], dtype=torch.float32))]

    # Deep supervision: the full-resolution level and one at half resolution, the labels sampled
    # down nearest-exact (what downsample_labels promises), the weighted sum of the two losses.
    fine_targets = torch.randint(0, 3, (2, 8, 8, 8), generator=gen)
    coarse = F.interpolate(fine_targets[:, None].double(), scale_factor=0.5,
                           mode="nearest-exact")[:, 0].round().long()
    logits0, logits1 = uniform(gen, 2, 3, 8, 8, 8, scale=3.0), uniform(gen, 2, 3, 4, 4, 4, scale=3.0)
    weights = (2.0 / 3.0, 1.0 / 3.0)
    results = {}
    for dtype in (torch.float32, torch.float64):
        l0 = logits0.to(dtype).clone().requires_grad_(True)
        l1 = logits1.to(dtype).clone().requires_grad_(True)
        loss = weights[0] * F.cross_entropy(l0, fine_targets) + weights[1] * F.cross_entropy(l1, coarse)
        loss.backward()
        results[dtype] = (loss.detach(), l0.grad, l1.grad)
    for a, b in zip(results[torch.float32], results[torch.float64]):
        if scaled_error(a, b) > AGREEMENT_LIMIT:
            raise SystemExit("deep_sup: PyTorch fp32 and fp64 differ")
    loss64, d0, d1 = results[torch.float64]
    tensors += [("deep_sup.logits0", logits0), ("deep_sup.logits1", logits1),
                ("deep_sup.targets", fine_targets.int()), ("deep_sup.coarse", coarse.int()),
                ("deep_sup.loss", f32(loss64).reshape(1)), ("deep_sup.dlogits0", f32(d0)),
                ("deep_sup.dlogits1", f32(d1))]

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
    print(f"wrote {len(tensors)} tensors, {len(out)} bytes to {path}")


if __name__ == "__main__":
    main()
