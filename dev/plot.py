#!/usr/bin/env python3
"""
Plot the train and val loss of one or several runs into one PNG, and their HellaSwag accuracy where run.

    python3 dev/plot.py out/tiny                     # -> loss.png
    python3 dev/plot.py out/a out/b -o compare.png

Each RUN is an output folder given to train_gpt with -o (or its main.log), whose lines are
"s:STEP trl:LOSS" (train loss after step STEP), "s:STEP tel:LOSS" (val loss at step STEP) and, with
--eval-hellaswag, "s:STEP eval:ACC" (HellaSwag's acc_norm at step STEP; llm.c's lines, all three), drawn on
a second axis at the right. A run resumed or rolled back logs some steps again; the last value of a step
counts. Needs matplotlib.
"""
import argparse
import os
import re
import sys

LINE = re.compile(r"s:(\d+) (trl|tel|eval):(\S+)")


def read_log(path):
    """{"trl": {step: loss}, "tel": {step: loss}, "eval": {step: accuracy}} from a main.log."""
    losses = {"trl": {}, "tel": {}, "eval": {}}
    with open(path) as f:
        for line in f:
            m = LINE.match(line)
            if m:
                losses[m.group(2)][int(m.group(1))] = float(m.group(3))
    return losses


def labels(runs):
    """Each run's folder name, or its path where two runs have the same name."""
    names = [os.path.basename(os.path.normpath(run)) for run in runs]
    return [name if names.count(name) == 1 else run for name, run in zip(names, runs)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="RUN", help="output folder of a run (-o), or its main.log")
    ap.add_argument("-o", "--out", default="loss.png", help="PNG to write [loss.png]")
    args = ap.parse_args()
    try:
        import matplotlib
    except ImportError:
        sys.exit("plot.py: error: needs matplotlib: pip install -r dev/data/requirements.txt")
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    runs, logs = [], []
    for run in args.runs:
        path = run if os.path.isfile(run) else os.path.join(run, "main.log")
        runs.append(os.path.dirname(path) or ".")
        try:
            losses = read_log(path)
        except OSError as e:
            sys.exit(f"plot.py: error: {path}: {e.strerror} (was the run given -o {run}?)")
        if not losses["trl"] and not losses["tel"]:
            sys.exit(f"plot.py: error: {path}: no loss lines (s:STEP trl:LOSS or tel:LOSS)")
        logs.append(losses)

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    acc = ax.twinx() if any(losses["eval"] for losses in logs) else None  # accuracy has its own scale, 0 .. 1
    for k, (label, losses) in enumerate(zip(labels(runs), logs)):
        color = f"C{k % 10}"
        styles = (("trl", "train", dict(lw=1, alpha=0.45)), ("tel", "val", dict(lw=1.5, marker="o", ms=3)))
        for key, what, style in styles:
            if losses[key]:
                steps = sorted(losses[key])
                ax.plot(steps, [losses[key][s] for s in steps], color=color, label=f"{label} {what}", **style)
        if losses["eval"]:
            steps = sorted(losses["eval"])
            acc.plot(steps, [losses["eval"][s] for s in steps], color=color, ls="--", marker="s", ms=3,
                     label=f"{label} HellaSwag")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    handles, names = ax.get_legend_handles_labels()
    if acc:
        acc.set_ylabel("HellaSwag acc_norm")
        more = acc.get_legend_handles_labels()
        handles, names = handles + more[0], names + more[1]
    ax.legend(handles, names)
    fig.tight_layout()
    try:
        fig.savefig(args.out)
    except OSError as e:
        sys.exit(f"plot.py: error: {args.out}: {e.strerror}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
