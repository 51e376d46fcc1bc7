"""One API request through the official client's `ApiClient` (the I/O shell).

pyproxy talks to the API server with the `kubernetes` client's `ApiClient`: its
Configuration, kubeconfig and in-cluster loading, authentication, TLS and urllib3 pool. It does
not go through the generated API classes (`CoreV1Api`…): since client 37 each of their
methods is wrapped in a pydantic validator built when the class is first touched, which cost
0.9 s of start-up and 22 MiB of resident memory for `CoreV1Api` alone (measured on this
project's VM) to build URLs that pyproxy can write itself: a handful of collection paths with
the standard list/watch query parameters. The request is exactly what the generated method
sends (`param_serialize` with the same auth settings, then `call_api`), and a status outside
2xx raises the client's own `ApiException`, whose `.status` the reflector reads.
"""

from __future__ import annotations

import json
import re
import ssl
import time
from collections.abc import Mapping
from typing import Any, Protocol
from urllib.parse import urlsplit

from pyproxy.lazy import submodule

# Query parameters as the list/watch calls name them (snake_case keyword → API name).
QUERY_NAMES = {
    "watch": "watch",
    "resource_version": "resourceVersion",
    "resource_version_match": "resourceVersionMatch",
    "allow_watch_bookmarks": "allowWatchBookmarks",
    "send_initial_events": "sendInitialEvents",
    "timeout_seconds": "timeoutSeconds",
    "limit": "limit",
    "_continue": "continue",
    "label_selector": "labelSelector",
    "field_selector": "fieldSelector",
}


def query_params(options: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The query of a list or watch call; None is left out, as the generated code does.
    An option the API does not have is an error, not a silently dropped parameter."""
    params = []
    for name, value in options.items():
        if value is None:
            continue
        if name not in QUERY_NAMES:
            raise TypeError(f"unknown list/watch option {name!r}")
        params.append((QUERY_NAMES[name], value))
    return params


def request(api_client: Any, method: str, path: str, *, query: Mapping[str, Any] | None = None,
            body: Mapping[str, Any] | None = None, timeout: Any = None,
            accept: str = "application/json") -> Any:
    """Send one request; returns the raw urllib3 response (not read: the caller streams or
    reads it and releases the connection). A non-2xx answer raises ApiException. `accept`:
    the media types asked for (the response's Content-Type says which came)."""
    api_exception = submodule("kubernetes.client.exceptions").ApiException

    # gzip: the API server compresses a response above 128 KiB (a list page: 500 Services
    # are ~0.75 MB of JSON, about a tenth of that gzipped) and a streamed list's events
    # (watch-list), as it does for kube-proxy; urllib3 decompresses as it reads.
    headers = {"Accept": accept, "Accept-Encoding": "gzip"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    params = api_client.param_serialize(
        method=method, resource_path=path, query_params=query_params(query or {}),
        header_params=headers, body=body,
        auth_settings=["BearerToken"])
    response = api_client.call_api(*params, _request_timeout=timeout)
    if not 200 <= response.status <= 299:
        response.read()
        raise api_exception.from_response(http_resp=response, body=None, data=None)
    return response.response


# ---------------------------------------------------------------------------------------------
# What an operator sees of a request: the metrics of every one, the reason of a failed one


class RequestObserver(Protocol):
    """Told of every request the client sends (serve/metrics.py's client-go metrics)."""

    def request_done(self, method: str, host: str, code: str, seconds: float) -> None:
        """`code`: the HTTP status, or "<error>" when no answer came (client-go's label)."""


def observe_requests(api_client: Any, observer: RequestObserver,
                     clock: Any = time.monotonic) -> Any:
    """Tell `observer` of every request of a `kubernetes.client.ApiClient`: its method, the
    server's host:port (client-go's `host` label: its base URL's host), the status or
    "<error>", and the seconds from asking (the rate limiter's wait included, as client-go's
    request latency) to the response's headers. Every request pyproxy makes goes through
    `call_api` (`request` above): lists, watches, the start Event."""
    call_api = api_client.call_api
    host = urlsplit(str(api_client.configuration.host)).netloc.rpartition("@")[2]

    def observed(method: str, *args: Any, **kwargs: Any) -> Any:
        started = clock()
        try:
            response = call_api(method, *args, **kwargs)
        except BaseException:
            observer.request_done(method, host, "<error>", clock() - started)
            raise
        observer.request_done(method, host, str(response.status), clock() - started)
        return response

    api_client.call_api = observed
    return api_client


# A reason is cut to this many characters, once the useful part is found: a 403's Status
# message or a TLS error is well under it; a proxy's HTML error page is not.
REASON_LIMIT = 1000


def describe_error(err: BaseException, limit: int = REASON_LIMIT) -> str:
    """What went wrong with a request, the reason first: an API answer as its status and
    its Status message (`403 Forbidden: services is forbidden: User "…" cannot list …`),
    not the client's text that starts with every response header; a failure to connect as
    its innermost cause (`SSLCertVerificationError: [SSL: CERTIFICATE_VERIFY_FAILED]
    certificate verify failed: …`), not urllib3's wrapping that starts with the whole URL.
    Cut to `limit` characters after that."""
    status = getattr(err, "status", None)
    if isinstance(status, int) and hasattr(err, "body"):
        text = f"{status} {getattr(err, 'reason', '') or ''}".rstrip()
        detail = _status_message(getattr(err, "body", None))
        text = f"{text}: {detail}" if detail else text
    else:
        cause = _innermost(err)
        text = f"{type(cause).__name__}: {_message(cause)}"
        where = _where(err)
        if where:
            text = f"{text} ({where})"
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _status_message(body: Any) -> str:
    """A Status body's message (its reason when it has none), or the body as it is."""
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if not body:
        return ""
    try:
        status = json.loads(body)
    except ValueError:
        return " ".join(str(body).split())
    if isinstance(status, dict) and status.get("kind") == "Status":
        return str(status.get("message") or status.get("reason") or "")
    return " ".join(str(body).split())


def _innermost(err: BaseException) -> BaseException:
    """The exception under urllib3's wrapping: a TLS error itself, the connection error
    under a MaxRetryError (its `reason`), the OSError under a ProtocolError; urllib3's own
    otherwise (a read timeout)."""
    for _ in range(10):  # a chain is a few links deep; never loop on a cycle
        if isinstance(err, ssl.SSLError):
            return err
        inner = getattr(err, "reason", None)
        if not isinstance(inner, BaseException) and type(err).__module__.startswith("urllib3"):
            inner = next((a for a in err.args if isinstance(a, BaseException)), None)
            if inner is None and isinstance(err.__cause__, ssl.SSLError):
                inner = err.__cause__
        if not isinstance(inner, BaseException):
            return err
        err = inner
    return err


# urllib3 starts its messages with the pool or the connection: `HTTPSConnectionPool(host='…',
# port=443): `. The host and port are given once, at the end.
_POOL_PREFIX = re.compile(r"^\w*Connection(Pool)?\(host=[^)]*\):\s*")


def _message(err: BaseException) -> str:
    return _POOL_PREFIX.sub("", " ".join(str(err).split()))


def _where(err: BaseException) -> str:
    """The server a connection error was with, from urllib3's pool (host:port)."""
    pool = getattr(err, "pool", None)
    host, port = getattr(pool, "host", None), getattr(pool, "port", None)
    return f"{host}:{port}" if host else ""
