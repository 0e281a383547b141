"""Flags of the queue's commands are also PAGEDQ_* variables (flag > environment > default), validated with a
one-line error (exit 2); the engine's flags come from pagedq/engine/options.py and reach EngineConfig; `python -m
pagedq.engine` runs without the queue stack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedq.worker.cli.engine import build_engine
from pagedq.worker.cli.main import build_parser, main, settings_from_args
from pagedq.worker.ops.embedded_redis import EmbeddedRedis
from pagedq.worker.service.config import WorkerSettings

REPO = Path(__file__).resolve().parents[1]
NO_REDIS = "redis://127.0.0.1:1/0"  # never dialled by these tests: only set so no private redis-server starts


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_a_variable_fills_a_worker_flag_and_reaches_the_stub_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDQ_LEASE_MS", "1234")
    monkeypatch.setenv("PAGEDQ_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("PAGEDQ_RESULT_TTL", "99")
    monkeypatch.setenv("PAGEDQ_BURST", "true")
    args = parse("worker", "--engine", "stub")
    settings = settings_from_args(args, "cpu", "stub")
    assert (settings.lease_ms, settings.result_ttl_s, settings.burst) == (1234, 99, True)
    engine, _ = build_engine(args)
    assert engine.max_num_seqs == 7
    assert build_engine(parse("worker", "--engine", "stub", "--max-model-len", "64"))[0].max_model_len == 64


def test_a_flag_beats_the_variable_and_the_default_fills_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDQ_LEASE_MS", "1234")
    monkeypatch.setenv("PAGEDQ_HEARTBEAT_INTERVAL", "2.5")
    settings = settings_from_args(parse("worker", "--engine", "stub", "--lease-ms", "5000"), "cpu", "stub")
    assert (settings.lease_ms, settings.heartbeat_every_s) == (5000, 2.5)
    assert settings.max_attempts == WorkerSettings().max_attempts and settings.queue == "default"


def test_code_that_builds_worker_settings_reads_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDQ_LEASE_MS", "1234")
    monkeypatch.setenv("PAGEDQ_QUEUE", "elsewhere")
    assert (WorkerSettings().lease_ms, WorkerSettings(burst=True).queue) == (60_000, "default")


@pytest.mark.parametrize(
    "env, argv, problem",
    [
        ({"PAGEDQ_LEASE_MS": "soon"}, ["worker"], "PAGEDQ_LEASE_MS='soon': Input should be a valid integer"),
        (
            {"PAGEDQ_MAX_ATTEMPTS": "0"},
            ["worker"],
            "PAGEDQ_MAX_ATTEMPTS='0': Input should be greater than or equal to 1",
        ),
        (
            {"PAGEDQ_LEASE_MS": "5"},
            ["worker", "--metrics-port", "70000"],
            "--metrics-port='70000': Input should be less than or equal to 65535",
        ),
        ({"PAGEDQ_PREEMPTION_MODE": "drop"}, ["worker"], "PAGEDQ_PREEMPTION_MODE='drop': Input should be 'recompute'"),
        ({}, ["worker", "--engine", "gpt"], "--engine='gpt': Input should be 'llm' or 'stub'"),
        ({"PAGEDQ_QUEUE": "a:b"}, ["worker"], "PAGEDQ_QUEUE='a:b': String should match pattern"),
        ({}, ["status", "--queue", "ok", "--queue", "no way"], "--queue='no way': String should match pattern"),
        ({}, ["serve", "--queue", "{x}"], "--queue='{x}': String should match pattern"),
        ({"PAGEDQ_PORT": "99999"}, ["serve"], "PAGEDQ_PORT='99999': Input should be less than or equal to 65535"),
        ({"PAGEDQ_WINDOW": "-1"}, ["bulk", "in.jsonl", "out.jsonl"], "PAGEDQ_WINDOW='-1'"),
        ({"PAGEDQ_REQUESTS": "many"}, ["bench", "gateway"], "PAGEDQ_REQUESTS='many'"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_flag_or_variable(env, argv, problem, monkeypatch, capsys) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--redis", NO_REDIS] if argv[0] != "bench" else argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and problem in err and err.startswith(f"pagedq {argv[0]}"), err


@pytest.mark.slow  # a `python -m pagedq.worker` process
def test_the_installed_way_a_bad_variable_fails(tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/local/bin:/usr/bin:/bin", "PAGEDQ_BLOCK_MS": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "pagedq.worker", "worker", "--engine", "stub", "--redis", NO_REDIS],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr == "pagedq worker: error: PAGEDQ_BLOCK_MS='0': Input should be greater than or equal to 1\n"


@pytest.mark.parametrize(
    "command, shown",
    [
        (
            "worker",
            [
                "(default 60000; env PAGEDQ_LEASE_MS)",
                "(default 86400; env PAGEDQ_RESULT_TTL)",
                "(default 256; env PAGEDQ_MAX_NUM_SEQS)",
                "(default recompute; env PAGEDQ_PREEMPTION_MODE)",
                "$PAGEDQ_REDIS_URL",
                "(env PAGEDQ_BURST)",
            ],
        ),
        ("serve", ["(default 8000; env PAGEDQ_PORT)", "(default 127.0.0.1; env PAGEDQ_HOST)"]),
        ("bulk", ["(default 256; env PAGEDQ_WINDOW)", "(default bulk; env PAGEDQ_BAND)"]),
        ("dlq", ["(default default; env PAGEDQ_QUEUE)"]),
        ("status", ["(env PAGEDQ_QUEUE)", "(env PAGEDQ_JSON)"]),
        ("demo", ["(default 32; env PAGEDQ_MAX_TOKENS)", "(default 0.9; env PAGEDQ_GPU_MEMORY_UTILIZATION)"]),
        ("bench worker", ["(default 20000; env PAGEDQ_STUB_JOBS)", "(default 3000; env PAGEDQ_MIXED_BULK_JOBS)"]),
        ("bench gateway", ["(default 16; env PAGEDQ_CONCURRENCY)"]),
    ],
)
def test_help_shows_each_default_and_variable(command, shown, capsys) -> None:
    with pytest.raises(SystemExit):
        main([*command.split(), "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps help lines
    for fragment in shown:
        assert fragment in text


def test_worker_accepts_a_numbered_cuda_device_which_the_engine_config_then_checks(tiny_llama_dir, capsys) -> None:
    args = parse("worker", "--device", "cuda:1", "--model", str(tiny_llama_dir))
    assert args.device == "cuda:1"
    if torch.cuda.device_count() < 2:  # this CPU machine: EngineConfig refuses it, in one line, exit 2
        with EmbeddedRedis() as server:  # the worker checks Redis before it builds the engine
            assert main(["worker", "--device", "cuda:1", "--model", str(tiny_llama_dir), "--redis", server.url]) == 2
        lines = capsys.readouterr().err.splitlines()  # one line for a person, one JSON log line (startup_errors)
        plain = [line for line in lines if not line.startswith("{")]
        logged = [json.loads(line) for line in lines if line.startswith("{")]
        assert plain == ["pagedq worker: error: device 'cuda:1' was asked for but CUDA is not available"]
        assert len(logged) == 1 and logged[0]["cause"] == "engine" and logged[0]["event"] == "startup_failed"
    else:
        assert str(build_engine(args)[0].config.device) == "cuda:1"


def test_engine_knobs_reach_engine_config(tiny_llama_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    monkeypatch.setenv("PAGEDQ_SWAP_SPACE_GIB", "0.5")
    args = parse(
        "worker",
        "--model",
        str(tiny_llama_dir),
        "--device",
        "cpu",
        "--num-kv-blocks",
        "16",
        "--no-enable-prefix-caching",
        "--preemption-mode",
        "swap",
        "--max-model-len",
        "40",
        "--seed",
        "3",
    )
    try:
        engine, _ = build_engine(args)
    finally:
        gc.unfreeze()
    config = engine.config
    assert (config.enable_prefix_caching, config.preemption_mode, config.max_model_len) == (False, "swap", 40)
    assert (config.swap_space_gib, config.seed, config.num_kv_blocks, engine.max_model_len) == (0.5, 3, 16, 40)
    assert parse("worker", "--enable-prefix-caching").enable_prefix_caching is True


def test_pagedq_status_and_dlq_help_import_no_torch() -> None:
    code = (
        "import sys\nfrom pagedq.worker.cli.main import main\n"
        "for argv in (['status', '--help'], ['dlq', '--help'], ['bulk', '--help'], ['serve', '--help']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "print('torch' in sys.modules, 'pagedq.engine.config.engine' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "False False"


# Makes the queue stack unimportable, as on a GPU box with only the engine's dependencies.
_BLOCKER = (
    "import runpy, sys\n"
    "class Block:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        queue_stack = {'redis', 'celery', 'pydantic', 'pydantic_settings', 'structlog'}\n"
    "        if name.startswith('pagedq.worker') or name.split('.')[0] in queue_stack:\n"
    "            raise ImportError('blocked ' + name)\n"
    "sys.meta_path.insert(0, Block())\n"
    "module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]\n"
    "runpy.run_module(module, run_name='__main__', alter_sys=True)\n"
)


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["pagedq.engine", "--help"], "generate"),
        (["pagedq.engine", "generate", "--help"], "--preemption-mode"),
        (["pagedq.bench", "throughput", "--help"], "--workload"),
    ],
)
def test_python_m_engine_runs_without_the_queue_stack(argv, expect) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKER, *argv], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert expect in proc.stdout and "worker" not in proc.stdout.split("positional arguments")[0]


def test_python_m_engine_generates_without_the_queue_stack(tiny_llama_dir) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _BLOCKER,
            "pagedq.engine",
            "generate",
            "--model",
            str(tiny_llama_dir),
            "--device",
            "cpu",
            "--max-tokens",
            "2",
            "--num-kv-blocks",
            "8",
            "--no-enable-prefix-caching",
            "Hi",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "### Hi" in proc.stdout and "2 tokens]" in proc.stdout


def test_every_engine_config_knob_comes_from_the_flag_spec() -> None:
    """A knob added to EngineConfig itself (not to EngineOptions) would have no flag: refuse that here."""
    import dataclasses

    from pagedq.engine.config.engine import EngineConfig
    from pagedq.engine.options import EngineOptions, engine_options

    config_fields = [f.name for f in dataclasses.fields(EngineConfig) if f.name != "model"]
    assert config_fields == [f.name for f in dataclasses.fields(EngineOptions)] == [o.name for o in engine_options()]
    assert {o.name: o.default for o in engine_options()} == {
        f.name: f.default for f in dataclasses.fields(EngineConfig) if f.name != "model"
    }
