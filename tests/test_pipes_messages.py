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


def test_a_message_still_being_written_is_read_whole(tmp_path):
    """The child appends a message in two writes; a read between them sees half a line. The
    reader holds it back until its newline arrives (Dagster's own tail hands the half to
    ``json.loads``, which ends the reader thread and loses every later message)."""
    import json

    from dagster._utils import tail_file

    from assets.launch import tail_whole_lines

    def run(tail) -> list[str]:
        path = tmp_path / f"messages-{tail.__name__}"
        path.write_text('{"method": "report_asset_materialization", "params": {"metad')
        calls = []

        def should_stop() -> bool:  # the first time the file has nothing more: the writer finishes the line
            calls.append(1)
            if len(calls) == 1:
                with open(path, "a") as f:
                    f.write('ata": {}}}\n{"method": "closed"}\n')
                return False
            return True

        return list(tail(str(path), should_stop))

    lines = run(tail_whole_lines)
    assert [json.loads(line)["method"] for line in lines] == ["report_asset_materialization", "closed"]
    assert json.loads(lines[0])["params"] == {"metadata": {}}
    theirs = run(tail_file)  # the race this reader closes
    assert len(theirs) == 3 and not theirs[0].endswith("\n")
