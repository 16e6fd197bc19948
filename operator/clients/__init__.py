"""The operator's doors to the outside: the Kubernetes API (``kubeclient``) and how it logs in (``login``),
the runtime pods' HTTP (``podclient``), and the operator's own ``/metrics`` endpoint (``opmetrics``). They
know nothing of how a CR is reconciled.
"""
