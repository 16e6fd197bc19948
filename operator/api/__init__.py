"""The operator's edges as types (bottom layer): the ``KVDriveDeployment`` resource, its spec and status
(pydantic, the one source ``scripts/gen_crd.py`` generates the CRD from), Kubernetes quantities, and the
runtime pods' ``/metrics`` as the operator reads them. Pure: no Kubernetes API, no Kopf, no I/O.
"""
