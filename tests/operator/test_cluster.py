"""Against a real API server (kind, any cluster): the CRD's schema and CEL rules, and children via dry run.

Marked ``cluster``; skipped unless KUBECONFIG names a cluster. Needs rights to install CRDs.
"""

from __future__ import annotations

import copy
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from crdcheck import load_crd, load_example

from kvdrive.operator.manifests import render
from kvdrive.operator.spec import parse_cr

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="needs a real cluster via KUBECONFIG"),
]


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    from kubernetes import client, config, dynamic

    config.load_kube_config()
    api = dynamic.DynamicClient(client.ApiClient())
    crds = api.resources.get(api_version="apiextensions.k8s.io/v1", kind="CustomResourceDefinition")
    crds.server_side_apply(body=load_crd(), name=load_crd()["metadata"]["name"], field_manager="kvdrive-tests", force_conflicts=True)
    namespaces = api.resources.get(api_version="v1", kind="Namespace")
    namespace = f"kvdrive-test-{uuid.uuid4().hex[:6]}"
    namespaces.create(body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    api.test_namespace = namespace  # type: ignore[attr-defined]
    try:
        yield api
    finally:
        namespaces.delete(name=namespace)


def _cr(api: Any) -> Any:
    import time

    for _ in range(30):  # the CRD needs a moment to be served
        try:
            return api.resources.get(api_version="kvdrive.io/v1alpha1", kind="KVDriveDeployment")
        except Exception:
            time.sleep(1)
            api.resources.invalidate_cache()
    raise AssertionError("the CRD is not served")


def _with(doc: dict[str, Any], **spec: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    doc["spec"].update(spec)
    return doc


@pytest.mark.parametrize("example", ["minimal.yaml", "full.yaml", "fixed-replicas.yaml"])
def test_examples_are_accepted_by_the_api_server(client: Any, example: str) -> None:
    doc = load_example(example)
    doc["metadata"]["namespace"] = client.test_namespace
    _cr(client).create(body=doc, namespace=client.test_namespace, dry_run="All")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"replicas": 2}, "spec.replicas must not be set"),
        ({"tiers": {"dram": {"size": "3Mi"}}}, "whole number of hugepages"),
        ({"autoscaling": {"mode": "operator", "minReplicas": 9, "maxReplicas": 8}}, "minReplicas must not exceed"),
        ({"attention": {"tokenBudget": 100, "pageSize": 16}}, "multiple of"),
        ({"tiers": {"ssd": {"size": "0"}}}, "greater than zero"),
    ],
)
def test_cel_rules_reject_on_the_api_server(client: Any, spec: dict[str, Any], message: str) -> None:
    from kubernetes.dynamic.exceptions import UnprocessableEntityError

    doc = _with(load_example("full.yaml"), **spec)
    doc["metadata"]["namespace"] = client.test_namespace
    with pytest.raises(UnprocessableEntityError) as info:
        _cr(client).create(body=doc, namespace=client.test_namespace, dry_run="All")
    assert message in str(info.value.body)


def test_rendered_children_pass_server_dry_run(client: Any) -> None:
    doc = load_example("full.yaml")
    doc["metadata"]["namespace"] = client.test_namespace
    for child in render(parse_cr(doc), "token"):
        resource = client.resources.get(api_version=child["apiVersion"], kind=child["kind"])
        resource.create(body=child, namespace=client.test_namespace, dry_run="All")
