"""Readings of processes from /proc: CPU seconds (of a process, a process tree, the whole machine), RSS, and the
mappings of .ngc files (Rss and Pss from smaps)."""

from __future__ import annotations

import os
import re
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """The process's children, their children, ... (/proc/<pid>/task/*/children; gone ones left out)."""
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            out += [child, *descendants(child)]
    return out


def tree_cpu_seconds(pid: int) -> float:
    """cpu_seconds of a process and every process under it (a `serve --workers N` replica's workers)."""
    total = 0.0
    for p in (pid, *descendants(pid)):
        try:
            total += cpu_seconds(p)
        except OSError:  # exited in between
            pass
    return total


def machine_busy() -> float:
    """CPU seconds the whole machine spent busy so far, all cores (/proc/stat: everything but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU microseconds per row of each process over one timed run (where the time goes)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.start = {name: cpu_seconds(pid) for name, pid in pids.items()}

    def per_row(self, rows: int) -> dict[str, float]:
        return {name: (cpu_seconds(pid) - self.start[name]) * 1e6 / rows for name, pid in self.pids.items()}


def rss_kib(pid: int) -> int:
    """The resident set size of a process, KiB (/proc/<pid>/status VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))  # type: ignore[union-attr]


def ngc_mapping(pid: int) -> tuple[int, int, int, list[str]]:
    """Size, Rss and Pss (KiB) summed over the mappings of `pid` whose path ends with .ngc, and those paths."""
    size = rss = pss = 0
    paths: list[str] = []
    current = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if head and re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", head[0]):
                current = len(head) >= 6 and head[-1].endswith(".ngc")
                if current and head[-1] not in paths:
                    paths.append(head[-1])
            elif current and head[0] in ("Size:", "Rss:", "Pss:"):
                kib = int(head[1])
                if head[0] == "Size:":
                    size += kib
                elif head[0] == "Rss:":
                    rss += kib
                else:
                    pss += kib
    return size, rss, pss, paths

