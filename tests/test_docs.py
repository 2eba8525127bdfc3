"""Documentation that is generated from code must match the code."""

from pathlib import Path

from lm_pipeline.docgen import render

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_reference_is_up_to_date():
    current = (ROOT / "docs" / "configuration.md").read_text()
    assert current == render(), "docs/configuration.md is stale: run `python -m lm_pipeline.docgen > docs/configuration.md`"


def test_configuration_reference_covers_every_section():
    text = render()
    for section in ("`data`", "`data.tokenizer`", "`model (type: gpt2)`", "`model (type: llama)`", "`trainer`",
                    "`trainer.checkpointer`", "`trainer.tracker (type: wandb)`", "`optimizer`", "`store`"):
        assert f"## {section}" in text
