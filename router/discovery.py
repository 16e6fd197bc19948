"""Where the replicas are: a fixed ``--backend`` list, or the ready endpoints of a Service's EndpointSlices
(``discovery.k8s.io/v1``, labelled ``kubernetes.io/service-name``), listed every few seconds with the
official client, from the pod's service account or a kubeconfig."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("kvdrive.router")


@dataclass(frozen=True)
class StaticDiscovery:
    urls: tuple[str, ...]

    def __call__(self) -> list[str]:
        return list(self.urls)


class EndpointSliceDiscovery:
    """Ready endpoints of ``service`` in ``namespace``, as ``http://<address>:<port>``. The port is the
    slice's port named ``port_name`` when there is one, else ``port``."""

    def __init__(self, service: str, namespace: str, port: int, port_name: str | None = None,
                 kubeconfig: str | None = None) -> None:
        from kubernetes import client, config

        if kubeconfig:
            api_client = config.new_client_from_config(config_file=kubeconfig)
        else:
            config.load_incluster_config()
            api_client = client.ApiClient()
        self._api = client.DiscoveryV1Api(api_client)
        self.service, self.namespace, self.port, self.port_name = service, namespace, port, port_name

    def __call__(self) -> list[str]:
        slices = self._api.list_namespaced_endpoint_slice(
            self.namespace, label_selector=f"kubernetes.io/service-name={self.service}", _request_timeout=5)
        urls: list[str] = []
        for sl in slices.items:
            port = next((p.port for p in sl.ports or [] if self.port_name and p.name == self.port_name), self.port)
            for ep in sl.endpoints or []:
                ready = ep.conditions.ready if ep.conditions is not None else None
                if ready is False or not ep.addresses:
                    continue  # ready None means unknown: treated as ready, as kube-proxy does
                host = ep.addresses[0]
                urls.append(f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}")
        return sorted(set(urls))


Discovery = Callable[[], list[str]]
