"""The command line's flags (`radixserve serve`, `python -m radixserve.launch_server`): every flag
has help with its default and choices, `--version`, no abbreviations, SGLang's names for the flags
we implement, and the SGLang flags we do not support refused by name (exit 2)."""
import argparse
import dataclasses

import pytest

from radixserve import __version__, cli, launch_server
from radixserve.config import REFUSED_SGLANG_FLAGS, HelpFormatter, RefusedFlag, ServerArgs

FIELDS = dataclasses.fields(ServerArgs)

# SGLang flag names users type that radixserve implements (value, or None for an on/off flag)
SGLANG_NAMES = {"--model-path": "/m", "--model": "/m", "--tokenizer-path": "/t",
                "--served-model-name": "m", "--load-format": "dummy", "--dtype": "bfloat16",
                "--device": "cpu", "--context-length": "512", "--chat-template": "{{ messages }}",
                "--host": "0.0.0.0", "--port": "8000", "--log-level": "debug",
                "--mem-fraction-static": "0.5", "--max-total-tokens": "100",
                "--max-running-requests": "4", "--max-prefill-tokens": "64",
                "--chunked-prefill-size": "-1", "--schedule-policy": "lpm",
                "--schedule-conservativeness": "0.5", "--disable-radix-cache": None,
                "--page-size": "1", "--tp-size": "1", "--tensor-parallel-size": "1",
                "--dp-size": "1", "--data-parallel-size": "1", "--random-seed": "7",
                "--disable-cuda-graph": None, "--cuda-graph-max-bs": "8",
                "--disable-overlap-schedule": None, "--max-queued-requests": "9",
                "--stream-interval": "4", "--enable-mixed-chunk": None,
                "--grammar-backend": "xgrammar", "--api-key": "k", "--enable-metrics": None,
                "--log-requests": None, "--admin-api-key": "adm", "--tokenizer-worker-num": "3",
                "--enable-priority-scheduling": None, "--schedule-low-priority-values-first": None,
                "--priority-scheduling-preemption-threshold": "5",
                "--disable-priority-preemption": None, "--default-priority-value": "0",
                "--abort-on-priority-when-disabled": None}


def serve_parsers():
    """(name, parser) of both ways in: `radixserve serve` and launch_server."""
    top = cli.build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return [("radixserve serve", sub.choices["serve"]), ("launch_server", cli.serve_parser())]


def flag_of(field):
    return "--" + field.name.replace("_", "-")


def parse(*argv):
    return ServerArgs.from_cli_args(cli.build_parser().parse_args(["serve", *argv]))


def test_every_flag_has_help_with_its_default_and_choices():
    for f in FIELDS:
        assert f.metadata.get("help", "").strip(), f"{f.name} has no help text"
    for _, parser in serve_parsers():
        actions = {a.dest: a for a in parser._actions if a.option_strings}
        fmt = HelpFormatter("x")
        for f in FIELDS:
            action = actions[f.name]
            assert action.help and action.help is not argparse.SUPPRESS, f.name
            assert flag_of(f) in action.option_strings
            assert "default" in fmt._get_help_string(action).lower(), f.name
            if f.metadata.get("choices"):
                assert tuple(action.choices) == tuple(f.metadata["choices"])
                assert f.default in action.choices


def test_help_output_shows_defaults_and_choices(capsys):
    for argv, main in ((["serve", "--help"], cli.main), (["--help"], launch_server.main)):
        assert main(argv) == 0
        out = " ".join(capsys.readouterr().out.split())
        for shown in ("--schedule-policy {fcfs,lpm}", "(default: fcfs)", "--port PORT",
                      "(default: 30000)", "{auto,safetensors,dummy}", "(default: auto)",
                      "--dtype {auto,float32,float,bfloat16,float16,half}", "(default: off)",
                      "--grammar-backend {xgrammar}", "--tp-size N, --tensor-parallel-size N",
                      "--model-path PATH, --model PATH", "(default: 8388608)",
                      "default: 0.85 of the GPU's free memory", "--trust-remote-code"):
            assert shown in out, shown
        assert "--api-key KEY" in out and "default: $RADIXSERVE_API_KEY" in out


def test_version(capsys):
    for main, argv in ((cli.main, ["--version"]), (cli.main, ["serve", "--version"]),
                       (launch_server.main, ["--version"])):
        assert main(argv) == 0
        assert capsys.readouterr().out == f"radixserve {__version__}\n"


def test_flags_are_not_abbreviated(capsys):
    for argv in (["serve", "--tp", "1"], ["serve", "--port=1", "--tp", "1"],
                 ["serve", "--disable-radix"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "unrecognized arguments" in err and "not abbreviated" in err
    assert cli.main(["serve", "--tp", "1"]) == 2
    assert "did you mean --tp-size?" in capsys.readouterr().err
    assert launch_server.main(["--tp", "1"]) == 2
    assert "--tp-size" in capsys.readouterr().err
    assert cli.main(["convert", "--gg", "x", "--out", "y"]) == 2
    capsys.readouterr()
    top = cli.build_parser()
    parsers = [top, cli.serve_parser()] + [p for a in top._actions
                                           if isinstance(a, argparse._SubParsersAction)
                                           for p in a.choices.values()]
    assert all(not p.allow_abbrev for p in parsers)


def test_sglang_names_parse_to_our_fields():
    for flag, value in SGLANG_NAMES.items():
        parse(flag, *([] if value is None else [value]))         # accepted
    a = parse(*[x for flag, value in SGLANG_NAMES.items() if flag not in
                ("--model", "--tensor-parallel-size", "--data-parallel-size")
                for x in ([flag] if value is None else [flag, value])])
    assert (a.api_key, a.enable_metrics, a.log_requests, a.grammar_backend, a.stream_interval,
            a.chat_template, a.tp_size, a.dp_size, a.admin_api_key, a.tokenizer_worker_num) == (
        ["k"], True, True, "xgrammar", 4, "{{ messages }}", 1, 1, "adm", 3)
    a.check()
    assert parse("--api-key", "k1", "--api-key", "k2").api_key == ["k1", "k2"]    # repeatable


def test_default_drain_ends_within_common_grace_periods():
    """SIGTERM: the drain (--shutdown-timeout) plus the time uvicorn gives connections to close
    stays below Kubernetes' default terminationGracePeriodSeconds (30 s), so a pod is not
    killed mid-drain; --help says so."""
    from radixserve.server.app import CONNECTION_CLOSE_S, KUBERNETES_DEFAULT_GRACE_S
    assert KUBERNETES_DEFAULT_GRACE_S == 30
    assert ServerArgs().shutdown_timeout + CONNECTION_CLOSE_S < KUBERNETES_DEFAULT_GRACE_S
    help_text = next(f for f in FIELDS if f.name == "shutdown_timeout").metadata["help"]
    assert "Kubernetes' default 30 s grace period" in help_text


def test_each_alias_sets_the_same_field():
    aliased = [f for f in FIELDS if f.metadata.get("aliases")]
    assert {a for f in aliased for a in f.metadata["aliases"]} >= {
        "--model", "--tensor-parallel-size", "--data-parallel-size"}
    for f in aliased:
        value = "/m" if "str" in str(f.type) else "1"
        want = getattr(parse(flag_of(f), value), f.name)
        assert want != f.default or f.name in ("tp_size", "dp_size")
        for alias in f.metadata["aliases"]:
            assert getattr(parse(alias, value), f.name) == want, alias


def test_only_one_device_and_xgrammar(capsys):
    for argv, message in ((["--tp-size", "64", "--device", "cuda"],
                           "--tp-size 64 needs 64 GPUs (one per rank); this host has"),
                          (["--tensor-parallel-size", "64", "--device", "cuda"],
                           "needs 64 GPUs"),
                          (["--tp-size", "0"], "--tp-size must be >= 1"),
                          (["--dp-size", "0"], "--dp-size must be >= 1"),
                          (["--dp-size", "64", "--device", "cuda"],
                           "--dp-size 64 x --tp-size 1 needs 64 GPUs"),
                          (["--router-policy", "least_load"], "invalid choice: 'least_load'"),
                          (["--stream-interval", "0"], "--stream-interval must be >= 1"),
                          (["--grammar-backend", "outlines"], "invalid choice: 'outlines'"),
                          (["--schedule-policy", "random"], "invalid choice: 'random'"),
                          (["--device", "xpu"], "invalid choice: 'xpu'"),
                          (["--load-format", "pt"], "invalid choice: 'pt'"),
                          (["--dtype", "int8"], "invalid choice: 'int8'")):
        assert cli.main(["serve", *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv
    with pytest.raises(ValueError, match="--grammar-backend"):
        ServerArgs(grammar_backend="outlines").check()


def test_each_refused_sglang_flag_exits_2_naming_it(capsys):
    assert len(REFUSED_SGLANG_FLAGS) >= 40
    ours = {s for f in FIELDS for s in (flag_of(f), *f.metadata["aliases"])}
    assert not ours & set(REFUSED_SGLANG_FLAGS), "a flag is both accepted and refused"
    for flag, reason in REFUSED_SGLANG_FLAGS.items():
        assert flag.startswith("--") and reason.strip(), flag
        message = f"{flag} is an SGLang flag radixserve does not support yet: {reason}"
        for main, argv in ((cli.main, ["serve", flag]), (cli.main, ["serve", "--port", "1", flag, "x"]),
                           (cli.main, ["serve", f"{flag}=x"]), (launch_server.main, [flag, "x", "y"])):
            assert main(argv) == 2, argv
            assert message in capsys.readouterr().err, argv
    for _, parser in serve_parsers():
        refused = [a for a in parser._actions if isinstance(a, RefusedFlag)]
        assert sorted(s for a in refused for s in a.option_strings) == sorted(REFUSED_SGLANG_FLAGS)


def test_trust_remote_code_is_refused(capsys):
    for common in ("--trust-remote-code", "--lora-paths", "--speculative-draft-model-path",
                   "--enable-dp-attention", "--nnodes", "--attention-backend"):
        assert common in REFUSED_SGLANG_FLAGS
    assert "trust_remote_code" not in {f.name for f in FIELDS}
    with pytest.raises(TypeError):
        ServerArgs(trust_remote_code=True)
    assert cli.main(["serve", "--model-path", "/m", "--trust-remote-code"]) == 2
    err = capsys.readouterr().err
    assert "--trust-remote-code is an SGLang flag radixserve does not support yet" in err


def test_chat_template_flag(tmp_path, default_model_path):
    from radixserve.tokenizer.tokenizer import Tokenizer

    jinja = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(jinja)
    assert ServerArgs().resolved_chat_template() is None
    assert ServerArgs(chat_template=str(path)).resolved_chat_template() == jinja
    assert ServerArgs(chat_template=jinja).resolved_chat_template() == jinja
    ServerArgs(chat_template=str(path)).check()
    for bad, message in (("chatml", "built-in template names are not supported"),
                         ("{% for %}", "--chat-template: the chat template does not compile")):
        with pytest.raises(ValueError, match=message):
            ServerArgs(chat_template=bad).check()
    (tmp_path / "t.json").write_text("{}")
    with pytest.raises(ValueError, match="JSON conversation templates"):
        ServerArgs(chat_template=str(tmp_path / "t.json")).check()
    tok = Tokenizer.from_path(default_model_path)
    tok.set_chat_template(ServerArgs(chat_template=str(path)).resolved_chat_template())
    assert tok.chat_template_text == jinja
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user]hi"
