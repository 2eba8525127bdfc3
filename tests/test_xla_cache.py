"""The persistent XLA compilation cache (``lm_pipeline/xla_cache.py``): where it lives, that a
second process really loads what the first compiled, that entries are written atomically; and
``trainer.mp: auto`` (resolved per platform, the resolved policy hashed).

``tests/conftest.py`` sets ``$JAX_COMPILATION_CACHE_DIR`` for the whole session, which the
module respects; every test here that needs the module's own placement removes it from the
environment it passes (or from the child process's environment).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lm_pipeline import hostinfo, xla_cache
from lm_pipeline.config import dump_config, load_config
from lm_pipeline.schema import ConfigError
from lm_pipeline.steps import Pipeline
from lm_pipeline.store import ArtifactStore
from lm_pipeline.train.config import MP_FOR_PLATFORM, TrainerConfig, parse_mp, resolve_mp
from lm_pipeline.train.precision import auto_cpu_mp

REPO = Path(__file__).resolve().parents[1]

# -- where the cache lives ------------------------------------------------------------------


def _env(**kw: str) -> dict[str, str]:
    return {"HOME": "/home/someone", **kw}  # never the session's JAX_COMPILATION_CACHE_DIR


def test_local_store_puts_the_cache_under_the_store(tmp_path):
    key = xla_cache.cache_key("cpu")
    assert xla_cache.cache_dir_for(str(tmp_path / "store"), _env(), platform="cpu") == \
        str(tmp_path / "store" / "_xla_cache" / key)
    assert xla_cache.cache_dir_for(f"file://{tmp_path}/store", _env(), platform="cpu") == \
        str(tmp_path / "store" / "_xla_cache" / key)
    rel = xla_cache.cache_dir_for("artifacts", _env(), platform="cpu")
    assert rel == os.path.join(os.getcwd(), "artifacts", "_xla_cache", key)


@pytest.mark.parametrize("root", ["s3://bucket/store", "gs://bucket/a/b", "memory://x"])
def test_url_store_puts_the_cache_in_a_local_directory(root, tmp_path):
    key = xla_cache.cache_key("cpu")
    assert xla_cache.cache_dir_for(root, _env(), platform="cpu") == f"/home/someone/.cache/lm_pipeline/xla/{key}"
    env = _env(XDG_CACHE_HOME=str(tmp_path / "xdg"))
    assert xla_cache.cache_dir_for(root, env, platform="cpu") == str(tmp_path / "xdg" / "lm_pipeline" / "xla" / key)
    env = _env(LM_PIPELINE_XLA_CACHE=str(tmp_path / "mine"))
    assert xla_cache.cache_dir_for(root, env, platform="cpu") == str(tmp_path / "mine" / key)


def test_env_directory_opt_out_and_the_users_jax_setting(tmp_path):
    store = str(tmp_path / "store")
    assert xla_cache.cache_dir_for(store, _env(LM_PIPELINE_XLA_CACHE=str(tmp_path / "c")), platform="cpu") == \
        str(tmp_path / "c" / xla_cache.cache_key("cpu"))
    for off in ("0", "off", "false", "no", "OFF"):
        assert xla_cache.cache_dir_for(store, _env(LM_PIPELINE_XLA_CACHE=off)) is None
        assert xla_cache.enable(store, _env(LM_PIPELINE_XLA_CACHE=off)) is None
    assert not xla_cache.disabled(_env())
    mine = str(tmp_path / "users")
    # The user's own JAX setting wins over everything, the opt-out included (JAX reads it itself).
    assert xla_cache.cache_dir_for(store, _env(JAX_COMPILATION_CACHE_DIR=mine, LM_PIPELINE_XLA_CACHE="off")) == mine
    assert xla_cache.enable(store, _env(JAX_COMPILATION_CACHE_DIR=mine)) == mine
    assert not os.path.exists(os.path.join(store, "_xla_cache"))


def test_key_names_platform_versions_and_the_machine(monkeypatch):
    from importlib import metadata

    key = xla_cache.cache_key("cpu")
    assert key.startswith(f"cpu-jax{metadata.version('jax')}-jaxlib{metadata.version('jaxlib')}-")
    assert xla_cache.cache_key("gpu") != key
    monkeypatch.setattr(hostinfo, "cpu_flags", lambda: "fpu sse2 avx2 avx512f")
    other = xla_cache.cache_key("cpu")
    monkeypatch.setattr(hostinfo, "cpu_flags", lambda: "fpu sse2 avx2")
    assert xla_cache.cache_key("cpu") != other != key  # a machine with other CPU features: another directory


def test_platform_detection_without_jax(monkeypatch):
    assert hostinfo.platform_from_env("cpu") == "cpu"
    assert hostinfo.platform_from_env("cuda,cpu") == "gpu"
    assert hostinfo.platform_from_env(" rocm ") == "gpu"
    assert hostinfo.platform_from_env("tpu") == "tpu"
    assert hostinfo.platform_from_env("") is None and hostinfo.platform_from_env(None) is None
    assert hostinfo.detect_platform({"JAX_PLATFORMS": "cuda"}) == "gpu"
    assert hostinfo.detect_platform({"JAX_PLATFORMS": "cpu"}) == "cpu"
    # An installed plugin counts only with its device present.
    assert hostinfo._installed_accelerator({"xla_cuda12"}, exists=lambda p: False) is None
    assert hostinfo._installed_accelerator({"xla_cuda12"}, exists=lambda p: p == "/dev/nvidiactl") == "gpu"
    assert hostinfo._installed_accelerator({"jax_rocm60_plugin"}, exists=lambda p: p == "/dev/kfd") == "gpu"
    assert hostinfo._installed_accelerator({"libtpu"}, exists=lambda p: False, globber=lambda g: ["/dev/accel0"]) == "tpu"
    assert hostinfo._installed_accelerator(set(), exists=lambda p: True, globber=lambda g: ["x"]) is None


def test_atomic_put_never_leaves_a_partial_entry(tmp_path, monkeypatch):
    cls = xla_cache.atomic_cache_class()
    cache = cls(str(tmp_path), max_size=-1)
    cache.put("k1", b"a" * 10_000)
    assert cache.get("k1") == b"a" * 10_000
    cache.put("k1", b"b")  # an existing entry is kept (as JAX's cache does)
    assert cache.get("k1") == b"a" * 10_000

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)  # the writer dies between writing and renaming
    with pytest.raises(OSError):
        cache.put("k2", b"c" * 10_000)
    assert cache.get("k2") is None  # no truncated entry that every later run would fail to read
    assert sorted(os.listdir(tmp_path)) == ["k1-cache"]  # and no temporary file left behind


# -- a second process loads what the first compiled -----------------------------------------

_CHILD = textwrap.dedent("""
    import json, os, sys
    from lm_pipeline import xla_cache
    path = xla_cache.enable(sys.argv[1])
    import jax, jax.numpy as jnp
    from jax import monitoring
    counts = {}
    monitoring.register_event_listener(lambda e, **kw: counts.__setitem__(e, counts.get(e, 0) + 1))

    def loss(w, x, y):
        h = jnp.tanh(x @ w["a"])
        return jnp.mean((h @ w["b"] - y) ** 2)

    @jax.jit
    def train_step(w, x, y):
        g = jax.grad(loss)(w, x, y)
        return jax.tree.map(lambda p, d: p - 0.1 * d, w, g), loss(w, x, y)

    k = jax.random.key(0)
    w = {"a": jnp.ones((16, 32)) * 0.1, "b": jnp.ones((32, 4)) * 0.1}
    x, y = jnp.arange(128.0).reshape(8, 16) / 128, jnp.ones((8, 4))
    w, l = train_step(w, x, y)
    installed = xla_cache.installed_cache()
    print(json.dumps({"path": path, "loss": float(l), "hits": counts.get("/jax/compilation_cache/cache_hits", 0),
                      "misses": counts.get("/jax/compilation_cache/cache_misses", 0),
                      "cache_class": type(installed).__name__ if installed is not None else None}))
""")


def _run_child(tmp_path: Path, store: Path, **env_extra: str) -> dict:
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "LM_PIPELINE_XLA_CACHE")}
    env.update(JAX_PLATFORMS="cpu", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", **env_extra)
    r = subprocess.run([sys.executable, str(script), str(store)], capture_output=True, text=True, env=env,
                       cwd=str(REPO), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _entries(directory: Path) -> set[str]:
    return {p.name for p in directory.rglob("*-cache")} if directory.exists() else set()


def test_second_process_hits_the_cache_under_the_store(tmp_path):
    store = tmp_path / "store"
    first = _run_child(tmp_path, store)
    expected = store / "_xla_cache" / xla_cache.cache_key("cpu")
    assert first["path"] == str(expected)
    assert first["cache_class"] == "AtomicLRUCache"
    written = _entries(expected)
    assert first["misses"] >= 1 and first["hits"] == 0 and len(written) >= first["misses"]
    assert not list(expected.glob("*.tmp"))

    second = _run_child(tmp_path, store)
    assert second["hits"] >= 1 and second["misses"] == 0  # every program loaded, none compiled and written
    assert _entries(expected) == written  # nothing new
    assert second["loss"] == first["loss"]


def test_users_jax_dir_and_opt_out_are_respected(tmp_path):
    store, users = tmp_path / "store", tmp_path / "users_cache"
    res = _run_child(tmp_path, store, JAX_COMPILATION_CACHE_DIR=str(users))
    assert res["path"] == str(users) and _entries(users) and not (store / "_xla_cache").exists()
    off = _run_child(tmp_path, store, LM_PIPELINE_XLA_CACHE="off")
    assert off["path"] is None and off["hits"] == 0 and off["misses"] == 0 and not (store / "_xla_cache").exists()


# -- trainer.mp: auto ------------------------------------------------------------------------


AVX2, BF16_CPU, AMX = "avx avx2 fma sse4_2", "avx2 avx512f avx512bw avx512_bf16", "avx512f amx_bf16 amx_tile amx_int8"


def test_mp_auto_resolves_per_platform(monkeypatch):
    from lm_pipeline import hostinfo

    monkeypatch.setattr(hostinfo, "cpu_flags", lambda: AVX2)
    assert resolve_mp("auto", "cpu") == "f32"
    # a CPU with bf16 dot instructions (AVX512-BF16, AMX) multiplies bf16 operands; nothing else changes
    for flags in (BF16_CPU, AMX):
        monkeypatch.setattr(hostinfo, "cpu_flags", lambda f=flags: f)
        assert resolve_mp("auto", "cpu") == "p=f32,c=f32,m=bf16"
        assert parse_mp(resolve_mp("auto", "cpu")).compute.__name__ == "float32"
    assert auto_cpu_mp("avx512f avx512_vnni") == "f32" and auto_cpu_mp("") == "f32"  # AVX-512 without bf16 dots
    assert auto_cpu_mp() == ("p=f32,c=f32,m=bf16" if {"avx512_bf16", "amx_bf16"} & set(hostinfo.cpu_flags().split())
                             else "f32")
    monkeypatch.setattr(hostinfo, "cpu_flags", lambda: AVX2)
    assert resolve_mp("auto", "gpu") == resolve_mp("auto", "cuda") == "p=f32,c=bfloat16"
    assert resolve_mp("auto", "tpu") == "p=f32,c=bfloat16"
    assert resolve_mp("p=f32,c=f16", "gpu") == "p=f32,c=f16"  # an explicit policy is never changed
    assert parse_mp(MP_FOR_PLATFORM["cpu"]).compute.__name__ == "float32"
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    cpu = TrainerConfig()
    assert TrainerConfig.__dataclass_fields__["mp"].default == "auto"
    assert cpu.mp == "f32" and cpu.mp_is_auto
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    gpu = TrainerConfig(mp="auto")
    assert gpu.mp == "p=f32,c=bfloat16" and gpu.precision.compute.__name__ == "bfloat16"
    assert TrainerConfig(mp="f32").mp == "f32" and not TrainerConfig(mp="f32").mp_is_auto
    # The estimator asks about a platform: auto follows it, an explicit policy does not.
    assert cpu.precision_for("gpu").compute.__name__ == "bfloat16"
    assert TrainerConfig(mp="f32").precision_for("gpu").compute.__name__ == "float32"
    with pytest.raises(ConfigError):
        resolve_mp("auto", "")


def test_mp_auto_fingerprints_the_resolved_policy(monkeypatch, tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))

    def config_version(platforms: str, mp: str) -> tuple[str, str]:
        monkeypatch.setenv("JAX_PLATFORMS", platforms)
        cfg = load_config(str(REPO / "configs" / "experiments" / "default.yaml"), {"trainer.mp": mp})
        return Pipeline(cfg, store).config_version("train_ckpt"), dump_config(cfg)

    from lm_pipeline import hostinfo

    monkeypatch.setattr(hostinfo, "cpu_flags", lambda: AVX2)
    cpu_auto, dumped = config_version("cpu", "auto")
    gpu_auto, gpu_dumped = config_version("cuda", "auto")
    assert cpu_auto != gpu_auto  # a CPU run and a GPU run of one `auto` config never share an address
    assert cpu_auto == config_version("cpu", "f32")[0]  # auto on an AVX2 CPU is f32: the same artifact
    monkeypatch.setattr(hostinfo, "cpu_flags", lambda: BF16_CPU)
    bf16_auto, bf16_dumped = config_version("cpu", "auto")
    assert bf16_auto == config_version("cpu", "p=f32,c=f32,m=bf16")[0] and bf16_auto not in (cpu_auto, gpu_auto)
    assert "mp: p=f32,c=f32,m=bf16" in bf16_dumped
    assert gpu_auto == config_version("cpu", "p=f32,c=bfloat16")[0]
    # The saved config (checkpoints, the Pipes child's YAML) holds the resolved policy, not "auto".
    assert "mp: f32" in dumped and "mp: p=f32,c=bfloat16" in gpu_dumped and "auto" not in dumped.split("mp:")[1][:8]
