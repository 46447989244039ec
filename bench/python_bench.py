#!/usr/bin/env python3
"""The Python front-end's costs against the C++ client's, side by side in one run (issue 13):

- OpByOp, pipelined: N dependent calls of a one-device function, then one fetch, from Python
  (`f(x)` on pathways Arrays) and from C++ (the same loop over the same client and compiled
  function, inside the extension), per call;
- put and fetch of a 64 MiB tensor from Python (torch tensors in and out) against C++ (HostArray).

    PYTHONPATH=build/python /usr/bin/python3 bench/python_bench.py [--calls 2000] [--repeats 5]
"""
import argparse
import statistics
import sys
import time

import torch

import pathways
from pathways import P, _pathways as ext


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--mib", type=int, default=64)
    a = p.parse_args(argv)
    with pathways.LocalCluster(islands=1, hosts_per_island=1, devices_per_host=1, device_memory="1GiB") as cluster:
        client = cluster.connect()
        one = client.slice((1,))

        @pathways.function(in_shardings=[P("x")], out_shardings=[P("x")])
        def add_one(v):
            return v + 1.0

        x = client.put(torch.zeros(1), one, P("x"))
        add_one(x).fetch()  # compile
        compiled = next(iter(add_one._compiled.values()))
        py_us, cpp_us = [], []
        for _ in range(a.repeats):
            start = time.perf_counter()
            y = x
            for _ in range(a.calls):
                y = add_one(y)
            y.fetch()
            py_us.append((time.perf_counter() - start) / a.calls * 1e6)
            cpp_us.append(ext.bench_chain_of_calls(client._native, compiled, one._native, x._native, a.calls) /
                          a.calls * 1e6)
        print(f"OpByOp pipelined, {a.calls} dependent calls then a fetch, median of {a.repeats}:")
        print("| client | us per call |\n|---|---|")
        print(f"| C++ | {statistics.median(cpp_us):.1f} |\n| Python | {statistics.median(py_us):.1f} |")
        print(f"Python / C++: {statistics.median(py_us) / statistics.median(cpp_us):.2f}x\n")

        nbytes = a.mib << 20
        tensor = torch.zeros(nbytes // 4)
        rows = {"Python": ([], []), "C++": ([], [])}
        for _ in range(a.repeats):
            # A put is timed until its data is on the device, a fetch from there on.
            start = time.perf_counter()
            arr = client.put(tensor, one)
            arr.ready()
            put = time.perf_counter()
            arr.fetch()
            rows["Python"][0].append(put - start)
            rows["Python"][1].append(time.perf_counter() - put)
            del arr
            put_s, fetch_s = ext.bench_put_and_fetch(client._native, one._native, nbytes)
            rows["C++"][0].append(put_s)
            rows["C++"][1].append(fetch_s)
        print(f"Put and fetch of {a.mib} MiB, median of {a.repeats} (GB/s):")
        print("| client | put | fetch |\n|---|---|---|")
        rate = {}
        for name, (puts, fetches) in rows.items():
            rate[name] = (nbytes / statistics.median(puts) / 1e9, nbytes / statistics.median(fetches) / 1e9)
            print(f"| {name} | {rate[name][0]:.2f} | {rate[name][1]:.2f} |")
        print(f"Python / C++: put {rate['Python'][0] / rate['C++'][0]:.2f}, fetch {rate['Python'][1] / rate['C++'][1]:.2f}")
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
