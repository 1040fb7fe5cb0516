"""Prometheus' HTTP query API, one instant query at a time (the standard library's HTTP:
no client library for one GET). A failure is a value that says what to check."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class QueryFailed:
    """Why a query has no answer, in words a person can act on."""

    why: str


@dataclass(frozen=True, slots=True)
class PrometheusApi:
    """Where Prometheus is and how to reach it: its base URL, a bearer token file, CA
    certificates for https (the system's when None)."""

    url: str
    token_file: str | None = None
    ca_file: str | None = None
    timeout: float = 60.0

    def query(self, expr: str) -> object | QueryFailed:
        """The decoded JSON answer to the instant query `expr` at now."""
        url = f"{self.url}/api/v1/query"
        body = urllib.parse.urlencode({"query": expr}).encode()
        headers = {"Accept": "application/json"}
        try:
            if self.token_file is not None:
                token = Path(self.token_file).read_text().strip()
                headers["Authorization"] = f"Bearer {token}"
            context = ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as exc:
            return QueryFailed(f"cannot read {exc.filename or 'the CA file'}: {exc.strerror}")
        # An http(s) URL: `settings.recommend.parse_url` takes no other.
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")  # noqa: S310
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=context) as r:  # noqa: S310
                answer: object = json.loads(r.read())
                return answer
        except urllib.error.HTTPError as exc:
            return QueryFailed(_refused(url, exc))
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            return QueryFailed(
                f"cannot reach Prometheus at {self.url} ({reason}): check --prometheus (the "
                "server's address and port, e.g. through `kubectl port-forward`), and "
                "--ca-file for https"
            )
        except ValueError as exc:
            return QueryFailed(f"{url} did not answer JSON ({exc}): is it Prometheus?")


def _refused(url: str, exc: urllib.error.HTTPError) -> str:
    """A refusal's words: Prometheus' own error, or what to check for the status."""
    try:
        error = json.loads(exc.read()).get("error")
    except (ValueError, AttributeError, OSError):
        error = None
    if error:
        return f"Prometheus refused the query: {error}"
    if exc.code in (401, 403):
        return f"{url}: HTTP {exc.code}: check --bearer-token-file (and the token's rights)"
    if exc.code == 404:
        return f"{url}: HTTP 404: check --prometheus (the server's base URL, without /api)"
    return f"{url}: HTTP {exc.code} {exc.reason}"
