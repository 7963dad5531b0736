"""The reliability table counts what happened: a trial that fails shows in it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import reliability


def test_a_failed_trial_and_a_failed_block_show_in_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "reliability.jsonl"
    monkeypatch.setattr(reliability, "OUT", out)
    # One trial of three fails on purpose: the test fails, and the record says 3 tried, 2 held.
    with pytest.raises(AssertionError, match="1 of 3 failed"):
        with reliability.trials("three calls", area="soak", note="on purpose") as t:
            for i in range(3):
                t.judge(["the reply was not heard"] if i == 1 else [], f"call {i + 1}")
            t.figures = {"calls": 3}
            t.check()
    # A block ended by an assertion of its own before judging anything: one trial, none held.
    with pytest.raises(AssertionError, match="RSS grew"):
        with reliability.trials("memory after calls", area="soak"):
            raise AssertionError("RSS grew by 80 MB")
    with reliability.trials("all fine", area="input") as t:
        t.judge([])
        t.check()
    # Trials judged by the assertions in their blocks: the third of four fails and ends it.
    with pytest.raises(AssertionError, match="no answer"):
        with reliability.trials("asserted cases", area="input") as t:
            for i in range(4):
                with t.trial(f"case {i}"):
                    assert i != 2, "no answer"
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["fault"], r["tried"], r["held"]) for r in records] == [
        ("three calls", 3, 2),
        ("memory after calls", 1, 0),
        ("all fine", 1, 1),
        ("asserted cases", 3, 2),
    ]
    assert "case 2: AssertionError: no answer" in records[3]["note"]
    assert "failed: call 2: the reply was not heard" in records[0]["note"]
    assert records[0]["note"].startswith("on purpose")
    assert "RSS grew by 80 MB" in records[1]["note"]
    rows = reliability.table(reliability.latest(out)).splitlines()
    assert any("| three calls | 3 | 2 |" in row for row in rows), rows
    assert any("| memory after calls | 1 | 0 |" in row for row in rows), rows
