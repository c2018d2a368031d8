"""Device meshes: declared in `meshes/*.toml` (or inline, `pp=2,tp=4`), checked against the
devices present and the model, and built as a named JAX mesh with axes (dp, pp, tp, ep).

  dp  data-parallel replicas (refused for now)  pp  pipeline stages (contiguous layers)
  tp  tensor parallelism (heads, ffn, vocab)     ep  expert parallelism (experts split over ep)

A mesh file:

    [mesh]
    dp = 1
    pp = 2
    tp = 4
    [pipeline]
    microbatches = 2      # optional; default: pp
    [hosts]               # optional, for deployments spanning hosts
    count = 2
    devices_per_host = 8
    [device]              # optional: what each device is, for `jfire plan`
    kind = "H200"
    memory_gib = 140.0    # usable memory per device, as the driver reports it
    memory_tb_per_s = 4.8 # optional, spec-sheet peaks for the plan's throughput on paper:
    bf16_tflops = 989.0   # memory bandwidth (1e12 B/s), dense bf16 (1e12 FLOP/s) and the
    link_gb_per_s = 450.0 # device-to-device link, one direction (1e9 B/s)
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import jax
import numpy as np

from jfire.errors import JfireError
from jfire.models.family import Family, MeshShape

AXES = ("dp", "pp", "tp", "ep")
MESHES_DIR = Path(__file__).resolve().parents[1] / "meshes"
# The [device] table's spec-sheet peaks (MeshSpec.device_<key>), beside kind and memory_gib.
DEVICE_PEAKS = ("memory_tb_per_s", "bf16_tflops", "link_gb_per_s")


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    name: str
    dp: int = 1
    pp: int = 1
    tp: int = 1
    ep: int = 1
    microbatches: int | None = None  # pipeline micro-batches; None = one per stage
    hosts: int = 1
    devices_per_host: int | None = None
    device_kind: str | None = None  # [device] kind, e.g. "H200" (named in plans)
    device_memory_gib: float | None = None  # [device] memory_gib: usable memory of one device
    # [device] spec-sheet peaks of one device, for the plan's throughput on paper (jfire/throughput.py)
    device_memory_tb_per_s: float | None = None
    device_bf16_tflops: float | None = None
    device_link_gb_per_s: float | None = None

    def __post_init__(self):
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or size < 1:
                raise JfireError(f"mesh {self.name!r}: axis {axis} must be a positive integer, got {size!r}")
        if self.microbatches is not None and self.microbatches < 1:
            raise JfireError(f"mesh {self.name!r}: microbatches must be >= 1, got {self.microbatches}")
        if self.devices_per_host is not None and self.hosts * self.devices_per_host != self.size:
            raise JfireError(
                f"mesh {self.name!r}: dp*pp*tp*ep = {self.size} devices, but hosts declare "
                f"{self.hosts} x {self.devices_per_host} = {self.hosts * self.devices_per_host}"
            )
        memory = self.device_memory_gib
        if memory is not None and (isinstance(memory, bool) or not isinstance(memory, (int, float)) or not memory > 0):
            raise JfireError(
                f"mesh {self.name!r}: [device] memory_gib must be a positive number of GiB, got {memory!r}"
            )
        for key in DEVICE_PEAKS:
            value = getattr(self, f"device_{key}")
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise JfireError(f"mesh {self.name!r}: [device] {key} must be a positive number, got {value!r}")
        if self.device_kind is not None and not isinstance(self.device_kind, str):
            raise JfireError(
                f'mesh {self.name!r}: [device] kind must be a string like "H200", got {self.device_kind!r}'
            )

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp * self.ep

    @property
    def shape(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in AXES}

    @property
    def num_microbatches(self) -> int:
        return self.microbatches or self.pp

    # -- reading ---------------------------------------------------------------------------

    @classmethod
    def from_toml(cls, path: Path) -> MeshSpec:
        try:
            doc = tomllib.loads(Path(path).read_text())
        except tomllib.TOMLDecodeError as e:
            raise JfireError(f"mesh file {path} is not valid TOML: {e}") from None
        mesh = doc.get("mesh")
        if not isinstance(mesh, dict):
            raise JfireError(f"mesh file {path} needs a [mesh] table with axis sizes (dp, pp, tp, ep)")
        unknown = set(mesh) - set(AXES)
        if unknown:
            raise JfireError(f"mesh file {path}: unknown axes {sorted(unknown)}; axes are {', '.join(AXES)}")
        hosts = doc.get("hosts", {})
        device = doc.get("device", {})
        if not isinstance(device, dict) or set(device) - {"kind", "memory_gib", *DEVICE_PEAKS}:
            raise JfireError(
                f'mesh file {path}: [device] takes kind (e.g. "H200"), memory_gib (e.g. 140.0) and '
                f"the spec-sheet peaks {', '.join(DEVICE_PEAKS)}, got {sorted(device) if isinstance(device, dict) else device!r}"
            )
        return cls(
            name=doc.get("name", Path(path).stem),
            **mesh,
            microbatches=doc.get("pipeline", {}).get("microbatches"),
            hosts=hosts.get("count", 1),
            devices_per_host=hosts.get("devices_per_host"),
            device_kind=device.get("kind"),
            device_memory_gib=device.get("memory_gib"),
            device_memory_tb_per_s=device.get("memory_tb_per_s"),
            device_bf16_tflops=device.get("bf16_tflops"),
            device_link_gb_per_s=device.get("link_gb_per_s"),
        )

    @classmethod
    def inline(cls, text: str) -> MeshSpec:
        sizes = {}
        for part in text.split(","):
            key, _, value = part.partition("=")
            key = key.strip()
            if key not in AXES + ("microbatches",) or not value.strip().isdigit():
                raise JfireError(
                    f"inline mesh {text!r}: expected axis=size pairs like 'pp=2,tp=4' "
                    f"(axes: {', '.join(AXES)}; also microbatches=N)"
                )
            sizes[key] = int(value)
        return cls(name=text, **sizes)


def files_with_table(table: str) -> list[Path]:
    """The readable .toml files in meshes/ that have `table`: mesh files have [mesh], deployment
    files (which live beside them) [[groups]]."""
    if not MESHES_DIR.is_dir():
        return []
    out = []
    for path in sorted(MESHES_DIR.glob("*.toml")):
        try:
            if table in tomllib.loads(path.read_text()):
                out.append(path)
        except (OSError, tomllib.TOMLDecodeError):
            continue
    return out


def mesh_files() -> list[Path]:
    return files_with_table("mesh")


def resolve(arg: str | None) -> MeshSpec:
    """`--mesh`: None or 'single' (one device), inline 'pp=2,tp=4', a file, or a name in meshes/."""
    if arg in (None, "", "single"):
        return MeshSpec(name="single")
    if "=" in arg:
        return MeshSpec.inline(arg)
    path = Path(arg)
    if path.is_file():
        return MeshSpec.from_toml(path)
    named = MESHES_DIR / f"{arg}.toml"
    if named.is_file():
        return MeshSpec.from_toml(named)
    known = [p.stem for p in mesh_files()]
    raise JfireError(
        f"no mesh {arg!r}: give an inline mesh like 'pp=2,tp=4', a .toml file, or one of: "
        + (", ".join(known) or "(none found)")
    )


def problems(spec: MeshSpec, cfg: Family, num_devices: int) -> list[str]:
    """Why this mesh cannot run this model on num_devices devices (empty: it can)."""
    found = []
    if spec.size > num_devices:
        hint = ""
        if jax.default_backend() == "cpu":  # the usual case: a mesh tried on a machine without accelerators
            hint = f" (without accelerators, --cpu-devices {spec.size} exposes {spec.size} CPU devices)"
        found.append(f"it needs {spec.size} devices (dp*pp*tp*ep) but {num_devices} are present{hint}")
    if spec.dp > 1:
        # Rows are not split over dp yet: each replica would repeat the whole batch's work.
        found.append(
            f"dp={spec.dp} is not supported yet (every replica would repeat the same work); run "
            "separate groups or engines instead, and use dp=1"
        )
    return found + cfg.mesh_problems(MeshShape(dp=spec.dp, pp=spec.pp, tp=spec.tp, ep=spec.ep))


def check_fits(spec: MeshSpec, cfg: Family, num_devices: int) -> None:
    """Refuses a mesh the devices or the model cannot take, saying why and what would fit."""
    found = problems(spec, cfg, num_devices)
    if found:
        raise JfireError(
            f"mesh {spec.name!r} does not fit: " + "; ".join(found) + f". Would fit: {suggest(cfg, num_devices)}"
        )


def suggest(cfg: Family, num_devices: int) -> str:
    """Meshes (pp x tp x ep, dp=1) that fit this model on at most num_devices devices."""
    fits = []
    for ep in range(1, num_devices + 1):
        for tp in range(1, num_devices // ep + 1):
            for pp in range(1, num_devices // (ep * tp) + 1):
                candidate = MeshSpec(name="candidate", pp=pp, tp=tp, ep=ep)
                if not problems(candidate, cfg, num_devices):
                    fits.append(f"pp={pp},tp={tp}" + (f",ep={ep}" if ep > 1 else ""))
    return ", ".join(fits[-6:]) if fits else "none"


def build(spec: MeshSpec, devices=None) -> jax.sharding.Mesh:
    devices = list(devices if devices is not None else jax.devices())[: spec.size]
    grid = np.array(devices, dtype=object).reshape([spec.shape[a] for a in AXES])
    return jax.sharding.Mesh(grid, AXES)
