#!/usr/bin/env python3
"""
Check a timeline that `train_gpt --trace FILE` wrote, strictly, and print a PASS or FAIL line per check
(then "N passed, N failed"; the exit status is the number failed, at most 1):

  python3 dev/timeline/check.py FILE --ranks N [--pp P --micro-batches M] [--step-ms MS] [--skew-us US]

- the format: Chrome's trace-event JSON object format (a "traceEvents" list; each event a complete event
  "X" with name, cat, ts and dur in microseconds (non-negative numbers), integer pid and tid, an args
  object; or a metadata event "M" naming a process or thread, or sorting processes);
- every rank 0 .. N-1 is a process, named "rank R: tT pP dD" ("rank R: tT cpC pP dD" with context parallelism),
  with events;
- on each thread, events nest: two events are disjoint or one holds the other (begin/end pairs balanced);
- with --pp and --micro-batches (1F1B, one chunk per stage): each pipeline rank's forwards and backwards
  in 1F1B's order for its stage (stage s runs min(P - s - 1, M) forwards, then alternates, then the rest
  of the backwards);
- each step's phases (the events directly inside a "step N" event) cover at least 95% of it, on every rank;
- collectives carry the time they waited for their group's last rank (args "waited_for_peers_us"), at least
  0 and at most their own length (a call cannot end before its last member arrives) plus --skew-us, the
  ranks' clock disagreement (default 50: one host, one clock);
- with --step-ms: rank 0's "step N" events last within 5% of MS (the step line's time).
"""
import argparse
import json
import re
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--step-ms", type=float)
    ap.add_argument("--skew-us", type=float, default=50.0)
    args = ap.parse_args()
    results = []

    def check(ok, what):
        results.append(bool(ok))
        print(("PASS " if ok else "FAIL ") + what)

    try:
        doc = json.load(open(args.file))
    except (OSError, ValueError) as e:
        check(False, f"{args.file} is JSON ({e})")
        return finish(results)
    events = doc.get("traceEvents") if isinstance(doc, dict) else None
    check(isinstance(events, list) and events, "a JSON object whose traceEvents is a non-empty list")
    if not isinstance(events, list):
        return finish(results)

    def well_formed(e):
        if not isinstance(e, dict) or not isinstance(e.get("name"), str) or not e["name"]:
            return False
        if not isinstance(e.get("pid"), int) or not isinstance(e.get("tid"), int) or not isinstance(e.get("args"), dict):
            return False
        if e.get("ph") == "M":
            return e["name"] in ("process_name", "process_sort_index", "thread_name")
        number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
        return e.get("ph") == "X" and isinstance(e.get("cat"), str) and number(e.get("ts")) and number(e.get("dur"))

    bad = [e for e in events if not well_formed(e)]
    check(not bad, f"every event a complete event (X) or metadata (M) with the fields Chrome's format names ({len(bad)} not: {bad[:2]})")
    spans = [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and well_formed(e)]
    names = {e["pid"]: e["args"].get("name", "") for e in events if isinstance(e, dict) and e.get("name") == "process_name"}
    have = {e["pid"] for e in spans}
    check(sorted(names) == list(range(args.ranks)) and have == set(range(args.ranks))
          and all(re.fullmatch(rf"rank {p}: t\d+( cp\d+)? p\d+ d\d+", names[p]) for p in names),
          f"ranks 0 .. {args.ranks - 1} each a process named 'rank R: tT [cpC ]pP dD' with events ({sorted(names)}, {sorted(have)})")

    def end(e):
        return e["ts"] + e["dur"]

    threads = {}
    for e in spans:
        threads.setdefault((e["pid"], e["tid"]), []).append(e)
    crossing = []
    parent = {}
    for key, evs in threads.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in evs:
            while stack and e["ts"] >= end(stack[-1]):
                stack.pop()
            if stack and end(e) > end(stack[-1]):
                crossing.append((key, stack[-1]["name"], e["name"]))
            parent[id(e)] = stack[-1] if stack else None
            stack.append(e)
    check(not crossing, f"events nest on every thread: disjoint or one inside the other ({len(crossing)} cross: {crossing[:3]})")

    if args.pp > 1:
        wrong = []
        for pid, label in names.items():
            stage = int(re.search(r" p(\d+) ", label).group(1))
            got = [e["name"] for e in sorted((e for e in spans if e["pid"] == pid), key=lambda e: e["ts"]) if re.fullmatch(r"[FB]\d+", e["name"])]
            m, warm = args.micro_batches, min(args.pp - stage - 1, args.micro_batches)
            order = [f"F{i}" for i in range(warm)]
            for i in range(m - warm):
                order += [f"F{warm + i}", f"B{i}"]
            order += [f"B{i}" for i in range(m - warm, m)]
            steps = len(got) // (2 * m) if m else 0
            if got != order * steps or not steps:
                wrong.append((pid, got[:8], order))
        check(not wrong, f"each pipeline rank runs its forwards and backwards in 1F1B's order ({wrong[:2]})")

    waits = [e for e in spans if "waited_for_peers_us" in e["args"]]
    off = [(e["pid"], e["name"], e["args"]["waited_for_peers_us"], e["dur"]) for e in waits
           if not 0 <= e["args"]["waited_for_peers_us"] <= e["dur"] + args.skew_us]
    check((waits or args.ranks == 1) and not off, f"{len(waits)} collectives carry their wait for peers, each within [0, its length + "
          f"{args.skew_us} us] ({off[:3]})")

    short, step_ms = [], []
    for e in spans:
        if not re.fullmatch(r"step \d+", e["name"]):
            continue
        inside = sum(c["dur"] for c in spans if parent.get(id(c)) is e)
        if inside < 0.95 * e["dur"]:
            short.append((e["pid"], e["name"], round(inside / max(e["dur"], 1e-9), 3)))
        if e["pid"] == 0:
            step_ms.append(e["dur"] / 1e3)
    check(step_ms and not short, f"each step's phases cover at least 95% of it on every rank ({short[:3]})")
    if args.step_ms:
        off = [ms for ms in step_ms if abs(ms - args.step_ms) > 0.05 * args.step_ms]
        check(step_ms and not off, f"rank 0's steps last the step line's {args.step_ms} ms within 5% ({step_ms})")
    return finish(results)


def finish(results):
    print(f"{sum(results)} passed, {len(results) - sum(results)} failed")
    sys.exit(min(1, len(results) - sum(results)))


if __name__ == "__main__":
    main()
