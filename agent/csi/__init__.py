"""prewarm's CSI node plugin (``prewarm-csi``): cached models as csi volumes, no hostPath.

Pods in namespaces that Pod Security Admission keeps at ``baseline`` or
``restricted`` may not mount hostPath volumes; they may mount csi volumes. This
plugin serves the CSI Identity and Node services on the kubelet's plugin socket
and turns a pod's inline volume (``driver: csi.prewarm.io``, ``volumeAttributes:
{uri: s3://...}``) into the model's snapshot, bound read-only, with a lease the
plugin holds for as long as the pod runs. It is a client of the agent: every
request goes through the socket of the pod's tenant ([[csi.tenants]]).
"""

from agent.csi.node import CsiNode, serving_csi

__all__ = ["CsiNode", "serving_csi"]
