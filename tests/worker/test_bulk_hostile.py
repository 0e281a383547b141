"""`pagedq bulk` given careless or hostile files (issue 34): lines split on "\\n" only; an output that is the input
refused before anything is touched; a file the run did not create never trimmed; a run id reused on another input
refused and never adopting its results; results expired before a resume run again; forged output lines, lines that
are not UTF-8 or not objects, and a bad --run-id. Oracles: a real Redis and worker thread, the stub engine's own
answers, the files' bytes."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest
from redis import Redis

from pagedq.worker.bulk.lines import job_id_for
from pagedq.worker.bulk.runner import BulkRun
from pagedq.worker.cli.main import main
from pagedq.worker.testing.stub_engine import StubEngine

from .helpers import KEYS, offline, worker_thread


def _line(cid: str, prompt: str, max_tokens: int = 3) -> str:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": body}, ensure_ascii=False)


def _texts(path: Path) -> dict[str, str]:
    lines = [json.loads(x) for x in path.read_text().split("\n") if x]
    return {line["custom_id"]: line["response"]["body"]["choices"][0]["text"] for line in lines}


def _answer(prompt: str, max_tokens: int = 3) -> str:
    return offline(prompt, max_tokens=max_tokens, temperature=0.0)[0]


def _run(r: Redis, inp: Path, out: Path, err: Path, **kwargs) -> dict[str, int]:
    """BulkRun in a thread, so a run that never ends fails the test instead of hanging it."""
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(BulkRun(r, inp, out, err, progress=False, **kwargs).run()))
    thread.daemon = True
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the bulk run did not finish"
    return result


def _cli(redis_url: str, *args: str) -> int:
    """`pagedq bulk ARGS` in this process (it installs a SIGTERM handler: put back after)."""
    handler = signal.getsignal(signal.SIGTERM)
    try:
        return main(["bulk", *args, "--redis", redis_url, "--no-progress"])
    finally:
        signal.signal(signal.SIGTERM, handler)


def test_lines_split_on_newline_only(redis_url, r, tmp_path):
    inp, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    prompts = {
        f"s{i}": f"a{sep}b" for i, sep in enumerate(["\u2028", "\u2029", "\x85", "\x1c", "\x1d", "\x1e", "\x0c"])
    }
    lines = [_line(cid, p) for cid, p in prompts.items()]
    prompts["cr"] = "bare carriage return"  # a "\r" is JSON whitespace: text files' universal newlines split on it
    lines.append('{"custom_id": "cr",\r"prompt": "bare carriage return", "max_tokens": 3, "temperature": 0}')
    inp.write_bytes("\r\n".join(lines).encode())
    assert len(inp.read_text(encoding="utf-8").splitlines()) > len(prompts)  # what str.splitlines made of it
    assert BulkRun(r, inp, out, err, progress=False).total_lines == len(prompts)
    with worker_thread(StubEngine(), redis_url):
        counts = _run(r, inp, out, err)
    assert (counts["completed"], counts["errors"]) == (len(prompts), 0) and err.read_text() == ""
    assert _texts(out) == {cid: _answer(p) for cid, p in prompts.items()}


@pytest.mark.abuse
def test_an_output_that_is_the_input_is_refused_before_anything_is_touched(redis_url, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    content = (_line("a", "x") + "\n" + _line("b", "y")).encode()  # its last line has no newline
    inp.write_bytes(content)
    (tmp_path / "link.jsonl").symlink_to(inp)
    os.link(inp, tmp_path / "hard.jsonl")
    cases = [
        [str(inp), str(inp)],
        [str(inp), str(tmp_path / "link.jsonl")],
        [str(inp), str(tmp_path / "hard.jsonl")],
        [str(inp), str(tmp_path / "out.jsonl"), "--errors", str(tmp_path / "hard.jsonl")],
    ]
    for args in cases:
        assert _cli(redis_url, *args) == 2, args
        assert "is the same file as the input" in capsys.readouterr().err
    assert inp.read_bytes() == content and not (tmp_path / "out.jsonl").exists()
    assert Redis.from_url(redis_url).dbsize() == 0  # nothing enqueued either


@pytest.mark.abuse
def test_a_file_the_run_did_not_create_keeps_its_last_line(redis_url, r, tmp_path):
    inp, err = tmp_path / "in.jsonl", tmp_path / "err.jsonl"
    inp.write_text(_line("a", "alpha") + "\n" + _line("b", "beta") + "\n")
    notes, target = tmp_path / "notes.txt", tmp_path / "target.txt"
    notes.write_text("my notes\nthe last line, no newline")
    target.write_text("kept\nalso kept, no newline")
    (tmp_path / "link.jsonl").symlink_to(target)
    with worker_thread(StubEngine(), redis_url):
        for out in (notes, tmp_path / "link.jsonl"):
            assert _run(r, inp, out, err)["completed"] == 2
        own = tmp_path / "own.jsonl"
        _run(r, inp, own, tmp_path / "own.errors.jsonl")
        own.write_bytes(own.read_bytes() + b'{"id": "batch_req_bulk.')  # killed mid-write: this run's own file
        again = _run(r, inp, own, tmp_path / "own.errors.jsonl")
    assert notes.read_text().startswith("my notes\nthe last line, no newline\n")
    assert target.read_text().startswith("kept\nalso kept, no newline\n")
    assert _texts(tmp_path / "own.jsonl") == {"a": _answer("alpha"), "b": _answer("beta")}  # its partial line cut
    assert again["skipped"] == 2


@pytest.mark.abuse
def test_a_run_id_reused_on_another_input_is_refused_and_never_adopts_its_results(redis_url, r, tmp_path, capsys):
    alice, bob = tmp_path / "alice.jsonl", tmp_path / "bob.jsonl"
    alice.write_text(_line("awaited", "alice's secret question") + "\n")
    bob.write_text(_line("awaited", "bob's question") + "\n")
    with worker_thread(StubEngine(), redis_url):
        assert _cli(redis_url, str(alice), str(tmp_path / "a.jsonl"), "--run-id", "shared") == 0
        assert _cli(redis_url, str(bob), str(tmp_path / "b.jsonl"), "--run-id", "shared") == 2
        assert "belongs to another input" in capsys.readouterr().err
        assert not (tmp_path / "b.jsonl").exists()
        r.delete(KEYS.bulk_run("shared"))  # the run's record expired (--ttl): its job ids still differ from bob's
        counts = _run(r, bob, tmp_path / "b.jsonl", tmp_path / "b.errors.jsonl", run_id="shared")
    assert counts["enqueued"] == 1 and counts["awaited"] == 0
    assert _texts(tmp_path / "b.jsonl") == {"awaited": _answer("bob's question")}
    assert _texts(tmp_path / "a.jsonl") == {"awaited": _answer("alice's secret question")}


def test_results_that_expired_before_a_resume_run_again(redis_url, r, tmp_path):
    inp, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    prompts = {f"c{i}": f"prompt {i}" for i in range(4)}
    inp.write_text("".join(_line(cid, p) + "\n" for cid, p in prompts.items()))
    with worker_thread(StubEngine(), redis_url):
        _run(r, inp, out, err)
        # what a run killed before it wrote its results leaves a day later: the jobs in the run's enqueued set,
        # no line for them, and their final records gone with the result TTL
        out.write_text("")
        r.delete(*r.keys(KEYS.final("*")), *r.keys(KEYS.result("*")))
        counts = _run(r, inp, out, err)
    assert counts["awaited"] == 4 and counts["requeued"] == 4 and counts["completed"] == 4
    assert _texts(out) == {cid: _answer(p) for cid, p in prompts.items()}


@pytest.mark.abuse
def test_forged_output_lines_broken_input_lines_and_a_bad_run_id(redis_url, r, tmp_path, capsys):
    inp, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    good = {"a": "alpha", "b": "beta", "c": "gamma"}
    inp.write_bytes(
        b"\n".join(
            [
                _line("a", "alpha").encode(),
                b'{"custom_id": "bin", "prompt": "\xff\xfe"}',  # not UTF-8
                b"[1, 2]",  # not an object
                _line("b", "beta").encode(),
                b'"text"',
                _line("c", "gamma").encode(),
            ]
        )
        + b"\n"
    )
    run_id = BulkRun(r, inp, out, err, progress=False).run_id
    forged = [
        {"id": "batch_req_bulk.other.0", "custom_id": "a", "response": {}, "error": None},  # not this run's job
        {"id": "batch_req_line_4", "custom_id": "b", "line": 4, "error": {"code": "invalid_request"}},  # line 4 is fine
        {"id": f"batch_req_{job_id_for(run_id, 'x')}", "custom_id": "c", "response": {}},  # another custom_id's job
        [1],
    ]
    out.write_text("".join(json.dumps(f) + "\n" for f in forged) + "\xff not json\n")
    with worker_thread(StubEngine(), redis_url):
        counts = _run(r, inp, out, err)
    assert counts["completed"] == 3 and counts["skipped"] == 0  # no forged line made a request be skipped
    assert {cid: text for cid, text in _texts_after(out, len(forged) + 1).items()} == {
        cid: _answer(p) for cid, p in good.items()
    }
    errors = {e["line"]: e for e in map(json.loads, err.read_text().split("\n")[:-1])}
    assert sorted(errors) == [2, 3, 5] and all(e["error"]["code"] == "invalid_json" for e in errors.values())
    assert "line 2 is not UTF-8" in errors[2]["error"]["message"]
    capsys.readouterr()
    assert _cli(redis_url, str(inp), str(tmp_path / "o2.jsonl"), "--run-id", "bad:id") == 2
    assert "--run-id must be" in capsys.readouterr().err and not (tmp_path / "o2.jsonl").exists()


def _texts_after(path: Path, skip: int) -> dict[str, str]:
    """_texts of the lines after the first `skip` (lines the test put there)."""
    rest = path.read_bytes().split(b"\n")[skip:]
    lines = [json.loads(x) for x in rest if x]
    return {line["custom_id"]: line["response"]["body"]["choices"][0]["text"] for line in lines}
