"""Every row of the op table, gathered from the per-family case files."""

from __future__ import annotations

import cases
import cases_elem
import cases_more_elem
import cases_nn
import cases_scan
import cases_shape
from cases import Case

ALL_CASES: list[Case] = (cases.CASES + cases_elem.CASES + cases_shape.CASES + cases_nn.CASES
                         + cases_scan.CASES + cases_more_elem.CASES)
