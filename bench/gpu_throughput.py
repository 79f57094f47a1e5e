"""Inference and training throughput (img/s, bf16) of our T models beside timm's ConvFormer-S18 and CAFormer-S18.

The paper's reference point (RTX 4090, 224x224): CPolyNeXt-T 2358 img/s vs ConvFormer-S18 2325 img/s, a ratio
of 1.01. Absolute numbers depend on the GPU; compare the *ratio* measured here with the paper's. Writes
``throughput.json`` and ``throughput.png`` to ``--out``.

    python bench/gpu_throughput.py --device cuda --batch-size 128 --out runs/throughput
    python bench/gpu_throughput.py --device cpu --img-size 64 --steps 2 --warmup 1 --batch-size 2   # smoke
    python bench/gpu_throughput.py --device cuda --models CPolyNeXt-T --ln-fused --channels-last --profile 12

``--ln-fused`` swaps our LN models' ``LayerNorm2d`` (mean and E[x^2] over the channel axis of NCHW: six kernels)
for ``F.layer_norm`` on the channels-last view (one kernel; no copy when the tensor is channels-last), the
layout timm's MetaFormers use. ``--profile N`` adds the N CUDA kernels that take most time in a training step.

timm is optional (``pip install "polyfhe[bench]"``): without it the timm models are skipped with a message,
or the run fails when ``--require-timm`` is given.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from machine_info import cpu_name
from torch import nn

log = logging.getLogger("gpu_throughput")

TIMM_HINT = 'timm is not installed; install the benchmark extra with: pip install "polyfhe[bench]"'
PAPER_IMG_S = {"CPolyNeXt-T": 2358.0, "ConvFormer-S18": 2325.0}  # RTX 4090, 224x224 (PolyNeXt paper)


def _ours(name: str) -> Callable[[int, str], nn.Module]:
    def build(img_size: int, norm: str) -> nn.Module:
        from polyfhe.models.registry import create_model

        return create_model(name + ("_bn" if norm == "bn" else ""), img_size=img_size)

    return build


def _timm(name: str) -> Callable[[int, str], nn.Module]:
    def build(img_size: int, norm: str) -> nn.Module:
        import timm  # only reached when timm imports (checked up front)

        return timm.create_model(name, pretrained=False, num_classes=1000)

    return build


# display name -> (source, builder); "timm" entries need the optional dependency.
MODELS: dict[str, tuple[str, Callable[[int, str], nn.Module]]] = {
    "MONet-T": ("polyfhe", _ours("monet_t")),
    "CPolyNeXt-T": ("polyfhe", _ours("cpolynext_t")),
    "APolyNeXt-T": ("polyfhe", _ours("apolynext_t")),
    "ConvFormer-S18": ("timm", _timm("convformer_s18")),
    "CAFormer-S18": ("timm", _timm("caformer_s18")),
}


@dataclass(frozen=True)
class Measurement:
    model: str
    source: str
    params_m: float
    infer_img_s: float | None
    train_img_s: float | None
    peak_mem_gib: float | None
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def timm_available() -> bool:
    try:
        import timm  # noqa: F401
    except ImportError:
        return False
    return True


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], None], warmup: int, steps: int, device: torch.device) -> float:
    """Seconds for ``steps`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    _sync(device)
    return time.perf_counter() - start


def fused_layer_norm_2d(self, x: torch.Tensor) -> torch.Tensor:
    """``LayerNorm2d.forward`` as one ``F.layer_norm`` over the channels of the NHWC view (same maths, the variance
    taken two-pass instead of E[x^2] - mu^2)."""
    y = F.layer_norm(x.permute(0, 2, 3, 1), (self.channels,), self.weight, self.bias, self.eps)
    return y.permute(0, 3, 1, 2)


def native_layer_norm_2d(self, x: torch.Tensor) -> torch.Tensor:
    """:func:`fused_layer_norm_2d` in the input's dtype: autocast runs ``layer_norm`` in float32, and its float32
    output makes every elementwise product up to the next conv move twice the bytes (the kernel itself keeps
    float32 statistics for bf16 inputs)."""
    with torch.autocast(x.device.type, enabled=False):
        weight = self.weight.to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        y = F.layer_norm(x.permute(0, 2, 3, 1), (self.channels,), weight, bias, self.eps)
    return y.permute(0, 3, 1, 2)


def patch_layer_norm(enabled: bool, native: bool = False) -> Callable[[], None]:
    """Swap ``LayerNorm2d.forward`` for :func:`fused_layer_norm_2d` (or :func:`native_layer_norm_2d` when
    ``native``) while ``enabled``; returns the undo."""
    from polyfhe.models.layers.norms import LayerNorm2d

    original = LayerNorm2d.forward
    if enabled:
        LayerNorm2d.forward = native_layer_norm_2d if native else fused_layer_norm_2d

    def undo() -> None:
        LayerNorm2d.forward = original

    return undo


def build_inputs(name: str, args: argparse.Namespace, device: torch.device):
    """The model (on ``device``, in the requested layout, compiled if asked), a batch, labels and autocast."""
    _, build = MODELS[name]
    model = build(args.img_size, args.norm).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, device=device)
    if args.channels_last:
        x = x.to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (args.batch_size,), device=device)
    amp = torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=args.amp == "bf16")
    return model, x, y, amp


def profile_train_step(name: str, args: argparse.Namespace, device: torch.device, top: int,
                       steps: int = 5, warmup: int = 3) -> list[dict]:
    """The ``top`` kernels (or CPU ops on CPU) by self time over ``steps`` eager training steps, as
    ``{"name", "ms_per_step", "share", "calls_per_step"}``."""
    from torch.profiler import ProfilerActivity, profile

    model, x, y, amp = build_inputs(name, args, device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        with amp:
            loss = F.cross_entropy(model(x).float(), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    on_gpu = device.type == "cuda"
    rows = []
    for event in prof.key_averages():
        self_us = event.self_device_time_total if on_gpu else event.self_cpu_time_total
        if self_us > 0 and (not on_gpu or event.device_type.name == "CUDA"):
            rows.append((self_us, event.key, event.count))
    total = sum(r[0] for r in rows) or 1.0
    rows.sort(reverse=True)
    return [{"name": key[:160], "ms_per_step": round(us / 1e3 / steps, 3), "share": round(us / total, 4),
             "calls_per_step": count / steps} for us, key, count in rows[:top]]


def measure(name: str, args: argparse.Namespace, device: torch.device) -> Measurement:
    source, _ = MODELS[name]
    model, x, y, amp = build_inputs(name, args, device)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    runner = torch.compile(model) if args.compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    @torch.inference_mode()
    def infer() -> None:
        with amp:
            runner(x)

    def train_step() -> None:
        with amp:
            loss = F.cross_entropy(runner(x).float(), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    results: dict[str, float | None] = {}
    notes = []
    for key, fn, mode in (("infer", infer, model.eval), ("train", train_step, model.train)):
        mode()
        try:
            seconds = _timed(fn, args.warmup, args.steps, device)
            results[key] = args.batch_size * args.steps / seconds
        except torch.cuda.OutOfMemoryError:
            results[key] = None
            notes.append(f"{key}: out of memory at batch {args.batch_size}")
            torch.cuda.empty_cache()
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return Measurement(name, source, params, results["infer"], results["train"], peak, "; ".join(notes))


def _timm_version() -> str | None:
    try:
        import timm
    except ImportError:
        return None
    return timm.__version__


def machine_details(device: torch.device, args: argparse.Namespace) -> dict:
    gpu = gpu_mem = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu, gpu_mem = props.name, round(props.total_memory / 2**30, 1)
    return {
        "device": str(device), "gpu": gpu, "gpu_memory_gib": gpu_mem, "cpu": cpu_name(),
        "cores": len(os.sched_getaffinity(0)), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None, "timm": _timm_version(),
        "python": platform.python_version(), "batch_size": args.batch_size, "img_size": args.img_size,
        "amp": args.amp, "norm": args.norm, "channels_last": args.channels_last, "compile": args.compile,
        "ln_fused": getattr(args, "ln_fused", False), "ln_native": getattr(args, "ln_native", False), "steps": args.steps, "warmup": args.warmup,
    }


def paper_ratios(results: list[Measurement]) -> dict[str, float | None]:
    """CPolyNeXt-T / ConvFormer-S18 img/s here (inference, training) and in the paper (RTX 4090)."""
    by_name = {r.model: r for r in results}
    ours, theirs = by_name.get("CPolyNeXt-T"), by_name.get("ConvFormer-S18")

    def ratio(key: str) -> float | None:
        a, b = (getattr(ours, key, None), getattr(theirs, key, None))
        return a / b if a and b else None

    return {"inference": ratio("infer_img_s"), "training": ratio("train_img_s"),
            "paper": PAPER_IMG_S["CPolyNeXt-T"] / PAPER_IMG_S["ConvFormer-S18"]}


def render(results: list[Measurement], details: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (f"{details['gpu'] or details['cpu']} | torch {details['torch']} | batch {details['batch_size']} | "
             f"{details['img_size']}px | amp {details['amp']}")
    console = Console(width=max(Console().width, 120))  # logs are no terminal: rich would wrap at 80 columns
    console.print("machine: " + ", ".join(f"{k} {v}" for k, v in details.items()), soft_wrap=True)
    table = Table(title=title)
    for col in ("model", "source", "params (M)", "inference img/s", "training img/s", "peak GiB", "note"):
        table.add_column(col, justify="left" if col in ("model", "source", "note") else "right", no_wrap=col == "model")
    for r in results:
        table.add_row(r.model, r.source, f"{r.params_m:.2f}",
                      "-" if r.infer_img_s is None else f"{r.infer_img_s:,.1f}",
                      "-" if r.train_img_s is None else f"{r.train_img_s:,.1f}",
                      "-" if r.peak_mem_gib is None else f"{r.peak_mem_gib:.2f}", r.note)
    console.print(table)
    ratios = paper_ratios(results)
    if ratios["inference"] is not None:
        train = "-" if ratios["training"] is None else f"{ratios['training']:.3f}"
        console.print(f"CPolyNeXt-T / ConvFormer-S18: inference {ratios['inference']:.3f}, training {train} "
                      f"(paper, RTX 4090: 2358 / 2325 = {ratios['paper']:.3f})")


def plot(results: list[Measurement], details: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.5))
    ax = fig.subplots()
    names = [r.model for r in results]
    xs = range(len(names))
    width = 0.38
    ax.bar([x - width / 2 for x in xs], [r.infer_img_s or 0 for r in results], width, label="inference")
    ax.bar([x + width / 2 for x in xs], [r.train_img_s or 0 for r in results], width, label="training")
    ax.set_xticks(list(xs), names, rotation=15)
    ax.set_ylabel("images / s")
    ratio = paper_ratios(results)["inference"]
    versus = "" if ratio is None else f"\nCPolyNeXt-T / ConvFormer-S18 inference {ratio:.2f} (paper, RTX 4090: 1.01)"
    ax.set_title(f"{details['gpu'] or details['cpu']}, batch {details['batch_size']}, {details['img_size']}px, "
                 f"{details['amp']}, torch {details['torch']}{versus}", fontsize=9)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS), metavar="MODEL",
                   help=f"any of: {', '.join(MODELS)} (default all)")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=30, help="timed iterations per mode")
    p.add_argument("--warmup", type=int, default=10, help="untimed iterations before timing")
    p.add_argument("--amp", choices=("bf16", "off"), default="bf16")
    p.add_argument("--norm", choices=("ln", "bn"), default="ln", help="our LN models (the paper's) or BN variants")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile each model (CUDA only)")
    p.add_argument("--ln-fused", action="store_true",
                   help="our LN models' LayerNorm2d as one F.layer_norm on the channels-last view")
    p.add_argument("--ln-native", action="store_true",
                   help="with --ln-fused: the layer norm in the input's dtype (bf16), not autocast's float32")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also list the N kernels that take most time in an eager training step, per model")
    p.add_argument("--require-timm", action="store_true", help="fail instead of skipping timm models")
    p.add_argument("--out", type=Path, default=Path("runs/throughput"))
    args = p.parse_args(argv)
    if min(args.img_size, args.batch_size, args.steps) < 1 or args.warmup < 0:
        p.error("--img-size, --batch-size and --steps must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"error: --device {args.device} but CUDA is not available (torch {torch.__version__})", file=sys.stderr)
        return 2
    if args.compile and device.type != "cuda":
        print("error: --compile is CUDA only; drop it on CPU", file=sys.stderr)
        return 2
    names = list(args.models)
    wanted_timm = [n for n in names if MODELS[n][0] == "timm"]
    if wanted_timm and not timm_available():
        if args.require_timm:
            print(f"error: {', '.join(wanted_timm)} need timm. {TIMM_HINT}", file=sys.stderr)
            return 2
        print(f"skipping {', '.join(wanted_timm)}: {TIMM_HINT}")
        names = [n for n in names if n not in wanted_timm]
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    results = []
    profiles: dict[str, list[dict]] = {}
    undo = patch_layer_norm(args.ln_fused, args.ln_native)
    try:
        for name in names:
            log.info("measuring %s ...", name)
            results.append(measure(name, args, device))
            # each row as soon as it is known: a run stopped by a time limit (torch.compile is slow) keeps its rows
            log.info("%s: %s", name, json.dumps(results[-1].to_dict()))
            if args.profile:
                profiles[name] = profile_train_step(name, args, device, args.profile, steps=min(5, args.steps),
                                                    warmup=min(3, args.warmup))
                log.info("%s top kernels: %s", name, json.dumps(profiles[name]))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        undo()
    details = machine_details(device, args)
    render(results, details)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"machine": details, "paper_img_s_rtx4090": PAPER_IMG_S, "cpolynext_over_convformer": paper_ratios(results),
              "results": [r.to_dict() for r in results]}
    if profiles:
        report["profiles"] = profiles
    (args.out / "throughput.json").write_text(json.dumps(report, indent=2) + "\n")
    if results:
        plot(results, details, args.out / "throughput.png")
    print(f"wrote {args.out / 'throughput.json'} and {args.out / 'throughput.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
