"""Lower a single-layout polyfhe program to the Orion v2 model container run by Lattigo's evaluator.

Pure data work (numpy, struct, json): no engine import, so exports and tests run without the wheels.

The container is ``b"ORION\\0\\2\\0"`` | header length (uint32 LE) | JSON header | blob count (uint32 LE) | blobs,
each ``length (uint64 LE) | bytes``. A diagonal blob is ``n (uint32) | n indices (int32) | n x slots float64``;
a bias blob is ``slots x float64``. Graph nodes used here: ``flatten`` (the input), ``linear_transform``
(one input register times a diagonal matrix, hoisted baby-step giant-step, one rescale, bias, then
``output_rotations`` doublings by ``slots/2, slots/4, ...``), ``add``, ``mult``, ``quad`` and ``bootstrap``
(shift, scale into [-1, 1] at the cost of a level, sparse bootstrap, integer scale back, shift back).

Semantics matched to polyfhe's executor (``polyfhe.runtime.execute._single_linear``):
- polyfhe stores each diagonal pre-rotated for its own giant step; Lattigo wants plain diagonals and pre-rotates
  them itself, so the giant-step roll is undone here.
- polyfhe sums ``space/period`` partial blocks with rotations by ``period, 2*period, ...``; the evaluator can only
  rotate by ``slots/2, slots/4, ...``. With ``period == space`` nothing is summed and the tiled diagonals carry
  over unchanged; otherwise the diagonals are kept in the first ``space`` block only and the evaluator sums all
  ``slots/period`` blocks, which gives the same result replicated with the same period. The bias is added before
  those rotations, so it is kept in the first ``period`` block only.
- ``k`` interleaved samples per ciphertext: a virtual rotation by r is a real one by ``r*k`` and every virtual
  slot vector is repeated k times.

Scales. Lattigo tracks every ciphertext's scale exactly, but its ``add`` of two ciphertexts whose scales differ
multiplies the smaller one by the *integer part* of the ratio: with primes a few parts in 10^4 below the nominal
scale, scales drift apart through products (``s^2/q``) and a residual sum weighs one operand by ``floor(r)/r``
(measured: 1% errors on cpolynext_fhe_bn). The same holds for a transform's bias, a plaintext encoded at the
default scale. The lowering replays that bookkeeping on Lattigo's own primes (:class:`LattigoScales`) and divides
each summed term's diagonals and bias by the factor the adds will apply.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from polyfhe.program.boundary import galois_element as rotation_galois_element
from polyfhe.program.diagonals import plain_diagonals

__all__ = ["LattigoModel", "LattigoScales", "best_bsgs_n1", "bootstrap_spec", "bsgs_rotations", "evaluation_key_set", "galois_element",
           "lattigo_params", "lower_program", "parse_container", "run_container_plain", "secret_weight"]

MAGIC = b"ORION\x00\x02\x00"
GALOIS_GENERATOR = 5  # Lattigo's rotation generator (SEAL uses 3)
INPUT_NODE = "input"
# Relative costs for choosing the baby-step giant-step ratio: a giant step is a full key switch, a baby step
# a hoisted one (the input's decomposition is shared), a new key costs upload bytes and keygen time once.
GIANT_COST, BABY_COST, NEW_KEY_COST = 1.0, 0.4, 0.5
# log2 of the baby/giant ratio Lattigo aims for. Not -1 (no BSGS): Lattigo's plain diagonal product returned
# garbage here on an input above the map's level (measured with orion-v2-evaluator 2.1.8), so it is never emitted.
LOG_RATIOS = (0, 1, 2, 3, 4, 5)


def galois_element(step: int, poly_modulus_degree: int) -> int:
    """Lattigo's Galois element for a left rotation by ``step`` slots: 5^step mod 2N."""
    return rotation_galois_element(step, poly_modulus_degree, GALOIS_GENERATOR)


def lattigo_params(params, bootstrap: dict | None = None) -> dict:
    """The evaluator's parameter dict for polyfhe's :class:`~polyfhe.program.params.CKKSParams`.

    Same ring and primes as the SEAL program: ``logq`` = output prime + one prime per level, ``logp`` = the
    special prime. ``h``: a fixed-weight ternary secret with two thirds of the coefficients non-zero, the weight a
    uniform ternary secret (the HE standard's model) has on average. ``bootstrap``: the manifest's bootstrapping
    spec (:class:`~polyfhe.program.bootstrapping.BootstrapSpec` as a dict), for programs that bootstrap.
    """
    bits = list(params.coeff_mod_bits)
    n = params.poly_modulus_degree
    out = {"logn": int(math.log2(n)), "logq": bits[:-1], "logp": bits[-1:], "log_default_scale": params.scale_bits,
           "h": secret_weight(n), "ring_type": "standard", "boot_logp": None}
    if bootstrap:  # every prime an NTT prime of the bootstrapping ring too (the evaluator derives the same)
        logn = int(bootstrap["logn"])
        out.update(boot_logp=[int(b) for b in bootstrap["logp"]], btp_logn=logn, log_nth_root=logn + 1)
    return out


def secret_weight(n: int) -> int:
    """Non-zero coefficients of the fixed-weight ternary secret on ring ``n``: two thirds, the weight a uniform
    ternary secret (the HE standard's model) has on average. The bootstrapping ring's secret (ring switching)
    gets its own ring's weight."""
    return (2 * n) // 3


def bootstrap_spec(manifest) -> dict | None:
    """The manifest's bootstrapping spec, or None for a program that never bootstraps."""
    return manifest.bootstrap_spec


def evaluation_key_set(relin: bytes | None, galois: dict[int, bytes]) -> list[bytes]:
    """Lattigo's ``MemEvaluationKeySet`` marshalling, as chunks, from keys marshalled one at a time.

    Layout (Lattigo v6 ``core/rlwe/keys.go``, ``utils/structs/map.go``): u8 has-relin | relin key | u8 has-galois |
    u32 count | (u64 Galois element | Galois key) sorted by element, all little-endian. Making and marshalling one
    key at a time keeps a single key in Go memory instead of the whole set (gigabytes at N=16384).
    """
    chunks = [struct.pack("<B", relin is not None)]
    if relin is not None:
        chunks.append(relin)
    chunks.append(struct.pack("<BI", 1, len(galois)))
    for element in sorted(galois):
        chunks += [struct.pack("<Q", element), galois[element]]
    return chunks


def _bsgs_index(diags, slots: int, n1: int) -> tuple[list[int], list[int]]:
    """Lattigo's ``BSGSIndex``: the giant-step (multiples of n1) and baby-step (below n1) rotations of ``diags``."""
    giants, babies = set(), set()
    for rot in diags:
        rot &= slots - 1
        giants.add(((rot // n1) * n1) & (slots - 1))
        babies.add(rot & (n1 - 1))
    return sorted(giants), sorted(babies)


def best_bsgs_n1(diags, slots: int, log_ratio: int) -> int:
    """Lattigo's ``FindBestBSGSRatio``: the first power of two n1 whose baby/giant rotation ratio reaches
    2^log_ratio (n1/2 where it overshoots), with Go's float semantics (x/0 = +Inf, 0/0 = NaN). The evaluator's
    linear maps and bootstrapping's DFT matrices both split this way."""
    max_ratio = float(1 << log_ratio)
    n1 = 1
    while n1 < slots:
        giants, babies = _bsgs_index(diags, slots, n1)
        n_giant, n_baby = len(giants) - 1, len(babies) - 1
        ratio = (n_baby / n_giant) if n_giant else (math.inf if n_baby else math.nan)
        if ratio == max_ratio:
            return n1
        if ratio > max_ratio:
            return n1 // 2
        n1 <<= 1
    return 1


def bsgs_rotations(diags: list[int], slots: int, log_ratio: int) -> tuple[list[int], list[int]]:
    """(giant, baby) rotation steps Lattigo uses for these diagonal indices (0 excluded: no key needed)."""
    if log_ratio < 0:
        return [], sorted({d & (slots - 1) for d in diags} - {0})
    n1 = best_bsgs_n1(diags, slots, log_ratio)
    giants, babies = _bsgs_index(diags, slots, n1)
    return [g for g in giants if g], [b for b in babies if b]


def _choose_ratio(diags: list[int], slots: int, keys: set[int]) -> tuple[int, list[int], list[int]]:
    """(log ratio, giant steps, baby steps) of the cheapest split, given the keys earlier maps already need."""
    best = None
    for log_ratio in LOG_RATIOS:
        giants, babies = bsgs_rotations(diags, slots, log_ratio)
        new_keys = len((set(giants) | set(babies)) - keys)
        cost = GIANT_COST * len(giants) + BABY_COST * len(babies) + NEW_KEY_COST * new_keys
        if best is None or cost < best[0]:
            best = (cost, log_ratio, giants, babies)
    return best[1:]


@dataclass(frozen=True)
class Tag:
    """A ciphertext's level and exact scale as Lattigo tracks them."""

    level: int
    scale: Fraction


SCALE_BITS_KEPT = 256  # Lattigo's scales are 128-bit floats; ours keep twice that, rounded after each op


def _rounded(value: Fraction) -> Fraction:
    """``value`` to ``SCALE_BITS_KEPT`` significant bits. Exact fractions of a deep program's scales are
    products of every prime they were rescaled by: thousands of digits, whose reductions took minutes."""
    shift = SCALE_BITS_KEPT - (value.numerator.bit_length() - value.denominator.bit_length())
    if shift <= 0:
        return Fraction(value.numerator // (value.denominator << -shift) << -shift)
    return Fraction((value.numerator << shift) // value.denominator, 1 << shift)


def _floor_ratio(big: Fraction, small: Fraction) -> int:
    """floor(big / small), where a ratio within rounding of the next integer counts as that integer."""
    ratio = big / small
    whole = math.floor(ratio)
    return whole + 1 if (whole + 1 - ratio) * (1 << (SCALE_BITS_KEPT - 16)) < whole + 1 else whole


class LattigoScales:
    """Lattigo's scale bookkeeping for the evaluator's nodes, on the ciphertext primes Q[0..L] (rationals of
    ``SCALE_BITS_KEPT`` bits)."""

    def __init__(self, moduli: Sequence[int], scale_bits: int) -> None:
        self.moduli = [int(q) for q in moduli]
        self.default = Fraction(1 << scale_bits)

    def input(self, level: int) -> Tag:
        return Tag(level, self.default)

    def linear(self, tag: Tag, level: int) -> Tag:
        """Diagonals encoded at scale Q[level], the product rescaled once by the prime at the level it ran at."""
        at = min(level, tag.level)
        return Tag(at - 1, _rounded(tag.scale * self.moduli[level] / self.moduli[at]))

    def product(self, a: Tag, b: Tag) -> Tag:
        at = min(a.level, b.level)
        return Tag(at - 1, _rounded(a.scale * b.scale / self.moduli[at]))

    @staticmethod
    def add(a: Tag, b: Tag) -> tuple[Tag, float, float]:
        """(result, factor on a's value, factor on b's value): the smaller scale is multiplied by floor(ratio)."""
        big, small = max(a.scale, b.scale), min(a.scale, b.scale)
        weak = float(_floor_ratio(big, small) * small / big)
        fa, fb = (1.0, weak) if a.scale >= b.scale else (weak, 1.0)
        return Tag(min(a.level, b.level), big), fa, fb

    @staticmethod
    def bootstrap(tag: Tag, top: int) -> Tag:
        """Lattigo's bootstrap returns its input's scale at the top of the chain (after the evaluator's
        prescale, an exact plaintext product by Q[level] and a rescale by the same prime)."""
        return Tag(top, tag.scale)

    def bias(self, tag: Tag) -> Tag:
        """A transform's bias: a plaintext the evaluator encoded at the default scale, added like a ciphertext."""
        return Tag(tag.level, self.default)

    def with_bias(self, tag: Tag) -> tuple[Tag, float, float]:
        return self.add(tag, self.bias(tag))


def _bootstrap_config(step, top: int) -> dict:
    """The evaluator's bootstrap node: shift by ``constant``, scale by ``1/postscale`` into [-1, 1] (one level),
    refresh ``slots`` slots, scale back by the integer ``postscale`` and shift back."""
    a = step.bootstrap
    return {"input_level": top, "input_min": a.range[0], "input_max": a.range[1],
            "prescale": 1.0 / a.postscale, "postscale": float(a.postscale), "constant": a.constant,
            "slots": a.slots}


@dataclass
class LattigoModel:
    """The lowered program: container bytes, the rotation steps it needs keys for, and what it does."""

    data: bytes
    galois_steps: tuple[int, ...]
    needs_relin: bool
    input_level: int
    counts: dict = field(default_factory=dict)


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[dict] = []
        self.edges: list[dict] = []
        self.blobs: list[bytes] = []

    def blob(self, data: bytes) -> int:
        self.blobs.append(data)
        return len(self.blobs) - 1

    def node(self, name: str, op: str, inputs: list[str], level: int, depth: int = 0, config: dict | None = None,
             blob_refs: dict | None = None) -> str:
        self.nodes.append({"name": name, "op": op, "level": level, "depth": depth, "shape": {},
                           "config": config or {}, "blob_refs": blob_refs or {}})
        self.edges.extend({"src": src, "dst": name} for src in inputs)
        return name

    def diagonal_blob(self, ks: np.ndarray, diags: np.ndarray) -> int:
        head = struct.pack("<I", len(ks)) + np.asarray(ks, dtype="<i4").tobytes()
        return self.blob(head + np.ascontiguousarray(diags, dtype="<f8").tobytes())


def _summed_term_weights(tags: list[Tag]) -> tuple[Tag, list[float]]:
    """The tag of ``((t0 + t1) + t2) + ...`` and the factor Lattigo's adds put on each term's value."""
    acc, weights = tags[0], [1.0]
    for tag in tags[1:]:
        acc, f_acc, f_term = LattigoScales.add(acc, tag)
        weights = [w * f_acc for w in weights] + [f_term]
    return acc, weights


def _packing_weights(program, weak: Mapping[int, float]) -> dict[int, float]:
    """The linear steps whose values to scale so that a packed bootstrap's add leaves its registers as they were:
    ``weak`` maps a register to the factor the evaluator's add put on it. A product is scaled through a factor
    only it reads (the compiler masked such a factor to pack it)."""
    steps = {step.out: step for step in program.manifest.steps}
    readers: dict[int, list[int]] = {}
    for step in program.manifest.steps:
        for r in step.reads():
            readers.setdefault(r, []).append(step.out)
    weights = {}
    for register, factor in weak.items():
        step = steps.get(register)
        if step is not None and step.op == "mul":
            step = next((steps[f] for f in sorted(set(step.inputs)) if f in steps and steps[f].op == "linear"
                         and readers.get(f) == [register]), None)
        if step is None or step.op != "linear":
            raise ValueError(f"register {register} is packed into a bootstrap, and no linear map that makes it "
                             "alone can take the evaluator's scale correction; export with pack_bootstraps=False")
        weights[step.out] = weights.get(step.out, 1.0) / factor
    return weights


def lower_program(program, moduli: Sequence[int] | None = None) -> LattigoModel:
    """The Orion v2 container for a single-layout ``program``; raises ``ValueError`` for what it cannot hold.

    ``moduli``: the ciphertext primes Lattigo generates for the program's parameters (see :class:`LattigoScales`);
    ``None`` lowers for ideal primes of exactly the nominal bit sizes. A packed bootstrap adds registers of
    unequal scales, which the evaluator's add leaves slightly off; the program is lowered a second time with the
    maps that make them scaled to cancel that (their scales, and so the factors, do not change).
    """
    weak: dict[int, float] = {}
    lowered = _lower_program(program, moduli, {}, weak)
    if not weak:
        return lowered
    return _lower_program(program, moduli, _packing_weights(program, weak), {})


def _lower_program(program, moduli: Sequence[int] | None, value_weights: Mapping[int, float],
                   weak: dict[int, float]) -> LattigoModel:
    m = program.manifest
    if m.layout != "single":
        raise ValueError("the Lattigo backend runs the single layout (one sample packed across the slots); "
                         f"this program uses layout={m.layout!r}: export it with layout='single'")
    params, lanes = m.params, m.samples_per_ciphertext
    slots, virtual = params.slots, m.virtual_slots
    top = params.levels
    moduli = [1 << b for b in params.coeff_mod_bits[:-1]] if moduli is None else [int(q) for q in moduli]
    if len(moduli) != top + 1:
        raise ValueError(f"{len(moduli)} ciphertext primes given for a chain of {top + 1}")
    scales = LattigoScales(moduli, params.scale_bits)
    b = _Builder()
    names = {0: b.node(INPUT_NODE, "flatten", [], top)}
    tags = {0: scales.input(top)}
    keys: set[int] = set()
    counts = {"linear_transforms": 0, "diagonals": 0, "giant_rotations": 0, "baby_rotations": 0,
              "output_rotations": 0, "products": 0, "scale_corrections": 0}
    worst_correction = 0.0
    spec = bootstrap_spec(m)
    for i, step in enumerate(m.steps):
        if step.op == "bootstrap":
            src, tag = names[step.inputs[0]], tags[step.inputs[0]]
            for j, other in enumerate(step.inputs[1:], start=1):  # packed: registers in disjoint slot blocks
                tag, f_acc, f_other = scales.add(tag, tags[other])
                for register, factor in zip((*step.inputs[:j], other), (f_acc,) * j + (f_other,), strict=True):
                    if factor != 1.0:
                        weak[register] = weak.get(register, 1.0) * factor
                src = b.node(f"s{i}p{j}", "add", [src, names[other]], tag.level)
            names[step.out] = b.node(f"s{i}", "bootstrap", [src], top, 0, _bootstrap_config(step, top))
            tags[step.out] = scales.bootstrap(tag, top)
            counts["bootstraps"] = counts.get("bootstraps", 0) + 1
            continue
        if step.op == "mul":
            a, c = step.inputs
            op, inputs = ("quad", [names[a]]) if a == c else ("mult", [names[a], names[c]])
            names[step.out] = b.node(f"s{i}", op, inputs, top - step.level)
            tags[step.out] = scales.product(tags[a], tags[c])
            counts["products"] += 1
            continue
        if step.op != "linear":
            raise ValueError(f"step {i} ({step.op}) has no Lattigo lowering")
        attrs = step.linear
        if attrs.pre_sums or attrs.post_sums:
            raise ValueError(f"step {i} ({attrs.label or 'linear'}) sums blocks by rotate-and-add around its "
                             "diagonals, which the Lattigo graph cannot express; export the model with "
                             "backend='lattigo' (its planner does not use them) or run it on SEAL")
        period, space, baby = int(attrs.period), attrs.reduction_space(virtual), int(attrs.baby)
        reduce = period < space
        doublings = int(math.log2(virtual // period)) if reduce else 0
        level = top - (step.level - 1)
        terms = attrs.terms
        chain = [scales.linear(tags[t.input], level) for t in terms]
        if attrs.bias:  # the evaluator adds the bias to the first term, before the terms are summed
            chain.insert(1, scales.bias(chain[0]))
        out_tag, weights = _summed_term_weights(chain)
        value_weight = value_weights.get(step.out, 1.0)  # see lower_program: a packed bootstrap's correction
        weights = [w / value_weight for w in weights]
        counts["scale_corrections"] += sum(w != 1.0 for w in weights)
        worst_correction = max(worst_correction, *(abs(1.0 / w - 1.0) for w in weights))
        bias_weight = weights.pop(1) if attrs.bias else 1.0
        parts = []
        for j, term in enumerate(terms):
            ks = np.asarray(program.arrays[term.diagonals.ks], dtype=np.int64)
            diags = plain_diagonals(ks, program.arrays[term.diagonals.diags], baby) / weights[j]
            if reduce:  # keep the first ``space`` block: the evaluator's doublings sum every block
                diags[:, space:] = 0.0
            real_ks = (ks * lanes) % slots
            real = np.repeat(diags, lanes, axis=1) if lanes > 1 else diags
            log_ratio, giants, babies = _choose_ratio([int(k) for k in real_ks], slots, keys)
            keys |= {*giants, *babies}
            refs = {"diag_0_0": b.diagonal_blob(real_ks, real)}
            if j == 0 and attrs.bias:
                bias = np.asarray(program.arrays[attrs.bias], dtype=np.float64)[:virtual] / bias_weight
                if reduce:
                    bias[period:] = 0.0
                refs["bias_0"] = b.blob(np.repeat(bias, lanes).astype("<f8").tobytes())
            config = {"bsgs_ratio": float(2.0**log_ratio), "output_rotations": doublings, "num_input_cts": 1,
                      "num_output_cts": 1}
            parts.append(b.node(f"s{i}t{j}", "linear_transform", [names[term.input]], level, 1, config, refs))
            counts["linear_transforms"] += 1
            counts["diagonals"] += len(ks)
            counts["giant_rotations"] += len(giants)
            counts["baby_rotations"] += len(babies)
            counts["output_rotations"] += doublings
        if doublings:
            keys |= {slots >> (d + 1) for d in range(doublings)}
        out = parts[0]
        for j, part in enumerate(parts[1:], start=1):
            out = b.node(f"s{i}a{j}", "add", [out, part], level - 1)
        names[step.out], tags[step.out] = out, out_tag
    counts["worst_scale_correction"] = float(f"{worst_correction:.3g}")
    galois_steps = tuple(sorted(keys))
    needs_relin = counts["products"] > 0
    # not read by the evaluator: what the corrections were computed for, so the plain reference can replay them
    extra = {"polyfhe": {"moduli": moduli, "scale_bits": params.scale_bits}}
    data = write_container(params, spec, galois_steps, needs_relin, top, counts.get("bootstraps", 0),
                           (INPUT_NODE, names[m.output]), b.nodes, b.edges, b.blobs, extra)
    return LattigoModel(data, galois_steps, needs_relin, top, counts)


def write_container(params, spec: dict | None, galois_steps: Sequence[int], needs_relin: bool, input_level: int,
                    bootstraps: int, ends: tuple[str, str], nodes: list[dict], edges: list[dict],
                    blobs: list[bytes], extra: dict | None = None) -> bytes:
    """An Orion v2 container: JSON header (parameters, key manifest, graph from ``ends[0]`` to ``ends[1]``), then
    the blobs, each length-prefixed. ``extra``: header keys the evaluator does not read."""
    header = {
        "version": 2, "params": lattigo_params(params, spec),
        "config": {"margin": 1, "embedding_method": "hybrid", "fuse_modules": True},
        "manifest": {"galois_elements": [galois_element(s, params.poly_modulus_degree) for s in galois_steps],
                     "bootstrap_slots": [1 << int(spec["log_slots"])] if spec else [],
                     "boot_logp": list(spec["logp"]) if spec else None, "needs_rlk": needs_relin,
                     **({"btp_logn": int(spec["logn"])} if spec else {})},
        "input_level": input_level, "cost": {"bootstrap_count": bootstraps, "galois_key_count": len(galois_steps),
                                             "bootstrap_key_count": 0},
        "graph": {"input": ends[0], "output": ends[1], "nodes": nodes, "edges": edges},
        "blob_count": len(blobs),
        **(extra or {}),
    }
    raw = json.dumps(header).encode()
    chunks = [MAGIC, struct.pack("<I", len(raw)), raw, struct.pack("<I", len(blobs))]
    for blob in blobs:
        chunks += [struct.pack("<Q", len(blob)), blob]
    return b"".join(chunks)


def parse_container(data: bytes) -> tuple[dict, list[bytes]]:
    """(header, blobs) of a container made by :func:`lower_program` (bounded: lengths checked against ``data``)."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
        raise ValueError("not an Orion v2 model container")
    (size,) = struct.unpack_from("<I", data, len(MAGIC))
    pos = len(MAGIC) + 4
    header = json.loads(data[pos:pos + size])
    pos += size
    (count,) = struct.unpack_from("<I", data, pos)
    pos += 4
    blobs = []
    for _ in range(count):
        (length,) = struct.unpack_from("<Q", data, pos)
        pos += 8
        if pos + length > len(data):
            raise ValueError("truncated Orion v2 model container")
        blobs.append(data[pos:pos + length])
        pos += length
    return header, blobs


def run_container_plain(data: bytes, vec: np.ndarray) -> np.ndarray:
    """The evaluator's semantics on plain slot vectors, Lattigo's scale bookkeeping included: the reference for
    :func:`lower_program` without Lattigo."""
    header, blobs = parse_container(data)
    slots = len(vec)
    meta = header.get("polyfhe")
    if meta is None:
        raise ValueError("this container names no prime chain: it was not made by lower_program")
    scales = LattigoScales(meta["moduli"], meta["scale_bits"])
    preds: dict[str, list[str]] = {}
    for edge in header["graph"]["edges"]:
        preds.setdefault(edge["dst"], []).append(edge["src"])
    values: dict[str, np.ndarray] = {}
    tags: dict[str, Tag] = {}
    for node in header["graph"]["nodes"]:  # lower_program emits nodes in a topological order
        name, op, srcs = node["name"], node["op"], preds.get(node["name"], [])
        ins = [values[p] for p in srcs]
        if op == "flatten":
            values[name] = (ins[0] if ins else vec).copy()
            tags[name] = tags[srcs[0]] if srcs else scales.input(header["input_level"])
        elif op in ("quad", "mult"):
            a, c = (ins[0], ins[0]) if op == "quad" else ins
            values[name] = a * c
            tags[name] = scales.product(tags[srcs[0]], tags[srcs[-1]])
        elif op == "add":
            tags[name], fa, fc = scales.add(tags[srcs[0]], tags[srcs[1]])
            values[name] = fa * ins[0] + fc * ins[1]
        elif op == "linear_transform":
            raw = blobs[node["blob_refs"]["diag_0_0"]]
            (n,) = struct.unpack_from("<I", raw)
            ks = np.frombuffer(raw, "<i4", n, 4)
            diags = np.frombuffer(raw, "<f8", n * slots, 4 + 4 * n).reshape(n, slots)
            out = sum((d * np.roll(ins[0], -int(k)) for k, d in zip(ks, diags, strict=True)), np.zeros(slots))
            tag = scales.linear(tags[srcs[0]], int(node["level"]))
            if "bias_0" in node["blob_refs"]:
                tag, f_out, f_bias = scales.with_bias(tag)
                out = f_out * out + f_bias * np.frombuffer(blobs[node["blob_refs"]["bias_0"]], "<f8")
            for i in range(int(node["config"]["output_rotations"])):
                out = out + np.roll(out, -(slots >> (i + 1)))
            values[name], tags[name] = out, tag
        elif op == "bootstrap":
            cfg = node["config"]
            width = int(cfg["slots"])
            shifted = (ins[0] + cfg["constant"]) * cfg["prescale"]
            values[name] = np.tile(shifted[:width], slots // width) * cfg["postscale"] - cfg["constant"]
            tags[name] = scales.bootstrap(tags[srcs[0]], int(node["level"]))
        else:
            raise ValueError(f"node {name}: op {op!r} is not one lower_program emits")
    return values[header["graph"]["output"]]
