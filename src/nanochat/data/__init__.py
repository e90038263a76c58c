"""Corpus sources -> token store (built once, memory-mapped) -> batches; instruction records.

    from nanochat.data.prepare import prepare_data
    from nanochat.data.batches import TokenBatches, split_stream
    prepared = prepare_data(path, tokenizer=None, vocab_size=4096, cache_root=".cache")
    train = split_stream(prepared.store, "train", seq_len=256, pad_id=pad_id)
    loader = TokenBatches(train, seq_len=256, batch_size=16, seed=0, rank=r, world_size=n)

A corpus (text files, .jsonl or parquet shards, or this Python's standard library) is listed,
checked and tokenized once into a token store that every run and every rank memory-maps, so
start-up and memory do not grow with the corpus; batches are deterministic, resumable and
rank-aware. Instruction records (prompt/completion, chat, multiple choice) go the same way with a
loss mask. Every data problem is a `DataError` raised before any model is built.

Each module imports only from the ones before it in docs/layout.md (`make test` checks there
is no cycle). Why each choice was made, with the figures: docs/data.md.
"""
