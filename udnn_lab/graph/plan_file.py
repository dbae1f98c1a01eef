"""A Plan as a file: made in one process (a notebook), carried out in another (the training job a launcher starts).

The file is JSON: what it is (``FORMAT``, ``FORMAT_VERSION``), the udnn_lab that wrote it, the step's
fingerprint, and every field of the plan, located (its tensor sites, the step's op families and hook
events) so that the runtime needs no graph to follow it. Reading refuses, in one line that says what
differs, a file of another format and one written by another udnn_lab (a plan's meaning may change
between versions: plan again there). ``Plan.save`` and ``Plan.load`` (plan_ir.py) write and read
through here; ``Plan.load`` with a graph also refuses a plan made for another step (``check_plan``).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from udnn_lab.errors import PlanError
from udnn_lab.vocabulary import PACKAGE_VERSION

FORMAT = "udnn_lab plan"
FORMAT_VERSION = 3  # 2: Plan.reruns; 3: Plan.replays_views


def write_plan_file(fields: dict[str, Any], path: str | Path) -> Path:
    """Write a plan's fields (``dataclasses.asdict``) to ``path`` as a plan file; return the path."""
    document = {"format": FORMAT, "format_version": FORMAT_VERSION, "udnn_lab": PACKAGE_VERSION,
                "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "step_fingerprint": fields["graph_fingerprint"], "plan": fields}
    target = Path(path)
    target.write_text(json.dumps(document, indent=1))
    return target


def read_plan_file(path: str | Path) -> dict[str, Any]:
    """The plan's fields in the plan file at ``path``, once the file is one this udnn_lab wrote."""
    source = Path(path)
    try:
        document = json.loads(source.read_text())
    except FileNotFoundError:
        raise PlanError(f"no plan file at {source}: save one with plan.save(path)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise PlanError(f"{source} is not a plan file (not JSON: {err}); save one with plan.save(path)") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise PlanError(f"{source} is not a plan file (it has no {FORMAT!r} format field); save one with "
                        "plan.save(path)")
    if document.get("format_version") != FORMAT_VERSION:
        raise PlanError(f"{source} is a plan file of format version {document.get('format_version')}, this "
                        f"udnn_lab reads version {FORMAT_VERSION}: plan again with this udnn_lab")
    if document.get("udnn_lab") != PACKAGE_VERSION:
        raise PlanError(f"{source} was saved by udnn_lab {document.get('udnn_lab')}, this is udnn_lab "
                        f"{PACKAGE_VERSION}: plan again with this version (or load it with the one that saved it)")
    fields = document.get("plan")
    if not isinstance(fields, dict):
        raise PlanError(f"{source} is a plan file without a plan: save one with plan.save(path)")
    return fields
