"""The plan promise on the test corpus: every model x policy x budget kind, on the CPU, one thread.

For each model of tests/corpus (keep-all once without a budget, then every other policy at
the budgets "min", "min+10%" and "midway"): does the plan run, give eager's results bit for
bit, stay within its budget, and peak where the simulator said (tests/corpus/promise.py).
Shows progress on stderr, prints the failure kinds with their counts and a per-model
summary, and writes every row as JSON.

    python benchmarks/plan_promise.py [--models a,b] [--policies auto,recompute] [--quick]
                                      [--out data/benchmarks/plan_promise.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tests.corpus import CORPUS  # noqa: E402
from tests.corpus.promise import BUDGET_KINDS, KINDS, PLANNED_POLICIES, check  # noqa: E402
from udnn_lab.devices import device_name  # noqa: E402

QUICK_MODELS = ("mobilenet_v3_small", "gpt2_tied", "lstm_cell_loop", "unet", "tied_weights", "user_generator")
QUICK_POLICIES = ("vdnn-all", "recompute", "auto")


def run(models: list[str], policies: list[str], budget_kinds: list[str]) -> list[dict]:
    rows = []
    start = time.perf_counter()
    for name in models:
        began = time.perf_counter()
        entry = CORPUS[name]
        found = [check(entry, "keep-all", "none")]
        found += [check(entry, policy, kind) for policy in policies for kind in budget_kinds]
        rows += found
        failed = Counter(kind for row in found if row["status"] != "ok" for kind in row["status"].split(", "))
        print(f"{name:28s} {time.perf_counter() - began:6.1f}s (total {time.perf_counter() - start:6.0f}s) "
              f"{sum(row['status'] == 'ok' for row in found)}/{len(found)} ok"
              + (": " + ", ".join(f"{k} x{n}" for k, n in failed.most_common()) if failed else ""),
              file=sys.stderr, flush=True)
    return rows


def kinds_table(rows: list[dict]) -> list[dict]:
    counts, models = Counter(), {}
    for row in rows:
        for kind in row["status"].split(", ") if row["status"] != "ok" else ():
            counts[kind] += 1
            models.setdefault(kind, set()).add(row["model"])
    return [{"kind": kind, "checks": n, "models": len(models[kind]), "description": KINDS.get(kind, "")}
            for kind, n in counts.most_common()]


def print_summary(rows: list[dict]) -> None:
    print(f"{len(rows)} checks, {sum(r['status'] == 'ok' for r in rows)} ok\n")
    print(f"{'failure kind':26s} {'checks':>6s} {'models':>6s}  description")
    for line in kinds_table(rows):
        print(f"{line['kind']:26s} {line['checks']:6d} {line['models']:6d}  {line['description']}")
    followed = Counter(_how(r["followed_by"]) for r in rows if r.get("followed_by"))
    print("\nplans carried out " + "; ".join(f"{how}: {n}" for how, n in followed.most_common()))
    print(f"\n{'model':28s} {'ok':>7s}  failures (policy@budget)")
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        by_kind: dict[str, list[str]] = {}
        for r in mine:
            for kind in r["status"].split(", ") if r["status"] != "ok" else ():
                by_kind.setdefault(kind, []).append(f"{r['policy']}@{r['budget_kind']}")
        ok = f"{sum(r['status'] == 'ok' for r in mine)}/{len(mine)}"
        text = "; ".join(f"{kind}: {_short(where)}" for kind, where in by_kind.items())
        known = CORPUS[model].known_failure
        print(f"{model:28s} {ok:>7s}  {text}" + (f"  [expected: {known}]" if known else ""))


def _how(followed_by: str) -> str:
    """The runtime's way of following a plan, without its window count."""
    return "by hooks, in windows" if followed_by.rstrip(")").endswith(("window", "windows")) else followed_by


def _short(where: list[str]) -> str:
    return ", ".join(where) if len(where) <= 4 else f"{', '.join(where[:3])} and {len(where) - 3} more"


def code_state() -> dict:
    """The commit run, and the package files that differ from it (the results belong to that code)."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""
    return {"commit": git("rev-parse", "HEAD") or None,
            "modified": [line[3:] for line in git("status", "--porcelain", "--", "udnn_lab").splitlines()]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", help="comma-separated corpus names (default: every available one)")
    parser.add_argument("--policies", help=f"comma-separated (default: {','.join(PLANNED_POLICIES)})")
    parser.add_argument("--budgets", help=f"comma-separated budget kinds (default: {','.join(BUDGET_KINDS)})")
    parser.add_argument("--quick", action="store_true",
                        help=f"{len(QUICK_MODELS)} models, {','.join(QUICK_POLICIES)}, midway only")
    parser.add_argument("--out", type=Path, default=ROOT / "data" / "benchmarks" / "plan_promise.json")
    args = parser.parse_args()
    models = args.models.split(",") if args.models else list(QUICK_MODELS if args.quick else CORPUS)
    policies = args.policies.split(",") if args.policies else list(QUICK_POLICIES if args.quick else PLANNED_POLICIES)
    budgets = args.budgets.split(",") if args.budgets else (["midway"] if args.quick else list(BUDGET_KINDS))
    unknown = [m for m in models if m not in CORPUS]
    if unknown:
        parser.error(f"not in the corpus: {', '.join(unknown)}; it has: {', '.join(CORPUS)}")
    skipped = {m: f"needs {CORPUS[m].requires}" for m in models if not CORPUS[m].available}
    models = [m for m in models if m not in skipped]

    start = time.perf_counter()
    rows = run(models, policies, budgets)
    seconds = time.perf_counter() - start
    print_summary(rows)
    print(f"\n{seconds / 60:.1f} minutes" + (f"; skipped: {skipped}" if skipped else ""))
    document = {
        "benchmark": "plan_promise", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": device_name("cpu"), "cores": os.cpu_count(), "threads": 1, "torch": torch.__version__,
                    "python": platform.python_version(), "platform": platform.platform()},
        "code": code_state(),
        "ran": {"models": models, "policies": ["keep-all", *policies], "budget_kinds": budgets, "quick": args.quick,
                "whole_corpus": set(models) | set(skipped) == set(CORPUS) and policies == list(PLANNED_POLICIES)
                and budgets == list(BUDGET_KINDS)},
        "skipped": skipped, "known_failures": {n: e.known_failure for n, e in CORPUS.items() if e.known_failure},
        "seconds": round(seconds, 1), "kinds": kinds_table(rows), "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
