"""One rank of 04's fabric test: all_reduce across the cluster with torch.distributed (runs in a node's container).

usage: python3 -c SOURCE CONFIG_JSON   (SOURCE = probes.source("allreduce")) -> its document
CONFIG: backend (nccl | gloo), rank, world, master ("ip:port" of rank 0's store), device (CUDA index, -1 on CPU),
sizes (bytes), iters (at most), budget_s (per size), warmup, timeout_s, netdev (the fabric netdev, for its link
rate), leaders (the first rank of each node, in node order). Needs torch (the image's); the rest is stdlib.

The process ends itself at timeout_s (SIGALRM's default action, which also ends a collective hung inside NCCL).
Per size: the median time of one all_reduce (each timed alone, so a preempted one does not skew it) after `warmup`,
over `iters`, or fewer where the warm-up shows they would take longer than budget_s (every rank agrees on the count:
the slowest rank's warm-up decides); the slowest rank's median, with nccl-tests' algbw = bytes / time and
busbw = algbw * 2(n-1)/n, and whether a sum of ones came back as n.
Then each node leader sends the largest size to the next node's leader in turn (a ring, one link at a time): the
receiver's rate is that link's, in that direction. Last, the first (latency) size is timed again and the better of its
two passes reported (both kept in `passes_us`): a burst of load on a shared node lasting through one pass (8.2 ms
at 32 KiB against 1.2 ms at 256 KiB right after, measured on a busy 2-core lab) no longer reads as a slow fabric,
while a link that is slow stays slow in both.
"""
import functools
import json
import signal
import statistics
import sys
import time
from datetime import timedelta


def link_mbps(netdev):
    """The netdev's link rate in Mb/s as the kernel reports it; None where it reports none (-1, virtual)."""
    try:
        speed = int(open(f"/sys/class/net/{netdev}/speed").read())
    except (OSError, ValueError):
        return None
    return speed if speed > 0 else None


def figures(size, seconds, world, iters, correct):
    """One size's document: nccl-tests' algbw and busbw from the slowest rank's median time."""
    algbw = size * 8 / seconds / 1e9
    return {"bytes": size, "us": seconds * 1e6, "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (world - 1) / world,
            "iters": iters, "correct": correct}


def main():
    cfg = json.loads(sys.argv[1])
    signal.alarm(int(cfg["timeout_s"]))
    import torch
    import torch.distributed as dist

    rank, world, cuda = cfg["rank"], cfg["world"], cfg["device"] >= 0
    if cuda:
        torch.cuda.set_device(cfg["device"])
    device = torch.device("cuda", cfg["device"]) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.monotonic()
    dist.init_process_group(cfg["backend"], init_method=f"tcp://{cfg['master']}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg["timeout_s"]))
    dist.all_reduce(torch.zeros(1, device=device))  # NCCL makes its communicator here, not in the first size's warm-up
    sync()
    init_s = time.monotonic() - t0

    def median_s(op, n):
        took = []
        for _ in range(n):
            sync()
            start = time.perf_counter()
            op()
            sync()
            took.append(time.perf_counter() - start)
        return statistics.median(took)

    def slowest_median_s(op, n):
        took = torch.tensor([median_s(op, n)], dtype=torch.float64, device=device)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return took.item()

    sizes = []
    for size in cfg["sizes"]:
        buf = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
        once = functools.partial(dist.all_reduce, buf)
        iters = max(2, min(cfg["iters"], int(cfg["budget_s"] / max(slowest_median_s(once, cfg["warmup"]), 1e-9))))
        seconds = slowest_median_s(once, iters)
        if not sizes:
            latency = (once, iters)  # timed again after everything else
        buf.fill_(1)
        dist.all_reduce(buf)
        sizes.append(figures(size, seconds, world, iters, bool((buf == world).all().item())))

    links, leaders = [], cfg["leaders"]
    buf = torch.ones(max(cfg["sizes"]) // 4, dtype=torch.float32, device=device)
    for i, src in enumerate(leaders if len(leaders) > 1 else []):
        dst = leaders[(i + 1) % len(leaders)]
        if rank == src:
            op = functools.partial(dist.send, buf, dst)
        elif rank == dst:
            op = functools.partial(dist.recv, buf, src)
        else:
            continue
        median_s(op, 1)  # the pair meets here (and NCCL makes its point-to-point channel)
        seconds = median_s(op, 3)
        if rank == dst:
            links.append({"src_rank": src, "dst_rank": dst, "gbps": buf.numel() * 4 * 8 / seconds / 1e9})
    first = sizes[0]
    passes = [first["us"] / 1e6, slowest_median_s(*latency)]
    sizes[0] = {**figures(first["bytes"], min(passes), world, first["iters"], first["correct"]),
                "passes_us": [p * 1e6 for p in passes]}
    dist.all_reduce(torch.zeros(1, device=device))  # no rank leaves while a link is measured
    dist.destroy_process_group()
    return {"rank": rank, "world": world, "backend": cfg["backend"], "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else "", "init_s": init_s,
            "sizes": sizes, "links": links, "link_mbps": link_mbps(cfg["netdev"])}
