"""How many threads the CPU forward runs on (EngineConfig.num_threads, `--threads`); process.py sets it.

The default is the physical cores this process may use: the CPUs of its affinity mask
(`taskset`, a container's cpuset), counted once per core (two hyperthreads of one core share its
arithmetic units: a second spinning worker there only takes turns), and no more than its cgroup's
CPU quota allows (`docker --cpus 1.5`, Kubernetes limits: cpu.max, rounded down, since a worker
past the quota is throttled for the rest of the period and the step waits for it). torch's own
default counts the machine's cores, whatever the process is given; on a shared or limited machine
that puts more spinning workers than cores, and a step waits for the one that is descheduled.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
SYS_CPU = Path("/sys/devices/system/cpu")


def allowed_cpus() -> set[int]:
    """The logical CPUs this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):          # not Linux
        return set(range(os.cpu_count() or 1))


def physical_cores(cpus: set[int], sys_cpu: Path = SYS_CPU) -> int:
    """Distinct (package, core) pairs among `cpus`; len(cpus) where the topology is unreadable."""
    cores = set()
    for cpu in cpus:
        topo = sys_cpu / f"cpu{cpu}" / "topology"
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            return len(cpus)
    return len(cores) or len(cpus)


def cgroup_cpu_limit(root: Path = CGROUP, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs the cgroup quota allows (quota / period; the tightest of the process's cgroup and its
    parents), or None without a quota. cgroup v2's cpu.max ("max 100000" or "150000 100000"), or
    v1's cpu.cfs_quota_us / cpu.cfs_period_us (-1: none)."""
    limits = []
    for d in _cgroup_dirs(root, proc_cgroup):
        try:
            quota, period = (d / "cpu.max").read_text().split()[:2]
            if quota != "max":
                limits.append(int(quota) / int(period))
            continue
        except (OSError, ValueError):
            pass
        try:
            q = int((d / "cpu.cfs_quota_us").read_text())
            p = int((d / "cpu.cfs_period_us").read_text())
            if q > 0 and p > 0:
                limits.append(q / p)
        except (OSError, ValueError):
            pass
    return min(limits) if limits else None


def _cgroup_dirs(root: Path, proc_cgroup: Path) -> list[Path]:
    """The process's own cgroup directory and its parents up to `root` (v2's unified line "0::/x",
    or v1's cpu controller line); `root` itself is always among them (inside a container the
    namespace makes it the container's own)."""
    rel = ""
    try:
        for line in proc_cgroup.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "" or "cpu" in controllers.split(","):
                rel = path.strip("/")
                if controllers != "":
                    root = root / controllers if (root / controllers).is_dir() else root / "cpu"
                break
    except (OSError, ValueError):
        pass
    dirs = [root]
    parts = [p for p in rel.split("/") if p]
    for i in range(1, len(parts) + 1):
        d = root.joinpath(*parts[:i])
        if d.is_dir():
            dirs.append(d)
    return dirs


def default_num_threads(cgroup_root: Path = CGROUP, proc_cgroup: Path = Path("/proc/self/cgroup"),
                        sys_cpu: Path = SYS_CPU) -> int:
    """The physical cores of the affinity mask, at most the cgroup quota rounded down, at least 1."""
    n = physical_cores(allowed_cpus(), sys_cpu)
    quota = cgroup_cpu_limit(cgroup_root, proc_cgroup)
    if quota is not None:
        n = min(n, math.floor(quota))
    return max(1, n)

