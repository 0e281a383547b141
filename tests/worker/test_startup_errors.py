"""Start-up mistakes read as one line on stderr plus one JSON log line, exit status 2
(pagedq/worker/cli/startup_errors.py).

Each case runs the real command in a subprocess against a real (or a closed) Redis port, as a person would.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis
from redis.crc import key_slot

from pagedq.worker.cli.startup_errors import redact, with_readable_errors
from pagedq.worker.ops.embedded_redis import EmbeddedRedis, free_port
from pagedq.worker.protocol.keys import QueueKeys

pytestmark = pytest.mark.slow  # each case runs the real command as a process

REPO = Path(__file__).resolve().parents[2]
HUB_HINT = "pagedq loads local checkpoint folders only; no model hub is reachable"


def run_cli(
    args: list[str], cwd: Path, env: dict[str, str] | None = None, module: str = "pagedq.worker"
) -> subprocess.CompletedProcess[str]:
    """`python -m pagedq.worker ARGS` (module "pagedq.worker") or the `pagedq` script's entry point,
    pagedq.worker.cli:main (module "pagedq"), from this checkout (the editable install may point elsewhere), no
    Redis in env."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PAGEDQ_", "CELERY_"))}
    base["PYTHONPATH"] = str(REPO)
    command = (
        [sys.executable, "-m", module]
        if module == "pagedq.worker"
        else [sys.executable, "-c", "import sys; from pagedq.worker.cli.main import main; sys.exit(main())"]
    )
    return subprocess.run(
        [*command, *args], cwd=cwd, env={**base, **(env or {})}, capture_output=True, text=True, timeout=120
    )


def assert_readable(result: subprocess.CompletedProcess[str], cause: str, *needles: str) -> dict[str, object]:
    """Exit 2, no traceback, exactly one plain line naming the cause, exactly one JSON line; returns the JSON."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    records, plain = [], []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            plain.append(line)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert len(plain) == 1 and len(records) == 1, lines
    assert plain[0].startswith("pagedq ") and ": error: " in plain[0], plain
    for needle in needles:
        assert needle in plain[0], (needle, plain[0])
    record = records[0]
    assert record["event"] == "startup_failed" and record["cause"] == cause and record["level"] == "error", record
    assert record["error"] == plain[0].split(": error: ", 1)[1]
    return record


def closed_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"


def test_worker_with_redis_unreachable(tmp_path: Path) -> None:
    url = closed_url()
    result = run_cli(["worker", "--redis", url, "--engine", "stub", "--burst"], tmp_path)
    record = assert_readable(result, "redis_unreachable", "cannot reach Redis", url, "--redis")
    assert record["redis_url"] == url and record["command"] == "worker"


def test_status_hides_the_password_of_an_unreachable_redis(tmp_path: Path) -> None:
    port = free_port()
    result = run_cli(["status", "--redis", f"redis://:hunter2secret@127.0.0.1:{port}/0"], tmp_path)
    assert_readable(result, "redis_unreachable", f"redis://:***@127.0.0.1:{port}/0")
    assert "hunter2secret" not in result.stderr + result.stdout


def test_bulk_checks_redis_before_creating_output_files(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text('{"custom_id": "a", "prompt": "hi"}\n')
    result = run_cli(["bulk", "in.jsonl", "out.jsonl", "--redis", closed_url()], tmp_path)
    assert_readable(result, "redis_unreachable", "cannot reach Redis")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_dlq_names_the_environment_variable_it_took_the_url_from(tmp_path: Path) -> None:
    url = closed_url()
    result = run_cli(["dlq", "list"], tmp_path, env={"PAGEDQ_REDIS_URL": url})
    record = assert_readable(result, "redis_unreachable", url, "PAGEDQ_REDIS_URL")
    assert record["command"] == "dlq list" and record["source"] == "PAGEDQ_REDIS_URL"


def test_unknown_url_scheme_names_the_value(tmp_path: Path) -> None:
    result = run_cli(["status", "--redis", "http://localhost:6379"], tmp_path)
    assert_readable(result, "redis_url", "--redis 'http://localhost:6379'", "redis://")


def test_metrics_port_in_use_names_the_flag(tmp_path: Path) -> None:
    with EmbeddedRedis() as server, socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = run_cli(
            ["worker", "--redis", server.url, "--engine", "stub", "--burst", "--metrics-port", str(port)], tmp_path
        )
    record = assert_readable(result, "metrics_port", f"--metrics-port {port} is in use")
    assert record["port"] == port and record["flag"] == "--metrics-port"


def test_wrong_password_is_one_line_without_the_password(tmp_path: Path) -> None:
    with EmbeddedRedis() as server:
        Redis(port=server.port).config_set("requirepass", "the-right-one")
        result = run_cli(["status", "--redis", f"redis://:wrong-secret@127.0.0.1:{server.port}/0"], tmp_path)
    assert_readable(result, "redis_auth", "refused the credentials", "redis://:***@")
    assert "wrong-secret" not in result.stderr + result.stdout


def test_celery_broker_unreachable_names_the_broker_flag(tmp_path: Path) -> None:
    broker = f"redis://:broker-secret@127.0.0.1:{free_port()}/0"
    with EmbeddedRedis() as server:  # the queue's Redis is up; only the broker is not
        args = ["worker", "--redis", server.url, "--engine", "stub", "--burst", "--celery", "--celery-broker", broker]
        result = run_cli(args, tmp_path)
    record = assert_readable(result, "celery_broker_unreachable", "cannot reach the Celery broker", "--celery-broker")
    assert record["source"] == "--celery-broker" and "broker-secret" not in result.stderr


@pytest.fixture
def cluster_node() -> Iterator[str]:
    """A real two-node Redis Cluster where the default queue's slot lives on the second node; the URL of the
    first, which answers MOVED for the queue's keys."""
    nodes = [
        EmbeddedRedis(extra_args=("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")).start()
        for _ in range(2)
    ]
    try:
        first, second = (Redis(port=n.port) for n in nodes)
        slot = key_slot(QueueKeys("default").jobs.encode())
        first.execute_command("CLUSTER ADDSLOTS", *[s for s in range(16384) if s != slot])
        second.execute_command("CLUSTER ADDSLOTS", slot)
        first.execute_command("CLUSTER MEET", "127.0.0.1", nodes[1].port)
        deadline = time.monotonic() + 20
        while first.execute_command("CLUSTER INFO").get("cluster_state") != "ok":
            assert time.monotonic() < deadline, "the two-node cluster did not form"
            time.sleep(0.05)
        yield nodes[0].url
    finally:
        for node in nodes:
            node.stop()


def test_plain_url_at_a_cluster_node_says_use_the_cluster_scheme(tmp_path: Path, cluster_node: str) -> None:
    result = run_cli(["worker", "--redis", cluster_node, "--engine", "stub", "--burst"], tmp_path)
    port = cluster_node.rsplit(":", 1)[1].split("/")[0]
    assert_readable(result, "redis_cluster", "MOVED", f"this is a cluster: use redis+cluster://127.0.0.1:{port}")


def test_cluster_node_serving_no_slots_says_use_the_cluster_scheme(tmp_path: Path) -> None:
    with EmbeddedRedis(extra_args=("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")) as node:
        result = run_cli(["worker", "--redis", node.url, "--engine", "stub", "--burst"], tmp_path)
    hint = f"this is a cluster: use redis+cluster://127.0.0.1:{node.port}"
    assert_readable(result, "redis_cluster", "CLUSTERDOWN", hint)


def test_worker_model_that_is_not_a_checkpoint_folder(tmp_path: Path) -> None:
    (tmp_path / "Llama-typo").mkdir()
    with EmbeddedRedis() as server:  # Redis is checked first: it must answer for the model to be loaded
        result = run_cli(["worker", "--model", "Llama-typo", "--redis", server.url, "--device", "cpu"], tmp_path)
    record = assert_readable(result, "model", "Llama-typo is not a checkpoint folder (no config.json in it)", HUB_HINT)
    assert record["model"] == "Llama-typo"


def test_generate_with_a_hub_id_says_only_local_folders_load(tmp_path: Path) -> None:
    result = run_cli(
        ["generate", "hi", "--model", "meta-llama/Llama-3.2-1B", "--device", "cpu"], tmp_path, module="pagedq"
    )
    assert_readable(result, "model", "meta-llama/Llama-3.2-1B is not a checkpoint folder (no such folder)", HUB_HINT)


def test_unexpected_errors_keep_their_traceback() -> None:
    def buggy(_args: argparse.Namespace) -> int:
        raise KeyError("a bug, not a mistake")

    wrapped = with_readable_errors(buggy)
    assert with_readable_errors(wrapped) is wrapped  # wrapped at registration and again at dispatch: once
    with pytest.raises(KeyError, match="a bug"):
        wrapped(argparse.Namespace(command="status", redis=None))
    with pytest.raises(ValueError, match="plain"):  # a ValueError from neither the engine nor redis is a bug too
        with_readable_errors(lambda _a: int("plain"))(argparse.Namespace(command="status", redis=None))


def test_redact_hides_only_the_password() -> None:
    assert redact("redis://user:pw@h:1/0") == "redis://user:***@h:1/0"
    assert redact("rediss://:pw@h:1") == "rediss://:***@h:1"
    assert redact("redis://h:1/0") == "redis://h:1/0"
    assert redact("redis://:pw@[bad") == "redis://..."
