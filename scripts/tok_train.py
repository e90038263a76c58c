"""Train a BPE tokenizer on a corpus and save it: `python scripts/tok_train.py --tokenizer_dir DIR`.

Thin entrypoint: parse flags into TokTrainConfig (tyro), load the corpus, train, save, print the
vocabulary size, the compression on the validation split and the time. `base_train.py
--tokenizer_dir DIR` loads the result; without that flag base_train trains and caches its own.
A DIR that already holds a tokenizer is refused before training unless --overwrite, and a run's
own tokenizer/ always (its checkpoints were trained with it). Errors are one `error:` line (exit
2: bad flags or input; 1: e.g. a full disk); `--debug` adds the traceback.
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
    from nanochat.common import setup_logging
    from nanochat.data import load_corpus
    from nanochat.tokenizer import Tokenizer, check_tokenizer_dir, take_chars

    setup_logging()
    check_tokenizer_dir(cfg.tokenizer_dir, overwrite=cfg.overwrite)
    changed = [f.name for f in dataclasses.fields(FP8Fields) if getattr(cfg, f.name) != getattr(FP8Fields(), f.name)]
    if changed:
        print(f"note: {', '.join('--' + n for n in changed)} do not apply to tokenizer training "
              "(it has no matmuls); ignored")
    corpus = load_corpus(cfg.dataset_path)
    print(f"corpus: {corpus.describe()}")

    t0 = time.perf_counter()
    tok = Tokenizer.train(take_chars(corpus.train_docs, cfg.max_chars), cfg.vocab_size)
    train_s = time.perf_counter() - t0
    tok.save(cfg.tokenizer_dir, overwrite=cfg.overwrite)

    n_chars = min(cfg.max_chars, sum(len(d) for d in corpus.train_docs))
    val_bytes = sum(len(d.encode("utf-8")) for d in corpus.val_docs)
    val_tokens = sum(len(ids) for ids in tok.encode_batch(corpus.val_docs))
    print(f"tokenizer: vocab {tok.vocab_size} (asked {cfg.vocab_size}), fingerprint {tok.fingerprint}, "
          f"trained on {n_chars:,} chars in {train_s:.1f} s")
    print(f"compression on val: {val_bytes / max(val_tokens, 1):.3f} bytes/token "
          f"({val_bytes:,} bytes -> {val_tokens:,} tokens)")
    print(f"saved to {cfg.tokenizer_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
