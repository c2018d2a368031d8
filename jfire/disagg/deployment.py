"""Deployment files: which processes a disaggregated service runs, and where.

A deployment (TOML, in meshes/ beside the mesh files) names its groups: each is a prefill or
decode group with its own mesh, so the two sides can be shaped differently. Process ids are
fixed by the file: 0 is the frontend (it also hosts the jax.distributed coordinator), then
each group's processes in file order. Every launcher (local, SSH, Slurm) derives the same
table from the same file.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

from jfire import mesh as meshes
from jfire.errors import JfireError

ROLES = ("prefill", "decode")
DEFAULT_COORDINATOR_PORT = 8476


@dataclasses.dataclass(frozen=True)
class Group:
    name: str
    role: str  # "prefill" or "decode"
    mesh: meshes.MeshSpec
    processes: int = 1
    devices_per_process: int = 1
    port: int = 0  # the leader's control port; 0 = any free port (it is published to the others)


@dataclasses.dataclass(frozen=True)
class Process:
    """One OS process of the deployment."""

    process_id: int
    role: str  # "frontend", "prefill" or "decode"
    group: Group | None = None
    rank: int = 0  # within its group; rank 0 leads

    @property
    def devices(self) -> int:
        return self.group.devices_per_process if self.group else 1

    @property
    def label(self) -> str:
        return "frontend" if self.group is None else f"{self.group.name}/{self.rank}"


@dataclasses.dataclass(frozen=True)
class Deployment:
    name: str
    groups: tuple[Group, ...]
    frontend_port: int = 8000
    coordinator_port: int = DEFAULT_COORDINATOR_PORT
    transfer_timeout_s: float = 30.0  # a published KV cache not pulled and acknowledged by then is released
    transfer_compress: bool = False  # KV pages coded losslessly on the wire (jfire.disagg.kv_codec)
    path: Path | None = None

    def __post_init__(self):
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise JfireError(f"deployment {self.name!r}: group names must be unique, got {names}")
        for role in ROLES:
            if not any(g.role == role for g in self.groups):
                raise JfireError(
                    f"deployment {self.name!r} has no {role} group; it needs at least one "
                    f'[[groups]] table with role = "{role}"'
                )
        if self.transfer_timeout_s <= 0:
            raise JfireError(
                f"deployment {self.name!r}: [transfer] timeout_s must be > 0, got {self.transfer_timeout_s}"
            )
        spanning = [g.name for g in self.groups if g.processes > 1]
        if self.transfer_compress and spanning:
            raise JfireError(
                f"deployment {self.name!r}: [transfer] compress = true codes the KV cache of groups of one "
                f"process; group(s) {', '.join(spanning)} span processes and send it in blocks, uncoded: "
                "set compress = false or run those groups in one process each"
            )

    @property
    def processes(self) -> list[Process]:
        out = [Process(0, "frontend")]
        for group in self.groups:
            for rank in range(group.processes):
                out.append(Process(len(out), group.role, group, rank))
        return out

    def process(self, process_id: int) -> Process:
        table = self.processes
        if not 0 <= process_id < len(table):
            raise JfireError(
                f"deployment {self.name!r} has processes 0..{len(table) - 1}; got --process-id {process_id}"
            )
        return table[process_id]

    def host_index(self, process_id: int, num_hosts: int) -> int:
        """Which of num_hosts hosts runs a process: contiguous blocks in process order (the
        frontend and the first groups on the first host), as Slurm's block distribution does."""
        return process_id * num_hosts // len(self.processes)

    def group(self, name: str) -> Group:
        return next(g for g in self.groups if g.name == name)

    # -- reading ---------------------------------------------------------------------------

    @classmethod
    def load(cls, arg: str) -> Deployment:
        """A deployment file path, or the name of one in meshes/ (e.g. 'local-1p1d')."""
        path = Path(arg)
        if not path.is_file():
            path = meshes.MESHES_DIR / f"{arg}.toml"
        if not path.is_file():
            known = [p.stem for p in meshes.files_with_table("groups")]
            raise JfireError(f"no deployment {arg!r}: give a .toml file or one of: {', '.join(known) or '(none)'}")
        try:
            doc = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise JfireError(f"deployment file {path} is not valid TOML: {e}") from None
        where = f"deployment file {path}"
        raw_groups = doc.get("groups")
        if not isinstance(raw_groups, list) or not raw_groups:
            raise JfireError(f"{where} needs [[groups]] tables (name, role, mesh, processes, devices_per_process)")
        groups = tuple(_group(g, i, where) for i, g in enumerate(raw_groups))
        return cls(
            name=doc.get("name", path.stem),
            groups=groups,
            frontend_port=_int(doc.get("frontend", {}), "port", 8000, where + " [frontend]"),
            coordinator_port=_int(
                doc.get("coordinator", {}), "port", DEFAULT_COORDINATOR_PORT, where + " [coordinator]"
            ),
            transfer_timeout_s=float(doc.get("transfer", {}).get("timeout_s", 30.0)),
            transfer_compress=_bool(doc.get("transfer", {}), "compress", False, where + " [transfer]"),
            path=path,
        )


def _bool(table: dict, key: str, default: bool, where: str) -> bool:
    value = table.get(key, default)
    if not isinstance(value, bool):
        raise JfireError(f"{where}: {key} must be true or false, got {value!r}")
    return value


def _int(table: dict, key: str, default: int, where: str) -> int:
    value = table.get(key, default)
    if not isinstance(value, int) or value < 0:
        raise JfireError(f"{where}: {key} must be a non-negative integer, got {value!r}")
    return value


def _group(raw: dict, index: int, where: str) -> Group:
    where = f"{where}, group {raw.get('name', index)!r}"
    unknown = set(raw) - {"name", "role", "mesh", "processes", "devices_per_process", "port"}
    if unknown:
        raise JfireError(
            f"{where}: unknown keys {sorted(unknown)}; "
            "a group has name, role, mesh, processes, devices_per_process, port"
        )
    if raw.get("role") not in ROLES:
        raise JfireError(f"{where}: role must be one of {', '.join(ROLES)}, got {raw.get('role')!r}")
    spec = meshes.resolve(raw.get("mesh", "single"))
    processes = _int(raw, "processes", 1, where)
    devices = _int(raw, "devices_per_process", max(1, spec.size), where)
    if processes < 1:
        raise JfireError(f"{where}: processes must be >= 1, got {processes}")
    if processes == 1 and spec.size > devices:
        raise JfireError(
            f"{where}: its mesh {spec.name!r} needs {spec.size} devices but the group has "
            f"{processes} x {devices}; raise devices_per_process to {spec.size}"
        )
    if processes > 1 and spec.size != processes * devices:
        # One mesh over every device of every process of the group (jfire.lockstep).
        raise JfireError(
            f"{where}: its mesh {spec.name!r} has {spec.size} devices but the group's processes hold "
            f"{processes} x {devices} = {processes * devices}; a group spanning processes runs its mesh "
            f"over all of them: set devices_per_process = {spec.size / processes:g} or change the mesh"
        )
    return Group(
        name=str(raw.get("name", f"{raw['role']}-{index}")),
        role=raw["role"],
        mesh=spec,
        processes=processes,
        devices_per_process=devices,
        port=_int(raw, "port", 0, where),
    )
