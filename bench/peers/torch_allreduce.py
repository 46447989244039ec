#!/usr/bin/python3
"""The Figure 5 step on torch.distributed with Gloo: all_reduce(max) of a float32 tensor, then add 1.

One process per rank, started by collective_bench with RANK and WORLD_SIZE set; the ranks meet
through a file store. Rank 0 prints one line per repeat: "steps_per_s <rate>".
"""
import argparse
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bytes", type=int, required=True, help="bytes per rank")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--store", required=True, help="file for the rendezvous")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="file://" + args.store, rank=rank, world_size=world)
    x = torch.zeros(max(1, args.bytes // 4), dtype=torch.float32)
    for _ in range(min(args.steps, 10)):  # warm-up: connections, allocations
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        x.add_(1)
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
            x.add_(1)
        rate = args.steps / (time.perf_counter() - start)
        if rank == 0:
            print(f"steps_per_s {rate:.1f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
