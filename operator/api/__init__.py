"""The operator's edges as types (bottom layer): the ``KVDriveDeployment`` resource, its spec and status
(pydantic), Kubernetes quantities, the runtime pods' ``/metrics`` as the operator reads them, and the CRD
generated from those types. Pure: no Kubernetes API, no Kopf, no I/O.
"""
