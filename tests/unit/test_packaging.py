"""The source distribution can build radixserve._C: it carries every file of csrc/ that git
tracks, the build files and the release scripts (MANIFEST.in), and none of the build outputs.
release/inspect_wheel.py's checks of a wheel, on wheels made here from parts."""
import json
import os
import subprocess
import sys
import tarfile
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "release"))
import inspect_wheel  # noqa: E402


def _git_files(*paths):
    out = subprocess.run(["git", "ls-files", *paths], cwd=REPO, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return set(out.stdout.split())


@pytest.fixture(scope="module")
def sdist_members(tmp_path_factory):
    out = tmp_path_factory.mktemp("sdist")
    env = dict(os.environ, RADIXSERVE_CUDA="0")
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "--formats=gztar", "-d", str(out)],
                   cwd=REPO, env=env, check=True, capture_output=True)
    (archive,) = out.iterdir()
    with tarfile.open(archive) as tf:
        names = tf.getnames()
    top = names[0].split("/")[0]
    assert top.startswith("radixserve-")
    return {n[len(top) + 1:] for n in names if "/" in n}


def test_sdist_carries_every_source_the_extension_builds_from(sdist_members):
    needed = _git_files("csrc", "release") | {"setup.py", "pyproject.toml", "MANIFEST.in",
                                              "README.md", "CMakeLists.txt", "Makefile"}
    missing = sorted(needed - sdist_members)
    assert not missing, f"MANIFEST.in leaves out {missing}"


def test_sdist_carries_the_package_and_tests_but_no_build_outputs(sdist_members):
    assert _git_files("pysrc") - sdist_members == set()
    assert {f for f in _git_files("tests") if f.endswith(".py")} - sdist_members == set()
    leaked = [n for n in sdist_members if n.endswith((".so", ".o", ".pyc"))
              or n.startswith("bench/results/")]
    assert not leaked, leaked


def _wheel(path, requires="torch==2.14.*", so=b"\x7fELF"):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("radixserve-0.1.0.dist-info/METADATA",
                    f"Name: radixserve\nRequires-Dist: {requires}\nRequires-Dist: numpy\n")
        zf.writestr("radixserve-0.1.0.dist-info/WHEEL", "Tag: cp311-cp311-manylinux_2_28_x86_64\n")
        if so is not None:
            zf.writestr("radixserve/_C.cpython-311-x86_64-linux-gnu.so", so)
    return str(path)


def test_expected_archs_spelling():
    assert inspect_wheel.expected_archs("80+PTX;90a;100a;120") == {
        "elf": ["sm_80", "sm_90a", "sm_100a", "sm_120"], "ptx": ["compute_80"]}


def test_problems_name_a_missing_arch_an_unpinned_torch_and_debug_info():
    info = {"extension": "radixserve/_C.so", "requires_torch": ["torch>=2.4"],
            "debug_sections": [".debug_info"], "cubin_archs": ["sm_80", "sm_90a"],
            "ptx_archs": []}
    bad = inspect_wheel.problems(info, "80+PTX;90a;120")
    assert any("not pinned" in p for p in bad)
    assert any(".debug_info" in p for p in bad)
    assert any("sm_120" in p for p in bad) and any("compute_80" in p for p in bad)
    good = dict(info, requires_torch=["torch==2.14.*"], debug_sections=[],
                cubin_archs=["sm_80", "sm_90a", "sm_120"], ptx_archs=["compute_80"])
    assert inspect_wheel.problems(good, "80+PTX;90a;120") == []


def test_inspect_reads_tags_and_pin_and_refuses_a_wheel_without_the_extension(tmp_path):
    info = inspect_wheel.inspect(_wheel(tmp_path / "a.whl", so=None), str(tmp_path))
    assert info["tags"] == ["cp311-cp311-manylinux_2_28_x86_64"]
    assert info["requires_torch"] == ["torch==2.14.*"]
    assert inspect_wheel.problems(info, None) == ["the wheel carries no radixserve/_C extension"]


@pytest.mark.skipif(not any(f.startswith("_C.") and f.endswith(".so")
                            for f in os.listdir(os.path.join(REPO, "pysrc", "radixserve"))),
                    reason="radixserve._C is not built here")
def test_the_built_extension_as_a_wheel(tmp_path):
    """The in-place _C of this checkout, packed into a wheel: it needs torch's libraries (which
    the wheel must not bundle) and cuobjdump finds in it the archs its build recorded."""
    import torch  # noqa: F401  (loads libc10 & co. before radixserve._C is imported below)
    pkg = os.path.join(REPO, "pysrc", "radixserve")
    so = next(f for f in os.listdir(pkg) if f.startswith("_C.") and f.endswith(".so"))
    wheel = _wheel(tmp_path / "b.whl", so=open(os.path.join(pkg, so), "rb").read())
    wheel_so = "radixserve/_C.cpython-311-x86_64-linux-gnu.so"
    info = inspect_wheel.inspect(wheel, str(tmp_path))
    assert info["extension"] == wheel_so
    assert any(lib.startswith("libc10") for lib in info["needed_libraries"])
    json.dumps(info)
    if inspect_wheel.find_cuobjdump() is None:
        pytest.skip("no cuobjdump (the test extra installs nvidia-cuda-cuobjdump)")
    import radixserve._C as C   # noqa: E402 (needs torch's libraries loaded, as the ops do)
    want = inspect_wheel.expected_archs(C.CUDA_ARCHS.replace(",", ";"))
    assert info["cubin_archs"] == sorted(want["elf"]) and info["ptx_archs"] == sorted(want["ptx"])
