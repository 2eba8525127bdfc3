"""An extra leaf stage, declared the way a new stage of the product is (docs/architecture.md, "How to
add a stage"): ``token_stats`` reads the token cache and records, per split, its documents, its
tokens, how many distinct token ids occur and the most frequent one.

Everything about the stage is here; the table gains it with one entry
(``STAGES = (..., TOKEN_STATS)`` in ``lm_pipeline/steps/stages.py``, which
:func:`add_to_table` applies in a test).
"""

from __future__ import annotations

from typing import Any

from lm_pipeline.steps.display import Table, common
from lm_pipeline.steps.stage import Stage

COLUMNS = (("split", "string"), ("docs", "int"), ("tokens", "int"), ("distinct", "int"), ("top_id", "int"),
           ("top_count", "int"))


def split_stats(tokens, num_docs: int) -> dict[str, int]:
    """The statistics of one split's token ids."""
    import numpy as np

    counts = np.bincount(np.asarray(tokens, dtype=np.int64))
    top = int(counts.argmax())
    return {"docs": int(num_docs), "tokens": int(counts.sum()), "distinct": int((counts > 0).sum()), "top_id": top,
            "top_count": int(counts[top])}


def build(ctx, inputs) -> Any:
    cache = inputs["token_cache"]  # its upstream artifact: path and manifest

    def write(path: str):
        from lm_pipeline import atomic, fs
        from lm_pipeline.data.cache.reader import open_cache

        stats = {}
        for split in cache.manifest["summary"]["splits"]:
            c = open_cache(fs.join(cache.path, split))
            stats[split] = split_stats(c.read_tokens(0, c.num_tokens), c.num_docs)
        atomic.atomic_write_json(fs.join(path, "token_stats.json"), stats)
        return {"splits": stats}, {}

    return ctx.run(write)


def metadata(res) -> dict[str, Any]:
    rows = tuple({"split": split, **s} for split, s in res.manifest["summary"]["splits"].items())
    return {**common(res), "stats": Table(COLUMNS, rows)}


TOKEN_STATS = Stage("token_stats", 1, ("token_cache",), lambda pipe: {}, build, kind="numpy", metadata=metadata,
                    command=("token-stats", "count the documents, tokens and distinct ids of each split"),
                    description="Per split of the token cache: documents, tokens, distinct ids, the most frequent id.")


def add_to_table() -> None:
    """The one line a new stage adds to ``lm_pipeline/steps/stages.py``, applied in this process."""
    from lm_pipeline.steps import stages

    stages.STAGES = (*stages.STAGES, TOKEN_STATS)
