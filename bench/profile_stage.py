"""Where a short stage's time goes: one local net of a run, profiled, split into what trains and what does not.

    python bench/profile_stage.py                                  # the default digits run, local net 0
    python bench/profile_stage.py data=mnist data.train_subset=10000 trainer.max_epochs=2 --stage coarse
    python bench/profile_stage.py engine.loop=lightning                  # the same local net through Lightning

Prints the stage's wall time and the cumulative time of: forward + loss, backward, optimizer step, validation,
checkpoint writes, CSV logging, data loading, and the rest of Lightning's loop (the remainder of ``fit``).
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

# (label, predicate on (file, function name)) -- cumulative time of the outermost matching frames.
# Lightning's loop (engine.loop=lightning):
LIGHTNING_PARTS = [
    ("forward + loss", lambda f, n: n == "_step" and f.endswith("classifier.py")),
    ("backward", lambda f, n: n == "backward" and "torch/_tensor.py" in f),
    ("optimizer step", lambda f, n: n == "step" and "/torch/optim/" in f),
    ("validation loop", lambda f, n: n == "run" and "evaluation_loop.py" in f),
    ("checkpoint writes", lambda f, n: n == "save_checkpoint" and "trainer.py" in f),
    ("metrics/CSV logging", lambda f, n: n == "save" and "csv_logs.py" in f),
    ("data loading", lambda f, n: n == "__next__" and "dataloader.py" in f),
    ("predictions (after fit)", lambda f, n: n == "save_predictions"),
    ("fit (Lightning, total)", lambda f, n: n == "fit" and f.endswith("trainer/trainer.py")),
]
# ddcnn's plain loop (engine.loop=plain, the default on one device):
PLAIN_PARTS = [
    ("backward", lambda f, n: n == "backward" and "torch/_tensor.py" in f),
    ("optimizer step", lambda f, n: n == "step" and "/torch/optim/" in f),
    ("validation", lambda f, n: n == "_evaluate" and f.endswith("tensor_fit.py")),
    ("checkpoint + metrics.csv writes", lambda f, n: n == "save" and f.endswith("tensor_fit.py")),
    ("epoch lines / loggers", lambda f, n: n == "__call__" and f.endswith("engine/train.py")),
    ("predictions (after fit)", lambda f, n: n == "save_predictions"),
    ("fit (plain loop, total)", lambda f, n: n == "fit_tensors"),
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
    loop = meta.get("loop", "lightning")
    parts = PLAIN_PARTS if loop == "plain" else LIGHTNING_PARTS
    print(f"stage {args.stage} ({loop} loop): wall {wall:.2f} s under cProfile (meta time_s {meta['time_s']:.2f} s)")
    totals = {label: sum(v[3] for (f, _, n), v in stats.stats.items() if match(f, n)) for label, match in parts}
    if loop == "plain":
        total = totals["fit (plain loop, total)"]
        rest = total - sum(
            totals[k]
            for k in (
                "backward",
                "optimizer step",
                "validation",
                "checkpoint + metrics.csv writes",
                "epoch lines / loggers",
            )
        )
        rows = [*totals.items(), ("forward + loss, batches, rest", rest)]
    else:
        # Lightning runs forward and backward inside optimizer.step (the closure): the optimizer's share is the rest.
        totals["optimizer step"] -= totals["forward + loss"] + totals["backward"]
        loop_rest = totals["fit (Lightning, total)"] - sum(
            totals[k] for k in ("forward + loss", "backward", "optimizer step", "validation loop", "data loading")
        )
        rows = [*totals.items(), ("Lightning loop, hooks, rest", loop_rest)]
    for label, value in rows:
        print(f"  {label:32s} {value:7.2f} s  {100 * value / wall:5.1f}%")


if __name__ == "__main__":
    main()
