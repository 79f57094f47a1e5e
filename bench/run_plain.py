"""Simulation-mode speed: ``prog.run_plain`` on a test set, this tree beside another checkout, the same values.

    python bench/run_plain.py                                   # a small CNN on 28x28, 2,000 images
    python bench/run_plain.py --images 10000 --baseline-tree ../polyfhe-prev

The program (a 1 -> 4 -> 8 channel CNN with BN and x^2, average pooling and a linear head, exported for CKKS on
random [0, 1] calibration images, single layout) is compiled once here and saved; each tree then loads it in a
process of its own and times ``run_plain`` on the same images (one warm-up call on 16 images first). Printed: the
machine, a markdown table (seconds, ms per image, speed-up against the baseline) and the largest difference between
the trees' logits; written: ``--out/run_plain.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine_info import machine_info  # noqa: E402

TIMER = """
import json, sys, time
import numpy as np
from polyfhe import load_program  # the public name: baseline trees keep it where they like
prog = load_program(sys.argv[1])
x = np.load(sys.argv[2])
prog.run_plain(x[:16])
t0 = time.perf_counter()
out = prog.run_plain(x)
seconds = time.perf_counter() - t0
np.save(sys.argv[3], out)
print(json.dumps({"seconds": seconds}))
"""


def build_program(folder: Path) -> Path:
    import torch
    from torch import nn

    import polyfhe

    class Square(nn.Module):
        def forward(self, x):
            return x * x

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), Square(), nn.AvgPool2d(2),
                          nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), Square(), nn.AvgPool2d(2),
                          nn.Flatten(), nn.Linear(8 * 7 * 7, 10)).eval()
    calibration = np.random.default_rng(0).random((64, 1, 28, 28)).astype(np.float32)
    program = polyfhe.export(model, target="ckks", calibration=calibration, input_shape=(1, 28, 28))
    return program.save(folder / "cnn")


def time_tree(tree: Path | None, program: Path, images: Path, out: Path) -> float:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree.resolve()), env.get("PYTHONPATH", "")) if p)
    done = subprocess.run([sys.executable, "-c", TIMER, str(program), str(images), str(out)], env=env,
                          cwd=None if tree is None else str(tree.resolve()), capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["seconds"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--baseline-tree", type=Path, help="also time the run_plain of this polyfhe checkout")
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args(argv)
    info = machine_info()
    print(f"machine: {info['cpu']}, {info['cores']} cores, load average {os.getloadavg()[0]:.2f}; Python "
          f"{info['python']}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="polyfhe-run-plain-") as tmp:
        folder = Path(tmp)
        program = build_program(folder)
        images = folder / "x.npy"
        np.save(images, np.random.default_rng(1).random((args.images, 1, 28, 28)))
        trees = [("this tree", None)] + ([("baseline", args.baseline_tree)] if args.baseline_tree else [])
        outputs = {}
        for name, tree in trees:
            seconds = time_tree(tree, program, images, folder / f"{len(outputs)}.npy")
            outputs[name] = np.load(folder / f"{len(outputs)}.npy")
            rows.append({"tree": name, "seconds": seconds, "ms_per_image": 1000 * seconds / args.images})
    base = rows[-1]["seconds"] if len(rows) > 1 else None
    lines = ["| tree | images | seconds | ms per image | speed-up against the baseline |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        speedup = f"{base / r['seconds']:.1f}x" if base else "-"
        lines.append(f"| {r['tree']} | {args.images} | {r['seconds']:.2f} | {r['ms_per_image']:.2f} | {speedup} |")
    table = "\n".join(lines)
    print(table)
    difference = None
    if len(outputs) > 1:
        difference = float(np.abs(outputs["this tree"] - outputs["baseline"]).max())
        print(f"largest difference between the trees' logits: {difference:.3g}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "run_plain.json").write_text(json.dumps({"machine": info, "runs": rows, "max_difference":
                                                         difference, "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
