"""How fast pinned host memory grows, as offloaded checkpoints grow it in a first step (Note [Pinning host memory in
parallel] in lightning_seqpar.parallel.resources): ``--procs`` processes at once (one per GPU, as ranks do), each pinning
``--gb`` GB in the 256 MiB pieces of ``HostOffload``, under torch's default (``cudaHostAlloc``) and under what the
strategy turns on when it offloads (malloc, pages faulted in on 8 threads, ``cudaHostRegister``).

    python benchmarks/pinning.py --gb 8 --procs 4 --out $OUT/pinning.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

PIECE = 1 << 28  # HostOffload's piece_bytes


def _pin(rank: int, gb: float, settings: str | None, queue: mp.Queue) -> None:
    import torch

    torch.cuda.set_device(rank % torch.cuda.device_count())
    torch.cuda.init()
    if settings:
        torch._C._accelerator_setAllocatorSettings(settings)
    pieces, n = [], int(gb * 1e9) // PIECE
    start = time.perf_counter()
    for _ in range(n):
        pieces.append(torch.empty(PIECE, dtype=torch.uint8, pin_memory=True))
    seconds = time.perf_counter() - start
    queue.put((rank, n * PIECE, seconds))


def measure(gb: float, procs: int, settings: str | None) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    workers = [ctx.Process(target=_pin, args=(r, gb, settings, queue)) for r in range(procs)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    results = [queue.get(timeout=600) for _ in workers]
    for w in workers:
        w.join()
    wall = max(s for _, _, s in results)
    total = sum(b for _, b, _ in results)
    return dict(settings=settings or "default (cudaHostAlloc)", procs=procs, gb_per_proc=round(results[0][1] / 1e9, 2),
                slowest_proc_s=round(wall, 2), gb_per_s_all_procs=round(total / 1e9 / wall, 2),
                spawn_and_pin_s=round(time.perf_counter() - start, 2))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gb", type=float, default=8.0, help="GB each process pins")
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "pinning.json"))
    args = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch

    from lightning_seqpar.parallel.resources import PARALLEL_PINNING

    rows = []
    for settings in (None, PARALLEL_PINNING):
        row = measure(args.gb, args.procs, settings)
        row.update(bench="pinning", device=torch.cuda.get_device_name(), torch=torch.__version__,
                   commit=os.environ.get("SEQPAR_COMMIT", "unknown"))
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
