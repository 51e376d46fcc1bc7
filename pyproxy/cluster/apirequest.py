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

from collections.abc import Mapping
from typing import Any

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
    from kubernetes.client.exceptions import ApiException

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
        raise ApiException.from_response(http_resp=response, body=None, data=None)
    return response.response
