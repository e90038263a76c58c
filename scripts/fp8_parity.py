"""FP8 parity: train the same model with no FP8 and with each FP8 mode, over several seeds.

    OMP_NUM_THREADS=1 python scripts/fp8_parity.py            # the default config (~65 min, 1 core)
    OMP_NUM_THREADS=1 python scripts/fp8_parity.py --jobs 2   # two runs at once (~half the time)
    python scripts/fp8_parity.py --quick --seeds 1            # a seconds-long smoke run

What is compared, the targets and the default config's reasoning: scripts/parity.py and
docs/fp8_parity.md. A run that fails is recorded in parity.json and the sweep goes on; the
exit status is then 1, with one `error:` line after the report naming the failed runs.
"""

import sys

from nanochat.common import NanoChatError, run_main
from nanochat.config import ParityConfig, parse_cli, resolved
from parity import run_parity  # the harness, next to this script


def main(argv: list[str] | None = None) -> int:
    cfg = resolved(parse_cli(ParityConfig, argv))

    def sweep() -> int:
        runs = [(seed, mode, r) for seed, modes in run_parity(cfg)["runs"].items() for mode, r in modes.items()]
        failed = [f"seed {seed} {mode} ({r['error'].splitlines()[0][:200]})"
                  for seed, mode, r in runs if r.get("error")]
        if failed:
            raise NanoChatError(f"{len(failed)} of {len(runs)} runs failed: {'; '.join(failed[:3])}"
                                + (" ..." if len(failed) > 3 else "") + f"; the errors are in {cfg.out_dir}/"
                                "parity.json, the tracebacks above (with --jobs > 1: in each run's train.log)")
        return 0

    return run_main(sweep, debug=cfg.debug)  # errors of the sweep itself (the corpus, --out_dir): one line


if __name__ == "__main__":
    sys.exit(main())
