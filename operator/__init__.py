"""KVDrive Kubernetes operator (import name ``kvdrive.operator``).

Owns the reconciliation of ``KVDriveDeployment`` custom resources into runtime pods.
It never imports torch or the runtime's internals, so its image stays small.
"""

__version__ = "0.1.0"
