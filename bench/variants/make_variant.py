"""Writes one variant of a kernel header for a side-by-side sweep (see README.md).

    python3 bench/variants/make_variant.py OUT NAME HEADER [--rev REV] [--sub OLD NEW]...

copies csrc/include/radixserve/HEADER (from the working tree, or from git revision REV) to
OUT/var_NAME/radixserve/HEADER with each OLD replaced by NEW (every OLD must occur).
"""
import argparse
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("name")
    ap.add_argument("header")
    ap.add_argument("--rev")
    ap.add_argument("--sub", nargs=2, action="append", default=[], metavar=("OLD", "NEW"))
    a = ap.parse_args()
    rel = "csrc/include/radixserve/" + a.header
    if a.rev:
        src = subprocess.run(["git", "show", f"{a.rev}:{rel}"], capture_output=True, text=True,
                             cwd=ROOT, check=True).stdout
    else:
        src = open(os.path.join(ROOT, rel)).read()
    for old, new in a.sub:
        old, new = old.encode().decode("unicode_escape"), new.encode().decode("unicode_escape")
        if old not in src:
            raise SystemExit(f"not in {a.header}: {old!r}")
        src = src.replace(old, new)
    d = os.path.join(a.out, "var_" + a.name, "radixserve")
    os.makedirs(d, exist_ok=True)
    open(os.path.join(d, a.header), "w").write(src)


if __name__ == "__main__":
    main()
