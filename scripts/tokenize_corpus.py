"""Tokenize a corpus once into its token store: `python scripts/tokenize_corpus.py --dataset_path D --tokenizer_dir T`.

Thin entrypoint: parse flags into TokenizeConfig (tyro), build the store base_train reads for the
same corpus and tokenizer (under $NANOCHAT_CACHE, default .cache/stores/), or find it built and
current, and print where it is and what it holds. Run it on a CPU node, or before torchrun, so
that training starts on a built store; a killed build continues where it stopped. `--verify`
re-reads every file of the token store (token arrays, masks, document index) against the sha256
its manifest recorded at build time (exit 1 on a difference); the corpus's own files are checked
as every start checks them, by size and modification time, not by their bytes. The name is not tokenize.py: a script's directory comes first on sys.path, and a
tokenize.py there would stand in for the standard library's module in every script. Errors are
one `error:` line (exit 2: bad flags or input; 1: a failed verification, a full disk);
`--debug` adds the traceback.
"""

import sys

from nanochat.config import TokenizeConfig, parse_cli


def main(argv: list[str] | None = None) -> int:
    cfg = parse_cli(TokenizeConfig, argv)
    from nanochat.common import run_main  # after parsing: --help stays fast

    return run_main(lambda: tokenize(cfg), debug=cfg.debug)


def tokenize(cfg: TokenizeConfig) -> int:
    from pathlib import Path

    from nanochat.common import NanoChatError, UsageError, cache_root, setup_logging
    from nanochat.data.prepare import prepare_data
    from nanochat.data.token_store import verify_store
    from nanochat.tokenizer import BPETokenizer, HFTokenizer

    setup_logging()
    tokenizer = None
    if cfg.tokenizer_dir is not None:
        d = Path(cfg.tokenizer_dir)
        if not d.is_dir():
            raise UsageError(f"--tokenizer_dir {d}: no such directory; make one with: python scripts/tok_train.py "
                             f"--tokenizer_dir {d}")
        tokenizer = HFTokenizer.load(d) if (d / "tokenizer.json").is_file() else BPETokenizer.load(d)
    prepared = prepare_data(cfg.dataset_path, tokenizer=tokenizer, vocab_size=cfg.vocab_size,
                            chat_template=cfg.chat_template, workers=cfg.workers, build=not cfg.verify,
                            cache_root=cache_root())
    store = prepared.store
    for fallback in prepared.fallbacks:
        print(f"fallback: {fallback}")
    print(f"corpus: {store.describe()}")
    print(f"store: {store.summary()}")
    split = store.manifest["split"]
    print(f"tokens: {split['train']['tokens']:,} train / {split['val']['tokens']:,} val, tokenizer "
          f"{prepared.tokenizer.fingerprint} (vocab {prepared.tokenizer.vocab_size})")
    if cfg.verify:
        problems = verify_store(store.path)
        if problems:
            raise NanoChatError(f"token store {store.path} does not verify: {'; '.join(problems)}; delete it and "
                                "run this script again (without --verify) to rebuild it")
        print(f"verified: the token store's {len(store.manifest['files'])} files match the sha256 recorded at build "
              f"time; the corpus's {len(prepared.sources.files)} files match its listing by size and modification "
              "time (their bytes are not hashed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
