"""ops/kernel_status.py: why the CUDA kernels are (not) in use, the start-up log line, and
`radixserve env`. No GPU here: every GPU branch is simulated (the import of radixserve._C,
torch.version.cuda, the device's capability)."""
import logging
import os
import subprocess
import sys
import types

import pytest
import torch

from radixserve import cli
from radixserve import env_report
from radixserve.model import default_model
from radixserve.ops import _ext
from radixserve.ops import kernel_status as ks


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.delenv("RADIXSERVE_DISABLE_KERNELS", raising=False)
    ks.reset()
    yield
    ks.reset()   # the next test (and the ops) see the real machine again


def fake_extension(monkeypatch, archs="90a,80", error=None):
    """radixserve._C as a file that imports to a module with CUDA_ARCHS (None: not recorded), or
    raises error."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(ks, "_extension_file", lambda: "/site/radixserve/_C.so")

    def imp():
        if error is not None:
            raise error
        mod = types.SimpleNamespace()
        if archs is not None:
            mod.CUDA_ARCHS = archs
        return mod
    monkeypatch.setattr(ks, "_import_extension", imp)


def fake_gpu(monkeypatch, capability=(9, 0), name="NVIDIA H200"):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i=None: types.SimpleNamespace(total_memory=141 << 30))


# ------------------------------------------------------------------ the classifier

def test_in_use_on_a_gpu_the_build_covers(monkeypatch):
    fake_extension(monkeypatch, "90a,80")
    fake_gpu(monkeypatch, (9, 0))
    st = ks.probe("cuda")
    assert st.in_use and st.kind == "in_use"
    assert st.kernel_arch == "sm_90a" and st.device_arch == "sm_90"
    assert st.built_archs == ["sm_90a", "sm_80"] and st.device == "cuda:0"
    assert st.torch_cuda == "13.0" and st.torch_version == str(torch.__version__)
    level, msg = st.log_line()
    assert level == logging.INFO
    assert msg.startswith("CUDA kernels: in use (radixserve._C, sm_90a, built for sm_90a,sm_80")
    assert "NVIDIA H200" in msg


@pytest.mark.parametrize("cap,chosen", [((8, 0), "sm_80"), ((8, 6), "sm_80"), ((8, 9), "sm_80"),
                                        ((9, 0), "sm_90a")])
def test_the_cubin_the_driver_would_pick(monkeypatch, cap, chosen):
    fake_extension(monkeypatch, "90a;80")
    fake_gpu(monkeypatch, cap)
    st = ks.probe("cuda")
    assert st.in_use and st.kernel_arch == chosen


@pytest.mark.parametrize("cap,archs,suggested", [((10, 0), "90a,80", "100"),
                                                 ((12, 0), "90a,80", "120"),
                                                 ((9, 0), "80", "90a"),
                                                 ((7, 5), "90a,80", "75")])
def test_gpu_architecture_the_build_lacks(monkeypatch, caplog, cap, archs, suggested):
    fake_extension(monkeypatch, archs)
    fake_gpu(monkeypatch, cap, name="Some GPU")
    st = ks.probe("cuda")
    assert not st.in_use and st.kind == "arch_missing"
    assert f"sm_{cap[0]}{cap[1]}" in st.reason and "Some GPU" in st.reason
    assert ",".join(ks.parse_archs(archs)) in st.reason
    assert f"rebuild with {suggested} in RADIXSERVE_CUDA_ARCHS" in st.reason
    level, msg = st.log_line()
    assert level == logging.WARNING
    assert "no code for this GPU's architecture" in msg
    assert msg.endswith("using the torch reference ops (radixserve.ops.reference) (slow on a GPU)")
    # and the ops fall back to the references instead of failing with "no kernel image"
    assert _ext.kernels_available() is False


def test_kernels_available_follows_the_status(monkeypatch):
    fake_extension(monkeypatch, "90a,80")
    fake_gpu(monkeypatch, (9, 0))
    assert _ext.kernels_available() is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ks.reset()
    assert _ext.kernels_available() is False   # no GPU: no CUDA tensor can ask


def test_archs_not_recorded_are_probed_with_one_launch(monkeypatch):
    fake_extension(monkeypatch, archs=None)          # a build from before CUDA_ARCHS existed
    fake_gpu(monkeypatch, (10, 0))
    monkeypatch.setattr(ks, "_probe_launch", lambda dev: None)
    st = ks.probe("cuda")
    assert st.in_use and st.built_archs == [] and "unknown archs" in st.log_line()[1]
    monkeypatch.setattr(ks, "_probe_launch", lambda dev: "CUDA error: no kernel image is "
                        "available for execution on the device")
    st = ks.probe("cuda")
    assert not st.in_use and st.kind == "arch_missing" and "no kernel image" in st.reason
    monkeypatch.setattr(ks, "_probe_launch", lambda dev: "CUDA error: out of memory")
    st = ks.probe("cuda")
    assert not st.in_use and st.kind == "import_error" and "out of memory" in st.reason


def test_not_built(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(ks, "_extension_file", lambda: None)
    monkeypatch.setattr(ks, "_import_extension", lambda: pytest.fail("must not import"))
    fake_gpu(monkeypatch)
    st = ks.probe("cuda")
    assert not st.in_use and st.kind == "not_built"
    assert "radixserve._C is not built" in st.reason
    assert st.log_line()[0] == logging.WARNING
    cpu = ks.probe("cpu")
    assert cpu.kind == "cpu_device" and "radixserve._C: not built" in cpu.reason
    assert cpu.log_line()[0] == logging.INFO


def test_cpu_only_torch(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(ks, "_import_extension", lambda: pytest.fail("must not import"))
    st = ks.probe("cuda")
    assert not st.in_use and st.kind == "cpu_torch" and st.torch_cuda is None
    assert "CPU-only build" in st.reason and str(torch.__version__) in st.reason
    assert st.log_line()[0] == logging.WARNING
    cpu = ks.probe("cpu")
    assert cpu.kind == "cpu_device" and "CPU-only build" in cpu.reason
    assert cpu.log_line()[0] == logging.INFO


@pytest.mark.parametrize("message", [
    "/site/radixserve/_C.so: undefined symbol: _ZN3c104cuda9SetDeviceEab",
    "libc10_cuda.so: cannot open shared object file: No such file or directory",
    "libtorch_cuda.so: cannot open shared object file: No such file or directory",
])
def test_torch_abi_mismatch(monkeypatch, message):
    fake_extension(monkeypatch, error=ImportError(message))
    fake_gpu(monkeypatch)
    st = ks.probe("cuda")
    assert not st.in_use and st.kind == "abi_mismatch"
    assert st.reason.startswith("torch ABI mismatch") and message in st.reason
    assert str(torch.__version__) in st.reason and "--no-build-isolation" in st.reason
    assert st.import_error == message and not st.extension_loaded
    level, msg = st.log_line()
    assert level == logging.WARNING and "torch ABI mismatch" in msg
    cpu = ks.probe("cpu")      # on the CPU the line still says the extension is broken
    assert cpu.kind == "cpu_device" and "failed to load" in cpu.reason


def test_other_import_errors_keep_their_message(monkeypatch):
    fake_extension(monkeypatch, error=ImportError("libcudart.so.12: cannot open shared object"))
    fake_gpu(monkeypatch)
    st = ks.probe("cuda")
    assert st.kind == "import_error" and "libcudart.so.12" in st.reason


def test_no_gpu_for_a_cuda_device(monkeypatch):
    fake_extension(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    st = ks.probe("cuda")
    assert not st.in_use and st.kind == "no_gpu" and st.extension_loaded


def test_disabled_by_the_debugging_switch(monkeypatch):
    fake_extension(monkeypatch, error=AssertionError("must not import"))
    fake_gpu(monkeypatch)
    monkeypatch.setenv("RADIXSERVE_DISABLE_KERNELS", "1")
    st = ks.probe("cuda")
    assert not st.in_use and st.kind == "disabled" and "RADIXSERVE_DISABLE_KERNELS=1" in st.reason
    assert _ext.kernels_available() is False


def test_the_extension_is_imported_once(monkeypatch):
    fake_extension(monkeypatch)
    calls = []
    monkeypatch.setattr(ks, "_import_extension",
                        lambda: calls.append(1) or types.SimpleNamespace(CUDA_ARCHS="80"))
    fake_gpu(monkeypatch, (8, 0))
    for _ in range(3):
        ks.probe("cuda")
        ks.kernel_status("cuda:0")
    assert calls == [1]


def test_this_machine_on_the_cpu():
    st = ks.probe("cpu")
    assert not st.in_use and st.kind in ("cpu_device", "disabled") and st.device_arch is None
    assert st.log_line()[0] == logging.INFO


@pytest.mark.parametrize("built,cap,runs", [
    ("sm_80", (8, 0), True), ("sm_80", (8, 6), True), ("sm_86", (8, 0), False),
    ("sm_80", (9, 0), False), ("sm_90a", (9, 0), True), ("sm_90a", (10, 0), False),
    ("sm_90", (9, 0), True), ("sm_100a", (10, 0), True), ("sm_100a", (10, 3), False),
    ("sm_100f", (10, 3), True), ("sm_120", (12, 1), True), ("sm_75", (8, 0), False),
    ("compute_80", (8, 0), True), ("compute_80", (12, 0), True), ("compute_90", (8, 9), False),
    ("compute_90a", (10, 0), False), ("compute_90a", (9, 0), True), ("bogus", (9, 0), False)])
def test_arch_runs_on(built, cap, runs):
    assert ks.arch_runs_on(built, cap) is runs


def test_parse_archs():
    assert ks.parse_archs("90a,80") == ["sm_90a", "sm_80"]
    assert ks.parse_archs("90a;80") == ["sm_90a", "sm_80"]
    assert ks.parse_archs(" sm_90a, sm_80 ") == ["sm_90a", "sm_80"]
    assert ks.parse_archs("") == [] and ks.parse_archs(None) == []
    assert ks.parse_archs("80+PTX,90a,100a,120") == ["sm_80", "compute_80", "sm_90a", "sm_100a",
                                                     "sm_120"]


@pytest.mark.parametrize("cap,chosen", [((9, 0), "sm_90a"), ((8, 9), "sm_80"),
                                        ((12, 0), "sm_120"), ((11, 0), "compute_80")])
def test_a_release_build_picks_a_cubin_before_its_ptx(monkeypatch, cap, chosen):
    """The release archs (setup.py RELEASE_ARCHS): every GPU from 8.0 up runs something, a cubin
    where one fits, else the PTX the driver compiles."""
    fake_extension(monkeypatch, "80+PTX,90a,100a,120")
    fake_gpu(monkeypatch, cap)
    st = ks.probe("cuda")
    assert st.in_use and st.kernel_arch == chosen
    assert ("PTX" in st.reason) is chosen.startswith("compute_")


# ------------------------------------------------------------------ the start-up line

def test_log_kernel_status_levels(monkeypatch, caplog):
    fake_extension(monkeypatch, "80")
    fake_gpu(monkeypatch, (9, 0))
    with caplog.at_level(logging.INFO):
        ks.log_kernel_status("cuda")
        ks.log_kernel_status("cpu")
    lines = [(r.levelno, r.getMessage()) for r in caplog.records
             if r.getMessage().startswith("CUDA kernels:")]
    assert len(lines) == 2
    assert lines[0][0] == logging.WARNING and "sm_90" in lines[0][1]
    assert "using the torch reference ops" in lines[0][1]
    assert lines[1][0] == logging.INFO and "the device is the CPU" in lines[1][1]


def test_model_runner_logs_one_line_at_start(caplog):
    from radixserve.config import ModelConfig, ServerArgs
    from radixserve.model.runner import ModelRunner

    config = ModelConfig.from_dict({"num_attention_heads": 2, "num_key_value_heads": 1,
                                    "hidden_size": 8, "intermediate_size": 16,
                                    "num_hidden_layers": 1, "vocab_size": 32,
                                    "max_position_embeddings": 64})
    args = ServerArgs(device="cpu", max_total_tokens=16, max_running_requests=2,
                      context_length=32)
    with caplog.at_level(logging.INFO, logger="radixserve"):
        runner = ModelRunner(args, config, "unused", model=torch.nn.Linear(1, 1))
    lines = [r for r in caplog.records if r.getMessage().startswith("CUDA kernels:")]
    assert len(lines) == 1
    assert lines[0].levelno == logging.INFO and lines[0].name == "radixserve.model.runner"
    assert "not in use" in lines[0].getMessage()
    assert runner.kernel_status.kind in ("cpu_device", "disabled")


# ------------------------------------------------------------------ radixserve env

def _env_rows(capsys):
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    return out, {line.split(":", 1)[0]: line.split(":", 1)[1].strip()
                 for line in out.splitlines() if ":" in line}


def test_env_on_this_machine(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    out, rows = _env_rows(capsys)
    import radixserve
    assert rows["radixserve"].startswith(radixserve.__version__)
    assert rows["Python"].startswith(sys.version.split()[0])
    assert rows["torch"].startswith(str(torch.__version__))
    assert (torch.version.cuda or "CPU-only") in rows["torch"]
    assert "CUDA driver" in rows
    assert any(k.startswith("GPU") for k in rows)
    assert rows["CUDA kernels"].startswith("in use (" if ks.kernel_status().in_use
                                           else "not in use: ")
    assert "radixserve._C" in rows
    path = os.path.join(str(tmp_path), default_model.DEFAULT_MODEL_NAME)
    assert path == default_model.default_model_dir()
    assert rows["default model"] == f"{default_model.DEFAULT_MODEL_NAME}: {path} (not yet " \
        "converted: the first `radixserve serve` without --model-path makes it)"
    assert not os.path.exists(path)            # nothing downloaded or converted
    assert rows["$RADIXSERVE_CACHE_DIR"] == str(tmp_path)
    os.makedirs(path)
    _, rows = _env_rows(capsys)
    assert rows["default model"].endswith("(present)")


def test_env_on_a_simulated_gpu(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    fake_extension(monkeypatch, "90a,80")
    fake_gpu(monkeypatch, (9, 0))
    monkeypatch.setattr(env_report, "nvidia_smi_driver", lambda: "580.159.03")
    monkeypatch.setattr(env_report, "cuda_driver_api_version", lambda: "13.0")
    _, rows = _env_rows(capsys)
    assert rows["torch"].startswith(f"{torch.__version__} (CUDA build 13.0")
    assert rows["CUDA driver"] == "580.159.03, CUDA 13.0"
    assert rows["GPU 0"] == "NVIDIA H200, compute capability 9.0 (sm_90), 141 GiB"
    assert rows["CUDA kernels"] == "in use (sm_90a code on NVIDIA H200, sm_90)"
    assert rows["radixserve._C"].startswith("loaded, built for sm_90a,sm_80")


def test_env_on_a_simulated_gpu_the_build_lacks(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    fake_extension(monkeypatch, "90a,80")
    fake_gpu(monkeypatch, (10, 0), name="NVIDIA B200")
    monkeypatch.setattr(env_report, "nvidia_smi_driver", lambda: None)
    monkeypatch.setattr(env_report, "cuda_driver_api_version", lambda: None)
    _, rows = _env_rows(capsys)
    assert rows["CUDA driver"] == "n/a"
    assert rows["CUDA kernels"].startswith("not in use: radixserve._C has no code for this GPU's "
                                           "architecture (NVIDIA B200, sm_100")


def test_nvidia_smi_driver_reads_nvidia_smi(monkeypatch, tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 580.159.03\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    assert env_report.nvidia_smi_driver() == "580.159.03"
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert env_report.nvidia_smi_driver() is None


def test_radixserve_env_as_a_command(tmp_path):
    env = dict(os.environ, RADIXSERVE_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "radixserve", "env"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for label in ("radixserve:", "Python:", "torch:", "CUDA driver:", "GPU", "CUDA kernels:",
                  "radixserve._C:", "default model:", str(tmp_path)):
        assert label in proc.stdout


def test_missing_extension_ops(monkeypatch):
    """The ops check of .ci/run and release/check_wheel.sh: [] for this checkout's build, the
    import error when _C cannot load."""
    if ks._extension_file() is not None:
        assert ks.missing_extension_ops() == []
    monkeypatch.setattr(ks, "_import_extension", lambda: (_ for _ in ()).throw(ImportError("x")))
    with pytest.raises(ImportError):
        ks.missing_extension_ops()
