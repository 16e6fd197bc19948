"""The operator and the runtime agree: every pod's `kvdrive serve` command line parses with the
runtime's own argument parser, and carries the values of the spec."""

from __future__ import annotations

import pytest
from crdcheck import EXAMPLES, load_example

from kvdrive.operator.api.cr import parse_cr
from kvdrive.operator.render.manifests import render
from kvdrive.runtime.cli import build_parser


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_pod_command_line_is_accepted_by_kvdrive_serve(example: str) -> None:
    doc = load_example(example)
    doc["metadata"] = {**doc["metadata"], "uid": "0b0c8e2e-1111-2222-3333-444455556666"}
    cr = parse_cr(doc)
    sts = next(c for c in render(cr, "t0ken") if c["kind"] == "StatefulSet")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(container["args"])  # SystemExit on any unknown flag
    assert args.command == "serve" and args.port == 8000
    assert args.page_size == cr.spec.attention.page_size and args.token_budget == cr.spec.attention.token_budget
    assert args.served_model_name == cr.spec.model.name
    assert args.admin_token_file and args.ssd_dir
    # the envelope's split: the starting limit and the rows reserved for the tuner's ceiling
    assert args.max_running == cr.spec.concurrency.max_running
    assert args.max_sequences == cr.spec.max_sequences() >= args.max_running
    shared = cr.spec.tiers.shared  # the shared KV tier (full.yaml): its flags as kvdrive serve reads them
    if shared is not None:
        assert args.shared_tier.startswith("valkeys://" if shared.tls.enabled else "valkey://")
        assert (args.shared_tier_namespace, args.shared_tier_user) == (shared.namespace, shared.user)
        assert int(args.shared_tier_timeout_ms) == shared.timeout_ms
        assert bool(args.shared_tier_auth_file) == (shared.auth_secret_ref is not None)
        assert bool(args.shared_tier_ca_file) == (shared.tls.ca_secret_ref is not None)


@pytest.mark.parametrize(("gpus", "device"), [(0, "cpu"), (2, "cuda")])
def test_the_pod_device_flag_is_one_kvdrive_serve_accepts(gpus: int, device: str) -> None:
    doc = load_example("minimal.yaml")
    doc["metadata"] = {**doc["metadata"], "uid": "0b0c8e2e-1111-2222-3333-444455556666"}
    doc["spec"] = {**doc["spec"], "resources": {"gpus": gpus}}
    sts = next(c for c in render(parse_cr(doc), "t0ken") if c["kind"] == "StatefulSet")
    args = build_parser().parse_args(sts["spec"]["template"]["spec"]["containers"][0]["args"])
    assert args.device == device
