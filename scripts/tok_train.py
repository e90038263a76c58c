"""Train a BPE tokenizer on a corpus and save it: `python scripts/tok_train.py --tokenizer_dir DIR`.

Thin entrypoint: parse flags into TokTrainConfig (tyro), read the first --max_chars characters of
the corpus's training split (streamed: a corpus of any size), train, save, print the vocabulary
size, the compression on (up to --max_chars characters of) the validation split and the time.
`base_train.py --tokenizer_dir DIR` loads the result (and `tokenize_corpus.py --tokenizer_dir DIR`
builds the token store with it); without that flag base_train trains and caches its own. A DIR
that already holds a tokenizer is refused before training unless --overwrite, and a run's own
tokenizer/ always (its checkpoints were trained with it). Errors are one `error:` line (exit 2:
bad flags or input; 1: e.g. a full disk); `--debug` adds the traceback.
"""

import dataclasses
import sys
import time

from nanochat.config import FP8Fields, TokTrainConfig, parse_cli


def main(argv: list[str] | None = None) -> int:
    cfg = parse_cli(TokTrainConfig, argv)
    from nanochat.common import run_main  # after parsing: --help stays fast

    return run_main(lambda: train(cfg), debug=cfg.debug)


def train(cfg: TokTrainConfig) -> int:
    from nanochat.common import format_bytes, setup_logging
    from nanochat.data.plan import plan_sources
    from nanochat.data.sources import list_sources
    from nanochat.data.split import split_texts
    from nanochat.tokenizer import BPETokenizer, check_tokenizer_dir

    setup_logging()
    check_tokenizer_dir(cfg.tokenizer_dir, overwrite=cfg.overwrite)
    changed = [f.name for f in dataclasses.fields(FP8Fields) if getattr(cfg, f.name) != getattr(FP8Fields(), f.name)]
    if changed:
        print(f"note: {', '.join('--' + n for n in changed)} do not apply to tokenizer training "
              "(it has no matmuls); ignored")
    sources = list_sources(cfg.dataset_path)
    plan = plan_sources(sources)
    print(f"corpus: {sources.name} ({sources.source}): {len(sources.files)} files, "
          f"{format_bytes(sum(f.size for f in sources.files))} ({plan.kind})")

    t0 = time.perf_counter()
    texts = split_texts(plan, cfg.max_chars)
    tok = BPETokenizer.train(texts, cfg.vocab_size)
    train_s = time.perf_counter() - t0
    tok.save(cfg.tokenizer_dir, overwrite=cfg.overwrite)

    val = split_texts(plan, cfg.max_chars, "val")
    val_bytes = sum(len(d.encode("utf-8")) for d in val)
    val_tokens = sum(len(ids) for ids in tok.encode_batch(val))
    print(f"tokenizer: vocab {tok.vocab_size} (asked {cfg.vocab_size}), fingerprint {tok.fingerprint}, "
          f"trained on {sum(len(t) for t in texts):,} chars in {train_s:.1f} s")
    print(f"compression on val: {val_bytes / max(val_tokens, 1):.3f} bytes/token "
          f"({val_bytes:,} bytes -> {val_tokens:,} tokens)")
    print(f"saved to {cfg.tokenizer_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
