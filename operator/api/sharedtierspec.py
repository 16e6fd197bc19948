"""The spec's shared KV tier (pydantic, the CR's edge): ``spec.tiers.shared``, a Valkey or Redis cluster (or
single node) that the user runs and every pod of the CR reads and writes KV pages in.

Owns those fields, their defaults and constraints, and the CEL rules beside the validators that check the
same: where the servers are (``endpoints`` or a ``service``, exactly one), the key namespace, the ACL user,
the Secret holding the password, TLS and its CA bundle, and the time budget of one fetch.
``render.sharedtier`` owns what the pods get from them (``kvdrive serve --shared-tier ...`` and the
Secrets mounted as files). The operator never deploys the store itself.
"""

from __future__ import annotations

import re

from pydantic import ConfigDict, Field, field_validator, model_validator

from kvdrive.operator.api.podsettings import DNS_SUBDOMAIN
from kvdrive.operator.api.specbase import Model, cel, cross, rules

# HOST:PORT: a DNS name or an IPv4 address, and a port 1-65535 (one expression for CEL's RE2 and Python's re)
_LABEL = r"[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?"
_PORT = r"(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})"
ENDPOINT_PATTERN = rf"^{_LABEL}([.]{_LABEL})*:{_PORT}$"  # no backslash: a CEL string would read it as an escape
ENDPOINT_MESSAGE = "each endpoint must be HOST:PORT (a DNS name or an IPv4 address, and a port 1-65535)"
MAX_ENDPOINTS = 64
MAX_ENDPOINT_LENGTH = 253 + 1 + 5  # a DNS name, ":", a port
# the runtime's keys are kvd:<namespace>:<page digest>
KEY_NAMESPACE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
SERVICE_NAME = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"  # a Service's name (RFC 1035 label)
NAMESPACE_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
SECRET_KEY = r"^[-._a-zA-Z0-9]+$"  # a key of a Secret's data
ACL_USER = r"^[A-Za-z0-9._@-]+$"
DEFAULT_PORT = 6379


class ServiceRef(Model):
    """A Service in front of the store's nodes (a cluster's seed: the client learns the others from it)."""

    name: str = Field(pattern=SERVICE_NAME, max_length=63, description="The Service's name.")
    namespace: str | None = Field(default=None, pattern=NAMESPACE_NAME, max_length=63,
                                  description="Its namespace (default: the CR's).")
    port: int = Field(default=DEFAULT_PORT, ge=1, le=65535, description="Its port.")


class PasswordSecretRef(Model):
    """The key of a Secret in the CR's namespace that holds the store's password."""

    name: str = Field(pattern=DNS_SUBDOMAIN, max_length=253, description="The Secret's name (in the CR's namespace).")
    key: str = Field(default="password", pattern=SECRET_KEY, max_length=253,
                     description="The key holding the password (e.g. valkey-password for Bitnami's charts).")


class CaSecretRef(Model):
    """The key of a Secret in the CR's namespace that holds the PEM CA bundle the store's certificates chain to."""

    name: str = Field(pattern=DNS_SUBDOMAIN, max_length=253, description="The Secret's name (in the CR's namespace).")
    key: str = Field(default="ca.crt", pattern=SECRET_KEY, max_length=253,
                     description="The key holding the PEM CA bundle.")


class SharedTls(Model):
    model_config = ConfigDict(**Model.model_config, json_schema_extra=rules(
        cel("!has(self.caSecretRef) || (has(self.enabled) && self.enabled)",
            "spec.tiers.shared.tls.caSecretRef must not be set unless spec.tiers.shared.tls.enabled is true",
            ".caSecretRef")))
    enabled: bool = Field(default=False,
                          description="Connect over TLS (a valkeys:// URL); without caSecretRef the image's CAs are trusted.")
    ca_secret_ref: CaSecretRef | None = Field(default=None,
                                              description=("A Secret's key holding the PEM CA bundle to verify the "
                                                           "servers with (mounted as a file, --shared-tier-ca-file). "
                                                           "Only with enabled: true."))

    @model_validator(mode="after")
    def _ca_needs_tls(self) -> SharedTls:
        if self.ca_secret_ref is not None and not self.enabled:
            raise cross("caSecretRef", "must not be set unless enabled is true")
        return self


class SharedTier(Model):
    """``spec.tiers.shared``: a KV tier every pod of the CR shares, on a Valkey or Redis cluster the user runs."""

    model_config = ConfigDict(**Model.model_config, json_schema_extra=rules(
        cel("!(has(self.endpoints) && has(self.service))",
            "spec.tiers.shared: endpoints and service must not both be set (one names where the servers are)",
            ".service", reason="FieldValueForbidden"),
        cel("has(self.endpoints) || has(self.service)",
            "spec.tiers.shared: one of endpoints or service must be set (where the servers are)",
            reason="FieldValueRequired")))
    endpoints: list[str] | None = Field(default=None, min_length=1, max_length=MAX_ENDPOINTS,
                                        description=("The servers as HOST:PORT (one node, or some or all nodes of a "
                                                     "cluster: the client discovers the rest). Exactly one of "
                                                     "endpoints and service."),
                                        json_schema_extra={
                                            "items": {"description": "HOST:PORT.", "maxLength": MAX_ENDPOINT_LENGTH},
                                            "x-kubernetes-list-type": "set",
                                            **rules(cel(f"self.all(e, e.matches('{ENDPOINT_PATTERN}'))",
                                                        f"spec.tiers.shared.endpoints: {ENDPOINT_MESSAGE}"))})
    service: ServiceRef | None = Field(default=None,
                                       description=("A Service in front of the servers, reached as "
                                                    "NAME.NAMESPACE.svc:PORT. Exactly one of endpoints and service."))
    namespace: str = Field(default="default", pattern=KEY_NAMESPACE_PATTERN, max_length=63,
                           description=("The key namespace: pages are stored as kvd:<namespace>:<page digest> "
                                        "(--shared-tier-namespace). CRs that serve the same model with the same "
                                        "settings may share one to reuse each other's pages; the tenant salt is in "
                                        "the digest either way."))
    user: str | None = Field(default=None, pattern=ACL_USER, max_length=128,
                             description="The ACL user to authenticate as (--shared-tier-user; default: the store's default user).")
    auth_secret_ref: PasswordSecretRef | None = Field(default=None,
                                                      description=("A Secret's key holding the password (mounted as "
                                                                   "a file, --shared-tier-auth-file); none: no "
                                                                   "authentication."))
    tls: SharedTls = Field(default=SharedTls(), description="TLS to the servers.")
    timeout_ms: int = Field(default=500, ge=10, le=10000,
                            description=("Time budget of one fetch in milliseconds (--shared-tier-timeout-ms): a "
                                         "slower answer is a miss, recomputed."))

    @field_validator("endpoints")
    @classmethod
    def _host_ports(cls, endpoints: list[str] | None) -> list[str] | None:
        if endpoints is not None:
            if any(len(e) > MAX_ENDPOINT_LENGTH or not re.fullmatch(ENDPOINT_PATTERN, e) for e in endpoints):
                raise ValueError(ENDPOINT_MESSAGE)
            if len(set(endpoints)) != len(endpoints):
                raise ValueError("endpoints must be unique")
        return endpoints

    @model_validator(mode="after")
    def _one_place(self) -> SharedTier:
        if self.endpoints is not None and self.service is not None:
            raise cross("service", "endpoints and service must not both be set (one names where the servers are)")
        if self.endpoints is None and self.service is None:
            raise ValueError("one of endpoints or service must be set (where the servers are)")
        return self

    def secret_refs(self) -> list[tuple[str, str, str]]:
        """The Secrets the pods mount, as (the field that names it, the Secret's name, its key)."""
        found = []
        if self.auth_secret_ref is not None:
            found.append(("spec.tiers.shared.authSecretRef", self.auth_secret_ref.name, self.auth_secret_ref.key))
        if self.tls.ca_secret_ref is not None:
            found.append(("spec.tiers.shared.tls.caSecretRef", self.tls.ca_secret_ref.name, self.tls.ca_secret_ref.key))
        return found
