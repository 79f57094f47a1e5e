"""Issue 41's GPU checks in one prepared run: onnxruntime's CUDA provider against torch, CPolyNeXt-T against
ConvFormer-S18 (eager and compiled, with a kernel profile and the fixes it suggests), and DDP over nccl.

Stages, each written to ``--out``/issue41.json as soon as it ends (a run cut off by a time limit keeps them):

1. ``machine``: GPU, driver-side versions, torch/timm/onnxruntime and its providers.
2. ``onnxruntime``: ``cpolynext_fhe_bn`` exported to ONNX, run by onnxruntime's CUDA provider beside torch (max
   relative error, img/s); skipped with the reason when the provider is not offered.
3. ``eager``: inference and training img/s, bf16, of ConvFormer-S18 and CPolyNeXt-T as built, with the fused
   LayerNorm2d (``--ln-fused`` of bench/gpu_throughput.py), and fused + channels-last.
4. ``profiles``: the kernels that take most time in an eager training step of each.
5. ``ddp``: ``polyfhe train`` under ``torch.distributed.run --nproc-per-node 1`` on the GPU (nccl): the
   distributed path end to end on a one-GPU machine.
6. ``compiled``: ConvFormer-S18, the fastest CPolyNeXt-T variant of stage 3 and CPolyNeXt-T as built under
   ``torch.compile``, while ``--budget`` seconds last.

    python bench/gpu_issue41.py --out runs/issue41                  # on the GPU machine
    python bench/gpu_issue41.py --smoke --out runs/issue41-smoke    # CPU: every stage at toy size, no compile
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_throughput as gt
from tree_import import ROOT, use_source_tree

log = logging.getLogger("gpu_issue41")

VARIANTS = {  # name -> bench/gpu_throughput.py flags
    "as built": [],
    "ln-fused": ["--ln-fused"],
    "ln-fused + channels-last": ["--ln-fused", "--channels-last"],
}
# added after the first GPU run: its profile showed the fused norm running in float32 under autocast
NATIVE_VARIANTS = {
    "ln-native": ["--ln-fused", "--ln-native"],
    "ln-native + channels-last": ["--ln-fused", "--ln-native", "--channels-last"],
}


class Report:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict = {}

    def put(self, key: str, value) -> None:
        self.data[key] = value
        self.path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        log.info("%s: %s", key, json.dumps(value, default=str)[:4000])


def sizes(smoke: bool) -> list[str]:
    if smoke:
        return ["--img-size", "32", "--batch-size", "2", "--steps", "1", "--warmup", "0"]
    return ["--img-size", "224", "--batch-size", "128", "--steps", "20", "--warmup", "5"]


def gt_args(model: str, flags: list[str], smoke: bool, device: str) -> argparse.Namespace:
    return gt.parse_args(["--device", device, "--models", model, *sizes(smoke), *flags])


def one(model: str, flags: list[str], smoke: bool, device: torch.device) -> dict:
    args = gt_args(model, flags, smoke, device.type)
    undo = gt.patch_layer_norm(args.ln_fused, args.ln_native)
    try:
        start = time.perf_counter()
        row = gt.measure(model, args, device).to_dict()
        row["seconds"] = round(time.perf_counter() - start, 1)
        return row
    finally:
        undo()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def ratio(ours: dict | None, theirs: dict | None) -> dict:
    def r(key: str) -> float | None:
        a, b = (ours or {}).get(key), (theirs or {}).get(key)
        return round(a / b, 3) if a and b else None

    return {"inference": r("infer_img_s"), "training": r("train_img_s")}


# ------------------------------------------------------------------------------------------------- stages
def stage_machine(device: torch.device) -> dict:
    import onnxruntime as ort

    details = gt.machine_details(device, gt_args("CPolyNeXt-T", [], True, device.type))
    details.update({"onnxruntime": ort.__version__, "ort_providers": ort.get_available_providers(),
                    "gpus": torch.cuda.device_count() if device.type == "cuda" else 0})
    return details


def stage_onnxruntime(device: torch.device, smoke: bool, tmp: Path) -> dict:
    """Parity and throughput of onnxruntime's CUDA provider against torch on ``cpolynext_fhe_bn`` (float32)."""
    import numpy as np
    import onnxruntime as ort

    from polyfhe.models.registry import create_model

    providers = ort.get_available_providers()
    wanted = "CPUExecutionProvider" if smoke else "CUDAExecutionProvider"
    if wanted not in providers:
        return {"ran": False, "providers": providers,
                "reason": f"{wanted} is not offered: this onnxruntime {ort.__version__} is the CPU build "
                          "(onnxruntime-gpu, the gpu extra, is not installed)"}
    model = create_model("cpolynext_fhe_bn").eval()
    batch = 8 if smoke else 256
    x = torch.rand(batch, 1, 28, 28)
    path = tmp / "cpolynext_fhe_bn.onnx"
    torch.onnx.export(model, (x[:2],), str(path), dynamo=False, opset_version=17, input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "b"}, "y": {0: "b"}})
    session = ort.InferenceSession(str(path), providers=[wanted])
    model = model.to(device)
    xd = x.to(device)
    with torch.no_grad():
        expected = model(xd).float().cpu().numpy()
    got = session.run(None, {"x": x.numpy()})[0]
    rel = float(np.abs(got - expected).max() / max(float(np.abs(expected).max()), 1e-30))
    steps = 2 if smoke else 50

    def ort_run() -> None:
        session.run(None, {"x": x.numpy()})

    @torch.no_grad()
    def torch_run() -> None:
        model(xd)

    ort_s = gt._timed(ort_run, 1, steps, torch.device("cpu"))  # session.run returns host arrays: synchronous
    torch_s = gt._timed(torch_run, 1, steps, device)
    return {"ran": True, "provider": session.get_providers()[0], "model": "cpolynext_fhe_bn", "batch": batch,
            "max_rel_error": rel, "ort_img_s": batch * steps / ort_s, "torch_fp32_img_s": batch * steps / torch_s,
            "note": "onnxruntime timing includes the host-device copies of input and output"}


def stage_eager(device: torch.device, smoke: bool, have_timm: bool, variants: dict[str, list[str]]) -> dict:
    rows: dict[str, dict] = {}
    if have_timm:
        rows["ConvFormer-S18"] = one("ConvFormer-S18", [], smoke, device)
        rows["ConvFormer-S18, channels-last"] = one("ConvFormer-S18", ["--channels-last"], smoke, device)
    for variant, flags in variants.items():
        rows[f"CPolyNeXt-T, {variant}"] = one("CPolyNeXt-T", flags, smoke, device)
    base = rows.get("ConvFormer-S18")
    return {"rows": rows, "over_convformer": {k: ratio(v, base) for k, v in rows.items() if k.startswith("CPoly")}}


def stage_profiles(device: torch.device, smoke: bool, have_timm: bool) -> dict:
    out = {}
    todo = [("CPolyNeXt-T", "as built"), ("CPolyNeXt-T", "ln-fused + channels-last")]
    if have_timm:
        todo.append(("ConvFormer-S18", "as built"))
    for model, variant in todo:
        args = gt_args(model, VARIANTS[variant], smoke, device.type)
        undo = gt.patch_layer_norm(args.ln_fused, args.ln_native)
        try:
            out[f"{model}, {variant}"] = gt.profile_train_step(model, args, device, top=15,
                                                               steps=1 if smoke else 2, warmup=1 if smoke else 3)
        finally:
            undo()
    return out


def stage_ddp(device: torch.device, tmp: Path) -> dict:
    """``polyfhe train`` as torchrun starts it, one process on this device (nccl on CUDA, gloo on CPU)."""
    out = tmp / "ddp"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               str(Path(__file__).with_name("tree_import.py")), "train", "--model", "cpolynext_fhe_bn",
               "--data", "digits", "--epochs", "3", "--batch-size", "64", "--lr", "0.01", "--device", device.type,
               "--no-progress", "--out", str(out)]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    shown = " ".join(str(Path(c).relative_to(ROOT)) if c.startswith(str(ROOT)) else c for c in command[1:])
    result = {"command": shown, "returncode": done.returncode,
              "seconds": round(time.perf_counter() - start, 1), "tail": (done.stdout + done.stderr)[-1500:]}
    if (out / "metrics.json").is_file():
        metrics = json.loads((out / "metrics.json").read_text())
        result.update({k: metrics[k] for k in ("test_accuracy", "processes", "device", "amp", "wall_time_s")})
    return result


def stage_compiled(device: torch.device, eager: dict, have_timm: bool, deadline: float) -> dict:
    rows = eager["rows"]
    cpoly = {k: v for k, v in rows.items() if k.startswith("CPolyNeXt-T") and v.get("train_img_s")}
    best = max(cpoly, key=lambda k: cpoly[k]["train_img_s"]).split(", ", 1)[1] if cpoly else "as built"
    todo = ([("ConvFormer-S18", "as built", [])] if have_timm else []) + [("CPolyNeXt-T", best, VARIANTS[best])]
    if best != "as built":
        todo.append(("CPolyNeXt-T", "as built", []))
    out: dict = {"rows": {}, "best_eager_variant": best}
    for model, variant, flags in todo:
        if time.time() > deadline:
            out["rows"][f"{model}, {variant}"] = {"skipped": "out of time"}
            continue
        out["rows"][f"{model}, {variant}"] = one(model, [*flags, "--compile"], False, device)
    base = out["rows"].get("ConvFormer-S18, as built")
    out["over_convformer"] = {k: ratio(v, base) for k, v in out["rows"].items() if k.startswith("CPoly")}
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--smoke", action="store_true", help="CPU, toy sizes, no torch.compile")
    p.add_argument("--budget", type=float, default=420.0, help="seconds after which compiled runs are skipped")
    p.add_argument("--eager-only", action="store_true",
                   help="the second run: eager rows of the first run's baseline and the native-dtype norm only")
    p.add_argument("--scratch", type=Path, default=Path("runs/issue41-scratch"),
                   help="folder for the ONNX file and the DDP run's output")
    args = p.parse_args(argv)
    deadline = time.time() + args.budget
    use_source_tree()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
    args.out.mkdir(parents=True, exist_ok=True)
    args.scratch.mkdir(parents=True, exist_ok=True)
    report = Report(args.out / ("issue41-eager.json" if args.eager_only else "issue41.json"))
    have_timm = gt.timm_available()
    report.put("machine", stage_machine(device))
    if args.eager_only:
        variants = {"as built": [], "ln-fused + channels-last": VARIANTS["ln-fused + channels-last"],
                    **NATIVE_VARIANTS}
        report.put("eager", stage_eager(device, args.smoke, have_timm, variants))
        return 0
    for key, stage in (
        ("onnxruntime", lambda: stage_onnxruntime(device, args.smoke, args.scratch)),
        ("eager", lambda: stage_eager(device, args.smoke, have_timm, VARIANTS)),
        ("profiles", lambda: stage_profiles(device, args.smoke, have_timm)),
        ("ddp", lambda: stage_ddp(device, args.scratch)),
    ):
        try:
            report.put(key, stage())
        except Exception as exc:  # one failed stage must not cost the others' numbers
            log.exception("stage %s failed", key)
            report.put(key, {"error": f"{type(exc).__name__}: {exc}"})
    if device.type == "cuda" and not args.smoke:
        try:
            report.put("compiled", stage_compiled(device, report.data["eager"], have_timm, deadline))
        except Exception as exc:
            log.exception("stage compiled failed")
            report.put("compiled", {"error": f"{type(exc).__name__}: {exc}"})
    log.info("wrote %s", report.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
