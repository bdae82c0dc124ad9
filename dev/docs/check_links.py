#!/usr/bin/env python3
"""Check the relative links of README.md, dev/docs/*.md and dev/*/README.md: every `](target)` names an existing file and,
with a #fragment, a heading of that file (GitHub's anchors: lower case, punctuation dropped, spaces to
hyphens). Run from anywhere: python3 dev/docs/check_links.py. Prints each broken link; exit 1 if any."""
import glob, os, re, sys

root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

def anchors(path):
    out, fence = set(), False
    for line in open(path, encoding="utf-8"):
        if line.startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"#+ (.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out

bad = 0
files = [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "dev/docs/*.md")) + glob.glob(os.path.join(root, "dev/*/README.md")))
for md in files:
    text = re.sub(r"```.*?```", "", open(md, encoding="utf-8").read(), flags=re.S)  # not inside code blocks
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http:, mailto: ...
        path, _, frag = target.partition("#")
        full = os.path.normpath(os.path.join(os.path.dirname(md), path)) if path else md
        rel = os.path.relpath(md, root)
        if not os.path.exists(full):
            print(f"{rel}: {target}: no such file"); bad += 1
        elif frag and full.endswith(".md") and frag not in anchors(full):
            print(f"{rel}: {target}: no heading #{frag}"); bad += 1
print(f"{len(files)} files checked, {bad} broken links")
sys.exit(1 if bad else 0)
