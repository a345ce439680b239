"""What a simulated device is: a model's shape, a GPU's datasheet, TP, the link to other workers,
and optionally a measured step-time table. Read from the shipped presets (presets/presets.toml)
or a profile file in the same format; `pd-worker --simulate list` prints the presets.

A PROFILE is either `MODEL:DEVICE[:tpN][:LINK]` over the presets (`llama-3.1-70b:h100:tp4`,
`llama-3.1-8b:h200:tp1:tcp-100g`) or the path of a TOML file:

    model = "llama-3.1-70b"          # a preset, or a [model] table with the preset's keys
    device = "h100"                  # a preset, or a [device] table
    tp = 4
    link = "rdma-400g"               # a preset, or a [link] table (default: rdma-400g)
    memory_utilization = 0.9         # share of the GPUs' memory the worker may use
    [[prefill_table]]                # optional measured figures (then no roofline):
    tokens = 1024                    #   a prefill step of this many tokens took
    seconds = 0.085                  #   this long
    [[decode_table]]
    rows = 32                        #   a decode step of this many rows,
    context = 1024                   #   each this many tokens of context,
    seconds = 0.012                  #   took this long
"""

from __future__ import annotations

import importlib.resources
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found]

DEFAULT_LINK = "rdma-400g"
BF16_BYTES = 2
# A new worker's start-up (issue 43: a simulated worker takes load only after it): its weights
# read from shared storage at WEIGHT_LOAD_BYTES_PER_S for the whole node (a network file system
# or object store's share, not a local NVMe's page cache), then ENGINE_INIT_S of engine start
# (CUDA graphs, warm-up). Stated, not measured: llama-3.1-70b's 141 GB give 90 s, within the
# 60-120 s that serving systems report for a cold 70B replica; llama-3.1-8b's 16 GB give 28 s.
WEIGHT_LOAD_BYTES_PER_S = 2e9
ENGINE_INIT_S = 20.0


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    params: float  # parameters in all (embedding and LM head included)
    dtype_bytes: int = BF16_BYTES  # of the weights and the KV cache

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over every layer and KV head (all TP ranks together)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def layer_linear_params(self) -> int:
        """Parameters of one layer's matmuls: QKV, O, and the gated MLP's three."""
        h, d = self.hidden_size, self.head_dim
        qkv = h * (self.num_heads + 2 * self.num_kv_heads) * d
        o = self.num_heads * d * h
        mlp = 3 * h * self.intermediate_size
        return qkv + o + mlp


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_flops: float  # dense bf16 FLOP/s of one GPU
    hbm_bandwidth: float  # bytes/s of one GPU
    memory_bytes: float  # of one GPU
    interconnect_bandwidth: float  # bytes/s per direction between the GPUs of one TP group
    compute_efficiency: float  # share of peak_flops a real kernel reaches
    memory_efficiency: float  # share of hbm_bandwidth a real kernel reaches
    step_overhead_s: float  # fixed cost of one step (launches, scheduling, sampling)


@dataclass(frozen=True)
class LinkSpec:
    """The path a KV pull takes between a prefill and a decode worker, per GPU."""

    name: str
    bandwidth: float  # bytes/s
    latency_s: float  # of one read, before its first byte lands

    def transfer_s(self, nbytes: float, tp: int = 1) -> float:
        """How long `nbytes` take, spread over `tp` GPUs' links side by side."""
        return self.latency_s + nbytes / (self.bandwidth * max(1, tp))


@dataclass(frozen=True)
class Profile:
    model: ModelSpec
    device: DeviceSpec
    tp: int = 1
    link: LinkSpec | None = None
    memory_utilization: float = 0.9
    # Measured (tokens, seconds) of prefill steps and (rows, context, seconds) of decode steps;
    # empty: the roofline.
    prefill_table: tuple[tuple[int, float], ...] = field(default=())
    decode_table: tuple[tuple[int, int, float], ...] = field(default=())

    @property
    def name(self) -> str:
        link = f":{self.link.name}" if self.link else ""
        return f"{self.model.name}:{self.device.name}:tp{self.tp}{link}"

    @property
    def startup_s(self) -> float:
        """Seconds from a new worker's start to ready: its weights read, its engine started."""
        return self.model.weight_bytes / WEIGHT_LOAD_BYTES_PER_S + ENGINE_INIT_S

    def kv_tokens(self) -> int:
        """Tokens of KV the worker's GPUs hold: their usable memory less the weights."""
        usable = self.device.memory_bytes * self.tp * self.memory_utilization
        free = usable - self.model.weight_bytes
        return max(0, int(free // self.model.kv_bytes_per_token))

    def kv_pages(self, page_size: int) -> int:
        pages = self.kv_tokens() // page_size
        if pages < 16:
            raise ValueError(
                f"{self.model.name} does not fit on {self.tp} x {self.device.name} "
                f"({self.model.weight_bytes / 1e9:.0f} GB of weights, "
                f"{self.device.memory_bytes * self.tp * self.memory_utilization / 1e9:.0f} GB "
                "usable): give it more TP"
            )
        return pages


def _read_presets() -> dict[str, Any]:
    text = importlib.resources.files("pd.sim").joinpath("presets/presets.toml").read_text()
    return tomllib.loads(text)


PRESETS: dict[str, Any] = _read_presets()


def _build(cls: type, name: str, table: dict[str, Any]) -> Any:
    known = {f.name for f in fields(cls)} - {"name"}
    unknown = set(table) - known
    if unknown:
        raise ValueError(f"{cls.__name__} {name!r}: unknown keys {sorted(unknown)}")
    try:
        return cls(name=name, **table)
    except TypeError as e:
        raise ValueError(f"{cls.__name__} {name!r}: {e}") from None


def _part(kind: str, cls: type, value: Any, presets: dict[str, Any]) -> Any:
    """A preset by name, or a table of its own (named by its `name` key, else 'custom')."""
    group = presets.get(kind + "s", {})
    if isinstance(value, str):
        if value not in group:
            raise ValueError(f"unknown {kind} {value!r}: one of {', '.join(sorted(group))}")
        return _build(cls, value, group[value])
    if isinstance(value, dict):
        table = dict(value)
        return _build(cls, str(table.pop("name", "custom")), table)
    raise ValueError(f"{kind} must be a preset name or a table, got {value!r}")


def model_preset(name: str) -> ModelSpec:
    return _part("model", ModelSpec, name, PRESETS)


def device_preset(name: str) -> DeviceSpec:
    return _part("device", DeviceSpec, name, PRESETS)


def link_preset(name: str) -> LinkSpec:
    return _part("link", LinkSpec, name, PRESETS)


def parse_profile(spec: str) -> Profile:
    """A PROFILE argument: `MODEL:DEVICE[:tpN][:LINK]` or a TOML file (see the module doc)."""
    path = Path(spec)
    if spec.endswith(".toml") or path.is_file():
        return _profile_file(path)
    parts = spec.split(":")
    if len(parts) < 2:
        raise ValueError(f"--simulate {spec!r}: MODEL:DEVICE[:tpN][:LINK] or a .toml file")
    tp = 1
    link = DEFAULT_LINK
    for extra in parts[2:]:
        if extra.startswith("tp") and extra[2:].isdigit():
            tp = int(extra[2:])
        else:
            link = extra
    return _checked(Profile(model_preset(parts[0]), device_preset(parts[1]), tp, link_preset(link)))


def _profile_file(path: Path) -> Profile:
    data = tomllib.loads(path.read_text())
    # A file may add presets of its own ([models.X], ...) and name them.
    presets = {k: {**PRESETS.get(k, {}), **data.get(k, {})} for k in ("models", "devices", "links")}
    known = {"model", "device", "tp", "link", "memory_utilization", "prefill_table"}
    unknown = set(data) - known - {"decode_table", "models", "devices", "links"}
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
    if "model" not in data or "device" not in data:
        raise ValueError(f"{path}: a profile needs a model and a device")
    return _checked(
        Profile(
            _part("model", ModelSpec, data["model"], presets),
            _part("device", DeviceSpec, data["device"], presets),
            int(data.get("tp", 1)),
            _part("link", LinkSpec, data.get("link", DEFAULT_LINK), presets),
            float(data.get("memory_utilization", 0.9)),
            tuple((int(r["tokens"]), float(r["seconds"])) for r in data.get("prefill_table", [])),
            tuple(
                (int(r["rows"]), int(r["context"]), float(r["seconds"]))
                for r in data.get("decode_table", [])
            ),
        )
    )


def with_tp(p: Profile, tp: int) -> Profile:
    """`p` at another TP (checked as a parsed profile is); a measured profile keeps its own."""
    if tp != p.tp and p.prefill_table:
        raise ValueError(f"a measured profile is measured at tp {p.tp}, not {tp}")
    return _checked(replace(p, tp=tp))


def _checked(p: Profile) -> Profile:
    if p.tp < 1 or p.model.num_kv_heads % p.tp and p.tp % p.model.num_kv_heads:
        raise ValueError(
            f"tp {p.tp} does not divide {p.model.name}'s {p.model.num_kv_heads} KV heads"
        )
    if p.model.num_heads % p.tp:
        raise ValueError(f"tp {p.tp} does not divide {p.model.name}'s {p.model.num_heads} heads")
    if not 0 < p.memory_utilization <= 1:
        raise ValueError("memory_utilization must be in (0, 1]")
    if bool(p.prefill_table) != bool(p.decode_table):
        raise ValueError("a measured profile gives both a prefill_table and a decode_table")
    return p


def list_presets() -> str:
    """What `pd-worker --simulate list` prints."""
    lines = ["models:"]
    for name, m in PRESETS["models"].items():
        lines.append(
            f"  {name:16} {m['num_layers']} layers, hidden {m['hidden_size']}, "
            f"{m['num_heads']} heads / {m['num_kv_heads']} KV heads, {m['params'] / 1e9:.1f}B params"
        )
    lines.append("devices:")
    for name, d in PRESETS["devices"].items():
        lines.append(
            f"  {name:16} {d['peak_flops'] / 1e12:.0f} TFLOP/s bf16, "
            f"{d['hbm_bandwidth'] / 1e12:.2f} TB/s HBM, {d['memory_bytes'] / 1e9:.0f} GB"
        )
    lines.append("links:")
    for name, li in PRESETS["links"].items():
        lines.append(
            f"  {name:16} {li['bandwidth'] * 8 / 1e9:.0f} Gb/s, {li['latency_s'] * 1e6:.0f} us"
        )
    lines.append("PROFILE: MODEL:DEVICE[:tpN][:LINK] (e.g. llama-3.1-70b:h100:tp4) or a .toml file")
    return "\n".join(lines)
