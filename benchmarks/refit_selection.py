"""Measured selection's calibration refitted from recorded runs: a change to the fit measured in seconds.

Every run of ``cost_model_accuracy.py`` records what measured selection's trials measured in the default path
(the profile the strategy took, every rank's observations, the trials) and the step time measured for each
benchmarked plan. This script fits the calibration again from those observations with the library's current
``fit_calibration`` -- the profile's own calibration the prior, as ``selection/measured.py`` fits it -- and
prices every plan with it: the after-selection step-time MAPE and Spearman per run, next to what the run
recorded when it was taken. The data's noise stays (each run is one sample of this machine, profile included);
what changes between two invocations is only the fit.

    python benchmarks/refit_selection.py                       # the recorded runs and the latest result
    python benchmarks/refit_selection.py RUN.json ...          # chosen runs (full results or kept ones)
    python benchmarks/refit_selection.py --keep                # keep the latest result's selection data too

Runs are kept in ``benchmarks/data/selection_runs/`` (what the refit needs, about 90 KB each).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from cost_model_accuracy import OPTIMIZER, PRECISION
from harness import REPO, RESULTS, mape, spearman

from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.profiles import Profile
from lightning_galvatron.search import evaluate
from lightning_galvatron.search.calibration import Observation, fit_calibration
from lightning_galvatron.search.overheads import profile_calibration

RUNS = REPO / "benchmarks" / "data" / "selection_runs"
LATEST = RESULTS / "cost_model_accuracy.json"
PLAN_KEYS = ("name", "plan", "measured_step_s", "after_selection_step_s", "mechanisms_measured_by_selection")


def kept(result: dict[str, Any], source: str) -> dict[str, Any]:
    """What a refit needs of a ``cost_model_accuracy.py`` result."""
    selection = result["measured_selection"]
    return {
        "source": source,
        "machine": result["machine"],
        "model": result["model"],
        "summary": {k: v for k, v in result["summary"].items() if k.startswith("after_selection")},
        "measured_selection": {k: selection[k] for k in ("profile", "observations", "trials")},
        "plans": [{k: p[k] for k in PLAN_KEYS if k in p} for p in result["plans"]],
    }


def refit(run: dict[str, Any]) -> dict[str, Any]:
    """The run's after-selection predictions with today's fit: MAPE and Spearman over all plans and over those
    using only mechanisms the trials measured."""
    selection = run["measured_selection"]
    profile = Profile.from_dict(selection["profile"])
    # What the strategy fitted: the trials before its calibrated search's plan (tried after the fit, if at all).
    later = {_key(t["plan"]) for t in selection["trials"] if t["name"] == "calibrated search"}
    observations = [Observation.from_dict(o) for o in selection["observations"] if _key(o["plan"]) not in later]
    calibration = fit_calibration(
        profile,
        observations,
        precision=PRECISION,
        optimizer=OPTIMIZER,
        source="refit",
        prior=profile_calibration(profile),
    )
    rows = []
    for p in run["plans"]:
        plan = ParallelPlan.from_dict(p["plan"])
        priced = evaluate(profile, plan, precision=PRECISION, optimizer=OPTIMIZER, calibration=calibration)
        rows.append((p, priced.step_time_s))
    measured = [p["measured_step_s"] for p, _ in rows]
    predicted = [t for _, t in rows]
    covered = [(p["measured_step_s"], t) for p, t in rows if p.get("mechanisms_measured_by_selection")]
    return {
        "recorded_mape": run["summary"].get("after_selection_step_time_mape"),
        "mape": mape(predicted, measured),
        "spearman": spearman(predicted, measured),
        "covered_mape": mape([t for _, t in covered], [m for m, _ in covered]) if covered else None,
        "plans": {p["name"]: {"measured_s": p["measured_step_s"], "refit_s": t} for p, t in rows},
        "calibration": calibration.to_dict(),
    }


def _key(plan: dict[str, Any]) -> str:
    return json.dumps(plan, sort_keys=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="*", type=Path, help="results or kept runs (default: the recorded ones)")
    parser.add_argument("--keep", action="store_true", help=f"keep {LATEST.name}'s selection data in {RUNS}")
    parser.add_argument("--plans", action="store_true", help="print every plan's measured and refitted step")
    args = parser.parse_args()
    if args.keep:
        result = json.loads(LATEST.read_text())
        RUNS.mkdir(parents=True, exist_ok=True)
        target = RUNS / f"run{len(list(RUNS.glob('run*.json'))) + 1}.json"
        target.write_text(json.dumps(kept(result, f"{LATEST.name} of {time_of(LATEST)}"), separators=(",", ":")))
        print(f"kept {target.relative_to(REPO)}")
    paths = args.runs or sorted(RUNS.glob("run*.json"))
    out, mapes = {}, []
    print(f"{'run':34s} {'recorded':>9s} {'refit':>7s} {'covered':>8s} {'Spearman':>9s}")
    for path in paths:
        found = refit(json.loads(path.read_text()))
        out[str(path)] = found
        mapes.append(found["mape"])
        recorded = found["recorded_mape"]
        print(
            f"{path.name:34s} {'-' if recorded is None else f'{recorded:.1%}':>9s} {found['mape']:7.1%} "
            f"{'-' if found['covered_mape'] is None else format(found['covered_mape'], '.1%'):>8s} "
            f"{found['spearman']:9.2f}"
        )
        if args.plans:
            for name, p in found["plans"].items():
                print(
                    f"    {name:36s} measured {p['measured_s']:.3f} s  refit {p['refit_s']:.3f} s "
                    f"({p['refit_s'] / p['measured_s'] - 1:+.0%})"
                )
    if mapes:
        print(f"mean refit MAPE {statistics.fmean(mapes):.1%}, worst {max(mapes):.1%} over {len(mapes)} runs")
    (RESULTS / "refit_selection.json").write_text(json.dumps(out, indent=1))


def time_of(path: Path) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(path.stat().st_mtime, tz=datetime.timezone.utc).strftime("%Y-%m-%d")


if __name__ == "__main__":
    main()
