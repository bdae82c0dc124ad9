#!/usr/bin/env python3
"""
Plot the train and val loss of one or several runs into one PNG, and their HellaSwag accuracy where run;
or draw a step's timeline from train_gpt --trace.

    python3 dev/plot.py out/tiny                     # -> loss.png
    python3 dev/plot.py out/a out/b -o compare.png
    python3 dev/plot.py --trace step2.json -o timeline.png

Each RUN is an output folder given to train_gpt with -o (or its main.log), whose lines are
"s:STEP trl:LOSS" (train loss after step STEP), "s:STEP tel:LOSS" (val loss at step STEP) and, with
--eval-hellaswag, "s:STEP eval:ACC" (HellaSwag's acc_norm at step STEP; llm.c's lines, all three), drawn on
a second axis at the right. A run resumed or rolled back logs some steps again; the last value of a step
counts. Needs matplotlib.

With --trace FILE (train_gpt --trace): a row per rank (rank 0 on top), its forwards (light) and backwards
(dark) as boxes holding their micro-batch's number (a chunk's other than 0 after a dot: 3.1), its blocking
communication as thin grey bars, as the pipeline papers draw a schedule; and a line per traced step with the
pipeline bubble measured (the forward-backward phase's time over the busiest stage's forward and backward
compute, less 1) beside the ideal schedule's: (p-1)/m for 1F1B and GPipe, (p-1)/(v m) interleaved, which
--print-schedule's simulator gives with unit costs; and, where plan_gpt is built in this checkout, the
planner's bubble for the same grid (the file's otherData names it; its build's cluster preset: cpu, or
dgx-h100), over the busiest stage's compute as the measured one is.
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


def read_trace(path):
    """The complete events of a --trace file, each rank's (t, p, d) from its process name, and its otherData."""
    import json
    try:
        doc = json.load(open(path))
    except (OSError, ValueError) as e:
        sys.exit(f"plot.py: error: {path}: {getattr(e, 'strerror', None) or e}")
    events = doc.get("traceEvents", []) if isinstance(doc, dict) else []
    coords = {}
    for e in events:
        m = re.fullmatch(r"rank \d+: t(\d+) p(\d+) d(\d+)", str(e.get("args", {}).get("name", "")))
        if e.get("name") == "process_name" and m:
            coords[e["pid"]] = tuple(int(x) for x in m.groups())
    spans = [e for e in events if e.get("ph") == "X"]
    if not spans or not coords:
        sys.exit(f"plot.py: error: {path}: not a train_gpt --trace timeline (no events, or no ranks named)")
    return spans, coords, doc.get("otherData", {})


def planned_bubble(other):
    """The planner's row for the traced run's grid (otherData's "plan": plan_gpt's flags for it), on the cluster
    preset of its build (cpu, or dgx-h100): (bubble ms, the busiest stage's compute ms, the command), or None
    where the file names no plan or plan_gpt is not built beside this script's checkout."""
    import shlex
    import subprocess
    binary = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "plan_gpt")
    if "plan" not in other or not os.access(binary, os.X_OK):
        return None
    cmd = [binary] + shlex.split(other["plan"]) + ["--cluster", "cpu" if other.get("build") == "cpu" else "dgx-h100"]
    out = subprocess.run(cmd, capture_output=True, text=True).stdout.splitlines()
    header = next((line for line in out if line.startswith("| t | p |")), None)
    if header is None:
        return None
    names = [c.strip() for c in header.strip("|").split("|")]
    row = [c.strip() for c in out[out.index(header) + 2].strip("|").split("|")]
    cols = dict(zip(names, row))
    return float(cols["bubble"]), float(cols["compute"]), " ".join(shlex.quote(c) for c in ["./plan_gpt"] + cmd[1:])


def plot_trace(path, out, plt):
    spans, coords, other = read_trace(path)
    compute = [e for e in spans if re.fullmatch(r"[FB]\d+", e["name"])]
    ranks = sorted(coords)
    p = len({c[1] for c in coords.values()})
    v = len({e["args"].get("chunk", 0) for e in compute}) or 1
    m = len({e["args"].get("micro", 0) for e in compute}) or 1
    t0 = min(e["ts"] for e in spans)
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(ranks) + 1.2), dpi=100)
    for row, rank in enumerate(ranks):
        y = len(ranks) - 1 - row
        for e in spans:
            if e["pid"] != rank:
                continue
            x, w = (e["ts"] - t0) / 1e3, e["dur"] / 1e3
            if e in compute:
                forward = e["name"][0] == "F"
                ax.barh(y, w, left=x, height=0.8, color="#9ecae1" if forward else "#3182bd", edgecolor="black", lw=0.4)
                chunk = e["args"].get("chunk", 0)
                ax.text(x + w / 2, y, e["name"][1:] + (f".{chunk}" if chunk else ""), ha="center", va="center", fontsize=7,
                        color="black" if forward else "white")
            elif e.get("cat") == "comm" and e["dur"] > 0:
                ax.barh(y - 0.5, w, left=x, height=0.12, color="grey")
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r} (t{coords[r][0]} p{coords[r][1]} d{coords[r][2]})" for r in reversed(ranks)], fontsize=8)
    ax.set_xlabel("ms from the timeline's start (F light, B dark, micro-batch.chunk; grey: waiting in communication)")
    ideal = (p - 1) / (v * m)
    for step in sorted({e["name"] for e in spans if re.fullmatch(r"step \d+", e["name"])}, key=lambda n: int(n.split()[1])):
        bubbles = []
        for rank in ranks:
            s = next(e for e in spans if e["pid"] == rank and e["name"] == step)
            inside = [e for e in compute if e["pid"] == rank and s["ts"] <= e["ts"] <= s["ts"] + s["dur"]]
            fb = next((e for e in spans if e["pid"] == rank and e["name"] == "forward-backward" and s["ts"] <= e["ts"] <= s["ts"] + s["dur"]), None)
            if fb and inside:
                bubbles.append((fb["dur"], sum(e["dur"] for e in inside)))
        wall, busy = max(b[0] for b in bubbles), max(b[1] for b in bubbles)
        print(f"{step}: pipeline bubble measured {100 * (wall / busy - 1):.1f}% (p={p} v={v} m={m}; forward-backward "
              f"{wall / 1e3:.2f} ms, the busiest rank computing {busy / 1e3:.2f} ms); the ideal schedule's {100 * ideal:.1f}%")
    planned = planned_bubble(other)
    if planned:
        bubble, compute, cmd = planned
        print(f"the plan for this grid: pipeline bubble {100 * bubble / compute:.1f}% ({bubble:.4g} ms over the busiest stage's "
              f"{compute:.4g} ms of compute, its cluster preset's speeds: {cmd})")
    ax.set_title(f"{os.path.basename(path)}: {len(ranks)} ranks, p={p} v={v} m={m}")
    fig.tight_layout()
    try:
        fig.savefig(out)
    except OSError as e:
        sys.exit(f"plot.py: error: {out}: {e.strerror}")
    print(f"wrote {out}")


def labels(runs):
    """Each run's folder name, or its path where two runs have the same name."""
    names = [os.path.basename(os.path.normpath(run)) for run in runs]
    return [name if names.count(name) == 1 else run for name, run in zip(names, runs)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="*", metavar="RUN", help="output folder of a run (-o), or its main.log")
    ap.add_argument("--trace", metavar="FILE", help="draw this train_gpt --trace timeline instead")
    ap.add_argument("-o", "--out", help="PNG to write [loss.png; timeline.png with --trace]")
    args = ap.parse_args()
    if bool(args.runs) == bool(args.trace):
        ap.error("give RUN folders or --trace FILE (one of the two)")
    try:
        import matplotlib
    except ImportError:
        sys.exit("plot.py: error: needs matplotlib: pip install -r dev/data/requirements.txt")
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    if args.trace:
        return plot_trace(args.trace, args.out or "timeline.png", plt)
    args.out = args.out or "loss.png"

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
