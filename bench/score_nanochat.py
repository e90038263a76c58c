"""karpathy/nanochat's checkpoints scored by bench/common_bpb.py, run with nanochat's Python:

    <nanochat python> bench/score_nanochat.py --checkout C --base_dir B --model_tag bench-1 \\
        --docs val.json --seq_len 256 --steps 50 100 150

Loads each step's model with the checkout's own checkpoint manager (NANOCHAT_BASE_DIR=B), tokenizes
the documents of --docs (a JSON list of strings) with its tokenizer, and prints one JSON line:
{"steps": [...], "bpb": [...]}. bench_vs_nanochat.py runs it; it needs only what nanochat's
training needed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkout", required=True)
    ap.add_argument("--base_dir", required=True)
    ap.add_argument("--model_tag", required=True)
    ap.add_argument("--docs", required=True)
    ap.add_argument("--seq_len", type=int, required=True)
    ap.add_argument("--steps", type=int, nargs="+", required=True)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    os.environ["NANOCHAT_BASE_DIR"] = args.base_dir
    sys.path.insert(0, str(Path(args.checkout).resolve()))  # its `nanochat`, not ours
    import torch
    from nanochat.checkpoint_manager import build_model

    import common_bpb  # this script's directory is on sys.path

    ckpt_dir = os.path.join(args.base_dir, "base_checkpoints", args.model_tag)
    texts = json.loads(Path(args.docs).read_text())
    rows, token_bytes, bpb = None, None, []
    for step in args.steps:
        model, tok, _ = build_model(ckpt_dir, step, torch.device(args.device), "eval")
        if rows is None:
            rows = common_bpb.document_rows([tok.encode(t) for t in texts], tok.get_bos_token_id(), args.seq_len)
            token_bytes = torch.load(os.path.join(args.base_dir, "tokenizer", "token_bytes.pt"))
        loss_fn = lambda x, y: model(x, y, loss_reduction="none").view(y.shape)  # noqa: E731
        bpb.append(common_bpb.bits_per_byte(loss_fn, *rows, token_bytes, batch_size=args.batch_size,
                                            device=args.device))
    print(json.dumps(dict(steps=args.steps, bpb=bpb)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
