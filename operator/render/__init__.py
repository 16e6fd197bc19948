"""Pure rendering of a ``KVDriveDeployment`` into the manifests of its children (the runtime's, the router's,
the ``InferencePool``) and what those children share (names, labels, selectors). Imports only ``api``.
"""
