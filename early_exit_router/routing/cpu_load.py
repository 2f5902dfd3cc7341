"""How much of the CPUs this process may run on other work held while it timed something.

A cost table timed while another process (a test run, a build, a second model) shared the cores prices every chunk
length as that contention left it, and often nothing inside the table shows it: the costs still rise with the
positions, and a real step timed in the same minute agrees with them. Cached, such a table would steer every later
process.
So the measurement reads the kernel's CPU accounting around itself (`CpuReading`, Linux's `/proc/stat`), and
`other_work_share` says which share of this process's CPUs went to anything but this process, time a hypervisor
stole from the virtual machine included. Where the system does not say (not Linux), nothing is known: None.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")
MIN_SPAN_S = 0.5  # the kernel counts CPU time in clock ticks (10 ms): over a shorter span a share says nothing


@dataclass(frozen=True)
class CpuReading:
    """One moment's CPU accounting: seconds the CPUs this process may run on spent busy (user, nice, system, irq,
    softirq and steal), seconds this process spent on a CPU, and the wall clock."""

    busy_s: float
    own_s: float
    wall_s: float
    cpus: int


def read_cpu() -> CpuReading | None:
    """The CPU accounting now, over the CPUs this process may run on; None where the system does not provide it."""
    try:
        lines = PROC_STAT.read_text().splitlines()
        allowed = os.sched_getaffinity(0)
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, AttributeError, ValueError):
        return None
    busy = 0
    cpus = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in allowed:
            continue
        # user nice system idle iowait irq softirq steal [guest guest_nice: already counted in user and nice]
        values = [int(v) for v in rest.split()[:8]] + [0] * 8  # older kernels list fewer fields
        busy += sum(values[:8]) - values[3] - values[4]
        cpus += 1
    if cpus == 0:
        return None
    return CpuReading(busy / tick, time.process_time(), time.perf_counter(), cpus)


def other_work_share(before: CpuReading | None, after: CpuReading | None) -> float | None:
    """The share (0 to 1) of this process's CPUs that other work held between two readings; None where unknown."""
    if before is None or after is None or after.wall_s - before.wall_s < MIN_SPAN_S:
        return None
    others = (after.busy_s - before.busy_s) - (after.own_s - before.own_s)
    return min(1.0, max(0.0, others / ((after.wall_s - before.wall_s) * after.cpus)))
