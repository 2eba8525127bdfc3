"""Helpers shared by the benchmarks: where a benchmark ran (CPU model, ISA flags, cores), summary
statistics, process counters, allocator set-up.

Kept free of heavy imports (no JAX / torch) so a benchmark can use it before deciding to
re-execute itself (see :func:`ensure_allocator`).
"""

from __future__ import annotations

import os
import platform
import re
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lm_pipeline import launch  # noqa: E402  (light: stdlib only)

_NO_TCMALLOC_MARKER = "_BENCH_NO_TCMALLOC_REEXEC"


def ensure_allocator(use_tcmalloc: bool) -> str:
    """Make the allocator match the request, re-executing this process if needed; returns a
    one-line description for the output.

    ``use_tcmalloc``: preload tcmalloc when the library exists (via
    :func:`lm_pipeline.launch.maybe_reexec_with_tcmalloc`). Otherwise, if tcmalloc was
    inherited through ``LD_PRELOAD``, re-execute without it (once), so ``--no-tcmalloc`` really
    measures glibc malloc.
    """
    if use_tcmalloc:
        launch.maybe_reexec_with_tcmalloc(sys.argv)
        return launch.tcmalloc_status()
    preload = os.environ.get("LD_PRELOAD", "")
    if "tcmalloc" in preload and not os.environ.get(_NO_TCMALLOC_MARKER):
        env = dict(os.environ)
        kept = [p for p in preload.replace(":", " ").split() if "tcmalloc" not in p]
        if kept:
            env["LD_PRELOAD"] = " ".join(kept)
        else:
            env.pop("LD_PRELOAD", None)
        env[_NO_TCMALLOC_MARKER] = "1"
        env[launch.OPT_OUT_ENV] = "1"
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    if launch.tcmalloc_loaded():
        return "tcmalloc loaded (could not remove it)"
    return "glibc malloc (--no-tcmalloc)"


#: The CPU feature flags that matter to these benchmarks' kernels (``/proc/cpuinfo`` names), in
#: the order they are reported: vector widths, FMA, AVX-512 subsets, bf16 / fp16 / int8 dot
#: products and Intel's AMX tiles (oneDNN uses them for PyTorch's bf16; XLA:CPU does not).
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd",
             "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def parse_cpuinfo(text: str) -> dict:
    """``{"model", "isa", "logical_cpus"}`` from a ``/proc/cpuinfo`` text: the first processor's
    ``model name`` (ARM: ``Hardware`` / ``CPU part``, else ""), which of :data:`ISA_FLAGS` its
    ``flags`` (ARM: ``Features``) line lists, in that order, and the number of ``processor`` entries."""
    model, flags, cpus = "", None, 0
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "processor":
            cpus += 1
        elif key in ("model name", "Hardware") and not model:
            model = value
        elif key in ("flags", "Features") and flags is None:
            flags = set(value.split())
    return {"model": " ".join(model.split()), "isa": [f for f in ISA_FLAGS if f in (flags or ())],
            "logical_cpus": cpus}


def cpu_info(cpuinfo_text: str | None = None) -> dict:
    """Where this benchmark runs: ``{"model": str, "isa": [flags], "cores": int}``. ``cores`` is
    the number of CPUs this process may run on (its affinity mask; what the thread pools see),
    ``isa`` the :data:`ISA_FLAGS` present. ``cpuinfo_text`` replaces ``/proc/cpuinfo`` (tests)."""
    if cpuinfo_text is None:
        try:
            cpuinfo_text = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo_text = ""
    parsed = parse_cpuinfo(cpuinfo_text)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = parsed["logical_cpus"] or os.cpu_count() or 0
    return {"model": parsed["model"] or platform.processor() or platform.machine(), "isa": parsed["isa"],
            "cores": cores}


def host_info(gpu: str | None = None, cpuinfo_text: str | None = None) -> dict:
    """The fields every benchmark puts into its ``RESULT`` json: ``{"cpu": cpu_info()}``, plus
    ``"gpu"`` (the accelerator's name, e.g. JAX's ``device_kind``) when one was used."""
    info: dict = {"cpu": cpu_info(cpuinfo_text)}
    if gpu:
        info["gpu"] = gpu
    return info


def host_line(info: dict | None = None) -> str:
    """One line for a benchmark's table header: ``cpu: <model>, <n> cores; isa: <flags>[; gpu: <name>]``."""
    info = host_info() if info is None else info
    cpu = info["cpu"]
    line = f"cpu: {cpu['model']}, {cpu['cores']} cores; isa: {' '.join(cpu['isa']) or '(none of the listed)'}"
    if info.get("gpu"):
        line += f"; gpu: {info['gpu']}"
    return line


def machine_cpu_s(stat_text: str | None = None) -> tuple[float, float]:
    """``(busy, steal)``: CPU seconds the machine's processes have spent busy, and CPU seconds the
    hypervisor took from this (virtual) machine's CPUs to run something else (``steal``), both from
    ``/proc/stat``'s first line (``stat_text`` replaces the file: tests); ``(0, 0)`` elsewhere.

    Steal is kept apart from busy: on a VM whose host is contended a vCPU stops for a while, and a
    program whose threads wait for each other after every operation stops with it, though no
    other process ran in the guest."""
    try:
        if stat_text is None:
            with open("/proc/stat") as f:
                stat_text = f.readline()
        v = [int(x) for x in stat_text.splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0
    v += [0] * (8 - len(v))
    # user nice system idle iowait irq softirq steal (guest time is already inside user/nice)
    tick = os.sysconf("SC_CLK_TCK")
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / tick, v[7] / tick


@dataclass
class Counters:
    """Wall time, CPU time (user, system) and minor page faults of this process, the busy CPU
    time of the whole machine (to tell how much other processes took during a window) and the
    CPU time the hypervisor stole from the machine's vCPUs (:func:`machine_cpu_s`)."""

    wall: float
    user: float
    sys: float
    minflt: int
    machine: float
    steal: float = 0.0

    @classmethod
    def now(cls) -> Counters:
        r = resource.getrusage(resource.RUSAGE_SELF)
        busy, steal = machine_cpu_s()
        return cls(time.perf_counter(), r.ru_utime, r.ru_stime, r.ru_minflt, busy, steal)

    def __sub__(self, other: Counters) -> Counters:
        return Counters(self.wall - other.wall, self.user - other.user, self.sys - other.sys,
                        self.minflt - other.minflt, self.machine - other.machine, self.steal - other.steal)

    @property
    def others_cores(self) -> float:
        """Cores' worth of CPU used by other processes during this interval (>= 0; /proc/stat
        ticks are coarse, so short intervals are approximate)."""
        if self.wall <= 0:
            return 0.0
        return max(0.0, (self.machine - self.user - self.sys) / self.wall)

    @property
    def steal_cores(self) -> float:
        """Cores' worth of CPU the hypervisor took from this machine during this interval."""
        if self.wall <= 0:
            return 0.0
        return max(0.0, self.steal / self.wall)


def summarize(values: list[float]) -> dict[str, float]:
    """median, min, max and the interquartile range (q1, q3) of ``values``."""
    xs = sorted(values)
    if len(xs) >= 2:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    else:
        q1 = q3 = xs[0]
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "q1": q1, "q3": q3, "n": len(xs)}


def loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def fmt_rate(x: float) -> str:
    return f"{x / 1e3:,.1f}k" if x >= 1e4 else f"{x:,.0f}"


# --- log timestamps -------------------------------------------------------------------------

_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(,\d{3})? ")  # Python logging's and Dagster's


def log_time(line: str) -> float | None:
    """The epoch time a log line starts with (``2026-11-26 18:00:00,123 ...``), None without one."""
    m = _LOG_TIME.match(line)
    if not m:
        return None
    t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
    return t + (int(m.group(2)[1:]) / 1000 if m.group(2) else 0.0)


def log_marks(log_text: str, marks: tuple[tuple[str, str], ...]) -> dict[str, float]:
    """For each ``(name, regex)`` of ``marks``, the time of the first timestamped line it matches."""
    found: dict[str, float] = {}
    for line in log_text.splitlines():
        t = log_time(line)
        if t is None:
            continue
        for name, pattern in marks:
            if name not in found and re.search(pattern, line):
                found[name] = t
    return found
