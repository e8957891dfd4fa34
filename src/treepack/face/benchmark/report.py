"""What the benchmarks print and draw: the ``treepack bench`` table, its plot, and the one-line
rows of the single-path benchmarks."""

from __future__ import annotations

import torch

from treepack.face.benchmark.steps import STEPS

UNCERTAIN = "*"  # marks a ratio whose spread over the rounds crosses 1


def print_paths(results: dict, device: torch.device, what: str) -> None:
    """Print the device line and one ``seconds / peak MB`` row per path of a side-by-side
    benchmark (``results``: name -> :func:`measure`'s result)."""
    import platform

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    print(f"device: {where}; torch {torch.__version__}; {what}")
    width = max(len(name) for name in results) + 2
    print(f"{'path':<{width}}{'seconds':>10}{'peak MB':>10}")
    for name, m in results.items():
        print(f"{name:<{width}}{m.seconds:>10.3f}{m.peak_bytes / 2**20:>10.0f}")


def ratio_cell(work: dict, key: str) -> str:
    """``0.218 [0.209-0.230]``: a ratio of :func:`compare_step`'s result, median [lowest-highest
    round], then :data:`UNCERTAIN` where that range crosses 1 (else a space); ``-`` where the
    result has no such ratio."""
    if key not in work:
        return "- "
    low, high = work[f"{key}_spread"]
    mark = UNCERTAIN if work[f"{key}_uncertain"] else " "
    return f"{work[key]:.3f} [{low:.3f}-{high:.3f}]{mark}"


def uncertain_note(works: list[dict]) -> list[str]:
    """The footnote to :data:`UNCERTAIN`, where a ratio in ``works`` carries it."""
    if not any(w.get(f"{k}_uncertain") for w in works for k in ("tree_vs_padded",
                                                                 "tree_vs_padding_free")):
        return []
    return [f"  {UNCERTAIN} the rounds disagree on which step is faster (a busy machine?): "
            "rerun on a quieter one, or with more --repeats"]


def render(result: dict) -> str:
    """The ``treepack bench`` report of :func:`run_bench`'s result, as printed."""
    r = result
    steps = [s for s in STEPS if s in r["workloads"][0]["steps"]]
    lines = [
        f"treepack bench: one training step (forward, mean NLL over every prediction, "
        f"backward) of a random {r['model']} ({r['model_params'] / 1e6:.1f}M params), "
        f"{r['dtype']}, {r['device']}, backend={r['backend']}",
    ]
    lines += [f"  {s:<13}{STEPS[s]}" for s in steps]
    lines += ["", f"  step time (s), lower is better: the median of {r['repeats']} rounds after "
              "a warm-up, each round running every step once, interleaved;",
              "  tree / baseline: the median of the per-round ratios [lowest-highest round], "
              f"{UNCERTAIN} where that range crosses 1:"]
    head = (f"  {'workload':<12}{'tokens':>8}{'rows':>8}{'ratio':>7}"
            + "".join(f"{s.replace('_', '-'):>13}" for s in steps)
            + f"{'tree / padded':>23}{'tree / padding-free':>23}{'FLOP-ratio limit':>18}")
    lines.append(head)
    for w in r["workloads"]:
        lines.append(
            f"  {w['workload']:<12}{w['original_tokens']:>8,}{w['packed_rows']:>8,}"
            f"{w['token_ratio']:>7.3f}"
            + "".join(f"{w['steps'][s]['seconds']:>13.2f}" for s in steps)
            + f"{ratio_cell(w, 'tree_vs_padded'):>23}"
            + f"{ratio_cell(w, 'tree_vs_padding_free'):>23}"
            + f"{w['flop_ratio_limit']:>17.3f}")
    lines += uncertain_note(r["workloads"])
    lines += ["", "  peak memory (MB):"]
    lines.append(f"  {'workload':<12}" + "".join(f"{s.replace('_', '-'):>13}" for s in steps))
    for w in r["workloads"]:
        lines.append(f"  {w['workload']:<12}"
                     + "".join(f"{w['steps'][s]['peak_mb']:>13.0f}" for s in steps))
    loss = max(x["loss_rel_error"] for w in r["workloads"] for x in w["steps"].values())
    grad = max(x["grad_max_rel_error"] for w in r["workloads"] for x in w["steps"].values())
    lines += ["", f"  equivalence against the padded step: loss rel. error {loss:.1e}, largest "
              f"gradient rel. error {grad:.1e} ({r['dtype']})"]
    for w in r["workloads"]:
        lines.append(f"  {w['workload']}: {w['description']}")
    lines += [
        "",
        "  Claw-R1 token-ratio scenarios (n_steps branches of branch_len tokens off one "
        "prefix_len prompt):",
        f"  {'n_steps':>9}{'prefix':>8}{'branch':>8}{'measured':>10}{'published':>11}",
    ]
    for c in r["claw_r1"]:
        lines.append(f"  {c['n_steps']:>9}{c['prefix_len']:>8}{c['branch_len']:>8}"
                     f"{c['measured']:>10.3f}{'~' + format(c['published'], '.2f'):>11}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """A PNG: per workload, the tree step's time against both baselines (median, with the
    range over rounds as error bars) beside the FLOP-ratio limit; and Claw-R1's token-ratio
    scenarios measured beside their published values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    works = result["workloads"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120,
                                   gridspec_kw={"width_ratios": [3, 2]})
    x = range(len(works))
    series = [("tree_vs_padded", "tree / padded", "#1c4f99"),
              ("tree_vs_padding_free", "tree / padding-free", "#6aa84f"),
              ("flop_ratio_limit", "FLOP-ratio limit", "#bbbbbb")]
    width = 0.8 / len(series)
    top = 1.0
    for i, (key, label, color) in enumerate(series):
        values = [w.get(key, float("nan")) for w in works]
        spreads = [w.get(f"{key}_spread", [v, v]) for w, v in zip(works, values)]
        below = [v - low for v, (low, _) in zip(values, spreads)]
        above = [high - v for v, (_, high) in zip(values, spreads)]
        bars = ax1.bar([j + (i - 1) * width for j in x], values, width, label=label, color=color,
                       yerr=[below, above], capsize=2, error_kw=dict(lw=0.8))
        for b, v, (_, high) in zip(bars, values, spreads):
            ax1.text(b.get_x() + b.get_width() / 2, high, f"{v:.2f}", ha="center", va="bottom",
                     fontsize=7)
        top = max([top, *(high for _, high in spreads if high == high)])
    ax1.axhline(1.0, color="black", lw=0.8)
    ax1.set_ylim(0, top * 1.15)
    ax1.set_xticks(list(x), [w["workload"].replace("_", " ") for w in works])
    ax1.set_ylabel("step time ratio (lower is better)")
    ax1.set_title(f"one training step, {result['model']}, {result['device']}", fontsize=9)
    ax1.legend(fontsize=7, loc="upper left")
    claw = result["claw_r1"]
    labels = [f"{c['n_steps']} x {c['branch_len']}\non {c['prefix_len']}" for c in claw]
    cx = range(len(labels))
    ax2.bar([i - 0.2 for i in cx], [c["measured"] for c in claw], 0.4,
            label="treepack, measured", color="#3b7dd8")
    ax2.bar([i + 0.2 for i in cx], [c["published"] for c in claw], 0.4,
            label="Claw-R1 docs (approximate)", color="#bbbbbb")
    ax2.set_xticks(list(cx), labels, fontsize=8)
    ax2.set_xlabel("branches x branch tokens on a shared prompt of N tokens", fontsize=8)
    ax2.set_ylabel("packed rows / original tokens (lower is better)", fontsize=8)
    ax2.set_title("token ratio on Claw-R1's scenarios", fontsize=9)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
