"""The precision search: the cheapest precision assignment whose PSNR is certified against f32.

Algorithm (:func:`run_search`), deterministic for a given ``search.seed``; seeds used are
``seed, seed + 1, ..., seed + certify_seeds - 1`` and every run is the training protocol of the
config (``train`` group) with one candidate as the ``precision`` group:

1. **Space**: every candidate of ``search.space`` (:func:`~mptex.search.space.enumerate_space`);
   invalid and redundant ones are pruned before any training, with the reason recorded.
2. **Cost**: each candidate's modelled seconds per iteration on ``search.cost.gpu``
   (:mod:`mptex.search.cost`); on a CUDA device the measured ms / iteration of its runs replaces
   the model wherever it has run (the model still orders what is tried).
3. **Reference**: f32 everywhere at every certification seed.
4. **Screen, one part at a time** (greedy over layers): for the encoder and each linear layer,
   and each lower dtype the space allows, the reference with only that part lowered (with the
   first kept loss-scaling mode of dynamic, static, none) at the first seed. A screen passes
   when the run completed (not diverged, not collapsed) and ``|Δ| <= screen_db``, Δ being the
   paired PSNR difference to f32 at that seed.
5. **Combine**: every combination of the lowerings that passed (f32 kept as an option per part),
   cheapest first, screened while cheaper than the cheapest passing candidate so far, at most
   ``max_combinations`` screens.
6. **Variants**: the cheapest passing candidate's dtypes with the other loss-scaling modes and
   without master weights, and tcnn's fused network, each screened while cheaper than the
   cheapest passing candidate, at most ``max_variants`` screens.
7. **Certify**: the passing candidates, cheapest first, each re-run at the other seeds; certified
   when all ``certify_seeds`` runs completed and the paired 95 % Student-t interval of Δ lies
   within ``[-margin_db, +margin_db]`` (the report's equivalence rule,
   :func:`mptex.intervals.mean_ci`). The first certified is the answer; at most
   ``max_certify`` candidates are tried. If none certifies the answer is f32 itself.
8. **Output** in the search directory: ``search.json`` (every candidate: stage, cost, runs, Δ,
   interval, verdict; the pruned list; the budget), ``search.md`` (the report section) with
   ``pareto.png``, and ``precision/<name>.yaml`` under ``search.config_dir`` (default: the
   search directory's ``configs/``; nothing is written into mptex's own configs), which
   ``mptex-train --config-dir <config dir> precision=<name>`` runs.

Runs live in ``<search dir>/runs/<candidate>/seed<k>/``; a run whose ``metrics.json`` says
completed or diverged is read back instead of trained again, so the same command continues an
interrupted search (and an interrupted run continues from its checkpoint). A search directory
remembers its settings (``search_config.json``) and refuses different ones.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shlex
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from mptex.search.cost import GPUS, iteration_cost, shape_from_config
from mptex.search.space import Candidate, check_space, enumerate_space, reference_candidate

__all__ = [
    "SEARCH_DEFAULTS",
    "SearchError",
    "SearchInterrupted",
    "check_search_config",
    "run_search",
    "certify",
]

SEARCH_DEFAULTS: dict[str, Any] = {
    "name": None,  # the result's precision arm name; null: search_<scene>
    "seed": 0,
    "certify_seeds": 3,
    "margin_db": 0.5,  # the report's equivalence margin (mptex.intervals.EQUIVALENCE_MARGIN_DB)
    "screen_db": 0.5,
    "max_combinations": 3,
    "max_variants": 4,
    "max_certify": 3,
    "workers": 2,  # training runs at a time (one process each)
    "threads": 1,  # torch threads per run
    "space": {},
    "cost": {"gpu": "h100", "points": None, "texture": None},
    "config_dir": None,  # where precision/<name>.yaml is written; null: <search dir>/configs
}
_HEADER = "# Written by mptex's precision search"
_DONE = ("completed", "diverged")


class SearchError(ValueError):
    """A bad ``search`` config or a search directory that cannot be used; one line."""


class SearchInterrupted(RuntimeError):
    """A stop signal ended the search; the same command continues it."""


_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")


class _StopFlag:
    """While installed, a stop signal sets ``raised`` and is passed on to the worker processes
    (each run checkpoints and stops, mptex.train's own handling); the search then stops before
    starting anything new."""

    def __init__(self) -> None:
        self.raised: str | None = None
        self._old: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        import multiprocessing
        import signal

        self.raised = signal.Signals(signum).name
        for child in multiprocessing.active_children():
            try:
                os.kill(child.pid, signum)
            except (ProcessLookupError, TypeError):
                pass

    def __enter__(self) -> _StopFlag:
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for name in _STOP_SIGNALS:
                signum = getattr(signal, name)
                self._old[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        import signal

        for signum, handler in self._old.items():
            signal.signal(signum, handler)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_search_config(search: Mapping[str, Any] | None) -> dict[str, Any]:
    """``search`` with defaults filled in; :class:`SearchError` naming the first bad key."""
    s = dict(search or {})
    unknown = sorted(set(s) - set(SEARCH_DEFAULTS) - {"enabled"})
    if unknown:
        raise SearchError(
            f"search.{unknown[0]}: unknown key; valid keys: {sorted(SEARCH_DEFAULTS)}"
        )
    s = {**SEARCH_DEFAULTS, **s}
    s["cost"] = {**SEARCH_DEFAULTS["cost"], **dict(s["cost"] or {})}

    def need(key, ok, what):
        if not ok:
            raise SearchError(f"search.{key}: expected {what}, got {_get(s, key)!r}")

    need(
        "name",
        s["name"] is None or (isinstance(s["name"], str) and s["name"].isidentifier()),
        "null or a name of letters, digits and _",
    )
    need("seed", _is_int(s["seed"]) and s["seed"] >= 0, "an integer >= 0")
    need(
        "certify_seeds",
        _is_int(s["certify_seeds"]) and s["certify_seeds"] >= 2,
        "an integer >= 2 (an interval needs two paired seeds)",
    )
    for key in ("margin_db", "screen_db"):
        need(key, _is_number(s[key]) and s[key] > 0, "a number > 0")
    for key in ("max_combinations", "max_variants"):
        need(key, _is_int(s[key]) and s[key] >= 0, "an integer >= 0")
    for key in ("max_certify", "workers", "threads"):
        need(key, _is_int(s[key]) and s[key] >= 1, "an integer >= 1")
    unknown = sorted(set(s["cost"]) - set(SEARCH_DEFAULTS["cost"]))
    if unknown:
        raise SearchError(
            f"search.cost.{unknown[0]}: unknown key; valid keys: {sorted(SEARCH_DEFAULTS['cost'])}"
        )
    need("cost.gpu", s["cost"]["gpu"] in GPUS, f"one of {sorted(GPUS)}")
    need(
        "cost.points",
        s["cost"]["points"] is None or (_is_int(s["cost"]["points"]) and s["cost"]["points"] >= 1),
        "null (this run's texture queries per iteration) or an integer >= 1",
    )
    need(
        "cost.texture",
        s["cost"]["texture"] is None or isinstance(s["cost"]["texture"], str),
        "null (this run's texture group) or a configs/texture name",
    )
    try:
        s["space"] = check_space(s["space"])
    except ValueError as exc:
        raise SearchError(str(exc)) from None
    return s


def _get(s: Mapping[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        s = s.get(part) if isinstance(s, Mapping) else None
    return s


# --------------------------------------------------------------------------- runs
def _job(cfg: dict[str, Any], run_dir: str) -> dict[str, Any]:
    """One training run (in a worker process); the metrics the search reads."""
    from mptex.train import train

    try:
        metrics = train(cfg, run_dir)
    except Exception as exc:  # noqa: BLE001 - a failed run is a result (metrics.json has it)
        return {**_summary({}), "status": "failed", "error": f"{type(exc).__name__}: {exc}"}
    return _summary(metrics)


def _summary(metrics: Mapping[str, Any]) -> dict[str, Any]:
    from mptex.collapse import classify_collapse

    status = metrics.get("status")
    note = None
    if status == "completed":
        collapse = classify_collapse(metrics)
        if collapse is not None:
            status, note = "collapsed", str(collapse.get("reason") or "collapsed")
    return {
        "status": status,
        "psnr": metrics.get("psnr"),
        "baseline_psnr": metrics.get("baseline_psnr"),
        "time_per_iter_s": metrics.get("time_per_iter_s"),
        "wall_time_s": metrics.get("wall_time_s"),
        "iterations": metrics.get("iterations"),
        "device": metrics.get("device"),
        "error": metrics.get("error"),
        "note": note,
    }


class _Runner:
    """Trains (candidate, seed) runs, reusing finished ones; ``workers`` processes at a time."""

    def __init__(
        self, base: dict[str, Any], out: Path, settings: Mapping[str, Any], stop: _StopFlag
    ):
        self.base, self.out, self.settings, self.stop = base, out, settings, stop
        self.results: dict[tuple[str, int], dict[str, Any]] = {}
        self.trained, self.reused = 0, 0

    def run_dir(self, candidate: Candidate, seed: int) -> Path:
        return self.out / "runs" / candidate.name / f"seed{seed}"

    def config(self, candidate: Candidate, seed: int) -> dict[str, Any]:
        cfg = json.loads(json.dumps(self.base))
        cfg["precision"] = candidate.policy_dict()
        cfg["train"].update(
            seed=seed,
            threads=self.settings["threads"],
            progress=False,
            n_val_images=0,
            resume="auto",
        )
        return cfg

    def _finished(self, run_dir: Path) -> dict[str, Any] | None:
        path = run_dir / "metrics.json"
        if not path.is_file():
            return None
        try:
            metrics = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return _summary(metrics) if metrics.get("status") in _DONE else None

    def run(self, jobs: Sequence[tuple[Candidate, int]]) -> None:
        todo = []
        for candidate, seed in dict.fromkeys(jobs):
            key = (candidate.name, seed)
            if key in self.results:
                continue
            done = self._finished(self.run_dir(candidate, seed))
            if done is not None:
                self.results[key] = done
                self.reused += 1
            else:
                todo.append((candidate, seed))
        if not todo:
            return
        if self.stop.raised:
            raise SearchInterrupted(
                f"stopped by {self.stop.raised}; the same command continues "
                f"the search in {self.out}"
            )
        args = [(self.config(c, s), str(self.run_dir(c, s))) for c, s in todo]
        workers = min(self.settings["workers"], len(todo))
        if workers == 1:
            outputs = [_job(*a) for a in args]
        else:
            # spawn: a fresh interpreter per job, so no torch state (threads, seeds) leaks between
            # runs and a run is the same whichever worker trains it.
            with ProcessPoolExecutor(
                workers, mp_context=get_context("spawn"), max_tasks_per_child=1
            ) as pool:
                outputs = list(pool.map(_job, *zip(*args, strict=True)))
        for (candidate, seed), result in zip(todo, outputs, strict=True):
            self.results[(candidate.name, seed)] = result
            self.trained += 1
        stopped = [
            self.run_dir(c, s)
            for (c, s), r in zip(todo, outputs, strict=True)
            if r["status"] == "interrupted"
        ]
        if stopped or self.stop.raised:
            raise SearchInterrupted(
                f"stopped by {self.stop.raised or 'a signal'} ({len(stopped)} run(s) "
                f"checkpointed); the same command continues the search in {self.out}"
            )


# --------------------------------------------------------------------------- statistics
def certify(deltas: Sequence[float], margin_db: float) -> dict[str, Any]:
    """Paired 95 % interval of ``deltas`` (dB) and whether it lies within ``±margin_db``.

    Returns ``mean_ci``'s dict plus ``verdict`` (the report's) and ``certified`` (True only when
    ``-margin_db <= low`` and ``high <= margin_db``; never with fewer than 2 values).
    """
    from mptex.intervals import mean_ci, verdict

    ci = mean_ci(deltas)
    ok = ci["low"] is not None and -margin_db <= ci["low"] and ci["high"] <= margin_db
    return {**ci, "verdict": verdict(ci, margin_db), "certified": bool(ok)}


# --------------------------------------------------------------------------- the search
def _points(full: Mapping[str, Any]) -> int:
    """Texture queries per iteration of the run config: views x covered pixels (mean over the
    training views) x 2 with the kd smoothness term."""
    import torch

    from mptex.scenes import build_scene

    scene = build_scene(full["scene"], "cpu")
    with torch.no_grad():
        coverage = scene.train_views(range(scene.n_train_views)).mask.float().mean().item()
    train = full["train"]
    h, w = scene.resolution
    reg = 2 if train["kd_smooth"] and train["kd_smooth_weight"] > 0 else 1
    return max(1, round(train["batch_size"] * h * w * coverage * reg))


def _cost_texture(settings: Mapping[str, Any], full: Mapping[str, Any]) -> dict[str, Any]:
    name = settings["cost"]["texture"]
    if name is None:
        return full
    from omegaconf import OmegaConf

    from mptex._paths import CONFIG_DIR

    path = CONFIG_DIR / "texture" / f"{name}.yaml"
    if not path.is_file():
        raise SearchError(f"search.cost.texture: no texture config {name!r} ({path})")
    return {"texture": OmegaConf.to_container(OmegaConf.load(path), resolve=True)}


def _result_path(settings: Mapping[str, Any], name: str, out: Path) -> Path:
    """``<config dir>/precision/<name>.yaml``: ``search.config_dir``, by default the search
    directory's ``configs/``, never mptex's own configs (``mptex-train --config-dir`` adds it)."""
    root = Path(settings["config_dir"]) if settings["config_dir"] else out / "configs"
    return root / "precision" / f"{name}.yaml"


def _check_result_path(path: Path) -> None:
    if path.exists():
        first = path.read_text().splitlines()[:1]
        if not first or not first[0].startswith(_HEADER):
            raise SearchError(
                f"search.name: {path} exists and was not written by a precision search; "
                "choose another search.name"
            )


def _settings_record(settings: Mapping[str, Any], full: Mapping[str, Any]) -> dict[str, Any]:
    train = {
        k: v
        for k, v in full["train"].items()
        if k
        not in (
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
    }
    return {
        "search": {k: v for k, v in settings.items() if k not in ("workers", "threads")},
        "scene": full["scene"],
        "texture": full["texture"],
        "train": train,
    }


def _check_dir(out: Path, record: Mapping[str, Any]) -> None:
    path = out / "search_config.json"
    if path.is_file():
        old = json.loads(path.read_text())
        if old != json.loads(json.dumps(record)):
            keys = sorted(k for k in set(old) | set(record) if old.get(k) != record.get(k))
            raise SearchError(
                f"search dir {out} holds a search with other settings ({', '.join(keys)} "
                "differ); use a new directory or the same settings to continue it"
            )
    else:
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1, sort_keys=True, default=str))


def _preferred(
    kept: set[Candidate], enc: str, layers: tuple[str, ...], scale: float
) -> Candidate | None:
    """The candidate with these dtypes and the first kept loss scaling of dynamic, static,
    none (f16 values want a scale; bf16 and f32 ones do not, and the space prunes it)."""
    for mode in ("dynamic", "static", "none"):
        c = Candidate(enc, layers, True, mode, scale)
        if c in kept:
            return c
    return None


def run_search(cfg: Mapping[str, Any], out: str | os.PathLike) -> dict[str, Any]:
    """Run the search (module docstring) for the composed config ``cfg`` into ``out``.

    Args:
        cfg: ``mptex-train``'s composed config with a ``search`` block (``SEARCH_DEFAULTS``
            for missing keys); ``precision`` is ignored (the search sets it per run).
        out: the search directory.

    Returns:
        the ``search.json`` dict.

    Raises:
        SearchError: a bad ``search`` key or an unusable search directory, before any training.
        ValueError: a bad ``scene``/``texture``/``train`` key (the training's own check).
    """
    from mptex.train.config import _plain, validate_config

    start = time.perf_counter()
    plain = dict(_plain(cfg))
    settings = check_search_config(plain.pop("search", None))
    out = Path(out)
    base = {k: v for k, v in plain.items() if k in ("scene", "texture", "train", "export")}
    n_layers = int(base["texture"]["hidden"]) + 1
    ref = reference_candidate(n_layers)
    full = validate_config({**base, "precision": ref.policy_dict()})
    base["train"] = dict(full["train"])
    scene_name = str(full["scene"].get("name", "scene"))
    name = settings["name"] or f"search_{scene_name}"
    result_path = _result_path(settings, name, out)
    _check_result_path(result_path)
    record = _settings_record(settings, full)
    _check_dir(out, record)

    kept_list, pruned = enumerate_space(
        n_layers, int(base["texture"]["internal_dims"]), settings["space"]
    )
    kept = set(kept_list) | {ref}
    points = settings["cost"]["points"] or _points(full)
    shape = shape_from_config(_cost_texture(settings, full), points)
    model = {c.name: iteration_cost(c, shape, settings["cost"]["gpu"]) for c in kept}

    state = _State(settings=settings, base=base, ref=ref, kept=kept, pruned=pruned,
                   model=model, points=points, shape=shape, name=name,
                   result_path=result_path, out=out, start=start)  # fmt: skip
    with _StopFlag() as stop:
        return _search(state, stop)


@dataclass
class _State:
    """What the search's stages share."""

    settings: dict[str, Any]
    base: dict[str, Any]
    ref: Candidate
    kept: set[Candidate]
    pruned: list[dict[str, Any]]
    model: dict[str, dict[str, Any]]
    points: int
    shape: Any
    name: str
    result_path: Path
    out: Path
    start: float
    stages: dict[str, str] = field(default_factory=dict)
    runner: Any = None
    delta: Any = None

    @property
    def seeds(self) -> list[int]:
        first = self.settings["seed"]
        return [first + i for i in range(self.settings["certify_seeds"])]


def _search(state: _State, stop: _StopFlag) -> dict[str, Any]:
    settings, ref, kept, model, out = (state.settings, state.ref, state.kept, state.model,
                                       state.out)  # fmt: skip
    n_layers = len(ref.layers)
    runner = state.runner = _Runner(state.base, out, settings, stop)
    seeds = state.seeds
    s0 = seeds[0]
    stages = state.stages
    scale = float(settings["space"]["static_loss_scale"])

    def cost(c: Candidate) -> float:
        return model[c.name]["seconds"]

    def order(cands):
        return sorted(cands, key=lambda c: (cost(c), c.name))

    def delta(c: Candidate, seed: int) -> float | None:
        a, b = runner.results.get((c.name, seed)), runner.results.get((ref.name, seed))
        if not a or not b or a["status"] != "completed" or b["status"] != "completed":
            return None
        return float(a["psnr"]) - float(b["psnr"])

    def passes(c: Candidate) -> bool:
        d = delta(c, s0)
        return d is not None and abs(d) <= settings["screen_db"]

    def screen(cands: Sequence[Candidate], stage: str) -> None:
        for c in cands:
            stages.setdefault(c.name, stage)
        runner.run([(c, s0) for c in cands])

    # 3-4: the reference at every seed and the one-part lowerings at the first seed, one batch.
    stages[ref.name] = "reference"
    singles = []
    for enc in sorted({c.encoder for c in kept if c.mlp == "linear"} - {"f32"}):
        c = _preferred(kept, enc, ref.layers, scale)
        singles += [c] if c else []
    for i in range(n_layers):
        for d in sorted({c.layers[i] for c in kept if c.mlp == "linear"} - {"f32"}):
            layers = ref.layers[:i] + (d,) + ref.layers[i + 1 :]
            c = _preferred(kept, "f32", layers, scale)
            singles += [c] if c else []
    for c in singles:
        stages.setdefault(c.name, "screen: one part")
    runner.run([(ref, s) for s in seeds] + [(c, s0) for c in singles])
    passed = [c for c in singles if passes(c)]

    def best_cost() -> float:
        return min([cost(ref)] + [cost(c) for c in passed])

    def explore(pool: Sequence[Candidate], stage: str, budget: int) -> None:
        tried = 0
        pool = [c for c in order(pool) if c.name not in stages]
        while tried < budget:
            pool = [c for c in pool if cost(c) < best_cost()]
            batch = pool[: min(settings["workers"], budget - tried)]
            if not batch:
                return
            screen(batch, stage)
            tried += len(batch)
            pool = pool[len(batch) :]
            passed.extend(c for c in batch if passes(c))

    # 5: combinations of the parts that passed.
    options = [["f32"] + sorted({c.encoder for c in passed if c.encoder != "f32"})]
    for i in range(n_layers):
        options.append(
            ["f32"]
            + sorted(
                {
                    c.layers[i]
                    for c in passed
                    if c.layers[i] != "f32" and c.encoder == "f32" and c.mlp == "linear"
                }
            )
        )
    combos = []
    for enc, *layers in itertools.product(*options):
        changed = (enc != "f32") + sum(d != "f32" for d in layers)
        if changed >= 2 and (c := _preferred(kept, enc, tuple(layers), scale)) is not None:
            combos.append(c)
    explore(combos, "screen: combination", settings["max_combinations"])

    # 6: variants of the cheapest passing candidate: other loss scaling, no masters, fused.
    best = order([ref] + passed)[0]
    variants = [
        c
        for c in kept
        if c.mlp == "fused" or (c.encoder == best.encoder and c.layers == best.layers)
    ]
    explore([c for c in variants if c != best], "screen: variant", settings["max_variants"])

    # 7: certification, cheapest first.
    certified = ref
    tried = []
    for c in order(c for c in passed if cost(c) < cost(ref)):
        if len(tried) >= settings["max_certify"]:
            break
        tried.append(c)
        runner.run([(c, s) for s in seeds])
        if _certificate(c, seeds, delta, runner, settings)["certified"]:
            certified = c
            break

    state.delta = delta
    summary = _summarise(state, certified)
    _write_result(state.result_path, certified, summary)
    (out / "search.json").write_text(json.dumps(summary, indent=1, default=str))
    from mptex.search.report import write_search_report

    write_search_report(out, summary)
    return summary


def _certificate(c, seeds, delta, runner, settings) -> dict[str, Any]:
    deltas = [delta(c, s) for s in seeds]
    statuses = [(runner.results.get((c.name, s)) or {}).get("status") for s in seeds]
    if any(d is None for d in deltas):
        return {
            "certified": False,
            "n": sum(d is not None for d in deltas),
            "reason": f"runs not completed: {statuses}",
        }
    return certify(deltas, settings["margin_db"])


def _summarise(state: _State, certified: Candidate) -> dict[str, Any]:
    settings, runner, seeds, delta, ref = (state.settings, state.runner, state.seeds,
                                           state.delta, state.ref)  # fmt: skip
    kept, model, stages, shape = state.kept, state.model, state.stages, state.shape
    rows = []
    summary_scene = runner.base["scene"].get("name")
    by_name = {c.name: c for c in kept}
    for cname, stage in stages.items():
        c = by_name[cname]
        runs = {s: runner.results[(cname, s)] for s in seeds if (cname, s) in runner.results}
        measured = [
            r["time_per_iter_s"]
            for r in runs.values()
            if str(r.get("device") or "").startswith("cuda") and r.get("time_per_iter_s")
        ]
        deltas = {s: delta(c, s) for s in runs}
        cert = _certificate(c, seeds, delta, runner, settings) if len(runs) == len(seeds) else None
        rows.append(
            {
                "candidate": cname,
                "stage": stage,
                **c.to_json(),
                "model_s": model[cname]["seconds"],
                "measured_s": sorted(measured)[len(measured) // 2] if measured else None,
                "runs": {str(s): r for s, r in runs.items()},
                "delta_db": {str(s): d for s, d in deltas.items()},
                "screen_passed": (
                    deltas.get(seeds[0]) is not None
                    and abs(deltas[seeds[0]]) <= settings["screen_db"]
                ),
                "certificate": cert,
            }
        )
    for row in rows:
        row["cost_s"] = row["measured_s"] if row["measured_s"] is not None else row["model_s"]
    rows.sort(key=lambda r: (r["cost_s"], r["candidate"]))
    all_runs = list(runner.results.values())
    return {
        "name": state.name,
        "scene": summary_scene,
        "reproduce": _reproduce(state.name, seeds[0], state.result_path.parents[1]),
        "result_config": str(state.result_path),
        "certified": certified.name,
        "certified_is_reference": certified == ref,
        "reference": ref.name,
        "seeds": seeds,
        "margin_db": settings["margin_db"],
        "screen_db": settings["screen_db"],
        "cost": {
            "gpu": settings["cost"]["gpu"],
            "gpu_name": GPUS[settings["cost"]["gpu"]].name,
            "source": GPUS[settings["cost"]["gpu"]].source,
            "points": state.points,
            "shape": vars(shape),
            "measured": any(r["measured_s"] for r in rows),
            "reference_parts": model[ref.name]["parts"],
            "certified_parts": model[certified.name]["parts"],
        },
        "space": {"kept": len(kept), "pruned": state.pruned},
        "candidates": rows,
        "budget": {
            "runs": len(all_runs),
            "trained": runner.trained,
            "reused": runner.reused,
            "iterations": sum(int(r.get("iterations") or 0) for r in all_runs),
            "run_wall_s": sum(float(r.get("wall_time_s") or 0) for r in all_runs),
            "search_wall_s": time.perf_counter() - state.start,
            "workers": settings["workers"],
        },
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
        ["mptex-train", "--config-dir", shlex.quote(str(config_dir)), "+experiment=quick",
         f"precision={name}", f"train.seed={seed}", *extra]  # fmt: skip
    )


def _psnrs(row: Mapping[str, Any]) -> str:
    return ", ".join(
        f"{seed}: {run['psnr']:.2f} dB"
        for seed, run in row["runs"].items()
        if run.get("psnr") is not None
    )


def _write_result(path: Path, candidate: Candidate, summary: Mapping[str, Any]) -> None:
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
        f"# Candidate {candidate.name}; paired 95 % interval of PSNR - PSNR(f32) over seeds "
        f"{summary['seeds']}: {interval} (margin +-{summary['margin_db']} dB).",
        f"# Modelled cost {row['model_s'] * 1e6:.1f} us / iteration on "
        f"{summary['cost']['gpu_name']} (f32: {ref_row['model_s'] * 1e6:.1f} us); "
        "report: search.md in the search directory.",
        f"# PSNR per train.seed, this arm: {_psnrs(row)}; f32: {_psnrs(ref_row)} "
        f"(scene {summary['scene']}). Reproduce seed {summary['seeds'][0]}:",
        f"#   {summary['reproduce']}",
    ]
    body = yaml.safe_dump(candidate.policy_dict(summary["name"]), sort_keys=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text("\n".join(lines) + "\n" + body)
    tmp.replace(path)
