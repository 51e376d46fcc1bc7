"""What the applier (pyproxy/sync/applier.py) needs of the kernel's nftables, as a protocol:
`LibNftables` (kernel/libnftables.py) in production, the stateful fake (testkit/fakes.py)
where no namespace is needed; and `FaultyKernel`, which refuses transactions as the kernel
would, for the drills' /fault. I/O only: what to write and when is decided in sync/."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import structlog

from pyproxy.kernel.libnftables import NftError
from pyproxy.render import ops, staging
from pyproxy.render.objects import (
    Element,
    SetDecl,
)
from pyproxy.render.ops import Op
from pyproxy.render.ruleset import (
    Structure,
)

log = structlog.get_logger(__name__)

# Chains left without references are deleted this long after they were flushed: on kernels
# before 6.2 the kernel notices a chain is unreferenced only a short time after the vmap
# element that used it was deleted, and an immediate delete fails with EBUSY
# (kubernetes#122604).
class Kernel(Protocol):
    """What the applier needs from the kernel's nftables: `LibNftables` in production, the
    stateful fake (testkit/fakes.py) where no namespace is needed. Every method names our
    table by family; listings return None where the object does not exist."""

    def apply(self, family: str, transaction: Sequence[Op]) -> str:
        """Commit the operations on our table as one transaction (all or nothing);
        NftError if refused. Returns them as the nft script they are (for `last_script`)."""
        ...

    def apply_elements(self, family: str, transaction: Sequence[Op],
                       declarations: Mapping[str, SetDecl]) -> str:
        """Commit a transaction of element additions and deletions only, in sets with
        these declarations, as `apply` does (all or nothing; NftError if refused)."""
        ...

    def add_elements(self, family: str, chunk: staging.ElementChunk) -> None:
        """Add elements to sets and maps that nothing references yet, as one transaction
        (all or nothing; NftError if refused)."""
        ...

    def renew(self) -> None:
        """Drop whatever the connection caches of the table (after a full sync)."""
        ...

    def bulk(self) -> AbstractContextManager[None]:
        """A bulk of our own writes inside (a staged full sync): not announced to our own
        change listener, which compares the structure after instead."""
        ...

    def list_structure(self, family: str) -> Structure | None:
        """Our table's chains, rules and set declarations (no elements), as listed."""
        ...

    def list_elements(self, family: str, kind: str, name: str) -> list[Element] | None:
        """The elements of one set or map, (key, value) each."""
        ...

    def list_names(self, family: str) -> tuple[list[str], list[str]]:
        """Names of our table's chains and of its sets and maps (empty: no table)."""
        ...

    def table_comment(self, family: str) -> str | None:
        """Our table's comment ("" without one; None: no table, or not known)."""
        ...


class FaultyKernel:
    """A kernel that refuses the next `fail_next` sync transactions before they reach
    `inner`, as if the kernel did: the debug socket's /fault, for the drills
    (docs/drills.md). Installed in front of an applier's kernel only when a fault is
    asked for; everything else goes to `inner`. The deletion of stale chains (a transaction
    of its own, before a sync's) is let through: refused, it is only counted and retried,
    and it would take the fault meant for the sync."""

    def __init__(self, inner: Kernel) -> None:
        self.inner = inner
        self.fail_next = 0

    def apply(self, family: str, transaction: Sequence[Op]) -> str:
        if self.fail_next > 0 and transaction and not _only_chain_deletions(transaction):
            self._fail()
        return self.inner.apply(family, transaction)

    def apply_elements(self, family: str, transaction: Sequence[Op],
                       declarations: Mapping[str, SetDecl]) -> str:
        if self.fail_next > 0 and transaction:
            self._fail()
        return self.inner.apply_elements(family, transaction, declarations)

    def add_elements(self, family: str, chunk: staging.ElementChunk) -> None:
        if self.fail_next > 0:
            self._fail()
        self.inner.add_elements(family, chunk)

    def _fail(self) -> None:
        self.fail_next -= 1
        raise NftError("injected fault: transaction refused (debug socket /fault)")

    def renew(self) -> None:
        self.inner.renew()

    def bulk(self) -> AbstractContextManager[None]:
        return self.inner.bulk()

    def list_structure(self, family: str) -> Structure | None:
        return self.inner.list_structure(family)

    def list_elements(self, family: str, kind: str, name: str) -> list[Element] | None:
        return self.inner.list_elements(family, kind, name)

    def list_names(self, family: str) -> tuple[list[str], list[str]]:
        return self.inner.list_names(family)

    def table_comment(self, family: str) -> str | None:
        return self.inner.table_comment(family)


def _only_chain_deletions(transaction: Sequence[Op]) -> bool:
    return all(op.verb is ops.Verb.DELETE and isinstance(op.obj, ops.Chain)
               for op in transaction)
