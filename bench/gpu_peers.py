"""This trainer against maintained peers on the same card: same Llama, sequence length, tokens per
optimizer step, bf16 compute with f32 master parameters, AdamW.

Trainers (each in its own subprocess, so memory, allocators and compilation caches never
interfere; one after another, never side by side):

* ``ours``: this trainer's jitted step, exactly as ``bench/gpu_mfu.py`` builds and times it
  (:func:`gpu_mfu.bench_shape`: ``build_step_functions``, ``p=f32,c=bfloat16``, AdamW with
  clipping at 1.0, cuDNN flash attention, no gradient checkpointing, micro-batch from
  ``per_device_parallelism: auto`` with gradient accumulation to the step's tokens).
* ``torchtitan`` (pip ``torchtitan==0.3.0``, PyTorch): its own Llama 3 model
  (``Llama3Model`` from its ``_build_llama3_layers``: fused QKV, its RMSNorm, RoPE and SwiGLU)
  prepared by its own ``parallelize_llama`` (per-block ``torch.compile``; FSDP2 on a one-rank
  mesh, which is how torchtitan applies mixed precision on one GPU: bf16 parameters for
  compute, f32 master parameters and f32 gradient reduction), its ``ChunkedLossWrapper`` over
  its compiled ``CrossEntropyLoss`` (its Llama 3 default), its optimizer container
  (``default_adamw``: fused AdamW, betas 0.9/0.95, weight decay 0.1), its
  ``clip_grad_norm_`` at 1.0, its attention backend ``flex`` (the default; ``--tt-attention``
  picks ``flex_flash``/``varlen``) with its block-causal masks from positions, the SPMD backend
  it defaults to, and CUDA graphs for forward + backward as its trainer does by default. The
  loop is a copy of ``Trainer.train_step`` (one micro-batch per accumulation step) without its
  data loader, tokenizer, checkpointing and metrics; no activation checkpointing (ours runs
  without it too). Its trainer entry point was not used: it needs a tokenizer and a data set
  on disk and builds a checkpointer and metrics; what it times is the same model, step and
  optimizer. Python's automatic garbage collection is off, as in its trainer.
* ``transformers`` (the fallback peer, always runnable where PyTorch is): Hugging Face
  ``LlamaForCausalLM`` with f32 parameters, ``torch.autocast`` bf16, SDPA attention,
  ``torch.compile`` of the model, fused AdamW (betas 0.9/0.95, weight decay 0.1), gradient
  clipping at 1.0.

MaxText (JAX) is not run by this script.

Shapes (vocab 32000 for both models, untied embeddings, no biases, RMSNorm, SwiGLU, RoPE)::

    llama_350m: 24 layers, 16 heads (16 kv), width 1024, MLP 2816   (373,867,520 parameters)
    llama_1b:   16 layers, 32 heads (8 kv),  width 2048, MLP 8192   (1,104,218,112 parameters)

each at seq 2048 and 4096, ``--tokens-per-step`` (65,536 by default: 32 x 2048 or 16 x 4096)
for every trainer. Ours picks its micro-batch with its estimator; the peers start at the same
micro-batch (the whole batch when ours is not run) and a run that runs out of memory is retried
with half the micro-batch and twice the gradient accumulation, so every trainer does the same
tokens per optimizer step (``--micro-batch N`` sets it for all).

Reported per shape and trainer: tokens/s, median step time, peak device memory
(``torch.cuda.max_memory_allocated`` / JAX ``peak_bytes_in_use``, each process's own), MFU with
the same FLOPs per token for every trainer (``6N + 12·L·T·D``, PaLM style, as
``bench/gpu_mfu.py``: ``LlamaConfig.flops_per_token``) against the vendor dense bf16 peak
(``PEAK_BF16_FLOPS`` by card name) and against the measured peak (the fastest bf16 matmul of
JAX and PyTorch on the card, ``gpu_mfu.matmul_peak``, measured first in its own process). Each
peer also counts its own model's parameters and computes the FLOPs formula from its own
modules (the matmul weights of its linear layers, its layer and head counts); both are printed
next to ours (our parameters counted from the model's arrays, our FLOPs from its config), and a
peer whose counts differ from ours is flagged and left out of the ratio.

    python bench/gpu_peers.py --install-peers            # on the GPU machine
    python bench/gpu_peers.py --shapes llama_350m_s2048 --trainers ours,torchtitan
    python bench/gpu_peers.py --smoke                    # tiny shapes on CPU: checks the script

``--install-peers`` pip-installs a missing peer's pinned version (``PEER_PINS``) into the
interpreter that runs it, then runs it; without it a missing peer is reported as
``not installed``, never dropped; one that is installed but does not import with the PyTorch at
hand (torchtitan 0.3.0 on PyTorch 2.11: its ``fsdp`` module imports a name that version lacks) is
reported as ``incompatible``. ``--python NAME=PATH`` runs a trainer with another
interpreter (e.g. torchtitan from a scratch virtual environment).

The last line is ``RESULT {json}``: ``rows`` (one per shape and trainer), ``shapes`` (per shape:
parameters, FLOPs per token, best peer, ours / best peer), the device, both peaks and
``ratio`` = the smallest over the shapes of our tokens/s / the best peer's tokens/s (null when
no peer ran).

``--smoke``: tiny shapes (2 layers, width 64, seq 128, 4 sequences a step) on the CPU, in
float32 for every trainer (PyTorch's bf16 autocast on this CPU is an order of magnitude slower
than its f32, and the numbers mean nothing anyway), PyTorch trainers in eager mode unless
``--compile``. torchtitan on CPU (checked with torchtitan 0.3.0 and torch 2.13.0+cpu in a
scratch virtual environment) runs only with two substitutions this script makes there:
(1) ``torchtitan.tools.utils`` picks ``"cuda"`` as its device type when no accelerator is
present (``_get_available_device_type() or "cuda"``), so its process group asks for NCCL and
fails ("Distributed package doesn't have NCCL built in"); the script sets it to ``"cpu"``
before importing the rest of torchtitan; (2) its language-model attention backends are
``flex``, ``flex_flash`` and ``varlen`` only, and PyTorch's FlexAttention has no backward pass
on CPU ("FlexAttention does not support backward on CPU"), so on CPU the blocks use
torchtitan's own ``ScaledDotProductAttention`` (causal) instead. Its package also imports
``triton`` unconditionally (``minimal_async_ep/kernels.py``), which CPU builds of PyTorch do
not install: the scratch environment needs ``pip install triton``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _p in (str(ROOT), str(BENCH)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from common import host_info, host_line  # noqa: E402

MODELS = {  # ours: LlamaConfig fields; peers build the same shapes from these
    "llama_350m": {"hidden_dim": 1024, "num_layers": 24, "num_heads": 16, "num_kv_heads": 16,
                   "intermediate_dim": 2816, "vocab": 32000},
    "llama_1b": {"hidden_dim": 2048, "num_layers": 16, "num_heads": 32, "num_kv_heads": 8,
                 "intermediate_dim": 8192, "vocab": 32000},
}
SEQ_LENS = (2048, 4096)
SHAPES = {f"{m}_s{t}": {**spec, "seq_len": t} for m in MODELS for t in SEQ_LENS for spec in (MODELS[m],)}
SMOKE_MODEL = {"hidden_dim": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_dim": 128,
               "vocab": 512, "seq_len": 128}
SMOKE_TOKENS_PER_STEP = 4 * 128
TOKENS_PER_STEP = 65536

TRAINERS = ("ours", "torchtitan", "transformers")
PEERS = TRAINERS[1:]
PEER_PINS = {  # what --install-peers installs (torch itself if missing: the registry's default build)
    "torchtitan": ["torchtitan==0.3.0"],
    "transformers": ["transformers==5.23.0"],
}
PEER_MODULES = {"torchtitan": "torchtitan", "transformers": "transformers"}
CHILD_PREFIX = "CHILD "


# ----------------------------------------------------------------------------- children


def _emit(obj: dict) -> None:
    print(CHILD_PREFIX + json.dumps(obj, default=float), flush=True)


def _first_and_timed_steps(step, sync, spec: dict):
    """(seconds of the first step, the timed steps' seconds), or the row of a run out of memory."""
    try:
        t0 = time.perf_counter()
        step()
        sync()
        first_s = time.perf_counter() - t0
        return first_s, _time_steps(step, spec["steps"], spec["warmup"], sync)
    except Exception as e:  # noqa: BLE001
        if _is_oom(e):
            return {"status": "oom", "error": str(e)[:300]}
        raise


def _time_steps(step, steps: int, warmup: int, sync) -> list[float]:
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def _flops_from_modules(linear_weights: int, layers: int, seq: int, heads: int, head_dim: int) -> float:
    """The shared formula (``LlamaConfig.flops_per_token``), fed from a peer's own modules."""
    return float(6 * linear_weights + 12 * layers * seq * heads * head_dim)


def child_peak(spec: dict) -> dict:
    import jax
    from gpu_mfu import matmul_peak

    from lm_pipeline.train.trainer import device_peak_flops

    peaks = matmul_peak(spec["matmul"], seconds=spec["seconds"])
    d = jax.devices()[0]
    return {"status": "ok", "device": d.device_kind, "platform": d.platform, "jax": jax.__version__,
            "matmul_flops": peaks, "matmul_peak_flops": max(peaks.values()), "vendor_peak_flops": device_peak_flops()}


def child_ours(spec: dict) -> dict:
    from gpu_mfu import bench_shape

    m, b = spec["model"], spec["batch"]
    overrides = {
        "model.type": "llama", "model.hidden_dim": m["hidden_dim"], "model.num_heads": m["num_heads"],
        "model.num_kv_heads": m["num_kv_heads"], "model.intermediate_dim": m["intermediate_dim"],
        "model.num_layers": m["num_layers"], "model.seq_len": m["seq_len"], "model.gradient_checkpointing": False,
        "trainer.train_batch_size": b, "vocab": m["vocab"],
    }
    try:
        r = bench_shape(spec["shape"], overrides, spec["steps"], spec["warmup"],
                        per_device=str(spec["micro_batch"] or "auto"), mp=spec["mp"])
    except Exception as e:  # noqa: BLE001 - reported, the parent retries out-of-memory with a smaller micro-batch
        if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():
            return {"status": "oom", "error": str(e)[:300]}
        raise
    cfg = our_config(m)
    return {"status": "ok", "step_s": r["step_s"], "step_s_min": r["step_s_min"], "tokens_per_s": r["tokens_per_s"],
            "micro_batch": r["micro_batch"], "peak_bytes": r["peak_bytes_in_use"], "params": r["num_params"],
            "params_formula": r["config_params"], "flops_per_token_model": r["flops_per_token"],
            "flops_per_token_config": cfg.flops_per_token(m["vocab"]), "loss": r["loss"], "compile_s": r["compile_s"],
            "precision": spec["mp"]}


def _torch_setup(spec: dict):
    import torch

    cuda = torch.cuda.is_available() and not spec["smoke"]
    if not cuda and not spec["smoke"]:
        raise SystemExit(f"PyTorch {torch.__version__} here sees no CUDA device: install its CUDA build "
                         "(or run --smoke for the CPU check)")
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    return torch, device, cuda, sync


def _incompatible(peer: str, torch_version: str, e: ImportError) -> dict:
    """The row of a peer that is installed but does not import with this PyTorch."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        have = f"{peer} {version(peer)}"
    except PackageNotFoundError:
        have = peer
    return {"status": "incompatible",
            "error": f"{have} does not import with PyTorch {torch_version}: {e}; run it with a PyTorch it supports "
                     f"(--python {peer}=PATH, or pip install {' '.join(PEER_PINS[peer])} with its own torch)"}


def _is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def our_config(m: dict):
    """Our ``LlamaConfig`` for a shape of this script (its vocabulary is ``m["vocab"]``)."""
    from lm_pipeline.models.config import LlamaConfig

    return LlamaConfig(seq_len=m["seq_len"], hidden_dim=m["hidden_dim"], intermediate_dim=m["intermediate_dim"],
                       num_layers=m["num_layers"], num_heads=m["num_heads"], num_kv_heads=m["num_kv_heads"])


def hf_llama(m: dict):
    """The transformers peer's model for a shape: ``LlamaForCausalLM`` (f32 parameters, SDPA), on
    the current default device (``with torch.device("meta")`` builds it without memory)."""
    from transformers import LlamaConfig as HfLlamaConfig
    from transformers import LlamaForCausalLM

    cfg = HfLlamaConfig(vocab_size=m["vocab"], hidden_size=m["hidden_dim"], intermediate_size=m["intermediate_dim"],
                        num_hidden_layers=m["num_layers"], num_attention_heads=m["num_heads"],
                        num_key_value_heads=m["num_kv_heads"], max_position_embeddings=m["seq_len"],
                        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                        use_cache=False, hidden_act="silu", attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def hf_counts(model, seq_len: int) -> tuple[int, float]:
    """(parameters, FLOPs per token) of a transformers Llama, counted from its own modules."""
    import torch

    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    linear = sum(mod.weight.numel() for mod in model.modules() if isinstance(mod, torch.nn.Linear))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return params, _flops_from_modules(linear, cfg.num_hidden_layers, seq_len, cfg.num_attention_heads, head_dim)


def child_transformers(spec: dict) -> dict:
    torch, device, cuda, sync = _torch_setup(spec)
    import transformers

    m, b, mb = spec["model"], spec["batch"], spec["micro_batch"] or spec["batch"]
    t, v = m["seq_len"], m["vocab"]
    torch.manual_seed(0)
    model = hf_llama(m).to(device)  # f32 parameters (master weights)
    params, fpt = hf_counts(model, t)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    fwd = torch.compile(model) if spec["compile"] else model
    dtype = torch.bfloat16 if spec["bf16"] else torch.float32
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, v, (b, t), generator=g).to(device) for _ in range(2)]
    accum, it = b // mb, [0]
    losses = []

    def step():
        batch = batches[it[0] % 2]
        it[0] += 1
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(accum):
            x = batch[i * mb:(i + 1) * mb]
            with torch.autocast(device.type, dtype=dtype, enabled=spec["bf16"]):
                loss = fwd(input_ids=x, labels=x).loss / accum
            loss.backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        losses.append(total)

    timed = _first_and_timed_steps(step, sync, spec)
    if isinstance(timed, dict):
        return timed
    first_s, times = timed
    step_s = statistics.median(times)
    return {"status": "ok", "version": transformers.__version__, "torch": torch.__version__, "step_s": step_s,
            "step_s_min": min(times), "tokens_per_s": b * t / step_s, "micro_batch": mb,
            "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None, "params": params,
            "flops_per_token_model": fpt, "loss": float(losses[-1]), "compile_s": first_s,
            "precision": "f32 params, bf16 autocast" if spec["bf16"] else "f32",
            "settings": f"SDPA attention, {'torch.compile' if spec['compile'] else 'eager'}, fused AdamW"}


def tt_llama_config(m: dict, attention: str):
    """torchtitan's ``Llama3Model.Config`` for a shape, from its own builders (as its ``1B`` flavour
    is built, with our width, depth, heads, MLP width and vocabulary, untied, RoPE theta 10000
    without scaling). ``attention``: its backend name, or ``"sdpa"`` for its
    ``ScaledDotProductAttention`` (causal; used on CPU, see the module docstring)."""
    from torchtitan.models import llama3 as tt_llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention

    d, n, v = m["hidden_dim"], m["num_heads"], m["vocab"]
    mc = tt_llama3.Llama3Model.Config(
        dim=d, vocab_size=v,
        tok_embeddings=Embedding.Config(num_embeddings=v, embedding_dim=d, param_init=tt_llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=d, param_init=tt_llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=d, out_features=v, param_init=tt_llama3._output_linear_init(d)),
        layers=tt_llama3._build_llama3_layers(
            n_layers=m["num_layers"], dim=d, n_heads=n, n_kv_heads=m["num_kv_heads"], hidden_dim=m["intermediate_dim"],
            rope=ComplexRoPE.Config(dim=d // n, max_seq_len=m["seq_len"], theta=10000.0), fuse_qkv=True,
            attn_backend="flex" if attention == "sdpa" else attention),
    )
    if attention == "sdpa":
        for layer in mc.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return mc


def child_torchtitan(spec: dict) -> dict:
    torch, device, cuda, sync = _torch_setup(spec)
    for k, val in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(spec["port"])}.items():
        os.environ.setdefault(k, val)
    import torchtitan.tools.utils as tt_utils

    if not cuda:  # torchtitan falls back to "cuda" without an accelerator (see the module docstring)
        tt_utils.device_type, tt_utils.device_module = "cpu", torch.cpu
    from importlib.metadata import version

    try:
        from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
        from torchtitan.components.optimizer import default_adamw
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.config.configs import CommConfig
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.distributed.spmd_types import annotate_input_spmd_types
        from torchtitan.models import llama3 as tt_llama3
        from torchtitan.protocols.model_spec import ModelSpec
        from torchtitan.trainer import Trainer
    except ImportError as e:  # e.g. torchtitan 0.3.0 on PyTorch 2.11: a name its fsdp module needs is missing
        return _incompatible("torchtitan", torch.__version__, e)

    m, b, mb = spec["model"], spec["batch"], spec["micro_batch"] or spec["batch"]
    t, v, d, n = m["seq_len"], m["vocab"], m["hidden_dim"], m["num_heads"]
    workdir = tempfile.mkdtemp(prefix="gpu_peers_tt_")
    world = dist_utils.init_distributed(CommConfig(trace_buf_size=0), base_folder=workdir)
    parallelism = ParallelismConfig()
    pdims = ParallelDims.from_config(parallelism, world)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    attention = spec["tt_attention"] if cuda else "sdpa"
    mc = tt_llama_config(m, attention)
    compile_cfg = CompileConfig(enable=spec["compile"])
    training = TrainingConfig(local_batch_size=mb, global_batch_size=b, seq_len=t,
                              mixed_precision_param="bfloat16" if spec["bf16"] else "float32",
                              disable_cuda_graphs=not (cuda and spec["tt_cuda_graphs"]))
    trainer_cfg = Trainer.Config(
        model_spec=ModelSpec(name="llama3", flavor="gpu_peers", model=mc, parallelize_fn=tt_llama3.parallelize_llama,
                             pipelining_fn=None, post_optimizer_build_fn=None, state_dict_adapter=None),
        training=training, parallelism=parallelism, compile=compile_cfg)
    mc.update_from_config(config=trainer_cfg)
    with torch.device("meta"):
        model = mc.build()
    params = sum(p.numel() for p in model.parameters())
    linear = sum(mod.weight.numel() for mod in model.modules() if isinstance(mod, torch.nn.Linear))
    fpt = _flops_from_modules(linear, len(mc.layers), t, n, d // n)
    _, own_fpt = mc.get_nparams_and_flops(model, t)
    model = tt_llama3.parallelize_llama(model, parallel_dims=pdims, training=training, parallelism=parallelism,
                                        compile_config=compile_cfg, ac_config=None, dump_folder=workdir)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=v)).build(
        compile_config=compile_cfg)
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    opt = default_adamw(lr=3e-4).build(model_parts=[model])
    context = dist_utils.get_spmd_context(parallel_dims=pdims)
    gc_handler = tt_utils.GarbageCollection(gc_freq=training.gc_freq)  # its trainer's: automatic GC off

    def fwd_bwd(inputs, labels, gvt, extra):
        with context():
            pred = model(inputs, **extra)
            loss, _ = loss_fn(pred, labels, gvt, positions=extra["positions"])
            del pred
            loss.backward()
        return loss

    if not training.disable_cuda_graphs:
        from torchtitan.distributed.cudagraph import wrap_with_cuda_graph

        fwd_bwd = wrap_with_cuda_graph(fwd_bwd)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, v, (b, t + 1), generator=g) for _ in range(2)]
    accum, it, losses = b // mb, [0], []
    gvt = torch.tensor(b * t, device=device)

    def step():
        batch = batches[it[0] % 2]
        it[0] += 1
        opt.zero_grad(set_to_none=training.disable_cuda_graphs)
        total = None
        for i in range(accum):
            rows = batch[i * mb:(i + 1) * mb].to(device)
            inputs, labels = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
            extra = {"positions": torch.arange(t, device=device).repeat(mb, 1)}
            if attention != "sdpa":
                extra["attention_masks"] = model.get_attention_masks(positions=extra["positions"])
            inputs, labels, extra = annotate_input_spmd_types(pdims, inputs, labels, extra)
            loss = fwd_bwd(inputs, labels, gvt, extra).detach()
            total = loss.clone() if total is None else total + loss
        dist_utils.clip_grad_norm_([p for p in model.parameters()], 1.0, foreach=True)
        opt.step()
        losses.append(total)
        gc_handler.run(it[0])

    timed = _first_and_timed_steps(step, sync, spec)
    if isinstance(timed, dict):
        return timed
    first_s, times = timed
    step_s = statistics.median(times)
    return {"status": "ok", "version": version("torchtitan"), "torch": torch.__version__, "step_s": step_s,
            "step_s_min": min(times), "tokens_per_s": b * t / step_s, "micro_batch": mb,
            "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None, "params": params,
            "flops_per_token_model": fpt, "flops_per_token_own": float(own_fpt), "loss": float(losses[-1]),
            "compile_s": first_s,
            "precision": "FSDP2 mixed precision: bf16 params for compute, f32 master and reduction" if spec["bf16"]
            else "f32",
            "settings": f"attention {attention}, {'per-block torch.compile' if spec['compile'] else 'eager'}, "
                        f"CUDA graphs {'on' if not training.disable_cuda_graphs else 'off'}, chunked loss, fused AdamW"}


CHILDREN = {"peak": child_peak, "ours": child_ours, "torchtitan": child_torchtitan, "transformers": child_transformers}


def child_main(kind: str, spec: dict) -> None:
    if kind in PEER_MODULES:
        import importlib.util

        if importlib.util.find_spec(PEER_MODULES[kind]) is None or importlib.util.find_spec("torch") is None:
            missing = "torch" if importlib.util.find_spec("torch") is None else PEER_MODULES[kind]
            _emit({"status": "not installed", "error": f"No module named {missing!r} in {sys.executable}"})
            return
    _emit(CHILDREN[kind](spec))


# ----------------------------------------------------------------------------- parent


def run_child(kind: str, spec: dict, python: str, timeout: float) -> dict:
    env = dict(os.environ)
    if spec.get("smoke"):
        env.setdefault("JAX_PLATFORMS", "cpu")
    cmd = [python, str(Path(__file__).resolve()), "--child", kind, "--spec", json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired:
        return {"status": "error", "error": f"timed out after {timeout:.0f} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith(CHILD_PREFIX):
            out = json.loads(line[len(CHILD_PREFIX):])
            out["wall_s"] = time.perf_counter() - t0
            return out
    tail = (p.stderr or p.stdout).strip().splitlines()[-12:]
    return {"status": "error", "error": f"exit {p.returncode}: " + " | ".join(tail)[-1500:]}


def pip_install(python: str, packages: list[str]) -> str:
    p = subprocess.run([python, "-m", "pip", "install", *packages], capture_output=True, text=True)
    return "ok" if p.returncode == 0 else "pip failed: " + " | ".join(p.stderr.strip().splitlines()[-5:])


def run_trainer(kind: str, spec: dict, python: str, timeout: float, install: bool, log) -> dict:
    """One trainer on one shape, retried with half the micro-batch while it runs out of memory."""
    spec = dict(spec)
    installed_now = False
    while True:
        r = run_child(kind, spec, python, timeout)
        if r["status"] == "not installed" and install and not installed_now:
            pins = list(PEER_PINS[kind])
            if "torch" in r["error"].split("'")[1:2]:
                pins.insert(0, "torch")
            log(f"  installing {' '.join(pins)} into {python} ...")
            how = pip_install(python, pins)
            installed_now = True
            if how != "ok":
                return {"status": "not installed", "error": how}
            continue
        if r["status"] != "oom":
            return r
        current = spec["micro_batch"] or (r.get("micro_batch") or spec["batch"])
        if current <= 1:
            return {"status": "error", "error": "out of memory at micro-batch 1: " + r.get("error", "")}
        spec["micro_batch"] = current // 2
        log(f"  {kind}: out of memory at micro-batch {current}; retrying at {spec['micro_batch']}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {', '.join(SHAPES)}")
    p.add_argument("--trainers", default=",".join(TRAINERS), help="comma-separated, from " + ", ".join(TRAINERS))
    p.add_argument("--tokens-per-step", type=int, default=TOKENS_PER_STEP,
                   help="tokens per optimizer step, the same for every trainer (batch = this / seq)")
    p.add_argument("--micro-batch", type=int, default=0,
                   help="sequences per micro-batch for every trainer (0: ours picks with its estimator, "
                        "the peers start at ours' choice, or the whole batch when ours is not run; "
                        "every trainer halves it on out-of-memory)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the first (compiling) one")
    p.add_argument("--matmul", type=int, default=8192, help="side of the square bf16 matmul that measures the peak")
    p.add_argument("--tt-attention", default="flex", choices=("flex", "flex_flash", "varlen"),
                   help="torchtitan's attention backend on GPU (default: its default, flex)")
    p.add_argument("--tt-cuda-graphs", type=int, default=1, help="torchtitan: CUDA graphs for forward+backward (its default: 1)")
    p.add_argument("--compile", action="store_true", help="with --smoke: torch.compile the PyTorch trainers too")
    p.add_argument("--install-peers", action="store_true",
                   help="pip-install a missing peer's pinned version (PEER_PINS) into the interpreter that runs it")
    p.add_argument("--python", action="append", default=[], metavar="NAME=PATH",
                   help="run trainer NAME with this interpreter (default: this one)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per trainer process")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU in float32: checks the script only")
    args = p.parse_args(argv)
    if args.child:
        child_main(args.child, json.loads(args.spec))
        return

    def log(msg: str) -> None:
        print(msg, flush=True)

    pythons = {name: sys.executable for name in TRAINERS}
    for item in args.python:
        name, sep, path = item.partition("=")
        if not sep or name not in TRAINERS:
            p.error(f"--python {item!r}: expected NAME=PATH with NAME in {', '.join(TRAINERS)}")
        pythons[name] = path
    asked = [x.strip() for x in args.trainers.split(",") if x.strip()]
    for x in asked:
        if x not in TRAINERS:
            p.error(f"unknown trainer {x!r}; choose from {', '.join(TRAINERS)}")
    trainers = [x for x in TRAINERS if x in asked]  # ours first: the peers start at its micro-batch
    if args.smoke:
        shapes = {"smoke": dict(SMOKE_MODEL)}
        args.tokens_per_step = SMOKE_TOKENS_PER_STEP
        args.steps, args.warmup, args.matmul = min(args.steps, 3), 1, 256
    else:
        names = [s.strip() for s in args.shapes.split(",") if s.strip()]
        for s in names:
            if s not in SHAPES:
                p.error(f"unknown shape {s!r}; choose from {', '.join(SHAPES)}")
        shapes = {s: SHAPES[s] for s in names}
    bf16 = not args.smoke
    compile_ = args.compile or not args.smoke

    peak = run_child("peak", {"matmul": args.matmul, "seconds": 0.2 if args.smoke else 2.0, "smoke": args.smoke},
                     sys.executable, args.timeout)
    if peak["status"] != "ok":
        raise SystemExit(f"measuring the matmul peak failed: {peak.get('error')}")
    vendor, measured = peak["vendor_peak_flops"], peak["matmul_peak_flops"]
    log(f"device: {peak['device']} ({peak['platform']}); bf16 {args.matmul}^3 matmul: "
        + ", ".join(f"{k} {x / 1e12:.1f}" for k, x in peak["matmul_flops"].items())
        + f" TFLOP/s; measured peak {measured / 1e12:.1f}"
        + (f"; vendor dense bf16 peak {vendor / 1e12:.0f} TFLOP/s" if vendor else "; vendor peak unknown for this card"))
    host = host_info(gpu=peak["device"] if peak["platform"] == "gpu" else None)
    log(host_line(host))
    log("precision: " + ("bf16 compute, f32 master parameters" if bf16 else "float32 (CPU smoke run)")
        + f"; {args.tokens_per_step:,} tokens per optimizer step for every trainer")

    rows, summaries, peer_status = [], {}, {}
    port = 29500 + os.getpid() % 1000
    for shape, model in shapes.items():
        seq = model["seq_len"]
        if args.tokens_per_step % seq:
            p.error(f"--tokens-per-step {args.tokens_per_step} is not a multiple of seq {seq}")
        batch = args.tokens_per_step // seq
        cfg = our_config(model)
        fpt = cfg.flops_per_token(model["vocab"])
        params = cfg.num_params(model["vocab"])
        log(f"\n{shape}: {model['num_layers']} x {model['hidden_dim']}, {model['num_heads']}/{model['num_kv_heads']} "
            f"heads, MLP {model['intermediate_dim']}, vocab {model['vocab']}, seq {seq}, batch {batch}; "
            f"{params:,} parameters, {fpt / 1e9:.3f} GFLOP/token")
        shape_rows, start_mb = [], args.micro_batch or None
        for kind in trainers:
            port += 1
            spec = {"shape": shape, "model": model, "batch": batch, "micro_batch": start_mb,
                    "steps": args.steps, "warmup": args.warmup, "smoke": args.smoke, "bf16": bf16,
                    "compile": compile_, "mp": "p=f32,c=bfloat16" if bf16 else "p=f32,c=f32",
                    "tt_attention": args.tt_attention, "tt_cuda_graphs": bool(args.tt_cuda_graphs), "port": port}
            r = run_trainer(kind, spec, pythons[kind], args.timeout, args.install_peers and kind != "ours", log)
            row = {"shape": shape, "trainer": kind, "seq_len": seq, "batch": batch, **r}
            if kind == "ours" and r["status"] == "ok" and not args.micro_batch:
                start_mb = r["micro_batch"]  # the peers start where our estimator landed
            if kind != "ours" and peer_status.get(kind, "ok") == "ok":
                peer_status[kind] = r["status"]  # "ok" only when it ran on every shape
            if r["status"] == "ok":
                row["flops_per_token"] = fpt
                row["achieved_flops"] = fpt * r["tokens_per_s"]
                row["mfu_vendor"] = row["achieved_flops"] / vendor if vendor else None
                row["mfu_measured"] = row["achieved_flops"] / measured
                row["params_match"] = r["params"] == params
                row["flops_match"] = abs(r["flops_per_token_model"] - fpt) <= 1e-9 * fpt
                mem = r.get("peak_bytes")
                log(f"  {kind:<12} step {r['step_s'] * 1e3:9.1f} ms  {r['tokens_per_s']:>11,.0f} tok/s  "
                    f"MFU {100 * row['mfu_measured']:5.1f}% of measured"
                    + (f", {100 * row['mfu_vendor']:5.1f}% of vendor" if vendor else "")
                    + (f"  peak memory {mem / 2**30:.1f} GiB" if mem else "  peak memory n/a")
                    + f"  micro-batch {r['micro_batch']}  "
                    + (f"compile {r['compile_s']:.1f} s" if kind == "ours" else f"first step {r['compile_s']:.1f} s"))
                log(f"  {'':<12} parameters {r['params']:,} (ours {params:,}: "
                    f"{'equal' if row['params_match'] else 'DIFFERENT'}); FLOPs/token from its modules "
                    f"{r['flops_per_token_model'] / 1e9:.4f} G (ours {fpt / 1e9:.4f} G: "
                    f"{'equal' if row['flops_match'] else 'DIFFERENT'})"
                    + (f"; its own formula {r['flops_per_token_own'] / 1e9:.4f} G" if "flops_per_token_own" in r else ""))
            else:
                log(f"  {kind:<12} {r['status']}: {r.get('error', '')}")
            shape_rows.append(row)
        rows += shape_rows
        ours = next((r for r in shape_rows if r["trainer"] == "ours" and r["status"] == "ok"), None)
        peers = [r for r in shape_rows if r["trainer"] != "ours" and r["status"] == "ok"
                 and r["params_match"] and r["flops_match"]]
        best = max(peers, key=lambda r: r["tokens_per_s"]) if peers else None
        ratio = ours["tokens_per_s"] / best["tokens_per_s"] if ours and best else None
        summaries[shape] = {"params": params, "flops_per_token": fpt, "batch": batch, "seq_len": seq,
                            "best_peer": best["trainer"] if best else None, "ratio": ratio}
        if ratio is not None:
            log(f"  ours / {best['trainer']} (the fastest comparable peer): {ratio:.3f}")
    ratios = [s["ratio"] for s in summaries.values() if s["ratio"] is not None]
    print("RESULT " + json.dumps({
        "ratio": min(ratios) if ratios else None, "device": peak["device"], "platform": peak["platform"],
        "smoke": args.smoke, "precision": "bf16 compute, f32 master parameters" if bf16 else "float32 (CPU smoke)",
        "tokens_per_step": args.tokens_per_step, "jax": peak["jax"], "vendor_peak_flops": vendor,
        "matmul_peak_flops": measured, "matmul_flops": peak["matmul_flops"], "peers": peer_status,
        "shapes": summaries, "rows": rows, **host,
    }, default=float))


if __name__ == "__main__":
    main()
