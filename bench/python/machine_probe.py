"""How fast this machine computes right now, at mixtral-tiny's shapes.

On every processor this process may run on, at once (as the ranks of a validation run share
them), one single-threaded process repeats a fixed piece of the executor's work for a while: a
SwiGLU-sized pair of multiplies over 2,048 tokens (hidden 128, width 256) and a causal attention
over 8 sequences of 256 tokens (4 heads of 32). Prints one line: the Unix time, then each
processor's median time per repetition in milliseconds, then the slowest of them.

Used to follow a shared VM's speed across a calibration and a validation (docs/validation.md,
"The validation matrix with each run's routing"). Needs the torch that scripts/install-torch
installs:

    ~/.cache/moeplan/torch-2.15.0/bin/python bench/python/machine_probe.py [--seconds 1.5]
"""

import argparse
import multiprocessing as mp
import os
import statistics
import time


def probe(cpu: int, seconds: float, out) -> None:
    os.sched_setaffinity(0, {cpu})
    import torch  # imported here so that each process loads it after pinning itself

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(2048, 128)
    w1, w2 = torch.randn(128, 256), torch.randn(256, 128)
    q, k, v = (torch.randn(8, 4, 256, 32) for _ in range(3))

    def once() -> torch.Tensor:
        h = torch.nn.functional.silu(x @ w1) @ w2
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return h.sum() + a.sum()

    for _ in range(5):
        once()
    times = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    out.put((cpu, 1e3 * statistics.median(times)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.5, help="how long each processor repeats the work")
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    results = mp.Queue()
    workers = [mp.Process(target=probe, args=(cpu, args.seconds, results)) for cpu in cpus]
    for w in workers:
        w.start()
    medians = dict(results.get() for _ in workers)
    for w in workers:
        w.join()
    cells = " ".join(f"{medians[cpu]:.3f}" for cpu in cpus)
    print(f"{int(time.time())} {cells} {max(medians.values()):.3f}")


if __name__ == "__main__":
    main()
