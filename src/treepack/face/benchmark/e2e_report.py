"""``treepack bench --e2e``'s report: what two runs of a workload show (:func:`summarize`),
the printed table (:func:`render_e2e`) and the plot (:func:`plot_e2e`)."""

from __future__ import annotations

import numpy as np

__all__ = ["PHASES", "RUNS", "summarize", "render_e2e", "plot_e2e"]

PHASES = ("generate", "score", "logprobs", "update")
RUNS = ("stock", "treepack")


def summarize(runs: dict, steps: int) -> dict:
    """What a workload's two runs show: where they sample alike, how far their losses are
    apart while they do, whether the reward rose, and the seconds per phase (every step but
    the first, a warm-up) with treepack's over stock's. Adds each run's totals to its entry
    of ``runs`` (``seconds``, ``training_seconds``, ``total_seconds``, the reward's first and
    last quarter) and returns the comparison."""
    stock, tree = runs["stock"]["steps"], runs["treepack"]["steps"]
    same = 0
    while same < len(stock) and stock[same]["completions"] == tree[same]["completions"]:
        same += 1
    scale = max(abs(s["loss"]) for s in stock) or 1.0
    loss_gap = max((abs(s["loss"] - t["loss"]) for s, t in zip(stock[:same], tree[:same])),
                   default=0.0)
    quarter = max(1, steps // 4)
    out = {"identical_steps": same, "steps": steps,
           "max_loss_difference": loss_gap, "max_loss_difference_relative": loss_gap / scale}
    timed = slice(1, None) if steps > 1 else slice(None)
    for name, run in runs.items():
        rewards = [s["reward"] for s in run["steps"]]
        seconds = {p: sum(s["seconds"][p] for s in run["steps"][timed]) for p in PHASES}
        run["reward_first_quarter"] = float(np.mean(rewards[:quarter]))
        run["reward_last_quarter"] = float(np.mean(rewards[-quarter:]))
        run["seconds"] = seconds
        run["training_seconds"] = seconds["logprobs"] + seconds["update"]
        run["total_seconds"] = sum(seconds.values())
    ratios = [s["token_ratio"] for s in tree if "token_ratio" in s]
    if ratios:
        out["token_ratio"] = float(np.mean(ratios))
    s, t = runs["stock"], runs["treepack"]
    out["training_ratio"] = t["training_seconds"] / s["training_seconds"]
    out["run_ratio"] = t["total_seconds"] / s["total_seconds"]
    out["stock_training_share"] = s["training_seconds"] / s["total_seconds"]
    out["phase_ratios"] = {p: t["seconds"][p] / s["seconds"][p] if s["seconds"][p] else None
                           for p in PHASES}
    # step k of both runs ran back to back: their ratio saw the same load (a burst on the
    # machine shows in one step's ratio, not in the median)
    for key, phases in (("training", ("logprobs", "update")), ("run", PHASES)):
        per_step = [sum(b["seconds"][p] for p in phases) / sum(a["seconds"][p] for p in phases)
                    for a, b in zip(stock[timed], tree[timed])]
        out[f"{key}_ratio_per_step"] = {"median": float(np.median(per_step)),
                                        "low": float(min(per_step)), "high": float(max(per_step))}
    if same < steps:  # after the runs part: the same learning, statistically
        after = {name: np.array([x["reward"] for x in run["steps"][same:]])
                 for name, run in runs.items()}
        error = (np.sqrt(sum(v.var(ddof=1) / len(v) for v in after.values()))
                 if steps - same > 1 else 0.0)
        difference = after["treepack"].mean() - after["stock"].mean()
        out["after_split"] = {
            "steps": steps - same,
            "reward_mean": {name: float(v.mean()) for name, v in after.items()},
            # the difference of the means in units of its standard error (Welch); None where
            # the steps after are too few to have one
            "reward_difference_in_standard_errors":
                float(difference / error) if error > 0 else None}
    return out


def render_e2e(result: dict) -> str:
    """The printed report of :func:`run_e2e`'s result."""
    r = result
    lines = [f"treepack bench --e2e: GRPO with generation, stock trl.GRPOTrainer vs "
             f"treepack.trl.TreepackGRPOTrainer, a random {r['model']} "
             f"({r['model_params'] / 1e6:.1f}M params), {r['dtype']}, {r['device']}",
             f"  {r['steps']} steps of {r['prompts_per_step']} prompts x {r['num_generations']} "
             f"completions, lr {r['learning_rate']:g}, beta {r['beta']:g}; the runs take their "
             "steps in turn, from one seed", ""]
    head = (f"  {'workload':<17}{'run':<10}{'reward first→last quarter':>27}"
            + "".join(f"{p:>10}" for p in PHASES) + f"{'train':>9}{'total':>9}")
    lines += ["  seconds over every step but the first (phases: generate, score, no-grad "
              "log-probs, loss + backward + optimizer):", head]
    for w in r["workloads"]:
        for name in RUNS:
            run = w["runs"][name]
            rewards = f"{run['reward_first_quarter']:.3f} → {run['reward_last_quarter']:.3f}"
            lines.append(f"  {w['workload']:<17}{name:<10}{rewards:>27}"
                         + "".join(f"{run['seconds'][p]:>10.2f}" for p in PHASES)
                         + f"{run['training_seconds']:>9.2f}{run['total_seconds']:>9.2f}")
    lines += ["", f"  {'workload':<17}{'token ratio':>12}{'train ratio':>24}{'run ratio':>24}"
              f"{'train share':>13}{'same samples':>14}{'loss gap':>10}"]

    def cell(spread):
        return f"{spread['median']:.3f} [{spread['low']:.3f}-{spread['high']:.3f}]"

    for w in r["workloads"]:
        a = w["agreement"]
        lines.append(f"  {w['workload']:<17}{a.get('token_ratio', float('nan')):>12.3f}"
                     f"{cell(a['training_ratio_per_step']):>24}"
                     f"{cell(a['run_ratio_per_step']):>24}{a['stock_training_share']:>13.2f}"
                     f"{a['identical_steps']:>8} of {a['steps']:<4}"
                     f"{a['max_loss_difference_relative']:>10.1e}")
    lines += ["  train ratio: treepack's (no-grad log-probs + update) seconds over stock's, step "
              "by step (the steps ran back to back): median [lowest-highest step];",
              "  run ratio: the same of whole steps; train share: stock's training seconds over "
              "its steps'; same samples: the leading steps whose completions",
              "  are identical in both runs; loss gap: the largest loss difference over those "
              "steps, relative to the largest loss"]
    for w in r["workloads"]:
        split = w["agreement"].get("after_split")
        if split:
            m = split["reward_mean"]
            lines.append(
                f"  {w['workload']}: from step {w['agreement']['identical_steps'] + 1} the runs "
                f"sample differently; mean reward over the {split['steps']} steps after: stock "
                f"{m['stock']:.3f}, treepack {m['treepack']:.3f} ({_in_errors(split)})")
    return "\n".join(lines)


def _in_errors(split: dict) -> str:
    z = split["reward_difference_in_standard_errors"]
    return "too few steps for a standard error" if z is None else f"{z:+.1f} standard errors"


def plot_e2e(result: dict, path: str) -> None:
    """A PNG, a row per workload: reward and loss of both runs overlaid, and the seconds per
    phase stacked per step (stock left, treepack right of each step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    works = result["workloads"]
    fig, axes = plt.subplots(len(works), 3, figsize=(14, 3.6 * len(works)), dpi=110,
                             squeeze=False)
    colors = {"stock": "#888888", "treepack": "#1c4f99"}
    phase_colors = dict(zip(PHASES, ("#f4b942", "#a0c878", "#7fb3e0", "#1c4f99")))
    for row, w in zip(axes, works):
        for name in RUNS:
            steps = w["runs"][name]["steps"]
            x = range(1, len(steps) + 1)
            style = dict(color=colors[name], lw=1.4 if name == "treepack" else 3, alpha=0.9,
                         ls="-" if name == "stock" else "--", label=name)
            row[0].plot(x, [s["reward"] for s in steps], **style)
            row[1].plot(x, [s["loss"] for s in steps], **style)
        row[0].set_title(f"{w['workload']}: reward", fontsize=9)
        row[1].set_title(f"{w['workload']}: loss", fontsize=9)
        same = w["agreement"]["identical_steps"]
        for ax in row[:2]:
            ax.set_xlabel("step")
            if same < w["agreement"]["steps"]:
                ax.axvline(same + 0.5, color="#cc4444", lw=0.8, ls=":")
            ax.legend(fontsize=7)
        ax = row[2]
        width = 0.4
        for offset, name in ((-0.2, "stock"), (0.2, "treepack")):
            steps = w["runs"][name]["steps"]
            bottom = np.zeros(len(steps))
            x = np.arange(1, len(steps) + 1) + offset
            for p in PHASES:
                values = np.array([s["seconds"][p] for s in steps])
                ax.bar(x, values, width, bottom=bottom, color=phase_colors[p],
                       label=p if name == "stock" else None,
                       hatch=None if name == "stock" else "//", edgecolor="white", lw=0)
                bottom += values
        ax.set_title(f"{w['workload']}: seconds per step, stock | treepack (hatched)", fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.suptitle(f"GRPO run, {result['model']}, {result['dtype']}, {result['device']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
