"""How long `import hfacc` and `hfacc <command> --help` take, each in a fresh process, against what they stand on.

    python benchmarks/cli_startup.py --rounds 5
    python benchmarks/cli_startup.py --rounds 5 --baseline /tmp/main    # another checkout's hfacc beside this one

Each round starts every contender once, in a fresh Python process, in an order that alternates between rounds (the
machine's load then weighs on all of them alike); a ratio is the median of the per-round ratios. The targets:
`import hfacc` within 1.3x `import torch, transformers, accelerate` (what any run imports anyway), and `hfacc dpo
--help` within 1.3x `from transformers import TrainingArguments` (the settings `--help` prints are its fields).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
CLI = "import sys; from hfacc.cli import main; sys.exit(main({argv!r}))"  # what the `hfacc` console script runs
CONTENDERS = {
    "import torch, transformers, accelerate": "import torch, transformers, accelerate",
    "from transformers import TrainingArguments": "from transformers import TrainingArguments",
    "import hfacc": "import hfacc",
    "hfacc --version": CLI.format(argv=["--version"]),
    "hfacc dpo --help": CLI.format(argv=["dpo", "--help"]),
    "hfacc dpo --lerning_rate 1e-5 (a typo)": CLI.format(argv=["dpo", "--lerning_rate", "1e-5"]),
}
# (contender, what it is measured against, the target ratio)
TARGETS = [
    ("import hfacc", "import torch, transformers, accelerate", 1.3),
    ("hfacc dpo --help", "from transformers import TrainingArguments", 1.3),
    ("hfacc dpo --lerning_rate 1e-5 (a typo)", "from transformers import TrainingArguments", 1.3),
]


def time_process(code: str, path: Path) -> float:
    """Wall-clock seconds of ``python -c code`` run in ``path`` (python -c puts the current folder first on the path, so ``path``'s hfacc is the one imported) (its exit code aside: a
    typo exits 2 on purpose)."""
    env = {**os.environ, "PYTHONPATH": str(path), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", code], cwd=path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return time.perf_counter() - start


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", type=Path, help="another checkout of hfacc, timed beside this one")
    parser.add_argument("--quick", action="store_true", help="one round of `hfacc dpo --help` and what it stands on")
    args = parser.parse_args(argv)
    contenders, targets = CONTENDERS, TARGETS
    if args.quick:
        args.rounds, targets = 1, TARGETS[1:2]
        contenders = {name: CONTENDERS[name] for name in targets[0][:2]}
    runs = [(name, code, HERE) for name, code in contenders.items()]
    if args.baseline is not None:
        runs += [(f"{name} [baseline]", code, args.baseline) for name, code in contenders.items() if "hfacc" in name]
    times: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    for round_ in range(args.rounds):
        order = runs if round_ % 2 == 0 else runs[::-1]
        for name, code, path in order:
            times[name].append(time_process(code, path))
        print(f"round {round_ + 1}: " + ", ".join(f"{n} {times[n][-1]:.2f}s" for n, _, _ in runs), flush=True)
    print(f"\n{'contender':52s} median s   per round")
    for name, values in times.items():
        print(f"{name:52s} {statistics.median(values):8.2f}   " + " ".join(f"{v:.2f}" for v in values))
    print()
    for suffix in ("", " [baseline]") if args.baseline else ("",):
        for name, against, target in targets:
            ratios = [a / b for a, b in zip(times[name + suffix], times[against], strict=True)]
            ratio = statistics.median(ratios)
            verdict = "met" if ratio <= target else "NOT met"
            print(f"{name + suffix} / {against}: {ratio:.2f}x (target <= {target}x: {verdict})")
    return times


if __name__ == "__main__":
    main()
