"""The ledger of made sandboxes: numbered, bounded, read after a mark."""

from __future__ import annotations

from sandboxes.base import SandboxInfo, SandboxLedger, SandboxState


def _info(n: int) -> SandboxInfo:
    return SandboxInfo(id=f"sbx_{n}", backend="test", node="n", state=SandboxState.READY, image="i", created_at=n)


def test_the_ledger_returns_what_was_made_after_a_mark_and_forgets_the_oldest():
    ledger = SandboxLedger(size=3)
    assert ledger.after(0) == ([], 0)
    for n in range(2):
        ledger.add(_info(n))
    made, mark = ledger.after(0)
    assert ([i.id for i in made], mark) == (["sbx_0", "sbx_1"], 2)
    for n in range(2, 6):
        ledger.add(_info(n))
    made, mark = ledger.after(2)
    assert ([i.id for i in made], mark) == (["sbx_3", "sbx_4", "sbx_5"], 6), "four made since, three held"
    assert [i.id for i in ledger.after(4)[0]] == ["sbx_4", "sbx_5"]
    assert ledger.after(6) == ([], 6) and ledger.after(99) == ([], 6)
