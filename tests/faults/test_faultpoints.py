"""The fault point mechanism itself (fast; part of the default run)."""

from __future__ import annotations

import pytest

from lm_pipeline import faultpoints
from lm_pipeline.data.tokenizer import MAX_TRAIN_WORD, _split_long_words
from lm_pipeline.faultpoints import FaultInjected, faultpoint


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    for name in (faultpoints.ENV, faultpoints.ENV_ACTION, faultpoints.ENV_FILE, faultpoints.ENV_TRACE):
        monkeypatch.delenv(name, raising=False)
    faultpoints.reset()
    yield
    faultpoints.reset()


def test_armed_pass_fires_once_and_trace_records_every_pass(monkeypatch, tmp_path):
    trace = tmp_path / "trace"
    monkeypatch.setenv(faultpoints.ENV, "a.b:3:raise,other.point:1")
    monkeypatch.setenv(faultpoints.ENV_TRACE, str(trace))
    faultpoint("a.b")
    faultpoint("a.b")
    faultpoint("unrelated")
    with pytest.raises(FaultInjected, match="'a.b' \\(pass 3\\)"):
        faultpoint("a.b")
    faultpoint("a.b")  # pass 4: not armed
    assert trace.read_text().split() == ["a.b", "a.b", "unrelated", "a.b", "a.b"]


def test_every_pass_and_default_action(monkeypatch):
    monkeypatch.setenv(faultpoints.ENV, "x.y:*")
    monkeypatch.setenv(faultpoints.ENV_ACTION, "raise")
    for _ in range(3):
        with pytest.raises(FaultInjected):
            faultpoint("x.y")
    monkeypatch.setenv(faultpoints.ENV, "x.y:*:sleep=0")
    faultpoint("x.y")
    monkeypatch.setenv(faultpoints.ENV, "x.y:*:explode")
    with pytest.raises(ValueError, match="unknown action 'explode'"):
        faultpoint("x.y")


def test_long_words_are_cut_for_bpe_training_only():
    text = "a b " + "x" * (2 * MAX_TRAIN_WORD + 500) + " tail"
    pieces = list(_split_long_words([text, "short"]))
    assert "".join(pieces[:-1]) == text and pieces[-1] == "short"
    assert max(len(p) for p in pieces) == MAX_TRAIN_WORD


def test_passes_count_from_each_new_arming(monkeypatch):
    """A point armed anew (another $LM_PIPELINE_FAULTPOINT value) counts its passes from there,
    whatever an earlier arming in the same process counted."""
    from lm_pipeline import faultpoints as fp

    fp.reset()
    monkeypatch.setenv(fp.ENV, "demo.point:3:raise")
    fp.faultpoint("demo.point")
    fp.faultpoint("demo.point")
    with pytest.raises(fp.FaultInjected, match="pass 3"):
        fp.faultpoint("demo.point")
    fp.faultpoint("demo.point")  # pass 4: nothing
    monkeypatch.setenv(fp.ENV, "demo.point:2:raise")  # armed anew: pass 1, then 2 fires
    fp.faultpoint("demo.point")
    with pytest.raises(fp.FaultInjected, match="pass 2"):
        fp.faultpoint("demo.point")
