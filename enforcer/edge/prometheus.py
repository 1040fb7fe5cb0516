"""Prometheus' HTTP query API, one instant query at a time (the standard library's HTTP:
no client library for one GET). A failure is a value that says what to check."""

from __future__ import annotations

import http.client
import json
import re
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

# RFC 6750's b64token: what a bearer token may hold (no space, no line break).
_TOKEN = re.compile(r"[A-Za-z0-9._~+/-]+=*")


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
        if self.token_file is not None:
            token = _token(self.token_file)
            if isinstance(token, QueryFailed):
                return token
            headers["Authorization"] = f"Bearer {token}"
        try:
            context = ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as exc:
            return QueryFailed(
                f"cannot read --ca-file {self.ca_file} ({exc}): check that it holds PEM "
                "certificates"
            )
        # An http(s) URL: `settings.recommend.parse_url` takes no other.
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")  # noqa: S310
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=context) as r:  # noqa: S310
                raw = r.read()
        except urllib.error.HTTPError as exc:
            return QueryFailed(_refused(url, exc))
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            return QueryFailed(
                f"cannot reach Prometheus at {self.url} ({reason}): check --prometheus (the "
                "server's address and port, e.g. through `kubectl port-forward`), and "
                "--ca-file for https"
            )
        except http.client.HTTPException as exc:  # not HTTP, or an answer cut short
            return QueryFailed(
                f"{url} did not answer in HTTP ({type(exc).__name__}: {str(exc)[:100]!r}): "
                "check --prometheus (Prometheus' HTTP port; https:// for a TLS port)"
            )
        try:
            answer: object = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:100]
            return QueryFailed(f"{url} did not answer JSON ({why}): is it Prometheus?")
        return answer


def _token(path: str) -> str | QueryFailed:
    """The bearer token that the file at `path` holds, without the line break that ends it."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        return QueryFailed(f"cannot read --bearer-token-file {path}: {exc.strerror}")
    except UnicodeDecodeError:
        return QueryFailed(
            f"--bearer-token-file {path} is not text (not UTF-8): check that it holds the token"
        )
    if not _TOKEN.fullmatch(token):
        return QueryFailed(
            f"--bearer-token-file {path} does not hold one bearer token (it is empty, or has "
            "a space, a line break or a character a token cannot have): check that it holds "
            "the token alone"
        )
    return token


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
