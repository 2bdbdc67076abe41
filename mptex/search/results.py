"""What the search writes into its directory, and what the directory remembers.

* ``search_config.json``: the settings a search directory was started with
  (:func:`check_search_dir` refuses others, so that resumed runs belong to one search);
* ``search.json``: every candidate (stage, cost, runs, Δ, interval, verdict), the pruned list
  and the budget (:func:`summarise`);
* ``precision/<name>.yaml`` under ``search.config_dir``: the certified assignment as a
  precision arm, with how it was certified and the command that reproduces it
  (:func:`write_result`);
* ``search.md`` and ``pareto.png`` (:func:`mptex.search.report.write_search_report`).
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mptex._paths import CONFIG_DIR
from mptex.intervals import ratio_ci
from mptex.numbers import is_number
from mptex.search.config import SearchError
from mptex.search.cost import GPUS
from mptex.search.report import confidence_text, write_search_report
from mptex.search.space import Candidate

if TYPE_CHECKING:
    from mptex.search.driver import SearchState

__all__ = ["write_results", "summarise"]

# The first line of every precision config a search writes: one without it is the user's.
_HEADER = "# Written by mptex's precision search"
# train keys that do not change a run's result: a search continues across changes of these.
_RUN_ONLY_KEYS = (
    "seed",
    "threads",
    "progress",
    "n_val_images",
    "resume",
    "device",
    "tensorboard",
    "checkpoint_interval",
    "inject_signal_at",  # a stop and its resume give the same run
    "inject_signal",
    "stop_signals",
)


def result_path(settings: Mapping[str, Any], name: str, out: Path) -> Path:
    """``<config dir>/precision/<name>.yaml``: ``search.config_dir``, by default the search
    directory's ``configs/``, never mptex's own configs (``mptex-train --config-dir`` adds it)."""
    root = Path(settings["config_dir"]) if settings["config_dir"] else out / "configs"
    return root / "precision" / f"{name}.yaml"


def _shipped(name: str) -> bool:
    """Whether mptex ships a precision config ``name`` (an arm, or a shipped search result)."""
    return (CONFIG_DIR / "precision" / f"{name}.yaml").is_file()


def default_result_name(scene: str) -> str:
    """``search_<scene>``, or ``my_search_<scene>`` where mptex ships a ``search_<scene>``
    (builtin, soccer): the printed ``mptex-train --config-dir <dir> precision=<name>`` would
    train the shipped config, whose directory Hydra searches first."""
    name = f"search_{scene}"
    return f"my_{name}" if _shipped(name) else name


def check_result_path(path: Path, name: str) -> None:
    """Refuse, before any training (:class:`SearchError`), a ``name`` that mptex ships as a
    precision config (``precision=<name>`` would train that one: Hydra searches mptex's configs
    before ``--config-dir``'s), and a precision config at ``path`` that no search wrote."""
    if _shipped(name):
        raise SearchError(
            f"search.name: mptex ships a precision config {name!r}, which "
            f"'mptex-train --config-dir ... precision={name}' would train instead of the "
            "result; choose another search.name"
        )
    # The folder is made now: a config_dir that cannot hold the result fails before the
    # search trains, not after.
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        writable = os.access(path.parent, os.W_OK)
    except OSError as exc:
        raise SearchError(
            f"search.config_dir: cannot make {path.parent}: {exc.strerror or exc}"
        ) from None
    if not writable:
        raise SearchError(f"search.config_dir: {path.parent} is not writable")
    if path.exists():
        first = path.read_text().splitlines()[:1]
        if not first or not first[0].startswith(_HEADER):
            raise SearchError(
                f"search.name: {path} exists and was not written by a precision search; "
                "choose another search.name"
            )


def settings_record(settings: Mapping[str, Any], full: Mapping[str, Any]) -> dict[str, Any]:
    """What must stay the same for a search directory's runs to be one search's: the search
    settings (but its parallelism) and the scene, texture and training of the runs."""
    train = {k: v for k, v in full["train"].items() if k not in _RUN_ONLY_KEYS}
    # search.adjust at its default is left out: a directory started before the key existed
    # (unadjusted, as that default is) continues under the same command.
    search = {k: v for k, v in settings.items() if k not in ("workers", "threads")
              and not (k == "adjust" and v == "none")}  # fmt: skip
    return {
        "search": search,
        "scene": full["scene"],
        "texture": full["texture"],
        "train": train,
    }


def _differing_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two records (nested mappings descended)."""
    if not (isinstance(old, Mapping) and isinstance(new, Mapping)):
        return [prefix] if old != new else []
    keys = []
    for key in sorted(set(old) | set(new), key=str):
        name = f"{prefix}.{key}" if prefix else str(key)
        keys += _differing_keys(old.get(key), new.get(key), name)
    return keys


def check_search_dir(out: Path, record: Mapping[str, Any]) -> None:
    """Write ``record`` as ``out/search_config.json``, or refuse (:class:`SearchError`) a
    directory whose record differs."""
    path = out / "search_config.json"
    if path.is_file():
        old = json.loads(path.read_text())
        new = json.loads(json.dumps(record, default=str))
        if old != new:
            keys = _differing_keys(old, new)
            raise SearchError(
                f"search dir {out} holds a search with other settings (different: "
                f"{', '.join(keys)}); use a new directory or the same settings to continue it"
            )
    else:
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1, sort_keys=True, default=str))


def write_results(state: SearchState, certified: Candidate) -> dict[str, Any]:
    """Write the finished search's files (the module docstring's list); returns ``search.json``'s
    dict."""
    summary = summarise(state, certified)
    write_result(state.result_path, certified, summary)
    (state.out / "search.json").write_text(json.dumps(summary, indent=1, default=str))
    write_search_report(state.out, summary)
    return summary


def summarise(state: SearchState, certified: Candidate) -> dict[str, Any]:
    """The ``search.json`` dict of a finished search whose answer is ``certified``."""
    settings, pool, seeds, ref = state.settings, state.pool, state.seeds, state.ref
    s0 = state.screen_seed
    kept, model, stages, shape = state.kept, state.model, state.stages, state.shape
    rows = []
    by_name = {c.name: c for c in kept}
    gpu_times: dict[str, dict[int, float]] = {}
    for cname, stage in stages.items():
        c = by_name[cname]
        runs = {s: pool.results[(cname, s)] for s in [s0, *seeds] if (cname, s) in pool.results}
        # A GPU time is the candidate's own only where its run had the device to itself (no
        # other run trained beside it): with several workers the runs share it.
        gpu_times[cname] = {
            s: float(r["time_per_iter_s"])
            for s, r in runs.items()
            if str(r.get("device") or "").startswith("cuda")
            and is_number(r.get("time_per_iter_s"))
            and r["time_per_iter_s"] > 0
            and r.get("ran_beside") == 0
        }
        measured = list(gpu_times[cname].values())
        deltas = {s: state.delta(c, s) for s in runs}
        cert = state.certificate(c) if all(s in runs for s in seeds) else None
        rows.append(
            {
                "candidate": cname,
                "stage": stage,
                **c.to_json(),
                "model_s": model[cname]["seconds"],
                # the median: with an even count (f32 and a certified candidate have the
                # screens' seed and certify_seeds more) the mean of the middle two
                "measured_s": statistics.median(measured) if measured else None,
                "runs": {str(s): r for s, r in runs.items()},
                "delta_db": {str(s): d for s, d in deltas.items()},
                "screen_passed": (
                    deltas.get(s0) is not None and abs(deltas[s0]) <= settings["screen_db"]
                ),
                "certificate": cert,
            }
        )
    for row in rows:
        measured = row["measured_s"]
        row["cost_source"] = "modelled" if measured is None else "measured"
        row["cost_s"] = row["model_s"] if measured is None else measured
        # A measured cost is compared with f32's seed by seed, with an interval: the GPU's
        # times vary from run to run.
        ref_times, own = gpu_times.get(ref.name, {}), gpu_times[row["candidate"]]
        pairs = [(ref_times[s], t) for s, t in own.items() if s in ref_times]
        row["measured_speedup"] = (ratio_ci(pairs, state.confidence)
                                   if pairs and row["candidate"] != ref.name else None)  # fmt: skip
    rows.sort(key=lambda r: (r["cost_s"], r["candidate"]))
    all_runs = list(pool.results.values())
    return {
        "name": state.name,
        "scene": pool.base["scene"].get("name"),
        "reproduce": _reproduce(state.name, s0, state.result_path.parents[1]),
        "result_config": str(state.result_path),
        "certified": certified.name,
        "certified_is_reference": certified == ref,
        "reference": ref.name,
        "screen_seed": s0,
        "seeds": seeds,
        "margin_db": settings["margin_db"],
        "adjust": settings["adjust"],
        "confidence": state.confidence,
        "max_certify": settings["max_certify"],
        "screen_db": settings["screen_db"],
        "cost": {
            "gpu": settings["cost"]["gpu"],
            "gpu_name": GPUS[settings["cost"]["gpu"]].name,
            "source": GPUS[settings["cost"]["gpu"]].source,
            "points": state.points,
            "shape": vars(shape),
            "measured": any(r["cost_source"] == "measured" for r in rows),
            "reference_parts": model[ref.name]["parts"],
            "certified_parts": model[certified.name]["parts"],
        },
        "space": {"kept": len(kept), "pruned": state.pruned},
        "not_trained": not_trained(kept, set(stages), model),
        "candidates": rows,
        "budget": {
            "runs": len(all_runs),
            "trained": pool.trained,
            "reused": pool.reused,
            "iterations": sum(int(r.get("iterations") or 0) for r in all_runs),
            # every process of each run (a run stopped and continued is several), at least:
            # all of it only where every run's time is known whole (run_wall_complete)
            "run_wall_s": sum(float(r.get("wall_time_total_s") or 0) for r in all_runs),
            "run_wall_complete": all(r.get("time_total_complete") is True for r in all_runs),
            # this invocation's added to what the directory's search.json says (a finished
            # search run again, which reads its runs back); an invocation that a stop signal
            # ended wrote no search.json, so its time is not in it
            "search_wall_s": _earlier_wall_s(state.out) + time.perf_counter() - state.start,
            "workers": settings["workers"],
        },
    }


def _earlier_wall_s(out: Path) -> float:
    """``budget.search_wall_s`` of the search.json earlier invocations wrote in ``out`` (0.0
    where there is none, or it cannot be read)."""
    try:
        earlier = json.loads((out / "search.json").read_text())["budget"]["search_wall_s"]
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0
    return float(earlier) if isinstance(earlier, (int, float)) and earlier >= 0 else 0.0


def _kind(candidate: Candidate) -> str | None:
    """The family a candidate belongs to for :func:`not_trained` (None: an f16/bf16/f32 one)."""
    if candidate.quant != "none":
        return {
            "fp8": "FP8 GEMMs, delayed scaling",
            "fp8_current": "FP8 GEMMs, current scaling",
            "fp8_rowwise": "FP8 GEMMs, row-wise scaling",
            "int8_qat": "trained for an int8 decoder",
            "fp8_qat": "trained for an FP8 decoder",
            "fp8_rowwise_qat": "trained for a row-wise FP8 decoder",
        }[candidate.quant]
    if candidate.encoder == "bf16":
        return "bfloat16 hash grid"
    return None


def not_trained(
    kept: Sequence[Candidate], trained: set[str], model: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """The kept candidates the search never trained: how many, and the cheapest (modelled) one
    of each family below f16 or of the bfloat16 grid, so that a reader sees what the search
    knew of them and why it stopped before them."""
    left = [c for c in kept if c.name not in trained]
    cheapest: dict[str, Candidate] = {}
    for c in sorted(left, key=lambda c: (model[c.name]["seconds"], c.name)):
        kind = _kind(c)
        if kind is not None and kind not in cheapest:
            cheapest[kind] = c
    return {
        "count": len(left),
        "cheapest_by_kind": [
            {"kind": kind, "candidate": c.name, "model_s": model[c.name]["seconds"]}
            for kind, c in cheapest.items()
        ],
    }


def _reproduce(name: str, seed: int, config_dir: Path) -> str:
    """The command that trains the result as the search did: the quick experiment has the
    search's protocol (train=ablation, 300 iterations, the output margin, 1 thread); the
    search's own scene/train/texture overrides are repeated."""
    extra = []
    try:
        from hydra.core.hydra_config import HydraConfig

        extra = [
            o
            for o in HydraConfig.get().overrides.task
            if o.split("=")[0].lstrip("+~").split(".")[0] in ("scene", "train", "texture")
            and not o.startswith("train.seed=")
        ]
    except ValueError:  # not under Hydra (a direct call): no overrides to repeat
        pass
    return " ".join(
        [
            "mptex-train",
            "--config-dir",
            shlex.quote(str(config_dir)),
            "+experiment=quick",
            f"precision={name}",
            f"train.seed={seed}",
            *extra,
        ]  # fmt: skip
    )


def _psnrs(row: Mapping[str, Any]) -> str:
    return ", ".join(
        f"{seed}: {run['psnr']:.2f} dB"
        for seed, run in row["runs"].items()
        if run.get("psnr") is not None
    )


def write_result(path: Path, candidate: Candidate, summary: Mapping[str, Any]) -> None:
    """Write ``candidate`` as the precision arm ``summary["name"]`` at ``path`` (atomically),
    its header saying how it was certified and how to reproduce it."""
    import yaml

    row = next(r for r in summary["candidates"] if r["candidate"] == candidate.name)
    cert = row["certificate"] or {}
    interval = (
        f"[{cert['low']:+.2f}, {cert['high']:+.2f}] dB"
        if cert.get("low") is not None
        else "none (the reference itself)"
    )
    ref_row = next(r for r in summary["candidates"] if r["candidate"] == summary["reference"])
    lines = [
        f"{_HEADER} ({summary['name']}): the cheapest assignment certified against f32.",
        f"# Candidate {candidate.name}; paired {confidence_text(summary)} interval of PSNR - "
        f"PSNR(f32) over seeds {summary['seeds']}: {interval} (margin +-{summary['margin_db']} "
        "dB).",
        f"# Modelled cost {row['model_s'] * 1e6:.1f} us / iteration on "
        f"{summary['cost']['gpu_name']} (f32: {ref_row['model_s'] * 1e6:.1f} us); "
        "report: search.md in the search directory.",
        f"# PSNR per train.seed, this arm: {_psnrs(row)}; f32: {_psnrs(ref_row)} "
        f"(scene {summary['scene']}). Reproduce seed {summary['screen_seed']}:",
        f"#   {summary['reproduce']}",
    ]
    body = yaml.safe_dump(candidate.policy_dict(summary["name"]), sort_keys=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text("\n".join(lines) + "\n" + body)
    tmp.replace(path)
