"""The one table of radixserve's environment variables (KNOBS), and the one reader of them.

Every setting of a running server is a ServerArgs field (config.py: a flag of `radixserve
serve`) or a row of this table; `radixserve env` prints the table with the values it finds.
Each row says the variable's name, what values it takes, its default, what it does, which
modules read it (through value(), never os.environ or getenv of their own; the build's and the
tests' knobs excepted, see Kinds), and, for the settings of A/B runs, the hidden `serve` flag
(--debug-*, not in --help) that overrides it.

    value(name)   the knob's value now: an override() in force, else the --debug-* flag's
                  (which ModelRunner applies at start through set_flags()), else the
                  environment's, else the default. An empty variable counts as unset; a
                  value the knob does not take is logged once (WARNING, naming the variable
                  and what it takes) and the default used instead, as the readers before this
                  table ignored values they did not know.
    source(name)  where value(name) comes from: "override", "flag", "environment", "default",
                  or "default (invalid environment value ...)".
    set_flags({name: value})   the --debug-* flags' values (replacing any set before: the
                  last ModelRunner started decides, as a process has one set of kernels).
    override(name, value)      a context manager: value(name) is value inside the block, over
                  flags and environment alike (benchmarks, tests).
    table()       a Row (knob, value as shown, source, the environment's raw setting, why it
                  was not taken) per knob: what `radixserve env` prints.

Environment variables are parsed once per distinct value: value() looks the variable up (a
dict lookup: tests switch kernels with monkeypatch.setenv between two calls) and re-parses only
when it changed. The CUDA kernels read no environment variable: the op seam (ops/__init__.py)
passes the kernel choices to each op as arguments.

Kinds: "runtime" knobs are read by the package; "build" ones by setup.py while the extension is
compiled (before this package is importable; listed here so that one table names them all);
"test" ones by the test suite. tests/unit/test_knobs.py fails on a RADIXSERVE_* variable that
the sources use and this table lacks, and on a read of one outside this module.

Ground floor: imports nothing of radixserve (config.py and everything above import it).
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Tuple

logger = logging.getLogger(__name__)


def _choice(*values: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in values:
            raise ValueError(f"takes {' or '.join(values)}")
        return raw
    return parse


def _int(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError("takes an integer") from None


def _zero_one(raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError("takes 0 or 1")
    return raw == "1"


def _text(raw: str) -> str:
    return raw


@dataclass(frozen=True)
class Knob:
    name: str                       # the environment variable, RADIXSERVE_...
    values: str                     # what it takes, as the table shows it ("auto|simt", "N")
    default: Any                    # value() when unset (None: the reader's own default)
    help: str                       # what it does; what None means when that is the default
    read_by: Tuple[str, ...]        # who reads it (modules, functions)
    parse: Callable[[str], Any] = _text   # raw -> value; ValueError("takes ...") if it does not
    flag: Optional[str] = None      # the hidden `serve` flag that overrides it (ServerArgs field)
    kind: str = "runtime"           # runtime | build | test
    secret: bool = False            # `radixserve env` shows "set", never the value
    unset: str = ""                 # what the reader does when the default is None

    def shown(self, value: Any) -> str:
        """value as the table shows it (0/1 knobs as 0/1, None as "-")."""
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "1" if value else "0"
        return str(value)

    def default_text(self) -> str:
        """The default as --help and the table say it: the value, or what unset means."""
        return self.unset if self.default is None and self.unset else self.shown(self.default)

    def coerce(self, value: Any) -> Any:
        """A flag's value (a string from the command line, or the parsed type from Python, e.g.
        Engine(debug_gc_gen0=700)) as value() returns it; ValueError if the knob does not take
        it."""
        if isinstance(value, str):
            return self.parse(value)
        return self.parse(self.shown(value))


KNOBS: Dict[str, Knob] = {k.name: k for k in (
    # --- runtime: the kernels' A/B switches (hidden --debug-* flags of `serve` override them)
    Knob("RADIXSERVE_DECODE_KERNEL", "auto|simt", "auto",
         "decode attention's kernel: auto = the tensor-core kernel where it serves (batches that "
         "fill the GPU without splitting requests, 4 to 8 q heads per kv head, head_dim a "
         "multiple of 64), else the CUDA-core one; simt = the CUDA-core kernel always (for "
         "comparisons and tests). Passed to paged_decode_attention per call (a CUDA graph keeps "
         "the kernel it captured)",
         ("ops.paged_decode_attention",), _choice("auto", "simt"), "--debug-decode-kernel"),
    Knob("RADIXSERVE_EXTEND_KERNEL", "auto|mma", "auto",
         "extend (prefill) attention's kernel: auto = the sm_90a wgmma kernel where the build and "
         "GPU have it (16-bit KV pools), else mma.sync; mma = the mma.sync kernel always (the "
         "sm_80 path, for comparisons and tests). Passed to paged_extend_attention per call",
         ("ops.paged_extend_attention", "ops.extend_attention_kernel"),
         _choice("auto", "mma"), "--debug-extend-kernel"),
    Knob("RADIXSERVE_FP8_SCALED_MM", "plain|fast|swap|swap-fast", "plain",
         "how the W8A8 GEMM calls torch._scaled_mm (ops.fp8_scaled_mm): plain = x [M, K] times "
         "the weight's transpose, fp32 accumulation; fast = with use_fast_accum (the tensor "
         "cores' own accumulation, as vLLM's Hopper FP8 kernels run); swap = the weight as the "
         "first operand (out.t() = w x.t(), so the library tiles the long N side; rows M % 16 "
         "!= 0 run plain); swap-fast = both. For A/B runs (bench/scaled_mm_variants.py, "
         "bench/fp8_speed.py). Read per call (a CUDA graph keeps what it captured)",
         ("ops.fp8_scaled_mm",), _choice("plain", "fast", "swap", "swap-fast"),
         "--debug-fp8-scaled-mm"),
    Knob("RADIXSERVE_DECODE_NO_SPLIT_TOKENS", "N", None,
         "decode requests of at most N KV tokens are never split across CTAs; 0 = split at any "
         "length (the earlier plan, for A/B runs). Passed to paged_decode_attention per call",
         ("ops.paged_decode_attention",), _int, "--debug-decode-no-split-tokens",
         unset="the kernel's attn::kDecodeNoSplitTokens, 256"),
    Knob("RADIXSERVE_GRAPH_CONTEXT_CLASSES", "0|1", True,
         "1 = decode batches of up to CLASS_BUCKET_MAX rows get one CUDA graph per context class "
         "(each planned for that capacity); 0 = one full-context graph per batch bucket (for A/B "
         "runs). Read when the graphs are captured",
         ("model.cuda_graph_runner.CudaGraphRunner",), _zero_one,
         "--debug-graph-context-classes"),
    Knob("RADIXSERVE_GC_GEN0", "N", 50_000,
         "the garbage collector's young-generation threshold while an engine runs "
         "(engine/async_engine.GC_GEN0_THRESHOLD; 700 = CPython's own, for A/B runs). Read when "
         "an engine starts",
         ("engine.async_engine.freeze_startup_objects",), _int, "--debug-gc-gen0"),
    Knob("RADIXSERVE_SWITCH_INTERVAL_US", "N", 200,
         "the interpreter's thread switch interval (sys.setswitchinterval) in microseconds while "
         "an engine runs (engine/async_engine.SWITCH_INTERVAL_US; 5000 = CPython's own, for A/B "
         "runs). Read when an engine starts",
         ("engine.async_engine.shorten_switch_interval",), _int, "--debug-switch-interval-us"),
    Knob("RADIXSERVE_SPEC_OVERLAP", "auto|on|off", "auto",
         "speculative verify steps in the overlapped loop (engine/scheduler/spec.py): auto = "
         "where measured to pay (a serial verify step's period at least 1.5x its device time, "
         "per batch size), on = always, off = never (a verify step then runs with no step in "
         "flight, for comparisons and tests). Read at every decode step's planning",
         ("engine.scheduler.spec.SpecDecoder.overlap_verify",), _choice("auto", "on", "off"),
         "--debug-spec-overlap"),
    # --- runtime: the rest
    Knob("RADIXSERVE_DISABLE_KERNELS", "0|1", False,
         "1 = radixserve._C is not loaded: the torch reference ops run everywhere (the debugging "
         "switch, for A/B checks of the kernels). Read once, when the kernels' status is probed",
         ("ops.kernel_status.probe",), _zero_one),
    Knob("RADIXSERVE_CACHE_DIR", "PATH", None,
         "where the default model is converted and its GGUF downloaded",
         ("model.default_model.cache_dir",),
         unset="$XDG_CACHE_HOME/radixserve, else ~/.cache/radixserve"),
    Knob("RADIXSERVE_API_KEY", "KEY", None,
         "the client key when --api-key is not given (serve's flag; the variable keeps the key "
         "out of the process listing)",
         ("config.ServerArgs.resolved_api_keys",), secret=True, unset="no key"),
    Knob("RADIXSERVE_ADMIN_API_KEY", "KEY", None,
         "the admin key when --admin-api-key is not given",
         ("config.ServerArgs.resolved_admin_api_key",), secret=True, unset="none"),
    # --- build: read by setup.py (and release/wheel.sh) while radixserve._C is compiled
    Knob("RADIXSERVE_CUDA", "0|1", None,
         "1 = build radixserve._C (fail loudly if it cannot be built), 0 = skip it",
         ("setup.py",), _zero_one, kind="build",
         unset="build it when nvcc and a CUDA torch are present"),
    Knob("RADIXSERVE_CUDA_ARCHS", "ARCHS", None,
         "the GPU architectures compiled (';'-separated, e.g. 90a;80; +PTX adds PTX)",
         ("setup.py", "release/wheel.sh"), kind="build",
         unset="90a;80, or setup.py's RELEASE_ARCHS with RADIXSERVE_RELEASE=1"),
    Knob("RADIXSERVE_RELEASE", "0|1", False,
         "1 = a release build (RELEASE_ARCHS, release compiler flags)",
         ("setup.py",), _zero_one, kind="build"),
    # --- test: read by the test suite
    Knob("RADIXSERVE_ACCEPTANCE", "0|1", False,
         "1 = also run the long CPU acceptance tests", ("tests/unit",), _zero_one, kind="test"),
    Knob("RADIXSERVE_TEST_GGUF", "PATH", None,
         "the GGUF the GPU model tests load", ("tests/gpu/test_model_cuda.py",), kind="test",
         unset="the default model's"),
    Knob("RADIXSERVE_TEST_INSTALLED", "0|1", False,
         "1 = the tests run against the installed package, not the source tree",
         ("tests/conftest.py",), _zero_one, kind="test"),
)}

_MISSING = object()
_flags: Dict[str, Any] = {}                                  # set_flags()
_overrides: Dict[str, Any] = {}                              # override() blocks in force
_parsed: Dict[str, Tuple[Optional[str], Any, Optional[str]]] = {}   # name -> (raw, value, error)


def _from_environment(knob: Knob) -> Tuple[Optional[str], Any, Optional[str]]:
    """(raw, value, error) for the environment's current setting of knob, parsed once per raw."""
    raw = os.environ.get(knob.name) or None
    cached = _parsed.get(knob.name)
    if cached is not None and cached[0] == raw:
        return cached
    value, error = knob.default, None
    if raw is not None:
        try:
            value = knob.parse(raw)
        except ValueError as e:
            error = f"it {e}; the default ({knob.default_text()}) is used"
            logger.warning("%s=%r ignored: %s", knob.name, raw, error)
    entry = (raw, value, error)
    _parsed[knob.name] = entry
    return entry


def value(name: str) -> Any:
    """The knob's value: an override() in force, else the --debug-* flag's, else the
    environment's, else the default. KeyError for a name the table lacks."""
    for layer in (_overrides, _flags):
        if layer:
            v = layer.get(name, _MISSING)
            if v is not _MISSING:
                return v
    return _from_environment(KNOBS[name])[1]


def source(name: str) -> str:
    knob = KNOBS[name]
    if name in _overrides:
        return "override"
    if name in _flags:
        return "flag"
    raw, _, error = _from_environment(knob)
    if error is not None:
        return f"default (invalid environment value {raw!r})"
    return "environment" if raw is not None else "default"


def set_flags(values: Mapping[str, Any]) -> None:
    """The --debug-* flags' values, {knob name: value} (ServerArgs.knob_overrides()): they
    replace those set before (a flag not given leaves its knob to the environment)."""
    new = {}
    for name, v in values.items():
        knob = KNOBS[name]
        if knob.flag is None:
            raise KeyError(f"{name} has no flag")
        new[name] = knob.coerce(v)
    _flags.clear()
    _flags.update(new)


@contextlib.contextmanager
def override(name: str, v: Any) -> Iterator[None]:
    """value(name) is v (coerced as a flag's value) inside the block, whatever the flags and the
    environment say."""
    knob = KNOBS[name]
    before = _overrides.get(name, _MISSING)
    _overrides[name] = knob.coerce(v)
    try:
        yield
    finally:
        if before is _MISSING:
            _overrides.pop(name, None)
        else:
            _overrides[name] = before


class Row(NamedTuple):
    knob: Knob
    value: str             # value(), as the table shows it ("set" / "-" for a secret knob)
    source: str            # source()
    raw: Optional[str]     # the environment's setting (None: unset or empty)
    error: Optional[str]   # why the environment's setting was not taken (None: it was)


def table(kinds: Tuple[str, ...] = ("runtime", "build", "test")) -> List[Row]:
    """A Row per knob of the kinds, in table order."""
    out = []
    for knob in KNOBS.values():
        if knob.kind not in kinds:
            continue
        v = value(knob.name)
        raw, _, error = _from_environment(knob)
        shown = ("set" if v is not None else "-") if knob.secret else knob.shown(v)
        out.append(Row(knob, shown, source(knob.name), raw, error))
    return out
