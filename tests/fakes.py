"""Fakes for the I/O shells (no mocks): a libnftables stand-in that records transactions."""

from __future__ import annotations

from pyproxy.nft import NftError


class FakeNft:
    """Records every script; `fail_next` makes the next transaction fail like the kernel
    refusing it."""

    def __init__(self) -> None:
        self.scripts: list[str] = []
        self.fail_next = 0

    def run(self, script: str) -> str:
        if self.fail_next:
            self.fail_next -= 1
            raise NftError("Error: Could not process rule: Invalid argument (injected)")
        self.scripts.append(script)
        return ""

    def list_names(self, family: str) -> tuple[list[str], list[str]]:
        return [], []

    @property
    def last(self) -> str:
        return self.scripts[-1] if self.scripts else ""
