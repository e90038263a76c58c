"""Corpus sources -> token store (built once, memory-mapped) -> batches; instruct records.

Each module imports only from those listed before it (`make test` checks there is no cycle):
    instruct.py  instruction records: their shapes, rendering with a loss mask, chat templates,
                 multiple-choice items
    sources.py   the files of a corpus, one stat each, and their split roles; DataError
    read.py      a unit of work (a parquet row group, a range of .jsonl lines, a text file) and
                 the documents it holds
    plan.py      the corpus cut into units, every file checked before any work
    split.py     the train / validation rules (id hash, split files, tiny corpora); the corpus in
                 one line
    streams.py   a token stream read window by window; records packed into windows
    store.py     the token store: its files, opened, mapped and verified against its manifest
    build.py     the store built: a process pool, pieces kept across a kill, one builder at a time
    prepare.py   prepare_data: sources -> tokenizer -> token store, once
    batches.py   deterministic, resumable, rank-aware (x, y) batches from a stream
Why each choice was made, with the figures: docs/data.md.
"""
