#!/usr/bin/env python3
"""Draws make soak's container-cycle samples (scripts/soak.sh; CSV from
tests/tests/cri_microvm_soak.rs) as one PNG per file: memory (host cgroup, shim RSS, VM
processes' RSS, guest MemAvailable) and open fds (shim, VM processes) against the cycle.

    scripts/soak-plot.py build/soak/container-cycles-qemu.csv [...]  -> <csv>.png beside each

Needs matplotlib (pip install matplotlib); make soak draws the curves only where it is there.
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MIB = 1 << 20


def plot(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return
    cycle = [int(r["cycle"]) for r in rows]
    fig, (mem, fds) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for key, label in [
        ("cgroup_usage_bytes", "host cgroup usage"),
        ("vm_rss_bytes", "VM processes' RSS"),
        ("guest_available_bytes", "guest MemAvailable"),
        ("shim_rss_bytes", "shim RSS"),
    ]:
        mem.plot(cycle, [int(r[key]) / MIB for r in rows], label=label)
    limit = int(rows[0]["cgroup_limit_bytes"]) / MIB
    if limit > 0:
        mem.axhline(limit, color="grey", linestyle="--", label="host cgroup limit")
    mem.set_ylabel("MiB")
    mem.set_ylim(bottom=0)
    mem.legend(loc="center right", fontsize="small")
    mem.set_title(path.rsplit("/", 1)[-1])
    for key, label in [("vm_fds", "VM processes' open fds"), ("shim_fds", "shim's open fds")]:
        fds.plot(cycle, [int(r[key]) for r in rows], label=label)
    fds.set_ylabel("open fds")
    fds.set_ylim(bottom=0)
    fds.set_xlabel("container cycle")
    fds.legend(loc="center right", fontsize="small")
    fig.tight_layout()
    out = path[: -len(".csv")] + ".png" if path.endswith(".csv") else path + ".png"
    fig.savefig(out, dpi=80)
    print(f"soak-plot: {out}")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        plot(p)
