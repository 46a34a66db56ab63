"""Apply a `git diff` patch to the working directory, in plain Python (the device image may lack
`patch` and the device copy has no git repository).

    python3 bench/variants/apply_patch.py bench/variants/NAME.patch [...]

Each hunk's old lines (context and removals) must occur in the file exactly: they are looked for
at the hunk's line number first, then nearest to it (earlier patches may have shifted it). A new
file (`--- /dev/null`) is created. A hunk that does not match stops with exit status 1 before any
file of its patch is written (patches named before it stay applied). Files are taken to end with a newline (`\ No newline at end of file` is
not supported: the tree's sources all end with one).
"""
from __future__ import annotations

import re
import sys
from typing import Dict, List, Optional, Tuple

Hunk = Tuple[int, List[str], List[str]]          # (old start line, old lines, new lines)


def parse(text: str) -> List[Tuple[str, bool, List[Hunk]]]:
    """[(path, is_new_file, hunks)] of a git diff."""
    files, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        if not lines[i].startswith("--- "):
            i += 1
            continue
        new_file = lines[i] == "--- /dev/null"
        path = lines[i + 1][len("+++ b/"):]
        hunks: List[Hunk] = []
        i += 2
        while i < len(lines) and lines[i].startswith("@@"):
            start = int(re.match(r"@@ -(\d+)", lines[i]).group(1))
            old, new = [], []
            i += 1
            while i < len(lines) and lines[i][:1] in (" ", "-", "+", "\\"):
                tag, body = lines[i][:1], lines[i][1:]
                if tag == "\\":
                    raise ValueError(f"{path}: a file without a final newline is not supported")
                if tag in (" ", "-"):
                    old.append(body)
                if tag in (" ", "+"):
                    new.append(body)
                i += 1
            hunks.append((start, old, new))
        files.append((path, new_file, hunks))
    return files


def find(content: List[str], block: List[str], near: int) -> Optional[int]:
    """The start of block in content nearest to line index near, or None."""
    hits = [k for k in range(len(content) - len(block) + 1) if content[k:k + len(block)] == block]
    return min(hits, key=lambda k: abs(k - near)) if hits else None


def apply(files: List[Tuple[str, bool, List[Hunk]]]) -> Dict[str, str]:
    """The patched text of every file; raises ValueError naming a hunk that does not match."""
    out: Dict[str, str] = {}
    for path, new_file, hunks in files:
        if new_file:                                   # one hunk, every line added
            out[path] = "\n".join(hunks[0][2] + [""])  # "" : the last line's newline
            continue
        content = open(path).read().split("\n")
        offset = 0
        for start, old, new in hunks:
            at = find(content, old, start - 1 + offset)
            if at is None:
                raise ValueError(f"{path}: hunk at line {start} does not match")
            content[at:at + len(old)] = new
            offset += len(new) - len(old)
        out[path] = "\n".join(content)
    return out


def main(argv: List[str]) -> int:
    for patch_file in argv:
        try:
            patched = apply(parse(open(patch_file).read()))
        except (ValueError, OSError) as e:
            print(f"{patch_file}: {e}", file=sys.stderr)
            return 1
        for path, text in patched.items():
            with open(path, "w") as f:
                f.write(text)
        print(f"{patch_file}: applied to {len(patched)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
