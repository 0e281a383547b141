"""Files and batches belong to their owner (the API key's tenant, or a plain key): to any other caller they are
missing (404), ids are checked before they reach Redis, each owner has a quota of files and bytes, and nothing of a
batch outlives its objects. Two tenants' keys and a plain key, a real Redis, the openai SDK and raw HTTP."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import openai
import pytest
from redis import Redis

from pagedq.worker.protocol.keys import QueueKeys
from pagedq.worker.testing.stub_engine import StubEngine

from .conftest import gateway_thread, wait_for, worker_thread

KEYS = QueueKeys()
TENANTS = {"key-a": "acme", "key-b": "globex"}
PLAIN = "key-plain"  # an API key with no tenant: its own owner


def _requests(*custom_ids: str, url: str = "/v1/completions") -> bytes:
    lines = [
        {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "stub", "prompt": cid, "max_tokens": 3}}
        for cid in custom_ids
    ]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


@contextlib.contextmanager
def tenants_gateway(redis_url: str, **overrides) -> Iterator[SimpleNamespace]:
    """A stub worker and a gateway with two tenants' keys and a plain key; yields an SDK client per key."""
    with (
        worker_thread(StubEngine(), redis_url, model="stub"),
        gateway_thread(redis_url, api_key_tenants=TENANTS, api_keys=[PLAIN], **overrides) as base,
    ):

        def sdk(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=base, api_key=key, max_retries=0)

        yield SimpleNamespace(base=base, a=sdk("key-a"), b=sdk("key-b"), plain=sdk(PLAIN), r=Redis.from_url(redis_url))


def _finished_batch(sdk: openai.OpenAI, content: bytes):
    upload = sdk.files.create(file=("in.jsonl", content), purpose="batch")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    done = wait_for(
        lambda: (b := sdk.batches.retrieve(batch.id)).status == "completed" and b, timeout=20, what="batch done"
    )
    return upload, done


def _not_found(base: str, key: str, method: str, path: str, **kw) -> dict:
    """The error body of a request that must get a 404 in OpenAI's shape."""
    response = httpx.request(method, base + path, headers={"Authorization": f"Bearer {key}"}, timeout=10, **kw)
    assert response.status_code == 404, (path, response.status_code, response.text)
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "not_found_error"
    return body


@pytest.mark.abuse
def test_another_owner_gets_the_404_of_a_missing_id_for_every_file_and_batch(redis_url):
    with tenants_gateway(redis_url) as gw:
        upload, done = _finished_batch(gw.a, _requests("x", "y"))
        mine = gw.a.files.content(done.output_file_id).text
        never = {"file": "file-" + "0" * 32, "batch": "batch_" + "0" * 32}  # well-formed ids nobody was given
        for key in ("key-b", PLAIN):
            for path, missing in (
                (f"/files/{upload.id}", f"/files/{never['file']}"),
                (f"/files/{upload.id}/content", f"/files/{never['file']}/content"),
                (f"/files/{done.output_file_id}/content", f"/files/{never['file']}/content"),
                (f"/files/{done.error_file_id}", f"/files/{never['file']}"),
                (f"/batches/{done.id}", f"/batches/{never['batch']}"),
            ):
                theirs, nobodys = _not_found(gw.base, key, "GET", path), _not_found(gw.base, key, "GET", missing)
                assert theirs["code"] == nobodys["code"] and theirs["param"] == nobodys["param"]
            cancel = _not_found(gw.base, key, "POST", f"/batches/{done.id}/cancel")
            assert cancel["code"] == "batch_not_found"
            create = {"input_file_id": upload.id, "endpoint": "/v1/completions", "completion_window": "24h"}
            assert _not_found(gw.base, key, "POST", "/batches", json=create)["code"] == "file_not_found"
            assert _not_found(gw.base, key, "DELETE", f"/files/{upload.id}")["code"] == "file_not_found"
        with pytest.raises(openai.NotFoundError):
            gw.b.files.content(done.output_file_id)
        # the owner still has everything, and may start another batch from its file
        again = gw.a.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
        assert gw.a.files.retrieve(upload.id).bytes == len(_requests("x", "y"))
        assert gw.a.files.content(done.output_file_id).text == mine and len(mine.splitlines()) == 2
    assert done.id not in done.output_file_id and done.id not in done.error_file_id  # not derived from the batch id
    assert again.output_file_id != done.output_file_id


@pytest.mark.abuse
def test_the_plain_key_and_each_tenant_are_separate_owners(redis_url):
    with tenants_gateway(redis_url) as gw:
        plain = gw.plain.files.create(file=("p.jsonl", _requests("p")), purpose="batch")
        globex = gw.b.files.create(file=("g.jsonl", _requests("g")), purpose="batch")
        for sdk, other in ((gw.a, plain.id), (gw.a, globex.id), (gw.plain, globex.id), (gw.b, plain.id)):
            with pytest.raises(openai.NotFoundError):
                sdk.files.retrieve(other)
        assert gw.plain.files.retrieve(plain.id).id == plain.id and gw.b.files.retrieve(globex.id).id == globex.id


def test_objects_stored_before_owners_belong_to_the_keyless_gateway_only(redis_url):
    r = Redis.from_url(redis_url)
    legacy_id, content = "file-" + "1" * 32, _requests("old")
    meta = {"id": legacy_id, "object": "file", "bytes": len(content), "purpose": "batch", "filename": "old.jsonl"}
    r.hset(KEYS.file(legacy_id), mapping={"meta": json.dumps(meta), "content": content})  # no owner field
    with gateway_thread(redis_url) as base:
        keyless = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
        assert keyless.files.content(legacy_id).content == content
    with gateway_thread(redis_url, api_key_tenants=TENANTS, api_keys=[PLAIN]) as base:
        for key in (*TENANTS, PLAIN):
            with pytest.raises(openai.NotFoundError):
                openai.OpenAI(base_url=base, api_key=key, max_retries=0).files.content(legacy_id)


@pytest.mark.abuse
def test_ids_outside_the_issued_shape_get_404_not_another_keys_type(redis_url):
    with gateway_thread(redis_url) as base:
        sdk = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
        with worker_thread(StubEngine(), redis_url, model="stub"):
            upload, done = _finished_batch(sdk, _requests("x"))
        # each of these names a key of another type (a list, a set, a string, the stream of jobs) or none
        for path in (
            f"/files/{done.output_file_id}:lines",
            f"/files/{done.output_file_id}:lines/content",
            f"/batches/{done.id}:answered",
            f"/batches/{done.id}:answered/cancel",
            "/files/x",
            "/batches/" + "b" * 5000,
        ):
            method = "POST" if path.endswith("/cancel") else "GET"
            assert _not_found(base, "unused", method, path)["code"] in ("file_not_found", "batch_not_found")
        body = {
            "input_file_id": f"{done.output_file_id}:lines",
            "endpoint": "/v1/completions",
            "completion_window": "24h",
        }
        assert _not_found(base, "unused", "POST", "/batches", json=body)["code"] == "file_not_found"
        assert _not_found(base, "unused", "DELETE", f"/files/{upload.id}:x")["code"] == "file_not_found"


@pytest.mark.abuse
def test_each_owner_has_a_quota_of_files_and_bytes(redis_url):
    with tenants_gateway(redis_url, max_files_per_owner=3, max_file_bytes_per_owner=100) as gw:

        def upload(sdk: openai.OpenAI, size: int):
            return sdk.files.create(file=("f.jsonl", b"x" * size), purpose="batch")

        first, _ = upload(gw.a, 40), upload(gw.a, 40)
        with pytest.raises(openai.RateLimitError) as by_bytes:
            upload(gw.a, 40)
        third = upload(gw.a, 20)  # 100 bytes in 3 files: both quotas met, neither passed
        with pytest.raises(openai.RateLimitError) as by_count:
            upload(gw.a, 0)
        assert upload(gw.b, 100).bytes == 100 and upload(gw.plain, 100).bytes == 100  # other owners: their own
        assert gw.a.files.delete(first.id).deleted
        upload(gw.a, 40)  # the deleted file's room is free again
        # an expired file frees its room too: its key and its quota entry as time would leave them
        gw.r.delete(KEYS.file(third.id))
        gw.r.zadd(KEYS.owner_files("tenant:acme"), {third.id: int(time.time() * 1000) - 1}, xx=True)
        assert upload(gw.a, 20).bytes == 20
        raw = httpx.post(
            gw.base + "/files",
            headers={"Authorization": "Bearer key-a"},
            files={"file": ("f.jsonl", b"x")},
            data={"purpose": "batch"},
            timeout=10,
        )
    for error, quota in ((by_bytes, "max_file_bytes_per_owner"), (by_count, "max_files_per_owner")):
        assert error.value.status_code == 429 and error.value.body["code"] == "file_quota_exceeded"
        assert quota in error.value.body["message"] and error.value.body["param"] == "file"
    assert "80 bytes kept, 40 more asked, at most 100" in by_bytes.value.body["message"]
    assert raw.status_code == 429 and raw.headers["x-should-retry"] == "false"  # waiting does not free a quota


def test_batch_output_expires_with_its_objects(redis_url):
    with tenants_gateway(redis_url, file_ttl_s=60) as gw:
        _, done = _finished_batch(gw.a, _requests("x", "y") + b'{"custom_id": "broken"\n')
        ttl = {name: gw.r.pttl(key) for name, key in _keys_of(done).items()}
        for name, object_key in (("output lines", "output file"), ("error lines", "error file"), ("answered", "batch")):
            assert 0 < ttl[name] <= 60_000 and abs(ttl[name] - ttl[object_key]) < 5_000, ttl
        gw.a.files.delete(done.output_file_id)  # a deleted file takes its lines with it
        deleted = [gw.r.exists(key) for key in (KEYS.file(done.output_file_id), KEYS.file_lines(done.output_file_id))]
    assert done.request_counts.completed == 2 and done.request_counts.failed == 1
    assert deleted == [0, 0]


def test_a_batch_file_keeps_its_size_as_it_grows_so_retrieving_it_reads_no_line(redis_url):
    with tenants_gateway(redis_url) as gw:
        _, done = _finished_batch(gw.a, _requests("x", "y") + b'{"custom_id": "broken"\n')
        lranges = gw.r.info("commandstats").get("cmdstat_lrange", {}).get("calls", 0)
        sizes = [gw.a.files.retrieve(done.output_file_id).bytes, gw.a.files.retrieve(done.error_file_id).bytes]
        assert gw.r.info("commandstats").get("cmdstat_lrange", {}).get("calls", 0) == lranges
        output, errors = gw.a.files.content(done.output_file_id), gw.a.files.content(done.error_file_id)
    assert sizes == [len(output.content), len(errors.content)] and all(sizes)


def _keys_of(batch) -> dict[str, str]:
    return {
        "batch": KEYS.batch(batch.id),
        "answered": KEYS.batch_answered(batch.id),
        "output file": KEYS.file(batch.output_file_id),
        "output lines": KEYS.file_lines(batch.output_file_id),
        "error file": KEYS.file(batch.error_file_id),
        "error lines": KEYS.file_lines(batch.error_file_id),
    }
