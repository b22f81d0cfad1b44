"""How many CPU threads torch computes with: what the user asks for, else the cores idle now.

torch's default is one thread per core, which beside other work (a browser, another member,
a build) oversubscribes the machine: on a 2-core machine kept busy, a 2-thread training step
took 2.3-3.9x as long as a 1-thread one (docs/hardware.md, "Threads"). So unless told, a
command measures how many cores are idle over a moment (``/proc/stat``; the load average
where there is none) and takes that many, at least one. Its threads then wait passively
(``OMP_WAIT_POLICY=PASSIVE``, set by the ``matformer`` package before torch loads): a
thread that spins while it waits takes a core another process needed.

    chosen = use_threads(args.threads)       # torch.set_num_threads, and why
    print(chosen.describe())                 # "2 threads (2 of 2 cores idle)"
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import torch

from matformer.modeling.errors import InvalidValue

SAMPLE_S = 0.25  # how long idle cores are measured over


@dataclass(frozen=True, slots=True)
class Threads:
    count: int
    cores: int  # the cores this process may run on
    idle: float | None  # cores idle when measured; None when the count was asked for
    source: str = "asked for"  # where an unmeasured count came from

    def describe(self) -> str:
        if self.idle is None:
            return f"{self.count} thread{'s' if self.count > 1 else ''} ({self.source})"
        return (f"{self.count} thread{'s' if self.count > 1 else ''} ({self.idle:.1f} of "
                f"{self.cores} cores idle; --threads sets it)")


def usable_cores() -> int:
    """The cores this process may run on (its affinity; all of them where none is set)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def idle_cores(sample_s: float = SAMPLE_S) -> float:
    """Cores idle over ``sample_s``, from the kernel's CPU time counters; on a system without
    ``/proc/stat``, the cores less the 1-minute load average."""
    cores = usable_cores()
    try:
        first = _cpu_times()
        time.sleep(sample_s)
        second = _cpu_times()
    except OSError:
        return max(cores - os.getloadavg()[0], 0.0)
    busy, total = (b - a for a, b in zip(first, second, strict=True))
    if total <= 0:
        return float(cores)
    machine = os.cpu_count() or cores
    return min(max((1 - busy / total) * machine, 0.0), float(cores))


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies summed over every CPU, from the first line of /proc/stat."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal
    return total - idle, total


def choose_threads(requested: int | None = None, *, processes: int | None = None,
                   sample_s: float = SAMPLE_S) -> Threads:
    """``requested`` threads when given (>= 1), else $OMP_NUM_THREADS when set (as torch
    reads it), else this process's part of the cores idle now, rounded, at least one and at
    most the usable cores. ``processes``: how many of this machine's processes share them
    (default: torchrun's ranks on this machine, else 1)."""
    cores = usable_cores()
    if requested is None and os.environ.get("OMP_NUM_THREADS", "").strip().isdigit():
        return Threads(count=max(int(os.environ["OMP_NUM_THREADS"]), 1), cores=cores,
                       idle=None, source="OMP_NUM_THREADS")
    if processes is None:
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if requested is not None:
        if requested < 1:
            raise InvalidValue(f"--threads must be at least 1, got {requested}.")
        return Threads(count=requested, cores=cores, idle=None)
    idle = idle_cores(sample_s)
    return Threads(count=min(max(round(idle / max(processes, 1)), 1), cores), cores=cores,
                   idle=idle)


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    """``--threads N``, which ``use_threads(args.threads)`` reads."""
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="CPU threads torch computes with (default: the cores idle at the "
                             "start, measured; at least 1)")


def use_threads(requested: int | None = None, *, processes: int | None = None) -> Threads:
    """``choose_threads``, applied to torch (intra-op threads) for this process."""
    chosen = choose_threads(requested, processes=processes)
    torch.set_num_threads(chosen.count)
    return chosen
