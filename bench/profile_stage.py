"""Where a short stage's time goes: one stage of a run, profiled, split into what trains and what does not.

    python bench/profile_stage.py                                  # the default digits run, local net 0
    python bench/profile_stage.py data=mnist data.train_subset=10000 trainer.max_epochs=2 --stage coarse

Prints the stage's wall time and the cumulative time of: the network's set-up and warm-up, backward, optimizer step,
validation, checkpoint writes, progress/loggers, predictions, and the rest of ddcnn's loop (forward + loss, batches,
Fabric's wrappers: the remainder of ``fit_batches``).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import config, quiet  # noqa: E402

# (label, predicate on (file, function name)) -- cumulative time of the outermost matching frames of ddcnn's loop.
PARTS = [
    ("set-up on the device + warm-up", lambda f, n: n in ("setup", "warm_up") and f.endswith("engine/loop.py")),
    ("backward", lambda f, n: n == "backward" and "torch/_tensor.py" in f),
    ("optimizer step", lambda f, n: n == "step" and "/torch/optim/" in f),
    ("validation", lambda f, n: n == "evaluate" and f.endswith("engine/loop.py")),
    ("checkpoint + metrics.csv writes", lambda f, n: n == "save" and f.endswith("engine/loop.py")),
    ("progress / loggers", lambda f, n: n in ("epoch", "steps", "close") and f.endswith("engine/loggers.py")),
    ("predictions (after fit)", lambda f, n: n == "save_predictions"),
    ("fit (the loop, total)", lambda f, n: n == "fit_batches"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", default="local", choices=["local", "coarse", "global"])
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    quiet()
    from ddcnn import registry
    from ddcnn.context import build_context

    with tempfile.TemporaryDirectory() as tmp:
        cfg = config(["trainer.enable_progress_bar=false", *args.overrides], Path(tmp))
        ctx = build_context(cfg, tmp)
        if args.stage == "coarse":
            for i in range(ctx.decomposition.num_subdomains):
                registry.run("local", ctx, "cpu", subdomain=i)
        kwargs = {"subdomain": 0} if args.stage == "local" else {}
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        meta = registry.run(args.stage, ctx, "cpu", **kwargs)
        profile.disable()
        wall = time.perf_counter() - start
    stats = pstats.Stats(profile)
    print(f"stage {args.stage}: wall {wall:.2f} s under cProfile (meta time_s {meta['time_s']:.2f} s)")
    totals = {label: sum(v[3] for (f, _, n), v in stats.stats.items() if match(f, n)) for label, match in PARTS}
    inside = [k for k in totals if k not in ("predictions (after fit)", "fit (the loop, total)")]
    rest = totals["fit (the loop, total)"] - sum(totals[k] for k in inside)
    rows = [*totals.items(), ("forward + loss, batches, Fabric, rest", rest)]
    for label, value in rows:
        print(f"  {label:32s} {value:7.2f} s  {100 * value / wall:5.1f}%")


if __name__ == "__main__":
    main()
