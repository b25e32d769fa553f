"""The benchmark's results: keys, the JSON-lines files and resuming.

Every finished measurement is one line of ``<name>.jsonl`` keyed ``model|batch|mode|policy``;
keys already there are skipped on the next run (``done_keys``). Before an item starts, a line goes
to ``<name>.attempts.jsonl``; an item started twice with most of a run ahead of it and never
finished was killed (``killed_items``) and is recorded as failed instead of tried forever. Run
records go to ``<name>.runs.jsonl``, interleaved timings to ``<name>.interleaved.jsonl``; every
line is flushed and copied to the mirror folder at once (a run cut at the device's limit keeps
what it wrote).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import shutil
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

log = logging.getLogger("bench")




def make_key(model: str, batch: int, mode: str, policy: str) -> str:
    return f"{model}|{batch}|{mode}|{policy}"


@dataclass(frozen=True)
class Item:
    model: str
    batch: int
    mode: str
    policy: str

    @property
    def key(self) -> str:
        return make_key(self.model, self.batch, self.mode, self.policy)

    @property
    def group(self) -> tuple[str, int, str]:
        return self.model, self.batch, self.mode


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of ``path``; a torn last line (a run killed while writing) is ignored."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("ignoring a broken line in %s", path)
    return rows


def done_keys(rows: list[dict[str, Any]], *, retry_failed: bool = False, redo: str | None = None,
              redo_before: str | None = None) -> set[str]:
    """Keys with a result; with ``retry_failed`` only the successful ones (the last row of a key
    wins). ``redo`` (a glob over keys) with ``redo_before`` (an ISO time): matching keys whose last
    row is older count as not done, so the same command can be repeated until they are."""
    last = {}
    for row in rows:
        if "key" in row:
            last[row["key"]] = row
    stale = set()
    if redo:
        cutoff = datetime.fromisoformat(redo_before)
        if cutoff.tzinfo is None:
            cutoff = cutoff.replace(tzinfo=timezone.utc)
        for key, row in last.items():
            when = row.get("time")
            if fnmatch.fnmatchcase(key, redo) and (not when or datetime.fromisoformat(when) < cutoff):
                stale.add(key)
    return {k for k, r in last.items() if (not retry_failed or r.get("status") == "ok") and k not in stale}


class Results:
    """Appends rows (and attempts) to the JSONL files, flushing each line; mirrors them to a folder."""

    def __init__(self, out: Path, name: str, mirror: Path | None) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / f"{name}.jsonl"
        self.attempts_path = out / f"{name}.attempts.jsonl"
        self.runs_path = out / f"{name}.runs.jsonl"
        self.interleaved_path = out / f"{name}.interleaved.jsonl"
        self.mirror = mirror
        self.rows = read_rows(self.path)

    def _append(self, path: Path, record: dict[str, Any]) -> None:
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=_json_default) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._copy(path)

    def _copy(self, path: Path) -> None:
        if self.mirror is not None and path.exists():
            self.mirror.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, self.mirror / path.name)

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        self._append(self.path, row)

    def add_interleaved(self, record: dict[str, Any]) -> None:
        self._append(self.interleaved_path, record)

    def attempt(self, item: Item, run: str, left_s: float) -> None:
        self._append(self.attempts_path, {"key": item.key, "run": run, "left_s": round(left_s, 1),
                                          "time": datetime.now(timezone.utc).isoformat(timespec="seconds")})

    def attempts(self) -> list[dict[str, Any]]:
        return read_rows(self.attempts_path)

    def runs(self) -> list[dict[str, Any]]:
        return read_rows(self.runs_path)

    def run_record(self, record: dict[str, Any]) -> None:
        self._append(self.runs_path, record)


def _json_default(value):
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value)}")


def killed_items(attempts: list[dict[str, Any]], rows: list[dict[str, Any]], runs: list[dict[str, Any]],
                 *, full_run_s: float) -> dict[str, int]:
    """Keys started at least twice with at least ``full_run_s`` ahead of them since their last row.

    Only attempts after a key's latest row (any status) count: an item measured again with
    ``--redo`` or ``--retry-failed`` has attempts from the runs that did finish it, and those say
    nothing about whether it can finish now. An attempt's time is its own (``time``) or, in files
    written before attempts had one, the start of its run.
    """
    def moment(text: str | None) -> datetime | None:
        when = datetime.fromisoformat(text) if text else None
        return when.replace(tzinfo=timezone.utc) if when is not None and when.tzinfo is None else when

    started = {r["run"]: r["start"] for r in runs if "run" in r and "start" in r}
    latest: dict[str, datetime] = {}
    for row in rows:
        when = moment(row.get("time"))
        if when is not None and "key" in row:
            latest[row["key"]] = max(when, latest.get(row["key"], when))
    counts: dict[str, int] = {}
    for record in attempts:
        key = record["key"]
        when = moment(record.get("time") or started.get(record.get("run")))
        if key in latest and (when is None or when <= latest[key]):
            continue
        if record.get("left_s", 0) >= full_run_s:
            counts[key] = counts.get(key, 0) + 1
    return {k: n for k, n in counts.items() if n >= 2}
