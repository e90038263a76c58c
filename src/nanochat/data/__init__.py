"""Corpus sources -> token store (built once, memory-mapped) -> batches; instruct records."""
