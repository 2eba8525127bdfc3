"""bench/gpu_peers.py: the CPU smoke run ends with a RESULT line whose rows compare like with like, and
the transformers peer's models at the real shapes have exactly our parameter and FLOP counts."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.bench import bench_module

ROOT = Path(__file__).resolve().parents[1]
gpu_peers = bench_module("gpu_peers")


@pytest.fixture(scope="module")
def smoke():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_peers.py"), "--smoke"], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    return json.loads(last[len("RESULT "):]), out.stdout


@pytest.mark.slow  # runs the bench's --smoke (about 30 s)
def test_smoke_result_compares_ours_with_the_transformers_peer(smoke):
    res, _ = smoke
    assert res["smoke"] is True and res["platform"] == "cpu" and res["precision"] == "float32 (CPU smoke)"
    rows = {r["trainer"]: r for r in res["rows"] if r["shape"] == "smoke"}
    assert set(rows) == set(gpu_peers.TRAINERS)  # every trainer has a row, run or not
    ours, hf = rows["ours"], rows["transformers"]
    assert ours["status"] == hf["status"] == "ok"
    expected = gpu_peers.our_config(gpu_peers.SMOKE_MODEL)
    vocab = gpu_peers.SMOKE_MODEL["vocab"]
    # both models have the shape asked for, counted from their own arrays / modules
    assert ours["params"] == hf["params"] == expected.num_params(vocab) == res["shapes"]["smoke"]["params"]
    assert hf["flops_per_token_model"] == ours["flops_per_token_model"] == expected.flops_per_token(vocab)
    assert hf["params_match"] and hf["flops_match"]
    tokens = gpu_peers.SMOKE_TOKENS_PER_STEP
    for r in (ours, hf):
        assert r["tokens_per_s"] > 0 and r["batch"] * r["seq_len"] == tokens == res["tokens_per_step"]
        assert r["tokens_per_s"] == pytest.approx(tokens / r["step_s"])
        assert r["mfu_measured"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / res["matmul_peak_flops"])
    peers = [r for r in rows.values() if r["trainer"] != "ours" and r["status"] == "ok"]
    best = max(peers, key=lambda r: r["tokens_per_s"])
    assert res["shapes"]["smoke"]["best_peer"] == best["trainer"]
    assert res["ratio"] == pytest.approx(ours["tokens_per_s"] / best["tokens_per_s"])


@pytest.mark.slow  # runs the bench's --smoke (about 30 s)
def test_smoke_reports_a_peer_that_is_not_installed(smoke):
    res, stdout = smoke
    pytest.importorskip("torch")
    try:
        import torchtitan  # noqa: F401
    except ImportError:
        (row,) = [r for r in res["rows"] if r["trainer"] == "torchtitan"]
        assert row["status"] == "not installed" and "torchtitan" in row["error"]
        assert res["peers"]["torchtitan"] == "not installed"
        assert "torchtitan   not installed" in stdout
    else:
        assert res["peers"]["torchtitan"] == "ok"


@pytest.mark.parametrize("shape", sorted(gpu_peers.SHAPES))
def test_transformers_peer_builds_our_shapes(shape):
    """At the real sizes (on the meta device: no memory): same parameters and FLOPs per token."""
    torch = pytest.importorskip("torch")
    m = gpu_peers.SHAPES[shape]
    with torch.device("meta"):
        model = gpu_peers.hf_llama(m)
    params, fpt = gpu_peers.hf_counts(model, m["seq_len"])
    ours = gpu_peers.our_config(m)
    assert params == ours.num_params(m["vocab"])
    assert fpt == ours.flops_per_token(m["vocab"])
    assert model.config.num_key_value_heads == m["num_kv_heads"] and not model.config.tie_word_embeddings


def test_a_peer_that_does_not_import_with_this_pytorch_is_reported_incompatible(tmp_path, monkeypatch):
    """An installed torchtitan whose modules fail to import against the PyTorch at hand (as 0.3.0 does on
    PyTorch 2.11) gives an "incompatible" row naming both versions and the missing name, not a traceback.
    The stand-in package fails the way the real one did: an import from torch.distributed.fsdp."""
    torch = pytest.importorskip("torch")
    pkg = tmp_path / "torchtitan"
    for sub in ("", "tools", "components"):
        (pkg / sub).mkdir(parents=True, exist_ok=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "tools" / "utils.py").write_text("device_type, device_module = 'cuda', None\n")
    (pkg / "components" / "loss.py").write_text("from torch.distributed.fsdp import NoSuchNameInThisTorch\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "torchtitan" or m.startswith("torchtitan.")]:
        monkeypatch.delitem(sys.modules, name)
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)  # restored afterwards (the child sets them where unset)
    row = gpu_peers.child_torchtitan({"smoke": True, "port": 1})
    assert row["status"] == "incompatible"
    assert f"PyTorch {torch.__version__}" in row["error"] and "NoSuchNameInThisTorch" in row["error"]
    assert "\n" not in row["error"] and "--python torchtitan=PATH" in row["error"]
