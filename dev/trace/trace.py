#!/usr/bin/env python3
"""dev/trace/trace.py BINARY TRACE: the calls of one training step, the call edges an instrumented build wrote
(trace_hooks.c: from the second entry into lp_step_forward_backward to the exit of the lp_step_update after
it; the first step warms up), against llmpar.h's sections. Prints: functions, distinct call edges, edges that
cross sections (switches), each edge's distance in lines between the two functions' definitions in llmpar.h
(jumps over 1,000 lines, median; the pairs of sections with the most of them), the pairs of sections called
both ways, calls to a later section, and the functions that ran from the MoE and offload code."""
import bisect, re, statistics, struct, subprocess, sys

binary, trace = sys.argv[1], sys.argv[2]

# each function's name and place: nm -l on a -no-pie build
where = {}
for line in subprocess.run(["nm", "--defined-only", "-l", binary], capture_output=True, text=True).stdout.splitlines():
    m = re.match(r"([0-9a-f]+) [tTwW] (\S+)\s+(\S+):(\d+)$", line)
    if m:
        where[int(m.group(1), 16)] = (m.group(2).split(".")[0], m.group(3).split("/")[-1], int(m.group(4)))

# llmpar.h's sections: "// N. name" lines
starts, names = [], []
for n, line in enumerate(open("llmpar.h", encoding="utf-8"), 1):
    m = re.match(r"// (\d+)\. (\w+)$", line.rstrip())
    if m:
        starts.append(n)
        names.append(m.group(1) + " " + m.group(2))

def section(fn):
    name, file, line = fn
    if file != "llmpar.h":
        return file
    k = bisect.bisect_right(starts, line) - 1
    return names[k] if k >= 0 else "top"

edges, functions = set(), set()
for line in open(trace):
    caller, callee, count = line.split()
    a, b = where.get(int(caller, 16)), where.get(int(callee, 16))
    if a and b:
        edges.add((a, b))
        functions.update((a, b))
if not edges:
    sys.exit(f"trace.py: no call edges in {trace} (run at least 2 steps)")

switches = [(a, b) for a, b in edges if section(a) != section(b)]
dist = [abs(a[2] - b[2]) for a, b in edges if a[1] == b[1] == "llmpar.h" and a != b]
pairs = {}
for a, b in switches:
    pairs[(section(a), section(b))] = pairs.get((section(a), section(b)), 0) + 1
both = sorted({tuple(sorted(p)) for p in pairs if (p[1], p[0]) in pairs})
number = lambda fn: int(section(fn).split()[0])
later = [(a, b) for a, b in switches if a[1] == b[1] == "llmpar.h" and number(b) > number(a)]
print(f"one step: {len(functions)} functions, {len(edges)} distinct call edges")
print(f"section switches: {len(switches)} edges cross sections")
print(f"distance between caller and callee in llmpar.h: {sum(d > 1000 for d in dist)} edges over 1,000 lines, "
      f"median {statistics.median(dist) if dist else 0:.0f} lines, longest {max(dist) if dist else 0}")
long = {}
for a, b in edges:
    if a[1] == b[1] == "llmpar.h" and abs(a[2] - b[2]) > 1000:
        long[(section(a), section(b))] = long.get((section(a), section(b)), 0) + 1
print("jumps over 1,000 lines by sections: " + ", ".join(f"{x} -> {y} {n}" for (x, y), n in
                                                          sorted(long.items(), key=lambda kv: -kv[1])[:8]))
print("sections called both ways: " + (", ".join(f"{x} <-> {y} ({pairs[(x, y)]}+{pairs[(y, x)]})" for x, y in both) or "none"))
print(f"calls from a section to a later one: {len(later)}" +
      ("".join(f"\n  {section(a)}: {a[0]} -> {section(b)}: {b[0]}" for a, b in sorted(later, key=lambda e: e[0][2]))))
moe = sorted({fn[0] for fn in functions if "moe" in fn[0] or "offload" in fn[0] or "host_optim" in fn[0]})
print(f"MoE and offload functions that ran: {len(moe)}" + (": " + ", ".join(moe) if moe else ""))
