"""What acts on the cluster: the Kopf handlers, the reconciler, the live loop and the pruning of children a
CR no longer wants; the only layer that joins the clients to the pure layers below.
"""
