"""One table of knobs (issue 36, point 5): every RADIXSERVE_* environment variable the sources
use is a row of knobs.KNOBS, only knobs.py reads one (the CUDA sources read none), `radixserve
env` prints the table, the A/B switches are hidden --debug-* flags of `serve` that beat the
environment, and the kernel choices reach the attention ops as arguments."""
from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import re
import types

import pytest

from radixserve import cli, knobs, launch_server, ops
from radixserve.config import ServerArgs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
THIS = os.path.abspath(__file__)
# where RADIXSERVE_* names are used: the package, the CUDA sources, the build, the tests, the
# benchmarks' Python and the release scripts (bench/variants' patches and bench/results' logs
# are not sources of this tree)
SOURCE_DIRS = ("pysrc", "csrc", "tests", "bench", "release")
SOURCE_FILES = ("setup.py", "Makefile")
NAME = re.compile(r"\bRADIXSERVE_[A-Z0-9_]*[A-Z0-9]\b")


def _sources():
    for rel in SOURCE_FILES:
        yield os.path.join(ROOT, rel)
    for top in SOURCE_DIRS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if d not in ("__pycache__", "variants", "results")]
            for f in filenames:
                if f.endswith((".py", ".cu", ".cuh", ".cpp", ".h", ".sh")):
                    path = os.path.join(dirpath, f)
                    if os.path.abspath(path) != THIS:
                        yield path


def _read(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


@pytest.fixture(autouse=True)
def fresh_knobs(monkeypatch):
    """No flag, override or parsed value of another test; none left for the next."""
    for name in knobs.KNOBS:
        monkeypatch.delenv(name, raising=False)
    knobs.set_flags({})
    knobs._overrides.clear()
    knobs._parsed.clear()
    yield
    knobs.set_flags({})
    knobs._overrides.clear()
    knobs._parsed.clear()


# ----------------------------------------------------------------------------- the table

def _variant_knobs():
    """The names bench/variants' patches use: knobs of a patch not in this tree (the GPU session
    applies it, then sets them); bench/ may name them, the tree's sources may not."""
    variants = os.path.join(ROOT, "bench", "variants")
    return {n for f in os.listdir(variants) if f.endswith(".patch")
            for n in NAME.findall(_read(os.path.join(variants, f)))}


def test_every_radixserve_variable_in_the_sources_is_a_knob():
    used = {}
    macros = set()
    variant = _variant_knobs()
    for path in _sources():
        text = _read(path)
        macros |= set(re.findall(r"#\s*define\s+(RADIXSERVE_\w+)", text))
        rel = os.path.relpath(path, ROOT)
        for name in NAME.findall(text):
            in_bench = rel.startswith("bench" + os.sep)
            if not (name in variant and name not in knobs.KNOBS and in_bench):
                used.setdefault(name, rel)
    missing = {n: where for n, where in used.items() if n not in knobs.KNOBS and n not in macros}
    assert not missing, (f"RADIXSERVE_* variables used but not in knobs.KNOBS (add a row to "
                         f"pysrc/radixserve/knobs.py): {missing}")
    # and every row is used somewhere (no stale row)
    assert set(knobs.KNOBS) <= set(used), set(knobs.KNOBS) - set(used)


def test_only_knobs_py_reads_the_environment_and_the_kernels_read_none():
    """Python: no os.environ / os.getenv of a RADIXSERVE_* name outside knobs.py (readers call
    knobs.value); CUDA sources: no getenv at all (the ops take the choices as arguments)."""
    offenders = []
    pkg = os.path.join(ROOT, "pysrc", "radixserve")
    for dirpath, _, filenames in os.walk(pkg):
        for f in filenames:
            path = os.path.join(dirpath, f)
            if not f.endswith(".py") or path == os.path.join(pkg, "knobs.py"):
                continue
            for n, line in enumerate(_read(path).splitlines(), 1):
                if re.search(r"(environ|getenv)\b.*RADIXSERVE_", line):
                    offenders.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}")
    for dirpath, _, filenames in os.walk(os.path.join(ROOT, "csrc")):
        for f in filenames:
            path = os.path.join(dirpath, f)
            for n, line in enumerate(_read(path).splitlines(), 1):
                if "getenv" in line:
                    offenders.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_rows_are_complete():
    for name, knob in knobs.KNOBS.items():
        assert name == knob.name and name.startswith("RADIXSERVE_")
        assert knob.help and knob.read_by and knob.values, name
        assert knob.kind in ("runtime", "build", "test"), name
        assert knob.default is not None or knob.unset, f"{name}: say what unset means"
        assert knob.flag is None or knob.kind == "runtime", name


# ----------------------------------------------------------------------------- value()

def test_default_then_environment_then_flag_then_override(monkeypatch):
    name = "RADIXSERVE_DECODE_KERNEL"
    assert knobs.value(name) == "auto" and knobs.source(name) == "default"
    monkeypatch.setenv(name, "")                       # empty: unset
    assert knobs.value(name) == "auto" and knobs.source(name) == "default"
    monkeypatch.setenv(name, "simt")                   # seen at the next call
    assert knobs.value(name) == "simt" and knobs.source(name) == "environment"
    knobs.set_flags({name: "auto"})
    assert knobs.value(name) == "auto" and knobs.source(name) == "flag"
    with knobs.override(name, "simt"):
        assert knobs.value(name) == "simt" and knobs.source(name) == "override"
        knobs.set_flags({})                            # an engine starting inside the block
        assert knobs.value(name) == "simt"
    assert knobs.value(name) == "simt" and knobs.source(name) == "environment"
    monkeypatch.delenv(name)
    assert knobs.value(name) == "auto"


def test_typed_values(monkeypatch):
    assert knobs.value("RADIXSERVE_GC_GEN0") == 50_000
    assert knobs.value("RADIXSERVE_GRAPH_CONTEXT_CLASSES") is True
    assert knobs.value("RADIXSERVE_DECODE_NO_SPLIT_TOKENS") is None      # the kernel's 256
    assert knobs.value("RADIXSERVE_DISABLE_KERNELS") is False
    monkeypatch.setenv("RADIXSERVE_GC_GEN0", "700")
    monkeypatch.setenv("RADIXSERVE_GRAPH_CONTEXT_CLASSES", "0")
    monkeypatch.setenv("RADIXSERVE_DECODE_NO_SPLIT_TOKENS", "0")
    monkeypatch.setenv("RADIXSERVE_DISABLE_KERNELS", "1")
    assert knobs.value("RADIXSERVE_GC_GEN0") == 700
    assert knobs.value("RADIXSERVE_GRAPH_CONTEXT_CLASSES") is False
    assert knobs.value("RADIXSERVE_DECODE_NO_SPLIT_TOKENS") == 0
    assert knobs.value("RADIXSERVE_DISABLE_KERNELS") is True
    with pytest.raises(KeyError):
        knobs.value("RADIXSERVE_NO_SUCH_KNOB")


def test_a_value_the_knob_does_not_take_is_warned_about_once_and_ignored(monkeypatch, caplog):
    """As before the table: RADIXSERVE_DECODE_KERNEL=tc ran the default kernel (now it also
    says so, once per value)."""
    monkeypatch.setenv("RADIXSERVE_DECODE_KERNEL", "tc")
    monkeypatch.setenv("RADIXSERVE_GC_GEN0", "many")
    with caplog.at_level(logging.WARNING, logger="radixserve.knobs"):
        for _ in range(3):
            assert knobs.value("RADIXSERVE_DECODE_KERNEL") == "auto"
        assert knobs.value("RADIXSERVE_GC_GEN0") == 50_000
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings
    assert "RADIXSERVE_DECODE_KERNEL='tc' ignored: it takes auto or simt" in warnings[0]
    assert knobs.source("RADIXSERVE_DECODE_KERNEL").startswith("default (invalid")


def test_set_flags_checks_and_replaces():
    knobs.set_flags({"RADIXSERVE_GC_GEN0": "700", "RADIXSERVE_DECODE_KERNEL": "simt"})
    assert knobs.value("RADIXSERVE_GC_GEN0") == 700
    knobs.set_flags({"RADIXSERVE_GC_GEN0": 900})
    assert knobs.value("RADIXSERVE_GC_GEN0") == 900
    assert knobs.value("RADIXSERVE_DECODE_KERNEL") == "auto"            # replaced, not merged
    with pytest.raises(ValueError, match="takes auto or simt"):
        knobs.set_flags({"RADIXSERVE_DECODE_KERNEL": "tc"})
    with pytest.raises(KeyError):
        knobs.set_flags({"RADIXSERVE_CACHE_DIR": "/x"})                # no flag for it


# ----------------------------------------------------------------------------- radixserve env

def test_env_prints_every_knob_with_its_value(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("RADIXSERVE_DECODE_KERNEL", "simt")
    monkeypatch.setenv("RADIXSERVE_GC_GEN0", "seven")
    monkeypatch.setenv("RADIXSERVE_API_KEY", "sk-do-not-print")
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert "sk-do-not-print" not in out
    for name, knob in knobs.KNOBS.items():
        assert f"\n  {name} = " in out, name
        if knob.flag:
            assert f"flag {knob.flag}" in out
    assert "\n  RADIXSERVE_DECODE_KERNEL = simt  [environment; takes auto|simt; default auto; " \
           "flag --debug-decode-kernel]" in out
    assert "\n  RADIXSERVE_EXTEND_KERNEL = auto  [default; takes auto|mma" in out
    assert "\n  RADIXSERVE_GC_GEN0 = 50000  [default (invalid environment value 'seven')" in out
    assert "\n  RADIXSERVE_API_KEY = set  [environment" in out
    rows = {line.split(":", 1)[0]: line.split(":", 1)[1].strip()
            for line in out.splitlines() if line.startswith("$")}
    assert rows["$RADIXSERVE_CACHE_DIR"] == str(tmp_path)
    assert rows["$RADIXSERVE_DECODE_KERNEL"] == "simt"
    assert rows["$RADIXSERVE_API_KEY"] == "set"
    assert rows["$RADIXSERVE_GC_GEN0"].startswith("seven (ignored: it takes an integer")
    assert "$RADIXSERVE_EXTEND_KERNEL" not in rows                       # unset: table only


# ----------------------------------------------------------------------------- --debug-* flags

DEBUG_FIELDS = {f.name: f.metadata["knob"] for f in dataclasses.fields(ServerArgs)
                if f.metadata.get("knob")}


def test_each_flagged_knob_has_its_hidden_field():
    flagged = {k.name: k.flag for k in knobs.KNOBS.values() if k.flag}
    assert sorted(DEBUG_FIELDS.values()) == sorted(flagged)
    for field, name in DEBUG_FIELDS.items():
        assert "--" + field.replace("_", "-") == flagged[name]
    assert set(flagged) == {"RADIXSERVE_DECODE_KERNEL", "RADIXSERVE_EXTEND_KERNEL",
                            "RADIXSERVE_DECODE_NO_SPLIT_TOKENS", "RADIXSERVE_GC_GEN0",
                            "RADIXSERVE_FP8_SCALED_MM",
                            "RADIXSERVE_GRAPH_CONTEXT_CLASSES", "RADIXSERVE_SPEC_OVERLAP",
                            "RADIXSERVE_SWITCH_INTERVAL_US"}


def test_debug_flags_parse_but_are_not_in_help(capsys):
    for argv, main in ((["serve", "--help"], cli.main), (["--help"], launch_server.main)):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "--debug-integrity" in out                     # a documented flag stays
        assert "--debug-decode-kernel" not in out and "--debug-gc-gen0" not in out
        assert "debug:" not in out                            # nor their (empty) section
    ns = cli.build_parser().parse_args([
        "serve", "--debug-decode-kernel", "simt", "--debug-extend-kernel", "mma",
        "--debug-decode-no-split-tokens", "0", "--debug-graph-context-classes", "0",
        "--debug-gc-gen0", "700"])
    args = ServerArgs.from_cli_args(ns)
    assert (args.debug_decode_kernel, args.debug_extend_kernel, args.debug_decode_no_split_tokens,
            args.debug_graph_context_classes, args.debug_gc_gen0) == ("simt", "mma", 0, False, 700)
    args.check()
    assert args.knob_overrides() == {
        "RADIXSERVE_DECODE_KERNEL": "simt", "RADIXSERVE_EXTEND_KERNEL": "mma",
        "RADIXSERVE_DECODE_NO_SPLIT_TOKENS": 0, "RADIXSERVE_GRAPH_CONTEXT_CLASSES": False,
        "RADIXSERVE_GC_GEN0": 700}
    assert ServerArgs().knob_overrides() == {}
    assert cli.main(["serve", "--debug-decode-kernel", "tc"]) == 2
    assert "--debug-decode-kernel: 'tc': it takes auto or simt" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--debug-gc-gen0 'x'"):
        ServerArgs(debug_gc_gen0="x").check()


def _tiny_runner(tmp_path, **kw):
    from radixserve.config import ModelConfig
    from radixserve.model.runner import ModelRunner

    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
           "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_key_value_heads": 1, "max_position_embeddings": 64, "rms_norm_eps": 1e-5}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    args = ServerArgs(model_path=str(tmp_path), load_format="dummy", device="cpu",
                      max_total_tokens=128, max_running_requests=4, **kw)
    return ModelRunner(args, ModelConfig.from_path(str(tmp_path)), str(tmp_path))


def test_debug_flags_beat_the_environment_from_the_runners_start(monkeypatch, tmp_path):
    from radixserve.engine.async_engine import freeze_startup_objects

    monkeypatch.setenv("RADIXSERVE_DECODE_KERNEL", "auto")
    monkeypatch.setenv("RADIXSERVE_GRAPH_CONTEXT_CLASSES", "1")
    monkeypatch.setenv("RADIXSERVE_GC_GEN0", "700")
    _tiny_runner(tmp_path, debug_decode_kernel="simt", debug_graph_context_classes=False,
                 debug_gc_gen0=1234)
    assert knobs.value("RADIXSERVE_DECODE_KERNEL") == "simt"
    assert knobs.value("RADIXSERVE_GRAPH_CONTEXT_CLASSES") is False
    assert knobs.source("RADIXSERVE_GC_GEN0") == "flag"
    before = freeze_startup_objects()
    try:
        assert gc.get_threshold()[0] == 1234
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
    _tiny_runner(tmp_path)                       # a runner without them: the environment again
    assert knobs.value("RADIXSERVE_DECODE_KERNEL") == "auto"
    assert knobs.value("RADIXSERVE_GC_GEN0") == 700
    before = freeze_startup_objects()
    try:
        assert gc.get_threshold()[0] == 700
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


# ----------------------------------------------------------------------------- the op seam

@pytest.fixture
def fake_ops(monkeypatch):
    """The seam's kernel path with torch.ops.radixserve replaced by a recorder of the calls."""
    calls = []

    def op(name):
        def call(*args):
            calls.append((name, args))
            return name
        return call

    radixserve_ops = types.SimpleNamespace(**{n: op(n) for n in (
        "paged_decode_attention", "paged_extend_attention", "extend_attention_kernel")})
    monkeypatch.setattr(ops, "torch", types.SimpleNamespace(
        ops=types.SimpleNamespace(radixserve=radixserve_ops)))
    monkeypatch.setattr(ops, "_use_attention_kernel", lambda q: True)
    monkeypatch.setattr(ops, "_kernel_q", lambda q: q)
    return calls


def test_the_seam_passes_the_kernel_choices_to_the_ops(fake_ops, monkeypatch):
    q = types.SimpleNamespace(shape=(1, 8, 128))        # a head_dim the kernels take

    def decode(**kw):
        ops.paged_decode_attention(q, "k", "v", "indptr", "indices", 0.1, **kw)
        return fake_ops.pop()[1][8:]                   # (kernel, no_split_tokens, window)

    def extend(**kw):
        ops.paged_extend_attention(q, "k", "v", "qo", "kv", "idx", 0.1, **kw)
        return fake_ops.pop()[1][9:]                   # (kernel, window)

    assert decode() == ("auto", None, 0) and extend() == ("auto", 0)
    monkeypatch.setenv("RADIXSERVE_DECODE_KERNEL", "simt")       # tests/gpu switch so
    monkeypatch.setenv("RADIXSERVE_DECODE_NO_SPLIT_TOKENS", "0")
    monkeypatch.setenv("RADIXSERVE_EXTEND_KERNEL", "mma")
    assert decode() == ("simt", 0, 0) and extend() == ("mma", 0)
    ops.extend_attention_kernel(q)
    assert fake_ops.pop() == ("extend_attention_kernel", (q, "mma"))
    knobs.set_flags({"RADIXSERVE_DECODE_KERNEL": "auto", "RADIXSERVE_EXTEND_KERNEL": "auto",
                     "RADIXSERVE_DECODE_NO_SPLIT_TOKENS": 64})
    assert decode() == ("auto", 64, 0) and extend() == ("auto", 0)
    assert decode(kernel="simt") == ("simt", 64, 0) and extend(kernel="mma") == ("mma", 0)
    assert decode(window=4096) == ("auto", 64, 4096) and extend(window=4096) == ("auto", 4096)


def test_the_ops_schemas_take_the_choices():
    """csrc/bindings.cpp: the choices are arguments of the ops (defaults: the documented ones)."""
    text = _read(os.path.join(ROOT, "csrc", "bindings.cpp"))
    assert 'str kernel=\\"auto\\", int? no_split_tokens=None, int window=0) -> Tensor' in text
    assert 'float v_scale=1.0, str kernel=\\"auto\\", int window=0) -> Tensor' in text
    assert 'extend_attention_kernel(Tensor q, str kernel=\\"auto\\") -> str' in text
