"""The flagship example in miniature, and multiple-choice accuracy checked against transformers.

Everything is built here: a tiny Llama saved by transformers, a byte-level BPE tokenizer.json
without a chat template (a base model) whose vocabulary has ` A` and ` B` but spells ` C` and
` D` as two tokens, and ARC in the hub's layout (`ARC-Challenge/train-*`, `validation-*`,
`test-*` parquet, letter and digit labels, a README next to them).

- `scripts/base_train.py --model_name <dir> --dataset_path <arc> --fp8 --fp8_emulate
  --fp8_opt_level 2`, 20 steps on CPU: exits 0 and prints the memory plan, the plain-format
  fallback line and the accuracy at step 0 and at the end, with the scoring used (option
  log-likelihood, 1-2 tokens per option); metrics.jsonl holds both and result.json's
  val_accuracy and accuracy_scoring are the last ones.
- The step-0 accuracy equals the accuracy computed with transformers' LlamaForCausalLM on the
  original checkpoint, lm-evaluation-harness's way, from text written out by hand in the
  documented plain format (question, lettered options, `Answer:` as the context, ` D` as the
  continuation): exact, a count of argmaxes; every question's best option beats the runner-up
  by more than 1e-4 nats (asserted), ten times the logits' agreement (1e-5).
- The run, exported with scripts/export_hf.py, reloads in transformers with logits equal to our
  model's (atol/rtol 1e-5) and with the plain template as its chat template
  (apply_chat_template gives our rendering); its accuracy, computed by transformers, equals the
  run's final val_accuracy.
- scripts/eval.py on the run reproduces the run's final accuracy, naming the checkpoint and step it
  evaluated (the run's newest), and result.json's val_loss and val_bpb within 1e-5 relative; on
  the base model, step 0's. The same on a plain-text run (in-process, another batch size): its
  val_loss and val_bpb. Both are `loss_and_bpb` on the same windows: they differ only where a
  batch of other size sums fp32 in another order (~1e-7 relative), so 1e-5 has 100x to spare,
  and a different window, mask or byte count moves them by far more (one window is 1/64 of
  the tokens scored here). eval.py says which of --seq_len / --eval_tokens the run used when
  they differ.
- The run exported with --quantize fp8 and mxfp8 next to the plain export: scripts/eval.py
  --model_name on each (nanochat dequantizes the FP8 ones); each FP8 accuracy equals transformers'
  on the same export with its dequantizing route (the same weights, so the MARGIN argument above
  holds), and the plain one the run's final accuracy. All are printed, with transformers'
  accuracy of the FP8 export as vLLM computes it (activations also in e4m3, per token).
- A vocabulary where every letter is one token: every prediction is the old rule's (the largest
  of the letters' logits), exactly.
- choice_counts against a hand count on fixed logits (prompts, options of one and two tokens
  and option counts of different lengths in one batch; every batch size gives the same count).
"""

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("jinja2")

from nanochat.data import instruct  # noqa: E402
from nanochat.checkpoint import committed  # noqa: E402
from nanochat.train.evaluation import choice_counts  # noqa: E402
from tests.conftest import load_script, run_records, tiny_train_kwargs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORDS = "red green blue cat dog fish sun moon star tree rock sand water fire ice wind".split()
# Our model against transformers' on the same weights: forward passes only, with no FP8 cast and no
# optimizer step to amplify a last bit, so the two differ by fp32 sums over widths <= 128 taken in
# another order (~sqrt(n) * 2^-24 relative, ~1e-6 on logits of magnitude <= 10): 1e-5 has 10x to spare.
TOL = dict(rtol=1e-5, atol=1e-5)
MARGIN = 1e-4  # nats between the best and the second option: 10x the logits' agreement (TOL)


def arc_rows(n: int, split: str, seed: int) -> list[dict]:
    """ARC-shaped rows (id, question, choices{text,label}, answerKey); every third with digit
    labels, as a few ARC questions have. Answers lean to the first option, so there is
    something a few steps can learn."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        opts = rng.sample(WORDS, 4)
        key = 0 if rng.random() < 0.7 else rng.randrange(4)
        labels = ["1", "2", "3", "4"] if i % 3 == 0 else ["A", "B", "C", "D"]
        rows.append({"id": f"{split}_{i}", "question": f"{split} question {i}: which is {opts[key]}?",
                     "choices": {"text": opts, "label": labels}, "answerKey": labels[key]})
    return rows


def write_arc(root: Path, fmt: str = "parquet") -> Path:
    """root/ARC-Challenge/{train,validation,test}-00000-of-00001.<fmt> and a README.md."""
    arc = root / "ARC-Challenge"
    arc.mkdir(parents=True)
    for split, n, seed in (("train", 160, 0), ("validation", 24, 1), ("test", 24, 2)):
        rows = arc_rows(n, split, seed)
        path = arc / f"{split}-00000-of-00001.{fmt}"
        if fmt == "parquet":
            pq.write_table(pa.Table.from_pylist(rows), path)
        else:
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "README.md").write_text("# ai2_arc\nThe dataset card.\n")
    return root


def write_base_llama(directory: Path, merged_letters: str = "AB") -> Path:
    """A tiny Llama saved by transformers, with a byte-level BPE tokenizer.json and no chat template.
    The tokenizer is trained on text where only `merged_letters` follow a space, so ` A` is one
    token and ` D` is two (` `, `D`), as in a real vocabulary trained on a small corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [json.dumps(r) for r in arc_rows(60, "train", 9)] + ["Answer: " + " ".join(merged_letters)] * 5
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=400, show_progress=False, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)
    assert not (directory / "chat_template.jinja").exists()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, bos_token_id=0, eos_token_id=1)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def reference_accuracy(model_dir: Path, rows: list[dict], *, use_template: bool, **load) -> float:
    """Accuracy by transformers alone, lm-evaluation-harness's way: each option's whole text (the
    plain format written out here, or the directory's chat template via apply_chat_template); the
    context is the text all options share (its trailing space goes to the options), the
    continuation what follows up to the ending they share (</s>); an option's score is the sum of
    its continuation tokens' log-softmax, the prediction the best score. Asserts that the best
    option beats the runner-up by more than MARGIN in every question, so the two computations'
    difference (1e-5 on logits) cannot change a prediction and the accuracies must be equal.
    `load`: more from_pretrained arguments (an FP8 export's quantization_config)."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **load).eval()
    correct = 0
    for row in rows:
        labels = [str(x) for x in row["choices"]["label"]]
        letters = "ABCD"[:len(labels)]
        options = "\n".join(f"{letters[i]}. {t}" for i, t in enumerate(row["choices"]["text"]))
        user = f"{row['question']}\n\n{options}\n\n{instruct.MC_INSTRUCTION}"
        if use_template:
            msgs = [{"role": "user", "content": user, "shape": "multiple choice", "choices": letters}]
            texts = [tok.apply_chat_template(msgs + [{"role": "assistant", "content": L}], tokenize=False)
                     for L in letters]
        else:
            texts = [f"<s>{row['question']}\n\n{options}\nAnswer: {L}</s>" for L in letters]
        context = os.path.commonprefix(texts).rstrip(" ")
        ending = os.path.commonprefix([t[::-1] for t in texts])[::-1]
        context_ids = tok(context, add_special_tokens=False)["input_ids"]
        n_context, n_ending = len(context_ids), len(tok(ending, add_special_tokens=False)["input_ids"])
        scores = []
        for text in texts:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert ids[:n_context] == context_ids  # no token straddles the context's end
            with torch.no_grad():
                logp = model(torch.tensor([ids])).logits[0].log_softmax(-1)
            scores.append(sum(float(logp[p - 1, ids[p]]) for p in range(n_context, len(ids) - n_ending)))
        runner_up, best = sorted(scores)[-2:]
        assert best - runner_up > MARGIN, (row["id"], scores)
        correct += scores.index(best) == labels.index(row["answerKey"])
    return correct / len(rows)


@pytest.fixture(scope="module")
def flagship(tmp_path_factory):
    """The CLI run: (model dir, data dir, run dir, stdout)."""
    root = tmp_path_factory.mktemp("flagship")
    model_dir = write_base_llama(root / "Meta-Llama-3-tiny")
    data = write_arc(root / "arc")
    run = root / "run"
    cmd = [sys.executable, str(ROOT / "scripts" / "base_train.py"), "--model_name", str(model_dir),
           "--dataset_path", str(data), "--fp8", "--fp8_emulate", "--fp8_layers", "all", "--fp8_opt_level", "2",
           "--fp8_min_dim", "16",
           "--num_iterations", "20", "--eval_every", "10", "--batch_size", "8", "--seq_len", "64",
           "--lr", "3e-3", "--warmup_steps", "2", "--num_samples", "0", "--device", "cpu", "--run_dir", str(run)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=600,
                       env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")})
    assert r.returncode == 0, r.stderr[-3000:]
    return model_dir, data, run, r.stdout + r.stderr


def test_flagship_run_reports_plan_fallback_and_accuracy(flagship):
    model_dir, data, run, out = flagship
    assert "memory plan (estimate)" in out and "fits" in out
    assert "fallback: " + instruct.PLAIN_FALLBACK in out
    assert "step 0: val loss" in out and "val accuracy" in out
    records = run_records(run)
    acc = {r["step"]: r["val_accuracy"] for r in records if "val_accuracy" in r}
    assert sorted(acc) == [0, 10, 20]
    result = json.loads((run / "result.json").read_text())
    assert result["val_accuracy"] == acc[20]
    # ` A` and ` B` are one token each, ` C` and ` D` two: scored by their log-likelihood, and said so
    assert result["accuracy_scoring"] == "option log-likelihood (1-2 tokens per option)"
    assert f"val accuracy {acc[20]:.4f} (multiple choice, option log-likelihood (1-2 tokens per option))" in out
    assert instruct.PLAIN_FALLBACK in result["fallbacks"]
    assert result["planned_memory_bytes"] > 0 and result["peak_memory_bytes"] is None  # CPU: not measured
    # the run's tokenizer carries the template it trained with
    assert (run / "tokenizer" / "chat_template.jinja").read_text() == instruct.PLAIN_TEMPLATE
    # step 0 = the base checkpoint, scored by transformers from the hand-written plain format
    val = arc_rows(24, "validation", 1)
    assert acc[0] == reference_accuracy(model_dir, val, use_template=False)


def test_export_reloads_with_our_logits_template_and_accuracy(flagship, tmp_path):
    from nanochat.checkpoint import load_model, read_run

    model_dir, data, run, _ = flagship
    out = tmp_path / "exported"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "export_hf.py"), "--run_dir", str(run),
                        "--out_dir", str(out)], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")})
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "chat_template.jinja").read_text() == instruct.PLAIN_TEMPLATE
    ours, tok = load_model(read_run(run))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, tok.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours.eval()(ids), **TOL)
    # transformers renders records with the exported template exactly as we trained on them
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    row = arc_rows(24, "validation", 1)[0]
    messages = instruct.to_messages(row, "multiple choice")
    assert hf_tok.apply_chat_template(messages, tokenize=False) == tok.render_chat(messages)
    final = json.loads((run / "result.json").read_text())["val_accuracy"]
    assert reference_accuracy(out, arc_rows(24, "validation", 1), use_template=True) == final


def test_eval_script_reproduces_the_runs_accuracy(flagship):
    model_dir, data, run, out = flagship
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")}
    result = json.loads((run / "result.json").read_text())
    final = result["val_accuracy"]
    step0 = next(r["val_accuracy"] for r in run_records(run) if r.get("step") == 0)
    newest = committed(run)[-1]
    evaluated = {str(run): (f"{newest.path} (step {newest.step})", newest.step), str(model_dir): (str(model_dir), None)}
    for source, expected in ((["--run_dir", str(run)], final), (["--model_name", str(model_dir)], step0)):
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "eval.py"), *source, "--dataset_path", str(data),
                            "--device", "cpu", "--seq_len", "64"], capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        report = json.loads(r.stdout.strip().splitlines()[-1])
        assert report["val_accuracy"] == expected and report["questions"] == 24
        # the run's loss and bits per byte, at its end (the run's checkpoint) or its step 0 (the base model)
        measured = result if source[0] == "--run_dir" else next(rec for rec in run_records(run) if rec.get("step") == 0)
        for key in ("val_loss", "val_bpb"):
            assert report[key] == pytest.approx(measured[key], rel=1e-5), (source[0], key)
        # which checkpoint (and step) was evaluated, in the report and the printed lines
        assert (report["evaluated"], report["step"]) == evaluated[source[1]]
        assert f"evaluated {report['evaluated']}" in r.stdout
        assert report["accuracy_scoring"] == "option log-likelihood (1-2 tokens per option)"


def test_eval_script_reproduces_a_text_runs_loss_and_bpb(small_corpus, tmp_path, capsys, monkeypatch):
    """Plain text: eval.py's val_loss and val_bpb are result.json's (rel 1e-5, module docstring),
    with another --batch_size; without the run's --eval_tokens it says which the run used."""
    from nanochat.common import logger
    from nanochat.train.trainer import NanoChatTrainer

    run = tmp_path / "run"
    result = NanoChatTrainer(**tiny_train_kwargs(small_corpus, run, num_iterations=6, num_samples=0)).train()
    main = load_script("eval").main
    monkeypatch.setattr(logger, "handlers", [])  # eval.py logs to this test's stderr (capsys's)
    capsys.readouterr()
    common = ["--run_dir", str(run), "--dataset_path", str(small_corpus), "--device", "cpu", "--seq_len", "32"]
    assert main([*common, "--eval_tokens", "2048", "--batch_size", "3"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["tokens"] > 1000 and report["val_accuracy"] is None and report["step"] == 6
    assert report["val_loss"] == pytest.approx(result.val_loss, rel=1e-5)
    assert report["val_bpb"] == pytest.approx(result.val_bpb, rel=1e-5)
    assert main(common) == 0  # the default --eval_tokens: more windows, another figure, and a note
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1])["tokens"] > report["tokens"]
    assert "the run evaluated with --eval_tokens 2048" in err
    # without --dataset_path: the run's own corpus, the same figures
    assert main(["--run_dir", str(run), "--device", "cpu", "--seq_len", "32", "--eval_tokens", "2048"]) == 0
    own = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert own["val_bpb"] == pytest.approx(result.val_bpb, rel=1e-5) and own["tokens"] == report["tokens"]
    # a run trained on a relative path, evaluated from elsewhere: one line saying so, before any work
    monkeypatch.chdir(small_corpus.parent)
    relative = tmp_path / "relative"
    NanoChatTrainer(**tiny_train_kwargs(small_corpus.name, relative, num_iterations=2, num_samples=0)).train()
    monkeypatch.chdir(tmp_path)
    assert main(["--run_dir", str(relative), "--device", "cpu"]) == 2
    assert f"the run trained on --dataset_path {small_corpus.name}, which is not there from" in capsys.readouterr().err


def test_read_run_loads_the_checkpoint_of_a_given_step(small_corpus, tmp_path):
    """read_run(step=k) is the checkpoint file of step k (its weights, tensor for tensor), not the
    newest; a step without one is one error naming the steps saved."""
    from nanochat.checkpoint import load_model, read_run
    from nanochat.common import UsageError
    from nanochat.train.trainer import NanoChatTrainer

    run = tmp_path / "run"
    NanoChatTrainer(**tiny_train_kwargs(small_corpus, run, num_iterations=4, save_every=2, num_samples=0)).train()
    for step in (2, 4):
        model, _ = load_model(read_run(run, step=step))
        saved = torch.load(run / f"checkpoint-{step:06d}.pt", weights_only=True)["model"]
        state = model.state_dict()
        assert saved.keys() <= state.keys() and all(torch.equal(state[k], v) for k, v in saved.items())
        assert read_run(run, step=step).step == step
    newest, _ = load_model(read_run(run))
    assert torch.equal(newest.lm_head.weight, model.lm_head.weight)
    with pytest.raises(UsageError, match=r"no checkpoint of step 3 \(steps saved: 2, 4\)"):
        read_run(run, step=3)


def test_single_token_letters_score_as_their_logits(tmp_path):
    """A vocabulary with ` A` ... ` D` as single tokens: every prediction is the old rule's (the
    largest of the letters' logits after the prompt), and so is the accuracy. Exact: with
    batch_size 1 the row is the prompt alone, the very forward the old rule ran."""
    from nanochat.model.hf import load_hf_model

    model, tok = load_hf_model(write_base_llama(tmp_path / "m", merged_letters="ABCD"))
    model.eval()
    tok, _ = instruct.choose_chat_template(tok, None, records=True)
    items = instruct.choice_items(tok, [instruct.to_messages(r, "multiple choice") for r in arc_rows(24, "validation", 1)])
    assert instruct.describe_scoring(items) == "option log-likelihood (1 token per option)"
    with torch.no_grad():
        old = [int(model(torch.tensor([it.prompt]))[0, -1][[o[0] for o in it.options]].argmax()) for it in items]
    as_old = [it._replace(answer=pick) for it, pick in zip(items, old)]
    assert choice_counts(model, as_old, batch_size=1, seq_len=256, device="cpu") == (24, 24)
    old_correct = sum(pick == it.answer for it, pick in zip(items, old))
    assert choice_counts(model, items, batch_size=1, seq_len=256, device="cpu") == (old_correct, 24)
    assert 0 < old_correct < 24  # predictions that differ from question to question


def test_choice_counts_against_a_hand_count():
    """Options of one and two tokens, against log-softmax written out by hand."""
    table = torch.tensor([[0.0, 3.0, 1.0, 2.0, 0.0], [5.0, 0.0, 0.0, 4.0, 9.0], [0.0, 1.0, 1.0, 0.0, 0.0],
                          [2.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 6.0]])

    class Fixed(torch.nn.Module):
        """Logits that depend only on the current token: row = that token's id."""

        def forward(self, x):
            return table[x]

    def logp(prev: int, tok: int) -> float:  # log-softmax of row `prev` at `tok`
        return float(table[prev, tok]) - math.log(sum(math.exp(v) for v in table[prev].tolist()))

    items = [instruct.ChoiceItem([2, 0], [[1], [2], [3]], 0),     # logits 3, 1, 2 -> option 0: correct
             instruct.ChoiceItem([1], [[1], [2], [3], [4]], 3),   # 0, 0, 4, 9 -> option 3: correct (token 0's
                                                                  # 5 is larger, but token 0 is not an option)
             instruct.ChoiceItem([0, 2], [[1], [3]], 1),          # 1, 0 -> option 0: wrong
             instruct.ChoiceItem([1, 2, 1], [[0], [3]], 1),       # 5, 4 -> option 0: wrong
             instruct.ChoiceItem([2], [[1, 3], [3, 0]], 1),
             instruct.ChoiceItem([0], [[4, 0], [4, 4], [0, 4]], 1),
             instruct.ChoiceItem([2], [[1], [3, 4]], 0)]
    # two-token options: the first token's logit after the prompt (its normalizer is the same for
    # every option) plus the second's log-probability after the first. The first two questions
    # are lost by the first token alone (1 > 0; a tie) and the first by raw logits (1+4 > 0+2).
    scores = [[1.0 + logp(1, 3), 0.0 + logp(3, 0)],                    # -4.03, -0.43
              [0.0 + logp(4, 0), 0.0 + logp(4, 4), 0.0 + logp(0, 4)],  # -6.01, -0.01, -3.47
              [1.0, 0.0 + logp(3, 4)]]                                 # 1, -2.43
    assert [max(range(len(s)), key=s.__getitem__) for s in scores] == [it.answer for it in items[4:]]
    # rows of different lengths padded in one batch, options sharing a row or not: every batch
    # size gives the same count
    for batch_size in (1, 2, 3, 8):
        assert choice_counts(Fixed(), items, batch_size=batch_size, seq_len=8, device="cpu") == (5, 7)


def test_fp8_export_accuracy_next_to_the_plain_models(flagship, tmp_path):
    pytest.importorskip("compressed_tensors")
    model_dir, data, run, _ = flagship
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    accuracy = {}
    for kind, extra in (("plain", []), ("fp8", ["--quantize", "fp8"]), ("mxfp8", ["--quantize", "mxfp8"])):
        out = tmp_path / kind
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "export_hf.py"), "--run_dir", str(run),
                            "--out_dir", str(out), *extra], capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "eval.py"), "--model_name", str(out),
                            "--dataset_path", str(data), "--device", "cpu", "--seq_len", "64"],
                           capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        report = json.loads(r.stdout.strip().splitlines()[-1])
        assert report["questions"] == 24
        accuracy[kind] = report["val_accuracy"]
    fp8_dir = tmp_path / "fp8"
    assert accuracy["plain"] == json.loads((run / "result.json").read_text())["val_accuracy"]
    rows = arc_rows(24, "validation", 1)
    dense = transformers.CompressedTensorsConfig(dequantize=True)
    assert accuracy["fp8"] == reference_accuracy(fp8_dir, rows, use_template=True, quantization_config=dense)
    assert accuracy["mxfp8"] == reference_accuracy(tmp_path / "mxfp8", rows, use_template=True,
                                                   quantization_config=dense)
    served = reference_accuracy(fp8_dir, rows, use_template=True)
    print(f"ARC, CPU example: plain export {accuracy['plain']:.4f}, FP8 export {accuracy['fp8']:.4f} "
          f"(nanochat, weights dequantized), {served:.4f} (transformers, e4m3 weights and activations); "
          f"MXFP8 export {accuracy['mxfp8']:.4f} (nanochat)")
