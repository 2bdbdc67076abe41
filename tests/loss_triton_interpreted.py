"""Run mptex.train._loss_triton's kernels on saved cases under Triton's CPU interpreter.

Usage: python tests/loss_triton_interpreted.py CASES.pt RESULTS.pt
   or: python tests/loss_triton_interpreted.py --compile-check (compile for sm_90, no GPU needed)
   or: python tests/loss_triton_interpreted.py --check (fused_loss_check on the CPU)
   or: python tests/loss_triton_interpreted.py --check-flipped (the same, the kernels dividing
       the means' gradients as CUDA torch does: a machine where they would not be torch's)
   or: python tests/loss_triton_interpreted.py --train OUT (the training loop, eager and fused)

Run in a subprocess by tests/test_fused_loss.py: the interpreter is chosen when ``triton.jit``
decorates the kernels, so ``TRITON_INTERPRET=1`` must be in the environment before the module is
first imported, which a fresh process guarantees.

Cases: dicts with ``name``, ``pred``, ``rgba``, ``background``, ``grad`` (a float32 scalar
tensor) and ``tonemap``; or, with ``kind`` "kd", ``tex``, ``tex_jitter``, ``grad`` and
``pixels`` (the smoothness term). Results: ``{name: {"partials": ..., "grad": ...,
"grad_reciprocal": ...}}``, the backward with the mean's division as CPU torch does it and as
CUDA torch does it.
"""

import re
import sys


def compile_check() -> None:
    """Compile the image loss's kernels for sm_90, with and without the tone map, and the
    smoothness term's, with the options the module launches them with; exit 3 (skip) if this
    triton has no CUDA backend. Asserts: every
    float32 division is ``div.rn.f32``; without the tone map (no libdevice code) nothing is
    flushed to zero, approximated or contracted into a multiply-add; with it, the only
    flush-to-zero instructions are libdevice's own approximate reciprocal or ``exp2`` (part of
    its ``logf``/``powf``; which of them depends on the libdevice's release), a small fraction
    of what the kernels hold when libdevice is compiled in its flush-to-zero mode (Triton's
    default), and fewer multiply-adds
    than when contraction is allowed (the kernels' own products and sums stay apart); the
    smoothness kernels have no libdevice code: none of the three at all."""
    import triton
    from triton.compiler import ASTSource
    from triton_subprocess import cuda_target

    target = cuda_target(90)
    import mptex.train._loss_triton as lt

    assert not lt.INTERPRETED
    if lt.LAUNCH_OPTIONS is None:
        print("this triton has no enable_reflect_ftz option: the fused loss is not used")
        sys.exit(3)
    flags = ("TONEMAP", "INTERP", "BLOCK", "MEAN_BY_RECIPROCAL")

    def ptx(kernel, tonemap, **options):
        signature = {name: "constexpr" if name in flags else ("i32" if name == "n" else "*fp32")
                     for name in kernel.arg_names}  # fmt: skip
        constexprs = dict(TONEMAP=tonemap, INTERP=False, BLOCK=lt._BLOCK)
        if "MEAN_BY_RECIPROCAL" in kernel.arg_names:
            constexprs["MEAN_BY_RECIPROCAL"] = True
        compiled = triton.compile(
            ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
            target=target,
            options={**lt.LAUNCH_OPTIONS, **options},
        )
        return compiled.asm["ptx"]

    def ftz(text):
        return re.findall(r"\b[a-z0-9]+(?:\.[a-z0-9]+)*\.ftz(?:\.[a-z0-9]+)*\b", text)

    def fmas(text):
        return len(re.findall(r"\bfma\.rn\.f32\b", text))

    for kernel in (lt._partials_kernel, lt._grad_kernel):
        name = kernel.fn.__name__
        plain = ptx(kernel, False)
        divs = set(re.findall(r"\bdiv\.[a-z.]*f32\b", plain))
        assert divs <= {"div.rn.f32"}, (name, divs)
        assert not ftz(plain) and ".approx" not in plain and not fmas(plain), name
        mapped = ptx(kernel, True)
        divs = set(re.findall(r"\bdiv\.[a-z.]*f32\b", mapped))
        assert divs <= {"div.rn.f32"}, (name, divs)
        approximations = {"rcp.approx.ftz.f32", "ex2.approx.ftz.f32"}  # libdevice's, by design
        assert set(ftz(mapped)) <= approximations, (name, sorted(set(ftz(mapped))))
        flushed = ftz(ptx(kernel, True, enable_reflect_ftz=True))
        assert len(ftz(mapped)) * 10 < len(flushed), (name, len(ftz(mapped)), len(flushed))
        contracted = fmas(ptx(kernel, True, enable_fp_fusion=True))
        assert fmas(mapped) < contracted, (name, fmas(mapped), contracted)
        print(f"{name}: {len(ftz(mapped))} libdevice approximations (flush-to-zero mode: "
              f"{len(flushed)} .ftz), {fmas(mapped)} fma (contracted: {contracted})")  # fmt: skip
    for kernel in (lt._kd_partials_kernel, lt._kd_grad_kernel):
        signature = {name: "constexpr" if name in ("C", "BLOCK", "MEAN_BY_RECIPROCAL")
                     else ("i32" if name in ("n", "pixels") else "*fp32")
                     for name in kernel.arg_names}  # fmt: skip
        for reciprocal in (False, True):
            constexprs = dict(C=3, BLOCK=lt._BLOCK)
            if "MEAN_BY_RECIPROCAL" in kernel.arg_names:
                constexprs["MEAN_BY_RECIPROCAL"] = reciprocal
            text = triton.compile(
                ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                target=target,
                options=lt.LAUNCH_OPTIONS,
            ).asm["ptx"]
            divs = set(re.findall(r"\bdiv\.[a-z.]*f32\b", text))
            assert divs <= {"div.rn.f32"}, (kernel.fn.__name__, divs)
            assert not ftz(text) and ".approx" not in text and not fmas(text), kernel.fn.__name__
    print("the smoothness kernels: no flush to zero, approximation or multiply-add")


def run_cases(cases_path: str, results_path: str) -> None:
    import warnings

    import torch

    import mptex.train._loss_triton as lt

    assert lt.INTERPRETED, "TRITON_INTERPRET=1 did not select the interpreter"
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # numpy on NaN and inf inputs
    results = {}
    for case in torch.load(cases_path):
        if case.get("kind") == "kd":
            args = case["tex"], case["tex_jitter"]
            results[case["name"]] = {
                "partials": lt.kd_partials(*args),
                "grad": lt.kd_grad(*args, case["grad"], case["pixels"], False),
                "grad_reciprocal": lt.kd_grad(*args, case["grad"], case["pixels"], True),
            }
            continue
        args = case["pred"], case["rgba"], case["background"]
        results[case["name"]] = {
            "partials": lt.loss_partials(*args, case["tonemap"]),
            "grad": lt.loss_grad(*args, case["grad"], case["tonemap"], False),
            "grad_reciprocal": lt.loss_grad(*args, case["grad"], case["tonemap"], True),
        }
    torch.save(results, results_path)


def run_check(flipped: bool = False) -> None:
    """``mptex.train.fused_loss.fused_loss_check`` on the CPU, interpreted: a JSON object of its
    answer per fused loss. With ``flipped`` the kernels divide the means' gradients by a
    multiplication by the reciprocal, as on CUDA, where CPU torch divides."""
    import json

    import mptex.train.fused_loss as fused_loss

    if flipped:
        fused_loss._mean_by_reciprocal = lambda device: True
    answers = {loss: fused_loss.fused_loss_check("cpu", loss) for loss in fused_loss.FUSED_LOSSES}
    print(json.dumps(answers))


# The training runs of --train: every arm's loss in l1 (logl1's log and pow are torch's CPU
# functions eager and correctly rounded interpreted); the smoothness term from the first
# iterations on, over 24 x 24 pixels (a count whose reciprocal is not a power of two: the
# means' divisions must be the eager ones); fused Adam and the overlapped loop, as on CUDA.
TRAIN_RUNS = {
    "f32": ["precision=f32", "train.stats_interval=3"],
    # loss scaling with a skipped step; the texture evaluated twice per iteration
    "f16_dynamic": ["precision=f16_dynamic", "train.kd_smooth_joint=false",
                    "train.inject_nonfinite_at=5", "train.stats_interval=2"],
    # the grid and the FP8 GEMMs in their Triton kernels too, as auto picks them on CUDA
    "fp8_triton": ["precision=fp8", "texture.backend=triton", "texture.fp8_gemm=triton",
                   "train.iterations=6", "train.stats_interval=2"],
}  # fmt: skip


def run_training(out: str) -> None:
    """Each of :data:`TRAIN_RUNS` with ``train.fused_loss`` false and true, on the CPU with the
    kernels interpreted (the loop's CUDA requirement of the fused path lifted; its start-up
    check runs): ``OUT/<run>_<fused>.pt``, the checkpoint at the end, and ``OUT/<run>_<fused>
    .json``, metrics.json."""
    import json
    import shutil
    from pathlib import Path

    from test_train import tiny_cfg

    import mptex.train.fused_loss as fused_loss
    import mptex.train.loop as loop
    from mptex.train import train

    def problem(device, loss):
        return None if loss is None or loss in fused_loss.FUSED_LOSSES else "a fused loss"

    fused_loss.fused_loss_problem = loop.fused_loss_problem = problem
    loop._adam_implementation = lambda texture, device: {"fused": True, "foreach": False}
    for name, overrides in TRAIN_RUNS.items():
        for fused in ("false", "true"):
            run_dir = Path(out) / f"{name}_{fused}"
            cfg = tiny_cfg("scene.resolution=24", "train.loss=l1", "train.iterations=12",
                           "train.kd_smooth_ramp=4", *overrides,
                           f"train.fused_loss={fused}")  # fmt: skip
            metrics = train(cfg, run_dir)
            shutil.copy(run_dir / "checkpoint.pt", Path(out) / f"{name}_{fused}.pt")
            (Path(out) / f"{name}_{fused}.json").write_text(json.dumps(metrics, default=str))


if __name__ == "__main__":
    from triton_subprocess import script_main

    if sys.argv[1] in ("--check", "--check-flipped"):
        run_check(flipped=sys.argv[1] == "--check-flipped")
    elif sys.argv[1] == "--train":
        run_training(sys.argv[2])
    else:
        script_main(compile_check, run_cases)
