"""Deleting the children a KVDriveDeployment no longer wants (nothing else removes them: the garbage
collector acts only when the CR goes).

Owns two deletions, both of objects this CR controls only: the router's objects when routing is turned
off (its ServiceAccount last, so that reading the ServiceAccount alone tells whether anything is left:
``router_manifests.KINDS``), and the ``InferencePool`` when ``spec.routing.mode`` leaves
``inferencepool`` (for ``prefix`` or ``none``). The pool is looked for only when the router's Service,
as it was before this reconcile applied anything, has the ext_proc port (``inferencepool.serves_ext_proc``):
a CR that was not in mode inferencepool costs no call, and a cluster without the Gateway API Inference
Extension CRDs no discovery round; and the pool goes before the Service loses that port, so a reconcile
cut short finds the same evidence the next time. Called by the reconciler, with its API session.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kvdrive.operator.act.objects import CHILDREN
from kvdrive.operator.api.cr import KVDriveDeployment
from kvdrive.operator.clients.kubeclient import KindNotServed, KubeApi
from kvdrive.operator.render import inferencepool, router_manifests
from kvdrive.operator.render.childmeta import Names, controller_uid

Logger = logging.Logger | logging.LoggerAdapter


async def prune_pool(api: KubeApi, model: KVDriveDeployment, router_service: Mapping[str, Any] | None,
                     logger: Logger) -> None:
    """Mode not inferencepool: delete the InferencePool this CR controls, if the router's Service
    (``router_service``, read before this reconcile's apply) says that one may exist."""
    if inferencepool.enabled(model.spec) or not inferencepool.serves_ext_proc(router_service):
        return
    ref, namespace, name = CHILDREN[inferencepool.KIND], model.metadata.namespace, Names(model.metadata.name).pool
    try:
        found = await api.get(ref, namespace, name)
    except KindNotServed:
        return  # the CRD was removed, and every InferencePool with it
    if found is not None and controller_uid(found) == model.metadata.uid:
        logger.info("routing mode %s: deleting %s %s", model.spec.routing.mode, inferencepool.KIND, name)
        await api.delete(ref, namespace, name)


async def prune_router(api: KubeApi, model: KVDriveDeployment, logger: Logger) -> None:
    """Routing off: delete the router's objects that this CR controls (and first its InferencePool)."""
    if router_manifests.enabled(model.spec):
        return
    namespace, uid, name = model.metadata.namespace, model.metadata.uid, Names(model.metadata.name).router
    account = await api.get(CHILDREN["ServiceAccount"], namespace, name)
    if account is None or controller_uid(account) != uid:
        return
    found = {kind: account if kind == "ServiceAccount" else await api.get(CHILDREN[kind], namespace, name)
             for kind in reversed(router_manifests.KINDS)}
    await prune_pool(api, model, found["Service"], logger)
    for kind, obj in found.items():
        if obj is not None and controller_uid(obj) == uid:
            logger.info("routing off: deleting %s %s", kind, name)
            await api.delete(CHILDREN[kind], namespace, name)
