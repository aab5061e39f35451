"""Worker registry: compatibility groups, servability, registration and hash changes."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.router.config import BreakerConfig
from services.router.registry import WorkerRegistry
from services.router.workers import MetadataError, WorkerMetadata
from shared.protocol.pd import Role
from tests.support.fake_worker import FakeWorker, expected_text

ADMIN = {"Authorization": "Bearer admin-secret"}


def _md(role: str, compat_hash: str, mode: str) -> WorkerMetadata:
    return WorkerMetadata.parse({"role": role, "model": {"id": "m"}, "compat_hash": compat_hash,
                                 "transfer_mode": mode,
                                 "kv_endpoint": {"host": "127.0.0.1", "port": 7001}})


def test_groups_pair_only_within_one_hash():
    reg = WorkerRegistry(BreakerConfig())
    reg.add("http://p:1", Role.PREFILL).mark_healthy(_md("prefill", "H-push", "push"))
    reg.add("http://d:1", Role.DECODE).mark_healthy(_md("decode", "H-pull", "pull"))
    groups = {g.compat_hash: g for g in reg.groups()}
    assert set(groups) == {"H-push", "H-pull"} and not reg.servable_groups()
    assert groups["H-push"].reason.endswith("prefill prefill-0 but no decode worker")
    assert groups["H-pull"].reason.endswith("decode decode-0 but no prefill worker")
    reg.add("http://d:2", Role.DECODE).mark_healthy(_md("decode", "H-push", "push"))
    (servable,) = reg.servable_groups()
    assert servable.compat_hash == "H-push" and servable.decode == ("decode-1",)


def test_unhealthy_members_make_a_group_unservable_with_a_reason():
    reg = WorkerRegistry(BreakerConfig())
    reg.add("http://p:1", Role.PREFILL).mark_healthy(_md("prefill", "H", "pull"))
    decode = reg.add("http://d:1", Role.DECODE)
    decode.mark_healthy(_md("decode", "H", "pull"))
    decode.mark_unhealthy("gone")
    (group,) = reg.groups()
    assert not group.servable and "no healthy decode worker" in group.reason


def test_worker_kernels_are_relayed_as_reported():
    kernels = {"cpu_tier": "avx2", "max_tier": "avx2", "dense": "avx2", "mxfp4": "portable"}
    reg = WorkerRegistry(BreakerConfig())
    worker = reg.add("http://w:1", Role.MIXED)
    assert worker.describe()["kernels"] == {}  # no metadata yet
    worker.mark_healthy(WorkerMetadata.parse({"role": "mixed", "model": "m", "kernels": kernels}))
    assert worker.describe()["kernels"] == kernels
    # a worker of an older build, without the field, is still a worker
    assert WorkerMetadata.parse({"role": "mixed", "model": "m"}).kernels == {}


def test_mixed_worker_without_hash_gets_its_own_group():
    md = WorkerMetadata.parse({"role": "mixed", "model": {"id": "m", "fingerprint": "f"}})
    assert md.compat_hash.startswith("mixed-")


async def test_incompatible_push_prefill_and_pull_decode_fail_fast_and_say_why(make_mesh):
    mesh = await make_mesh([FakeWorker("prefill", compat_hash="H-push", transfer_mode="push"),
                            FakeWorker("decode", compat_hash="H-pull", transfer_mode="pull")],
                           wait=False, admin_token="admin-secret")
    await mesh.health_round()
    start = time.monotonic()
    resp = await mesh.client.post("/v1/completions", json={"model": "fake-model", "prompt": "x"})
    body = await resp.json()
    assert resp.status == 503 and time.monotonic() - start < 0.5
    assert body["error"]["code"] == "no_servable_group"
    assert "no decode worker" in body["error"]["message"]
    assert "no prefill worker" in body["error"]["message"]
    assert resp.headers["x-should-retry"] == "false"
    assert not any(w.calls for w in mesh.workers)  # no byte went to either worker
    assert (await mesh.client.get("/health")).status == 503
    meta = await mesh.metadata()
    assert not meta["servable"]
    by_hash = {g["compat_hash"]: g for g in meta["groups"]}
    assert by_hash["H-push"]["prefill"] == ["prefill-0"] and by_hash["H-push"]["decode"] == []
    assert by_hash["H-push"]["transfer_mode"] == "push" and not by_hash["H-push"]["servable"]
    assert "no decode worker" in by_hash["H-push"]["reason"]
    workers = {w["id"]: w for w in meta["workers"]}
    assert workers["decode-0"]["compat_hash"] == "H-pull"
    assert workers["prefill-0"]["compat_factors"]["transfer_mode"] == "push"

    # A compatible decode registered later makes the push group servable.
    late = await FakeWorker("decode", compat_hash="H-push", transfer_mode="push").start()
    mesh.workers.append(late)
    resp = await mesh.client.post("/workers", json={"url": late.url, "role": "decode"},
                                  headers=ADMIN)
    job = await resp.json()
    assert resp.status == 202 and job["state"] == "pending"
    await _wait_job(mesh, job["job_id"], "succeeded")
    assert (await mesh.client.get("/health")).status == 200
    meta = await mesh.metadata()
    assert meta["servable"] and {g["compat_hash"]: g["servable"] for g in meta["groups"]} == {
        "H-push": True, "H-pull": False}


async def _wait_job(mesh, job_id, state):
    for _ in range(100):
        doc = await (await mesh.client.get(f"/workers/jobs/{job_id}")).json()
        if doc["state"] != "pending":
            assert doc["state"] == state, doc
            return doc
        await asyncio.sleep(0.02)
    raise AssertionError("job never finished")


async def test_registration_refuses_another_model_and_needs_the_admin_token(make_mesh):
    mesh = await make_mesh([FakeWorker("prefill"), FakeWorker("decode")], admin_token="admin-secret")
    other = await FakeWorker("decode", model="other-model").start()
    mesh.workers.append(other)
    resp = await mesh.client.post("/workers", json={"url": other.url})
    assert resp.status == 401
    resp = await mesh.client.post("/workers", json={"url": other.url}, headers=ADMIN)
    doc = await _wait_job(mesh, (await resp.json())["job_id"], "failed")
    assert "other-model" in doc["error"]
    assert len((await (await mesh.client.get("/workers")).json())["workers"]) == 2
    resp = await mesh.client.post("/workers", json={"url": "ftp://x"}, headers=ADMIN)
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "url"


async def test_admin_changes_fail_closed_without_a_token(make_mesh):
    mesh = await make_mesh([FakeWorker("prefill"), FakeWorker("decode")])
    resp = await mesh.client.post("/workers", json={"url": "http://127.0.0.1:1"}, headers=ADMIN)
    assert resp.status == 403 and (await resp.json())["error"]["code"] == "admin_disabled"
    assert (await mesh.client.delete("/workers/decode-0", headers=ADMIN)).status == 403


async def test_delete_worker_makes_the_mesh_unservable(make_mesh):
    mesh = await make_mesh([FakeWorker("prefill"), FakeWorker("decode")], admin_token="admin-secret")
    resp = await mesh.client.delete("/workers/decode-0", headers=ADMIN)
    assert resp.status == 200 and (await resp.json())["removed"]
    assert (await mesh.client.delete("/workers/decode-0", headers=ADMIN)).status == 404
    resp = await mesh.client.post("/v1/completions", json={"model": "fake-model", "prompt": "x"})
    assert resp.status == 503


async def test_a_worker_whose_hash_changes_moves_group_at_its_next_check(make_mesh):
    mesh = await make_mesh([FakeWorker("prefill"), FakeWorker("decode"), FakeWorker("decode")])
    body = {"model": "fake-model", "prompt": "hash move", "max_tokens": 3}
    mesh.workers[1].compat_hash = "hash-b"  # decode-0 was upgraded: incompatible now
    await mesh.health_round()
    meta = await mesh.metadata()
    groups = {g["compat_hash"]: g for g in meta["groups"]}
    assert groups["hash-a"]["decode"] == ["decode-1"] and groups["hash-b"]["decode"] == ["decode-0"]
    assert not groups["hash-b"]["servable"]
    for _ in range(4):
        resp = await mesh.client.post("/v1/completions", json=body)
        assert (await resp.json())["choices"][0]["text"] == expected_text(body)
    assert not mesh.workers[1].calls and len(mesh.workers[2].calls) == 4


async def test_unreachable_worker_is_unhealthy_with_reason(make_mesh):
    mesh = await make_mesh([FakeWorker("prefill"), FakeWorker("decode")])
    mesh.workers[1].metadata_status = 503
    await mesh.health_round()
    meta = await mesh.metadata()
    decode = next(w for w in meta["workers"] if w["id"] == "decode-0")
    assert decode["health"] == "unhealthy" and "503" in decode["reason"]
    assert (await mesh.client.get("/health")).status == 503
    resp = await mesh.client.post("/v1/completions", json={"model": "fake-model", "prompt": "x"})
    assert resp.status == 503 and resp.headers["x-should-retry"] == "true"
    assert (await mesh.client.get("/live")).status == 200


def test_malformed_metadata_is_a_metadata_error():
    for doc in ([], {"role": "prefill", "model": "m"}, {"role": "chef", "model": "m"},
                {"role": "mixed", "model": "m", "load": {"num_running": "many"}},
                {"role": "decode", "model": {"id": "m"}, "compat_hash": "h",
                 "kv_endpoint": {"port": "x"}}):
        with pytest.raises(MetadataError):
            WorkerMetadata.parse(doc)


def test_a_push_prefill_without_a_kv_endpoint_is_a_metadata_error():
    """The router gives the decode leg the prefill's KV address: a push prefill must report it
    (a pull prefill puts it in each response, so it need not)."""
    base = {"role": "prefill", "model": "m", "compat_hash": "h", "transfer_mode": "push"}
    with pytest.raises(MetadataError, match="KV endpoint"):
        WorkerMetadata.parse(base)
    with pytest.raises(MetadataError, match="KV endpoint"):
        WorkerMetadata.parse({**base, "kv_endpoint": {"host": "10.0.0.1"}})
    meta = WorkerMetadata.parse({**base, "kv_endpoint": {"host": "10.0.0.1", "port": 7001}})
    assert (meta.kv_host, meta.kv_port) == ("10.0.0.1", 7001)
    assert WorkerMetadata.parse({**base, "transfer_mode": "pull"}).kv_port is None
