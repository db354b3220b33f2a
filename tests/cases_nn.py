"""Op-table rows for the nn ops (see cases.py for the row format)."""

from __future__ import annotations

from cases import Case

CASES: list[Case] = []
