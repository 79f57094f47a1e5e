"""The typed instructions of a CKKS program and their JSON form.

A step is ``{"op", "out", "inputs", "size", "level", "attrs"}`` on disk, ``attrs`` holding the op's own fields.
Each op has a frozen record here (:data:`OP_ATTRS`); its JSON keeps the keys, their order and which ones are
present exactly as the compiler writes them, because the program id hashes that JSON. The server loads programs
from untrusted hands, so an unknown op, an unknown key or a value of the wrong type is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, Self, TypeVar

from polyfhe.program.errors import ProgramError

__all__ = ["OP_ATTRS", "BootstrapAttrs", "Diagonals", "LinearAttrs", "MatMulAttrs", "MulAttrs", "SparseRows",
           "Step", "StepAttrs", "Term"]


# ------------------------------------------------------------------------------------------------------------
# JSON value checks: each returns the typed value or raises ProgramError naming the key
# ------------------------------------------------------------------------------------------------------------
def _int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProgramError(f"{key!r} must be an integer, got {value!r}")
    return value


def _float(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProgramError(f"{key!r} must be a number, got {value!r}")
    return float(value)


def _str(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise ProgramError(f"{key!r} must be a string, got {value!r}")
    return value


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ProgramError(f"{key!r} must be true or false, got {value!r}")
    return value


def _ints(value: Any, key: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ProgramError(f"{key!r} must be a list of integers, got {value!r}")
    return tuple(_int(v, key) for v in value)


def _float_pair(value: Any, key: str) -> tuple[float, float]:
    if not isinstance(value, list) or len(value) != 2:
        raise ProgramError(f"{key!r} must be a [low, high] pair, got {value!r}")
    return _float(value[0], key), _float(value[1], key)


def _optional_str(value: Any, key: str) -> str | None:
    return None if value is None else _str(value, key)


def _object(value: Any, what: str) -> dict:
    if not isinstance(value, dict):
        raise ProgramError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _check_keys(d: dict, known: tuple[str, ...], what: str) -> None:
    unknown = [k for k in d if k not in known]
    if unknown:
        raise ProgramError(f"unknown key {unknown[0]!r} in {what}; accepted: {list(known)}")


# ------------------------------------------------------------------------------------------------------------
# linear terms
# ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Diagonals:
    """Single layout: a term's non-zero period-P diagonals (rows, pre-rotated per giant step) and offsets k."""

    diags: str
    ks: str


@dataclass(frozen=True)
class SparseRows:
    """Batch layout: a term's matrix as CSR arrays (one scalar per ciphertext product)."""

    data: str
    indices: str
    indptr: str


_MATRIX_KINDS: tuple[type[Diagonals | SparseRows], ...] = (Diagonals, SparseRows)


@dataclass(frozen=True)
class Term:
    """One summand ``M @ register`` of a linear step; ``matrix`` names the arrays holding M."""

    input: int
    matrix: Diagonals | SparseRows

    @property
    def diagonals(self) -> Diagonals:
        if not isinstance(self.matrix, Diagonals):
            raise ProgramError("a batch-layout term (CSR rows) has no diagonals")
        return self.matrix

    @property
    def rows(self) -> SparseRows:
        if not isinstance(self.matrix, SparseRows):
            raise ProgramError("a single-layout term (diagonals) has no CSR rows")
        return self.matrix

    def array_names(self) -> tuple[str, ...]:
        return tuple(getattr(self.matrix, f.name) for f in fields(self.matrix))

    def to_dict(self) -> dict:
        return {"input": self.input, **{f.name: getattr(self.matrix, f.name) for f in fields(self.matrix)}}

    @classmethod
    def from_dict(cls, value: Any) -> Term:
        d = _object(value, "a linear term")
        known = ("input", *(f.name for kind in _MATRIX_KINDS for f in fields(kind)))
        _check_keys(d, known, "a linear term")
        for kind in _MATRIX_KINDS:
            names = [f.name for f in fields(kind)]
            if set(d) == {"input", *names}:
                return cls(_int(d["input"], "input"), kind(*(_str(d[n], n) for n in names)))
        raise ProgramError(f"a linear term needs 'input' and either diags/ks or data/indices/indptr, got {list(d)}")


def _terms(value: Any, key: str) -> tuple[Term, ...]:
    if not isinstance(value, list):
        raise ProgramError(f"{key!r} must be a list of terms, got {value!r}")
    return tuple(Term.from_dict(t) for t in value)


# ------------------------------------------------------------------------------------------------------------
# per-op fields
# ------------------------------------------------------------------------------------------------------------
A = TypeVar("A", bound="_Attrs")
MAX_ROTATE_SUMS = 24  # rotate-and-add steps of one window: log2 of the block, and no ring has 2^24 slots


class _Attrs:
    """JSON of a record of op fields: ``KEYS`` in the order written, a field at None left out unless in
    ``ALWAYS``, each key read by its ``PARSE`` entry; ``REQUIRED`` keys must be present."""

    KEYS: ClassVar[tuple[str, ...]] = ()
    ALWAYS: ClassVar[tuple[str, ...]] = ()
    REQUIRED: ClassVar[tuple[str, ...]] = ()
    PARSE: ClassVar[Mapping[str, Callable[[Any, str], Any]]] = {}

    def to_dict(self) -> dict:
        out = {}
        for key in self.KEYS:
            value = getattr(self, key)
            if value is None and key not in self.ALWAYS:
                continue
            if isinstance(value, tuple):
                value = [v.to_dict() if isinstance(v, Term) else v for v in value]
            out[key] = value
        return out

    @classmethod
    def from_dict(cls, value: Any, what: str = "step attrs") -> Self:
        d = _object(value, what)
        _check_keys(d, cls.KEYS, what)
        missing = [k for k in cls.REQUIRED if k not in d]
        if missing:
            raise ProgramError(f"{what} lack {missing[0]!r}")
        return cls(**{k: cls.PARSE[k](d[k], k) for k in d})


@dataclass(frozen=True)
class LinearAttrs(_Attrs):
    """``out = sum of term.matrix @ term.input (+ bias)``. Single layout only: the period P of the diagonals,
    the ``space`` the output is reduced over by rotate-and-add (absent: all virtual slots), the baby-step size,
    and whether giant partial sums are rescaled before they rotate.

    ``pre_sums`` / ``post_sums``: rotate-and-add steps (``x += rot(x, s)`` for each s, in order) applied to each
    input before its diagonals, and to the result after its rescale: a block sum broadcast over its block is a
    window sum, one masking diagonal and a spread, instead of a diagonal per slot of the block."""

    terms: tuple[Term, ...]
    bias: str | None = None
    label: str | None = None
    period: int | None = None
    space: int | None = None
    baby: int | None = None
    rescale_giants: bool | None = None
    pre_sums: tuple[int, ...] | None = None
    post_sums: tuple[int, ...] | None = None

    KEYS: ClassVar = ("period", "space", "baby", "terms", "bias", "label", "rescale_giants", "pre_sums", "post_sums")
    ALWAYS: ClassVar = ("terms", "bias")
    REQUIRED: ClassVar = ("terms",)
    PARSE: ClassVar = {"period": _int, "space": _int, "baby": _int, "terms": _terms, "bias": _optional_str,
                       "label": _str, "rescale_giants": _bool, "pre_sums": _ints, "post_sums": _ints}

    @classmethod
    def from_dict(cls, value: Any, what: str = "linear step attrs") -> LinearAttrs:
        attrs = super().from_dict(value, what)
        kinds = {type(t.matrix) for t in attrs.terms}
        if len(kinds) > 1:
            raise ProgramError(f"{what} mix diagonal and CSR terms")
        if kinds == {Diagonals} and (attrs.period is None or attrs.baby is None):
            raise ProgramError(f"{what}: diagonal terms need 'period' and 'baby'")
        for key in ("pre_sums", "post_sums"):
            shifts = getattr(attrs, key) or ()
            if len(shifts) > MAX_ROTATE_SUMS or any(shift <= 0 for shift in shifts):
                raise ProgramError(f"{what}: {key!r} takes at most {MAX_ROTATE_SUMS} positive rotation steps "
                                   f"(one per doubling of a block), got {list(shifts)[:8]}")
        return attrs

    def reduction_space(self, slots: int) -> int:
        """Slots the output is summed over by rotate-and-add (``space``; all ``slots`` where absent)."""
        return self.space if self.space is not None else slots

    def remapped(self, mapping: Mapping[int, int]) -> LinearAttrs:
        return replace(self, terms=tuple(replace(t, input=mapping.get(t.input, t.input)) for t in self.terms))


@dataclass(frozen=True)
class MulAttrs(_Attrs):
    """A ciphertext product of the step's two inputs, relinearised and rescaled."""

    label: str | None = None

    KEYS: ClassVar = ("label",)
    PARSE: ClassVar = {"label": _str}


@dataclass(frozen=True)
class MatMulAttrs(_Attrs):
    """Batch layout: ``out = a @ b`` of two encrypted tensors (flattened row-major)."""

    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    label: str | None = None

    KEYS: ClassVar = ("a_shape", "b_shape", "out_shape", "label")
    REQUIRED: ClassVar = ("a_shape", "b_shape", "out_shape")
    PARSE: ClassVar = {"a_shape": _ints, "b_shape": _ints, "out_shape": _ints, "label": _str}


@dataclass(frozen=True)
class BootstrapAttrs(_Attrs):
    """Refresh of the input register: the first ``slots`` real slots, mapped into [-1, 1] as
    ``(x + constant) / postscale`` for the engine's bootstrap and back; ``range`` the calibrated (min, max),
    ``cut`` the level after which the compiler placed it."""

    slots: int
    constant: float
    postscale: int
    range: tuple[float, float]
    cut: int

    KEYS: ClassVar = ("slots", "constant", "postscale", "range", "cut")
    REQUIRED: ClassVar = KEYS
    PARSE: ClassVar = {"slots": _int, "constant": _float, "postscale": _int, "range": _float_pair, "cut": _int}


StepAttrs = LinearAttrs | MulAttrs | MatMulAttrs | BootstrapAttrs
OP_ATTRS: dict[str, type[StepAttrs]] = {
    "linear": LinearAttrs, "mul": MulAttrs, "matmul": MatMulAttrs, "bootstrap": BootstrapAttrs,
}


# ------------------------------------------------------------------------------------------------------------
# steps
# ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One instruction: ``op`` in :data:`OP_ATTRS`, its fields in ``attrs``; ``level`` = rescales consumed once
    it is done."""

    op: str
    out: int
    inputs: tuple[int, ...]
    size: int
    level: int
    attrs: StepAttrs = field(default_factory=MulAttrs)

    def __post_init__(self) -> None:
        kind = OP_ATTRS.get(self.op)
        if kind is None:
            raise ProgramError(f"unknown step op {self.op!r}; accepted: {list(OP_ATTRS)}")
        if not isinstance(self.attrs, kind):
            raise ProgramError(f"a {self.op} step takes {kind.__name__}, got {type(self.attrs).__name__}")

    def to_dict(self) -> dict:
        return {"op": self.op, "out": self.out, "inputs": list(self.inputs), "size": self.size,
                "level": self.level, "attrs": self.attrs.to_dict()}

    @classmethod
    def from_dict(cls, value: Any) -> Step:
        d = _object(value, "a step")
        _check_keys(d, ("op", "out", "inputs", "size", "level", "attrs"), "a step")
        op = _str(d.get("op"), "op")
        kind = OP_ATTRS.get(op)
        if kind is None:
            raise ProgramError(f"unknown step op {op!r}; accepted: {list(OP_ATTRS)}")
        out = _int(d.get("out"), "out")
        attrs = kind.from_dict(d.get("attrs", {}), f"the attrs of step {out} ({op})")
        return cls(op, out, _ints(d.get("inputs"), "inputs"), _int(d.get("size"), "size"),
                   _int(d.get("level"), "level"), attrs)

    def _as(self, kind: type[A]) -> A:
        if not isinstance(self.attrs, kind):
            raise ProgramError(f"step {self.out} is a {self.op} step, not {kind.__name__.removesuffix('Attrs')}")
        return self.attrs

    @property
    def linear(self) -> LinearAttrs:
        return self._as(LinearAttrs)

    @property
    def matmul(self) -> MatMulAttrs:
        return self._as(MatMulAttrs)

    @property
    def bootstrap(self) -> BootstrapAttrs:
        return self._as(BootstrapAttrs)

    @property
    def label(self) -> str | None:
        return getattr(self.attrs, "label", None)

    @property
    def terms(self) -> tuple[Term, ...]:
        """The linear terms (none for other ops)."""
        return self.attrs.terms if isinstance(self.attrs, LinearAttrs) else ()

    def reads(self) -> list[int]:
        """Registers this step reads: its inputs and its linear terms' inputs."""
        return sorted({*self.inputs, *(t.input for t in self.terms)})

    def array_names(self) -> list[str]:
        names = [name for t in self.terms for name in t.array_names()]
        bias = self.attrs.bias if isinstance(self.attrs, LinearAttrs) else None
        return names + ([bias] if bias else [])

    def remapped(self, mapping: Mapping[int, int]) -> Step:
        """This step reading register ``mapping[r]`` wherever it read r (in its inputs and its terms)."""
        attrs = self.attrs.remapped(mapping) if isinstance(self.attrs, LinearAttrs) else self.attrs
        return replace(self, inputs=tuple(mapping.get(r, r) for r in self.inputs), attrs=attrs)
