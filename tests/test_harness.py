"""lm-evaluation-harness over our JAX models (``lm_pipeline.eval.harness``) against the harness's
own Hugging Face backend (``HFLM``) on the exported ``transformers`` directory of the same model.

Both score the same requests: every per-example log-likelihood within 1e-4 (relative), the same
greedy flags, the same generated text and the same metrics, on local task files shaped like
HellaSwag, ARC (2-shot, under an alias), LAMBADA, WikiText (rolling windows) and a
generate_until task. The models have a vocabulary padded beyond the tokenizer's (the export
slices it off); one tokenizer starts every encoding with a BOS that is not its EOS, so the
prefix token and the special tokens of each encoding are checked, not assumed.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from helpers.data import tiny_tokenizer
from helpers.harness_tasks import bos_tokenizer, harness_requests, write_tasks

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # the HF backend's import

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lm_pipeline.eval.harness import HarnessLM, load_harness_lm  # noqa: E402
from lm_pipeline.eval.harness_config import EvalHarnessConfig  # noqa: E402
from lm_pipeline.eval.tasks import metrics, run_tasks, task_manager  # noqa: E402
from lm_pipeline.hf import export_hf  # noqa: E402
from lm_pipeline.schema import from_dict  # noqa: E402

CASES = {"gpt2-plain": ("gpt2", "plain"), "llama-bos": ("llama", "bos")}
LL_TASKS = ["tiny_hellaswag", {"task": "tiny_arc", "num_fewshot": 2, "task_alias": "tiny_arc_2shot"}, "tiny_lambada",
            "tiny_wikitext"]


def _model(family: str):
    from test_hf import CONFIGS, make  # random weights with a vocabulary padded to 320 rows

    return make(CONFIGS[family], seed=3)


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    return write_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def manager(tasks_dir):
    return task_manager(from_dict(EvalHarnessConfig, {"include_path": [str(tasks_dir)]}))


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(our LM from the export, the HF backend on the export, the export dir)."""
    from lm_eval.models.huggingface import HFLM

    family, tok_kind = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    tok = bos_tokenizer(str(tmp / "tok")) if tok_kind == "bos" else tiny_tokenizer(str(tmp / "tok"))
    out = export_hf(_model(family), tmp / "hf", tokenizer_dir=tok)
    ours = load_harness_lm(out, batch_size=4)
    ref = HFLM(pretrained=str(out), device="cpu", batch_size=4, dtype="float32")
    return ours, ref, str(out)


def _ll_pairs(ref) -> list[tuple[str, str]]:
    long_context = " ".join(["alpha beta gamma delta"] * 30)  # beyond max_length: cut from the left
    greedy = ref.generate_until(harness_requests("generate_until", [("the quick", {"until": ["\n\n"], "max_gen_toks": 3})]))[0]
    return [("the quick", " fox"), ("", "alpha beta"), ("naïve café ", "42"), (long_context, " beta gamma"),
            ("x", " foo_bar the quick fox"), ("the quick", greedy), ("", greedy)]


def test_loglikelihoods_match_the_hf_backend(pair):
    ours, ref, _ = pair
    pairs = _ll_pairs(ref)
    got = ours.loglikelihood(harness_requests("loglikelihood", pairs))
    want = ref.loglikelihood(harness_requests("loglikelihood", pairs))
    np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], rtol=1e-4)
    assert [g[1] for g in got] == [w[1] for w in want]
    assert any(w[1] for w in want), "no greedy continuation among the requests: the flag is not checked"
    texts = [(" ".join(["gamma delta x"] * n),) for n in (1, 5, 40)]  # the last spans several windows
    np.testing.assert_allclose(ours.loglikelihood_rolling(harness_requests("loglikelihood_rolling", texts)),
                               ref.loglikelihood_rolling(harness_requests("loglikelihood_rolling", texts)), rtol=1e-4)


def _resps(results: dict, task: str) -> list[float]:
    out = []
    for sample in results["samples"][task]:
        for resp in sample["resps"]:
            value = resp[0]
            out.append(value[0] if isinstance(value, (tuple, list)) else value)
    return out


def test_tasks_give_the_hf_backends_log_likelihoods_and_metrics(pair, manager, tasks_dir):
    ours, ref, _ = pair
    cfg = from_dict(EvalHarnessConfig, {"task_spec": LL_TASKS, "include_path": [str(tasks_dir)]})
    got = run_tasks(ours, cfg, manager, log_samples=True)
    want = run_tasks(ref, cfg, manager, log_samples=True)
    assert set(got["samples"]) == {"tiny_hellaswag", "tiny_arc_2shot", "tiny_lambada", "tiny_wikitext"}
    for task in got["samples"]:
        np.testing.assert_allclose(_resps(got, task), _resps(want, task), rtol=1e-4, err_msg=task)
    assert got["n-shot"]["tiny_arc_2shot"] == 2
    ours_m, ref_m = metrics(got), metrics(want)
    assert set(ours_m) == set(ref_m) and {"lm_eval/tiny_hellaswag/acc_norm", "lm_eval/tiny_lambada/perplexity",
                                          "lm_eval/tiny_wikitext/bits_per_byte"} <= set(ours_m)
    for name, value in ours_m.items():
        assert math.isclose(value, ref_m[name], rel_tol=1e-4), (name, value, ref_m[name])


@pytest.mark.parametrize("pair", ["llama-bos"], indirect=True)  # one case: a compiled program per prompt length
def test_generate_until_gives_the_hf_backends_text(pair, manager, tasks_dir):
    ours, ref, _ = pair
    cfg = from_dict(EvalHarnessConfig, {"task_spec": ["tiny_qa"], "include_path": [str(tasks_dir)], "max_examples": 4})
    got = run_tasks(ours, cfg, manager, log_samples=True)
    want = run_tasks(ref, cfg, manager, log_samples=True)
    texts = [s["resps"][0][0] for s in got["samples"]["tiny_qa"]]
    assert texts == [s["resps"][0][0] for s in want["samples"]["tiny_qa"]]
    assert all("\n" not in t for t in texts) and any(texts)
    assert metrics(got) == metrics(want)


def test_add_bos_token_prepends_bos_as_the_hf_backend_does(tmp_path):
    from lm_eval.models.huggingface import HFLM

    out = export_hf(_model("gpt2"), tmp_path / "hf", tokenizer_dir=tiny_tokenizer(str(tmp_path / "tok")))
    pairs = [("the quick", " fox"), ("alpha", " beta gamma")]
    plain = load_harness_lm(out).loglikelihood(harness_requests("loglikelihood", pairs))
    forced = HarnessLM(*_model_and_tok(out), add_bos_token=True)
    ref = HFLM(pretrained=str(out), device="cpu", batch_size=2, dtype="float32", add_bos_token=True)
    assert forced.tok_encode("the quick")[0] == forced.prefix_token_id
    got, want = forced.loglikelihood(harness_requests("loglikelihood", pairs)), ref.loglikelihood(harness_requests("loglikelihood", pairs))
    np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], rtol=1e-4)
    assert not np.allclose([g[0] for g in got], [p[0] for p in plain], rtol=1e-4)  # BOS changed the numbers


def _model_and_tok(hf_dir: str):
    from lm_pipeline.eval.loading import load_model_from_checkpoint

    loaded = load_model_from_checkpoint(hf_dir)
    return loaded.model, loaded.tokenizer_dir

