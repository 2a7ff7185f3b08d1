"""Peak memory of one P-EAGLE training step against the partition segment size.

A random drafter (default: the tiny target's shape) and one random sequence of ``--length``
tokens with COD-sampled depths; each configuration runs one forward/backward in a fresh
process and reports

* saved activations: the high-water mark of tensors autograd keeps for backward (unique
  storages, parameters excluded), counted with ``torch.autograd.graph.saved_tensors_hooks``;
* RSS growth: the process's peak resident size (``ru_maxrss``) minus its size just before
  the step, which also sees the attention mask, scores and logits that are not saved;
* CUDA peak: ``torch.cuda.max_memory_allocated`` growth, when run with ``--device cuda``.

    python scripts/bench_partition_memory.py --length 1024 --depths 8 --segments 0 512 256 128 64
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import weakref
from pathlib import Path

import torch

# Runnable from a plain checkout, without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class SavedPeak:
    """High-water mark of the bytes autograd holds for backward (unique storages)."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude, self.live, self.now, self.peak = exclude, {}, 0, 0

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if not entry[1]:
            self.now -= entry[0]
            del self.live[key]

    def pack(self, t: torch.Tensor) -> object:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        holder = _Holder(t)
        if key in self.exclude or not storage.nbytes():
            return holder
        if key not in self.live:
            self.live[key] = [storage.nbytes(), 0]
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
        self.live[key][1] += 1
        weakref.finalize(holder, self._release, key)
        return holder

    @staticmethod
    def unpack(holder: _Holder) -> torch.Tensor:
        return holder.t


class _Holder:
    __slots__ = ("__weakref__", "t")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def one(args: argparse.Namespace) -> dict[str, float]:
    from vllm_peagle.modeling import PEagleDrafter, PEagleDrafterConfig
    from vllm_peagle.training.cod import CodConfig, cod_sample, pack_layouts
    from vllm_peagle.training.partition import partitioned_backward
    from vllm_peagle.training.step import Batch, drafter_loss_sum

    torch.manual_seed(0)
    dev = torch.device(args.device)
    h = args.hidden
    cfg = PEagleDrafterConfig(
        hidden_size=h,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, h // 64),
        num_key_value_heads=max(1, h // 64),
        intermediate_size=int(h * 2.75),
        vocab_size=args.vocab,
        mask_token_id=args.vocab - 1,
        max_position_embeddings=args.length,
    )
    drafter = PEagleDrafter(cfg).to(dev)
    n = args.length
    gen = torch.Generator().manual_seed(0)
    layout = cod_sample(torch.ones(n, dtype=torch.bool), CodConfig(args.depths), gen)
    batch = Batch(
        torch.randint(0, args.vocab - 1, (1, n), generator=gen),
        torch.randn(1, n, 3 * h, generator=gen),
        torch.randn(1, n, args.vocab, generator=gen),
        pack_layouts([layout]),
    ).to(dev)
    params = {p.untyped_storage().data_ptr() for p in drafter.parameters()}
    tracker = SavedPeak(params)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        cuda0 = torch.cuda.memory_allocated()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
        if args.segment_len:
            partitioned_backward(
                lambda fn, *a: fn(drafter, *a), drafter, batch, "peagle", args.segment_len, 1.0
            )
        else:
            loss, _ = drafter_loss_sum(drafter, batch, "peagle")
            loss.backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0  # KiB on Linux
    out = {
        "elements": len(layout),
        "saved_mib": tracker.peak / 2**20,
        "rss_mib": rss / 1024,
        "seconds": seconds,
    }
    if dev.type == "cuda":
        out["cuda_mib"] = (torch.cuda.max_memory_allocated() - cuda0) / 2**20
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=1024, help="tokens in the sequence")
    parser.add_argument("--depths", type=int, default=8, help="K (COD depths)")
    parser.add_argument("--segments", type=int, nargs="+", default=[0, 512, 256, 128, 64])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--segment-len", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(one(args)))
        return
    rows = []
    for seg in args.segments:
        argv = [sys.executable, __file__, "--one", "--segment-len", str(seg)]
        for flag in ("length", "depths", "hidden", "layers", "vocab", "device", "threads"):
            argv += [f"--{flag}", str(getattr(args, flag))]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"segment {seg} failed:\n{done.stderr[-2000:]}")
        rows.append((seg, json.loads(done.stdout.strip().splitlines()[-1])))
    base = rows[0][1] if rows and rows[0][0] == 0 else None
    cuda = "cuda_mib" in rows[0][1]
    print(
        f"length {args.length} tokens, K={args.depths}, hidden {args.hidden}, "
        f"{args.layers} layer(s), vocab {args.vocab}, {rows[0][1]['elements']} flat elements, "
        f"device {args.device}"
    )
    head = "| segment (anchors) | saved activations MiB | RSS growth MiB |"
    head += " CUDA peak MiB |" if cuda else ""
    head += " vs unpartitioned (saved) | step s |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for seg, r in rows:
        ratio = f"{r['saved_mib'] / base['saved_mib']:.2f}x" if base else "-"
        line = f"| {seg or 'none'} | {r['saved_mib']:.1f} | {r['rss_mib']:.1f} |"
        line += f" {r['cuda_mib']:.1f} |" if cuda else ""
        print(line + f" {ratio} | {r['seconds']:.2f} |")


if __name__ == "__main__":
    main()
