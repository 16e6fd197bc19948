"""The CRD on a real kube-apiserver: every example and good variant is accepted, every bad variant is
refused by the server itself with a message naming the field (the CEL rules' cost budget, quantity
library and messages are the server's own), every CEL rule fires at least once, and the schema's
defaults land on the stored object."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from crdcheck import load_crd, load_example, version_schema
from kopfenv import Cluster
from kubernetes.client import ApiException, CustomObjectsApi
from test_crd import BAD_VARIANTS, GOOD, GOOD_VARIANTS, _set, _walk

from kvdrive.operator.act.objects import CR


def _cel_messages() -> set[str]:
    schema = version_schema(load_crd())
    rules = [r for _, sub in _walk(schema) for r in sub.get("x-kubernetes-validations", [])]
    rules += schema.get("x-kubernetes-validations", [])
    return {r["message"] for r in rules}


async def _dry_run(cluster: Cluster, doc: dict[str, Any]) -> str | None:
    """None when the server accepts ``doc`` (dry run), else its refusal message."""
    doc = {**doc, "metadata": {**doc["metadata"], "namespace": cluster.namespace}}

    def call() -> str | None:
        # as kubectl sends it: strict field validation (an unknown field is an error, not a warning)
        api = CustomObjectsApi(cluster.dynamic.client)
        group, version = CR.api_version.split("/")
        try:
            api.create_namespaced_custom_object(group, version, cluster.namespace, CR.plural, doc, dry_run="All",
                                                field_validation="Strict")
        except ApiException as exc:
            assert exc.status in (400, 422), exc  # 400: strict decoding (unknown field)
            return str(json.loads(exc.body)["message"])
        return None
    return await asyncio.to_thread(call)


async def test_examples_and_good_variants_are_accepted(cluster: Cluster) -> None:
    docs = [load_example(name) for name in GOOD] + [_set(load_example(b), f, v) for b, f, v in GOOD_VARIANTS]
    for doc in docs:
        assert await _dry_run(cluster, doc) is None, doc


async def test_every_bad_variant_is_refused_by_the_server_naming_its_field(cluster: Cluster) -> None:
    """One pass over the table (the server is shared, so one test keeps it fast); CEL refusals carry
    their rule's message, and every rule of the CRD is seen to fire."""
    fired: set[str] = set()
    cel = _cel_messages()
    for base, field, value, named, kind in BAD_VARIANTS:
        refusal = await _dry_run(cluster, _set(load_example(base), field, value))
        assert refusal is not None, f"the server accepted {field}={value!r}"
        leaf = named.split(".")[-1]
        assert leaf in refusal or named.rsplit(".", 1)[0] in refusal, (field, refusal)
        if kind == "cel":
            matched = {m for m in cel if m in refusal}
            assert matched, (field, refusal)
            fired |= matched
    assert fired == cel, f"CEL rules never exercised on the server: {sorted(cel - fired)}"


async def test_defaults_are_stored_by_the_server(cluster: Cluster) -> None:
    await cluster.create(CR, load_example("minimal.yaml"))
    stored = await cluster.get(CR, load_example("minimal.yaml")["metadata"]["name"])
    assert stored is not None
    spec = stored["spec"]
    assert spec["tiers"]["dram"] == {"size": "8Gi", "hugePageSize": "2Mi"}
    assert spec["autoscaling"]["mode"] == "none" and "replicas" not in spec
    assert stored["metadata"]["generation"] == 1 and stored["metadata"]["uid"]


@pytest.mark.parametrize("name", GOOD)
async def test_examples_are_stored_as_written(cluster: Cluster, name: str) -> None:
    doc = load_example(name)
    await cluster.create(CR, doc)
    stored = await cluster.get(CR, doc["metadata"]["name"])
    assert stored is not None and stored["spec"]["model"] == {**stored["spec"]["model"], **doc["spec"]["model"]}
