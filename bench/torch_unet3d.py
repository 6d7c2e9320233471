#!/usr/bin/env python3
"""The peer for train_unet3d: the same 3D U-Net in PyTorch, timed per training step.

The network is train_unet3d's (model/unet3d.h) layer for layer, so parameter counts match
(--preset nnunet: 31,194,083 for one input channel and 3 classes): per encoder level two
conv3d(3x3x3, padding 1, bias) -> norm -> activation blocks, levels after the first entered by a
stride-2 first convolution (nnunet) or a 2x2x2 max pool (tiny/small: group norm of 4 groups,
SiLU); the bottleneck likewise; per decoder level a ConvTranspose3d(2, stride 2), the skip
concatenated along channels, two conv blocks; a 1x1x1 head; cross-entropy over voxels; AdamW.

  python3 torch_unet3d.py --preset nnunet --volume 128 --batch 2 --amp --steps 20
  python3 torch_unet3d.py --preset nnunet --volume 256 --batch 1 --amp --checkpoint --save-on-cpu

Prints one line per timed step and a summary:
  summary: preset=nnunet volume=128 batch=2 params=31194083 step_ms_median=... voxels_per_s=...
  peak_gib=...
Data: the same procedural spheres-and-boxes task is not reproduced here (timing only): inputs
are random normal volumes and random labels, which cost the network the same.
"""
import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


PRESETS = {
    "tiny": dict(base=4, depth=1, max_channels=0, norm="group", act="silu", down="pool", volume=8),
    "small": dict(base=8, depth=2, max_channels=0, norm="group", act="silu", down="pool", volume=16),
    "nnunet": dict(base=32, depth=5, max_channels=320, norm="instance", act="leaky",
                   down="strided", volume=128),
}


class Blocks(nn.Module):
    def __init__(self, cin, cout, cfg, stride=1):
        super().__init__()
        self.conv1 = nn.Conv3d(cin, cout, 3, stride=stride, padding=1)
        self.conv2 = nn.Conv3d(cout, cout, 3, padding=1)
        groups = cout if cfg["norm"] == "instance" else 4
        self.norm1 = nn.GroupNorm(groups, cout)
        self.norm2 = nn.GroupNorm(groups, cout)
        self.act = nn.LeakyReLU(0.01) if cfg["act"] == "leaky" else nn.SiLU()

    def forward(self, x):
        x = self.act(self.norm1(self.conv1(x)))
        return self.act(self.norm2(self.conv2(x)))


class UNet3d(nn.Module):
    def __init__(self, cfg, in_channels=1, classes=3, deep_supervision=False):
        super().__init__()
        self.cfg = cfg

        def channels(level):
            c = cfg["base"] << level
            return min(c, cfg["max_channels"]) if cfg["max_channels"] else c

        strided = cfg["down"] == "strided"
        self.enc = nn.ModuleList()
        cin = in_channels
        for i in range(cfg["depth"]):
            self.enc.append(Blocks(cin, channels(i), cfg, 2 if strided and i > 0 else 1))
            cin = channels(i)
        self.bottleneck = Blocks(cin, channels(cfg["depth"]), cfg, 2 if strided else 1)
        self.up = nn.ModuleList()
        self.dec = nn.ModuleList()
        for i in reversed(range(cfg["depth"])):
            self.up.append(nn.ConvTranspose3d(channels(i + 1), channels(i), 2, stride=2))
            self.dec.append(Blocks(2 * channels(i), channels(i), cfg))
        self.head = nn.Conv3d(channels(0), classes, 1)
        # Deep supervision (Tessera's UNet3dConfig::deep_supervision): heads on decoder levels
        # 1 .. depth - 2 as well.
        self.ds_levels = list(range(1, cfg["depth"] - 1)) if deep_supervision else []
        self.ds_heads = nn.ModuleDict(
            {str(i): nn.Conv3d(channels(i), classes, 1) for i in self.ds_levels})

    def forward(self, x):
        skips = []
        for i, enc in enumerate(self.enc):
            x = enc(x)
            skips.append(x)
            if self.cfg["down"] == "pool":
                x = F.max_pool3d(x, 2)
        x = self.bottleneck(x)
        coarse = {}
        for level, (up, dec, skip) in zip(reversed(range(self.cfg["depth"])),
                                          zip(self.up, self.dec, reversed(skips))):
            x = dec(torch.cat([up(x), skip], dim=1))
            if level in self.ds_levels:
                coarse[level] = self.ds_heads[str(level)](x)
        return [self.head(x)] + [coarse[i] for i in self.ds_levels]


def segmentation_loss(outputs, y):
    """Cross-entropy of the full-resolution logits, or with deep supervision the levels' sum
    weighted 2^-i (normalised), each against the labels sampled down nearest-exact."""
    weights = [2.0 ** -i for i in range(len(outputs))]
    total = sum(weights)
    loss = 0
    for i, (logits, w) in enumerate(zip(outputs, weights)):
        target = y if i == 0 else F.interpolate(
            y[:, None].float(), scale_factor=0.5 ** i, mode="nearest-exact")[:, 0].long()
        loss = loss + (w / total) * F.cross_entropy(logits.float(), target)
    return loss


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="nnunet", choices=sorted(PRESETS))
    parser.add_argument("--volume", type=int, default=0, help="patch edge (0: the preset's)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="timed steps (after 3 warm-up)")
    parser.add_argument("--amp", action="store_true", help="bf16 autocast (PyTorch AMP)")
    parser.add_argument("--checkpoint", action="store_true",
                        help="activation checkpointing per encoder/decoder level")
    parser.add_argument("--save-on-cpu", action="store_true",
                        help="torch.autograd.graph.save_on_cpu for saved activations")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: PyTorch's)")
    parser.add_argument("--deep-supervision", action="store_true",
                        help="heads on decoder levels 1 .. depth-2, the loss their weighted sum")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    cfg = dict(PRESETS[args.preset])
    volume = args.volume or cfg["volume"]
    torch.manual_seed(1)
    model = UNet3d(cfg, deep_supervision=args.deep_supervision).to(args.device)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    x = torch.randn(args.batch, 1, volume, volume, volume, device=args.device)
    y = torch.randint(0, 3, (args.batch, volume, volume, volume), device=args.device)
    if args.checkpoint:
        import torch.utils.checkpoint as cp
        for blocks in list(model.enc) + [model.bottleneck] + list(model.dec):
            blocks.forward = (lambda f: lambda t: cp.checkpoint(f, t, use_reentrant=False))(
                blocks.forward)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16, enabled=args.amp):
            if args.save_on_cpu:
                with torch.autograd.graph.save_on_cpu(pin_memory=True):
                    loss = segmentation_loss(model(x), y)
                    loss.backward()
            else:
                loss = segmentation_loss(model(x), y)
                loss.backward()
        optimizer.step()
        return loss

    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(3 + args.steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step()
        if cuda:
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) * 1e3
        if i >= 3:
            times.append(elapsed)
            print(f"step {i - 2}/{args.steps} loss {loss.item():.4f} {elapsed:.1f} ms", flush=True)
    median = statistics.median(times)
    voxels = args.batch * volume ** 3
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else 0.0
    print(f"summary: preset={args.preset} volume={volume} batch={args.batch} params={params} "
          f"amp={int(args.amp)} checkpoint={int(args.checkpoint)} save_on_cpu={int(args.save_on_cpu)} "
          f"deep_supervision={int(args.deep_supervision)} "
          f"step_ms_median={median:.2f} voxels_per_s={voxels / (median / 1e3):.0f} "
          f"peak_gib={peak:.2f}")


if __name__ == "__main__":
    main()
