"""Every benchmark says where it ran: bench/common.py's host helper parses /proc/cpuinfo texts (an
Intel Xeon with AVX-512 and AMX, an AMD EPYC with AVX2 only), and every bench script prints its
line and puts its fields into the RESULT json. bench/quality_per_time.py's smoke run (slow tier)."""

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"

_spec = importlib.util.spec_from_file_location("bench_common", BENCH / "common.py")
common = sys.modules["bench_common"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)

# Two processors of a Xeon (Sapphire Rapids) VM as Linux lists them, shortened to the lines that matter.
INTEL_AMX = """\
processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 207
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep sse sse2 ssse3 fma cx16 sse4_1 sse4_2 avx f16c avx2 \
avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512vbmi avx512_vbmi2 gfni vaes avx512_vnni \
avx512_bitalg avx512_vpopcntdq avx_vnni avx512_bf16 amx_bf16 avx512_fp16 amx_tile amx_int8 arch_capabilities
cpu cores\t: 2

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep sse sse2 ssse3 fma cx16 sse4_1 sse4_2 avx f16c avx2 \
avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512vbmi avx512_vbmi2 gfni vaes avx512_vnni \
avx512_bitalg avx512_vpopcntdq avx_vnni avx512_bf16 amx_bf16 avx512_fp16 amx_tile amx_int8 arch_capabilities
"""

AMD_AVX2 = """\
processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 23
model name\t: AMD EPYC  7B12
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr sse sse2 ht syscall nx mmxext pdpe1gb lm pni \
pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm \
abm sse4a misalignsse 3dnowprefetch bmi1 avx2 smep bmi2 rdseed adx smap clflushopt clwb sha_ni xsaveopt

processor\t: 1
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC  7B12
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr sse sse2 ht syscall nx mmxext pdpe1gb lm pni \
pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm \
abm sse4a misalignsse 3dnowprefetch bmi1 avx2 smep bmi2 rdseed adx smap clflushopt clwb sha_ni xsaveopt
"""


def test_parse_cpuinfo_intel_with_avx512_and_amx():
    info = common.parse_cpuinfo(INTEL_AMX)
    assert info == {
        "model": "Intel(R) Xeon(R) Processor",
        "isa": ["sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd",
                "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"],
        "logical_cpus": 2,
    }


def test_parse_cpuinfo_amd_with_avx2_only():
    info = common.parse_cpuinfo(AMD_AVX2)
    assert info == {"model": "AMD EPYC 7B12", "isa": ["sse4_2", "avx", "avx2", "fma"], "logical_cpus": 2}
    # flags that merely contain a listed name (avx512ifma, avx_vnni, sse4a) do not count as it
    assert "avx512f" not in common.parse_cpuinfo("flags : avx512ifma avx_vnni sse4a")["isa"]


def test_host_info_and_line():
    host = common.host_info(cpuinfo_text=INTEL_AMX)
    assert set(host) == {"cpu"} and set(host["cpu"]) == {"model", "isa", "cores"}
    assert host["cpu"]["cores"] >= 1 and "amx_bf16" in host["cpu"]["isa"]
    line = common.host_line(host)
    assert line.startswith("cpu: Intel(R) Xeon(R) Processor, ") and "amx_tile amx_bf16 amx_int8" in line
    gpu = common.host_info(gpu="NVIDIA H100 80GB HBM3", cpuinfo_text=AMD_AVX2)
    assert gpu["gpu"] == "NVIDIA H100 80GB HBM3" and common.host_line(gpu).endswith("; gpu: NVIDIA H100 80GB HBM3")
    assert common.cpu_info(cpuinfo_text="")["model"]  # no /proc/cpuinfo: still names the processor
    assert json.loads(json.dumps(common.host_info())) == common.host_info()  # what goes into RESULT


def _called_names(tree: ast.AST) -> set[str]:
    return {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py") if p.name != "common.py"))
def test_every_bench_script_reports_its_host(script):
    """Each script prints host_line(...) in its header and puts host_info()'s fields into RESULT."""
    source = (BENCH / script).read_text()
    tree = ast.parse(source)
    assert {"host_info", "host_line"} <= _called_names(tree), f"{script} does not call both host helpers"
    assert "RESULT " in source
    # the host dict (or host_info() itself) is unpacked into the dict printed as RESULT, or into the
    # result record that is
    assert "**host" in source, f"{script}: the RESULT json does not include the host fields"
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "common"]
    assert any({"host_info", "host_line"} <= {a.name for a in n.names} for n in imports), script


# /proc/stat's first lines on a 2-vCPU guest whose host took 3.00 s of CPU (300 ticks of steal).
PROC_STAT = """\
cpu  3731036 41314 196123 1269781 9755 11 9368 63599 500 0
cpu0 1878213 20666 97351 622588 5480 0 3885 31915 0 0
"""


def test_machine_cpu_s_keeps_steal_apart_from_busy():
    tick = os.sysconf("SC_CLK_TCK")
    busy, steal = common.machine_cpu_s(PROC_STAT)
    # user + nice + system + irq + softirq; idle, iowait, steal and guest (already in user) are not busy
    assert busy == pytest.approx((3731036 + 41314 + 196123 + 11 + 9368) / tick)
    assert steal == pytest.approx(63599 / tick)
    assert common.machine_cpu_s("cpu  10 0 5 100") == (pytest.approx(15 / tick), 0.0)  # an old kernel: no steal field
    assert common.machine_cpu_s("") == (0.0, 0.0)
    real = common.machine_cpu_s()
    assert real[0] > 0 and real[1] >= 0


def test_counters_split_other_processes_from_steal():
    a = common.Counters(wall=10.0, user=5.0, sys=1.0, minflt=100, machine=20.0, steal=3.0)
    b = common.Counters(wall=12.0, user=8.0, sys=1.5, minflt=160, machine=25.5, steal=4.0)
    d = b - a
    assert (d.wall, d.user, d.sys, d.minflt) == (pytest.approx(2.0), pytest.approx(3.0), pytest.approx(0.5), 60)
    assert d.others_cores == pytest.approx((5.5 - 3.5) / 2.0)  # the machine's busy time beyond this process's own
    assert d.steal_cores == pytest.approx(0.5)
    assert common.Counters(0.0, 0, 0, 0, 0, 1.0).steal_cores == 0.0


@pytest.mark.slow  # one tiny end-to-end CLI run from an empty store, and its evaluation (about 20-40 s)
def test_quality_per_time_smoke(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH / "quality_per_time.py"), "--smoke", "--work-root", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("cpu: ") and lines[-1].startswith("RESULT ")
    res = json.loads(lines[-1][len("RESULT "):])
    assert res["smoke"] is True and res["ratio"] is None and res["nanogpt"] is None
    assert set(res["cpu"]) == {"model", "isa", "cores"}
    v = res["variants"]["default"]
    assert v["steps"] == 24 and v["batch"] == 12 and v["tokens"] == 24 * 12 * 64
    assert 0 < v["bpb"] < 10 and 0 < v["in_run_bpb"] < 10 and abs(v["bpb"] - v["in_run_bpb"]) < 0.2
    ph = v["phases_s"]
    for k in ("start", "raw_shards", "tokenizer", "token_cache", "setup", "steps", "eval", "finish"):
        assert ph[k] is not None and ph[k] >= 0, k
    # the phases account for the whole run (log timestamps are to the millisecond)
    assert abs(sum(x for k, x in ph.items() if k != "steady_step_s") - v["wall_s"]) < 0.5
    assert list(tmp_path.iterdir()) == []  # stores, corpus and logs removed
