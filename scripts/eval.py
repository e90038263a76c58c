"""Evaluate a model on a dataset without training: validation loss, bits per byte and
multiple-choice accuracy.

    python scripts/eval.py --run_dir runs/make_train                             # a run, on its own corpus
    python scripts/eval.py --run_dir runs/arc --dataset_path data/arc            # a run, on a dataset
    python scripts/eval.py --model_name org/name --dataset_path data/arc         # a model as loaded

The validation split is the one training uses (split files: the validation files); a run is
evaluated at its newest checkpoint, named with its step in the output. The loss and bits per
byte are the run's own function on the same windows (nanochat.train.evaluation.loss_and_bpb):
with the run's --seq_len and --eval_tokens, eval.py on a finished run reproduces result.json's
val_loss and val_bpb. Accuracy picks the option whose answer tokens have the highest
log-likelihood; the records are rendered with the run's chat template, or as --chat_template
says. The last line is JSON: val_loss, val_bpb, val_accuracy, tokens, questions,
accuracy_scoring, evaluated, step. Errors are one `error:` line (exit 2: bad flags or input,
e.g. a run directory without a checkpoint; 1: e.g. a corrupt checkpoint); `--debug` adds the
traceback.
"""

import json
import sys

from nanochat.common import print0, run_main, setup_logging
from nanochat.config import EvalConfig, parse_cli


def main(argv: list[str] | None = None) -> int:
    cfg = parse_cli(EvalConfig, argv)
    return run_main(lambda: evaluate(cfg), debug=cfg.debug)


def evaluate(cfg: EvalConfig) -> int:
    from nanochat.train.evaluation import evaluate_saved  # after parsing: --help stays fast

    setup_logging()
    result = evaluate_saved(cfg)
    accuracy = (f"val accuracy {result.val_accuracy:.4f} ({result.questions} questions, "
                f"{result.accuracy_scoring})" if result.val_accuracy is not None else "no multiple-choice records")
    print0(f"evaluated {result.source}")
    print0(f"val loss {result.val_loss:.4f} | val bpb {result.val_bpb:.4f} ({result.tokens:,} tokens) | {accuracy}")
    for f in result.fallbacks:
        print0(f"fallback: {f}")
    print0(json.dumps({"val_loss": result.val_loss, "val_bpb": result.val_bpb, "val_accuracy": result.val_accuracy,
                       "tokens": result.tokens, "questions": result.questions,
                       "accuracy_scoring": result.accuracy_scoring, "evaluated": result.source, "step": result.step}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
