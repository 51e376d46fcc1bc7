"""apiemu: an in-process kube-apiserver emulator for Services, Nodes, EndpointSlices,
ServiceCIDRs (``unserved=("servicecidrs",)`` plays a server without that API: 404) and
events.k8s.io Events (stored as written: the daemon records one when it starts).

It speaks the real list/watch HTTP protocol over a socket (resourceVersions, label/field
selectors, chunked watch streams, bookmarks, 410 Expired), so pyproxy's watch layer can be tested
against the unmodified ``kubernetes`` client. See `ApiEmulator` for the test hooks (among them
``forbid``: RBAC's 403 for every resource request; ``tls=(cert, key)``: HTTPS).

Typical use::

    with ApiEmulator(bookmark_interval=0.2) as api, api.api_client() as client_:
        api.create("services", {"metadata": {"name": "web"}, "spec": {"ports": [{"port": 80}]}})
        core = kubernetes.client.CoreV1Api(client_)      # or: api.write_kubeconfig(path)
        rv = core.list_service_for_all_namespaces().metadata.resource_version
        ...                                               # watch from rv in another thread
        api.wait_for_watches(1, "services")               # the watch is registered
        api.patch("services", "web", {"metadata": {"labels": {"a": "b"}}})  # -> MODIFIED
        api.compact()                                     # next watch from rv -> 410 Expired
        assert api.count("list", "services") == 2         # ... and the code relisted

Fidelity notes (deliberate simplifications): strategic merge patch is applied as a JSON merge
patch; finalizers, dryRun, server-side apply, managedFields, protobuf/CBOR and Namespace
objects are not modelled; ``continue`` pages come from the current state (not an MVCC
snapshot); a list's ``resourceVersion``/``resourceVersionMatch`` only matter when the RV is
in the future (504 "Too large resource version" after ``too_large_rv_wait``).
"""

from .resources import ENDPOINTSLICES, NODES, RESOURCES, SERVICECIDRS, SERVICES, ResourceDef
from .selection import SelectorError, parse_field_selector, parse_label_selector
from .server import ApiEmulator, RequestRecord, UnavailableMode
from .store import ApiError

__all__ = [
    "ENDPOINTSLICES",
    "NODES",
    "RESOURCES",
    "SERVICECIDRS",
    "SERVICES",
    "ApiEmulator",
    "ApiError",
    "RequestRecord",
    "ResourceDef",
    "SelectorError",
    "UnavailableMode",
    "parse_field_selector",
    "parse_label_selector",
]
