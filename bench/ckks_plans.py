"""CKKS planner benchmark: this tree's plans against a baseline tree's, on the same models and weights, one run.

    python bench/ckks_plans.py                                  # every case, 100 images, baseline = HEAD~ (see --baseline)
    python bench/ckks_plans.py --cases user_monet --images 20 --baseline-images 2
    python bench/ckks_plans.py --baseline none                  # this tree only
    python bench/ckks_plans.py --backend seal lattigo           # both engines (and the baseline on SEAL), one run

    python bench/ckks_plans.py --model runs/deep --backend lattigo --cases --images 2   # a trained checkpoint
    python bench/ckks_plans.py --cases user_attention --images 16 --model-file runs/attention/model.pt

Cases: ``user_monet`` (a MONet-BN written as plain torch code, ``user_models.py``, trained briefly on
Fashion-MNIST), ``user_attention`` (a polynomial attention network written as plain torch code: 49 tokens of width
32, two blocks of ``x += Wo((Q K^T / s) V)`` and a Hadamard MLP, ``user_models.UserAttentionBN``, trained briefly
on Fashion-MNIST; ``--model-file`` runs one trained longer by ``attention_accuracy.py`` instead), ``monet_fhe_bn``
and ``cpolynext_fhe_bn`` (zoo recipes at 28x28, BatchNorm statistics from the
calibration images) and ``digits_mlp`` (64->32->x^2->10 on scikit-learn's digits); ``--model`` adds a zoo name (trained one short
epoch here) or a checkpoint folder from ``polyfhe train`` (its own weights, Fashion-MNIST or digits test images). The weights are made once, here,
and both trees load the same ones. Every measurement runs in fresh processes, one after another: compile (time and
peak RSS), the client's keys and encrypted queries (its private backup kept in a temporary folder of mode 0700),
the server, then the client restored from its backup to decrypt; so the server's peak RSS is its own and no
client holding its keys runs beside it. Latency is server compute per ciphertext (several images share one when the program interleaves
them); the first query is cold (plaintexts encoded on the fly), the median of the rest warm.
The baseline is another commit checked out with ``git worktree`` into a temporary folder and imported instead of
this tree; its images are fewer (it is slow) and it is compared on the images both ran. A tree whose compiler
refuses a case (its export raises one of its refusals, a ``ValueError`` such as ``CKKSExportError`` or
``LoweringError``) gets the refusal in its column ("refused: ..."), and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine_info import machine_info

log = logging.getLogger("bench.ckks_plans")
DEFAULT_OUT = HERE / "results"
CASES = ("user_monet", "user_attention", "monet_fhe_bn", "cpolynext_fhe_bn", "digits_mlp")
# the issue's targets: case -> {result key: (what, upper bound)}; the recipes' 4 GB is their compile's, the
# user MONet's and the user attention network's their server's
TARGETS = {
    "user_monet": {"per_image_s": ("time per image s", 10.0), "plaintext_diagonals": ("plaintext diagonals", 4000),
                   "server_rss_gb": ("server RSS GB", 4.0)},
    "user_attention": {"per_image_s": ("time per image s", 10.0), "server_rss_gb": ("server RSS GB", 4.0)},
    "monet_fhe_bn": {"per_image_s": ("time per image s", 10.0), "compile_s": ("compile s", 60.0),
                     "compile_rss_gb": ("compile RSS GB", 4.0)},
    "cpolynext_fhe_bn": {"per_image_s": ("time per image s", 10.0), "compile_s": ("compile s", 60.0),
                         "compile_rss_gb": ("compile RSS GB", 4.0)},
    "digits_mlp": {"per_image_s": ("time per sample s", 0.030)},
}
# lower bounds, read the same way: case -> {result key: (what, lower bound)}
FLOOR_TARGETS = {"user_attention": {"argmax_agreement": ("argmax agreement", 1.0)}}


# ------------------------------------------------------------------------------------------------------------
# models and data (made once, in the parent, with this tree)
# ------------------------------------------------------------------------------------------------------------
def _fashion(n_train: int, n_test: int):
    from polyfhe.data.sources import load_dataset

    data = load_dataset("fashion-mnist")
    return data.x_train[:n_train], data.y_train[:n_train], data.x_test[:n_test]


def _checkpoint_case(spec: Path, images: int):
    """A trained checkpoint (its input normalisation folded in, as ``polyfhe export`` does: it takes images in
    [0, 1]): its model, calibration images from the training split, test images."""
    from polyfhe.data.sources import load_dataset
    from polyfhe.training.checkpoint import fold_input_normalization, load_checkpoint

    model, info = load_checkpoint(spec)
    model = fold_input_normalization(model, info)
    data = load_dataset("fashion-mnist" if tuple(model.input_shape) == (1, 28, 28) else "digits")
    return model, data.x_train[:256], data.x_test[:images]


# a zoo recipe whose eval-mode logits have not settled after one short epoch is trained by the library instead
SETTLED_LOGIT = 1e3
SETTLE_EPOCHS, SETTLE_IMAGES = 4, 12000


def _largest_logit(model, x: np.ndarray) -> float:
    import torch

    with torch.no_grad():
        largest = float(model.double()(torch.from_numpy(x.astype(np.float64))).abs().max())
    model.float()
    return largest


def _trained_by_polyfhe(name: str):
    """``name`` trained by ``polyfhe.train`` (BatchNorm statistics settle over its schedule), its input
    normalisation folded in so that it takes images in [0, 1] like the briefly trained models."""
    import polyfhe

    with tempfile.TemporaryDirectory() as out:
        result = polyfhe.train(name, "fashion-mnist", epochs=SETTLE_EPOCHS, out_dir=Path(out) / "run", device="cpu",
                               train_subset=SETTLE_IMAGES, batch_size=128, lr=2e-3, augment="none", progress=False,
                               seed=0, model_kwargs=_model_kwargs())
    return result.normalization.prepend_to(result.model).eval()


def _model_kwargs() -> dict:
    """``--model-kwargs``: constructor arguments of the zoo models named by ``--model`` (e.g. a narrower width)."""
    return json.loads(os.environ.get("POLYFHE_BENCH_MODEL_KWARGS", "{}"))


def _insecure_params() -> dict:
    """``--insecure-ring LOGN``: compile on an INSECURE ``[60, 40 x 7, 60]`` chain at N=2^LOGN that bootstraps on
    its own ring, for deep programs whose 128-bit bootstrapping keys do not fit this machine (the deep recipe's
    slow test does the same). Timings then compare trees, not what a 128-bit deployment costs."""
    logn = os.environ.get("POLYFHE_BENCH_INSECURE_RING")
    memory = os.environ.get("POLYFHE_BENCH_BOOTSTRAP_MEMORY_GB")
    extra = {} if memory is None else {"bootstrap_memory": int(float(memory) * 1e9)}
    if not logn:
        return extra
    params = _tree_attr("CKKSParams", "polyfhe.fhe.params", "polyfhe.program.params")
    return {"params": params(1 << int(logn), (60, *(40,) * 7, 60), 40, security="none"), "allow_insecure": True,
            **extra}


def _model_file_case(name: str, model_file: Path, images: int):
    """A pickled module (``torch.save(model)``, e.g. ``attention_accuracy.py``'s ``model.pt``) for case ``name``:
    its calibration images from the training split, its test images (digits for ``digits_mlp``, else
    Fashion-MNIST)."""
    import torch

    model = torch.load(model_file, weights_only=False).eval()
    if name == "digits_mlp":
        from polyfhe.data.sources import load_digits

        data = load_digits()
        return model, data.x_train[:256], np.resize(data.x_test, (images, 1, 8, 8))
    x, _, test = _fashion(256, images)
    return model, x, test


def make_case(name: str, folder: Path, images: int, model_file: Path | None = None) -> None:
    """Write ``model.pt`` (a pickled module: both trees load it without our model code), the calibration
    and test images of ``name`` to ``folder``. ``name``: a case, a zoo name, or a checkpoint folder;
    ``model_file``: a pickled module used instead of the one the case would train."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if model_file is not None:
        model, calib, test = _model_file_case(name, Path(model_file), images)
    elif Path(name).is_dir():
        model, calib, test = _checkpoint_case(Path(name), images)
    elif name == "user_monet":
        from user_models import UserMONetBN, train_briefly

        x, y, test = _fashion(6000, images)
        model = train_briefly(UserMONetBN(), torch.from_numpy(x), torch.from_numpy(y).long(), epochs=1)
        calib = x[:256]
    elif name == "user_attention":  # 2 epochs of 12000 images: about 50% on the test split (1 of 6000: about 32%)
        from user_models import UserAttentionBN, train_briefly

        x, y, test = _fashion(12000, images)
        model = train_briefly(UserAttentionBN(), torch.from_numpy(x), torch.from_numpy(y).long(), epochs=2)
        calib = x[:256]
    elif name == "digits_mlp":
        from ckks_naive import Square

        from polyfhe.data.sources import load_digits

        data = load_digits()
        model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), Square(), nn.Linear(32, 10))
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        xt, yt = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
        for _ in range(80):
            optim.zero_grad()
            nn.functional.cross_entropy(model(xt), yt).backward()
            optim.step()
        calib, test = data.x_train[:256], np.resize(data.x_test, (images, 1, 8, 8))
    else:  # a zoo recipe, trained one short epoch: untrained ones have far wider value ranges than trained ones
        from user_models import train_briefly

        from polyfhe.models.registry import create_model

        x, y, test = _fashion(6000, images)
        model = create_model(name, num_classes=10, img_size=28, in_chans=1, **_model_kwargs())
        model = train_briefly(model, torch.from_numpy(x), torch.from_numpy(y).long(), epochs=1)
        largest = _largest_logit(model, x[:1024])
        if not largest < SETTLED_LOGIT:  # deep BN recipes overflow in eval mode until their statistics settle
            log.warning("%s: logits reach %.3g in eval mode after one short epoch; training it with polyfhe.train "
                        "(%d epochs on %d images) instead", name, largest, SETTLE_EPOCHS, SETTLE_IMAGES)
            model = _trained_by_polyfhe(name)
        calib = x[:256]
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(model.eval(), folder / "model.pt")
    np.savez(folder / "data.npz", calibration=np.asarray(calib, np.float32), test=np.asarray(test, np.float32))


# ------------------------------------------------------------------------------------------------------------
# stages (each in a fresh process)
# ------------------------------------------------------------------------------------------------------------
def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _cap_address_space() -> None:
    """``--compile-memory-cap``: this process's address space, so an outgrowing compile raises MemoryError."""
    cap = os.environ.get("POLYFHE_BENCH_COMPILE_CAP_GB")
    if cap:
        limit = int(float(cap) * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def stage_compile(folder: Path, out: Path, backend: str = "seal") -> dict:
    import torch

    import polyfhe

    _cap_address_space()

    model = torch.load(folder / "model.pt", weights_only=False)
    data = np.load(folder / "data.npz")
    engine = {} if backend == "seal" else {"backend": backend}  # a baseline tree may predate engines
    start = time.perf_counter()
    prog = polyfhe.export(model, target="ckks", calibration=data["calibration"],
                          input_shape=tuple(data["calibration"].shape[1:]), **engine, **_insecure_params())
    seconds = time.perf_counter() - start
    prog.save(out)
    info = prog.manifest.info
    return {"compile_s": seconds, "compile_rss_gb": _rss_gb(), "ring": prog.params.poly_modulus_degree,
            "levels": prog.params.levels, "depth": prog.manifest.depth, "analyzer_levels": info["analyzer"]["levels"],
            "plaintext_diagonals": info.get("plaintext_diagonals"), "linear_maps": info.get("linear_maps"),
            "galois_keys": len(prog.manifest.galois_steps), "rotation_steps": info.get("rotation_steps"),
            "samples_per_ciphertext": prog.manifest.samples_per_ciphertext,
            "planned": {k: v for k, v in info.get("planned", {}).items() if k != "plaintext_bytes"},
            **_bootstrap_summary(info.get("bootstrap")), **_memory_spend_summary(info.get("memory_spend")),
            **_predicted(prog)}


def _plaintext_budget() -> int | None:
    """The servers' plaintext store budget in bytes (``--plaintext-cache-gb``), or None: the library's default."""
    budget = os.environ.get("POLYFHE_BENCH_PLAINTEXT_GB")
    return None if budget is None else int(float(budget) * 1e9)


def _predicted(prog) -> dict:
    """The cost model's latency and server memory for the program (``polyfhe cost PROGRAM``), priced with the
    server's plaintext budget; empty in a tree without the cost model."""
    try:
        predict = _tree_attr("predict", "polyfhe.cost.model")
        workload = _tree_attr("program_workload", "polyfhe.cost.workload")(prog)
        costs = _tree_attr("calibrated_costs", "polyfhe.cost.model")(prog.manifest.backend)
    except ImportError:
        return {}
    budget = _plaintext_budget()
    kwargs = {} if budget is None else {"plaintext_budget": budget}
    p = predict(workload, costs, **kwargs)
    return {"predicted_warm_s": p.eval_seconds / max(1, p.samples), "predicted_cold_s": p.cold_seconds,
            "predicted_peak_gb": p.peak_bytes / 1e9}


def _memory_spend_summary(spend: dict | None) -> dict:
    """What the export did when the merged program's server would not fit the memory budget."""
    if not spend:
        return {}
    merged = spend["merged"]
    return {"memory_factored": len(spend["factored"]), "merged_diagonals": merged["diagonals"],
            "merged_bootstraps": merged["bootstraps"], "merged_server_gb": merged["server_peak_bytes"] / 1e9}


def _bootstrap_summary(boot: dict | None) -> dict:
    if not boot:
        return {"bootstraps": 0}
    return {"bootstraps": boot["count"], "bootstrap_slots": boot["slots"], "bootstrap_cuts": boot["cuts_after_level"],
            "predicted_bootstrap_key_gb": boot.get("key_bytes", 0) / 1e9,
            "predicted_server_gb": boot.get("server_memory", {}).get("peak_bytes", 0) / 1e9 or None}


def _tree_attr(name: str, *modules: str):
    """``name`` from the first of ``modules`` this tree has: a baseline from before the package redesign keeps
    its modules under their old names (``polyfhe.fhe...``). List the old name first: this tree's editable install
    would otherwise lend a baseline process the new module. ImportError when none holds it."""
    import importlib

    for module in modules:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"none of {modules} defines {name}")


def stage_server(program: Path, work: Path) -> dict:
    """Load the program and the public context, evaluate every ciphertext in ``work``; times and RSS."""
    import polyfhe

    prog = polyfhe.load_program(program)
    with open(work / "context.bin", "rb") as f:  # memory-mapped: the server's keys are its only anonymous copy
        context = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    warm_s = None
    if os.environ.get("POLYFHE_BENCH_WARM") == "1":  # --warm: plaintexts encoded before the first query
        try:
            warm_plaintexts = _tree_attr("warm_plaintexts", "polyfhe.fhe.prewarm", "polyfhe.engines.seal.prewarm")
        except ImportError:  # a baseline tree from before prewarm.py
            pass
        else:
            warm_s = warm_plaintexts(prog).seconds
    budget = _plaintext_budget()
    server = prog.server(context) if budget is None else prog.server(context, max_cache_bytes=budget)
    # parsed: a server drops the uploaded bytes now (the file's pages come back if an engine reads them again)
    context.madvise(mmap.MADV_DONTNEED)
    times, counts = [], []
    for path in sorted(work.glob("query-*.bin")):
        start = time.perf_counter()
        result = server.run(path.read_bytes())
        times.append(time.perf_counter() - start)
        path.with_suffix(".out").write_bytes(result)
        counts.append(dict(server.last_run.counts))
    return {"server_s": times, "server_rss_gb": _rss_gb(), "counts": counts[-1] if counts else {}, "warm_up_s": warm_s,
            "dot_kernel": _dot_kernel(prog.manifest.backend)}


def _dot_kernel(backend: str) -> str | None:
    """Whether this tree's SEAL server summed its plaintext products on polyfhe's dot kernel (a baseline from
    before the kernel: no)."""
    if backend != "seal":
        return None
    try:
        dot_available = _tree_attr("dot_available", "polyfhe.fhe.seal_native", "polyfhe.engines.seal.native")
    except ImportError:
        return "no"
    return "yes" if dot_available() else "no"


def stage_keys(folder: Path, program: Path, work: Path, images: int) -> dict:
    """The client's first half: keys, the public context and the encrypted queries into ``work``, and the private
    backup into a file of mode 0600 there (the decrypt stage restores the client from it). The process then
    ends, so the server stage runs beside no client holding gigabytes of keys (SEAL's memory pool keeps them)."""
    import polyfhe

    prog = polyfhe.load_program(program)
    test = np.load(folder / "data.npz")["test"][:images]
    start = time.perf_counter()  # keys are made in the constructor (Lattigo) or on the first context (SEAL)
    client = prog.client()
    context = client.public_context()
    keygen = time.perf_counter() - start
    (work / "context.bin").write_bytes(context)
    fd = os.open(work / "secret.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(client.secret_context())
    lanes = prog.manifest.samples_per_ciphertext
    for i in range(0, len(test), lanes):
        (work / f"query-{i // lanes:05d}.bin").write_bytes(client.encrypt(test[i:i + lanes]))
    return {"keygen_s": keygen, "context_mb": len(context) / 1e6,
            "keygen_child_rss_gb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20 or None,
            "client_rss_gb": _rss_gb()}


def stage_decrypt(program: Path, work: Path, images: int) -> dict:
    """The client's second half: restored from its backup and the public context it made, it decrypts."""
    import polyfhe
    restore_client = _tree_attr("restore_client", "polyfhe.fhe.backends", "polyfhe.program.engines")

    prog = polyfhe.load_program(program)
    with open(work / "context.bin", "rb") as f:
        context = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    client = restore_client(prog.manifest, (work / "secret.bin").read_bytes(), context)
    lanes = prog.manifest.samples_per_ciphertext
    counts = [min(lanes, images - i) for i in range(0, images, lanes)]
    logits = np.concatenate([client.decrypt((work / f"query-{i:05d}.out").read_bytes())[:n]
                             for i, n in enumerate(counts)])
    return {"logits": logits.tolist()}


def stage_client(folder: Path, program: Path, tree_env: dict, images: int) -> dict:
    """Keys, server and decryption, each in a process of its own; the error and agreement against torch."""
    import torch

    import polyfhe

    manifest = polyfhe.load_program(program).manifest
    lanes = manifest.samples_per_ciphertext
    test = np.load(folder / "data.npz")["test"][:images]
    model = torch.load(folder / "model.pt", weights_only=False).double()
    with torch.no_grad():
        reference = model(torch.from_numpy(test.astype(np.float64))).numpy()
    with tempfile.TemporaryDirectory() as tmp:  # mode 0700: the backup in it is the client's alone
        work = Path(tmp)
        keys = _run_stage(["keys", str(folder), str(program), str(work), str(len(test))], tree_env)
        server = _run_stage(["server", str(program), str(work)], tree_env)
        logits = np.asarray(_run_stage(["decrypt", str(program), str(work), str(len(test))], tree_env)["logits"])
    warm = server["server_s"][1:] or server["server_s"]
    return {**keys, "images": len(test), "lanes": lanes,
            "cold_s": server["server_s"][0], "warm_s": statistics.median(warm), "warm_up_s": server.get("warm_up_s"),
            "per_image_s": statistics.median(warm) / lanes, "server_rss_gb": server["server_rss_gb"],
            "max_logit_error": float(np.max(np.abs(logits - reference))),
            "argmax_agreement": float(np.mean(logits.argmax(1) == reference.argmax(1))), "counts": server["counts"],
            **run_counts(server["counts"], manifest.backend), "dot_kernel": server.get("dot_kernel")}


def run_counts(counts: dict, backend: str) -> dict:
    """Rotations (and key switches) per query, counted ones apart from planned ones: SEAL counts them as it runs
    (``rotations``, ``key_switches``); Lattigo's evaluator counts nothing, so its server reports its lowering's
    predictions as ``planned_*``, rotations by kind (giant, hoisted baby and output rotations; a baseline tree
    from before that naming reported the same predictions unprefixed: filed as planned all the same). Lattigo's
    key switches are not predicted (the bootstraps' own are not counted), so none are reported for it."""
    if backend != "lattigo" and not any(k.startswith("planned_") for k in counts):
        return {"rotations": counts.get("rotations"), "key_switches": counts.get("key_switches")}
    planned = {k.removeprefix("planned_"): v for k, v in counts.items()}
    kinds = [planned[k] for k in ("giant_rotations", "baby_rotations", "output_rotations") if k in planned]
    return {"planned_rotations": sum(kinds) if kinds else planned.get("rotations")}


class StageFailed(RuntimeError):
    """A stage's process failed; the message is the error it raised (its type and first line, as the stage
    reported it), else the last line it wrote to stderr. ``refusal``: the compile stage's export refused the model
    (raised a ``ValueError``, as the compiler's refusals are) rather than crashed."""

    def __init__(self, message: str, refusal: str | None = None) -> None:
        super().__init__(message)
        self.refusal = refusal


def stage_failure(stage: str, exc: BaseException) -> dict:
    """What a failed stage reports to its parent: the error's type and first line, and whether it is a refusal."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    message = f"{type(exc).__name__}: {lines[0].strip() if lines else 'no message'}"
    return {"failed": {"message": message[:300], "refusal": stage == "compile" and isinstance(exc, ValueError)}}


def _run_stage(args: list[str], env: dict) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", *args, "--stage-out", out.name]
        # in the tree's own folder: a child it starts with ``python -m`` finds the tree's package first
        proc = subprocess.run(cmd, env=env, stderr=subprocess.PIPE, text=True, check=False,
                              cwd=env.get("POLYFHE_BENCH_TREE"))
        sys.stderr.write(proc.stderr)
        if proc.returncode:
            try:  # the error the stage reported (none when it died without raising: killed, out of memory)
                failed = json.loads(Path(out.name).read_text())["failed"]
            except (ValueError, KeyError, TypeError):
                lines = [line for line in proc.stderr.splitlines() if line.strip()]
                failed = {"message": (lines[-1] if lines else "no message")[:300], "refusal": False}
            raise StageFailed(f"{args[0]} stage failed (exit {proc.returncode}): {failed['message']}",
                              refusal=failed["message"] if failed["refusal"] else None)
        return json.loads(Path(out.name).read_text())


# ------------------------------------------------------------------------------------------------------------
# baseline tree
# ------------------------------------------------------------------------------------------------------------
def baseline_tree(ref: str, root: Path) -> Path:
    """A worktree of ``ref`` importable as ``polyfhe`` (its package-dir mapping rebuilt with symlinks)."""
    repo = HERE.parent
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "-f", str(root), ref], check=True,
                   capture_output=True)
    for sub in ("models", "calibration", "export"):
        link = root / "polyfhe" / sub
        if not link.exists():
            link.symlink_to(Path("..") / sub)
    # its own compiled kernels: without them its SEAL server would run on the bindings alone (2-3x slower), and
    # this tree's editable install cannot lend them once the module names differ
    build = subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "build_ext", "--inplace",
                            "-q"], cwd=root, capture_output=True, text=True, check=False)
    if build.returncode:
        log.warning("the baseline's native kernels did not build (its SEAL runs on the bindings): %s",
                    build.stderr.strip().splitlines()[-1:] or "no message")
    return root


def tree_env(tree: Path | None) -> dict:
    """The stages' environment: Go's collector settings for Lattigo (read only at process start), the tree's path."""
    from polyfhe.engines.lattigo.go_env import GO_ENV_DEFAULTS

    env = {**GO_ENV_DEFAULTS, **os.environ}
    if tree is not None:  # a path entry wins over the editable install's finder
        env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["POLYFHE_BENCH_TREE"] = str(tree)
    return env


def case_label(case: str) -> str:
    """A case's name in the tables: a checkpoint folder by the model it holds and its epoch."""
    if not Path(case).is_dir():
        return case
    from polyfhe.training.checkpoint import read_checkpoint_info

    info = read_checkpoint_info(case)
    return f"{info.model_name} (checkpoint, epoch {info.epoch})"


def measure(case: str, folder: Path, tree: Path | None, images: int, backend: str = "seal") -> dict:
    env = tree_env(tree)
    program = folder / (f"program-base-{backend}" if tree else f"program-{backend}")
    result = {"case": case_label(case), "tree": "baseline" if tree else "this", "backend": backend,
              "column": f"{'baseline' if tree else 'this tree'} / {backend}"}
    try:
        result.update(_run_stage(["compile", str(folder), str(program), backend], env))
        result.update(_run_stage(["client", str(folder), str(program), str(images)], env))
        if result.get("predicted_warm_s") and result.get("per_image_s"):
            result["warm_vs_predicted"] = result["per_image_s"] / result["predicted_warm_s"]
    except StageFailed as exc:
        if exc.refusal is not None:  # the tree's compiler declines the model: a result, not a crash
            result["refused"] = exc.refusal
        else:
            result["error"] = str(exc)
    return result


# ------------------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------------------
ROWS = [("plaintext_diagonals", "plaintext diagonals", "{:,}"), ("linear_maps", "linear maps", "{}"),
        ("galois_keys", "Galois keys", "{}"), ("rotations", "rotations per query (counted)", "{:,}"),
        ("key_switches", "key switches per query (counted)", "{:,}"),
        ("planned_rotations", "rotations per query, planned: giant + baby + output (Lattigo: not measured)", "{:,}"),
        ("ring", "ring N", "{}"), ("depth", "levels used", "{}"),
        ("bootstraps", "bootstraps", "{}"), ("bootstrap_slots", "slots per bootstrap", "{}"),
        ("bootstrap_cuts", "bootstraps after levels", "{}"),
        ("predicted_bootstrap_key_gb", "bootstrapping keys, predicted (GB)", "{:.2f}"),
        ("predicted_server_gb", "server peak, predicted at export (GB)", "{:.2f}"),
        ("memory_factored", "inputs of shifts / depthwise convs factored to fit memory", "{}"),
        ("merged_diagonals", "merged plan: plaintext diagonals", "{:,}"),
        ("merged_bootstraps", "merged plan: bootstraps", "{}"),
        ("merged_server_gb", "merged plan: server peak, predicted (GB)", "{:.2f}"),
        ("analyzer_levels", "analyzer levels (lower bound)", "{}"), ("compile_s", "compile (s)", "{:.1f}"),
        ("compile_rss_gb", "compile peak RSS (GB)", "{:.2f}"), ("keygen_s", "key generation (s)", "{:.1f}"),
        ("context_mb", "public context (MB)", "{:.0f}"), ("lanes", "images per ciphertext", "{}"),
        ("warm_up_s", "plaintexts encoded before serving (s)", "{:.1f}"),
        ("cold_s", "cold latency per ciphertext (s)", "{:.2f}"), ("warm_s", "warm latency per ciphertext (s)", "{:.2f}"),
        ("per_image_s", "warm time per image (s)", "{:.3f}"), ("server_rss_gb", "server peak RSS (GB)", "{:.2f}"),
        ("predicted_warm_s", "cost model: warm time per image (s)", "{:.2f}"),
        ("predicted_cold_s", "cost model: cold latency (s)", "{:.2f}"),
        ("warm_vs_predicted", "measured / predicted, warm", "{:.2f}"),
        ("predicted_peak_gb", "cost model: client + server peak, one process (GB)", "{:.2f}"),
        ("dot_kernel", "SEAL products summed on the dot kernel", "{}"),
        ("keygen_child_rss_gb", "bootstrapping key generation peak RSS (GB)", "{:.2f}"),
        ("client_rss_gb", "client peak RSS, making the public context (GB)", "{:.2f}"),
        ("images", "images run", "{}"), ("argmax_agreement", "argmax agreement", "{:.0%}"),
        ("max_logit_error", "max logit error", "{:.1e}")]
STATUS_LABEL = "compiled"  # the first row: "yes", or "refused: <the compiler's error>"


def render(info: dict, results: list[dict]) -> str:
    lines = [(f"machine: {info['cpu']}, {info['usable_cores']} cores, load {info['load_avg_1m']:.2f}, "
              f"Python {info['python']}; baseline: {info.get('baseline')}; "
              "cold = first query, warm = median of the rest")]
    if info.get("model_files"):
        lines.append("models from files: " + ", ".join(f"{c}: {p}" for c, p in info["model_files"].items()))
    for case in dict.fromkeys(r["case"] for r in results):
        pair = {r["column"]: r for r in results if r["case"] == case}
        columns = list(pair)
        lines += ["", f"## {case}", "", "| | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
        if any("refused" in pair[c] for c in columns):
            cells = [f"refused: {pair[c]['refused']}" if "refused" in pair[c] else
                     ("yes" if "compile_s" in pair[c] else "-") for c in columns]
            lines.append(f"| {STATUS_LABEL} | " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        for key, label, fmt in ROWS:
            cells = [fmt.format(pair[c][key]) if pair[c].get(key) is not None else "-" for c in columns]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        for c, r in pair.items():
            if "error" in r:
                lines.append(f"| error ({c}) | {r['error']} |" + " |" * (len(columns) - 1))
        target, floor = TARGETS.get(case, {}), FLOOR_TARGETS.get(case, {})
        for column in [c for c in columns if pair[c]["tree"] == "this" and "per_image_s" in pair[c]]:
            if not target and not floor:
                break
            mine = pair[column]
            lines.append("")
            lines += [f"- {column}: target {name} <= {bound}: {value:.3g} {'met' if value <= bound else 'MISSED'}"
                      for key, (name, bound) in target.items() if (value := mine.get(key)) is not None]
            lines += [f"- {column}: target {name} >= {bound}: {value:.3g} {'met' if value >= bound else 'MISSED'}"
                      for key, (name, bound) in floor.items() if (value := mine.get(key)) is not None]
    return "\n".join(lines)


def _plotted(result: dict, key: str) -> float:
    """A result's value for a plot panel (0 where it has none): the planned counts live under ``planned``."""
    value = result.get(key, (result.get("planned") or {}).get(key))
    return float(value or 0)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in results))
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    for ax, key, label in ((axes[0], "per_image_s", "warm seconds per image"),
                           (axes[1], "cold_s", "cold latency (s)"),
                           (axes[2], "server_rss_gb", "server peak RSS (GB)"),
                           (axes[3], "plain_products", "plaintext products per query (planned)")):
        columns = list(dict.fromkeys(r["column"] for r in results))
        width = 0.8 / len(columns)
        for i, column in enumerate(columns):
            values = [next((_plotted(r, key) for r in results if r["case"] == c and r["column"] == column), 0)
                      for c in cases]
            ax.bar(np.arange(len(cases)) + (i - (len(columns) - 1) / 2) * width, values, width=width, label=column)
        ax.set_xticks(range(len(cases)), cases, rotation=20)
        shown = [_plotted(r, key) for r in results if _plotted(r, key)]
        if shown and max(shown) > 20 * min(shown):  # cases orders of magnitude apart; else bars from zero
            ax.set_yscale("log")
        ax.set_title(label)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_model_files(specs: list[str], cases: list[str]) -> dict[str, Path]:
    """``--model-file`` values (``CASE=PATH`` or a bare ``PATH`` when one case runs) -> {case: existing path}."""
    files = {}
    for spec in specs:
        case, sep, path = spec.partition("=")
        if not sep:
            if len(cases) != 1:
                raise ValueError(f"--model-file {spec}: name its case (CASE=PATH) when {len(cases)} cases run")
            case, path = cases[0], spec
        if case not in cases:
            raise ValueError(f"--model-file {spec}: case {case!r} is not run (cases: {', '.join(cases) or 'none'})")
        if not Path(path).is_file():
            raise ValueError(f"--model-file {spec}: no file {path}")
        files[case] = Path(path)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", choices=CASES, default=list(CASES))
    parser.add_argument("--model", action="append", default=[], metavar="NAME_OR_CHECKPOINT",
                        help="also run a zoo model (trained one short epoch here) or a `polyfhe train` checkpoint")
    parser.add_argument("--model-file", action="append", default=[], metavar="[CASE=]PATH",
                        help="a pickled module (torch.save(model), e.g. attention_accuracy.py's model.pt) that CASE "
                             "runs instead of the model it trains; a bare PATH needs exactly one case")
    parser.add_argument("--images", type=int, default=100, help="test images run encrypted per case (this tree)")
    parser.add_argument("--baseline", default="HEAD~", help="git ref of the baseline tree, or 'none'")
    parser.add_argument("--baseline-images", type=int, default=2, help="images for the baseline (slow)")
    parser.add_argument("--backend", nargs="+", choices=("seal", "lattigo"), default=["seal"],
                        help="engines to run this tree's programs on")
    parser.add_argument("--baseline-backend", choices=("seal", "lattigo"), default="seal",
                        help="the engine the baseline runs on (default seal: older baselines predate engines)")
    parser.add_argument("--model-kwargs", type=json.loads, default={}, metavar="JSON",
                        help='constructor arguments of the --model zoo models, e.g. \'{"dims": [32]}\'')
    parser.add_argument("--insecure-ring", type=int, metavar="LOGN",
                        help="compile on an INSECURE N=2^LOGN chain that bootstraps on its own ring (deep models "
                             "whose 128-bit bootstrapping keys do not fit this machine); both trees alike")
    parser.add_argument("--bootstrap-memory", type=float, metavar="GB",
                        help="the memory budget bootstrapped programs are planned for (export's bootstrap_memory; "
                             "default 75%% of this machine's), both trees alike: a plan predicted just over the "
                             "default is then measured as planned instead of factored")
    parser.add_argument("--compile-memory-cap", type=float, metavar="GB",
                        help="cap each tree's compile process at GB of address space (RLIMIT_AS): a compile that "
                             "would outgrow the machine fails with MemoryError and is reported, instead of being "
                             "killed by the kernel with everything else running")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--warm", action="store_true",
                        help="servers encode the program's plaintexts before the first query (polyfhe serve --warm); "
                             "cold is then the first query after that")
    parser.add_argument("--plaintext-cache-gb", type=float, metavar="GB",
                        help="the servers' plaintext store budget (polyfhe run --plaintext-cache-mb; default: the "
                             "library's, half of this machine's memory); the cost model prices the same budget")
    parser.add_argument("--stage", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--stage-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warm:
        os.environ["POLYFHE_BENCH_WARM"] = "1"  # read by the server stages
    if args.model_kwargs:
        os.environ["POLYFHE_BENCH_MODEL_KWARGS"] = json.dumps(args.model_kwargs)
    if args.plaintext_cache_gb is not None:
        os.environ["POLYFHE_BENCH_PLAINTEXT_GB"] = str(args.plaintext_cache_gb)  # read by compile and server stages
    if args.insecure_ring:
        os.environ["POLYFHE_BENCH_INSECURE_RING"] = str(args.insecure_ring)  # read by the compile stages
    if args.bootstrap_memory:
        os.environ["POLYFHE_BENCH_BOOTSTRAP_MEMORY_GB"] = str(args.bootstrap_memory)  # read by the compile stages
    if args.compile_memory_cap:
        os.environ["POLYFHE_BENCH_COMPILE_CAP_GB"] = str(args.compile_memory_cap)  # read by the compile stages
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.stage:
        kind, *rest = args.stage
        fn = {"compile": lambda: stage_compile(Path(rest[0]), Path(rest[1]), *rest[2:]),
              "server": lambda: stage_server(Path(rest[0]), Path(rest[1])),
              "client": lambda: stage_client(Path(rest[0]), Path(rest[1]), dict(os.environ), int(rest[2])),
              "keys": lambda: stage_keys(Path(rest[0]), Path(rest[1]), Path(rest[2]), int(rest[3])),
              "decrypt": lambda: stage_decrypt(Path(rest[0]), Path(rest[1]), int(rest[2]))}[kind]
        try:
            result = fn()
        except Exception as exc:  # reported to the parent, then raised: the traceback still goes to stderr
            Path(args.stage_out).write_text(json.dumps(stage_failure(kind, exc)))
            raise
        Path(args.stage_out).write_text(json.dumps(result))
        return 0
    try:
        model_files = parse_model_files(args.model_file, [*args.cases, *args.model])
    except ValueError as exc:
        parser.error(str(exc))
    args.out.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    info["baseline"] = args.baseline
    if model_files:
        info["model_files"] = {case: str(path) for case, path in model_files.items()}
    if args.insecure_ring:
        info["insecure_ring"] = f"N=2^{args.insecure_ring}, security none (both trees)"
    if args.bootstrap_memory:
        info["bootstrap_memory"] = f"{args.bootstrap_memory:g} GB (both trees)"
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        base = None if args.baseline == "none" else baseline_tree(args.baseline, Path(tmp) / "baseline")
        try:
            for case in [*args.cases, *args.model]:
                folder = Path(tmp) / Path(case).name
                make_case(case, folder, args.images, model_files.get(case))
                for backend in args.backend:
                    log.warning("%s: measuring this tree on %s, %d images", case, backend, args.images)
                    results.append(measure(case, folder, None, args.images, backend))
                if base is not None:
                    log.warning("%s: measuring the baseline on %d images", case, args.baseline_images)
                    results.append(measure(case, folder, base, min(args.baseline_images, args.images),
                                           args.baseline_backend))
                (args.out / "ckks_plans.json").write_text(json.dumps({"machine": info, "results": results}, indent=1))
        finally:
            if base is not None:
                subprocess.run(["git", "-C", str(HERE.parent), "worktree", "remove", "--force", str(base)],
                               check=False, capture_output=True)
    table = render(info, results)
    print(table)
    (args.out / "ckks_plans.md").write_text(table + "\n")
    plot(results, args.out / "ckks_plans.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
