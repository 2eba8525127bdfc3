"""A minimal in-memory shard: handy for tests, benchmarks and small programmatic corpora.

Real shards (files, URLs, Hugging Face datasets) come from :mod:`lm_pipeline.data.sources`; the
cache builder only needs ``.name``, ``.fingerprint`` and ``.iter_texts()`` and a picklable object.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class TextShard:
    """A named tuple of documents; its fingerprint is the sha256 of its name and texts."""

    name: str
    texts: tuple[str, ...]

    @property
    def fingerprint(self) -> str:
        h = hashlib.sha256(self.name.encode("utf-8"))
        for text in self.texts:
            data = text.encode("utf-8")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        return h.hexdigest()[:16]

    def iter_texts(self) -> Iterator[str]:
        yield from self.texts
