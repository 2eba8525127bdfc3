"""Task files for lm-evaluation-harness written by the tests: the harness's YAML task format
over local JSON Lines data, shaped like HellaSwag (multiple choice over endings), ARC (question
and lettered choices, few-shot from a train split), LAMBADA (the last word's log-likelihood),
WikiText (rolling log-likelihood of whole pages) and a generate_until task (greedy answer up to
a newline, exact match); and requests to an ``LM`` built the way the harness builds them."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ["alpha", "beta", "gamma", "delta", "naïve", "café", "foo_bar", "42", "x", "the", "quick", "fox"]

MULTIPLE_CHOICE_METRICS = """metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""

#: task name -> the YAML body (data files are added by :func:`write_tasks`).
TASKS = {
    "tiny_hellaswag": """
output_type: multiple_choice
doc_to_text: "{{query}}"
doc_to_target: "{{label}}"
doc_to_choice: "choices"
""" + MULTIPLE_CHOICE_METRICS,
    "tiny_arc": """
output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_target: "{{choices.label.index(answerKey)}}"
doc_to_choice: "{{choices.text}}"
fewshot_split: train
""" + MULTIPLE_CHOICE_METRICS,
    "tiny_lambada": """
output_type: loglikelihood
doc_to_text: "{{text.split(' ')[:-1]|join(' ')}}"
doc_to_target: "{{' '+text.split(' ')[-1]}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
""",
    "tiny_wikitext": """
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{page}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""",
    "tiny_qa": """
output_type: generate_until
doc_to_text: "Q: {{question}}\\nA:"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n"]
  do_sample: false
  max_gen_toks: 6
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""",
}


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _docs(task: str, n: int, rng: random.Random) -> list[dict]:
    if task == "tiny_hellaswag":
        return [{"query": _sentence(rng, rng.randint(3, 9)), "choices": [" " + _sentence(rng, rng.randint(1, 6)) for _ in range(4)],
                 "label": rng.randrange(4)} for _ in range(n)]
    if task == "tiny_arc":
        return [{"question": _sentence(rng, rng.randint(3, 8)) + "?",
                 "choices": {"text": [_sentence(rng, rng.randint(1, 3)) for _ in range(4)], "label": list("ABCD")},
                 "answerKey": rng.choice("ABCD")} for _ in range(n)]
    if task == "tiny_lambada":
        return [{"text": _sentence(rng, rng.randint(4, 12))} for _ in range(n)]
    if task == "tiny_wikitext":  # one page longer than the model's window: several rolling windows
        return [{"page": _sentence(rng, 90 if i == 0 else rng.randint(5, 30))} for i in range(n)]
    return [{"question": _sentence(rng, rng.randint(2, 5)), "answer": rng.choice(WORDS)} for _ in range(n)]


def write_tasks(root: Path, n_docs: int = 6, seed: int = 0) -> Path:
    """Write every task of :data:`TASKS` (``<name>.yaml`` + ``<name>.<split>.jsonl``) under
    ``root``; returns the directory to pass as the harness's include path."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for name, body in TASKS.items():
        files = {}
        for split in ("train", "validation"):
            path = root / f"{name}.{split}.jsonl"
            path.write_text("".join(json.dumps(d) + "\n" for d in _docs(name, n_docs, rng)), encoding="utf-8")
            files[split] = str(path)
        head = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": files},
                "training_split": "train", "validation_split": "validation", "test_split": None}
        (root / f"{name}.yaml").write_text(_yaml(head) + body, encoding="utf-8")
    return root


def _yaml(head: dict) -> str:
    import yaml

    return yaml.safe_dump(head, sort_keys=False)


def bos_tokenizer(out_dir: str, vocab_size: int = 300) -> str:
    """A byte-level BPE whose post-processor starts every encoding with a BOS token ``<s>`` that
    is not its EOS (``<|endoftext|>``): the harness's prefix token is then BOS, not EOS."""
    import os

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from helpers.data import EOS, sample_texts

    bos = "<s>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(sample_texts(200) + [" ".join(WORDS)] * 20, trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS, bos], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": EOS, "bos_token": bos, "pad_token": EOS}, f)
    return out_dir


def harness_requests(kind: str, args: list[tuple]) -> list:
    """lm-evaluation-harness ``Instance`` requests of one ``kind`` (``loglikelihood``,
    ``loglikelihood_rolling``, ``generate_until``) with the given argument tuples, in order."""
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]
