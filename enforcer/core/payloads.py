"""The JSON of the Kubernetes objects that the enforcer reads and writes, as TypedDicts.

Only the fields we use are declared, all optional (`total=False`), as the API server may
leave any of them out. They type what the code reads; they do not validate: data from
outside is checked where it enters (`shapes.check` for the webhook's pods), and readers
of the API's objects still treat a field of the wrong shape as absent.
"""

from __future__ import annotations

from typing import Any, TypedDict

Quantity = str | int | float  # "12Gi", or a bare number


class ObjectMeta(TypedDict, total=False):
    name: str
    generateName: str
    namespace: str
    uid: str
    resourceVersion: str
    labels: dict[str, str]
    annotations: dict[str, str]


# Pods


class EnvVar(TypedDict, total=False):
    name: str
    value: str
    valueFrom: dict[str, Any]


class VolumeMount(TypedDict, total=False):
    name: str
    mountPath: str
    readOnly: bool


class ContainerPort(TypedDict, total=False):
    name: str
    containerPort: int
    protocol: str


class ContainerClaim(TypedDict, total=False):
    name: str  # a claim of the pod (spec.resourceClaims[].name)
    request: str


class ResourceRequirements(TypedDict, total=False):
    limits: dict[str, Quantity]
    requests: dict[str, Quantity]
    claims: list[ContainerClaim]


class PodResourceClaim(TypedDict, total=False):
    name: str
    resourceClaimName: str
    resourceClaimTemplateName: str


class Container(TypedDict, total=False):
    name: str
    image: str
    command: list[str]
    env: list[EnvVar]
    ports: list[ContainerPort]
    volumeMounts: list[VolumeMount]
    resources: ResourceRequirements
    securityContext: dict[str, Any]
    restartPolicy: str
    terminationMessagePolicy: str
    startupProbe: dict[str, Any]


class Volume(TypedDict, total=False):
    name: str
    emptyDir: dict[str, str]
    projected: dict[str, Any]


class PodSpec(TypedDict, total=False):
    containers: list[Container]
    initContainers: list[Container]
    ephemeralContainers: list[Container]
    volumes: list[Volume]
    hostPID: bool
    securityContext: dict[str, Any]
    shareProcessNamespace: bool
    automountServiceAccountToken: bool
    runtimeClassName: str
    restartPolicy: str
    nodeName: str
    resourceClaims: list[PodResourceClaim]


class TerminatedState(TypedDict, total=False):
    exitCode: int
    reason: str


class ContainerState(TypedDict, total=False):
    running: dict[str, Any]
    waiting: dict[str, Any]
    terminated: TerminatedState


class ContainerStatus(TypedDict, total=False):
    name: str
    containerID: str
    state: ContainerState
    restartCount: int
    ready: bool
    image: str


class PodStatus(TypedDict, total=False):
    phase: str
    containerStatuses: list[ContainerStatus]
    initContainerStatuses: list[ContainerStatus]
    ephemeralContainerStatuses: list[ContainerStatus]


class Pod(TypedDict, total=False):
    apiVersion: str
    kind: str
    metadata: ObjectMeta
    spec: PodSpec
    status: PodStatus


# Nodes


class NodeStatus(TypedDict, total=False):
    capacity: dict[str, Quantity]
    allocatable: dict[str, Quantity]


class Node(TypedDict, total=False):
    metadata: ObjectMeta
    status: NodeStatus


# Events


class ObjectReference(TypedDict, total=False):
    apiVersion: str
    kind: str
    namespace: str
    name: str
    uid: str
    fieldPath: str


class EventSource(TypedDict, total=False):
    component: str
    host: str


class Event(TypedDict, total=False):
    metadata: ObjectMeta
    involvedObject: ObjectReference
    reason: str
    message: str
    type: str
    source: EventSource
    reportingComponent: str
    reportingInstance: str
    firstTimestamp: str
    lastTimestamp: str
    count: int


# Admission


class GroupVersionKind(TypedDict, total=False):
    group: str
    version: str
    kind: str


class AdmissionRequest(TypedDict, total=False):
    uid: str
    kind: GroupVersionKind
    operation: str
    subResource: str
    object: object  # checked before it is read as a Pod


class Status(TypedDict):
    code: int
    message: str


class AdmissionResponse(TypedDict, total=False):
    uid: str
    allowed: bool
    patchType: str
    patch: str
    status: Status
    warnings: list[str]  # kubectl prints each as "Warning: ..."


class AdmissionReview(TypedDict, total=False):
    apiVersion: str
    kind: str
    request: AdmissionRequest
    response: AdmissionResponse


class PatchOperation(TypedDict, total=False):
    """One operation of a JSON patch (RFC 6902)."""

    op: str
    path: str
    value: Any
