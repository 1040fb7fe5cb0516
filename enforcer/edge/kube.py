"""The Kubernetes API: connecting, one call as JSON, and the one retry policy.

Everything goes through the official client's `ApiClient`: its kubeconfig and in-cluster
loading, bearer tokens (re-read when the projected token rotates), TLS and proxies. Objects
are handled as plain JSON, so the pure modules see the same dicts the API server sends.
Writes are JSON patches, but for a pod's condition (a strategic-merge patch: it merges by
`type`, which a JSON patch cannot address).

The generated typed API classes are not used. Importing `CoreV1Api` alone costs about
20 MiB of resident memory (hundreds of pydantic-validated methods), and every object was
turned back into JSON anyway. The sidecar runs in every enforced pod, so this is paid once
per pod. `request()` is the same code path those classes end in.
"""

from __future__ import annotations

import contextlib
import email.utils
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import tenacity
import urllib3.exceptions
import urllib3.util
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

log = logging.getLogger(__name__)

COMPONENT = "vram-enforcer"
NODE = "/api/v1/nodes/{name}"
POD = "/api/v1/namespaces/{namespace}/pods/{name}"
EVENTS = "/api/v1/namespaces/{namespace}/events"
EVICTION = POD + "/eviction"  # policy/v1 Eviction, a subresource of the pod
POD_STATUS = POD + "/status"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"

# Connection problems and the API statuses that a later attempt can fix.
_RETRYABLE_STATUS = frozenset({409, 429, 500, 502, 503, 504})
_NETWORK_ERRORS = (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError, OSError)


class KubeError(Exception):
    """An API failure that retrying will not fix; the message says what to do."""


class KubeConfigError(KubeError):
    """No way to reach the API server was configured."""


class Forbidden(KubeError):
    """RBAC denied a request: which verb on which resource, and how to grant it."""

    def __init__(self, verb: str, resource: str, detail: str) -> None:
        super().__init__(
            f"RBAC forbids '{verb}' on '{resource}': {detail}. Grant it to this "
            "ServiceAccount (see deploy/rbac/ for the minimal roles)"
        )
        self.verb = verb
        self.resource = resource


class NotFound(KubeError):
    """The object does not exist (HTTP 404)."""


class TooManyRequests(KubeError):
    """HTTP 429 after every retry: the API is overloaded, or (an eviction) a
    PodDisruptionBudget does not allow it now."""


class Conflict(KubeError):
    """HTTP 409 after every retry: a precondition failed (a pod of that name now has
    another UID), or the object changed under every try."""


# One owner of retries: `call`'s policy (`retrying`), which knows the caller's deadline.
# urllib3 retries nothing by itself: it would otherwise try a connection up to four times
# inside one of our tries, each with that try's whole timeout, and obey a Retry-After of
# any length, holding the calling thread far past its deadline.
_URLLIB3_RETRIES = False

# The shortest timeout a try is given, however little of its deadline is left (a timeout of
# 0 is none at all to the client).
MIN_TRY_TIMEOUT = 0.1


def api_client(configuration: client.Configuration) -> client.ApiClient:
    """The official client on `configuration`, with our division of retries (see above)."""
    configuration.retries = _URLLIB3_RETRIES
    return client.ApiClient(configuration)


def connect(kubeconfig: str | None = None) -> client.ApiClient:
    """An API client from `kubeconfig`, else in-cluster, else the default kubeconfig."""
    configuration = client.Configuration()
    try:
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
            return api_client(configuration)
        try:
            config.load_incluster_config(client_configuration=configuration)
        except ConfigException:
            config.load_kube_config(client_configuration=configuration)
        return api_client(configuration)
    except (ConfigException, OSError) as exc:
        raise KubeConfigError(
            f"cannot configure the Kubernetes client ({exc}); run in a pod with a "
            "ServiceAccount, or pass --kubeconfig"
        ) from exc


def request(
    api: client.ApiClient,
    method: str,
    path: str,
    *,
    params: dict[str, str] | None = None,
    query: dict[str, str] | None = None,
    body: Any = None,
    timeout: float = 10.0,
    patch: str = JSON_PATCH,
) -> Any:
    """One API call as JSON: `path` has `{name}` placeholders filled (escaped) from `params`,
    and `query` is the query string.

    A PATCH is of the kind `patch` names (a JSON patch unless told). A status outside 2xx
    raises the client's `ApiException`, as its typed methods do. `timeout` bounds the whole
    request, connecting and reading (urllib3 makes one try), so a server that accepts and
    never answers cannot hold a thread.
    """
    headers = {"Accept": "application/json"}
    if body is not None:
        headers["Content-Type"] = patch if method == "PATCH" else "application/json"
    response = _send(api, method, path, params, query, headers, body, timeout)
    data: bytes = response.read()
    if not 200 <= response.status <= 299:
        raise ApiException.from_response(
            http_resp=response, body=data.decode("utf-8", "replace"), data=None
        )
    return json.loads(data) if data else None


def _send(
    api: client.ApiClient,
    method: str,
    path: str,
    params: dict[str, str] | None,
    query: dict[str, str] | None,
    headers: dict[str, str],
    body: Any,
    timeout: float | tuple[float, float],
) -> Any:
    method, url, headers, body, post = api.param_serialize(
        method=method,
        resource_path=path,
        path_params=params,
        query_params=list((query or {}).items()),
        header_params=headers,
        body=body,
        auth_settings=["BearerToken"],
    )
    return api.call_api(method, url, headers, body, post, _request_timeout=timeout)


def watch_error(status: Any) -> ApiException:
    """A watch's ERROR event (a Status object) as the exception a request would raise."""
    code = status.get("code") if isinstance(status, dict) else None
    reason = status.get("message") if isinstance(status, dict) else None
    return ApiException(status=code if isinstance(code, int) else 0, reason=str(reason))


class WatchStream:
    """A watch's events as they arrive (`?watch=true`): one JSON object per line.

    The read timeout is longer than the server's own `timeoutSeconds`, so a connection
    that went silent is noticed; `close()` from another thread ends a blocked read.
    """

    def __init__(self, api: client.ApiClient, path: str, query: dict[str, str], timeout: float):
        headers = {"Accept": "application/json"}
        response = _send(
            api, "GET", path, None, {**query, "watch": "true"}, headers, None, (10.0, timeout)
        )
        if not 200 <= response.status <= 299:
            data = response.read()
            raise ApiException.from_response(
                http_resp=response, body=data.decode("utf-8", "replace"), data=None
            )
        self._raw = response.response  # urllib3's response, not read yet

    def __iter__(self) -> Iterator[dict[str, Any]]:
        pending = b""
        for chunk in self._raw.stream(65536, decode_content=True):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.strip():
                    yield json.loads(line)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._raw.shutdown()
        with contextlib.suppress(Exception):
            self._raw.release_conn()


def is_retryable(exc: BaseException) -> bool:
    if isinstance(exc, ApiException):
        return exc.status in _RETRYABLE_STATUS or exc.status == 0
    return isinstance(exc, _NETWORK_ERRORS)


MAX_RETRY_AFTER = 30.0  # a server that asks for longer is asked again after this long


def retry_after(exc: BaseException | None) -> float | None:
    """Seconds the API server asked us to wait before trying again (Retry-After on a 429 or
    503: API Priority and Fairness, max-in-flight), capped; None when it did not ask."""
    if not isinstance(exc, ApiException) or exc.status not in (429, 503) or not exc.headers:
        return None
    value = str(exc.headers.get("Retry-After") or "").strip()
    if value.isascii() and value.isdigit():  # not "²", which isdigit() admits
        seconds = float(value)
    else:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            return None
        seconds = when.timestamp() - time.time()
    return min(max(seconds, 0.0), MAX_RETRY_AFTER)


class _WaitRetryAfter(tenacity.wait.wait_base):
    """What the server asked for in Retry-After, else `fallback`."""

    def __init__(self, fallback: tenacity.wait.wait_base) -> None:
        self._fallback = fallback

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        outcome = retry_state.outcome
        asked = retry_after(outcome.exception() if outcome is not None else None)
        return asked if asked is not None else float(self._fallback(retry_state))


def retrying(deadline: float) -> tenacity.Retrying:
    """Retry transient failures, pausing as long as Retry-After says (capped), else with
    exponential backoff and jitter; give up rather than pause past `deadline`."""
    backoff = tenacity.wait_exponential(multiplier=0.2, max=10) + tenacity.wait_random(0, 0.5)
    return tenacity.Retrying(
        retry=tenacity.retry_if_exception(is_retryable),
        wait=_WaitRetryAfter(backoff),
        stop=tenacity.stop_before_delay(deadline),
        reraise=True,
        before_sleep=lambda state: log.info(
            "Kubernetes API call failed (%s); retrying",
            _short(state.outcome.exception() if state.outcome else None),
        ),
    )


def _short(exc: BaseException | None) -> str:
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason}"
    return f"{type(exc).__name__}: {exc}"


_VERBS = {"GET": "get", "PATCH": "patch", "POST": "create", "DELETE": "delete"}


# Its keyword arguments are the parts of one request, each optional: a type to group them
# would be read by this function alone.
def call(  # noqa: PLR0913
    api: client.ApiClient,
    method: str,
    path: str,
    resource: str,
    *,
    deadline: float,
    params: dict[str, str] | None = None,
    query: dict[str, str] | None = None,
    body: Any = None,
    timeout: float = 10.0,
    verb: str | None = None,
    patch: str = JSON_PATCH,
) -> Any:
    """`request()` under the retry policy, within `deadline` seconds in all: each try gets
    what is left of it (at most `timeout`, at least MIN_TRY_TIMEOUT) as its own timeout, and
    no pause runs past it. Errors become `KubeError`s that name the RBAC verb (`verb`, else
    the method's) and `resource`; a 403 becomes `Forbidden`. A reply that is not a JSON
    object (a proxy's error page with a 200, a truncated body) is an error of the API like
    any other, never an exception that ends the caller's thread."""
    verb = verb or _VERBS[method]
    ends = time.monotonic() + deadline
    try:
        for attempt in retrying(deadline):
            with attempt:
                left = max(MIN_TRY_TIMEOUT, min(timeout, ends - time.monotonic()))
                reply = request(
                    api,
                    method,
                    path,
                    params=params,
                    query=query,
                    body=body,
                    timeout=left,
                    patch=patch,
                )
                if not isinstance(reply, dict):
                    raise KubeError(
                        f"{verb} {resource} failed: the API server's reply is "
                        f"{type(reply).__name__}, not a JSON object"
                    )
                return reply
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError: a 2xx that is not JSON
        raise KubeError(
            f"{verb} {resource} failed: the API server's reply is not JSON ({exc})"
        ) from exc
    except ApiException as exc:
        if exc.status == 403:
            raise Forbidden(verb, resource, _reason(exc)) from exc
        failed = f"{verb} {resource} failed: {_short(exc)}: {_reason(exc)}"
        if exc.status == 429:
            raise TooManyRequests(failed) from exc
        if exc.status == 409:
            raise Conflict(failed) from exc
        raise (NotFound(failed) if exc.status == 404 else KubeError(failed)) from exc
    except _NETWORK_ERRORS as exc:
        raise KubeError(f"{verb} {resource} failed: the API server is unreachable ({exc})") from exc
    raise AssertionError("unreachable")  # pragma: no cover - tenacity returns or raises


def _reason(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body or "{}").get("message") or exc.reason)
    except (ValueError, AttributeError):
        return str(exc.reason)


def evict(
    api: client.ApiClient, namespace: str, name: str, uid: str, grace: int, deadline: float = 10.0
) -> KubeError | None:
    """Evict the pod (policy/v1 Eviction), as `kubectl drain` does, only if it is still the
    pod of `uid` (a precondition: never a newcomer of the same name), with `grace` seconds
    for its containers to stop (its own `terminationGracePeriodSeconds` otherwise, which
    its author chose); None once the API has accepted it, else the error (a
    PodDisruptionBudget that refuses it now: `TooManyRequests`; the pod gone: `NotFound`,
    or `Conflict` where a newcomer has its name)."""
    body = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": name, "namespace": namespace},
        "deleteOptions": _delete_options(uid, grace),
    }
    return _leave(api, "POST", EVICTION, "pods/eviction", namespace, name, body, deadline)


def delete_pod(
    api: client.ApiClient, namespace: str, name: str, uid: str, grace: int, deadline: float = 10.0
) -> KubeError | None:
    """Delete the pod, whatever its PodDisruptionBudgets, as the kubelet's node-pressure
    eviction stops a pod; only if it is still the pod of `uid`, with `grace` seconds for its
    containers to stop. None once the API has accepted it, else the error (`NotFound`, or
    `Conflict` where a newcomer has its name: either way, that pod is gone)."""
    body = {"apiVersion": "v1", "kind": "DeleteOptions", **_delete_options(uid, grace)}
    return _leave(api, "DELETE", POD, "pods", namespace, name, body, deadline)


def _delete_options(uid: str, grace: int) -> dict[str, Any]:
    return {"gracePeriodSeconds": grace, "preconditions": {"uid": uid}}


def _leave(
    api: client.ApiClient,
    method: str,
    path: str,
    resource: str,
    namespace: str,
    name: str,
    body: dict[str, Any],
    deadline: float,
) -> KubeError | None:
    """One request that makes the pod `namespace/name` leave: None once accepted."""
    try:
        call(
            api,
            method,
            path,
            resource,
            body=body,
            deadline=deadline,
            params={"namespace": namespace, "name": name},
        )
    except KubeError as exc:
        return exc
    return None


def server_version(api: client.ApiClient, deadline: float = 30.0) -> str:
    """The API server's gitVersion (`v1.29.3`), retried like any other call."""
    info = call(api, "GET", "/version", "version", deadline=deadline)
    return str(info["gitVersion"])


def access_allowed(
    api: client.ApiClient,
    verb: str,
    resource: str,
    namespace: str | None = None,
    subresource: str | None = None,
    group: str = "",
    deadline: float = 5.0,
) -> bool:
    """Whether this identity may do `verb` on `resource` (of API `group`), as the API
    server's RBAC says."""
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SelfSubjectAccessReview",
        "spec": {
            "resourceAttributes": {
                "verb": verb,
                "resource": resource,
                "group": group,
                "namespace": namespace,
                "subresource": subresource,
            }
        },
    }
    reply = call(
        api,
        "POST",
        "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
        "selfsubjectaccessreviews",
        body=review,
        deadline=deadline,
    )
    return bool(reply["status"]["allowed"])
