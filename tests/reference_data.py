"""The in-memory data path: the reference the token store is tested against, token for token.

    corpus = load_corpus(path)                            # split as the store splits it
    tokens = tokenize_docs(tokenizer, corpus.train_docs)  # = a text store's train stream
    tokens, mask, starts = tokenize_records(tokenizer, corpus.train_records, with_starts=True)
    tokens, mask, packing = pack_records(tokens, mask, starts, seq_len, pad_id)

`load_corpus` and `tokenize_docs` are scripts/bench_data.py's, the baseline that benchmark
measures the store against; the records' tokenization and packing, which only tests need, are
here. A run never reads its data this way: holding a corpus as Python strings and its tokens as
one tensor per process is what the memory-mapped store avoids (BENCHMARKS.md §9). The
split, the document ids and the record rendering are the store's own (nanochat.data.split,
nanochat.data.read, nanochat.data.instruct).
"""

import numpy as np
import torch

from nanochat.data import instruct
from nanochat.data.sources import DataError
from nanochat.data.streams import Packing, pack_layout
from nanochat.tokenizer import Tokenizer
from tests.conftest import load_script

bench_data = load_script("bench_data")
Corpus, load_corpus, tokenize_docs = bench_data.Corpus, bench_data.load_corpus, bench_data.tokenize_docs


def tokenize_records(tokenizer: Tokenizer, records: list[list[dict[str, str]]], *, ids: list[str] | None = None,
                     with_starts: bool = False):
    """tokens [n_tokens] int32 and loss_mask [n_tokens] bool of instruction records, one after the
    other: each record as `nanochat.data.instruct.render` makes it (ours: `<|bos|><|user_start|>...`;
    a Hugging Face tokenizer: its chat template), loss_mask True exactly on the assistant tokens.
    With `with_starts`, also starts [n_records] int64: where each record begins (for
    `pack_records`). `ids` (e.g. `corpus.train_ids`) name records in errors."""
    try:
        instruct.check_tokenizer(tokenizer)
    except ValueError as e:
        raise DataError(str(e)) from None
    tokens: list[int] = []
    mask: list[bool] = []
    starts: list[int] = []
    for k, messages in enumerate(records):
        try:
            rec_ids, rec_mask = instruct.render(tokenizer, messages)
        except ValueError as e:  # e.g. a chat template that is not prefix-stable, or raises
            where = ids[k] if ids is not None else f"record {k}"
            raise DataError(f"{where}: {e}") from None
        starts.append(len(tokens))
        tokens += rec_ids
        mask += rec_mask
    out = (torch.tensor(tokens, dtype=torch.int32), torch.tensor(mask, dtype=torch.bool))
    return (*out, torch.tensor(starts, dtype=torch.int64)) if with_starts else out


def pack_records(tokens: torch.Tensor, loss_mask: torch.Tensor, starts: torch.Tensor, seq_len: int,
                 pad_id: int) -> tuple[torch.Tensor, torch.Tensor, Packing]:
    """Lay records out so that each lies inside one window of `TokenBatches` / `val_batches`
    (`nanochat.data.streams.pack_layout`: the rules), in memory; the positions skipped hold `pad_id`
    with loss_mask False (never scored; the model sees them as context, like the other records
    in a window). Returns tokens, loss_mask, Packing. A store's streams are packed the same way
    without a copy (`TokenStream.packed`)."""
    st = starts.numpy().astype(np.int64)
    out_start, info = pack_layout(st, len(tokens), seq_len)
    if len(st) == 0:
        return tokens, loss_mask, info
    lengths = np.diff(np.append(st, len(tokens)))
    # every source position j of record i moves by out_start[i] - starts[i]
    dest = torch.from_numpy(np.arange(len(tokens)) + np.repeat(out_start - st, lengths))
    packed = torch.full((info.tokens,), pad_id, dtype=tokens.dtype)
    packed_mask = torch.zeros(info.tokens, dtype=torch.bool)
    packed[dest], packed_mask[dest] = tokens, loss_mask
    return packed, packed_mask, info
