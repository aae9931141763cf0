"""What the planner knows about GPUs, links between them, and the shape of a cluster.

Units: FLOP/s and bytes/s internally; the catalogs are written in the units the data sheets and the
seed documents use (dense TFLOP/s, GiB of HBM, GB/s of bandwidth, microseconds of latency).

Link bandwidths are the seeds' figures (`../shared/seeds/`), and traffic volumes are the seeds'
arithmetic. Those figures mix conventions: NVLink's 600/900 GB/s and InfiniBand's 50/100 GB/s are
both directions of one GPU's links added together, PCIe's 32/64 GB/s is one direction. A ring
collective is limited by one direction, and NCCL reaches less than the wire: collectives are
priced at `Link.efficiency` of the figure (LINK_EFFICIENCY, measured on NVLink 4), or at what your
fabric measures (nccl-tests "busbw") with `--link.nvlink-gbps 370` and the like.
docs/planner.md tabulates seed figure against data-sheet figure for every entry.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from plait.errors import UserError, bad_value

GB = 1e9
GIB = float(1 << 30)


@dataclass(frozen=True)
class GPU:
    name: str
    tflops: dict[str, float]
    """Dense peak TFLOP/s per dtype (no 2:4 sparsity): bf16, fp16, fp8, tf32, fp32."""
    hbm_gib: float
    """Memory the driver reports, in GiB."""
    hbm_gbps: float
    """HBM bandwidth, GB/s."""
    intra_link: str
    """Default link between GPUs of one node (key of LINKS)."""
    inter_link: str
    """Default link between nodes (key of LINKS), one NIC per GPU."""
    sms: int = 0
    """Streaming multiprocessors (for reference; the cost model does not use it)."""

    def peak_flops(self, dtype: str = "bf16") -> float:
        if dtype not in self.tflops:
            raise bad_value("dtype", dtype, f"{self.name} has no {dtype} tensor cores; choose one of "
                            f"{', '.join(sorted(self.tflops))}")
        return self.tflops[dtype] * 1e12


@dataclass(frozen=True)
class Link:
    name: str
    gbps: float
    """Bandwidth per GPU in GB/s (gigaBYTES per second), as the seeds quote it."""
    latency_us: float
    """Per-message latency (the alpha of the alpha-beta model), microseconds."""
    measured: object = field(default=None, compare=False, repr=False)
    """A `plait.planner.profile.HardwareProfile` whose collectives were measured over this link:
    measured (op, group size) pairs cost what they measured, the rest follow alpha-beta."""
    efficiency: float = 1.0
    """Share of `gbps` that collectives reach as bus bandwidth: LINK_EFFICIENCY for the catalog's
    figures, 1 for one a user gives (`--link.nvlink-gbps 370`: what the link achieves)."""

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * GB * self.efficiency

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6


# Data-sheet figures. V100 has no bf16: fp16 stands in. H100 "1000" in the seeds is 989.4 dense.
GPUS: dict[str, GPU] = {
    "v100": GPU("V100 SXM2 32GB", {"fp16": 125.0, "fp32": 15.7}, 32, 900, "nvlink2", "ib-hdr", 80),
    "a100-40gb": GPU("A100 SXM 40GB", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
                     40, 1555, "nvlink3", "ib-hdr", 108),
    "a100-80gb": GPU("A100 SXM 80GB", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
                     80, 2039, "nvlink3", "ib-hdr", 108),
    "h100": GPU("H100 SXM 80GB", {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "tf32": 494.7,
                                  "fp32": 66.9}, 80, 3350, "nvlink4", "ib-ndr", 132),
    "h100-pcie": GPU("H100 PCIe 80GB", {"bf16": 756.0, "fp16": 756.0, "fp8": 1513.0, "tf32": 378.0,
                                        "fp32": 51.2}, 80, 2000, "pcie5", "ib-ndr", 114),
    "h200": GPU("H200 SXM 141GB", {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "tf32": 494.7,
                                   "fp32": 66.9}, 141, 4800, "nvlink4", "ib-ndr", 132),
    "b200": GPU("B200 SXM 180GB", {"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0, "tf32": 1100.0,
                                   "fp32": 75.0}, 180, 8000, "nvlink5", "ib-ndr", 148),
}
GPU_ALIASES = {"a100": "a100-80gb", "h100-sxm": "h100", "h200-sxm": "h200", "v100-32gb": "v100"}
# what torch.cuda.get_device_name reports -> the catalog entry (recorded runs, calibrated profiles)
CARD_NAMES = {"NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200", "NVIDIA H100 PCIe": "h100-pcie",
              "NVIDIA A100-SXM4-80GB": "a100-80gb", "NVIDIA A100-SXM4-40GB": "a100-40gb", "NVIDIA B200": "b200",
              "Tesla V100-SXM2-32GB": "v100"}


def card_key(device_name: str) -> str | None:
    """The catalog entry of a card as torch names it, or None for one the catalog does not know."""
    return CARD_NAMES.get(device_name)

# The catalog's bandwidths are the seeds' (and the vendors') figures per GPU, both directions
# together: NVLink 4's 900 GB/s is 450 each way. NCCL's collectives reach a share of it as bus
# bandwidth: on 4 x H200 over NVLink 4 the all-reduce ran at 357 GB/s at 1 GiB, all-gather 345,
# reduce-scatter 326 (../NOTES, `hardware-h200.json`): 0.36-0.40 of 900. The planner prices an
# uncalibrated NVLink at 0.4 of its figure. InfiniBand, never measured here, keeps its figure (both
# directions too, so up to 2x optimistic). A calibrated cluster costs what it measured instead.
LINK_EFFICIENCY = 0.4
ONE_WAY_EFFICIENCY = 0.8  # PCIe's and Ethernet's figures are one direction already (an assumption: unmeasured here)
# Seed figures (GB/s per GPU) and latencies (seed 002: NVLink ~1 us, IB 1-5 us, PCIe ~1 us).
LINKS: dict[str, Link] = {
    "nvlink2": Link("NVLink 2 (V100)", 300.0, 1.0, efficiency=LINK_EFFICIENCY),
    "nvlink3": Link("NVLink 3 (A100)", 600.0, 1.0, efficiency=LINK_EFFICIENCY),
    "nvlink4": Link("NVLink 4 (H100/H200)", 900.0, 1.0, efficiency=LINK_EFFICIENCY),
    "nvlink5": Link("NVLink 5 (B200)", 1800.0, 1.0, efficiency=LINK_EFFICIENCY),
    "pcie4": Link("PCIe Gen4 x16", 32.0, 1.0, efficiency=ONE_WAY_EFFICIENCY),
    "pcie5": Link("PCIe Gen5 x16", 64.0, 1.0, efficiency=ONE_WAY_EFFICIENCY),
    "ib-hdr": Link("InfiniBand HDR", 50.0, 5.0),
    "ib-ndr": Link("InfiniBand NDR", 100.0, 5.0),
    "ethernet": Link("Ethernet 200GbE", 25.0, 10.0, efficiency=ONE_WAY_EFFICIENCY),
}


def gpu(name: str) -> GPU:
    key = GPU_ALIASES.get(name.lower(), name.lower())
    if key not in GPUS:
        raise bad_value("--gpu", name, f"unknown GPU; choose one of {', '.join(GPUS)}")
    return GPUS[key]


def link(name: str, field: str = "link") -> Link:
    key = name.lower().replace("_", "-")
    family = [k for k in LINKS if k.startswith(key)]
    if key not in LINKS and family:  # `nvlink` names a bandwidth override's link, not a kind to swap in
        raise bad_value(field, name, f"names a family of links; choose its kind: {', '.join(family)}")
    if key not in LINKS:
        raise bad_value(field, name, f"unknown link; choose one of {', '.join(LINKS)}")
    return LINKS[key]


@dataclass(frozen=True)
class Cluster:
    """The machines a job runs on, and how fast the planner assumes they go."""

    gpu: GPU
    nodes: int = 1
    gpus_per_node: int = 8
    intra: Link = field(default_factory=lambda: LINKS["nvlink4"])
    inter: Link = field(default_factory=lambda: LINKS["ib-ndr"])
    matmul_efficiency: float = 0.7
    """Share of the dense peak that large matrix multiplies reach (calibrate with measurements)."""
    hbm_efficiency: float = 0.8
    """Share of HBM bandwidth that memory-bound kernels reach."""
    reserved_gib: float = 2.0
    """Memory per GPU that training cannot use: CUDA context, NCCL buffers, allocator slack."""
    dtype: str = "bf16"
    """Compute dtype whose peak the roofline and MFU use."""
    profile: object = field(default=None, compare=False, repr=False)
    """A measured `plait.planner.profile.HardwareProfile` (`plait plan --hardware`): matmuls,
    attention and the optimizer cost what this machine measured instead of peak x efficiency."""

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad_value(f"--{name.replace('_', '-')}", v, "must be a positive integer")
        for name in ("matmul_efficiency", "hbm_efficiency"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise bad_value(f"--gpu.{name.replace('_', '-')}", v, "must be in (0, 1]")
        if self.reserved_gib < 0:
            raise bad_value("--gpu.reserved-gib", self.reserved_gib, "must be zero or more")


    @property
    def n_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def peak_flops(self) -> float:
        return self.gpu.peak_flops(self.dtype)


def cluster(gpu_name: str = "h100", nodes: int = 1, gpus_per_node: int = 8, **kw) -> Cluster:
    """A cluster of `gpu_name` with its default links (override any field through `kw`)."""
    g = gpu(gpu_name)
    kw.setdefault("dtype", half_dtype(g))
    return Cluster(g, nodes, gpus_per_node, LINKS[g.intra_link], LINKS[g.inter_link], **kw)


def half_dtype(g: GPU) -> str:
    """The 16-bit dtype mixed precision computes in on `g`: bf16, or fp16 on a card without bf16
    tensor cores (V100). fp16 with fp32 master weights keeps the same bytes per parameter and per
    activation, so only the peak differs, and pricing the card at its fp16 rate is what training
    on it does (`plait plan` has no dtype flag to pick it by hand)."""
    return "bf16" if "bf16" in g.tflops else "fp16"


# `--link.nvlink-gbps 370`, `--gpu.tflops 900`, ...: the command line's way into the catalog.
_GPU_KEYS = {"tflops": "tflops", "hbm-gib": "hbm_gib", "hbm-gbps": "hbm_gbps"}
_CLUSTER_KEYS = {"efficiency": "matmul_efficiency", "matmul-efficiency": "matmul_efficiency",
                 "hbm-efficiency": "hbm_efficiency", "reserved-gib": "reserved_gib"}


def _number(key: str, value, positive: bool = False) -> float:
    """`value` as a number; `positive`: a rate or a capacity, which 0 does not make sense for (every
    time divides by a peak or a bandwidth; a GPU of 0 GiB fits nothing)."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise bad_value(f"--{key}", value, "expected a number") from None
    if x != x or x in (float("inf"), float("-inf")):  # nan / inf: no message about its sign fits it
        raise bad_value(f"--{key}", value, "expected a finite number")
    if positive and not x > 0:  # one message for -5 and 0 (was "zero or more", then "positive")
        raise bad_value(f"--{key}", value, "must be a positive number")
    if x < 0:
        raise bad_value(f"--{key}", value, "must be zero or more")
    return x


def apply_overrides(c: Cluster, overrides: dict[str, str]) -> Cluster:
    """Return `c` with `{"link.nvlink-gbps": "370", "gpu.tflops": "900", ...}` applied.

    link.<which>-gbps / link.<which>-latency-us, where <which> is intra, inter, a link kind of the
    catalog (nvlink4, ib-ndr, ...) or a family (nvlink, ib, pcie, ethernet) naming whichever of the
    cluster's two links belongs to it; link.intra / link.inter = <kind> swaps a link for another;
    gpu.tflops (dense, the cluster's dtype), gpu.hbm-gib, gpu.hbm-gbps, gpu.efficiency,
    gpu.hbm-efficiency, gpu.reserved-gib."""
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        if section == "link":
            c = _override_link(c, name, value)
        elif section == "gpu":
            if name not in _GPU_KEYS and name not in _CLUSTER_KEYS:
                raise UserError(f"unknown override --{key}: gpu overrides are "
                                f"{', '.join('gpu.' + k for k in [*_GPU_KEYS, *_CLUSTER_KEYS])}")
            x = _number(key, value, positive=name in ("tflops", "hbm-gbps", "hbm-gib"))
            # checked here, by the flag given: Cluster would name gpu.matmul-efficiency for gpu.efficiency
            if name in ("efficiency", "matmul-efficiency", "hbm-efficiency") and not 0 < x <= 1:
                raise bad_value(f"--{key}", value, "must be in (0, 1]")
            if name == "tflops":
                tf = dict(c.gpu.tflops)
                tf[c.dtype] = x
                c = dataclasses.replace(c, gpu=dataclasses.replace(c.gpu, tflops=tf))
            elif name in _GPU_KEYS:
                c = dataclasses.replace(c, gpu=dataclasses.replace(c.gpu, **{_GPU_KEYS[name]: x}))
            else:
                c = dataclasses.replace(c, **{_CLUSTER_KEYS[name]: x})
        else:
            raise UserError(f"unknown override --{key}: use --link.<link>-gbps, --link.<link>-latency-us "
                            f"or --gpu.<field> (e.g. --link.nvlink-gbps 370)")
    if c.reserved_gib >= c.gpu.hbm_gib:  # nothing would fit, and every plan would just say so (after all overrides)
        raise bad_value("--gpu.reserved-gib", c.reserved_gib, f"must be less than the {c.gpu.name}'s "
                        f"{c.gpu.hbm_gib:g} GiB of memory (or give a larger --gpu.hbm-gib)")
    return c


def _override_link(c: Cluster, name: str, value) -> Cluster:
    if name in ("intra", "inter"):
        return dataclasses.replace(c, **{name: link(str(value), f"--link.{name}")})
    for suffix, attr in (("-gbps", "gbps"), ("-latency-us", "latency_us")):
        if name.endswith(suffix):
            which = name[: -len(suffix)]
            x = _number(f"link.{name}", value, positive=attr == "gbps")
            hit = False
            for slot in ("intra", "inter"):
                current: Link = getattr(c, slot)
                kind = next((k for k, v in LINKS.items() if v.name == current.name), "")
                if which in (slot, kind) or (kind.startswith(which) and which in ("nvlink", "ib", "pcie", "ethernet")):
                    # a bandwidth given is what the link achieves: no catalog share applies to it
                    eff = {"efficiency": 1.0} if attr == "gbps" else {}
                    c = dataclasses.replace(c, **{slot: dataclasses.replace(current, **{attr: x}, **eff)})
                    hit = True
            if not hit:
                raise bad_value(f"--link.{name}", value, f"this cluster's links are {c.intra.name} (intra) "
                                f"and {c.inter.name} (inter); name one of intra, inter, nvlink, ib, pcie, "
                                f"ethernet or a kind like {next(iter(LINKS))}")
            return c
    raise UserError(f"unknown override --link.{name}: use --link.<link>-gbps or --link.<link>-latency-us "
                    f"(e.g. --link.nvlink-gbps 370) or --link.intra/--link.inter <kind>")
