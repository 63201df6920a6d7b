"""gloo's reduce-scatter and all-gather against the forms the executor could use instead.

Two (or --ranks) CPU processes on this machine, one thread each: for each size, the median of 15
calls of reduce_scatter_tensor against all_to_all_single of the equal chunks plus a local sum, and
all_gather_into_tensor against the list form of all_gather, alternating, the faster of two rounds.
Run with the Python of the PyTorch wheel the executor links ($MOEPLAN_TORCH_HOME/bin/python)."""
import argparse, os, time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

FORMS = ["reduce_scatter_tensor", "all_to_all + sum", "all_gather_into_tensor", "all_gather (list)"]


def call(form, full, n):
    numel = full.numel()
    if form == "reduce_scatter_tensor":
        out = torch.empty(numel // n, dtype=full.dtype)
        dist.reduce_scatter_tensor(out, full)
    elif form == "all_to_all + sum":
        out = torch.empty_like(full)
        dist.all_to_all_single(out, full)
        out.view(n, -1).sum(0)
    elif form == "all_gather_into_tensor":
        out = torch.empty(numel, dtype=full.dtype)
        dist.all_gather_into_tensor(out, full[: numel // n])
    else:
        out = torch.empty(numel, dtype=full.dtype)
        dist.all_gather(list(out.chunk(n)), full[: numel // n])


def worker(rank, n, port, sizes_mb):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    for mb in sizes_mb:
        full = torch.randn(int(mb * 1e6 / 4) // n * n)
        best = {}
        for form in FORMS * 2:
            times = []
            for _ in range(15):
                dist.barrier()
                start = time.perf_counter()
                call(form, full, n)
                times.append(time.perf_counter() - start)
            times.sort()
            best[form] = min(best.get(form, float("inf")), times[len(times) // 2])
        if rank == 0:
            print(f"{mb:6.1f} MB fp32: " + "  ".join(f"{f} {best[f] * 1e3:.2f} ms" for f in FORMS), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--port", type=int, default=29533)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[0.2, 2, 8, 32])
    args = parser.parse_args()
    mp.spawn(worker, args=(args.ranks, args.port, args.sizes_mb), nprocs=args.ranks)
