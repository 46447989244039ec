#!/usr/bin/env python3
"""Trains the built-in Transformer language model from Python, as `pathways train` does from the
command line (the same flags, the same losses for the same flags and seed):

    PYTHONPATH=build/python /usr/bin/python3 examples/train_lm.py --steps 200 \\
        --data-parallel 2 --tensor-parallel 2 --pipeline-stages 2 --microbatches 2
"""
import argparse
import json
import math
import sys
import time

import pathways


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=0)
    p.add_argument("--vocab", type=int, default=0)
    p.add_argument("--data-parallel", type=int, default=1)
    p.add_argument("--tensor-parallel", type=int, default=1)
    p.add_argument("--pipeline-stages", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--islands", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--data", default="markov")
    p.add_argument("--metrics-jsonl", default="")
    p.add_argument("--device-memory", default="1GiB")
    p.add_argument("--recompute", action="store_true",
                   help="pipeline stages recompute their forward pass instead of keeping residuals")
    a = p.parse_args(argv)

    # The embedded cluster `pathways train` starts for these flags: islands of hosts of
    # tensor-parallel-many devices each.
    devices = a.data_parallel * a.tensor_parallel * a.pipeline_stages
    per_island = -(-devices // a.islands)
    per_host = min(a.tensor_parallel, per_island)
    with pathways.LocalCluster(islands=a.islands, hosts_per_island=-(-per_island // per_host),
                               devices_per_host=per_host, device_memory=a.device_memory) as cluster:
        client = cluster.connect()
        trainer = pathways.Trainer(client, model=a.model, batch=a.batch, seq_len=a.seq_len, vocab=a.vocab,
                                   data_parallel=a.data_parallel, tensor_parallel=a.tensor_parallel,
                                   pipeline_stages=a.pipeline_stages, microbatches=a.microbatches,
                                   islands=a.islands, seed=a.seed, learning_rate=a.learning_rate, data=a.data,
                                   recompute=a.recompute)
        print(trainer)
        metrics = open(a.metrics_jsonl, "w") if a.metrics_jsonl else None
        start = last = time.monotonic()
        pending = []
        losses = []
        for step in range(1, a.steps + 2):
            if step <= a.steps:
                pending.append(trainer.step())  # one step in flight while the previous loss is read
            if len(pending) == 2 or (step > a.steps and pending):
                loss = pending.pop(0).result()
                losses.append(loss)
                now = time.monotonic()
                rate = trainer.tokens_per_step / (now - last)
                last = now
                if metrics:
                    metrics.write(json.dumps({"step": len(losses), "loss": loss, "tokens_per_s": rate}) + "\n")
                if len(losses) % max(1, a.steps // 10) == 0:
                    print(f"  step {len(losses)}/{a.steps}  loss {loss:.4f}  {rate:.0f} tokens/s")
        if metrics:
            metrics.close()
        tail = losses[-max(1, a.steps // 10):]
        final = sum(tail) / len(tail)
        print(f"trained {a.steps} steps in {time.monotonic() - start:.1f} s: loss {losses[0]:.4f} at the first step, "
              f"{final:.4f} over the last {len(tail)}"
              + ("" if math.isnan(trainer.entropy) else f", against the data's entropy {trainer.entropy:.4f} nats"))
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
