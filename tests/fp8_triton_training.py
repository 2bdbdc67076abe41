"""Train the FP8 arms a few iterations on the CPU as a GPU with FP8 tensor cores would:

    python tests/fp8_triton_training.py OUT c|triton ARM...

Every FP8 GEMM goes through ``torch._scaled_mm`` (its CPU kernel; ``has_fp8_tensor_cores``
patched to true). Each quantisation (the QAT arms' E4M3 rounding included) runs the C kernel
(``c``) or, with ``TRITON_INTERPRET=1`` in
the environment, mptex's Triton kernels under Triton's interpreter (``triton``; every
quantisation in its form for large tensors: the per-tensor amax over two launches, a row-wise
tensor and its transpose in two launches, the transpose's columns in chunks; the
``torch._scaled_mm`` operands that need padding copied by :mod:`mptex._fp8_layout_triton`'s
kernel instead of zeros and a copy). Writes ``OUT/ARM.pt`` (the checkpoint) and
``OUT/ARM.json`` (the loss history, and in ``triton`` mode the number of quantisations, of
row-wise quantisations both ways in two launches and of padded copies). Run by
``tests/test_fp8_triton.py``: both modes must train the same bits.
"""

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

import mptex.fp8
from mptex.cli import CONFIG_DIR
from mptex.train import train

TINY = [
    "train=tiny", "texture=tiny", "scene.resolution=32", "scene.n_train_views=4",
    "scene.n_val_views=2", "scene.tubular_segments=48", "scene.radial_segments=8",
    "train.iterations=3", "train.val_interval=3", "train.checkpoint_interval=3",
    "train.stats_interval=2",
]  # fmt: skip


def main(out: Path, mode: str, arms: list[str]) -> None:
    mptex.fp8.has_fp8_tensor_cores = lambda device, rowwise=False: True
    counts = {"quantisations": 0, "both_split": 0, "padded_copies": 0}
    if mode == "triton":
        import mptex._fp8_layout_triton as layout
        import mptex._fp8_triton as kernels

        copy = layout.padded_copy

        def padded_copy(*args):
            counts["padded_copies"] += 1
            return copy(*args)

        layout.padded_copy = padded_copy

        assert kernels.INTERPRETED, "TRITON_INTERPRET=1 did not select the interpreter"
        kernels._TILES_PER_CHUNK = 1  # split any row longer than one tile
        kernels._ONE_PROGRAM_BLOCKS = 0  # the forms for large tensors, whatever the size

        class CountedLaunch:  # the row-wise kernel both ways, counted at each launch
            def __init__(self, kernel):
                self.kernel = kernel

            def __getitem__(self, grid):
                counts["both_split"] += 1
                return self.kernel[grid]

        def quantize(x, *args):
            counts["quantisations"] += 1
            return kernels.fp8_quantize_triton(x.detach(), *args)

        kernels._rowwise_both_kernel = CountedLaunch(kernels._rowwise_both_kernel)
        mptex.fp8.fp8_quantize = quantize
    out.mkdir(parents=True, exist_ok=True)
    for arm in arms:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("config", overrides=[*TINY, f"precision={arm}"])
        with tempfile.TemporaryDirectory() as run_dir:
            metrics = train(cfg, run_dir)
            shutil.copy(Path(run_dir) / "checkpoint.pt", out / f"{arm}.pt")
        losses = [entry["loss"] for entry in metrics["history"]]
        (out / f"{arm}.json").write_text(json.dumps({"status": metrics["status"],
                                                     "losses": losses, **counts}))  # fmt: skip
        counts.update(quantisations=0, both_split=0, padded_copies=0)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
