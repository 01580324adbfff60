"""Peer (4): PyTorch ``DistributedDataParallel`` with the gloo backend, N processes on this host.

Each of the N ranks trains an ``nn.Module`` equivalent to the workload's Keras model on its ``B / N`` rows
of every global batch of the same arrays, with Adam(1e-3) and cross-entropy, and counts correct
predictions on device (no per-step host sync, like the other systems). Each rank gets
``max(1, cpus // N)`` intra-op threads. BatchNorm is per-replica (PyTorch's default; Keras' JAX systems
normalise over the global batch). Rank 0 times the run between barriers; the peak memory reported is the
sum of every rank's peak RSS.

Needs ``pip install torch==2.13.0`` (the CPU wheel). Run:
``python -m benchmarks.peers.torch_ddp --workload mlp --devices 2``.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any

from benchmarks.peers import _common


def build_module(workload: Any) -> Any:
    """The workload's model as a ``torch.nn.Module`` (layer for layer the Keras model), returning logits."""
    import torch
    from torch import nn


    if workload.kind == "mlp":
        return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 10))
    if workload.kind == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32, eps=1e-3, momentum=0.01), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(64 * 4 * 4, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 10))

    class LM(nn.Module):
        """Decoder-only LM: embeddings, pre-LN causal blocks, final LayerNorm, logits."""

        def __init__(self) -> None:
            super().__init__()
            d, t = workload.width, workload.seq_len
            self.embed = nn.Embedding(workload.vocab, d)
            self.pos = nn.Parameter(torch.randn(t, d) * 0.02)
            layer = nn.TransformerEncoderLayer(d, workload.heads, workload.ffn, dropout=0.0,
                                               activation="gelu", batch_first=True, norm_first=True,
                                               layer_norm_eps=1e-5)
            self.blocks = nn.TransformerEncoder(layer, workload.layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(d, eps=1e-5)
            self.head = nn.Linear(d, workload.vocab)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(t), persistent=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens) + self.pos
            x = self.blocks(x, mask=self.mask, is_causal=True)
            return self.head(self.norm(x))

    return LM()


def _rank_main(rank: int, args: Any, port: int, out_dir: str) -> None:
    """One DDP rank: trains, times (rank 0) and writes its peak RSS (and rank 0 the rates)."""
    import json

    import torch
    import torch.distributed as dist
    from torch import nn

    from benchmarks import workloads

    n = args.devices
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    wl = workloads.get(args.workload)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(build_module(wl))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()

    x, y = workloads.make_data(wl, args.batch * max(args.steps, args.warmup), seed=args.seed)
    local = args.batch // n
    xt, yt = torch.from_numpy(x), torch.from_numpy(y).long()
    if wl.kind == "cnn":
        xt = xt.permute(0, 3, 1, 2).contiguous()  # NHWC -> NCHW
    batches = [(xt[i + rank * local:i + (rank + 1) * local], yt[i + rank * local:i + (rank + 1) * local])
               for i in range(0, len(xt) - args.batch + 1, args.batch)]
    correct = torch.zeros(())
    model.train()

    def steps(count: int) -> None:
        nonlocal correct
        for i in range(count):
            xb, yb = batches[i % len(batches)]
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(args.bf16)):
                out = model(xb)
            out = out.float()
            loss = loss_fn(out.reshape(-1, out.shape[-1]), yb.reshape(-1))
            loss.backward()
            optimizer.step()
            correct += (out.argmax(-1) == yb).sum().detach()

    def timed(count: int) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        steps(count)
        dist.barrier()
        return time.perf_counter() - t0

    warmup_s = timed(args.warmup)
    times = [timed(args.steps) for _ in range(args.repeats)]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"peak_rss_mb": _common.peak_rss_mb(), "times": times, "warmup_s": warmup_s,
                   "num_params": sum(p.numel() for p in model.parameters()),
                   "threads": torch.get_num_threads()}, f)
    dist.destroy_process_group()


def run(args: Any) -> None:
    """Starts N ranks (fork), waits for them, and writes the combined result."""
    import json
    import tempfile

    import torch
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank_main, args=(args, port, out_dir), nprocs=args.devices, join=True,
                           start_method="fork")
        ranks = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(args.devices)]
    samples = args.steps * args.batch
    _common.write_result(args, samples_per_s=[samples / t for t in ranks[0]["times"]],
                         warmup_s=ranks[0]["warmup_s"], device_kind=f"cpu ({args.devices} processes)",
                         num_params=ranks[0]["num_params"],
                         peak_rss_mb=sum(r["peak_rss_mb"] for r in ranks),
                         note=f"torch {torch.__version__}, gloo, {ranks[0]['threads']} thread(s)/rank; "
                              "RSS summed over ranks")


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m benchmarks.peers.torch_ddp --workload W --devices N ...``."""
    args = _common.parse_args("torch_ddp", argv)
    _common.main_guard(args, lambda: run(args))


if __name__ == "__main__":
    main(sys.argv[1:])
