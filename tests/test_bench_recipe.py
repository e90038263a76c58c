"""bench/bench_recipe.py, each group's recipe rate against it scaled, on a `--quick` run (d2, 6
steps, factor 2: the recipe's run and one run per group).

Checked against: nanochat.optim.recipe.recipe_rates for d2's width and the quick batch (the rates
printed and recorded, to the last bit); each run's recorded settings (bench_run.json): the group
scaled by its factor, every other group at the recipe's; each group's best factor and gap
recomputed from those runs' own final val bpb (to 1e-12). The figures say nothing about the
rates (6 steps): that is the default run's job. Bad flags: one line.
"""

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import bench_recipe as br  # noqa: E402  (a benchmark, outside the package)

from nanochat.optim.recipe import recipe_rates  # noqa: E402


@pytest.fixture(scope="module")
def quick_run(small_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_recipe")
    argv = ["--quick", "--no_compile", "--dataset_path", str(small_corpus), "--out_dir", str(out / "runs"),
            "--device", "cpu", "--out", str(out / "figures.json")]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = br.main(argv)
    return out, rc, printed.getvalue()


def test_every_group_is_scaled_alone_and_the_best_is_recomputed_from_the_runs(quick_run):
    out, rc, printed = quick_run
    assert rc == 0, printed
    data = json.loads((out / "figures.json").read_text())
    want = recipe_rates(width=128, tokens_per_step=4 * 32, lr=3e-3)  # d2, QUICK's 4 x 32
    assert data["rates"] == want.as_dict()

    def saved(label):
        return json.loads((out / "runs" / f"muon-lr{data['rates']['matrix'] * (2 if label == 'matrix-x2' else 1):g}-"
                                             f"{label}" / "seed-1" / "bench_run.json").read_text())

    base = saved("recipe")
    assert (base["settings"]["embedding_lr"], base["settings"]["head_lr"]) == (want.embedding, want.head)
    for group, field in br.GROUPS.items():
        run = saved(f"{group}-x2")
        for g, f in br.GROUPS.items():
            assert run["settings"][f] == want.for_role(g) * (2 if g == group else 1)
        tried = {"1": base["record"]["val_bpb"], "2": run["record"]["val_bpb"]}
        figures = data["groups"][group]
        assert figures["val_bpb"] == tried
        top = min(tried, key=tried.get)
        assert figures["best_factor"] == float(top)
        assert figures["recipe_gap_pct"] == pytest.approx(100 * (tried["1"] - tried[top]) / tried[top], abs=1e-12)
    assert data["holds"] == all(g["recipe_gap_pct"] <= 0.3 for g in data["groups"].values())
    assert "the recipe holds here" in printed or "the recipe does not hold here" in printed


@pytest.mark.parametrize("flags, fragment", [
    (["--groups", "bias"], "--groups: unknown bias"),
    (["--factors", "1"], "--factors must be positive and not 1"),
])
def test_bad_flags_are_one_line_errors(flags, fragment, capsys):
    with pytest.raises(SystemExit) as e:
        br.main(flags)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1
