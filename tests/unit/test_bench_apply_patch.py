"""bench/variants/apply_patch.py, the plain-Python `git diff` applier that gpu_session.sh's patchab
stage uses on the device (no `patch`, no git repository there): against GNU patch's behaviour on
a shifted hunk and a new file, and all-or-nothing on a hunk that does not match; and the
prepared patches still apply to this tree."""
import py_compile
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "bench" / "variants" / "apply_patch.py"

ORIGINAL = "".join(f"line {i}\n" for i in range(1, 21))
# a git diff made against a file that had 3 more lines at the top: both hunks sit 3 lines lower
# in the patch than in ORIGINAL; plus a new file and a removal at the end
PATCH = """diff --git a/a.txt b/a.txt
index 1111111..2222222 100644
--- a/a.txt
+++ b/a.txt
@@ -5,3 +5,4 @@
 line 2
 line 3
+inserted after 3
 line 4
@@ -20,4 +21,3 @@
 line 17
 line 18
-line 19
 line 20
diff --git a/sub/new.txt b/sub/new.txt
new file mode 100644
index 0000000..3333333
--- /dev/null
+++ b/sub/new.txt
@@ -0,0 +1,2 @@
+first
+
"""


def _run(tmp_path, patch_text):
    (tmp_path / "p.patch").write_text(patch_text)
    return subprocess.run([sys.executable, str(TOOL), "p.patch"], cwd=tmp_path,
                          capture_output=True, text=True)


def test_applies_shifted_hunks_and_creates_files(tmp_path):
    (tmp_path / "a.txt").write_text(ORIGINAL)
    (tmp_path / "sub").mkdir()
    r = _run(tmp_path, PATCH)
    assert r.returncode == 0, r.stderr
    want = ORIGINAL.replace("line 3\n", "line 3\ninserted after 3\n").replace("line 19\n", "")
    assert (tmp_path / "a.txt").read_text() == want
    assert (tmp_path / "sub" / "new.txt").read_text() == "first\n\n"


def test_a_hunk_that_does_not_match_changes_nothing(tmp_path):
    (tmp_path / "a.txt").write_text(ORIGINAL.replace("line 18\n", "line eighteen\n"))
    (tmp_path / "sub").mkdir()
    r = _run(tmp_path, PATCH)
    assert r.returncode == 1 and "does not match" in r.stderr
    assert (tmp_path / "a.txt").read_text() == ORIGINAL.replace("line 18\n", "line eighteen\n")
    assert not (tmp_path / "sub" / "new.txt").exists()


def _patchab_default_patches():
    """The patches gpu_session.sh's patchab stage applies by default, in its order."""
    text = (ROOT / "bench" / "gpu_session.sh").read_text()
    match = re.search(r"for patch in \$\{PATCHES:-([^}]*)\}", text)
    assert match, "patchab's default PATCHES list not found in gpu_session.sh"
    return match.group(1).split()


def test_the_prepared_kernel_patches_still_apply_to_this_tree(tmp_path):
    """Every patch patchab applies by default applies, in order, to a copy of this tree (a
    change on main that moves their context would otherwise surface only on a GPU machine),
    and every Python file it leaves still compiles."""
    patches = _patchab_default_patches()
    assert patches and all((ROOT / "bench" / "variants" / f"{p}.patch").is_file() for p in patches)
    skip = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    for top in ("csrc", "pysrc", "tests", "bench"):
        shutil.copytree(ROOT / top, tmp_path / top, ignore=skip)
    for name in patches:
        r = subprocess.run([sys.executable, str(TOOL), f"bench/variants/{name}.patch"],
                           cwd=tmp_path, capture_output=True, text=True)
        assert r.returncode == 0, f"{name}: {r.stderr}"
    for path in list((tmp_path / "pysrc").rglob("*.py")) + list((tmp_path / "tests").rglob("*.py")):
        py_compile.compile(str(path), doraise=True, cfile=str(tmp_path / "c.pyc"))
