"""Pure decisions from what was observed: the CR's conditions, the live tuner's concurrency limits, the
autoscaler's replica count and how the live loop reports them. Imports ``render`` and ``api``, never a client.
"""
