"""The training child's Pipes messages survive other threads writing to the same stdout (Ray
forwards its workers' log lines to a job's driver), as Dagster's log-tailing readers parse them."""

import io
import sys

from dagster._core.pipes.utils import extract_message_or_forward_to_file
from dagster_pipes import PipesDefaultMessageWriter

from lm_pipeline.pipes_train import line_safe_writer

MESSAGE = {"__dagster_pipes_version": "0.1", "method": "report_custom_message",
           "params": {"payload": {"type": "checkpoint", "step": 6}}}


class _Handler:
    def __init__(self):
        self.messages = []

    def handle_message(self, message):
        self.messages.append(message)


def _read(text: str) -> tuple[list, str]:
    """What a reader of the job's log (dagster-ray's, line by line) makes of ``text``."""
    handler, forwarded = _Handler(), io.StringIO()
    for line in text.split("\n"):
        if line:
            extract_message_or_forward_to_file(handler, line, forwarded)
    return handler.messages, forwarded.getvalue()


def _write_between_a_foreign_lines_parts(writer, monkeypatch) -> str:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    with writer.open({"stdio": "stdout"}) as channel:
        out.write("(TrainProcess pid=1816) checkpoint: saved step 6")  # a forwarded line, its newline not yet written
        channel.write_message(MESSAGE)
        out.write("\n")
    return out.getvalue()


def test_a_message_written_inside_a_forwarded_log_line_is_still_read(monkeypatch):
    messages, forwarded = _read(_write_between_a_foreign_lines_parts(line_safe_writer(), monkeypatch))
    assert messages == [MESSAGE]
    assert forwarded == "(TrainProcess pid=1816) checkpoint: saved step 6\n"  # the log line stays a log line


def test_dagsters_own_writer_loses_it_there(monkeypatch):
    """The failure the line-safe writer exists for (seen once in the Ray training test: the step-6
    checkpoint never became an observation)."""
    messages, forwarded = _read(_write_between_a_foreign_lines_parts(PipesDefaultMessageWriter(), monkeypatch))
    assert messages == [] and '"step": 6' in forwarded


def test_file_channels_are_dagsters_own(tmp_path):
    path = tmp_path / "messages"
    with line_safe_writer().open({"path": str(path)}) as channel:
        channel.write_message(MESSAGE)
    assert _read(path.read_text())[0] == [MESSAGE]
