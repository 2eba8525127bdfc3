"""Rows and blocks of the data path, each against a plain NumPy/Python reference of the documented
rule, never against the module's own output.

* ``concat`` layouts: ``row_pieces(r)`` is the span ``tokens[r * T:(r + 1) * T]``.
* :class:`GrowingCacheDataset`: when the committed tokens are an exact multiple of ``seq_len``
  no full row is dropped, and every row is the token stream's slice.
* :class:`Mixture`: every block holds each component's share, in an order of its own (not one
  block's order repeated).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.data import EOS, sample_texts, tiny_tokenizer
from tokenizers import Tokenizer

from lm_pipeline.data.cache import build_cache
from lm_pipeline.data.loader import GrowingCacheDataset
from lm_pipeline.data.mixture import Mixture
from lm_pipeline.data.packing import PackedLayout, pack_documents
from lm_pipeline.data.textshard import TextShard

# -- concat layouts: row spans -------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 3, 8])
def test_concat_row_pieces_are_the_rows_token_spans(T):
    rng = np.random.default_rng(5)
    lens = rng.integers(1, 20, size=30)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    lay = PackedLayout("concat", T, **pack_documents(offsets, T, "concat"))
    total = int(offsets[-1])
    assert lay.num_rows == total // T  # the final partial row is dropped
    stream = np.arange(total)
    for r in range(lay.num_rows):
        starts, plens = lay.row_pieces(r)
        got = np.concatenate([stream[s : s + n] for s, n in zip(starts.tolist(), plens.tolist(), strict=True)])
        np.testing.assert_array_equal(got, stream[r * T : (r + 1) * T], err_msg=f"row {r}")


# -- GrowingCacheDataset: an exact multiple of seq_len -------------------------------------------


def _token_stream(tokdir: str, shards: list[TextShard]) -> list[int]:
    """The cache's token stream, from the tokenizer alone: each document's ids, then EOS."""
    tok = Tokenizer.from_file(f"{tokdir}/tokenizer.json")
    eos = tok.token_to_id(EOS)
    return [i for s in shards for text in s.texts for i in [*tok.encode(text).ids, eos]]


def test_growing_dataset_keeps_the_last_full_row_when_tokens_divide_seq_len(tmp_path):
    tokdir = tiny_tokenizer(str(tmp_path / "tok"))
    texts = [t for t in sample_texts(40, seed=7) if t.strip()]
    shards = [TextShard(f"s{i}", tuple(texts[i::2])) for i in range(2)]
    stream = _token_stream(tokdir, shards)
    n_tok = len(stream)
    # a seq_len that divides the token count exactly (the number itself at worst), >= 2 rows if any
    T = next((t for t in range(4, 65) if n_tok % t == 0 and n_tok // t >= 2), n_tok)
    build_cache(tmp_path / "c", shards, tokdir, num_workers=1, shard_group_size=1, progress=False)
    ds = GrowingCacheDataset(tmp_path / "c", T, poll_s=0.01, stall_timeout_s=1.0)
    assert ds.complete
    rows = n_tok // T
    assert len(ds) == rows, (n_tok, T)
    assert ds.rows_ready(rows) == rows
    expect = np.asarray(stream, np.int64).reshape(rows, T)
    got = ds.get_many(np.arange(rows)).tokens
    np.testing.assert_array_equal(got, expect)
    np.testing.assert_array_equal(ds.get_many([rows - 1]).tokens[0], expect[-1])


# -- Mixture: a new permutation for every block --------------------------------------------------


def _block_counts(weights: dict[str, float], names: list[str], S: int) -> list[int]:
    """Rows of each component in a block of ``S``: the weight's share rounded down, the rest to the
    largest (Levanter's rule)."""
    total = sum(weights.values())
    counts = [int(weights[n] / total * S) for n in names]
    largest = max(range(len(names)), key=counts.__getitem__)  # the first on a tie
    counts[largest] += S - sum(counts)
    return counts


def test_mixture_blocks_each_have_their_own_permutation():
    names, weights = ["a", "b", "c"], {"a": 0.5, "b": 0.3, "c": 0.2}
    S, seed, blocks = 20, 11, 6
    mix = Mixture(names, weights, batch_size=4, block_size=S, seed=seed)
    component, draw = mix.assign(np.arange(blocks * S))
    counts = _block_counts(weights, names, S)
    for b in range(blocks):
        np.testing.assert_array_equal(np.bincount(component[b * S : (b + 1) * S], minlength=len(names)), counts)
    # a new order in every block, not one pattern repeated
    patterns = {tuple(component[b * S : (b + 1) * S].tolist()) for b in range(blocks)}
    assert len(patterns) == blocks
    # the draw of a position: how many rows of its component come before it in the run
    seen = [0] * len(names)
    ref_draw = []
    for c in component.tolist():
        ref_draw.append(seen[c])
        seen[c] += 1
    np.testing.assert_array_equal(draw, ref_draw)
