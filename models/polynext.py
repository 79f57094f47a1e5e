"""PolyNeXt (CPolyNeXt / APolyNeXt): activation-free MetaFormer-style backbones, spec section 2.

Two-stream (DARTS-style) wiring of cells; every cell merges its two inputs with per-channel scales, normalises
the sum ("pre-cell norm") and refines it with stacks of (mixer, PolyMLP) residual branches weighted by
Sigmoid-Scales. The mixer is PolyConv (CPolyNeXt, and APolyNeXt stages 1-2) or PolyAttn (APolyNeXt stages 3-4).
The LN models use LayerNorm2d / l1 attention rows; the ``_bn`` models use ChannelBatchNorm /
RunningRowSumNorm, which are constant affine maps at inference, so the whole network is add/mul only.

Choices where the spec leaves a gap (spec **[gap]** marks):

* LowRes Sigmoid-Scale: reproduces the reference quirk (the T probabilities stored as raw logits, unpaired).
* BN models build every BN buffer/parameter at construction for the resolution implied by ``img_size`` (no
  lazy creation); ``img_size`` must be divisible by the total stride, otherwise ValueError.
* ChannelBatchNorm keeps the code's affine (gamma_c * gamma_hw, no beta), not the paper's eq. 19.
* Drop path is applied by the cell to each branch output; every branch ends with its norm (or PolyAttn), so
  this equals the reference "DropPath after the branch norm".
* Head dropout: the buffer ``p`` ramps linearly from 0 to ``drop_rate`` over ``rampout`` epochs
  (``set_epoch``); ``rampout=0`` means constant ``drop_rate``.
* Module names are our own (``head.norm``, ``cells.i.mixers.j`` ...), not the reference state-dict names
  of spec 2.10; loading released checkpoints needs a key map.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import Tensor, nn

from polyfhe.models.layers.drop import DropPath
from polyfhe.models.layers.norms import Resolution, make_norm
from polyfhe.models.layers.poly_attn import PolyAttnMixer
from polyfhe.models.layers.poly_conv import PolyConv, depthwise_conv
from polyfhe.models.layers.poly_mlp import PolyMLP
from polyfhe.models.registry import register_model

logger = logging.getLogger(__name__)

__all__ = ["PolyHead", "PolyNeXt", "PolyNeXtArch", "PolyNeXtCell", "StageConfig", "build_polynext"]


# ----------------------------------------------------------------------------------------------- configs
@dataclass(frozen=True)
class StageConfig:
    """One stage: ``depth`` cells of ``stacks`` (mixer, PolyMLP) pairs at ``channels`` channels."""

    channels: int
    depth: int
    stacks: int
    exp_conv: float
    exp_mlp: float
    mixer: str = "conv"  # key of MIXERS
    coarse_kernel: int = 5  # PolyConv K_c: 3x3 dil 2 in stage 1, 5x5 dil 2 later
    coarse_dilation: int = 2

    @property
    def conv_hidden(self) -> int:
        return int(self.channels * self.exp_conv)

    @property
    def mlp_hidden(self) -> int:
        return int(self.channels * self.exp_mlp)


@dataclass(frozen=True)
class StemConfig:
    kernel: int
    stride: int
    padding: int


STEMS: dict[str, StemConfig] = {"imagenet": StemConfig(7, 4, 3), "lowres": StemConfig(3, 1, 1)}


@dataclass(frozen=True)
class PolyNeXtArch:
    """The architecture table of spec 2.6 plus the Sigmoid-Scale initialisation of spec 2.2."""

    name: str
    stages: tuple[StageConfig, ...]
    stem: str
    downsample: tuple[str, str]  # (s0 stream, s1 stream), keys of DOWNSAMPLES
    skip_logits: tuple[float, ...]  # raw lambda; residual weight r = sigmoid(lambda)
    skip_paired: bool  # True: stack j uses (j, j+1); False: (2j, 2j+1)

    @property
    def num_cells(self) -> int:
        return sum(s.depth for s in self.stages)

    @property
    def downsample_cells(self) -> tuple[int, ...]:
        """Indices of the first cell of every stage after the first (both streams are reduced there)."""
        starts, total = [], 0
        for stage in self.stages[:-1]:
            total += stage.depth
            starts.append(total)
        return tuple(starts)

    def skip_pairs(self, stacks: int) -> tuple[tuple[int, int], ...]:
        pairs = tuple((j, j + 1) if self.skip_paired else (2 * j, 2 * j + 1) for j in range(stacks))
        if pairs and max(pairs[-1]) >= len(self.skip_logits):
            raise ValueError(
                f"{self.name}: {stacks} stacks need more than {len(self.skip_logits)} skip logits"
            )
        return pairs

    def with_attention(self, from_stage: int = 2) -> PolyNeXtArch:
        """The APolyNeXt version: every cell of stage index >= ``from_stage`` uses the PolyAttn mixer."""
        stages = tuple(replace(s, mixer="attn") if i >= from_stage else s for i, s in enumerate(self.stages))
        return replace(self, name="A" + self.name.removeprefix("C"), stages=stages)


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


_T_SCALES = (0.5, 0.5, 0.25, 0.125, 0.0625, 0.03125)
_T_LOGITS = tuple(_logit(v) for v in _T_SCALES)  # T: sigma(lambda) = _T_SCALES, paired (j, j + 1)
_SB_LOGITS = tuple(-i / 2 for i in range(8))  # S / B: sigma gives 0.5, 0.378, 0.269, ...
_L_LOGITS = tuple(-i / 2 - 0.5 for i in range(8))  # L: sigma gives 0.378 ... 0.018
_IN_EXP = ((1.0, 1.0, 0.75, 0.75), (2.0, 2.0, 1.75, 1.75))  # (exp_conv, exp_mlp) per stage
_LR_EXP = ((1.0,) * 3, (2.0,) * 3)
_SEP_SEP, _SEP_FULL = ("sep3x3", "sep3x3"), ("sep3x3", "full3x3")


Ints = tuple[int, ...]


def _arch(
    name: str,
    channels: Ints,
    depths: Ints,
    stacks: Ints,
    downsample: tuple[str, str],
    logits: tuple[float, ...],
    paired: bool,
    exp: tuple[tuple[float, ...], tuple[float, ...]] = _IN_EXP,
    stem: str = "imagenet",
) -> PolyNeXtArch:
    """One row of spec 2.6; stage 1 uses the 3x3-dilation-2 coarse branch, later stages 5x5 dilation 2."""
    rows = enumerate(zip(channels, depths, stacks, *exp, strict=True))
    stages = tuple(
        StageConfig(c, d, s, ec, em, coarse_kernel=3 if i == 0 else 5) for i, (c, d, s, ec, em) in rows
    )
    return PolyNeXtArch(name, stages, stem, downsample, logits, paired)


ARCHS: dict[str, PolyNeXtArch] = {
    "t": _arch("CPolyNeXt-T", (48, 96, 192, 288), (2, 2, 6, 2), (3,) * 4, _SEP_SEP, _T_LOGITS, True),
    "s": _arch("CPolyNeXt-S", (72, 144, 288, 432), (3, 3, 8, 3), (3, 4, 4, 4), _SEP_FULL, _SB_LOGITS, False),
    "b": _arch("CPolyNeXt-B", (84, 168, 336, 504), (3, 5, 10, 3), (4,) * 4, _SEP_FULL, _SB_LOGITS, False),
    "l": _arch("CPolyNeXt-L", (96, 192, 384, 576), (3, 6, 12, 3), (4,) * 4, _SEP_FULL, _L_LOGITS, False),
    # [gap] LowRes stores the T probabilities as raw logits and does not pair them (spec 2.2).
    "lr": _arch(
        "CPolyNeXt-LR", (72, 144, 288), (2, 3, 3), (3,) * 3, _SEP_SEP, _T_SCALES, False, _LR_EXP, "lowres"
    ),
}


# ------------------------------------------------------------------------------------------ small modules
class ChannelScale(nn.Module):
    """Per-channel scale (1, C, 1, 1), init 1, no bias: the cell's ``preprocess`` a0 / a1."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1, channels, 1, 1))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale


class RampDropout(nn.Module):
    """Dropout whose probability lives in buffer ``p`` and ramps linearly over ``rampout`` epochs."""

    def __init__(self, rate: float = 0.0, rampout: int = 0) -> None:
        super().__init__()
        self.rate = float(rate)
        self.rampout = int(rampout)
        self.register_buffer("p", torch.tensor(self.rate if self.rampout <= 0 else 0.0))

    def set_epoch(self, epoch: int) -> None:
        frac = 1.0 if self.rampout <= 0 else min(1.0, max(0.0, epoch / self.rampout))
        self.p.fill_(self.rate * frac)

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.rate == 0.0:
            return x
        # p stays on the device: float(p) would sync the GPU every step and break torch.compile's graph
        return x * (torch.rand_like(x) >= self.p) / (1.0 - self.p)


class SepDownsample(nn.Module):
    """``sep3x3``: depthwise 3x3 stride 2 on C_prev, then 1x1 C_prev -> C_cur; no bias."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.depthwise = depthwise_conv(c_in, 3, stride=2)
        self.pointwise = nn.Conv2d(c_in, c_out, kernel_size=1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.pointwise(self.depthwise(x))


class FullDownsample(nn.Module):
    """``full3x3``: dense 3x3 stride 2 padding 1, no bias."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel_size=3, stride=2, padding=1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)


DOWNSAMPLES: dict[str, Callable[[int, int], nn.Module]] = {"sep3x3": SepDownsample, "full3x3": FullDownsample}


def _conv_mixer(stage: StageConfig, norm: str, res: Resolution | None) -> nn.Module:
    return PolyConv(stage.channels, stage.conv_hidden, stage.coarse_kernel, stage.coarse_dilation, norm, res)


def _attn_mixer(stage: StageConfig, norm: str, res: Resolution | None) -> nn.Module:
    return PolyAttnMixer(stage.channels, norm, res)


MIXERS: dict[str, Callable[[StageConfig, str, Resolution | None], nn.Module]] = {
    "conv": _conv_mixer,
    "attn": _attn_mixer,
}


# ------------------------------------------------------------------------------------------ cell and head
class PolyNeXtCell(nn.Module):
    """P = Norm(a0 s0 + a1 s1); per stack j: P += r_a Mixer_j(P); P += r_b PolyMLP_j(P) (spec 2.2)."""

    def __init__(
        self,
        stage: StageConfig,
        arch: PolyNeXtArch,
        norm: str,
        resolution: Resolution | None,
        drop_path: float = 0.0,
    ) -> None:
        super().__init__()
        c = stage.channels
        self.preprocess0 = ChannelScale(c)
        self.preprocess1 = ChannelScale(c)
        self.pre_norm = make_norm(norm, c, resolution)
        self.skip_weight = nn.Parameter(torch.tensor(arch.skip_logits, dtype=torch.float32))
        self.skip_pairs = arch.skip_pairs(stage.stacks)
        self.mixers = nn.ModuleList(MIXERS[stage.mixer](stage, norm, resolution) for _ in range(stage.stacks))
        self.mlps = nn.ModuleList(PolyMLP(c, stage.mlp_hidden, norm, resolution) for _ in range(stage.stacks))
        self.drop_path = DropPath(drop_path)

    def forward(self, s0: Tensor, s1: Tensor) -> Tensor:
        p = self.pre_norm(self.preprocess0(s0) + self.preprocess1(s1))
        r = torch.sigmoid(self.skip_weight)
        for (ia, ib), mixer, mlp in zip(self.skip_pairs, self.mixers, self.mlps, strict=True):
            p = p + r[ia] * self.drop_path(mixer(p))
            p = p + r[ib] * self.drop_path(mlp(p))
        return p


class PolyHead(nn.Module):
    """Norm -> 1x1 C -> 4C -> u = l + l * r (halves) -> global mean -> dropout -> Linear (spec 2.1)."""

    def __init__(
        self,
        channels: int,
        num_classes: int,
        norm: str,
        resolution: Resolution | None,
        drop_rate: float = 0.0,
        rampout: int = 0,
    ) -> None:
        super().__init__()
        self.norm = make_norm(norm, channels, resolution)
        self.proj = nn.Conv2d(channels, 4 * channels, kernel_size=1, bias=False)
        self.dropout = RampDropout(drop_rate, rampout)
        self.fc = nn.Linear(2 * channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        left, right = self.proj(self.norm(x)).chunk(2, dim=1)
        u = (left + left * right).mean(dim=(2, 3))
        return self.fc(self.dropout(u))


# ------------------------------------------------------------------------------------------------- model
def _as_pair(size: int | tuple[int, int]) -> Resolution:
    h, w = (size, size) if isinstance(size, int) else size
    if h <= 0 or w <= 0:
        raise ValueError(f"img_size must be positive, got {size}")
    return int(h), int(w)


def _conv_out(n: int, kernel: int, stride: int, padding: int) -> int:
    return (n + 2 * padding - kernel) // stride + 1


def stage_resolutions(arch: PolyNeXtArch, img_size: Resolution, strict: bool) -> tuple[Resolution, ...]:
    """Feature-map (H, W) of every stage; ``strict`` (BN models) demands divisibility by the total stride."""
    stem = STEMS[arch.stem]
    total = stem.stride * 2 ** (len(arch.stages) - 1)
    if strict and (img_size[0] % total or img_size[1] % total):
        raise ValueError(
            f"img_size {img_size} is not compatible with {arch.name}'s strides: BN variants need H and W "
            f"divisible by {total} (stem stride {stem.stride}, {len(arch.stages) - 1} stride-2 downsamples)"
        )
    res = tuple(_conv_out(n, stem.kernel, stem.stride, stem.padding) for n in img_size)
    out = [res]
    for _ in arch.stages[1:]:
        res = tuple(_conv_out(n, 3, 2, 1) for n in res)
        out.append(res)
    return tuple(out)  # type: ignore[return-value]


def two_stream_features(net: nn.Module, x: Tensor) -> Tensor:
    """The DARTS-style wiring shared by the training and folded models (spec 2.1).

    ``net`` provides ``stem``, ``reductions`` (two per downsample, one per stream), ``downsample_cells`` and
    ``cells``; each cell maps (s0, s1) to the next s1.
    """
    s0 = s1 = net.stem(x)
    reduction = iter(net.reductions)
    for i, cell in enumerate(net.cells):
        if i in net.downsample_cells:
            s0, s1 = next(reduction)(s0), next(reduction)(s1)
        s0, s1 = s1, cell(s0, s1)
    return s1


class PolyNeXt(nn.Module):
    """Stem -> two-stream cells with per-stream reductions -> PolyHead on the last s1 (spec 2.1)."""

    def __init__(
        self,
        arch: PolyNeXtArch,
        norm: str = "ln",
        num_classes: int = 1000,
        img_size: int | tuple[int, int] = 224,
        in_chans: int = 3,
        drop_path_rate: float = 0.0,
        drop_rate: float = 0.0,
        rampout: int = 0,
    ) -> None:
        super().__init__()
        hw = _as_pair(img_size)
        self.arch = arch
        self.norm_kind = norm
        self.num_classes = num_classes
        self.input_shape: tuple[int, int, int] = (in_chans, *hw)
        self.stage_resolutions = stage_resolutions(arch, hw, strict=norm == "bn")
        stem = STEMS[arch.stem]
        chans = [s.channels for s in arch.stages]
        self.stem = nn.Conv2d(in_chans, chans[0], stem.kernel, stem.stride, stem.padding, bias=False)
        self.reductions = nn.ModuleList(
            DOWNSAMPLES[arch.downsample[stream]](chans[k - 1], chans[k])
            for k in range(1, len(chans))
            for stream in (0, 1)
        )
        self.downsample_cells = arch.downsample_cells
        rates = torch.linspace(0.0, drop_path_rate, arch.num_cells, device="cpu").tolist()
        stage_of_cell = [i for i, s in enumerate(arch.stages) for _ in range(s.depth)]
        self.cells = nn.ModuleList(
            PolyNeXtCell(arch.stages[k], arch, norm, self.stage_resolutions[k], rates[i])
            for i, k in enumerate(stage_of_cell)
        )
        self.head = PolyHead(chans[-1], num_classes, norm, self.stage_resolutions[-1], drop_rate, rampout)
        init_weights(self)

    def forward_features(self, x: Tensor) -> Tensor:
        return two_stream_features(self, x)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.forward_features(x))

    def set_epoch(self, epoch: int) -> None:
        """Advance the head-dropout ramp."""
        self.head.dropout.set_epoch(epoch)


_POLY_INIT_TYPES = (PolyConv, PolyMLP, SepDownsample, FullDownsample)


def init_weights(model: nn.Module) -> None:
    """Spec 2.8: Kaiming-normal (fan_in, gain sqrt 2) for PolyConv, PolyMLP and downsample convs.

    Everything else (stem, PolyAttn convs, head) keeps PyTorch's default init; norms and scales start at 1.
    """
    for module in model.modules():
        if isinstance(module, _POLY_INIT_TYPES):
            for conv in module.modules():
                if isinstance(conv, nn.Conv2d):
                    nn.init.kaiming_normal_(conv.weight, mode="fan_in", nonlinearity="relu")


def build_polynext(arch: PolyNeXtArch | str, *, norm: str = "ln", **kwargs) -> PolyNeXt:
    """Build a PolyNeXt from an architecture (or a key of ``ARCHS``) and model options."""
    arch = ARCHS[arch] if isinstance(arch, str) else arch
    model = PolyNeXt(arch, norm=norm, **kwargs)
    logger.debug(
        "built %s (%s) with %d parameters", arch.name, norm, sum(p.numel() for p in model.parameters())
    )
    return model


# ---------------------------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class _Variant:
    arch: str
    attention: bool
    params_ln: int
    params_bn: int | None  # after materialisation at the default img_size; None: no reference number
    ct_depth: int | None
    levels_bn: int | None


_IMAGENET_CFG = {"num_classes": 1000, "img_size": 224, "in_chans": 3}
_LOWRES_CFG = {"num_classes": 10, "img_size": 32, "in_chans": 3}

_VARIANTS: dict[str, _Variant] = {
    "cpolynext_t": _Variant("t", False, 6_431_752, 6_495_599, 73, 310),
    "apolynext_t": _Variant("t", True, 6_530_380, 6_612_791, 145, 382),
    "cpolynext_s": _Variant("s", False, 25_654_376, 25_756_884, 131, None),
    "apolynext_s": _Variant("s", True, 26_287_948, None, None, None),
    "cpolynext_b": _Variant("b", False, 39_753_160, None, 169, None),
    "apolynext_b": _Variant("b", True, 40_896_400, None, None, None),
    "cpolynext_l": _Variant("l", False, 57_359_272, None, 193, None),
    "apolynext_l": _Variant("l", True, 57_404_020, None, None, None),
    "cpolynext_lr": _Variant("lr", False, 5_460_322, None, 49, 208),
}


def _register_variants() -> None:
    for name, v in _VARIANTS.items():
        arch = ARCHS[v.arch].with_attention() if v.attention else ARCHS[v.arch]
        cfg = _LOWRES_CFG if v.arch == "lr" else _IMAGENET_CFG
        for norm, suffix, params, levels in (
            ("ln", "", v.params_ln, None),
            ("bn", "_bn", v.params_bn, v.levels_bn),
        ):
            register_model(
                name + suffix,
                family="polynext",
                norm=norm,
                default_cfg=cfg,
                spec_params=params,
                spec_ct_depth=v.ct_depth,
                spec_levels=levels,
                description=f"{arch.name} ({'LayerNorm' if norm == 'ln' else 'BatchNorm, add/mul only'})",
            )(partial(build_polynext, arch, norm=norm))


_register_variants()
