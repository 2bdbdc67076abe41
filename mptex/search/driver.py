"""The precision search: the cheapest precision assignment whose PSNR is certified against f32.

Algorithm (:func:`run_search`), deterministic for a given ``search.seed``; the screens run at
``seed`` and the certification at the next ``certify_seeds`` seeds, ``seed + 1, ...,
seed + certify_seeds``, and every run is the training protocol of the config (``train`` group)
with one candidate as the ``precision`` group:

1. **Space**: every candidate of ``search.space`` (:func:`~mptex.search.space.enumerate_space`);
   invalid and redundant ones are pruned before any training, with the reason recorded.
2. **Cost**: each candidate's modelled seconds per iteration on ``search.cost.gpu``
   (:mod:`mptex.search.cost`); on a CUDA device the measured ms / iteration of its runs replaces
   the model wherever it has run (the model still orders what is tried).
3. **Reference**: f32 everywhere at the screens' seed and every certification seed.
4. **Screen, one part at a time** (greedy over layers): for the encoder and each linear layer,
   and each lower dtype the space allows, the reference with only that part lowered (with the
   first kept loss-scaling mode of dynamic, static, none) at the screens' seed. A screen passes
   when the run completed (not diverged, not collapsed) and ``|Δ| <= screen_db``, Δ being the
   paired PSNR difference to f32 at that seed.
5. **Combine**: every combination of the lowerings that passed (f32 kept as an option per part),
   cheapest first, screened while cheaper than the cheapest passing candidate so far, at most
   ``max_combinations`` screens.
6. **Variants**: the cheapest passing candidate's dtypes with the other loss-scaling modes and
   without master weights, tcnn's fused network, and the MLP below f16 (FP8 GEMMs, QAT: the
   space's ``quantized``), each screened while cheaper than the cheapest passing candidate, at
   most ``max_variants`` screens. (QAT adds work to the f32 MLP: it is screened only when the
   model finds it cheaper, i.e. with a lower-precision grid than the cheapest passing one.)
7. **Certify**: the passing candidates, cheapest first, each run at the certification seeds,
   which are fresh: the screen's seed chose the candidate (its |Δ| was small there), and an
   interval that counted it again would be pulled towards 0 (a candidate truly 0.5 dB worse
   than f32 was measured to certify about twice as often as the interval's 2.5 % with the
   screen's seed counted, in a simulation of 3 seeds). Certified when all ``certify_seeds`` runs
   completed and the paired Student-t interval of Δ (95 %, or adjusted: below) lies within
   ``[-margin_db, +margin_db]`` (the report's equivalence rule,
   :func:`mptex.intervals.mean_ci`). The first certified is the answer; at most
   ``max_certify`` candidates are tried, each a test of its own (with k tried, the chance that
   one truly outside the margin certifies is up to k x 2.5 %), unless ``search.adjust`` is
   ``bonferroni``: then each interval is at ``1 - 0.05 / max_certify`` and that chance is at
   most 2.5 % for the whole search (:func:`mptex.intervals.family_confidence`). If none
   certifies the answer is f32 itself.
8. **Output** in the search directory: ``search.json`` (every candidate: stage, cost, runs, Δ,
   interval, verdict; the pruned list; the budget), ``search.md`` (the report section) with
   ``pareto.png``, and ``precision/<name>.yaml`` under ``search.config_dir`` (default: the
   search directory's ``configs/``; nothing is written into mptex's own configs), which
   ``mptex-train --config-dir <config dir> precision=<name>`` runs.

Runs live in ``<search dir>/runs/<candidate>/seed<k>/``; a run whose ``metrics.json`` says
completed or diverged is read back instead of trained again, so the same command continues an
interrupted search (and an interrupted run continues from its checkpoint). A search directory
remembers its settings (``search_config.json``) and refuses different ones.

This module is the algorithm; the ``search`` group's schema is :mod:`~mptex.search.config`,
the runs, their worker processes and stop signals :mod:`~mptex.search.pool`, the files written
:mod:`~mptex.search.results`.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mptex.config_schema import plain
from mptex.intervals import CONFIDENCE, family_confidence
from mptex.search.config import SearchError, check_search_config
from mptex.search.cost import iteration_cost, shape_from_config
from mptex.search.pool import RunPool
from mptex.search.results import (
    check_result_path,
    check_search_dir,
    default_result_name,
    result_path,
    settings_record,
    write_results,
)
from mptex.search.space import Candidate, enumerate_space, reference_candidate
from mptex.texture import check_texture_config
from mptex.train.signals import DEFAULT_STOP_SIGNALS, StopSignals

__all__ = ["certify", "run_search"]


def certify(
    deltas: Sequence[float], margin_db: float, confidence: float = CONFIDENCE
) -> dict[str, Any]:
    """Paired interval of ``deltas`` (dB) at ``confidence`` (two-sided; 95 % by default) and
    whether it lies within ``±margin_db``.

    Returns ``mean_ci``'s dict plus ``confidence``, ``verdict`` (the report's) and
    ``certified`` (True only when ``-margin_db <= low`` and ``high <= margin_db``; never with
    fewer than 2 values).
    """
    from mptex.intervals import mean_ci, verdict

    ci = mean_ci(deltas, confidence)
    ok = ci["low"] is not None and -margin_db <= ci["low"] and ci["high"] <= margin_db
    return {**ci, "confidence": confidence, "verdict": verdict(ci, margin_db),
            "certified": bool(ok)}  # fmt: skip


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

    folder = CONFIG_DIR / "texture"
    path = folder / f"{name}.yaml"
    if "/" in name or "\\" in name or not path.is_file():
        names = sorted(p.stem for p in folder.glob("*.yaml"))
        raise SearchError(f"search.cost.texture: expected the name of one of mptex's texture "
                          f"configs {names}, got {name!r}")  # fmt: skip
    return {"texture": OmegaConf.to_container(OmegaConf.load(path), resolve=True)}


def run_search(cfg: Mapping[str, Any], out: str | os.PathLike) -> dict[str, Any]:
    """Run the search (module docstring) for the composed config ``cfg`` into ``out``.

    Args:
        cfg: ``mptex-train``'s composed config with a ``search`` block
            (:class:`~mptex.search.config.SearchConfig`'s defaults for missing keys);
            ``precision`` is ignored (the search sets it per run).
        out: the search directory.

    Returns:
        the ``search.json`` dict.

    Raises:
        SearchError: a bad ``search`` key or an unusable search directory, before any training.
        ValueError: a bad ``scene``/``texture``/``train`` key (the training's own check).
        SearchInterrupted: a stop signal (SIGTERM, SIGINT, SIGUSR1, SIGUSR2) stopped it; the
            same call continues it.
    """
    from mptex.train.config import validate_config

    start = time.perf_counter()
    given = dict(plain(cfg))
    settings = check_search_config(given.pop("search", None))
    out = Path(out)
    base = {k: v for k, v in given.items() if k in ("scene", "texture", "train", "export")}
    # The reference arm is sized by the texture's depth: its group checked first, so that a
    # bad texture.hidden is the check's one line, not int()'s error.
    n_layers = check_texture_config(base.get("texture"))["hidden"] + 1
    ref = reference_candidate(n_layers)
    full = validate_config({**base, "precision": ref.policy_dict()})
    base["train"] = dict(full["train"])
    scene_name = str(full["scene"].get("name", "scene"))
    name = settings["name"] or default_result_name(scene_name)
    result = result_path(settings, name, out)
    check_result_path(result, name)
    check_search_dir(out, settings_record(settings, full))

    kept_list, pruned = enumerate_space(
        n_layers, int(base["texture"]["internal_dims"]), settings["space"]
    )
    kept = set(kept_list) | {ref}
    points = settings["cost"]["points"] or _points(full)
    shape = shape_from_config(_cost_texture(settings, full), points)
    model = {c.name: iteration_cost(c, shape, settings["cost"]["gpu"]) for c in kept}

    # The runs' own handlers stop them; the search's records the signal, relays it to the
    # worker processes and starts nothing new.
    stop = StopSignals(relay=True)
    try:
        stop.install(DEFAULT_STOP_SIGNALS, owner="run_search()")
        state = SearchState(settings=settings, ref=ref, kept=kept, pruned=pruned, model=model,
                            points=points, shape=shape, name=name, result_path=result, out=out,
                            start=start, pool=RunPool(base, out, settings, stop))  # fmt: skip
        return _search(state)
    finally:
        stop.uninstall()


@dataclass
class SearchState:
    """What the search's stages share: the settings, the space and its modelled costs, the
    pool of runs and the stage each candidate was first tried in."""

    settings: dict[str, Any]
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
    pool: RunPool
    stages: dict[str, str] = field(default_factory=dict)

    @property
    def screen_seed(self) -> int:
        """The seed every screen runs at."""
        return self.settings["seed"]

    @property
    def seeds(self) -> list[int]:
        """The certification's seeds: the ``certify_seeds`` after the screens' (module
        docstring, step 7)."""
        first = self.screen_seed + 1
        return [first + i for i in range(self.settings["certify_seeds"])]

    def cost(self, c: Candidate) -> float:
        """Modelled seconds per iteration."""
        return self.model[c.name]["seconds"]

    def delta(self, c: Candidate, seed: int) -> float | None:
        """PSNR(c) - PSNR(f32) at ``seed``; None unless both runs completed."""
        a = self.pool.results.get((c.name, seed))
        b = self.pool.results.get((self.ref.name, seed))
        if not a or not b or a["status"] != "completed" or b["status"] != "completed":
            return None
        return float(a["psnr"]) - float(b["psnr"])

    def certificate(self, c: Candidate) -> dict[str, Any]:
        """:func:`certify` over the certification seeds, or why it cannot be made."""
        deltas = [self.delta(c, s) for s in self.seeds]
        if any(d is None for d in deltas):
            statuses = [(self.pool.results.get((c.name, s)) or {}).get("status")
                        for s in self.seeds]  # fmt: skip
            reason = f"runs not completed: {statuses}"
            # A seed where f32's run did not complete has no Δ either: name those runs too.
            ref = [(self.pool.results.get((self.ref.name, s)) or {}).get("status")
                   for s in self.seeds]  # fmt: skip
            if c != self.ref and any(status != "completed" for status in ref):
                reason += f"; f32's: {ref}"
            return {
                "certified": False,
                "n": sum(d is not None for d in deltas),
                "reason": reason,
            }
        return certify(deltas, self.settings["margin_db"], self.confidence)

    @property
    def confidence(self) -> float:
        """Each certification interval's two-sided confidence (``search.adjust``)."""
        settings = self.settings
        return family_confidence(settings["max_certify"], settings["adjust"])


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


def _search(state: SearchState) -> dict[str, Any]:
    """Stages 3-8 of the module docstring."""
    settings, ref, kept, pool = state.settings, state.ref, state.kept, state.pool
    n_layers = len(ref.layers)
    seeds, s0 = state.seeds, state.screen_seed
    stages = state.stages
    scale = float(settings["space"]["static_loss_scale"])
    cost = state.cost

    def order(cands):
        return sorted(cands, key=lambda c: (cost(c), c.name))

    def passes(c: Candidate) -> bool:
        d = state.delta(c, s0)
        return d is not None and abs(d) <= settings["screen_db"]

    def screen(cands: Sequence[Candidate], stage: str) -> None:
        for c in cands:
            stages.setdefault(c.name, stage)
        pool.run([(c, s0) for c in cands])

    # 3-4: the reference at every seed and the one-part lowerings at the screens', one batch.
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
    pool.run([(ref, s) for s in [s0, *seeds]] + [(c, s0) for c in singles])
    passed = [c for c in singles if passes(c)]

    def best_cost() -> float:
        return min([cost(ref)] + [cost(c) for c in passed])

    def explore(cands: Sequence[Candidate], stage: str, budget: int) -> None:
        tried = 0
        todo = [c for c in order(cands) if c.name not in stages]
        while tried < budget:
            todo = [c for c in todo if cost(c) < best_cost()]
            batch = todo[: min(settings["workers"], budget - tried)]
            if not batch:
                return
            screen(batch, stage)
            tried += len(batch)
            todo = todo[len(batch) :]
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

    # 6: variants of the cheapest passing candidate: other loss scaling, no masters, fused, and
    # the MLP below f16.
    best = order([ref] + passed)[0]
    variants = [
        c
        for c in kept
        if c.mlp == "fused"
        or c.quant != "none"
        or (c.encoder == best.encoder and c.layers == best.layers)
    ]
    explore([c for c in variants if c != best], "screen: variant", settings["max_variants"])

    # 7: certification, cheapest first.
    certified = ref
    tried = []
    for c in order(c for c in passed if cost(c) < cost(ref)):
        if len(tried) >= settings["max_certify"]:
            break
        tried.append(c)
        pool.run([(c, s) for s in seeds])
        if state.certificate(c)["certified"]:
            certified = c
            break
    return write_results(state, certified)
