"""Every precision arm on one device: time per training iteration, peak memory, PSNR.

Usage:
    python benchmarks/gpu_arms.py                      # CUDA when present: nvdiffrec's setting
    python benchmarks/gpu_arms.py --device cpu --resolution 128 --batch 2 --iterations 100 \\
        --texture cpu                                  # the same table on a CPU

Each arm trains the built-in scene through ``mptex.train.train`` (the loop behind
``mptex-train``) from the same seed: on CUDA at nvdiffrec's resolution (512x512, batch 4) with
nvdiffrec's texture (16 levels, log2 19, max resolution 4096). ``time/iter`` is the loop's own
median over iterations, device-synchronised (CUDA: the loop synchronises before reading the
clock); ``peak memory`` is CUDA's max allocated (or the process's peak RSS on a CPU). Arms that
cannot run here (``tcnn_fused`` without tinycudann) are listed as unavailable. Then the
encoder's forward+backward throughput at 2^18 and 2^20 points per backend (see
``benchmarks/encoding.py``). Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from mptex import PrecisionPolicy
from mptex.cli import CONFIG_DIR
from mptex.train import train

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import machine, print_table  # noqa: E402

ARMS = ["nvdiffrec", "f32", "f16_naive", "f16_static", "f16_dynamic", "amp", "bf16", "per_layer",
        "tcnn_fused"]  # fmt: skip


def _config(arm: str, args: argparse.Namespace):
    overrides = [
        f"precision={arm}",
        f"texture={args.texture}",
        f"scene.resolution={args.resolution}",
        f"train.batch_size={args.batch}",
        f"train.iterations={args.iterations}",
        f"train.val_interval={args.iterations}",
        f"train.device={args.device}",
        "train.checkpoint_interval=0",
        "train.progress=false",
    ]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def arm_rows(args: argparse.Namespace) -> list[list[str]]:
    rows = []
    for arm in args.arms:
        ok, why = PrecisionPolicy.named(arm).availability()
        if not ok:
            rows.append([arm, "unavailable", "–", "–", "–", why])
            continue
        with tempfile.TemporaryDirectory() as run_dir:
            metrics = train(_config(arm, args), run_dir)
        rows.append([
            arm,
            f"{metrics['psnr']:.2f}" if metrics["psnr"] is not None else "nan",
            f"{metrics['time_per_iter_s'] * 1e3:.1f} ms",
            f"{metrics['peak_memory_bytes'] / 2**20:.0f} MiB ({metrics['peak_memory_kind']})",
            str(metrics["skipped_steps"]),
            metrics["status"] + (f" at {metrics['diverged_at']}" if metrics["diverged_at"] else ""),
        ])  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=500)
    parser.add_argument(
        "--texture", default="default", help="texture config: default (nvdiffrec's) | cpu"
    )
    parser.add_argument("--arms", nargs="+", default=ARMS)
    parser.add_argument("--skip-encoder", action="store_true")
    args = parser.parse_args()

    size = f"{args.resolution}x{args.resolution}"
    print(f"## Precision arms: builtin scene, {size}, batch {args.batch}, "
          f"{args.iterations} iterations, texture={args.texture}\n")  # fmt: skip
    print_table(
        ["arm", "PSNR (dB)", "time/iter", "peak memory", "skipped", "status"], arm_rows(args)
    )
    print(f"\nmachine: {machine(args.device)}")
    if torch.device(args.device).type == "cuda":
        props = torch.cuda.get_device_properties(args.device)
        memory = f"{props.total_memory / 2**30:.0f} GiB"
        print(f"GPU: {props.name}, {memory}, CUDA {torch.version.cuda}")
    if not args.skip_encoder:
        print("\n## Encoder throughput\n", flush=True)
        subprocess.run([sys.executable, str(HERE / "encoding.py"), "--device", args.device,
                        "--log2-points", "18", "20"], check=True)  # fmt: skip


if __name__ == "__main__":
    main()
