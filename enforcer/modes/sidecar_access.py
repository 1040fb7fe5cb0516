"""How a sidecar learns its pod and posts its Events (`--api-access`).

- `agent` (the default): through the node agent's socket, which it holds anyway for the
  usage. The agent pushes the pod (its containers and their IDs, and with DRA its claims
  and the node's slices) on every change its one watch of the node sees, proven from the
  sidecar's own cgroup, and posts the sidecar's reports as Events on that pod. The sidecar
  makes no API request, needs no RBAC, and never loads the `kubernetes` client.
- `direct`: with the pod's ServiceAccount, as sidecars of 0.1.0 did: a pod watcher
  thread, the claims read after each read of the pod, and an Event recorder thread. The
  `kubernetes` client is imported only here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from enforcer.core.dra import DraObjects
from enforcer.core.payloads import ObjectReference, Pod
from enforcer.core.pod import ContainerRef, pod_reference
from enforcer.core.protocol import EventRequest
from enforcer.core.settings.sidecar import SidecarSettings
from enforcer.core.sidecar_report import POD_WATCHER_LOOP
from enforcer.edge.agent_link import AgentLink
from enforcer.edge.telemetry import SidecarTelemetry

if TYPE_CHECKING:
    from enforcer.edge.events import EventRecorder

log = logging.getLogger(__name__)


class PodView(Protocol):
    """The pod as last known: None before it is; `error` says why it may be out of date."""

    @property
    def pod(self) -> Pod | None: ...

    @property
    def error(self) -> str | None: ...

    def refresh(self) -> None:
        """Ask for the pod again soon (a process of a container it does not list yet)."""


class EventSink(Protocol):
    def post(
        self, reason: str, message: str, warning: bool, container: ContainerRef | None = None
    ) -> None:
        """Post a report as an Event on the pod (the container's, when one is given)."""


@dataclass
class PodAccess:
    pod: PodView
    claims: Callable[[], DraObjects | None]
    events: EventSink
    helpers: list[threading.Thread] = field(default_factory=list)  # to start, and to watch
    close: Callable[[], None] = lambda: None


class PodFromAgent:
    """The pod as the node agent last pushed it with the usage.

    What was last known is kept, and enforced on, while the agent is away or cannot tell
    (it restarted and has not listed the node's pods yet); `error` then says why.
    """

    def __init__(self, link: AgentLink) -> None:
        self._link = link
        self._seen = -1
        self._pod: Pod | None = None
        self._objects: DraObjects | None = None
        self._error: str | None = "the node agent has not sent this pod yet"
        self._said: str | None = None  # the problems last logged ("": none)

    def _update(self) -> None:
        if self._link.pod_replies == self._seen:
            return
        self._seen = self._link.pod_replies
        reply = self._link.pod_reply
        if reply is None:
            return
        if reply.pod is not None:
            self._pod = reply.pod
        if reply.dra is not None:
            self._objects = reply.dra
        self._error = reply.problem
        problems = "; ".join(p for p in (reply.problem, reply.dra_problem) if p)
        if problems != self._said:
            if problems:
                log.warning("the node agent says: %s; enforcing with what was last known", problems)
            elif reply.pod is not None:
                log.info("the node agent sent this pod")
            self._said = problems

    @property
    def pod(self) -> Pod | None:
        self._update()
        return self._pod

    @property
    def objects(self) -> DraObjects | None:
        self._update()
        return self._objects

    @property
    def error(self) -> str | None:
        self._update()
        if self._link.fileno() is None:
            return "the node agent is not connected"
        return self._error

    def refresh(self) -> None:
        """Nothing to ask: the agent pushes every change of the pod."""


class AgentEvents:
    """Reports handed to the agent, which posts them on the pod it proved is ours."""

    def __init__(self, link: AgentLink) -> None:
        self._link = link

    def post(
        self, reason: str, message: str, warning: bool, container: ContainerRef | None = None
    ) -> None:
        name = container.name if container is not None else None
        self._link.send_event(EventRequest(reason, message, warning, name))


def through_agent(link: AgentLink) -> PodAccess:
    view = PodFromAgent(link)
    return PodAccess(view, lambda: view.objects, AgentEvents(link))


def about(settings: SidecarSettings, container: ContainerRef | None = None) -> ObjectReference:
    return pod_reference(settings.namespace, settings.pod_name, settings.pod_uid, container)


class RecordedEvents:
    """Reports posted by the sidecar itself (`direct`), through the recorder's thread."""

    def __init__(self, recorder: EventRecorder, settings: SidecarSettings) -> None:
        self._recorder = recorder
        self._settings = settings

    def post(
        self, reason: str, message: str, warning: bool, container: ContainerRef | None = None
    ) -> None:
        self._recorder.record(about(self._settings, container), reason, message, warning)


class NoApi(Exception):
    """The API cannot even be configured (no in-cluster config, a bad kubeconfig)."""


def direct(settings: SidecarSettings, telemetry: SidecarTelemetry) -> PodAccess:
    from enforcer.edge.claims import ClaimReader, ClaimState  # noqa: PLC0415 - only here
    from enforcer.edge.events import EventRecorder  # noqa: PLC0415
    from enforcer.edge.kube import KubeError, connect  # noqa: PLC0415
    from enforcer.edge.pod_watcher import PodWatcher  # noqa: PLC0415

    try:
        api = connect(settings.kubeconfig)
    except KubeError as exc:
        raise NoApi(str(exc)) from exc
    claims = None
    if settings.dra is not None:  # the claims are read after each read of the pod
        claims = ClaimState(ClaimReader(api, settings.node_name))
    # A "container"-mode sidecar watches the other containers' states to know when to exit.
    period = 2.0 if settings.sidecar_mode == "container" else 30.0
    watcher = PodWatcher(
        api,
        settings.namespace,
        settings.pod_name,
        period=period,
        on_read=claims.refresh if claims is not None else None,
        unexpected=telemetry.unexpected.labels(POD_WATCHER_LOOP),
    )
    recorder = EventRecorder(api, settings.pod_name, settings.node_name, telemetry.event_failures)

    def close() -> None:
        watcher.stop.set()
        watcher.refresh()
        recorder.close()

    return PodAccess(
        watcher,
        lambda: claims.objects if claims is not None else None,
        RecordedEvents(recorder, settings),
        [watcher, recorder],
        close,
    )
