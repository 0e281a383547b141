"""The endpoints client libraries call beyond completions (issue 35, item 6): GET /v1/models/{id}, GET /v1/files and
GET /v1/batches with OpenAI's cursor pagination, each caller seeing only its own objects, and DELETE /v1/files/{id}'s
shape. The openai SDK and raw HTTP against a stub worker, a gateway with two tenants' keys and a plain key, and a
real Redis."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from openai.types import FileDeleted

from pagedq.worker.protocol.keys import QueueKeys

from .conftest import wait_for
from .test_tenancy import PLAIN, TENANTS, _requests, tenants_gateway

KEYS = QueueKeys()


def _error(base: str, key: str, path: str, status: int, **params) -> dict:
    response = httpx.get(base + path, headers={"Authorization": f"Bearer {key}"}, params=params, timeout=10)
    assert response.status_code == status, (path, response.status_code, response.text)
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return body


def test_a_served_model_is_retrieved_by_id_and_an_unknown_one_is_openais_404(redis_url):
    with tenants_gateway(redis_url) as gw:
        wait_for(lambda: gw.a.models.list().data, timeout=20, what="a live worker")
        model = gw.a.models.retrieve("stub")
        assert (model.id, model.object, model.owned_by) == ("stub", "model", "pagedq")
        assert model.created == gw.a.models.list().data[0].created
        with pytest.raises(openai.NotFoundError) as caught:
            gw.b.models.retrieve("gpt-4o")
        assert caught.value.code == "model_not_found" and caught.value.param == "model"
        assert "'gpt-4o' is not served here (served: stub)" in caught.value.message
        # a model id may be a path (a worker's checkpoint folder): the route takes slashes
        body = _error(gw.base, "key-a", "/models/org/name", 404)
        assert body["type"] == "not_found_error" and "'org/name'" in body["message"]
        assert _error(gw.base, "no-such-key", "/models/stub", 401)["type"] == "authentication_error"


def test_files_list_pages_through_the_callers_own_files_only(redis_url):
    with tenants_gateway(redis_url) as gw:
        uploads = []
        for i in range(5):
            uploads.append(gw.a.files.create(file=(f"a{i}.jsonl", _requests(f"a{i}")), purpose="batch").id)
            time.sleep(0.002)  # distinct creation instants: the listing's order is theirs
        theirs = gw.b.files.create(file=("b.jsonl", _requests("b")), purpose="batch").id
        batch = gw.a.batches.create(input_file_id=uploads[0], endpoint="/v1/completions", completion_window="24h")
        done = wait_for(
            lambda: (b := gw.a.batches.retrieve(batch.id)).status == "completed" and b, timeout=20, what="batch"
        )
        outputs = {done.output_file_id, done.error_file_id}

        first = gw.a.files.list(limit=2)
        assert len(first.data) == 2 and first.has_more is True
        everything = list(gw.a.files.list(limit=2))  # the SDK's auto-pagination: `after` the last id of each page
        assert len(everything) == 7 and len({f.id for f in everything}) == 7
        assert {f.id for f in everything} == set(uploads) | outputs
        assert [f.id for f in everything if f.purpose == "batch"] == uploads[::-1]  # newest first by default
        assert [f.id for f in gw.a.files.list(purpose="batch", order="asc", limit=3)] == uploads
        output = next(f for f in everything if f.id == done.output_file_id)
        assert output.purpose == "batch_output" and output.bytes == len(gw.a.files.content(output.id).content)
        assert [f.id for f in gw.b.files.list()] == [theirs]
        assert list(gw.plain.files.list()) == []

        raw = httpx.get(gw.base + "/files", headers={"Authorization": "Bearer key-a"}, params={"limit": 3}).json()
        assert set(raw) == {"object", "data", "first_id", "last_id", "has_more"} and raw["object"] == "list"
        assert (raw["first_id"], raw["last_id"]) == (raw["data"][0]["id"], raw["data"][-1]["id"])

        deleted = gw.a.files.delete(uploads[1])  # OpenAI's shape: {"id", "object": "file", "deleted": true}
        assert isinstance(deleted, FileDeleted) and (deleted.id, deleted.object, deleted.deleted) == (
            uploads[1],
            "file",
            True,
        )
        gw.r.delete(KEYS.file(uploads[2]))  # gone under the index (as a file that expired)
        walked = [f.id for f in gw.a.files.list(purpose="batch", order="asc", limit=1)]  # a page at a time
        assert walked == [uploads[0], uploads[3], uploads[4]]
        assert {f.id for f in gw.a.files.list(purpose="batch")} == {uploads[0], uploads[3], uploads[4]}
        index = KEYS.owner_file_index(f"tenant:{TENANTS['key-a']}")
        assert {m.decode() for m in gw.r.zrange(index, 0, -1)} == {uploads[0], uploads[3], uploads[4]} | outputs

        # another owner's id, or an unknown one, is no cursor: a 400 naming `after`
        assert _error(gw.base, "key-a", "/files", 400, after=theirs)["param"] == "after"
        assert _error(gw.base, "key-a", "/files", 400, limit=10_001)["param"] == "limit"
        assert _error(gw.base, "key-a", "/files", 400, order="sideways")["param"] == "order"


def test_expired_files_and_batches_leave_the_owners_index(redis_url):
    with tenants_gateway(redis_url) as gw:
        kept = gw.a.files.create(file=("kept.jsonl", _requests("k")), purpose="batch").id
        old = gw.a.files.create(file=("old.jsonl", _requests("o")), purpose="batch").id
        index = KEYS.owner_file_index(f"tenant:{TENANTS['key-a']}")
        gw.r.zadd(index, {old: int(time.time() * 1000) - 1})  # its expiry passed (its hash would be gone too)
        assert [f.id for f in gw.a.files.list()] == [kept]
        assert [m.decode() for m in gw.r.zrange(index, 0, -1)] == [kept]
        assert gw.r.pttl(index) > 0  # the index itself expires with its longest-lived file


def test_batches_list_pages_through_the_callers_own_batches_newest_first(redis_url):
    with tenants_gateway(redis_url) as gw:
        upload = gw.a.files.create(file=("in.jsonl", _requests("x")), purpose="batch").id
        mine = []
        for _ in range(5):
            mine.append(gw.a.batches.create(input_file_id=upload, endpoint="/v1/completions", completion_window="24h"))
            time.sleep(0.002)
        theirs_file = gw.b.files.create(file=("in.jsonl", _requests("y")), purpose="batch").id
        theirs = gw.b.batches.create(input_file_id=theirs_file, endpoint="/v1/completions", completion_window="24h")

        first = gw.a.batches.list(limit=2)
        assert [b.id for b in first.data] == [mine[4].id, mine[3].id] and first.has_more is True
        assert [b.id for b in gw.a.batches.list(limit=2)] == [b.id for b in mine[::-1]]  # auto-pagination
        assert all(b.input_file_id == upload and b.object == "batch" for b in gw.a.batches.list())
        assert [b.id for b in gw.b.batches.list()] == [theirs.id]
        assert list(gw.plain.batches.list()) == []

        raw = httpx.get(gw.base + "/batches", headers={"Authorization": "Bearer key-a"}, params={"limit": 5}).json()
        assert raw["has_more"] is False and (raw["first_id"], raw["last_id"]) == (mine[4].id, mine[0].id)
        assert [b["id"] for b in raw["data"]] == [b.id for b in mine[::-1]]

        gw.r.delete(KEYS.batch(mine[2].id))  # expired under the index
        assert [b.id for b in gw.a.batches.list()] == [mine[4].id, mine[3].id, mine[1].id, mine[0].id]
        assert _error(gw.base, "key-a", "/batches", 400, after=theirs.id)["param"] == "after"
        assert _error(gw.base, "key-a", "/batches", 400, limit=101)["param"] == "limit"
        assert _error(gw.base, PLAIN, "/batches", 400, limit=0)["param"] == "limit"
