"""FP8 parity: train the same model with no FP8 and with each FP8 mode, over several seeds.

    OMP_NUM_THREADS=1 python scripts/fp8_parity.py            # the default config (~65 min, 1 core)
    OMP_NUM_THREADS=1 python scripts/fp8_parity.py --jobs 2   # two runs at once (~half the time)
    python scripts/fp8_parity.py --quick --seeds 1            # a seconds-long smoke run

What is compared, the targets and the default config's reasoning: scripts/parity.py and
docs/fp8_parity.md.
"""

import sys

from nanochat.common import run_main
from nanochat.config import ParityConfig, parse_cli, resolved
from parity import run_parity  # the harness, next to this script


def main(argv: list[str] | None = None) -> int:
    cfg = resolved(parse_cli(ParityConfig, argv))

    def sweep() -> int:
        run_parity(cfg)  # a failing run is recorded in parity.json and the sweep goes on
        return 0

    return run_main(sweep)  # errors of the sweep itself (the corpus, --out_dir): one line


if __name__ == "__main__":
    sys.exit(main())
